"""The ``call_cache`` table's writes, once for both stores (docs/stores.md#call-cache, docs/design-lab.md#call-cache).

Reads go through :meth:`Store.rows` (SQL both backends take); the writes below need a transaction and the store's
own ``_run``.  A body passes the secret scrub on its way in, as every text the store keeps does, and a long one is
stored once in ``texts`` (``body_ref``), as a job's long instruction is.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from .base import Transaction
from .texts import TEXT_REF_MIN_CHARS

__all__ = ["CacheRows"]


class CacheRows:
    """``cache_put``, ``cache_hit`` and ``cache_clear`` for a store with ``transaction``, ``_put_text`` and ``_run``."""

    @abstractmethod
    def transaction(self) -> AbstractContextManager[Transaction]: ...

    @abstractmethod
    def _put_text(self, c: Any, body: str) -> str: ...

    @abstractmethod
    def _run(self, c: Transaction, sql: str, params: Sequence[Any] = ()) -> Any:
        """Execute ``sql`` (``?`` placeholders) in transaction ``c``; its cursor."""

    @staticmethod
    @abstractmethod
    def _clean(text: str) -> str: ...

    @abstractmethod
    def _tx(self, c: Transaction) -> Any: ...

    def cache_put(self, key: str, *, kind: str, model: str, body: str, prompt_tokens: int | None = None,
                  completion_tokens: int | None = None, job_id: int | None = None) -> None:
        """Record ``body`` under ``key`` unless a row has it already (two workers that missed together: the first
        one's answer stays)."""
        body = self._clean(body)
        with self.transaction() as c:
            ref = self._put_text(self._tx(c), body) if len(body) >= TEXT_REF_MIN_CHARS else None
            self._run(c, "INSERT INTO call_cache (key, kind, model, body, body_ref, prompt_tokens, completion_tokens, "
                         "job_id, created) VALUES (?,?,?,?,?,?,?,?,?) ON CONFLICT (key) DO NOTHING",
                      (key, kind, model, None if ref else body, ref, prompt_tokens, completion_tokens, job_id,
                       time.time()))

    def cache_hit(self, key: str) -> None:
        """Count one answer given from the row of ``key``."""
        with self.transaction() as c:
            self._run(c, "UPDATE call_cache SET hits=hits+1, last_hit=? WHERE key=?", (time.time(), key))

    def cache_clear(self, before: float | None = None) -> int:
        """Delete the rows created before ``before`` (epoch seconds; None: every row), and the long bodies in
        ``texts`` that only they named; how many rows went."""
        where, params = ("WHERE created < ?", (before,)) if before is not None else ("", ())
        with self.transaction() as c:
            refs = [r[0] for r in self._run(c, f"SELECT DISTINCT body_ref FROM call_cache {where}", params).fetchall()
                    if r[0] is not None]
            n = self._run(c, f"DELETE FROM call_cache {where}", params).rowcount
            for ref in refs:  # a text another row, or a job, still names stays
                self._run(c, "DELETE FROM texts WHERE hash=? AND NOT EXISTS (SELECT 1 FROM call_cache WHERE body_ref=?) "
                             "AND NOT EXISTS (SELECT 1 FROM jobs WHERE instruction_ref=? OR enriched_ref=?)",
                          (ref, ref, ref, ref))
        return int(n)
