"""Built-in scorers (docs/design-lab.md#built-in-scorers) and the LLM judge (docs/design-lab.md#llm-judge).

A scorer is any function of the ended :class:`~agentnb.Job` (``agentnb.batch.Scorer``); these are ready-made ones,
each built once with its arguments checked (a bad regular expression, a path that leaves the work directory, an
unknown judge model: one line, when it is built, before any job is scored)::

    from agentnb.scorers import contains, equals_expected, file_exists, json_valid, llm_judge, regex
    ws.batch(cases, scorers={"right": equals_expected, "cites": regex(r"\\[\\d+\\]"),
                             "report": file_exists("output/report.md"),
                             "quality": llm_judge("Is the answer correct and complete?", model="openai:gpt-4o-mini")})

What they read, through the public Job API:

- **the answer**: the job's final summary (``job.summary``: what its last finished movement said it did), or, with
  ``path=``, the text of that file of its work directory (``path="output/answer.txt"``);
- **files**: paths relative to the job's work directory (``output/report.md``, ``input/a.md``), never outside it
  (an absolute path or one with ``..`` that leaves it is refused when the scorer is built; a symbolic link that
  leads out is the score's error when it is met);
- **the expected value**: ``job.expected``, the batch case's ``expected``.

A job with no answer (no finished movement, or the file missing) scores False (the judge: the lowest value of its
scale, without a call), so a variant's mean counts its failures; a scorer that cannot judge at all (a case without
``expected``, a file that is not UTF-8 text, a judge whose answer has no valid verdict) raises, and
``score_value`` records that as the score's ``error``, never a guess.

The judge's calls are LLM calls like any other: made through the model layer (``agentnb.models``) and recorded on
the scored job as ``llm_request``/``llm_response`` events with ``purpose: "judge"`` (outside any movement run),
with their tokens and latency; each is priced by the judge's own model, which its ``llm_response`` names.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

from .errors import AgentnbError, ModelSpecError, ToolError, UsageError
from .events import LLMRequest, LLMResponse, RecordedToolCall, Usage
from .models.base import ModelRequest, ModelResponse, check_model_spec, normalise_spec
from .models.factory import resolve_model
from .models.messages import Message, SystemMessage, UserMessage
from .tools.paths import open_regular, resolve_path

__all__ = ["JUDGE_PURPOSE", "PASS_FAIL", "VERDICT_TOOL", "JudgeError", "LLMJudge", "ScorerError", "contains",
           "equals_expected", "file_exists", "file_matches", "json_valid", "llm_judge", "regex"]

JUDGE_PURPOSE = "judge"  # the ``purpose`` of a judge's llm_request and llm_response (docs/events.md#llm_request)
PASS_FAIL = "pass/fail"
VERDICT_TOOL = "verdict"  # the one tool a judge is offered and must call
# the most of an answer (or a reference) a judge is shown; the rest is cut with a note saying how much
JUDGE_MAX_CHARS = 20_000


class ScorerError(AgentnbError):
    """A built-in scorer could not score a job (recorded as the score's ``error``)."""


class JudgeError(ScorerError):
    """An LLM judge gave no valid verdict (its call failed, or its answer was not a verdict on its scale)."""


# -- reading a job -------------------------------------------------------------------------------------------

def _checked_path(path: Any, what: str) -> str:
    """``path`` as a POSIX path relative to a job's work directory; a UsageError for one that leaves it."""
    if not isinstance(path, str) or not path.strip():
        raise UsageError(f"{what}: path {path!r}; allowed: a non-empty path relative to the job's work directory, "
                         "such as 'output/report.md'")
    posix = path.replace("\\", "/")
    if posixpath.isabs(posix) or posix.startswith("~") or re.match(r"^[A-Za-z]:(/|$)", posix) or "\x00" in posix:
        raise UsageError(f"{what}: path {path!r} is absolute; allowed: a path relative to the job's work directory, "
                         "such as 'output/report.md'")
    norm = posixpath.normpath(posix)
    if norm == ".." or norm.startswith("../"):
        raise UsageError(f"{what}: path {path!r} leaves the job's work directory; allowed: a path inside it, "
                         "such as 'output/report.md'")
    if norm == ".":
        raise UsageError(f"{what}: path {path!r} is the work directory itself; allowed: a file inside it")
    return norm


def _read(job: Any, path: str) -> bytes | None:
    """The bytes of file ``path`` of the job's work directory (None when there is no such regular file); a
    ScorerError when the path leads out of it (a symbolic link) or is not a regular file."""
    try:
        real = resolve_path(job.workdir, path)
    except ToolError as exc:
        raise ScorerError(f"job {job.id}: {exc}") from None
    if not real.exists():
        return None
    try:
        fd = open_regular(real, path)
    except ToolError as exc:
        raise ScorerError(f"job {job.id}: {exc}") from None
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def _text(job: Any, path: str) -> str | None:
    data = _read(job, path)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ScorerError(f"job {job.id}: {path} is not UTF-8 text ({len(data):,} bytes)") from None


def _answer(job: Any, path: str | None) -> str | None:
    """The job's answer: its final summary, or the text of file ``path`` (None: it has none)."""
    return job.summary if path is None else _text(job, path)


def _where(path: str | None) -> str:
    return "its final summary" if path is None else path


@dataclass(frozen=True)
class _BuiltIn:
    """A built-in scorer: a callable of the Job with a readable repr (a batch's scorers show in a cell)."""

    label: str
    fn: Callable[[Any], Any]

    def __call__(self, job: Any) -> Any:
        return self.fn(job)

    def __repr__(self) -> str:
        return self.label


# -- the built-in scorers ------------------------------------------------------------------------------------

def _same(a: Any, b: Any) -> bool:
    """JSON values equal as JSON reads them: 1 and 1.0 are, true and 1 are not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _equals(job: Any, path: str | None) -> bool:
    expected = job.expected
    if expected is None:
        where = f"case {job.case} of batch {job.batch!r}" if job.batch is not None else "it is not in a batch, so it"
        raise ScorerError(f"job {job.id}: {where} has no 'expected' value to compare with")
    answer = _answer(job, path)
    if answer is None:
        return False
    if isinstance(expected, str):
        return answer.strip() == expected.strip()
    try:  # a number, true/false, a list or a dict: the answer read as JSON
        return _same(json.loads(answer), expected)
    except ValueError:
        return False


@overload
def equals_expected(job: Any, /) -> bool: ...
@overload
def equals_expected(*, path: str | None = None) -> _BuiltIn: ...
def equals_expected(job: Any = None, /, *, path: str | None = None) -> Any:
    """Whether the job's answer equals its case's ``expected``: a scorer as it is (``{"right": equals_expected}``:
    the final summary), or built with ``path=`` to read a file (``equals_expected(path="output/answer.txt")``).

    Text is compared with surrounding whitespace stripped; any other expected value (a number, true/false, a list,
    a dict) with the answer read as JSON (``41`` equals ``41.0``; ``true`` does not equal ``1``).  No answer:
    False.  A case without ``expected`` is the score's error."""
    if job is None:
        checked = None if path is None else _checked_path(path, "equals_expected")
        return _BuiltIn(f"equals_expected(path={checked!r})" if checked else "equals_expected",
                        lambda j: _equals(j, checked))
    if path is not None:
        raise UsageError("equals_expected(job, path=…): give path= when building the scorer, "
                         "equals_expected(path='output/answer.txt'), not when calling it")
    return _equals(job, None)


def contains(text: str, *, path: str | None = None, ignore_case: bool = False) -> _BuiltIn:
    """A scorer: whether the job's answer (its final summary, or file ``path``) contains ``text``
    (``ignore_case=True``: in any case).  No answer: False."""
    if not isinstance(text, str) or not text:
        raise UsageError(f"contains({text!r}): allowed: non-empty text to look for in the answer")
    checked = None if path is None else _checked_path(path, f"contains({text!r})")
    needle = text.casefold() if ignore_case else text

    def score(job: Any) -> bool:
        answer = _answer(job, checked)
        if answer is None:
            return False
        return needle in (answer.casefold() if ignore_case else answer)

    return _BuiltIn(f"contains({text!r}" + (f", path={checked!r}" if checked else "")
                    + (", ignore_case=True" if ignore_case else "") + ")", score)


def _compiled(pattern: Any, what: str) -> re.Pattern[str]:
    if isinstance(pattern, re.Pattern):
        if not isinstance(pattern.pattern, str):
            raise UsageError(f"{what}: a bytes pattern; allowed: a text regular expression")
        return pattern
    if not isinstance(pattern, str) or not pattern:
        raise UsageError(f"{what}: pattern {pattern!r}; allowed: a non-empty regular expression (Python's re)")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise UsageError(f"{what}: {pattern!r} is not a valid regular expression ({exc}); allowed: "
                         "Python's re syntax, e.g. r'\\d+ items'") from None


def regex(pattern: str | re.Pattern[str], *, path: str | None = None) -> _BuiltIn:
    """A scorer: whether ``pattern`` (Python's ``re``, searched anywhere; ``(?i)`` for any case) matches the job's
    answer (its final summary, or file ``path``).  No answer: False."""
    compiled = _compiled(pattern, f"regex({getattr(pattern, 'pattern', pattern)!r})")
    checked = None if path is None else _checked_path(path, f"regex({compiled.pattern!r})")

    def score(job: Any) -> bool:
        answer = _answer(job, checked)
        return answer is not None and compiled.search(answer) is not None

    return _BuiltIn(f"regex({compiled.pattern!r}" + (f", path={checked!r})" if checked else ")"), score)


def file_exists(path: str) -> _BuiltIn:
    """A scorer: whether the job's work directory has the regular file ``path`` (``output/report.md``)."""
    checked = _checked_path(path, "file_exists")

    def score(job: Any) -> bool:
        try:
            real = resolve_path(job.workdir, checked)
        except ToolError as exc:
            raise ScorerError(f"job {job.id}: {exc}") from None
        return real.is_file()

    return _BuiltIn(f"file_exists({checked!r})", score)


def file_matches(path: str, pattern: str | re.Pattern[str]) -> _BuiltIn:
    """A scorer: whether ``pattern`` (Python's ``re``, searched anywhere) matches the text of file ``path`` of the
    job's work directory.  A missing file: False; one that is not UTF-8 text: the score's error."""
    checked = _checked_path(path, "file_matches")
    compiled = _compiled(pattern, f"file_matches({checked!r}, …)")

    def score(job: Any) -> bool:
        text = _text(job, checked)
        return text is not None and compiled.search(text) is not None

    return _BuiltIn(f"file_matches({checked!r}, {compiled.pattern!r})", score)


def json_valid(path: str) -> _BuiltIn:
    """A scorer: whether file ``path`` of the job's work directory is valid JSON (UTF-8).  A missing file: False."""
    checked = _checked_path(path, "json_valid")

    def score(job: Any) -> bool:
        data = _read(job, checked)
        if data is None:
            return False
        try:
            json.loads(data.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError is one too
            return False
        return True

    return _BuiltIn(f"json_valid({checked!r})", score)


# -- the LLM judge -------------------------------------------------------------------------------------------

_JUDGE_SYSTEM = (
    "You are a careful, strict evaluator. You judge the answer an AI agent gave to a task, following the rubric "
    "you are given, and comparing with the reference answer when there is one. Give your verdict by calling the "
    f"`{VERDICT_TOOL}` tool exactly once, with a score on the scale you are given and a short reason; do not "
    "answer in text.")


def _check_scale(scale: Any) -> tuple[int, int] | str:
    if scale == PASS_FAIL and isinstance(scale, str):
        return PASS_FAIL
    if isinstance(scale, Sequence) and not isinstance(scale, str) and len(scale) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in scale) and scale[0] < scale[1]:
        return int(scale[0]), int(scale[1])
    raise UsageError(f"llm_judge: scale={scale!r}; allowed: (low, high), two whole numbers with low < high such "
                     f"as (1, 5), or {PASS_FAIL!r}")


def _check_judge_model(model: Any) -> str:
    if not isinstance(model, str) or not model.strip():
        raise UsageError(f"llm_judge: model={model!r}; allowed: a model spec such as 'openai:gpt-4o-mini', "
                         "'scripted:judge.yaml' or 'demo'")
    spec = normalise_spec(model)
    if spec.startswith("replay:"):
        raise ModelSpecError(f"llm_judge: model={model!r}: a replay re-serves a job's own calls and cannot judge; "
                             "allowed: 'demo', 'scripted:<file.yaml>', 'openai:<model>'")
    try:
        check_model_spec(spec)
        resolve_model(spec)  # a malformed script is refused now, not at the first job scored
    except ModelSpecError as exc:
        # a replay cannot judge: the list of allowed specs leaves it out
        raise ModelSpecError(f"llm_judge: {str(exc).replace(', replay:<job_id>', '')}") from None
    return spec


def _shown(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[… {len(text) - limit:,} more characters not shown]"


class LLMJudge:
    """A scorer that asks a model for a verdict on the job's answer (:func:`llm_judge` builds one).

    ``rubric``, ``model`` (the spec, a ``scripted:`` file made absolute), ``scale`` (``(low, high)`` or
    ``"pass/fail"``), ``reference`` (``"expected"`` or None) and ``path`` (None: the final summary) are fixed when
    it is built; calling it with a Job makes one recorded call and returns the verdict (an int on a numeric
    scale, True for pass and False for fail)."""

    def __init__(self, rubric: str, *, model: str, scale: tuple[int, int] | str, reference: str | None,
                 path: str | None, max_chars: int) -> None:
        self.rubric = rubric
        self.model = model
        self.scale = scale
        # (low, high) of a numeric scale; None for pass/fail
        self.bounds: tuple[int, int] | None = None if isinstance(scale, str) else scale
        self.reference = reference
        self.path = path
        self.max_chars = max_chars

    def __repr__(self) -> str:
        first = self.rubric.strip().splitlines()[0] if self.rubric.strip() else ""
        return f"llm_judge({first[:60]!r}, model={self.model!r}, scale={self.scale!r})"

    # -- what the judge is sent -------------------------------------------------------------------------------
    def verdict_tool(self) -> dict[str, Any]:
        """The ``verdict`` tool's schema (OpenAI's function format): ``score`` on the scale, and ``reason``."""
        if self.bounds is None:
            score: dict[str, Any] = {"type": "string", "enum": ["pass", "fail"],
                                     "description": "pass when the answer meets the rubric, else fail"}
        else:
            low, high = self.bounds
            score = {"type": "integer", "minimum": low, "maximum": high,
                     "description": f"a whole number from {low} (worst) to {high} (best)"}
        return {"type": "function", "function": {
            "name": VERDICT_TOOL, "description": "Record your verdict on the agent's answer.",
            "parameters": {"type": "object", "properties": {
                "score": score, "reason": {"type": "string", "description": "why, in one or two sentences"}},
                "required": ["score", "reason"], "additionalProperties": False}}}

    def messages(self, job: Any, answer: str) -> list[Message]:
        """The system prompt and the user message the judge is sent about ``job``."""
        parts = [f"## Rubric\n{self.rubric.strip()}", f"## The task the agent was given\n{job.instruction}"]
        expected = job.expected if self.reference == "expected" else None
        if expected is not None:
            shown = expected if isinstance(expected, str) else json.dumps(expected, ensure_ascii=False, indent=1)
            parts.append(f"## Reference answer\n{_shown(shown, self.max_chars)}")
        parts.append(f"## The agent's answer ({_where(self.path)})\n{_shown(answer, self.max_chars)}")
        if self.bounds is None:
            parts.append(f"## Scale\n\"pass\" when the answer meets the rubric, otherwise \"fail\". Call "
                         f"{VERDICT_TOOL} with score and reason.")
        else:
            parts.append(f"## Scale\nA whole number from {self.bounds[0]} (worst) to {self.bounds[1]} (best). Call "
                         f"{VERDICT_TOOL} with score and reason.")
        return [SystemMessage(_JUDGE_SYSTEM), UserMessage("\n\n".join(parts))]

    # -- judging -----------------------------------------------------------------------------------------------
    def lowest(self) -> int | bool:
        return False if self.bounds is None else self.bounds[0]

    def __call__(self, job: Any) -> int | bool:
        store = getattr(getattr(job, "workspace", None), "store", None)
        if store is None:
            raise ScorerError(f"job {job.id} is not attached to a workspace: the judge records its calls there")
        answer = _answer(job, self.path)
        if answer is None or not answer.strip():
            return self.lowest()  # nothing to judge: no call, the scale's lowest (a failure counts as one)
        messages = self.messages(job, answer)
        tools = [self.verdict_tool()]
        # this judge model's answered calls on the job so far: a scripted judge plays its responses in that order
        # (a re-score gets the next one); a call that failed left no answer and is asked again
        earlier = sum(1 for ev in store.events(job.id, kinds=["llm_response"])
                      if isinstance(ev, LLMResponse) and ev.purpose == JUDGE_PURPOSE and ev.model == self.model)
        # the request is durable before the model is asked, as every call of a job is (ARCHITECTURE.md)
        store.append([LLMRequest(job_id=job.id, ts=time.time(), messages=len(messages), tools=[VERDICT_TOOL],
                                 purpose=JUDGE_PURPOSE)])
        request = ModelRequest(messages=messages, tools=tools, job_id=job.id, movement=JUDGE_PURPOSE,
                               call_index=earlier, movement_call_index=earlier, purpose=JUDGE_PURPOSE,
                               extra={"tool_choice": {"type": "function", "function": {"name": VERDICT_TOOL}}})
        started = time.perf_counter()
        try:
            response = resolve_model(self.model, stream=False).complete(request)
        except Exception as exc:  # the call's failure is the score's error; nothing is guessed
            text = " ".join(str(exc).split()) or type(exc).__name__
            raise JudgeError(f"the judge's call to {self.model} failed: {text}") from None
        latency = response.latency_s if response.latency_s is not None else time.perf_counter() - started
        store.append([LLMResponse(
            job_id=job.id, ts=time.time(), content=response.content,
            tool_calls=[RecordedToolCall(id=c.id, name=c.name, arguments=c.arguments,
                                         raw_arguments=c.raw_arguments or None) for c in response.tool_calls],
            usage=_usage(self.model, messages, tools, response), latency_s=latency, purpose=JUDGE_PURPOSE,
            response_model=response.response_model, response_id=response.response_id,
            finish_reason=response.finish_reason, cached_tokens=response.cached_tokens, model=self.model)])
        return self.parse(response)

    def parse(self, response: ModelResponse) -> int | bool:
        """The verdict of the judge's answer: its one ``verdict`` call's score, checked against the scale; a
        JudgeError for anything else (no call, several, arguments that are not an object, a score off the scale)."""
        calls = [c for c in response.tool_calls if c.name == VERDICT_TOOL]
        if not calls:
            said = " ".join((response.content or "").split())
            other = ", ".join(c.name for c in response.tool_calls)
            what = f"called {other} instead" if other else (f"said {said[:120]!r}" if said else "gave an empty answer")
            raise JudgeError(f"the judge did not call {VERDICT_TOOL} (it {what}); no verdict")
        if len(calls) > 1:
            raise JudgeError(f"the judge called {VERDICT_TOOL} {len(calls)} times; one verdict is needed")
        args = calls[0].arguments
        if not isinstance(args, Mapping) or "score" not in args:
            shown = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False, default=str)
            raise JudgeError(f"the judge's {VERDICT_TOOL} has no score: arguments {shown[:120]!r}")
        score = args["score"]
        if self.bounds is None:
            if score in ("pass", "fail"):
                return bool(score == "pass")
            raise JudgeError(f"the judge's score {score!r} is not on the scale; allowed: 'pass' or 'fail'")
        low, high = self.bounds
        whole = isinstance(score, int) and not isinstance(score, bool)
        if isinstance(score, float) and math.isfinite(score) and score.is_integer():
            score, whole = int(score), True  # 4.0 is 4: JSON does not tell them apart
        if not whole or not low <= score <= high:
            raise JudgeError(f"the judge's score {score!r} is not on the scale; allowed: a whole number from "
                             f"{low} to {high}")
        return int(score)


def _usage(spec: str, messages: Sequence[Message], tools: list[dict[str, Any]], response: ModelResponse) -> Usage:
    """The call's tokens: the endpoint's counts, else counted here (as the engine counts a call without usage)."""
    from .engine.tokens import counter_for_model

    given = response.usage
    if given is not None and given.completion_tokens is not None:
        return Usage(prompt_tokens=given.prompt_tokens, completion_tokens=given.completion_tokens,
                     total_tokens=given.prompt_tokens + given.completion_tokens, source=given.source or "usage")
    counter = counter_for_model(spec)
    sent = [getattr(m, "text", "") or "" for m in messages] + [json.dumps(tools, ensure_ascii=False)]
    prompt = given.prompt_tokens if given is not None else sum(counter.count(t) for t in sent)
    completion = counter.count(response.content or "") + sum(counter.count(c.arguments_text())
                                                             for c in response.tool_calls)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 source=counter.source, encoding=counter.encoding)


def llm_judge(rubric: str, *, model: str, scale: tuple[int, int] | str = (1, 5), reference: str | None = "expected",
              path: str | None = None, max_chars: int = JUDGE_MAX_CHARS) -> LLMJudge:
    """A scorer that asks ``model`` to judge the job's answer against ``rubric`` (docs/design-lab.md#llm-judge).

    ``model``: a spec as ``submit`` takes (``openai:…``, ``scripted:judge.yaml``, ``demo``), checked now.  ``scale``:
    ``(low, high)`` whole numbers (the score is an int) or ``"pass/fail"`` (the score is True for pass).
    ``reference="expected"`` shows the judge the case's ``expected`` when it has one (None: never).  ``path``: judge
    that file of the work directory instead of the final summary.  ``max_chars``: the most of the answer (and of
    the reference) shown.  The verdict is the judge's one call of the ``verdict`` tool; anything else is the score's
    error.  Each call is recorded on the job with ``purpose: "judge"`` and priced apart (``judge_cost_usd``)."""
    if not isinstance(rubric, str) or not rubric.strip():
        raise UsageError(f"llm_judge: rubric {rubric!r}; allowed: non-empty text saying what a good answer is")
    checked_scale = _check_scale(scale)
    if reference not in ("expected", None):
        raise UsageError(f"llm_judge: reference={reference!r}; allowed: 'expected' (the case's expected value, when "
                         "it has one) or None")
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 100:
        raise UsageError(f"llm_judge: max_chars={max_chars!r}; allowed: a whole number ≥ 100 (characters of the "
                         "answer shown to the judge)")
    checked_path = None if path is None else _checked_path(path, "llm_judge")
    spec = _check_judge_model(model)
    return LLMJudge(rubric, model=spec, scale=checked_scale, reference=reference, path=checked_path,
                    max_chars=max_chars)
