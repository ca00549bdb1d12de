"""The call cache (docs/design-lab.md#call-cache): an LLM call answered from a recorded response when an identical
request was made before, kept in the store (table ``call_cache``, docs/stores.md#call-cache) so that every worker
of a PostgreSQL store shares it.

* **Identical** means the same key: the sha256 of the model spec, its endpoint (an ``openai:`` model's base URL, a
  ``scripted:`` file's content), the messages, the tools, the parameters (the call's purpose and the request's
  ``extra``; for the offline models, which answer by position rather than by the messages, also the movement and
  the call's place in the job) and the job's epoch — left out with ``cache="across-epochs"``.
* **The clock.**  Every movement's user prompt opens with the date and time of its activation, so keys on the exact
  messages would miss a minute later.  A cached job's activation therefore reuses the clock a first activation with
  the same enriched instruction (the date-and-time block left out), model and epoch recorded — as a fork reuses
  its original's — and from there its prompts, and so its keys, are the first run's.
* A hit is recorded as an ``llm_response`` with ``cached: true`` and 0 tokens (so it costs 0 and counts in no
  total); the original call's counts (as reported, else counted offline) stay in the cache's row, which
  ``agentnb cache stats`` sums as tokens saved.
* Only jobs submitted with ``cache=`` look up and record; a ``replay:`` model and a fork's re-served runs are never
  cached (they ask no model), and a fork does not take its original's mode (fork.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..models.base import Model, ModelRequest, ModelResponse, ToolCall
from ..models.messages import AssistantMessage, TokenUsage
from ..store import reads
from .context import message_text
from .prompts import clock_block
from .tokens import counter_for_model

if TYPE_CHECKING:
    from ..store.base import Store
    from ..store.records import JobOptions, JobRecord

__all__ = [
    "CACHE_MODES",
    "CacheStats",
    "CachedModel",
    "cache_mode",
    "cache_option",
    "cache_stats",
    "check_cache_mode",
    "clear_cache",
    "job_epoch",
    "parse_age",
    "reuse_clock",
    "with_cache",
]

# the modes a job stores in its options (``"cache"``); True is "on"
CACHE_MODES = ("on", "across-epochs")
_ALLOWED = "'on' (or True), 'across-epochs' or 'off' (or False); not given, the workspace's mode"
_KEY_VERSION = 1  # in every key: a change of what a key covers starts a new cache instead of answering wrongly


def check_cache_mode(value: Any) -> str | None:
    """``cache=`` checked: ``"on"``, ``"across-epochs"``, ``"off"``, or None (not given: the workspace's); a bad
    value is a :class:`UsageError` naming what is allowed."""
    if value is None:
        return None
    if value is True or value == "on":
        return "on"
    if value is False or value == "off":
        return "off"
    if value == "across-epochs":
        return "across-epochs"
    raise UsageError(f"cache={value!r} is not a cache mode; allowed: {_ALLOWED}")


def cache_option(given: Any, default: str | None = None) -> dict[str, str]:
    """The job options a submit with ``cache=given`` stores (``default``: the workspace's mode, checked)."""
    mode = check_cache_mode(given)
    mode = default if mode is None else mode
    return {"cache": mode} if mode in CACHE_MODES else {}


def cache_mode(options: JobOptions) -> str | None:
    """The cache mode a job was submitted with (``on``, ``across-epochs``), or None."""
    mode = options.extra.get("cache")
    return mode if mode in CACHE_MODES else None


def job_epoch(store: Store, row: JobRecord) -> int:
    """The epoch a job's calls are cached under: the one place the key learns it from — the batch epoch it answers
    for (docs/design-lab.md#epochs: a subtask's is its batch job's, a fork's its original's), 1 outside a batch."""
    return reads.epoch_of(store, row) or 1


def _digest(data: Mapping[str, Any]) -> str:
    text = json.dumps({"v": _KEY_VERSION, **data}, sort_keys=True, ensure_ascii=False, separators=(",", ":"),
                      default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _endpoint(model: Model) -> str | None:
    """Where the model's answers come from, beyond its spec: an ``openai:`` model's base URL (the key is never part
    of it), a ``scripted:`` file's content (an edited script answers otherwise under the same spec)."""
    spec = model.spec
    if spec.startswith("openai:"):
        return str(getattr(model, "base_url", None) or "https://api.openai.com/v1")
    if spec.startswith("scripted:"):
        path = Path(spec.split(":", 1)[1])
        try:
            return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            return None
    return None


def _message(m: Any) -> dict[str, Any]:
    return {"role": m.role, **dataclasses.asdict(m)}


def _lookup(store: Store, key: str, kind: str) -> str | None:
    """The body recorded under ``key`` (its long text from ``texts``), or None."""
    _, rows = store.rows("SELECT c.body, t.body FROM call_cache c LEFT JOIN texts t ON t.hash = c.body_ref "
                         "WHERE c.key = ? AND c.kind = ?", (key, kind))
    if not rows:
        return None
    inline, long = rows[0]
    return inline if inline is not None else long


def _response_json(r: ModelResponse) -> str:
    usage = None if r.usage is None else {"prompt_tokens": r.usage.prompt_tokens,
                                          "completion_tokens": r.usage.completion_tokens, "source": r.usage.source}
    return json.dumps({
        "content": r.content,
        "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments, "raw_arguments": c.raw_arguments}
                       for c in r.tool_calls],
        "usage": usage, "response_model": r.response_model, "response_id": r.response_id,
        "finish_reason": r.finish_reason,
    }, ensure_ascii=False)


def _response(body: str) -> ModelResponse | None:
    """The recorded response of ``body``, marked cached; None when it cannot be read (then the call is asked)."""
    try:
        data = json.loads(body)
        usage = data.get("usage")
        return ModelResponse(
            content=data.get("content"),
            tool_calls=tuple(ToolCall(id=str(c["id"]), name=str(c["name"]), arguments=c.get("arguments"),
                                      raw_arguments=str(c.get("raw_arguments") or "")) for c in data["tool_calls"]),
            usage=None if usage is None else TokenUsage(int(usage["prompt_tokens"]), usage.get("completion_tokens"),
                                                        usage.get("source")),
            response_model=data.get("response_model"), response_id=data.get("response_id"),
            finish_reason=data.get("finish_reason"), cached=True,
        )
    except (ValueError, KeyError, TypeError):
        return None


class CachedModel:
    """``inner`` behind the call cache: a request whose key the store holds is answered with the recorded response
    (``ModelResponse.cached``); any other is asked of ``inner`` and its response recorded.  ``epoch`` None: the
    key leaves the epoch out (``across-epochs``)."""

    def __init__(self, inner: Model, store: Store, *, epoch: int | None) -> None:
        self.inner = inner
        self.spec = inner.spec
        self.store = store
        self.epoch = epoch
        self.endpoint = _endpoint(inner)
        # demo and scripted models answer by the call's place in the job, not by the messages: it is in the key
        self.positional = not inner.spec.startswith("openai:")

    def __repr__(self) -> str:
        return f"CachedModel({self.inner!r}, epoch={self.epoch})"

    def key(self, request: ModelRequest) -> str:
        params: dict[str, Any] = {"purpose": request.purpose, "extra": request.extra}
        if self.positional:
            params.update(movement=request.movement, movement_seq=request.movement_seq, iteration=request.iteration,
                          call_index=request.call_index, movement_call_index=request.movement_call_index)
        return _digest({"kind": "call", "model": self.spec, "endpoint": self.endpoint,
                        "messages": [_message(m) for m in request.messages], "tools": request.tools,
                        "parameters": params, "epoch": self.epoch})

    def complete(self, request: ModelRequest) -> ModelResponse:
        key = self.key(request)
        body = _lookup(self.store, key, "call")
        hit = _response(body) if body is not None else None
        if hit is not None:
            self.store.cache_hit(key)
            return hit
        response = self.inner.complete(request)
        prompt, completion = self._counts(request, response)
        self.store.cache_put(key, kind="call", model=self.spec, body=_response_json(response), prompt_tokens=prompt,
                             completion_tokens=completion, job_id=request.job_id)
        return response

    def _counts(self, request: ModelRequest, response: ModelResponse) -> tuple[int, int]:
        """The call's tokens as the endpoint reported them, else counted offline as the ContextManager does: what a
        hit on it saves (``agentnb cache stats``)."""
        usage = response.usage
        if usage is not None and usage.completion_tokens is not None:
            return usage.prompt_tokens, usage.completion_tokens
        counter = counter_for_model(self.spec)  # only when the endpoint did not count: it may load a tokenizer
        completion = 4 + counter.count(message_text(AssistantMessage(response.content, response.tool_calls)))
        if usage is not None:
            return usage.prompt_tokens, completion
        prompt = sum(4 + counter.count(message_text(m)) for m in request.messages)
        return prompt + (counter.count(json.dumps(request.tools, ensure_ascii=False)) if request.tools else 0), completion


def with_cache(model: Model, store: Store, row: JobRecord) -> Model:
    """The model a job's calls go to: behind the cache when the job was submitted with ``cache=`` (never a
    ``replay:`` model, which asks nothing), keyed by the job's epoch (:func:`job_epoch`) unless across epochs."""
    mode = cache_mode(row.options)
    if mode is None or model.spec.startswith("replay:"):
        return model
    return CachedModel(model, store, epoch=None if mode == "across-epochs" else job_epoch(store, row))


def reuse_clock(store: Store, row: JobRecord, enriched: str) -> str:
    """A cached job's enriched instruction with the date and time its first identical activation recorded (the
    first records its own): the same instruction, comments, files, model and epoch give the same prompts."""
    mode = cache_mode(row.options)
    clock = clock_block(enriched) if mode is not None else None
    if clock is None:
        return enriched
    rest = enriched[len(clock):]
    key = _digest({"kind": "clock", "model": row.model, "rest": rest,
                   "epoch": None if mode == "across-epochs" else job_epoch(store, row)})
    recorded = _lookup(store, key, "clock")
    if recorded is None:
        store.cache_put(key, kind="clock", model=row.model, body=clock, job_id=row.id)
        recorded = _lookup(store, key, "clock") or clock  # another worker's, if it recorded first
    return recorded + rest


# -- agentnb cache stats / clear -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CacheStats:
    """What the cache holds: recorded responses and clocks, the hits, and the tokens the hits did not spend (summed
    from the original calls' counts where the endpoint or script reported them)."""

    responses: int
    clocks: int
    hits: int
    prompt_tokens_saved: int
    completion_tokens_saved: int
    models: tuple[str, ...]
    oldest: float | None
    newest: float | None

    def lines(self, where: str) -> list[str]:
        if not self.responses and not self.clocks:
            return [f"call cache of {where}: empty"]
        saved = self.prompt_tokens_saved + self.completion_tokens_saved
        return [
            f"call cache of {where}: {_count(self.responses, 'response')}, {_count(self.clocks, 'clock')}",
            f"hits: {self.hits:,}; tokens saved: {saved:,} (prompt {self.prompt_tokens_saved:,}, "
            f"completion {self.completion_tokens_saved:,})",
            f"models: {', '.join(self.models) or '-'}",
            f"recorded: {_when(self.oldest)} … {_when(self.newest)}",
        ]


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts is not None else "-"


def cache_stats(store: Store) -> CacheStats:
    _, rows = store.rows(
        "SELECT SUM(CASE WHEN kind='call' THEN 1 ELSE 0 END), SUM(CASE WHEN kind='clock' THEN 1 ELSE 0 END), "
        "SUM(CASE WHEN kind='call' THEN hits ELSE 0 END), SUM(hits * COALESCE(prompt_tokens, 0)), "
        "SUM(hits * COALESCE(completion_tokens, 0)), MIN(created), MAX(created) FROM call_cache")
    _, models = store.rows("SELECT DISTINCT model FROM call_cache WHERE kind='call' ORDER BY model")
    r = rows[0]
    return CacheStats(responses=int(r[0] or 0), clocks=int(r[1] or 0), hits=int(r[2] or 0),
                      prompt_tokens_saved=int(r[3] or 0), completion_tokens_saved=int(r[4] or 0),
                      models=tuple(str(m[0]) for m in models), oldest=r[5], newest=r[6])


_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_age(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``90s``, ``2w`` in seconds; a :class:`UsageError` naming the form otherwise."""
    m = _AGE.match(text) if isinstance(text, str) else None
    if m is None:
        raise UsageError(f"--older-than {text!r} is not an age; allowed: a number and a unit s, m, h, d or w "
                         "(e.g. 7d, 12h)")
    return float(m.group(1)) * _UNIT[m.group(2)]


def clear_cache(store: Store, older_than: str | None = None) -> int:
    """Delete what the cache recorded (only what is older than ``older_than``, e.g. ``7d``, when given); how many
    rows went."""
    before = time.time() - parse_age(older_than) if older_than is not None else None
    return store.cache_clear(before)
