"""MCP servers as tool sources (docs/tools.md#mcp-tools, docs/pieces.md#mcp-servers): a stdio server written
here with the ``mcp`` package's own server class and run as a real subprocess, and ``mcp-server-time`` from
the registry as a user runs it.  Never a mock of the protocol."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, transition, write_piece, write_script

from agentnb import Workspace
from agentnb.engine.pieces import parse_piece
from agentnb.errors import PieceError
from agentnb.tools.context import ToolContext
from agentnb.tools.mcp import McpServer, McpSession, McpStartError

pytest.importorskip("mcp", reason="the mcp package is not installed: pip install -e '.[test]' (or agentnb[mcp])")

# a 1×1 PNG, as a server sends an image (base64); the blob and the audio are bytes nobody should read as text
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
BLOB = "QUJD" * 1000  # 3,000 bytes

SERVER = textwrap.dedent('''
    import os, sys, time
    from mcp.server.mcpserver import MCPServer
    from mcp.types import (AudioContent, BlobResourceContents, CallToolResult, EmbeddedResource, ImageContent,
                           ResourceLink, TextContent, TextResourceContents, ToolAnnotations)

    server = MCPServer("notes")
    START = f"{os.getpid()}-{os.urandom(4).hex()}"
    PNG, BLOB = %r, %r

    @server.tool()
    def picture() -> CallToolResult:
        """Text, images, resources, audio and a link, in this order."""
        return CallToolResult(content=[
            TextContent(type="text", text="before"),
            ImageContent(type="image", data=PNG, mime_type="image/png"),
            EmbeddedResource(type="resource", resource=TextResourceContents(
                uri="file:///notes/a.txt", mime_type="text/plain", text="the resource's text")),
            EmbeddedResource(type="resource", resource=BlobResourceContents(
                uri="file:///notes/b.bin", mime_type="application/octet-stream", blob=BLOB)),
            AudioContent(type="audio", data=BLOB, mime_type="audio/wav"),
            ImageContent(type="image", data=PNG, mime_type="image/png"),
            ImageContent(type="image", data=BLOB, mime_type="image/tiff"),
            ResourceLink(type="resource_link", name="c", uri="file:///notes/c.txt", mime_type="text/plain", size=12),
            TextContent(type="text", text="after"),
        ])

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def huge(lines: int) -> str:
        """A long text."""
        return "".join(f"line {i:07d} of the huge result\\n" for i in range(lines))

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def echo(text: str) -> str:
        """Say the text back."""
        return "echo: " + text

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def stats(values: list[int]) -> dict[str, int]:
        """Sum and count of the values."""
        return {"sum": sum(values), "count": len(values)}

    @server.tool()
    def only_structured(n: int) -> CallToolResult:
        """A result with structured content and no text."""
        return CallToolResult(content=[], structured_content={"n": n, "square": n * n})

    @server.tool()
    def fail(reason: str) -> CallToolResult:
        """Always fails."""
        return CallToolResult(content=[TextContent(type="text", text="refused: " + reason)], is_error=True)

    @server.tool()
    def slow(seconds: float) -> str:
        """Sleeps."""
        time.sleep(seconds)
        return "woke"

    @server.tool()
    def die() -> str:
        """The server exits in the middle of the call."""
        os._exit(1)

    @server.tool()
    def count(path: str) -> str:
        """Appends a line to a file anywhere: an effect outside the work directory."""
        with open(path, "a") as fh:
            fh.write("called\\n")
        return "counted"

    @server.tool()
    def whoami() -> str:
        """This start of the server (its pid, which a jail numbers from 1, and a random mark), its folder and its
        MCP_GREETING."""
        return f"{START} {os.getcwd()} {os.environ.get('MCP_GREETING', '-')}"

    @server.tool()
    def write_note(name: str, text: str) -> str:
        """Writes a file in the server's folder."""
        with open(name, "w") as fh:
            fh.write(text)
        return "written"

    @server.tool()
    def read_path(path: str) -> CallToolResult:
        """Reads a file anywhere; the error's own text when it cannot."""
        try:
            with open(path) as fh:
                return _text(fh.read())
        except OSError as exc:
            return _text(str(exc), is_error=True)

    @server.tool()
    def connect(port: int) -> CallToolResult:
        """Opens a TCP connection to a loopback port and reads what it says; the error's own text when it cannot."""
        import socket
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                return _text(sock.recv(100).decode())
        except OSError as exc:
            return _text(str(exc), is_error=True)

    def _text(text: str, is_error: bool = False) -> CallToolResult:
        return CallToolResult(content=[TextContent(type="text", text=text)], is_error=is_error)

    @server.tool()
    def getenv(name: str) -> str:
        """One variable of the server's environment, '-' when it has none."""
        return os.environ.get(name, "-")

    print("notes server starting", file=sys.stderr)
    server.run("stdio")
''') % (PNG, BLOB)


@pytest.fixture
def server_file(tmp_path: Path) -> Path:
    """The server's script, in the work directory of the sessions made here (jailed, a server sees nothing else);
    a job gets it as an input (:func:`_inputs`).  Its name is this test's own, so the process table tells its
    servers from those of other tests."""
    path = tmp_path / "work" / f"notes_{uuid.uuid4().hex[:8]}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(SERVER, encoding="utf-8")
    return path


def _inputs(server_file: Path) -> dict[str, Path]:
    return {server_file.name: server_file}


def _args(server_file: Path) -> list[str]:
    """A job's server script: its copy in input/, relative to the job's work directory (the server's folder)."""
    return [f"input/{server_file.name}"]


# the server runs in Bash's jail (the sandbox is on unless AGENTNB_BASH_SANDBOX=off): without bwrap it cannot start
JAILED = pytest.mark.needs("bwrap")


def _spec(server_file: Path, **extra: Any) -> McpServer:
    return McpServer(name="notes", command=sys.executable, args=(str(server_file),), **extra)


def _ctx(tmp_path: Path) -> ToolContext:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return ToolContext(workdir=work, logs_dir=tmp_path / "logs", budget_tokens=10_000)


def _servers_of(server_file: Path) -> list[int]:
    """The live processes (not zombies) whose command line names ``server_file`` (a jail's bwrap too)."""
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            if proc.name.isdigit() and server_file.name in (proc / "cmdline").read_text() and _alive(int(proc.name)):
                found.append(int(proc.name))
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` is in the process table as a live process (not gone, not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# -- the session: listing and calls --------------------------------------------------------------------------------

@JAILED
def test_a_server_lists_its_tools_with_their_schemas_and_its_calls_give_text_structured_and_errors(
        tmp_path: Path, server_file: Path) -> None:
    session = McpSession({"notes": _spec(server_file, timeout=2, trust_annotations=True)}, tmp_path / "work",
                         tmp_path / "logs")
    ctx = _ctx(tmp_path)
    try:
        tools = {t.name: t for t in session.tools_for(["notes.*"], taken=["Read"])}
        assert set(tools) == {"echo", "stats", "only_structured", "fail", "slow", "die", "count", "whoami", "write_note",
                              "picture", "huge", "read_path", "connect", "getenv"}
        assert tools["echo"].parameters["properties"]["text"]["type"] == "string"
        assert tools["echo"].parameters["required"] == ["text"]
        assert tools["echo"].server == "notes" and tools["echo"].permission == "full"
        # trust_annotations: readOnlyHint makes echo read-only; write_note says nothing, so it is not
        assert tools["echo"].read_only and not tools["write_note"].read_only

        out = tools["echo"].invoke(ctx, {"text": "hi"})
        assert (out.content, out.is_error) == ("echo: hi", False)
        out = tools["stats"].invoke(ctx, {"values": [1, 2, 3]})
        assert not out.is_error and '"sum": 6' in out.content and '"count": 3' in out.content
        out = tools["only_structured"].invoke(ctx, {"n": 3})
        assert (out.content, out.is_error) == ('{"n": 3, "square": 9}', False)
        out = tools["fail"].invoke(ctx, {"reason": "no"})
        assert out.is_error and "refused: no" in out.content
        started = time.monotonic()
        out = tools["slow"].invoke(ctx, {"seconds": 30})
        assert out.is_error and "timeout of 2 s" in out.content and "cancelled" in out.content
        assert time.monotonic() - started < 10
        # the server is still usable after a cancelled call
        assert tools["echo"].invoke(ctx, {"text": "again"}).content == "echo: again"
    finally:
        session.close()


@JAILED
def test_a_server_that_dies_during_a_call_is_a_tool_error_and_is_started_again_for_the_next(
        tmp_path: Path, server_file: Path) -> None:
    session = McpSession({"notes": _spec(server_file, timeout=10)}, tmp_path, tmp_path / "logs")
    ctx = _ctx(tmp_path)
    try:
        tools = {t.name: t for t in session.tools_for(["notes.die", "notes.whoami"], taken=[])}
        first = tools["whoami"].invoke(ctx, {}).content.split()[0]
        first_processes = _servers_of(server_file)  # the host's pids: the guard, the jail's bwrap, the server
        out = tools["die"].invoke(ctx, {})
        assert out.is_error and "MCP server 'notes'" in out.content and "\n" not in out.content
        second = tools["whoami"].invoke(ctx, {}).content.split()[0]
        assert second != first and first_processes and not any(_alive(p) for p in first_processes)
    finally:
        session.close()
    assert not _servers_of(server_file)


@JAILED
def test_a_name_that_clashes_is_prefixed_with_the_server_and_the_allow_list_limits_the_tools(
        tmp_path: Path, server_file: Path) -> None:
    session = McpSession({"notes": _spec(server_file, tools=("echo", "whoami"))}, tmp_path, tmp_path / "logs")
    try:
        tools = session.tools_for(["notes.*"], taken=["echo"])
        assert sorted(t.name for t in tools) == ["notes_echo", "whoami"]
    finally:
        session.close()


@JAILED
def test_env_passes_the_workers_variable_or_a_literal_and_the_folder_is_the_work_directory(
        tmp_path: Path, server_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTES_GREETING_SOURCE", "hello-from-worker")
    ctx = _ctx(tmp_path)
    for env, expected in ((("MCP_GREETING", "${NOTES_GREETING_SOURCE}"),), "hello-from-worker"), \
                         ((("MCP_GREETING", "literal"),), "literal"):
        session = McpSession({"notes": _spec(server_file, env=env)}, ctx.workdir, tmp_path / "logs")
        try:
            whoami = next(t for t in session.tools_for(["notes.whoami"], taken=[]))
            _, cwd, greeting = whoami.invoke(ctx, {}).content.split()
            assert (Path(cwd), greeting) == (ctx.workdir.resolve(), expected)
        finally:
            session.close()
        assert not _servers_of(server_file)


@JAILED
def test_a_server_that_cannot_start_is_one_line_naming_it_and_its_stderr(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nprint('cannot find the config', file=sys.stderr)\nsys.exit(3)\n")
    for spec in (McpServer(name="ghost", command="no-such-mcp-server-here"),
                 McpServer(name="ghost", command=sys.executable, args=(str(bad),))):
        session = McpSession({"ghost": spec}, tmp_path, tmp_path / "logs")
        with pytest.raises(McpStartError) as err:
            session.tools_for(["ghost.*"], taken=[])
        session.close()
        assert "MCP server 'ghost'" in str(err.value) and "\n" not in str(err.value)
    assert "cannot find the config" in str(err.value)


# -- the piece ---------------------------------------------------------------------------------------------------

PIECE = """\
name: with-notes
mcp_servers:
  notes:
    command: python
    args: [server.py]
    env: {TOKEN: "${NOTES_TOKEN}", MODE: plain}
    permission: edit
    read_only_tools: [echo]
    timeout: 5
movements:
  - name: work
    instruction: Use the notes.
    tools: [Read, notes.echo, notes.*]
    permission: edit
    rules: [{next: COMPLETE}]
"""


def test_a_piece_declares_servers_and_its_movements_name_their_tools() -> None:
    piece = parse_piece(PIECE.replace("notes.echo, notes.*", "notes.echo, notes.write_note"), source="p.yaml")
    notes = piece.mcp_servers["notes"]
    assert (notes.command, notes.args, notes.permission, notes.timeout) == ("python", ("server.py",), "edit", 5.0)
    assert notes.env == (("TOKEN", "${NOTES_TOKEN}"), ("MODE", "plain"))
    assert piece.movements[0].tools == ("Read", "notes.echo", "notes.write_note")
    assert parse_piece(piece.to_yaml(), source="p.yaml") == piece
    # in Python: declared on a Piece, checked like a file
    plain = parse_piece("name: plain\nmovements:\n  - {name: work, instruction: Go., permission: edit, "
                        "rules: [{next: COMPLETE}]}\n")
    built = plain.with_mcp_server("notes", command="python", args=["server.py"], permission="edit")
    built = built.replace_movement("work", tools=["notes.*"])
    assert built.mcp_servers["notes"].permission == "edit" and built.movements[0].tools == ("notes.*",)
    with pytest.raises(PieceError, match=r"movements\[0\] \(work\)\.tools\[0\].*needs permission 'full'"):
        plain.with_mcp_server("notes", command="python").replace_movement("work", tools=["notes.*"])


@pytest.mark.parametrize(("change", "expected"), [
    (("notes.echo, notes.*", "notes.echo, nope.*"),
     r"p\.yaml:13: movements\[0\] \(work\)\.tools\[2\]: unknown MCP server 'nope'.*declared in mcp_servers: notes"),
    (("    timeout: 5\n", "    timeout: 5\n    colour: red\n"),
     r"p\.yaml:10: mcp_servers\.notes\.colour: unknown key 'colour'; allowed keys: command, args"),
    (("    permission: edit\n    read", "    permission: full\n    read"),
     r"p\.yaml:13: movements\[0\] \(work\)\.tools\[1\]: MCP server 'notes' needs permission 'full'; this "
     r"movement has 'edit'"),
    (("    command: python\n", "    url: http://localhost:1/mcp\n"),
     r"p\.yaml:5: mcp_servers\.notes\.args: 'args' is for a stdio server \(command\); a Streamable HTTP server"),
    (("${NOTES_TOKEN}", "x${NOTES_TOKEN}"), r"p\.yaml:6: mcp_servers\.notes\.env\.TOKEN: found 'x\$\{NOTES_TOKEN\}'"),
])
def test_piece_validation_names_file_line_and_field(change: tuple[str, str], expected: str) -> None:
    with pytest.raises(PieceError, match=expected) as err:
        parse_piece(PIECE.replace(*change), source="p.yaml")
    assert "\n" not in str(err.value)


def test_a_piece_with_servers_is_refused_at_submit_without_the_mcp_package(tmp_path: Path) -> None:
    piece = write_piece(tmp_path, "with-notes", PIECE)
    # a real interpreter in which `mcp` cannot be found (None in sys.modules), as on a machine without the extra
    code = textwrap.dedent(f"""
        import sys
        sys.modules["mcp"] = None
        from agentnb import Workspace
        try:
            Workspace({str(tmp_path / 'ws')!r}).submit("go", piece={str(piece)!r}, model="demo")
        except Exception as exc:
            print(type(exc).__name__, exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == ("UsageError the piece declares MCP servers (notes) but the 'mcp' package is not "
                                  "installed; install the extra: pip install 'agentnb[mcp]'"), out.stderr
    assert not (tmp_path / "ws" / "jobs" / "1").exists()


# -- a job ---------------------------------------------------------------------------------------------------------

def _job_piece(tmp_path: Path, server_file: Path, permission: str = "edit") -> Path:
    return write_piece(tmp_path, "notes-job", {
        "mcp_servers": {"notes": {"command": sys.executable, "args": _args(server_file), "permission": "edit",
                                  "read_only_tools": ["echo", "whoami"], "timeout": 2}},
        "movements": [{"name": "work", "instruction": "Use the notes.", "tools": ["Read", "notes.*"],
                       "permission": permission, "rules": [{"next": "COMPLETE"}]}],
    })


@JAILED
def test_a_job_calls_mcp_tools_as_ordinary_tool_calls_and_leaves_no_server_behind(
        ws: Workspace, tmp_path: Path, server_file: Path) -> None:
    spec = write_script(tmp_path, "notes-script", responses=[
        call("whoami"),
        call("echo", text="hello"),
        call("write_note", name="note.txt", text="from mcp"),
        call("fail", reason="because"),
        call("missing_tool"),
        transition("COMPLETE", summary="used the notes"),
    ])
    job = ws.run(ws.submit("Use the notes", piece=str(_job_piece(tmp_path, server_file)), model=spec,
                               inputs=_inputs(server_file)))
    assert job.status == "succeeded", job.error
    calls = ws.events(job, kinds=["tool_call"])
    results = {e.call_id: e for e in ws.events(job, kinds=["tool_result"])}
    by_tool = {c.tool: results[c.call_id] for c in calls}
    assert [c.server for c in calls] == ["notes", "notes", "notes", "notes", None, None]
    assert by_tool["echo"].content == "echo: hello" and by_tool["echo"].server == "notes"
    assert by_tool["write_note"].content == "written"
    assert by_tool["fail"].is_error and "refused: because" in by_tool["fail"].content
    assert by_tool["missing_tool"].is_error and "not available in this step" in by_tool["missing_tool"].content
    assert "server" not in by_tool["transition"].payload  # other tools' events are as before
    # the model was shown the server's tools with their schemas
    request_tools = ws.events(job, kinds=["llm_request"])[0].tools
    assert {"Read", "echo", "write_note", "whoami", "transition"} <= set(request_tools)
    # the server ran in the job's work directory, and is gone now the run has ended
    _, cwd, _ = by_tool["whoami"].content.split()
    assert (Path(cwd) / "note.txt").read_text() == "from mcp"
    assert not _servers_of(server_file), "the MCP server outlived its job run"
    # and the session's event loop thread ended with it
    import threading

    assert not [t for t in threading.enumerate() if t.name == "agentnb-mcp"]


@JAILED
def test_a_tool_with_effects_is_committed_before_it_runs(ws: Workspace, tmp_path: Path, server_file: Path) -> None:
    # one response: echo (read-only), then slow, which is not; the store holds slow's tool_call while the server
    # still runs it, seen from another connection (a fresh Workspace on the same files)
    import threading

    spec = write_script(tmp_path, "slow-script", responses=[
        {"tool_calls": [{"name": "echo", "arguments": {"text": "first"}},
                        {"name": "slow", "arguments": {"seconds": 1.5}}]},
        transition("COMPLETE", summary="slept")])
    job = ws.submit("Sleep", piece=str(_job_piece(tmp_path, server_file)), model=spec, inputs=_inputs(server_file))
    seen: list[list[str]] = []

    def watch() -> None:
        other = Workspace(ws.root)
        for _ in range(200):
            stored = [(e.kind, getattr(e, "tool", "")) for e in other.events(job)]
            if ("tool_call", "slow") in stored:
                seen.append([kind for kind, tool in stored if tool == "slow"])
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    done = ws.run(job)
    watcher.join()
    assert done.status == "succeeded", done.error
    assert seen == [["tool_call"]]
    slow = ws.events(job, kinds=["tool_result"])[1]
    assert (slow.tool, slow.content, slow.server) == ("slow", "woke", "notes")


@JAILED
def test_a_movement_whose_server_cannot_start_fails_with_one_line_naming_it(ws: Workspace, tmp_path: Path) -> None:
    piece = write_piece(tmp_path, "ghost", {
        "mcp_servers": {"ghost": {"command": "no-such-mcp-server-here", "permission": "readonly"}},
        "movements": [{"name": "work", "instruction": "Go.", "tools": ["ghost.*"], "rules": [{"next": "COMPLETE"}]}],
    })
    spec = write_script(tmp_path, "ghost-script", responses=[transition("COMPLETE")])
    job = ws.run(ws.submit("Go", piece=str(piece), model=spec))
    assert job.status == "failed"
    errors = ws.events(job, kinds=["error"])
    assert errors[-1].where == "mcp" and "MCP server 'ghost' could not be started" in errors[-1].message


def test_a_fork_re_serves_mcp_results_from_the_record_and_never_calls_the_server_again(
        ws: Workspace, tmp_path: Path, server_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an effect outside the work directory, which only an unjailed server can have
    monkeypatch.setenv("AGENTNB_BASH_SANDBOX", "off")
    outside = tmp_path / "outside.log"
    piece = write_piece(tmp_path, "two-runs", {
        "mcp_servers": {"notes": {"command": sys.executable, "args": [str(server_file)], "permission": "edit"}},
        "movements": [
            {"name": "first", "instruction": "Count.", "tools": ["notes.count"], "permission": "edit",
             "rules": [{"next": "second"}]},
            {"name": "second", "instruction": "Finish.", "rules": [{"next": "COMPLETE"}]},
        ],
    })
    spec = write_script(tmp_path, "two-runs-script", {
        "first": [call("count", path=str(outside)), transition("second")],
        "second": [transition("COMPLETE"), transition("COMPLETE")],
    })
    job = ws.run(ws.submit("Count", piece=str(piece), model=spec))
    assert job.status == "succeeded", job.error
    fork = ws.fork(job, at=2)
    assert ws.job(fork).status == "succeeded", ws.job(fork).error
    assert outside.read_text() == "called\n"  # once: the fork's re-served run 1 did not call the server
    assert not (ws.job(fork).workdir / "logs" / "mcp-notes.stderr.log").exists()  # nor even start it
    (kept,) = [e for e in ws.events(fork, kinds=["tool_result"]) if e.tool == "count"]
    assert (kept.content, kept.server, kept.is_error) == ("counted", "notes", False)
    assert not ws.events(fork, kinds=["replay_divergence"])


# -- isolation: Bash's jail and environment allow-list ------------------------------------------------------------

@contextlib.contextmanager
def _listener() -> Any:
    """A loopback TCP port that greets whoever connects; yields the port."""
    import socket
    import threading

    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"hello from the listener")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        sock.close()


@pytest.mark.parametrize("sandbox", [pytest.param("auto", marks=JAILED), "off"])
def test_a_stdio_server_runs_in_bashs_jail_with_bashs_environment_allow_list(
        ws: Workspace, tmp_path: Path, server_file: Path, monkeypatch: pytest.MonkeyPatch, sandbox: str) -> None:
    monkeypatch.setenv("AGENTNB_BASH_SANDBOX", sandbox)
    monkeypatch.setenv("AGENTNB_BASH_ENV", "NOTES_ALLOWED")  # Bash's allow-list, which a server shares
    monkeypatch.setenv("NOTES_ALLOWED", "allowed-by-bash-env")
    monkeypatch.setenv("NOTES_SOURCE", "passed-by-env")
    monkeypatch.setenv("NOTES_WORKER_ONLY", "the-workers-own")  # neither allowed nor named: never the server's
    monkeypatch.setenv("NOTES_API_KEY", "sk-worker-secret-123456")
    monkeypatch.setenv("USER", "someone")  # the mcp package's own default environment, not Bash's allow-list
    outside = tmp_path / "outside.txt"
    outside.write_text("OUTSIDE-CONTENT")
    server = {"command": sys.executable, "args": _args(server_file), "permission": "edit",
              "env": {"MCP_GREETING": "${NOTES_SOURCE}"}}
    piece = write_piece(tmp_path, "jailed", {
        "mcp_servers": {"closed": server, "open": {**server, "network": True}},
        # the open server's connect clashes with the closed one's: the model sees it as open_connect
        "movements": [{"name": "work", "instruction": "Go.", "tools": ["closed.*", "open.connect"],
                       "permission": "edit", "rules": [{"next": "COMPLETE"}]}],
    })
    with _listener() as port:
        spec = write_script(tmp_path, "jail-script", responses=[
            call("read_path", path=str(outside)),
            call("write_note", name="output/inside.txt", text="written inside"),
            call("read_path", path="output/inside.txt"),
            call("connect", port=port),
            call("open_connect", port=port),
            *[call("getenv", name=n) for n in ("NOTES_ALLOWED", "MCP_GREETING", "PATH", "NOTES_WORKER_ONLY",
                                               "NOTES_API_KEY", "USER", "AGENTNB_MCP_PARENT")],
            transition("COMPLETE", summary="probed"),
        ])
        job = ws.run(ws.submit("Go", piece=str(piece), model=spec, inputs=_inputs(server_file)))
    assert job.status == "succeeded", job.error
    results = [e for e in ws.events(job, kinds=["tool_result"]) if e.tool != "transition"]
    read_outside, write, read_inside, closed, opened, *env = results
    assert (write.content, read_inside.content) == ("written", "written inside")
    assert (ws.root / "jobs" / str(job.id) / "output" / "inside.txt").read_text() == "written inside"
    assert opened.content == "hello from the listener" and opened.server == "open"
    if sandbox == "auto":
        # the model reads the server's own error: the file is not there in the jail, nor the network
        assert read_outside.is_error and "No such file or directory" in read_outside.content
        assert closed.is_error and "refused" in closed.content and closed.server == "closed"
    else:
        assert read_outside.content == "OUTSIDE-CONTENT" and closed.content == "hello from the listener"
    assert [e.content for e in env[:2]] == ["allowed-by-bash-env", "passed-by-env"]
    assert env[2].content != "-"  # PATH
    assert [e.content for e in env[3:]] == ["-", "-", "-", "-"]


@JAILED
def test_a_server_installed_in_a_virtual_environment_of_its_own_runs_in_the_jail(
        tmp_path: Path, server_file: Path) -> None:
    # a program on PATH outside the system folders and the running Python, as `pipx` or `uv tool` install one: a
    # virtual environment's bin/ script whose #! names that environment's python.  The jail shows the environment
    # (read-only) and nothing else of where it lies
    import site
    import venv

    tools = tmp_path / "tools"
    venv.create(tools, with_pip=False)
    (tools / "secret.txt").write_text("NEXT-TO-THE-PROGRAM")
    program = tools / "bin" / "notes-server"
    program.write_text(f"#!{tools}/bin/python\nimport sys\nsys.path[:0] = {site.getsitepackages()!r}\n"
                       + SERVER, encoding="utf-8")
    program.chmod(0o755)
    spec = McpServer(name="notes", command="notes-server", env=(("PATH", f"{tools / 'bin'}:/usr/bin:/bin"),))
    session = McpSession({"notes": spec}, server_file.parent, tmp_path / "logs")
    try:
        tools_ = {t.name: t for t in session.tools_for(["notes.*"], taken=[])}
        ctx = _ctx(tmp_path)
        assert tools_["echo"].invoke(ctx, {"text": "installed"}).content == "echo: installed"
        assert tools_["read_path"].invoke(ctx, {"path": str(tools / "secret.txt")}).content == "NEXT-TO-THE-PROGRAM"
        out = tools_["write_note"].invoke(ctx, {"name": str(tools / "bin" / "changed"), "text": "x"})
        assert out.is_error and not (tools / "bin" / "changed").exists()  # read-only
        assert tools_["read_path"].invoke(ctx, {"path": str(tmp_path / "logs" / "mcp-notes.stderr.log")}).is_error
    finally:
        session.close()


def test_without_bubblewrap_a_server_is_refused_in_one_line_unless_the_sandbox_is_off(
        tmp_path: Path, server_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no bwrap on it; the server's python is named in full
    session = McpSession({"notes": _spec(server_file)}, server_file.parent, tmp_path / "logs")
    with pytest.raises(McpStartError) as err:
        session.tools_for(["notes.echo"], taken=[])
    session.close()
    assert "MCP server 'notes' could not be started" in str(err.value) and "\n" not in str(err.value)
    assert "bubblewrap" in str(err.value) and "AGENTNB_BASH_SANDBOX=off" in str(err.value)
    assert not _servers_of(server_file)
    monkeypatch.setenv("AGENTNB_BASH_SANDBOX", "off")
    session = McpSession({"notes": _spec(server_file)}, server_file.parent, tmp_path / "logs")
    try:
        (echo,) = session.tools_for(["notes.echo"], taken=[])
        assert echo.invoke(_ctx(tmp_path), {"text": "unconfined"}).content == "echo: unconfined"
    finally:
        session.close()


def test_network_is_true_or_false_and_kept_with_the_piece() -> None:
    piece = parse_piece(PIECE.replace("    timeout: 5\n", "    timeout: 5\n    network: true\n"), source="p.yaml")
    assert piece.mcp_servers["notes"].network is True
    assert parse_piece(piece.to_yaml(), source="p.yaml") == piece
    assert parse_piece(PIECE, source="p.yaml").mcp_servers["notes"].network is False
    assert "network" not in parse_piece(PIECE, source="p.yaml").mcp_servers["notes"].to_dict()
    plain = parse_piece("name: plain\nmovements:\n  - {name: work, instruction: Go., rules: [{next: COMPLETE}]}\n")
    assert plain.with_mcp_server("notes", command="python", network=True).mcp_servers["notes"].network is True
    with pytest.raises(PieceError, match=r"^p\.yaml:10: mcp_servers\.notes\.network: expected true or false$"):
        parse_piece(PIECE.replace("    timeout: 5\n", "    timeout: 5\n    network: \"yes\"\n"), source="p.yaml")
    with pytest.raises(PieceError, match=r"mcp_servers\.notes\.network: expected true or false"):
        plain.with_mcp_server("notes", command="python", network="on")


# -- a server from the registry, as a user runs it ---------------------------------------------------------------

def _time_server() -> str | None:
    import shutil

    found = shutil.which("mcp-server-time") or str(Path(sys.executable).parent / "mcp-server-time")
    return found if os.access(found, os.X_OK) else None


@JAILED
def test_mcp_server_time_from_the_registry(ws: Workspace, tmp_path: Path) -> None:
    command = _time_server()
    if command is None:
        message = "mcp-server-time is not installed: pip install -e '.[test]'"
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    piece = write_piece(tmp_path, "clock", {
        "mcp_servers": {"time": {"command": command, "args": ["--local-timezone", "UTC"], "permission": "readonly",
                                 "trust_annotations": True}},
        "movements": [{"name": "ask", "instruction": "What time is it in Tokyo?", "tools": ["time.*"],
                       "rules": [{"next": "COMPLETE"}]}],
    })
    spec = write_script(tmp_path, "clock-script", responses=[
        call("get_current_time", timezone="Asia/Tokyo"), transition("COMPLETE", summary="asked")])
    job = ws.run(ws.submit("Time?", piece=str(piece), model=spec))
    assert job.status == "succeeded", job.error
    result = ws.events(job, kinds=["tool_result"])[0]
    assert result.server == "time" and not result.is_error and "Asia/Tokyo" in result.content


@JAILED
def test_a_worker_killed_during_a_call_with_effects_never_runs_it_again(
        ws: Workspace, tmp_path: Path, server_file: Path) -> None:
    # one response: echo (read-only), then slow (not read-only), then echo again; the worker is SIGKILLed while
    # slow runs.  The next worker completes the response: slow's result is the "effect unknown" tool error, the
    # read-only echo simply runs
    import signal

    spec = write_script(tmp_path, "crash-script", responses=[
        {"tool_calls": [{"name": "echo", "arguments": {"text": "one"}},
                        {"name": "slow", "arguments": {"seconds": 60}},
                        {"name": "echo", "arguments": {"text": "two"}}]},
        transition("COMPLETE", summary="done")])
    piece = write_piece(tmp_path, "crash", {
        "mcp_servers": {"notes": {"command": sys.executable, "args": _args(server_file), "permission": "edit",
                                  "read_only_tools": ["echo"], "timeout": 120}},
        "movements": [{"name": "work", "instruction": "Go.", "tools": ["notes.*"], "permission": "edit",
                       "rules": [{"next": "COMPLETE"}]}],
    })
    job = ws.submit("Go", piece=str(piece), model=spec, inputs=_inputs(server_file))
    code = "import sys; from agentnb import Workspace; print(Workspace(sys.argv[1]).run(int(sys.argv[2])).status)"
    first = subprocess.Popen([sys.executable, "-c", code, str(ws.root), str(job.id)], start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(e.tool == "slow" for e in ws.events(job, kinds=["tool_call"])):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-2000:]
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    # the killed worker's server went down with it (its guard got the kernel's parent-death signal)
    deadline = time.monotonic() + 10
    while _servers_of(server_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _servers_of(server_file)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"MCP server processes {left} outlived their SIGKILLed worker"
    second = subprocess.run([sys.executable, "-c", code, str(ws.root), str(job.id)], capture_output=True,
                            text=True, timeout=120)
    assert second.stdout.strip() == "succeeded", second.stderr[-3000:]
    results = [(e.tool, e.is_error, e.content[:60]) for e in ws.events(job, kinds=["tool_result"])]
    assert results[:3] == [("echo", False, "echo: one"),
                           ("slow", True, "Error: this call of slow was interrupted by a restart (agent"),
                           ("echo", False, "echo: two")]
    assert [e.tool for e in ws.events(job, kinds=["tool_call"])] == ["echo", "slow", "echo", "transition"]


# -- content -------------------------------------------------------------------------------------------------------

@JAILED
def test_content_blocks_keep_their_order_the_first_image_is_attached_and_binary_content_is_a_note(
        tmp_path: Path, server_file: Path) -> None:
    ctx = _ctx(tmp_path)
    session = McpSession({"notes": _spec(server_file)}, ctx.workdir, tmp_path / "logs")
    try:
        picture, fail = sorted(session.tools_for(["notes.picture", "notes.fail"], taken=[]), key=lambda t: t.name,
                               reverse=True)
        out = picture.invoke(ctx, {})
        long_error = fail.invoke(ctx, {"reason": "no " * 100_000})  # an error is cut to the budget too
    finally:
        session.close()
    assert long_error.is_error and long_error.truncated and long_error.content.startswith("Error: refused: no no")
    assert long_error.original_chars == len("Error: refused: ") + 300_000 > 5 * long_error.returned_chars
    assert not out.is_error and out.image == f"data:image/png;base64,{PNG}"
    assert out.content.splitlines() == [
        "before",
        "(image: image/png, 70 bytes; attached below)",
        "the resource's text",
        "(resource: application/octet-stream, 3,000 bytes, file:///notes/b.bin; not shown)",
        "(audio: audio/wav, 3,000 bytes; not shown)",
        "(image: image/png, 70 bytes; not attached: one image per tool result, the first is)",
        "(image: image/tiff, 3,000 bytes; not attached: images are attached as .png, .jpg, .jpeg, .gif, .webp)",
        "(resource link: text/plain, 12 bytes, file:///notes/c.txt; not shown)",
        "after",
    ]
    assert BLOB[:40] not in out.content  # a blob is never dumped as text


@JAILED
def test_an_mcp_image_reaches_the_model_after_the_tool_results_as_ReadImage_s_does(
        ws: Workspace, tmp_path: Path, server_file: Path, loopback: Any) -> None:
    from openai_server import reply

    srv = loopback()
    srv.play(reply(None, [("picture", {}), ("echo", {"text": "x"})]),
             reply(None, [("transition", {"next_step": "COMPLETE", "summary": "looked"})]))
    job = ws.run(ws.submit("Look", piece=str(_job_piece(tmp_path, server_file)), model="openai:m",
                           inputs=_inputs(server_file)))
    assert job.status == "succeeded", job.error
    picture = ws.events(job, kinds=["tool_result"])[0]
    assert (picture.tool, picture.server, picture.image) == ("picture", "notes", f"data:image/png;base64,{PNG}")
    sent = srv.received[1].body["messages"]
    # the tool messages right after the assistant's calls, then the image, as ReadImage's (tests/test_crash.py)
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert sent[3]["content"].startswith("before\n(image: image/png") and sent[4]["content"] == "echo: x"
    assert sent[5]["content"][0] == {"type": "text", "text": "(image attached by picture)"}
    assert sent[5]["content"][1]["image_url"]["url"] == f"data:image/png;base64,{PNG}"


@JAILED
def test_a_huge_result_is_cut_by_the_tool_result_budget_with_a_note(
        ws: Workspace, tmp_path: Path, server_file: Path) -> None:
    spec = write_script(tmp_path, "huge-script", responses=[
        call("huge", lines=60_000), transition("COMPLETE", summary="read it")])
    job = ws.run(ws.submit("Read a lot", piece=str(_job_piece(tmp_path, server_file)), model=spec,
                           inputs=_inputs(server_file)))
    assert job.status == "succeeded", job.error
    (huge,) = [e for e in ws.events(job, kinds=["tool_result"]) if e.tool == "huge"]
    assert huge.server == "notes" and huge.truncated and not huge.is_error
    assert huge.original_chars == 60_000 * 32 > 1_900_000  # about 2 MB came back from the server
    assert huge.returned_chars < huge.budget_tokens * 8 < huge.original_chars
    assert huge.content.startswith("line 0000000 of the huge result\n")
    assert "[agentnb: output truncated automatically: returned the first" in huge.content
    assert "of 1,920,000 characters" in huge.content


@JAILED
@pytest.mark.parametrize(("variable", "env", "asks"), [
    # the worker's variable looks like a secret
    ("NOTES_API_TOKEN", {"MCP_GREETING": "${NOTES_API_TOKEN}"}, call("whoami")),
    # it does not, but the name env: gives it does
    ("UPSTREAM_VALUE", {"SERVICE_TOKEN": "${UPSTREAM_VALUE}"}, call("getenv", name="SERVICE_TOKEN")),
], ids=["secret-variable", "secret-key"])
def test_a_secret_a_tool_returns_is_scrubbed_before_it_is_stored(
        ws: Workspace, tmp_path: Path, server_file: Path, monkeypatch: pytest.MonkeyPatch,
        variable: str, env: dict[str, str], asks: dict[str, Any]) -> None:
    secret = "tok-4f9a-0b7c-secret-value-2c1d"
    monkeypatch.setenv(variable, secret)
    piece = write_piece(tmp_path, "secret", {
        "mcp_servers": {"notes": {"command": sys.executable, "args": _args(server_file), "permission": "readonly",
                                  "env": env, "read_only_tools": ["whoami", "getenv"]}},
        "movements": [{"name": "work", "instruction": "Go.", "tools": ["notes.whoami", "notes.getenv"],
                       "rules": [{"next": "COMPLETE"}]}],
    })
    spec = write_script(tmp_path, "secret-script", responses=[asks, transition("COMPLETE")])
    job = ws.run(ws.submit("Who?", piece=str(piece), model=spec, inputs=_inputs(server_file)))
    assert job.status == "succeeded", job.error
    result = ws.events(job, kinds=["tool_result"])[0]
    assert not result.is_error and result.content.endswith("***") and secret not in result.content
    ws.close()
    leaked = [p for p in Path(ws.root).rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaked, f"the secret reached {leaked}"


# -- faults --------------------------------------------------------------------------------------------------------

@JAILED
def test_junk_on_a_servers_stdout_is_skipped_and_kept_in_its_stderr_log(
        tmp_path: Path, server_file: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # the mcp server class keeps stdout for the protocol, so the junk is put in front of every line it writes, as a
    # server in another language that prints to stdout would (the handshake's answer too)
    relay = server_file.parent / "relay.py"
    relay.write_text("import sys\nn = 0\nfor line in iter(sys.stdin.readline, ''):\n    n += 1\n"
                     "    sys.stdout.write(f'junk {n}: not JSON-RPC\\n' + line)\n    sys.stdout.flush()\n")
    junk = f"{sys.executable} {server_file.name} | {sys.executable} relay.py"
    session = McpSession({"notes": McpServer(name="notes", command="sh", args=("-c", junk), timeout=5)},
                         server_file.parent, tmp_path / "logs")
    try:
        tools = {t.name: t for t in session.tools_for(["notes.echo", "notes.stats"], taken=[])}
        assert tools["echo"].invoke(_ctx(tmp_path), {"text": "through"}).content == "echo: through"
        assert '"sum": 3' in tools["stats"].invoke(_ctx(tmp_path), {"values": [1, 2]}).content
    finally:
        session.close()
    log = (tmp_path / "logs" / "mcp-notes.stderr.log").read_text()
    skipped = "[agentnb] the server wrote a line to stdout that is not an MCP message; skipped: junk "
    assert f"{skipped}1: not JSON-RPC\n" in log and log.count(skipped) >= 4  # handshake, listing, two calls
    assert "Failed to parse" not in capfd.readouterr().err  # no traceback on the worker's stderr


@JAILED
def test_a_server_that_hangs_at_initialise_fails_the_movement_after_the_start_timeout(
        ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stuck = tmp_path / f"stuck_{uuid.uuid4().hex[:8]}.py"
    stuck.write_text("import sys, time\nprint('loading a large index', file=sys.stderr, flush=True)\ntime.sleep(600)\n")
    piece = write_piece(tmp_path, "stuck", {
        "mcp_servers": {"stuck": {"command": sys.executable, "args": [f"input/{stuck.name}"],
                                  "permission": "readonly"}},
        "movements": [{"name": "work", "instruction": "Go.", "tools": ["stuck.*"], "rules": [{"next": "COMPLETE"}]}],
    })
    spec = write_script(tmp_path, "stuck-script", responses=[transition("COMPLETE")])
    monkeypatch.setenv("AGENTNB_MCP_START_TIMEOUT", "2")
    started = time.monotonic()
    job = ws.run(ws.submit("Go", piece=str(piece), model=spec, inputs={stuck.name: stuck}))
    assert time.monotonic() - started < 20
    assert job.status == "failed"
    error = ws.events(job, kinds=["error"])[-1]
    assert error.where == "mcp" and "\n" not in error.message
    assert error.message.startswith("MCP server 'stuck' did not answer the MCP handshake within 2 s "
                                    "($AGENTNB_MCP_START_TIMEOUT sets the limit)")
    assert error.message.endswith("its stderr ends: loading a large index")
    deadline = time.monotonic() + 10
    while _servers_of(stuck) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _servers_of(stuck), "the server that hung outlived its failed run"
    # a bad value of the variable is one line naming it and what is allowed
    monkeypatch.setenv("AGENTNB_MCP_START_TIMEOUT", "soon")
    session = McpSession({"stuck": McpServer(name="stuck", command=sys.executable, args=(str(stuck),))}, tmp_path,
                         tmp_path / "logs")
    with pytest.raises(McpStartError, match=r"^\$AGENTNB_MCP_START_TIMEOUT must be a number of seconds above 0 "
                                            r"and at most 3600; found 'soon'$"):
        session.tools_for(["stuck.*"], taken=[])
    session.close()


@JAILED
def test_a_tool_the_server_does_not_offer_is_a_tool_error_and_the_server_stays_up(
        tmp_path: Path, server_file: Path) -> None:
    refusing = server_file.parent / "refusing_server.py"
    # a server that answers an unknown tool with a JSON-RPC error rather than an isError result, as some do
    refusing.write_text(textwrap.dedent('''
        import os
        from mcp.server.mcpserver import MCPServer
        from mcp.shared.exceptions import MCPError
        server = MCPServer("refusing")

        @server.tool()
        def pid() -> str:
            """The server's pid."""
            return str(os.getpid())

        @server.tool()
        def gone() -> str:
            """Answers as a server does for a tool it does not have."""
            raise MCPError(code=-32602, message="Unknown tool: gone")
        server.run("stdio")
    '''))
    session = McpSession({"notes": _spec(server_file),
                          "refusing": McpServer(name="refusing", command=sys.executable, args=(str(refusing),))},
                         server_file.parent, tmp_path / "logs")
    ctx = _ctx(tmp_path)
    try:
        out = session.call("notes", "no_such_tool", {}, ctx)  # the model named a tool the listing did not have
        assert out.is_error and "no_such_tool" in out.content and "\n" not in out.content
        (pid,) = session.tools_for(["refusing.pid"], taken=[])
        before = pid.invoke(ctx, {}).content
        out = session.call("refusing", "gone", {}, ctx)
        assert (out.content, out.is_error) == ("Error: MCP server 'refusing' refused gone: Unknown tool: gone", True)
        assert pid.invoke(ctx, {}).content == before  # answered, not crashed: the same process goes on
    finally:
        session.close()


# -- replays -------------------------------------------------------------------------------------------------------

def test_a_replay_re_serves_mcp_results_from_the_record_and_never_starts_the_server(
        ws: Workspace, tmp_path: Path, server_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTNB_BASH_SANDBOX", "off")  # an effect outside the work directory: unjailed only
    outside = tmp_path / "outside.log"
    spec = write_script(tmp_path, "replay-script", responses=[
        {"tool_calls": [{"name": "count", "arguments": {"path": str(outside)}},
                        {"name": "Read", "arguments": {"path": "input/a.txt"}},
                        {"name": "echo", "arguments": {"text": "hi"}}]},
        call("picture"),
        transition("COMPLETE", summary="counted"),
    ])
    job = ws.run(ws.submit("Count", piece=str(_job_piece(tmp_path, server_file)), model=spec,
                           inputs={"a.txt": "read again\n", **_inputs(server_file)}))
    assert job.status == "succeeded", job.error
    assert outside.read_text() == "called\n"
    replay = ws.replay(job)
    assert replay.status == "succeeded", replay.error
    assert outside.read_text() == "called\n"  # the server's tool was not called a second time
    assert (job.workdir / "logs" / "mcp-notes.stderr.log").exists()
    assert not (replay.workdir / "logs" / "mcp-notes.stderr.log").exists()  # nor was the server started

    def comparable(j: Any) -> list[tuple[Any, ...]]:
        return [(e.kind, e.movement_seq, e.iteration, e.payload) for e in ws.events(j)
                if e.kind in ("llm_request", "tool_call", "tool_result")]

    assert comparable(replay) == comparable(job)  # the same tools offered, the same results, images and servers
    results = ws.events(replay, kinds=["tool_result"])
    assert [(e.tool, e.server) for e in results] == [("count", "notes"), ("Read", None), ("echo", "notes"),
                                                     ("picture", "notes"), ("transition", None)]
    assert results[3].image == f"data:image/png;base64,{PNG}"
