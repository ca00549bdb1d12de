"""WAL checkpoints of a SQLite store, run beside its writers (docs/stores.md#checkpoints).

SQLite copies the write-ahead log back into the database file (a checkpoint) when a commit leaves the log past a
size (``wal_autocheckpoint``), in the committing connection, before its ``COMMIT`` returns.  In agentnb that is
inside the writer's turn (store/_write_turn.py): the job whose commit it was stood still for it, and so did every
writer of every process on the file, 30–50 ms on the benchmarks' machine for 10,000 pages, two ``fsync`` included
(benchmarks/README.md).  So the store's connection leaves checkpoints to SQLite only past a far larger log, as a
backstop, and every :data:`EVERY` commits of a store object a thread of its own runs a passive checkpoint on a
connection of its own: a passive checkpoint takes no write lock, so the writers go on meanwhile.  The thread
starts with the first checkpoint due and ends when the store is closed.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading

__all__ = ["BACKSTOP_PAGES", "EVERY", "Checkpoints"]

EVERY = 1000  # commits of a store object between two checkpoints: about 8,000–10,000 pages of a job's writes
IDLE_S = 60.0  # a thread with no checkpoint due for this long ends (and the next due starts one): a store object
#                dropped without close() leaves no thread or connection behind for long
BACKSTOP_PAGES = 40_000  # the store connection's wal_autocheckpoint: SQLite checkpoints inline only past this

_log = logging.getLogger("agentnb.store")


class Checkpoints:
    """The checkpoints of one store object's file."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self._commits = 0
        self._due = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def committed(self) -> None:
        """One more commit of the store object (called after its turn was let go)."""
        self._commits += 1
        if self._commits < EVERY:
            return
        self._commits = 0
        with self._lock:
            if self._closed:
                return
            if self._pid != os.getpid():  # forked: the parent's thread and connection are not this process's
                self._pid, self._thread = os.getpid(), None
            if self._thread is None:
                # a daemon: a checkpoint never keeps the process alive (close() waits for one under way)
                self._thread = threading.Thread(target=self._work, name="agentnb-checkpoint", daemon=True)
                self._thread.start()
            self._due.set()  # under the lock: a thread that gives up for idleness sees it first

    def _work(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while True:
                if not self._due.wait(IDLE_S):
                    with self._lock:
                        if not self._due.is_set():
                            self._thread = None
                            return
                self._due.clear()
                if self._closed:
                    return
                try:
                    if conn is None:
                        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                               timeout=self.timeout)
                        conn.execute("PRAGMA synchronous=NORMAL")  # the syncs a checkpoint makes, as the writers'
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error:  # the next one, or SQLite's backstop, does it: never a job's failure
                    _log.debug("agentnb: a checkpoint of %s failed", self.path, exc_info=True)
        finally:
            if conn is not None:
                conn.close()

    def close(self) -> None:
        """Stop the thread, after the checkpoint under way if one is."""
        with self._lock:
            self._closed = True
            thread = self._thread if self._pid == os.getpid() else None
        if thread is not None:
            self._due.set()
            thread.join(self.timeout)
