"""Loop monitors (docs/context.md#loop-monitors): a cycle of movements repeated ``threshold`` times is recorded as
``loop_detected`` and judged (a movement run named after the monitor) or sent to the monitor's ``next``.

Then two- and three-movement cycles with and without a judge, two monitors in one piece, forced runs and
validation on a four-movement piece; a loop monitor and compaction in one job, resumed, forked and replayed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _resuming import comparable, step_in_children, timeless
from _scripting import call, transition, user_prompts, write_piece, write_script
from openai_server import OpenAIServer, reply

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


# -- a four-movement piece: write → review ⇄ fix, review → test ----------------------------------------------------
MODEL = "openai:gpt-4o-mini"
WINDOW = 4_000  # warn 2,800 · prompt 3,400 · force_transition 3,800


@pytest.fixture
def server(loopback: Callable[..., OpenAIServer]) -> OpenAIServer:
    return loopback("sk-loop-test-0000", retries="0", timeout="30")


def tools(prompt: int, *calls: tuple[str, dict[str, Any]], content: str | None = None) -> dict[str, Any]:
    return reply(content, list(calls), usage=(prompt, 10))


def go(step: str, prompt: int = 900, summary: str = "done") -> dict[str, Any]:
    return reply(None, [("transition", {"next_step": step, "summary": summary})], usage=(prompt, 10))


def of(ws: Workspace, job: Any, kind: str) -> list[Any]:
    return ws.events(job, kinds=[kind])


def payloads(ws: Workspace, job: Any, kind: str) -> list[dict[str, Any]]:
    return [e.payload for e in of(ws, job, kind)]


def g(prompt: int, tool: str = "Glob", **arguments: Any) -> dict[str, Any]:
    args = arguments or {"pattern": "*"}
    return {**call(tool, **args), "usage": {"prompt_tokens": prompt, "completion_tokens": 10}}


def summary(words: str) -> dict[str, Any]:
    return {"content": words, "usage": {"prompt_tokens": 3_600, "completion_tokens": 20}}


def loop_piece(tmp: Path, monitors: list[dict[str, Any]], *, name: str = "loops",
               context: dict[str, Any] | None = None, extra: dict[str, dict[str, Any]] | None = None) -> Path:
    """write → review → fix → review … ; review may also go to test, fix back to write; test → review | COMPLETE."""
    mvs: list[dict[str, Any]] = [
        {"name": "write", "instruction": "Write it.", "tools": ["Glob"], "rules": [{"next": "review"}]},
        {"name": "review", "instruction": "Review it.", "tools": ["Glob"],
         "rules": [{"condition": "issues", "next": "fix"}, {"condition": "needs tests", "next": "test"},
                   {"condition": "good", "next": "COMPLETE"}], "default_next": "fix"},
        {"name": "fix", "instruction": "Fix it.", "tools": ["Glob"],
         "rules": [{"condition": "start over", "next": "write"}, {"condition": "fixed", "next": "review"},
                   {"condition": "check", "next": "test"}], "default_next": "review"},
        {"name": "test", "instruction": "Test it.", "tools": ["Glob"],
         "rules": [{"condition": "failing", "next": "review"}, {"condition": "passing", "next": "COMPLETE"}]},
    ]
    for m in mvs:
        m.update((extra or {}).get(m["name"], {}))
    body: dict[str, Any] = {"max_movements": 60, "movements": mvs, "loop_monitors": monitors}
    if context is not None:
        body["context"] = context
    return write_piece(tmp, name, body)


def judged(threshold: int, *targets: str, cycle: tuple[str, ...] = ("review", "fix"), **more: Any) -> dict[str, Any]:
    return {"cycle": list(cycle), "threshold": threshold, **more,
            "judge": {"persona": "You judge loops.", "instruction": "Decide whether to go on.",
                      "rules": [{"condition": f"choose {t}", "next": t} for t in targets]}}


def loops_of(ws: Workspace, job: Any) -> list[dict[str, Any]]:
    return [{**e.payload, "seq": e.movement_seq} for e in of(ws, job, "loop_detected")]


def test_judge_goes_on_then_sends_to_a_movement_outside_the_cycle(tmp_path: Path) -> None:
    p = loop_piece(tmp_path, [judged(2, "review", "test", "ABORT")])
    spec = write_script(tmp_path, "s", {
        "write": [transition("review", "wrote v1")],
        "review": [transition("fix", f"review {i}: two issues") for i in (1, 2, 3, 4)],
        "fix": [transition("review", f"fix {i}") for i in (1, 2, 3, 4)],
        JUDGE: [transition("review", "fewer issues each round: go on"), transition("test", "enough: test it")],
        "test": [transition("COMPLETE", "tests pass")],
    })
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec))
    assert job.status == "succeeded", job.error
    assert _names(ws, job) == ["write", "review", "fix", "review", "fix", JUDGE,
                              "review", "fix", "review", "fix", JUDGE, "test"]
    first, second = loops_of(ws, job)
    assert (first["seq"], first["cycle"], first["count"], first["runs"]) == (5, ["review", "fix"], 2, [2, 3, 4, 5])
    assert first["summaries"] == ["review 1: two issues", "fix 1", "review 2: two issues", "fix 2"]
    assert (second["seq"], second["runs"]) == (10, [7, 8, 9, 10])
    assert second["summaries"] == ["review 3: two issues", "fix 3", "review 4: two issues", "fix 4"]
    assert first["judge"] == second["judge"] == JUDGE and first["next"] is None
    prompts = user_prompts(ws, job, JUDGE)
    assert all(s in prompts[0] for s in first["summaries"]) and "Decide whether to go on." in prompts[0]
    assert all(s in prompts[1] for s in second["summaries"]) and "review 2" not in prompts[1]
    mv = ws.frames.movements(job)
    assert [bool(j) for j in mv["judge"]] == [n == JUDGE for n in _names(ws, job)]
    assert list(mv["next_step"])[5] == "review" and list(mv["next_step"])[10] == "test"
    markup = job_html(ws, job.id)
    assert markup.count("⟳ loop review → fix ×2") == 2


def test_the_judge_is_sent_its_persona_the_summaries_and_only_the_transition_tool(server: OpenAIServer,
                                                                                    tmp_path: Path) -> None:
    p = loop_piece(tmp_path, [judged(2, "review", "ABORT")])
    server.play(go("review", summary="wrote"), go("fix", summary="R1: the title is wrong"),
                go("review", summary="F1: retitled"), go("fix", summary="R2: the title is still wrong"),
                go("review", summary="F2: retitled again"), go("ABORT", summary="stuck on the title"))
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=MODEL))
    assert job.status == "aborted", job.error
    judge = server.received[-1].body
    assert judge["messages"][0] == {"role": "system", "content": "You judge loops."}
    assert [t["function"]["name"] for t in judge["tools"]] == ["transition"]
    user = judge["messages"][1]["content"]
    for words in ("Decide whether to go on.", "R1: the title is wrong", "F1: retitled", "R2: the title is still wrong",
                  "F2: retitled again"):
        assert words in user
    assert user.index("R1: the title") < user.index("F1: retitled") < user.index("F2: retitled again")
    enum = judge["tools"][0]["function"]["parameters"]["properties"]["next_step"].get("enum")
    assert enum is None or set(enum) == {"review", "ABORT"}


def test_a_judged_loop_stepped_one_call_per_process_sends_the_same_messages(server: OpenAIServer,
                                                                            tmp_path: Path) -> None:
    p = loop_piece(tmp_path, [judged(2, "review", "ABORT")])
    actions = [go("review", summary="wrote"), tools(1_000, ("Glob", {"pattern": "*"})),
               go("fix", summary="R1"), go("review", summary="F1"), go("fix", summary="R2"),
               tools(1_200, ("Glob", {"pattern": "output/*"})), go("review", summary="F2"),
               tools(900, content="Comparing the rounds."), go("ABORT", summary="stuck")]
    server.play(*actions)
    straight_ws = Workspace(tmp_path / "straight")
    straight = straight_ws.run(straight_ws.submit("t", piece=str(p), model=MODEL))
    assert straight.status == "aborted", straight.error
    with OpenAIServer(actions=list(actions)) as other:
        ws = Workspace(tmp_path / "stepped")
        job = ws.submit("t", piece=str(p), model=MODEL)
        assert step_in_children(ws, job, env={**os.environ, "OPENAI_BASE_URL": other.base_url})[-1] == "aborted"
        assert timeless([r.body for r in other.received]) == timeless([r.body for r in server.received])
    assert timeless(comparable(ws, job)) == timeless(comparable(straight_ws, straight))
    assert _names(ws, job) == ["write", "review", "fix", "review", "fix", JUDGE]


def test_a_monitor_without_a_judge_may_complete_the_job(tmp_path: Path) -> None:
    p = loop_piece(tmp_path, [{"cycle": ["review", "fix", "test"], "threshold": 1, "next": "COMPLETE"}])
    spec = write_script(tmp_path, "s", {"write": [transition("review")], "review": [transition("fix", "r1")],
                                        "fix": [transition("test", "f1")], "test": [transition("review", "t1")]})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec))
    assert job.status == "succeeded", job.error
    assert _names(ws, job) == ["write", "review", "fix", "test"]
    (ev,) = loops_of(ws, job)
    assert (ev["cycle"], ev["count"], ev["runs"], ev["summaries"], ev["next"]) == (
        ["review", "fix", "test"], 1, [2, 3, 4], ["r1", "f1", "t1"], "COMPLETE")
    # the run's own transition is recorded as the model made it; the monitor decided where the job went
    assert payloads(ws, job, "transition")[-1]["next_step"] == "review"


def test_judge_says_complete(tmp_path: Path) -> None:
    p = loop_piece(tmp_path, [judged(3, "COMPLETE", "ABORT")])
    spec = write_script(tmp_path, "s", {
        "write": [transition("review")], "review": [transition("fix", f"r{i}") for i in range(3)],
        "fix": [transition("review", f"f{i}") for i in range(3)],
        JUDGE: [transition("COMPLETE", "good enough after three rounds")]})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec))
    assert job.status == "succeeded"
    assert _names(ws, job) == ["write"] + ["review", "fix"] * 3 + [JUDGE]
    (ev,) = loops_of(ws, job)
    assert ev["count"] == 3 and ev["runs"] == [2, 3, 4, 5, 6, 7]


def test_two_monitors_in_one_piece_each_fire_on_their_own_cycle(tmp_path: Path) -> None:
    monitors = [judged(2, "review", "ABORT"),
                {"name": "tests-loop", "cycle": ["review", "test"], "threshold": 2, "next": "ABORT"}]
    p = loop_piece(tmp_path, monitors)
    ws = Workspace(tmp_path / "ws")
    # review ⇄ test twice: the second monitor aborts, the first never fires
    a = ws.run(ws.submit("t", piece=str(p), model=write_script(tmp_path, "a", {
        "write": [transition("review")], "review": [transition("test", f"r{i}") for i in range(3)],
        "test": [transition("review", f"t{i}") for i in range(3)]})))
    assert a.status == "aborted"
    assert _names(ws, a) == ["write", "review", "test", "review", "test"]
    (ev,) = loops_of(ws, a)
    assert (ev["monitor"], ev["cycle"], ev["judge"], ev["next"]) == ("tests-loop", ["review", "test"], None, "ABORT")
    assert a.error == "loop monitor tests-loop: review → test repeated 2 times"
    markup = job_html(ws, a.id)
    assert markup.count("⟳ loop review → test ×2") == 1 and "loop monitor tests-loop: runs 2–5; then ABORT" in markup
    assert not ws.frames.movements(a)["judge"].any()
    # mixed: review→fix→review→test→review→fix→review→fix: the first monitor's cycle ends the history twice
    # only after the test detour, counted from the runs themselves
    b = ws.run(ws.submit("t", piece=str(p), model=write_script(tmp_path, "b", {
        "write": [transition("review")],
        "review": [transition("fix", "r1"), transition("test", "r2"), transition("fix", "r3"), transition("fix", "r4"),
                   transition("COMPLETE", "r5")],
        "fix": [transition("review", f"f{i}") for i in (1, 2, 3)],
        "test": [transition("review", "t1")],
        JUDGE: [transition("review", "go on")]})))
    assert b.status == "succeeded", b.error
    assert _names(ws, b) == ["write", "review", "fix", "review", "test", "review", "fix", "review", "fix", JUDGE,
                            "review"]
    (ev,) = loops_of(ws, b)
    assert (ev["monitor"], ev["runs"]) == (JUDGE, [6, 7, 8, 9])
    mv = ws.frames.movements(b)
    assert [bool(j) for j in mv["judge"]] == [False] * 9 + [True, False]


def test_a_three_movement_cycle_left_before_the_threshold_counts_again_from_scratch(tmp_path: Path) -> None:
    judge = "judge:review/fix/test"
    p = loop_piece(tmp_path, [judged(2, "COMPLETE", "ABORT", cycle=("review", "fix", "test"))],
                   extra={"test": {"rules": [{"condition": "failing", "next": "review"},
                                             {"condition": "passing", "next": "COMPLETE"}]}})
    spec = write_script(tmp_path, "s", {
        "write": [transition("review", "w1"), transition("review", "w2")],
        "review": [transition("fix", f"r{i}") for i in range(1, 6)],
        "fix": [transition("test", "f1"), transition("write", "f2: start over"),
                transition("test", "f3"), transition("test", "f4"), transition("test", "f5")],
        "test": [transition("review", f"t{i}") for i in range(1, 5)],
        judge: [transition("ABORT", "round and round")]})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec))
    assert job.status == "aborted"
    assert _names(ws, job) == ["write", "review", "fix", "test", "review", "fix", "write",
                              "review", "fix", "test", "review", "fix", "test", judge]
    (ev,) = loops_of(ws, job)
    assert ev["runs"] == [8, 9, 10, 11, 12, 13] and ev["summaries"] == ["r3", "f3", "t2", "r4", "f4", "t3"]
    assert ev["cycle"] == ["review", "fix", "test"]


def test_a_loop_of_forced_runs_is_detected_with_their_forced_summaries(tmp_path: Path) -> None:
    # fix never transitions (max_iterations 1 → default_next review); review crosses 95 % (→ default_next fix)
    p = loop_piece(tmp_path, [{"cycle": ["review", "fix"], "threshold": 2, "next": "test"}],
                   context={"window_tokens": WINDOW}, extra={"fix": {"max_iterations": 1}})
    spec = write_script(tmp_path, "s", {
        "write": [transition("review")],
        "review": [g(3_900), g(3_900)],
        "fix": [{"content": "I am thinking."}, {"content": "Still thinking."}],
        "test": [transition("COMPLETE", "passes")]})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec))
    assert job.status == "succeeded", job.error
    assert _names(ws, job) == ["write", "review", "fix", "review", "fix", "test"]
    (ev,) = loops_of(ws, job)
    assert ev["next"] == "test" and ev["judge"] is None and ev["runs"] == [2, 3, 4, 5]
    assert all(s.startswith("Forced transition: ") for s in ev["summaries"])
    assert "force_transition (95%)" in ev["summaries"][0] and "max_iterations (1)" in ev["summaries"][1]
    assert [bool(f) for f in ws.frames.movements(job)["forced"]] == [False, True, True, True, True, False]


def test_a_one_movement_cycle_and_a_monitor_sending_to_a_movement(tmp_path: Path) -> None:
    # fix → fix three times is a loop of one movement; its monitor sends the job to test, with no judge
    p = loop_piece(tmp_path, [{"name": "self", "cycle": ["fix"], "threshold": 3, "next": "test"}],
                   extra={"fix": {"rules": [{"condition": "again", "next": "fix"},
                                            {"condition": "fixed", "next": "review"}]}})
    spec = write_script(tmp_path, "s", {
        "write": [transition("review")], "review": [transition("fix", "r1")],
        "fix": [transition("fix", f"f{i}") for i in range(1, 6)], "test": [transition("COMPLETE", "ok")]})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec))
    assert job.status == "succeeded", job.error
    assert _names(ws, job) == ["write", "review", "fix", "fix", "fix", "test"]
    (ev,) = loops_of(ws, job)
    assert (ev["monitor"], ev["cycle"], ev["count"], ev["runs"], ev["next"]) == ("self", ["fix"], 3, [3, 4, 5], "test")
    assert ev["summaries"] == ["f1", "f2", "f3"]
    assert "⟳ loop fix ×3" in job_html(ws, job.id)


@pytest.mark.parametrize(("yaml_text", "line", "field", "words"), [
    ("loop_monitors:\n  - cycle: [review, fix]\n    threshold: 2\n    next: ABORT\n"
     "  - cycle:\n      - review\n      - nowhere\n    threshold: 2\n    next: ABORT\n",
     15, "loop_monitors[1].cycle[1]", "unknown movement 'nowhere'"),
    ("loop_monitors:\n  - cycle: [review, fix]\n    threshold: 2\n    judge:\n      instruction: x\n"
     "      rules:\n        - {condition: a, next: review}\n        - {condition: b, next: elsewhere}\n",
     16, "loop_monitors[0].judge.rules[1].next", "unknown movement 'elsewhere'"),
    ("loop_monitors:\n  - cycle: [review, fix]\n    threshold: 2\n    next: ABORT\n    judge:\n"
     "      rules: [{next: review}]\n", 10, "loop_monitors[0].judge", "exactly one of 'judge' and 'next'"),
    ("loop_monitors:\n  - cycle: [review, fix]\n    threshold: 0\n    next: ABORT\n", 11,
     "loop_monitors[0].threshold", "whole number ≥ 1"),
    ("loop_monitors:\n  - cycle: [review, fix]\n    threshold: -3\n    next: ABORT\n", 11,
     "loop_monitors[0].threshold", "whole number ≥ 1"),
    ("loop_monitors:\n  - cycle: [review, fix]\n    threshold: true\n    next: ABORT\n", 11,
     "loop_monitors[0].threshold", "whole number"),
    ("loop_monitors:\n  - {cycle: [review, fix], threshold: 2, judge: {rules: [{next: review}]}}\n"
     "  - {cycle: [review, fix], threshold: 3, judge: {rules: [{next: ABORT}]}}\n", 11,
     "loop_monitors[1].name", "duplicate loop monitor name 'judge:review/fix'"),
    ("loop_monitors:\n  - {cycle: review, threshold: 2, next: ABORT}\n", 10, "loop_monitors[0].cycle", "list"),
    ("loop_monitors: {cycle: [review, fix]}\n", 9, "loop_monitors", "list"),
], ids=["unknown-in-second-monitor", "judge-rule-target", "judge-and-next", "threshold-0", "threshold-negative",
        "threshold-bool", "same-default-name", "cycle-not-a-list", "monitors-not-a-list"])
def test_more_validation_errors_name_file_line_and_field(tmp_path: Path, yaml_text: str, line: int, field: str,
                                                         words: str) -> None:
    base = ("name: p\nmovements:\n  - name: review\n    instruction: r\n    rules: [{next: fix}]\n"
            "  - name: fix\n    instruction: f\n    rules: [{next: review}]\n")
    path = tmp_path / "bad.yaml"
    path.write_text(base + yaml_text, encoding="utf-8")
    with pytest.raises(PieceError) as err:
        load_piece(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}:{line}: {field}: "), message
    assert words in message, message


# -- a loop monitor and compaction in one job; resumed, forked, replayed -------------------------------------------
def loop_and_compaction(tmp: Path) -> tuple[Path, str]:
    """review ⇄ fix twice; fix compacts in each run (its own context), the judge compacts (the piece's context
    reaches it) then aborts."""
    p = loop_piece(tmp, [judged(2, "review", "ABORT")],
                   context={"window_tokens": WINDOW, "on_pressure": "compact", "compact_keep_last": 2},
                   extra={"review": {"context": {"on_pressure": "transition"}},
                          # one compaction per run: max_compactions counts per movement run, not per name
                          "fix": {"context": {"compact_keep_last": 1, "max_compactions": 1}}})
    spec = write_script(tmp, "s", {
        "write": [transition("review", "wrote")],
        "review": [g(1_000), transition("fix", "review 1"), g(1_000), transition("fix", "review 2")],
        "fix": [g(1_000), g(1_500), g(3_500), summary("FIX-SUM-1"), g(1_000), transition("review", "fix 1"),
                g(1_000), g(1_500), g(3_500), summary("FIX-SUM-2"), transition("review", "fix 2")],
        JUDGE: [{"content": "Round one fixed a typo.", "usage": {"prompt_tokens": 1_000, "completion_tokens": 10}},
                {"content": "Round two fixed the same typo.",
                 "usage": {"prompt_tokens": 3_500, "completion_tokens": 10}},
                summary("JUDGE-SUM"),
                transition("ABORT", "the same typo twice: stuck")],
    })
    return p, spec


def test_a_compacting_movement_inside_a_cycle_and_a_compacting_judge(tmp_path: Path) -> None:
    p, spec = loop_and_compaction(tmp_path)
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec))
    assert job.status == "aborted", job.error
    assert _names(ws, job) == ["write", "review", "fix", "review", "fix", JUDGE]
    seq_name = dict(enumerate(_names(ws, job), start=1))
    comps = of(ws, job, "compaction")
    assert [(seq_name[c.movement_seq], c.payload["summary"]) for c in comps] == [
        ("fix", "FIX-SUM-1"), ("fix", "FIX-SUM-2"), (JUDGE, "JUDGE-SUM")]
    # fix keeps 1 (its own setting): the last Glob call with its result → 2 messages; the judge keeps 2 of
    # [sys, user, a, reminder, a, reminder]
    assert [(c.payload["removed_messages"], c.payload["kept_messages"]) for c in comps] == [(4, 2), (4, 2), (2, 2)]
    (ev,) = loops_of(ws, job)
    assert ev["summaries"] == ["review 1", "fix 1", "review 2", "fix 2"]
    # the judge compacted but its loop summaries are still in its user prompt (message 1, never summarised)
    (start,) = [e for e in of(ws, job, "movement_start") if e.payload["movement"] == JUDGE]
    assert all(s in start.payload["user"] for s in ev["summaries"])
    reminders = [(seq_name[e.movement_seq], e.payload["reason"]) for e in of(ws, job, "reminder")]
    assert reminders == [(JUDGE, "no tool call"), (JUDGE, "no tool call")]
    usage = ws.frames.usage(job)
    assert list(usage[usage["action"] == "compaction"]["movement"]) == ["fix", "fix", JUDGE]
    markup = job_html(ws, job.id)
    assert "⟳ loop review → fix ×2" in markup and "FIX-SUM-2" in markup and "JUDGE-SUM" in markup


def test_loop_and_compaction_stepped_one_call_per_process_equals_a_straight_run(tmp_path: Path) -> None:
    p, spec = loop_and_compaction(tmp_path)
    straight_ws = Workspace(tmp_path / "straight")
    straight = straight_ws.run(straight_ws.submit("t", piece=str(p), model=spec))
    ws = Workspace(tmp_path / "stepped")
    job = ws.submit("t", piece=str(p), model=spec)
    statuses = step_in_children(ws, job)
    assert statuses[-1] == straight.status == "aborted"
    assert comparable(ws, job) == comparable(straight_ws, straight)


def test_loop_and_compaction_forked_and_replayed(tmp_path: Path) -> None:
    p, spec = loop_and_compaction(tmp_path)
    ws = Workspace(tmp_path / "ws")
    original = ws.run(ws.submit("t", piece=str(p), model=spec))
    # a replay re-serves every call, the summaries too, and detects the same loop
    replay = ws.replay(original)
    assert replay.status == "aborted", replay.error
    assert ws.compare(original, replay).first_divergence is None
    assert [c.payload["summary"] for c in of(ws, replay, "compaction")] == ["FIX-SUM-1", "FIX-SUM-2", "JUDGE-SUM"]
    assert [(e["runs"], e["summaries"]) for e in loops_of(ws, replay)] == [
        (e["runs"], e["summaries"]) for e in loops_of(ws, original)]
    # a fork at the judge's run: runs 1-5 re-served (their compactions at 0 tokens), the judge live, compacting
    # again with its own summary and going on instead
    live = write_script(tmp_path, "live", {
        JUDGE: [{"content": "A.", "usage": {"prompt_tokens": 1_000, "completion_tokens": 10}},
                {"content": "B.", "usage": {"prompt_tokens": 3_600, "completion_tokens": 10}},
                summary("NEW-JUDGE-SUM"), transition("review", "one more round")],
        # the scripted model counts a movement's calls over the whole job: the 4 re-served review calls first
        "review": [{"content": "unused"}] * 4 + [transition("COMPLETE", "clean now")]})
    fork = ws.fork(original, at=6, model=live)
    assert fork.status == "succeeded", fork.error
    assert _names(ws, fork) == ["write", "review", "fix", "review", "fix", JUDGE, "review"]
    assert [bool(r) for r in ws.frames.movements(fork)["replayed"]] == [True] * 5 + [False, False]
    comps = of(ws, fork, "compaction")
    assert [c.payload["summary"] for c in comps] == ["FIX-SUM-1", "FIX-SUM-2", "NEW-JUDGE-SUM"]
    usage = ws.frames.usage(fork)
    re_served = usage[(usage["action"] == "compaction") & (usage["seq"] < 6)]
    assert list(re_served["total_tokens"]) == [0, 0]
    (ev,) = loops_of(ws, fork)
    assert ev["runs"] == [2, 3, 4, 5] and ev["seq"] == 5
    assert "fix 2" in user_prompts(ws, fork, JUDGE)[0]
    # a fork at fix's second run: it runs live (a new summary), and the loop is detected at its end again
    live2 = write_script(tmp_path, "live2", {
        "fix": [{"content": "unused"}] * 6
        + [g(1_000), g(1_500), g(3_500), summary("OTHER-FIX-SUM"), transition("review", "fix 2 again")],
        JUDGE: [transition("ABORT", "stuck")]})
    fork2 = ws.fork(original, at=5, model=live2)
    assert fork2.status == "aborted", fork2.error
    assert [c.payload["summary"] for c in of(ws, fork2, "compaction")] == ["FIX-SUM-1", "OTHER-FIX-SUM"]
    (ev2,) = loops_of(ws, fork2)
    assert ev2["summaries"] == ["review 1", "fix 1", "review 2", "fix 2 again"]
