"""Forks and replays (docs/fork-compare.md#fork): re-served runs spend nothing, rebuild the work directory and are
checked.

Then jobs unlike those (a review→fix loop with Bash, Glob, Grep, Checklist and Edit; a job forced out by context
pressure and by max_iterations, with a reminder), forked at every run, edited, chained and resumed, compared with
their originals event by event (timestamps and ids aside), token by token and byte by byte; the what-if against a
reference of the default ContextManager rules."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml
from _scripting import call, transition, write_piece, write_script
from conftest import backend_store, require
from openai_server import OpenAIServer, reply

import agentnb
from agentnb import Workspace
from agentnb.errors import AgentnbError, PieceError, UsageError
from agentnb.events import LLMResponse, MovementStart, ReplayDivergence

PIECE = "plan-implement-verify"
REPO = Path(__file__).resolve().parent.parent


def _script(tmp: Path, name: str, version: str, *, usage: bool = False) -> str:
    """Three movements: plan reads, implement writes output/ (``version``), verify reads it and completes."""
    def u(p: int) -> dict[str, Any]:
        return {"usage": {"prompt_tokens": p, "completion_tokens": 7}} if usage else {}

    return write_script(tmp, name, {
        "plan": [{**call("Read", path="input/a.md"), **u(900)},
                 {**transition("implement", "planned", lessons="keep it short"), **u(950)}],
        "implement": [{**call("Write", path="output/out.md", content=f"result {version}\n"), **u(1200)},
                      {**call("Write", path="output/notes.txt", content=f"notes {version}"), **u(1250)},
                      {**transition("verify", f"wrote {version}"), **u(1300)}],
        "verify": [{**call("Read", path="output/out.md"), **u(1000)}, {**transition("COMPLETE", "ok"), **u(1010)}],
    })


def _tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (logs/ aside, which holds timestamps), relative path → content digest."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and "logs" not in p.relative_to(folder).parts:
            out[p.relative_to(folder).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _comparable(events: list[Any]) -> list[tuple[Any, ...]]:
    """Events without what differs between two runs of the same thing: timestamps, ids, the claim owner."""
    out = []
    for ev in events:
        data = ev.payload
        if ev.kind == "job_status" and str(data.get("reason", "")).startswith("claimed by"):
            data = {**data, "reason": "claimed by …"}
        out.append((ev.kind, ev.movement_seq, ev.iteration, json.dumps(data, sort_keys=True)))
    return out


@pytest.fixture
def original(ws: Workspace, tmp_path: Path) -> agentnb.Job:
    spec = _script(tmp_path, "v1", "v1")
    job = ws.run(ws.submit("Summarise input/a.md", piece=PIECE, model=spec, inputs={"a.md": "hello"}))
    assert job.status == "succeeded"
    return job


def _workdirs_by_run(ws: Workspace, job: agentnb.Job) -> list[dict[str, str]]:
    """The job's work directory before each movement run, stepping it one run at a time."""
    seen = []
    while True:
        seen.append(_tree(job.workdir))
        job = ws.step(job)
        if job.status != "queued":
            return seen


@pytest.mark.parametrize("at", [1, 2, 3])
def test_a_fork_spends_nothing_before_its_point_and_rebuilds_the_work_directory(ws: Workspace, tmp_path: Path,
                                                                               at: int) -> None:
    spec = _script(tmp_path, "v1", "v1")
    stepped = ws.submit("Summarise input/a.md", piece=PIECE, model=spec, inputs={"a.md": "hello"})
    before = _workdirs_by_run(ws, stepped)
    assert ws.job(stepped.id).status == "succeeded"

    fork = ws.fork(stepped, at=at, run=False)
    assert fork.forked_from == (stepped.id, at)
    for _ in range(at - 1):  # step the re-served runs; the work directory then is the original's at run `at`
        fork = ws.step(fork)
    assert _tree(fork.workdir) == before[at - 1]
    fork = ws.run(fork)
    assert fork.status == "succeeded"

    usage = ws.frames.usage(fork)
    assert usage[usage.seq < at].total_tokens.sum() == 0
    assert usage[usage.seq >= at].total_tokens.sum() == ws.frames.usage(stepped).query("seq >= @at").total_tokens.sum()
    responses = [e for e in fork.events if isinstance(e, LLMResponse)]
    assert [e.replayed_from for e in responses if e.movement_seq < at] == [stepped.id] * sum(
        1 for e in responses if e.movement_seq < at)
    assert all(e.replayed_from is None for e in responses if e.movement_seq >= at)
    starts = [e for e in fork.events if isinstance(e, MovementStart)]
    assert [(e.seq, e.replayed_from) for e in starts] == [(s, stepped.id if s < at else None) for s in (1, 2, 3)]
    # nothing changed: the fork is the original again, event for event (re-served runs marked), and its output
    mine, theirs = _comparable(ws.events(fork, kinds=_RUN_KINDS)), _comparable(ws.events(stepped, kinds=_RUN_KINDS))
    assert [e for e in mine if (e[1] or 0) >= at] == [e for e in theirs if (e[1] or 0) >= at]
    assert [e for e in mine if e[0] != "movement_start"] == [e for e in theirs if e[0] != "movement_start"]
    assert _tree(fork.workdir / "output") == _tree(stepped.workdir / "output")
    assert not ws.events(fork, kinds=["replay_divergence"])


_RUN_KINDS = ["movement_start", "llm_request", "tool_call", "tool_result", "context_action", "reminder",
              "transition", "lesson"]


def test_a_fork_with_an_edited_movement_changes_what_follows(ws: Workspace, tmp_path: Path,
                                                             original: agentnb.Job) -> None:
    piece = ws.piece(original).replace_movement("implement", instruction="Write version two.",
                                                persona="You write tersely.")
    fork = ws.fork(original, at=2, piece=piece, model=_script(tmp_path, "v2", "v2"))
    assert fork.status == "succeeded"
    assert (fork.workdir / "output" / "out.md").read_text() == "result v2\n"
    assert (original.workdir / "output" / "out.md").read_text() == "result v1\n"
    starts = [e for e in fork.events if isinstance(e, MovementStart)]
    assert starts[0].replayed_from == original.id and starts[1].replayed_from is None
    assert "Write version two." in starts[1].user and starts[1].system == "You write tersely."
    # the re-served run kept the original's prompts, its clock included
    original_starts = [e for e in original.events if isinstance(e, MovementStart)]
    assert starts[0].user == original_starts[0].user and starts[0].system == original_starts[0].system
    # the live run's prompt is the original's apart from the edited instruction
    assert starts[1].user.replace("Write version two.", "") .split("## Current step")[0] == \
        original_starts[1].user.split("## Current step")[0]
    summaries = [m["summary"] for m in ws.movements(fork)]
    assert summaries == ["planned", "wrote v2", "ok"]


def test_a_fork_of_a_fork_re_serves_what_its_original_saw(ws: Workspace, tmp_path: Path) -> None:
    spec = _script(tmp_path, "u1", "v1", usage=True)
    original = ws.run(ws.submit("Summarise input/a.md", piece=PIECE, model=spec, inputs={"a.md": "hello"}))
    first = ws.fork(original, at=2, model=_script(tmp_path, "u2", "v2", usage=True))
    second = ws.fork(first, at=3)
    assert second.status == "succeeded" and second.forked_from == (first.id, 3)
    assert (second.workdir / "output" / "out.md").read_text() == "result v2\n"
    # run 1 was re-served twice over: the ContextManager still saw the original's counts
    ratios = {int(r.seq): r.ratio for r in ws.frames.usage(second).itertuples() if r.seq < 3}
    want = {int(r.seq): r.ratio for r in ws.frames.usage(first).itertuples() if r.seq < 3}
    assert ratios == want and ratios[1] == pytest.approx(950 / 128_000, abs=1e-6)
    assert ws.frames.usage(second).query("seq < 3").total_tokens.sum() == 0
    assert [e.replayed_from for e in second.events if isinstance(e, MovementStart)] == [first.id, first.id, None]


@agentnb.tool
def Clock() -> str:
    """The time in nanoseconds (a result that changes every time)."""
    return str(time.time_ns())


def _clock_piece(tmp: Path) -> Path:
    path = tmp / "clocked.yaml"
    path.write_text(
        "name: clocked\nmovements:\n"
        "  - name: look\n    instruction: Look.\n    tools: [Clock, Read]\n    rules: [{next: work}]\n"
        "  - name: work\n    instruction: Work.\n    tools: [Write]\n    permission: edit\n"
        "    rules: [{next: COMPLETE}]\n",
        encoding="utf-8")
    return path


def _clock_script(tmp: Path) -> str:
    return write_script(tmp, "clock", {
        "look": [call("Read", path="input/a.md"), call("Clock"), transition("work", "looked")],
        "work": [call("Write", path="output/o.txt", content="x"), transition("COMPLETE", "done")],
    })


def test_a_tool_whose_result_changes_is_recorded_as_a_divergence(ws: Workspace, tmp_path: Path) -> None:
    job = ws.run(ws.submit("t", piece=_clock_piece(tmp_path), model=_clock_script(tmp_path), inputs={"a.md": "a"}))
    assert job.status == "succeeded"
    fork = ws.fork(job, at=2)
    assert fork.status == "succeeded"  # by default the fork goes on
    (div,) = [e for e in fork.events if isinstance(e, ReplayDivergence)]
    recorded = next(e for e in job.events if e.kind == "tool_result" and e.tool == "Clock")
    actual = next(e for e in fork.events if e.kind == "tool_result" and e.tool == "Clock")
    assert (div.seq, div.iteration, div.tool, div.call_id) == (1, 2, "Clock", recorded.call_id)
    assert div.expected == recorded.content and div.actual == actual.content != recorded.content
    assert div.payload["seq"] == 1 and div.payload["iteration"] == 2


def test_a_strict_fork_fails_at_the_first_divergent_call(ws: Workspace, tmp_path: Path) -> None:
    job = ws.run(ws.submit("t", piece=_clock_piece(tmp_path), model=_clock_script(tmp_path), inputs={"a.md": "a"}))
    fork = ws.fork(job, at=2, strict=True)
    assert fork.status == "failed"
    assert "run 1 (look), call 2: Clock" in fork.error and f"job {job.id}" in fork.error
    assert [e.where for e in fork.events if e.kind == "error"] == ["replay"]
    assert len([e for e in fork.events if e.kind == "replay_divergence"]) == 1
    assert not (fork.workdir / "output" / "o.txt").exists()  # nothing ran after the divergence
    # a strict fork of a job whose tools do the same again goes through
    steady = ws.run(ws.submit("t", piece=PIECE, model=_script(tmp_path, "s", "v1"), inputs={"a.md": "hello"}))
    assert ws.fork(steady, at=3, strict=True).status == "succeeded"


def test_a_fork_keeps_the_originals_context_for_re_served_runs(ws: Workspace, tmp_path: Path) -> None:
    """A re-served run forced out by the ContextManager is forced again, whatever the fork's own piece says."""
    spec = write_script(tmp_path, "ctx", {
        "plan": [{**call("Read", path="input/a.md"), "usage": {"prompt_tokens": 8_000, "completion_tokens": 5}},
                 {**call("Read", path="input/a.md"), "usage": {"prompt_tokens": 9_800, "completion_tokens": 5}}],
        "implement": [{**call("Write", path="output/x.md", content="x")}, transition("verify", "w")],
        "verify": [transition("COMPLETE", "ok")],
    })
    job = ws.run(ws.submit("t", piece=PIECE, model=spec, inputs={"a.md": "a"}, context={"window_tokens": 10_000}))
    assert next(m["forced"] for m in ws.movements(job))
    wide = ws.piece(job).replace_movement("verify", max_iterations=5)
    fork = ws.fork(job, at=3, piece=wide)
    assert fork.status == "succeeded"
    assert [(e.action, e.movement_seq) for e in ws.events(fork, kinds=["context_action"])] == \
        [(e.action, e.movement_seq) for e in ws.events(job, kinds=["context_action"])]
    assert [m["forced"] for m in ws.movements(fork)] == [m["forced"] for m in ws.movements(job)]


def test_a_fork_keeps_the_options_this_version_does_not_know_in_their_place(ws: Workspace,
                                                                           original: agentnb.Job) -> None:
    """A key a newer version wrote into a job's options survives a fork where it was; the fork's own settings
    follow it, and a strict fork's flag goes last, as the stored text had them before the options were typed."""
    with ws.store.transaction() as c:
        ws.store.update_job(c, original.id, options='{"future":{"x":1},"strict_replay":true}')
    fork = ws.fork(original, at=2, strict=True, context={"window_tokens": 9000})
    assert ws.store.job(fork.id).options_text == \
        '{"future":{"x":1},"context":{"window_tokens":9000},"strict_replay":true}'
    assert ws.store.job(ws.fork(fork, at=2).id).options_text == '{"future":{"x":1},"context":{"window_tokens":9000}}'


def test_a_fork_resumes_in_another_process_in_the_middle_of_its_re_served_runs(ws: Workspace, tmp_path: Path,
                                                                               original: agentnb.Job) -> None:
    fork = ws.fork(original, at=3, run=False)
    for _ in range(3):  # into run 2, between two calls
        fork = ws.step(fork, unit="call")
    assert fork.status == "queued" and fork.movement_seq == 2
    code = ("import sys; from agentnb import Workspace; ws = Workspace(sys.argv[1]); "
            "print(ws.run(int(sys.argv[2])).status)")
    out = subprocess.run([sys.executable, "-c", code, str(ws.root), str(fork.id)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(REPO / "tests")})
    assert out.stdout.strip() == "succeeded", out.stderr
    assert _comparable(ws.events(fork, kinds=_RUN_KINDS))[-8:] == _comparable(ws.events(original, kinds=_RUN_KINDS))[-8:]
    assert ws.frames.usage(fork).query("seq < 3").total_tokens.sum() == 0
    assert len(ws.events(fork, kinds=["llm_response"])) == len(ws.events(original, kinds=["llm_response"]))
    assert _tree(fork.workdir / "output") == _tree(original.workdir / "output")


# -- refusals: one line, nothing stored ----------------------------------------------------------------------------

def _nothing_added(ws: Workspace, before: int) -> None:
    assert len(ws.jobs()) == before
    assert sorted(p.name for p in (ws.root / "jobs").iterdir()) == sorted(str(j.id) for j in ws.jobs())


@pytest.mark.parametrize("at, words", [(0, "allowed: a movement run from 1 to 3"), (4, "ran 3 movement run(s)"),
                                       (True, "at=True"), ("2", "at='2'")])
def test_a_bad_fork_point_is_refused(ws: Workspace, original: agentnb.Job, at: Any, words: str) -> None:
    before = len(ws.jobs())
    with pytest.raises(UsageError, match="at=") as info:
        ws.fork(original, at=at)
    assert words in str(info.value) and "\n" not in str(info.value)
    _nothing_added(ws, before)


def test_a_running_or_waiting_job_cannot_be_forked(ws: Workspace, tmp_path: Path) -> None:
    running = ws.submit("t", piece=PIECE, model=_script(tmp_path, "r", "v1"), inputs={"a.md": "x"})
    assert ws.store.claim(running.id) is not None
    with pytest.raises(UsageError, match=f"job {running.id} is running; a fork needs a job that has stopped"):
        ws.fork(running, at=1)
    asking = write_script(tmp_path, "ask", {"plan": [transition("ASK", "?", question="Which file?")]})
    waiting = ws.run(ws.submit("t", piece=PIECE, model=asking))
    assert waiting.status == "waiting_human"
    before = len(ws.jobs())
    with pytest.raises(UsageError, match=r"is waiting_human .*reply"):
        ws.fork(waiting, at=1)
    _nothing_added(ws, before)


def test_a_fork_re_serves_a_question_with_the_replies_it_got(ws: Workspace, tmp_path: Path) -> None:
    spec = write_script(tmp_path, "asked", {
        "clarify": [transition("ASK", "?", question="Which file?"), transition("work", "clear")],
        "work": [call("Write", path="output/o.md", content="one"), transition("COMPLETE", "done")],
    })
    job = ws.run(ws.submit("t", piece="ask-first", model=spec))
    assert job.status == "waiting_human"
    job = ws.run(ws.reply(job, "Use a.md, please."))
    assert job.status == "succeeded" and [m["name"] for m in ws.movements(job)] == ["clarify", "clarify", "work"]
    edited = ws.piece(job).replace_movement("work", instruction="Write it twice.")
    fork = ws.fork(job, at=3, piece=edited, model=write_script(tmp_path, "twice", {
        "clarify": [transition("ASK", "?", question="Which file?"), transition("work", "clear")],
        "work": [call("Write", path="output/o.md", content="one one"), transition("COMPLETE", "done")]}))
    assert fork.status == "succeeded"  # never waited: the question was answered as the original's was
    assert "waiting_human" not in [e.status for e in fork.events if e.kind == "job_status"]
    assert [(c["author"], c["body"], c["ts"]) for c in ws.comments(fork)] == \
        [(c["author"], c["body"], c["ts"]) for c in ws.comments(job)]
    users = {e.seq: e.user for e in job.events if isinstance(e, MovementStart)}
    mine = {e.seq: e.user for e in fork.events if isinstance(e, MovementStart)}
    assert mine[2] == users[2] and "Use a.md, please." in mine[3]
    assert mine[3].split("## Current step")[0] == users[3].split("## Current step")[0]
    assert (fork.workdir / "output" / "o.md").read_text() == "one one"
    again = ws.fork(fork, at=3)  # a fork of the fork finds the replies in the job that was answered
    assert again.status == "succeeded" and (again.workdir / "output" / "o.md").read_text() == "one one"
    assert [c["body"] for c in ws.comments(again)] == ["Which file?", "Use a.md, please."]


def test_a_fork_re_serves_subtasks_as_replays_of_the_originals_children(ws: Workspace, tmp_path: Path) -> None:
    spec = write_script(tmp_path, "fan", {
        "split": [transition("WAIT_SUBTASKS", "split", subtasks=[{"instruction": "part one", "piece": "single"},
                                                                 {"instruction": "part two", "piece": "single"}])],
        "work": [call("Write", path="output/part.md", content="a part"), transition("COMPLETE", "part done")],
        "merge": [call("Write", path="output/result.md", content="merged"), transition("COMPLETE", "merged")],
    })
    job = ws.run(ws.submit("t", piece="fan-out", model=spec))
    assert job.status == "succeeded", job.error
    children = ws.children(job)
    fork = ws.fork(job, at=2, model=write_script(tmp_path, "fan2", {
        "merge": [call("Write", path="output/result.md", content="merged again"), transition("COMPLETE", "m")]}))
    assert fork.status == "succeeded", fork.error
    mine = ws.children(fork)
    assert [c.model for c in mine] == [f"replay:{c.id}" for c in children]
    assert [c.instruction for c in mine] == ["part one", "part two"] and all(c.status == "succeeded" for c in mine)
    assert all((c.workdir / "output" / "part.md").read_text() == "a part" for c in mine)
    assert ws.frames.jobs().set_index("job").loc[[c.id for c in mine], "cost_usd"].sum() == 0
    merge = next(e for e in fork.events if isinstance(e, MovementStart) and e.seq == 2)
    assert f"job {mine[0].id} (succeeded): part one" in merge.user
    assert (fork.workdir / "output" / "result.md").read_text() == "merged again"


def test_a_fork_onto_a_piece_without_the_movement_is_refused(ws: Workspace, original: agentnb.Job) -> None:
    before = len(ws.jobs())
    with pytest.raises(PieceError, match=r"starts run 2 with movement 'implement'.*movements: work"):
        ws.fork(original, at=2, piece="single")
    with pytest.raises(PieceError, match="replace_movement: no movement 'nope'"):
        ws.piece(original).replace_movement("nope", persona="x")
    with pytest.raises(PieceError, match=r"unknown key\(s\) \['name'\]"):
        ws.piece(original).replace_movement("plan", name="x")
    with pytest.raises(PieceError, match="rules"):
        ws.piece(original).replace_movement("plan", rules=[{"next": "nowhere"}])
    with pytest.raises(agentnb.errors.ModelSpecError):
        ws.fork(original, at=2, model="nonsense")
    with pytest.raises(agentnb.errors.StoreError, match="no job 999"):
        ws.fork(999, at=1)
    _nothing_added(ws, before)



@pytest.mark.parametrize("at, movement", [(1, "plan"), (2, "implement"), (3, "verify")])
def test_a_fork_onto_a_piece_without_the_movement_is_refused_at_every_run(ws: Workspace, original: agentnb.Job,
                                                                          at: int, movement: str) -> None:
    # at 1 the fork used to run the other piece's own first movement; README: run SEQ starts the movement the
    # original's run SEQ started, so the piece must have it
    before = len(ws.jobs())
    single = agentnb.load_piece("single")
    with pytest.raises(PieceError) as info:
        ws.fork(original, at=at, piece="single")
    assert str(info.value) == (f"{single.source}: movements: the fork starts run {at} with movement {movement!r}, "
                               f"as job {original.id} did, but the piece has no such movement; movements: work")
    with pytest.raises(PieceError, match=f"starts run 1 with movement 'plan', as job {original.id} did"):
        ws.replay(original, piece=single)
    _nothing_added(ws, before)


def test_a_fork_at_1_starts_the_movement_the_original_started(ws: Workspace, tmp_path: Path,
                                                             original: agentnb.Job) -> None:
    edited = ws.piece(original).replace_movement("plan", instruction="Plan it twice.")
    fork = ws.fork(original, at=1, piece=edited)
    assert fork.status == "succeeded", fork.error
    assert "Plan it twice." in next(e.user for e in fork.events if isinstance(e, MovementStart) and e.seq == 1)
    # a piece that has the movement but starts elsewhere: run 1 is still the original's run 1
    data = ws.piece(original).to_dict()
    data["initial_movement"] = "implement"
    elsewhere = agentnb.parse_piece(yaml.safe_dump(data), source="elsewhere")
    fork = ws.fork(original, at=1, piece=elsewhere)
    assert fork.status == "succeeded", fork.error
    assert [m["name"] for m in ws.movements(fork)] == ["plan", "implement", "verify"]
    again = ws.replay(original, piece=elsewhere)
    assert again.status == "succeeded" and _comparable(again.events) == _comparable(original.events)


CLI = shutil.which("agentnb")


@pytest.mark.skipif(CLI is None, reason="the agentnb entry point is not installed")
def test_agentnb_fork_onto_a_piece_without_the_movement_is_refused_in_one_line(ws: Workspace,
                                                                               original: agentnb.Job) -> None:
    # AGENTNB_STORE stays: under AGENTNB_TEST_BACKEND=postgres the command must use the test's database
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTNB_", "OPENAI_")) or k == "AGENTNB_STORE"}

    def fork(*args: str) -> subprocess.CompletedProcess[str]:
        assert CLI is not None
        return subprocess.run([CLI, "--workspace", str(ws.root), "fork", str(original.id), *args],
                              capture_output=True, text=True, timeout=120, env=env)

    before = len(ws.jobs())
    single = agentnb.load_piece("single").source
    for at, movement in (("1", "plan"), ("2", "implement")):
        out = fork("--at", at, "--piece", "single")
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr == (f"agentnb: error: {single}: movements: the fork starts run {at} with movement "
                              f"{movement!r}, as job {original.id} did, but the piece has no such movement; "
                              "movements: work\n")
    _nothing_added(ws, before)
    out = fork("--at", "1", "--piece", PIECE)
    assert out.returncode == 0, out.stderr
    assert f"forked from job {original.id} at run 1" in out.stdout



def test_agent_fork_magic_onto_a_piece_without_the_movement_is_refused(shell: Any, tmp_path: Path) -> None:
    from IPython.core.error import UsageError as MagicUsageError

    original = shell.run_line_magic("agent", 'run "Summarise the task"')
    assert original.status == "succeeded", original.error
    ws = Workspace(tmp_path / "ws")
    before = len(ws.jobs())
    with pytest.raises(MagicUsageError) as info:
        shell.run_line_magic("agent", f"fork {original.id} --at 1 --piece single")
    assert str(info.value).startswith("%agent fork: ") and "\n" not in str(info.value)
    assert f"the fork starts run 1 with movement 'plan', as job {original.id} did" in str(info.value)
    _nothing_added(ws, before)


# -- replay --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("usage", [False, True], ids=["counted", "reported"])
def test_a_replay_reproduces_the_events_and_the_output(ws: Workspace, tmp_path: Path, usage: bool) -> None:
    spec = _script(tmp_path, "rp", "v1", usage=usage)
    job = ws.run(ws.submit("Summarise input/a.md", piece=PIECE, model=spec, inputs={"a.md": "hello"}))
    again = ws.replay(job)
    assert again.model == f"replay:{job.id}" and again.status == "succeeded"
    assert _comparable(again.events) == _comparable(job.events)
    assert _tree(again.workdir / "output") == _tree(job.workdir / "output")
    assert ws.frames.usage(again).total_tokens.tolist() == ws.frames.usage(job).total_tokens.tolist()


def test_a_replay_of_an_openai_job_keeps_the_models_call_ids(ws: Workspace, loopback: Callable[..., OpenAIServer]) -> None:
    srv = loopback()
    srv.play(reply(tool_calls=[("Write", {"path": "output/r.md", "content": "r"})], usage=(300, 20)),
             reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "s"})], usage=(340, 9)))
    job = ws.run(ws.submit("t", piece="single", model="openai:gpt-4o-mini"))
    assert job.status == "succeeded", job.error
    asked = len(srv.received)
    again = ws.replay(job)
    assert len(srv.received) == asked  # nothing was asked of the endpoint
    assert again.status == "succeeded"
    assert _comparable(again.events) == _comparable(job.events)
    assert [c.id for e in again.events if isinstance(e, LLMResponse) for c in e.tool_calls] == ["call_1_0", "call_2_0"]
    assert ws.frames.jobs().set_index("job").loc[again.id, "cost_usd"] == 0


def test_a_fork_of_an_openai_job_asks_the_endpoint_only_from_its_point(ws: Workspace,
                                                                      loopback: Callable[..., OpenAIServer]) -> None:
    srv = loopback()
    srv.play(reply(tool_calls=[("Read", {"path": "input/a.md"})], usage=(500, 10)),
             reply(tool_calls=[("transition", {"next_step": "implement", "summary": "p"})], usage=(520, 10)),
             reply(tool_calls=[("transition", {"next_step": "verify", "summary": "i"})], usage=(600, 10)),
             reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "v"})], usage=(700, 10)))
    job = ws.run(ws.submit("t", piece=PIECE, model="openai:gpt-4o-mini", inputs={"a.md": "a"}))
    assert job.status == "succeeded", job.error
    asked = len(srv.received)
    srv.play(reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "v2"})], usage=(710, 12)))
    fork = ws.fork(job, at=3)
    assert len(srv.received) == asked + 1  # runs 1 and 2 re-served: only verify was asked
    assert fork.status == "succeeded"
    costs = ws.frames.usage(fork).groupby("seq").cost_usd.sum()
    assert costs[1] == 0 and costs[2] == 0 and costs[3] > 0


def test_a_fork_takes_its_piece_as_yaml_text(ws: Workspace, tmp_path: Path, original: agentnb.Job) -> None:
    text = ws.piece(original).replace_movement("verify", instruction="Check twice.").to_yaml()
    fork = ws.fork(original, at=3, piece=text)
    assert fork.status == "succeeded"
    assert "Check twice." in next(e.user for e in fork.events if isinstance(e, MovementStart) and e.seq == 3)
    with pytest.raises(PieceError, match="<piece text>"):
        ws.fork(original, at=3, piece="name: broken\nmovements: 3\n")


def test_a_fork_with_other_context_settings_is_the_real_answer_to_a_what_if(ws: Workspace, tmp_path: Path) -> None:
    job = ws.run(ws.submit("t", piece=PIECE, model=_script(tmp_path, "w", "v1", usage=True), inputs={"a.md": "a"}))
    what_if = ws.frames.what_if(job, window=1_300)
    (seq, it), = what_if[what_if.first_forced][["seq", "iteration"]].values.tolist()
    assert (seq, it) == (2, 2)  # implement's second call: 1,250 of 1,300 tokens ≥ 95 %
    fork = ws.fork(job, at=2, context={"window_tokens": 1_300})
    actions = [(e.movement_seq, e.iteration, e.action) for e in ws.events(fork, kinds=["context_action"])]
    assert (2, 2, "force_transition") in actions and all(s >= 2 for s, _, _ in actions)
    assert ws.movements(fork)[1]["forced"]
    assert ws.frames.usage(fork).query("seq == 1").window.tolist() == [128_000, 128_000]  # re-served as recorded
    with pytest.raises(UsageError, match="window_tokens=3; allowed: a whole number ≥ 256"):
        ws.fork(job, at=2, context={"window_tokens": 3})


# -- forks of jobs with tool mixes, a review loop and context pressure ---------------------------------------------

TOKENS = ["prompt_tokens", "completion_tokens", "total_tokens"]
# the seed's defaults (warn 70 %, prompt 85 %, force_transition 95 %, exhausted 99 %), in firing order
SEED = {"warn": 0.70, "prompt": 0.85, "force_transition": 0.95, "exhausted": 0.99}
# skipped with one line on a machine without bubblewrap, failed under CI (conftest)
needs_bwrap = pytest.mark.needs("bwrap")
# the review loop runs Bash in its jail: only made when bwrap is there
LOOP = pytest.param("loop", marks=needs_bwrap)


# -- comparing a fork with its original, event by event ------------------------------------------------------------

def _event(ev: Any, *, re_served: bool = False) -> tuple[Any, ...]:
    """An event apart from its timestamp, row id, claim owner and latency; for a re-served run also apart from
    what re-serving changes by design (``replayed_from``, the token counts and their source)."""
    data = dict(ev.payload)
    if ev.kind == "job_status" and str(data.get("reason", "")).startswith("claimed by"):
        data["reason"] = "claimed by …"
    if ev.kind == "llm_response":
        data.pop("latency_s", None)
    if re_served and ev.kind in ("llm_response", "movement_start"):
        data.pop("replayed_from", None)
        if ev.kind == "llm_response":
            data["usage"] = {k: v for k, v in data["usage"].items() if k in ("ratio", "window")}
    return ev.kind, ev.movement_seq, ev.iteration, json.dumps(data, sort_keys=True, default=str)


def _run_events(job: agentnb.Job, runs: range | None = None, *, re_served: bool = False) -> list[tuple[Any, ...]]:
    return [_event(e, re_served=re_served) for e in job.events
            if e.kind != "job_status" and (runs is None or e.movement_seq in runs)]


def _assert_unedited_fork(ws: Workspace, job: agentnb.Job, fork: agentnb.Job, at: int) -> None:
    """A fork with nothing changed is its original: re-served runs as recorded with 0 tokens, the rest equal."""
    last = len(ws.movements(job))
    assert fork.forked_from == (job.id, at) and fork.status == job.status, fork.error
    assert _run_events(fork, range(1, at), re_served=True) == _run_events(job, range(1, at), re_served=True)
    assert _run_events(fork, range(at, last + 1)) == _run_events(job, range(at, last + 1))
    assert _tree(fork.workdir) == _tree(job.workdir)
    served = [e.replayed_from for e in fork.events if e.kind == "llm_response"]
    calls = [e.movement_seq for e in fork.events if e.kind == "llm_response"]
    assert [s is not None for s in served] == [seq < at for seq in calls]
    mine, theirs = ws.frames.usage(fork), ws.frames.usage(job)
    assert (mine.loc[mine.seq < at, TOKENS] == 0).all().all()
    assert mine["replayed"].tolist() == [seq < at for seq in mine.seq]
    cols = ["seq", "iteration", "ratio", "window", "action", "actions", "source"]
    pd.testing.assert_frame_equal(mine[cols], theirs[cols])  # the context as it was, the source kept
    live = ["seq", "iteration", *TOKENS]
    pd.testing.assert_frame_equal(mine.loc[mine.seq >= at, live].reset_index(drop=True),
                                  theirs.loc[theirs.seq >= at, live].reset_index(drop=True))
    keys = ["seq", "movement", "next_step", "forced"]
    pd.testing.assert_frame_equal(ws.frames.movements(fork)[keys], ws.frames.movements(job)[keys])


# -- jobs with a review loop and context pressure ------------------------------------------------------------------

def _u(prompt: int, completion: int = 11) -> dict[str, Any]:
    return {"usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


def _loop_piece(folder: Path) -> Path:
    return write_piece(folder, "review-loop", {
        "max_movements": 10,
        "movements": [
            {"name": "survey", "persona": "You survey.", "instruction": "Look around.",
             "tools": ["Glob", "Grep", "Read"], "permission": "readonly",
             "rules": [{"condition": "seen", "next": "draft"}], "default_next": "draft"},
            {"name": "draft", "persona": "You draft.", "instruction": "Draft output/report.md.",
             "tools": ["Write", "Bash", "Read"], "permission": "full",
             "rules": [{"condition": "drafted", "next": "review"}]},
            {"name": "review", "persona": "You review.", "instruction": "Review the report.",
             "tools": ["Read", "Checklist", "Grep"], "permission": "readonly", "verify": "fix",
             "rules": [{"condition": "needs work", "next": "fix"}, {"condition": "good", "next": "COMPLETE"}]},
            {"name": "fix", "persona": "You fix.", "instruction": "Fix what the review found.",
             "tools": ["Read", "Edit"], "permission": "edit", "max_iterations": 3,
             "rules": [{"condition": "fixed", "next": "review"}], "default_next": "review"},
        ]})


def _loop_script(folder: Path, name: str, *, draft: str = "mkdir -p output && printf 'line1\\nTODO fix\\n' > "
                 "output/report.md && wc -l output/report.md", fixed: str = "fixed") -> str:
    """survey → draft (Bash) → review (Checklist, feedback) → fix (Edit) → review (Grep, a reminder) → done."""
    return write_script(folder, name, {
        "survey": [{**call("Glob", pattern="input/*.txt"), **_u(500)},
                   {**call("Grep", pattern="TODO", path="input"), **_u(600)},
                   {**transition("draft", "surveyed", lessons="two todos"), **_u(700)}],
        "draft": [{**call("Bash", command=draft), **_u(800)}, {**transition("review", "drafted"), **_u(900)}],
        "review": [{**call("Checklist", name="rev", items=[{"text": "no TODO", "done": False}]), **_u(1000)},
                   {**transition("fix", "has a TODO", feedback="remove the TODO"), **_u(1100)},
                   {**call("Grep", pattern="TODO", path="output"), **_u(1200)},
                   {"content": "Looks fine now.", **_u(1250)},  # no tool call: the loop reminds
                   {**transition("COMPLETE", "clean"), **_u(1300)}],
        "fix": [{**call("Edit", path="output/report.md", old="TODO fix", new=fixed), **_u(1400)},
                {**transition("review", "fixed"), **_u(1500)}],
    })


def _pressure_piece(folder: Path) -> Path:
    return write_piece(folder, "pressure", {
        "max_movements": 8, "context": {"window_tokens": 3000},
        "movements": [
            {"name": "gather", "persona": "You gather.", "instruction": "Read everything.", "tools": ["Read", "Glob"],
             "permission": "readonly", "rules": [{"condition": "read", "next": "write"}], "default_next": "write"},
            {"name": "write", "persona": "You write.", "instruction": "Write output/sum.md.",
             "tools": ["Write", "Read"], "permission": "edit", "max_iterations": 2,
             "rules": [{"condition": "written", "next": "check"}], "default_next": "check"},
            {"name": "check", "persona": "You check.", "instruction": "Check it.", "tools": ["Read"],
             "permission": "readonly", "rules": [{"condition": "good", "next": "COMPLETE"}]},
        ]})


def _pressure_script(folder: Path, name: str, second: str = "part 1\npart 2\n") -> str:
    """One ``responses:`` list, some calls with usage and some counted locally: gather is forced out by the
    ContextManager (2950/3000 tokens), write by its max_iterations, check is reminded once."""
    responses = [call("Glob", pattern="input/*"), call("Read", path="input/big.txt", limit=20),
                 {**call("Read", path="input/big.txt", offset=40, limit=5), **_u(2200, 9)},
                 call("Read", path="input/big.txt", offset=80, limit=5),
                 {**call("Read", path="input/big.txt", offset=90, limit=5), **_u(2950, 9)},
                 call("Write", path="output/sum.md", content="part 1\n"),
                 call("Write", path="output/sum.md", content=second),
                 call("Read", path="output/sum.md"), {"content": "all good"}, transition("COMPLETE", "checked")]
    return write_script(folder, name, responses=responses)


BIG = "\n".join(f"line {i} " + "lorem ipsum dolor sit amet " * 6 for i in range(120))


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("fork-lab")
    ws = Workspace(folder / "ws", store=backend_store(request))
    out: dict[str, Any] = {"ws": ws, "folder": folder}
    out["pressure"] = ws.run(ws.submit("Summarise", piece=str(_pressure_piece(folder)),
                                       model=_pressure_script(folder, "p"), inputs={"big.txt": BIG}))
    if shutil.which("bwrap"):
        out["loop"] = ws.run(ws.submit("Write a report", piece=str(_loop_piece(folder)),
                                       model=_loop_script(folder, "loop"),
                                       inputs={"a.txt": "TODO one\n", "b.txt": "TODO two\n"}))
    return out


def test_the_originals_are_what_the_checks_need(lab: dict[str, Any]) -> None:
    ws, job = lab["ws"], lab["pressure"]
    assert job.status == "succeeded"
    assert [(m["name"], m["forced"]) for m in ws.movements(job)] == [("gather", True), ("write", True),
                                                                     ("check", False)]
    assert [e.action for e in job.events if e.kind == "context_action"] == ["warn", "prompt", "force_transition"]
    assert set(ws.frames.usage(job).source) == {"usage", "tiktoken"}
    assert "reminder" in [e.kind for e in job.events if e.movement_seq == 3]


# -- unedited forks and replays are their originals ----------------------------------------------------------------

@pytest.mark.parametrize("at", [1, 2, 3])
def test_an_unedited_fork_of_the_pressure_job_is_the_original(lab: dict[str, Any], at: int) -> None:
    ws, job = lab["ws"], lab["pressure"]
    _assert_unedited_fork(ws, job, ws.fork(job, at=at), at)


@needs_bwrap
@pytest.mark.parametrize("at", [1, 2, 3, 4, 5])
def test_an_unedited_fork_of_the_review_loop_is_the_original(lab: dict[str, Any], at: int) -> None:
    ws, job = lab["ws"], lab["loop"]
    assert job.status == "succeeded" and [m["name"] for m in ws.movements(job)] == \
        ["survey", "draft", "review", "fix", "review"]
    fork = ws.fork(job, at=at)
    _assert_unedited_fork(ws, job, fork, at)
    c = ws.compare(job, fork)
    assert c.frame["identical"].all() and c.first_divergence is None and c.files().empty


@pytest.mark.parametrize("name", ["pressure", LOOP])
def test_a_replay_is_its_original_event_for_event_and_byte_for_byte(lab: dict[str, Any], name: str) -> None:
    if name not in lab:
        require("bwrap")
    ws, job = lab["ws"], lab[name]
    replay = ws.replay(job)
    assert replay.model == f"replay:{job.id}" and replay.status == job.status
    assert _run_events(replay) == _run_events(job)
    assert _tree(replay.workdir) == _tree(job.workdir)
    assert ws.frames.usage(replay)[TOKENS].equals(ws.frames.usage(job)[TOKENS])  # counts re-served as recorded


# -- edited forks --------------------------------------------------------------------------------------------------

@needs_bwrap
def test_a_fork_with_an_edited_prompt_differs_only_in_that_prompt(lab: dict[str, Any]) -> None:
    ws, job = lab["ws"], lab["loop"]
    piece = ws.piece(job).replace_movement("review", instruction="Review it strictly.")
    fork = ws.fork(job, at=3, piece=piece)
    assert fork.status == "succeeded" and _tree(fork.workdir) == _tree(job.workdir)
    starts = {e.seq: e for e in fork.events if e.kind == "movement_start"}
    theirs = {e.seq: e for e in job.events if e.kind == "movement_start"}
    for seq in (3, 5):  # both review runs, the one after fix too
        assert "Review it strictly." in starts[seq].user and "Review it strictly." not in theirs[seq].user
    assert starts[4].user == theirs[4].user
    same = [e for e in _run_events(fork, range(3, 6)) if e[0] != "movement_start"]
    assert same == [e for e in _run_events(job, range(3, 6)) if e[0] != "movement_start"]
    f = ws.compare(job, fork).frame
    assert f["identical"].tolist() == [True, True, False, True, False]
    assert f["diverged"].tolist() == [False, False, True, False, False]


@needs_bwrap
def test_a_fork_on_another_script_changes_output_after_its_point_only(lab: dict[str, Any]) -> None:
    ws, job, folder = lab["ws"], lab["loop"], lab["folder"]
    other = _loop_script(folder, "loop-fixed", fixed="done right")
    fork = ws.fork(job, at=4, model=other)
    assert fork.status == "succeeded" and fork.model == other
    assert (fork.workdir / "output" / "report.md").read_text() == "line1\ndone right\n"
    assert ws.frames.usage(fork).query("seq < 4")[TOKENS].eq(0).all().all()
    c = ws.compare(job, fork)
    assert c.first_divergence == 4 and c.frame["identical"].tolist() == [True, True, True, False, True]
    files = c.files()
    assert files[["path", "change"]].values.tolist() == [["report.md", "changed"]]
    assert "-fixed" in files["diff"][0] and "+done right" in files["diff"][0]


@needs_bwrap
def test_a_fork_on_yaml_text_with_a_shorter_loop(lab: dict[str, Any]) -> None:
    """The piece as YAML text, review allowed to complete at once: the fork ends earlier than its original."""
    ws, job, folder = lab["ws"], lab["loop"], lab["folder"]
    text = _loop_piece(folder).read_text(encoding="utf-8").replace("name: review-loop", "name: review-once")
    script = write_script(folder, "once", {
        "review": [{**call("Read", path="output/report.md"), **_u(700)}, {**transition("COMPLETE", "fine"), **_u(800)}],
    })
    fork = ws.fork(job, at=3, piece=text, model=script)
    assert fork.status == "succeeded", fork.error
    assert ws.piece(fork).name == "review-once"
    assert [m["name"] for m in ws.movements(fork)] == ["survey", "draft", "review"]
    assert _tree(fork.workdir / "input") == _tree(job.workdir / "input")
    assert (fork.workdir / "output" / "report.md").read_text() == "line1\nTODO fix\n"  # as at run 3's start
    f = ws.compare(job, fork).frame
    assert f["identical"].tolist() == [True, True, False, False, False]
    assert f["movement_b"].isna().tolist() == [False, False, False, True, True]
    assert ws.compare(job, fork).files()[["path", "change"]].values.tolist() == [["report.md", "changed"]]


def test_a_fork_with_more_iterations_is_no_longer_forced_out(lab: dict[str, Any]) -> None:
    ws, job, folder = lab["ws"], lab["pressure"], lab["folder"]
    piece = ws.piece(job).replace_movement("write", max_iterations=3)
    base = yaml.safe_load(Path(_pressure_script(folder, "p3").split(":", 1)[1]).read_text())["responses"]
    responses = [*base[:7], transition("check", "written"), *base[7:]]
    fork = ws.fork(job, at=2, piece=piece, model=write_script(folder, "p3", responses=responses))
    assert fork.status == "succeeded", fork.error
    assert [m["forced"] for m in ws.movements(fork)] == [True, False, False]  # the re-served run stays forced
    assert [e.action for e in fork.events if e.kind == "context_action"] == ["warn", "prompt", "force_transition"]
    assert _tree(fork.workdir / "output") == _tree(job.workdir / "output")
    assert ws.compare(job, fork).frame["identical"].tolist() == [True, False, True]


# -- chains, strictness, resumes -----------------------------------------------------------------------------------

@needs_bwrap
def test_a_fork_of_a_fork_of_a_fork(lab: dict[str, Any]) -> None:
    ws, job, folder = lab["ws"], lab["loop"], lab["folder"]
    one = ws.fork(job, at=4, model=_loop_script(folder, "chain", fixed="chained"))
    two = ws.fork(one, at=5)
    three = ws.fork(two, at=2)
    for fork, origin, at in ((one, job, 4), (two, one, 5), (three, two, 2)):
        assert fork.status == "succeeded" and fork.forked_from == (origin.id, at)
        assert ws.frames.usage(fork).query(f"seq < {at}")[TOKENS].eq(0).all().all()
    _assert_unedited_fork(ws, one, two, 5)
    # three runs live from run 2 what two re-served: equal to it apart from what re-serving changes, and
    # spending what the jobs that ran those runs live spent (the scripts' counts are the same)
    assert _run_events(three, re_served=True) == _run_events(two, re_served=True)
    assert _tree(three.workdir) == _tree(two.workdir)
    live = ["seq", "iteration", *TOKENS]
    pd.testing.assert_frame_equal(ws.frames.usage(three).query("seq >= 2")[live].reset_index(drop=True),
                                  ws.frames.usage(job).query("seq >= 2")[live].reset_index(drop=True))
    assert ws.frames.usage(three)["replayed"].tolist() == ws.frames.usage(job).seq.lt(2).tolist()
    assert (three.workdir / "output" / "report.md").read_text() == "line1\nchained\n"
    jobs = ws.frames.jobs().set_index("job")
    assert (jobs.loc[three.id, "forked_from_job"], jobs.loc[three.id, "forked_from_seq"]) == (two.id, 2)


@needs_bwrap
def test_a_clock_in_bash_diverges_and_a_strict_fork_stops_there(lab: dict[str, Any]) -> None:
    ws, folder = lab["ws"], lab["folder"]
    clock = "mkdir -p output && date +%s%N > output/stamp && cat output/stamp"
    job = ws.run(ws.submit("Stamp", piece=str(_loop_piece(folder)),
                           model=_loop_script(folder, "clock", draft=clock), inputs={"a.txt": "TODO\n"}))
    assert job.status == "succeeded"  # the Edit finds no TODO: a tool error the script goes on from
    loose = ws.fork(job, at=3)
    (div,) = [e for e in loose.events if e.kind == "replay_divergence"]
    recorded = next(e for e in job.events if e.kind == "tool_result" and e.tool == "Bash")
    assert (div.seq, div.iteration, div.tool, div.call_id) == (2, recorded.iteration, "Bash", recorded.call_id)
    assert div.expected == recorded.content != div.actual
    strict = ws.fork(job, at=3, strict=True)
    assert strict.status == "failed" and "run 2 (draft)" in strict.error and "Bash" in strict.error
    assert [e.movement_seq for e in strict.events if e.kind == "movement_start"] == [1, 2]


@needs_bwrap
def test_a_fork_resumed_by_another_process_in_its_re_served_runs(lab: dict[str, Any]) -> None:
    ws, job = lab["ws"], lab["loop"]
    fork = ws.fork(job, at=5, run=False)
    for _ in range(6):  # survey's three calls, draft's two, then into review
        fork = ws.step(fork, unit="call")
    assert fork.status == "queued" and fork.movement_seq == 3
    code = "import sys; from agentnb import Workspace; print(Workspace(sys.argv[1]).run(int(sys.argv[2])).status)"
    # the lab's store, which under AGENTNB_TEST_BACKEND=postgres is not this test's AGENTNB_STORE
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if ws.store_url:
        env["AGENTNB_STORE"] = ws.store_url
    out = subprocess.run([sys.executable, "-c", code, str(ws.root), str(fork.id)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.stdout.strip() == "succeeded", out.stderr
    _assert_unedited_fork(ws, job, ws.job(fork.id), 5)


# -- refusals: one line, nothing stored ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    ({"at": 4}, "allowed: a movement run from 1 to 3"),
    ({"at": 2, "strict": "yes"}, "strict='yes'"),
    ({"at": 2, "model": 7}, "model=7"),
    ({"at": 2, "model": "scripted:/nowhere/x.yaml"}, "not found"),
    ({"at": 3, "piece": "name: p\nmovements:\n  - {name: other, persona: p, instruction: i}\n"}, "'check'"),
    ({"at": 2, "context": {"thresholds": {"warn": 0.99}}}, "warn"),
])
def test_a_bad_fork_is_refused_in_one_line_and_stores_nothing(lab: dict[str, Any], kwargs: dict[str, Any],
                                                              words: str) -> None:
    ws, job = lab["ws"], lab["pressure"]
    before = (len(ws.jobs()), sorted(p.name for p in (ws.root / "jobs").iterdir()))
    with pytest.raises((AgentnbError, ValueError)) as info:
        ws.fork(job, **kwargs)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert (len(ws.jobs()), sorted(p.name for p in (ws.root / "jobs").iterdir())) == before


# -- what-if against a reference of the seed's rules ---------------------------------------------------------------

def _reference(usage: pd.DataFrame, window: int | None, thresholds: dict[str, float]) -> list[tuple[str, ...]]:
    """The seed's ContextManager by hand: per movement run, each action fires once, at the first call whose
    prompt/window reaches it (a re-served call's prompt being its recorded ratio × recorded window)."""
    fired: dict[tuple[int, int], set[str]] = {}
    out = []
    for row in usage.itertuples():
        prompt = round(row.ratio * row.window) if row.replayed else row.prompt_tokens
        ratio = prompt / (window or row.window)
        done = fired.setdefault((row.job, row.seq), set())
        now = tuple(a for a in SEED if ratio >= thresholds[a] and a not in done)
        done.update(now)
        out.append(now)
    return out


SETTINGS = [(None, None), (2500, None), (1000, None), (None, {"warn": 0.3, "prompt": 0.5}),
            (4000, {"warn": 0.4, "prompt": 0.5, "force_transition": 0.6, "exhausted": 0.7}), (100_000, None)]


@pytest.mark.parametrize("window, thresholds", SETTINGS)
@pytest.mark.parametrize("name", ["pressure", LOOP, "pressure-fork"])
def test_what_if_matches_a_reference_of_the_seed_rules(lab: dict[str, Any], name: str, window: int | None,
                                                       thresholds: dict[str, float] | None) -> None:
    if name not in lab and name != "pressure-fork":
        require("bwrap")
    ws = lab["ws"]
    job = ws.fork(lab["pressure"], at=3) if name == "pressure-fork" else lab[name]
    wi = ws.frames.what_if(job, window=window, thresholds=thresholds)
    merged = {**SEED, **(thresholds or {})}
    expected = _reference(ws.frames.usage(job), window, merged)
    got = [tuple(str(wi.actions_what_if[i]).split(",")) if pd.notna(wi.actions_what_if[i]) else ()
           for i in range(len(wi))]
    assert got == expected
    assert wi["action_what_if"].astype(object).where(wi["action_what_if"].notna(), None).tolist() == \
        [e[-1] if e else None for e in expected]
    forced = ["force_transition" in e for e in expected]
    assert wi["forced_what_if"].tolist() == forced
    assert wi["first_forced"].tolist() == [f and not any(forced[:i]) for i, f in enumerate(forced)]
    usage = ws.frames.usage(job)
    prompts = [round(r * w) if s else p for r, w, s, p in zip(usage.ratio, usage.window, usage.replayed,
                                                               usage.prompt_tokens, strict=True)]
    for got_ratio, prompt, w in zip(wi["ratio_what_if"], prompts, usage.window, strict=True):
        assert got_ratio == round(prompt / (window or w), 6)  # rounded as the record's ratio is
    if window is None and thresholds is None:  # nothing changed: the recorded actions come back
        assert wi["action_what_if"].astype(object).tolist() == wi["action_recorded"].astype(object).tolist()
        assert wi["actions_what_if"].fillna("").tolist() == usage["actions"].fillna("").tolist()


def test_what_if_predicts_what_a_fork_with_those_settings_does_up_to_the_first_forced_call(
        lab: dict[str, Any]) -> None:
    ws, job = lab["ws"], lab["pressure"]
    wi = ws.frames.what_if(job, thresholds={"warn": 0.2, "prompt": 0.6})
    real = ws.fork(job, at=1, context={"thresholds": {"warn": 0.2, "prompt": 0.6}})
    fired = ws.frames.usage(real)
    stop = int(wi.index[wi.first_forced][0])
    assert wi.loc[:stop, "actions_what_if"].fillna("").tolist() == fired.loc[:stop, "actions"].fillna("").tolist()


@pytest.mark.parametrize("kwargs, words", [({"window": 100}, "window=100"), ({"window": 2.5}, "window=2.5"),
                                           ({"thresholds": {"warn": 0.99}}, "warn"),
                                           ({"thresholds": {"panic": 0.5}}, "panic")])
def test_what_if_refuses_bad_settings_in_one_line(lab: dict[str, Any], kwargs: dict[str, Any], words: str) -> None:
    ws = lab["ws"]
    with pytest.raises(UsageError) as info:
        ws.frames.what_if(lab["pressure"], **kwargs)
    assert words in str(info.value) and "\n" not in str(info.value)


# -- the views in a real IPython shell -----------------------------------------------------------------------------

def test_fork_and_compare_in_a_real_shell(shell: Any, tmp_path: Path) -> None:
    from IPython.utils.capture import capture_output

    ws = Workspace(tmp_path / "ws")
    original = ws.run(ws.submit("Summarise", piece=str(_pressure_piece(tmp_path)),
                                model=_pressure_script(tmp_path, "sh"), inputs={"big.txt": BIG}))
    with capture_output() as cap:
        result = shell.run_cell(f"t_fork = %agent fork {original.id} --at 3")
    assert result.error_in_exec is None, result.error_in_exec
    fork = shell.user_ns["t_fork"]
    assert fork.forked_from == (original.id, 3) and fork.status == "succeeded"
    live = [o.data["text/html"] for o in cap.outputs if "text/html" in o.data][-1]
    assert f"forked from job {original.id} at run 3" in live and live.count("re-served") >= 2
    with capture_output():
        c = shell.run_cell(f"%agent compare {original.id} {fork.id}").result
    assert c.frame["identical"].all() and c.frame["replayed_b"].tolist() == [True, True, False]
    html = c._repr_html_()
    assert f"job {original.id}" in html and f"job {fork.id}" in html and "re-served" in html
    jobs_before = len(ws.jobs())
    from IPython.core.error import UsageError as MagicUsageError

    with pytest.raises(MagicUsageError) as err:
        shell.run_line_magic("agent", f"fork {original.id} --at 4")
    assert str(err.value).startswith("%agent fork: --at 4: ") and "\n" not in str(err.value)
    assert len(ws.jobs()) == jobs_before


# -- fan-out and ask-first -----------------------------------------------------------------------------------------

def _fan_events(ws: Workspace, job: agentnb.Job) -> list[tuple[Any, ...]]:
    """The job's events with each child named by its place (child ids and models differ by design)."""
    kids = [s for e in job.events if e.kind == "transition" for s in e.subtasks or []]
    out = []
    for kind, seq, it, text in _run_events(job):
        for n, kid in enumerate(kids):
            text = (text.replace(f'"job_id": {kid.job_id},', f'"job_id": "child {n}",')
                    .replace(f'"model": "{kid.model}"', '"model": "child model"')
                    .replace(f"job {kid.job_id} (", f"child {n} ("))
        out.append((kind, seq, it, text))
    return out


def test_a_replay_of_a_fan_out_job_replays_its_children(ws: Workspace, tmp_path: Path) -> None:
    spec = write_script(tmp_path, "fan", {
        "split": [call("Read", path="input/x.txt"),
                  transition("WAIT_SUBTASKS", "split", subtasks=[{"instruction": "one", "piece": "single"},
                                                                  {"instruction": "two", "piece": "single"}])],
        "work": [call("Write", path="output/part.md", content="p"), transition("COMPLETE", "part")],
        "merge": [call("Write", path="output/result.md", content="merged"), transition("COMPLETE", "merged")]})
    job = ws.run(ws.submit("Fan", piece="fan-out", model=spec, inputs={"x.txt": "x"}))
    assert job.status == "succeeded"
    replay = ws.replay(job)
    assert replay.status == "succeeded"
    kids = [s for e in job.events if e.kind == "transition" for s in e.subtasks or []]
    mine = [s for e in replay.events if e.kind == "transition" for s in e.subtasks or []]
    # the replay's children are replays of the original's children, not of the parent's responses
    assert [s.model for s in mine] == [f"replay:{s.job_id}" for s in kids]
    for theirs, ours in zip(kids, mine, strict=True):
        child, again = ws.job(theirs.job_id), ws.job(ours.job_id)
        assert again.status == "succeeded" and _run_events(again) == _run_events(child)
        assert _tree(again.workdir) == _tree(child.workdir)
    assert _fan_events(ws, replay) == _fan_events(ws, job)
    assert _tree(replay.workdir) == _tree(job.workdir)
