"""The ContextManager: token accounting, thresholds and tool-output budgets.

After each LLM call it records the prompt size — the response's
``usage.prompt_tokens`` when given, else a tiktoken count of the movement's
messages, else a character estimate — and fires each threshold action at most
once per movement.  When an earlier call of the movement reported usage, a
call without it counts on from that size (the messages added since).  Counting is incremental: each message is tokenized once when
it is appended, so a movement of N calls costs O(total message size).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..events import ACTIONS, ContextActionName, UsageSource
from ..models.messages import AssistantMessage, Message, TokenUsage, UserMessage
from .pieces import COMPACTION_DEFAULTS, DEFAULT_THRESHOLDS, ON_PRESSURE
from .tokens import CHARS_PER_TOKEN, TokenCounter, counter_for_model

if TYPE_CHECKING:
    from ..store.base import JobOptions

__all__ = [
    "DEFAULT_MIN_TOOL_TOKENS",
    "DEFAULT_WINDOW",
    "KNOWN_WINDOWS",
    "MAX_TOOL_TOKENS",
    "ContextDecision",
    "ContextManager",
    "check_context_options",
    "context_items",
    "job_thresholds",
    "window_for_model",
]

DEFAULT_WINDOW = 128_000
DEFAULT_MIN_TOOL_TOKENS = 1_000
MAX_TOOL_TOKENS = 60_000

# Context windows of well-known models (prefix match, longest first).
KNOWN_WINDOWS: dict[str, int] = {
    "demo": 8_192,
    "gpt-4.1": 1_047_576,
    "gpt-4o": 128_000,
    "gpt-4-turbo": 128_000,
    "gpt-4-32k": 32_768,
    "gpt-4": 8_192,
    "gpt-3.5-turbo": 16_385,
    "gpt-5": 400_000,
    "o1": 200_000,
    "o3": 200_000,
    "o4-mini": 200_000,
    "claude": 200_000,
    "llama-3": 128_000,
    "qwen": 32_768,
    "mistral": 32_768,
}


def window_for_model(model: str) -> int:
    """The context window of a model spec (``openai:gpt-4o``, ``demo`` …), or the default."""
    name = model.split(":", 1)[-1].lower()
    for prefix in sorted(KNOWN_WINDOWS, key=len, reverse=True):
        if name.startswith(prefix):
            return KNOWN_WINDOWS[prefix]
    return DEFAULT_WINDOW


def _whole(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"context.{name}={value!r}; allowed: a whole number ≥ {minimum}")
    return value


def check_thresholds(thresholds: Mapping[str, Any], *, complete: bool = False) -> dict[str, float]:
    """Validate threshold overrides: known actions, ratios in (0, 1], and (when ``complete``) in order."""
    if not isinstance(thresholds, Mapping):
        raise ValueError(f"context.thresholds={thresholds!r}; allowed: a mapping of {', '.join(ACTIONS)} to ratios")
    unknown = sorted(set(thresholds) - set(ACTIONS))
    if unknown:
        raise ValueError(f"context.thresholds: unknown action(s) {unknown}; allowed: {', '.join(ACTIONS)}")
    out: dict[str, float] = {}
    for key, value in thresholds.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"context.thresholds.{key}={value!r}; allowed: a number between 0 (excluded) and 1")
        out[key] = float(value)
    if complete:
        for lower, upper in pairwise(ACTIONS):
            if out[lower] > out[upper]:
                raise ValueError(
                    f"context.thresholds: {lower} ({out[lower]}) is above {upper} ({out[upper]}); "
                    f"allowed: {' ≤ '.join(ACTIONS)}"
                )
    return out


def check_context_options(options: Mapping[str, Any],
                          piece_thresholds: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Validate a job's ``context=`` overrides (``window_tokens``, ``thresholds``, ``min_tool_tokens``, and the
    compaction settings ``on_pressure``, ``compact_keep_last``, ``max_compactions`` of docs/context.md#compaction).

    Called at submit time so that a bad value is refused before the job is stored.  The job's
    thresholds are merged over ``piece_thresholds`` (the piece's, else the defaults) as at run time,
    and the merged set must still rise.
    """
    allowed = ("window_tokens", "thresholds", "min_tool_tokens", *COMPACTION_DEFAULTS)
    if not isinstance(options, Mapping):
        raise ValueError(f"context={options!r}; allowed: a mapping with {', '.join(allowed)}")
    unknown = sorted(set(options) - set(allowed), key=str)
    if unknown:
        raise ValueError(f"context: unknown key(s) {unknown}; allowed: {', '.join(allowed)}")
    out: dict[str, Any] = {}
    if options.get("on_pressure") is not None:
        if options["on_pressure"] not in ON_PRESSURE:
            raise ValueError(f"context.on_pressure={options['on_pressure']!r}; allowed: {', '.join(ON_PRESSURE)}")
        out["on_pressure"] = options["on_pressure"]
    for key in ("compact_keep_last", "max_compactions"):
        if options.get(key) is not None:
            out[key] = _whole(options[key], key, 0)
    if options.get("window_tokens") is not None:
        out["window_tokens"] = _whole(options["window_tokens"], "window_tokens", 256)
    if options.get("min_tool_tokens") is not None:
        out["min_tool_tokens"] = _whole(options["min_tool_tokens"], "min_tool_tokens", 1)
    if options.get("thresholds") is not None:
        th = check_thresholds(options["thresholds"])
        # the job's values are merged over the piece's at run time: a set that would not rise is refused now,
        # not when a worker starts the job
        base = {**DEFAULT_THRESHOLDS, **(piece_thresholds or {})}
        try:
            check_thresholds({**base, **th}, complete=True)
        except ValueError as exc:
            raise ValueError(f"{exc} (the job's context.thresholds over the piece's "
                             f"{', '.join(f'{k}={v}' for k, v in base.items())})") from None
        out["thresholds"] = th
    return out


@dataclass
class ContextDecision:
    """What the ContextManager concluded after one LLM response."""

    prompt_tokens: int
    completion_tokens: int
    source: UsageSource
    ratio: float
    fired: list[tuple[ContextActionName, float]] = field(default_factory=list)  # (action, threshold)


def message_text(message: Message) -> str:
    """The text of a message that occupies the context: its text and, for an answer, each tool call's name
    and arguments as sent (the parts one per line, as the Chat Completions message's are counted)."""
    if isinstance(message, AssistantMessage):
        parts = [] if message.text is None else [message.text]
        for call in message.tool_calls:
            parts.append(call.name)
            parts.append(call.arguments_text())
        return "\n".join(parts)
    return message.text


# A fixed per-message overhead, as in OpenAI's own counting guide (role and separators).
_PER_MESSAGE = 4
# An attached image is charged at a typical low-detail cost.
_IMAGE_TOKENS = 765


class ContextManager:
    """One movement's context accounting; a new movement gets a new manager (actions fire once per movement)."""

    def __init__(
        self,
        *,
        window: int,
        thresholds: Mapping[str, float] | None = None,
        counter: TokenCounter | None = None,
        model: str = "",
        min_tool_tokens: int | None = None,
        max_tool_tokens: int = MAX_TOOL_TOKENS,
        on_pressure: str = "transition",
        compact_keep_last: int = 4,
        max_compactions: int = 2,
    ) -> None:
        self.window = int(window)
        if self.window < 1:
            raise ValueError(f"window={window!r}; allowed: a whole number of tokens ≥ 1")
        self.thresholds = check_thresholds({**DEFAULT_THRESHOLDS, **(thresholds or {})}, complete=True)
        self.counter = counter or counter_for_model(model or "gpt-4o")
        # the floor scales down for small windows, so a floor never fills one on its own
        self.min_tool_tokens = (
            min_tool_tokens if min_tool_tokens is not None else min(DEFAULT_MIN_TOOL_TOKENS, self.window // 16)
        )
        self.max_tool_tokens = max_tool_tokens
        # docs/context.md#compaction: at the prompt threshold, summarise and go on (compact) instead of wrapping up (transition)
        if on_pressure not in ON_PRESSURE:
            raise ValueError(f"on_pressure={on_pressure!r}; allowed: {', '.join(ON_PRESSURE)}")
        self.on_pressure = on_pressure
        self.compact_keep_last = _whole(compact_keep_last, "compact_keep_last", 0)
        self.max_compactions = _whole(max_compactions, "max_compactions", 0)
        self.fired: set[str] = set()
        self._current = 0  # best estimate of the context size now, less what is owed (current)
        # what is owed to the estimate and not counted yet: messages and texts to add (a number: already counted,
        # its sign included).  Counted when the estimate is read, dropped when a response's usage replaces it: a
        # job whose endpoint reports its usage never tokenizes a message (nor loads a tokenizer, engine/tokens.py)
        self._owed: list[tuple[int, Message | str | int]] = []
        self._tools_text = ""  # the tool schemas sent with every call, as counted
        self._tools_tokens: int | None = 0

    # -- accounting ---------------------------------------------------------
    def count_message(self, message: Message) -> int:
        n = _PER_MESSAGE + self.counter.count(message_text(message))
        if isinstance(message, UserMessage) and message.images:
            n += _IMAGE_TOKENS * len(message.images)
        return n

    def _tokens(self, item: Message | str | int) -> int:
        if isinstance(item, int):
            return item
        return self.counter.count(item) if isinstance(item, str) else self.count_message(item)

    @property
    def current(self) -> int:
        """The best estimate of the context size now (what the last usage reported, plus what was added since)."""
        if self._owed:
            owed, self._owed = self._owed, []
            self._current += sum(sign * self._tokens(item) for sign, item in owed)
        return self._current

    @current.setter
    def current(self, value: int) -> None:
        self._owed = []
        self._current = value

    @property
    def tools_tokens(self) -> int:
        if self._tools_tokens is None:
            self._tools_tokens = self.counter.count(self._tools_text)
        return self._tools_tokens

    def set_tools(self, schemas: list[dict[str, Any]]) -> None:
        """Charge the tool schemas sent with every call (counted once per movement, when the estimate needs them)."""
        text = json.dumps(schemas, ensure_ascii=False) if schemas else ""
        if text == self._tools_text:
            return
        if self._tools_text:
            self._owed.append((-1, self._tools_tokens if self._tools_tokens is not None else self._tools_text))
        if text:
            self._owed.append((1, text))
        self._tools_text, self._tools_tokens = text, (None if text else 0)

    def add(self, message: Message) -> None:
        """Add a message to the context (counted when the estimate is next read)."""
        self._owed.append((1, message))

    @property
    def source(self) -> UsageSource:
        return self.counter.source

    def after_response(
        self, assistant: AssistantMessage, usage: TokenUsage | None
    ) -> ContextDecision:
        """Record one LLM call: its prompt size, and the threshold actions that fire now."""
        # Without usage the prompt is what the last usage reported plus the messages counted since (all of
        # them when no call reported usage): a response that omits usage must not make the context seem
        # to shrink back to a bare count that misses the provider's own overhead.
        if usage is not None:
            prompt = usage.prompt_tokens
            completion = (usage.completion_tokens if usage.completion_tokens is not None
                          else self.count_message(assistant))
            # a recording re-served (replay, a fork's prefix) keeps the source its counts had
            source: UsageSource = usage.source or "usage"
            self.current = prompt + completion  # what was owed is in the prompt: never counted
        else:
            prompt = self.current
            completion = self.count_message(assistant)
            self._current += completion
            source = self.counter.source
        ratio = prompt / self.window
        decision = ContextDecision(prompt, completion, source, ratio)
        for action in ACTIONS:
            limit = self.thresholds[action]
            if ratio >= limit and action not in self.fired:
                self.fired.add(action)
                decision.fired.append((action, limit))
        return decision

    def side_call(self, extra: Message, reply: AssistantMessage,
                  usage: TokenUsage | None) -> ContextDecision:
        """The counts of a call that is not a turn of the conversation (a compaction's summarisation, docs/context.md#compaction):
        the messages so far and ``extra``, without tools, answered by ``reply``.  Nothing is added to the
        context and no action fires."""
        reply_tokens = self.count_message(reply)
        if usage is not None:
            return ContextDecision(usage.prompt_tokens,
                                   usage.completion_tokens if usage.completion_tokens is not None else reply_tokens,
                                   usage.source or "usage", usage.prompt_tokens / self.window)
        prompt = self.current - self.tools_tokens + self.count_message(extra)
        return ContextDecision(prompt, reply_tokens, self.counter.source, prompt / self.window)

    def recount(self, messages: Sequence[Message]) -> int:
        """Start the accounting again from ``messages`` (after a compaction replaced them): the context is now
        their count plus the tool schemas, and every action may fire again.  Returns that count."""
        self.current = self.tools_tokens + sum(self.count_message(m) for m in messages)
        self.fired = set()
        return self.current

    # -- budgets ----------------------------------------------------------------
    @property
    def available(self) -> int:
        return max(0, self.window - self.current)

    def tool_budget(self) -> int:
        """Tokens one tool result may take: half of what is left, capped, never below the floor."""
        return max(self.min_tool_tokens, min(self.max_tool_tokens, self.available // 2))

    @property
    def chars_per_token(self) -> float:
        return CHARS_PER_TOKEN if self.counter.source == "chars" else 3.5


def job_thresholds(piece_thresholds: Mapping[str, float], options: JobOptions | None) -> dict[str, float]:
    """The thresholds a job runs with: its piece's, overridden by the ``context=`` it was submitted with
    (``options`` is the job's stored options).  The runner, the frames, the plots and the panel all ask here."""
    merged = dict(piece_thresholds)
    merged.update(options.thresholds if options is not None else {})
    return {k: float(v) for k, v in merged.items()}


def context_items(items: Sequence[str], option: str = "--context") -> dict[str, Any]:
    """A command line's ``KEY=VALUE`` items as the ``context=`` mapping ``submit`` and ``fork`` take.

    ``agentnb run --context on_pressure=compact`` and ``%agent run --context …`` share it.  A value is read as a
    YAML scalar (``64000`` a number, ``compact`` text); ``thresholds.prompt=0.8`` sets one threshold, as does
    ``thresholds={prompt: 0.8}``.  Each item is checked as ``check_context_options`` checks a key, so a bad one is
    refused with its own words before anything is stored; whether merged thresholds still rise is left to
    ``submit``/``fork``, which know the piece's.
    """
    import yaml

    keys = ", ".join(("window_tokens", "thresholds.ACTION", "min_tool_tokens", *COMPACTION_DEFAULTS))
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = (part.strip() for part in item.partition("="))
        if not sep or not key or not raw:
            raise UsageError(f"{option} {item!r}: expected KEY=VALUE, e.g. on_pressure=compact; keys: {keys}")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise UsageError(f"{option} {item}: {raw!r} is not a value (a number, a word, or {{prompt: 0.8}} "
                             "for thresholds)") from None
        try:
            if key.startswith("thresholds."):
                action = key.split(".", 1)[1]
                check_thresholds({action: value})
                out.setdefault("thresholds", {})[action] = value
            elif key == "thresholds":
                check_thresholds(value)
                out["thresholds"] = {**out.get("thresholds", {}), **value}
            else:
                check_context_options({key: value})
                out[key] = value
        except ValueError as exc:
            raise UsageError(f"{option} {item}: {exc}") from None
    return out
