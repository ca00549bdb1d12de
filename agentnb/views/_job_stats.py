"""The numbers of a job's views, read from its folded events (``timeline.py``): :class:`JobStats` (movements, calls, tokens, running and
wall time, cost, the newest context ratio, the open question, errors, scores), which the header of
:func:`agentnb.views.render.job_html`, the panel and the magic show.  ``render`` re-exports ``JobStats`` and
``job_stats``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..events import Event, ScoreEvent
from ..store.base import JobStatus
from .source import JobRecord, JobSource
from .status import display_status
from .timeline import RunningClock, Timeline, fold, is_compaction_error

__all__ = ["JobStats", "RunningClock", "is_compaction_error", "job_stats", "stats_from_events", "stats_from_timeline"]


@dataclass
class JobStats:
    """Numbers about a job read from its events (shared by the header, the panel and the magic)."""

    movements: int = 0
    calls: int = 0
    tool_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # Seconds the job spent running (the sum of its running intervals, from its job_status events), and
    # wall seconds since it was submitted (until it ended, for a job that ended).  Waiting for a human,
    # for subtasks or in the queue between steps counts in ``wall_s`` only.
    running_s: float = 0.0
    wall_s: float = 0.0
    last_seq: int | None = None
    # The latest context accounting of the newest movement run: for a context-usage bar.
    last_ratio: float | None = None
    last_tokens: int | None = None
    window: int | None = None
    actions: list[str] = field(default_factory=list)  # context actions of the newest movement run
    question: str | None = None  # the open ASK question, when the job waits for a human
    errors: list[str] = field(default_factory=list)
    status: str = ""  # the status as shown: ``paused`` for a job stopped part-way (see _status.display_status)
    latest: tuple[int, int] | None = None  # (movement run, LLM call) of the newest call, answered or in flight
    # US dollars of the answered calls, each priced at its own time by the job's model; None when unpriced
    cost_usd: float | None = 0.0
    scores: dict[str, ScoreEvent] = field(default_factory=dict)  # the latest score of each name

    @property
    def elapsed(self) -> float:
        """The running time (``running_s``); kept for callers written before wall time was told apart."""
        return self.running_s


def stats_from_timeline(job: JobRecord, tl: Timeline, now: float | None = None) -> JobStats:
    """The numbers of a job row and its folded events (``now``: the time running intervals still open end at)."""
    t = tl.totals
    now = time.time() if now is None else now
    running = t.running_seconds(now if job.status == JobStatus.running else None)
    if not t.status_events and job.started:  # a store written without job_status events
        running = max(0.0, (job.ended or (now if job.status == JobStatus.running else job.updated)) - job.started)
    return JobStats(
        movements=t.movements, calls=t.calls, tool_calls=t.tool_calls, prompt_tokens=t.prompt_tokens,
        completion_tokens=t.completion_tokens, total_tokens=t.total_tokens, running_s=running,
        wall_s=max(0.0, (job.ended or now) - job.created), last_seq=t.last_seq, last_ratio=t.last_ratio,
        last_tokens=t.last_tokens, window=t.window, actions=list(t.actions),
        question=t.question if job.status == JobStatus.waiting_human else None, errors=list(t.errors),
        status=display_status(job.status, t.status_reason), latest=t.latest, cost_usd=t.cost_usd(job.model),
        scores=dict(t.scores))


def stats_from_events(job: JobRecord, events: Sequence[Event], now: float | None = None) -> JobStats:
    return stats_from_timeline(job, fold(events, runs=False), now)


def job_stats(ws: JobSource, job_id: int) -> JobStats:
    """Movements run, LLM calls, tokens, running and wall seconds and the newest context ratio of a job."""
    return stats_from_events(ws.job(job_id).snapshot(), ws.events(job_id))
