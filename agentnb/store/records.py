"""The store's rows as frozen, typed records: a job, a movement run, a comment, a batch.

The store builds them; the rest of the package reads their fields instead of looking up columns by name.  Each
has ``to_dict()``, which gives the row as the plain dict the public API returned before
(docs/python-api.md#records), so a user's notebook that reads ``ws.movements(job)[0]["name"]`` keeps working.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Literal

from ..events import encode_payload

__all__: list[str] = [
    "JOB_COLUMNS",
    "JOB_STATES",
    "TERMINAL_STATES",
    "WAITING_STATES",
    "BatchCase",
    "BatchRecord",
    "BatchVariant",
    "CommentRecord",
    "JobOptions",
    "JobRecord",
    "JobStatus",
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

    ``options`` is the column's JSON text: the batch's ``context=`` (which nothing reads back) and ``epochs``
    (:attr:`epochs`).  ``jobs`` and
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

    @property
    def epochs(self) -> int:
        """How many times the batch runs each case × variant (docs/design-lab.md#epochs): 1 for a batch made
        before epochs."""
        return int(json.loads(self.options or "{}").get("epochs") or 1)

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
# -- a job's status and options (JobStatus and JobOptions, imported by store/base.py too) ------------------------


class JobStatus(str, Enum):
    """A job's status (docs/job-states.md).  A ``str`` enum: a member is equal to, hashes as and is stored as its
    value, so the store's columns, events and SQL hold the same text as before the enum was used; rows read back
    from the store carry the plain text, which compares equal to the member."""

    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    aborted = "aborted"
    waiting_human = "waiting_human"
    waiting_subtasks = "waiting_subtasks"

    def __str__(self) -> str:
        return self.value

    @property
    def terminal(self) -> bool:
        return self.value in TERMINAL_STATES

    @property
    def waiting(self) -> bool:
        return self.value in WAITING_STATES


# plain text, not members: SQL is built from them and frames' categories are made of them
JOB_STATES: tuple[str, ...] = tuple(s.value for s in JobStatus)
TERMINAL_STATES = frozenset({JobStatus.succeeded.value, JobStatus.failed.value, JobStatus.aborted.value})
WAITING_STATES = frozenset({JobStatus.waiting_human.value, JobStatus.waiting_subtasks.value})

# -- a job's options ----------------------------------------------------------------------------------------------

_OPTION_KEYS = ("retries", "max_backoff", "context", "strict_replay", "subtask_cap")


@dataclass(frozen=True)
class JobOptions:
    """A job's ``options`` column, decoded once (docs/python-api.md#job-options).

    ``retries``/``max_backoff``: the openai retry settings it was submitted or retried with; ``context``: its
    checked ``context=`` settings; ``strict_replay``: a strict fork; ``subtask_cap``: the tools and permission of
    the movement that created a subtask.  ``None`` is "not set".  Keys this version does not know stay in
    ``extra`` and ``order`` keeps the keys as stored, so that writing the options back (a retry, a fork, a
    subtask's copy) gives the text it gave before they were typed, and a newer version's keys survive.
    """

    retries: int | None = None
    max_backoff: float | None = None
    context: Mapping[str, Any] | None = None
    strict_replay: bool | None = None
    subtask_cap: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    order: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, text: str | None) -> JobOptions:
        """The options of a job row's ``options`` text (empty or NULL: none set)."""
        return cls.from_dict(json.loads(text or "{}"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobOptions:
        known = {k: data[k] for k in _OPTION_KEYS if k in data}
        return cls(**known, extra={k: v for k, v in data.items() if k not in _OPTION_KEYS}, order=tuple(data))

    def updated(self, **changes: Any) -> JobOptions:
        """These options with ``changes`` set: a key already set keeps its place, a new one goes last (as a
        dict's update does)."""
        extra = {k: v for k, v in changes.items() if k not in _OPTION_KEYS}
        known = {k: v for k, v in changes.items() if k in _OPTION_KEYS}
        return replace(self, **known, extra={**self.extra, **extra},
                       order=self.order + tuple(k for k in changes if k not in self.order))

    def without(self, *keys: str) -> JobOptions:
        """These options with ``keys`` unset."""
        return replace(self, **{k: None for k in keys if k in _OPTION_KEYS},
                       extra={k: v for k, v in self.extra.items() if k not in keys},
                       order=tuple(k for k in self.order if k not in keys))

    def to_dict(self) -> dict[str, Any]:
        """The options as the JSON object stored, in the stored order (a key set here but not stored goes last)."""
        keys = self.order + tuple(k for k in _OPTION_KEYS if k not in self.order and getattr(self, k) is not None)
        return {k: self.extra[k] if k in self.extra else getattr(self, k) for k in keys}

    def to_json(self) -> str:
        """The stored text: compact and UTF-8, as the store encodes a job's options."""
        return encode_payload(self.to_dict())

    @property
    def thresholds(self) -> Mapping[str, float]:
        """The context thresholds the job was submitted with (over its piece's); empty when none."""
        return (self.context or {}).get("thresholds") or {}



# a job's columns as a record and its to_dict() give them: the jobs table's, in its order, without the text
# references (instruction_ref, enriched_ref), which the store expands into the texts
JOB_COLUMNS = (
    "id", "parent_id", "piece", "piece_yaml", "piece_path", "model", "instruction", "status",
    "current_movement", "resume_movement", "movement_seq", "workdir", "options", "enriched",
    "error", "claimed_by", "created", "updated", "started", "ended", "batch", "batch_case", "batch_variant",
    "forked_from_job", "forked_from_seq", "lease_until", "lease_gen", "batch_epoch",
)


@dataclass(frozen=True, slots=True)
class JobRecord:
    """One row of the ``jobs`` table, as :meth:`Store.job`, :meth:`Store.jobs` and :meth:`Store.claim` give it
    (docs/python-api.md#records): long texts expanded, ``status`` a :class:`JobStatus`, ``options`` decoded once
    into :class:`JobOptions` (``options_text``: the stored JSON text, which :meth:`to_dict` gives back)."""

    id: int
    parent_id: int | None
    piece: str
    piece_yaml: str
    piece_path: str | None
    model: str
    instruction: str
    status: JobStatus
    current_movement: str | None
    resume_movement: str | None
    movement_seq: int
    workdir: str
    options: JobOptions
    options_text: str
    enriched: str | None
    error: str | None
    claimed_by: str | None
    created: float
    updated: float
    started: float | None
    ended: float | None
    batch: str | None
    batch_case: int | None
    batch_variant: int | None
    forked_from_job: int | None
    forked_from_seq: int | None
    lease_until: float | None
    lease_gen: int
    # which run of its case × variant a batch job is, from 1 (docs/design-lab.md#epochs); None outside a batch
    # and for a batch job made before epochs (see :attr:`epoch`)
    batch_epoch: int | None = None

    @classmethod
    def from_row(cls, columns: Sequence[str], row: Sequence[Any]) -> JobRecord:
        """The record of a ``jobs`` row: its column names and values (columns it does not hold, as the text
        references, are left out; their texts must have been expanded into the row already)."""
        return cls.from_mapping(dict(zip(columns, row, strict=True)))

    @classmethod
    def from_mapping(cls, v: Mapping[str, Any]) -> JobRecord:
        """The record of a ``jobs`` row given as a mapping of column → value."""
        options = v["options"]
        return cls(
            v["id"], v["parent_id"], v["piece"], v["piece_yaml"], v["piece_path"], v["model"], v["instruction"],
            _STATUSES.get(v["status"]) or JobStatus(v["status"]), v["current_movement"], v["resume_movement"],
            v["movement_seq"], v["workdir"], _options(options), options, v["enriched"], v["error"], v["claimed_by"], v["created"], v["updated"],
            v["started"], v["ended"], v["batch"], v["batch_case"], v["batch_variant"], v["forked_from_job"],
            v["forked_from_seq"], v["lease_until"], v["lease_gen"], v["batch_epoch"],
        )

    def to_dict(self) -> dict[str, Any]:
        """The row as a plain dict, column → stored value in the table's order: ``status`` its text, ``options``
        its JSON text (what ``Store.job`` returned before it returned records)."""
        return {
            "id": self.id, "parent_id": self.parent_id, "piece": self.piece, "piece_yaml": self.piece_yaml,
            "piece_path": self.piece_path, "model": self.model, "instruction": self.instruction,
            "status": self.status.value, "current_movement": self.current_movement,
            "resume_movement": self.resume_movement, "movement_seq": self.movement_seq, "workdir": self.workdir,
            "options": self.options_text, "enriched": self.enriched, "error": self.error,
            "claimed_by": self.claimed_by, "created": self.created, "updated": self.updated,
            "started": self.started, "ended": self.ended, "batch": self.batch, "batch_case": self.batch_case,
            "batch_variant": self.batch_variant, "forked_from_job": self.forked_from_job,
            "forked_from_seq": self.forked_from_seq, "lease_until": self.lease_until, "lease_gen": self.lease_gen,
            "batch_epoch": self.batch_epoch,
        }

    @property
    def epoch(self) -> int | None:
        """The batch epoch of a batch job (1 for one made before epochs); None for a job outside a batch."""
        if self.batch is None:
            return None
        return int(self.batch_epoch or 1)

    @property
    def batch_position(self) -> tuple[int, int, int]:
        """(case, variant, epoch) of a batch job: the order a batch lists its jobs in (0, 0, 1 outside a batch)."""
        return int(self.batch_case or 0), int(self.batch_variant or 0), int(self.batch_epoch or 1)

    @property
    def forked_from(self) -> tuple[int, int] | None:
        """(the original job, the movement run it runs live from) of a fork; None for any other job."""
        if self.forked_from_job is None:
            return None
        return int(self.forked_from_job), int(self.forked_from_seq or 0)



# Building a record is on the hot path (a job's row is read several times per step), so its two decodings are
# looked up: the status by its text, and the options by their text, decoded once per distinct text (a store
# holds few: most jobs have "{}").  The options are frozen and never changed in place, so records share them.
_STATUSES: dict[str, JobStatus] = {s.value: s for s in JobStatus}
_OPTIONS: dict[str, JobOptions] = {}
_MAX_OPTIONS = 256


def _options(text: str | None) -> JobOptions:
    found = _OPTIONS.get(text or "{}")
    if found is None:
        found = JobOptions.from_json(text)
        if len(_OPTIONS) >= _MAX_OPTIONS:
            _OPTIONS.clear()  # simpler than an LRU under threads, and rare: 256 different options texts
        _OPTIONS[text or "{}"] = found
    return found
