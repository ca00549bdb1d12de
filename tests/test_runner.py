"""The piece runner and agent loop: transitions, end states, lessons, reminders, limits and tool checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, say, transition, write_piece, write_script

import agentnb
from agentnb import Workspace
from agentnb.engine.prompts import MAX_LESSON_CHARS

AB = """
name: ab
max_movements: {max_movements}
{extra}
movements:
  - name: a
    persona: You are A.
    instruction: Do part A.
    tools: [Read, Write, shout, explode]
    permission: {permission}
    max_iterations: {max_iterations}
    rules:
      - {{condition: A is done, next: b}}
    {default_next}
  - name: b
    persona: You are B.
    instruction: Do part B.
    tools: [Read]
    rules:
      - {{condition: all done, next: COMPLETE}}
      - {{condition: A must be redone, next: a}}
"""


@pytest.fixture(autouse=True)
def user_tools():
    """Two user tools, defined here like in a notebook cell."""

    @agentnb.tool
    def shout(text: str, times: int = 1) -> str:
        """Upper-case a text.

        Args:
            text: what to shout
            times: how often
        """
        return " ".join([text.upper()] * times)

    @agentnb.tool(permission="full")
    def explode(reason: str) -> str:
        """Always fails."""
        raise RuntimeError(f"boom: {reason}")

    yield
    agentnb.tools.base.unregister("shout")
    agentnb.tools.base.unregister("explode")


def _piece(tmp_path: Path, *, max_movements: int = 6, permission: str = "edit", max_iterations: int = 8,
           default_next: str | None = "b", extra: str = "") -> Path:
    return write_piece(tmp_path, "piece", AB.format(
        max_movements=max_movements, permission=permission, max_iterations=max_iterations, extra=extra,
        default_next=f"default_next: {default_next}" if default_next else "",
    ))


def _run(ws: Workspace, tmp_path: Path, script: dict[str, Any], **piece: Any):
    job = ws.submit("the task", piece=_piece(tmp_path, **piece), model=write_script(tmp_path, "script", **script))
    return ws.run(job)


def _payloads(ws: Workspace, job, kind: str) -> list[dict[str, Any]]:
    return [e.payload for e in ws.events(job, kinds=[kind])]


def test_complete_succeeds_and_records_transitions(ws: Workspace, tmp_path: Path) -> None:
    job = _run(ws, tmp_path, {"responses": [transition("b", "A done", lessons="A was easy"),
                                            transition("COMPLETE", "B done", lessons="B too")]})
    assert job.status == "succeeded" and job.error is None
    assert [t["next_step"] for t in _payloads(ws, job, "transition")] == ["b", "COMPLETE"]
    assert [t["forced"] for t in _payloads(ws, job, "transition")] == [False, False]
    assert [(m["name"], m["next_step"], m["status"]) for m in ws.movements(job)] == [
        ("a", "b", "done"), ("b", "COMPLETE", "done")]


def test_abort_ends_the_job_aborted(ws: Workspace, tmp_path: Path) -> None:
    job = _run(ws, tmp_path, {"responses": [transition("ABORT", "the input is unusable")]})
    assert job.status == "aborted"
    assert job.error == "the input is unusable"
    assert _payloads(ws, job, "job_status")[-1] == {"status": "aborted", "reason": "a → ABORT"}


def test_a_next_step_that_is_not_allowed_is_a_tool_error_and_the_movement_goes_on(ws: Workspace, tmp_path: Path) -> None:
    job = _run(ws, tmp_path, {"responses": [
        transition("verify", "wrong target"),          # not a movement at all
        transition("a", "a is not a rule target of a"),  # a real movement, but not allowed from a
        transition("b", "now right"),
        transition("COMPLETE"),
    ]})
    assert job.status == "succeeded", job.error
    results = [r for r in _payloads(ws, job, "tool_result") if r["tool"] == "transition"]
    assert results[0]["is_error"] and results[1]["is_error"] and not results[2]["is_error"]
    assert results[0]["content"] == ("Error: next_step 'verify' is not allowed here; "
                                     "allowed: b, ABORT")
    assert "'a' is not allowed here" in results[1]["content"]
    assert ws.movements(job)[0]["iterations"] == 3  # the same movement continued
    assert [t["next_step"] for t in _payloads(ws, job, "transition")] == ["b", "COMPLETE"]


def test_exceeding_max_movements_fails_with_that_reason(ws: Workspace, tmp_path: Path) -> None:
    script = {"movements": {"a": [transition("b")] * 5, "b": [transition("a")] * 5}}
    job = _run(ws, tmp_path, script, max_movements=3)
    assert job.status == "failed"
    assert job.error == "max_movements (3) exceeded: the piece ran 3 movements and wanted to start 'b'"
    assert len(ws.movements(job)) == 3
    assert _payloads(ws, job, "error")[-1]["message"] == job.error
    assert _payloads(ws, job, "job_status")[-1]["reason"] == job.error


def test_messages_are_not_carried_between_movements(ws: Workspace, tmp_path: Path) -> None:
    job = _run(ws, tmp_path, {"responses": [
        call("shout", text="hello"), say("thinking"), transition("b", "A done"), transition("COMPLETE"),
    ]})
    assert job.status == "succeeded", job.error
    requests = ws.events(job, kinds=["llm_request"])
    by_seq = {}
    for r in requests:
        by_seq.setdefault(r.movement_seq, []).append(r.payload["messages"])
    # movement a grows: system+user, +assistant+tool, +assistant+reminder
    assert by_seq[1] == [2, 4, 6]
    # movement b starts again from its own system + user prompt only
    assert by_seq[2] == [2]
    start_b = _payloads(ws, job, "movement_start")[1]
    assert start_b["system"] == "You are B."
    assert "HELLO" not in start_b["user"] and "thinking" not in start_b["user"]


def test_lessons_are_injected_under_a_heading(ws: Workspace, tmp_path: Path) -> None:
    job = _run(ws, tmp_path, {"responses": [transition("b", "A done", lessons="the files are small"),
                                            transition("COMPLETE", "B done")]})
    user_a, user_b = (s["user"] for s in _payloads(ws, job, "movement_start"))
    assert "## Lessons from previous steps" not in user_a
    assert "## Lessons from previous steps\n- [a] the files are small\n" in user_b


def test_japanese_piece_uses_the_japanese_lessons_heading(ws: Workspace, tmp_path: Path) -> None:
    job = _run(ws, tmp_path, {"responses": [transition("b", "A", lessons="ファイルは小さい"), transition("COMPLETE")]},
               extra="language: ja")
    user_b = _payloads(ws, job, "movement_start")[1]["user"]
    assert "## 前のステップで得た教訓\n- [a] ファイルは小さい" in user_b
    assert "Lessons from previous steps" not in user_b


def test_lessons_are_capped_dropping_the_oldest(ws: Workspace, tmp_path: Path) -> None:
    lessons = [f"L{n:02d} " + "x" * 290 for n in range(10)]
    script = {"movements": {
        "a": [transition("b", f"a{n}", lessons=lessons[2 * n]) for n in range(5)],
        "b": [transition("a", f"b{n}", lessons=lessons[2 * n + 1]) for n in range(4)] + [transition("COMPLETE")],
    }}
    job = _run(ws, tmp_path, script, max_movements=12)
    assert job.status == "succeeded", job.error
    last = _payloads(ws, job, "movement_start")[-1]["user"]
    block = last.split("## Lessons from previous steps\n", 1)[1].split("\n\n## ", 1)[0]
    assert len(block) <= MAX_LESSON_CHARS
    kept = [line.split("] ", 1)[1] for line in block.splitlines()]
    given = lessons[:9]  # a, b, a, … a: nine transitions with lessons before the last movement
    assert kept[-1] == given[-1]  # the newest is kept …
    assert given[0] not in block  # … the oldest dropped first
    assert kept == given[len(given) - len(kept):]  # a contiguous run of the newest, oldest first
    assert len(block) + len(lessons[0]) + 10 > MAX_LESSON_CHARS  # nothing more would have fitted


def test_complete_without_lessons_records_the_summary_as_lesson(ws: Workspace, tmp_path: Path) -> None:
    job = _run(ws, tmp_path, {"responses": [transition("b", "A done"), transition("COMPLETE", "everything is written")]})
    lessons = _payloads(ws, job, "lesson")
    assert lessons == [{"lessons": "everything is written", "summary": "everything is written", "movement": "b"}]
    rows = [json.loads(line) for line in (ws.root / "jobs" / str(job.id) / "logs" / "lessons.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    assert rows[0]["lessons"] == "everything is written"


def test_a_forced_complete_records_its_summary_as_the_lesson(ws: Workspace, tmp_path: Path) -> None:
    # the seed turns the summary of any COMPLETE without lessons into the lesson, whatever the cause
    job = _run(ws, tmp_path, {"responses": [say("hmm")] * 2}, max_iterations=2, default_next="COMPLETE")
    assert job.status == "succeeded", job.error
    (forced,) = _payloads(ws, job, "transition")
    assert (forced["next_step"], forced["forced"]) == ("COMPLETE", True)
    summary = "Forced transition: max_iterations (2) reached without a transition."
    assert forced["summary"] == summary
    assert _payloads(ws, job, "lesson") == [{"lessons": summary, "summary": summary, "movement": "a"}]
    path = ws.root / "jobs" / str(job.id) / "logs" / "lessons.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [(r["movement"], r["seq"], r["lessons"], r["summary"]) for r in rows] == [("a", 1, summary, summary)]


def test_lessons_jsonl_rows(ws: Workspace, tmp_path: Path) -> None:
    job = _run(ws, tmp_path, {"responses": [transition("b", "A done", lessons="lesson one"),
                                            transition("COMPLETE", "B done", lessons="lesson two")]})
    path = ws.root / "jobs" / str(job.id) / "logs" / "lessons.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [set(r) for r in rows] == [{"job", "movement", "seq", "lessons", "summary", "timestamp"}] * 2
    assert [(r["job"], r["movement"], r["seq"], r["lessons"], r["summary"]) for r in rows] == [
        (job.id, "a", 1, "lesson one", "A done"), (job.id, "b", 2, "lesson two", "B done")]
    assert all(r["timestamp"][:4].isdigit() and "T" in r["timestamp"] for r in rows)


def test_a_reply_without_a_tool_call_gets_a_reminder(ws: Workspace, tmp_path: Path) -> None:
    job = _run(ws, tmp_path, {"responses": [say("I think I am done."), transition("b"), transition("COMPLETE")]})
    reminders = ws.events(job, kinds=["reminder"])
    assert len(reminders) == 1
    text = reminders[0].payload["text"]
    assert "`transition`" in text and "one of: b, ABORT." in text
    assert reminders[0].payload["reason"] == "no tool call"
    assert reminders[0].movement_seq == 1 and reminders[0].iteration == 1


def test_max_iterations_forces_default_next(ws: Workspace, tmp_path: Path) -> None:
    script = {"movements": {"a": [say("hmm")] * 3, "b": [transition("COMPLETE")]}}
    job = _run(ws, tmp_path, script, max_iterations=3)
    assert job.status == "succeeded", job.error
    forced = _payloads(ws, job, "transition")[0]
    assert forced["next_step"] == "b" and forced["forced"] is True
    assert forced["reason"] == "max_iterations (3) reached without a transition"
    assert len(ws.events(job, kinds=["llm_response"])) == 4  # 3 in a, then 1 in b
    assert ws.movements(job)[0]["forced"] == 1
    assert _payloads(ws, job, "lesson")[0]["movement"] == "b"  # a forced transition carries no lesson


def test_max_iterations_without_default_next_aborts(ws: Workspace, tmp_path: Path) -> None:
    job = _run(ws, tmp_path, {"responses": [say("hmm")] * 2}, max_iterations=2, default_next=None)
    assert job.status == "aborted"
    forced = _payloads(ws, job, "transition")[0]
    assert (forced["next_step"], forced["forced"]) == ("ABORT", True)
    assert "max_iterations (2)" in job.error


def test_tools_outside_the_movement_or_above_its_permission_are_tool_errors(ws: Workspace, tmp_path: Path) -> None:
    job = _run(ws, tmp_path, {"responses": [
        call("Bash", command="ls"),                     # a built-in not listed in the movement
        call("NoSuchTool"),                              # not a tool at all
        call("Write", path="output/x.txt", content="x"),  # listed, but needs edit: the movement is readonly
        call("explode", reason="r"),                      # a user tool that needs full
        call("shout", text="hi"),
        transition("b"), transition("COMPLETE"),
    ]}, permission="readonly")
    assert job.status == "succeeded", job.error
    results = [r for r in _payloads(ws, job, "tool_result") if r["tool"] != "transition"]
    assert [r["is_error"] for r in results] == [True, True, True, True, False]
    assert results[0]["content"] == ("Error: tool 'Bash' is not available in this step; "
                                     "available: Read, Write, shout, explode, transition")
    assert "'NoSuchTool' is not available" in results[1]["content"]
    assert results[2]["content"] == "Error: Write needs permission 'edit'; this step has 'readonly'"
    assert results[3]["content"] == "Error: explode needs permission 'full'; this step has 'readonly'"
    assert not (Path(job.workdir) / "output" / "x.txt").exists()


def test_user_tool_result_and_exception_become_tool_results(ws: Workspace, tmp_path: Path) -> None:
    job = _run(ws, tmp_path, {"responses": [
        call("shout", text="hi", times=2),
        call("explode", reason="bad weather"),
        call("shout", nope=1),
        transition("b"), transition("COMPLETE"),
    ]}, permission="full")
    assert job.status == "succeeded", job.error
    ok, boom, bad_args = [r for r in _payloads(ws, job, "tool_result") if r["tool"] != "transition"]
    assert (ok["content"], ok["is_error"]) == ("HI HI", False)
    assert boom["is_error"] and boom["content"] == "Error: explode raised RuntimeError: boom: bad weather"
    assert bad_args["is_error"] and "unknown argument(s) 'nope' for shout; allowed: text, times" in bad_args["content"]
    schema = next(e.payload for e in ws.events(job, kinds=["llm_request"]))
    assert schema["tools"] == ["Read", "Write", "shout", "explode", "transition"]


def test_forced_ask_without_a_question_still_asks_something(ws: Workspace, tmp_path: Path) -> None:
    job = _run(ws, tmp_path, {"responses": [say("hmm")]}, max_iterations=1, default_next="ASK")
    assert job.status == "waiting_human"
    question = [c for c in ws.comments(job) if c["author"] == "agent"][-1]["body"]
    assert "max_iterations (1)" in question
