"""The worker and the enriched instruction, checked on the prompts recorded in ``movement_start``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from unittest import mock

import pytest
from _scripting import call, transition, write_piece, write_script
from openai_server import OpenAIServer, reply, stall

from agentnb import Workspace
from agentnb.store.base import STOP_CUT_REASON

TWO_STEPS = """
name: two-steps
movements:
  - name: first
    instruction: Look around.
    tools: [Read, Glob, Write]
    permission: edit
    rules:
      - {condition: seen, next: second}
  - name: second
    instruction: Finish.
    tools: [Read]
    rules:
      - {condition: done, next: COMPLETE}
"""


def _starts(ws: Workspace, job) -> list[dict]:
    return [e.payload for e in ws.events(job, kinds=["movement_start"])]


def test_enriched_instruction_blocks(ws: Workspace, tmp_path: Path) -> None:
    piece = write_piece(tmp_path, "piece", TWO_STEPS)
    model = write_script(tmp_path, "script", responses=[
        call("Read", path="input/notes.md"),
        call("Write", path="output/draft.txt", content="draft!"),
        transition("second", "looked", lessons="notes are short"),
        transition("COMPLETE", "finished"),
    ])
    job = ws.submit("Summarise the notes, please.", piece=piece, model=model,
                    inputs={"notes.md": "SECRET-CONTENT-1234\n" * 10, "sub/data.csv": "a,b\n1,2\n"})
    bodies = [f"comment {n} " + ("x" * (600 if n == 6 else 20)) for n in range(1, 8)]
    for body in bodies:
        ws.reply(job, body)  # a queued job just gets the comment
    before = datetime.now().astimezone()
    job = ws.run(job)
    assert job.status == "succeeded", job.error
    first, second = _starts(ws, job)
    user = first["user"]

    # the date-time block, first
    assert user.startswith("## Current date and time\n")
    stamp = re.search(r"^(\d{4}-\d\d-\d\d \d\d:\d\d) \(", user, re.M)
    assert stamp is not None
    assert abs(datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M") - before.replace(tzinfo=None, second=0,
               microsecond=0)).total_seconds() <= 120

    # only the last five comments, each cut to 500 characters with a visible marker
    assert "(last 5 of 7 comments)" in user
    assert "comment 1 " not in user and "comment 2 " not in user
    for n in (3, 4, 5, 7):
        assert bodies[n - 1] in user
    long = bodies[5]
    assert long[:500] in user
    assert long[:501] not in user
    assert "… [cut: 500 of 610 characters shown]" in user

    # names and sizes of input/ and output/, never the contents
    assert "input/\n  - notes.md (200 bytes)\n  - sub/data.csv (8 bytes)" in user
    assert "output/\n  (empty)" in user
    assert "SECRET-CONTENT" not in user

    # the task, then the movement's own instruction
    assert "## Task\nSummarise the notes, please." in user
    assert user.index("## Task") < user.index("## Current step: first") < user.index("Look around.")

    # the second movement: same enriched opening (one activation), none of the first movement's conversation
    user2 = second["user"]
    assert user2.split("## Current step")[0].startswith(user.split("## Lessons")[0].split("## Current step")[0])
    assert "SECRET-CONTENT" not in user2  # the Read result stayed in the first movement
    assert "draft!" not in user2
    assert "lessons.jsonl" not in user2 and "logs/" not in user2
    assert "## Lessons from previous steps\n- [first] notes are short" in user2


def test_enriched_instruction_is_rebuilt_after_a_reply(ws: Workspace, tmp_path: Path) -> None:
    """A reply re-activates the job: the new opening lists the new comment and the new output files."""
    model = write_script(tmp_path, "script", responses=[
        call("Write", path="output/answer.md", content="42"),
        transition("ASK", "asked", question="Short or long?"),
        transition("COMPLETE", "finished"),
    ])
    job = ws.submit("task", piece="single", model=model)
    job = ws.run(job)
    assert job.status == "waiting_human"
    job = ws.reply(job, "Short, please.")
    job = ws.run(job)
    assert job.status == "succeeded", job.error
    first, second = _starts(ws, job)
    assert "Short, please." not in first["user"] and "Conversation so far" not in first["user"]
    assert "(last 2 of 2 comments)" in second["user"]
    assert "Short or long?" in second["user"] and "Short, please." in second["user"]
    assert "output/\n  - answer.md (2 bytes)" in second["user"]


def test_japanese_headings(ws: Workspace, tmp_path: Path) -> None:
    piece = write_piece(tmp_path, "piece", TWO_STEPS.replace("name: two-steps", "name: two-steps\nlanguage: ja"))
    model = write_script(tmp_path, "script", responses=[
        transition("second", "見た", lessons="メモは短い"), transition("COMPLETE", "完了"),
    ])
    job = ws.run(ws.submit("要約して", piece=piece, model=model))
    assert job.status == "succeeded", job.error
    user2 = _starts(ws, job)[1]["user"]
    for heading in ("## 現在日時", "## ワークスペースの状況", "## タスク\n要約して", "## 前のステップで得た教訓\n- [first] メモは短い"):
        assert heading in user2
    assert "## Lessons from previous steps" not in user2


def test_worker_runs_every_queued_job(ws: Workspace, tmp_path: Path) -> None:
    model = write_script(tmp_path, "script", responses=[transition("COMPLETE", "ok")])
    jobs = [ws.submit(f"task {n}", piece="single", model=model) for n in range(3)]
    assert ws.worker().run() == 3
    assert [ws.job(j).status for j in jobs] == ["succeeded"] * 3
    assert ws.worker().run() == 0  # nothing left


def test_a_worker_keeps_no_runner_of_an_ended_job_but_a_paused_one_goes_on(ws: Workspace, tmp_path: Path) -> None:
    # a long-lived worker (or a batch) must not hold every job it ran in memory: an ended job is claimed again
    # only by a retry, which starts from the store
    import gc

    from agentnb.engine.runner import JobRunner

    def runners() -> int:
        gc.collect()
        return sum(isinstance(o, JobRunner) for o in gc.get_objects())

    model = write_script(tmp_path, "script", responses=[call("Glob", pattern="*"), transition("COMPLETE", "ok")])
    held = runners()
    jobs = [ws.submit(f"task {n}", piece="single", model=model) for n in range(5)]
    assert ws.worker().run() == 5
    assert [ws.job(j).status for j in jobs] == ["succeeded"] * 5
    assert runners() == held
    # a job paused between calls keeps its runner for its next step, and ends as a whole run does
    paused = ws.submit("paused", piece="single", model=model)
    assert ws.step(paused, "call").status == "queued"
    assert runners() == held + 1
    assert ws.run(paused).status == "succeeded"
    assert runners() == held
    assert [e.kind for e in ws.events(paused, kinds=["llm_request", "transition"])] == [
        "llm_request", "llm_request", "transition"]


@pytest.mark.sqlite_only("submit(workdir=) is refused on PostgreSQL (files live in the store)")
def test_the_listing_leaves_out_what_leads_outside_the_work_directory(ws: Workspace, tmp_path: Path) -> None:
    import os

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "outside-name.txt").write_text("x", encoding="utf-8")
    project = tmp_path / "project"
    (project / "output").mkdir(parents=True)
    os.symlink(outside, project / "input")  # the whole input/ leads out
    os.symlink(outside / "outside-name.txt", project / "output" / "linked.txt")
    (project / "output" / "own.txt").write_text("mine", encoding="utf-8")
    os.symlink("own.txt", project / "output" / "again.txt")  # a link that stays inside is listed, its target's size
    os.symlink("nowhere.txt", project / "output" / "dangling.txt")
    os.symlink(outside, project / "output" / "folder")  # a linked folder is not entered
    spec = write_script(tmp_path, "script", responses=[transition("second"), transition("COMPLETE")])
    job = ws.run(ws.submit("Look", piece=write_piece(tmp_path, "piece", TWO_STEPS), model=spec, workdir=project))
    user = _starts(ws, job)[0]["user"]
    assert "## Workspace files\ninput/\n  (empty)\noutput/\n  - again.txt (4 bytes)\n  - own.txt (4 bytes)\n" in user
    assert "outside-name" not in user and "linked.txt" not in user


def _stalled_worker(tmp_path: Path, command: list[str]) -> tuple[Workspace, int, subprocess.Popen[str], OpenAIServer]:
    """A worker process blocked in an LLM call of a queued job (the loopback server does not answer yet)."""
    server = OpenAIServer().__enter__()
    server.play(stall(120))
    ws = Workspace(tmp_path / "ws")
    with mock.patch.dict(os.environ, {"OPENAI_API_KEY": "test-key"}):  # refused at submit without a key
        job = ws.submit("Do it", piece="single", model="openai:test-model")
    # AGENTNB_STORE stays: under AGENTNB_TEST_BACKEND=postgres the subprocess must use the test's database
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AGENTNB_", "OPENAI_")) or k == "AGENTNB_STORE"}
    env.update(OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY="test-key", AGENTNB_OPENAI_TIMEOUT="300")
    proc = subprocess.Popen([sys.executable, *command, str(ws.root)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not server.received:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    assert ws.job(job.id).status == "running"
    return ws, job.id, proc, server


@pytest.mark.parametrize("command", [
    ["-m", "agentnb.cli", "worker", "--workspace"],
    ["-c", "import sys; from agentnb import Workspace; Workspace(sys.argv[1]).worker().run()"],
], ids=["agentnb worker", "Worker.run"])
def test_sigterm_gives_the_running_job_back_to_the_queue(tmp_path: Path, command: list[str]) -> None:
    ws, job_id, proc, server = _stalled_worker(tmp_path, command)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, err
        assert "Traceback" not in err, err
        job = ws.job(job_id)
        assert job.status == "queued"
        # the call it was waiting on is recorded as a Stop's (docs/models.md#streaming)
        last = ws.events(job_id, kinds=["job_status"])[-1].payload
        assert last == {"status": "queued", "reason": STOP_CUT_REASON}
        (stopped,) = ws.events(job_id, kinds=["error"])
        assert stopped.where == "interrupted" and "stopped before its answer began" in stopped.message
        # resumable: the interrupted call is made again, here with an answer
        server.play(reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "done"})]))
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OPENAI_BASE_URL", server.base_url)
            mp.setenv("OPENAI_API_KEY", "test-key")
            assert ws.run(job_id).status == "succeeded"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.__exit__(None, None, None)
