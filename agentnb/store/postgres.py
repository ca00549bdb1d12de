"""The PostgreSQL store: the :class:`~agentnb.store.base.Store` interface on a PostgreSQL server (docs/stores.md).

The same tables, rows and events as :mod:`agentnb.store.sqlite` (a notebook cannot tell the two apart), through
psycopg 3 and a :class:`psycopg_pool.ConnectionPool` (extra ``agentnb[postgres]``):

* one transaction per write.  A thread's :meth:`PostgresStore.transaction` holds one pooled connection until it
  ends, and re-entering it in the same thread joins it (the engine nests store operations in one transaction).
* write transactions are ordered where the engine decides on what it has read.  The engine reads and then
  decides inside a transaction (the last subtask to end queues its parent, a batch name is free, a comment
  arrives for a running job), and under READ COMMITTED two such transactions could both decide on what neither
  has committed.  :meth:`PostgresStore.transaction` therefore takes advisory locks first (see
  :meth:`PostgresStore._open_writes`):

  - a transaction of a *lease holder* writing for its job (:meth:`PostgresStore.fenced`: the runner's
    activation, movement start and end, status, subtasks, ``notify_parent``) takes the store-wide lock
    ``_WRITE_LOCK`` **shared** and its job *tree*'s lock (the root job's id) **exclusive**: the decisions such a
    transaction makes concern its own tree only (its children, its parent's open children), so jobs of
    different trees write side by side, and the jobs of one tree one at a time;
  - every other transaction (submit, batch creation and resumption, a user's comment or stop, a worker giving
    jobs back) takes ``_WRITE_LOCK`` **exclusive**, and so is ordered against every write transaction, as
    SQLite's ``BEGIN IMMEDIATE`` orders them.

  Plain event appends, lease renewals and :meth:`PostgresStore.claim` take no advisory lock: appends only
  insert, a renewal updates one row, and a claim locks the job rows it takes (``SELECT … FOR UPDATE SKIP
  LOCKED``), so workers on many hosts claim side by side and never the same job.

  **Lock order** (deadlocks): advisory locks before any row lock, ``_WRITE_LOCK`` before a tree's lock, and at
  most one tree lock per transaction; then row locks: the transaction's own job (the fence), then its parent
  (``notify_parent``), then rows it creates.  Claims and recoveries never wait for a row (SKIP LOCKED), and
  renewals and plain appends hold nothing else while they wait for their one job's row.
* numbered migrations (:mod:`agentnb.store.pg_migrations`) applied on open under an advisory lock (see
  :meth:`PostgresStore._migrate` for why a session lock), so two processes opening a new database at once
  migrate it once; a database of a newer schema is refused
  before anything is written.
* every problem met on open (unreachable server, refused password, missing database, newer schema) is one
  :class:`StoreError` line naming the server by its URL *without* the password.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from ..errors import StoreError
from ..events import (
    Event,
    JobStatusEvent,
    encode_payload,
    event_from_row,
    strict_events,
)
from ._cache_rows import CacheRows
from ._pg_dialect import Row as Row  # defined here before; importable from here still
from ._pg_dialect import no_nul, psycopg_sql, row_factory
from ._rows import JOB_COLUMNS, StoreRows, events_query
from .base import (
    DEFAULT_LEASE,
    LEASE_EXPIRED,
    RECOVERED,
    TERMINAL_STATES,
    Dialect,
    FrameRows,
    JobStatus,
    LeaseLost,
    PreparedRow,
    StoredFile,
    StoreUnreachable,
    Transaction,
    can_name_a_job,
    lease_lost,
    owner_id,
    owner_is_gone,
)
from .pg_migrations import PG_MIGRATIONS, PG_SCHEMA_VERSION
from .pg_notify import NOTIFY_SQL, PgJobWaiter
from .pg_outage import connected, is_outage, watch_outages
from .pg_session import check_handed_out, session_limits
from .records import JobRecord
from .texts import REF_FIELDS

__all__ = ["BACKEND_ERRORS", "PG_SCHEMA_VERSION", "PostgresStore", "describe_pg_error", "display_url"]

# what errors of this backend look like, for callers that word them instead of a traceback
BACKEND_ERRORS: tuple[type[Exception], ...] = (psycopg.Error,)

# rows per multi-row INSERT (_insert_rows): far below PostgreSQL's 65,535 parameters per statement
_ROWS_PER_INSERT = 500

# advisory lock keys (any bigint; these spell "agnbmigr" and "agnbwrit" so a DBA can tell them in pg_locks)
_MIGRATE_LOCK = int.from_bytes(b"agnbmigr", "big") & (2**63 - 1)
_WRITE_LOCK = int.from_bytes(b"agnbwrit", "big") & (2**63 - 1)
# a job tree's lock is the two-int4 form (classid "agnt", the root job's id folded into an int4): PostgreSQL
# keeps that key space apart from the one-bigint form above.  Two trees that fold alike only wait for each other.
_TREE_LOCK = int.from_bytes(b"agnt", "big")

# Leases are set and checked on the server's clock, so the workers' clocks do not matter.  clock_timestamp(), not
# now(): now() is the transaction's start, and a claim may have waited for locks since.
_NOW = "extract(epoch from clock_timestamp())"




def display_url(url: str) -> str:
    """``url`` without its password (never shown, logged or put in an error)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{parts.username}@{host}" if parts.username else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def describe_pg_error(exc: BaseException, url: str) -> str:
    """One line for an error met opening or using the store at ``url``; the password never appears in it."""
    where = display_url(url)
    parts = urlsplit(url)
    text = " ".join(str(exc).split())
    if parts.password:
        text = text.replace(parts.password, "***")
    low = text.lower()
    if "password authentication failed" in low or "no password supplied" in low:
        return (f"the PostgreSQL server at {where} refused the password for user {parts.username or '?'}: "
                "check the password in the URL (or PGPASSWORD, ~/.pgpass)")
    if "does not exist" in low and "database" in low:
        return f"{where}: {text}: create it first (createdb) or name an existing database"
    if isinstance(exc, psycopg.errors.IdleInTransactionSessionTimeout):
        return (f"{where}: the server ended this process's transaction, idle for longer than the lease "
                "(frozen or cut off?); nothing of it was written")
    if isinstance(exc, psycopg.OperationalError) and ("connect" in low or "timeout" in low or "refused" in low
                                                        or "could not translate host name" in low):
        server = f"{parts.hostname or 'localhost'}:{parts.port or 5432}"
        return f"cannot reach the PostgreSQL server at {server} ({where}): is it running and listening there?"
    return f"{where}: {text}"


def _insert_rows(conn: psycopg.Connection[Any], head: str, rows: Sequence[tuple[Any, ...]],
                 tail: str = "") -> list[Any]:
    """``head`` followed by one ``(%s, …)`` per row (and ``tail``), a few hundred rows per statement.

    Not ``executemany``: psycopg runs it in pipeline mode, which ends with a Flush after its Sync, and PostgreSQL
    disarms ``idle_in_transaction_session_timeout`` on a Flush until the next query: a process frozen right
    after an append would keep its locks for good (pg_session.py)."""
    returned: list[Any] = []  # what a RETURNING tail gives back
    for at in range(0, len(rows), _ROWS_PER_INSERT):
        chunk = rows[at:at + _ROWS_PER_INSERT]
        values = ",".join(["(" + ",".join(["%s"] * len(chunk[0])) + ")"] * len(chunk))
        cur = conn.execute(head + values + tail, [v for row in chunk for v in row])
        if cur.description is not None:
            returned.extend(r[0] for r in cur.fetchall())
    return returned


class PostgresStore(StoreRows[psycopg.Connection[Any]], CacheRows):
    """A workspace's jobs, comments, movements and events in a PostgreSQL database (``postgresql://…``).

    ``readonly=True`` refuses every write (:meth:`transaction` raises), as SQLite's read-only store does.
    ``pool_size`` is the most connections this process holds: one per thread inside a transaction.
    """

    dialect: Dialect = "postgres"

    def __init__(self, url: str, *, readonly: bool = False, pool_size: int = 16,
                 connect_timeout: float = 10.0, lease: float = DEFAULT_LEASE) -> None:
        self.url = url
        # what error messages name: the URL without its password
        self.path = display_url(url)
        self.readonly = readonly
        self._local = threading.local()
        self.lease = lease
        # the (job id, lease generation) this thread writes for, when it holds a lease (fenced())
        self._fence = threading.local()
        self._texts: dict[str, str] = {}
        self._texts_lock = threading.Lock()
        self._strict = strict_events()
        # every connection's server-side idle-in-transaction limit and TCP keepalives follow the lease this
        # store is opened with (pg_session.py says why and which values)
        kwargs: dict[str, Any] = {"autocommit": True, "connect_timeout": max(1, int(connect_timeout)),
                                  **session_limits(url, lease)}
        self._kwargs = kwargs
        try:
            # one plain connection first: its errors are the server's own words (a pool would only time out)
            with psycopg.connect(url, **kwargs) as conn:
                if readonly:
                    self._check_version(conn)
                else:
                    self._migrate(conn)
        except psycopg.Error as exc:
            raise StoreError(describe_pg_error(exc, url)) from None
        # check: a connection the server dropped while idle in the pool (a restart, an idle timeout) is replaced
        # when handed out, instead of failing the next call
        # a server restart: one line when it goes, one when it is back, not the pool's traces (pg_outage.py)
        watch_outages()
        self._pool = ConnectionPool(url, min_size=1, max_size=max(1, pool_size), kwargs=kwargs, open=True,
                                    name="agentnb", timeout=60.0, check=check_handed_out,
                                    configure=connected)

    def __repr__(self) -> str:
        return f"PostgresStore({self.path!r})"

    # -- opening ---------------------------------------------------------------
    @staticmethod
    def _version(conn: psycopg.Connection[Any]) -> tuple[int, list[str]]:
        """The schema version and the current schema's tables, read in one statement (one snapshot): a process
        migrating meanwhile commits both at once, and two reads could see its tables without its version."""
        row = conn.execute("SELECT to_regclass('agentnb_schema') IS NOT NULL, ARRAY(SELECT tablename::text "
                           "FROM pg_tables WHERE schemaname = current_schema() ORDER BY 1)").fetchone()
        if not row:
            return 0, []
        tables = [str(name) for name in row[1] or []]
        if not row[0]:
            return 0, tables
        got = conn.execute("SELECT MAX(version) FROM agentnb_schema").fetchone()
        return (int(got[0] or 0) if got else 0), tables

    def _check_version(self, conn: psycopg.Connection[Any]) -> int:
        version, tables = self._version(conn)
        if version > PG_SCHEMA_VERSION:
            raise StoreError(
                f"{self.path} has schema version {version}, newer than this agentnb's {PG_SCHEMA_VERSION}: "
                "it was written by a newer agentnb; upgrade agentnb to open it (nothing was changed)")
        if version == 0 and tables:  # another program's: agentnb's tables would join its own, or clash with one
            raise StoreError(f"{self.path}: not an agentnb store (it has tables {', '.join(tables)} but no "
                             "agentnb schema version); use another database (nothing was changed)")
        if version == 0 and self.readonly:
            raise StoreError(f"{self.path} holds no agentnb workspace yet (no agentnb tables): there is nothing to "
                             "read; the first write (a submit, a batch, agentnb store copy) creates them")
        if version < PG_SCHEMA_VERSION and self.readonly:
            raise StoreError(f"{self.path} has schema version {version}, older than this agentnb's "
                             f"{PG_SCHEMA_VERSION}: open it once without readonly to upgrade it")
        return version

    def _migrate(self, conn: psycopg.Connection[Any]) -> None:
        """Apply the missing migrations, one process at a time.

        The advisory lock is the session's, taken *before* the migrating transaction begins, not
        ``pg_advisory_xact_lock`` inside it: a transaction that waited for the lock still sees the catalog as it
        was when it began (its cache of "no such table" is refreshed only when a transaction starts), so it would
        run migration 1 again after the first process committed it ("relation texts already exists").
        """
        if self._check_version(conn) == PG_SCHEMA_VERSION:
            return  # the common case takes no lock
        conn.execute("SELECT pg_advisory_lock(%s)", (_MIGRATE_LOCK,))
        try:
            with conn.transaction():
                version = self._check_version(conn)  # again: another process may have migrated while we waited
                if version == PG_SCHEMA_VERSION:
                    return
                conn.execute("CREATE TABLE IF NOT EXISTS agentnb_schema (version INTEGER NOT NULL)")
                for number, script in enumerate(PG_MIGRATIONS[version:], start=version + 1):
                    conn.execute(script)  # no parameters: several statements in one go (DDL is transactional)
                    conn.execute("DELETE FROM agentnb_schema")
                    conn.execute("INSERT INTO agentnb_schema (version) VALUES (%s)", (number,))
        finally:
            if not conn.closed:
                conn.execute("SELECT pg_advisory_unlock(%s)", (_MIGRATE_LOCK,))

    # -- plumbing --------------------------------------------------------------
    @contextmanager
    def _transaction(self, *, exclusive: bool) -> Iterator[psycopg.Connection[Any]]:
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is not None:  # re-entered in the same thread: join the open transaction
            local.depth += 1
            try:
                yield conn
            finally:
                local.depth -= 1
            return
        if self.readonly:
            raise StoreError(f"{self.path} was opened read-only: open it without readonly to change jobs")
        committed = False
        try:
            with self._worded(), self._pool.connection() as conn, conn.transaction():
                local.conn, local.depth, local.locked = conn, 1, set()
                try:
                    self._open_writes(conn, exclusive=exclusive)
                    yield conn
                    self._live_ready()  # events to publish: in commit order (live.py)
                finally:
                    local.conn, local.depth, local.locked = None, 0, set()
            committed = True
        finally:
            self._live_end(committed)

    def _open_writes(self, conn: psycopg.Connection[Any], *, exclusive: bool) -> None:
        """What a write transaction does before anything else, in this order: its advisory locks when
        ``exclusive`` (the module's docstring says why and in which order: a lease holder's, ``_WRITE_LOCK``
        shared then its job tree's lock; any other, ``_WRITE_LOCK`` exclusive), then the fence of a lease holder
        (below).  Sent as one message of several statements where there are several: they run in order, and
        each round trip a transaction saves is CPU its worker and the server save (every value in them is an int
        of agentnb's, not a user's).

        The fence refuses the transaction just begun when this thread writes for a job whose lease it lost.  The
        job's row stays locked until this transaction ends, so no claim moves the generation before it commits (a
        claim passes over a locked row: SKIP LOCKED)."""
        statements = []
        tree: int | None = getattr(self._fence, "tree", None)
        if exclusive and tree is None:
            statements.append(f"SELECT pg_advisory_xact_lock({_WRITE_LOCK:d})")
        elif exclusive and tree is not None:
            statements.append(f"SELECT pg_advisory_xact_lock_shared({_WRITE_LOCK:d})")
            statements.append(f"SELECT pg_advisory_xact_lock({_TREE_LOCK:d}, {int(tree) % 2**31:d})")
        held = getattr(self._fence, "held", None)
        if held is None:
            if statements:
                conn.execute(";".join(statements))
            return
        fence = "SELECT lease_gen FROM jobs WHERE id=%s FOR UPDATE"
        if not statements:
            cursor = conn.execute(fence, (held[0],))  # alone: a prepared statement, as every job's fence is alike
        else:
            cursor = conn.execute(";".join([*statements, fence % f"{int(held[0]):d}"]))
            for _ in statements:
                cursor.nextset()  # to the fence's result, the last
        self._local.locked.add(held[0])
        row = cursor.fetchone()
        if row is None or int(row[0] or 0) != held[1]:
            raise lease_lost(held[0], held[1], None if row is None else row[0])

    def _root_of(self, job_id: int) -> int:
        """The id of the job at the top of ``job_id``'s tree (itself when it has no parent); a job's parent
        never changes, so this is looked up once per lease."""
        rows = self._tuples(
            "WITH RECURSIVE up(id, parent_id, n) AS (SELECT id, parent_id, 0 FROM jobs WHERE id=? "
            "UNION ALL SELECT j.id, j.parent_id, up.n + 1 FROM jobs j JOIN up ON j.id = up.parent_id "
            "WHERE up.n < 1000) SELECT id FROM up ORDER BY n DESC LIMIT 1", (job_id,))[1]
        return int(rows[0][0]) if rows else job_id

    @contextmanager
    def fenced(self, job_id: int, gen: int) -> Iterator[None]:
        previous = getattr(self._fence, "held", None), getattr(self._fence, "tree", None)
        tree = self._root_of(job_id) if can_name_a_job(job_id) else job_id
        self._fence.held, self._fence.tree = (job_id, gen), tree
        try:
            yield
        finally:
            self._fence.held, self._fence.tree = previous

    @contextmanager
    def _worded(self) -> Iterator[None]:
        """A lost server (stopped, unreachable, the pool out of connections) as one StoreError line, as on open:
        a :class:`StoreUnreachable` when it is an outage (``pg_outage.is_outage``), which a worker waits out."""
        try:
            yield
        except psycopg.OperationalError as exc:
            line = describe_pg_error(exc, self.url)
            raise (StoreUnreachable(line) if is_outage(exc) else StoreError(line)) from None
        except PoolTimeout as exc:
            raise self._no_connection(exc) from None
        except psycopg.errors.IdleInTransactionSessionTimeout as exc:
            # the server ended a transaction left idle for a whole lease (pg_session.py): this process was frozen
            # or cut off meanwhile, so a holder may have lost its job: it stops as when a fence refuses it
            held = getattr(self._fence, "held", None)
            message = describe_pg_error(exc, self.url)
            raise (StoreError(message) if held is None else LeaseLost(f"job {held[0]}: {message}")) from None

    def _no_connection(self, exc: PoolTimeout) -> StoreError:
        """Why the pool had no connection to give: the server's own words, from one connection made now.  The pool
        only says it timed out, whether the server is down (an outage), refuses this process (its password
        changed, its database dropped: no wait mends that) or every pooled connection was busy."""
        try:
            psycopg.connect(self.url, **self._kwargs).close()
        except psycopg.Error as probe:
            line = describe_pg_error(probe, self.url)
            return StoreUnreachable(line) if is_outage(probe) else StoreError(line)
        return StoreUnreachable(describe_pg_error(exc, self.url))

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """One write transaction (re-entrant within a thread): a lease holder's is ordered with the others of
        its job tree and with every transaction that is not a lease holder's; any other, with all (as
        SQLite's).  See the module's docstring."""
        with self._transaction(exclusive=True) as conn:
            yield cast(Transaction, conn)

    @contextmanager
    def _reader(self) -> Iterator[psycopg.Connection[Any]]:
        """The thread's open transaction (so it reads its own writes), else a pooled connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            yield conn
            return
        with self._worded(), self._pool.connection() as pooled:
            yield pooled

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Rows of ``sql`` (``?`` placeholders) as dicts that can also be indexed by position (:class:`_pg_dialect.Row`)."""
        with self._reader() as conn, conn.cursor(row_factory=row_factory) as cur:
            cur.execute(psycopg_sql(sql), tuple(params))
            return cur.fetchall()

    def _tuples(self, sql: str, params: Sequence[Any]) -> FrameRows:
        with self._reader() as conn, conn.cursor() as cur:
            cur.execute(psycopg_sql(sql), tuple(params))
            rows = cur.fetchall()
            return [d.name for d in cur.description or ()], rows

    @staticmethod
    def _tx(c: Transaction) -> psycopg.Connection[Any]:
        # the transaction handle transaction() gives out is the thread's pooled connection
        return cast("psycopg.Connection[Any]", c)

    @staticmethod
    def _exec(conn: psycopg.Connection[Any], sql: str, params: Sequence[Any] = ()) -> psycopg.Cursor[Any]:
        return conn.execute(psycopg_sql(sql), tuple(params))

    def _run(self, c: Transaction, sql: str, params: Sequence[Any] = ()) -> psycopg.Cursor[Any]:
        return self._exec(self._tx(c), sql, params)

    def close(self) -> None:
        self._pool.close()

    # -- wake-ups (pg_notify.py) -------------------------------------------------
    @staticmethod
    def _notify(conn: psycopg.Connection[Any]) -> None:
        """Wake the idle workers when the transaction that just queued a job commits (pg_notify.py)."""
        conn.execute(NOTIFY_SQL)

    def job_waiter(self) -> PgJobWaiter:
        return PgJobWaiter(self.url)

    # -- jobs ------------------------------------------------------------------
    def create_job(self, **values: Any) -> int:
        now = time.time()
        values.setdefault("status", JobStatus.queued)
        values.setdefault("created", now)
        values.setdefault("updated", now)
        if isinstance(values.get("options"), dict):
            values["options"] = encode_payload(values["options"])
        with self._transaction(exclusive=True) as conn:
            self._new_job(conn, values)
            cols = ", ".join(values)
            marks = ", ".join("?" for _ in values)
            row = self._exec(conn, f"INSERT INTO jobs ({cols}) VALUES ({marks}) RETURNING id",
                             tuple(values.values())).fetchone()
            assert row is not None  # INSERT … RETURNING gives its row
            job_id = int(row[0])
            self._append(conn, [JobStatusEvent(job_id=job_id, ts=now, status=values["status"], reason="submitted")])
            if values["status"] == JobStatus.queued:
                self._notify(conn)
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
        for column, value in (("status", status), ("parent_id", parent_id), ("batch", batch)):
            if value is not None:
                where.append(f"{column}=?")
                params.append(value)
        if where:
            sql += " WHERE " + " AND ".join(where)
        return [self._job_record(r) for r in self.query(sql + " ORDER BY id", params)]

    def job_ids(self) -> list[int]:
        return [int(r["id"]) for r in self.query("SELECT id FROM jobs ORDER BY id")]

    def job_columns(self, job_id: int, columns: Sequence[str]) -> dict[str, Any] | None:
        bad = set(columns) - set(JOB_COLUMNS)
        if bad:
            raise StoreError(f"no job columns {sorted(bad)}")
        if not can_name_a_job(job_id):
            return None
        rows = self.query(f"SELECT {', '.join(columns)} FROM jobs WHERE id=?", (job_id,))
        return rows[0] if rows else None

    def update_job(self, c: Transaction, job_id: int, **values: Any) -> None:
        conn = self._tx(c)
        self._exec(conn, *self._job_update(conn, job_id, values))

    # -- large texts, stored once (see texts.py): this store's SQL for _rows.StoreRows ----------------
    def _instruction_ref(self, c: psycopg.Connection[Any], job_id: int) -> str | None:
        row = self._exec(c, "SELECT instruction_ref FROM jobs WHERE id=?", (job_id,)).fetchone()
        return row[0] if row else None

    def _put_text(self, c: psycopg.Connection[Any], body: str) -> str:
        ref = hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()
        self._exec(c, "INSERT INTO texts (hash, body) VALUES (?, ?) ON CONFLICT (hash) DO NOTHING", (ref, body))
        self._remember(ref, body)
        return ref

    def _text(self, ref: str) -> str:
        with self._texts_lock:
            body = self._texts.get(ref)
        if body is None:
            rows = self.query("SELECT body FROM texts WHERE hash=?", (ref,))
            if not rows:
                raise StoreError(f"{self.path} is damaged: text {ref[:12]}… that a job refers to is missing")
            body = str(rows[0]["body"])
            self._remember(ref, body)
        return body

    def set_status(self, c: Transaction, job_id: int, status: str, reason: str = "", **values: Any) -> None:
        """Change a job's status and record the ``job_status`` event, in transaction ``c``."""
        event = self._status_change(job_id, status, reason, values)
        self.update_job(c, job_id, status=status, **values)
        self._append(self._tx(c), [event])
        if status == JobStatus.queued:
            self._notify(self._tx(c))

    def claim(self, job_id: int | None = None, owner: str | None = None,
              lease: float | None = None) -> JobRecord | None:
        """Atomically move a queued job (the given one, or the oldest) to ``running``, leased for ``lease``
        seconds on the server's clock; its row, or None.

        ``FOR UPDATE SKIP LOCKED``: a row another claim holds is passed over, so concurrent workers each
        take a different job without waiting for one another (and without the store-wide write lock).
        """
        owner = owner or owner_id()
        seconds = float(self.lease if lease is None else lease)
        with self._transaction(exclusive=False) as conn:
            self._recover_orphans(conn, job_id)
            sql, params = "SELECT id FROM jobs WHERE status='queued'", list[Any]()
            if job_id is not None:
                if not can_name_a_job(job_id):
                    return None
                sql += " AND id=?"
                params.append(job_id)
            row = self._exec(conn, sql + " ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED", params).fetchone()
            if row is None:
                return None
            job_id = int(row[0])
            self._local.locked.add(job_id)
            now = time.time()
            cur = self._exec(conn, "UPDATE jobs SET status='running', claimed_by=?, updated=?, "
                                   f"started=COALESCE(started, ?), lease_gen=lease_gen+1, lease_until={_NOW}+? "
                                   "WHERE id=? AND status='queued'",
                             (owner, now, now, seconds, job_id))
            if cur.rowcount != 1:
                return None
            self._append(conn, [JobStatusEvent(job_id=job_id, ts=time.time(), status=JobStatus.running,
                                               reason=f"claimed by {owner}")])
            with conn.cursor(row_factory=dict_row) as dcur:
                dcur.execute("SELECT * FROM jobs WHERE id=%s", (job_id,))
                claimed = dcur.fetchone()
            return self._job_record(claimed) if claimed else None

    def _recover_orphans(self, c: psycopg.Connection[Any], job_id: int | None) -> None:
        """Queue again the running jobs whose lease has run out on the server's clock (their holder died, froze
        or lost the network, on any host), and those whose owner process on this host has died (no need to wait).

        Their lease generation moves on, so that a holder that comes back writes nothing more.  A row locked
        by its holder's write in progress is passed over (SKIP LOCKED): that holder is alive; a later claim
        looks again.
        """
        select = (f"SELECT id, claimed_by, COALESCE(lease_until < {_NOW}, false) FROM jobs WHERE status='running' "
                  f"AND (? OR id=? OR lease_until < {_NOW})")
        # Looked at first without locking: locking every running row (FOR UPDATE) would hold up, until this
        # claim commits, the writes and renewals of every job in progress.  Only the rows to take back are then
        # locked, and looked at again, as their holder may have renewed or ended them meanwhile.
        params = (job_id is None, job_id if job_id is not None and can_name_a_job(job_id) else 0)
        todo = [int(jid) for jid, claimed_by, expired in self._exec(c, select, params).fetchall()
                if expired or owner_is_gone(claimed_by)]
        if not todo:
            return
        rows = self._exec(c, select + " AND id = ANY(?) ORDER BY id FOR UPDATE SKIP LOCKED",
                          (*params, todo)).fetchall()
        for jid, claimed_by, expired in rows:
            if owner_is_gone(claimed_by):
                reason = f"{RECOVERED}the process that ran it ({claimed_by}) is gone"
            elif expired:
                reason = LEASE_EXPIRED
            else:
                continue
            self._local.locked.add(int(jid))
            self._exec(c, "UPDATE jobs SET lease_gen=lease_gen+1 WHERE id=?", (int(jid),))
            self.set_status(cast(Transaction, c), int(jid), JobStatus.queued, reason=reason)

    def renew_lease(self, job_id: int, gen: int, lease: float) -> bool:
        # no store-wide lock: one row, and it waits only for its own holder's write in progress
        with self._transaction(exclusive=False) as conn:
            cur = self._exec(conn, f"UPDATE jobs SET lease_until={_NOW}+? WHERE id=? AND lease_gen=? "
                                   "AND status='running'", (float(lease), job_id, gen))
            return cur.rowcount == 1

    # -- batches ---------------------------------------------------------------
    def create_batch(self, c: Transaction, name: str, *, fingerprint: str, cases: str, variants: str,
                     options: str) -> None:
        now = time.time()
        clean = self._clean_batch({"cases": cases, "options": options})
        cases, options = clean["cases"], clean["options"]
        self._exec(self._tx(c),
                   "INSERT INTO batches (name, created, updated, fingerprint, cases, variants, options) "
                   "VALUES (?,?,?,?,?,?,?)", (name, now, now, fingerprint, cases, variants, options))

    def update_batch(self, c: Transaction, name: str, **values: Any) -> None:
        bad = set(values) - {"fingerprint", "cases", "variants", "options"}
        if bad:
            raise StoreError(f"cannot update batch columns {sorted(bad)}")
        values = self._clean_batch(values)
        values["updated"] = time.time()
        sets = ", ".join(f"{k}=?" for k in values)
        self._exec(self._tx(c), f"UPDATE batches SET {sets} WHERE name=?", (*values.values(), name))

    # -- events ----------------------------------------------------------------
    def _append(self, c: psycopg.Connection[Any], events: Iterable[Event | PreparedRow]) -> None:
        rows = self._rows_in(c, events)
        self._lock_jobs(c, {int(r[0]) for r in rows})
        self._insert(c, rows)

    def _lock_jobs(self, c: psycopg.Connection[Any], job_ids: set[int]) -> None:
        """Lock the rows of the jobs whose events this transaction appends, until it ends.

        Event ids come from a sequence, and two transactions appending for one job (its runner, a comment from
        another process) could commit out of id order, so that a reader of ``events(after_id=)`` misses one.
        Holding the job's row from the insert to the commit makes one job's events commit in id order.  A
        fenced transaction and a claim hold their job's row already (one round trip saved per append)."""
        locked: set[int] = self._local.locked
        todo = sorted(job_ids - locked)
        if todo:
            c.execute("SELECT id FROM jobs WHERE id = ANY(%s) ORDER BY id FOR UPDATE", (todo,))
            locked.update(todo)

    def _insert(self, c: psycopg.Connection[Any], rows: list[tuple[Any, ...]]) -> None:
        head = "INSERT INTO events (job_id, movement_seq, iteration, ts, kind, payload) VALUES "
        if not self._live_wants(rows):
            _insert_rows(c, head, rows)
            return
        # their ids, for live.py: a sequence gives them in row order
        self._live_rows(rows, sorted(_insert_rows(c, head, rows, " RETURNING id")))

    def _payload_text(self, data: dict[str, Any]) -> str:
        # the stored payload text is the same on both backends, but for the NULs PostgreSQL cannot hold
        return no_nul(encode_payload(data))

    def append(self, events: Sequence[Event | PreparedRow], c: Transaction | None = None) -> None:
        # every row is built (and checked) before the first is written
        if c is not None:
            self._append(self._tx(c), events)
            return
        rows = self.prepare(events)
        # inserts only: no store-wide lock (see the module's docstring); the jobs' rows, so that one job's events
        # commit in id order (a fenced runner holds its own already: no round trip)
        with self._transaction(exclusive=False) as conn:
            built = self._rows_in(conn, rows)
            self._lock_jobs(conn, {int(r[0]) for r in built})
            self._insert(conn, built)

    def events(self, job_id: int, *, after_id: int = 0, kinds: Sequence[str] | None = None,
               movement_seq: int | None = None) -> list[Event]:
        # payload::text: the stored text itself (json keeps it), decoded by events.py like SQLite's
        sql, params = events_query("payload::text", job_id, after_id, kinds, movement_seq)
        rows = self._tuples(sql + " ORDER BY id", params)[1] if can_name_a_job(job_id) else []
        return [event_from_row(self._expand(tuple(r)) if r[5] in REF_FIELDS else tuple(r)) for r in rows]

    def last_event_id(self, job_id: int) -> int:
        return int(self._tuples("SELECT MAX(id) FROM events WHERE job_id=?", (job_id,))[1][0][0] or 0)

    def change_mark(self) -> tuple[int | None, int | None]:
        row = self._tuples("SELECT (SELECT MAX(id) FROM events), (SELECT MAX(id) FROM jobs)", ())[1][0]
        return row[0], row[1]

    # -- the DataFrame views (SQL in frames_sql.py, PostgreSQL dialect) -------------
    # -- a job's files (docs/stores.md#files: workers on other machines share only the database; engine/jobfiles.py) -----
    keeps_files = True

    def file_rows(self, job_id: int) -> list[dict[str, Any]]:
        return [dict(r) for r in self.query("SELECT path, mode, size, sha256, updated FROM files WHERE job_id=? "
                                            "ORDER BY path", (job_id,))]

    def file_data(self, job_id: int, paths: Sequence[str]) -> dict[str, bytes]:
        with self._reader() as conn:
            rows = self._exec(conn, "SELECT path, data FROM files WHERE job_id=? AND path = ANY(?)",
                              (job_id, list(paths))).fetchall()
        return {str(path): bytes(data) for path, data in rows}

    def write_files(self, c: Transaction, job_id: int, files: Sequence[StoredFile], removed: Sequence[str]) -> None:
        conn, now = self._tx(c), time.time()
        if removed:
            self._exec(conn, "DELETE FROM files WHERE job_id=? AND path = ANY(?)", (job_id, list(removed)))
        _insert_rows(conn, "INSERT INTO files (job_id, path, mode, size, sha256, data, updated) VALUES ",
                     [(job_id, f.path, f.mode, f.size, f.sha256, f.data, now) for f in files],
                     " ON CONFLICT (job_id, path) DO UPDATE SET mode=EXCLUDED.mode, size=EXCLUDED.size, "
                     "sha256=EXCLUDED.sha256, data=EXCLUDED.data, updated=EXCLUDED.updated")

    def add_comment(self, c: Transaction, job_id: int, author: str, body: str, *, ts: float | None = None) -> None:
        row, event = self._comment_row(job_id, author, body, ts)
        conn = self._tx(c)
        self._exec(conn, "INSERT INTO comments (job_id, author, body, ts) VALUES (?,?,?,?)", row)
        self._append(conn, [event])

    def reopen_failed_movement(self, c: Transaction, job_id: int) -> None:
        self._exec(self._tx(c), "UPDATE movements SET status='running', ended=NULL WHERE job_id=? AND "
                                "status='failed' AND seq=(SELECT MAX(seq) FROM movements WHERE job_id=?)",
                   (job_id, job_id))

    # -- operations the engine asks for ----------------------------------------
    def start_movement(self, c: Transaction, job_id: int, seq: int, name: str) -> None:
        self._exec(self._tx(c), "INSERT INTO movements (job_id, seq, name, status, started) VALUES (?,?,?,?,?)",
                   (job_id, seq, name, "running", time.time()))

    def finish_movement(self, c: Transaction, job_id: int, seq: int, *, iterations: int, next_step: str,
                        forced: bool, summary: str) -> None:
        self._exec(self._tx(c), "UPDATE movements SET status='done', ended=?, iterations=?, next_step=?, forced=?, "
                                "summary=? WHERE job_id=? AND seq=?",
                   (time.time(), iterations, next_step, int(forced), self._clean(summary), job_id, seq))

    def fail_movement(self, c: Transaction, job_id: int, seq: int, *, iterations: int) -> None:
        self._exec(self._tx(c), "UPDATE movements SET status='failed', ended=?, iterations=? WHERE job_id=? AND seq=?",
                   (time.time(), iterations, job_id, seq))

    def create_child_job(self, c: Transaction, parent_id: int, *, piece: str, piece_yaml: str,
                         piece_path: str | None, model: str, instruction: str, options: str) -> int:
        """Insert a queued subtask of ``parent_id`` (its instruction and options as given, but for secrets)."""
        now = time.time()
        row = self._exec(
            self._tx(c),
            "INSERT INTO jobs (parent_id, piece, piece_yaml, piece_path, model, instruction, status, workdir, "
            "options, created, updated) VALUES (?,?,?,?,?,?,?,?,?,?,?) RETURNING id",
            (parent_id, piece, piece_yaml, piece_path, model, self._clean(instruction), JobStatus.queued, "",
             self._clean_json(options), now, now),
        ).fetchone()
        assert row is not None  # INSERT … RETURNING gives its row
        self._notify(self._tx(c))
        return int(row[0])

    def parent_of(self, c: Transaction, job_id: int) -> int | None:
        row = self._exec(self._tx(c), "SELECT parent_id FROM jobs WHERE id=?", (job_id,)).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def subtask_wait(self, c: Transaction, job_id: int) -> tuple[bool, str | None]:
        row = self._exec(self._tx(c), "SELECT status, resume_movement, current_movement FROM jobs WHERE id=?",
                         (job_id,)).fetchone()
        if row is None or row[0] != JobStatus.waiting_subtasks:
            return False, None
        return True, row[1] or row[2]

    def open_children(self, c: Transaction, parent_id: int) -> int:
        states = sorted(TERMINAL_STATES)
        row = self._exec(
            self._tx(c),
            f"SELECT COUNT(*) FROM jobs WHERE parent_id=? AND status NOT IN ({','.join('?' * len(states))})",
            (parent_id, *states)).fetchone()
        return int(row[0]) if row else 0
