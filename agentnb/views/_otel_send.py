"""The live export's work on the runs that ended (docs/otel.md#live): read each job back, map its spans, post them.

:class:`Sender` is used where the work is done: in the live export's own process (:mod:`._otel_process`), or in
its thread when the store cannot be opened from another process.  It takes the notes the jobs' threads made (a
run or a job ended) and gives back a :class:`Report` — the spans sent, and those dropped per job with why — which
:class:`~agentnb.views.otel_live.LiveExport` adds to its counts and its one warning.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from ..store.base import Store
from ._otel_encode import post
from ._otel_spans import TraceRecord, job_trace

__all__ = ["PAUSE_AFTER_FAILURE", "Note", "Report", "Sender"]

_log = logging.getLogger("agentnb.otel")

PAUSE_AFTER_FAILURE = 10.0  # seconds the spans are dropped untried after a failed request

Note = tuple[str, int, "int | None"]  # ("run", job id, movement seq) or ("job", job id, None)


class Report(NamedTuple):
    """What became of the spans of one request's notes."""
    sent: int
    dropped: tuple[tuple[int, int], ...]  # (job id, spans) not sent
    why: str | None  # why they were not sent, for the one warning; None: dropped untried after a failure


class Sender:
    """Maps and posts the spans of ended runs of ``store``'s jobs to ``url`` (a collector's traces URL; headers from
    the standard variables, read by the OTLP exporter), one request a call of :meth:`export`."""

    def __init__(self, store: Store, url: str, *, content: bool, timeout: float, identity: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        self.store = store
        self.url = url
        self.content = content
        self.identity = identity
        self.exporter = OTLPSpanExporter(endpoint=url, timeout=timeout)
        self.paused_until = 0.0

    def export(self, notes: list[Note]) -> Report:
        per_job: list[tuple[int, int]] = []
        traces: list[TraceRecord] = []
        # a job is read and mapped once per request, however many of its runs (and its end) the notes name
        by_job: dict[int, list[tuple[str, int | None]]] = {}
        for what, job_id, seq in notes:
            by_job.setdefault(job_id, []).append((what, seq))
        for job_id, ended in by_job.items():
            try:
                trace = self.spans_of(job_id, ended)
            except Exception:  # a job deleted meanwhile, a store that went away: never the job's problem
                _log.debug("agentnb: could not map job %s for live export", job_id, exc_info=True)
                continue
            if trace.spans:
                traces.append(trace)
                per_job.append((job_id, len(trace.spans)))
        if not traces:
            return Report(0, (), None)
        if time.monotonic() < self.paused_until:
            return Report(0, tuple(per_job), None)
        try:
            ok = post(self.exporter, traces)
        except Exception:  # the exporter's client says what it knows; anything else is a failure too
            ok = False
        if ok:
            return Report(sum(n for _, n in per_job), (), None)
        self.paused_until = time.monotonic() + PAUSE_AFTER_FAILURE
        return Report(0, tuple(per_job), f"the collector at {self.url} did not take them (unreachable, too slow or "
                                         "it refused them)")

    def spans_of(self, job_id: int, ended: list[tuple[str, int | None]]) -> TraceRecord:
        """The spans of job ``job_id`` that the notes ``ended`` name: each ended run's (``("run", seq)``) with its
        calls and tools; at the job's end (``("job", None)``) its own span and the runs that ended without a
        transition (none of their notes came), with theirs."""
        seqs = {seq for what, seq in ended if what == "run"}
        if all(what == "run" for what, _ in ended):  # only runs ended: their own events are all it takes
            return job_trace(self.store, self.store.job(job_id), content=self.content, identity=self.identity,
                             runs={s for s in seqs if s is not None})
        trace = job_trace(self.store, self.store.job(job_id), content=self.content, identity=self.identity)
        runs = {s.span_id: s for s in trace.spans if s.attributes.get("gen_ai.operation.name") == "invoke_agent"}
        chosen = {i for i, s in runs.items() if s.attributes.get("agentnb.movement_seq") in seqs}
        keep: set[int] = set()
        if any(what == "job" for what, _ in ended):
            keep.add(trace.spans[0].span_id)
            chosen |= {i for i, s in runs.items() if "agentnb.next_step" not in s.attributes}
        return TraceRecord(trace.trace_id, trace.resource, tuple(
            s for s in trace.spans if s.span_id in keep or s.span_id in chosen or s.parent_id in chosen))

    def close(self) -> None:
        self.exporter.shutdown()
