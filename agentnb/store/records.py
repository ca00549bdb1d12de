"""The store's rows as frozen, typed records: a job, a movement run, a comment, a batch.

The store builds them; the rest of the package reads their fields instead of looking up columns by name.  Each
has ``to_dict()``, which gives the row as the plain dict the public API returned before
(docs/python-api.md#records), so a user's notebook that reads ``ws.movements(job)[0]["name"]`` keeps working.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .base import JOB_STATES

__all__: list[str] = [
    "BatchCase",
    "BatchRecord",
    "BatchVariant",
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


# -- a batch (docs/design-lab.md) ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class BatchCase:
    """One stored case of a batch: its instruction, its input files by name (``{"bytes": n, "sha256": h}``; the
    bytes themselves are in each job's ``input/``), the expected value and the case's other columns."""

    instruction: str
    inputs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    expected: Any = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BatchCase:
        return cls(instruction=str(data["instruction"]), inputs=dict(data.get("inputs") or {}),
                   expected=data.get("expected"), extra=dict(data.get("extra") or {}))

    def to_dict(self) -> dict[str, Any]:
        """The case as stored (and as ``Batch.cases`` gives it): a copy the caller may change."""
        return {"instruction": self.instruction, "inputs": {k: dict(v) for k, v in self.inputs.items()},
                "expected": copy.deepcopy(self.expected), "extra": copy.deepcopy(dict(self.extra))}


@dataclass(frozen=True, slots=True)
class BatchVariant:
    """One stored variant of a batch: ``piece`` (its label, unique within the batch), the piece's YAML and
    source, and the model spec."""

    piece: str
    piece_yaml: str
    piece_source: str | None
    model: str

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BatchVariant:
        source = data.get("piece_source")
        return cls(piece=str(data["piece"]), piece_yaml=str(data["piece_yaml"]),
                   piece_source=None if source is None else str(source), model=str(data["model"]))

    def to_dict(self) -> dict[str, Any]:
        return {"piece": self.piece, "piece_yaml": self.piece_yaml, "piece_source": self.piece_source,
                "model": self.model}


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """A row of the ``batches`` table, its cases and variants decoded once.

    ``options`` is the column's JSON text (the batch's ``context=``), which nothing reads back.  ``jobs`` and
    ``counts`` (jobs per status, every status of ``JOB_STATES``) are set only on the records of
    :func:`agentnb.store.reads.batches`.  ``cases_json``/``variants_json`` keep the columns' text as stored,
    so that :meth:`to_dict` gives the row exactly as the store gave it before records.
    """

    name: str
    created: float
    updated: float
    fingerprint: str
    cases: tuple[BatchCase, ...]
    variants: tuple[BatchVariant, ...]
    options: str
    cases_json: str = field(repr=False)
    variants_json: str = field(repr=False)
    jobs: int | None = None
    counts: Mapping[str, int] | None = None

    @classmethod
    def from_row(cls, columns: Sequence[str], values: Sequence[Any]) -> BatchRecord:
        """The record of one row: the table's columns, then (from a listing) ``jobs`` and ``n_<status>``."""
        row = dict(zip(columns, values, strict=True))
        cases_json, variants_json = str(row["cases"]), str(row["variants"])
        listed = "jobs" in row
        return cls(name=str(row["name"]), created=float(row["created"]), updated=float(row["updated"]),
                   fingerprint=str(row["fingerprint"]),
                   cases=tuple(BatchCase.from_dict(c) for c in json.loads(cases_json)),
                   variants=tuple(BatchVariant.from_dict(v) for v in json.loads(variants_json)),
                   options=str(row["options"]), cases_json=cases_json, variants_json=variants_json,
                   jobs=int(row["jobs"] or 0) if listed else None,
                   counts={s: int(row.get(f"n_{s}") or 0) for s in JOB_STATES} if listed else None)

    def to_dict(self) -> dict[str, Any]:
        """The row as the plain dict the store gave before records: the columns (cases, variants and options as
        JSON text), and for a listed batch ``jobs`` and ``n_<status>``."""
        out: dict[str, Any] = {"name": self.name, "created": self.created, "updated": self.updated,
                               "fingerprint": self.fingerprint, "cases": self.cases_json,
                               "variants": self.variants_json, "options": self.options}
        if self.counts is not None:
            out["jobs"] = self.jobs
            out.update({f"n_{s}": n for s, n in self.counts.items()})
        return out
