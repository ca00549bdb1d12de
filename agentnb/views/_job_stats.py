"""The numbers of a job's views, read from its events: :class:`JobStats` (movements, calls, tokens, running and
wall time, cost, the newest context ratio, the open question, errors, scores), which the header of
:func:`agentnb.views.render.job_html`, the panel and the magic show.  ``render`` re-exports ``JobStats`` and
``job_stats``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..events import (
    CommentEvent,
    Compaction,
    ContextAction,
    ErrorEvent,
    Event,
    JobStatusEvent,
    LLMRequest,
    LLMResponse,
    MovementStart,
    ScoreEvent,
    ToolCallEvent,
    Transition,
)
from ..models.prices import call_costs
from ..store.base import is_recovery
from .source import JobRecord, JobSource
from .status import display_status

__all__ = ["JobStats", "RunningClock", "is_compaction_error", "job_stats", "stats_from_events"]


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


class RunningClock:
    """The seconds a job ran, from its events in order: the intervals from each ``running`` job_status to the
    job's next job_status.  An interval a recovery ended (``recovered: …``: its holder was killed, froze or was
    cut off) ends at that holder's last event instead: the job only looked ``running`` until its lease ran out
    or a claim found its process gone, and nobody ran it then.  The views (a job's header, a batch's
    ``seconds``) all count with this one clock."""

    def __init__(self) -> None:
        self.total = 0.0
        self.since: float | None = None  # the start of the open running interval
        self._last = 0.0  # the latest event of the open interval's holder

    def see(self, ev: Event) -> None:
        if isinstance(ev, JobStatusEvent):
            if self.since is not None:
                end = min(self._last, ev.ts) if is_recovery(ev.reason) else ev.ts
                self.total += max(0.0, end - self.since)
            self.since = ev.ts if ev.status == "running" else None
            self._last = ev.ts
        elif self.since is not None and not isinstance(ev, CommentEvent | ScoreEvent):  # not the holder's own
            self._last = max(self._last, ev.ts)

    def seconds(self, now: float | None = None) -> float:
        """The total; an interval still open counts up to ``now`` when it is given."""
        if self.since is None or now is None:
            return self.total
        return self.total + max(0.0, now - self.since)


def stats_from_events(job: JobRecord, events: Sequence[Event], now: float | None = None) -> JobStats:
    st = JobStats()
    reason: str | None = None
    calls: tuple[list[int], list[int], list[float | None]] = ([], [], [])
    now = time.time() if now is None else now
    clock = RunningClock()
    status_events = False
    for ev in events:
        clock.see(ev)
        match ev:
            case JobStatusEvent():
                status_events = True
                reason = ev.reason
            case MovementStart():
                st.movements += 1
                st.last_seq = ev.movement_seq
                st.last_ratio = st.last_tokens = None
                st.actions = []
            case LLMRequest(movement_seq=int(seq), iteration=int(it)):
                st.latest = (seq, it)  # a call in flight is the latest one
            case LLMResponse(usage=u):
                st.calls += 1
                st.prompt_tokens += u.prompt_tokens
                st.completion_tokens += u.completion_tokens
                st.total_tokens += u.total_tokens
                calls[0].append(u.prompt_tokens)
                calls[1].append(u.completion_tokens)
                calls[2].append(ev.ts)
                if ev.movement_seq == st.last_seq:
                    st.last_ratio = u.ratio
                    st.last_tokens = u.prompt_tokens
                    st.window = u.window or st.window
            case Compaction() if ev.movement_seq == st.last_seq:
                # the summarisation call's ratio is its request's; the context goes on from the compacted list
                st.last_tokens = ev.tokens_after
                st.last_ratio = ev.tokens_after / st.window if st.window else st.last_ratio
                st.actions = []  # the ContextManager re-armed
            case ToolCallEvent():
                st.tool_calls += 1
            case ContextAction() if ev.movement_seq == st.last_seq:
                st.actions.append(ev.action)
            case Transition(question=str(question)) if question:
                st.question = question
            case ErrorEvent() if not is_compaction_error(ev):  # a failed compaction is a warning, not an error
                st.errors.append(ev.message)
            case ScoreEvent():
                st.scores[ev.name] = ev
    costs = call_costs(job.model, *calls)
    st.cost_usd = None if None in costs else sum(c for c in costs if c is not None)
    st.status = display_status(job.status, reason)
    if job.status != "waiting_human":
        st.question = None
    st.running_s = clock.seconds(now if job.status == "running" else None)
    if not status_events and job.started:  # a store written without job_status events
        st.running_s = max(0.0, (job.ended or (now if job.status == "running" else job.updated)) - job.started)
    st.wall_s = max(0.0, (job.ended or now) - job.created)
    return st


def job_stats(ws: JobSource, job_id: int) -> JobStats:
    """Movements run, LLM calls, tokens, running and wall seconds and the newest context ratio of a job."""
    return stats_from_events(ws.job(job_id).snapshot(), ws.events(job_id))


def is_compaction_error(ev: ErrorEvent) -> bool:
    """A summarisation call that failed (docs/context.md#compaction): the movement went on uncompacted; no failure."""
    return ev.where == "compaction"
