"""The typed next step of a job after a movement ends, built once from the movement's transition.

The model (or a forced transition) names the next step as a string (``COMPLETE``, ``ASK``, ``ABORT``,
``WAIT_SUBTASKS`` or a movement name); that string is stored as it is in the ``transition`` event and
the movement row.  :func:`next_step` turns it, with the transition's other fields, into one of the
classes below, which :class:`~agentnb.engine.runner.JobRunner` applies with ``match``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .loop import Outcome
from .pieces import SPECIAL_NEXT, Movement

__all__ = ["Abort", "Ask", "Complete", "Fail", "GoTo", "NextStep", "WaitSubtasks", "next_step"]


@dataclass(frozen=True, slots=True)
class Complete:
    """The job succeeded."""


@dataclass(frozen=True, slots=True)
class Abort:
    """The job cannot be done; ``reason`` is kept as its error."""

    reason: str


@dataclass(frozen=True, slots=True)
class Ask:
    """The job waits for the user's reply to ``question``, then goes on at ``resume``."""

    question: str
    resume: str


@dataclass(frozen=True, slots=True)
class WaitSubtasks:
    """The job hands out ``requests`` (``{instruction, piece?, model?}``, checked when the transition was
    made) as child jobs and waits for them, then goes on at ``resume``."""

    requests: tuple[dict[str, Any], ...]
    resume: str


@dataclass(frozen=True, slots=True)
class Fail:
    """The transition cannot be followed (a forced WAIT_SUBTASKS that named no subtasks)."""

    message: str


@dataclass(frozen=True, slots=True)
class GoTo:
    """The job goes on at another (or the same) movement."""

    movement: str


NextStep = Complete | Abort | Ask | WaitSubtasks | Fail | GoTo


def next_step(out: Outcome, movement: Movement) -> NextStep:
    """What ``out`` — the transition that ended ``movement`` — asks the job to do next."""
    step = out.next_step
    if step == "COMPLETE":
        return Complete()
    if step == "ABORT":
        return Abort(out.reason or out.summary or "aborted by the model")
    if step == "ASK":
        return Ask(out.question or "", resume=movement.name)
    if step == "WAIT_SUBTASKS":
        if not out.subtasks:
            # only a forced transition gets here (the transition tool insists on subtasks):
            # with no child to wait for, the job would wait forever
            return Fail(f"{movement.name} ended with WAIT_SUBTASKS but named no subtasks "
                        f"({out.reason or 'no reason given'})")
        resume = out.resume or movement.default_next
        if resume is None or resume in SPECIAL_NEXT:
            resume = movement.name
        return WaitSubtasks(tuple(out.subtasks), resume=resume)
    return GoTo(step)
