"""Reads derived from the stored rows, written once for both backends (next to ``frames_sql.py``).

The :class:`~agentnb.store.base.Store` Protocol keeps the persistence core (jobs, events, transactions, claims
and leases); what is computed from those rows (counts, totals, the last reason, a job's movements or comments)
is a function here of a store and its arguments, in SQL both SQLite and PostgreSQL take, run through
:meth:`Store.rows`.  Each returns the typed records of :mod:`agentnb.store.records` where a row is returned.
"""

from __future__ import annotations

__all__: list[str] = []
