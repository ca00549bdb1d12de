"""The agent loop of one movement, as a resumable step: :meth:`AgentLoop.call` makes one LLM call.

Within a movement every assistant message, tool result and reminder is appended
to ``messages`` and the whole list is re-sent on the next call.  The list is not
carried into the next movement.  Its state can always be rebuilt from the events
of the movement (:meth:`AgentLoop.resume`), so a job stopped between calls — even
across a restart — goes on from the SQLite file.

A response is committed before the first of its tools runs, and a tool that is not
read-only (Write, Edit, Bash, Checklist, a custom tool without ``read_only=True``) has
its ``tool_call`` committed before it runs.  A process that dies while tools run
therefore leaves the response in the store: the restarted loop does not ask the
model again but completes the response's remaining calls.  A started call of a tool
that is not read-only is never run twice — the model reads that it was interrupted
and that its effect is unknown; a read-only one simply runs again.

With ``context.on_pressure: compact`` (docs/context.md#compaction) a call whose response crosses the prompt threshold is
followed by a compaction step: one tool-less summarisation call (its ``llm_request`` has ``purpose:
"compaction"``), then the messages become the system prompt, the user prompt, the summary and the last
``compact_keep_last`` messages (moved back so a tool call is never parted from its results), recorded as a
``compaction`` event from which :meth:`AgentLoop.resume` rebuilds the same list.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import live
from .._secrets import scrub_data
from ..errors import CallCancelled
from ..events import (
    Compaction,
    ContextAction,
    ErrorEvent,
    Event,
    LLMRequest,
    LLMResponse,
    MovementStart,
    RecordedToolCall,
    Reminder,
    ReplayDivergence,
    ToolCallEvent,
    ToolResult,
    Usage,
)
from ..models.base import Model, ModelError, ModelRequest, ModelResponse, ToolCall
from ..models.messages import (
    AssistantMessage,
    Delta,
    ImagePart,
    Message,
    SystemMessage,
    TokenUsage,
    ToolCallPart,
    ToolMessage,
    UserMessage,
)
from ..models.replay import RecordedCall, Recording, ReplayModel
from ..tools.base import PERMISSION_RANK, Tool, ToolContext, ToolOutput, get_tool
from ..tools.mcp import kept_result, recorded_output
from .context import ContextDecision, ContextManager
from .pieces import SPECIAL_NEXT, Movement
from .prompts import text, transition_schema
from .recorder import Recorder

if TYPE_CHECKING:
    from ..tools.mcp import McpSession

__all__ = ["INTERRUPTED", "AgentLoop", "CallCounters", "Outcome", "Recorder", "ReplayDiverged", "transition_schema"]

INTERRUPTED = (
    "Error: this call of {tool} was interrupted by a restart (agentnb stopped or was killed while it ran), "
    "so it has no result. Its effect is unknown: it may have run completely, partly or not at all. "
    "Check the current state (for example read the files it would change) before repeating it."
)


class ReplayDiverged(ModelError):
    """A fork run with ``strict=True`` re-ran a tool whose result differs from its original's (docs/fork-compare.md#fork)."""


@dataclass
class Outcome:
    """How a movement ended: the transition the model called, or a forced one."""

    next_step: str
    summary: str = ""
    lessons: str = ""
    forced: bool = False
    reason: str = ""
    question: str | None = None
    feedback: str | None = None
    subtasks: list[dict[str, Any]] | None = None
    resume: str | None = None


@dataclass
class _Unfinished:
    """A recorded response whose tool calls were not all completed when the process stopped."""

    iteration: int
    calls: list[ToolCall]
    started: int  # calls with a recorded tool_call (a prefix of ``calls``)
    done: int  # calls with a recorded tool_result (a prefix of the started ones)
    transition_ok: bool  # a recorded, successful transition among the done calls
    force_reason: str
    prompt: ContextAction | None
    images: list[UserMessage]  # images of the done results, sent after every tool message


@dataclass(frozen=True)
class _Pressure:
    """A compaction due at the next step: the crossing that called for it (for the fall-back, docs/context.md#compaction)."""

    force_reason: str
    ratio: float
    tokens: int


@dataclass
class CallCounters:
    """The job's LLM calls so far, which the model sees in each request (scripted models pick by them)."""

    call_index: int = 0  # LLM calls in the job so far
    by_movement: dict[str, int] = field(default_factory=dict)  # calls per movement name so far


class AgentLoop:
    def __init__(
        self,
        *,
        recorder: Recorder,
        movement: Movement,
        seq: int,
        model: Model,
        ctx: ContextManager,
        workdir: Path,
        logs_dir: Path,
        language: str,
        counters: CallCounters,
        check_subtasks: Callable[[list[Any]], str | None] | None = None,
        reserve: Recording | None = None,
        strict: bool = False,
        mcp: McpSession | None = None,
    ) -> None:
        self.rec = recorder
        self.movement = movement
        self.seq = seq
        self.model = model
        self.ctx = ctx
        self.workdir = workdir
        self.logs_dir = logs_dir
        self.language = language
        self.counters = counters
        self.check_subtasks = check_subtasks
        # A fork's run before its fork point (docs/fork-compare.md#fork): each response is re-served from this recording
        # instead of asking the model, and each tool re-run is compared with the recorded result.
        self.reserve = reserve
        self.strict = strict
        self._recorded: RecordedCall | None = None
        self.messages: list[Message] = []
        self.iteration = 0
        self.tools = [t for t in (get_tool(n) for n in movement.tools) if t is not None]
        self.schemas = [t.schema() for t in self.tools] + [transition_schema(movement)]
        self.tool_names = [t.name for t in self.tools] + ["transition"]
        # MCP tools (docs/tools.md#mcp-tools), listed from their servers at this run's first call in this process
        self.mcp, self._mcp_tools = mcp, dict[str, Tool]()
        self._mcp_due = mcp is not None and any("." in n for n in movement.tools)
        self._allowed = set(movement.next_steps)
        self._prompt_due = False
        self._unfinished: _Unfinished | None = None
        self._response_pending = False  # the current response is not committed yet
        # compaction (docs/context.md#compaction): how many this run made, calls that were not turns of the conversation (they
        # do not count toward max_iterations), whether compacting is over for this run (a compaction that left
        # the context above prompt, a failed one, nothing left to remove), and the compaction due next
        self.compactions = 0
        self.side_calls = 0
        self._compaction_off = False
        self._compaction: _Pressure | None = None
        self.ctx.set_tools(self.schemas)

    # -- starting and resuming ---------------------------------------------
    def start(self, system: str, user: str) -> None:
        self._append(SystemMessage(system))
        self._append(UserMessage(user))
        self.rec.add(MovementStart(job_id=self.rec.job_id, movement_seq=self.seq, iteration=0, ts=time.time(),
                                   movement=self.movement.name, seq=self.seq, system=system, user=user,
                                   replayed_from=self.reserve.job_id if self.reserve is not None else None))

    def resume(self, events: Sequence[Event]) -> None:
        """Rebuild messages, iteration and fired actions from this movement's events.

        When the last response's tool calls were not all completed (the process stopped
        in between), the next :meth:`call` completes them instead of asking the model.
        """
        images: list[UserMessage] = []
        last: LLMResponse | None = None
        started = done = 0
        transition_ok = False
        actions: list[ContextAction] = []
        fired: set[str] = set()  # the actions fired since the run began or since its last compaction
        pressure: ContextAction | None = None  # the last response's prompt crossing, until it is answered

        def flush_images() -> None:
            for m in images:
                self._append(m)
            images.clear()

        for ev in events:
            if isinstance(ev, MovementStart):
                self._append(SystemMessage(ev.system))
                self._append(UserMessage(ev.user))
            elif isinstance(ev, LLMResponse) and ev.purpose == "compaction":
                self.iteration = ev.iteration or self.iteration + 1  # its summary is in the compaction event
            elif isinstance(ev, Compaction):
                flush_images()
                self._compacted(ev.summary, ev.kept_messages)
                self.side_calls += 1
                self._compaction_off = self._compaction_off or self._still_pressed(ev.tokens_after)
                fired, pressure = set(), None
            elif isinstance(ev, ErrorEvent) and ev.where == "compaction":
                self.iteration = max(self.iteration, ev.iteration or 0)  # a failed call leaves no response
                self.side_calls += 1
                self._compaction_off, pressure = True, None
            elif isinstance(ev, LLMResponse):
                flush_images()
                self.iteration = ev.iteration or self.iteration + 1
                assistant = AssistantMessage(ev.content, tuple(_call_part(c) for c in ev.tool_calls))
                self.messages.append(assistant)
                self.ctx.after_response(assistant, TokenUsage(ev.usage.prompt_tokens, ev.usage.completion_tokens)
                                        if ev.usage.source == "usage" else None)
                last, started, done, transition_ok, actions, pressure = ev, 0, 0, False, [], None
            elif isinstance(ev, ToolCallEvent):
                started += 1
            elif isinstance(ev, ToolResult):
                done += 1
                if ev.tool == "transition" and not ev.is_error:
                    transition_ok = True
                self._append(ToolMessage(ev.call_id, ev.content))
                if ev.image:
                    images.append(_image_message(ev.tool, ev.image))
            elif isinstance(ev, Reminder):
                flush_images()
                self._append(UserMessage(ev.text))
                if ev.reason == "context prompt":  # the seed's wrap-up: this run compacts no more
                    self._compaction_off, pressure = True, None
            elif isinstance(ev, ContextAction):
                actions.append(ev)
                fired.add(ev.action)
                if ev.action == "prompt":
                    pressure = ev
        if last is not None and done < len(last.tool_calls):
            force = next((a for a in actions if a.action == "force_transition"), None)
            self._unfinished = _Unfinished(
                iteration=self.iteration,
                calls=[_recorded_call(c, i) for i, c in enumerate(last.tool_calls)],
                started=max(started, done), done=done, transition_ok=transition_ok,
                force_reason=_force_reason(force.ratio, force.window, force.threshold) if force else "",
                prompt=next((a for a in actions if a.action == "prompt"), None),
                images=list(images),
            )
        else:
            flush_images()
            if pressure is not None and self._compaction_open():
                # stopped between a call that crossed the prompt threshold and its compaction (or during it)
                force = next((a for a in actions if a.action == "force_transition"), None)
                self._compaction = _Pressure(
                    _force_reason(force.ratio, force.window, force.threshold) if force else "",
                    pressure.ratio, pressure.tokens)
        self.ctx.fired = fired

    def _append(self, message: Message) -> None:
        self.messages.append(message)
        self.ctx.add(message)

    # -- one LLM call ------------------------------------------------------------
    def call(self) -> Outcome | None:
        """Make one LLM call and run the tools it asks for; return the outcome if the movement ended.

        After a restart in the middle of a response, this completes that response instead.
        """
        if self._mcp_due and self.reserve is None and not isinstance(self.model, ReplayModel):
            self._load_mcp()  # a re-served run starts no server until a call the record does not hold (_run_tool)
        if self._unfinished is not None:
            return self._complete_unfinished()
        if self._compaction is not None:
            return self._compaction_step()
        self.rec.still_held()  # a holder that lost its lease asks the model nothing more
        if self.rec.cancelled():
            return None  # stopped before this call was asked: nothing is asked or recorded; the runner pauses
        mv = self.movement
        self.iteration += 1
        it = self.iteration
        seq = self.seq
        source = self._source(it, self.counters.call_index)
        self.rec.add(LLMRequest(job_id=self.rec.job_id, movement_seq=seq, iteration=it, ts=time.time(),
                                messages=len(self.messages), tools=self.tool_names if source is None or not
                                self._mcp_due or source.tools is None else list(source.tools)))
        watched = live.listening() and live.wants(self.rec.store, (self.rec.job_id,))
        if watched or self.reserve is not None or not getattr(self.model, "answers_at_once", False):
            # Durable before the (slow, fallible) model call.  A model that answers here at once (the scripted
            # one) and nobody watches: the request goes in the next commit, with the response, so a short job
            # takes the store's write lock fewer times (docs/stores.md#sqlite-writers).  A restart in between
            # asks it again, and it answers the same.
            self.rec.flush()
        name = mv.name
        request = ModelRequest(
            messages=self.messages, tools=self.schemas, job_id=self.rec.job_id, movement=name,
            movement_seq=seq, iteration=it, call_index=self.counters.call_index,
            movement_call_index=self.counters.by_movement.get(name, 0),
        )
        started = time.perf_counter()
        latency_s: float | None
        if self.reserve is not None:
            response, latency_s = self._reserved(it), None  # no model was asked: nothing to time
        else:
            self.rec.still_held()  # again: the flush above may have waited long for the store
            live.notice(self.rec.store, self.rec.job_id, "call_started", movement_seq=seq, iteration=it)
            if watched:
                request.on_delta = _delta_publisher(self.rec.store, self.rec.job_id, seq, it)
            request.cancel = self.rec.cancel
            try:
                response = self.model.complete(request)
            except CallCancelled as cut:
                self._interrupted(it, cut)
                if cut.interrupt is not None:  # Ctrl-C or SIGTERM in this thread: recorded, then let go on
                    # a store gone meanwhile must not swallow the interrupt: the call is asked again on resume
                    with contextlib.suppress(Exception):
                        self.rec.flush()
                    raise cut.interrupt from None
                return None
            # a replayed response keeps its original's latency, so a replay's events are its original's
            latency_s = response.latency_s if response.latency_s is not None else round(time.perf_counter() - started, 6)
        self._recorded = source
        self.counters.call_index += 1
        self.counters.by_movement[name] = self.counters.by_movement.get(name, 0) + 1

        assistant = AssistantMessage(response.content, response.tool_calls)
        self.messages.append(assistant)
        decision = self.ctx.after_response(assistant, response.usage)
        job_id = self.rec.job_id
        # a re-served call spends nothing: its tokens are 0, its ratio and window the context as it was
        spent = self.reserve is None
        usage = self._usage(decision, spent and not response.cached)  # nor does a cached one (engine/callcache.py)
        answered_at = time.time()
        self.rec.add(LLMResponse(job_id=job_id, movement_seq=seq, iteration=it, ts=answered_at,
                                 content=response.content, tool_calls=[_call_record(c) for c in response.tool_calls],
                                 usage=usage, latency_s=latency_s, ttft_s=response.ttft_s if spent else None,
                                 replayed_from=None if spent else self.reserve.job_id,  # type: ignore[union-attr]
                                 **(_answer_details(response) if spent else {})))
        force_reason = ""
        for action, limit in decision.fired:
            # stamped with the answer that fired it: the call's span holds it (docs/otel.md#mapping)
            self.rec.add(ContextAction(job_id=job_id, movement_seq=seq, iteration=it, ts=answered_at, action=action,
                                       ratio=round(decision.ratio, 6), tokens=decision.prompt_tokens,
                                       window=self.ctx.window, threshold=limit))
            if action == "prompt":
                self._prompt_due = True
            elif action == "force_transition":
                force_reason = _force_reason(decision.ratio, self.ctx.window, limit)

        if not response.tool_calls:
            self._remind(it)
        self._response_pending = True
        outcome = self._run_calls(response.tool_calls, it)
        self._response_pending = False
        return self._after_calls(it, outcome, force_reason, decision.ratio, decision.prompt_tokens)

    def _load_mcp(self) -> None:
        """Add the movement's MCP tools (starting their servers: McpStartError when one cannot start)."""
        assert self.mcp is not None
        self._mcp_tools = {t.name: t for t in self.mcp.tools_for(self.movement.tools, self.tool_names)}
        self._mcp_due = False
        self.tools += self._mcp_tools.values()
        self.schemas = [t.schema() for t in self.tools] + [transition_schema(self.movement)]
        self.tool_names = [t.name for t in self.tools] + ["transition"]
        self.ctx.set_tools(self.schemas)

    def _interrupted(self, it: int, cut: CallCancelled) -> None:
        """A call cut off mid-answer by the job's Stop (docs/models.md#streaming): no response is made from the
        partial answer; the tokens it spent are recorded as an estimate on an ``error`` event (``where:
        "interrupted"``), and the same call is asked again when the job resumes (here or from the store)."""
        self.iteration = it - 1
        self.rec.cut = True
        counter = self.ctx.counter
        done = counter.count(cut.partial_text) + counter.count(cut.partial_arguments)
        prompt = self.ctx.current
        how = f"mid-answer after ~{done} completion tokens (estimated)" if done else "before its answer began"
        self.rec.add(ErrorEvent(
            job_id=self.rec.job_id, movement_seq=self.seq, iteration=it, ts=time.time(), where="interrupted",
            message=f"call {it} of run {self.seq} ({self.movement.name}) was stopped {how}; it is asked again when "
                    "the job resumes",
            usage=Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done, source="estimate",
                        encoding=counter.encoding),
        ))

    def _run_calls(self, calls: Sequence[ToolCall], it: int, *, started: int = 0, first: int = 0,
                   images: list[UserMessage] | None = None, outcome: Outcome | None = None) -> Outcome | None:
        """Run ``calls`` in order, recording each; the first ``started`` of them were begun by a process
        that stopped before their results were recorded; ``first``: the index of ``calls[0]`` in its response."""
        images = [] if images is None else images
        seq = self.seq
        for i, call in enumerate(calls):
            resumed = i < started
            budget = self.ctx.tool_budget()  # the tool is cut to it and its result records it
            # a re-served response's MCP call: its recorded result, never the server again (docs/tools.md#mcp-tools)
            kept = kept_result(self._recorded.results if self._recorded else (), first + i, call.name,
                               self.movement.tools)
            server = kept.server if kept is not None else getattr(self._mcp_tools.get(call.name), "server", None)
            if not resumed:
                self.rec.add(ToolCallEvent(job_id=self.rec.job_id, movement_seq=seq, iteration=it, ts=time.time(),
                                           tool=call.name, arguments=call.arguments, call_id=call.id, server=server))
            if outcome is not None:
                out = ToolOutput("Skipped: the movement already ended with transition.", is_error=True)
            elif call.name == "transition":
                out, outcome = self._transition(call.arguments)
            elif kept is not None:
                out = recorded_output(kept)
            elif resumed and not self._rerunnable(call.name):
                out = ToolOutput(INTERRUPTED.format(tool=call.name or "a tool"), is_error=True)
            else:
                out = self._run_tool(call.name, call.arguments, budget)
            self.rec.add(ToolResult(
                job_id=self.rec.job_id, movement_seq=seq, iteration=it, ts=time.time(), tool=call.name,
                call_id=call.id, content=out.content, is_error=out.is_error, truncated=out.truncated,
                # never None: ToolOutput fills both in from its content
                original_chars=out.original_chars or 0, returned_chars=out.returned_chars or 0,
                continuation=out.continuation, image=out.image, budget_tokens=budget, server=server,
            ))
            if self.reserve is not None and kept is None:  # a divergence check only where a tool ran again
                self._check_replayed(it, first + i, call, out)
            self._append(ToolMessage(call.id, out.content))
            if out.image:
                images.append(_image_message(call.name, out.image))
        for m in images:
            self._append(m)
        return outcome

    def _after_calls(self, it: int, outcome: Outcome | None, force_reason: str, ratio: float,
                     tokens: int) -> Outcome | None:
        mv = self.movement
        # When the response that crosses force_transition itself made a valid transition, the model's own
        # choice stands (forced=False): it ended the movement as asked, and a mechanical default_next/ABORT
        # would only throw its summary away.  The crossing is still recorded as a context_action above.
        if outcome is not None:
            return outcome
        at_limit = self.iteration - self.side_calls >= mv.max_iterations  # turns of the conversation only
        if self._prompt_due and not at_limit and self._compaction_open():
            # docs/context.md#compaction: the next step summarises instead of wrapping up (or forcing a transition at 95 %)
            self._prompt_due = False
            self._compaction = _Pressure(force_reason, ratio, tokens)
            return None
        if force_reason:
            return self._forced(force_reason)
        if at_limit:
            return self._forced(f"max_iterations ({mv.max_iterations}) reached without a transition")
        if self._prompt_due:
            self._prompt_due = False
            self._wrap_up(it, ratio, tokens)
        return None

    def _wrap_up(self, it: int, ratio: float, tokens: int) -> None:
        """The seed's answer to the prompt threshold: ask the model to save its work and transition."""
        msg = text(self.language, "wrap_up", pct=f"{ratio:.0%}", tokens=tokens, window=self.ctx.window)
        self.rec.add(Reminder(job_id=self.rec.job_id, movement_seq=self.seq, iteration=it, ts=time.time(),
                              text=msg, reason="context prompt"))
        self._append(UserMessage(msg))
        self._compaction_off = True  # from here on the seed's behaviour applies

    # -- compaction (docs/context.md#compaction) -----------------------------------------------------------------------
    def _compaction_open(self) -> bool:
        return (self.ctx.on_pressure == "compact" and self.compactions < self.ctx.max_compactions
                and not self._compaction_off)

    def _still_pressed(self, tokens: int) -> bool:
        """Whether a compaction to ``tokens`` left the context at or above the prompt threshold."""
        return tokens / self.ctx.window >= self.ctx.thresholds["prompt"]

    def _keep_from(self) -> int:
        """Where the kept tail of the messages begins: the last ``compact_keep_last``, moved back over tool
        results (and the images they attached) to the assistant message that called them; never before the
        first two (the system and user prompts)."""
        msgs = self.messages
        k = max(2, len(msgs) - self.ctx.compact_keep_last)
        while 2 < k < len(msgs) and (isinstance(msgs[k], ToolMessage) or _is_attachment(msgs[k])):
            k -= 1
        return k

    def _compacted(self, summary: str, kept: int) -> None:
        """Replace the messages by the prompts, the summary and the last ``kept`` messages; recount."""
        self.compactions += 1
        note = UserMessage(text(self.language, "compact_summary", n=self.compactions, summary=summary))
        tail = self.messages[len(self.messages) - kept:] if kept else []
        self.messages = [*self.messages[:2], note, *tail]
        self.ctx.recount(self.messages)

    def _compaction_step(self) -> Outcome | None:
        """One step: the summarisation call and the new message list; when it cannot be made or fails, the
        seed's behaviour for the crossing that called for it (its wrap-up reminder, or its forced transition)."""
        pressure, self._compaction = self._compaction, None
        assert pressure is not None
        if not self._compact(pressure.ratio):
            if pressure.force_reason:
                return self._forced(pressure.force_reason)
            self._wrap_up(self.iteration, pressure.ratio, pressure.tokens)
        return None

    def _compact(self, ratio: float) -> bool:
        """Summarise and replace the messages; False (compaction over for this run) when nothing could be
        removed or the call failed — recorded, never raised."""
        keep_from = self._keep_from()
        if keep_from <= 2:  # only the prompts and what must be kept: a summary would free nothing
            self._compaction_off = True
            return False
        job_id, seq, name = self.rec.job_id, self.seq, self.movement.name
        self.iteration += 1
        it = self.iteration
        self.side_calls += 1
        ask = UserMessage(text(self.language, "compact_request", pct=f"{ratio:.0%}"))
        self.rec.still_held()
        self.rec.add(LLMRequest(job_id=job_id, movement_seq=seq, iteration=it, ts=time.time(),
                                messages=len(self.messages) + 1, tools=[], purpose="compaction"))
        self.rec.flush()  # durable before the model call, with the results of the call that crossed
        request = ModelRequest(
            messages=[*self.messages, ask], tools=[], job_id=job_id, movement=name, movement_seq=seq,
            iteration=it, call_index=self.counters.call_index,
            movement_call_index=self.counters.by_movement.get(name, 0), purpose="compaction",
        )
        self.rec.still_held()  # again, after the flush; outside the try below, which turns failures into records
        started = time.perf_counter()
        try:
            if self.reserve is not None:
                response, latency_s = self._reserved(it, purpose="compaction"), None
            else:
                response = self.model.complete(request)
                latency_s = (response.latency_s if response.latency_s is not None
                             else round(time.perf_counter() - started, 6))
        except Exception as exc:  # a failed summary falls back to the seed; it never ends the job
            self._compaction_failed(it, f"the summarisation call failed: {exc}", detail=str(exc))
            return False
        self.counters.call_index += 1
        self.counters.by_movement[name] = self.counters.by_movement.get(name, 0) + 1
        summary = (response.content or "").strip()
        reply = AssistantMessage(response.content)
        size = self.ctx.side_call(ask, reply, response.usage)
        spent = self.reserve is None
        usage = self._usage(size, spent and not response.cached)
        # the summary is the content; tool calls a model made anyway are kept in the record, never run
        self.rec.add(LLMResponse(job_id=job_id, movement_seq=seq, iteration=it, ts=time.time(),
                                 content=response.content, tool_calls=[_call_record(c) for c in response.tool_calls],
                                 usage=usage, latency_s=latency_s, purpose="compaction",
                                 replayed_from=None if spent else self.reserve.job_id,  # type: ignore[union-attr]
                                 **(_answer_details(response) if spent else {})))
        if not summary:
            self._compaction_failed(it, "the summarisation call returned no text", detail="it returned no text")
            return False
        before = self.ctx.current
        removed, kept = keep_from - 2, len(self.messages) - keep_from
        self._compacted(summary, kept)
        self.rec.add(Compaction(job_id=job_id, movement_seq=seq, iteration=it, ts=time.time(),
                                tokens_before=before, tokens_after=self.ctx.current, removed_messages=removed,
                                kept_messages=kept, summary=summary))
        if self._still_pressed(self.ctx.current):
            self._compaction_off = True  # it freed too little: the seed's wrap-up and forced transition apply
        return True

    def _usage(self, decision: ContextDecision, spent: bool) -> Usage:
        """An ``llm_response``'s usage: the decision's counts, or 0 tokens for a re-served call (nothing spent)
        that keeps its ratio and window (the context as it was)."""
        return Usage(
            prompt_tokens=decision.prompt_tokens if spent else 0,
            completion_tokens=decision.completion_tokens if spent else 0,
            total_tokens=decision.prompt_tokens + decision.completion_tokens if spent else 0, source=decision.source,
            window=self.ctx.window, ratio=round(decision.ratio, 6),
            encoding=self.ctx.counter.encoding,  # the tokenizer behind tiktoken counts and budgets
        )

    def _compaction_failed(self, it: int, why: str, *, detail: str) -> None:
        # ``detail``: the cause alone (a failed call's own error, which a fork or replay re-serves as data,
        # models/replay.py), ``why`` that cause in the message's words
        self.rec.add(ErrorEvent(
            job_id=self.rec.job_id, movement_seq=self.seq, iteration=it, ts=time.time(), where="compaction",
            message=f"compaction {self.compactions + 1} of run {self.seq} ({self.movement.name}): {why}; the "
                    "movement goes on uncompacted (the seed's wrap-up and forced transition apply)",
            detail=detail,
        ))
        self._compaction_off = True

    def _complete_unfinished(self) -> Outcome | None:
        """Finish the tool calls of a response recorded by a process that stopped in the middle of it."""
        u = self._unfinished
        assert u is not None
        self._unfinished = None
        outcome: Outcome | None = None
        if u.transition_ok:  # cannot normally be left behind (a transition commits with its movement's end)
            call = next(c for c in u.calls[: u.done] if c.name == "transition")
            outcome = self._transition(call.arguments)[1]
        self._recorded = self._source(u.iteration, self.counters.call_index - 1)
        outcome = self._run_calls(u.calls[u.done:], u.iteration, started=u.started - u.done, first=u.done,
                                  images=u.images, outcome=outcome)
        self._prompt_due = u.prompt is not None
        ratio, tokens = (u.prompt.ratio, u.prompt.tokens) if u.prompt is not None else (0.0, 0)
        return self._after_calls(u.iteration, outcome, u.force_reason, ratio, tokens)

    # -- a fork's re-served run (docs/fork-compare.md#fork) ----------------------------------------------------------------
    def _reserved(self, it: int, purpose: str | None = None) -> ModelResponse:
        assert self.reserve is not None
        recorded = self.reserve.call(self.seq, it)
        if recorded is not None and recorded.purpose != purpose:
            raise ModelError(
                f"the fork's run {self.seq} ({self.movement.name}) made a "
                f"{'compaction' if purpose else 'conversation'} call at {it}, where job {self.reserve.job_id} "
                f"made a {'compaction' if recorded.purpose else 'conversation'} call"
            )
        if recorded is None and purpose == "compaction":
            failed = self.reserve.failed_compaction(self.seq, it)
            if failed is not None:
                raise failed
        if recorded is None:
            raise ModelError(
                f"the fork's run {self.seq} ({self.movement.name}) asked for call {it}, which job "
                f"{self.reserve.job_id} did not make: the re-served runs took another path than the original's"
            )
        self._recorded = recorded
        return recorded.response

    def _source(self, it: int, index: int) -> RecordedCall | None:
        """The recorded call that response ``it`` (the job's call ``index``) re-serves: a fork's re-served run's or
        a replay's; None for a live one."""
        if self.reserve is not None:
            return self.reserve.call(self.seq, it)
        return self.model.recorded(index) if isinstance(self.model, ReplayModel) else None

    def _check_replayed(self, it: int, index: int, call: ToolCall, out: ToolOutput) -> None:
        """Record a ``replay_divergence`` when a re-run tool's result is not what the original's was."""
        recorded = self._recorded
        expected = recorded.results[index] if recorded is not None and index < len(recorded.results) else None
        if expected is not None and expected.content == out.content and expected.is_error == out.is_error:
            return
        assert self.reserve is not None
        self.rec.add(ReplayDivergence(
            job_id=self.rec.job_id, movement_seq=self.seq, iteration=it, ts=time.time(), seq=self.seq,
            call_id=call.id, tool=call.name, expected="" if expected is None else expected.content,
            actual=out.content,
        ))
        if self.strict:
            raise ReplayDiverged(
                f"the fork diverged from job {self.reserve.job_id} at run {self.seq} ({self.movement.name}), "
                f"call {it}: {call.name or 'a tool'} ({call.id}) gave another result than the original's "
                "(strict=True stops the fork; see its replay_divergence event)"
            )

    def _rerunnable(self, name: str) -> bool:
        """Whether a started call of ``name`` may simply run again: a read-only tool, or a name this step
        cannot run at all (it only gets its error again)."""
        if name in self._mcp_tools:
            return self._mcp_tools[name].read_only
        if name not in self.movement.tools:  # with MCP servers: maybe a tool its server no longer offers
            return not any("." in n for n in self.movement.tools)
        t = get_tool(name)
        return t is not None and t.read_only  # a tool missing from this process may have had effects

    def _remind(self, it: int) -> None:
        steps = ", ".join(self.movement.next_steps)
        msg = text(self.language, "reminder", steps=steps)
        self.rec.add(Reminder(job_id=self.rec.job_id, movement_seq=self.seq, iteration=it, ts=time.time(),
                              text=msg, reason="no tool call"))
        self._append(UserMessage(msg))

    def _forced(self, reason: str) -> Outcome:
        target = self.movement.default_next or "ABORT"
        # a forced ASK still has to put a question to the user, or the reply would answer nothing
        question = f"The step {self.movement.name!r} stopped: {reason}. How should it go on?" if target == "ASK" else None
        return Outcome(next_step=target, summary=f"Forced transition: {reason}.", forced=True, reason=reason,
                       question=question)

    def _run_tool(self, name: str, arguments: Any, budget: int) -> ToolOutput:
        if self._mcp_due and name not in self.tool_names:
            self._load_mcp()  # a re-served run's call the record does not hold runs live: its servers start now
        if not isinstance(name, str) or not name.strip():
            return ToolOutput(f"Error: this tool call names no tool (its function name is missing or empty); "
                              f"available: {', '.join(self.tool_names)}", is_error=True)
        if name in self.movement.tools and name not in self.tool_names:
            # e.g. a notebook's @agentnb.tool, and the job was resumed by another process
            return ToolOutput(f"Error: tool {name!r} is named by this step but not defined in this Python process; "
                              f"available: {', '.join(self.tool_names)}", is_error=True)
        if name not in self.tool_names:
            allowed = ", ".join(self.tool_names)
            return ToolOutput(f"Error: tool {name!r} is not available in this step; available: {allowed}", is_error=True)
        t = self._mcp_tools.get(name) or get_tool(name)
        if t is None:
            return ToolOutput(f"Error: tool {name!r} is not registered in this Python process", is_error=True)
        if PERMISSION_RANK[t.permission] > PERMISSION_RANK[self.movement.permission]:
            return ToolOutput(
                f"Error: {name} needs permission {t.permission!r}; this step has {self.movement.permission!r}",
                is_error=True,
            )
        if not isinstance(arguments, dict):
            return ToolOutput(f"Error: the arguments for {name} are not a JSON object: {str(arguments)[:200]}",
                              is_error=True)
        tctx = ToolContext(
            workdir=self.workdir, logs_dir=self.logs_dir, budget_tokens=budget,
            chars_per_token=self.ctx.chars_per_token, job_id=self.rec.job_id, movement=self.movement.name,
            count_tokens=self.ctx.counter.count,
        )
        # a holder that lost its lease runs no further tool, not even the next one of the same response
        self.rec.still_held()
        if self._response_pending or not t.read_only:
            # Durable before any tool runs: the response (a restart completes it instead of asking the model
            # again) and, for a tool with effects, this tool_call (a restart knows it started and never runs
            # it a second time).  Read-only tools after the first need no commit of their own.
            self.rec.flush()
            self._response_pending = False
            self.rec.still_held()  # again: the commit may have waited long for the store
        return t.invoke(tctx, arguments)

    def _transition(self, args: Any) -> tuple[ToolOutput, Outcome | None]:
        def err(message: str) -> tuple[ToolOutput, None]:
            return ToolOutput(f"Error: {message}", is_error=True), None

        if not isinstance(args, dict):
            return err("transition arguments must be a JSON object")
        unknown = set(args) - {"next_step", "summary", "lessons", "question", "feedback", "subtasks", "resume"}
        if unknown:
            return err(f"unknown transition argument(s) {sorted(unknown)}; allowed: next_step, summary, lessons, "
                       "question, feedback, subtasks, resume")
        step = args.get("next_step")
        if not isinstance(step, str) or step not in self._allowed:
            return err(f"next_step {step!r} is not allowed here; allowed: {', '.join(self.movement.next_steps)}")
        for key in ("summary", "lessons", "question", "feedback", "resume"):
            if args.get(key) is not None and not isinstance(args[key], str):
                return err(f"{key} must be text")
        question = args.get("question")
        if step == "ASK" and not (question or "").strip():
            return err("next_step ASK needs a question for the user")
        subtasks = args.get("subtasks")
        if step == "WAIT_SUBTASKS":
            if self.check_subtasks is None:
                return err("subtasks are not available here")
            problem = self.check_subtasks(subtasks)  # type: ignore[arg-type]
            if problem:
                return err(problem)
        resume = args.get("resume")
        if resume is not None and resume not in self._allowed - set(SPECIAL_NEXT):
            return err(f"resume {resume!r} is not a movement this step can go to")
        outcome = Outcome(
            next_step=step, summary=args.get("summary") or "", lessons=args.get("lessons") or "",
            question=question, feedback=args.get("feedback"), subtasks=subtasks if step == "WAIT_SUBTASKS" else None,
            resume=resume,
        )
        return ToolOutput(f"Transition to {step} recorded."), outcome


def _answer_details(response: ModelResponse) -> dict[str, Any]:
    """What the endpoint said of its answer, for the ``llm_response`` event."""
    return {"response_model": response.response_model, "response_id": response.response_id,
            "finish_reason": response.finish_reason, "cached_tokens": response.cached_tokens,
            "cached": response.cached or None}


def _force_reason(ratio: float, window: int, limit: float) -> str:
    return f"context at {ratio:.1%} of {window:,} tokens reached force_transition ({limit:.0%})"


def _recorded_call(c: RecordedToolCall, i: int) -> ToolCall:
    """A tool call as recorded in ``llm_response``, back as a :class:`ToolCall`."""
    return ToolCall(id=str(c.id or f"call_{i}"), name=str(c.name or ""), arguments=c.arguments,
                    raw_arguments=c.raw_arguments or "")


def _call_record(c: ToolCall) -> RecordedToolCall:
    """A tool call as kept in ``llm_response``; the model's own argument text too when re-encoding
    would change it (compact or double-encoded JSON), so a resumed movement re-sends what it said."""
    raw = c.raw_arguments if c.raw_arguments and c.raw_arguments != _json_args(c.arguments) else None
    if raw is not None and "\\" in raw and scrub_data(c.arguments) is not c.arguments:
        # the arguments hold a secret, which the model's JSON text may write escaped (\", \u0041, \/) where the
        # store's masking of text does not see it: only the arguments are kept, masked by the store (a text with
        # no escape holds its strings as they are, and is masked as they would be)
        raw = None
    return RecordedToolCall(id=c.id, name=c.name, arguments=c.arguments, raw_arguments=raw)


def _call_part(c: RecordedToolCall) -> ToolCallPart:
    """A recorded tool call as the assistant message sent it (the model's own argument text when kept)."""
    return ToolCallPart(id=c.id, name=c.name, arguments=c.arguments,
                        raw_arguments=c.raw_arguments or (c.arguments if isinstance(c.arguments, str) else ""))


def _json_args(arguments: Any) -> str:
    import json

    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _image_message(tool: str, data_url: str) -> UserMessage:
    return UserMessage(f"(image attached by {tool})", (ImagePart(data_url),))


def _is_attachment(m: Message) -> bool:
    """A user message carrying a tool's images: it belongs with the tool results before it."""
    return isinstance(m, UserMessage) and bool(m.images)


def _delta_publisher(store: Any, job_id: int, seq: int, iteration: int) -> Callable[[Delta], None]:
    """Publish each streamed fragment of call ``iteration`` as a ``delta`` notice (docs/python-api.md#live-events):
    only while someone in this process watches the job, and never stored."""

    def publish(delta: Delta) -> None:
        live.notice(store, job_id, "delta", movement_seq=seq, iteration=iteration, delta=delta)

    return publish
