"""Models: what answers an LLM call.

Specs: ``demo`` (built in, no network), ``scripted:<file.yaml>``,
``openai:<model>`` (any OpenAI-compatible endpoint) and ``replay:<job_id>``.
Models are stateless: the loop tells each call where it stands in the job
(``call_index``, ``movement_call_index``), so a job resumed in a new process gets
the same answers.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import re
import threading
import time
from collections.abc import (  # not typing's: their isinstance checks are several times slower
    Callable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, Protocol, runtime_checkable

import yaml

from ..errors import CallCancelled, ModelError, ModelSpecError, UsageError
from .messages import Delta, Message, TokenUsage, ToolCallPart

__all__ = [
    "MODEL_SPECS",
    "Model",
    "ModelError",
    "ModelRequest",
    "ModelResponse",
    "ModelSpecError",
    "ScriptedModel",
    "TokenUsage",
    "ToolCall",
    "ToolCallPart",
    "check_model_spec",
    "check_retry_settings",
    "demo_pace",
    "normalise_spec",
    "short_spec",
    "stream_response",
]

MODEL_SPECS = ("demo", "scripted:<file.yaml>", "openai:<model>", "replay:<job_id>")

# libyaml's safe loader parses a long script ~10x faster than the pure-Python one
# (a 1,000-response script: ~330 ms → ~35 ms, which was most of a scripted run's cost).
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_PLAIN_TAGS = {"tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"}


def _load_script_yaml(text: str) -> Any:
    """``yaml.safe_load`` of a script, built from libyaml's node tree without PyYAML's per-node bookkeeping.

    PyYAML's constructor still costs ~30 µs per scripted response in Python; plain
    strings, lists and mappings (what scripts are made of) are built ~2x faster here.
    Anything else — merge keys, !!set/!!omap, unhashable keys, cyclic aliases — goes
    through the full safe loader, so the result is always what safe_load gives.
    """
    root = yaml.compose(text, Loader=_SafeLoader)
    if root is None:
        return None
    scalars = yaml.constructor.SafeConstructor()  # ints, floats, bools, nulls, timestamps

    class _Fallback(Exception):
        pass

    def build(node: yaml.Node) -> Any:
        if isinstance(node, yaml.ScalarNode):
            return node.value if node.tag == "tag:yaml.org,2002:str" else scalars.construct_object(node, deep=True)
        if node.tag not in _PLAIN_TAGS:
            raise _Fallback
        if isinstance(node, yaml.MappingNode):
            out = {}
            for key, value in node.value:
                if key.tag == "tag:yaml.org,2002:merge":
                    raise _Fallback
                out[build(key)] = build(value)
            return out
        return [build(v) for v in node.value]

    try:
        return build(root)
    except (_Fallback, TypeError, RecursionError):
        return yaml.load(text, Loader=_SafeLoader)


@functools.lru_cache(maxsize=16)
def _parsed_script(text: str) -> Any:
    return _load_script_yaml(text)


def _script_yaml(text: str) -> Any:
    """A script's YAML parsed once per process and text (a worker running a batch's jobs parsed the same script for
    each: a fifth of a short job's CPU), each caller getting its own copy to keep."""
    return copy.deepcopy(_parsed_script(text))


# A tool call of the model's answer; the name models have always returned it under.
ToolCall = ToolCallPart


@dataclass(frozen=True)
class ModelResponse:
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    usage: TokenUsage | None = None
    # the latency a recording had (replay:), recorded instead of the time re-serving it took
    latency_s: float | None = None
    # time to first token of a streamed answer (docs/models.md#streaming), or a recording's; None when not streamed
    ttft_s: float | None = None
    # what the endpoint said of its answer, where it says it (docs/events.md#llm_response): the model that answered,
    # the completion's id, why it stopped, and the prompt tokens it read from its cache; None when not said
    response_model: str | None = None
    response_id: str | None = None
    finish_reason: str | None = None
    cached_tokens: int | None = None
    # answered from the call cache (engine/callcache.py, docs/design-lab.md#call-cache): no model was asked
    cached: bool = False


@dataclass
class ModelRequest:
    # the conversation so far, typed (models/messages.py); an adapter turns it into its provider's format
    messages: Sequence[Message]
    tools: list[dict[str, Any]]
    job_id: int = 0
    movement: str = ""
    movement_seq: int = 0
    iteration: int = 0
    call_index: int = 0  # LLM calls made earlier in this job
    movement_call_index: int = 0  # LLM calls made earlier in runs of this movement name
    # settings for the adapter: ``tool_choice`` (an ``openai:`` model's; "auto" when absent)
    extra: dict[str, Any] = field(default_factory=dict)
    # None for a turn of the conversation; "compaction" for the tool-less call that summarises it (docs/context.md#compaction);
    # "judge" for an LLM judge's call on an ended job (docs/design-lab.md#llm-judge)
    purpose: str | None = None
    # streaming (docs/models.md#streaming): a model that streams hands each fragment to ``on_delta`` as it
    # arrives (None: nobody watches), and stops reading at once, raising CallCancelled, when ``cancel`` is set
    on_delta: Callable[[Delta], None] | None = None
    cancel: threading.Event | None = None


@runtime_checkable
class Model(Protocol):
    spec: str

    def complete(self, request: ModelRequest) -> ModelResponse: ...


# ---------------------------------------------------------------------------
# Scripted


def _yaml_error(path: Path, exc: yaml.YAMLError) -> str:
    """One line for a script that is not YAML: file:line:column, what is wrong, and in what."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    what = f"{problem} ({context})" if context else problem
    return " ".join(f"{where}: not valid YAML: {what}".split())


_RESPONSE_KEYS = ("content", "tool_calls", "usage", "stream", "chunk")


def _parse_item(item: Any, where: str, epoch: int) -> tuple[ModelResponse, int | None]:
    """A script's item: a response, or ``by_epoch`` (a list of responses, one per batch epoch, taken in turn:
    docs/models.md#epochs), whose every response is checked and the one of ``epoch`` (from 1) taken."""
    if isinstance(item, Mapping) and "by_epoch" in item:
        choices = item["by_epoch"]
        if set(item) != {"by_epoch"} or not isinstance(choices, list) or not choices:
            raise ModelSpecError(f"{where}: by_epoch must be the response's only key, with a non-empty list of "
                                 "responses (one per epoch, taken in turn)")
        parsed = [_parse_response(r, f"{where}.by_epoch[{i}]") for i, r in enumerate(choices)]
        return parsed[(epoch - 1) % len(parsed)]
    return _parse_response(item, where)


def _parse_response(item: Any, where: str) -> tuple[ModelResponse, int | None]:
    """A scripted response, and how it streams: None (it does not), 0 (in word-ish pieces, ``stream: true``) or
    ``chunk`` characters a piece."""
    if not isinstance(item, Mapping):
        raise ModelSpecError(f"{where}: each response must be a mapping with content and/or tool_calls")
    unknown = set(item) - set(_RESPONSE_KEYS)
    if unknown:
        raise ModelSpecError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {', '.join(_RESPONSE_KEYS)}")
    calls = []
    for i, call in enumerate(item.get("tool_calls") or []):
        if not isinstance(call, Mapping) or "name" not in call:
            raise ModelSpecError(f"{where}.tool_calls[{i}]: needs a name (and arguments)")
        args = call.get("arguments") or {}
        calls.append(ToolCall(id=str(call.get("id") or f"call_{i}"), name=str(call["name"]), arguments=args))
    usage = item.get("usage")
    if usage is not None:
        if not isinstance(usage, Mapping) or "prompt_tokens" not in usage:
            raise ModelSpecError(f"{where}.usage: needs prompt_tokens (and optionally completion_tokens)")
        unknown_keys = sorted(set(usage) - {"prompt_tokens", "completion_tokens", "total_tokens"})
        if unknown_keys:  # a misspelt completion_tokens would otherwise be dropped without a word
            raise ModelSpecError(f"{where}.usage: unknown key(s) {unknown_keys}; "
                                 "allowed: prompt_tokens, completion_tokens, total_tokens")
        for key, value in usage.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ModelSpecError(f"{where}.usage.{key}: {value!r}; allowed: a whole number ≥ 0")
    stream, chunk = item.get("stream", False), item.get("chunk")
    if not isinstance(stream, bool):
        raise ModelSpecError(f"{where}.stream: {stream!r}; allowed: true or false")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ModelSpecError(f"{where}.chunk: {chunk!r}; allowed: a whole number ≥ 1 (characters per streamed piece)")
    content = item.get("content")
    response = ModelResponse(content=None if content is None else str(content), tool_calls=tuple(calls),
                             usage=None if usage is None else TokenUsage(usage["prompt_tokens"],
                                                                         usage.get("completion_tokens")))
    return response, chunk if chunk is not None else (0 if stream else None)


class ScriptedModel:
    """Plays responses from a YAML script (docs/models.md): one list for the whole job, or one per movement.

    A response with ``stream: true`` (word-ish pieces) or ``chunk: N`` (N characters a piece) streams itself
    through the request's ``on_delta`` (docs/models.md#streaming); the others answer at once.  ``epoch``: the
    batch epoch of the job it answers (None outside a batch: 1), which picks each ``by_epoch`` item's response.
    """

    # it answers in this process at once, and the same again when asked again: its call needs no commit of the
    # request before it (AgentLoop.call; docs/stores.md#sqlite-writers)
    answers_at_once = True

    def __init__(self, script: Mapping[str, Any] | str | os.PathLike[str], *, spec: str | None = None,
                 epoch: int | None = None) -> None:
        source = "<script>"
        if not isinstance(script, Mapping):
            path = Path(script)
            source = str(path)
            if not path.is_file():
                raise ModelSpecError(f"scripted model file not found: {path}")
            try:
                script = _script_yaml(path.read_text(encoding="utf-8")) or {}
            except yaml.YAMLError as exc:
                raise ModelSpecError(_yaml_error(path, exc)) from None
        if not isinstance(script, Mapping) or not ({"responses", "movements"} & set(script)):
            raise ModelSpecError(f"{source}: a script needs 'responses' (a list) or 'movements' (name → list)")
        self.spec = spec or f"scripted:{source}"
        self.source = source
        self.responses: list[ModelResponse] | None = None
        self.by_movement: dict[str, list[ModelResponse]] | None = None
        # how each response streams (_parse_response), beside it: the responses stay what they always were
        self._chunks: list[int | None] = []
        self._chunks_by_movement: dict[str, list[int | None]] = {}
        if not isinstance(script.get("responses") or [], list):
            raise ModelSpecError(f"{source}: responses must be a list of responses")
        if not isinstance(script.get("movements") or {}, Mapping) or not all(
            isinstance(v or [], list) for v in (script.get("movements") or {}).values()
        ):
            raise ModelSpecError(f"{source}: movements must map each movement name to a list of responses")
        if "responses" in script:
            parsed = [_parse_item(r, f"{source}: responses[{i}]", epoch or 1)
                      for i, r in enumerate(script["responses"] or [])]
            self.responses = [r for r, _ in parsed]
            self._chunks = [c for _, c in parsed]
        if "movements" in script:
            self.by_movement = {}
            for name, items in (script["movements"] or {}).items():
                parsed = [_parse_item(r, f"{source}: movements.{name}[{i}]", epoch or 1)
                          for i, r in enumerate(items or [])]
                self.by_movement[str(name)] = [r for r, _ in parsed]
                self._chunks_by_movement[str(name)] = [c for _, c in parsed]

    def complete(self, request: ModelRequest) -> ModelResponse:
        if self.by_movement is not None and request.movement in self.by_movement:
            items = self.by_movement[request.movement]
            i = request.movement_call_index
            if i >= len(items):
                raise ModelError(
                    f"scripted model ran out of responses for movement {request.movement!r}: "
                    f"{self.source} has {len(items)}, call {i + 1} was asked for"
                )
            return self._answer(items[i], self._chunks_by_movement[request.movement][i], request)
        if self.responses is not None:
            i = request.call_index
            if i >= len(self.responses):
                raise ModelError(
                    f"scripted model ran out of responses: {self.source} has {len(self.responses)}, "
                    f"call {i + 1} was asked for"
                )
            return self._answer(self.responses[i], self._chunks[i], request)
        raise ModelError(f"scripted model has no responses for movement {request.movement!r} in {self.source}")

    @staticmethod
    def _answer(resp: ModelResponse, chunk: int | None, request: ModelRequest) -> ModelResponse:
        response = _with_ids(resp, request)
        if chunk is not None:
            stream_response(response, request, chunk=chunk or None)
        return response


def _with_ids(resp: ModelResponse, request: ModelRequest) -> ModelResponse:
    """Give scripted tool calls ids unique within the movement."""
    calls = tuple(
        ToolCall(id=f"call_{request.movement_seq}_{request.iteration}_{i}", name=c.name, arguments=c.arguments,
                 raw_arguments=c.raw_arguments)
        for i, c in enumerate(resp.tool_calls)
    )
    return ModelResponse(content=resp.content, tool_calls=calls, usage=resp.usage)


# ---------------------------------------------------------------------------
# Streaming the offline models' answers (docs/models.md#streaming)

_WORDISH = re.compile(r"\S*\s*")
# a tool call's arguments stream in pieces of at least this many characters, and in at most _ARG_PIECES pieces
# (the demo's report is ~14,000 characters: paced, it must still take a second, not minutes)
_ARG_MIN = 16
_ARG_PIECES = 40


def _pieces(text: str, chunk: int | None, *, arguments: bool = False) -> Iterator[str]:
    """``text`` in the pieces it streams in: ``chunk`` characters each, else word-ish (text) or a few dozen
    pieces (arguments).  They join to ``text``."""
    if chunk is None and not arguments:
        yield from (p for p in _WORDISH.findall(text) if p)
        return
    size = chunk or max(_ARG_MIN, math.ceil(len(text) / _ARG_PIECES))
    for start in range(0, len(text), size):
        yield text[start:start + size]


def stream_response(response: ModelResponse, request: ModelRequest, *, chunk: int | None = None,
                    pace: float = 0.0) -> None:
    """Stream ``response`` through ``request.on_delta`` as a streaming endpoint would: its text in pieces, then
    each tool call (id and name at once, then its JSON arguments in pieces), ``pace`` seconds before each piece.

    ``chunk``: characters per piece (None: word-ish text, arguments in a few dozen pieces).  Between pieces a set
    ``request.cancel`` raises :class:`CallCancelled` with what was sent.  Nobody watching and no pace: nothing
    is done at all (the non-streamed path, unchanged).
    """
    emit, cancel = request.on_delta, request.cancel
    if emit is None and not pace:
        return
    sent_text: list[str] = []
    sent_args: list[str] = []

    def send(delta: Delta) -> None:
        if cancel is not None and cancel.is_set():
            raise CallCancelled(partial_text="".join(sent_text), partial_arguments="".join(sent_args))
        if pace:
            if cancel is not None:
                if cancel.wait(pace):  # a stop during the wait cuts the call off at once
                    raise CallCancelled(partial_text="".join(sent_text), partial_arguments="".join(sent_args))
            else:
                time.sleep(pace)
        if emit is not None:
            emit(delta)
        sent_text.append(delta.text)
        sent_args.append(delta.arguments)

    for piece in _pieces(response.content or "", chunk):
        send(Delta(text=piece))
    for index, call in enumerate(response.tool_calls):
        send(Delta(tool_index=index, tool_id=call.id, tool_name=call.name))
        for piece in _pieces(call.arguments_text(), chunk, arguments=True):
            send(Delta(tool_index=index, arguments=piece))
    # a stop asked after the last piece leaves the whole answer: it is returned, as a streamed endpoint's is


_DEMO_OPTIONS = ("pace",)


def demo_pace(spec: str) -> float:
    """The seconds per streamed piece a ``demo`` spec asks for: ``demo`` → 0, ``demo?pace=0.02`` → 0.02.

    :class:`ModelSpecError` (one line) for a bad pace or an option ``demo`` does not have."""
    _, _, query = spec.partition("?")
    pace = 0.0
    for option in query.split("&") if query else ():
        key, eq, value = option.partition("=")
        if key not in _DEMO_OPTIONS or not eq:
            raise ModelSpecError(f"{spec}: unknown option {option!r}; allowed: demo?pace=SECONDS "
                                 "(seconds before each streamed piece, e.g. demo?pace=0.02)")
        try:
            pace = float(value)
        except ValueError:
            pace = -1.0
        if not 0 <= pace <= 10:  # also refuses nan and inf
            raise ModelSpecError(f"{spec}: pace={value!r}; allowed: a number of seconds from 0 to 10 "
                                 "before each streamed piece (e.g. demo?pace=0.02)")
    return pace


# ---------------------------------------------------------------------------


MAX_RETRIES = 100


def check_retry_settings(retries: Any = None, max_backoff: Any = None) -> dict[str, Any]:
    """The given retry settings of an ``openai:`` model, checked; ``ValueError`` names what is allowed.

    ``retries``: tries after the first one (a whole number, 0 to 100); ``max_backoff``: the longest
    wait between two tries, in seconds (a number ≥ 0).  ``None`` leaves a setting to the fallback.
    """
    out: dict[str, Any] = {}
    if retries is not None:
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
            raise UsageError(f"retries={retries!r}; allowed: a whole number from 0 to {MAX_RETRIES} "
                             "(the tries after the first)")
        out["retries"] = retries
    if max_backoff is not None:
        if isinstance(max_backoff, bool) or not isinstance(max_backoff, (int, float)) \
                or not 0 <= max_backoff < float("inf"):
            raise UsageError(f"max_backoff={max_backoff!r}; allowed: a number of seconds ≥ 0 "
                             "(the longest wait between two tries)")
        out["max_backoff"] = float(max_backoff)
    return out


def check_model_spec(spec: str) -> None:
    """Validate a spec's shape without building the model (no files read, no client made)."""
    kind, _, rest = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if isinstance(spec, str) and spec.startswith("demo?"):
        demo_pace(spec)
        return
    if kind == "openai" and rest.strip() and not rest.partition("?")[0].strip():
        raise ModelSpecError(f"{spec}: no model name before the options; allowed: openai:NAME?OPTIONS "
                             "(e.g. openai:gpt-4o-mini?stream=0)")
    if spec == "demo" or (kind in ("scripted", "openai", "replay") and rest.strip()):
        if kind == "scripted" and not Path(rest).is_file():
            raise ModelSpecError(f"scripted model file not found: {rest}")
        if kind == "replay" and not rest.isdigit():
            raise ModelSpecError(f"replay:{rest}: the job id must be a number")
        if kind == "openai" and not os.environ.get("OPENAI_API_KEY") and not os.environ.get("OPENAI_BASE_URL"):
            # refused here, at submit, rather than as a job that fails on its first call
            raise ModelSpecError(f"{spec} needs OPENAI_API_KEY in the environment (or OPENAI_BASE_URL for another "
                                 "OpenAI-compatible server); set it before starting Jupyter, or in a cell with "
                                 "%env OPENAI_API_KEY=…")
        return
    raise ModelSpecError(f"unknown model spec {spec!r}; allowed: {', '.join(MODEL_SPECS)}")


def short_spec(spec: str, parts: int = 1) -> str:
    """``spec`` short enough for a label or a title: a ``scripted:`` file by the last ``parts`` parts of its
    path (its file name by default: the full path crowds a plot or a table); any other spec as it is."""
    if not spec.startswith("scripted:"):
        return spec
    path = PurePath(spec.split(":", 1)[1])
    names = path.parts[1:] if path.anchor else path.parts
    if parts >= len(names):
        return spec
    return "scripted:" + "/".join(names[-parts:])


def normalise_spec(spec: str) -> str:
    """``spec`` with a ``scripted:`` file made absolute, so it names the same file for a worker started
    in another folder."""
    if isinstance(spec, str) and spec.startswith("scripted:"):
        path = spec.split(":", 1)[1]
        if path and Path(path).is_file():
            return "scripted:" + str(Path(path).resolve())
    return spec
