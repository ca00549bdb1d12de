"""Leases on running jobs (DESIGN §13): the setting, and the one thread per process that renews them.

A claim leases its job for ``lease`` seconds (:meth:`Store.claim`).  While this process runs the job,
:func:`holding` keeps the lease alive — renewed every third of its length by one daemon thread for all the jobs
of the process — and fences the running thread's writes: each write transaction first checks that the job's
lease generation is still the one claimed, and raises :class:`~agentnb.store.base.LeaseLost` otherwise.  A holder
that stopped renewing (killed, frozen, cut off) loses the job to the next claim after the lease runs out, and,
if it comes back, writes nothing more for it.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .errors import StoreError, UsageError
from .store.base import DEFAULT_LEASE, Store

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
    """One lease this process holds: the job, the generation its claim got, and whether it was lost."""

    store: Store
    job_id: int
    gen: int
    seconds: float
    due: float = 0.0
    lost: threading.Event = field(default_factory=threading.Event)


class _Renewer:
    """One daemon thread renewing every lease of the process, each a third of its length after the last."""

    def __init__(self) -> None:
        self._held: set[Held] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, held: Held) -> None:
        with self._cond:
            held.due = time.monotonic() + held.seconds / 3
            self._held.add(held)
            # a fork()ed child inherits the Thread object but not the thread
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="agentnb-lease-renewer", daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, held: Held) -> None:
        with self._cond:
            self._held.discard(held)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [h for h in self._held if h.due <= now]
                if not due:
                    wait = min((h.due for h in self._held), default=now + 60) - now
                    self._cond.wait(timeout=max(wait, 0.01))
                    continue
                for h in due:
                    h.due = now + h.seconds / 3
            for h in due:
                self._renew(h)

    def _renew(self, held: Held) -> None:
        try:
            renewed = held.store.renew_lease(held.job_id, held.gen, held.seconds)
        except StoreError:
            return  # the server is unreachable for now: try again at the next third; the fence guards the rest
        except Exception:  # a closed store (the workspace was closed under a running job): stop renewing it
            self.remove(held)
            return
        if not renewed:
            held.lost.set()
            self.remove(held)


_RENEWER = _Renewer()


@contextmanager
def holding(store: Store, row: Mapping[str, Any], seconds: float | None = None) -> Iterator[Held]:
    """Hold the lease of the claimed job ``row`` while inside: renewed in the background, and every write
    transaction of this thread fenced by its generation."""
    job_id = int(row["id"])
    gen = row.get("lease_gen")
    if gen is None:  # a row from before the claim: the generation the claim gave it
        cols = store.job_columns(job_id, ["lease_gen"])
        gen = cols["lease_gen"] if cols else 0
    held = Held(store=store, job_id=job_id, gen=int(gen or 0),
                seconds=float(store.lease if seconds is None else seconds))
    _RENEWER.add(held)
    try:
        with store.fenced(held.job_id, held.gen):
            yield held
    finally:
        _RENEWER.remove(held)
