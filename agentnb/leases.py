"""Leases on running jobs (docs/stores.md#leases): the setting, the threads that renew them, and when one is lost.

A claim leases its job for ``lease`` seconds (:meth:`Store.claim`).  While this process runs the job,
:func:`holding` keeps the lease alive — renewed every third of its length by one daemon thread per store for
all the jobs the process holds there — and fences the running thread's writes: each write transaction first
checks that the job's lease generation is still the one claimed, and raises
:class:`~agentnb.store.base.LeaseLost` otherwise.  A holder
that stopped renewing (killed, frozen, cut off) loses the job to the next claim after the lease runs out, and,
if it comes back, writes nothing more for it.

Nor does it *do* anything more for it: the engine calls :meth:`Held.check` before every outside effect (each
LLM call, each tool call, between the tool calls of one response), which raises ``LeaseLost`` — the same quiet
stop as a refused write — once the lease is lost.  A lease is lost when the store refuses its renewal (another
claimer moved the generation), or when a whole lease has gone by since the last renewal the store confirmed
while the store did not answer (every attempt since failed, or the one under way has hung for a third of the
lease): another host may have claimed the job by then.  That second rule is decided by the clock, by the
renewer when a failed attempt returns and by :meth:`Held.check` itself, so a renewal stuck on an unreachable
server (a partition, a locked SQLite file) cannot postpone it.  When the renewer was merely late (this process
was frozen or starved, its last attempt succeeded), :meth:`Held.check` asks the store itself before deciding.

On PostgreSQL the server enforces the other side (:mod:`agentnb.store.pg_session`): a connection idle inside a
transaction for a whole lease is ended by the server, which frees the job row and the write locks a frozen
or cut-off holder would otherwise keep until TCP noticed; keepalives make a dead peer noticed within a lease.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .errors import StoreError, UsageError
from .store.base import DEFAULT_LEASE, LeaseLost, Store
from .store.records import JobRecord

__all__ = ["DEFAULT_LEASE", "Held", "check_lease", "holding", "lease_setting"]


def check_lease(value: Any, what: str = "lease") -> float:
    """``value`` as a lease length in seconds, or one line naming what is allowed."""
    try:
        seconds = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise UsageError(f"{what}={value!r}: the lease must be a number of seconds greater than 0 "
                         f"(default {DEFAULT_LEASE:g})")
    return seconds


def lease_setting(lease: float | str | None = None) -> float:
    """The lease length of a workspace: ``lease`` when given, else ``AGENTNB_LEASE``, else the default."""
    if lease is not None:
        return check_lease(lease)
    env = os.environ.get("AGENTNB_LEASE")
    if env is not None and env.strip():
        return check_lease(env.strip(), "AGENTNB_LEASE")
    return DEFAULT_LEASE


@dataclass(eq=False)
class Held:
    """One lease this process holds: the job, the generation its claim got, and whether it was lost.

    Times are ``time.monotonic()``: ``renewed`` is when the last renewal the store confirmed was *sent* (at
    first, when the claim returned), so the lease runs at least until ``renewed + seconds``; ``trying`` is when
    the renewal under way was sent (None: none is), ``failed`` whether the last one to return failed.
    """

    store: Store
    job_id: int
    gen: int
    seconds: float
    due: float = 0.0
    lost: threading.Event = field(default_factory=threading.Event)
    renewed: float = field(default_factory=time.monotonic)
    trying: float | None = None
    failed: bool = False
    why: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def check(self) -> None:
        """Raise :class:`LeaseLost` when the lease is lost (see the module's docstring); the engine calls this
        before each LLM call and each tool call."""
        if not self.lost.is_set():
            now = time.monotonic()
            with self._lock:
                late = now - self.renewed >= self.seconds
                stuck = self.failed or (self.trying is not None and now - self.trying >= self.seconds / 3)
            if late and stuck:
                self._lose(f"not renewed for {now - self.renewed:.1f} s, longer than its {self.seconds:g} s lease, "
                           "while the store did not answer: another worker may hold it now")
            elif late:  # the renewer is late but the store answered it last time: ask the store now
                self._confirm()
        if self.lost.is_set():
            raise LeaseLost(f"job {self.job_id}: lease lost ({self.why}); nothing more is done for it here")

    def _confirm(self) -> None:
        sent = time.monotonic()
        try:
            renewed = self.store.renew_lease(self.job_id, self.gen, self.seconds)
        except LeaseLost:
            renewed = False
        except Exception as exc:  # unreachable, or the backend's own error (a closed store)
            # a StoreError's line names the store without its password; a backend's raw error only by its type
            said = exc if isinstance(exc, StoreError) else type(exc).__name__
            self._lose(f"not renewed for {time.monotonic() - self.renewed:.1f} s, longer than its "
                       f"{self.seconds:g} s lease, and the store did not answer ({said})")
            return
        self.answered(sent, renewed)

    def attempt(self, sent: float) -> None:
        with self._lock:
            self.trying = sent

    def answered(self, sent: float, renewed: bool) -> None:
        """The store answered the renewal sent at ``sent``: renewed, or refused (the lease is lost)."""
        with self._lock:
            self.trying, self.failed = None, False
            if renewed:
                self.renewed = max(self.renewed, sent)
        if not renewed:
            self._lose(f"its renewal of generation {self.gen} was refused: another worker claimed it")

    def unanswered(self) -> None:
        """A renewal failed (the store could not be reached): lost once a whole lease went by without one."""
        now = time.monotonic()
        with self._lock:
            self.trying, self.failed = None, True
            late = now - self.renewed >= self.seconds
        if late:
            self._lose(f"not renewed for {now - self.renewed:.1f} s, longer than its {self.seconds:g} s lease: "
                       "the store could not be reached, and another worker may hold it now")

    def _lose(self, why: str) -> None:
        with self._lock:
            if not self.lost.is_set():
                self.why = why
                self.lost.set()


class _Renewer:
    """One daemon thread renewing every lease held on one store, each a third of its length after the last.

    One per store, not per process: a renewal hung on one store (a partition, a locked file) holds up only
    the leases on that store.  The thread ends once it has held nothing for a while, and the next lease on
    the store starts another.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._held: set[Held] = set()
        self._cond = threading.Condition()
        # when the thread's wait ends (monotonic; 0: it is not waiting): a lease falling due later needs no wake-up
        self._wakes = 0.0
        self.done = False
        self.pid = os.getpid()
        threading.Thread(target=self._run, name="agentnb-lease-renewer", daemon=True).start()

    def add(self, held: Held) -> None:
        with self._cond:
            held.due = time.monotonic() + held.seconds / 3
            self._held.add(held)
            # a job of a few milliseconds woke the thread (and took the GIL from it) for nothing: its first
            # renewal is a third of a lease away, after the thread's wait ends and it looks again
            if held.due < self._wakes or not self._wakes:
                self._cond.notify()

    def remove(self, held: Held) -> None:
        with self._cond:
            self._held.discard(held)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [h for h in self._held if h.due <= now]
                if not self._held:
                    self._wakes = now + _IDLE
                    woken = self._cond.wait(timeout=_IDLE)
                    self._wakes = 0.0
                    if not woken and self._retire():
                        return
                    continue
                if not due:
                    wait = max(min(h.due for h in self._held) - now, 0.01)
                    self._wakes = now + wait
                    self._cond.wait(timeout=wait)
                    self._wakes = 0.0
                    continue
                for h in due:
                    h.due = now + h.seconds / 3
            for h in due:
                self._renew(h)

    def _retire(self) -> bool:
        """End this thread if it still holds nothing (called with ``_cond`` held; takes ``_RENEWERS_LOCK``
        without waiting, as :func:`_renewer` takes them in the other order)."""
        if not _RENEWERS_LOCK.acquire(blocking=False):
            return False
        try:
            if self._held:
                return False
            self.done = True
            if _RENEWERS.get(id(self.store)) is self:
                del _RENEWERS[id(self.store)]
            return True
        finally:
            _RENEWERS_LOCK.release()

    def _renew(self, held: Held) -> None:
        if held.lost.is_set():  # given up by Held.check: extending it would only delay its recovery elsewhere
            self.remove(held)
            return
        sent = time.monotonic()
        held.attempt(sent)
        try:
            renewed = held.store.renew_lease(held.job_id, held.gen, held.seconds)
        except Exception:
            # the store did not answer (unreachable, locked past its busy timeout, closed under a running job):
            # try again at the next third, until a whole lease went by without a renewal
            held.unanswered()
            if held.lost.is_set():
                self.remove(held)
            return
        held.answered(sent, renewed)
        if not renewed:
            self.remove(held)


# seconds a renewer with nothing to renew waits before its thread ends
_IDLE = 5.0
_RENEWERS: dict[int, _Renewer] = {}
_RENEWERS_LOCK = threading.Lock()


def _add(held: Held) -> _Renewer:
    """Hand ``held`` to its store's renewer (started when there is none, or it is ending or was inherited
    by a fork()ed child without its thread)."""
    with _RENEWERS_LOCK:
        renewer = _RENEWERS.get(id(held.store))
        if renewer is None or renewer.store is not held.store or renewer.done or os.getpid() != renewer.pid:
            renewer = _RENEWERS[id(held.store)] = _Renewer(held.store)
        renewer.add(held)
        return renewer


@contextmanager
def holding(store: Store, row: JobRecord, seconds: float | None = None) -> Iterator[Held]:
    """Hold the lease of the claimed job ``row`` (the record its claim returned) while inside: renewed in the
    background, and every write transaction of this thread fenced by its generation."""
    held = Held(store=store, job_id=row.id, gen=row.lease_gen,
                seconds=float(store.lease if seconds is None else seconds))
    renewer = _add(held)
    try:
        with store.fenced(held.job_id, held.gen):
            yield held
    finally:
        renewer.remove(held)
