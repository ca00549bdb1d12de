"""A job's events folded once into one typed view model: the :class:`Timeline` every view renders.

A job → its movement runs (:class:`MovementRun`, by ``seq``) → each run's calls (:class:`Call`: the events of
one LLM call, ``iteration``, in the order they happened, each tool call paired with its result as a
:class:`ToolUse`), with the run's context actions, compactions, loop detections, divergences, errors and
transition gathered on the run, the job-level comments and errors placed between the runs in the order they
happened, and the job's numbers (:class:`Totals`: calls, tokens, the newest context ratio, the open question,
scores, the running time from its status intervals).  The HTML view (``render.py``), the text and notebook
transcript (``transcript.py``), the numbers of the header, panel and magic (``_job_stats.py``), the comparison
(``compare.py``), the batch totals and the CLI read this, never the events themselves.

A new event kind needs ``events.py`` only to show: the fold hands any kind not in :data:`VIEWED_KINDS` to
every view as a :class:`Note` (its kind in words and its payload as text), in its call (or between the runs
when it belongs to no run), which the HTML view and the transcript show and the comparison leaves out of the
conversation.  A kind that needs a view of its own is named in :data:`VIEWED_KINDS` (and, when it adds to a
run or the job's numbers, in ``_RUN_FACTS``/``_JOB_FACTS``) and taught to that one view: three modules.

The fold is incremental: :class:`Fold` takes events as they come (``fold.add(store.events(job,
after_id=fold.last_id))``) and hands out frozen snapshots, re-building only the runs and calls that changed,
so a live view appends what is new instead of reading the job again.

A call is what the job view has always shown as one: consecutive events of a run with the same
``iteration`` (the ``movement_start`` aside), so a run's events read the same way in every view.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields

from ..events import (
    CommentEvent,
    Compaction,
    ContextAction,
    ErrorEvent,
    Event,
    EventBase,
    JobStatusEvent,
    Lesson,
    LLMRequest,
    LLMResponse,
    LoopDetected,
    MovementStart,
    Reminder,
    ReplayDivergence,
    ScoreEvent,
    ToolCallEvent,
    ToolResult,
    Transition,
)
from ..models.prices import call_costs
from ..store.base import JobStatus, is_recovery

__all__ = ["VIEWED_KINDS", "Call", "Fold", "MovementRun", "Note", "RunningClock", "Timeline", "ToolUse", "Totals",
           "fold", "is_compaction_error", "is_interruption", "note", "tool_label"]

# The kinds the views know, each shown in its own way or on purpose not at all (a request is its response's
# call, a lesson is its transition's, a job_status is the header's); the fold turns any other kind into a Note.
# Named here, not read from events.Event: a kind added there is then a Note until a view learns it.
VIEWED_KINDS: frozenset[type] = frozenset({
    JobStatusEvent, MovementStart, LLMRequest, LLMResponse, ToolCallEvent, ToolResult, ContextAction, Reminder,
    Transition, Lesson, CommentEvent, ErrorEvent, ScoreEvent, ReplayDivergence, LoopDetected, Compaction,
})
_BASE_FIELDS = frozenset(f.name for f in fields(EventBase))


def is_compaction_error(ev: ErrorEvent) -> bool:
    """A summarisation call that failed (docs/context.md#compaction): the movement went on uncompacted; no failure."""
    return ev.where == "compaction"


# -- the frozen model ------------------------------------------------------------------------------------


def tool_label(tool: str, server: str | None) -> str:
    """``git_log · git``: a tool's name with the MCP server that offers it (docs/tools.md#mcp-tools); a built-in
    or Python tool's name alone."""
    return f"{tool} · {server}" if server else tool


@dataclass(frozen=True, slots=True)
class ToolUse:
    """A tool call and its result (either None: a call still running or stopped before its result; a result
    whose call is in another call group), at the place of the call (else of the result)."""

    call: ToolCallEvent | None
    result: ToolResult | None

    @property
    def tool(self) -> str:
        return self.call.tool if self.call is not None else self.result.tool  # type: ignore[union-attr]

    @property
    def label(self) -> str:
        """The tool's name as the text views show it: with its MCP server beside it (:func:`tool_label`)."""
        return tool_label(self.tool, self.server)

    @property
    def server(self) -> str | None:
        """The MCP server whose tool this is (docs/tools.md#mcp-tools); None for a built-in or Python tool."""
        return self.call.server if self.call is not None else self.result.server  # type: ignore[union-attr]

    @property
    def call_id(self) -> str:
        return self.call.call_id if self.call is not None else self.result.call_id  # type: ignore[union-attr]

    @property
    def iteration(self) -> int | None:
        return self.call.iteration if self.call is not None else self.result.iteration  # type: ignore[union-attr]


@dataclass(frozen=True, slots=True)
class Note:
    """An event of a kind no view knows (not in :data:`VIEWED_KINDS`), as every view shows it: ``label`` its
    kind in words, ``text`` its payload fields as ``name: value`` lines (strings as they are, other values as
    JSON); ``event`` the event itself."""

    event: EventBase
    label: str
    text: str


def note(ev: EventBase) -> Note:
    """The :class:`Note` of event ``ev`` (of any kind: read from its dataclass fields, so a kind defined
    outside ``events.py`` shows too)."""
    lines = []
    for f in fields(ev):
        if f.name not in _BASE_FIELDS:
            value = getattr(ev, f.name)
            shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
            lines.append(f"{f.name}: {shown}")
    return Note(ev, ev.kind.replace("_", " "), "\n".join(lines))


# what a call holds, in order: its events, tool calls and results paired, the notes of kinds no view knows
CallItem = Event | ToolUse | Note


@dataclass(frozen=True, slots=True)
class Call:
    """One LLM call of a run: ``items`` in the order they happened (request, response, context actions, tool
    uses, reminders, a compaction, the transition, errors…)."""

    iteration: int | None
    items: tuple[CallItem, ...]
    answered: bool  # an llm_response is among the items
    summarising: bool  # a compaction's summarisation call (its request's or response's purpose)
    tokens: int  # the responses' total tokens
    tools: tuple[str, ...]  # the tools called, in order


@dataclass(frozen=True, slots=True)
class MovementRun:
    """Movement run ``seq``: its start (None when never recorded), its calls, and what the views say of it."""

    seq: int
    start: MovementStart | None
    calls: tuple[Call, ...]
    transition: Transition | None  # the last one
    llm_calls: int
    tokens: int
    max_ratio: float | None  # the highest context ratio of its calls
    summarisations: int  # compaction summarisation calls among llm_calls
    actions: tuple[ContextAction, ...]
    errors: tuple[ErrorEvent, ...]  # failures (a failed compaction is not one)
    compaction_errors: tuple[ErrorEvent, ...]
    compactions: tuple[Compaction, ...]
    divergences: tuple[ReplayDivergence, ...]
    loops: tuple[LoopDetected, ...]

    @property
    def name(self) -> str:
        return self.start.movement if self.start is not None else "?"

    @property
    def replayed_from(self) -> int | None:
        return self.start.replayed_from if self.start is not None else None

    def compaction_number(self, iteration: int | None) -> int:
        """The number (1, 2, …) of the run's compaction made at call ``iteration``."""
        numbers = {int(e.iteration or 0): k for k, e in enumerate(self.compactions, start=1)}
        return numbers.get(iteration or 0, 1)


@dataclass(frozen=True, slots=True)
class Totals:
    """A job's numbers, folded with its runs (the header, the panel, the magic and the batch read them)."""

    movements: int = 0
    calls: int = 0
    tool_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    usage: tuple[tuple[int, int, float], ...] = ()  # each answered call's (prompt, completion, ts), to price it
    last_seq: int | None = None  # the newest run started
    last_ratio: float | None = None  # the newest run's latest context accounting
    last_tokens: int | None = None
    window: int | None = None
    actions: tuple[str, ...] = ()  # the newest run's context actions since its last compaction
    latest: tuple[int, int] | None = None  # (run, call) of the newest call, answered or in flight
    question: str | None = None  # the latest question asked (open or not)
    errors: tuple[str, ...] = ()  # failures, job-level and in runs
    scores: Mapping[str, ScoreEvent] = field(default_factory=dict)  # the latest score of each name
    # an LLM judge's calls (purpose "judge", docs/design-lab.md#llm-judge): spent on scoring the job, not by it, so
    # they count in none of the numbers above
    judge_calls: tuple[LLMResponse, ...] = ()
    reserved: Mapping[int, int] = field(default_factory=dict)  # run → the job it was re-served from (a fork's)
    status_reason: str | None = None  # the last job_status event's reason
    status_events: bool = False  # a store written before job_status events has none
    recovered: bool = False  # a job_status event says a holder was gone (the clock then reads every event)
    running_s: float = 0.0  # the closed running intervals
    running_since: float | None = None  # the start of the open one

    def cost_usd(self, model: str) -> float | None:
        """US dollars of the answered calls, each priced at its own time by ``model``; None when one is unpriced."""
        costs = call_costs(model, [u[0] for u in self.usage], [u[1] for u in self.usage], [u[2] for u in self.usage])
        return None if None in costs else sum(c for c in costs if c is not None)

    def judge_cost_usd(self, model: str) -> float | None:
        """US dollars of the judge calls, each priced by the judge's own model (``model``, the job's, for a call that
        does not name one); None when one is unpriced."""
        costs = [call_costs(ev.model or model, [ev.usage.prompt_tokens], [ev.usage.completion_tokens], [ev.ts])[0]
                 for ev in self.judge_calls]
        return None if None in costs else sum(c for c in costs if c is not None)

    def running_seconds(self, now: float | None = None) -> float:
        """The seconds the job ran; an interval still open counts up to ``now`` when it is given."""
        if self.running_since is None or now is None:
            return self.running_s
        return self.running_s + max(0.0, now - self.running_since)


@dataclass(frozen=True, slots=True)
class Timeline:
    """A job's events as the views read them (see the module docstring)."""

    entries: tuple[MovementRun | CommentEvent | ErrorEvent | Note, ...]  # runs and job-level events, in order
    runs: Mapping[int, MovementRun]  # by seq, in the order they first appeared
    asked: frozenset[str]  # the questions the agent asked in transitions (also stored as its comments)
    totals: Totals
    last_id: int  # the newest event folded (0: none)

    def run(self, seq: int) -> MovementRun | None:
        return self.runs.get(seq)

    def reserved_runs(self) -> dict[int, int]:
        """Movement run → the job it was re-served from (a fork's or a ``replay:`` job's runs)."""
        return dict(self.totals.reserved)


# -- folding ---------------------------------------------------------------------------------------------


class RunningClock:
    """The seconds a job ran, from its events in order: the intervals from each ``running`` job_status to the
    job's next job_status.  An interval a recovery ended (``recovered: …``: its holder was killed, froze or was
    cut off) ends at that holder's last event instead: the job only looked ``running`` until its lease ran out
    or a claim found its process gone, and nobody ran it then.  Every view counts with this one clock."""

    def __init__(self) -> None:
        self.total = 0.0
        self.since: float | None = None  # the start of the open running interval
        self._last = 0.0  # the latest event of the open interval's holder

    def see(self, ev: Event) -> None:
        kind = type(ev)
        if kind is JobStatusEvent:
            assert isinstance(ev, JobStatusEvent)  # for the type checker: the kind is exact
            if self.since is not None:
                end = min(self._last, ev.ts) if is_recovery(ev.reason) else ev.ts
                self.total += max(0.0, end - self.since)
            self.since = ev.ts if ev.status == JobStatus.running else None
            self._last = ev.ts
        elif self.since is not None and kind is not CommentEvent and kind is not ScoreEvent:  # not the holder's own
            self._last = max(self._last, ev.ts)

    def seconds(self, now: float | None = None) -> float:
        """The total; an interval still open counts up to ``now`` when it is given."""
        if self.since is None or now is None:
            return self.total
        return self.total + max(0.0, now - self.since)


class _CallParts:
    """A call being folded; frozen into a :class:`Call` when a snapshot is taken."""

    def __init__(self, iteration: int | None) -> None:
        self.iteration = iteration
        self.items: list[CallItem] = []
        self.open: dict[str, int] = {}  # call id → the index of its ToolUse, until its result comes
        self.tools: list[str] = []
        self.answered = self.summarising = False
        self.tokens = 0
        self.frozen: Call | None = None

    def add(self, ev: Event) -> None:
        # exact types, not isinstance: the fold sees every event of a job each time a view is drawn
        self.frozen = None
        kind = type(ev)
        if kind is ToolCallEvent:
            self.open[ev.call_id] = len(self.items)  # type: ignore[union-attr]
            self.items.append(ToolUse(ev, None))  # type: ignore[arg-type]
            self.tools.append(ev.tool)  # type: ignore[union-attr]
            return
        if kind is ToolResult:
            at = self.open.pop(ev.call_id, None)  # type: ignore[union-attr]
            if at is None:
                self.items.append(ToolUse(None, ev))  # type: ignore[arg-type]
            else:
                self._answer(at, ev)  # type: ignore[arg-type]
            return
        if kind is LLMResponse:
            self.answered = True
            self.tokens += ev.usage.total_tokens  # type: ignore[union-attr]
        if (kind is LLMResponse or kind is LLMRequest) and ev.purpose == "compaction":  # type: ignore[union-attr]
            self.summarising = True
        self.items.append(ev if kind in VIEWED_KINDS else note(ev))

    def _answer(self, at: int, result: ToolResult) -> None:
        use = self.items[at]
        assert isinstance(use, ToolUse)
        self.items[at] = ToolUse(use.call, result)

    def freeze(self) -> Call:
        if self.frozen is None:
            self.frozen = Call(iteration=self.iteration, items=tuple(self.items), answered=self.answered,
                               summarising=self.summarising, tokens=self.tokens, tools=tuple(self.tools))
        return self.frozen


class _RunParts:
    """A movement run being folded."""

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.start: MovementStart | None = None
        self.calls: list[_CallParts] = []
        self.transition: Transition | None = None
        self.llm_calls = self.tokens = self.summarisations = 0
        self.max_ratio: float | None = None
        self.lists: dict[type, list[Event]] = {ContextAction: [], ErrorEvent: [], Compaction: [],
                                               ReplayDivergence: [], LoopDetected: []}
        self.compaction_errors: list[ErrorEvent] = []
        self.frozen: MovementRun | None = None

    def add(self, ev: Event) -> None:
        self.frozen = None
        kind = type(ev)
        if kind is MovementStart:
            self.start = self.start or ev  # type: ignore[assignment]
            return
        calls = self.calls
        if not calls or calls[-1].iteration != ev.iteration:
            calls.append(_CallParts(ev.iteration))
        calls[-1].add(ev)
        facts = _RUN_FACTS.get(kind)
        if facts is not None:
            facts(self, ev)

    def freeze(self) -> MovementRun:
        if self.frozen is None:
            lists = self.lists
            self.frozen = MovementRun(
                seq=self.seq, start=self.start, calls=tuple(c.freeze() for c in self.calls),
                transition=self.transition, llm_calls=self.llm_calls, tokens=self.tokens,
                max_ratio=self.max_ratio, summarisations=self.summarisations,
                actions=tuple(lists[ContextAction]), errors=tuple(lists[ErrorEvent]),  # type: ignore[arg-type]
                compaction_errors=tuple(self.compaction_errors),
                compactions=tuple(lists[Compaction]), divergences=tuple(lists[ReplayDivergence]),  # type: ignore[arg-type]
                loops=tuple(lists[LoopDetected]))  # type: ignore[arg-type]
        return self.frozen


def _run_response(run: _RunParts, ev: LLMResponse) -> None:
    run.llm_calls += 1
    run.tokens += ev.usage.total_tokens
    run.summarisations += ev.purpose == "compaction"
    if ev.usage.ratio is not None:
        run.max_ratio = ev.usage.ratio if run.max_ratio is None else max(run.max_ratio, ev.usage.ratio)


def is_interruption(ev: ErrorEvent) -> bool:
    """A call stopped mid-answer by the job's Stop (docs/models.md#streaming): asked again on resume; no failure."""
    return ev.where == "interrupted"


def _run_error(run: _RunParts, ev: ErrorEvent) -> None:
    if is_interruption(ev):
        return  # shown in its call only
    # a failed compaction is a warning: the movement went on (the job's status says how it ended)
    (run.compaction_errors if is_compaction_error(ev) else run.lists[ErrorEvent]).append(ev)


def _run_listed(run: _RunParts, ev: Event) -> None:
    run.lists[type(ev)].append(ev)


def _run_transition(run: _RunParts, ev: Transition) -> None:
    run.transition = ev


# what each kind adds to its run beyond its place in a call (kinds not named: only that place)
_RUN_FACTS: dict[type, Callable[[_RunParts, Event], None]] = {
    LLMResponse: _run_response,  # type: ignore[dict-item]
    ErrorEvent: _run_error,  # type: ignore[dict-item]
    Transition: _run_transition,  # type: ignore[dict-item]
    ContextAction: _run_listed, Compaction: _run_listed, ReplayDivergence: _run_listed, LoopDetected: _run_listed,
}


class _JobNumbers:
    """The job's :class:`Totals` being folded, over all its events in order."""

    def __init__(self) -> None:
        self.movements = self.calls = self.tool_calls = 0
        self.prompt = self.completion = self.total = 0
        self.usage: list[tuple[int, int, float]] = []
        self.last_seq: int | None = None
        self.last_ratio: float | None = None
        self.last_tokens: int | None = None
        self.window: int | None = None
        self.actions: list[str] = []
        self.latest: tuple[int, int] | None = None
        self.question: str | None = None
        self.errors: list[str] = []
        self.scores: dict[str, ScoreEvent] = {}
        self.judge_calls: list[LLMResponse] = []
        self.reserved: dict[int, int] = {}
        self.reason: str | None = None
        self.status_events = False
        self.recovered = False
        self.clock = RunningClock()

    def add(self, ev: Event) -> None:
        self.clock.see(ev)
        facts = _JOB_FACTS.get(type(ev))
        if facts is not None:
            facts(self, ev)

    def freeze(self) -> Totals:
        return Totals(
            movements=self.movements, calls=self.calls, tool_calls=self.tool_calls, prompt_tokens=self.prompt,
            completion_tokens=self.completion, total_tokens=self.total, usage=tuple(self.usage),
            last_seq=self.last_seq, last_ratio=self.last_ratio, last_tokens=self.last_tokens, window=self.window,
            actions=tuple(self.actions), latest=self.latest, question=self.question, errors=tuple(self.errors),
            scores=dict(self.scores), judge_calls=tuple(self.judge_calls), reserved=dict(self.reserved), status_reason=self.reason, status_events=self.status_events,
            recovered=self.recovered,
            running_s=self.clock.total, running_since=self.clock.since)


def _job_status(n: _JobNumbers, ev: JobStatusEvent) -> None:
    n.status_events = True
    n.reason = ev.reason
    n.recovered = n.recovered or is_recovery(ev.reason)


def _job_start(n: _JobNumbers, ev: MovementStart) -> None:
    if ev.replayed_from is not None and ev.movement_seq is not None:
        n.reserved[ev.movement_seq] = ev.replayed_from
    n.movements += 1
    n.last_seq = ev.movement_seq
    n.last_ratio = n.last_tokens = None
    n.actions = []


def _job_request(n: _JobNumbers, ev: LLMRequest) -> None:
    if ev.movement_seq is not None and ev.iteration is not None:
        n.latest = (ev.movement_seq, ev.iteration)  # a call in flight is the latest one


def _job_response(n: _JobNumbers, ev: LLMResponse) -> None:
    if ev.purpose == "judge":
        n.judge_calls.append(ev)
        return
    u = ev.usage
    n.calls += 1
    n.prompt += u.prompt_tokens
    n.completion += u.completion_tokens
    n.total += u.total_tokens
    n.usage.append((u.prompt_tokens, u.completion_tokens, ev.ts))
    if ev.movement_seq == n.last_seq:
        n.last_ratio, n.last_tokens = u.ratio, u.prompt_tokens
        n.window = u.window or n.window


def _job_compaction(n: _JobNumbers, ev: Compaction) -> None:
    if ev.movement_seq == n.last_seq:
        # the summarisation call's ratio is its request's; the context goes on from the compacted list
        n.last_tokens = ev.tokens_after
        n.last_ratio = ev.tokens_after / n.window if n.window else n.last_ratio
        n.actions = []  # the ContextManager re-armed


def _job_tool(n: _JobNumbers, _ev: ToolCallEvent) -> None:
    n.tool_calls += 1


def _job_action(n: _JobNumbers, ev: ContextAction) -> None:
    if ev.movement_seq == n.last_seq:
        n.actions.append(ev.action)


def _job_transition(n: _JobNumbers, ev: Transition) -> None:
    if ev.question:
        n.question = ev.question


def _job_error(n: _JobNumbers, ev: ErrorEvent) -> None:
    if not (is_compaction_error(ev) or is_interruption(ev)):  # a failed compaction is a warning, not an error
        n.errors.append(ev.message)


def _job_score(n: _JobNumbers, ev: ScoreEvent) -> None:
    n.scores[ev.name] = ev


_JOB_FACTS: dict[type, Callable[[_JobNumbers, Event], None]] = {
    JobStatusEvent: _job_status, MovementStart: _job_start, LLMRequest: _job_request,  # type: ignore[dict-item]
    LLMResponse: _job_response, Compaction: _job_compaction, ToolCallEvent: _job_tool,  # type: ignore[dict-item]
    ContextAction: _job_action, Transition: _job_transition, ErrorEvent: _job_error,  # type: ignore[dict-item]
    ScoreEvent: _job_score,  # type: ignore[dict-item]
}


class Fold:
    """A job's timeline being folded: ``add`` events in the order they were recorded (all of them, or those
    after :attr:`last_id`), and get a frozen :class:`Timeline` back; only what changed is frozen again."""

    def __init__(self, *, runs: bool = True) -> None:
        self._with_runs = runs  # False: only the job's totals (the numbers of a header), the runs left empty
        self._entries: list[int | CommentEvent | ErrorEvent | Note] = []
        self._runs: dict[int, _RunParts] = {}
        self._asked: set[str] = set()
        self._numbers = _JobNumbers()
        self.last_id = 0

    def add(self, events: Iterable[Event]) -> Timeline:
        # one loop with its lookups held in locals: every view of a job folds all of its events
        numbers, runs, entries, asked = self._numbers, self._runs, self._entries, self._asked
        last: _RunParts | None = None
        for ev in events:
            if ev.id is not None and ev.id > self.last_id:
                self.last_id = ev.id
            numbers.add(ev)
            kind = type(ev)
            if kind is Transition and ev.question:  # type: ignore[union-attr]
                asked.add(ev.question)  # type: ignore[union-attr]
            seq = ev.movement_seq
            if not self._with_runs:
                continue
            if seq is None:
                if kind is CommentEvent or kind is ErrorEvent:
                    entries.append(ev)  # type: ignore[arg-type]
                elif kind not in VIEWED_KINDS:
                    entries.append(note(ev))
                continue
            if last is None or last.seq != seq:
                last = runs.get(seq)
                if last is None:
                    last = runs[seq] = _RunParts(seq)
                    entries.append(seq)
            last.add(ev)
        return self.timeline()

    def timeline(self) -> Timeline:
        runs = {seq: parts.freeze() for seq, parts in self._runs.items()}
        entries = tuple(runs[e] if isinstance(e, int) else e for e in self._entries)
        return Timeline(entries=entries, runs=runs, asked=frozenset(self._asked), totals=self._numbers.freeze(),
                        last_id=self.last_id)


def fold(events: Iterable[Event], *, runs: bool = True) -> Timeline:
    """The timeline of a job's events (all of them, oldest first; any subset folds the same way); ``runs=False``
    folds only its :class:`Totals` (its runs and entries are then empty), for a view that shows numbers only."""
    return Fold(runs=runs).add(events)
