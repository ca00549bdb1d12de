"""A job's folded timeline as OpenTelemetry GenAI spans, in plain data (docs/otel.md#mapping).

One more renderer of :mod:`agentnb.views.timeline`: the job → ``invoke_workflow {piece}``, each movement run →
``invoke_agent {movement}``, each LLM call → ``chat {model}`` (CLIENT), each tool use → ``execute_tool {tool}``;
the rest as span events, error statuses and resource attributes, exactly as the table in docs/otel.md says
(tests/test_otel.py reads that table).  Subtasks are spans of their parent's trace, under the run that asked
for them.  Nothing here imports OpenTelemetry: :mod:`agentnb.views.otel` turns these records into the SDK's
spans and the OTLP encodings, so the mapping can be read (and tested) without the extra.

Ids are derived, never random (docs/otel.md#stable-ids): a hash of the store's identity, the job id and the
event ids (a run by its ``seq``), so exporting a job twice gives the same trace and span ids.

Content (``content=True``, docs/otel.md#content) is scrubbed of secrets as the store is (``_secrets.scrub``,
with the secrets this process knows now) and cut to ``max_chars`` characters per attribute.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .._secrets import scrub, scrub_data
from ..events import (
    CommentEvent,
    Compaction,
    ContextAction,
    ErrorEvent,
    Event,
    LLMRequest,
    LLMResponse,
    LoopDetected,
    Reminder,
    ReplayDivergence,
    ScoreEvent,
    Transition,
)
from ..models.prices import call_cost, call_costs
from ..store.base import Store
from ..store.records import JobRecord
from .timeline import Call, MovementRun, Note, ToolUse, fold, is_compaction_error, is_interruption

__all__ = ["DEFAULT_MAX_CHARS", "AttrValue", "SpanEvent", "SpanRecord", "TraceRecord", "job_trace", "store_identity",
           "trace_of"]

AttrValue = str | bool | int | float | Sequence[str]
DEFAULT_MAX_CHARS = 16_000  # per content attribute: viewers and collectors cap attribute sizes near this


@dataclass(frozen=True, slots=True)
class SpanEvent:
    name: str
    ts: float
    attributes: Mapping[str, AttrValue]


@dataclass(slots=True)
class SpanRecord:
    """One span: ids as ints (trace id 128 bits, span ids 64), times in seconds since the epoch."""

    name: str
    kind: Literal["internal", "client"]
    span_id: int
    parent_id: int | None
    start: float
    end: float
    attributes: dict[str, AttrValue] = field(default_factory=dict)
    events: list[SpanEvent] = field(default_factory=list)
    error: str | None = None  # error.type: the span's status is ERROR
    error_message: str = ""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One root job's trace: its spans (the root job's first, subtasks' after their parent's) and resource."""

    trace_id: int
    resource: Mapping[str, AttrValue]
    spans: tuple[SpanRecord, ...]


def store_identity(store: Store) -> str:
    """What names the store in the ids: its file's real path, however it was named (a relative path, a symlinked
    folder, ``sqlite:////…``), or its URL (without password)."""
    return os.path.realpath(store.path) if isinstance(store.path, Path) else str(store.path)


def _hash_id(bits: int, *parts: object) -> int:
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode("utf-8"), digest_size=bits // 8).digest()
    return int.from_bytes(digest, "big") or 1  # an all-zero id is invalid in OTLP


def _provider(spec: str) -> tuple[str, str]:
    """(gen_ai.provider.name, the model's name) of a model spec: ``openai:gpt-4o`` → (openai, gpt-4o); the
    offline models (demo, scripted:FILE, replay:JOB) are agentnb's own, named by their kind alone (a script's
    path is no model's name)."""
    kind, _, rest = spec.partition(":")
    kind = kind.partition("?")[0]  # a spec's options (demo?pace=0.02, openai:gpt-4o?stream=0) name no model
    if kind == "openai":
        return "openai", rest.partition("?")[0]
    return f"agentnb.{kind}", kind


def _cut(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters: its start and a mark saying how many were cut (a limit too small
    for the mark: its start alone)."""
    if len(text) <= limit:
        return text
    keep = limit
    for _ in range(4):  # the mark's length depends on the count it gives
        keep = limit - len(f"… [{len(text) - keep} characters cut]")
    while keep > 0 and keep + len(f"… [{len(text) - keep} characters cut]") > limit:
        keep -= 1
    if keep <= 0:
        return text[:limit]
    return text[:keep] + f"… [{len(text) - keep} characters cut]"


class _Content:
    """Content attributes when ``content=True``: scrubbed, each at most ``max_chars`` characters."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars

    def text(self, value: str) -> str:
        return _cut(scrub(value), self.max_chars)

    def within(self, build: Callable[[int], Any], room: int | None = None, limit: int | None = None,
               floor: int = 0) -> str:
        """The JSON of ``build(limit)`` in at most ``room`` characters (default ``max_chars``): ``limit`` (what
        ``build`` cuts its texts or its list to; default ``max_chars``) shrinks until it fits, or down to ``floor``."""
        room = self.max_chars if room is None else room
        limit = self.max_chars if limit is None else limit
        while True:
            encoded = json.dumps(build(limit), ensure_ascii=False, default=str)
            if len(encoded) <= room or limit <= floor:
                return encoded
            limit = max(floor, min(limit - 1, limit * room // len(encoded) - 1))

    def data(self, value: Any) -> str:
        """JSON text of ``value`` (a tool's arguments), scrubbed and cut."""
        return self.text(json.dumps(scrub_data(value), ensure_ascii=False, default=str))

    def messages(self, messages: Sequence[dict[str, Any]]) -> str:
        """The conventions' message list as JSON, its text parts scrubbed, in at most ``max_chars`` characters and
        valid JSON: the newest messages that fit whole (each part cut to half the limit first); the newest alone
        when it does not, its parts cut shorter until it fits."""
        kept: list[str] = []
        size = 2
        part_limit = max(64, self.max_chars // 2)
        for message in reversed(messages):
            encoded = json.dumps(self._cut_message(message, part_limit), ensure_ascii=False, default=str)
            if size + len(encoded) + (1 if kept else 0) > self.max_chars:
                if not kept:
                    kept.append(self._fit(message, self.max_chars - 2, part_limit))
                break
            kept.append(encoded)
            size += len(encoded) + (1 if len(kept) > 1 else 0)
        return "[" + ",".join(reversed(kept)) + "]"

    def _fit(self, message: dict[str, Any], room: int, limit: int) -> str:
        encoded = self.within(lambda cut: self._cut_message(message, cut), room, limit, floor=16)
        if len(encoded) <= room:
            return encoded
        # too many parts to show even cut short: the message says how long it was
        stub = {"role": message.get("role", "assistant"),
                "parts": [_text_part(f"[{len(encoded)} characters cut]")]}
        return json.dumps(stub, ensure_ascii=False)

    @staticmethod
    def _cut_message(message: dict[str, Any], limit: int) -> dict[str, Any]:
        """The message with each text part scrubbed and cut to ``limit``; tool-call arguments longer than that as
        their cut JSON text."""
        parts = []
        for part in message.get("parts", ()):
            part = dict(part)
            for key in ("content", "result"):
                if isinstance(part.get(key), str):
                    part[key] = _cut(scrub(part[key]), limit)
            if "arguments" in part:
                arguments = scrub_data(part["arguments"])
                text = json.dumps(arguments, ensure_ascii=False, default=str)
                part["arguments"] = arguments if len(text) <= limit else _cut(text, limit)
            parts.append(part)
        return {**message, "parts": parts}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "content": text}


def _assistant(ev: LLMResponse) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [_text_part(ev.content)] if ev.content else []
    parts += [{"type": "tool_call", "id": c.id, "name": c.name, "arguments": c.arguments} for c in ev.tool_calls]
    return {"role": "assistant", "parts": parts}


def _finish_reason(ev: LLMResponse) -> str:
    # the endpoint's word for why it ended, in the conventions' values (OpenAI's "tool_calls" is "tool_call");
    # where none was recorded (scripted, demo, a re-served call): a call that asked for tools ended for them, any
    # other ended its answer
    if ev.finish_reason:
        return _FINISH_REASONS.get(ev.finish_reason, ev.finish_reason)
    return "tool_call" if ev.tool_calls else "stop"


_FINISH_REASONS = {"tool_calls": "tool_call", "function_call": "tool_call"}


class _Attempt:
    """One asking of the model within a call (its items from index ``at``): its request, its answer, or the Stop
    that cut it off, or the error that failed it; ``span`` once mapped."""

    __slots__ = ("at", "cut", "failed", "request", "response", "span")

    def __init__(self, at: int, request: LLMRequest | None, response: LLMResponse | None = None) -> None:
        self.at, self.request, self.response = at, request, response
        self.cut: ErrorEvent | None = None
        self.failed = False
        self.span: SpanRecord | None = None

    @property
    def open(self) -> bool:
        """Asked, and neither answered, cut off nor failed yet."""
        return self.response is None and self.cut is None and not self.failed


class _JobMapper:
    """The spans of one job (subtasks are mapped by their own mapper, nested by :func:`trace_of`)."""

    def __init__(self, store: Store, identity: str, job: JobRecord, parent_span: int | None,
                 content: _Content | None, events: list[Event] | None = None) -> None:
        self.store, self.identity, self.job, self.content = store, identity, job, content
        self.events: list[Event] = store.events(job.id) if events is None else events
        self.timeline = fold(self.events)
        self.provider, self.model = _provider(job.model)
        self.job_span = SpanRecord(name=f"invoke_workflow {job.piece}", kind="internal",
                                   span_id=self.span_id("job"), parent_id=parent_span, start=0.0, end=0.0)
        self.spans: list[SpanRecord] = [self.job_span]
        self.subtask_parents: dict[int, int] = {}  # child job → the span of the run that asked for it
        answered = [e for e in self.events if isinstance(e, LLMResponse) and e.purpose != "judge"]
        costs = call_costs(job.model, [e.usage.prompt_tokens for e in answered],
                           [e.usage.completion_tokens for e in answered], [e.ts for e in answered])
        self.costs = {id(e): c for e, c in zip(answered, costs, strict=True)}
        # an LLM judge's calls are priced by the judge's own model (docs/design-lab.md#llm-judge)
        self.costs.update({id(e): call_cost(e.model or job.model, e.usage.prompt_tokens, e.usage.completion_tokens, e.ts)
                           for e in self.events if isinstance(e, LLMResponse) and e.purpose == "judge"})

    def span_id(self, *parts: object) -> int:
        return _hash_id(64, self.identity, self.job.id, *parts)

    # -- the job ---------------------------------------------------------------------------------------
    def map(self) -> list[SpanRecord]:
        job, span = self.job, self.job_span
        times = [e.ts for e in self.events if e.ts]
        span.start = min(times) if times else job.created
        span.end = max(times) if times else (job.ended or job.updated)
        span.attributes.update({
            "gen_ai.operation.name": "invoke_workflow", "gen_ai.workflow.name": job.piece,
            "gen_ai.conversation.id": str(job.id), "agentnb.job_id": job.id, "agentnb.status": str(job.status.value),
            "agentnb.model": job.model,
        })
        if job.parent_id is not None:
            span.attributes["agentnb.parent_job_id"] = job.parent_id
        if job.status.value in ("failed", "aborted"):
            span.error, span.error_message = job.status.value, scrub(job.error or "")
        for entry in self.timeline.entries:
            if isinstance(entry, MovementRun):
                self.map_run(entry)
            elif isinstance(entry, CommentEvent):
                span.events.append(self.comment(entry))
            elif isinstance(entry, ErrorEvent):
                span.events.append(self.error_event(entry))
            elif isinstance(entry, Note):
                span.events.append(self.note(entry))
        for score in (e for e in self.events if isinstance(e, ScoreEvent)):
            span.events.append(self.score(score))
        self.map_judges()
        return self.spans

    def map_judges(self) -> None:
        """An LLM judge's calls (purpose ``judge``, outside any movement run): ``chat`` spans under the job's, named
        and priced by the judge's model (docs/otel.md#mapping)."""
        request: LLMRequest | None = None
        for ev in self.events:
            if isinstance(ev, LLMRequest) and ev.purpose == "judge":
                request = ev
            elif isinstance(ev, LLMResponse) and ev.purpose == "judge":
                self.spans.append(self.chat_span(request, ev, self.job_span, None, spec=ev.model))
                request = None
        if request is not None:  # asked, never answered (the judge's call failed)
            self.spans.append(self.chat_span(request, None, self.job_span, None))

    def map_runs(self) -> list[SpanRecord]:
        """The spans of the movement runs of :attr:`events` alone (no job span): each run's, its calls' and tools'."""
        for entry in self.timeline.entries:
            if isinstance(entry, MovementRun):
                self.map_run(entry)
        return self.spans[1:]

    # -- a movement run -------------------------------------------------------------------------------
    def map_run(self, run: MovementRun) -> None:
        items = [i for c in run.calls for i in c.items]
        times = [t for t in (_ts(i) for i in items) if t]
        start = run.start.ts if run.start is not None else (min(times) if times else self.job_span.start)
        span = SpanRecord(name=f"invoke_agent {run.name}", kind="internal", span_id=self.span_id("run", run.seq),
                          parent_id=self.job_span.span_id, start=start, end=max([start, *times]))
        span.attributes.update({"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": run.name,
                                "gen_ai.conversation.id": str(self.job.id), "agentnb.movement_seq": run.seq})
        if run.replayed_from is not None:
            span.attributes["agentnb.replayed_from"] = run.replayed_from
        if run.transition is not None:
            span.attributes["agentnb.next_step"] = run.transition.next_step
            span.attributes["agentnb.forced"] = run.transition.forced
            for sub in run.transition.subtasks or ():
                self.subtask_parents[sub.job_id] = span.span_id
        if run.errors and run.transition is None:  # a run retried to its transition ended well (its failed call
            # keeps its own error status)
            span.error, span.error_message = run.errors[-1].where or "error", scrub(run.errors[-1].message)
        self.spans.append(span)
        conversation = self.Conversation(run, self.content)
        for call in run.calls:
            self.map_call(run, call, span, conversation)

    class Conversation:
        """The run's messages as the model was sent them, rebuilt from its events (content only)."""

        def __init__(self, run: MovementRun, content: _Content | None) -> None:
            self.on = content is not None
            self.system = run.start.system if run.start is not None else ""
            self.user = {"role": "user", "parts": [_text_part(run.start.user if run.start is not None else "")]}
            self.messages: list[dict[str, Any]] = [self.user]
            self.compacted = False

        def add(self, item: Any) -> None:
            if isinstance(item, Compaction):
                self.compacted = True
                if self.on:
                    kept = self.messages[len(self.messages) - item.kept_messages:] if item.kept_messages else []
                    self.messages = [self.user, {"role": "user", "parts": [_text_part(item.summary)]}, *kept]
            elif not self.on:
                return
            elif isinstance(item, LLMResponse) and item.purpose != "compaction":
                self.messages.append(_assistant(item))
            elif isinstance(item, ToolUse) and item.result is not None:
                self.messages.append({"role": "tool", "parts": [
                    {"type": "tool_call_response", "id": item.call_id, "result": item.result.content}]})
            elif isinstance(item, Reminder):
                self.messages.append({"role": "user", "parts": [_text_part(item.text)]})

    # -- an LLM call and its tools ---------------------------------------------------------------------
    def map_call(self, run: MovementRun, call: Call, run_span: SpanRecord,
                 conversation: _JobMapper.Conversation) -> None:
        # each asking of the model is a span of its own: a call stopped by Stop and asked again on resume is two,
        # the first ended at its interruption (docs/otel.md#mapping)
        attempts: list[_Attempt] = []
        for i, item in enumerate(call.items):
            if isinstance(item, LLMRequest):
                attempts.append(_Attempt(i, item))
            elif isinstance(item, LLMResponse):
                if attempts and attempts[-1].open:
                    attempts[-1].response = item
                else:  # stored without its request (an older store, a completed unfinished answer)
                    attempts.append(_Attempt(i, None, item))
            elif isinstance(item, ErrorEvent) and is_interruption(item) and attempts and attempts[-1].open:
                attempts[-1].cut = item
        for a in attempts:
            span = a.span = self.chat_span(a.request, a.response, run_span, conversation)
            if a.cut is not None:
                span.end = max(span.start, a.cut.ts)
            self.spans.append(span)
        k = -1
        for i, item in enumerate(call.items):
            while k + 1 < len(attempts) and attempts[k + 1].at <= i:
                k += 1
            attempt = attempts[k] if k >= 0 else None
            chat = attempt.span if attempt is not None else None
            # an event after the call's answer (a reminder once its tools ran, an agent's question) is the run's:
            # a span's events stay inside it
            host = chat if chat is not None and _ts(item) <= chat.end else run_span
            if isinstance(item, ToolUse):
                self.spans.append(self.tool_span(item, run_span))
            elif isinstance(item, ContextAction):
                # fired by the call's answer, recorded just after it: the call's span ends with them
                if chat is not None:
                    chat.end = max(chat.end, item.ts)
                (chat or run_span).events.append(SpanEvent("agentnb.context_action", item.ts, {
                    "agentnb.action": item.action, "agentnb.context.ratio": item.ratio,
                    "agentnb.context.tokens": item.tokens, "agentnb.context.window": item.window}))
            elif isinstance(item, Reminder):
                attrs: dict[str, AttrValue] = {"agentnb.reason": item.reason}
                if self.content is not None:
                    attrs["agentnb.text"] = self.content.text(item.text)
                host.events.append(SpanEvent("agentnb.reminder", item.ts, attrs))
            elif isinstance(item, Compaction):
                attrs = {"agentnb.tokens_before": item.tokens_before, "agentnb.tokens_after": item.tokens_after,
                         "agentnb.removed_messages": item.removed_messages,
                         "agentnb.kept_messages": item.kept_messages}
                if self.content is not None:
                    attrs["agentnb.summary"] = self.content.text(item.summary)
                run_span.events.append(SpanEvent("agentnb.compaction", item.ts, attrs))
            elif isinstance(item, LoopDetected):
                run_span.events.append(SpanEvent("agentnb.loop_detected", item.ts, {
                    "agentnb.monitor": item.monitor, "agentnb.cycle": list(item.cycle), "agentnb.count": item.count,
                    **({"agentnb.judge": item.judge} if item.judge else {}),
                    **({"agentnb.next": item.next} if item.next else {})}))
            elif isinstance(item, ReplayDivergence):
                attrs = {"gen_ai.tool.name": item.tool, "gen_ai.tool.call.id": item.call_id}
                if self.content is not None:
                    attrs["agentnb.expected"] = self.content.text(item.expected)
                    attrs["agentnb.actual"] = self.content.text(item.actual)
                run_span.events.append(SpanEvent("agentnb.replay_divergence", item.ts, attrs))
            elif isinstance(item, Transition):
                attrs = {"agentnb.next_step": item.next_step, "agentnb.forced": item.forced}
                if self.content is not None:
                    # the run's summary and the lessons it passed on (its `lesson` event holds the same text)
                    attrs.update({f"agentnb.{k}": self.content.text(v) for k, v in (
                        ("summary", item.summary), ("lessons", item.lessons)) if v})
                run_span.events.append(SpanEvent("agentnb.transition", item.ts, attrs))
            elif isinstance(item, ErrorEvent):
                if is_interruption(item):
                    (chat or run_span).events.append(self.error_event(item))
                elif chat is not None and attempt is not None and (is_compaction_error(item) or attempt.open):
                    # the call failed: its span runs to the failure
                    chat.error, chat.error_message = item.where or "error", scrub(item.message)
                    chat.end = max(chat.end, item.ts)
                    attempt.failed = True
                else:
                    host.events.append(self.error_event(item))
            elif isinstance(item, CommentEvent):
                host.events.append(self.comment(item))
            elif isinstance(item, Note):
                host.events.append(self.note(item))
            conversation.add(item)

    def chat_span(self, request: LLMRequest | None, response: LLMResponse | None, run_span: SpanRecord,
                  conversation: _JobMapper.Conversation | None, spec: str | None = None) -> SpanRecord:
        """A call's span, named by model ``spec`` (None: the job's); ``conversation`` None: a judge's call, whose
        prompt is not stored (only its answer)."""
        first = request if request is not None else response
        assert first is not None
        provider, model = _provider(spec) if spec else (self.provider, self.model)
        end = response.ts if response is not None else first.ts
        # a response stored without its request (an older store): the call began its latency before the answer
        start = request.ts if request is not None else end - ((response.latency_s or 0.0) if response else 0.0)
        span = SpanRecord(name=f"chat {model}", kind="client", span_id=self.span_id("call", first.id),
                          parent_id=run_span.span_id, start=start, end=max(start, end))
        a = span.attributes
        a.update({"gen_ai.operation.name": "chat", "gen_ai.provider.name": provider,
                  "gen_ai.request.model": model, "gen_ai.conversation.id": str(self.job.id),
                  "agentnb.iteration": first.iteration or 0})
        purpose = first.purpose
        if purpose:
            a["agentnb.purpose"] = purpose
        if conversation is not None and conversation.compacted:
            a["gen_ai.conversation.compacted"] = True
        if response is not None:
            u = response.usage
            a.update({"gen_ai.response.finish_reasons": [_finish_reason(response)],
                      "gen_ai.usage.input_tokens": u.prompt_tokens, "gen_ai.usage.output_tokens": u.completion_tokens,
                      "agentnb.usage.source": u.source})
            known = {"agentnb.cost_usd": self.costs.get(id(response)), "agentnb.latency_s": response.latency_s,
                     "gen_ai.response.time_to_first_chunk": response.ttft_s,
                     "gen_ai.response.model": response.response_model, "gen_ai.response.id": response.response_id,
                     "gen_ai.usage.cache_read.input_tokens": response.cached_tokens,
                     "agentnb.context.ratio": u.ratio, "agentnb.replayed_from": response.replayed_from,
                     "agentnb.cached": response.cached}
            a.update({k: v for k, v in known.items() if v is not None})  # "when known" (docs/otel.md#mapping)
        c = self.content
        if c is not None:
            if conversation is not None and conversation.system:
                system = scrub(conversation.system)
                a["gen_ai.system_instructions"] = c.within(lambda limit: [_text_part(_cut(system, limit))])
            if conversation is not None:
                a["gen_ai.input.messages"] = c.messages(conversation.messages)
            if request is not None:
                a["gen_ai.tool.definitions"] = c.within(
                    lambda limit: [{"type": "function", "name": name} for name in request.tools[:limit]])
            if response is not None:
                a["gen_ai.output.messages"] = c.messages(
                    [{**_assistant(response), "finish_reason": _finish_reason(response)}])
        return span

    def tool_span(self, use: ToolUse, run_span: SpanRecord) -> SpanRecord:
        first = use.call if use.call is not None else use.result
        assert first is not None
        end = use.result.ts if use.result is not None else first.ts
        span = SpanRecord(name=f"execute_tool {use.tool}", kind="internal", span_id=self.span_id("tool", first.id),
                          parent_id=run_span.span_id, start=first.ts, end=max(first.ts, end))
        a = span.attributes
        a.update({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": use.tool,
                  "gen_ai.tool.call.id": use.call_id, "gen_ai.tool.type": "mcp" if use.server else "function"})
        if use.server:
            a["agentnb.mcp.server"] = use.server
        result = use.result
        if result is not None:
            a["agentnb.tool.truncated"] = result.truncated
            if result.is_error:
                span.error, span.error_message = "tool_error", f"{use.tool} returned an error"
        if self.content is not None:
            if use.call is not None:
                a["gen_ai.tool.call.arguments"] = self.content.data(use.call.arguments)
            if result is not None:
                a["gen_ai.tool.call.result"] = self.content.text(result.content)
        return span

    # -- span events of the job ------------------------------------------------------------------------
    def comment(self, ev: CommentEvent) -> SpanEvent:
        # a user's comment is a reply to the job (docs/job-states.md); the agent's are its questions
        name = "agentnb.human_reply" if ev.author == "user" else "agentnb.comment"
        attrs: dict[str, AttrValue] = {"agentnb.author": ev.author}
        if self.content is not None:
            attrs["agentnb.body"] = self.content.text(ev.body)
        return SpanEvent(name, ev.ts, attrs)

    def score(self, ev: ScoreEvent) -> SpanEvent:
        attrs: dict[str, AttrValue] = {"gen_ai.evaluation.name": ev.name}
        if isinstance(ev.value, (bool, int, float)):
            attrs["gen_ai.evaluation.score.value"] = float(ev.value)
        elif isinstance(ev.value, str):
            attrs["gen_ai.evaluation.score.label"] = scrub(ev.value)
        if ev.error:
            attrs["error.type"] = "scorer_error"
        return SpanEvent("gen_ai.evaluation.result", ev.ts, attrs)

    def error_event(self, ev: ErrorEvent) -> SpanEvent:
        return SpanEvent("agentnb.error", ev.ts, {"error.type": ev.where or "error", "agentnb.message": scrub(ev.message)})

    def note(self, n: Note) -> SpanEvent:
        attrs: dict[str, AttrValue] = {}
        if self.content is not None:
            attrs["agentnb.text"] = self.content.text(n.text)
        return SpanEvent(f"agentnb.{n.event.kind}", n.event.ts, attrs)


def _ts(item: Any) -> float:
    if isinstance(item, ToolUse):
        return max(e.ts for e in (item.call, item.result) if e is not None)
    if isinstance(item, Note):
        return item.event.ts
    return float(item.ts)


def trace_of(store: Store, root: JobRecord, *, content: bool = False, max_chars: int = DEFAULT_MAX_CHARS,
             identity: str | None = None, batch_names: Mapping[str, Any] | None = None) -> TraceRecord:
    """The trace of root job ``root`` and its subtasks (all generations), as plain records."""
    identity = identity if identity is not None else store_identity(store)
    cut = _Content(max_chars) if content else None
    spans: list[SpanRecord] = []
    pending: list[tuple[JobRecord, int | None]] = [(root, None)]
    while pending:
        job, parent = pending.pop(0)
        mapper = _JobMapper(store, identity, job, parent, cut)
        spans += mapper.map()
        for child in store.jobs(parent_id=job.id):
            pending.append((child, mapper.subtask_parents.get(child.id, mapper.job_span.span_id)))
    return TraceRecord(trace_id=_hash_id(128, identity, "trace", root.id), resource=_resource(root), spans=tuple(spans))


def _resource(root: JobRecord) -> dict[str, AttrValue]:
    forked = root.forked_from_job is not None
    known = {"agentnb.batch": root.batch, "agentnb.case": root.batch_case, "agentnb.variant": root.batch_variant,
             "agentnb.epoch": root.batch_epoch,
             "agentnb.forked_from": root.forked_from_job, "agentnb.forked_at": root.forked_from_seq if forked else None}
    return {"service.name": "agentnb", **{k: v for k, v in known.items() if v is not None}}


def job_trace(store: Store, job: JobRecord, *, content: bool = False, max_chars: int = DEFAULT_MAX_CHARS,
              identity: str | None = None, runs: Collection[int] | None = None) -> TraceRecord:
    """The spans of job ``job`` alone (not its subtasks'), with the ids, parent and resource that
    :func:`trace_of` of its root job gives them: what live export sends as the job runs (docs/otel.md#live).
    With ``runs`` (movement seqs), only the spans of those runs, mapped from their own events: a run that ends
    costs its events, not the job's so far again."""
    identity = identity if identity is not None else store_identity(store)
    parent_span: int | None = None
    root = job
    if job.parent_id is not None:
        # under the parent's run whose transition asked for it (the mapper's subtask_parents), else its job span
        parent_span = _hash_id(64, identity, job.parent_id, "job")
        for ev in store.events(job.parent_id, kinds=["transition"]):
            if isinstance(ev, Transition) and any(s.job_id == job.id for s in ev.subtasks or ()):
                parent_span = _hash_id(64, identity, job.parent_id, "run", ev.movement_seq)
        seen = {root.id}
        while root.parent_id is not None and root.parent_id not in seen:
            root = store.job(root.parent_id)
            seen.add(root.id)
    cut = _Content(max_chars) if content else None
    if runs is not None:
        # a run's events all carry its seq (any subset of a job's events folds the same way: views/timeline.py)
        events = [e for seq in sorted(runs) for e in store.events(job.id, movement_seq=seq)]
        spans = _JobMapper(store, identity, job, parent_span, cut, events).map_runs()
    else:
        spans = _JobMapper(store, identity, job, parent_span, cut).map()
    return TraceRecord(trace_id=_hash_id(128, identity, "trace", root.id), resource=_resource(root), spans=tuple(spans))
