"""A crash never silently redoes a side effect.

Each test runs a job in a real worker process, talking to the OpenAI-protocol server on
loopback, and SIGKILLs that process while a tool is in the middle of its work (the tool
writes a ``ready`` file once its effect is done, then sleeps) or while the model is
being asked.  A second worker process then takes the job over.  The effect must have
happened exactly once, the model must read that the interrupted call's effect is
unknown, and the job must finish.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from _scripting import write_piece
from conftest import pg_backend
from openai_server import OpenAIServer, openai_env, reply, stall

import agentnb
from agentnb import Workspace

PIECE = """
name: crashy
movements:
  - name: work
    persona: You work.
    instruction: Work.
    tools: [Read, Edit, Write, Bash, slow_append, slow_look]
    permission: full
    max_iterations: 10
    rules: [{next: COMPLETE}]
"""

# The same tools, defined in the worker processes; the first worker (CRASH_SLOW=1) parks inside them
# after their effect, so the test can kill it there.
WORKER = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    import agentnb

    SLOW = os.environ.get("CRASH_SLOW") == "1"

    def park(ctx):
        if SLOW:
            (Path(ctx.workdir) / "ready").write_text("the effect is done")
            time.sleep(120)

    @agentnb.tool(permission="edit")
    def slow_append(ctx, line: str) -> str:
        """Append a line to output/log.txt."""
        with open(Path(ctx.workdir) / "output" / "log.txt", "a") as fh:
            fh.write(line + "\\n")
        park(ctx)
        return "appended " + line

    @agentnb.tool(read_only=True)
    def slow_look(ctx) -> str:
        """Look around (declared read-only; it counts its runs in looks.txt so the test can see them)."""
        with open(Path(ctx.workdir) / "looks.txt", "a") as fh:
            fh.write("look\\n")
        park(ctx)
        return "nothing changed"

    agentnb.Workspace(sys.argv[1]).worker().run(max_jobs=1)
''')

INTERRUPTED = "Error: this call of {} was interrupted by a restart"


@pytest.fixture(autouse=True)
def tools() -> Iterator[None]:
    # known in this process too, so the piece naming them can be submitted here
    agentnb.tool(name="slow_append", permission="edit")(lambda line: "")
    agentnb.tool(name="slow_look", read_only=True)(lambda: "")
    yield
    agentnb.tools.base.unregister("slow_append")
    agentnb.tools.base.unregister("slow_look")


@pytest.fixture
def server(loopback: Callable[..., OpenAIServer]) -> OpenAIServer:
    return loopback()


def _env(server: OpenAIServer, slow: bool) -> dict[str, str]:
    src = str(Path(agentnb.__file__).resolve().parents[1])
    return {**os.environ, **openai_env(server), "CRASH_SLOW": "1" if slow else "0",
            "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}


def _worker(ws: Workspace, server: OpenAIServer, tmp_path: Path, slow: bool) -> subprocess.Popen[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    return subprocess.Popen([sys.executable, str(script), str(ws.root)], env=_env(server, slow),
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_when(proc: subprocess.Popen[str], ready: Any, what: str) -> None:
    """SIGKILL ``proc`` once ``ready()`` is true, as a crash would; clean up what it left running."""
    deadline = time.monotonic() + 90
    try:
        while not ready():
            if proc.poll() is not None:
                raise AssertionError(f"the worker ended before {what}: {proc.communicate()[1][-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)  # reaped: the store sees its owner gone
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a sleeping command the worker started, if any
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _crash_then_resume(ws: Workspace, server: OpenAIServer, tmp_path: Path, job: Any,
                       ready: Any = None, what: str = "the tool's effect") -> Any:
    wd = Path(job.workdir)
    first = _worker(ws, server, tmp_path, slow=True)
    _kill_when(first, ready or (lambda: (wd / "ready").exists()), what)
    assert ws.job(job).status == "running"  # the dead worker's claim is still there
    second = _worker(ws, server, tmp_path, slow=False)
    _out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err[-3000:]
    job = ws.job(job)
    reasons = [e.payload["reason"] for e in ws.events(job, kinds=["job_status"])]
    assert any(r.startswith("recovered: the process that ran it") for r in reasons), reasons
    return job


def _file(ws: Workspace, job: Any, path: str) -> str | None:
    """A file of the finished job as the store keeps it, None when it has none (read back through ws.pull, the
    same on both backends: on PostgreSQL the workers' work directories are their own)."""
    dest = Path(ws.root) / "pulled" / str(job.id)
    ws.pull(job, dest, overwrite=True)
    return (dest / path).read_text() if (dest / path).exists() else None


def _killed_effect(kept: str, lost: str | None) -> str | None:
    """What a file holds after a worker was killed mid-tool: on SQLite the work directory stays on disk, so the
    killed tool's effect is there (once); on PostgreSQL the next worker materialises the files stored with the
    last recorded result, so what the unfinished call changed went with the killed worker (docs/stores.md#files)."""
    return lost if pg_backend() else kept


def _results(ws: Workspace, job: Any, tool: str) -> list[dict[str, Any]]:
    return [e.payload for e in ws.events(job, kinds=["tool_result"]) if e.payload["tool"] == tool]


def _submit(ws: Workspace, tmp_path: Path) -> Any:
    # an openai: job is refused at submit without a key; the workers below are given the endpoint
    with mock.patch.dict(os.environ, {"OPENAI_API_KEY": "sk-test"}):
        return ws.submit("Do it.", piece=write_piece(tmp_path, "piece", PIECE), model="openai:m",
                         inputs={"a.txt": "alpha gamma\n"})


def test_a_custom_tool_killed_after_its_effect_is_not_run_again_and_the_model_is_told(
        ws: Workspace, tmp_path: Path, server: OpenAIServer) -> None:
    server.play(
        reply(None, [("slow_append", {"line": "one"})]),
        reply(None, [("transition", {"next_step": "COMPLETE", "summary": "checked the log"})]),
    )
    job = _crash_then_resume(ws, server, tmp_path, _submit(ws, tmp_path))
    assert job.status == "succeeded", job.error
    assert _file(ws, job, "output/log.txt") == _killed_effect("one\n", None)  # never twice
    assert len(server.received) == 2  # the first LLM call was not asked again
    sent = server.received[1].body["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool"]
    assert sent[3]["content"].startswith(INTERRUPTED.format("slow_append"))
    assert "effect is unknown" in sent[3]["content"] and "before repeating it" in sent[3]["content"]
    assert sent[3]["tool_call_id"] == sent[2]["tool_calls"][0]["id"]
    (result,) = _results(ws, job, "slow_append")
    assert result["is_error"]
    assert len(ws.events(job, kinds=["tool_call"])) == 2  # slow_append once, then the transition
    assert len(ws.events(job, kinds=["llm_response"])) == 2


def test_the_rest_of_the_response_runs_after_the_restart_and_its_transition_ends_the_movement(
        ws: Workspace, tmp_path: Path, server: OpenAIServer) -> None:
    server.play(reply("All at once.", [
        ("Read", {"path": "input/a.txt"}),
        ("Edit", {"path": "input/a.txt", "old": "alpha", "new": "beta"}),
        ("slow_append", {"line": "one"}),
        ("Write", {"path": "output/after.txt", "content": "after"}),
        ("transition", {"next_step": "COMPLETE", "summary": "did everything"}),
    ]))
    job = _crash_then_resume(ws, server, tmp_path, _submit(ws, tmp_path))
    assert job.status == "succeeded", job.error
    assert len(server.received) == 1  # no LLM call after the restart: the recorded response was completed
    assert _file(ws, job, "input/a.txt") == "beta gamma\n"  # the Edit ran once (a redo would fail)
    assert _file(ws, job, "output/log.txt") == _killed_effect("one\n", None)
    assert _file(ws, job, "output/after.txt") == "after"  # the call after the interrupted one ran
    results = [(e.payload["tool"], e.payload["is_error"]) for e in ws.events(job, kinds=["tool_result"])]
    assert results == [("Read", False), ("Edit", False), ("slow_append", True), ("Write", False),
                       ("transition", False)]
    assert _results(ws, job, "slow_append")[0]["content"].startswith(INTERRUPTED.format("slow_append"))
    assert _results(ws, job, "Read")[0]["content"].startswith("alpha gamma")
    # each call recorded once, in the response's order
    assert [e.payload["tool"] for e in ws.events(job, kinds=["tool_call"])] == [
        "Read", "Edit", "slow_append", "Write", "transition"]
    (mv,) = ws.movements(job)
    assert (mv["status"], mv["next_step"], mv["summary"]) == ("done", "COMPLETE", "did everything")


def test_a_read_only_tool_is_simply_run_again(ws: Workspace, tmp_path: Path, server: OpenAIServer) -> None:
    server.play(
        reply(None, [("slow_look", {})]),
        reply(None, [("transition", {"next_step": "COMPLETE", "summary": "looked"})]),
    )
    job = _crash_then_resume(ws, server, tmp_path, _submit(ws, tmp_path))
    assert job.status == "succeeded", job.error
    assert _file(ws, job, "looks.txt") == _killed_effect("look\nlook\n", "look\n")  # started, killed, run again
    (result,) = _results(ws, job, "slow_look")
    assert (result["is_error"], result["content"]) == (False, "nothing changed")
    assert len(server.received) == 2
    assert server.received[1].body["messages"][3]["content"] == "nothing changed"


@pytest.mark.needs("bwrap")
def test_a_bash_append_killed_mid_command_happens_once(ws: Workspace, tmp_path: Path,
                                                       server: OpenAIServer) -> None:
    server.play(
        reply(None, [("Bash", {"command": "echo one >> output/log.txt; touch ready; sleep 60"})]),
        reply(None, [("transition", {"next_step": "COMPLETE", "summary": "ok"})]),
    )
    job = _crash_then_resume(ws, server, tmp_path, _submit(ws, tmp_path), what="the Bash command's effect")
    assert job.status == "succeeded", job.error
    assert _file(ws, job, "output/log.txt") == _killed_effect("one\n", None)
    (result,) = _results(ws, job, "Bash")
    assert result["is_error"] and result["content"].startswith(INTERRUPTED.format("Bash"))
    assert server.received[1].body["messages"][3]["content"] == result["content"]


def test_killed_while_the_model_is_asked_the_finished_edit_stays_done(ws: Workspace, tmp_path: Path,
                                                                       server: OpenAIServer) -> None:
    server.play(
        reply(None, [("Edit", {"path": "input/a.txt", "old": "alpha", "new": "beta"})]),
        stall(60),  # the second LLM call hangs; the worker is killed meanwhile
        reply(None, [("transition", {"next_step": "COMPLETE", "summary": "edited"})]),
    )
    job = _crash_then_resume(ws, server, tmp_path, _submit(ws, tmp_path),
                             ready=lambda: len(server.received) >= 2, what="the second LLM call")
    assert job.status == "succeeded", job.error
    assert _file(ws, job, "input/a.txt") == "beta gamma\n"
    (result,) = _results(ws, job, "Edit")
    assert not result["is_error"]
    assert len(server.received) == 3
    # the call the crash cut short is asked again with the same conversation: nothing redone, nothing lost
    assert server.received[2].body["messages"] == server.received[1].body["messages"]


# -- in one process: an interrupt (Ctrl-C) in the middle of a tool leaves the store as a kill would -----------


@pytest.fixture
def stop_once() -> Iterator[dict[str, int]]:
    state = {"left": 1, "runs": 0}

    @agentnb.tool(name="stop_once")
    def stop_once_tool() -> str:
        """Interrupted the first time it runs."""
        state["runs"] += 1
        if state["left"]:
            state["left"] -= 1
            raise KeyboardInterrupt
        return "ran"

    yield state
    agentnb.tools.base.unregister("stop_once")


def test_a_completed_response_keeps_its_tool_messages_together_and_images_after_them(
        ws: Workspace, tmp_path: Path, server: OpenAIServer, stop_once: dict[str, int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    piece = write_piece(tmp_path, "piece", PIECE.replace("slow_look]", "slow_look, ReadImage, stop_once]"))
    server.play(
        reply(None, [("ReadImage", {"path": "input/dot.png"}), ("stop_once", {}), ("Read", {"path": "input/a.txt"})]),
        reply(None, [("transition", {"next_step": "COMPLETE", "summary": "ok"})]),
    )
    job = ws.submit("Look.", piece=piece, model="openai:m", inputs={"dot.png": b"\x89PNG\r\n\x1a\n", "a.txt": "a\n"})
    with pytest.raises(KeyboardInterrupt):
        ws.run(job)
    job = Workspace(ws.root).run(job.id)  # nothing kept in memory
    assert job.status == "succeeded", job.error
    assert stop_once["runs"] == 1
    sent = server.received[1].body["messages"]
    # an endpoint wants every tool message right after the assistant's calls; the image comes after them
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool", "tool", "tool", "user"]
    assert sent[4]["content"].startswith(INTERRUPTED.format("stop_once"))
    assert sent[5]["content"].startswith("a")
    assert sent[6]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")


def test_a_completed_response_still_counts_against_max_iterations(ws: Workspace, tmp_path: Path,
                                                                  server: OpenAIServer, stop_once: dict[str, int],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    piece = write_piece(tmp_path, "piece", PIECE.replace("slow_look]", "slow_look, stop_once]")
                        .replace("max_iterations: 10", "max_iterations: 1"))
    server.play(reply(None, [("stop_once", {})]))
    job = ws.submit("Once.", piece=piece, model="openai:m")
    with pytest.raises(KeyboardInterrupt):
        ws.run(job)
    job = ws.run(job)
    assert job.status == "aborted"  # forced: the only call allowed was used, and no default_next
    (mv,) = ws.movements(job)
    assert mv["forced"] and "max_iterations (1)" in mv["summary"]
    assert len(server.received) == 1


EDIT_IN_A_PROCESS = textwrap.dedent('''
    import sys
    from pathlib import Path
    from agentnb.tools.base import ToolContext, get_tool

    root = Path(sys.argv[1])
    args = ({"old": "OLD", "new": "NEW"} if sys.argv[2] == "Edit" else {"content": "NEW" + "y" * 50_000_000})
    out = get_tool(sys.argv[2]).invoke(ToolContext(workdir=root, logs_dir=root / "logs"), {"path": "big.txt", **args})
    print(out.content)
''')


@pytest.mark.parametrize("tool", ["Edit", "Write"])
def test_a_worker_killed_while_edit_or_write_writes_leaves_the_file_whole(tmp_path: Path, tool: str) -> None:
    # Writing in place emptied the file first: a SIGKILL mid-write left an edited file empty or cut short.
    root = tmp_path / "wd"
    root.mkdir()
    big = root / "big.txt"
    old = "OLD" + "x" * 50_000_000
    big.write_text(old)
    os.chmod(big, 0o640)
    script = tmp_path / "edit.py"
    script.write_text(EDIT_IN_A_PROCESS, encoding="utf-8")
    src = str(Path(agentnb.__file__).resolve().parents[1])
    proc = subprocess.Popen([sys.executable, str(script), str(root), tool], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])})
    deadline = time.monotonic() + 60
    try:
        # kill once the write has begun: the file in place changed, or the new file beside it appeared
        while big.stat().st_size == len(old) and not list(root.glob(".agentnb-*.tmp")):
            assert proc.poll() is None, f"the {tool} ended before the test could kill it: {proc.communicate()}"
            assert time.monotonic() < deadline, "the write never began"
            time.sleep(0.0005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    text = big.read_text()
    assert text in (old, "NEW" + old[3:], "NEW" + "y" * 50_000_000), (len(text), text[:10])
    assert stat.S_IMODE(big.stat().st_mode) == 0o640  # a finished write keeps the file's permissions
