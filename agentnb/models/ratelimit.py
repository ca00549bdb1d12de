"""One gate per endpoint and model, shared by every job of the process, so a rate limit slows the whole batch.

Many jobs run at once (``ws.batch(..., concurrency=N)``) and their ``openai:`` calls often go to the
same endpoint.  When that endpoint answers 429 ("too many requests"), retrying only the call that got it
would let the other N-1 jobs keep hammering the endpoint, and each would collect 429s of its own until
its retries run out.  So every call passes through the :class:`Gate` of its (base URL, model):

* **a shared pause** — a 429 closes the gate for the wait the server asked for (``retry-after-ms`` or
  ``retry-after``) or, when it gave none, the call's exponential backoff.  Every call to that endpoint,
  not only the one that was refused, waits it out before its next attempt.  A call never waits longer
  than its own ``max_backoff`` for the gate;
* **fewer calls in flight (AIMD)** — the first 429 caps the number of calls in flight at half of those in
  flight when it came; each further 429 halves the cap again (never below 1), and successful calls raise
  it by one per round (each by 1/cap: raising it by a whole call per success would double it every round
  and overshoot the endpoint's limit at once).  A 429 to a call sent before the last cut does not cut
  again: it was sent before the gate reacted.  Once the cap is back up to the most calls ever seen in
  flight, the gate is open again (no cap).  So a batch settles just under the endpoint's limit instead
  of hammering it.

A job's Stop (the call's ``cancel``) ends a wait in the gate at once: :meth:`Gate.acquire` returns None, and the
call is cut off as one stopped while its answer was awaited (docs/models.md#streaming).

A batch run in several processes (docs/design-lab.md#processes) shares what a 429 taught: each gate tells the
listeners of :func:`on_throttle` of a 429 it got itself, the batch's process passes it on, and the other processes
apply it to their own gate of that endpoint with :func:`throttle_heard` (which tells nobody, so it is not echoed).

Jobs do not fail because of this while their retries remain: a 429 is retried as before (``retries``
and ``max_backoff`` per job, workspace or environment), the gate only decides *when*.  5xx answers,
timeouts and malformed answers are retried by their own call only; they do not close the gate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Gate", "forget_gates", "gate_for", "on_throttle", "throttle_heard"]

# how often a call waiting for a slot under the cap looks at its job's Stop (a released slot wakes it at once)
STOP_POLL_S = 0.05


class Gate:
    """The calls in flight to one endpoint+model, their cap and the pause after a 429 (thread-safe)."""

    def __init__(self, key: tuple[str, str] | None = None) -> None:
        self.key = key  # (endpoint, model) of the process's gate; None: a gate of its own (tests)
        self._clock = time.monotonic
        self._cond = threading.Condition()
        self.in_flight = 0
        self.peak = 0  # the most calls seen in flight: the "original" the cap grows back to
        self.limit: float | None = None  # None: no cap (no 429 yet, or recovered); its whole part counts
        self.paused_until = 0.0
        self.throttled = 0  # 429s seen, for the curious
        self.waiting = 0  # calls waiting in acquire (out a pause or for a slot under the cap), for the curious
        self._last_cut = float("-inf")

    def __repr__(self) -> str:
        return f"<Gate in_flight={self.in_flight} limit={self.limit} peak={self.peak} throttled={self.throttled}>"

    def acquire(self, max_wait: float | None = None, waited_until: float | None = None,
                cancel: threading.Event | None = None) -> float | None:
        """Wait out the pause (at most ``max_wait`` seconds of it), then for a free slot under the cap.

        ``waited_until``: until when this caller has already slept (backing off after its own error);
        only a pause that lasts longer is waited for.  Returns the ticket to give :meth:`throttle`, or None, at
        once and holding no slot, when ``cancel`` is set before or during the wait (the job was stopped).
        """
        slept_for: set[float] = set()
        started = self._clock()
        with self._cond:
            self.waiting += 1
        try:
            while True:
                while True:
                    with self._cond:
                        end, now = self._pause_end(started, max_wait, waited_until), self._clock()
                    # one sleep per pause end seen: a pause made longer meanwhile is slept again
                    if end <= now or end in slept_for:
                        break
                    slept_for.add(end)
                    # not under the lock: a 429 elsewhere may extend the pause meanwhile
                    if _wait(cancel, end - now):
                        return None
                with self._cond:
                    while self.limit is not None and self.in_flight >= int(self.limit):
                        if cancel is not None and cancel.is_set():
                            return None
                        # a released call notifies; the timeout guards a missed wake-up and, short, looks at the Stop
                        self._cond.wait(0.5 if cancel is None else STOP_POLL_S)
                    if cancel is not None and cancel.is_set():
                        return None
                    end = self._pause_end(started, max_wait, waited_until)
                    if end > self._clock() and end not in slept_for:
                        # the slot came free with a 429 that paused the gate again: that pause is waited out
                        # first, or every call waiting for a slot would go out at once into it
                        continue
                    self.in_flight += 1
                    self.peak = max(self.peak, self.in_flight)
                    return self._clock()
        finally:
            with self._cond:
                self.waiting -= 1

    def _pause_end(self, started: float, max_wait: float | None, waited_until: float | None) -> float:
        """Until when a caller that began waiting at ``started`` waits out the pause (under the lock)."""
        end = self.paused_until
        if waited_until is not None and end <= waited_until:
            return float("-inf")
        if max_wait is not None:
            end = min(end, started + max_wait)
        return end

    def release(self, *, ok: bool) -> None:
        """A call ended; ``ok``: it was answered, which lets the cap grow (by 1/cap)."""
        with self._cond:
            self.in_flight -= 1
            if ok and self.limit is not None:
                self.limit += 1 / self.limit
                if self.limit >= self.peak:
                    self.limit = None
            self._cond.notify_all()

    def throttle(self, delay: float, ticket: float | None = None, *, heard: bool = False) -> None:
        """A call got a 429: pause every call for ``delay`` seconds and halve the calls in flight.

        Called before :meth:`release` of that call, so the calls in flight still count it.  A call let
        through before the last cut (``ticket``, from :meth:`acquire`) was sent before the gate reacted:
        its 429 only makes the pause longer when it asks for more.  A call sent after it brings the
        server's latest word: its wait replaces the pause, and it halves the cap again.  ``heard``: the 429 came to
        another process of the batch (:func:`throttle_heard`), so the listeners are not told again."""
        with self._cond:
            self.throttled += 1
            end = self._clock() + max(0.0, delay)
            if ticket is None or ticket >= self._last_cut:
                base = int(self.limit) if self.limit is not None else self.in_flight
                self.limit = float(max(1, base // 2))
                self._last_cut = self._clock()
                self.paused_until = end
            else:
                self.paused_until = max(self.paused_until, end)
            self._cond.notify_all()
        if not heard and self.key is not None:
            for listener in list(_listeners):
                listener(self.key, delay)


def _wait(cancel: threading.Event | None, seconds: float) -> bool:
    """Sleep ``seconds``; True, at once, when ``cancel`` is set meanwhile."""
    if cancel is None:
        time.sleep(seconds)
        return False
    return cancel.wait(seconds)


_gates: dict[tuple[str, str], Gate] = {}
_gates_lock = threading.Lock()


def gate_for(endpoint: str | None, model: str) -> Gate:
    """The process's gate of ``endpoint`` (its base URL; None: OpenAI's) and ``model``."""
    key = (endpoint or "https://api.openai.com/v1", model)
    with _gates_lock:
        gate = _gates.get(key)
        if gate is None:
            gate = _gates[key] = Gate(key)
        return gate


_listeners: list[Callable[[tuple[str, str], float], None]] = []


def on_throttle(listener: Callable[[tuple[str, str], float], None]) -> Callable[[], None]:
    """Call ``listener((endpoint, model), delay)`` after each 429 a gate of this process gets (in the calling
    thread); returns the function that stops it."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def throttle_heard(key: tuple[str, str], delay: float) -> None:
    """Apply a 429 another process of the batch got from endpoint+model ``key``: pause this process's calls to it
    for ``delay`` seconds and halve their cap, as its own 429 would."""
    gate_for(key[0], key[1]).throttle(delay, heard=True)


def forget_gates(endpoint: str | None = None) -> None:
    """Forget the gates of ``endpoint`` (every endpoint when None): what a 429 taught about an endpoint is not true
    of another one started later at the same URL (a test server on a port an earlier one had)."""
    with _gates_lock:
        for key in [k for k in _gates if endpoint is None or k[0] == endpoint]:
            del _gates[key]
