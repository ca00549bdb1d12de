"""Reads derived from the stored rows, written once for both backends (next to ``frames_sql.py``).

The :class:`~agentnb.store.base.Store` Protocol keeps the persistence core (jobs, events, transactions, claims
and leases); what is computed from those rows (counts, totals, the last reason, a job's movements or comments)
is a function here of a store and its arguments, in SQL both SQLite and PostgreSQL take, run through
:meth:`Store.rows`.  Each returns the typed records of :mod:`agentnb.store.records` where a row is returned.
"""

from __future__ import annotations

from .base import Store
from .records import CommentRecord, MovementRecord

__all__: list[str] = [
    "calls_by_movement",
    "comments",
    "count_comments",
    "movements",
    "open_movement",
    "runner_mark",
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
