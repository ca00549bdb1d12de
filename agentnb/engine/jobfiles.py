"""A job's files in a store that keeps them (docs/stores.md#files): on PostgreSQL, workers share nothing but the database.

**Where a job works.**  A job of such a store (``store.keeps_files``) works in ``jobs/<id>`` under the folder of
whichever :class:`~agentnb.workspace.Workspace` runs it (its local scratch folder), never at a path of the
machine that submitted it: the ``workdir`` column holds the relative ``jobs/<id>`` (:func:`workdir_column`) and
:func:`local_workdir` makes it a path of this machine.  ``workdir=`` (an existing folder of one machine) is
refused there.  A SQLite store's jobs keep the absolute work directory they have always had and no file goes
into the store.

**What is kept.**  Every regular file under the work directory (``input/``, ``output/``, ``logs/`` and whatever
else a tool wrote) with its ``st_mode``, size, sha256 and bytes, and every symbolic link whose target stays
inside the work directory (its data is the target, made relative).  A link that leads out is never stored (the
tools never follow one out either), nor are FIFOs, sockets or devices, nor empty folders.

**When.**  At submit, the ``input/`` files, in the submit's transaction (:func:`read_rows`).  At each claim,
:func:`materialise` makes the local work directory what the store holds.  When a movement ends (and when a job
ends or pauses), :func:`plan_write_back` compares the work directory with the store, and the runner writes the
difference in the transaction that records the movement (:meth:`WriteBack.apply`).  A running job's
:class:`~agentnb.engine._filecache.FileCache` (filled by :func:`materialise`) spares reading and hashing again
a file whose stat has not changed since it was last hashed (racily clean files excepted, as there).

**How much.**  At most ``files_limit`` bytes of files per job (:data:`DEFAULT_FILES_LIMIT`, ``AGENTNB_FILES_LIMIT``,
:func:`parse_files_limit`): more is refused at submit, and fails the job at a movement end with nothing written.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from ..errors import StoreError, UsageError
from ..store.base import StoredFile
from ._filecache import FileCache, hash_file, read_regular

if TYPE_CHECKING:
    from ..store.base import Store, Transaction
    from ..store.records import JobRecord

__all__ = [
    "DEFAULT_FILES_LIMIT",
    "FILES_LIMIT_ENV",
    "FileCache",
    "FilesOverLimit",
    "WriteBack",
    "check_total",
    "file_listing",
    "format_size",
    "local_workdir",
    "logs_folder",
    "materialise",
    "parse_files_limit",
    "plan_write_back",
    "pull_files",
    "read_rows",
    "stored_inputs",
    "workdir_column",
]

DEFAULT_FILES_LIMIT = 100 * 1000**2  # 100 MB
FILES_LIMIT_ENV = "AGENTNB_FILES_LIMIT"
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3}
_LIMIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
# the folders every work directory has (engine/workdir.py): never removed when a materialise empties them
_KEPT_FOLDERS = ("input", "output", "logs")


class FilesOverLimit(UsageError):
    """A job's files hold more bytes than the limit allows (the message is the one line a user sees)."""


# -- the limit ------------------------------------------------------------------------------------------------

def parse_files_limit(value: Any = None) -> int:
    """The per-job limit in bytes: ``value`` (an int of bytes, or text such as ``"100MB"``, ``"512KiB"``), else
    ``$AGENTNB_FILES_LIMIT``, else :data:`DEFAULT_FILES_LIMIT`; a bad value is one :class:`UsageError` line."""
    where = "files_limit"
    if value is None:
        value = os.environ.get(FILES_LIMIT_ENV) or None
        where = FILES_LIMIT_ENV
        if value is None:
            return DEFAULT_FILES_LIMIT
    allowed = "allowed: a whole number of bytes above 0, or with a unit: '100MB', '512KB', '2GB', '64MiB'"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UsageError(f"{where}={value!r}; {allowed}")
    if isinstance(value, int):
        number: float = value
    else:
        found = _LIMIT.match(value)
        if found is None or found.group(2).lower() not in _UNITS:
            raise UsageError(f"{where}={value!r}; {allowed}")
        number = float(found.group(1)) * _UNITS[found.group(2).lower()]
    if number < 1 or number != number:
        raise UsageError(f"{where}={value!r}; {allowed}")
    return int(number)


def format_size(size: int) -> str:
    """``size`` bytes in words: ``312 bytes``, ``4.2 kB``, ``100 MB`` (decimal units, as the limit's default)."""
    if size < 1000:
        return f"{size} byte{'s' if size != 1 else ''}"
    for unit, scale in (("GB", 1000**3), ("MB", 1000**2), ("kB", 1000)):
        if size >= scale:
            text = f"{size / scale:.1f}".removesuffix(".0")
            return f"{text} {unit}"
    return f"{size} bytes"  # pragma: no cover - the loop always returns


def check_total(what: str, total: int, limit: int, *, then: str) -> None:
    """One :class:`FilesOverLimit` line when ``total`` bytes of files (``what`` holds them) exceed ``limit``."""
    if total > limit:
        raise FilesOverLimit(f"{what}: {format_size(total)} ({total:,} bytes) of files, over the limit of "
                             f"{format_size(limit)} ({limit:,} bytes) per job (files_limit= or "
                             f"{FILES_LIMIT_ENV}); {then}")


# -- where a job works --------------------------------------------------------------------------------------

def workdir_column(store: Store, job_id: int, workdir: Path) -> str:
    """What the ``workdir`` column holds for a job working in ``workdir`` on this machine: the relative
    ``jobs/<id>`` in a store that keeps files (each worker has its own folder), the absolute path otherwise."""
    return f"jobs/{job_id}" if store.keeps_files else str(workdir)


def logs_folder(root: Path, job: JobRecord, keeps_files: bool) -> Path:
    """The ``logs/`` folder of ``job`` on this machine (``lessons.jsonl``, the Checklist tool's lists; docs/workspace.md).

    It belongs with the job's files: on SQLite, a job in the default layout works in ``jobs/<id>`` of the workspace
    that submitted it, and its ``logs/`` is there, whichever workspace folder runs or reads it (a worker started
    with ``--store sqlite:///…`` and a folder of its own); with ``workdir=`` (or in a store that keeps files) it is
    ``jobs/<id>/logs`` under ``root``."""
    if not keeps_files and job.workdir:
        workdir = Path(job.workdir)
        if workdir.name == str(job.id) and workdir.parent.name == "jobs":
            return workdir / "logs"
    return root / "jobs" / str(job.id) / "logs"


def local_workdir(root: Path, job: JobRecord, keeps_files: bool) -> Path:
    """The work directory of ``job`` on this machine: ``root/jobs/<id>`` in a store that keeps files
    (whatever the column says: a copied SQLite row may hold another machine's path), else the column's path."""
    if keeps_files:
        return root / "jobs" / str(job.id)
    return Path(job.workdir)


# -- reading a work directory --------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Local:
    """A file or link found under a work directory; ``link`` is a link's stored target."""

    path: str
    mode: int
    size: int
    sha256: str
    full: str
    link: str | None = None

    def row(self) -> StoredFile:
        """The row to store: a regular file's bytes read now (their hash and size with them), a link's target."""
        if self.link is not None:
            data = os.fsencode(self.link)
            return StoredFile(self.path, self.mode, len(data), self.sha256, data)
        data, st = read_regular(self.full)
        return StoredFile(self.path, st.st_mode, len(data), hashlib.sha256(data).hexdigest(), data)


def _inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root + os.sep)


def _sha_or_none(path: Path) -> str | None:
    try:
        return hash_file(path)
    except FileNotFoundError:
        return None


def _entries(workdir: Path) -> dict[str, tuple[str, os.stat_result]]:
    """Everything under ``workdir`` that is not a folder (links to folders included), by POSIX relative path;
    no link is followed.  (``os.scandir`` and string paths: it runs after every tool call, and making a
    ``Path`` of each file cost more than its ``lstat``.)"""
    found: dict[str, tuple[str, os.stat_result]] = {}
    if not workdir.is_dir():
        return found
    folders = [(str(workdir), "")]
    while folders:
        folder, prefix = folders.pop()
        try:
            listing = os.scandir(folder)
        except OSError:  # gone, or replaced, while we looked (os.walk skips it too)
            continue
        with listing:
            for entry in listing:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # gone while we looked
                    continue
                if stat.S_ISDIR(st.st_mode):
                    folders.append((entry.path, f"{prefix}{entry.name}/"))
                else:
                    found[prefix + entry.name] = (entry.path, st)
    return found


def _scan(workdir: Path, cache: FileCache | None = None) -> dict[str, _Local]:
    """The files and inside-pointing links under ``workdir``, hashed (a file ``cache`` trusts is not read);
    links that lead out and special files are left out."""
    root = os.path.realpath(workdir)
    cache = FileCache() if cache is None else cache
    since = time.time_ns()  # before any stat: what the cache measures a file's age against
    out: dict[str, _Local] = {}
    for rel, (full, st) in sorted(_entries(Path(root)).items()):
        if stat.S_ISREG(st.st_mode):
            try:
                sha, st = cache.sha256(rel, full, st, since)
            except FileNotFoundError:
                continue
            out[rel] = _Local(rel, st.st_mode, st.st_size, sha, full)
        elif stat.S_ISLNK(st.st_mode):
            target = os.readlink(full)
            real = os.path.realpath(full)
            if not _inside(real, root):
                continue  # it leads out of the work directory: never stored (the tools never follow one out)
            if os.path.isabs(target):  # the same place, written so that it holds in another worker's folder
                target = os.path.relpath(real, os.path.dirname(full))
            data = os.fsencode(target)
            out[rel] = _Local(rel, st.st_mode, len(data), hashlib.sha256(data).hexdigest(), full, link=target)
    cache.keep_only(rel for rel, f in out.items() if f.link is None)
    return out


def read_rows(workdir: Path, paths: Iterable[Path]) -> list[StoredFile]:
    """The rows of the regular files ``paths`` (under ``workdir``), read from disk: a submit's ``input/`` files."""
    rows: dict[str, StoredFile] = {}
    root = Path(os.path.realpath(workdir))
    for path in paths:
        real = Path(os.path.realpath(path))
        data = real.read_bytes()
        rel = real.relative_to(root).as_posix()
        rows[rel] = StoredFile(rel, os.stat(real).st_mode, len(data), hashlib.sha256(data).hexdigest(), data)
    return [rows[k] for k in sorted(rows)]


# -- writing back --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WriteBack:
    """What a work directory changed since the store last had it: rows to upsert and paths to delete."""

    files: list[StoredFile] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    total: int = 0  # the bytes of all the job's files after it

    @property
    def empty(self) -> bool:
        return not self.files and not self.removed

    def apply(self, store: Store, c: Transaction, job_id: int) -> None:
        """Write it in ``c`` (the transaction that records the movement, so both commit or neither does)."""
        if not self.empty:
            store.write_files(c, job_id, self.files, self.removed)


def plan_write_back(store: Store, job_id: int, workdir: Path, limit: int,
                    cache: FileCache | None = None) -> WriteBack:
    """Compare ``workdir`` with job ``job_id``'s files in ``store`` (reading only the files ``cache``, the
    running job's, cannot vouch for); :class:`FilesOverLimit` (nothing to write) when the work directory holds
    more than ``limit`` bytes."""
    what = f"job {job_id}'s work directory"
    then = "nothing was written back: remove large files from the work directory, or raise the limit"
    local = _scan(workdir, cache)
    check_total(what, sum(f.size for f in local.values()), limit, then=then)
    stored = {r["path"]: r for r in store.file_rows(job_id)}
    changed: list[StoredFile] = []
    kept: list[str] = []
    for rel, f in local.items():
        row = stored.get(rel)
        if row is not None and row["sha256"] == f.sha256 and int(row["mode"]) == f.mode:
            kept.append(rel)
            continue
        try:
            changed.append(f.row())  # read now: the hash stored is that of the bytes stored
        except (FileNotFoundError, IsADirectoryError):
            continue  # gone since the scan: its row (if any) is removed below
    present = set(kept) | {f.path for f in changed}
    total = sum(f.size for f in changed) + sum(int(stored[p]["size"]) for p in kept)
    check_total(what, total, limit, then=then)  # a file may have grown between the scan and the read
    return WriteBack(files=changed, removed=sorted(p for p in stored if p not in present), total=total)


# -- materialising ---------------------------------------------------------------------------------------------

def _safe_rel(job_id: int, rel: str) -> PurePosixPath:
    path = PurePosixPath(rel)
    if path.is_absolute() or not path.parts or any(p in ("", ".", "..") for p in path.parts):
        raise StoreError(f"job {job_id} has a stored file {rel!r} that is not a path inside its work directory")
    return path


def _make_parents(workdir: Path, rel: PurePosixPath) -> Path:
    """``workdir/rel``'s folder, made: a link or file where a folder must be is removed first (the store is
    the truth, and a link there would lead the write out of the work directory)."""
    here = workdir
    for part in rel.parts[:-1]:
        here = here / part
        if here.is_symlink() or (here.exists() and not here.is_dir()):
            here.unlink()
        here.mkdir(exist_ok=True)
    return here


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


def _place(workdir: Path, rel: PurePosixPath, mode: int, data: bytes) -> None:
    """Write one stored file or link at ``workdir/rel`` (through a temporary name, so a reader never sees
    half a file)."""
    folder = _make_parents(workdir, rel)
    target = folder / rel.name
    tmp = folder / f".{rel.name}.agentnb-{os.getpid()}.tmp"
    _remove(tmp)
    if stat.S_ISLNK(mode):
        os.symlink(os.fsdecode(data), tmp)
    else:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, stat.S_IMODE(mode))
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    os.replace(tmp, target)


def materialise(store: Store, job_id: int, workdir: Path, cache: FileCache | None = None) -> list[str]:
    """Make ``workdir`` hold job ``job_id``'s files as the store has them: each file whose sha256 (or link
    target) differs is written with its mode, each local file or link the store does not have is removed.
    ``cache`` (the running job's) learns every file's hash, and spares reading those it can vouch for.
    Returns the paths written."""
    rows = {r["path"]: r for r in store.file_rows(job_id)}
    workdir.mkdir(parents=True, exist_ok=True)
    root = Path(os.path.realpath(workdir))
    cache = FileCache() if cache is None else cache
    since = time.time_ns()
    local = _entries(root)
    wanted: list[str] = []
    for rel, row in rows.items():
        _safe_rel(job_id, rel)
        mode, sha = int(row["mode"]), str(row["sha256"])
        have = local.get(rel)
        if have is not None:
            full, st = have
            if stat.S_ISLNK(mode) and stat.S_ISLNK(st.st_mode):
                if hashlib.sha256(os.fsencode(os.readlink(full))).hexdigest() == sha:
                    continue
            elif stat.S_ISREG(mode) and stat.S_ISREG(st.st_mode) and _cached_sha(cache, rel, full, st, since) == sha:
                if stat.S_IMODE(st.st_mode) != stat.S_IMODE(mode):
                    os.chmod(full, stat.S_IMODE(mode))
                continue
        wanted.append(rel)
    # a folder (or anything) the store needs as a folder, and every file it does not have, goes first
    folders = {str(p) for rel in rows for p in PurePosixPath(rel).parents if str(p) != "."}
    for rel, (full, _st) in sorted(local.items(), reverse=True):
        if rel not in rows:
            os.unlink(full)
            _prune(root, Path(full).parent)
    for rel in sorted(folders):
        folder = root / rel
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            folder.unlink()
    data = store.file_data(job_id, wanted) if wanted else {}
    for rel in wanted:
        if rel not in data:  # deleted by the job's new owner since we listed it: the next claim catches up
            continue
        _place(root, _safe_rel(job_id, rel), int(rows[rel]["mode"]), data[rel])
        if stat.S_ISREG(int(rows[rel]["mode"])):
            cache.written(rel, str(root / rel), str(rows[rel]["sha256"]))
    cache.keep_only(rel for rel, row in rows.items() if stat.S_ISREG(int(row["mode"])))
    return [rel for rel in wanted if rel in data]


def _cached_sha(cache: FileCache, rel: str, full: str, st: os.stat_result, since: int) -> str | None:
    try:
        return cache.sha256(rel, full, st, since)[0]
    except FileNotFoundError:
        return None


def _prune(root: Path, folder: Path) -> None:
    """Remove ``folder`` and its parents below ``root`` while they are empty (not the work directory's own
    ``input/``, ``output/``, ``logs/``)."""
    while folder != root and root in folder.parents:
        if folder.parent == root and folder.name in _KEPT_FOLDERS:
            return
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


# -- what the facade shows and copies -----------------------------------------------------------------------

def _under(rel: str, under: str | None) -> bool:
    return under is None or rel == under or rel.startswith(under + "/")


def _check_under(under: str | None) -> str | None:
    if under is None:
        return None
    if not isinstance(under, str) or not under.strip("/ ") or ".." in PurePosixPath(under).parts \
            or PurePosixPath(under).is_absolute():
        raise UsageError(f"under={under!r}; allowed: a folder relative to the work directory, e.g. 'output'")
    return under.strip("/")


def file_listing(store: Store, job_id: int, workdir: Path, under: str | None = None) -> list[dict[str, Any]]:
    """One row per file of the job (``path``, ``size``, ``sha256``, ``updated`` (epoch seconds), ``mode``),
    sorted by path: the store's rows where it keeps files, else the work directory on disk, read the same way
    (``updated`` its modification time)."""
    under = _check_under(under)
    if store.keeps_files:
        rows = [dict(r) for r in store.file_rows(job_id)]
    else:
        rows = []
        for rel, f in _scan(workdir).items():
            rows.append({"path": rel, "size": f.size, "sha256": f.sha256,
                         "updated": os.lstat(f.full).st_mtime, "mode": f.mode})
    return [{k: r[k] for k in ("path", "size", "sha256", "updated", "mode")}
            for r in sorted(rows, key=lambda r: r["path"]) if _under(r["path"], under)]


def _same(target: Path, mode: int, sha: str) -> bool:
    """Whether ``target`` already holds this file (or link)."""
    if stat.S_ISLNK(mode):
        return target.is_symlink() and hashlib.sha256(os.fsencode(os.readlink(target))).hexdigest() == sha
    return target.is_file() and not target.is_symlink() and _sha_or_none(target) == sha


def pull_files(store: Store, job_id: int, workdir: Path, dest: str | os.PathLike[str], *,
               overwrite: bool = False, under: str | None = None) -> list[Path]:
    """Copy job ``job_id``'s files (those ``under`` a folder, or all) into ``dest`` at their paths relative to
    the work directory; files already there with the same content are left alone.  A different file in the
    way is one :class:`UsageError` line (nothing written) unless ``overwrite``.  Returns the paths written."""
    if overwrite not in (True, False):
        raise UsageError(f"overwrite={overwrite!r}; allowed: True or False")
    listing = file_listing(store, job_id, workdir, under)
    target_root = Path(dest).expanduser().resolve()
    if target_root.exists() and not target_root.is_dir():
        raise UsageError(f"dest {str(dest)!r} is a file; give a folder (it is made when missing)")
    todo: list[dict[str, Any]] = []
    clashes: list[str] = []
    for row in listing:
        rel = _safe_rel(job_id, row["path"])
        target = target_root.joinpath(*rel.parts)
        if not (target.exists() or target.is_symlink()):
            todo.append(row)
        elif not _same(target, int(row["mode"]), str(row["sha256"])):
            clashes.append(row["path"])
            todo.append(row)
    if clashes and not overwrite:
        more = f" and {len(clashes) - 1} more" if len(clashes) > 1 else ""
        raise UsageError(f"{len(clashes)} file(s) in {target_root} differ from job {job_id}'s: {clashes[0]}{more}; "
                         "nothing was copied: pass overwrite=True to replace them, or pull into an empty folder")
    if store.keeps_files:
        data = store.file_data(job_id, [r["path"] for r in todo]) if todo else {}
    else:
        local = _scan(workdir)
        data = {r["path"]: local[r["path"]].row().data for r in todo if r["path"] in local}
    target_root.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for row in todo:
        if row["path"] not in data:
            continue
        rel = _safe_rel(job_id, row["path"])
        _place(target_root, rel, int(row["mode"]), data[row["path"]])
        written.append(target_root.joinpath(*rel.parts))
    return written


def stored_inputs(store: Store, job_id: int) -> dict[str, bytes]:
    """Job ``job_id``'s regular ``input/`` files in the store, name (relative to ``input/``) → bytes: what a
    fork or replay of it starts from where files live in the store."""
    names = [r["path"] for r in store.file_rows(job_id)
             if r["path"].startswith("input/") and stat.S_ISREG(int(r["mode"]))]
    data = store.file_data(job_id, names) if names else {}
    return {path[len("input/"):]: data[path] for path in names if path in data}
