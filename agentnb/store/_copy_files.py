"""A job's files as :func:`agentnb.store.copy.copy_store` moves them: read from a work directory on disk (SQLite
keeps them there) or from the PostgreSQL ``files`` table, and written to either.

One file is a :class:`FileRow`, the shape of a ``files`` row (PG migration 2): ``path`` relative to the work
directory in POSIX form, ``mode`` its permission bits, ``size``, ``sha256`` of ``data``, ``updated`` (mtime).
"""

from __future__ import annotations

import hashlib
import os
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


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def read_tree(root: Path, prefix: str = "", *, skip: Path | None = None) -> Iterator[FileRow]:
    """Every regular file under ``root`` (sorted by path), each path prefixed with ``prefix``.

    A symbolic link is followed only when it leads to a regular file inside ``root`` (its content is stored,
    as a worker elsewhere would need it); one leading out is skipped, as the tools never leave the work
    directory.  ``skip``: a folder under ``root`` left out (it is read on its own).
    """
    if not root.is_dir():
        return
    real_root = root.resolve()
    found: list[tuple[str, Path]] = []
    for folder, dirs, names in os.walk(root, followlinks=False):
        here = Path(folder)
        if skip is not None:
            dirs[:] = [d for d in dirs if (here / d) != skip]
        for name in names:
            p = here / name
            found.append((PurePosixPath(*p.relative_to(root).parts).as_posix(), p))
    for rel, p in sorted(found):
        try:
            if p.is_symlink():
                target = p.resolve()
                if not _inside(target, real_root) or not target.is_file():
                    continue
            st = p.stat()
            if not stat.S_ISREG(st.st_mode):
                continue  # a FIFO or socket left in the folder is no file to keep
            data = p.read_bytes()
        except OSError as exc:
            raise StoreError(f"cannot read {p}: {exc.strerror or type(exc).__name__}") from None
        yield FileRow(prefix + rel, stat.S_IMODE(st.st_mode), len(data), hashlib.sha256(data).hexdigest(), data,
                      st.st_mtime)


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
            target.write_bytes(row.data)
            os.chmod(target, row.mode & 0o7777)
            os.utime(target, (row.updated, row.updated))
        except OSError as exc:
            raise StoreError(f"cannot write {target}: {exc.strerror or type(exc).__name__}") from None
        n += 1
        total += row.size
    return n, total
