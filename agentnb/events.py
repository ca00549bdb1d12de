"""Events: the single source of truth for everything a job does.

Each event is a frozen dataclass with a ``kind`` tag; the union :data:`Event` is
closed.  Events are stored as rows ``(id, job_id, movement_seq, iteration, ts,
kind, payload)`` where ``payload`` is the JSON of the kind-specific fields.
Every view (HTML, widgets, DataFrames, exported notebooks) is derived from them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping, Union

__all__ = [
    "EVENT_KINDS",
    "Event",
    "EventBase",
    "JobStatusEvent",
    "MovementStart",
    "LLMRequest",
    "LLMResponse",
    "ToolCallEvent",
    "ToolResult",
    "ContextAction",
    "Reminder",
    "Transition",
    "Lesson",
    "CommentEvent",
    "ErrorEvent",
    "event_from_row",
]


@dataclass(frozen=True)
class EventBase:
    job_id: int
    movement_seq: int | None = None
    iteration: int | None = None
    ts: float = 0.0
    id: int | None = None

    kind: ClassVar[str] = ""
    _payload_keys: ClassVar[tuple[str, ...]] = ()

    @property
    def payload(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._payload_keys}


def _kind(name: str):  # type: ignore[no-untyped-def]
    """Class decorator: set the kind tag and remember which fields are payload."""

    def wrap(cls):  # type: ignore[no-untyped-def]
        cls.kind = name
        base = {f.name for f in fields(EventBase)}
        cls._payload_keys = tuple(f.name for f in fields(cls) if f.name not in base)
        return cls

    return wrap


@_kind("job_status")
@dataclass(frozen=True)
class JobStatusEvent(EventBase):
    status: str = ""
    reason: str = ""


@_kind("movement_start")
@dataclass(frozen=True)
class MovementStart(EventBase):
    movement: str = ""
    seq: int = 0
    system: str = ""
    user: str = ""


@_kind("llm_request")
@dataclass(frozen=True)
class LLMRequest(EventBase):
    messages: int = 0
    tools: list[str] = field(default_factory=list)


@_kind("llm_response")
@dataclass(frozen=True)
class LLMResponse(EventBase):
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    latency_s: float | None = None  # wall time of the model call (retries included); None in older stores


@_kind("tool_call")
@dataclass(frozen=True)
class ToolCallEvent(EventBase):
    tool: str = ""
    arguments: Any = None
    call_id: str = ""


@_kind("tool_result")
@dataclass(frozen=True)
class ToolResult(EventBase):
    tool: str = ""
    call_id: str = ""
    content: str = ""
    is_error: bool = False
    truncated: bool = False
    original_chars: int = 0
    returned_chars: int = 0
    continuation: dict[str, Any] | None = None
    image: str | None = None
    budget_tokens: int | None = None  # the token budget the tool's output was cut to


@_kind("context_action")
@dataclass(frozen=True)
class ContextAction(EventBase):
    action: str = ""
    ratio: float = 0.0
    tokens: int = 0
    window: int = 0
    threshold: float = 0.0

    @property
    def payload(self) -> dict[str, Any]:
        # DESIGN §6 lists `iteration` among this kind's payload keys; it lives in the row's column
        return {**super().payload, "iteration": self.iteration}


@_kind("reminder")
@dataclass(frozen=True)
class Reminder(EventBase):
    text: str = ""
    reason: str = ""


@_kind("transition")
@dataclass(frozen=True)
class Transition(EventBase):
    movement: str = ""
    next_step: str = ""
    summary: str = ""
    lessons: str = ""
    forced: bool = False
    reason: str = ""
    question: str | None = None
    feedback: str | None = None
    subtasks: list[dict[str, Any]] | None = None


@_kind("lesson")
@dataclass(frozen=True)
class Lesson(EventBase):
    lessons: str = ""
    summary: str = ""
    movement: str = ""


@_kind("comment")
@dataclass(frozen=True)
class CommentEvent(EventBase):
    author: str = ""
    body: str = ""


@_kind("error")
@dataclass(frozen=True)
class ErrorEvent(EventBase):
    message: str = ""
    where: str = ""


Event = Union[
    JobStatusEvent,
    MovementStart,
    LLMRequest,
    LLMResponse,
    ToolCallEvent,
    ToolResult,
    ContextAction,
    Reminder,
    Transition,
    Lesson,
    CommentEvent,
    ErrorEvent,
]

_BY_KIND: dict[str, type[EventBase]] = {
    cls.kind: cls
    for cls in (
        JobStatusEvent,
        MovementStart,
        LLMRequest,
        LLMResponse,
        ToolCallEvent,
        ToolResult,
        ContextAction,
        Reminder,
        Transition,
        Lesson,
        CommentEvent,
        ErrorEvent,
    )
}
EVENT_KINDS: tuple[str, ...] = tuple(_BY_KIND)


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
    known = {k: data[k] for k in cls._payload_keys if k in data}
    return cls(job_id=job_id, movement_seq=seq, iteration=iteration, ts=ts, id=id_, **known)  # type: ignore[return-value]
