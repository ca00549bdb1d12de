"""Loop monitors (docs/context.md#loop-monitors): a cycle of movements repeated ``threshold`` times is recorded as
``loop_detected`` and judged (a movement run named after the monitor) or sent to the monitor's ``next``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _scripting import transition, user_prompts, write_piece, write_script

from agentnb import Workspace
from agentnb.engine.pieces import load_piece, parse_piece
from agentnb.errors import PieceError
from agentnb.events import LoopDetected
from agentnb.views.render import job_html

REPO = Path(__file__).resolve().parent.parent
JUDGE = "judge:review/fix"


def _piece(tmp: Path, *, cycle3: bool = False, monitor: dict[str, Any] | None = None, name: str = "loopy") -> Path:
    """write → review ⇄ fix (or review → fix → check → review), with one loop monitor."""
    mvs: list[dict[str, Any]] = [
        {"name": "write", "instruction": "Write it.", "rules": [{"next": "review"}]},
        {"name": "review", "instruction": "Review it.",
         "rules": [{"condition": "good", "next": "COMPLETE"}, {"condition": "bad", "next": "fix"}]},
        {"name": "fix", "instruction": "Fix it.", "rules": [{"next": "check" if cycle3 else "review"}]},
    ]
    if cycle3:
        mvs.append({"name": "check", "instruction": "Check it.", "rules": [{"next": "review"}]})
    cycle = ["review", "fix", "check"] if cycle3 else ["review", "fix"]
    mon = monitor or {
        "cycle": cycle, "threshold": 2,
        "judge": {"persona": "You judge loops.", "instruction": "Decide.",
                  "rules": [{"condition": "progress", "next": "review"}, {"condition": "stuck", "next": "ABORT"}]},
    }
    return write_piece(tmp, name, {"max_movements": 40, "movements": mvs, "loop_monitors": [mon]})


def _rounds(n: int, cycle: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Scripts for ``n`` rounds of the cycle: each movement passes to the next, the last back to the first."""
    out: dict[str, list[dict[str, Any]]] = {"write": [transition("review", "wrote")]}
    for i, name in enumerate(cycle):
        nxt = cycle[(i + 1) % len(cycle)]
        out[name] = [transition(nxt, f"{name} round {r + 1}") for r in range(n)]
    return out


def _names(ws: Workspace, job: Any) -> list[str]:
    return [str(m) for m in ws.frames.movements(job)["movement"]]


def _loops(ws: Workspace, job: Any) -> list[LoopDetected]:
    return [e for e in ws.events(job, kinds=["loop_detected"]) if isinstance(e, LoopDetected)]


def test_judge_stops_a_two_movement_loop(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    script = _rounds(2, ["review", "fix"])
    script[JUDGE] = [transition("ABORT", "no progress: the same two issues come back")]
    job = ws.run(ws.submit("t", piece=str(_piece(tmp_path)), model=write_script(tmp_path, "s", script)))
    assert job.status == "aborted"
    assert _names(ws, job) == ["write", "review", "fix", "review", "fix", JUDGE]
    (ev,) = _loops(ws, job)
    assert (ev.cycle, ev.count, ev.movement_seq, ev.runs) == (["review", "fix"], 2, 5, [2, 3, 4, 5])
    assert ev.summaries == ["review round 1", "fix round 1", "review round 2", "fix round 2"]
    assert ev.payload["summaries"] == ev.summaries  # the stored payload: docs/events.md's fields
    # the judge's run is an ordinary movement run: its prompt holds the loop's summaries, no tools
    (prompt,) = user_prompts(ws, job, JUDGE)
    assert "Decide." in prompt and "review round 2" in prompt and "fix round 1" in prompt
    starts = [e for e in ws.events(job, kinds=["movement_start"]) if e.payload["movement"] == JUDGE]
    assert starts[0].payload["system"] == "You judge loops."
    mv = ws.frames.movements(job)
    assert list(mv["judge"]) == [False] * 5 + [True]
    assert mv["next_step"].iloc[-1] == "ABORT"
    # the job view: a loop badge on the run that closed the loop, saying which judge follows
    markup = job_html(ws, job.id)
    assert markup.count("⟳ loop review → fix ×2") == 1
    assert f"loop monitor {JUDGE}: runs 2–5; then {JUDGE}" in markup
    # and the exported transcript
    path = ws.export_notebook(job, tmp_path / "t.ipynb")
    assert f"⟳ loop review → fix ×2 (monitor {JUDGE}, runs 2, 3, 4, 5): then {JUDGE}" in Path(path).read_text()


def test_judge_says_go_on_then_is_asked_again_and_stops(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    script = _rounds(4, ["review", "fix"])
    script[JUDGE] = [transition("review", "progress: fewer issues"), transition("ABORT", "stuck")]
    job = ws.run(ws.submit("t", piece=str(_piece(tmp_path)), model=write_script(tmp_path, "s", script)))
    assert job.status == "aborted"
    assert _names(ws, job) == ["write", "review", "fix", "review", "fix", JUDGE,
                               "review", "fix", "review", "fix", JUDGE]
    first, second = _loops(ws, job)
    assert (first.movement_seq, second.movement_seq) == (5, 10)
    assert second.runs == [7, 8, 9, 10]  # the count started again after the first judgement
    assert second.summaries == ["review round 3", "fix round 3", "review round 4", "fix round 4"]
    assert "review round 4" in user_prompts(ws, job, JUDGE)[1] and "round 1" not in user_prompts(ws, job, JUDGE)[1]


def test_three_movement_cycle_without_judge(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    mon = {"cycle": ["review", "fix", "check"], "threshold": 2, "next": "ABORT"}
    piece = _piece(tmp_path, cycle3=True, monitor=mon)
    job = ws.run(ws.submit("t", piece=str(piece), model=write_script(tmp_path, "s", _rounds(3, ["review", "fix", "check"]))))
    assert job.status == "aborted"
    assert _names(ws, job) == ["write"] + ["review", "fix", "check"] * 2
    (ev,) = _loops(ws, job)
    assert (ev.cycle, ev.count, ev.judge, ev.next, ev.runs) == (["review", "fix", "check"], 2, None, "ABORT",
                                                                [2, 3, 4, 5, 6, 7])
    assert "loop" in (job.error or "")
    assert not ws.frames.movements(job)["judge"].any()


def test_three_movement_cycle_with_judge_and_a_monitor_sending_elsewhere(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    judge = "judge:review/fix/check"
    piece = _piece(tmp_path, cycle3=True, monitor={
        "cycle": ["review", "fix", "check"], "threshold": 1,
        "judge": {"instruction": "Decide.", "rules": [{"condition": "stuck", "next": "write"},
                                                      {"condition": "done", "next": "COMPLETE"}]}})
    script = _rounds(2, ["review", "fix", "check"])
    script["write"].append(transition("review", "rewrote"))
    script[judge] = [transition("write", "start over"), transition("COMPLETE", "good enough")]
    job = ws.run(ws.submit("t", piece=str(piece), model=write_script(tmp_path, "s", script)))
    assert job.status == "succeeded"
    assert _names(ws, job) == ["write", "review", "fix", "check", judge, "write", "review", "fix", "check", judge]
    assert [e.count for e in _loops(ws, job)] == [1, 1]


def test_a_run_that_leaves_the_cycle_is_no_loop(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    script = _rounds(2, ["review", "fix"])
    script["review"][1] = transition("COMPLETE", "all good")
    job = ws.run(ws.submit("t", piece=str(_piece(tmp_path)), model=write_script(tmp_path, "s", script)))
    assert job.status == "succeeded" and not _loops(ws, job)
    assert not ws.frames.movements(job)["judge"].any()


def test_resume_in_another_process_between_detection_and_judge(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    script = _rounds(2, ["review", "fix"])
    script[JUDGE] = [{"content": "Let me compare the rounds."}, transition("ABORT", "stuck")]
    spec = write_script(tmp_path, "s", script)
    job = ws.submit("t", piece=str(_piece(tmp_path)), model=spec)
    for _ in range(5):
        job = ws.step(job)
    assert len(_loops(ws, job)) == 1 and job.current_movement == JUDGE and job.status == "queued"
    code = ("import sys; from agentnb import Workspace; ws = Workspace(sys.argv[1]); "
            "print(getattr(ws, sys.argv[3])(int(sys.argv[2]), *sys.argv[4:]).status)")

    def other_process(*args: str) -> str:
        done = subprocess.run([sys.executable, "-c", code, str(ws.root), str(job.id), *args], capture_output=True,
                              text=True, cwd=REPO, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    # one process makes the judge's first call, another its second: the judge resumes like any run
    assert other_process("step", "call") == "queued"
    assert len(user_prompts(ws, job, JUDGE)) == 1 and len(_loops(ws, job)) == 1
    assert other_process("run") == "aborted"
    assert _names(ws, job) == ["write", "review", "fix", "review", "fix", JUDGE]
    assert len(_loops(ws, job)) == 1
    assert "review round 2" in user_prompts(ws, job, JUDGE)[0]
    judge_calls = [e for e in ws.events(job, kinds=["llm_request"]) if e.movement_seq == 6]
    assert len(judge_calls) == 2


def test_fork_across_a_judged_loop(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    script = _rounds(4, ["review", "fix"])
    script[JUDGE] = [transition("review", "progress"), transition("ABORT", "stuck")]
    original = ws.run(ws.submit("t", piece=str(_piece(tmp_path)), model=write_script(tmp_path, "s", script)))
    # the fork re-serves runs 1-7 (the judge's run 6 among them) and runs live from run 8 on
    live = _rounds(4, ["review", "fix"])
    live["fix"] = [transition("review", "fixed for good")] * 4
    live["review"] = [transition("COMPLETE", "all good")] * 4
    fork = ws.fork(original, at=8, model=write_script(tmp_path, "f", live))
    assert fork.status == "succeeded"
    mv = ws.frames.movements(fork)
    assert list(mv["movement"]) == ["write", "review", "fix", "review", "fix", JUDGE, "review", "fix", "review"]
    assert list(mv["judge"]) == [False] * 5 + [True] + [False] * 3
    assert list(mv["replayed"])[:7] == [True] * 7
    assert [e.movement_seq for e in _loops(ws, fork)] == [5]
    # a fork at the judge's own run runs it live
    again = ws.fork(original, at=6, model=write_script(tmp_path, "g", {JUDGE: [transition("ABORT", "stuck at once")]}))
    assert again.status == "aborted" and _names(ws, again)[-1] == JUDGE
    assert not ws.frames.movements(again)["replayed"].iloc[-1] and ws.frames.movements(again)["judge"].iloc[-1]
    assert "review round 2" in user_prompts(ws, again, JUDGE)[0]
    # a replay re-serves every response in order, the judges' too, and detects the same loops
    replay = ws.replay(original)
    assert replay.status == "aborted" and _names(ws, replay) == _names(ws, original)
    assert [(e.movement_seq, e.runs) for e in _loops(ws, replay)] == [(e.movement_seq, e.runs) for e in _loops(ws, original)]


def test_piece_round_trip_and_replace_movement(tmp_path: Path) -> None:
    piece = load_piece(_piece(tmp_path))
    (lm,) = piece.loop_monitors
    assert (lm.name, lm.cycle, lm.threshold, lm.next) == (JUDGE, ("review", "fix"), 2, None)
    assert lm.judge is not None and piece.movement(JUDGE) is lm.judge and lm.judge.tools == ()
    assert JUDGE not in piece.names
    again = parse_piece(piece.to_yaml(), source="again")
    assert again.loop_monitors == piece.loop_monitors
    replaced = piece.replace_movement("fix", instruction="Fix it well.")
    assert replaced.loop_monitors == piece.loop_monitors
    assert "loop_monitors" not in load_piece("plan-implement-verify").to_dict()


def test_shipped_review_loop_piece(tmp_path: Path) -> None:
    for path in (REPO / "pieces" / "review-loop.yaml", REPO / "agentnb" / "pieces" / "review-loop.yaml"):
        piece = load_piece(path)
        assert piece.loop_monitors and piece.loop_monitors[0].judge is not None
    assert (REPO / "pieces" / "review-loop.yaml").read_text() == (REPO / "agentnb/pieces/review-loop.yaml").read_text()
    # by name, as a user runs it: three rounds of review/fix, then its judge stops the loop
    ws = Workspace(tmp_path / "ws")
    script = _rounds(3, ["review", "fix"])
    script["review"] = [transition("fix", f"review round {r}", feedback="the title is still wrong") for r in (1, 2, 3)]
    script["judge"] = [transition("ABORT", "the same issue keeps coming back")]
    job = ws.run(ws.submit("t", piece="review-loop", model=write_script(tmp_path, "s", script)))
    assert job.status == "aborted"
    assert _names(ws, job) == ["write"] + ["review", "fix"] * 3 + ["judge"]
    assert "the title is still wrong" in user_prompts(ws, job, "fix")[0]  # review verifies fix: its feedback


_BASE = """name: p
movements:
  - name: review
    instruction: r
    rules: [{next: fix}]
  - name: fix
    instruction: f
    rules: [{next: review}]
loop_monitors:
"""


@pytest.mark.parametrize(("monitor", "line", "field", "words"), [
    ("  - {cycle: [review, nope], threshold: 2, next: ABORT}", 10, "loop_monitors[0].cycle[1]", "unknown movement 'nope'"),
    ("  - {cycle: [review, fix], threshold: 0, next: ABORT}", 10, "loop_monitors[0].threshold", "whole number ≥ 1"),
    ("  - {cycle: [review, fix], threshold: 2.5, next: ABORT}", 10, "loop_monitors[0].threshold", "whole number"),
    ("  - {cycle: [review, fix], threshold: 2}", 10, "loop_monitors[0].judge", "exactly one of 'judge' and 'next'"),
    ("  - {cycle: [review, fix], threshold: 2, next: ABORT, judge: {rules: [{next: fix}]}}", 10,
     "loop_monitors[0].judge", "exactly one"),
    ("  - {cycle: [review, fix], threshold: 2, next: elsewhere}", 10, "loop_monitors[0].next",
     "unknown movement 'elsewhere'"),
    ("  - cycle: [review, fix]\n    threshold: 2\n    judge:\n      rules:\n        - {next: nowhere}", 14,
     "loop_monitors[0].judge.rules[0].next", "unknown movement 'nowhere'"),
    ("  - {cycle: [review, fix], threshold: 2, next: ABORT, every: 3}", 10, "loop_monitors[0].every", "unknown key"),
    ("  - {cycle: [], threshold: 2, next: ABORT}", 10, "loop_monitors[0].cycle", "at least one movement"),
    ("  - {threshold: 2, next: ABORT}", 10, "loop_monitors[0].cycle", "missing required key 'cycle'"),
    ("  - {cycle: [review, fix], threshold: 2, next: ABORT, name: fix}", 10, "loop_monitors[0].name",
     "name of a movement"),
    ("  - {cycle: [review, fix], threshold: 2, judge: {rules: [{next: fix}], tools: [Bash]}}", 10,
     "loop_monitors[0].judge.tools", "unknown key"),
    ("  - {cycle: [review, fix], threshold: 2, next: ASK}", 10, "loop_monitors[0].next",
     "found 'ASK', which a loop monitor cannot go to"),
    ("  - {cycle: [review, fix], threshold: 2, judge: {rules: [{next: WAIT_SUBTASKS}]}}", 10,
     "loop_monitors[0].judge.rules[0].next", "'WAIT_SUBTASKS', which a loop monitor cannot go to"),
])
def test_validation_errors_name_file_line_and_field(tmp_path: Path, monitor: str, line: int, field: str,
                                                    words: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(_BASE + monitor + "\n", encoding="utf-8")
    with pytest.raises(PieceError) as err:
        load_piece(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}:{line}: {field}: "), message
    assert words in message, message
