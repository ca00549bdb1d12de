"""A job's files as :func:`agentnb.store.copy.copy_store` moves them: read from a work directory on disk (SQLite
keeps them there) or from the PostgreSQL ``files`` table, and written to either.

One file is a :class:`FileRow`, the shape of a ``files`` row (PG migration 2): ``path`` relative to the work
directory in POSIX form, ``mode`` its whole ``st_mode`` (a regular file, or a symbolic link whose
``data`` is its target), ``size``, ``sha256`` of ``data``, ``updated`` (mtime).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import StoreError

__all__ = ["FileRow", "check_rel_path", "read_tree", "write_tree"]


@dataclass(frozen=True)
class FileRow:
    path: str
    mode: int
    size: int
    sha256: str
    data: bytes
    updated: float


def read_tree(root: Path, prefix: str = "") -> Iterator[FileRow]:
    """Every regular file and symbolic link under ``root`` (sorted by path), each path prefixed with ``prefix``,
    stored as the work-directory write-back (engine/jobfiles.py) stores them: ``mode`` the whole ``st_mode``; a
    link's data its target (made relative when it was absolute), kept only when it stays inside ``root`` (the
    tools never follow one out); FIFOs, sockets, devices and empty folders are not files to keep."""
    if not root.is_dir():
        return
    real_root = os.path.realpath(root)
    found: list[tuple[str, Path]] = []
    for folder, dirs, names in os.walk(real_root):
        here = Path(folder)
        for name in (*dirs, *names):  # a link to a folder is listed among the folders, and not walked into
            p = here / name
            if p.is_dir() and not p.is_symlink():
                continue
            found.append((PurePosixPath(*p.relative_to(real_root).parts).as_posix(), p))
    for rel, p in sorted(found):
        try:
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                real = os.path.realpath(p)
                if not (real == real_root or real.startswith(real_root + os.sep)):
                    continue
                target = os.readlink(p)
                if os.path.isabs(target):
                    target = os.path.relpath(real, os.path.dirname(p))
                data = os.fsencode(target)
            elif stat.S_ISREG(st.st_mode):
                data = p.read_bytes()
            else:
                continue
        except OSError as exc:
            raise StoreError(f"cannot read {p}: {exc.strerror or type(exc).__name__}") from None
        yield FileRow(prefix + rel, st.st_mode, len(data), hashlib.sha256(data).hexdigest(), data, st.st_mtime)


def check_rel_path(job_id: int, path: str) -> PurePosixPath:
    """``path`` of a ``files`` row as a relative path that stays inside the work directory, else one line."""
    rel = PurePosixPath(path)
    if not path or rel.is_absolute() or ".." in rel.parts or "\\" in path or "\x00" in path:
        raise StoreError(f"job {job_id} has a file {path!r} that does not stay inside its work directory: "
                         "nothing was copied")
    return rel


def write_tree(root: Path, job_id: int, rows: Iterator[FileRow]) -> tuple[int, int]:
    """Write ``rows`` under ``root`` (made if missing), each with its mode and mtime; (files, bytes) written.

    A row whose data does not match its sha256 (a damaged store) is refused with one line."""
    n = total = 0
    for row in rows:
        rel = check_rel_path(job_id, row.path)
        if hashlib.sha256(row.data).hexdigest() != row.sha256:
            raise StoreError(f"job {job_id}'s file {row.path!r} does not match its sha256: the source store is "
                             "damaged; nothing was copied")
        target = root.joinpath(*rel.parts)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if stat.S_ISLNK(row.mode):
                link = os.fsdecode(row.data)
                lands = posixpath.normpath(posixpath.join(posixpath.dirname(rel.as_posix()), link))
                if posixpath.isabs(link) or lands == ".." or lands.startswith("../"):
                    raise StoreError(f"job {job_id}'s link {row.path!r} leads out of its work directory "
                                     f"({link!r}): nothing was copied")
                os.symlink(link, target)
                n, total = n + 1, total + row.size
                continue
            target.write_bytes(row.data)
            os.chmod(target, stat.S_IMODE(row.mode))
            os.utime(target, (row.updated, row.updated))
        except OSError as exc:
            raise StoreError(f"cannot write {target}: {exc.strerror or type(exc).__name__}") from None
        n += 1
        total += row.size
    return n, total
