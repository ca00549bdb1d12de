"""Re-serving a recorded job (docs/models.md, docs/fork-compare.md#replay): :class:`Recording` and the ``replay:<job>`` model.

A :class:`Recording` is a job's LLM calls as recorded, each with the tool results that followed it: what
``replay:<job>`` re-serves in order, and what a fork re-serves for its movement runs before the fork
point (the engine compares each re-run tool with the recorded result).  A fork's own re-served calls
spend no tokens (their ``usage`` counts 0), so the counts the ContextManager needs are taken from the
job that made the call live, following ``replayed_from`` back; a fork of a fork re-serves exactly what
its original saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ModelError
from ..events import ErrorEvent, Event, LLMRequest, LLMResponse, MovementStart, ToolResult, Transition
from .base import ModelRequest, ModelResponse, ToolCall
from .messages import TokenUsage

if TYPE_CHECKING:
    from ..store.base import Store

__all__ = ["RecordedCall", "Recording", "ReplayModel"]


@dataclass(frozen=True)
class RecordedCall:
    """One recorded LLM call: the response as the model gave it, the counts the ContextManager used
    (``usage``: prompt and completion tokens and their source) and the tool results that followed."""

    seq: int
    iteration: int
    response: ModelResponse
    results: tuple[ToolResult, ...]
    latency_s: float | None
    purpose: str | None = None  # "compaction": a summarisation call (docs/context.md#compaction), not a turn of the conversation
    # the tool names its llm_request offered (None: not recorded): a re-served run that starts no MCP server
    # offers the same (docs/tools.md#mcp-tools)
    tools: tuple[str, ...] | None = None


class Recording:
    """The recorded calls of job ``job_id`` in movement runs before ``before`` (all runs when None)."""

    def __init__(self, store: Store, job_id: int, *, before: int | None = None) -> None:
        self.store = store
        self.job_id = job_id
        self.before = before
        store.job(job_id)  # a StoreError naming the job when there is none
        kinds = ["movement_start", "llm_request", "llm_response", "tool_result", "transition", "error"]
        events = [ev for ev in store.events(job_id, kinds=kinds)
                  if ev.movement_seq is not None and (before is None or ev.movement_seq < before)]
        self.movements: dict[int, str] = {}  # run → movement name
        self.starts: dict[int, MovementStart] = {}  # run → its movement_start (the prompts as sent, when)
        self.transitions: dict[int, Transition] = {}  # run → how it ended
        self._replayed_runs: dict[int, int] = {}  # run → the job it was re-served from
        # (run, call) → why the summarisation call made there failed: it left no response to re-serve, and a
        # re-served run must fail it the same way, not as a call the original never made (docs/context.md)
        self.failed_compactions: dict[tuple[int, int], str] = {}
        self._offered: dict[tuple[int, int], tuple[str, ...]] = {}  # (run, call) → the tool names its request sent
        responses, results = self._sort(events)
        # one Recording per job re-served from, made when its first call is met, reaching the last run re-served
        sources: dict[int, Recording] = {}
        reach = _reach(responses)
        self.calls: list[RecordedCall] = [self._recorded(ev, results, sources, reach) for ev in responses]
        self._by_key = {(c.seq, c.iteration): c for c in self.calls}

    def _sort(self, events: Sequence[Event]) -> tuple[list[LLMResponse], dict[tuple[int, int], list[ToolResult]]]:
        """Take each run's start, transition and failed compactions; give back the responses, in order, and
        the tool results by (run, call)."""
        results: dict[tuple[int, int], list[ToolResult]] = {}
        responses: list[LLMResponse] = []
        for ev in events:
            if isinstance(ev, MovementStart):
                self.movements[ev.seq] = ev.movement
                self.starts[ev.seq] = ev
                if ev.replayed_from is not None:
                    self._replayed_runs[ev.seq] = ev.replayed_from
            elif isinstance(ev, LLMResponse):
                responses.append(ev)
            elif isinstance(ev, LLMRequest):
                self._offered[(ev.movement_seq or 0, ev.iteration or 0)] = tuple(ev.tools)
            elif isinstance(ev, Transition):
                self.transitions[ev.movement_seq or 0] = ev
            elif isinstance(ev, ToolResult):
                results.setdefault((ev.movement_seq or 0, ev.iteration or 0), []).append(ev)
            elif isinstance(ev, ErrorEvent) and ev.where == "compaction":
                self.failed_compactions[(ev.movement_seq or 0, ev.iteration or 0)] = _failure_cause(ev)
        return responses, results

    def _recorded(self, ev: LLMResponse, results: dict[tuple[int, int], list[ToolResult]],
                  sources: dict[int, Recording], reach: dict[int, int]) -> RecordedCall:
        """Response ``ev`` as a call to re-serve, with the tool results that followed it (``sources``: the
        Recordings of the jobs re-served from, made so far; ``reach``: the runs each must reach)."""
        seq, it = ev.movement_seq or 0, ev.iteration or 0
        usage = TokenUsage(ev.usage.prompt_tokens, ev.usage.completion_tokens, ev.usage.source)
        latency, ttft = ev.latency_s, ev.ttft_s
        if ev.replayed_from is not None:  # a fork's re-served call: the counts are its live original's
            source = sources.get(ev.replayed_from)
            if source is None:
                source = sources[ev.replayed_from] = Recording(self.store, ev.replayed_from,
                                                               before=reach[ev.replayed_from])
            live = source.call(seq, it)
            if live is not None:
                usage = live.response.usage or usage
                latency = live.latency_s
                ttft = live.response.ttft_s
        calls = tuple(
            ToolCall(id=c.id or f"call_{seq}_{it}_{i}", name=c.name, arguments=c.arguments,
                     raw_arguments=c.raw_arguments or "")
            for i, c in enumerate(ev.tool_calls)
        )
        return RecordedCall(
            seq=seq, iteration=it,
            response=ModelResponse(content=ev.content, tool_calls=calls, usage=usage, latency_s=latency,
                                   ttft_s=ttft, response_model=ev.response_model, response_id=ev.response_id,
                                   finish_reason=ev.finish_reason, cached_tokens=ev.cached_tokens),
            results=tuple(results.get((seq, it), ())), latency_s=latency, purpose=ev.purpose,
            tools=self._offered.get((seq, it)),
        )

    def call(self, seq: int, iteration: int) -> RecordedCall | None:
        """The call made in run ``seq`` at ``iteration``, or None when none was recorded."""
        return self._by_key.get((seq, iteration))

    def failed_compaction(self, seq: int, iteration: int) -> ModelError | None:
        """The error to re-serve for a summarisation call that failed in run ``seq`` at ``iteration`` with no
        response (None when it did not fail there, or failed only on an empty answer, which is re-served)."""
        if (seq, iteration) not in self.failed_compactions or (seq, iteration) in self._by_key:
            return None
        why = self.failed_compactions[(seq, iteration)]
        if why.startswith("re-served from job "):  # a fork of a fork: already names the job that failed live
            return ModelError(why)
        return ModelError(f"re-served from job {self.job_id}, whose summarisation call failed here too: {why}")

    def live_job(self, seq: int) -> int:
        """The job that ran run ``seq`` live (this one, or the job its re-served run came from, and so on)."""
        # only each source's movement_start of that run is needed, not a whole Recording of it (whose
        # calls would be read and resolved again for every re-served run the runner starts)
        job, source = self.job_id, self._replayed_runs.get(seq)
        while source is not None:
            job = source
            starts = self.store.events(job, kinds=["movement_start"], movement_seq=seq)
            source = starts[0].replayed_from if starts and isinstance(starts[0], MovementStart) else None
        return job

    def replayed_runs(self) -> Sequence[int]:
        """The runs this job itself re-served from another job's record."""
        return sorted(self._replayed_runs)


def _reach(responses: Sequence[LLMResponse]) -> dict[int, int]:
    """Each job re-served from → the run its Recording must reach: past the last run this job re-served from
    it, not only the first (a Recording built for run 1 holds no calls of run 2)."""
    reach: dict[int, int] = {}
    for ev in responses:
        if ev.replayed_from is not None:
            reach[ev.replayed_from] = max(reach.get(ev.replayed_from, 0), (ev.movement_seq or 0) + 1)
    return reach


def _failure_cause(ev: ErrorEvent) -> str:
    """Why a compaction failed: its event's ``detail``; an event stored before that field existed has the
    cause only inside its message, "…: the summarisation call failed: WHY; the movement goes on …"."""
    if ev.detail is not None:
        return ev.detail
    return ev.message.split("call failed: ", 1)[-1].rsplit("; the movement goes on", 1)[0]


class ReplayModel:
    """``replay:<job>``: re-serves the responses recorded for another job, in order.

    Each response comes back as recorded (content, tool calls with their ids) with the token counts the
    original's ContextManager used, whatever their source, so a replay of a whole job with the same piece
    reproduces its events (docs/fork-compare.md).
    """

    def __init__(self, store: Store, job_id: int) -> None:
        self.spec = f"replay:{job_id}"
        self.job_id = job_id
        self.recording = Recording(store, job_id)
        self.responses: list[ModelResponse] = [c.response for c in self.recording.calls]

    def recorded(self, call_index: int) -> RecordedCall | None:
        """The recorded call the job's call ``call_index`` re-serves (its tool results: an MCP call's is given
        again, not asked of the server, docs/tools.md#mcp-tools); None past the last."""
        calls = self.recording.calls
        return calls[call_index] if 0 <= call_index < len(calls) else None

    def complete(self, request: ModelRequest) -> ModelResponse:
        if request.purpose == "compaction":
            failed = self.recording.failed_compaction(request.movement_seq, request.iteration)
            if failed is not None:  # it left no response, so the next recorded call is the one after it
                raise failed
        if request.call_index >= len(self.responses):
            raise ModelError(
                f"replay of job {self.job_id} ran out of responses: it recorded {len(self.responses)} LLM calls"
            )
        recorded = self.recording.calls[request.call_index]
        if recorded.purpose != request.purpose:
            # e.g. the original's summarisation call failed (it left no response) or it ran without compaction
            def what(purpose: str | None) -> str:
                return "a compaction call" if purpose == "compaction" else "a conversation call"

            raise ModelError(
                f"replay of job {self.job_id}: LLM call {request.call_index + 1} is {what(request.purpose)} here "
                f"but was {what(recorded.purpose)} in the original (run {recorded.seq}, call {recorded.iteration})"
            )
        return self.responses[request.call_index]
