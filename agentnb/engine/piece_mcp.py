"""A piece's ``mcp_servers:`` and the MCP tool names of its movements (docs/pieces.md#mcp-servers), checked over
YAML nodes so every error names its file, line and field.

``ck`` is the piece parser's checker (engine/pieces.py): ``mapping``, ``string``, ``sequence``, ``fail``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode

from ..tools._mcp_http import check_header_name, check_header_value, check_url
from ..tools.base import PERMISSION_RANK
from ..tools.mcp import ENV_REF, McpServer

__all__ = ["SERVER_KEYS", "check_mcp_tool", "mcp_servers"]

SERVER_KEYS = ("command", "args", "env", "cwd", "url", "headers", "permission", "read_only_tools",
               "trust_annotations", "timeout", "tools", "network")
_STDIO_ONLY = ("args", "env", "cwd", "network")  # a process's settings: a server at a URL has none
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
_VAR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def mcp_servers(ck: Any, node: Node) -> dict[str, McpServer]:
    """``mcp_servers:``: server name → a stdio or Streamable HTTP server's settings."""
    if isinstance(node, ScalarNode) and node.value == "":
        return {}
    if not isinstance(node, MappingNode):
        raise ck.fail(node, "mcp_servers", "found a value that is not a mapping, expected server name → settings")
    out: dict[str, McpServer] = {}
    for knode, vnode in node.value:
        name = ck.string(knode, "mcp_servers")
        fld = f"mcp_servers.{name}"
        if not _NAME.match(name):
            raise ck.fail(knode, fld, f"found server name {name!r}; allowed: 1–40 letters, digits, '_' or '-'")
        if name in out:
            raise ck.fail(knode, fld, f"server {name!r} appears twice")
        keys = ck.mapping(vnode, fld, SERVER_KEYS)
        _check_kind(ck, vnode, fld, keys)
        out[name] = McpServer(
            name=name, command=ck.string(keys["command"][1], f"{fld}.command") if "command" in keys else "",
            url=_url(ck, keys["url"][1], f"{fld}.url") if "url" in keys else None,
            headers=_headers(ck, keys["headers"][1], f"{fld}.headers") if "headers" in keys else (),
            args=_strings(ck, keys, "args", fld) or (),
            env=_env(ck, keys["env"][1], f"{fld}.env") if "env" in keys else (),
            cwd=_cwd(ck, keys["cwd"][1], f"{fld}.cwd") if "cwd" in keys else ".",
            permission=ck.string(keys["permission"][1], f"{fld}.permission", choices=tuple(PERMISSION_RANK))
            if "permission" in keys else "full",
            read_only_tools=_strings(ck, keys, "read_only_tools", fld) or (),
            trust_annotations=_bool(ck, keys["trust_annotations"][1], f"{fld}.trust_annotations")
            if "trust_annotations" in keys else False,
            timeout=_seconds(ck, keys["timeout"][1], f"{fld}.timeout") if "timeout" in keys else 60.0,
            tools=_strings(ck, keys, "tools", fld),
            network=_bool(ck, keys["network"][1], f"{fld}.network") if "network" in keys else False,
        )
    return out


def check_mcp_tool(ck: Any, node: Node, fld: str, tname: str, servers: Mapping[str, McpServer],
                   permission: str) -> None:
    """A movement's ``server.tool`` or ``server.*``: a declared server, a tool its allow-list has, and a
    movement permission at least the server's."""
    server, tool = tname.split(".", 1)
    if server not in servers:
        raise ck.fail(node, fld, f"unknown MCP server {server!r} in {tname!r}; declared in mcp_servers: "
                      f"{', '.join(servers) or 'none'}")
    spec = servers[server]
    if not tool or (tool != "*" and not re.fullmatch(r"[^\s*]+", tool)):
        raise ck.fail(node, fld, f"found {tname!r}; allowed: {server}.TOOL or {server}.*")
    if spec.tools is not None and tool != "*" and tool not in spec.tools:
        raise ck.fail(node, fld, f"tool {tool!r} is not in mcp_servers.{server}.tools; allowed: "
                      f"{', '.join(spec.tools) or 'none'}")
    if PERMISSION_RANK[permission] < PERMISSION_RANK[spec.permission]:
        raise ck.fail(node, fld, f"MCP server {server!r} needs permission {spec.permission!r}; this movement has "
                      f"{permission!r} (raise the movement's permission or lower the server's)")


def _check_kind(ck: Any, node: Node, fld: str, keys: Mapping[str, tuple[Node, Node]]) -> None:
    """A server is a program (``command``) or an address (``url``), exactly one, with the keys of its kind."""
    if "command" in keys and "url" in keys:
        raise ck.fail(keys["url"][0], f"{fld}.url", "give either command (a stdio server) or url (a Streamable HTTP "
                      "server), not both")
    if "command" not in keys and "url" not in keys:
        raise ck.fail(node, f"{fld}.command", "missing required key: command (a stdio server's program) or url (a "
                      "Streamable HTTP server's address)")
    if "url" in keys:
        for key in (k for k in _STDIO_ONLY if k in keys):
            raise ck.fail(keys[key][0], f"{fld}.{key}", f"{key!r} is for a stdio server (command); a Streamable "
                          "HTTP server (url) takes headers")
    elif "headers" in keys:
        raise ck.fail(keys["headers"][0], f"{fld}.headers", "'headers' is for a Streamable HTTP server (url); a "
                      "stdio server (command) takes env")


def _url(ck: Any, node: Node, fld: str) -> str:
    value: str = ck.string(node, fld)
    why = check_url(value)
    if why is not None:
        raise ck.fail(node, fld, why)
    return value


def _headers(ck: Any, node: Node, fld: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(node, MappingNode):
        raise ck.fail(node, fld, "found a value that is not a mapping, expected Header-Name: VARIABLE or "
                      "Header-Name: text with ${VARIABLE}")
    out: list[tuple[str, str]] = []
    for knode, vnode in node.value:
        key = ck.string(knode, fld)
        why = check_header_name(key)
        if why is None and any(k.lower() == key.lower() for k, _ in out):
            why = f"header {key!r} appears twice"
        if why is not None:
            raise ck.fail(knode, f"{fld}.{key}", why)
        value: str = ck.string(vnode, f"{fld}.{key}")
        why = check_header_value(value)
        if why is not None:
            raise ck.fail(vnode, f"{fld}.{key}", why)
        out.append((key, value))
    return tuple(out)


def _strings(ck: Any, keys: Mapping[str, tuple[Node, Node]], key: str, fld: str) -> tuple[str, ...] | None:
    if key not in keys:
        return None
    return tuple(ck.string(n, f"{fld}.{key}[{i}]") for i, n in enumerate(ck.sequence(keys[key][1], f"{fld}.{key}")))


def _env(ck: Any, node: Node, fld: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(node, MappingNode):
        raise ck.fail(node, fld, "found a value that is not a mapping, expected VARIABLE: value or VARIABLE: ${NAME}")
    out: list[tuple[str, str]] = []
    for knode, vnode in node.value:
        key = ck.string(knode, fld)
        if not _VAR.match(key):
            raise ck.fail(knode, f"{fld}.{key}", f"found variable name {key!r}; allowed: letters, digits and '_'")
        value = ck.string(vnode, f"{fld}.{key}", nonempty=False)
        if "${" in value and not ENV_REF.match(value):
            raise ck.fail(vnode, f"{fld}.{key}", f"found {value!r}; a value is either exactly ${{NAME}} (the worker's "
                          "variable NAME) or literal text without '${'")
        out.append((key, value))
    return tuple(out)


def _cwd(ck: Any, node: Node, fld: str) -> str:
    value: str = ck.string(node, fld)
    norm = os.path.normpath(value)
    if os.path.isabs(value) or norm == ".." or norm.startswith("../"):
        raise ck.fail(node, fld, f"found {value!r}; allowed: a folder inside the job's work directory (relative)")
    return norm


def _bool(ck: Any, node: Node, fld: str) -> bool:
    if not isinstance(node, ScalarNode) or node.tag != "tag:yaml.org,2002:bool":
        raise ck.fail(node, fld, "expected true or false")
    return bool(yaml.safe_load(node.value))


def _seconds(ck: Any, node: Node, fld: str) -> float:
    if not isinstance(node, ScalarNode) or node.tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float"):
        raise ck.fail(node, fld, "expected a number of seconds > 0")
    value = float(yaml.safe_load(node.value))
    if not 0 < value <= 3600:
        raise ck.fail(node, fld, f"found {value:g}; allowed: seconds > 0 and ≤ 3600")
    return value
