"""Stepping: one LLM call or one movement at a time, resumable from the SQLite file across restarts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, say, transition, write_piece, write_script
from openai_server import OpenAIServer, reply

import agentnb
from agentnb import Workspace
from agentnb.store.sqlite import StoreError

PIECE = """
name: steps
movements:
  - name: gather
    persona: You gather.
    instruction: Gather facts.
    tools: [Read, Glob, Write, pause_here]
    permission: edit
    rules:
      - {condition: gathered, next: report}
  - name: report
    persona: You report.
    instruction: Report.
    tools: [Read]
    rules:
      - {condition: reported, next: COMPLETE}
"""
SCRIPT = {"responses": [
    call("Glob", pattern="input/*"),
    call("Read", path="input/a.txt"),
    say("Let me think."),
    call("Write", path="output/facts.txt", content="a is one"),
    transition("report", "gathered", lessons="a is one"),
    call("Read", path="output/facts.txt"),
    transition("COMPLETE", "reported"),
]}


_PAUSE: dict[str, Any] = {}


@pytest.fixture(autouse=True)
def pause_tool():
    @agentnb.tool
    def pause_here() -> str:
        """Ask the workspace to pause this job, as a notebook's stop button would."""
        _PAUSE["ws"].stop(_PAUSE["job"])
        return "pausing"

    yield
    agentnb.tools.base.unregister("pause_here")
    _PAUSE.clear()


@pytest.fixture
def setup(ws: Workspace, tmp_path: Path) -> tuple[Path, str]:
    return write_piece(tmp_path, "piece", PIECE), write_script(tmp_path, "script", **SCRIPT)


def _submit(ws: Workspace, setup: tuple[Path, str]):
    piece, model = setup
    return ws.submit("collect", piece=piece, model=model, inputs={"a.txt": "one\n"})


def _shape(ws: Workspace, job) -> list[tuple[Any, ...]]:
    """Every non-status event with its payload, minus what depends on the clock or the job id."""
    out = []
    for e in ws.events(job):
        if e.kind == "job_status":
            continue
        payload = dict(e.payload)
        payload.pop("latency_s", None)  # the model's answer time
        if e.kind == "movement_start":
            payload["user"] = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d \(\w+, [^)]*\)", "<now>", payload["user"])
        out.append((e.kind, e.movement_seq, e.iteration, json.dumps(payload, sort_keys=True)))
    return out


def test_step_call_runs_exactly_one_llm_call(ws: Workspace, setup) -> None:
    job = _submit(ws, setup)
    for n in range(1, 4):
        job = ws.step(job, unit="call")
        assert job.status == "queued"
        assert len(ws.events(job, kinds=["llm_request"])) == n
        assert len(ws.events(job, kinds=["llm_response"])) == n
    # the third call had no tool call: its reminder is recorded before the step returns
    assert ws.events(job, kinds=["reminder"])[0].iteration == 3
    assert ws.movements(job)[0]["status"] == "running"
    assert job.current_movement == "gather"


def test_step_runs_one_movement(ws: Workspace, setup) -> None:
    job = _submit(ws, setup)
    job = ws.step(job)
    assert job.status == "queued"
    assert [(m["name"], m["status"], m["iterations"]) for m in ws.movements(job)] == [("gather", "done", 5)]
    assert job.current_movement == "report"
    job = ws.step(job, unit="call")  # starts report and makes its first call
    job = ws.step(job)  # the rest of report
    assert job.status == "succeeded"
    assert [m["name"] for m in ws.movements(job)] == ["gather", "report"]
    assert ws.step(job).status == "succeeded"  # stepping an ended job does nothing
    assert len(ws.events(job, kinds=["llm_response"])) == 7


@pytest.mark.parametrize("unit", ["call", "movement"])
def test_stepping_to_the_end_gives_the_same_events_as_run(ws: Workspace, setup, unit: str) -> None:
    ran = ws.run(_submit(ws, setup))
    stepped = _submit(ws, setup)
    steps = 0
    while stepped.status == "queued":
        stepped = ws.step(stepped, unit=unit)
        steps += 1
    assert ran.status == stepped.status == "succeeded"
    assert steps == (7 if unit == "call" else 2)
    assert _shape(ws, stepped) == _shape(ws, ran)
    # and the status events say it was paused between steps
    reasons = [e.payload["reason"] for e in ws.events(stepped, kinds=["job_status"])]
    assert reasons.count(f"paused after one {unit}") == steps - 1


def test_demo_stepped_call_by_call_equals_demo_run(ws: Workspace) -> None:
    inputs = {"notes.md": "alpha\nbeta\n"}
    ran = ws.run(ws.submit("Summarise", piece="plan-implement-verify", model="demo", inputs=inputs))
    stepped = ws.submit("Summarise", piece="plan-implement-verify", model="demo", inputs=inputs)
    for _ in ws.iter(stepped, unit="call"):
        pass
    assert ws.job(stepped).status == ran.status == "succeeded"
    assert _shape(ws, stepped) == _shape(ws, ran)


def test_a_new_workspace_object_continues_mid_movement(ws: Workspace, setup) -> None:
    ran = ws.run(_submit(ws, setup))
    job = _submit(ws, setup)
    ws.step(job, unit="call")
    ws.step(job, unit="call")
    # a "restart": a fresh Workspace on the same folder knows only the SQLite file
    for _ in range(20):
        fresh = Workspace(ws.root)
        job = fresh.step(job.id, unit="call")
        if job.status != "queued":
            break
    assert job.status == "succeeded"
    assert _shape(ws, job) == _shape(ws, ran)
    # and the first object, whose cached runner is now stale, still reads the right state
    assert ws.job(job.id).status == "succeeded"


def test_a_new_process_continues_from_the_sqlite_file(ws: Workspace, setup) -> None:
    # the other process has only the built-in tools, so the piece uses only those
    piece, model = setup
    setup = (write_piece(piece.parent, "builtin", PIECE.replace(", pause_here", "")), model)
    ran = ws.run(_submit(ws, setup))
    job = ws.step(_submit(ws, setup), unit="call")
    code = textwrap.dedent(f"""
        import sys
        from agentnb import Workspace
        ws = Workspace({str(ws.root)!r})
        job = ws.step({job.id}, unit="call")
        job = ws.step(job, unit="call")
        print(job.status, len(ws.events(job, kinds=["llm_response"])))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["queued", "3"]
    # this process's cached runner is behind the file: it must rebuild, not replay its old state
    job = ws.step(job, unit="call")
    assert len(ws.events(job, kinds=["llm_response"])) == 4
    job = ws.run(job)
    assert job.status == "succeeded"
    assert _shape(ws, job) == _shape(ws, ran)


def test_resumed_movement_sends_the_same_messages(ws: Workspace, tmp_path: Path, loopback: Callable[..., OpenAIServer]) -> None:
    """Through a real endpoint: the requests after a restart equal those of an uninterrupted run."""
    piece = write_piece(tmp_path, "piece", PIECE)
    actions = [
        reply("Looking.", [("Glob", {"pattern": "input/*"})]),
        reply(None, [("Read", {"path": "input/a.txt"})]),
        reply("Hmm."),
        reply(None, [("transition", {"next_step": "report", "summary": "s", "lessons": "l"})]),
        reply(None, [("transition", {"next_step": "COMPLETE", "summary": "r"})]),
    ]
    bodies: list[list[dict[str, Any]]] = []
    for restart in (False, True):
        srv = loopback("sk-x")
        srv.play(*actions)
        job = ws.submit("collect", piece=piece, model="openai:m", inputs={"a.txt": "one\n"})
        if restart:
            while job.status == "queued":
                job = Workspace(ws.root).step(job.id, unit="call")
        else:
            job = ws.run(job)
        assert job.status == "succeeded", job.error
        bodies.append([r.body for r in srv.received])
    normal = [json.dumps(b, sort_keys=True) for b in bodies[0]]
    restarted = [json.dumps(b, sort_keys=True) for b in bodies[1]]

    def clean(s: str) -> str:
        return re.sub(r"call_\d+_\d+", "call_N", re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d \(\w+, [^)]*\)", "<now>", s))

    assert [clean(s) for s in restarted] == [clean(s) for s in normal]
    assert len(bodies[1][2]["messages"]) == 6  # the third call re-sent the whole movement so far


def test_stop_pauses_a_running_job(ws: Workspace, setup) -> None:
    piece, _ = setup
    model = write_script(Path(piece).parent, "stop", responses=[
        call("Glob", pattern="*"), call("pause_here"), call("Read", path="input/a.txt"),
        transition("report", "g"), transition("COMPLETE", "r"),
    ])
    job = ws.submit("collect", piece=piece, model=model, inputs={"a.txt": "one\n"})
    _PAUSE.update(ws=ws, job=job)
    job = ws.run(job)
    assert job.status == "queued"  # paused right after the call whose tool asked for it
    assert len(ws.events(job, kinds=["llm_response"])) == 2
    assert ws.events(job, kinds=["job_status"])[-1].payload["status"] == "queued"
    job = ws.run(job)  # and it goes on from where it stopped
    assert job.status == "succeeded"
    assert len(ws.events(job, kinds=["llm_response"])) == 5


def test_a_job_running_elsewhere_cannot_be_stepped(ws: Workspace, setup) -> None:
    job = _submit(ws, setup)
    assert ws.store.claim(job.id, owner="another-worker") is not None
    with pytest.raises(StoreError, match=r"already running .*another-worker"):
        ws.step(job)
    with pytest.raises(ValueError, match="unit='line'; allowed: 'movement', 'call'"):
        ws.step(job, unit="line")


def test_a_job_whose_process_died_is_recovered_and_resumed(ws: Workspace, tmp_path: Path) -> None:
    """A process killed mid-movement leaves the job `running`; the next claim on this host takes it over."""
    piece = write_piece(tmp_path, "die", PIECE.replace("pause_here", "die_now"))
    model = write_script(tmp_path, "die_script", responses=[
        call("Glob", pattern="input/*"), call("die_now"), call("die_now"), transition("report", "g"),
        transition("COMPLETE", "r"),
    ])
    agentnb.tool(name="die_now")(lambda: "only the other process really dies")  # known here at submit …
    try:
        job = ws.submit("collect", piece=piece, model=model, inputs={"a.txt": "one\n"})
    finally:
        agentnb.tools.base.unregister("die_now")  # … and gone when this process resumes the job
    code = textwrap.dedent(f"""
        import os
        import agentnb
        @agentnb.tool
        def die_now() -> str:
            '''Kill this process, like a crash.'''
            os._exit(3)
        agentnb.Workspace({str(ws.root)!r}).run({job.id})
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    assert ws.job(job).status == "running"
    job = ws.run(job)
    assert job.status == "succeeded", job.error
    reasons = [e.payload["reason"] for e in ws.events(job, kinds=["job_status"])]
    assert any(r.startswith("recovered: the process that ran it") and "is gone" for r in reasons)
    died = [e.payload for e in ws.events(job, kinds=["tool_result"]) if e.payload["tool"] == "die_now"]
    # the call the process died in is not run again (it may have had effects): the model is told so …
    assert died[0]["is_error"] and died[0]["content"].startswith("Error: this call of die_now was interrupted")
    # … and when it asks again, that the tool exists only in the dead process
    assert died[1]["is_error"] and "not defined in this Python process" in died[1]["content"]
    assert len(died) == 2
    assert [m["status"] for m in ws.movements(job)] == ["done", "done"]


def test_a_job_run_by_a_live_process_is_not_taken_over(ws: Workspace, setup) -> None:
    job = _submit(ws, setup)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ws.store.claim(job.id, owner=f"{__import__('socket').gethostname()}:{live.pid}:abc")
        with pytest.raises(StoreError, match="already running"):
            ws.run(job)
    finally:
        live.kill()
        live.wait()
    assert ws.run(job).status == "succeeded"  # once that process is gone, the job is recovered


def test_an_interrupted_run_leaves_the_job_resumable(ws: Workspace, tmp_path: Path) -> None:
    """Ctrl-C (a notebook's interrupt) in the middle of a call: the job is queued again, not stuck running."""
    interrupts = {"left": 1}

    @agentnb.tool(name="die_now")
    def die_now() -> str:
        """Interrupted once, then fine."""
        if interrupts["left"]:
            interrupts["left"] -= 1
            raise KeyboardInterrupt
        return "fine now"

    try:
        piece = write_piece(tmp_path, "int", PIECE.replace("pause_here", "die_now"))
        model = write_script(tmp_path, "int_script", responses=[
            call("Glob", pattern="input/*"), call("die_now"), transition("report", "g"), transition("COMPLETE", "r"),
        ])
        job = ws.submit("collect", piece=piece, model=model)
        with pytest.raises(KeyboardInterrupt):
            ws.run(job)
        assert ws.job(job).status == "queued"
        assert ws.events(job, kinds=["job_status"])[-1].payload["reason"] == "interrupted"
        job = ws.run(job)
        assert job.status == "succeeded", job.error
        results = [e.payload["content"] for e in ws.events(job, kinds=["tool_result"]) if e.payload["tool"] == "die_now"]
        # the interrupted call had started (its effect is unknown): it is not run again, the model is told
        assert len(results) == 1 and results[0].startswith("Error: this call of die_now was interrupted")
        assert interrupts["left"] == 0
        # every assistant message with tool calls is followed by their results (a valid conversation)
        responses = ws.events(job, kinds=["llm_response"])
        assert [r.iteration for r in responses if r.movement_seq == 1] == [1, 2, 3]
    finally:
        agentnb.tools.base.unregister("die_now")
