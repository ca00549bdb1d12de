"""Events: the single typed contract for everything a job does.

Each event kind is one frozen dataclass whose ``kind`` is a ``Literal`` tag, so a type checker narrows
:data:`Event` on ``event.kind == "tool_result"`` or on ``match event: case ToolResult(...)``.  The
engine builds these objects and the store keeps them as rows ``(id, job_id, movement_seq, iteration,
ts, kind, payload)``, where ``payload`` is the JSON of the kind's own fields.  Serialisation both ways
lives here and nowhere else (:func:`payload_json`, :func:`event_from_row`); every view (HTML, widgets,
DataFrames, exported notebooks) is derived from these objects.

Constructors are keyword-only: an unknown field is a ``TypeError`` and a missing required one too, at
write time.  :func:`check_event` also checks every field's type; the store runs it on each event it
appends when ``AGENTNB_STRICT_EVENTS`` is set (the test suite sets it), so a wrong value fails the test
that wrote it instead of being stored.
"""

from __future__ import annotations

import json
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, ClassVar, Literal, Union

__all__ = [
    "ACTIONS",
    "EVENT_KINDS",
    "BudgetExceeded",
    "CommentEvent",
    "Compaction",
    "ContextAction",
    "ContextActionName",
    "ErrorEvent",
    "Event",
    "EventBase",
    "EventKind",
    "JobStatusEvent",
    "LLMRequest",
    "LLMResponse",
    "Lesson",
    "LoopDetected",
    "MovementStart",
    "RecordedToolCall",
    "Reminder",
    "ReplayDivergence",
    "ScoreEvent",
    "Subtask",
    "ToolCallEvent",
    "ToolResult",
    "Transition",
    "Usage",
    "UsageSource",
    "check_event",
    "encode_payload",
    "event_from_row",
    "field_hints",
    "payload_dict",
    "payload_json",
    "payload_path",
    "strict_events",
    "value_data",
]

EventKind = Literal[
    "job_status", "movement_start", "llm_request", "llm_response", "tool_call", "tool_result",
    "context_action", "reminder", "transition", "lesson", "comment", "error", "score", "replay_divergence",
    "loop_detected", "compaction", "budget",
]
# "estimate": tokens counted locally for a call that never finished (a stream stopped mid-answer, docs/models.md#streaming)
UsageSource = Literal["usage", "tiktoken", "chars", "estimate"]
# the ContextManager's actions, in threshold order (a context_action's `action`, frames' `action` categories)
ContextActionName = Literal["warn", "prompt", "force_transition", "exhausted"]
ACTIONS: tuple[ContextActionName, ...] = typing.get_args(ContextActionName)
# how exact each source is: a sum is only as exact as its least exact part
_EXACTNESS: dict[str, int] = {"usage": 2, "tiktoken": 1, "chars": 0, "estimate": 0}


# -- value types ---------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class Usage:
    """Tokens of one LLM call (or a sum of calls) and where the count came from.

    ``source`` is ``usage`` (the endpoint reported it), ``tiktoken`` (counted locally) or ``chars``
    (estimated from characters).  Adding two gives the least exact source of the two.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    source: UsageSource = "usage"
    # the ContextManager's view of the call, kept with it in ``llm_response``; None in a sum
    window: int | None = None
    ratio: float | None = None
    encoding: str | None = None  # the tokenizer behind tiktoken counts and tool budgets

    def __add__(self, other: Usage) -> Usage:
        if not isinstance(other, Usage):
            return NotImplemented
        source = min(self.source, other.source, key=_EXACTNESS.__getitem__)
        return Usage(prompt_tokens=self.prompt_tokens + other.prompt_tokens,
                     completion_tokens=self.completion_tokens + other.completion_tokens,
                     total_tokens=self.total_tokens + other.total_tokens, source=source)


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordedToolCall:
    """A tool call as the model made it, kept in ``llm_response``.  ``raw_arguments`` holds the model's
    own argument text when re-encoding ``arguments`` would change it, so a resumed movement re-sends it."""

    id: str
    name: str
    arguments: Any
    raw_arguments: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Subtask:
    """A child job a ``WAIT_SUBTASKS`` transition created."""

    instruction: str
    piece: str
    model: str
    job_id: int


# -- events ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class EventBase:
    """The row's columns; each subclass adds its payload fields."""

    job_id: int
    movement_seq: int | None = None
    iteration: int | None = None
    ts: float = 0.0
    id: int | None = None

    kind: ClassVar[EventKind]
    # filled in below from the dataclass fields: the names kept in ``payload``
    payload_keys: ClassVar[tuple[str, ...]] = ()

    @property
    def payload(self) -> dict[str, Any]:
        """The stored payload as plain JSON data (for users' own code; agentnb's views read the fields)."""
        return payload_dict(self)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True, slots=True)
class JobStatusEvent(EventBase):
    kind: ClassVar[Literal["job_status"]] = "job_status"
    status: str
    reason: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class MovementStart(EventBase):
    kind: ClassVar[Literal["movement_start"]] = "movement_start"
    movement: str
    seq: int
    system: str
    user: str  # the prompts as sent; a long one is stored once in ``texts`` and referred to
    # a fork's run re-served from this job's record (docs/fork-compare.md#fork); not stored when None
    replayed_from: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class LLMRequest(EventBase):
    kind: ClassVar[Literal["llm_request"]] = "llm_request"
    messages: int  # how many messages were sent
    tools: list[str]
    # why the call was made when it is not a turn of the conversation: "compaction" (docs/context.md#compaction), a
    # summarisation call without tools; "judge" (docs/design-lab.md#llm-judge), an LLM judge scoring the ended job,
    # outside any movement run.  Not stored when None.
    purpose: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class LLMResponse(EventBase):
    kind: ClassVar[Literal["llm_response"]] = "llm_response"
    content: str | None
    tool_calls: list[RecordedToolCall]
    usage: Usage
    latency_s: float | None = None  # wall time of the model call (retries included); None in older stores
    # time to first token of a streamed call (from the call's start, retries included); None when not streamed.
    # Not stored when None, so a scripted or demo run's events stay what they were
    ttft_s: float | None = None
    # A fork's call re-served from this job's record (docs/fork-compare.md#fork): no model was asked, so ``usage`` spends
    # nothing (its tokens are 0; ``ratio``/``window`` keep the context as it was).  Not stored when None.
    replayed_from: int | None = None
    # the request's purpose, repeated here so a response is known for what it is without its request
    purpose: str | None = None
    # what the endpoint said of its answer (an openai: model's; a replay repeats its original's): the model that
    # answered, the completion's id, why it stopped (``stop``, ``tool_calls``, ``length``…), and the prompt tokens
    # it read from its cache.  Not stored when None (scripted and demo calls)
    response_model: str | None = None
    response_id: str | None = None
    finish_reason: str | None = None
    cached_tokens: int | None = None
    # answered from the call cache (docs/design-lab.md#call-cache): no model was asked, so ``usage`` spends nothing
    # (0 tokens; ``ratio``/``window`` keep the context as it was).  Not stored unless true
    cached: bool | None = None
    # the model spec that answered when it is not the job's own: an LLM judge's (purpose "judge",
    # docs/design-lab.md#llm-judge), which prices the call.  Not stored when None
    model: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCallEvent(EventBase):
    kind: ClassVar[Literal["tool_call"]] = "tool_call"
    tool: str
    arguments: Any
    call_id: str
    server: str | None = None  # the MCP server whose tool this is (docs/tools.md#mcp-tools); None: not one


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolResult(EventBase):
    kind: ClassVar[Literal["tool_result"]] = "tool_result"
    tool: str
    call_id: str
    content: str
    is_error: bool = False
    truncated: bool = False
    original_chars: int = 0
    returned_chars: int = 0
    # how to read on after a cut, in the tool's own terms (e.g. {"path", "offset"} or {"path", "byte_offset"})
    continuation: dict[str, Any] | None = None
    image: str | None = None  # a data URL the model was shown
    budget_tokens: int | None = None  # the token budget the tool's output was cut to
    server: str | None = None  # the MCP server whose tool this is (docs/tools.md#mcp-tools); None: not one


@dataclass(frozen=True, kw_only=True, slots=True)
class ContextAction(EventBase):
    kind: ClassVar[Literal["context_action"]] = "context_action"
    action: ContextActionName
    ratio: float
    tokens: int
    window: int
    threshold: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Reminder(EventBase):
    kind: ClassVar[Literal["reminder"]] = "reminder"
    text: str
    reason: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Transition(EventBase):
    kind: ClassVar[Literal["transition"]] = "transition"
    movement: str
    next_step: str
    summary: str = ""
    lessons: str = ""
    forced: bool = False
    reason: str = ""
    question: str | None = None
    feedback: str | None = None
    subtasks: list[Subtask] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Lesson(EventBase):
    kind: ClassVar[Literal["lesson"]] = "lesson"
    lessons: str
    summary: str = ""
    movement: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class CommentEvent(EventBase):
    kind: ClassVar[Literal["comment"]] = "comment"
    author: str
    body: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ErrorEvent(EventBase):
    """Something failed; ``message`` is the line a user reads, ``where`` the part that failed.

    ``detail`` is the cause alone, as data, where a reader needs it apart from the message: a failed
    compaction's summarisation call (``where: "compaction"``) keeps its model error there, which a fork or
    replay re-serves (``models/replay.py``).  None (and absent from the payload) otherwise, and in every
    error event stored before it existed.
    """

    kind: ClassVar[Literal["error"]] = "error"
    message: str
    where: str = ""
    detail: str | None = None
    # a call stopped mid-answer (``where: "interrupted"``, docs/models.md#streaming): the tokens it had spent, counted
    # locally (``source: "estimate"``); None (and absent from the payload) otherwise
    usage: Usage | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoreEvent(EventBase):
    """One scorer's verdict on a finished job (docs/design-lab.md); the latest per ``name`` is the job's score.

    ``value`` is None exactly when the scorer raised or returned something that is not a bool, int,
    float or str; ``error`` then says what happened.
    """

    kind: ClassVar[Literal["score"]] = "score"
    name: str
    value: bool | int | float | str | None = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayDivergence(EventBase):
    """A tool re-run in a fork's re-served run gave another result than the original's (docs/fork-compare.md#fork).

    ``seq`` is the movement run; the row's ``iteration`` is stored in the payload too (docs/events.md lists it).
    ``expected`` is the original's result, ``actual`` the fork's (each as the model would read it).
    """

    kind: ClassVar[Literal["replay_divergence"]] = "replay_divergence"
    seq: int
    call_id: str
    tool: str
    expected: str
    actual: str


@dataclass(frozen=True, kw_only=True, slots=True)
class LoopDetected(EventBase):
    """A loop monitor fired (docs/context.md#loop-monitors): the runs ended with ``cycle`` repeated ``count`` times since the
    monitor's last judgement.  The row's ``movement_seq`` is the run that closed the loop; ``summaries`` are the
    transition summaries of the runs in the loop (``runs``, in order).  ``judge`` is the name of the judge's
    run that follows (None: the monitor has no judge and sends the job to ``next``)."""

    kind: ClassVar[Literal["loop_detected"]] = "loop_detected"
    monitor: str
    cycle: list[str]
    count: int
    summaries: list[str]
    runs: list[int]
    judge: str | None = None
    next: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Compaction(EventBase):
    """A movement's messages were replaced by a summary (docs/context.md#compaction, ``context.on_pressure: compact``).

    The conversation became: the system prompt, the user prompt, one message holding ``summary``, then the
    last ``kept_messages`` messages as they were; ``removed_messages`` messages were dropped.  ``tokens_before``
    is the context's size before (the ContextManager's estimate, as for its actions), ``tokens_after`` the new
    list's count (tools included).  The row's ``iteration`` — the summarisation call's — is in the payload too.
    """

    kind: ClassVar[Literal["compaction"]] = "compaction"
    tokens_before: int
    tokens_after: int
    removed_messages: int
    kept_messages: int
    summary: str


@dataclass(frozen=True, kw_only=True, slots=True)
class BudgetExceeded(EventBase):
    """A job reached a cost or token limit (docs/design-lab.md#budgets) after its call ``iteration``; it is aborted.

    ``measure`` is ``cost_usd`` or ``tokens``; ``spent`` what the job and its subtasks had spent (None: a call's
    price is unknown, which never counts as 0); ``limit`` the limit of job ``limit_job`` (this job, or the
    ancestor whose limit covers it); ``reason`` the job's status reason (``budget: $0.52 of $0.50``)."""

    kind: ClassVar[Literal["budget"]] = "budget"
    measure: str
    spent: float | None
    limit: float
    limit_job: int
    reason: str


Event = (
    JobStatusEvent
    | MovementStart
    | LLMRequest
    | LLMResponse
    | ToolCallEvent
    | ToolResult
    | ContextAction
    | Reminder
    | Transition
    | Lesson
    | CommentEvent
    | ErrorEvent
    | ScoreEvent
    | ReplayDivergence
    | LoopDetected
    | Compaction
    | BudgetExceeded
)

_CLASSES: tuple[type[EventBase], ...] = typing.get_args(Event)
_BY_KIND: dict[str, type[EventBase]] = {cls.kind: cls for cls in _CLASSES}
EVENT_KINDS: tuple[str, ...] = tuple(_BY_KIND)
_BASE_FIELDS = frozenset(f.name for f in fields(EventBase))
for _cls in _CLASSES:
    _cls.payload_keys = tuple(f.name for f in fields(_cls) if f.name not in _BASE_FIELDS)
# nested value types, rebuilt from their dicts on read
_NESTED: dict[str, dict[str, type]] = {
    "llm_response": {"usage": Usage},
    "error": {"usage": Usage},
}
_NESTED_LISTS: dict[str, dict[str, type]] = {
    "llm_response": {"tool_calls": RecordedToolCall},
    "transition": {"subtasks": Subtask},
}


# -- naming payload fields (the frames' SQL and column specs): checked against the dataclasses

def payload_path(cls: type, *names: str) -> str:
    """The JSON path ``$.a.b`` of field ``a`` of event class ``cls`` (then ``b`` of its value type),
    checked against the dataclass fields: an unknown name is a ``LookupError``."""
    owner: Any = cls
    for name in names:
        known = {f.name for f in fields(owner)}
        if isinstance(owner, type) and issubclass(owner, EventBase):
            known -= _BASE_FIELDS  # the row's columns, not the payload's
        if name not in known:
            raise LookupError(f"{owner.__name__} has no payload field {name!r} (fields: {', '.join(sorted(known))})")
        owner = _value_type(field_hints(owner)[name])
    return "$." + ".".join(names)


def field_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)`` of an event (or value) dataclass, worked out once per class and shared: the
    annotations are strings, compiled again on each call, and the frames' SQL names payload fields some 600 times
    at import (about 0.1 s of every process's start-up before this).  Read it, never change it."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


_HINTS: dict[type, dict[str, Any]] = {}


def _value_type(hint: Any) -> Any:
    """The dataclass inside ``hint`` (``Usage``, ``list[RecordedToolCall]``, ``X | None``), else None."""
    if is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        found = _value_type(arg)
        if found is not None:
            return found
    return None


# -- serialisation: the one place payload JSON is written and read --------------------------------------

_VALUE_TYPES = (Usage, RecordedToolCall, Subtask)


def value_data(obj: Usage | RecordedToolCall | Subtask) -> dict[str, Any]:
    """A nested value as it is stored in the payload JSON."""
    cls = type(obj)
    out = _VALUE_READERS[cls](obj)
    if cls is RecordedToolCall and out["raw_arguments"] is None:
        del out["raw_arguments"]  # kept only when it differs from the re-encoded arguments
    elif cls is Usage and out["window"] is None and out["ratio"] is None and out["encoding"] is None:
        del out["window"], out["ratio"], out["encoding"]  # a sum, not one call's accounting
    return out


def _stored(value: Any) -> Any:
    """A field that holds a value type (or a list of them), as stored."""
    if isinstance(value, _VALUE_TYPES):
        return value_data(value)
    if isinstance(value, list) and value and isinstance(value[0], _VALUE_TYPES):
        return [value_data(v) for v in value]
    return value


def _reader(fields_: dict[str, str]) -> Callable[[Any], dict[str, Any]]:
    """``lambda o: {"a": o.a, "b": _stored(o.b), ...}``: one dict display per type, from ``{key: expression}``.

    An event is turned into its payload once, ~5 per LLM call (benchmarks/overhead.py): a dict display
    built once per type costs a third of a loop over the field names that checks every value.
    """
    body = ", ".join(f"{key!r}: {expr}" for key, expr in fields_.items())
    return eval(f"lambda o: {{{body}}}", {"_stored": _stored})  # only field names of the classes above


def _payload_fields(cls: type[EventBase]) -> dict[str, str]:
    nested = {*_NESTED.get(cls.kind, {}), *_NESTED_LISTS.get(cls.kind, {})}
    out = {k: f"_stored(o.{k})" if k in nested else f"o.{k}" for k in cls.payload_keys}
    if cls.kind == "context_action":
        # docs/events.md lists `iteration` among this kind's payload keys; it lives in the row's column too.
        # Stored before `threshold`, where the engine has always written it (the stored JSON stays the same).
        threshold = out.pop("threshold")
        out["iteration"] = "o.iteration"
        out["threshold"] = threshold
    elif cls.kind == "replay_divergence":
        out = {"seq": out.pop("seq"), "iteration": "o.iteration", **out}  # docs/events.md lists it too
    elif cls.kind == "compaction":
        out["iteration"] = "o.iteration"  # docs/events.md lists it too
    return out


# Fields added after stores existed, kept out of the payload while None: the JSON of every event that
# does not use them stays what it was (and a replay's events stay equal to its original's).
_OMIT_NONE: dict[EventKind, tuple[str, ...]] = {"movement_start": ("replayed_from",),
                                                "llm_request": ("purpose",),
                                                "llm_response": ("ttft_s", "replayed_from", "purpose", "response_model",
                                                                 "response_id", "finish_reason", "cached_tokens", "cached",
                                                                 "model"),
                                                "error": ("detail", "usage"),
                                                "tool_call": ("server",), "tool_result": ("server",)}
_ROW_IN_PAYLOAD: dict[str, frozenset[str]] = {"context_action": frozenset({"iteration"}),
                                              "replay_divergence": frozenset({"iteration"}),
                                              "compaction": frozenset({"iteration"})}


_VALUE_READERS = {cls: _reader({f.name: f"o.{f.name}" for f in fields(cls)}) for cls in _VALUE_TYPES}
_PAYLOAD_READERS = {cls.kind: _reader(_payload_fields(cls)) for cls in _CLASSES}


def _omitting(read: Callable[[Any], dict[str, Any]], keys: tuple[str, ...]) -> Callable[[Any], dict[str, Any]]:
    def payload(o: Any) -> dict[str, Any]:
        out = read(o)
        for key in keys:
            if out[key] is None:
                del out[key]
        return out

    return payload


for _kind, _keys in _OMIT_NONE.items():
    _PAYLOAD_READERS[_kind] = _omitting(_PAYLOAD_READERS[_kind], _keys)
# compact and UTF-8 as stored; default=str keeps a stray non-JSON value (a Path) readable instead of failing a run
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=str)


def payload_dict(event: Event) -> dict[str, Any]:
    """The kind's own fields as plain JSON data, exactly as stored in the ``payload`` column."""
    return _PAYLOAD_READERS[event.kind](event)


def encode_payload(data: Mapping[str, Any]) -> str:
    """Payload data as the JSON text stored (the one encoder; the store uses it after putting its text
    references into the data)."""
    return _ENCODER.encode(data)


def payload_json(event: Event) -> str:
    """The ``payload`` column for ``event``."""
    if _STRICT:
        check_event(event)
    return encode_payload(payload_dict(event))


def event_from_row(row: Mapping[str, Any] | tuple[Any, ...]) -> Event:
    """Build the typed event of a stored row ``(id, job_id, movement_seq, iteration, ts, kind, payload)``."""
    if isinstance(row, tuple):
        id_, job_id, seq, iteration, ts, kind, payload = row
    else:
        id_, job_id, seq, iteration, ts, kind, payload = (
            row["id"], row["job_id"], row["movement_seq"], row["iteration"], row["ts"], row["kind"], row["payload"],
        )
    cls = _BY_KIND[kind]
    data = json.loads(payload) if isinstance(payload, str) else dict(payload)
    values: dict[str, Any] = {}
    for key in cls.payload_keys:
        if key in data:
            values[key] = data[key]
    for key, vtype in _NESTED.get(kind, {}).items():
        if isinstance(values.get(key), dict):
            values[key] = vtype(**values[key])
    for key, vtype in _NESTED_LISTS.get(kind, {}).items():
        if isinstance(values.get(key), list):
            values[key] = [vtype(**item) for item in values[key]]
    if _STRICT:
        unknown = set(data) - set(cls.payload_keys) - {"_texts"} - _ROW_IN_PAYLOAD.get(kind, frozenset())
        if unknown:
            raise ValueError(f"{kind} event {id_}: unknown payload key(s) {sorted(unknown)}")
    return cls(job_id=job_id, movement_seq=seq, iteration=iteration, ts=ts, id=id_, **values)  # type: ignore[return-value]


# -- strict checking (tests) ----------------------------------------------------------------------------

def strict_events() -> bool:
    """Whether every appended event is type-checked (``AGENTNB_STRICT_EVENTS`` set to anything but 0/empty)."""
    return os.environ.get("AGENTNB_STRICT_EVENTS", "") not in ("", "0")


_STRICT = strict_events()


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if origin is Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def check_event(event: Event | Usage | RecordedToolCall | Subtask) -> None:
    """Raise ``TypeError`` naming the first field whose value does not match its annotation."""
    cls = type(event)
    hints = field_hints(cls)
    for f in fields(event):
        value = getattr(event, f.name)
        if not _matches(value, hints[f.name]):
            raise TypeError(f"{getattr(cls, 'kind', cls.__name__)}.{f.name}: {value!r} is not {hints[f.name]}")
        if isinstance(value, (Usage, RecordedToolCall, Subtask)):
            check_event(value)
        elif isinstance(value, list):
            for v in value:
                if isinstance(v, (Usage, RecordedToolCall, Subtask)):
                    check_event(v)
