"""``agentnb store copy SRC DST``: a whole workspace moved from one store to another (docs/stores.md#moving-between-stores).

SRC and DST are each a folder or file path, ``sqlite:///ABS/PATH`` or ``postgresql://…``.  Every row is copied
with its id (texts, batches, jobs, comments, movements, events, in that order, each in id order), so the copy
reads event for event as the original; then the ids a new row gets go on after the largest copied one (on
PostgreSQL the sequences are set with ``setval``; SQLite's AUTOINCREMENT counter follows the inserted ids).

A job's files go with it: SQLite keeps them on disk in the job's work directory (``jobs.workdir``; with a
work directory of the user's own, ``jobs/<id>/logs`` of the workspace folder is added as ``logs/…``),
PostgreSQL in its ``files`` table, one row per regular file or inside-pointing symbolic link, ``mode`` its
whole ``st_mode`` (as the work-directory write-back of ``engine/jobfiles.py`` stores them).  Into SQLite they
are written to ``jobs/<id>`` under DST's folder (the folder of its ``agentnb.sqlite``) and ``workdir`` says so;
into PostgreSQL they become ``files`` rows and ``workdir`` is the relative ``jobs/<id>`` a PostgreSQL job holds
(each worker works in that folder under its own workspace folder).

What is refused, each with one line and nothing written: a DST that holds any row (a job, batch, text …),
or whose folder already has a ``jobs/`` folder with something in it; SRC and DST naming the same store; a
SRC that does not exist or holds nothing; a SRC with a ``running`` job (its runner may still write there, so
the copy would miss what it writes next: stop it first, or pass ``running="queue"``, which copies such a job
as ``queued`` with one more ``job_status`` event, reason ``copied: was running in SRC``, so that a worker on
DST resumes it from its events).  A claim never travels: ``claimed_by`` and ``lease_until`` are empty in the
copy.  SRC is read in one snapshot (a read-only transaction); DST is written in one transaction, whose row
counts are checked against SRC's before it commits.  When anything fails midway, the transaction rolls
back and the files written so far, and a DST store file that did not exist before, are removed.

A NUL character in an event payload cannot live in PostgreSQL: copied into it, it becomes U+FFFD, as
:class:`~agentnb.store.postgres.PostgresStore` itself stores it.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from ..errors import StoreError, UsageError
from ..events import JobStatusEvent, encode_payload, payload_dict
from ._copy_files import FileRow, read_tree, write_tree
from ._pg_dialect import no_nul
from .base import JobStatus, Store
from .sqlite import SQLiteStore

__all__ = ["COPIED_TABLES", "CopyCounts", "copy_store", "summary_lines"]

# in the order they are written (each row's references are written before it)
COPIED_TABLES = ("texts", "batches", "jobs", "comments", "movements", "events")
_ORDER = {"texts": "hash", "batches": "name", "jobs": "id", "comments": "id", "movements": "job_id, seq",
          "events": "id"}
_SERIAL = ("jobs", "comments", "events")
_CHUNK = 1000
COPIED_REASON = "copied: was running in SRC"

CopyCounts = dict[str, int]
"""Rows per table (``COPIED_TABLES``), then ``files`` and ``file_bytes``, as checked in DST."""

RunningPolicy = Literal["refuse", "queue"]


class _Opening:
    """The package's ``open_store`` and ``store_scheme``, handed in by :func:`agentnb.store.copy_store` (this
    module is imported by the package, so it cannot import them back)."""

    open_store: Callable[..., Store]
    store_scheme: Callable[[str], str | None]


_opening = _Opening()


def open_store(path_or_url: str | Path, *, readonly: bool = False) -> Store:
    return _opening.open_store(path_or_url, readonly=readonly)


def store_scheme(text: str) -> str | None:
    return _opening.store_scheme(text)


@dataclass(frozen=True)
class _Spec:
    """One side of the copy: what the user gave, and what it names."""

    given: str
    kind: Literal["sqlite", "postgres"]
    file: Path | None  # SQLite: the store file
    url: str | None  # PostgreSQL: the URL (with its password: never shown)

    @property
    def shown(self) -> str:
        if self.kind == "sqlite":
            return str(self.file)
        _psycopg()
        from .postgres import display_url

        return display_url(self.url or "")

    @property
    def root(self) -> Path:
        assert self.file is not None
        return self.file.parent

    def identity(self) -> tuple[Any, ...]:
        if self.kind == "sqlite":
            assert self.file is not None
            return ("sqlite", str(self.file))
        parts = urlsplit(self.url or "")
        host = (parts.hostname or "localhost").lower()
        if host in ("127.0.0.1", "::1", "localhost", ""):
            host = "localhost"
        return ("postgres", host, parts.port or 5432, parts.path.lstrip("/"))


def _spec(given: str | os.PathLike[str], what: str) -> _Spec:
    text = os.fspath(given)
    if not text.strip():
        raise UsageError(f"{what} is empty: give a folder or file path, sqlite:///ABS/PATH or "
                         "postgresql://user@host:port/db")
    scheme = store_scheme(text)
    if scheme is None or scheme == "sqlite":
        if scheme == "sqlite":
            rest = text[len("sqlite://"):]
            if not rest.startswith("/"):
                open_store(text)  # the one line about the absolute path
            path = Path(rest)
        else:
            path = Path(text).expanduser()
        path = path.resolve()
        file = path / "agentnb.sqlite" if path.is_dir() or not path.suffix else path
        return _Spec(text, "sqlite", file, None)
    if scheme in ("postgresql", "postgres"):
        return _Spec(text, "postgres", None, text)
    open_store(text)  # raises the one line naming the scheme and what is allowed
    raise AssertionError("open_store accepted an unknown scheme")  # pragma: no cover


def _location(spec: _Spec) -> str | Path:
    """What open_store opens for ``spec``."""
    return spec.file if spec.file is not None else spec.given


# -- reading and writing rows on either backend -----------------------------------------------------------------

class _Side:
    """Row access to one store's database for the copy (the store's own connection, or one of our own)."""

    def __init__(self, spec: _Spec, store: Store) -> None:
        self.spec = spec
        self.store = store
        self.pg = spec.kind == "postgres"
        self.conn: Any = None

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self.conn.execute(sql.replace("?", "%s") if self.pg else sql, tuple(params))

    def columns(self, table: str) -> list[str]:
        if self.pg:
            rows = self.execute("SELECT column_name FROM information_schema.columns WHERE table_name=? "
                                "AND table_schema=current_schema() ORDER BY ordinal_position", (table,)).fetchall()
        else:
            rows = [(r[1],) for r in self.execute(f"PRAGMA table_info({table})").fetchall()]
        return [str(r[0]) for r in rows]

    def has_table(self, table: str) -> bool:
        return bool(self.columns(table))

    def count(self, table: str) -> int:
        return int(self.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]) if self.has_table(table) else 0

    def select(self, table: str, cols: Sequence[str], order: str, where: str = "",
               params: Sequence[Any] = ()) -> Iterator[tuple[Any, ...]]:
        exprs = ", ".join(f"{c}::text" if self.pg and table == "events" and c == "payload" else c for c in cols)
        sql = f"SELECT {exprs} FROM {table} {where} ORDER BY {order}"
        if self.pg:
            # a server-side cursor: a large events table is read in chunks, not all at once
            with self.conn.cursor(name=f"agentnb_copy_{table}") as cur:
                cur.execute(sql.replace("?", "%s"), tuple(params))
                while rows := cur.fetchmany(_CHUNK):
                    yield from (tuple(r) for r in rows)
            return
        cur = self.conn.execute(sql, tuple(params))
        while rows := cur.fetchmany(_CHUNK):
            yield from (tuple(r) for r in rows)

    def insert(self, table: str, cols: Sequence[str], rows: Sequence[tuple[Any, ...]]) -> None:
        marks = ", ".join(["%s" if self.pg else "?"] * len(cols))
        sql = f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({marks})"
        if self.pg:
            with self.conn.cursor() as cur:
                cur.executemany(sql, rows)
        else:
            self.conn.executemany(sql, rows)


def _nonempty(side: _Side) -> dict[str, int]:
    return {t: n for t in (*COPIED_TABLES, "files") if (n := side.count(t))}


def _describe(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {t}" for t, n in counts.items())


# -- the copy --------------------------------------------------------------------------------------------------

def copy_store(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, running: RunningPolicy = "refuse",
               opener: Callable[..., Store], scheme_of: Callable[[str], str | None]) -> CopyCounts:
    """Copy the whole workspace in ``src`` into the empty store ``dst`` (see the module's docstring); the rows
    per table, files and file bytes now in ``dst``.  Every refusal and failure is one :class:`StoreError` or
    :class:`UsageError` line, with ``dst`` left as it was.  ``opener``/``scheme_of``: the package's
    ``open_store``/``store_scheme`` (call :func:`agentnb.store.copy_store`, which passes them)."""
    _opening.open_store, _opening.store_scheme = opener, scheme_of
    if running not in ("refuse", "queue"):
        raise UsageError(f"running={running!r}: give 'refuse' (the default) or 'queue'")
    s, d = _spec(src, "SRC"), _spec(dst, "DST")
    if s.identity() == d.identity():
        raise UsageError(f"SRC and DST are the same store ({s.shown}): give another DST")
    if s.kind == "sqlite":
        assert s.file is not None
        if not s.file.exists():
            raise StoreError(f"SRC {s.shown} does not exist: nothing to copy")
    with ExitStack() as stack:
        if s.kind == "postgres":
            _refuse_unmigrated_pg(s)
        src_store = open_store(_location(s), readonly=True)
        stack.callback(src_store.close)
        source = _Side(s, src_store)
        _begin_snapshot(source, stack)
        expected = {t: source.count(t) for t in COPIED_TABLES}
        if not any(expected.values()):
            raise StoreError(f"SRC {s.shown} is empty (no jobs, batches or texts): nothing to copy")
        running_ids = [int(r[0]) for r in source.execute("SELECT id FROM jobs WHERE status=? ORDER BY id",
                                                          (JobStatus.running.value,))]
        if running_ids and running == "refuse":
            shown = ", ".join(map(str, running_ids[:10])) + (" …" if len(running_ids) > 10 else "")
            raise StoreError(f"SRC {s.shown} has running jobs ({shown}): their runners may still write there; "
                             "stop them first (or let them end), or copy them as queued with --running queue "
                             "(running='queue')")
        _precheck_dst(d)
        return _copy_into(source, d, expected, running_ids, stack)
    raise AssertionError("unreachable")  # pragma: no cover


def _psycopg() -> Any:
    """psycopg, or the one line open_store gives when it is missing."""
    try:
        import psycopg
    except ImportError as exc:
        raise StoreError(f"a PostgreSQL store needs psycopg 3 and psycopg-pool ({exc}): "
                         "pip install 'agentnb[postgres]'") from None
    return psycopg


def _refuse_unmigrated_pg(spec: _Spec) -> None:
    """A PostgreSQL SRC without agentnb's tables is an empty store, said as such (a read-only open would ask
    for an upgrade instead)."""
    psycopg = _psycopg()

    from .postgres import describe_pg_error

    try:
        with psycopg.connect(spec.given, autocommit=True, connect_timeout=10) as conn:
            row = conn.execute("SELECT to_regclass('agentnb_schema') IS NOT NULL").fetchone()
    except psycopg.Error as exc:
        raise StoreError(f"SRC: {describe_pg_error(exc, spec.given)}") from None
    if not row or not row[0]:
        raise StoreError(f"SRC {spec.shown} holds no agentnb store (no agentnb tables): nothing to copy")


def _begin_snapshot(side: _Side, stack: ExitStack) -> None:
    """Read SRC in one read-only snapshot: rows written meanwhile are either all in the copy or none."""
    if side.pg:
        psycopg = _psycopg()
        url = side.spec.given
        conn = psycopg.connect(url, connect_timeout=10)
        stack.callback(conn.close)
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        side.conn = conn
        return
    assert isinstance(side.store, SQLiteStore)
    lite = side.store.conn
    lite.execute("BEGIN")  # a deferred read transaction: WAL readers see one snapshot until it ends
    lite.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # the snapshot starts at the first read
    stack.callback(lambda: lite.in_transaction and lite.execute("COMMIT"))
    side.conn = lite


def _precheck_dst(d: _Spec) -> None:
    """Refuse a non-empty DST before opening it for writing (which would migrate an older schema)."""
    if d.kind == "sqlite":
        assert d.file is not None
        found = {}
        if d.file.exists():
            store = open_store(d.file, readonly=True)
            try:
                side = _Side(d, store)
                assert isinstance(store, SQLiteStore)
                side.conn = store.conn
                found = _nonempty(side)
            finally:
                store.close()
        jobs = d.root / "jobs"
        if not found and jobs.is_dir() and any(jobs.iterdir()):
            raise StoreError(f"DST's folder {d.root} already has job folders in {jobs}: copy needs an empty "
                             "workspace; give a new folder")
    else:
        psycopg = _psycopg()
        from .postgres import describe_pg_error

        try:
            with psycopg.connect(d.given, autocommit=True, connect_timeout=10) as conn:
                side = _Side(d, None)  # type: ignore[arg-type]
                side.conn = conn
                found = _nonempty(side)
        except psycopg.Error as exc:
            raise StoreError(f"DST: {describe_pg_error(exc, d.given)}") from None
    if found:
        raise StoreError(f"DST {d.shown} is not empty ({_describe(found)}): copy needs an empty store; "
                         "nothing was written")


def _copy_into(source: _Side, d: _Spec, expected: dict[str, int], running_ids: list[int],
               stack: ExitStack) -> CopyCounts:
    made: list[Path] = []  # the folders to remove when the copy fails (SQLite DST), outermost first
    existed = d.file.exists() if d.file is not None else True
    if d.file is not None:
        made += [p for p in reversed(d.file.parents) if not p.exists()]
        if not (d.root / "jobs").exists():
            made.append(d.root / "jobs")
    try:
        dst_store = open_store(_location(d))
    except BaseException:
        _cleanup(d, made, existed)
        raise
    closed = False
    try:
        target = _Side(d, dst_store)
        with dst_store.transaction() as c:
            target.conn = c
            found = _nonempty(target)  # again, inside the transaction: another writer may have come first
            if found:
                raise StoreError(f"DST {d.shown} is not empty ({_describe(found)}): copy needs an empty store; "
                                 "nothing was written")
            counts = _copy_rows(source, target, expected, running_ids)
            counts.update(_copy_files(source, target))
        dst_store.close()
        closed = True
        return counts
    except BaseException:
        if not closed:
            dst_store.close()
        _cleanup(d, made, existed)
        raise


def _cleanup(d: _Spec, made: list[Path], existed: bool) -> None:
    """Remove what a failed copy made: job folders, and the store file with the folders it needed."""
    if d.kind != "sqlite":
        return
    assert d.file is not None
    if not existed:
        for suffix in ("", "-wal", "-shm", "-journal", "-lock"):
            Path(f"{d.file}{suffix}").unlink(missing_ok=True)
    # DST's jobs/ was missing or empty (_precheck_dst): what is in it now, the copy wrote
    jobs = d.root / "jobs"
    if jobs in made:
        shutil.rmtree(jobs, ignore_errors=True)
    elif jobs.is_dir():
        for p in jobs.iterdir():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
    for p in reversed(made):  # deepest first
        if p.is_dir():
            with suppress(OSError):
                p.rmdir()


def _copy_rows(source: _Side, target: _Side, expected: dict[str, int], running_ids: list[int]) -> CopyCounts:
    from_cols = {t: source.columns(t) for t in COPIED_TABLES}
    to_cols = {t: set(target.columns(t)) for t in COPIED_TABLES}
    for t in COPIED_TABLES:
        missing = [c for c in from_cols[t] if c not in to_cols[t]]
        if missing:
            raise StoreError(f"DST {target.spec.shown} has no column {t}.{missing[0]} that SRC has: upgrade agentnb "
                             "where DST is opened, or copy to a store of the same version")
    for t in COPIED_TABLES:
        cols = from_cols[t]
        fix = _row_fixer(t, cols, source, target)
        batch: list[tuple[Any, ...]] = []
        for row in source.select(t, cols, _ORDER[t]):
            batch.append(fix(row))
            if len(batch) >= _CHUNK:
                _insert(target, t, cols, batch)
                batch = []
        if batch:
            _insert(target, t, cols, batch)
    if target.pg:
        for t in _SERIAL:
            target.execute(f"SELECT setval(pg_get_serial_sequence('{t}', 'id'), COALESCE(MAX(id), 0) + 1, false) "
                           f"FROM {t}")
    expected = dict(expected)
    if running_ids:
        _requeue(target, running_ids)
        expected["events"] += len(running_ids)
    counts = {t: target.count(t) for t in COPIED_TABLES}
    for t in COPIED_TABLES:
        if counts[t] != expected[t]:
            raise StoreError(f"the copy of {t} has {counts[t]} rows, SRC {expected[t]}: nothing was written")
    return counts


def _insert(target: _Side, table: str, cols: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
    try:
        target.insert(table, cols, rows)
    except StoreError:
        raise
    except Exception as exc:  # a value DST cannot hold (a NUL in a PostgreSQL text column, …)
        if type(exc).__module__.split(".")[0] not in ("psycopg", "sqlite3"):
            raise
        text = " ".join(str(exc).split())
        raise StoreError(f"DST {target.spec.shown} cannot hold a row of {table} ({text}): nothing was written") \
            from None


def _row_fixer(table: str, cols: Sequence[str], source: _Side,
               target: _Side) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    if table == "events" and target.pg:
        at = cols.index("payload")

        def fix_payload(row: tuple[Any, ...]) -> tuple[Any, ...]:
            p = row[at]
            if isinstance(p, str) and "\\u0000" in p:
                return (*row[:at], no_nul(p), *row[at + 1:])
            return row

        return fix_payload
    if table != "jobs":
        return lambda row: row
    pos = {c: i for i, c in enumerate(cols)}

    def fix_job(row: tuple[Any, ...]) -> tuple[Any, ...]:
        out = list(row)
        # a claim never travels: nobody holds the copied job in DST
        for c in ("claimed_by", "lease_until"):
            if c in pos:
                out[pos[c]] = None
        if out[pos["status"]] == JobStatus.running:
            out[pos["status"]] = JobStatus.queued.value
        # where the job works in DST: under DST's folder (SQLite), or the relative jobs/<id> that a PostgreSQL
        # store's jobs hold (each worker materialises it in its own folder)
        job_id = int(row[pos["id"]])
        out[pos["workdir"]] = f"jobs/{job_id}" if target.pg else str(target.spec.root / "jobs" / str(job_id))
        return tuple(out)

    return fix_job


def _requeue(target: _Side, job_ids: list[int]) -> None:
    """The ``job_status`` event of each job copied as queued (it was running in SRC), after every copied event."""
    rows = []
    for job_id in job_ids:
        ev = JobStatusEvent(job_id=job_id, ts=time.time(), status=JobStatus.queued, reason=COPIED_REASON)
        rows.append((job_id, None, None, ev.ts, ev.kind, encode_payload(payload_dict(ev))))
    target.insert("events", ("job_id", "movement_seq", "iteration", "ts", "kind", "payload"), rows)


# -- files -------------------------------------------------------------------------------------------------------

def _src_files(source: _Side) -> Iterator[tuple[int, Iterator[FileRow]]]:
    """Each job's files in SRC, job by job (jobs in id order)."""
    if source.pg:
        current: list[FileRow] = []
        job: int | None = None
        for r in source.select("files", ("job_id", "path", "mode", "size", "sha256", "data", "updated"),
                               "job_id, path"):
            if job is not None and int(r[0]) != job:
                yield job, iter(current)
                current = []
            job = int(r[0])
            current.append(FileRow(str(r[1]), int(r[2]), int(r[3]), str(r[4]), bytes(r[5]), float(r[6])))
        if job is not None:
            yield job, iter(current)
        return
    root = source.spec.root
    for job_id, workdir in list(source.select("jobs", ("id", "workdir"), "id")):
        job_folder = root / "jobs" / str(job_id)
        wd = Path(workdir) if workdir else None
        if wd is not None and wd.resolve() == job_folder.resolve():
            yield int(job_id), read_tree(wd)
            continue
        # a work directory of the user's own: its tree, and the job's logs kept in the workspace folder
        logs = job_folder / "logs"

        def both(wd: Path | None = wd, logs: Path = logs) -> Iterator[FileRow]:
            if wd is not None:
                yield from read_tree(wd)
            yield from read_tree(logs, "logs/")

        yield int(job_id), both()


def _copy_files(source: _Side, target: _Side) -> CopyCounts:
    n = total = 0
    if target.pg:
        cols = ("job_id", "path", "mode", "size", "sha256", "data", "updated")
        for job_id, rows in _src_files(source):
            batch: list[tuple[Any, ...]] = []
            for f in rows:
                batch.append((job_id, f.path, f.mode, f.size, f.sha256, f.data, f.updated))
                n, total = n + 1, total + f.size
                if len(batch) >= 100:
                    _insert(target, "files", cols, batch)
                    batch = []
            if batch:
                _insert(target, "files", cols, batch)
        got = target.count("files")
        got_bytes = int(target.execute("SELECT COALESCE(SUM(size), 0) FROM files").fetchone()[0])
    else:
        jobs = target.spec.root / "jobs"
        for job_id, rows in _src_files(source):
            files, size = write_tree(jobs / str(job_id), job_id, rows)
            n, total = n + files, total + size
        # every job has its folder, as prepare_workdir makes it, whether or not it has files
        for (job_id,) in target.execute("SELECT id FROM jobs").fetchall():
            for sub in ("input", "output", "logs"):
                (jobs / str(job_id) / sub).mkdir(parents=True, exist_ok=True)
        got, got_bytes = _count_files(jobs)
    if (got, got_bytes) != (n, total):
        raise StoreError(f"the copy has {got} files ({got_bytes} bytes), SRC {n} ({total} bytes): nothing was "
                         "written")
    return {"files": got, "file_bytes": got_bytes}


def _count_files(root: Path) -> tuple[int, int]:
    """The files and links under ``root`` and their bytes (a link's: its target's text), as read_tree counts."""
    n = total = 0
    for folder, dirs, names in os.walk(root):
        for name in (*dirs, *names):
            p = Path(folder) / name
            if p.is_symlink():
                n, total = n + 1, total + len(os.fsencode(os.readlink(p)))
            elif p.is_file():
                n, total = n + 1, total + p.stat().st_size
    return n, total


def summary_lines(counts: CopyCounts) -> list[str]:
    """One line per table (then the files) for the CLI: ``jobs        12``."""
    lines = [f"{t:<10} {counts.get(t, 0):>8}" for t in COPIED_TABLES]
    lines.append(f"{'files':<10} {counts.get('files', 0):>8}  ({counts.get('file_bytes', 0)} bytes)")
    return lines
