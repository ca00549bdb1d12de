"""Each movement's tools with their source and parameters, as the model would be shown them
(docs/tools.md#listing-tools): ``%agent tools PIECE`` and ``agentnb tools PIECE``.

Built-in and Python tools are read from the registry; an MCP server's tools are asked of the server itself, which
is started for the listing (in a work directory laid out as a job's) and stopped after it.  A server that cannot
be started or listed is one line in :attr:`ToolListing.failures`; the other servers' tools are still listed.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..tools.base import Tool, get_tool
from ..tools.mcp import McpSession, McpStartError
from .pieces import Movement, Piece
from .prompts import transition_schema

__all__ = ["BUILTIN", "PYTHON", "ListedTool", "MovementTools", "ToolListing", "list_tools", "parameters_text"]

BUILTIN = "built-in"  # agentnb's own tools (tools/builtin.py) and ``transition``
PYTHON = "Python"  # a notebook's (or a module's) ``@agentnb.tool`` functions


@dataclass(frozen=True)
class ListedTool:
    """One tool of a movement: ``name`` as the model sees it, ``source`` (:data:`BUILTIN`, :data:`PYTHON` or the
    MCP server's name), ``parameters`` its JSON schema's ``properties`` and ``required``."""

    name: str
    source: str
    parameters: dict[str, Any]
    description: str = ""
    permission: str = "readonly"
    read_only: bool = False

    @property
    def parameters_text(self) -> str:
        return parameters_text(self.parameters)


@dataclass(frozen=True)
class MovementTools:
    movement: str
    permission: str
    tools: tuple[ListedTool, ...]


@dataclass(frozen=True)
class ToolListing:
    """A piece's movements, each with its tools; ``failures``: one line per MCP server that could not be asked."""

    piece: str
    movements: tuple[MovementTools, ...]
    failures: tuple[str, ...] = ()


def parameters_text(schema: Mapping[str, Any]) -> str:
    """``path: string, offset?: integer``: each parameter with its JSON type, ``?`` after an optional one."""
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    parts = []
    for name, spec in props.items():
        kind = spec.get("type") if isinstance(spec, Mapping) else None
        if isinstance(kind, list):
            kind = " | ".join(str(k) for k in kind)
        elif kind is None and isinstance(spec, Mapping) and ("anyOf" in spec or "oneOf" in spec):
            kind = " | ".join(str(s.get("type", "?")) for s in spec.get("anyOf", spec.get("oneOf", []))
                              if isinstance(s, Mapping))
        parts.append(f"{name}{'' if name in required else '?'}: {kind or 'any'}")
    return ", ".join(parts) or "(none)"


def _listed(t: Tool, source: str) -> ListedTool:
    first = (t.description or "").strip().split("\n\n", 1)[0]
    return ListedTool(name=t.name, source=source, parameters=dict(t.parameters), description=" ".join(first.split()),
                      permission=t.permission, read_only=t.read_only)


def _transition(movement: Movement) -> ListedTool:
    fn = transition_schema(movement)["function"]
    return ListedTool(name="transition", source=BUILTIN, parameters=fn["parameters"],
                      description=" ".join(str(fn.get("description", "")).split()), read_only=True)


def list_tools(piece: Piece, workdir: str | Path | None = None) -> ToolListing:
    """``piece``'s movements with the tools each would be shown, in order: registered tools, MCP tools, then
    ``transition``.  The piece's MCP servers are started in ``workdir`` (default: a fresh empty one laid out as a
    job's, with ``input/`` and ``output/``) and stopped before this returns."""
    if workdir is not None and not Path(workdir).expanduser().is_dir():
        raise UsageError(f"workdir {str(workdir)!r} is not an existing directory")
    with tempfile.TemporaryDirectory(prefix="agentnb-tools-") as tmp:
        wd = Path(workdir).expanduser() if workdir is not None else Path(tmp) / "work"
        for sub in ("input", "output"):
            (wd / sub).mkdir(parents=True, exist_ok=True)
        session = McpSession(piece.mcp_servers, wd, Path(tmp) / "logs") if piece.mcp_servers else None
        failed: dict[str, str] = {}  # a server that failed once is not started again for the next movement
        movements = []
        try:
            for m in (piece.movement(n) for n in piece.run_names):  # a loop monitor's judge is a run too
                tools = [t for t in (get_tool(n) for n in m.tools if "." not in n) if t is not None]
                listed = [_listed(t, BUILTIN if t.builtin else PYTHON) for t in tools]
                taken = [t.name for t in tools] + ["transition"]
                for server in dict.fromkeys(n.split(".", 1)[0] for n in m.tools if "." in n):
                    if session is None or server in failed:
                        continue
                    try:
                        mcp = session.tools_for([n for n in m.tools if n.split(".", 1)[0] == server], taken)
                    except McpStartError as exc:
                        failed[server] = " ".join(str(exc).split())
                        continue
                    taken += [t.name for t in mcp]
                    listed += [_listed(t, t.server or server) for t in mcp]
                listed.append(_transition(m))
                movements.append(MovementTools(m.name, m.permission, tuple(listed)))
        finally:
            if session is not None:
                session.close()
    return ToolListing(piece.name, tuple(movements), tuple(failed.values()))
