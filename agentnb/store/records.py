"""The store's rows as frozen, typed records: a job, a movement run, a comment, a batch.

The store builds them; the rest of the package reads their fields instead of looking up columns by name.  Each
has ``to_dict()``, which gives the row as the plain dict the public API returned before
(docs/python-api.md#records), so a user's notebook that reads ``ws.movements(job)[0]["name"]`` keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__: list[str] = [
    "CommentRecord",
    "MovementRecord",
    "MovementStatus",
]

# a movement run's status: open, closed by its transition, or stopped by its job's failure (a retry reopens it)
MovementStatus = Literal["running", "done", "failed"]


@dataclass(frozen=True, slots=True)
class MovementRecord:
    """One run of a movement: a row of the ``movements`` table (docs/events.md).

    ``seq`` counts the job's runs from 1; ``iterations`` the LLM calls the run made; ``next_step`` the
    transition that closed it (None while it is open or after it failed); ``forced`` whether the loop, not the
    model, chose that transition; ``summary`` what the run reported; ``started``/``ended`` epoch seconds.
    """

    job_id: int
    seq: int
    name: str
    status: MovementStatus
    started: float
    ended: float | None
    iterations: int
    next_step: str | None
    forced: bool
    summary: str | None

    @classmethod
    def from_row(cls, columns: Sequence[str], row: Sequence[Any]) -> MovementRecord:
        """The record of one row of ``columns`` (as :meth:`Store.rows` gives them; any order)."""
        v = dict(zip(columns, row, strict=True))
        return cls(job_id=v["job_id"], seq=v["seq"], name=v["name"], status=v["status"], started=v["started"],
                   ended=v["ended"], iterations=v["iterations"], next_step=v["next_step"],
                   forced=bool(v["forced"]), summary=v["summary"])

    def to_dict(self) -> dict[str, Any]:
        """The row as ``ws.movements()`` gives it: the table's columns in its order, ``forced`` stored as 0 or 1."""
        return {"job_id": self.job_id, "seq": self.seq, "name": self.name, "status": self.status,
                "started": self.started, "ended": self.ended, "iterations": self.iterations,
                "next_step": self.next_step, "forced": int(self.forced), "summary": self.summary}


@dataclass(frozen=True, slots=True)
class CommentRecord:
    """One comment on a job: a row of the ``comments`` table.  ``author`` is ``user`` (a reply) or ``agent`` (a
    question the job asked); ``ts`` when it was written, epoch seconds."""

    id: int
    job_id: int
    author: str
    body: str
    ts: float

    @classmethod
    def from_row(cls, columns: Sequence[str], row: Sequence[Any]) -> CommentRecord:
        """The record of one row of ``columns`` (as :meth:`Store.rows` gives them; any order)."""
        v = dict(zip(columns, row, strict=True))
        return cls(id=v["id"], job_id=v["job_id"], author=v["author"], body=v["body"], ts=v["ts"])

    def to_dict(self) -> dict[str, Any]:
        """The row as ``ws.comments()`` gives it: the table's columns in its order."""
        return {"id": self.id, "job_id": self.job_id, "author": self.author, "body": self.body, "ts": self.ts}
