"""Streamable HTTP MCP servers (docs/pieces.md#mcp-servers, docs/tools.md#mcp-tools): a server written here with the
``mcp`` package's own server class, served by uvicorn on loopback in a real subprocess that checks the
``Authorization`` header it is sent, stopped and started again on the same port.  Never a mock of the protocol."""

from __future__ import annotations

import contextlib
import http.server
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, transition, write_piece, write_script
from conftest import pg_backend

from agentnb import Workspace
from agentnb.engine.pieces import parse_piece
from agentnb.errors import PieceError
from agentnb.events import payload_json
from agentnb.tools import mcp as mcp_module
from agentnb.tools.context import ToolContext
from agentnb.tools.mcp import McpServer, McpSession, McpStartError

pytest.importorskip("mcp", reason="the mcp package is not installed: pip install -e '.[test]' (or agentnb[mcp])")

# the token the server wants, after "Bearer "; its variable's name is not secret-shaped (nothing masks it by name)
TOKEN = "tr4cker-s3cret-value-0042"

SERVER = textwrap.dedent('''
    import base64, json, os, socket, sys
    import anyio, uvicorn
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.types import CallToolResult, ImageContent, TextContent, ToolAnnotations

    server = MCPServer("tracker")
    PNG = base64.b64encode(bytes.fromhex(
        "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c4890000000d49444154789c63600000"
        "02000154a24f5d0000000049454e44ae426082")).decode()
    MARKS = os.environ["TRACKER_MARKS"]

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def echo(text: str) -> str:
        """Say the text back."""
        return "echo: " + text

    @server.tool()
    def stats(values: list[int]) -> dict[str, int]:
        """Sum and count of the values."""
        return {"sum": sum(values), "count": len(values)}

    @server.tool()
    def only_structured(n: int) -> CallToolResult:
        """A result with structured content and no text."""
        return CallToolResult(content=[], structured_content={"n": n, "square": n * n})

    @server.tool()
    def picture() -> CallToolResult:
        """A one-pixel image with a caption."""
        return CallToolResult(content=[TextContent(type="text", text="a dot"),
                                       ImageContent(type="image", data=PNG, mime_type="image/png")])

    @server.tool()
    def fail(reason: str) -> CallToolResult:
        """Always fails."""
        return CallToolResult(content=[TextContent(type="text", text="refused: " + reason)], is_error=True)

    @server.tool()
    async def slow(seconds: float) -> str:
        """Sleeps; a cancelled call leaves a mark."""
        try:
            await anyio.sleep(seconds)
        except anyio.get_cancelled_exc_class():
            open(os.path.join(MARKS, "cancelled"), "w").close()
            raise
        return "woke"

    @server.tool()
    def die() -> str:
        """The server exits in the middle of the call."""
        os._exit(1)

    @server.tool()
    def whoami() -> str:
        """The server's pid."""
        return str(os.getpid())

    @server.tool()
    def token_seen(ctx: Context) -> str:
        """The token this request came with."""
        return "seen=" + ctx.headers["authorization"].split(" ", 1)[1]

    @server.tool()
    def session(ctx: Context) -> str:
        """The MCP session this request belongs to (a handshake-era connection has one)."""
        return ctx.headers.get("mcp-session-id", "-")

    app = server.streamable_http_app()
    expected = "Bearer " + os.environ["TRACKER_EXPECTS"]

    async def answer(send, status, kind, body):
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]})
        await send({"type": "http.response.body", "body": body})

    async def guarded(scope, receive, send):
        # every request must carry the token, as a server behind an API gateway wants it
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization", b"").decode() != expected:
            return await answer(send, 401, b"text/plain", b"no entry")
        if scope["type"] == "http" and scope["method"] == "POST" and os.environ.get("TRACKER_LEGACY"):
            # a server of the handshake era (before 2026-07-28) knows no server/discover: the client then
            # initializes, and the server keeps an MCP session (Mcp-Session-Id) it forgets when it restarts
            body, more = b"", True
            while more:
                message = await receive()
                body, more = body + message.get("body", b""), message.get("more_body", False)
            request = json.loads(body)
            if request.get("method") == "server/discover":
                error = {"code": -32601, "message": "Method not found"}
                return await answer(send, 200, b"application/json",
                                    json.dumps({"jsonrpc": "2.0", "id": request["id"], "error": error}).encode())
            replayed = []

            async def again():
                if not replayed:
                    replayed.append(True)
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            return await app(scope, again, send)
        await app(scope, receive, send)

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", int(sys.argv[1])))
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(uvicorn.Config(guarded, log_level="warning")).run(sockets=[sock])
''')


class HttpServer:
    """The test server as a process on loopback: ``start`` (again on the same port), ``stop``."""

    def __init__(self, folder: Path, *, legacy: bool = False) -> None:
        self.legacy = legacy
        self.script = folder / "tracker_server.py"
        self.script.write_text(SERVER, encoding="utf-8")
        self.marks = folder / "marks"
        self.marks.mkdir()
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self) -> None:
        env = {**os.environ, "TRACKER_EXPECTS": TOKEN, "TRACKER_MARKS": str(self.marks),
               "TRACKER_LEGACY": "1" if self.legacy else ""}
        self.proc = subprocess.Popen([sys.executable, str(self.script), str(self.port)], stdout=subprocess.PIPE,
                                     text=True, env=env)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        deadline = time.monotonic() + 30
        while True:  # uvicorn answers once its app has started
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            assert time.monotonic() < deadline and self.proc.poll() is None, "the test server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HttpServer]:
    monkeypatch.setenv("TRACKER_CODE", TOKEN)  # what the pieces' headers name
    running = HttpServer(tmp_path)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def _spec(server: HttpServer, **extra: Any) -> McpServer:
    return McpServer(name="tracker", url=server.url, headers=(("Authorization", "Bearer ${TRACKER_CODE}"),), **extra)


def _ctx(tmp_path: Path) -> ToolContext:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return ToolContext(workdir=work, logs_dir=tmp_path / "logs", budget_tokens=10_000)


def _session(tmp_path: Path, spec: McpServer) -> McpSession:
    return McpSession({spec.name: spec}, tmp_path / "work", tmp_path / "logs")


# -- the session: listing and calls --------------------------------------------------------------------------------

def test_an_http_server_lists_its_tools_and_its_calls_give_text_structured_image_and_errors(
        tmp_path: Path, server: HttpServer) -> None:
    session = _session(tmp_path, _spec(server, timeout=2, trust_annotations=True))
    ctx = _ctx(tmp_path)
    try:
        tools = {t.name: t for t in session.tools_for(["tracker.*"], taken=["Read"])}
        assert set(tools) == {"echo", "stats", "only_structured", "picture", "fail", "slow", "die", "whoami",
                              "token_seen", "session"}
        assert tools["echo"].parameters["properties"]["text"]["type"] == "string"
        assert tools["echo"].parameters["required"] == ["text"]
        assert tools["echo"].server == "tracker" and tools["echo"].read_only and not tools["stats"].read_only

        out = tools["echo"].invoke(ctx, {"text": "hi"})
        assert (out.content, out.is_error) == ("echo: hi", False)
        out = tools["stats"].invoke(ctx, {"values": [1, 2, 3]})
        assert not out.is_error and '"sum": 6' in out.content and '"count": 3' in out.content
        out = tools["only_structured"].invoke(ctx, {"n": 3})
        assert (out.content, out.is_error) == ('{"n": 3, "square": 9}', False)
        out = tools["picture"].invoke(ctx, {})
        assert not out.is_error and out.content.startswith("a dot\n(image")
        out = tools["fail"].invoke(ctx, {"reason": "no"})
        assert out.is_error and "refused: no" in out.content
        # the headers reached the server, read from the worker's environment
        assert tools["token_seen"].invoke(ctx, {}).content == "seen=***"  # and its value is masked like a secret
    finally:
        session.close()
    assert not [t for t in threading.enumerate() if t.name == "agentnb-mcp"]


def test_a_call_past_its_timeout_is_a_tool_error_and_the_request_is_cancelled_on_the_server(
        tmp_path: Path, server: HttpServer) -> None:
    session = _session(tmp_path, _spec(server, timeout=2))
    ctx = _ctx(tmp_path)
    try:
        tools = {t.name: t for t in session.tools_for(["tracker.slow", "tracker.echo"], taken=[])}
        started = time.monotonic()
        out = tools["slow"].invoke(ctx, {"seconds": 60})
        assert out.is_error and "timeout of 2 s" in out.content and "cancelled" in out.content
        assert time.monotonic() - started < 10
        deadline = time.monotonic() + 10
        while not (server.marks / "cancelled").exists():
            assert time.monotonic() < deadline, "the server never saw the cancellation"
            time.sleep(0.05)
        # the connection is still usable after a cancelled call
        assert tools["echo"].invoke(ctx, {"text": "again"}).content == "echo: again"
    finally:
        session.close()


def test_a_server_that_goes_away_during_a_call_is_a_tool_error_and_the_next_call_connects_again(
        tmp_path: Path, server: HttpServer) -> None:
    session = _session(tmp_path, _spec(server, timeout=10))
    ctx = _ctx(tmp_path)
    try:
        tools = {t.name: t for t in session.tools_for(["tracker.die", "tracker.whoami"], taken=[])}
        first = tools["whoami"].invoke(ctx, {}).content
        out = tools["die"].invoke(ctx, {})
        assert out.is_error and "MCP server 'tracker' failed on die" in out.content and "\n" not in out.content
        server.proc.wait(timeout=10)  # type: ignore[union-attr]
        # while it is down: a tool error naming the server and its URL
        out = tools["whoami"].invoke(ctx, {})
        assert out.is_error and f"MCP server 'tracker' could not be started ({server.url})" in out.content
        assert "\n" not in out.content
        server.start()  # the same port again
        out = tools["whoami"].invoke(ctx, {})
        assert not out.is_error and out.content.isdigit() and out.content != first
    finally:
        session.close()


def test_a_handshake_era_server_that_forgot_its_session_gets_the_call_again_on_a_new_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a server restarted between two calls (or one that ended an idle session) answers the old session 404: the
    # call never ran there, and the spec says to start a new session, so the model sees no error
    monkeypatch.setenv("TRACKER_CODE", TOKEN)
    legacy = HttpServer(tmp_path, legacy=True)
    legacy.start()
    session = _session(tmp_path, _spec(legacy, timeout=10))
    ctx = _ctx(tmp_path)
    try:
        tools = {t.name: t for t in session.tools_for(["tracker.whoami", "tracker.session"], taken=[])}
        first = (tools["whoami"].invoke(ctx, {}).content, tools["session"].invoke(ctx, {}).content)
        assert first[0].isdigit() and first[1] != "-"  # a handshake-era connection, with its MCP session
        legacy.stop()
        legacy.start()
        out = tools["whoami"].invoke(ctx, {})
        assert not out.is_error and out.content.isdigit() and out.content != first[0], out.content
        second = tools["session"].invoke(ctx, {}).content
        assert second not in ("-", first[1])
    finally:
        session.close()
        legacy.stop()


def _listening_port() -> tuple[socket.socket, int]:
    """A socket that accepts connections and never answers (a server that hangs), and its port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


class _NotMcp(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # the standard library's name for it
        body = b"<html>a web page</html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_server_that_cannot_be_reached_or_is_not_mcp_is_one_line_naming_it(
        tmp_path: Path, server: HttpServer, monkeypatch: pytest.MonkeyPatch) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    refused_url = f"http://127.0.0.1:{closed.getsockname()[1]}/mcp"
    closed.close()
    web = http.server.HTTPServer(("127.0.0.1", 0), _NotMcp)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    hanging, hanging_port = _listening_port()
    monkeypatch.setenv("TRACKER_WRONG", "Bearer not-the-token-at-all")
    monkeypatch.setenv("TRACKER_BROKEN", "Bearer half-a-token\r\nX-Injected: yes")
    monkeypatch.delenv("TRACKER_UNSET", raising=False)
    monkeypatch.setattr(mcp_module, "START_TIMEOUT", 2.0)  # the hanging server: a start timeout of 2 s, not 30
    cases = [
        (McpServer(name="tracker", url=refused_url), "ConnectError"),
        (McpServer(name="tracker", url=f"http://127.0.0.1:{web.server_port}/mcp"), "text/html"),
        (McpServer(name="tracker", url=server.url, headers=(("Authorization", "TRACKER_WRONG"),)), "HTTP 401"),
        (McpServer(name="tracker", url=server.url + "/elsewhere", headers=(("Authorization", "Bearer ${TRACKER_CODE}"),)),
         "HTTP 404"),
        (McpServer(name="tracker", url=server.url, headers=(("Authorization", "Bearer ${TRACKER_UNSET}"),)),
         "headers.Authorization names the worker's variable 'TRACKER_UNSET', which is not set"),
        (McpServer(name="tracker", url=server.url, headers=(("Authorization", "TRACKER_BROKEN"),)),
         "headers.Authorization names the worker's variable 'TRACKER_BROKEN', whose value has a line break"),
        (McpServer(name="tracker", url=f"http://127.0.0.1:{hanging_port}/mcp"), "did not "),
    ]
    try:
        for spec, expected in cases:
            session = _session(tmp_path, spec)
            started = time.monotonic()
            with pytest.raises(McpStartError) as err:
                session.tools_for(["tracker.*"], taken=[])
            session.close()
            assert "MCP server 'tracker'" in str(err.value) and expected in str(err.value), str(err.value)
            assert "\n" not in str(err.value) and time.monotonic() - started < 15
            assert "not-the-token" not in str(err.value) and "half-a-token" not in str(err.value)
    finally:
        web.shutdown()
        hanging.close()


# -- the piece ---------------------------------------------------------------------------------------------------

PIECE = """\
name: with-tracker
mcp_servers:
  tracker:
    url: http://127.0.0.1:8931/mcp
    headers: {Authorization: "Bearer ${TRACKER_CODE}", X-Tenant: TRACKER_TENANT}
    permission: edit
    read_only_tools: [echo]
    timeout: 5
movements:
  - name: work
    instruction: Use the tracker.
    tools: [Read, tracker.*]
    permission: edit
    rules: [{next: COMPLETE}]
"""


def test_a_piece_declares_an_http_server_by_url_and_headers_that_name_variables() -> None:
    piece = parse_piece(PIECE, source="p.yaml")
    tracker = piece.mcp_servers["tracker"]
    assert (tracker.url, tracker.command, tracker.permission, tracker.timeout) == (
        "http://127.0.0.1:8931/mcp", "", "edit", 5.0)
    assert tracker.headers == (("Authorization", "Bearer ${TRACKER_CODE}"), ("X-Tenant", "TRACKER_TENANT"))
    assert parse_piece(piece.to_yaml(), source="p.yaml") == piece
    # in Python: declared on a Piece, checked like a file
    plain = parse_piece("name: plain\nmovements:\n  - {name: work, instruction: Go., permission: full, "
                        "rules: [{next: COMPLETE}]}\n")
    built = plain.with_mcp_server("tracker", url="https://mcp.example.com/mcp",
                                  headers={"Authorization": "Bearer ${TRACKER_CODE}"})
    assert built.mcp_servers["tracker"] == McpServer(name="tracker", url="https://mcp.example.com/mcp",
                                                     headers=(("Authorization", "Bearer ${TRACKER_CODE}"),))
    with pytest.raises(PieceError, match=r"mcp_servers\.tracker\.url: give either command .* or url"):
        plain.with_mcp_server("tracker", url="https://mcp.example.com/mcp", command="python")


@pytest.mark.parametrize(("change", "expected"), [
    (("    url: http", "    command: python\n    url: http"),
     r"p\.yaml:5: mcp_servers\.tracker\.url: give either command \(a stdio server\) or url \(a Streamable HTTP "
     r"server\), not both"),
    (("    url: http://127.0.0.1:8931/mcp\n", ""),
     r"p\.yaml:4: mcp_servers\.tracker\.command: missing required key: command .* or url"),
    (("    permission: edit\n", "    permission: edit\n    args: [x]\n"),
     r"p\.yaml:7: mcp_servers\.tracker\.args: 'args' is for a stdio server \(command\); a Streamable HTTP server "
     r"\(url\) takes headers"),
    (("    permission: edit\n", "    permission: edit\n    env: {A: b}\n"), r"mcp_servers\.tracker\.env: 'env' is for"),
    (("    permission: edit\n", "    permission: edit\n    cwd: input\n"), r"mcp_servers\.tracker\.cwd: 'cwd' is for"),
    (("    permission: edit\n", "    permission: edit\n    network: true\n"),
     r"mcp_servers\.tracker\.network: 'network' is for a stdio server"),
    (("    url: http://127.0.0.1:8931/mcp\n", "    command: python\n"),
     r"p\.yaml:5: mcp_servers\.tracker\.headers: 'headers' is for a Streamable HTTP server \(url\); a stdio "
     r"server \(command\) takes env"),
    (("http://127.0.0.1:8931/mcp", "ftp://127.0.0.1/mcp"),
     r"p\.yaml:4: mcp_servers\.tracker\.url: found 'ftp://127\.0\.0\.1/mcp'; allowed: an http:// or https:// URL"),
    (("http://127.0.0.1:8931/mcp", "http://me:pw@127.0.0.1/mcp"),
     r"mcp_servers\.tracker\.url: found credentials in the URL, which is stored with the piece; give them in "
     r"headers"),
    (("http://127.0.0.1:8931/mcp", "http://127.0.0.1:99999/mcp"), r"mcp_servers\.tracker\.url: found .*not a URL"),
    (("X-Tenant: TRACKER_TENANT", "X-Tenant: acme corp"),
     r"p\.yaml:5: mcp_servers\.tracker\.headers\.X-Tenant: found 'acme corp'; a header's value names the worker's "
     r"environment variables: NAME .* or text with \$\{NAME\} in it"),
    (("X-Tenant: TRACKER_TENANT", 'X-Tenant: "${A}${"'), r"headers\.X-Tenant: found '\$\{A\}\$\{'"),
    (("X-Tenant: TRACKER_TENANT", "Mcp-Session-Id: SESSION"),
     r"headers\.Mcp-Session-Id: header 'Mcp-Session-Id' is set by the MCP transport itself"),
    (("X-Tenant: TRACKER_TENANT", "authorization: OTHER"), r"headers\.authorization: header 'authorization' appears "
                                                           r"twice"),
    (("X-Tenant: TRACKER_TENANT", "Bad Header: X"), r"headers\.Bad Header: found header name 'Bad Header'"),
    (("{Authorization", "[Authorization"), None),
])
def test_piece_validation_of_http_servers_names_file_line_and_field(change: tuple[str, str],
                                                                    expected: str | None) -> None:
    text = PIECE.replace(*change)
    if expected is None:  # a headers list rather than a mapping
        text = PIECE.replace('{Authorization: "Bearer ${TRACKER_CODE}", X-Tenant: TRACKER_TENANT}', "[TRACKER_CODE]")
        expected = r"p\.yaml:5: mcp_servers\.tracker\.headers: found a value that is not a mapping"
    with pytest.raises(PieceError, match=expected) as err:
        parse_piece(text, source="p.yaml")
    assert "\n" not in str(err.value)


# -- a job ---------------------------------------------------------------------------------------------------------

def test_a_job_calls_an_http_servers_tools_and_its_header_value_is_never_stored(
        ws: Workspace, tmp_path: Path, server: HttpServer) -> None:
    piece = write_piece(tmp_path, "tracker-job", {
        "mcp_servers": {"tracker": {"url": server.url, "headers": {"Authorization": "Bearer ${TRACKER_CODE}"},
                                    "permission": "edit", "read_only_tools": ["echo"], "timeout": 5}},
        "movements": [{"name": "work", "instruction": "Use the tracker.", "tools": ["Read", "tracker.*"],
                       "permission": "edit", "rules": [{"next": "COMPLETE"}]}],
    })
    spec = write_script(tmp_path, "tracker-script", responses=[
        call("echo", text="hello"),
        call("stats", values=[2, 3]),
        call("picture"),
        call("fail", reason="because"),
        call("token_seen"),
        transition("COMPLETE", summary="used the tracker"),
    ])
    job = ws.run(ws.submit("Use the tracker", piece=str(piece), model=spec))
    assert job.status == "succeeded", job.error
    calls = ws.events(job, kinds=["tool_call"])
    results = {e.call_id: e for e in ws.events(job, kinds=["tool_result"])}
    by_tool = {c.tool: results[c.call_id] for c in calls}
    assert [c.server for c in calls] == ["tracker"] * 5 + [None]
    assert by_tool["echo"].content == "echo: hello" and by_tool["echo"].server == "tracker"
    assert '"sum": 5' in by_tool["stats"].content
    assert by_tool["picture"].content.startswith("a dot")
    assert by_tool["fail"].is_error and "refused: because" in by_tool["fail"].content
    # the server saw the token (its guard answers 401 without it); the result that repeats it is masked
    assert by_tool["token_seen"].content == "seen=***"
    assert {"echo", "stats", "picture", "token_seen", "transition"} <= set(ws.events(job, kinds=["llm_request"])[0].tools)
    # the piece is stored with the variable's name; its value is in no event and nowhere in the workspace's files
    assert not [e for e in ws.events(job) if TOKEN in payload_json(e)]
    stored = [p for p in ws.root.rglob("*") if p.is_file()]
    assert [p for p in stored if TOKEN.encode() in p.read_bytes()] == []
    if not pg_backend():  # the store is the SQLite file (its -wal too)
        assert any(b"${TRACKER_CODE}" in p.read_bytes() for p in stored if p.name.startswith("agentnb.sqlite"))


def test_a_movement_whose_http_server_is_down_fails_with_one_line_naming_it(ws: Workspace, tmp_path: Path) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{closed.getsockname()[1]}/mcp"
    closed.close()
    piece = write_piece(tmp_path, "down", {
        "mcp_servers": {"tracker": {"url": url, "permission": "readonly"}},
        "movements": [{"name": "work", "instruction": "Go.", "tools": ["tracker.*"], "rules": [{"next": "COMPLETE"}]}],
    })
    spec = write_script(tmp_path, "down-script", responses=[transition("COMPLETE")])
    job = ws.run(ws.submit("Go", piece=str(piece), model=spec))
    assert job.status == "failed"
    error = ws.events(job, kinds=["error"])[-1]
    assert error.where == "mcp" and f"MCP server 'tracker' could not be started ({url})" in error.message
    assert "\n" not in error.message
