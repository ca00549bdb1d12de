"""The typed next step: what the transition that ended a movement asks the job to do.

``next_step`` is the one place the stored ``next_step`` string (with the transition's other fields)
becomes a decision; the runner applies it with ``match``.  Each case here is also run end to end by
the piece tests (test_runner, test_ask, test_subtasks, test_verify); these pin the mapping itself.
"""

from __future__ import annotations

import pytest

from agentnb.engine.loop import Outcome
from agentnb.engine.pieces import Movement, Rule
from agentnb.engine.steps import Abort, Ask, Complete, Fail, GoTo, WaitSubtasks, next_step

WORK = Movement(name="work", rules=(Rule(condition="", next="review"), Rule(condition="", next="WAIT_SUBTASKS"), Rule(condition="", next="COMPLETE")),
                default_next="review")
LONE = Movement(name="lone", rules=(Rule(condition="", next="WAIT_SUBTASKS"),))


def test_complete_and_a_movement() -> None:
    assert next_step(Outcome(next_step="COMPLETE", summary="done"), WORK) == Complete()
    assert next_step(Outcome(next_step="review"), WORK) == GoTo("review")
    assert next_step(Outcome(next_step="work"), WORK) == GoTo("work")  # a movement may go back to itself


@pytest.mark.parametrize(("reason", "summary", "kept"), [
    ("no input", "gave up", "no input"),
    ("", "gave up", "gave up"),  # a model's ABORT gives its summary, not a reason
    ("", "", "aborted by the model"),
])
def test_abort_keeps_the_first_reason_given(reason: str, summary: str, kept: str) -> None:
    assert next_step(Outcome(next_step="ABORT", reason=reason, summary=summary), WORK) == Abort(kept)


def test_ask_resumes_at_the_movement_that_asked() -> None:
    assert next_step(Outcome(next_step="ASK", question="Which file?"), WORK) == Ask("Which file?", resume="work")


def test_wait_subtasks_resumes_where_named_else_at_default_next_else_here() -> None:
    subs = [{"instruction": "part one"}, {"instruction": "part two", "piece": "single"}]
    named = next_step(Outcome(next_step="WAIT_SUBTASKS", subtasks=subs, resume="work"), WORK)
    assert named == WaitSubtasks(tuple(subs), resume="work")
    assert next_step(Outcome(next_step="WAIT_SUBTASKS", subtasks=subs), WORK) == WaitSubtasks(tuple(subs), "review")
    assert next_step(Outcome(next_step="WAIT_SUBTASKS", subtasks=subs), LONE) == WaitSubtasks(tuple(subs), "lone")
    special = Movement(name="fan", rules=LONE.rules, default_next="COMPLETE")  # not a movement to resume at
    assert next_step(Outcome(next_step="WAIT_SUBTASKS", subtasks=subs), special) == WaitSubtasks(tuple(subs), "fan")


def test_a_forced_wait_without_subtasks_fails_the_job() -> None:
    step = next_step(Outcome(next_step="WAIT_SUBTASKS", forced=True, reason="max_iterations (3) reached"), LONE)
    assert step == Fail("lone ended with WAIT_SUBTASKS but named no subtasks (max_iterations (3) reached)")
    assert next_step(Outcome(next_step="WAIT_SUBTASKS", forced=True), LONE) == Fail(
        "lone ended with WAIT_SUBTASKS but named no subtasks (no reason given)")
