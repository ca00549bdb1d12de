"""The messages of a conversation with a model, as typed parts: what the engine builds and a model reads.

A movement's conversation is a sequence of :data:`Message`: the system and user prompts, the model's
answers (text and :class:`ToolCallPart`), the tools' results, and the user messages the engine adds
(reminders, a compaction's summary, a tool's attached images).  They are frozen, so a list the loop
keeps can be handed to a model, re-sent and compacted without copies.

No provider's wire format lives here: the ``openai:`` adapter turns them into Chat Completions
messages (``models/openai.py``), and the ContextManager counts their text (``engine/context.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ..events import UsageSource

__all__ = [
    "AssistantMessage",
    "Delta",
    "ImagePart",
    "Message",
    "SystemMessage",
    "TokenUsage",
    "ToolCallPart",
    "ToolMessage",
    "UserMessage",
]


@dataclass(frozen=True, slots=True)
class ToolCallPart:
    """One tool call of the model's answer."""

    id: str
    name: str
    arguments: Any  # a dict, or the raw string when the model sent invalid JSON
    # the model's own argument text, kept when re-encoding ``arguments`` would not give it back
    raw_arguments: str = ""

    def arguments_text(self) -> str:
        """The arguments as the model is sent them back: its own text when kept, else ``arguments`` as JSON."""
        return self.raw_arguments or json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class Delta:
    """A fragment of an answer as it streams in (docs/models.md#streaming): some text, or a piece of tool call
    ``tool_index`` (its id and name in the fragment that opens it, then its JSON argument text in pieces).

    Deltas are shown live and never stored: the answer they add up to is recorded as one ``llm_response``.
    ``restart``: what streamed so far is void (the stream broke off and the call is asked again): a view starts the
    answer afresh.
    """

    text: str = ""
    tool_index: int | None = None
    tool_id: str | None = None
    tool_name: str | None = None
    arguments: str = ""
    restart: bool = False


@dataclass(frozen=True, slots=True)
class ImagePart:
    """An image attached to a user message (a tool's image, sent after its result)."""

    url: str  # a data: URL


@dataclass(frozen=True, slots=True)
class SystemMessage:
    text: str
    role: ClassVar[Literal["system"]] = "system"


@dataclass(frozen=True, slots=True)
class UserMessage:
    """The user prompt, or a message the engine adds: a reminder, a compaction's summary, an attachment."""

    text: str
    images: tuple[ImagePart, ...] = ()
    role: ClassVar[Literal["user"]] = "user"


@dataclass(frozen=True, slots=True)
class AssistantMessage:
    """The model's answer: its text (None when it only called tools) and its tool calls, in order."""

    text: str | None
    tool_calls: tuple[ToolCallPart, ...] = ()
    role: ClassVar[Literal["assistant"]] = "assistant"


@dataclass(frozen=True, slots=True)
class ToolMessage:
    """A tool's result, answering the call ``call_id``."""

    call_id: str
    text: str
    role: ClassVar[Literal["tool"]] = "tool"


Message = SystemMessage | UserMessage | AssistantMessage | ToolMessage


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """The tokens a call reported: its prompt's, and its answer's (None when not reported: the
    ContextManager counts the answer); ``source``, from a recording, is where its counts came from."""

    prompt_tokens: int
    completion_tokens: int | None = None
    source: UsageSource | None = None
