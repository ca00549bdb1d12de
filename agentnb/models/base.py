"""Models: what answers an LLM call.

Specs: ``demo`` (built in, no network), ``scripted:<file.yaml>``,
``openai:<model>`` (any OpenAI-compatible endpoint) and ``replay:<job_id>``.
Models are stateless: the loop tells each call where it stands in the job
(``call_index``, ``movement_call_index``), so a job resumed in a new process gets
the same answers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import (  # not typing's: their isinstance checks are several times slower
    Callable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, Protocol, runtime_checkable

import yaml

from ..errors import ModelError, ModelSpecError, UsageError
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
    "normalise_spec",
    "short_spec",
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
    extra: dict[str, Any] = field(default_factory=dict)
    # None for a turn of the conversation; "compaction" for the tool-less call that summarises it (docs/context.md#compaction)
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


def _parse_response(item: Any, where: str) -> ModelResponse:
    if not isinstance(item, Mapping):
        raise ModelSpecError(f"{where}: each response must be a mapping with content and/or tool_calls")
    unknown = set(item) - {"content", "tool_calls", "usage"}
    if unknown:
        raise ModelSpecError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: content, tool_calls, usage")
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
    content = item.get("content")
    return ModelResponse(content=None if content is None else str(content), tool_calls=tuple(calls),
                         usage=None if usage is None else TokenUsage(usage["prompt_tokens"], usage.get("completion_tokens")))


class ScriptedModel:
    """Plays responses from a YAML script (docs/models.md): one list for the whole job, or one per movement."""

    def __init__(self, script: Mapping[str, Any] | str | os.PathLike[str], *, spec: str | None = None) -> None:
        source = "<script>"
        if not isinstance(script, Mapping):
            path = Path(script)
            source = str(path)
            if not path.is_file():
                raise ModelSpecError(f"scripted model file not found: {path}")
            try:
                script = _load_script_yaml(path.read_text(encoding="utf-8")) or {}
            except yaml.YAMLError as exc:
                raise ModelSpecError(_yaml_error(path, exc)) from None
        if not isinstance(script, Mapping) or not ({"responses", "movements"} & set(script)):
            raise ModelSpecError(f"{source}: a script needs 'responses' (a list) or 'movements' (name → list)")
        self.spec = spec or f"scripted:{source}"
        self.source = source
        self.responses: list[ModelResponse] | None = None
        self.by_movement: dict[str, list[ModelResponse]] | None = None
        if not isinstance(script.get("responses") or [], list):
            raise ModelSpecError(f"{source}: responses must be a list of responses")
        if not isinstance(script.get("movements") or {}, Mapping) or not all(
            isinstance(v or [], list) for v in (script.get("movements") or {}).values()
        ):
            raise ModelSpecError(f"{source}: movements must map each movement name to a list of responses")
        if "responses" in script:
            self.responses = [_parse_response(r, f"{source}: responses[{i}]") for i, r in enumerate(script["responses"] or [])]
        if "movements" in script:
            self.by_movement = {
                str(name): [_parse_response(r, f"{source}: movements.{name}[{i}]") for i, r in enumerate(items or [])]
                for name, items in (script["movements"] or {}).items()
            }

    def complete(self, request: ModelRequest) -> ModelResponse:
        if self.by_movement is not None and request.movement in self.by_movement:
            items = self.by_movement[request.movement]
            i = request.movement_call_index
            if i >= len(items):
                raise ModelError(
                    f"scripted model ran out of responses for movement {request.movement!r}: "
                    f"{self.source} has {len(items)}, call {i + 1} was asked for"
                )
            return _with_ids(items[i], request)
        if self.responses is not None:
            i = request.call_index
            if i >= len(self.responses):
                raise ModelError(
                    f"scripted model ran out of responses: {self.source} has {len(self.responses)}, "
                    f"call {i + 1} was asked for"
                )
            return _with_ids(self.responses[i], request)
        raise ModelError(f"scripted model has no responses for movement {request.movement!r} in {self.source}")


def _with_ids(resp: ModelResponse, request: ModelRequest) -> ModelResponse:
    """Give scripted tool calls ids unique within the movement."""
    calls = tuple(
        ToolCall(id=f"call_{request.movement_seq}_{request.iteration}_{i}", name=c.name, arguments=c.arguments,
                 raw_arguments=c.raw_arguments)
        for i, c in enumerate(resp.tool_calls)
    )
    return ModelResponse(content=resp.content, tool_calls=calls, usage=resp.usage)


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
