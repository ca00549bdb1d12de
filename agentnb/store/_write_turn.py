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
other would wait for itself for ever.  The turn's descriptor is closed with the last of those objects
(:func:`let_go`): a notebook that opens workspace after workspace keeps no descriptor of each.  The process's
threads wait for the turn on a lock with the store's time limit, as they waited for SQLite's lock before.  A
``flock`` is let go when its process ends, however it ends; a process *stopped* in the middle of a write (Ctrl-Z, a
debugger) keeps the others waiting until it goes on.
"""

from __future__ import annotations

import fcntl
import os
import stat
import threading

__all__ = ["WriteTurn", "let_go", "turn_for"]


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

    def close(self, wait: float) -> None:
        """Close the lock file (its ``flock`` goes with it), once a thread of this process holding the turn has
        given it back, or after ``wait`` seconds."""
        held = self._lock.acquire(timeout=wait)
        try:
            fd, self._fd = self._fd, -1
            if fd >= 0:
                os.close(fd)
        finally:
            if held:
                self._lock.release()


# each file's turn, with the number of store objects open on it
_TURNS: dict[str, tuple[WriteTurn | None, int]] = {}
_TURNS_LOCK = threading.Lock()


def turn_for(path: str) -> WriteTurn | None:
    """The turn of the store file at ``path`` (its real path) in this process, or None when its lock file cannot
    be made or opened (then the store's writers wait for SQLite's lock alone).  Asked once per store object, which
    gives it back with :func:`let_go` when it closes."""
    with _TURNS_LOCK:
        turn, users = _TURNS[path] if path in _TURNS else (_open(f"{path}-lock"), 0)
        _TURNS[path] = (turn, users + 1)
        return turn


def let_go(path: str, wait: float) -> None:
    """A store object on the file at ``path`` has closed: with the last one, the file's turn is closed
    (:meth:`WriteTurn.close`, waiting up to ``wait`` seconds for a thread still holding it)."""
    with _TURNS_LOCK:
        if path not in _TURNS:
            return
        turn, users = _TURNS.pop(path)
        if users > 1:
            _TURNS[path] = (turn, users - 1)
            return
    if turn is not None:
        turn.close(wait)


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
