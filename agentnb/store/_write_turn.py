"""Turns at a SQLite store's write lock for the processes that share it (docs/stores.md#sqlite-writers).

SQLite has no queue for its write lock: a writer that finds it taken can only try again later, and its own busy
handler sleeps 1, 2, 5 … 100 ms between tries while a job's transactions hold the lock for a tenth of a
millisecond or so.  Trying again in shorter steps (what the store did before) still left the lock free between a
writer's release and the next try, and cost every waiter failed tries (benchmarks/README.md, short jobs).

So agentnb's writers first take a turn: an exclusive ``flock`` on ``<store>-lock``, an empty file beside the
store.  The kernel queues the processes waiting for it and wakes the next as soon as the holder lets go; the
holder then finds SQLite's lock free.  A writer that is not agentnb (the ``sqlite3`` shell, another tool) does not
take turns, and is waited for by SQLite's own busy handler, as before.  The turn orders writers, it guards
nothing: SQLite's lock stays what keeps the store consistent, so a process that cannot make the file (a
read-only folder) writes without turns.

One turn per file and process, shared by every store object on that file in the process: two objects would
otherwise hold two ``flock`` descriptions of one file, and a thread in a transaction of one that wrote through the
other would wait for itself for ever.  The process's threads wait for the turn on a lock with the store's time
limit, as they waited for SQLite's lock before.  A ``flock`` is let go when its process ends, however it ends;
a process *stopped* in the middle of a write (Ctrl-Z, a debugger) keeps the others waiting until it goes on.
"""

from __future__ import annotations

import fcntl
import os
import stat
import threading

__all__ = ["WriteTurn", "turn_for"]


class WriteTurn:
    """This process's turn at one store file's write lock."""

    __slots__ = ("_fd", "_lock")

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()

    def take(self, wait: float) -> bool:
        """Wait for the turn; False when this process's other threads hold it for ``wait`` seconds."""
        if not self._lock.acquire(timeout=wait):
            return False
        if self._fd < 0:
            return True
        try:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fcntl.flock(self._fd, fcntl.LOCK_EX)  # another process writes: woken when it lets go
        except OSError:
            # a file system without flock (some network mounts): SQLite's lock alone from now on
            os.close(self._fd)
            self._fd = -1
        except BaseException:
            self._lock.release()
            raise
        return True

    def give(self) -> None:
        try:
            if self._fd >= 0:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()


_TURNS: dict[str, WriteTurn | None] = {}
_TURNS_LOCK = threading.Lock()


def turn_for(path: str) -> WriteTurn | None:
    """The turn of the store file at ``path`` (its real path) in this process, or None when its lock file cannot
    be made or opened (then the store's writers wait for SQLite's lock alone).  Asked once per store object."""
    with _TURNS_LOCK:
        if path not in _TURNS:
            _TURNS[path] = _open(f"{path}-lock")
        return _TURNS[path]


def _open(lock_path: str) -> WriteTurn | None:
    try:
        # O_NONBLOCK: a FIFO put there must not block the open; it is refused just below
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
    except OSError:
        return None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        regular = False
    if not regular:
        os.close(fd)
        return None
    return WriteTurn(fd)
