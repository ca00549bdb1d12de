"""Retrying a failed or aborted job: ``ws.retry``, ``agentnb retry`` and ``%agent retry``,
and the openai model's retry settings per job and per workspace."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, transition, write_piece, write_script
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
from openai_server import OpenAIServer, error, openai_env, reply

from agentnb import Workspace
from agentnb.store.sqlite import StoreError

PIECE = """
name: retried
max_movements: 4
movements:
  - name: work
    persona: You work.
    instruction: Work.
    tools: [Read, Write]
    permission: edit
    max_iterations: 10
    rules: [{next: review}]
  - name: review
    persona: You review.
    instruction: Review.
    tools: [Read]
    rules: [{next: COMPLETE}]
"""

WRITE = ("Write", {"path": "output/a.txt", "content": "A"})
TO_REVIEW = ("transition", {"next_step": "review", "summary": "wrote it"})
COMPLETE = ("transition", {"next_step": "COMPLETE", "summary": "fine"})


@pytest.fixture
def server(loopback: Callable[..., OpenAIServer]) -> OpenAIServer:
    # retries 6: what the job and workspace settings must win over
    return loopback("sk-test", timeout="5", retries="6")


def _reasons(ws: Workspace, job: Any) -> list[str]:
    return [e.payload["reason"] for e in ws.events(job, kinds=["job_status"])]


# -- ws.retry through a real endpoint ---------------------------------------------------------------------


def test_an_outage_fails_the_job_and_a_retry_goes_on_from_the_last_complete_call(
        ws: Workspace, tmp_path: Path, server: OpenAIServer) -> None:
    server.play(reply(None, [WRITE]), error(503, "down for maintenance", times=3))
    job = ws.submit("task", piece=write_piece(tmp_path, "piece", PIECE), model="openai:m", retries=2)
    job = ws.run(job)
    assert job.status == "failed"
    assert job.error == "openai:m: gave up after 3 tries; last error HTTP 503: down for maintenance"
    assert len(server.received) == 4  # one good call, then the job's own 2 retries (not the environment's 6)

    server.play(reply(None, [TO_REVIEW]), reply(None, [COMPLETE]))  # the endpoint is back
    job = ws.retry(job)
    assert (job.status, job.error, job.ended) == ("queued", None, None)
    assert _reasons(ws, job)[-1] == "retried"
    assert ws.movements(job)[0]["status"] == "running"  # the failed movement is open again
    job = ws.run(job)
    assert job.status == "succeeded", job.error
    assert len(server.received) == 6  # the failed call once more, then the review: no completed call repeated
    assert [r.body["messages"][-1]["role"] for r in server.received[4:]] == ["tool", "user"]
    resumed = server.received[4].body["messages"]
    assert [m["role"] for m in resumed] == ["system", "user", "assistant", "tool"]  # the Write's result, kept
    assert resumed == server.received[1].body["messages"]
    assert len(ws.events(job, kinds=["tool_call"])) == 3  # Write once, two transitions
    assert [(m["seq"], m["name"], m["status"], m["next_step"]) for m in ws.movements(job)] == [
        (1, "work", "done", "review"), (2, "review", "done", "COMPLETE")]
    assert (Path(job.workdir) / "output" / "a.txt").read_text() == "A"


def test_retry_can_change_the_jobs_retry_settings(ws: Workspace, tmp_path: Path, server: OpenAIServer) -> None:
    server.play(error(500, "boom", times=2))
    job = ws.run(ws.submit("task", piece=write_piece(tmp_path, "piece", PIECE), model="openai:m", retries=1))
    assert job.status == "failed" and len(server.received) == 2
    server.play(error(500, "boom", times=3), reply(None, [TO_REVIEW]), reply(None, [COMPLETE]))
    job = ws.run(ws.retry(job, retries=3))
    assert job.status == "succeeded", job.error
    assert len(server.received) == 2 + 4 + 1


def test_the_workspace_setting_applies_unless_the_job_has_its_own(tmp_path: Path, server: OpenAIServer) -> None:
    ws = Workspace(tmp_path / "ws", retries=1)
    piece = write_piece(tmp_path, "piece", PIECE)
    server.play(error(500, "boom", times=2))
    assert ws.run(ws.submit("task", piece=piece, model="openai:m")).status == "failed"
    assert len(server.received) == 2  # the workspace's 1 retry, not the environment's 6
    server.play(error(500, "boom"))
    assert ws.run(ws.submit("task", piece=piece, model="openai:m", retries=0)).status == "failed"
    assert len(server.received) == 3  # the job's 0


def test_max_backoff_caps_every_wait(tmp_path: Path, server: OpenAIServer, monkeypatch: pytest.MonkeyPatch) -> None:
    import agentnb.models.openai as oa

    waits: list[float] = []
    monkeypatch.setattr(oa, "pause", lambda delay, cancel: waits.append(delay) or False)  # recorded, not waited
    monkeypatch.setenv("AGENTNB_OPENAI_BACKOFF", "1000")  # uncapped, the waits would be ≥ 500 s
    piece = write_piece(tmp_path, "piece", PIECE)
    ws = Workspace(tmp_path / "ws", max_backoff=2.5)
    server.play(error(503, "busy", headers={"Retry-After": "3600"}), error(500, "boom", times=2))
    assert ws.run(ws.submit("task", piece=piece, model="openai:m", retries=2)).status == "failed"
    assert waits == [2.5, 2.5]  # the server's hour too
    server.play(error(500, "boom", times=3))
    assert ws.run(ws.submit("task", piece=piece, model="openai:m", retries=2, max_backoff=0.25)).status == "failed"
    assert waits[2:] == [0.25, 0.25]
    monkeypatch.setenv("AGENTNB_OPENAI_MAX_BACKOFF", "0.5")  # the fallback when neither sets it
    server.play(error(500, "boom", times=2))
    assert Workspace(tmp_path / "ws").run(ws.submit("task", piece=piece, model="openai:m", retries=1)).status == "failed"
    assert waits[4:] == [0.5]


# -- without an endpoint ----------------------------------------------------------------------------------


def test_a_failed_job_resumes_its_movement_even_in_a_workspace_that_ran_it(ws: Workspace, tmp_path: Path) -> None:
    spec = write_script(tmp_path, "s", responses=[call("Write", path="output/a.txt", content="A")])
    job = ws.run(ws.submit("task", piece=write_piece(tmp_path, "piece", PIECE), model=spec))
    assert job.status == "failed" and "ran out of responses" in job.error
    write_script(tmp_path, "s", responses=[call("Write", path="output/a.txt", content="A"), transition("review"),
                                           transition("COMPLETE")])
    Workspace(ws.root).retry(job.id)  # another process; `ws` still holds the runner it failed with
    job = ws.run(job)
    assert job.status == "succeeded", job.error
    assert [m["name"] for m in ws.movements(job)] == ["work", "review"]  # resumed, not a new run of work
    assert len(ws.events(job, kinds=["tool_call"])) == 3


def test_an_aborted_job_starts_the_movement_that_aborted_again(ws: Workspace, tmp_path: Path) -> None:
    spec = write_script(tmp_path, "script", responses=[
        transition("ABORT", "the input is missing"), transition("review", "found it"), transition("COMPLETE")])
    job = ws.run(ws.submit("task", piece=write_piece(tmp_path, "piece", PIECE), model=spec))
    assert job.status == "aborted"
    job = ws.run(ws.retry(job))
    assert job.status == "succeeded", job.error
    assert [(m["seq"], m["name"], m["next_step"]) for m in ws.movements(job)] == [
        (1, "work", "ABORT"), (2, "work", "review"), (3, "review", "COMPLETE")]
    assert _reasons(ws, job).count("retried") == 1


@pytest.mark.parametrize("status", ["queued", "succeeded", "waiting_human"])
def test_other_states_are_refused_naming_the_status(ws: Workspace, tmp_path: Path, status: str) -> None:
    job = ws.submit("task", piece="single", model="demo")
    if status != "queued":
        with ws.store.transaction() as c:
            ws.store.set_status(c, job.id, status, reason="test")
    before = ws.events(job)
    with pytest.raises(StoreError) as info:
        ws.retry(job)
    assert str(info.value) == f"job {job.id} is {status}; only a failed or aborted job can be retried"
    assert ws.events(job) == before and ws.job(job).status == status


def test_a_running_job_is_refused(ws: Workspace) -> None:
    job = ws.submit("task", piece="single", model="demo")
    ws.store.claim(job.id, owner="elsewhere")
    with pytest.raises(StoreError, match=f"^job {job.id} is running; only a failed or aborted job can be retried$"):
        ws.retry(job)
    with pytest.raises(StoreError, match=r"^no job 99 in "):
        ws.retry(99)


@pytest.mark.parametrize("kwargs, message", [
    ({"retries": -1}, "retries=-1; allowed: a whole number from 0 to 100 (the tries after the first)"),
    ({"retries": "3"}, "retries='3'; allowed: a whole number from 0 to 100"),
    ({"retries": True}, "retries=True; allowed"),
    ({"retries": 101}, "retries=101; allowed"),
    ({"max_backoff": -1}, "max_backoff=-1; allowed: a number of seconds ≥ 0 (the longest wait between two tries)"),
    ({"max_backoff": float("nan")}, "max_backoff=nan; allowed"),
    ({"max_backoff": "1s"}, "max_backoff='1s'; allowed"),
])
def test_bad_retry_settings_are_refused_before_anything_is_stored(ws: Workspace, tmp_path: Path,
                                                                 kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        ws.submit("task", piece="single", model="demo", **kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert ws.jobs() == []
    with pytest.raises(ValueError, match="^" + message.split(";")[0].replace("(", r"\(").replace(")", r"\)")):
        Workspace(tmp_path / "other", **kwargs)


# -- the command line, through the real entry point -------------------------------------------------------

AGENTNB = shutil.which("agentnb")


@pytest.mark.skipif(AGENTNB is None, reason="the agentnb entry point is not installed")
def test_agentnb_retry(tmp_path: Path, server: OpenAIServer) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTNB_", "OPENAI_"))}
    env.update(openai_env(server))

    def agentnb(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([AGENTNB, "--workspace", str(tmp_path / "ws"), *args], capture_output=True, text=True,
                              timeout=120, env=env, cwd=tmp_path)

    piece = write_piece(tmp_path, "piece", PIECE)
    server.play(reply(None, [WRITE]), error(502, "bad gateway", times=2))
    out = agentnb("run", "--piece", str(piece), "--model", "openai:m", "--retries", "1", "task")
    assert out.returncode == 1, out.stderr
    assert "error: openai:m: gave up after 2 tries; last error HTTP 502: bad gateway" in out.stdout
    assert len(server.received) == 3

    out = agentnb("retry", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("job 1: queued")
    assert "run it with: agentnb retry 1 --run" in out.stdout

    server.play(reply(None, [TO_REVIEW]), reply(None, [COMPLETE]))
    out = agentnb("retry", "1", "--run")  # a queued job is not retried: it is not failed or aborted
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == "agentnb: error: job 1 is queued; only a failed or aborted job can be retried\n"
    out = agentnb("worker")
    assert out.returncode == 0, out.stderr
    out = agentnb("show", "1")
    assert out.stdout.startswith("job 1: succeeded"), out.stdout
    assert len(server.received) == 5  # the failed call, then the review

    out = agentnb("retry", "1")
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == "agentnb: error: job 1 is succeeded; only a failed or aborted job can be retried\n"
    out = agentnb("retry", "1", "--retries", "-2")
    assert out.returncode == 2
    assert out.stderr.startswith("agentnb: error: --retries -2; allowed: a whole number from 0 to 100")
    assert out.stderr.count("\n") == 1


@pytest.mark.skipif(AGENTNB is None, reason="the agentnb entry point is not installed")
def test_agentnb_retry_run(tmp_path: Path, server: OpenAIServer) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTNB_", "OPENAI_"))}
    env.update(openai_env(server, retries="0"))
    piece = write_piece(tmp_path, "piece", PIECE)
    server.play(error(500, "boom"), reply(None, [TO_REVIEW]), reply(None, [COMPLETE]))
    base = [AGENTNB, "--workspace", str(tmp_path / "ws")]
    out = subprocess.run([*base, "run", "--piece", str(piece), "--model", "openai:m", "task"], capture_output=True,
                         text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 1 and "gave up after 1 tries" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([*base, "retry", "1", "--run"], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("job 1: succeeded")
    assert len(server.received) == 3


# -- the magic, through a real IPython shell -----------------------------------------------------------------


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[InteractiveShell]:
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "agentnb")
    sh.run_line_magic("config", f"AgentMagic.workspace = {str(tmp_path / 'ws')!r}")
    yield sh
    for name in [k for k in sh.user_ns if k.startswith("t_")]:
        del sh.user_ns[name]


def test_agent_retry_magic(shell: InteractiveShell, tmp_path: Path) -> None:
    spec = write_script(tmp_path, "s", responses=[call("Write", path="output/a.txt", content="A")])
    script = tmp_path / "s.yaml"
    piece = write_piece(tmp_path, "piece", PIECE)
    with capture_output():
        shell.run_cell(f't_job = %agent run --piece {piece} --model scripted:{script} "task"')
    job = shell.user_ns["t_job"]
    assert job.status == "failed" and spec.endswith(job.model.split(":", 1)[1])
    write_script(tmp_path, "s", responses=[call("Write", path="output/a.txt", content="A"), transition("review"),
                                           transition("COMPLETE")])

    with capture_output():
        shell.run_cell("t_queued = %agent retry t_job")
    assert shell.user_ns["t_queued"].status == "queued"
    with pytest.raises(UsageError) as info:
        shell.run_line_magic("agent", f"retry {job.id}")
    assert str(info.value) == f"%agent retry: job {job.id} is queued; only a failed or aborted job can be retried"
    with capture_output():
        shell.run_cell(f"t_done = %agent run --job {job.id}")
    assert shell.user_ns["t_done"].status == "succeeded"

    # an aborted job, retried and run at once
    spec2 = write_script(tmp_path, "s2", responses=[transition("ABORT", "no"), transition("review"),
                                                    transition("COMPLETE")])
    with capture_output():
        shell.run_cell(f't_ab = %agent run --piece {piece} --model {spec2} "task"')
    assert shell.user_ns["t_ab"].status == "aborted"
    with capture_output():
        shell.run_cell("t_again = %agent retry t_ab --run --retries 2")
    assert shell.user_ns["t_again"].status == "succeeded"
    with pytest.raises(UsageError, match=r"^%agent retry: --max-backoff -1\.0; allowed"):
        shell.run_line_magic("agent", "retry t_again --max-backoff -1")
