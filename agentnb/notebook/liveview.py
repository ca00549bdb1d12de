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

While the running call streams (``delta`` notices, docs/notebook.md#streaming), what it streamed so far is drawn in
an element of its own (``views.streaming``), at most ten times a second, and the job's view is not redrawn for it:
the sections the user opened or closed are left alone.  The recorded call (any event committed) empties it.  Its
draws carry ``"stream"`` (the characters shown) and ``"call"`` ([movement_seq, iteration]) in the same transient data.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from .. import live
from ..live import Notice
from ..models.messages import Delta
from ..views.streaming import StreamedCall

if TYPE_CHECKING:
    from ..execution import Execution

__all__ = ["STREAM_INTERVAL", "LiveView", "Streaming", "display_marks"]

STREAM_INTERVAL = 0.1  # seconds between two draws of the streamed text: at most ten a second


def display_marks(job_id: int, event_id: int, **more: Any) -> dict[str, Any]:
    """The transient display data of a redraw: which job, the newest event id it shows, and when (and ``more``,
    e.g. the streamed characters a draw of the streamed text shows)."""
    return {"agentnb": {"job": job_id, "event": event_id, "at": time.time(), **more}}


class Streaming:
    """What the running call of the followed job streamed so far, gathered in the job's thread (:meth:`add`) and
    taken by the view's thread (:meth:`take`) when it draws.  ``dirty``: something to draw (or to empty)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._call: tuple[int, int | None, int | None] | None = None  # (job, movement_seq, iteration)
        self._text: list[str] = []
        self._tools: dict[int, tuple[str, list[str]]] = {}
        self.shown = False  # the last draw showed something
        self._first: float | None = None  # when the call's first fragment arrived (time.monotonic())
        self._last: float | None = None  # and its latest
        self.dirty = False

    def begin(self, job_id: int, movement_seq: int | None, iteration: int | None) -> None:
        """Call ``iteration`` of run ``movement_seq`` is asked for: what the last call streamed is not its."""
        with self._lock:
            self._call = (job_id, movement_seq, iteration)
            self._text, self._tools, self._first, self._last = [], {}, None, None
            self.dirty = self.shown

    def add(self, job_id: int, movement_seq: int | None, iteration: int | None, delta: Delta) -> bool:
        """Add a fragment; True when it made the stream dirty (the view's thread needs waking)."""
        with self._lock:
            if self._call != (job_id, movement_seq, iteration):
                self._call = (job_id, movement_seq, iteration)
                self._text, self._tools = [], {}
            if delta.restart:  # the stream broke off and the call is asked again: its answer starts afresh
                self._text, self._tools = [], {}
                woke, self.dirty = not self.dirty, True
                return woke
            self._last = time.monotonic()
            if self._first is None:
                self._first = self._last
            if delta.tool_index is None:
                self._text.append(delta.text)
            else:
                name, args = self._tools.setdefault(delta.tool_index, (delta.tool_name or "", []))
                if delta.tool_name and delta.tool_name != name:  # the whole name so far: late, or in pieces
                    self._tools[delta.tool_index] = (delta.tool_name, args)
                args.append(delta.arguments)
            woke, self.dirty = not self.dirty, True
            return woke

    def end(self) -> None:
        """The call is recorded (or the run is over): nothing streams; a shown stream is to be emptied."""
        with self._lock:
            self._call = None
            self._text, self._tools, self._first, self._last = [], {}, None, None
            self.dirty = self.shown

    def take(self) -> StreamedCall | None:
        """What to draw now (None: nothing, empty the element); the stream is clean until the next fragment."""
        with self._lock:
            self.dirty = False
            if self._call is None or not (self._text or self._tools):
                self.shown = False
                return None
            self.shown = True
            tools = tuple((name, "".join(args)) for _, (name, args) in sorted(self._tools.items()))
            return StreamedCall(*self._call, text="".join(self._text), tools=tools)

    @property
    def ending(self) -> bool:
        """Dirty only to be emptied: drawn at once, not throttled."""
        return self.dirty and self._call is None

    def streamed_for(self) -> float:
        """Seconds from the call's first fragment to its latest (0 when fewer than two came): how long it has been
        streaming, which an answer that came in one burst never reaches however late it is recorded."""
        first, last = self._first, self._last
        return 0.0 if first is None or last is None else last - first


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
        self._moved = False  # a commit, the run's end or a wake() since the last wait() that saw one
        self.streaming = Streaming()  # the running call's streamed text (docs/notebook.md#streaming)
        self._streamed_at = 0.0  # when the streamed text was last drawn (time.monotonic())

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
                self.streaming.end()
                self.done.set()
                self._moved = True
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
            if item.what == "delta":
                # the view's thread is woken by the first fragment after a draw only: it draws the rest together
                if self.streaming.add(item.job_id, item.movement_seq, item.iteration, item.detail["delta"]):
                    self._changed.set()
            elif item.what == "call_started":
                self.streaming.begin(item.job_id, item.movement_seq, item.iteration)
            return
        # any event of the job during a call (its llm_response, an error, a retry) ends what streamed
        self.streaming.end()
        if item.id is not None and item.id > self.last_event:
            self.last_event = item.id
        self._moved = True
        self._changed.set()

    def wake(self) -> None:
        """End the current :meth:`wait` (a view closing)."""
        self._moved = True
        self._changed.set()

    def close(self) -> None:
        with self._lock:
            if self._sub is not None:
                self._sub.close()
                self._sub = None
        self._changed.set()

    def wait(self, timeout: float | None) -> bool:
        """Block until the followed job committed an event or the run ended (True; each wake-up counted once), or
        ``timeout`` seconds passed (False).  Reads nothing from the store.

        Streamed text due to be drawn (:meth:`draw_stream`) ends the wait early too, returning False."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            due = self._stream_due()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if due is not None:
                left = due if left is None else min(left, due)
            fired = self._changed.wait(left)
            if fired:
                self._changed.clear()
            if self._moved:
                self._moved = False
                return True
            if self._stream_due() == 0.0 or (deadline is not None and time.monotonic() >= deadline):
                return False

    def _stream_due(self) -> float | None:
        """Seconds until the streamed text may be drawn again (0: now), or None when there is nothing to draw."""
        if not self.streaming.dirty:
            return None
        if self.streaming.ending:
            return 0.0
        if not self.streaming.shown:
            # a call that streams for less than STREAM_INTERVAL (the demo unpaced, a short answer, one that came in
            # one burst and is recorded later) is shown once recorded, as if it had not streamed: no element
            # flashes, and the notebook gets no output for it; until its fragments have come over STREAM_INTERVAL
            # it is looked at again a little later (a fragment does not wake the view while one waits undrawn)
            # (and never sooner than STREAM_INTERVAL after the last draw: the previous call's emptying, say)
            if self.streaming.streamed_for() < STREAM_INTERVAL:
                return STREAM_INTERVAL / 2
            return max(0.0, self._streamed_at + STREAM_INTERVAL - time.monotonic())
        return max(0.0, self._streamed_at + STREAM_INTERVAL - time.monotonic())

    def draw_stream(self, draw: Callable[[StreamedCall | None], None], *, now: bool = False) -> None:
        """``draw(what streamed so far)`` (None: empty the element) when it changed and the last draw was at least
        STREAM_INTERVAL ago (``now``: when it changed at all)."""
        due = self._stream_due()
        if due is None or (due > 0 and not now):
            return
        self._streamed_at = time.monotonic()
        draw(self.streaming.take())

    def watch(self, redraw: Callable[[int], None],
              stream: Callable[[StreamedCall | None], None] | None = None) -> None:
        """Until the run ends: ``redraw(newest event id)`` whenever the followed job moved on, then once more; and
        ``stream(...)`` (:meth:`draw_stream`) as the running call streams, emptied at the end.

        Waits in short slices, so that a Ctrl-C in the notebook's main thread is taken at once.
        """
        seen = self._started_at
        while self.running:
            if self.wait(0.5) and self.last_event != seen:
                seen = self.last_event
                redraw(seen)
            if stream is not None:
                self.draw_stream(stream)
        redraw(self.last_event)
        if stream is not None:
            self.streaming.end()
            self.draw_stream(stream, now=True)

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
