"""The SQLite store's file, looked at before and around SQLite: what is wrong with it, in one line.

A file that is not a database, truncated, not a regular file (it or its ``-wal``/``-shm``/``-journal``: a FIFO
would block SQLite's open forever), or not writable is refused before anything is written, and every
SQLite/OS error met while using the store is worded by :func:`describe_error`.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
import time
from pathlib import Path

from .._fs import special_kind
from ..errors import StoreError

__all__ = ["SALVAGE", "describe_error", "header_problem", "special_problem", "wal_holds_pages", "writable"]

_SQLITE_MAGIC = b"SQLite format 3\x00"
SALVAGE = "restore it from a backup, or move it aside and save what is left with: sqlite3 {path} .recover"


def describe_error(exc: BaseException, path: str | os.PathLike[str]) -> str:
    """One line saying what is wrong with the store at ``path`` and what to do, for an error met using it."""
    if isinstance(exc, StoreError):
        return str(exc)
    msg = " ".join(str(exc).split())
    low = msg.lower()
    if isinstance(exc, sqlite3.IntegrityError):
        return (f"{path} refused a change ({msg}), which was not made: the store holds rows, indexes or triggers "
                "that agentnb did not write; undo what was changed in it by hand, or restore it from a backup")
    if "not a database" in low:
        return f"{path} is not an agentnb store (not a SQLite database): move it aside, or use another workspace folder"
    if "malformed" in low or "corrupt" in low:
        return f"{path} is damaged ({msg}): " + SALVAGE.format(path=path)
    if "readonly" in low or "read-only" in low:
        return (f"{path} cannot be written ({msg}): make it and its folder writable; reading still works "
                "(agentnb jobs, show, export; Workspace(path, readonly=True))")
    if "locked" in low or "busy" in low:
        return f"{path} is locked by another process ({msg}): try again when it has finished"
    if "disk is full" in low or "disk full" in low:
        return f"{path}: the disk is full ({msg}): free some space and try again"
    if "unable to open" in low:
        return f"cannot open {path} ({msg}): check that its folder exists and can be read and written"
    if isinstance(exc, OSError):
        if exc.strerror is None:  # raised with a message of its own
            return msg
        hint = {
            errno.EACCES: "check its permissions", errno.EPERM: "check its permissions",
            errno.EROFS: "it is on a read-only file system", errno.ENOSPC: "free some space and try again",
            errno.ENOTDIR: "a part of the path is a file, not a folder", errno.EISDIR: "it is a folder",
            errno.ENOENT: "check the path",
        }.get(exc.errno or 0, "check the path and its permissions")
        return f"{exc.filename or path}: {exc.strerror}: {hint}"
    return f"{path}: {msg}"


def header_problem(path: Path) -> str | None:
    """What is wrong with the first 100 bytes of an existing store file, read without SQLite (nothing written).

    SQLite only notices a truncated file when a query reaches a missing page; the header's page
    count finds it on open.  A file shorter than its header says is normal while a WAL still holds
    the rest (a checkpoint cut short), so a non-empty ``-wal`` file is left for SQLite to recover.
    """
    for look in range(_LOOKS):
        try:
            special = special_problem(path)
            if special:
                return special
            size = path.stat().st_size
            if size == 0:
                return None  # SQLite makes an empty file a new database
            with open(path, "rb") as f:
                head = f.read(100)
        except OSError as exc:
            return describe_error(exc, path)
        if len(head) < 100 or not head.startswith(_SQLITE_MAGIC):
            return f"{path} is not an agentnb store (not a SQLite database): move it aside, or use another workspace folder"
        page_size = int.from_bytes(head[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        pages = int.from_bytes(head[28:32], "big")
        counter_valid = head[24:28] == head[92:96]
        if page_size < 512 or page_size & (page_size - 1):
            return f"{path} is damaged (its header names a page size of {page_size}): " + SALVAGE.format(path=path)
        if not (counter_valid and pages and size < pages * page_size and not wal_holds_pages(path)):
            return None
        # Another connection writing the file (a new store's first transaction, a checkpoint) writes page 1, with
        # the new page count, before the pages that extend the file: a file that stays short is truncated
        if look < _LOOKS - 1:
            time.sleep(_LOOK_GAP)
    return (f"{path} is truncated ({size:,} bytes; its header says {pages * page_size:,}): "
            + SALVAGE.format(path=path))


_LOOKS, _LOOK_GAP = 3, 0.05  # a short file is looked at this many times, this many seconds apart


_SIDE_FILES = ("-wal", "-shm", "-journal")


def special_problem(path: Path) -> str | None:
    """The store file or one of SQLite's side files that exists and is not a regular file."""
    for part in (path, *(Path(f"{path}{suffix}") for suffix in _SIDE_FILES)):
        # SQLite opens these itself: a FIFO there blocks the open forever (and SIGTERM cannot end it)
        kind = _special_kind(part)
        if kind:
            return (f"{part} is {kind}, not a regular file, so it cannot be part of a store: "
                    "move it aside, or use another workspace folder")
    return None


def _special_kind(path: Path) -> str | None:
    """What ``path`` is when it exists and is not a regular file (symlinks followed), else None."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    return "a folder" if stat.S_ISDIR(mode) else special_kind(mode)


def wal_holds_pages(path: Path) -> bool:
    wal = Path(f"{path}-wal")
    return wal.exists() and wal.stat().st_size > 32  # more than the WAL header: frames not yet checkpointed


def writable(path: Path) -> bool:
    # os.access asks the kernel, so it answers for root (which ignores file modes) and for read-only mounts alike
    return os.access(path, os.W_OK)
