"""Live export: a job's spans sent to a collector as it runs, from a background thread (docs/otel.md#live).

:class:`LiveExport` subscribes to the store's channel in this process (:mod:`agentnb.live`, the door the views
use): in the job's thread it only notes what ended — a movement run (its ``transition`` event) or the job (a
terminal ``job_status``) — in a bounded queue.  Its own daemon thread hands them, several at a time, to the export's process
(:mod:`._otel_process`), which reads the job back from the store, maps it (:func:`agentnb.views._otel_spans.job_trace`:
the ids a file export gives) and posts the spans with the OTLP/HTTP exporter, one request for the notes handed
together (:mod:`._otel_send`); a store that cannot be opened from another process is exported so by the thread
itself.  A run's spans are its ``invoke_agent`` span with its ``chat`` and
``execute_tool`` spans; the job's ``invoke_workflow`` span goes when the job ends, with any run that ended
without a transition (a failed one).  A child span may reach the collector before its parent: OTLP allows it.
A job that waits (for a human, for its subtasks) sends its own span only when it ends, never at the wait: each
span goes once, whole, since a viewer may keep the first copy of a span id for good (Phoenix does;
docs/otel.md#a-job-that-waits).  With ``content`` the spans carry the messages, scrubbed and cut by the same
mapping as a file export's.

A collector that cannot be reached, is slow or refuses the spans never holds a job up: the queue is bounded, each
request has a short timeout, and after a failure the spans of the next seconds are dropped without trying.  Spans
not sent are counted (:attr:`LiveExport.dropped`, per job :func:`dropped_spans`, shown in the job view) and the
first failure is one warning on the ``agentnb.otel`` logger.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Mapping

from .. import live
from .._secrets import secret_values
from ..errors import UsageError
from ..events import JobStatusEvent, Transition
from ..store.base import TERMINAL_STATES, Store
from ._otel_process import ExporterProcess, file_id
from ._otel_send import Note, Report, Sender
from ._otel_spans import store_identity
from .otel import INSTALL_HINT, check_headers, traces_url

__all__ = ["LiveExport", "dropped_spans", "live_content", "live_endpoint"]

_log = logging.getLogger("agentnb.otel")
_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
QUEUE_SIZE = 10_000   # notes (a run or a job ended), not spans: a few bytes each
BATCH = 64            # notes read from the queue per request at most
LINGER = 0.5          # seconds the exporter gathers notes after the first before it maps and sends them

# (channel, job id) → spans of that job not exported, for the job view of any workspace on that store
_DROPPED: dict[tuple[str, int], int] = {}
_DROPPED_LOCK = threading.Lock()


def dropped_spans(store: Store, job_id: int) -> int:
    """How many spans of job ``job_id`` live export dropped in this process (0 without live export)."""
    return _DROPPED.get((live.channel(store), job_id), 0) if _DROPPED else 0


_OFF = ("", "0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def live_endpoint(value: str | bool | None, environ: Mapping[str, str]) -> str | None:
    """The URL a workspace posts its spans to live, or None (docs/otel.md#live): ``value`` is ``Workspace(otel=)``
    (a collector's base URL: its ``/v1/traces``; True: the standard variables, :func:`traces_url`; False: off),
    None reads ``AGENTNB_OTEL`` (a URL, or 1 for the standard variables; unset, empty or 0: off)."""
    where = "otel"
    if value is None:
        value, where = environ.get("AGENTNB_OTEL", ""), "AGENTNB_OTEL"
    if isinstance(value, str) and value.strip().lower() in _OFF + _ON:
        value = value.strip().lower() in _ON
    elif type(value) is int and value in (0, 1):  # as the message below allows it
        value = bool(value)
    if value is False:
        return None
    if value is True:
        url = traces_url(None, environ)
        if url is None:
            raise UsageError(f"{where} asks for the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
                             "OTEL_EXPORTER_OTLP_ENDPOINT, and neither is set: set one (e.g. "
                             "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318) or give the collector's URL")
        return url
    if not isinstance(value, str) or not value.lower().startswith(("http://", "https://")):
        raise UsageError(f"{where}={value!r}: allowed: an http:// or https:// collector URL (e.g. "
                         "http://127.0.0.1:4318), 1/True for the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
                         "OTEL_EXPORTER_OTLP_ENDPOINT, or 0/False")
    return traces_url(value, environ)


def live_content(value: bool | None, environ: Mapping[str, str]) -> bool:
    """Whether live export sends content (docs/otel.md#live-content): ``Workspace(otel_content=)``, None reads
    ``AGENTNB_OTEL_CONTENT`` (1 or 0; unset or empty: off)."""
    if value is None:
        text = environ.get("AGENTNB_OTEL_CONTENT", "").strip().lower()
        if text not in _OFF + _ON:
            raise UsageError(f"AGENTNB_OTEL_CONTENT={text!r}; allowed: 1 (or true, yes, on: send messages, tool "
                             "arguments and results, scrubbed) or 0 (or false, no, off; the default)")
        return text in _ON
    if not isinstance(value, bool):
        raise UsageError(f"otel_content={value!r}: allowed: True, False or None (the environment's "
                         "AGENTNB_OTEL_CONTENT)")
    return value


KILL_MARGIN = 0.15  # seconds before close()'s deadline that an export process still working is killed
SETTLE = 0.25  # seconds close() gives the thread, past its deadline, to count what was not sent


IDLE_CHECK = 1.0  # seconds between the waiting thread's looks at whether its export was garbage-collected
# seconds a collected export's process is given to send what it has and end before it is killed (one that stopped
# reading, SIGSTOPped or stuck, would else be left behind, stopped, for the life of the workspace's process)
COLLECTED_WAIT = 3.0


def _work(ref: weakref.ReferenceType[LiveExport], notes_queue: queue.Queue[tuple[LiveExport, Note] | None],
          subscription: live.Subscription, processes: list[ExporterProcess]) -> None:
    """The exporter thread: gathers the notes of a moment and delivers them.  Each queued note holds its export, so
    a workspace dropped unclosed is collected only once every note it made is delivered; waiting, the thread holds
    it weakly, and once it is gone it ends its subscription and its process (the process after reporting on what it
    has).  That is done here, not in a finalizer: a finalizer runs inside whatever allocation set the garbage
    collector off, maybe under the very lock unsubscribing takes."""
    while True:
        try:
            item = notes_queue.get(timeout=IDLE_CHECK)
        except queue.Empty:
            idle = ref()
            if idle is None:
                subscription.close()
                for process in processes:
                    process.close_input()
                deadline = time.monotonic() + COLLECTED_WAIT
                for process in processes:
                    process.finish(deadline)
                return
            idle._take_over()
            idle = None
            continue
        export = item[0] if item is not None else ref()
        if export is None:  # close()'s end marker, or nothing: the export is gone
            return
        notes = [] if item is None else [item[1]]
        stop = item is None
        # linger a moment: a run's note and its job's end note come moments apart, and the runs of a batch end
        # together, so each job is read and mapped once and several go in one request
        deadline = time.monotonic() + LINGER
        more: tuple[LiveExport, Note] | None = None
        while not stop and len(notes) < BATCH:
            try:
                more = notes_queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if more is None:
                stop = True
            else:
                notes.append(more[1])
        export._deliver(notes)
        if stop:
            export._stop()
            return
        export = item = more = None  # waiting, hold nothing of it


class _Quiet(logging.Filter):
    """Silence the exporter's own per-request warnings in the exporter threads: one warning of ours says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not threading.current_thread().name.startswith("agentnb-otel")


_QUIET = _Quiet()


class LiveExport:
    """Sends the spans of the jobs this process runs on ``store`` to ``url`` (the collector's traces URL, e.g.
    ``http://127.0.0.1:4318/v1/traces``; headers from ``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, else
    ``OTEL_EXPORTER_OTLP_HEADERS``) as their movement runs end; with ``content`` their messages, tool arguments
    and results, scrubbed and cut as a file export's (docs/otel.md#content).  With ``reopen`` (the store's file
    or URL, as :func:`~agentnb.store.open_store` takes it) the spans are read, mapped and posted by a process of
    their own; without, by a thread of this process."""

    def __init__(self, store: Store, url: str, *, content: bool = False, timeout: float = 2.0,
                 queue_size: int = QUEUE_SIZE, reopen: str | None = None) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: F401
        except ImportError:
            raise UsageError(INSTALL_HINT) from None
        check_headers(os.environ)
        self.store = store
        self.url = url
        self.content = content
        self.timeout = timeout
        self.sent = 0
        self.dropped = 0
        self.failures = 0
        self._queue: queue.Queue[tuple[LiveExport, Note] | None] = queue.Queue(queue_size)
        self._identity = store_identity(store)
        self._channel = live.channel(store)
        self._warned = False
        self._lock = threading.Lock()
        self._closed = False
        self._deadline = 0.0  # when close() stops waiting
        self._abandoned = False  # close() stopped waiting for the thread: what is left is counted, not sent
        self._sender: Sender | None = None  # the work done here: without a process, or after it ended
        self._process: ExporterProcess | None = None
        self._secrets: tuple[str, ...] | None = None  # the secrets the process was last told of
        # the process starts when the first run ends (its 0.3 s of start-up then overlaps no job's first calls:
        # benchmarks/README.md), with this moment's environment (the collector's headers checked above)
        self._reopen = reopen
        self._file = file_id(store)
        self._environ = dict(os.environ)
        logging.getLogger(_EXPORTER_LOGGER).addFilter(_QUIET)
        # only these kinds: the stores then decode and publish only the commits that hold one (live.py); only this
        # store object's, so that two workspaces on one store each export what they run, once.  The subscription,
        # the threads and the process hold this object weakly: a workspace dropped unclosed (a notebook's
        # `ws = Workspace(…)` run again) is collected with its export, which then stops (_work).
        ref = weakref.ref(self)

        def note(item: live.Item) -> None:
            export = ref()
            if export is not None:
                export._note(item)

        self._ref = ref
        self._procs: list[ExporterProcess] = []
        self._subscription = live.subscribe(store, None, note, kinds=("transition", "job_status"), own=True)
        # started now, waiting: a thread started at the first note would be started inside a job's last commit
        # (a daemon: a collector that hangs never keeps the process alive; close() waits, boundedly)
        self._thread = threading.Thread(target=_work, args=(ref, self._queue, self._subscription, self._procs),
                                        name=f"agentnb-otel-{id(self):x}", daemon=True)
        self._thread.start()

    @property
    def process_cpu(self) -> float | None:
        """The CPU seconds of the export's own process, once it has ended (:meth:`close`); None without one."""
        return self._procs[0].cpu if self._procs else None

    def _start_process(self) -> None:
        assert self._reopen is not None
        ref = self._ref

        def count(report: Report) -> None:
            export = ref()
            if export is not None:
                export._count(report)

        try:
            self._process = ExporterProcess(
                self._reopen, self.url, content=self.content, timeout=self.timeout, identity=self._identity,
                environ=self._environ, on_report=count, file=self._file)
            self._procs.append(self._process)
        except OSError as exc:  # no process to be had (a limit on processes): the work is done here
            _log.warning("agentnb: the live OpenTelemetry export could not start its process (%s); its spans are "
                         "exported from this process", exc)

    def _new_sender(self) -> Sender:
        return Sender(self.store, self.url, content=self.content, timeout=self.timeout, identity=self._identity)

    # -- in the job's thread: note, never wait -------------------------------------------------------------
    def _note(self, item: live.Item) -> None:
        if isinstance(item, Transition) and item.movement_seq is not None:
            self._put(("run", item.job_id, item.movement_seq))
        elif isinstance(item, JobStatusEvent) and item.status in TERMINAL_STATES:
            self._put(("job", item.job_id, None))

    def _put(self, note: Note) -> None:
        try:
            self._queue.put_nowait((self, note))
        except queue.Full:  # the exporter cannot keep up: the run's spans are lost, counted as one
            self._drop(note[1], 1, "the export queue was full")

    # -- the exporter thread (_work) -----------------------------------------------------------------------
    def _stop(self) -> None:
        """The end of the exporter thread: the process (if any) reports on what it took, or is killed just before
        close()'s deadline (a collector or a process that hangs); what it took and did not report on is exported
        here if it ended before it was told to, and counted as dropped if it had to be killed."""
        process = self._process
        if process is None:
            return
        ended = process.finish(self._deadline - 2 * KILL_MARGIN)  # close() waits for this thread until one margin
        left = process.take_unacked()
        if not left:
            return
        if ended:
            self._left_by(process, left)
        else:
            self._lost(left)

    def _deliver(self, notes: list[Note]) -> None:
        if self._abandoned or (self._closed and time.monotonic() >= self._deadline):  # close() gave up waiting
            self._lost(notes)
            return
        if self._reopen is not None and not self._procs and notes:
            self._start_process()
            if self._process is None:
                self._reopen = None
        process = self._process
        if process is not None and notes:
            secrets = secret_values()
            if process.send(notes, None if secrets is self._secrets else secrets):
                self._secrets = secrets
                return
            self._ended_by_itself(process)
            return
        if notes:
            if self._sender is None:
                self._sender = self._new_sender()
            self._count(self._sender.export(notes))

    def _take_over(self) -> None:
        """While idle: a process that ended by itself (its store gone, killed) leaves what it held to this one now,
        not at the next run's end."""
        process = self._process
        if process is not None and not process.alive:
            self._ended_by_itself(process)

    def _ended_by_itself(self, process: ExporterProcess) -> None:
        """The export's process ended (or stopped reading) before it was told to: given a second to finish, then what
        it did not report on is exported here (:meth:`_left_by`)."""
        process.finish(time.monotonic() + 1.0)
        self._left_by(process, process.take_unacked())

    def _left_by(self, process: ExporterProcess, notes: list[Note]) -> None:
        """The export's process ended before it was told to: what it did not report on (``notes``) is exported
        here, and all that comes after it."""
        self._process = None
        if self._abandoned:  # close() ended it, having stopped waiting: what it held is counted, not sent
            self._lost(notes)
            return
        _log.warning("agentnb: the live OpenTelemetry export's process ended (%s); its spans are now exported from "
                     "this process", process.why_gone())
        self._deliver(notes)

    def _lost(self, notes: list[Note]) -> None:
        """Notes whose spans will not be sent (the workspace closed first): counted, one span each at least."""
        for _, job_id, _ in notes:
            self._drop(job_id, 1, "the workspace closed before they were exported (a collector or an export process "
                                  "that did not answer)")

    def _count(self, report: Report) -> None:
        with self._lock:
            self.sent += report.sent
            if report.why is not None:
                self.failures += 1
        for job_id, n in report.dropped:
            self._drop(job_id, n, report.why)

    def _drop(self, job_id: int, n: int, why: str | None) -> None:
        with _DROPPED_LOCK:
            self.dropped += n
            key = (self._channel, job_id)
            _DROPPED[key] = _DROPPED.get(key, 0) + n
        if why is not None and not self._warned:
            self._warned = True
            _log.warning("agentnb: live OpenTelemetry export: spans dropped, %s; jobs go on, the spans not sent are "
                         "counted (ws.otel_dropped, the job view)", why)

    # -- the end -------------------------------------------------------------------------------------------
    def close(self, wait: float | None = None) -> None:
        """Stop noting, send what is queued within ``wait`` seconds (default: the request timeout and a second),
        then stop the thread (and the export's process); what is still queued then is not sent."""
        if self._closed:
            return
        self._deadline = time.monotonic() + (self.timeout + 1.0 if wait is None else wait)
        self._closed = True
        self._subscription.close()
        thread = self._thread
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=max(0.0, self._deadline - KILL_MARGIN - time.monotonic()))
        thread.join(max(0.0, self._deadline - KILL_MARGIN - time.monotonic()))
        if thread.is_alive():
            # stuck: writing to a process that stopped reading (its pipe full), or exporting here to a collector
            # that does not answer; what is left is counted as dropped, by the thread, before the deadline
            self._abandoned = True
            process = self._process
            if process is not None:
                process.kill()  # the write fails at once
            # counting what is left takes the thread milliseconds: waited for even when close(wait=0) waits no more
            thread.join(max(SETTLE, self._deadline - time.monotonic()))
        if self._sender is not None:
            self._sender.close()
