"""The store interface: every operation the engine, the views, the facade and the CLI ask of a store.

:class:`Store` is a :class:`typing.Protocol`: the SQLite backend (:class:`agentnb.store.sqlite.SQLiteStore`)
implements it, and everything outside this package is typed against it, so a second backend can be added
here without touching them.  No SQL crosses this interface: each method is named for what it does, and the
frames' queries are asked for by frame name.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from ..errors import StoreError
from ..events import Event
from .records import JOB_STATES, TERMINAL_STATES, WAITING_STATES, JobOptions, JobRecord, JobStatus

__all__ = [
    "DEFAULT_LEASE",
    "FRAME_QUERIES",
    "INTERRUPTED_REASON",
    "JOB_STATES",
    "LEASE_EXPIRED",
    "MAX_INSTRUCTION_CHARS",
    "RECOVERED",
    "STOP_CUT_REASON",
    "STOP_REASON",
    "TERMINAL_STATES",
    "UNREACHABLE_REASON",
    "WAITING_STATES",
    "Dialect",
    "FrameQuery",
    "FrameRows",
    "JobOptions",
    "JobStatus",
    "JobWaiter",
    "LeaseLost",
    "PreparedRow",
    "Store",
    "StoreUnreachable",
    "StoredFile",
    "Transaction",
    "can_name_a_job",
    "is_recovery",
    "lease_lost",
    "owned_by_this_process",
    "owner_host",
    "owner_host_pid",
    "owner_id",
    "owner_is_gone",
]

# -- rules every backend keeps ------------------------------------------------------------------------
# JobStatus, the state sets and JobOptions live in records.py (the records are built of them, and this Protocol
# returns the records: records.py imports nothing of this module); imported here, where they were defined before

# The longest instruction a job may have: far more than any model's window holds (long material belongs
# in input files, which the tools read in budgeted pieces).  Subtasks are held to it too.
MAX_INSTRUCTION_CHARS = 1_000_000


def can_name_a_job(job_id: int) -> bool:
    """Whether ``job_id`` lies in SQLite's (signed 64-bit) integer range of row ids: beyond it a lookup raises
    OverflowError instead of finding nothing, so callers say "no job" without asking."""
    return 0 < job_id < 2**63


# How long a claim holds a job before another claimer may take it back (seconds); its holder renews it every
# third of that (agentnb/leases.py).  Workspace(lease=), AGENTNB_LEASE and `agentnb worker --lease` change it.
DEFAULT_LEASE = 30.0
# every job_status reason of a recovery (a running job queued again because its holder died, froze or was cut
# off) begins so: the time between its holder's last event and the recovery was nobody's running time
RECOVERED = "recovered: "
# the job_status reason of a running job taken back because its lease ran out (docs/stores.md#leases)
LEASE_EXPIRED = RECOVERED + "lease expired"
# ... of a job its holder gave back because the store became unreachable while it ran (not a recovery: the
# holder was alive and counts its time until then); it goes on from its last commit
UNREACHABLE_REASON = "the store became unreachable while it ran"
# ... of a job paused by a Stop (panel, %agent stop, Ctrl-C in a live run) after its current LLM call
STOP_REASON = "paused on request after its current LLM call"
# ... of one whose Stop cut its LLM call off (mid-answer, waiting for the answer, or waiting to retry)
STOP_CUT_REASON = "paused on request; its LLM call was stopped and is asked again on resume"
# ... of a job given back because the process running it was interrupted (Ctrl-C, SIGTERM) mid-call
INTERRUPTED_REASON = "interrupted"


def is_recovery(reason: str) -> bool:
    """Whether a ``job_status`` reason is a recovery's (see :data:`RECOVERED`)."""
    return reason.startswith(RECOVERED)


class LeaseLost(StoreError):
    """A write by a lease holder whose lease generation is no longer the job's: another claimer has taken the
    job back (the holder was frozen, partitioned or too slow to renew).  Nothing of that write was stored."""


class StoreUnreachable(StoreError):
    """The store's server did not answer: refused the connection, was shutting down or starting up, or dropped
    the connection mid-call (a restart, a network cut).  Worth trying again later, unlike a refused password, a
    missing database or a newer schema.  A transaction it cut short wrote nothing, unless it was the commit
    itself that went unanswered; either way the store holds the job as it was at one of its commits."""


def lease_lost(job_id: int, held: int, now: Any) -> LeaseLost:
    return LeaseLost(f"job {job_id}: lease lost to another worker (held generation {held}, "
                     f"the job's is now {now}); nothing more is written for it here")


def owner_host() -> str:
    """The host name this process puts in its claims: ``AGENTNB_HOST`` when set (containers that share one
    host name and pid numbers must set it, or the pid check of :func:`owner_is_gone` would ask the wrong
    process), else the machine's."""
    return os.environ.get("AGENTNB_HOST") or socket.gethostname()


# a claim's owner is host:pid:random, so that a dead owner on this host can be told apart
def owner_id() -> str:
    return f"{owner_host()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def owner_host_pid(owner: str | None) -> tuple[str, int | None]:
    """The host and process id named by ``owner`` (an :func:`owner_id`); pid None when it names none."""
    host, _, rest = (owner or "").partition(":")
    pid_text = rest.split(":", 1)[0]
    return host, int(pid_text) if pid_text.isdigit() else None


def owned_by_this_process(owner: str | None) -> bool:
    """True when ``owner`` (a job's ``claimed_by``) is this very process."""
    return owner_host_pid(owner) == (owner_host(), os.getpid())


def owner_is_gone(owner: str | None) -> bool:
    """True only when ``owner`` names a process of this host that no longer exists.

    Owners on other hosts, or in this very process, are never taken over.
    """
    host, pid = owner_host_pid(owner)
    if host != owner_host() or pid is None or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists but belongs to someone else
        pass
    # A process that has exited but whose parent has not reaped it yet (a zombie) still answers kill(pid, 0);
    # it will never run again, and its parent may never reap it.
    return _process_state(pid) in ("Z", "X")


def _process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (R, S, D, Z, …), or None where there is no /proc to ask."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return "X" if os.path.isdir("/proc/self") else None  # gone between the two looks, or no /proc here
    except OSError:
        return None
    # "pid (comm) S …": comm may hold spaces and parentheses, so the state follows the last ')'
    fields = stat[stat.rfind(b")") + 1:].split()
    return fields[0].decode("ascii", "replace") if fields else None




# the DataFrame views whose rows a store computes (views/frames.py gives them their dtypes)
FrameQuery = Literal["jobs", "movements", "messages", "tool_calls", "usage", "context_actions", "job_models",
                     "call_costs", "scores", "divergences", "compactions", "loops"]
FRAME_QUERIES: tuple[FrameQuery, ...] = ("jobs", "movements", "messages", "tool_calls", "usage", "context_actions",
                                         "job_models", "call_costs", "scores", "divergences",
                                         "compactions", "loops")
# column names, then plain row tuples
FrameRows = tuple[list[str], list[tuple[Any, ...]]]
# the SQL a backend speaks: frames_sql.py renders each frame for both; store/reads.py writes SQL both take
Dialect = Literal["sqlite", "postgres"]


@dataclass(frozen=True)
class StoredFile:
    """One file of a job's work directory as a store that keeps files holds it (docs/stores.md#files, ``engine/jobfiles``).

    ``path`` is relative to the work directory, in POSIX form; ``mode`` the ``st_mode`` (type and permission
    bits: a regular file, or a symbolic link whose ``data`` is its target); ``sha256`` the hex digest of ``data``.
    """

    path: str
    mode: int
    size: int
    sha256: str
    data: bytes


class Transaction(Protocol):
    """An open write transaction, from :meth:`Store.transaction`.

    Opaque to callers: they only hand it back to the store's writes that must commit together.
    """


class PreparedRow(tuple[Any, ...]):
    """An event's ``events`` row as :meth:`Store.prepare` built it (job id, movement seq, iteration, ts, kind,
    payload text): opaque to callers, who only hand it back to :meth:`Store.append`."""

    __slots__ = ()


class JobWaiter(Protocol):
    """An idle worker's wake-up call: blocks until a job may have been queued (PostgreSQL's LISTEN/NOTIFY)."""

    def wait(self, timeout: float) -> bool:
        """Block until a job may have been queued (True) or ``timeout`` seconds passed (False).  Never raises:
        a lost connection waits out the timeout and reconnects on the next call."""
        ...

    def close(self) -> None: ...


class Store(Protocol):
    """Jobs, comments, movements and the event log of one workspace."""

    @property
    def path(self) -> Path | str:
        """Where the store lives (named in error messages): the SQLite file, or a server's URL without its
        password."""
        ...

    @property
    def readonly(self) -> bool: ...

    # seconds a claim made without ``lease=`` holds its job (the Workspace sets it from its ``lease`` setting)
    lease: float

    def close(self) -> None: ...

    def job_waiter(self) -> JobWaiter | None:
        """A :class:`JobWaiter` woken when a job is queued (on its own connection; close it after), or None when
        this backend sends no wake-ups and an idle worker polls instead (SQLite)."""
        ...

    def transaction(self) -> AbstractContextManager[Transaction]:
        """One write transaction, re-entrant within a thread: every write inside commits together or not at all."""
        ...

    # -- jobs ---------------------------------------------------------------------------------------------
    def create_job(self, **values: Any) -> int:
        """Insert a job row (its ``job_status`` event too) and return its id."""
        ...

    def job(self, job_id: int) -> JobRecord:
        """The job's row as a record (docs/python-api.md#records), long texts expanded; :class:`StoreError` when
        there is no such job."""
        ...

    def jobs(self, status: str | None = None, parent_id: int | None = None,
             batch: str | None = None) -> list[JobRecord]:
        """Job records in id order, optionally only those with ``status``, of ``parent_id`` or of ``batch``."""
        ...

    def job_ids(self) -> list[int]: ...

    def job_columns(self, job_id: int, columns: Sequence[str]) -> dict[str, Any] | None:
        """Only ``columns`` of the job's row (cheap: no long text expanded); None when there is no such job."""
        ...

    def update_job(self, c: Transaction, job_id: int, **values: Any) -> None: ...

    def set_status(self, c: Transaction, job_id: int, status: str, reason: str = "", **values: Any) -> None:
        """Change a job's status (and other columns) and record the ``job_status`` event, in ``c``."""
        ...

    def claim(self, job_id: int | None = None, owner: str | None = None,
              lease: float | None = None) -> JobRecord | None:
        """Atomically move a queued job (the given one, or the oldest) to ``running``; its record, or None.

        First every running job whose lease has run out goes back to the queue (``LEASE_EXPIRED``; its
        generation moves on, so its old holder's next write is refused), as does one whose owner process on
        this host is gone.  The claimed job gets ``lease_gen`` + 1 and ``lease_until`` = now + ``lease``
        (``self.lease`` when None); its row carries both.
        """
        ...

    def renew_lease(self, job_id: int, gen: int, lease: float) -> bool:
        """Extend a running job's lease to now + ``lease`` if ``gen`` is still its generation; False when the
        lease was lost (the job was taken back or ended)."""
        ...

    def fenced(self, job_id: int, gen: int) -> AbstractContextManager[None]:
        """While inside, every write transaction this thread begins first checks, in that transaction, that job
        ``job_id``'s lease generation is still ``gen``, and raises :class:`LeaseLost` (writing nothing) when not."""
        ...

    # -- events -------------------------------------------------------------------------------------------
    def append(self, events: Sequence[Event | PreparedRow], c: Transaction | None = None) -> None:
        """Record ``events`` (in ``c``, else in a transaction of their own); some may come as :meth:`prepare` made
        them."""
        ...

    def prepare(self, events: Sequence[Event]) -> list[Event | PreparedRow]:
        """``events`` made into their stored rows now, to be appended in a transaction opened after: the rows are
        built and checked outside it (those whose payload refers to the job's stored instruction stay events,
        built inside, as they read its reference)."""
        ...

    def events(
        self,
        job_id: int,
        *,
        after_id: int = 0,
        kinds: Sequence[str] | None = None,
        movement_seq: int | None = None,
    ) -> list[Event]: ...

    def last_event_id(self, job_id: int) -> int: ...

    def change_mark(self) -> tuple[int | None, int | None]:
        """The newest event id and job id of the whole store: different whenever anything was recorded."""
        ...

    # -- comments -----------------------------------------------------------------------------------------
    # (the writes; a job's comments and movement runs are read by store/reads.py as store/records.py's records)
    def add_comment(self, c: Transaction, job_id: int, author: str, body: str, *, ts: float | None = None) -> None:
        """Add a comment (and its ``comment`` event, stamped now); ``ts``: when it was written, if not now
        (a fork re-serving its original's conversation keeps the original's times, which prompts show)."""
        ...

    # -- movements ----------------------------------------------------------------------------------------
    def reopen_failed_movement(self, c: Transaction, job_id: int) -> None:
        """Reopen the job's last movement run when it failed (a retry resumes it from its events)."""
        ...

    # -- operations the engine asks for --------------------------------------------------------------------
    def start_movement(self, c: Transaction, job_id: int, seq: int, name: str) -> None:
        """Open the row of movement run ``seq`` (its events are recorded in the same transaction)."""
        ...

    def finish_movement(self, c: Transaction, job_id: int, seq: int, *, iterations: int, next_step: str,
                        forced: bool, summary: str) -> None:
        """Close movement run ``seq`` with the transition that ended it."""
        ...

    def fail_movement(self, c: Transaction, job_id: int, seq: int, *, iterations: int) -> None:
        """Close movement run ``seq`` as failed (its job fails in the same transaction)."""
        ...

    def create_child_job(self, c: Transaction, parent_id: int, *, piece: str, piece_yaml: str,
                         piece_path: str | None, model: str, instruction: str, options: str) -> int:
        """Insert a queued subtask of ``parent_id``; its id."""
        ...

    def parent_of(self, c: Transaction, job_id: int) -> int | None: ...

    def subtask_wait(self, c: Transaction, job_id: int) -> tuple[bool, str | None]:
        """Whether the job waits for its subtasks, and the movement it goes on at when they end."""
        ...

    def open_children(self, c: Transaction, parent_id: int) -> int:
        """How many subtasks of ``parent_id`` have not ended."""
        ...

    # -- batches (docs/design-lab.md) --------------------------------------------------------------------------------
    def create_batch(self, c: Transaction, name: str, *, fingerprint: str, cases: str, variants: str,
                     options: str) -> None:
        """Insert the batch row (``cases``/``variants``/``options`` are JSON texts); its jobs follow in ``c``."""
        ...

    def update_batch(self, c: Transaction, name: str, **values: Any) -> None:
        """Change ``variants``, ``options`` or ``fingerprint`` of a batch (``updated`` is set too)."""
        ...

    # -- the call cache (docs/stores.md#call-cache; read with rows(), engine/callcache.py) -------------------------------
    def cache_put(self, key: str, *, kind: str, model: str, body: str, prompt_tokens: int | None = None,
                  completion_tokens: int | None = None, job_id: int | None = None) -> None:
        """Record ``body`` (scrubbed; a long one once in ``texts``) under ``key``, in a transaction of its own; a
        key already there keeps its row."""
        ...

    def cache_hit(self, key: str) -> None:
        """Count one answer given from the row of ``key``."""
        ...

    def cache_clear(self, before: float | None = None) -> int:
        """Delete the rows created before ``before`` (epoch seconds; None: all); how many went."""
        ...


    # -- a job's files (docs/stores.md#files) ------------------------------------------------------------------------
    @property
    def keeps_files(self) -> bool:
        """Whether jobs' files live in this store (PostgreSQL: workers on other machines share only the database).
        False (SQLite): each job's work directory stays on disk where it is, and the three methods below refuse."""
        ...

    def file_rows(self, job_id: int) -> list[dict[str, Any]]:
        """The job's stored files without their bytes (``path``, ``mode``, ``size``, ``sha256``, ``updated``),
        by path."""
        ...

    def file_data(self, job_id: int, paths: Sequence[str]) -> dict[str, bytes]:
        """The bytes of the job's stored files ``paths`` (a path it does not have is left out)."""
        ...

    def write_files(self, c: Transaction, job_id: int, files: Sequence[StoredFile], removed: Sequence[str]) -> None:
        """In ``c``: store ``files`` (new or changed) and delete the rows of ``removed``."""
        ...

    # -- the DataFrame views --------------------------------------------------------------------------------
    @property
    def dialect(self) -> Dialect:
        """The SQL this backend speaks (``sqlite`` or ``postgres``)."""
        ...

    def rows(self, sql: str, params: Sequence[Any] = ()) -> FrameRows:
        """Column names and row tuples of a read-only query with ``?`` placeholders in SQL both backends take:
        what the derived reads of :mod:`agentnb.store.reads` are built on."""
        ...
