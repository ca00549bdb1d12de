"""The order in which a SQLite store's writers take their turns: a ``flock`` on ``<store>-lock``, held by a process
from before its ``BEGIN IMMEDIATE`` to after its ``COMMIT``.

SQLite's own wait for its write lock (its busy handler) sleeps 1, 2, 5, 10 … up to 100 ms between tries, and is not
woken when the lock is let go.  With several worker processes writing transactions of a fraction of a millisecond,
a process that finds the lock taken sleeps many times longer than the transaction it waits for: 400 short jobs ran
slower on 2 workers than on 1, each worker blocked a third of its time
(benchmarks/README.md#short-jobs-and-the-fixed-cost-per-job-issue-32).  A process waiting on the ``flock`` is woken by
the kernel the moment the holder lets go, so the writers take their turns back to back.

SQLite's lock is still what makes a write atomic: this one only orders agentnb's writers among themselves.  Where it
cannot be had (no ``fcntl``, a file system without ``flock``, a ``-lock`` that cannot be opened) it is left out and the
writers wait for SQLite's lock as before.  The file is made beside the store at the first write and never removed
(a lock file removed while another process waits on it would let two writers in at once).
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: SQLite's busy handler alone
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_SUFFIX", "WriteLock"]

LOCK_SUFFIX = "-lock"


class WriteLock:
    """The write lock of the store at ``path`` (None: none, for a read-only or in-memory store).  Not re-entrant:
    the store takes it once per outermost transaction, under its own thread lock."""

    def __init__(self, path: Path | None) -> None:
        self._path = None if path is None or fcntl is None else Path(f"{path}{LOCK_SUFFIX}")
        self._fd: int | None = None
        self._held = False

    def acquire(self) -> None:
        """Wait for this process's turn to write (at once when no other process writes)."""
        if self._path is None:
            return
        if self._fd is None:
            try:
                # O_NOFOLLOW: a link planted there is not followed; O_NONBLOCK: a FIFO there never blocks the open
                self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                                   0o666)
            except OSError:
                self._path = None
                return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except OSError:  # not supported here: SQLite's busy handler alone, from now on
            self.close()
            self._path = None
            return
        self._held = True

    def release(self) -> None:
        if self._held and self._fd is not None:
            self._held = False
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd, self._held = self._fd, None, False
            os.close(fd)  # lets go of the lock too
