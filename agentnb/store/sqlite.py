"""The SQLite store: jobs, comments, movements and the event log (the :class:`~agentnb.store.base.Store`
interface, implemented on one SQLite file).

One connection per :class:`SQLiteStore`, WAL mode, one transaction per write.  All
writes go through :meth:`SQLiteStore.transaction` (``BEGIN IMMEDIATE``), so claiming a
job is atomic across processes: two workers can never run the same job.

A store that cannot be used (not a database, truncated, newer than this code, not
writable) is refused on open with a :class:`StoreError` naming what is wrong and what
to do, before anything is written.  ``SQLiteStore(path, readonly=True)`` only reads.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from ..errors import StoreError
from ..events import (
    Event,
    JobStatusEvent,
    encode_payload,
    event_from_row,
    strict_events,
)
from ._cache_rows import CacheRows
from ._checkpoints import BACKSTOP_PAGES, Checkpoints
from ._rows import JOB_COLUMNS, StoreRows, events_query
from ._write_turn import WriteTurn, let_go, turn_for
from .base import (
    DEFAULT_LEASE,
    JOB_STATES,
    LEASE_EXPIRED,
    MAX_INSTRUCTION_CHARS,
    RECOVERED,
    TERMINAL_STATES,
    WAITING_STATES,
    Dialect,
    FrameRows,
    JobStatus,
    PreparedRow,
    StoredFile,
    Transaction,
    can_name_a_job,
    lease_lost,
    owned_by_this_process,
    owner_id,
    owner_is_gone,
)
from .files import SALVAGE, describe_error, header_problem, special_problem, wal_holds_pages, writable
from .migrations import MIGRATIONS
from .records import JobRecord
from .texts import REF_FIELDS, TEXT_REF, TEXT_REF_MIN_CHARS, instruction_sql, payload_text_sql

__all__ = [
    "JOB_STATES",
    "MAX_INSTRUCTION_CHARS",
    "SCHEMA_VERSION",
    "TERMINAL_STATES",
    "TEXT_REF",
    "TEXT_REF_MIN_CHARS",
    "WAITING_STATES",
    "SQLiteStore",
    "StoreError",
    "can_name_a_job",
    "describe_error",
    "instruction_sql",
    "owned_by_this_process",
    "payload_text_sql",
]

SCHEMA_VERSION = len(MIGRATIONS)




# what errors of this backend look like, for callers that word them (describe_error) instead of a traceback
BACKEND_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error,)


_BUSY_WAIT = 30.0  # seconds a statement waits for another process's lock before "database is locked"


def _wal(conn: sqlite3.Connection) -> None:
    """Switch ``conn``'s file to WAL.  The switch takes the file's exclusive lock and SQLite does not wait for it
    as it does for a write (no busy handler): processes opening a new store at once had it fail at once with
    "database is locked".  Tried again for as long as a write would wait."""
    _until_unlocked(conn, "PRAGMA journal_mode=WAL", _BUSY_WAIT, pause=0.005, longest=0.2)


def _until_unlocked(conn: sqlite3.Connection, sql: str, wait: float, *, pause: float, longest: float) -> None:
    """Execute ``sql``, tried again after "database is locked" with pauses from ``pause`` growing to ``longest``
    seconds, until ``wait`` seconds have passed (then the error is raised as SQLite's own would be)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            conn.execute(sql)
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 1.5, longest)


def _begin_immediate(conn: sqlite3.Connection) -> None:
    """``BEGIN IMMEDIATE``, waiting for another process's write lock in steps of a tenth of a millisecond.

    SQLite's own busy handler sleeps 1, 2, 5, 10 … 100 ms between tries and is not woken when the lock is let
    go, while a job's write transactions hold it for a fraction of a millisecond: two workers on one store
    spent a quarter of their time asleep (benchmarks/README.md, short jobs).  So the handler is off for this
    one statement, and the same 30 s as everywhere else bound the wait (docs/stores.md#sqlite-writers)."""
    conn.execute("PRAGMA busy_timeout=0")
    try:
        _until_unlocked(conn, "BEGIN IMMEDIATE", _BUSY_WAIT, pause=0.0001, longest=0.005)
    finally:
        conn.execute(f"PRAGMA busy_timeout={int(_BUSY_WAIT * 1000)}")


class SQLiteStore(StoreRows[sqlite3.Connection], CacheRows):
    """Access to one ``agentnb.sqlite`` file: the :class:`~agentnb.store.base.Store` interface on SQLite.

    ``readonly=True`` opens it for reading only and never writes a byte: a read-only folder
    or mount works, and a missing file reads as an empty store (nothing is created).
    """

    dialect: Dialect = "sqlite"

    def __init__(self, path: str | os.PathLike[str], *, readonly: bool = False) -> None:
        # absolute: the file stays the one opened, and so does its live channel, when the process changes folder
        self.path = Path(os.path.abspath(path))
        self.readonly = readonly
        self._lock = threading.RLock()
        # this process's turn at the file's write lock (store/_write_turn.py), once the file has opened as a store
        self._turn: WriteTurn | None = None
        self._let_go: Callable[[], Any] | None = None  # gives the turn back: on closing, or once collected
        # its WAL checkpoints, run beside the writers (store/_checkpoints.py), once the file has opened as a store
        self._checkpoints: Checkpoints | None = None
        self._depth = 0
        self._texts: dict[str, str] = {}
        self._texts_lock = self._lock  # the one lock: _text holds it while it reads and remembers a text
        self.lease = DEFAULT_LEASE
        # the (job id, lease generation) this thread writes for, when it holds a lease (fenced())
        self._fence = threading.local()
        # read once: every appended event is type-checked when set (the test suite sets it)
        self._strict = strict_events()
        try:
            self.conn = self._open_readonly() if readonly else self._open()
        except sqlite3.Error as exc:
            raise StoreError(describe_error(exc, self.path)) from None
        # not before: a file refused on opening (damaged, another program's) gets no lock file beside it
        if not readonly:
            turn_path = os.path.realpath(self.path)
            self._turn = turn_for(turn_path)
            # a store dropped unclosed (a notebook's `ws = Workspace(…)` run again) gives it back when collected
            self._let_go = weakref.finalize(self, let_go, turn_path, _BUSY_WAIT)
        self._checkpoints = None if readonly else Checkpoints(str(self.path), _BUSY_WAIT)
        self.conn.row_factory = sqlite3.Row

    # -- opening ------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise StoreError(f"cannot make the folder {folder}: a file of that name is in the way") from None
        except NotADirectoryError:
            raise StoreError(f"cannot make the folder {folder}: a part of that path is a file") from None
        except OSError as exc:
            raise StoreError(f"cannot make the folder {folder}: {exc.strerror or exc}") from None
        self._refuse_unusable()
        # Refused here, not at the first write: a read-only store must not half-open and then fail mid-job.
        # The folder must be writable too, for the WAL and its index.
        for where, what in ((self.path, "the file"), (folder, f"its folder {folder}")):
            if where.exists() and not writable(where):
                raise StoreError(
                    f"{self.path} cannot be written ({what} is read-only): make it writable to run or change "
                    "jobs; reading works as it is (agentnb jobs/show/export, Workspace(path, readonly=True))"
                )
        conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=_BUSY_WAIT)
        try:
            # before anything that could write: the version check must see the file as it was
            self._check_version(conn)
            _wal(conn)
            # NORMAL is durable across application crashes in WAL mode; only an OS
            # crash can lose the last transactions.
            conn.execute("PRAGMA synchronous=NORMAL")
            # Commits never fsync in this mode; checkpoints do (WAL, then the database: ~3 fsyncs of
            # ~4 ms each here).  At SQLite's default of 1,000 pages a busy job checkpointed every ~170
            # LLM calls, a third of the per-call overhead in benchmarks/overhead.py, and inside the writer's
            # turn.  A thread of the store's runs them beside the writers, every 1,000 commits (about 10,000
            # pages, a WAL of ~40 MB); SQLite's own is a backstop for a log four times that (store/_checkpoints.py).
            # Durability is unchanged.
            conn.execute(f"PRAGMA wal_autocheckpoint={BACKSTOP_PAGES}")
            conn.execute("PRAGMA foreign_keys=ON")
            self.conn = conn
            self._migrate()
        except BaseException:
            conn.close()
            raise
        return conn

    def _open_readonly(self) -> sqlite3.Connection:
        if not self.path.exists():
            return self._empty()
        self._refuse_unusable()
        uri = self.path.resolve().as_uri()
        try:
            conn = self._connect_uri(f"{uri}?mode=ro")
        except sqlite3.OperationalError:
            # A WAL store needs its -shm index, which cannot be made in a read-only folder; once every
            # writer has closed there is nothing in a WAL to miss, and immutable reads the file as it is.
            if writable(self.path.parent):
                raise
            if wal_holds_pages(self.path):
                raise StoreError(
                    f"{self.path}: the last transactions are in {self.path.name}-wal, which cannot be read in a "
                    "read-only folder without its -shm index: copy the workspace somewhere writable to read it"
                ) from None
            conn = self._connect_uri(f"{uri}?mode=ro&immutable=1")
        try:
            version = self._check_version(conn)
            if version == 0 and not conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall():
                conn.close()
                return self._empty()  # an empty file: no jobs yet
            if version < SCHEMA_VERSION:
                if not (writable(self.path) and writable(self.path.parent)):
                    raise StoreError(
                        f"{self.path} has schema version {version}, older than this agentnb's {SCHEMA_VERSION}, "
                        "and cannot be upgraded because it is read-only: open it once where it is writable"
                    )
                conn.close()
                SQLiteStore(self.path).close()  # upgrade it, as any writer would, then read
                conn = self._connect_uri(f"{uri}?mode=ro")
        except BaseException:
            conn.close()
            raise
        return conn

    def _refuse_unusable(self) -> None:
        """Refuse, before SQLite opens it, a store path that is a folder, or a file that is no SQLite store."""
        if self.path.is_dir():
            raise StoreError(f"{self.path} is a folder, not a store file: move it aside")
        if self.path.exists() or special_problem(self.path):
            problem = header_problem(self.path)
            if problem:
                raise StoreError(problem)

    @staticmethod
    def _connect_uri(uri: str) -> sqlite3.Connection:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False, timeout=_BUSY_WAIT)
        try:
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # opening is lazy: make it happen now
        except BaseException:
            conn.close()
            raise
        return conn

    def _empty(self) -> sqlite3.Connection:
        """An in-memory store with the current schema: what a missing file reads as."""
        self.conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self._migrate()
        return self.conn

    def _check_version(self, conn: sqlite3.Connection) -> int:
        # the version and the tables from one read transaction: another process migrating a new file meanwhile
        # commits both together, and two reads could see its tables but not yet its version
        conn.execute("BEGIN")
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            tables = [str(name) for (name,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%' ORDER BY name")]
        finally:
            conn.execute("COMMIT")
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path} has schema version {version}, newer than this agentnb's {SCHEMA_VERSION}: "
                "it was written by a newer agentnb; upgrade agentnb to open it (nothing was changed)"
            )
        if (version == 0 and tables) or (version > 0 and "jobs" not in tables):
            # another program's database: migrating would add agentnb's tables to it, or fail half-way on a
            # table of the same name ("table batches already exists")
            found = f"tables {', '.join(tables)}" if tables else "no tables"
            schema = "no agentnb schema version" if version == 0 else f"user_version {version} but no jobs table"
            raise StoreError(f"{self.path}: not an agentnb store (it has {found} but {schema}); use another path "
                             "or move it aside (nothing was changed)")
        return version

    # -- plumbing ---------------------------------------------------------
    def _migrate(self) -> None:
        readonly, self.readonly = self.readonly, False  # the in-memory store of a read-only open is built too
        try:
            with self.transaction() as c:
                version = c.execute("PRAGMA user_version").fetchone()[0]
                for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                    for statement in script.split(";"):
                        if statement.strip():
                            c.execute(statement)
                    c.execute(f"PRAGMA user_version={number}")
        finally:
            self.readonly = readonly

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (re-entrant within a thread), in this process's turn at the file's write lock
        (store/_write_turn.py)."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield self.conn
                finally:
                    self._depth -= 1
                return
            if self.readonly:
                raise StoreError(f"{self.path} was opened read-only: open it with Store(path) or "
                                 "Workspace(path) to change jobs")
            turn = self._turn
            if turn is not None and not turn.take(_BUSY_WAIT):
                raise sqlite3.OperationalError("database is locked")  # as SQLite words it: another thread's write
            try:
                try:
                    if turn is not None:
                        self.conn.execute("BEGIN IMMEDIATE")  # only a writer that takes no turns can hold it
                    else:
                        _begin_immediate(self.conn)
                except sqlite3.DatabaseError as exc:
                    self._damage(exc)
                    raise
                self._depth = 1
                try:
                    self._check_fence()
                    yield self.conn
                    self._depth = 0
                    self.conn.execute("COMMIT")
                except BaseException as exc:
                    self._depth = 0
                    self._live_end(committed=False)
                    # SQLite has already rolled back after some errors (a full disk, I/O): a second ROLLBACK
                    # would fail and hide the first error
                    if self.conn.in_transaction:
                        self.conn.execute("ROLLBACK")
                    self._damage(exc)
                    raise
            finally:
                if turn is not None:
                    turn.give()  # before the subscribers: the other processes need not wait for them
            # still under the store lock: subscribers see the events in commit order (live.py)
            self._live_end(committed=True)
            if self._checkpoints is not None:
                self._checkpoints.committed()

    @contextmanager
    def fenced(self, job_id: int, gen: int) -> Iterator[None]:
        previous = getattr(self._fence, "held", None)
        self._fence.held = (job_id, gen)
        try:
            yield
        finally:
            self._fence.held = previous

    def _check_fence(self) -> None:
        """Refuse the transaction just begun when this thread writes for a job whose lease it lost.  Inside
        BEGIN IMMEDIATE no claim can move the generation before this transaction commits."""
        held = getattr(self._fence, "held", None)
        if held is None:
            return
        row = self.conn.execute("SELECT lease_gen FROM jobs WHERE id=?", (held[0],)).fetchone()
        if row is None or int(row[0] or 0) != held[1]:
            raise lease_lost(held[0], held[1], None if row is None else row[0])

    def _damage(self, exc: BaseException) -> None:
        """Raise a damaged file (SQLite's plain DatabaseError: corrupt, not a database) as a one-line StoreError."""
        if type(exc) is sqlite3.DatabaseError:
            raise StoreError(describe_error(exc, self.path)) from exc

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            try:
                return self.conn.execute(sql, params).fetchall()
            except sqlite3.DatabaseError as exc:
                self._damage(exc)
                raise

    def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.close()  # before the connection: the last one closed checkpoints the whole log
        with self._lock:
            self.conn.close()
        if self._let_go is not None:
            self._let_go()  # once, however often the store is closed

    def job_waiter(self) -> None:
        """None: SQLite has no wake-ups to send between processes, so an idle worker polls."""
        return None

    def _tx(self, c: Transaction) -> sqlite3.Connection:
        # the transaction handle transaction() gives out is this store's own connection
        return cast(sqlite3.Connection, c)

    def _run(self, c: Transaction, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        return self._tx(c).execute(sql, tuple(params))

    # -- jobs ---------------------------------------------------------------
    def create_job(self, **values: Any) -> int:
        now = time.time()
        values.setdefault("status", JobStatus.queued)
        values.setdefault("created", now)
        values.setdefault("updated", now)
        if isinstance(values.get("options"), dict):
            values["options"] = encode_payload(values["options"])
        with self.transaction() as c:
            conn = self._tx(c)
            self._new_job(conn, values)
            cols = ", ".join(values)
            marks = ", ".join("?" for _ in values)
            cur = conn.execute(f"INSERT INTO jobs ({cols}) VALUES ({marks})", tuple(values.values()))
            job_id = int(cur.lastrowid)  # type: ignore[arg-type]
            self._append(conn, [JobStatusEvent(job_id=job_id, ts=now, status=values["status"], reason="submitted")])
        return job_id

    def job(self, job_id: int) -> JobRecord:
        rows = self.query("SELECT * FROM jobs WHERE id=?", (job_id,)) if can_name_a_job(job_id) else []
        if not rows:
            raise StoreError(f"no job {job_id} in {self.path}")
        return self._job_record(rows[0])

    def jobs(self, status: str | None = None, parent_id: int | None = None,
             batch: str | None = None) -> list[JobRecord]:
        sql, params = "SELECT * FROM jobs", list[Any]()
        where = []
        if status is not None:
            where.append("status=?")
            params.append(status)
        if parent_id is not None:
            where.append("parent_id=?")
            params.append(parent_id)
        if batch is not None:
            where.append("batch=?")
            params.append(batch)
        if where:
            sql += " WHERE " + " AND ".join(where)
        return [self._job_record(r) for r in self.query(sql + " ORDER BY id", params)]

    def job_ids(self) -> list[int]:
        return [int(r[0]) for r in self.query("SELECT id FROM jobs ORDER BY id")]

    def job_columns(self, job_id: int, columns: Sequence[str]) -> dict[str, Any] | None:
        bad = set(columns) - set(JOB_COLUMNS)
        if bad:
            raise StoreError(f"no job columns {sorted(bad)}")
        rows = self.query(f"SELECT {', '.join(columns)} FROM jobs WHERE id=?", (job_id,))
        return dict(rows[0]) if rows else None

    def update_job(self, c: Transaction, job_id: int, **values: Any) -> None:
        conn = self._tx(c)
        conn.execute(*self._job_update(conn, job_id, values))

    # -- large texts, stored once (see texts.py): this store's SQL for _rows.StoreRows ----------------
    def _instruction_ref(self, c: sqlite3.Connection, job_id: int) -> str | None:
        row = c.execute("SELECT instruction_ref FROM jobs WHERE id=?", (job_id,)).fetchone()
        return row[0] if row else None

    def _put_text(self, c: sqlite3.Connection, body: str) -> str:
        ref = hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()
        c.execute("INSERT OR IGNORE INTO texts (hash, body) VALUES (?, ?)", (ref, body))
        self._remember(ref, body)
        return ref

    def _text(self, ref: str) -> str:
        with self._lock:
            body = self._texts.get(ref)
            if body is None:
                row = self.conn.execute("SELECT body FROM texts WHERE hash=?", (ref,)).fetchone()
                if row is None:
                    raise StoreError(f"{self.path} is damaged: text {ref[:12]}… that a job refers to is missing; "
                                     + SALVAGE.format(path=self.path))
                body = row[0]
                self._remember(ref, body)
            return body

    def set_status(
        self, c: Transaction, job_id: int, status: str, reason: str = "", **values: Any
    ) -> None:
        """Change a job's status and record the ``job_status`` event, in transaction ``c``."""
        event = self._status_change(job_id, status, reason, values)
        self.update_job(c, job_id, status=status, **values)
        self._append(self._tx(c), [event])

    def claim(self, job_id: int | None = None, owner: str | None = None,
              lease: float | None = None) -> JobRecord | None:
        """Atomically move a queued job (the given one, or the oldest) to ``running``, leased for ``lease``
        seconds (this host's clock: hosts sharing the file must keep their clocks in step).

        Returns the claimed job row, or ``None`` when there is nothing to claim.
        """
        owner = owner or owner_id()
        seconds = self.lease if lease is None else lease
        with self.transaction() as c:
            conn = self._tx(c)
            self._recover_orphans(conn, job_id)
            if job_id is None:
                row = conn.execute("SELECT id FROM jobs WHERE status='queued' ORDER BY id LIMIT 1").fetchone()
                if row is None:
                    return None
                job_id = int(row[0])
            now = time.time()
            cur = conn.execute(
                "UPDATE jobs SET status='running', claimed_by=?, updated=?, started=COALESCE(started, ?), "
                "lease_gen=lease_gen+1, lease_until=? WHERE id=? AND status='queued'",
                (owner, now, now, now + seconds, job_id),
            )
            if cur.rowcount != 1:
                return None
            self._append(conn, [JobStatusEvent(job_id=job_id, ts=time.time(), status=JobStatus.running,
                                               reason=f"claimed by {owner}")])
            return self._job_record(conn.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone())

    def _recover_orphans(self, c: sqlite3.Connection, job_id: int | None) -> None:
        """Queue again the running jobs whose lease has run out (their holder died, froze or lost the network,
        on any host) and those whose owner process on this host has died (a crash, a kill: no need to wait).

        Their open movement is left open, so the next claim resumes it from its events; their lease generation
        moves on, so that a holder that comes back writes nothing more.
        """
        now = time.time()
        rows = c.execute(
            "SELECT id, claimed_by, lease_until IS NOT NULL AND lease_until < ? FROM jobs WHERE status='running' "
            "AND (? OR id=? OR lease_until < ?)", (now, job_id is None, job_id or 0, now)).fetchall()
        for jid, claimed_by, expired in rows:
            if owner_is_gone(claimed_by):
                reason = f"{RECOVERED}the process that ran it ({claimed_by}) is gone"
            elif expired:
                reason = LEASE_EXPIRED
            else:
                continue
            c.execute("UPDATE jobs SET lease_gen=lease_gen+1 WHERE id=?", (int(jid),))
            self.set_status(c, int(jid), JobStatus.queued, reason=reason)

    def renew_lease(self, job_id: int, gen: int, lease: float) -> bool:
        with self.transaction() as c:
            cur = self._tx(c).execute("UPDATE jobs SET lease_until=? WHERE id=? AND lease_gen=? AND status='running'",
                                      (time.time() + lease, job_id, gen))
            return cur.rowcount == 1

    # -- batches ---------------------------------------------------------------
    def create_batch(self, c: Transaction, name: str, *, fingerprint: str, cases: str, variants: str,
                     options: str) -> None:
        now = time.time()
        clean = self._clean_batch({"cases": cases, "options": options})
        cases, options = clean["cases"], clean["options"]
        self._tx(c).execute(
            "INSERT INTO batches (name, created, updated, fingerprint, cases, variants, options) VALUES (?,?,?,?,?,?,?)",
            (name, now, now, fingerprint, cases, variants, options),
        )

    def update_batch(self, c: Transaction, name: str, **values: Any) -> None:
        bad = set(values) - {"fingerprint", "cases", "variants", "options"}
        if bad:
            raise StoreError(f"cannot update batch columns {sorted(bad)}")
        values = self._clean_batch(values)
        values["updated"] = time.time()
        sets = ", ".join(f"{k}=?" for k in values)
        self._tx(c).execute(f"UPDATE batches SET {sets} WHERE name=?", (*values.values(), name))

    # -- events ---------------------------------------------------------------
    def _append(self, c: sqlite3.Connection, events: Iterable[Event | PreparedRow]) -> None:
        self._insert(c, self._rows_in(c, events))

    def _insert(self, c: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> None:
        c.executemany("INSERT INTO events (job_id, movement_seq, iteration, ts, kind, payload) VALUES (?,?,?,?,?,?)",
                      rows)
        if self._live_wants(rows):  # their ids, for live.py: consecutive, as nobody else writes inside the transaction
            last = int(c.execute("SELECT last_insert_rowid()").fetchone()[0])
            self._live_rows(rows, range(last - len(rows) + 1, last + 1))

    def append(self, events: Sequence[Event | PreparedRow], c: Transaction | None = None) -> None:
        # every row is built (and checked) before the first is written
        if c is not None:
            self._append(self._tx(c), events)
            return
        # Checked and encoded before the lock is taken: every job's thread waits for that lock, so only the
        # writes happen while it is held.  Only the payloads that refer to the job's stored instruction need
        # the transaction (they read its reference).
        rows = self.prepare(events)
        with self.transaction() as c2:
            conn = self._tx(c2)
            self._insert(conn, self._rows_in(conn, rows))

    def events(
        self,
        job_id: int,
        *,
        after_id: int = 0,
        kinds: Sequence[str] | None = None,
        movement_seq: int | None = None,
    ) -> list[Event]:
        sql, params = events_query("payload", job_id, after_id, kinds, movement_seq)
        with self._lock:
            rows = self._tuples(sql + " ORDER BY id", params)[1]
            return [event_from_row(self._expand(r) if r[5] in REF_FIELDS else r) for r in rows]

    def last_event_id(self, job_id: int) -> int:
        rows = self.query("SELECT MAX(id) FROM events WHERE job_id=?", (job_id,))
        return int(rows[0][0] or 0)

    def change_mark(self) -> tuple[int | None, int | None]:
        row = self.query("SELECT (SELECT MAX(id) FROM events), (SELECT MAX(id) FROM jobs)")[0]
        return row[0], row[1]

    # -- the DataFrame views (SQL in frames_sql.py) -------------------------------------
    # -- a job's files: they stay on disk (docs/stores.md#files) ---------------------------------------------------------
    keeps_files = False

    def _no_files(self) -> StoreError:
        return StoreError(f"{self.path} is a SQLite store: it keeps no files, each job's files stay in its work "
                          "directory on disk (ws.files(job) and ws.pull(job, dest) read them there)")

    def file_rows(self, job_id: int) -> list[dict[str, Any]]:
        raise self._no_files()

    def file_data(self, job_id: int, paths: Sequence[str]) -> dict[str, bytes]:
        raise self._no_files()

    def write_files(self, c: Transaction, job_id: int, files: Sequence[StoredFile], removed: Sequence[str]) -> None:
        raise self._no_files()

    def _tuples(self, sql: str, params: Sequence[Any]) -> FrameRows:
        """Column names and plain row tuples of a query (no ``sqlite3.Row`` per row: the frames read 100,000s)."""
        with self._lock:
            try:
                cur = self.conn.execute(sql, tuple(params))
                cur.row_factory = None
                rows = cur.fetchall()
            except sqlite3.DatabaseError as exc:
                self._damage(exc)
                raise
            return [d[0] for d in cur.description], rows

    # -- comments --------------------------------------------------------------
    def add_comment(self, c: Transaction, job_id: int, author: str, body: str, *, ts: float | None = None) -> None:
        row, event = self._comment_row(job_id, author, body, ts)
        conn = self._tx(c)
        conn.execute("INSERT INTO comments (job_id, author, body, ts) VALUES (?,?,?,?)", row)
        self._append(conn, [event])

    def reopen_failed_movement(self, c: Transaction, job_id: int) -> None:
        # the movement the failure stopped (none when the job failed between movements or at setup)
        self._tx(c).execute("UPDATE movements SET status='running', ended=NULL WHERE job_id=? AND status='failed' "
                            "AND seq=(SELECT MAX(seq) FROM movements WHERE job_id=?)", (job_id, job_id))

    # -- operations the engine asks for ----------------------------------------
    # Each takes the transaction ``c`` when the engine needs it to be atomic with other writes.
    def start_movement(self, c: Transaction, job_id: int, seq: int, name: str) -> None:
        """Open the row of movement run ``seq`` (its events are recorded in the same transaction)."""
        self._tx(c).execute("INSERT INTO movements (job_id, seq, name, status, started) VALUES (?,?,?,?,?)",
                  (job_id, seq, name, "running", time.time()))

    def finish_movement(self, c: Transaction, job_id: int, seq: int, *, iterations: int, next_step: str,
                        forced: bool, summary: str) -> None:
        """Close movement run ``seq`` with the transition that ended it."""
        self._tx(c).execute("UPDATE movements SET status='done', ended=?, iterations=?, next_step=?, forced=?, summary=? "
                  "WHERE job_id=? AND seq=?", (time.time(), iterations, next_step, int(forced), self._clean(summary),
                                                   job_id, seq))

    def fail_movement(self, c: Transaction, job_id: int, seq: int, *, iterations: int) -> None:
        """Close movement run ``seq`` as failed (its job fails in the same transaction)."""
        self._tx(c).execute("UPDATE movements SET status='failed', ended=?, iterations=? WHERE job_id=? AND seq=?",
                  (time.time(), iterations, job_id, seq))

    def create_child_job(self, c: Transaction, parent_id: int, *, piece: str, piece_yaml: str,
                         piece_path: str | None, model: str, instruction: str, options: str) -> int:
        """Insert a queued subtask of ``parent_id`` (no work directory yet: see :meth:`update_job`); its id.

        The instruction and the options text are kept as given (no ``texts`` reference), but for secrets.
        """
        now = time.time()
        cur = self._tx(c).execute(
            "INSERT INTO jobs (parent_id, piece, piece_yaml, piece_path, model, instruction, status, workdir, "
            "options, created, updated) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (parent_id, piece, piece_yaml, piece_path, model, self._clean(instruction), JobStatus.queued, "",
             self._clean_json(options), now, now),
        )
        return int(cur.lastrowid)  # type: ignore[arg-type]

    def parent_of(self, c: Transaction, job_id: int) -> int | None:
        """The id of the job that created ``job_id`` as a subtask, or None."""
        row = self._tx(c).execute("SELECT parent_id FROM jobs WHERE id=?", (job_id,)).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def subtask_wait(self, c: Transaction, job_id: int) -> tuple[bool, str | None]:
        """Whether job ``job_id`` waits for its subtasks, and the movement it goes on at when they end
        (the one it named, else its current one)."""
        row = self._tx(c).execute("SELECT status, resume_movement, current_movement FROM jobs WHERE id=?",
                        (job_id,)).fetchone()
        if row is None or row[0] != JobStatus.waiting_subtasks:
            return False, None
        return True, row[1] or row[2]

    def open_children(self, c: Transaction, parent_id: int) -> int:
        """How many subtasks of ``parent_id`` have not ended."""
        states = sorted(TERMINAL_STATES)
        return int(self._tx(c).execute(
            f"SELECT COUNT(*) FROM jobs WHERE parent_id=? AND status NOT IN ({','.join('?' * len(states))})",
            (parent_id, *states),
        ).fetchone()[0])
