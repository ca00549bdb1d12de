"""Signals that interrupt a run: SIGTERM made to act as Ctrl-C, so running jobs go back to the queue.

Below both the queue worker (:mod:`agentnb.worker`) and the executor (:mod:`agentnb.executor`), which
both run jobs that a SIGTERM must give back.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["Terminated", "sigterm_interrupts"]


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
