"""The live view of a job, shared by the ``%agent`` magic and the panel: run the job in a thread, redraw as it moves on.

A job this kernel runs (``%agent run``/``step``, the panel's Run/Step/Reply) is followed through the in-process
subscription (:meth:`agentnb.execution.Execution.subscribe`, :mod:`agentnb.live`): each committed event of the job wakes the view at once, and nothing polls the
store.  The subscriber only notes the newest event id and sets a flag, in the job's own thread; the redraw (which
reads the store to render) happens in the view's thread, once for however many events arrived meanwhile.

A job another process runs (a worker, another notebook) publishes nothing here: a view of it reads a mark of the
store every few tenths of a second instead (the panel's ``poll``) (:meth:`LiveView.next_change`), as before the subscription existed.

The redraws keep what the user opened or closed in the view (``views.render.KEEPER``) and render only when the job
moved on.  Each redraw of the magic's view carries, as transient display data (never saved in the notebook),
``{"agentnb": {"job": id, "event": newest event id shown, "at": time.time()}}``: what a test measures the latency
between an event's commit and the view's update with.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from .. import live
from ..live import Notice

if TYPE_CHECKING:
    from ..execution import Execution

__all__ = ["LiveView", "display_marks"]


def display_marks(job_id: int, event_id: int) -> dict[str, Any]:
    """The transient display data of a redraw: which job, the newest event id it shows, and when."""
    return {"agentnb": {"job": job_id, "event": event_id, "at": time.time()}}


class LiveView:
    """One run at a time of a job in a thread (:meth:`start`), and the waits of a view that follows it.

    ``follow(job_id)`` subscribes to the job's committed events (a run that submits its job first follows it once
    it exists); :meth:`wait` then returns as soon as one commits or the run ends.  :meth:`close` ends the
    subscription.
    """

    def __init__(self, execution: Execution, *, name: str = "agentnb-job") -> None:
        self.execution = execution  # whose subscription tells the view of a job run here (Execution.subscribe)
        self.name = name
        self.job_id: int | None = None
        self.last_event = 0  # the newest event id of the followed job the subscription delivered
        self.failure: BaseException | None = None
        self.done = threading.Event()
        self.done.set()  # no run yet
        self._changed = threading.Event()
        self._lock = threading.Lock()
        self._sub: live.Subscription | None = None
        self._thread: threading.Thread | None = None
        self._polled: Hashable = _UNREAD  # the store's mark as next_change last read it
        self._started_at = 0  # last_event when the current run began

    # -- the run -------------------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return not self.done.is_set()

    @property
    def started(self) -> bool:
        """Whether the current run's thread exists (an interrupt before it means nothing ran)."""
        return self._thread is not None and self._thread.ident is not None

    def start(self, work: Callable[[], Any], job_id: int | None = None) -> threading.Thread:
        """Run ``work()`` (the job's run or step) in a daemon thread; ``self.failure`` keeps what it raised."""
        if self.running:
            raise RuntimeError("this live view already runs a job")
        if job_id is not None:
            self.follow(job_id)
        # what the view showed when the run began: events the run commits before watch() starts are news too
        self._started_at = self.last_event
        self.failure = None
        self.done.clear()

        def run() -> None:
            try:
                work()
            except BaseException as exc:
                self.failure = exc
            finally:
                self.done.set()
                self._changed.set()

        self._thread = threading.Thread(target=run, name=f"{self.name}-{job_id or 'new'}", daemon=True)
        self._thread.start()
        return self._thread

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # -- following a job -------------------------------------------------------------------------------------------
    def follow(self, job_id: int) -> None:
        """Wake on each event job ``job_id`` commits from now on (it runs in this process)."""
        with self._lock:
            if self.job_id == job_id and self._sub is not None:
                return
            if self._sub is not None:
                self._sub.close()
            self.job_id, self.last_event = job_id, 0
            self._sub = self.execution.subscribe(job_id, self._arrived)
        self._changed.set()

    def _arrived(self, item: live.Item) -> None:
        # in the job's thread, right after its commit: note it, and let the view's thread redraw
        if isinstance(item, Notice):
            return  # nothing the store-rendered view shows yet (a call started, streamed text)
        if item.id is not None and item.id > self.last_event:
            self.last_event = item.id
        self._changed.set()

    def wake(self) -> None:
        """End the current :meth:`wait` (a view closing)."""
        self._changed.set()

    def close(self) -> None:
        with self._lock:
            if self._sub is not None:
                self._sub.close()
                self._sub = None
        self._changed.set()

    def wait(self, timeout: float | None) -> bool:
        """Block until the followed job committed an event or the run ended (True; each wake-up counted once), or
        ``timeout`` seconds passed (False).  Reads nothing from the store."""
        fired = self._changed.wait(timeout)
        if fired:
            self._changed.clear()
        return fired

    def watch(self, redraw: Callable[[int], None]) -> None:
        """Until the run ends: ``redraw(newest event id)`` whenever the followed job moved on, then once more.

        Waits in short slices, so that a Ctrl-C in the notebook's main thread is taken at once.
        """
        seen = self._started_at
        while self.running:
            if self.wait(0.5) and self.last_event != seen:
                seen = self.last_event
                redraw(seen)
        redraw(self.last_event)

    # -- any job: the subscription when it runs here, else the store ------------------------------------------------
    def next_change(self, job_id: int | None, *, interval: float, mark: Callable[[], Hashable]) -> bool:
        """Wait for job ``job_id`` (the one a view shows) to move on; True when it did (or the run ended).

        When this view runs it, its commits wake the wait and nothing is read from the store.  Else (another
        process runs it, or nothing does) ``mark()`` is read from the store after ``interval`` seconds (sooner
        after :meth:`wake`) and compared with the last one read: the polling fallback.
        """
        if self.running and job_id is not None and job_id == self.job_id:
            self._polled = _UNREAD  # polling again after the run reads the store's mark afresh
            return self.wait(interval)
        self.wait(interval)
        now = mark()
        moved, self._polled = now != self._polled, now
        return moved


_UNREAD = object()  # no mark read from the store yet
