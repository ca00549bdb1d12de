"""Reads derived from the stored rows, written once for both backends (next to ``frames_sql.py``).

The :class:`~agentnb.store.base.Store` Protocol keeps the persistence core (jobs, events, transactions, claims
and leases); what is computed from those rows (counts, totals, the last reason, a job's movements or comments)
is a function here of a store and its arguments, in SQL both SQLite and PostgreSQL take, run through
:meth:`Store.rows`.  Each returns the typed records of :mod:`agentnb.store.records` where a row is returned.
"""

from __future__ import annotations

from .base import JOB_STATES, Store
from .records import BatchRecord

__all__: list[str] = [
    "batch",
    "batches",
]


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
