"""pandas views of the event log: ``ws.frames.usage(job)``, ``ws.frames.jobs()`` and friends.

Every frame is built by **one** SQL query over the store (payload fields are read
with SQLite's ``json_extract`` and aggregated in SQL), then given fixed dtypes; the only
work left to pandas is vectorised (``usage``'s call numbers and running sums).
Column names are a stable interface; new columns may be added at the end.

Conventions shared by all frames:

* ``job`` is the job id, ``seq`` the movement's run number within the job (1, 2, …),
  ``movement`` the movement's name, ``iteration`` the LLM call number within that run.
* timestamps are ``datetime64[ns]``, naive, in **UTC**; durations are ``timedelta64[ns]``.
* counts are ``int64``; ``Int64`` (nullable) where a value may be missing.
* text is pandas' ``string`` dtype; ``status``, ``kind``, ``role``, ``source``,
  ``action`` and ``tool`` are categoricals (``action`` is ordered
  ``warn < prompt < force_transition < exhausted``).
* frames that take ``job=None`` cover every job in the store (for comparisons).

=================== ===========================================================================
frame               columns
=================== ===========================================================================
``jobs()``          job, parent, piece, model, status, instruction, current_movement, movements,
                    llm_calls, tool_calls, prompt_tokens, completion_tokens, total_tokens,
                    peak_ratio, created, started, ended, error, display_status, id
``movements(job)``  job, seq, movement, status, started, ended, iterations, llm_calls, tool_calls,
                    prompt_tokens, completion_tokens, total_tokens, peak_ratio, actions,
                    next_step, forced, summary, name, tokens
``messages(job)``   job, event_id, seq, movement, iteration, timestamp, role, kind, tool, call_id,
                    content, chars
``tool_calls(job)`` job, event_id, seq, movement, iteration, timestamp, tool, call_id, arguments,
                    is_error, truncated, original_chars, returned_chars, duration, result
``usage(job)``      job, call, seq, movement, iteration, timestamp, prompt_tokens,
                    completion_tokens, total_tokens, cumulative_tokens, source, window, ratio,
                    action, actions, transition, forced, latency_s
``lessons(job)``    job, movement, seq, lessons, summary, timestamp
``context_actions`` job, event_id, seq, movement, iteration, timestamp, action, ratio, tokens,
                    window, threshold
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
  ``transition`` is the ``next_step`` of the transition that ended the movement at
  this call (missing otherwise) and ``forced`` whether it was forced (missing when no transition).
  ``latency_s`` is how long the model took to answer, in seconds (retries and their backoff
  included; NaN for calls recorded before agentnb kept it).
* ``messages()`` holds the chat messages the model saw, in order: ``system`` and ``user``
  prompts (``kind`` movement_start), ``assistant`` replies (``tool`` lists the tools it
  called), ``tool`` results and the ``user`` reminders the loop injected.
* ``tool_calls()`` pairs each ``tool_call`` with its ``tool_result``: ``arguments`` is the JSON
  text of the arguments, ``duration`` the time the tool took, ``result`` what the model saw.
  Result columns are missing when a result was never recorded (e.g. a crash).
* ``lessons()`` reads ``<workspace>/jobs/<id>/logs/lessons.jsonl`` (the file is the source).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

from ..engine.context import ACTIONS, job_thresholds
from ..store.sqlite import JOB_STATES, instruction_sql, payload_text_sql
from ..tools.base import ToolError, unlinked_path
from .status import DISPLAY_STATES, display_status

if TYPE_CHECKING:
    from ..workspace import JobRef, Workspace

__all__ = ["ACTION_DTYPE", "COLUMNS", "Frames"]

ACTION_DTYPE = pd.CategoricalDtype(list(ACTIONS), ordered=True)
_STATUS = pd.CategoricalDtype(list(JOB_STATES))
_MOVEMENT_STATUS = pd.CategoricalDtype(["running", "done", "failed"])
_SOURCE = pd.CategoricalDtype(["usage", "tiktoken", "chars"])
_ROLE = pd.CategoricalDtype(["system", "user", "assistant", "tool"])
_MESSAGE_KIND = pd.CategoricalDtype(["movement_start", "llm_response", "tool_result", "reminder"])

# dtype per column: "int" (int64), "Int" (nullable Int64), "float", "time", "delta",
# "iso" (ISO-8601 text), "str", "bool", "boolean" (nullable) or a CategoricalDtype ("cat" = categories found).
_Spec = Mapping[str, Any]

_JOBS: _Spec = {
    "job": "int", "parent": "Int", "piece": "str", "model": "str", "status": _STATUS, "instruction": "str",
    "current_movement": "str", "movements": "int", "llm_calls": "int", "tool_calls": "int",
    "prompt_tokens": "int", "completion_tokens": "int", "total_tokens": "int", "peak_ratio": "float",
    "created": "time", "started": "time", "ended": "time", "error": "str",
    "display_status": pd.CategoricalDtype(list(DISPLAY_STATES)), "id": "int",
}
_MOVEMENTS: _Spec = {
    "job": "int", "seq": "int", "movement": "str", "status": _MOVEMENT_STATUS, "started": "time", "ended": "time",
    "iterations": "int", "llm_calls": "int", "tool_calls": "int", "prompt_tokens": "int",
    "completion_tokens": "int", "total_tokens": "int", "peak_ratio": "float", "actions": "str",
    "next_step": "str", "forced": "bool", "summary": "str", "name": "str", "tokens": "int",
}
_MESSAGES: _Spec = {
    "job": "int", "event_id": "int", "seq": "Int", "movement": "str", "iteration": "Int", "timestamp": "time",
    "role": _ROLE, "kind": _MESSAGE_KIND, "tool": "str", "call_id": "str", "content": "str", "chars": "int",
}
_TOOL_CALLS: _Spec = {
    "job": "int", "event_id": "int", "seq": "Int", "movement": "str", "iteration": "Int", "timestamp": "time",
    "tool": "cat", "call_id": "str", "arguments": "str", "is_error": "boolean", "truncated": "boolean",
    "original_chars": "Int", "returned_chars": "Int", "duration": "delta", "result": "str",
}
_USAGE: _Spec = {
    "job": "int", "call": "int", "seq": "int", "movement": "str", "iteration": "int", "timestamp": "time",
    "prompt_tokens": "int", "completion_tokens": "int", "total_tokens": "int", "cumulative_tokens": "int",
    "source": _SOURCE, "window": "int", "ratio": "float", "action": ACTION_DTYPE, "actions": "str",
    "transition": "str", "forced": "boolean", "latency_s": "float",
}
_LESSONS: _Spec = {
    "job": "int", "movement": "str", "seq": "Int", "lessons": "str", "summary": "str", "timestamp": "iso",
}
_CONTEXT_ACTIONS: _Spec = {
    "job": "int", "event_id": "int", "seq": "Int", "movement": "str", "iteration": "Int", "timestamp": "time",
    "action": ACTION_DTYPE, "ratio": "float", "tokens": "int", "window": "int", "threshold": "float",
}

COLUMNS: dict[str, tuple[str, ...]] = {
    "jobs": tuple(_JOBS), "movements": tuple(_MOVEMENTS), "messages": tuple(_MESSAGES),
    "tool_calls": tuple(_TOOL_CALLS), "usage": tuple(_USAGE), "lessons": tuple(_LESSONS),
    "context_actions": tuple(_CONTEXT_ACTIONS),
}

# -- SQL -------------------------------------------------------------------------
# ``{job}`` is replaced by `` AND <alias>.job_id=?`` or nothing; the events_kind
# index (kind, job_id) serves every per-kind scan below.


def _jx(alias: str, path: str) -> str:
    return f"json_extract({alias}.payload, '$.{path}')"


_MOVEMENT_NAME = "LEFT JOIN movements m ON m.job_id = e.job_id AND m.seq = e.movement_seq"



def _action_rank(expr: str) -> str:
    """SQL ranking an action name 1..4 in threshold order, so MAX picks the highest action."""
    return f"CASE {expr} " + " ".join(f"WHEN '{a}' THEN {i}" for i, a in enumerate(ACTIONS, start=1)) + " END"


# ca and tr are small: MATERIALIZED builds each once (with an automatic index) instead of
# probing the events index once per LLM call.  Rows come out of events_kind (kind, job_id, id)
# already in (job, id) order, so there is no sort; call numbers and running sums are added by pandas.
_USAGE_SQL = f"""
WITH ca AS MATERIALIZED (
    SELECT c.job_id, c.movement_seq, c.iteration,
           MAX({_action_rank(_jx('c', 'action'))}) AS rank,
           group_concat({_jx('c', 'action')}, ',') AS actions
    FROM events c WHERE c.kind = 'context_action'{{job_c}}
    GROUP BY c.job_id, c.movement_seq, c.iteration
),
tr AS MATERIALIZED (
    SELECT t.job_id, t.movement_seq, t.iteration,
           {_jx('t', 'next_step')} AS next_step, {_jx('t', 'forced')} AS forced
    FROM events t WHERE t.kind = 'transition'{{job_t}}
)
SELECT e.job_id AS job, e.movement_seq AS seq, m.name AS movement, e.iteration, e.ts AS timestamp,
       {_jx('e', 'usage.prompt_tokens')} AS prompt_tokens,
       {_jx('e', 'usage.completion_tokens')} AS completion_tokens,
       {_jx('e', 'usage.total_tokens')} AS total_tokens,
       {_jx('e', 'usage.source')} AS source,
       {_jx('e', 'usage.window')} AS window,
       {_jx('e', 'usage.ratio')} AS ratio,
       ca.rank AS action, ca.actions, tr.next_step AS transition, tr.forced,
       {_jx('e', 'latency_s')} AS latency_s
FROM events e
LEFT JOIN movements m ON m.job_id = e.job_id AND m.seq = e.movement_seq
LEFT JOIN ca ON ca.job_id = e.job_id AND ca.movement_seq = e.movement_seq AND ca.iteration = e.iteration
LEFT JOIN tr ON tr.job_id = e.job_id AND tr.movement_seq = e.movement_seq AND tr.iteration = e.iteration
WHERE e.kind = 'llm_response'{{job_e}}
ORDER BY e.job_id, e.id
"""

_JOBS_SQL = f"""
SELECT j.id AS job, j.parent_id AS parent, j.piece, j.model, j.status, {instruction_sql('j')} AS instruction,
       j.current_movement,
       (SELECT COUNT(*) FROM movements mv WHERE mv.job_id = j.id) AS movements,
       COALESCE(a.llm_calls, 0) AS llm_calls,
       (SELECT COUNT(*) FROM events t WHERE t.kind = 'tool_call' AND t.job_id = j.id) AS tool_calls,
       COALESCE(a.prompt_tokens, 0) AS prompt_tokens, COALESCE(a.completion_tokens, 0) AS completion_tokens,
       COALESCE(a.total_tokens, 0) AS total_tokens, a.peak_ratio,
       j.created, j.started, j.ended, j.error, j.id AS id,
       (SELECT {_jx('s', 'reason')} FROM events s WHERE s.kind = 'job_status' AND s.job_id = j.id
        ORDER BY s.id DESC LIMIT 1) AS status_reason
FROM jobs j
LEFT JOIN (
    SELECT e.job_id, COUNT(*) AS llm_calls,
           SUM({_jx('e', 'usage.prompt_tokens')}) AS prompt_tokens,
           SUM({_jx('e', 'usage.completion_tokens')}) AS completion_tokens,
           SUM({_jx('e', 'usage.total_tokens')}) AS total_tokens,
           MAX({_jx('e', 'usage.ratio')}) AS peak_ratio
    FROM events e WHERE e.kind = 'llm_response'
    GROUP BY e.job_id
) a ON a.job_id = j.id
ORDER BY j.id
"""

_MOVEMENTS_SQL = f"""
SELECT m.job_id AS job, m.seq, m.name AS movement, m.status, m.started, m.ended,
       -- the row's count is written when the run ends: a run paused mid-way (stepped) has made calls already
       MAX(m.iterations, COALESCE(a.last_iteration, 0)) AS iterations,
       COALESCE(a.llm_calls, 0) AS llm_calls, COALESCE(a.tool_calls, 0) AS tool_calls,
       COALESCE(a.prompt_tokens, 0) AS prompt_tokens, COALESCE(a.completion_tokens, 0) AS completion_tokens,
       COALESCE(a.total_tokens, 0) AS total_tokens, a.peak_ratio, a.actions,
       m.next_step, m.forced, m.summary, m.name AS name, COALESCE(a.total_tokens, 0) AS tokens
FROM movements m
LEFT JOIN (
    SELECT e.job_id, e.movement_seq,
           SUM(e.kind = 'llm_response') AS llm_calls,
           MAX(CASE WHEN e.kind = 'llm_response' THEN e.iteration END) AS last_iteration,
           SUM(e.kind = 'tool_call') AS tool_calls,
           SUM(CASE WHEN e.kind = 'llm_response' THEN {_jx('e', 'usage.prompt_tokens')} END) AS prompt_tokens,
           SUM(CASE WHEN e.kind = 'llm_response' THEN {_jx('e', 'usage.completion_tokens')} END) AS completion_tokens,
           SUM(CASE WHEN e.kind = 'llm_response' THEN {_jx('e', 'usage.total_tokens')} END) AS total_tokens,
           MAX(CASE WHEN e.kind = 'llm_response' THEN {_jx('e', 'usage.ratio')} END) AS peak_ratio,
           group_concat(CASE WHEN e.kind = 'context_action' THEN {_jx('e', 'action')} END, ',') AS actions
    FROM events e WHERE e.kind IN ('llm_response', 'tool_call', 'context_action'){{job_e}}
    GROUP BY e.job_id, e.movement_seq
) a ON a.job_id = m.job_id AND a.movement_seq = m.seq
{{where_m}}
ORDER BY m.job_id, m.seq
"""

_EVENT_HEAD = "e.job_id AS job, e.id AS event_id, e.movement_seq AS seq, m.name AS movement, e.iteration, e.ts AS timestamp"

_MESSAGES_SQL = f"""
SELECT * FROM (
    SELECT {_EVENT_HEAD}, 'system' AS role, e.kind, NULL AS tool, NULL AS call_id,
           {_jx('e', 'system')} AS content, 0 AS part
    FROM events e {_MOVEMENT_NAME} WHERE e.kind = 'movement_start'{{job_e}}
    UNION ALL
    SELECT {_EVENT_HEAD}, 'user', e.kind, NULL, NULL, {payload_text_sql('e', 'user')}, 1
    FROM events e {_MOVEMENT_NAME} WHERE e.kind = 'movement_start'{{job_e}}
    UNION ALL
    SELECT {_EVENT_HEAD}, 'assistant', e.kind,
           (SELECT group_concat(json_extract(tc.value, '$.name'), ',') FROM json_each(e.payload, '$.tool_calls') tc),
           NULL, {_jx('e', 'content')}, 0
    FROM events e {_MOVEMENT_NAME} WHERE e.kind = 'llm_response'{{job_e}}
    UNION ALL
    SELECT {_EVENT_HEAD}, 'tool', e.kind, {_jx('e', 'tool')}, {_jx('e', 'call_id')}, {_jx('e', 'content')}, 0
    FROM events e {_MOVEMENT_NAME} WHERE e.kind = 'tool_result'{{job_e}}
    UNION ALL
    SELECT {_EVENT_HEAD}, 'user', e.kind, NULL, NULL, {_jx('e', 'text')}, 0
    FROM events e {_MOVEMENT_NAME} WHERE e.kind = 'reminder'{{job_e}}
)
ORDER BY job, event_id, part
"""

_TOOL_CALLS_SQL = f"""
SELECT {_EVENT_HEAD}, {_jx('e', 'tool')} AS tool, {_jx('e', 'call_id')} AS call_id,
       CASE json_type(e.payload, '$.arguments') WHEN 'text' THEN {_jx('e', 'arguments')}
            ELSE json(json_extract(e.payload, '$.arguments')) END AS arguments,
       {_jx('r', 'is_error')} AS is_error, {_jx('r', 'truncated')} AS truncated,
       {_jx('r', 'original_chars')} AS original_chars, {_jx('r', 'returned_chars')} AS returned_chars,
       r.ts - e.ts AS duration, {_jx('r', 'content')} AS result
FROM events e {_MOVEMENT_NAME}
LEFT JOIN events r ON r.id = (
    -- the first matching result after the call; ORDER BY … LIMIT 1 stops there (MIN would scan on)
    SELECT x.id FROM events x
    WHERE x.kind = 'tool_result' AND x.job_id = e.job_id AND x.id > e.id
      AND {_jx('x', 'call_id')} IS {_jx('e', 'call_id')}
    ORDER BY x.id LIMIT 1
)
WHERE e.kind = 'tool_call'{{job_e}}
ORDER BY e.job_id, e.id
"""

_CONTEXT_ACTIONS_SQL = f"""
SELECT {_EVENT_HEAD}, {_jx('e', 'action')} AS action, {_jx('e', 'ratio')} AS ratio,
       {_jx('e', 'tokens')} AS tokens, {_jx('e', 'window')} AS window, {_jx('e', 'threshold')} AS threshold
FROM events e {_MOVEMENT_NAME}
WHERE e.kind = 'context_action'{{job_e}}
ORDER BY e.job_id, e.id
"""


class Frames:
    """The DataFrame views of one workspace (``ws.frames``); see the module docstring for the columns."""

    def __init__(self, ws: Workspace) -> None:
        self.ws = ws

    def __repr__(self) -> str:
        return f"<Frames of {self.ws!r}: {', '.join(COLUMNS)}>"

    # -- plumbing -------------------------------------------------------------
    def _job(self, job: JobRef | None) -> int | None:
        if job is None:
            return None
        job_id = self.ws._id(job)
        self.ws.store.job(job_id)  # an unknown job is an error, not an empty frame
        return job_id

    def _query(self, sql: str, params: Sequence[Any], spec: _Spec) -> pd.DataFrame:
        store = self.ws.store
        with store._lock:
            cur = store.conn.execute(sql, tuple(params))
            cur.row_factory = None  # type: ignore[assignment]  # plain tuples: no sqlite3.Row per row
            rows = cur.fetchall()
            names = [d[0] for d in cur.description]
        return _typed(pd.DataFrame.from_records(rows, columns=names), spec)

    @staticmethod
    def _scoped(sql: str, job_id: int | None, aliases: Sequence[str]) -> tuple[str, list[Any]]:
        """Fill the ``{job_<alias>}`` / ``{where_<alias>}`` slots, in the order they appear in ``sql``."""
        params: list[Any] = []
        fills: dict[str, str] = {}
        for a in aliases:
            fills[f"job_{a}"] = "" if job_id is None else f" AND {a}.job_id = ?"
            fills[f"where_{a}"] = "" if job_id is None else f"WHERE {a}.{'id' if a == 'j' else 'job_id'} = ?"
        if job_id is not None:
            # one parameter per slot occurrence, in textual order
            params = [job_id] * len(re.findall(r"\{(?:job|where)_\w\}", sql))
        return sql.format(**fills), params

    # -- frames -------------------------------------------------------------------
    def jobs(self) -> pd.DataFrame:
        """One row per job: what ran, its status, and its totals."""
        df = self._query(_JOBS_SQL, (), {**_JOBS, "status_reason": "str"})
        reasons = df.pop("status_reason").astype(object)
        df["display_status"] = pd.Series([display_status(s, r) for s, r in zip(df["status"].astype(object), reasons)],
                                         index=df.index, dtype=_JOBS["display_status"])
        return df

    def movements(self, job: JobRef | None = None) -> pd.DataFrame:
        """One row per movement run of ``job`` (every job when ``None``)."""
        sql, params = self._scoped(_MOVEMENTS_SQL, self._job(job), ("e", "m"))
        return self._query(sql, params, _MOVEMENTS)

    def messages(self, job: JobRef | None = None) -> pd.DataFrame:
        """One row per chat message the model saw (prompts, replies, tool results, reminders)."""
        sql, params = self._scoped(_MESSAGES_SQL, self._job(job), ("e",))
        df = self._query(sql, params, {**_MESSAGES, "part": "int"})
        df = df.drop(columns="part")
        df["chars"] = df["content"].str.len().fillna(0).astype("int64")
        return df

    def tool_calls(self, job: JobRef | None = None) -> pd.DataFrame:
        """One row per tool call with its result's flags and sizes."""
        sql, params = self._scoped(_TOOL_CALLS_SQL, self._job(job), ("e",))
        return self._query(sql, params, _TOOL_CALLS)

    def usage(self, job: JobRef | None = None) -> pd.DataFrame:
        """One row per LLM call of ``job`` (every job when ``None``), with the actions it fired."""
        job_id = self._job(job)
        sql, params = self._scoped(_USAGE_SQL, job_id, ("e", "c", "t"))
        spec = {k: v for k, v in _USAGE.items() if k not in ("call", "cumulative_tokens")}
        df = self._query(sql, params, {**spec, "action": "Int"})
        # rows are in (job, id) order: numbering and running sums are vectorised, per job
        by_job = df.groupby("job", sort=False)
        df.insert(1, "call", (by_job.cumcount() + 1).astype("int64"))
        df.insert(COLUMNS["usage"].index("cumulative_tokens"), "cumulative_tokens",
                  by_job["total_tokens"].cumsum().astype(df["total_tokens"].dtype))
        # the SQL ranks actions 1..4; map the rank back to the ordered category
        df["action"] = pd.Categorical.from_codes(
            (df["action"].fillna(0).astype("int64") - 1).to_numpy(), dtype=ACTION_DTYPE
        )
        if job_id is not None:
            df.attrs["job"] = job_id
            df.attrs["thresholds"] = self.thresholds(job_id)
        return df

    def context_actions(self, job: JobRef | None = None) -> pd.DataFrame:
        """One row per ContextManager action (``context_action`` event)."""
        sql, params = self._scoped(_CONTEXT_ACTIONS_SQL, self._job(job), ("e",))
        return self._query(sql, params, _CONTEXT_ACTIONS)

    def lessons(self, job: JobRef | None = None) -> pd.DataFrame:
        """The rows of ``logs/lessons.jsonl`` of ``job`` (every job when ``None``)."""
        job_id = self._job(job)
        ids = [job_id] if job_id is not None else [int(r[0]) for r in self.ws.store.query("SELECT id FROM jobs ORDER BY id")]
        records: list[dict[str, Any]] = []
        for i in ids:
            try:
                # a link planted in logs/ (the work directory's Bash may write there) is not the job's file
                path = unlinked_path(self.ws.root / "jobs" / str(i), "logs", "lessons.jsonl")
            except ToolError:
                continue
            if not path.is_file():
                continue
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line torn by a crash mid-write
                if isinstance(rec, dict):
                    records.append({**rec, "job": rec.get("job", i)})
        return _typed(pd.DataFrame.from_records(records, columns=list(_LESSONS)), _LESSONS)

    # -- helpers ------------------------------------------------------------------
    def thresholds(self, job: JobRef) -> dict[str, float]:
        """The ContextManager thresholds a job runs with: its piece's, overridden by ``context=`` at submit."""
        job_id = self.ws._id(job)
        options = json.loads(self.ws.store.job(job_id).get("options") or "{}")
        return job_thresholds(self.ws.piece(job_id).thresholds, options)


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
        elif kind == "bool":
            out[name] = col.fillna(0).astype(bool) if len(col) else col.astype(bool)
        elif kind == "boolean":
            out[name] = pd.to_numeric(col).astype("boolean")
        else:  # pragma: no cover - a typo in a spec above
            raise ValueError(f"unknown column kind {kind!r}")
    return pd.DataFrame(out, index=pd.RangeIndex(len(df)))
