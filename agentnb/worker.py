"""The queue worker: claims queued jobs one at a time and runs each through the workspace.

SIGTERM while it runs gives the running job back to the queue (:func:`sigterm_interrupts`).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from .store.base import Store

__all__ = ["JobQueue", "Terminated", "Worker", "sigterm_interrupts"]

JobT = TypeVar("JobT", covariant=True)


class JobQueue(Protocol[JobT]):
    """What a worker drives: the workspace facade (:class:`agentnb.workspace.Workspace`), named here by
    what it does so that this module does not import the facade that imports it."""

    @property
    def store(self) -> Store: ...

    def _run_claimed(self, row: dict[str, Any], unit: str) -> JobT: ...


class Terminated(SystemExit):
    """A SIGTERM, raised in the main thread while a worker runs (the exit status is 128 + 15)."""


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While inside, SIGTERM interrupts the main thread as Ctrl-C does, so the running job is re-queued.

    Without it SIGTERM (``kill``, ``systemctl stop``, a container shutting down) ends the process
    where it stands and the job stays ``running`` until a later claim notices its owner is gone.
    Only the main thread can receive signals: elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def interrupt(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if fired:  # a second SIGTERM must not cut short the re-queueing the first one started
            return
        fired = True
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


class Worker(Generic[JobT]):
    """Claims queued jobs one at a time and runs each until it ends or waits.

    SIGTERM (like Ctrl-C) gives the running job back to the queue, resumable, and raises
    :class:`Terminated`.
    """

    def __init__(self, workspace: JobQueue[JobT]) -> None:
        self.ws = workspace

    def run_once(self) -> JobT | None:
        """Claim the oldest queued job and run it; ``None`` when the queue is empty."""
        with sigterm_interrupts():
            row = self.ws.store.claim()
            if row is None:
                return None
            return self.ws._run_claimed(row, unit="job")

    def run(self, *, forever: bool = False, poll: float = 1.0, max_jobs: int | None = None) -> int:
        """Run queued jobs until none is left (or forever, polling); returns how many ran."""
        done = 0
        with sigterm_interrupts():
            while max_jobs is None or done < max_jobs:
                job = self.run_once()
                if job is None:
                    if not forever:
                        break
                    time.sleep(poll)
                    continue
                done += 1
        return done
