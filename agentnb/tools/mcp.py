"""MCP servers as tool sources (docs/tools.md#mcp-tools): a piece's ``mcp_servers:`` and the session that runs them.

A :class:`McpServer` is one declared server, as validated from the piece.  A :class:`McpSession` belongs to one
job runner: it starts a server the first time a movement run needs its tools, lists them once, calls them, and
stops every server at :meth:`McpSession.close` (the runner closes it when a run ends, pauses or fails).  The
``mcp`` package (the extra ``agentnb[mcp]``) is async; the session runs it on a private event loop in its own
thread, so the agent loop keeps calling tools synchronously.  Nothing here is imported or started for a piece
that declares no server.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import importlib.util
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from .._secrets import is_secret_name, register_secret
from ..errors import AgentnbError, UsageError
from ..events import ToolResult
from ._mcp_http import header_values, http_transport
from .base import Tool
from .context import IMAGE_TYPES, MAX_IMAGE_BYTES, ToolContext, ToolOutput
from .sandbox import bash_env, jailed_server
from .truncate import cut_text

if TYPE_CHECKING:
    import asyncio

__all__ = ["ENV_REF", "INSTALL_HINT", "START_TIMEOUT", "START_TIMEOUT_ENV", "McpServer", "McpSession", "McpStartError",
           "check_installed", "kept_result", "recorded_output", "start_timeout"]

# an ``env:`` value that is exactly ``${NAME}`` passes the worker's variable NAME through; any other is literal
ENV_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
INSTALL_HINT = "pip install 'agentnb[mcp]'"
START_TIMEOUT = 30.0  # seconds for a server to start and answer the handshake and the listing
START_TIMEOUT_ENV = "AGENTNB_MCP_START_TIMEOUT"  # the worker's variable that sets another (docs/tools.md#mcp-tools)
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what model endpoints take as a function name


class McpStartError(AgentnbError, RuntimeError):
    """A server could not be started or listed: the movement run fails with this line (``where: "mcp"``)."""


@dataclass(frozen=True)
class McpServer:
    """One entry of a piece's ``mcp_servers:`` (docs/pieces.md#mcp-servers): a stdio server (``command``) or a
    Streamable HTTP server (``url``), never both."""

    name: str
    command: str = ""
    args: tuple[str, ...] = ()
    # (variable, value) for the server's environment; a value ``${NAME}`` is the worker's NAME (ENV_REF)
    env: tuple[tuple[str, str], ...] = ()
    cwd: str = "."  # relative to the job's work directory
    permission: str = "full"
    read_only_tools: tuple[str, ...] = ()
    trust_annotations: bool = False
    timeout: float = 60.0
    tools: tuple[str, ...] | None = None  # the allow-list; None: every tool the server offers
    network: bool = False  # jailed (the Bash sandbox on): whether the server has the network
    url: str | None = None  # a Streamable HTTP server's address (then command is "")
    # (header, value) sent with every request to ``url``; a value names the worker's variables (_mcp_http.py)
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def target(self) -> str:
        """What the server is, for a message: its URL or its program."""
        return self.url if self.url is not None else self.command

    def to_dict(self) -> dict[str, Any]:
        """The YAML mapping the piece parser reads back to an equal server (defaults left out)."""
        out: dict[str, Any] = {"command": self.command} if self.url is None else {"url": self.url}
        if self.headers:
            out["headers"] = dict(self.headers)
        if self.args:
            out["args"] = list(self.args)
        if self.env:
            out["env"] = dict(self.env)
        if self.cwd != ".":
            out["cwd"] = self.cwd
        out["permission"] = self.permission
        if self.read_only_tools:
            out["read_only_tools"] = list(self.read_only_tools)
        if self.trust_annotations:
            out["trust_annotations"] = True
        if self.timeout != 60.0:
            out["timeout"] = self.timeout
        if self.tools is not None:
            out["tools"] = list(self.tools)
        if self.network:
            out["network"] = True
        return out

    def environment(self) -> dict[str, str]:
        """The variables ``env:`` gives the server; a ``${NAME}`` the worker lacks is a start error.

        A value given under a secret-looking name (``GITHUB_TOKEN: ${GH}``, ``API_KEY: …``, or ``${NAME}`` with
        ``NAME`` one) is masked like the environment's secrets from now on, so a server that repeats it in a
        result never puts it in the store (docs/tools.md#secrets)."""
        out: dict[str, str] = {}
        for key, value in self.env:
            ref = ENV_REF.match(value)
            if ref is None:
                out[key] = value
            elif ref.group(1) in os.environ:
                out[key] = os.environ[ref.group(1)]
            else:
                raise McpStartError(f"MCP server {self.name!r}: env.{key} names the worker's variable "
                                    f"{ref.group(1)!r}, which is not set")
            if is_secret_name(key) or (ref is not None and is_secret_name(ref.group(1))):
                register_secret(out[key])
        return out

    def header_values(self) -> dict[str, str]:
        """The headers sent to a Streamable HTTP server, read from the worker's environment now (never stored:
        each value is masked like a secret from now on); a variable the worker lacks is a start error."""
        out, why = header_values(self.headers, os.environ)
        if why is not None:
            raise McpStartError(f"MCP server {self.name!r}: {why}")
        for value in out.values():
            register_secret(value)
            register_secret(value.split(" ", 1)[1] if " " in value else None)  # the token of "Bearer <token>"
        return out


def recorded_output(result: ToolResult) -> ToolOutput:
    """An MCP tool's recorded result, as a fork's re-served run or a replay gives it again: an MCP tool's effects
    may lie outside the work directory, so a re-served call never reaches the server (docs/tools.md#mcp-tools)."""
    return ToolOutput(result.content, is_error=result.is_error, truncated=result.truncated,
                      original_chars=result.original_chars, returned_chars=result.returned_chars,
                      continuation=result.continuation, image=result.image)


def kept_result(results: Sequence[ToolResult], index: int, tool: str, names: Sequence[str]) -> ToolResult | None:
    """The recorded result to give again for call ``index`` of a re-served response (a fork's re-served run, a
    replay): an MCP call's, when it called the same tool of a server the movement still names (``names``, its
    ``tools:``).  None: the call runs (a built-in tool's, or one the record does not hold)."""
    if index >= len(results):
        return None
    kept = results[index]
    if kept.server is None or kept.tool != tool or not any("." in n and n.split(".", 1)[0] == kept.server for n in names):
        return None
    return kept


def start_timeout() -> float:
    """Seconds a server has to start and list its tools: ``$AGENTNB_MCP_START_TIMEOUT``, else :data:`START_TIMEOUT`."""
    raw = os.environ.get(START_TIMEOUT_ENV, "").strip()
    if not raw:
        return START_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 0 < value <= 3600:
        raise McpStartError(f"${START_TIMEOUT_ENV} must be a number of seconds above 0 and at most 3600; found {raw!r}")
    return value


def check_installed(servers: Mapping[str, McpServer]) -> None:
    """At submit: a piece that declares servers needs the ``mcp`` package."""
    if servers and importlib.util.find_spec("mcp") is None:
        raise UsageError(f"the piece declares MCP servers ({', '.join(servers)}) but the 'mcp' package is not "
                         f"installed; install the extra: {INSTALL_HINT}")


class _Running:
    """A started server: its client, and the event that ends the task holding its connection."""

    def __init__(self, client: Any, stop: asyncio.Event, done: concurrent.futures.Future[None]) -> None:
        self.client, self.stop, self.done = client, stop, done


class McpSession:
    """The MCP servers of one job runner: started on first use, stopped by :meth:`close` (and used again later
    starts them again)."""

    def __init__(self, servers: Mapping[str, McpServer], workdir: Path, logs_dir: Path) -> None:
        self.servers = dict(servers)
        self.workdir, self.logs_dir = workdir, logs_dir
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._running: dict[str, _Running] = {}
        self._refused: dict[str, str] = {}  # an HTTP server's last error status (_mcp_http.py), for the message
        self._lock = threading.Lock()

    # -- the private event loop -------------------------------------------------
    def _submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        import asyncio  # here, not at the top: a process whose pieces use no MCP server never loads it

        if self._loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="agentnb-mcp", daemon=True)
            thread.start()
            self._loop, self._thread = loop, thread
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _stderr_path(self, name: str) -> Path:
        return self.logs_dir / f"mcp-{name}.stderr.log"

    def _stderr_tail(self, name: str, lines: int = 5) -> str:
        try:
            text = self._stderr_path(name).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        tail = [ln for ln in text.splitlines() if ln.strip()][-lines:]
        return "; its stderr ends: " + " | ".join(tail) if tail else ""

    def _refusal(self, name: str) -> str:
        """An HTTP server's error status, when it answered with one (the SDK's own message does not say it)."""
        status = self._refused.get(name)
        return f" (the server answered {status})" if status else ""

    # -- starting and stopping ----------------------------------------------------
    def _client(self, name: str) -> Any:
        """The running client of server ``name``, started now when it is not running."""
        with self._lock:
            running = self._running.get(name)
            if running is not None and not running.done.done():
                return running.client
            server = self.servers[name]
            env = server.environment() if server.url is None else server.header_values()  # HTTP: its headers
            limit = start_timeout()
            cwd = (self.workdir / server.cwd).resolve()
            self.logs_dir.mkdir(parents=True, exist_ok=True)
            ready: concurrent.futures.Future[Any] = concurrent.futures.Future()
            holder: dict[str, asyncio.Event] = {}
            done = self._submit(self._hold(server, env, cwd, ready, holder))
            try:
                client = ready.result(timeout=limit)
            except concurrent.futures.TimeoutError:
                done.cancel()  # the transport's shielded shutdown then stops the server's process group
                raise McpStartError(f"MCP server {name!r} did not answer the MCP handshake within {limit:g} s "
                                    f"(${START_TIMEOUT_ENV} sets the limit)"
                                    f"{self._stderr_tail(name)}") from None
            except Exception as exc:
                raise McpStartError(f"MCP server {name!r} could not be started ({server.target}): "
                                    f"{_describe(exc)}{self._refusal(name)}{self._stderr_tail(name)}") from None
            self._running[name] = _Running(client, holder["stop"], done)
            return client

    async def _hold(self, server: McpServer, env: dict[str, str], cwd: Path,
                    ready: concurrent.futures.Future[Any], holder: dict[str, asyncio.Event]) -> None:
        """The task that holds one server's connection open until its stop event (anyio's scopes must be left
        by the task that entered them).  ``env``: a stdio server's environment, or an HTTP server's headers."""
        import asyncio

        from mcp import Client

        stop = holder["stop"] = asyncio.Event()
        try:
            with contextlib.ExitStack() as files:
                # only a process started here has a stderr to log (an HTTP server's output is its own)
                errlog = None if server.url is not None else \
                    files.enter_context(open(self._stderr_path(server.name), "a", encoding="utf-8"))
                async with Client(self._transport(server, env, cwd, errlog),
                                  read_timeout_seconds=server.timeout,
                                  message_handler=None if errlog is None else _junk_handler(errlog)) as client:
                    ready.set_result(client)
                    await stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            if not isinstance(exc, Exception):
                raise

    def _transport(self, server: McpServer, env: dict[str, str], cwd: Path, errlog: Any) -> Any:
        """How the client reaches the server: its URL (Streamable HTTP, ``env`` its headers), or a process it
        starts (stdio)."""
        if server.url is not None:
            self._refused.pop(server.name, None)
            return http_transport(server.url, env, server.timeout,
                                  lambda status: self._refused.update({server.name: status}))
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        params = StdioServerParameters(**_stdio(server, env, cwd, self.workdir))
        # the SDK starts it in its own session (process group) and kills the group when the session ends
        return stdio_client(params, errlog=errlog)

    def _drop(self, name: str) -> None:
        """Stop server ``name`` (whatever state it is in); the next use starts it again."""
        with self._lock:
            running = self._running.pop(name, None)
        if running is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(running.stop.set)
            with contextlib.suppress(Exception):
                running.done.result(timeout=10)

    def close(self) -> None:
        """Stop every running server and wait for its process group to be gone."""
        with self._lock:
            running, self._running = list(self._running.values()), {}
        loop = self._loop
        if loop is None:
            return
        for r in running:
            loop.call_soon_threadsafe(r.stop.set)
        for r in running:
            with contextlib.suppress(Exception):  # a server that failed has nothing left to stop
                r.done.result(timeout=10)
        # the thread ends too (a cached runner keeps no idle thread); the next use makes a new one
        with self._lock:
            thread, self._loop, self._thread = self._thread, None, None
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=10)
        loop.close()

    # -- tools ------------------------------------------------------------------------
    def tools_for(self, names: Sequence[str], taken: Iterable[str]) -> list[Tool]:
        """The tools a movement's ``server.tool`` / ``server.*`` names give, each server listed once now.

        The model sees each under the server's own name for it, or ``server_tool`` when that clashes with
        another tool of the movement or is not a valid function name."""
        wanted: dict[str, set[str] | None] = {}  # server → tool names (None: all)
        for n in names:
            if "." not in n:
                continue
            server, tool = n.split(".", 1)
            if tool == "*":
                wanted[server] = None
            elif wanted.get(server, set()) is not None:
                wanted.setdefault(server, set()).add(tool)  # type: ignore[union-attr]
        used = set(taken)
        out: list[Tool] = []
        for server, only in wanted.items():
            spec = self.servers[server]
            for listed in self._list(server):
                if (only is not None and listed.name not in only) or (
                        spec.tools is not None and listed.name not in spec.tools):
                    continue
                name = listed.name
                if name in used or not _FUNCTION_NAME.match(name):
                    name = re.sub(r"[^A-Za-z0-9_-]", "_", f"{server}_{listed.name}")[:64]
                used.add(name)
                out.append(self._tool(spec, listed, name))
        return out

    def _list(self, name: str) -> list[Any]:
        client = self._client(name)
        try:
            return list(self._submit(_list_all(client)).result(timeout=start_timeout()))
        except Exception as exc:
            raise McpStartError(f"MCP server {name!r} could not list its tools: {_describe(exc)}"
                                f"{self._refusal(name)}{self._stderr_tail(name)}") from None

    def _tool(self, spec: McpServer, listed: Any, name: str) -> Tool:
        hint = listed.annotations.read_only_hint if listed.annotations is not None else None
        read_only = listed.name in spec.read_only_tools or (spec.trust_annotations and hint is True)
        remote = listed.name

        def call(ctx: ToolContext, **arguments: Any) -> ToolOutput:
            return self.call(spec.name, remote, arguments, ctx)

        schema = dict(listed.input_schema or {"type": "object"})
        schema.setdefault("properties", {})
        return Tool(name=name, description=listed.description or listed.title or remote, parameters=schema, fn=call,
                    permission=spec.permission, takes_context=True, read_only=read_only, server=spec.name)

    def call(self, server: str, tool: str, arguments: Mapping[str, Any], ctx: ToolContext, *,
             again: bool = True) -> ToolOutput:
        """One ``tools/call``; a timeout cancels the request, every failure is a tool error the model reads."""
        spec = self.servers[server]
        try:
            client = self._client(server)
        except McpStartError as exc:
            return ToolOutput(f"Error: {exc}", is_error=True)
        self._refused.pop(server, None)
        future = self._submit(client.call_tool(tool, dict(arguments), read_timeout_seconds=spec.timeout))
        try:
            result = future.result(timeout=spec.timeout + 1)
        except concurrent.futures.TimeoutError:
            future.cancel()  # the task's cancellation cancels the request on the server too
            return _timed_out(server, tool, spec.timeout)
        except Exception as exc:
            if "timed out" in str(exc).lower() or isinstance(exc, TimeoutError):
                return _timed_out(server, tool, spec.timeout)
            refusal = _rpc_refusal(exc)
            if refusal is not None and server not in self._refused:
                # the server answered with a JSON-RPC error (a tool it does not offer, bad arguments): it stays up.
                # An HTTP error status the SDK spells as one (404: the session is gone) is a failure, below
                return ToolOutput(f"Error: MCP server {server!r} refused {tool}: {refusal}", is_error=True)
            self._drop(server)  # the connection may be gone (the server died): the next call starts it again
            if again and spec.url is not None and self._refused.get(server, "").startswith("HTTP 404"):
                # the server no longer knows this MCP session (it restarted, or ended the session while idle): it
                # refused the call before running it, so the call goes once more on a new session (the spec's rule)
                return self.call(server, tool, arguments, ctx, again=False)
            return ToolOutput(f"Error: MCP server {server!r} failed on {tool}: {_describe(exc)}"
                              f"{self._refusal(server)}{self._stderr_tail(server, 2)}", is_error=True)
        return _output(result, ctx)


def _stdio(server: McpServer, env: Mapping[str, str], cwd: Path, workdir: Path) -> dict[str, Any]:
    """How a stdio server starts: through the guard (_mcp_guard.py), which takes its process group down when this
    worker dies, and in Bash's jail when the sandbox is on, with Bash's allow-listed environment plus ``env:``
    (docs/tools.md#mcp-tools)."""
    env = {**bash_env(), **env}
    argv = jailed_server(server.command, server.args, workdir=str(workdir), cwd=str(cwd), env=env,
                         network=server.network)
    return {"command": sys.executable, "args": ["-I", "-S", str(Path(__file__).with_name("_mcp_guard.py")), *argv],
            "cwd": cwd, "env": {**env, "AGENTNB_MCP_PARENT": str(os.getpid()), "AGENTNB_MCP_ENV": ",".join(env)}}


async def _list_all(client: Any) -> list[Any]:
    tools: list[Any] = []
    cursor: str | None = None
    while True:
        page = await client.list_tools(cursor=cursor)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            return tools


def _junk_handler(errlog: IO[str]) -> Any:  # the mcp package's MessageHandlerFnT
    """The client's message handler: a line on the server's stdout that is not an MCP message reaches it as an
    exception (the client skips the line and goes on); it is kept in the server's stderr log, whole, instead of
    a traceback on the worker's stderr (docs/tools.md#mcp-tools)."""
    logging.getLogger("mcp.client.stdio").addFilter(_not_a_parse_error)  # once: a filter is added only once

    async def handle(message: Any) -> None:
        if isinstance(message, Exception):
            errors = getattr(message, "errors", None)
            found = errors()[0].get("input") if callable(errors) and errors() else None
            line = found if isinstance(found, str) else _describe(message)
            errlog.write(f"[agentnb] the server wrote a line to stdout that is not an MCP message; skipped: {line}\n")
            errlog.flush()

    return handle


def _not_a_parse_error(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Failed to parse JSONRPC message")


def _rpc_refusal(exc: BaseException) -> str | None:
    """The message of the JSON-RPC error a server answered a call with (it is alive and answering); None for a
    failure of the connection."""
    from mcp.shared.exceptions import MCPError
    from mcp.types import CONNECTION_CLOSED

    if isinstance(exc, MCPError) and exc.error.code != CONNECTION_CLOSED:
        return " ".join(exc.error.message.split()) or f"JSON-RPC error {exc.error.code}"
    return None


def _timed_out(server: str, tool: str, timeout: float) -> ToolOutput:
    return ToolOutput(f"Error: {tool} (MCP server {server!r}) gave no result within its timeout of {timeout:g} s; "
                      "the request was cancelled", is_error=True)


def _describe(exc: BaseException) -> str:
    """One line for an exception, the first of a group's (anyio wraps a task's failure in one)."""
    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:  # type: ignore[attr-defined]
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _output(result: Any, ctx: ToolContext) -> ToolOutput:
    """A ``CallToolResult`` as the text the model reads, its blocks in order (docs/tools.md#mcp-tools): text as it
    is, a resource's text, a note for what has no text (a binary resource, audio, a link), and the structured
    content as JSON when there is no block.  The first image is attached as ReadImage attaches one (the loop sends
    ``ToolOutput.image`` after the tool results); a later one, or one ReadImage could not attach, is a note.
    ``is_error`` is a tool error (its text and image as for a result)."""
    parts: list[str] = []
    image: str | None = None
    for block in result.content:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "image":
            note, url = _image(block, attach=image is None)
            parts.append(note)
            image = image or url
        elif kind == "resource":
            res = block.resource
            text = getattr(res, "text", None)
            parts.append(text if text is not None else
                         _note("resource", res.mime_type, _b64_size(getattr(res, "blob", "")), res.uri))
        elif kind == "resource_link":
            parts.append(_note("resource link", block.mime_type, block.size, block.uri))
        elif kind == "audio":
            parts.append(_note("audio", block.mime_type, _b64_size(block.data)))
        else:
            parts.append(f"({kind or 'unknown'} content, not shown)")
    if result.structured_content is not None and not parts:
        # a server that also sends text sends the same content as text (the spec's SHOULD): read it once
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts) or "(no output)"
    # an error's text is cut to the budget too: a server's error may be as long as any result
    out = cut_text(f"Error: {text}" if result.is_error else text, ctx, hint="generic")
    out.is_error, out.image = bool(result.is_error), image
    return out


def _b64_size(data: str) -> int:
    """The bytes a base64 text decodes to (without decoding it)."""
    data = "".join(data.split())
    return len(data) * 3 // 4 - (len(data) - len(data.rstrip("=")))


def _note(what: str, mime: str | None, size: int | None, uri: str | None = None, why: str = "not shown") -> str:
    """One line for content the model does not read: what it is, its type, size and address."""
    facts = [f for f in (mime, f"{size:,} bytes" if size is not None else None, str(uri) if uri else None) if f]
    return f"({what}{': ' + ', '.join(facts) if facts else ''}; {why})"


def _image(block: Any, *, attach: bool) -> tuple[str, str | None]:
    """An image block's note and, when it is attached, its ``data:`` URL: the types and size ReadImage takes,
    valid base64, and the first image of the result (a tool result carries one image)."""
    mime, size = block.mime_type, _b64_size(block.data)
    if mime not in IMAGE_TYPES.values():
        return _note("image", mime, size, why=f"not attached: images are attached as {', '.join(IMAGE_TYPES)}"), None
    if size > MAX_IMAGE_BYTES:
        return _note("image", mime, size, why=f"not attached: images up to {MAX_IMAGE_BYTES:,} bytes are"), None
    if not attach:
        return _note("image", mime, size, why="not attached: one image per tool result, the first is"), None
    data = "".join(block.data.split())
    try:
        base64.b64decode(data, validate=True)
    except ValueError:
        return _note("image", mime, None, why="not attached: its data is not base64"), None
    return _note("image", mime, size, why="attached below"), f"data:{mime};base64,{data}"
