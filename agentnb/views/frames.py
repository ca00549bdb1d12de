"""pandas views of the event log: ``ws.frames.usage(job)``, ``ws.frames.jobs()`` and friends.

Every frame is built by **one** query the store runs (:func:`agentnb.store.reads.frame_rows`; for SQLite the SQL is in
``store/frames_sql.py``: payload fields are read with ``json_extract`` and aggregated in SQL), then given
fixed dtypes here; the only work left to pandas is vectorised (``usage``'s call numbers and running sums).
Column names are a stable interface; new columns may be added at the end.

Conventions shared by all frames:

* ``job`` is the job id, ``seq`` the movement's run number within the job (1, 2, …),
  ``movement`` the movement's name, ``iteration`` the LLM call number within that run.
* timestamps are ``datetime64[ns]``, naive, in **UTC**; durations are ``timedelta64[ns]``.
* counts are ``int64``; ``Int64`` (nullable) where a value may be missing.
* text is pandas' ``string`` dtype; ``status``, ``kind``, ``role``, ``source``,
  ``action`` and ``tool`` are categoricals (``action`` is ordered
  ``warn < prompt < force_transition < exhausted < compaction``; only ``usage()`` has ``compaction``,
  the summarisation call of a compaction, docs/context.md#compaction).
* frames that take ``job=None`` cover every job in the store (for comparisons).

=================== ===========================================================================
frame               columns
=================== ===========================================================================
``jobs()``          job, parent, batch, case, piece, model, status, instruction, current_movement,
                    movements, llm_calls, tool_calls, prompt_tokens, completion_tokens, total_tokens,
                    cost_usd, peak_ratio, created, started, ended, error, forked_from_job,
                    forked_from_seq, display_status, id
``movements(job)``  job, seq, movement, status, started, ended, iterations, llm_calls, tool_calls,
                    prompt_tokens, completion_tokens, total_tokens, peak_ratio, actions,
                    next_step, forced, summary, replayed, judge, name, tokens
``messages(job)``   job, event_id, seq, movement, iteration, timestamp, role, kind, tool, call_id,
                    content, chars
``tool_calls(job)`` job, event_id, seq, movement, iteration, timestamp, tool, server, call_id,
                    arguments, is_error, truncated, original_chars, returned_chars, duration, result
``usage(job)``      job, call, seq, movement, iteration, timestamp, prompt_tokens,
                    completion_tokens, total_tokens, cumulative_tokens, cost_usd, source, window,
                    ratio, action, actions, transition, forced, latency_s, ttft_s, replayed, cached, purpose
``lessons(job)``    job, movement, seq, lessons, summary, timestamp
``context_actions`` job, event_id, seq, movement, iteration, timestamp, action, ratio, tokens,
                    window, threshold
``scores(job)``     job, batch, case, name, value, error, ts, latest
``what_if(job, …)`` usage's columns with, each after its twin, ratio_what_if, action_recorded,
                    action_what_if, actions_what_if, forced_what_if, first_forced (``views/what_if.py``)
``divergences(job)`` job, event_id, seq, movement, iteration, timestamp, call_id, tool, expected, actual
``compactions(job)`` job, event_id, seq, movement, iteration, timestamp, tokens_before, tokens_after,
                    removed_messages, kept_messages, summary
``loops(job)``      job, event_id, seq, movement, iteration, timestamp, monitor, cycle, count, runs,
                    summaries, judge, next
=================== ===========================================================================

The issue that specified these frames (and users) call some columns by other names; both work:

=========================  ==================================================================
said                       column
=========================  ==================================================================
jobs: id                   ``job`` (also as ``id``, a copy at the end)
jobs: movements run        ``movements``
jobs: LLM calls            ``llm_calls``
movements: name, tokens    ``movement``, ``total_tokens`` (also as ``name``, ``tokens``, copies at the end)
tool calls: sizes, error   ``original_chars``, ``returned_chars``, ``is_error`` (the event payload keys)
usage: movement seq, name  ``seq``, ``movement``
usage: token source        ``source``
usage: context window      ``window``
=========================  ==================================================================

Details:

* ``jobs().movements`` counts movement runs; ``llm_calls`` / token sums cover every
  ``llm_response`` event of the job (0 when none); ``peak_ratio`` is the highest
  context ratio seen (NaN before the first call).  ``display_status`` is ``status`` as the
  views show it: ``paused`` for a queued job that was stopped or stepped part-way
  (``agentnb._status.display_status``).
* ``jobs().batch`` / ``case`` name the batch a job belongs to and its case index (NA outside a batch;
  ``case`` is nullable ``Int64``).
* ``cost_usd`` is in US dollars, ``float64`` with **NaN** (not pandas' NA) where the price is unknown,
  so it sums, plots and divides like any float column.  ``usage()`` prices each call by its job's model
  spec at the time the call was made (prices change over time) from genai-prices' bundled data, never
  downloaded (``agentnb.models.prices``); offline models (``demo``, ``scripted:``, ``replay:``) cost 0; a
  model genai-prices does not know is NaN, with one ``UnknownPriceWarning`` naming it per process.
  ``jobs().cost_usd`` is the sum of its calls (0 for a job without calls) and **NaN when any of its calls
  is unpriced** — a partial sum would pass for a total.
* ``scores()`` has one row per ``score`` event, oldest first: ``value`` is the scorer's result as it
  returned it (``bool``, ``int``, ``float``, ``str``; ``None`` when it raised, with ``error`` saying why),
  ``ts`` when it was recorded, and ``latest`` is True for the newest score of each name of a job (re-scoring
  adds rows, it does not erase).  Score events are not calls, messages or tool calls: the other frames
  ignore them.
* ``movements().iterations`` is the run's LLM call number reached: a call that failed (the job
  failed with it) counts, so it can exceed ``llm_calls`` by one; a run paused mid-way counts its calls so far.
* ``usage()`` has one row per LLM call (``llm_response`` event).  ``call`` numbers the
  calls of a job from 1; ``prompt_tokens`` is the context size the ContextManager
  accounted for that call, ``total_tokens`` = prompt + completion, and
  ``cumulative_tokens`` the running sum of ``total_tokens`` within the job.
  ``source`` says where the count came from (``usage`` | ``tiktoken`` | ``chars``).
  ContextManager actions fired at that call: ``action`` is the *highest* one (NaN when
  none fired) and ``actions`` lists all of them, comma-separated in firing order
  (e.g. ``"warn,prompt"`` when both thresholds were crossed by the same call).
  A compaction's summarisation call (docs/context.md#compaction; its ``llm_response`` has ``purpose: "compaction"``) is a
  row like any call, with its tokens and price, but it is no turn of the conversation: its ``action`` and
  ``actions`` are ``compaction`` (the ContextManager fires nothing on it), so
  ``usage[usage.action == "compaction"]`` are the summarisation calls and the other rows the conversation's.
  Its ``ratio`` is the summarisation request's size (the whole conversation before it was compacted); the
  call after it shows the compacted context.  ``compactions()`` has the sizes before and after.
  ``transition`` is the ``next_step`` of the transition that ended the movement at
  this call (missing otherwise) and ``forced`` whether it was forced (missing when no transition).
  ``latency_s`` is how long the model took to answer, in seconds (retries and their backoff
  included; NaN for calls recorded before agentnb kept it); ``ttft_s`` how long its first token took, for a
  streamed answer (docs/models.md#streaming; NaN when the call was not streamed).
  ``purpose`` is the call's ``purpose`` (``compaction``, ``judge``; NA for a turn of the conversation).  An LLM
  judge's call (docs/design-lab.md#llm-judge: it scored the ended job) is a row with ``seq``, ``movement`` and
  ``iteration`` missing (``seq`` and ``iteration`` are then nullable ``Int64``), priced by the judge's own model; it adds nothing to ``cumulative_tokens``, and
  ``jobs()``, ``movements()`` and ``messages()`` leave it out (the job's own spending and conversation).
* ``messages()`` holds the chat messages the model saw, in order: ``system`` and ``user``
  prompts (``kind`` movement_start), ``assistant`` replies (``tool`` lists the tools it
  called), ``tool`` results and the ``user`` reminders the loop injected.
* ``tool_calls()`` pairs each ``tool_call`` with its ``tool_result``: ``arguments`` is the JSON
  text of the arguments, ``duration`` the time the tool took, ``result`` what the model saw; ``server`` the
  MCP server whose tool it is (docs/tools.md#mcp-tools), NA for a built-in or Python tool.
  Result columns are missing when a result was never recorded (e.g. a crash).
* Forks (docs/fork-compare.md#fork): ``jobs().forked_from_job`` / ``forked_from_seq`` (nullable ``Int64``, NA for a job that
  is no fork) name the job a fork was made of and the movement run it runs live from.  ``movements().replayed``
  is True for a run re-served from another job's record (its ``movement_start`` names it): a fork's runs before
  its fork point, every run of a ``replay:`` job.  ``usage().replayed`` is True for a call whose response was
  re-served (no tokens spent: its token counts are 0, its ``ratio`` and ``window`` the context as recorded).
  ``usage().cached`` is True for a call answered from the call cache (docs/design-lab.md#call-cache): 0 tokens
  and $0, like a re-served one; ``agentnb cache stats`` keeps what the original call spent.
  ``movements().judge`` is True for a loop monitor's judge run (docs/context.md#loop-monitors): the run right after a
  ``loop_detected`` event that named it as the judge.
  ``divergences()`` has one row per ``replay_divergence``: a tool re-run in a re-served run whose result
  (``actual``) differed from the original's (``expected``).
* ``compactions()`` has one row per ``compaction`` event (docs/context.md#compaction): ``iteration`` is the summarisation
  call's, ``tokens_before`` the context the ContextManager counted before, ``tokens_after`` the compacted
  list's (tool schemas included), ``removed_messages`` / ``kept_messages`` how many messages were dropped
  and kept verbatim after the summary, ``summary`` the summary.  A summarisation call that failed (an
  ``error`` event with ``where`` compaction) made no compaction and has no row.  ``jobs()`` and
  ``movements()`` count summarisation calls in ``llm_calls`` and their tokens in the token sums: they were
  spent.  In ``messages()`` the summarisation call's answer is an ``assistant`` row like any response, and
  the summary the conversation then went on from is a ``user`` row of ``kind`` compaction.
* ``loops()`` has one row per ``loop_detected`` event (docs/context.md#loop-monitors): a loop monitor fired after run ``seq``
  (the run that closed the loop), ``cycle`` repeated ``count`` times over ``runs`` (whose transition
  ``summaries`` the judge read); ``cycle``, ``runs`` and ``summaries`` are Python lists; ``judge`` is the name
  of the judge's run that followed (NA for a monitor without a judge) and ``next`` the monitor's ``next``.
* ``lessons()`` reads ``<workspace>/jobs/<id>/logs/lessons.jsonl`` (the file is the source).
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

from ..engine.context import job_thresholds
from ..engine.jobfiles import logs_folder
from ..errors import UsageError
from ..events import (
    Compaction,
    ContextAction,
    LLMResponse,
    LoopDetected,
    ReplayDivergence,
    ScoreEvent,
    ToolCallEvent,
    ToolResult,
    Transition,
    Usage,
    UsageSource,
    payload_path,
)
from ..models.prices import cost_array, summed_costs
from ..store import reads
from ..store.base import JOB_STATES, FrameQuery, Store
from ..tools.base import ToolError, unlinked_path
from .status import DISPLAY_STATES, display_status
from .style import USAGE_ACTIONS
from .what_if import simulate

# the store ranks actions in SQL in the order the ContextManager fires them

__all__ = ["ACTION_DTYPE", "COLUMNS", "Frames", "HasJobId", "JobArg"]


class HasJobId(Protocol):
    """A job object (the facade's ``Job``): frames only need its id."""

    @property
    def id(self) -> int: ...


# what a frame's ``job`` argument may be: a Job, or a job id (int or digits)
JobArg = HasJobId | int | str

# the ContextManager's actions in firing order, then compaction (usage rows of summarisation calls)
ACTION_DTYPE = pd.CategoricalDtype(list(USAGE_ACTIONS), ordered=True)
_STATUS = pd.CategoricalDtype(list(JOB_STATES))
_MOVEMENT_STATUS = pd.CategoricalDtype(["running", "done", "failed"])
_SOURCE = pd.CategoricalDtype(list(typing.get_args(UsageSource)))
_ROLE = pd.CategoricalDtype(["system", "user", "assistant", "tool"])
_MESSAGE_KIND = pd.CategoricalDtype(["movement_start", "llm_response", "tool_result", "reminder", "compaction"])

# dtype per column: "int" (int64), "Int" (nullable Int64), "float", "time", "delta",
# "iso" (ISO-8601 text), "str", "bool", "boolean" (nullable) or a CategoricalDtype ("cat" = categories found).
_Spec = Mapping[str, Any]


def _fields(cls: type, **dtypes: Any) -> dict[str, Any]:
    """Column specs of columns that are fields of ``cls`` (an event or a value type in it), checked on import:
    a field renamed in events.py fails here, as it does in the store's SQL (``payload_path``)."""
    for name in dtypes:
        payload_path(cls, name)
    return dtypes


_JOBS: _Spec = {
    "job": "int", "parent": "Int", "batch": "str", "case": "Int", "piece": "str", "model": "str", "status": _STATUS,
    "instruction": "str", "current_movement": "str", "movements": "int", "llm_calls": "int", "tool_calls": "int",
    "prompt_tokens": "int", "completion_tokens": "int", "total_tokens": "int", "cost_usd": "float", "peak_ratio": "float",
    "created": "time", "started": "time", "ended": "time", "error": "str",
    "forked_from_job": "Int", "forked_from_seq": "Int",
    "display_status": pd.CategoricalDtype(list(DISPLAY_STATES)), "id": "int",
}
_MOVEMENTS: _Spec = {
    "job": "int", "seq": "int", "movement": "str", "status": _MOVEMENT_STATUS, "started": "time", "ended": "time",
    "iterations": "int", "llm_calls": "int", "tool_calls": "int", "prompt_tokens": "int",
    "completion_tokens": "int", "total_tokens": "int", "peak_ratio": "float", "actions": "str",
    **_fields(Transition, next_step="str", forced="bool", summary="str"), "replayed": "bool",
    "judge": "bool", "name": "str", "tokens": "int",
}
_MESSAGES: _Spec = {
    "job": "int", "event_id": "int", "seq": "Int", "movement": "str", "iteration": "Int", "timestamp": "time",
    "role": _ROLE, "kind": _MESSAGE_KIND, **_fields(ToolResult, tool="str", call_id="str", content="str"), "chars": "int",
}
_TOOL_CALLS: _Spec = {
    "job": "int", "event_id": "int", "seq": "Int", "movement": "str", "iteration": "Int", "timestamp": "time",
    **_fields(ToolCallEvent, tool="cat", server="cat", call_id="str", arguments="str"),
    **_fields(ToolResult, is_error="boolean", truncated="boolean", original_chars="Int", returned_chars="Int"),
    "duration": "delta", "result": "str",
}
_USAGE: _Spec = {
    # seq and iteration are missing on an LLM judge's call (docs/design-lab.md#llm-judge), made outside any movement
    # run: "int" is then nullable Int64, as for any missing value
    "job": "int", "call": "int", "seq": "int", "movement": "str", "iteration": "int", "timestamp": "time",
    **_fields(Usage, prompt_tokens="int", completion_tokens="int", total_tokens="int"), "cumulative_tokens": "int",
    "cost_usd": "float",
    **_fields(Usage, source=_SOURCE, window="int", ratio="float"), "action": ACTION_DTYPE, "actions": "str",
    "transition": "str", "forced": "boolean", **_fields(LLMResponse, latency_s="float", ttft_s="float"),
    "replayed": "bool", "cached": "bool", **_fields(LLMResponse, purpose="str"),
}
_LESSONS: _Spec = {
    "job": "int", "movement": "str", "seq": "Int", "lessons": "str", "summary": "str", "timestamp": "iso",
}
_CONTEXT_ACTIONS: _Spec = {
    "job": "int", "event_id": "int", "seq": "Int", "movement": "str", "iteration": "Int", "timestamp": "time",
    **_fields(ContextAction, action=ACTION_DTYPE, ratio="float", tokens="int", window="int", threshold="float"),
}

_SCORES: _Spec = {
    "job": "int", "batch": "str", "case": "Int", **_fields(ScoreEvent, name="str", value="object", error="str"),
    "ts": "time", "latest": "bool",
}

_DIVERGENCES: _Spec = {
    "job": "int", "event_id": "int", "seq": "Int", "movement": "str", "iteration": "Int", "timestamp": "time",
    **_fields(ReplayDivergence, call_id="str", tool="str", expected="str", actual="str"),
}

_COMPACTIONS: _Spec = {
    "job": "int", "event_id": "int", "seq": "Int", "movement": "str", "iteration": "Int", "timestamp": "time",
    **_fields(Compaction, tokens_before="int", tokens_after="int", removed_messages="int", kept_messages="int",
              summary="str"),
}

_LOOPS: _Spec = {
    "job": "int", "event_id": "int", "seq": "Int", "movement": "str", "iteration": "Int", "timestamp": "time",
    **_fields(LoopDetected, monitor="str", cycle="object", count="int", runs="object", summaries="object",
              judge="str", next="str"),
}

COLUMNS: dict[str, tuple[str, ...]] = {
    "jobs": tuple(_JOBS), "movements": tuple(_MOVEMENTS), "messages": tuple(_MESSAGES),
    "tool_calls": tuple(_TOOL_CALLS), "usage": tuple(_USAGE), "lessons": tuple(_LESSONS),
    "context_actions": tuple(_CONTEXT_ACTIONS), "scores": tuple(_SCORES), "divergences": tuple(_DIVERGENCES),
    "compactions": tuple(_COMPACTIONS), "loops": tuple(_LOOPS),
}

class Frames:
    """The DataFrame views of one workspace (``ws.frames``); see the module docstring for the columns.

    Built by the facade from what the views need: the store, the workspace folder (``lessons`` reads
    ``jobs/<id>/logs/lessons.jsonl``), how a ``job`` argument becomes an id (with the facade's errors),
    the thresholds of a job's piece, and the facade's name (for ``repr``).
    """

    # job_id is the facade's own check of a job argument (its errors name what was wrong)
    def __init__(self, store: Store, root: Path, *, job_id: Callable[[Any], int],
                 piece_thresholds: Callable[[int], Mapping[str, float]], name: str) -> None:
        self.store = store
        self.root = root
        self._job_id = job_id
        self._piece_thresholds = piece_thresholds
        self._name = name

    def __repr__(self) -> str:
        return f"<Frames of {self._name}: {', '.join(COLUMNS)}>"

    # -- plumbing -------------------------------------------------------------
    def _job(self, job: JobArg | None) -> int | None:
        if job is None:
            return None
        job_id = self._job_id(job)
        self.store.job(job_id)  # an unknown job is an error, not an empty frame
        return job_id

    def _raw(self, frame: FrameQuery, job_id: int | None) -> pd.DataFrame:
        names, rows = reads.frame_rows(self.store, frame, job_id)
        return pd.DataFrame.from_records(rows, columns=names)

    def _query(self, frame: FrameQuery, job_id: int | None, spec: _Spec) -> pd.DataFrame:
        return _typed(self._raw(frame, job_id), spec)

    def _models(self, job_id: int | None) -> dict[int, str]:
        """Job id → model spec (of one job, or of every job)."""
        return {int(job): str(model) for job, model in reads.frame_rows(self.store, "job_models", job_id)[1]}

    def _job_costs(self, raw: pd.DataFrame) -> np.ndarray:
        """Each job's cost in US dollars from the jobs query's rows: its calls' sum, NaN when any is unpriced.

        A job whose calls all fell on one UTC day is priced from its token sums (a price holds for a day);
        the others (calls over midnight, or a model priced call by call) are read again call by call.
        """
        calls = pd.to_numeric(raw["llm_calls"]).to_numpy(dtype="float64")
        first = pd.to_numeric(raw["first_day"]).to_numpy(dtype="float64")
        last = pd.to_numeric(raw["last_day"]).to_numpy(dtype="float64")
        specs = raw["model"].to_numpy(dtype=object)
        costs = np.zeros(len(raw))  # no call, no cost (whatever the model: an unknown one is not warned about)
        exact = np.ones(len(raw), dtype=bool)
        made = calls > 0
        costs[made], exact[made] = summed_costs(
            specs[made], calls[made], pd.to_numeric(raw["prompt_tokens"]).to_numpy()[made],
            pd.to_numeric(raw["completion_tokens"]).to_numpy()[made], first[made])
        ids = raw["job"].to_numpy()
        for i in np.flatnonzero(made & (~exact | (first != last))):
            rows = self._raw("call_costs", int(ids[i]))
            per_call = cost_array([specs[i]] * len(rows), pd.to_numeric(rows["prompt_tokens"]),
                                  pd.to_numeric(rows["completion_tokens"]), pd.to_numeric(rows["ts"]))
            costs[i] = per_call.sum()  # NaN when any call is unpriced: a partial sum would pass for a total
        return costs

    # -- frames -------------------------------------------------------------------
    def jobs(self) -> pd.DataFrame:
        """One row per job: what ran (its batch and case when it is part of one), its status, and its totals.

        ``cost_usd`` is the sum of the prices of the job's calls in US dollars (0 without calls) and NaN when
        any of its calls has no price (a model genai-prices does not know): a partial sum is not a total.
        """
        raw = self._raw("jobs", None)
        df = _typed(raw, {k: v for k, v in _JOBS.items() if k != "cost_usd"} | {"status_reason": "str"})
        df.insert(COLUMNS["jobs"].index("cost_usd"), "cost_usd", self._job_costs(raw))
        reasons = df.pop("status_reason").astype(object)
        df["display_status"] = pd.Series([display_status(s, r) for s, r in zip(df["status"].astype(object), reasons, strict=True)],
                                         index=df.index, dtype=_JOBS["display_status"])
        return df

    def movements(self, job: JobArg | None = None) -> pd.DataFrame:
        """One row per movement run of ``job`` (every job when ``None``)."""
        return self._query("movements", self._job(job), _MOVEMENTS)

    def messages(self, job: JobArg | None = None) -> pd.DataFrame:
        """One row per chat message the model saw (prompts, replies, tool results, reminders)."""
        df = self._query("messages", self._job(job), {**_MESSAGES, "part": "int"})
        df = df.drop(columns="part")
        df["chars"] = df["content"].str.len().fillna(0).astype("int64")
        return df

    def tool_calls(self, job: JobArg | None = None) -> pd.DataFrame:
        """One row per tool call with its result's flags and sizes."""
        return self._query("tool_calls", self._job(job), _TOOL_CALLS)

    def usage(self, job: JobArg | None = None) -> pd.DataFrame:
        """One row per LLM call of ``job`` (every job when ``None``), with the actions it fired and its price
        (``cost_usd``, US dollars at the time of the call; NaN when the model has no price)."""
        job_id = self._job(job)
        spec = {k: v for k, v in _USAGE.items() if k not in ("call", "cumulative_tokens", "cost_usd")}
        raw = self._raw("usage", job_id)
        # priced before typing: the raw epoch seconds and counts go straight to numpy
        specs = raw["job"].map(self._models(job_id)).to_numpy(dtype=object)
        judged = raw.pop("call_model").to_numpy(dtype=object)  # a judge's call names its own model
        specs = np.where(pd.isna(judged), specs, judged)
        cost = cost_array(specs, pd.to_numeric(raw["prompt_tokens"]), pd.to_numeric(raw["completion_tokens"]),
                          pd.to_numeric(raw["timestamp"]))
        df = _typed(raw, {**spec, "action": "Int"})
        # rows are in (job, id) order: numbering and running sums are vectorised, per job
        by_job = df.groupby("job", sort=False)
        df.insert(1, "call", (by_job.cumcount() + 1).astype("int64"))
        # the job's own running sum: a judge's call (after the job ended) adds nothing to it
        own = df["total_tokens"].where(df["purpose"].ne("judge").fillna(True).astype(bool), 0)
        df.insert(COLUMNS["usage"].index("cumulative_tokens"), "cumulative_tokens",
                  own.groupby(df["job"], sort=False).cumsum().astype(df["total_tokens"].dtype))
        df.insert(COLUMNS["usage"].index("cost_usd"), "cost_usd", cost)
        # the SQL ranks actions 1..4 (5: a compaction's summarisation call); map the rank back to the category
        df["action"] = pd.Categorical.from_codes(
            (df["action"].fillna(0).astype("int64") - 1).to_numpy(), dtype=ACTION_DTYPE
        )
        if job_id is not None:
            df.attrs["job"] = job_id
            df.attrs["thresholds"] = self.thresholds(job_id)
        return df

    def what_if(self, job: JobArg, window: int | None = None,
                thresholds: Mapping[str, float] | None = None) -> pd.DataFrame:
        """``usage(job)`` with the ContextManager's actions recomputed from the recorded prompt token counts
        under another ``window`` (None: each call's recorded one) and ``thresholds`` (some or all actions,
        merged over the job's): ``action_recorded``, ``action_what_if``, ``actions_what_if``,
        ``ratio_what_if``, ``forced_what_if``, ``first_forced``, each right after its recorded twin
        (``ratio``, ``action``, ``actions``, ``forced``); ``attrs["what_if"]`` holds the settings.

        A simulation of the ContextManager alone: a movement forced to transition earlier would have
        changed everything after it, and calls the job never made cannot be simulated
        (``agentnb.views.what_if`` says how it is computed)."""
        job_id = self._job(job)
        if job_id is None:  # one job's settings are simulated: a frame of every job has no one window
            raise UsageError("what_if(None): allowed: a Job or a job id")
        usage = self.usage(job_id)
        usage = usage[usage["purpose"].ne("judge").fillna(True).astype(bool)]  # a judge's calls had no context to manage
        # the calls a fork re-served record 0 tokens: the simulation takes their context from ratio × window
        replayed = usage["replayed"].fillna(False).to_numpy(dtype=bool)
        return simulate(usage, window=window, thresholds=thresholds, replayed=replayed)

    def context_actions(self, job: JobArg | None = None) -> pd.DataFrame:
        """One row per ContextManager action (``context_action`` event)."""
        return self._query("context_actions", self._job(job), _CONTEXT_ACTIONS)

    def divergences(self, job: JobArg | None = None) -> pd.DataFrame:
        """One row per ``replay_divergence`` of ``job`` (every job when ``None``): a tool a fork (or a replay)
        ran again in a re-served run whose result, ``actual``, differed from the original's, ``expected``."""
        return self._query("divergences", self._job(job), _DIVERGENCES)

    def compactions(self, job: JobArg | None = None) -> pd.DataFrame:
        """One row per ``compaction`` of ``job`` (every job when ``None``, docs/context.md#compaction): a movement run's messages
        replaced by a summary, with the context's size before and after (see the module docstring)."""
        return self._query("compactions", self._job(job), _COMPACTIONS)

    def loops(self, job: JobArg | None = None) -> pd.DataFrame:
        """One row per ``loop_detected`` of ``job`` (every job when ``None``, docs/context.md#loop-monitors): a loop monitor fired
        (see the module docstring)."""
        raw = self._raw("loops", self._job(job))
        for name in ("cycle", "runs", "summaries"):  # JSON text from the store: lists here
            raw[name] = pd.Series([None if v is None else json.loads(v) for v in raw[name]], index=raw.index,
                                  dtype=object)
        return _typed(raw, _LOOPS)

    def scores(self, job: JobArg | None = None) -> pd.DataFrame:
        """One row per ``score`` event of ``job`` (every job when ``None``), oldest first; ``latest`` marks the
        newest score of each name of a job (a re-score supersedes, it does not erase)."""
        raw = self._raw("scores", self._job(job))
        # the store gives each value as JSON text: a bool stays a bool and an int an int
        raw["value"] = pd.Series([None if v is None else json.loads(v) for v in raw["value"]],
                                 index=raw.index, dtype=object)
        newest = raw.groupby(["job", "name"], sort=False)["event_id"].transform("max") if len(raw) else raw["event_id"]
        raw["latest"] = raw["event_id"] == newest
        return _typed(raw, _SCORES)

    def lessons(self, job: JobArg | None = None) -> pd.DataFrame:
        """The rows of ``logs/lessons.jsonl`` of ``job`` (every job when ``None``)."""
        job_id = self._job(job)
        ids = [job_id] if job_id is not None else self.store.job_ids()
        records: list[dict[str, Any]] = []
        for i in ids:
            if self.store.keeps_files:  # docs/stores.md#files: the job may have run elsewhere; the store has its file
                text = self.store.file_data(i, ["logs/lessons.jsonl"]).get("logs/lessons.jsonl", b"").decode(
                    "utf-8", "replace")
            else:
                try:
                    # a link planted in logs/ (the work directory's Bash may write there) is not the job's file
                    logs = logs_folder(self.root, self.store.job(i), False)
                    path = unlinked_path(logs.parent, logs.name, "lessons.jsonl")
                except ToolError:
                    continue
                if not path.is_file():
                    continue
                text = path.read_text(encoding="utf-8")
            for line in text.splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line torn by a crash mid-write
                if isinstance(rec, dict):
                    records.append({**rec, "job": rec.get("job", i)})
        return _typed(pd.DataFrame.from_records(records, columns=list(_LESSONS)), _LESSONS)

    # -- helpers ------------------------------------------------------------------
    def thresholds(self, job: JobArg) -> dict[str, float]:
        """The ContextManager thresholds a job runs with: its piece's, overridden by ``context=`` at submit."""
        job_id = self._job_id(job)
        return job_thresholds(self._piece_thresholds(job_id), self.store.job(job_id).options)


def _parse_iso(values: pd.Series) -> pd.Series:
    """ISO-8601 text with an offset (``lessons.jsonl``) as naive UTC ``datetime64[ns]``."""
    parsed = pd.to_datetime(values, utc=True, errors="coerce", format="ISO8601")
    return parsed.dt.tz_convert(None).astype("datetime64[ns]")


def _typed(df: pd.DataFrame, spec: _Spec) -> pd.DataFrame:
    """Give each column of ``spec`` its fixed dtype (on empty frames too)."""
    out: dict[str, pd.Series] = {}
    for name, kind in spec.items():
        col = df[name] if name in df else pd.Series([None] * len(df), index=df.index, dtype=object)
        if isinstance(kind, pd.CategoricalDtype):
            out[name] = col.astype(kind)
        elif kind == "cat":
            out[name] = col.astype("string").astype("category")
        elif kind == "int":
            # a hand-edited store may lack a value; keep the numbers rather than fail
            out[name] = col.astype("int64") if not col.isna().any() else col.astype("Int64")
        elif kind == "Int":
            out[name] = pd.to_numeric(col).astype("Int64")
        elif kind == "float":
            out[name] = pd.to_numeric(col).astype("float64")
        elif kind == "time":
            out[name] = pd.to_datetime(pd.to_numeric(col), unit="s").astype("datetime64[ns]")
        elif kind == "iso":
            out[name] = _parse_iso(col)
        elif kind == "delta":
            out[name] = pd.to_timedelta(pd.to_numeric(col), unit="s").astype("timedelta64[ns]")
        elif kind == "str":
            out[name] = col.astype("string")
        elif kind == "object":
            out[name] = col.astype(object)
        elif kind == "bool":
            out[name] = col.fillna(0).astype(bool) if len(col) else col.astype(bool)
        elif kind == "boolean":
            out[name] = pd.to_numeric(col).astype("boolean")
        else:  # pragma: no cover - a typo in a spec above
            raise ValueError(f"unknown column kind {kind!r}")
    return pd.DataFrame(out, index=pd.RangeIndex(len(df)))
