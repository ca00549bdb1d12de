"""The SQLite store: jobs, comments, movements and the event log.

One connection per :class:`Store`, WAL mode, one transaction per write.  All
writes go through :meth:`Store.transaction` (``BEGIN IMMEDIATE``), so claiming a
job is atomic across processes: two workers can never run the same job.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from ._migrations import MIGRATIONS
from .events import EVENT_KINDS, Event, event_from_row

__all__ = ["Store", "StoreError", "TERMINAL_STATES", "WAITING_STATES", "JOB_STATES"]

JOB_STATES = ("queued", "running", "succeeded", "failed", "aborted", "waiting_human", "waiting_subtasks")
TERMINAL_STATES = frozenset({"succeeded", "failed", "aborted"})
WAITING_STATES = frozenset({"waiting_human", "waiting_subtasks"})

_JOB_COLUMNS = (
    "id", "parent_id", "piece", "piece_yaml", "piece_path", "model", "instruction", "status",
    "current_movement", "resume_movement", "movement_seq", "workdir", "options", "enriched",
    "error", "claimed_by", "created", "updated", "started", "ended",
)
_UPDATABLE = frozenset(_JOB_COLUMNS) - {"id", "created"}

# An event row waiting to be written: (job_id, movement_seq, iteration, ts, kind, payload)
PendingEvent = tuple[int, "int | None", "int | None", float, str, dict[str, Any]]

_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=str)


def _fast_dumps() -> Any:
    """``_encoder.encode`` without rebuilding the C encoder on every call, as ``JSONEncoder.iterencode`` does.

    Every event payload is encoded once, ~5 per LLM call: this takes ~35% off each
    (~9 µs per call).  No circular-reference bookkeeping: payloads are built by the
    engine from JSON data and strings.  Falls back to ``encode`` where the C
    encoder is missing or behaves differently.
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return _encoder.encode
    try:
        enc = make(None, _encoder.default, json.encoder.encode_basestring, None, ":", ",", False, False, True)

        def dumps(obj: Any) -> str:
            return "".join(enc(obj, 0))

        probe = {"a": [1, 2.5, None, True], "é": "x\n\"y\"", "t": (1,), "o": object()}
        if dumps(probe) == _encoder.encode(probe):
            return dumps
    except Exception:
        pass
    return _encoder.encode


_dumps = _fast_dumps()


class StoreError(RuntimeError):
    """A store operation that cannot be done (unknown job, wrong state, …)."""


def owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _owner_is_gone(owner: str | None) -> bool:
    """True only when ``owner`` names a process of this host that no longer exists.

    Owners on other hosts, or in this very process, are never taken over.
    """
    host, _, rest = (owner or "").partition(":")
    pid_text = rest.split(":", 1)[0]
    if host != socket.gethostname() or not pid_text.isdigit() or int(pid_text) == os.getpid():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists but belongs to someone else
        return False
    return False


class Store:
    """Access to one ``agentnb.sqlite`` file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._depth = 0
        self.conn = sqlite3.connect(
            str(self.path), isolation_level=None, check_same_thread=False, timeout=30.0
        )
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL is durable across application crashes in WAL mode; only an OS
        # crash can lose the last transactions.
        self.conn.execute("PRAGMA synchronous=NORMAL")
        # Commits never fsync in this mode; checkpoints do (WAL, then the database: ~3 fsyncs of
        # ~4 ms each here).  At SQLite's default of 1,000 pages a busy job checkpointed every ~170
        # LLM calls, which was a third of the per-call overhead in benchmarks/overhead.py.  10,000
        # pages (a WAL of up to ~40 MB) makes that 10x rarer; durability is unchanged.
        self.conn.execute("PRAGMA wal_autocheckpoint=10000")
        self.conn.execute("PRAGMA foreign_keys=ON")
        self.conn.execute("PRAGMA busy_timeout=30000")
        self._migrate()

    # -- plumbing ---------------------------------------------------------
    def _migrate(self) -> None:
        with self.transaction() as c:
            version = c.execute("PRAGMA user_version").fetchone()[0]
            for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                for statement in script.split(";"):
                    if statement.strip():
                        c.execute(statement)
                c.execute(f"PRAGMA user_version={number}")

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (re-entrant within a thread)."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield self.conn
                finally:
                    self._depth -= 1
                return
            self.conn.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                yield self.conn
            except BaseException:
                self._depth = 0
                self.conn.execute("ROLLBACK")
                raise
            else:
                self._depth = 0
                self.conn.execute("COMMIT")

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self.conn.execute(sql, params).fetchall()

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    # -- jobs ---------------------------------------------------------------
    def create_job(self, **values: Any) -> int:
        now = time.time()
        values.setdefault("status", "queued")
        values.setdefault("created", now)
        values.setdefault("updated", now)
        if isinstance(values.get("options"), dict):
            values["options"] = _dumps(values["options"])
        cols = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        with self.transaction() as c:
            cur = c.execute(f"INSERT INTO jobs ({cols}) VALUES ({marks})", tuple(values.values()))
            job_id = int(cur.lastrowid)  # type: ignore[arg-type]
            self._append(c, [(job_id, None, None, now, "job_status", {"status": values["status"], "reason": "submitted"})])
        return job_id

    def job(self, job_id: int) -> dict[str, Any]:
        rows = self.query("SELECT * FROM jobs WHERE id=?", (job_id,))
        if not rows:
            raise StoreError(f"no job {job_id} in {self.path}")
        return dict(rows[0])

    def jobs(self, status: str | None = None, parent_id: int | None = None) -> list[dict[str, Any]]:
        sql, params = "SELECT * FROM jobs", []
        where = []
        if status is not None:
            where.append("status=?")
            params.append(status)
        if parent_id is not None:
            where.append("parent_id=?")
            params.append(parent_id)
        if where:
            sql += " WHERE " + " AND ".join(where)
        return [dict(r) for r in self.query(sql + " ORDER BY id", params)]

    def update_job(self, c: sqlite3.Connection, job_id: int, **values: Any) -> None:
        bad = set(values) - _UPDATABLE
        if bad:
            raise StoreError(f"cannot update job columns {sorted(bad)}")
        values["updated"] = time.time()
        sets = ", ".join(f"{k}=?" for k in values)
        c.execute(f"UPDATE jobs SET {sets} WHERE id=?", (*values.values(), job_id))

    def set_status(
        self, c: sqlite3.Connection, job_id: int, status: str, reason: str = "", **values: Any
    ) -> None:
        """Change a job's status and record the ``job_status`` event, in transaction ``c``."""
        now = time.time()
        if status in TERMINAL_STATES:
            values.setdefault("ended", now)
        if status != "running":
            values.setdefault("claimed_by", None)
        self.update_job(c, job_id, status=status, **values)
        self._append(c, [(job_id, None, None, now, "job_status", {"status": status, "reason": reason})])

    def claim(self, job_id: int | None = None, owner: str | None = None) -> dict[str, Any] | None:
        """Atomically move a queued job (the given one, or the oldest) to ``running``.

        Returns the claimed job row, or ``None`` when there is nothing to claim.
        """
        owner = owner or owner_id()
        with self.transaction() as c:
            self._recover_orphans(c, job_id)
            if job_id is None:
                row = c.execute("SELECT id FROM jobs WHERE status='queued' ORDER BY id LIMIT 1").fetchone()
                if row is None:
                    return None
                job_id = int(row[0])
            cur = c.execute(
                "UPDATE jobs SET status='running', claimed_by=?, updated=?, started=COALESCE(started, ?) "
                "WHERE id=? AND status='queued'",
                (owner, time.time(), time.time(), job_id),
            )
            if cur.rowcount != 1:
                return None
            self._append(c, [(job_id, None, None, time.time(), "job_status", {"status": "running", "reason": f"claimed by {owner}"})])
            return dict(c.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone())

    def _recover_orphans(self, c: sqlite3.Connection, job_id: int | None) -> None:
        """Queue again the running jobs whose owner process on this host has died (a crash, a kill).

        Their open movement is left open, so the next claim resumes it from its events.
        """
        sql, params = "SELECT id, claimed_by FROM jobs WHERE status='running'", ()
        if job_id is not None:
            sql, params = sql + " AND id=?", (job_id,)
        for jid, claimed_by in c.execute(sql, params).fetchall():
            if _owner_is_gone(claimed_by):
                self.set_status(c, int(jid), "queued", reason=f"recovered: the process that ran it ({claimed_by}) is gone")

    # -- events ---------------------------------------------------------------
    @staticmethod
    def _append(c: sqlite3.Connection, rows: Iterable[PendingEvent]) -> None:
        c.executemany(
            "INSERT INTO events (job_id, movement_seq, iteration, ts, kind, payload) VALUES (?,?,?,?,?,?)",
            [(j, s, i, t, k, _dumps(p)) for (j, s, i, t, k, p) in rows],
        )

    def append(self, rows: Sequence[PendingEvent], c: sqlite3.Connection | None = None) -> None:
        for row in rows:
            if row[4] not in EVENT_KINDS:
                raise StoreError(f"unknown event kind {row[4]!r}; allowed: {', '.join(EVENT_KINDS)}")
        if c is not None:
            self._append(c, rows)
            return
        with self.transaction() as c2:
            self._append(c2, rows)

    def events(
        self,
        job_id: int,
        *,
        after_id: int = 0,
        kinds: Sequence[str] | None = None,
        movement_seq: int | None = None,
    ) -> list[Event]:
        sql = "SELECT id, job_id, movement_seq, iteration, ts, kind, payload FROM events WHERE job_id=? AND id>?"
        params: list[Any] = [job_id, after_id]
        if kinds:
            sql += f" AND kind IN ({','.join('?' for _ in kinds)})"
            params.extend(kinds)
        if movement_seq is not None:
            sql += " AND movement_seq=?"
            params.append(movement_seq)
        with self._lock:
            cur = self.conn.execute(sql + " ORDER BY id", params)
            cur.row_factory = None  # type: ignore[assignment]
            return [event_from_row(tuple(r)) for r in cur.fetchall()]

    def last_event_id(self, job_id: int) -> int:
        rows = self.query("SELECT MAX(id) FROM events WHERE job_id=?", (job_id,))
        return int(rows[0][0] or 0)

    # -- comments --------------------------------------------------------------
    def add_comment(self, c: sqlite3.Connection, job_id: int, author: str, body: str) -> None:
        now = time.time()
        c.execute("INSERT INTO comments (job_id, author, body, ts) VALUES (?,?,?,?)", (job_id, author, body, now))
        self._append(c, [(job_id, None, None, now, "comment", {"author": author, "body": body})])

    def comments(self, job_id: int, last: int | None = None) -> list[dict[str, Any]]:
        if last is None:
            rows = self.query("SELECT * FROM comments WHERE job_id=? ORDER BY id", (job_id,))
        else:
            rows = self.query(
                "SELECT * FROM (SELECT * FROM comments WHERE job_id=? ORDER BY id DESC LIMIT ?) ORDER BY id",
                (job_id, last),
            )
        return [dict(r) for r in rows]

    def count_comments(self, job_id: int) -> int:
        return int(self.query("SELECT COUNT(*) FROM comments WHERE job_id=?", (job_id,))[0][0])

    # -- movements -------------------------------------------------------------
    def movements(self, job_id: int) -> list[dict[str, Any]]:
        return [dict(r) for r in self.query("SELECT * FROM movements WHERE job_id=? ORDER BY seq", (job_id,))]

    def open_movement(self, job_id: int) -> dict[str, Any] | None:
        rows = self.query(
            "SELECT * FROM movements WHERE job_id=? AND status='running' ORDER BY seq DESC LIMIT 1", (job_id,)
        )
        return dict(rows[0]) if rows else None
