"""Wake-ups for idle workers on PostgreSQL: ``NOTIFY agentnb_jobs`` where a job becomes queued, ``LISTEN`` to wait.

The store sends :data:`NOTIFY_SQL` inside the transaction that queues a job (a new job, a subtask, a job set
back to ``queued`` by a pause, a reply, a retry or a recovery); PostgreSQL delivers it when that transaction
commits, so a woken worker always finds the job committed, and a rolled-back transaction wakes nobody.  Every
NOTIFY carries the same (empty) payload, so PostgreSQL folds those of one transaction into one: a batch of 500
jobs created at once wakes each listener once.

:class:`PgJobWaiter` is a worker's listening side, on a connection of its own (a pooled one would be handed to
other threads, and it must stay idle between waits for the notifications to arrive).  Nothing is lost between
two waits: the server queues them for the connection, and ``notifies()`` yields the backlog first.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import psycopg

__all__ = ["NOTIFY_CHANNEL", "NOTIFY_SQL", "PgJobWaiter"]

NOTIFY_CHANNEL = "agentnb_jobs"
NOTIFY_SQL = f"NOTIFY {NOTIFY_CHANNEL}"


class PgJobWaiter:
    """``LISTEN agentnb_jobs`` on a dedicated connection; :meth:`wait` returns when a job may have been queued.

    A lost connection (server restart, network cut) is not an error here: the wait sleeps out its timeout and
    the next one reconnects, so the worker falls back to polling until the server is back (its claims report
    the loss themselves).
    """

    def __init__(self, url: str, *, connect_timeout: float = 10.0) -> None:
        self._url = url
        self._connect_timeout = max(1, int(connect_timeout))
        self._conn: psycopg.Connection[Any] | None = None
        self._closed = False

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            conn = psycopg.connect(self._url, autocommit=True, connect_timeout=self._connect_timeout)
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            self._conn = conn
        return self._conn

    def wait(self, timeout: float) -> bool:
        if self._closed:
            time.sleep(max(0.0, timeout))
            return False
        start = time.monotonic()
        try:
            conn = self._connection()
            got = False
            for _ in conn.notifies(timeout=max(0.0, timeout), stop_after=1):
                got = True
            if got:
                # a burst (many transactions queueing jobs) wakes once: take what has already arrived
                for _ in conn.notifies(timeout=0.0):
                    pass
            return got
        except psycopg.Error:
            self._drop()
            time.sleep(max(0.0, timeout - (time.monotonic() - start)))
            return False

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def close(self) -> None:
        self._closed = True
        self._drop()
