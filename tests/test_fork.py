"""Forks and replays (docs/fork-compare.md#fork): re-served runs spend nothing, rebuild the work directory and are checked."""

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

import pytest
import yaml
from _scripting import call, transition, write_script
from openai_server import OpenAIServer, reply

import agentnb
from agentnb import Workspace
from agentnb.errors import PieceError, UsageError
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


# -- refusals: one line, nothing stored ------------------------------------------------------------------------

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


# -- replay ---------------------------------------------------------------------------------------------------

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
