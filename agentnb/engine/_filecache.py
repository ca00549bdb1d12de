"""Reading a work directory's files, and a running job's cache of their hashes (``engine/jobfiles.py``).

Where the store keeps a job's files (docs/stores.md#files), the work directory is compared with the store after every
tool call.  :class:`FileCache` keeps, per file, the ``lstat`` it had when it was last hashed and that hash, so a
file whose stat has not changed is neither read nor hashed again.  It lives with the running job (the
:class:`~agentnb.workspace.Workspace` that claimed it; :func:`~agentnb.engine.jobfiles.materialise` fills it),
never in the store: it describes this machine's disk.

**Racily clean files.**  A stat is a fingerprint only if a later change must alter it.  A file rewritten in
place with the same size keeps its inode, and within the file system's timestamp granularity (a clock tick, a
second, two on FAT) its mtime and ctime too.  So, as git does for "racily clean" index entries, a hash is
trusted only when the file's mtime and ctime were already :data:`RACY_NS` (2 s) older than the moment the scan
that hashed it began: any write after that moment leaves a newer timestamp.  A file changed less than 2 s
before a scan is hashed again at the next one (and the one after that trusts it).  ctime is part of the
fingerprint as well, so a tool that restores an mtime (``touch -r``, ``cp -p``, ``tar``) is noticed too.  The
clock stepping back by more than 2 s between two scans, or a file system that forges ctime, would defeat it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RACY_NS", "FileCache", "hash_file", "on_read", "open_regular", "read_regular"]

RACY_NS = 2_000_000_000  # how much older than a scan a file's timestamps must be for its stat to be trusted
_READ_CHUNK = 1 << 20

# Called with the path of every file whose bytes are read here (hashed or read to be stored): tests and
# benchmarks count the reads through it; None in use.
on_read: Callable[[str | Path], None] | None = None


def open_regular(path: str | Path) -> int:
    """A descriptor of the regular file ``path``; FileNotFoundError when it is gone or is no longer a regular
    file (a tool may swap it for a link or a FIFO at any moment: never followed, never waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO):
            raise FileNotFoundError(str(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FileNotFoundError(str(path))
    return fd


def _hash_open(path: str | Path) -> tuple[str, os.stat_result]:
    """The sha256 of the regular file ``path`` and the stat of the very file read (taken before reading)."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if on_read is not None:
            on_read(path)
        digest = hashlib.sha256()
        while chunk := fh.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest(), st


def hash_file(path: str | Path) -> str:
    """The sha256 of the regular file ``path``, read now (FileNotFoundError as :func:`open_regular`)."""
    return _hash_open(path)[0]


def read_regular(path: str | Path) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file ``path`` and its stat (FileNotFoundError as :func:`open_regular`)."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if on_read is not None:
            on_read(path)
        return fh.read(), st


def _fingerprint(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True, slots=True)
class _Seen:
    fingerprint: tuple[int, ...]
    sha256: str
    settled: bool  # its timestamps were RACY_NS older than the scan that hashed it: a change would alter them


class FileCache:
    """The sha256 of each file of one work directory by its stat, for the job running there.

    One job runs in one thread of a process at a time, so a cache is never used by two threads at once.
    """

    def __init__(self) -> None:
        self._seen: dict[str, _Seen] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def sha256(self, rel: str, full: str | Path, st: os.stat_result, since_ns: int) -> tuple[str, os.stat_result]:
        """The sha256 of regular file ``full`` (``rel`` in the work directory, ``st`` its ``lstat``) and the stat
        that goes with it: the cached hash when ``st`` is the stat it was hashed at and that hash is settled, else
        read and hashed now.  ``since_ns`` is ``time.time_ns()`` taken before ``st`` was (the scan's start).
        FileNotFoundError when it is gone or no longer a regular file."""
        seen = self._seen.get(rel)
        if seen is not None and seen.settled and seen.fingerprint == _fingerprint(st):
            return seen.sha256, st
        sha, read_st = _hash_open(full)
        settled = max(read_st.st_mtime_ns, read_st.st_ctime_ns) < since_ns - RACY_NS
        self._seen[rel] = _Seen(_fingerprint(read_st), sha, settled)
        return sha, read_st

    def written(self, rel: str, full: str | Path, sha: str) -> None:
        """``full`` was just written with bytes of hash ``sha`` (a materialise): known, but not settled."""
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            self._seen.pop(rel, None)
            return
        self._seen[rel] = _Seen(_fingerprint(st), sha, settled=False)

    def keep_only(self, rels: Iterable[str]) -> None:
        """Forget every file but ``rels`` (those a scan found): the cache never outgrows the work directory."""
        keep = set(rels)
        for rel in [r for r in self._seen if r not in keep]:
            del self._seen[rel]
