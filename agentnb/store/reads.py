"""Reads derived from the stored rows, written once for both backends (next to ``frames_sql.py``).

The :class:`~agentnb.store.base.Store` Protocol keeps the persistence core (jobs, events, transactions, claims
and leases); what is computed from those rows (counts, totals, the last reason, a job's movements or comments)
is a function here of a store and its arguments, in SQL both SQLite and PostgreSQL take, run through
:meth:`Store.rows`.  Each returns the typed records of :mod:`agentnb.store.records` where a row is returned.
"""

from __future__ import annotations

import re
from typing import Any

from ..events import JobStatusEvent, LLMResponse
from .base import JOB_STATES, Dialect, FrameQuery, FrameRows, Store
from .frames_sql import FRAME_SQL, PG_FRAME_SQL, payload_field
from .records import BatchRecord, CommentRecord, JobRecord, MovementRecord

__all__: list[str] = [
    "batch",
    "batches",
    "calls_by_movement",
    "comments",
    "count_comments",
    "epoch_of",
    "frame_rows",
    "last_status_reason",
    "latest_request",
    "movements",
    "open_movement",
    "runner_mark",
    "subtask_depth",
    "total_tokens",
    "tree_calls",
]

# -- comments and movement runs -----------------------------------------------------------------------------------

# named, not *: a record's fields are these, whatever order a migration left the table's columns in
_COMMENT = "SELECT id, job_id, author, body, ts FROM comments"
_MOVEMENT = ("SELECT job_id, seq, name, status, started, ended, iterations, next_step, forced, summary "
             "FROM movements")


def comments(store: Store, job_id: int, last: int | None = None) -> list[CommentRecord]:
    """The job's comments, oldest first; ``last``: only the newest ``last`` of them (still oldest first)."""
    if last is None:
        cols, rows = store.rows(f"{_COMMENT} WHERE job_id=? ORDER BY id", (job_id,))
    else:
        cols, rows = store.rows(f"SELECT * FROM ({_COMMENT} WHERE job_id=? ORDER BY id DESC LIMIT ?) AS c "
                                "ORDER BY id", (job_id, last))
    return [CommentRecord.from_row(cols, r) for r in rows]


def count_comments(store: Store, job_id: int) -> int:
    """How many comments the job has."""
    return int(store.rows("SELECT COUNT(*) FROM comments WHERE job_id=?", (job_id,))[1][0][0])


def movements(store: Store, job_id: int) -> list[MovementRecord]:
    """The job's movement runs, in the order they ran."""
    cols, rows = store.rows(f"{_MOVEMENT} WHERE job_id=? ORDER BY seq", (job_id,))
    return [MovementRecord.from_row(cols, r) for r in rows]


def open_movement(store: Store, job_id: int) -> MovementRecord | None:
    """The job's movement run still open (``running``), or None between runs."""
    cols, rows = store.rows(f"{_MOVEMENT} WHERE job_id=? AND status='running' ORDER BY seq DESC LIMIT 1", (job_id,))
    return MovementRecord.from_row(cols, rows[0]) if rows else None


def calls_by_movement(store: Store, job_id: int) -> dict[str, int]:
    """How many LLM calls (``llm_response`` events) each movement name of the job has made so far."""
    _, rows = store.rows(
        "SELECT m.name, COUNT(*) FROM events e JOIN movements m ON m.job_id=e.job_id AND m.seq=e.movement_seq "
        "WHERE e.job_id=? AND e.kind='llm_response' GROUP BY m.name", (job_id,))
    return {r[0]: int(r[1]) for r in rows}


def runner_mark(store: Store, job_id: int) -> tuple[int, int, str | None]:
    """What a cached runner of the job must match: its last movement event id, its open movement run's seq (0 when
    none) and its options text."""
    _, rows = store.rows(
        "SELECT (SELECT MAX(id) FROM events WHERE job_id=? AND movement_seq IS NOT NULL), "
        "(SELECT MAX(seq) FROM movements WHERE job_id=? AND status='running'), "
        "(SELECT options FROM jobs WHERE id=?)", (job_id, job_id, job_id))
    return int(rows[0][0] or 0), int(rows[0][1] or 0), rows[0][2]


# -- batches (docs/design-lab.md) -------------------------------------------------------------------------------

_BATCH_COLUMNS = "b.name, b.created, b.updated, b.fingerprint, b.cases, b.variants, b.options"
# a count per job status; COUNT of a CASE without ELSE is 0, not NULL, for a batch without jobs on both engines
_STATUS_COUNTS = ", ".join(f"COUNT(CASE WHEN j.status = '{s}' THEN 1 END) AS n_{s}" for s in JOB_STATES)


def batch(store: Store, name: str) -> BatchRecord | None:
    """The batch ``name``, or None when the store has none of that name."""
    columns, rows = store.rows(f"SELECT {_BATCH_COLUMNS} FROM batches b WHERE b.name = ?", (name,))
    return BatchRecord.from_row(columns, rows[0]) if rows else None


def batches(store: Store) -> list[BatchRecord]:
    """Every batch, oldest first, each with ``jobs`` and its jobs' count per status (``counts``)."""
    # GROUP BY the primary key: PostgreSQL then takes the batch's other columns too
    columns, rows = store.rows(
        f"SELECT {_BATCH_COLUMNS}, COUNT(j.id) AS jobs, {_STATUS_COUNTS} FROM batches b "
        "LEFT JOIN jobs j ON j.batch = b.name GROUP BY b.name ORDER BY b.created, b.name")
    return [BatchRecord.from_row(columns, r) for r in rows]


_EPOCH_COLUMNS = ("parent_id", "forked_from_job", "batch", "batch_epoch")


def epoch_of(store: Store, row: JobRecord) -> int | None:
    """The batch epoch a job answers for (docs/design-lab.md#epochs): a batch job's own (1 when made before
    epochs), a subtask's its batch job's, a fork's its original's (a what-if asks what that very run would have
    done); None for a job with no batch job above it.  What a ``scripted:`` model's ``by_epoch`` chooses by."""
    found: dict[str, Any] | None = {c: getattr(row, c) for c in _EPOCH_COLUMNS}
    while found is not None and found["batch"] is None:
        above = found["parent_id"] if found["parent_id"] is not None else found["forked_from_job"]
        found = None if above is None else store.job_columns(int(above), _EPOCH_COLUMNS)
    return None if found is None else int(found["batch_epoch"] or 1)


# -- jobs and their events ------------------------------------------------------------------------------------

_DIALECTS: tuple[Dialect, ...] = ("sqlite", "postgres")

# the only difference between the backends is how a payload field is read (json_extract, or #>> and a cast).  Calls
# outside any movement run are an LLM judge's (docs/design-lab.md#llm-judge): spent scoring the job, not by it
_TOTAL_TOKENS = {d: f"SELECT COALESCE(SUM({payload_field(d, 'e', LLMResponse, 'usage.total_tokens')}), 0) "
                    "FROM events e WHERE e.job_id=? AND e.kind='llm_response' AND e.movement_seq IS NOT NULL"
                 for d in _DIALECTS}
_LAST_REASON = {d: f"SELECT {payload_field(d, 'e', JobStatusEvent, 'reason')} FROM events e "
                   "WHERE e.kind='job_status' AND e.job_id=? ORDER BY e.id DESC LIMIT 1" for d in _DIALECTS}


def total_tokens(store: Store, job_id: int) -> int:
    """The sum of ``usage.total_tokens`` over the job's LLM calls (0 before the first)."""
    return int(store.rows(_TOTAL_TOKENS[store.dialect], (job_id,))[1][0][0] or 0)


# a job (or a batch's jobs) and its subtasks, every generation: each LLM call's model spec (its job's), tokens and time
_TREE_CALLS = {(d, root): "WITH RECURSIVE tree(id, n) AS (SELECT id, 0 FROM jobs WHERE " + root + "=?"
                          + (" AND parent_id IS NULL" if root == "batch" else "") + " UNION ALL "
                          "SELECT j.id, t.n + 1 FROM jobs j JOIN tree t ON j.parent_id = t.id WHERE t.n < 1000) "
                          f"SELECT j.model, {payload_field(d, 'e', LLMResponse, 'usage.prompt_tokens')}, "
                          f"{payload_field(d, 'e', LLMResponse, 'usage.completion_tokens')}, "
                          f"{payload_field(d, 'e', LLMResponse, 'usage.total_tokens')}, e.ts "
                          "FROM tree JOIN jobs j ON j.id = tree.id JOIN events e ON e.job_id = tree.id "
                          "WHERE e.kind='llm_response' AND e.movement_seq IS NOT NULL"  # a judge's calls: not the job's
                          for d in _DIALECTS for root in ("id", "batch")}


def tree_calls(store: Store, job_id: int | None = None, *, batch: str | None = None) -> list[tuple[str, int, int, int, float]]:
    """``(model, prompt_tokens, completion_tokens, total_tokens, ts)`` of every LLM call of the job (or of every job
    of ``batch``) and of its subtasks, every generation (docs/design-lab.md#budgets: what a limit counts)."""
    root, key = ("id", job_id) if batch is None else ("batch", batch)
    return [(str(m), int(p or 0), int(c or 0), int(t or 0), float(ts))
            for m, p, c, t, ts in store.rows(_TREE_CALLS[store.dialect, root], (key,))[1]]


def last_status_reason(store: Store, job_id: int) -> str | None:
    """The reason of the job's newest ``job_status`` event (None before the first one)."""
    rows = store.rows(_LAST_REASON[store.dialect], (job_id,))[1]
    return None if not rows or rows[0][0] is None else str(rows[0][0])


def latest_request(store: Store, job_id: int) -> tuple[int | None, int | None] | None:
    """``(movement_seq, iteration)`` of the job's newest ``llm_request``, None before the first."""
    rows = store.rows("SELECT movement_seq, iteration FROM events WHERE job_id=? AND kind='llm_request' "
                      "AND movement_seq IS NOT NULL ORDER BY id DESC LIMIT 1", (job_id,))[1]
    return (rows[0][0], rows[0][1]) if rows else None


def subtask_depth(store: Store, job_id: int) -> int:
    """How many ancestors the job has (0 for a job a user submitted, or for no such job)."""
    rows = store.rows(
        "WITH RECURSIVE up(id, parent_id, n) AS (SELECT id, parent_id, 0 FROM jobs WHERE id=? "
        "UNION ALL SELECT j.id, j.parent_id, up.n + 1 FROM jobs j JOIN up ON j.id = up.parent_id "
        "WHERE up.n < 1000) SELECT MAX(n) FROM up", (job_id,))[1]
    return int(rows[0][0] or 0)


# -- the DataFrame views (docs/python-api.md#wsframes) --------------------------------------------------------

_FRAME_SQL = {"sqlite": FRAME_SQL, "postgres": PG_FRAME_SQL}  # built once, at frames_sql's import
_SLOT = re.compile(r"\{((?:job|where)_\w)\}")  # frames_sql's per-job slots


def frame_rows(store: Store, frame: FrameQuery, job_id: int | None = None) -> FrameRows:
    """The rows of one of ``ws.frames``' views (store/frames_sql.py, in the store's dialect), of one job or (None)
    of every job."""
    sql, aliases = _FRAME_SQL[store.dialect][frame]
    fills: dict[str, str] = {}
    for a in aliases:
        fills[f"job_{a}"] = "" if job_id is None else f" AND {a}.job_id = ?"
        fills[f"where_{a}"] = "" if job_id is None else f"WHERE {a}.{'id' if a == 'j' else 'job_id'} = ?"
    # one parameter per slot occurrence, in textual order; only the slots are filled (PostgreSQL's SQL holds JSON
    # paths in braces, '{usage,total_tokens}', so no str.format)
    params = [] if job_id is None else [job_id] * len(_SLOT.findall(sql))
    return store.rows(_SLOT.sub(lambda m: fills[m.group(1)], sql), params)
