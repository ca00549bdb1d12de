"""Signals that interrupt a run: SIGTERM made to act as Ctrl-C, so running jobs go back to the queue; and a
section that a Ctrl-C or SIGTERM interrupts only once it is done (:func:`held_interrupts`).

Below both the queue worker (:mod:`agentnb.worker`) and the executor (:mod:`agentnb.executor`), which
both run jobs that a SIGTERM must give back.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["Terminated", "held_interrupts", "sigterm_interrupts"]


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


_HELD = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def held_interrupts() -> Iterator[None]:
    """While inside, a Ctrl-C or SIGTERM waits: it is delivered (to the handler it would have reached) once the
    section ends, so a step that must not be cut in half — a message taken from a queue and acted on, a message
    half written to a pipe — is done whole or not begun.  Keep the section short: the interrupt waits for it.
    Only the main thread can receive signals: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        pending.append(signum)

    previous = {signum: signal.signal(signum, hold) for signum in _HELD}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        for came in dict.fromkeys(pending):  # each kind once, in the order they came
            signal.raise_signal(came)
