"""The SQL behind ``ws.frames``: one query per DataFrame view, run by :func:`agentnb.store.reads.frame_rows`.

Every payload field a query reads is named through :func:`payload_path`, which checks it against the
event dataclasses in :mod:`agentnb.events` when this module is imported: a field renamed there fails the
import instead of silently reading NULL.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any

from ..events import (
    ACTIONS,
    Compaction,
    ContextAction,
    JobStatusEvent,
    LLMResponse,
    LoopDetected,
    MovementStart,
    RecordedToolCall,
    Reminder,
    ReplayDivergence,
    ScoreEvent,
    ToolCallEvent,
    ToolResult,
    Transition,
    field_hints,
    payload_path,
)
from .base import Dialect, FrameQuery
from .texts import instruction_sql, payload_text_sql

__all__ = ["FRAME_SQL", "PER_CALL_KINDS_SQL", "PG_FRAME_SQL", "Dialect", "FrameSQL", "frame_sql", "payload_field"]



# -- SQL -------------------------------------------------------------------------
# ``{job}`` is replaced by `` AND <alias>.job_id=?`` or nothing.  One job's events are found through events_job
# (job_id, id); every job's events of one kind through events_kind (kind, job_id), which on SQLite leaves out the
# kinds every call writes (PER_CALL_KINDS_SQL below): those are read through events_job, in (job, id) order.


# -- dialects ---------------------------------------------------------------------
# One definition of each frame, written once and rendered for SQLite (json_extract on TEXT payloads) and for
# PostgreSQL (``#>``/``#>>`` on ``json`` payloads).  Where the two engines differ (JSON access, booleans as
# numbers, string aggregation, NULL-safe equality, integer truncation) the SQL is asked of the dialect, so a
# frame's shape cannot drift between the backends; the same rows come out of both (tests/test_store_postgres.py).

FrameSQL = dict[FrameQuery, tuple[str, tuple[str, ...]]]


def _leaf_hint(cls: type, names: Sequence[str]) -> Any:
    """The type annotation of payload field ``names`` (dotted path split) of event class ``cls``."""
    owner: Any = cls
    hint: Any = None
    for name in names:
        hint = field_hints(owner)[name]
        owner = next((a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a)), None)
    return hint


def _pg_type(hint: Any) -> str | None:
    """The PostgreSQL type a scalar payload field is read as (None: text, or JSON for lists and objects).

    Integers are read as ``integer``, not ``bigint``: ``SUM`` of an integer is a ``bigint``, of a ``bigint`` a
    ``numeric`` (a ``Decimal`` in Python), and no count a payload holds (tokens, characters, seqs) nears 2**31.
    Booleans become 1/0, as ``json_extract`` gives them on SQLite.
    """
    args = {a for a in typing.get_args(hint) if a is not type(None)} if typing.get_origin(hint) in (
        typing.Union, types.UnionType) else {hint}
    if args == {bool}:
        return "boolean::int"
    if args == {int}:
        return "integer"
    if args == {float} or args == {int, float}:
        return "double precision"
    return None


class _Dialect:
    """The pieces of SQL that differ between SQLite and PostgreSQL."""

    def __init__(self, name: Dialect) -> None:
        self.name = name

    def jx(self, alias: str, cls: type, path: str) -> str:
        """SQL reading scalar payload field ``path`` (dotted) of an event row ``alias`` of class ``cls``."""
        names = path.split(".")
        json_path = payload_path(cls, *names)  # checks the field exists
        if self.name == "sqlite":
            return f"json_extract({alias}.payload, '{json_path}')"
        hint = _leaf_hint(cls, names)
        if typing.get_origin(hint) is list or hint is Any or dataclasses.is_dataclass(hint):
            return self.json_text(alias, cls, path)
        cast = _pg_type(hint)
        text = f"({alias}.payload #>> '{{{','.join(names)}}}')"
        return f"{text}::{cast}" if cast else text

    def json_text(self, alias: str, cls: type, path: str) -> str:
        """Payload field ``path`` as JSON text (``true``, ``3``, ``"a"``, ``[1,2]``; NULL when absent)."""
        names = path.split(".")
        json_path = payload_path(cls, *names)
        if self.name == "sqlite":
            if len(names) == 1 and typing.get_origin(_leaf_hint(cls, names)) is not list:
                return f"({alias}.payload -> '{json_path}')"
            return f"json_extract({alias}.payload, '{json_path}')"  # lists: SQLite gives their JSON text
        # ``json`` keeps the stored text, so this is the text encode_payload wrote (compact, like SQLite's)
        return f"({alias}.payload #> '{{{','.join(names)}}}')::text"

    def text_or_json(self, alias: str, cls: type, path: str) -> str:
        """A field that is a string or a JSON value: the string itself, else its compact JSON text."""
        if self.name == "sqlite":
            json_path = payload_path(cls, *path.split("."))
            return (f"CASE json_type({alias}.payload, '{json_path}') WHEN 'text' THEN json_extract({alias}.payload, "
                    f"'{json_path}') ELSE json(json_extract({alias}.payload, '{json_path}')) END")
        names = "{" + ",".join(path.split(".")) + "}"
        payload_path(cls, *path.split("."))
        return (f"CASE json_typeof({alias}.payload #> '{names}') WHEN 'string' THEN {alias}.payload #>> '{names}' "
                f"ELSE ({alias}.payload #> '{names}')::text END")

    def tool_names(self, alias: str) -> str:
        """The names of an ``llm_response``'s tool calls, comma-separated (NULL when none)."""
        calls, name = payload_path(LLMResponse, "tool_calls"), payload_path(RecordedToolCall, "name")
        if self.name == "sqlite":
            return (f"(SELECT group_concat(json_extract(tc.value, '{name}'), ',') "
                    f"FROM json_each({alias}.payload, '{calls}') tc)")
        return (f"(SELECT string_agg(tc ->> '{name[2:]}', ',' ORDER BY n) FROM json_array_elements("
                f"CASE json_typeof({alias}.payload #> '{{{calls[2:]}}}') WHEN 'array' THEN {alias}.payload #> "
                f"'{{{calls[2:]}}}' END) WITH ORDINALITY AS t(tc, n))")

    def same(self, a: str, b: str) -> str:
        """``a`` equals ``b``, NULLs equal to each other."""
        return f"{a} IS {b}" if self.name == "sqlite" else f"{a} IS NOT DISTINCT FROM {b}"

    def flag(self, condition: str) -> str:
        """A condition as 1/0 (SQLite's booleans; PostgreSQL's are their own type)."""
        return f"({condition})" if self.name == "sqlite" else f"(CASE WHEN {condition} THEN 1 ELSE 0 END)"

    def concat(self, expr: str, order: str) -> str:
        """The values of ``expr`` joined by commas (in ``order`` on PostgreSQL, SQLite's scan order there)."""
        return f"group_concat({expr}, ',')" if self.name == "sqlite" else f"string_agg({expr}, ',' ORDER BY {order})"

    def greatest(self, a: str, b: str) -> str:
        return f"MAX({a}, {b})" if self.name == "sqlite" else f"GREATEST({a}, {b})"

    def day(self, ts: str) -> str:
        """The start of the UTC day of ``ts`` (seconds): a cast to integer truncates on SQLite, rounds on PostgreSQL."""
        if self.name == "sqlite":
            return f"CAST({ts} / 86400 AS INTEGER) * 86400"
        return f"CAST(FLOOR({ts} / 86400) AS bigint) * 86400"


def payload_field(dialect: Dialect, alias: str, cls: type, path: str) -> str:
    """SQL of ``dialect`` reading scalar payload field ``path`` (dotted, checked against event class ``cls``) of
    the event row ``alias``: what store/reads.py writes its SQL once with."""
    return _Dialect(dialect).jx(alias, cls, path)


def _action_rank(expr: str) -> str:
    """SQL ranking an action name 1..4 in threshold order, so MAX picks the highest action."""
    return f"CASE {expr} " + " ".join(f"WHEN '{a}' THEN {i}" for i, a in enumerate(ACTIONS, start=1)) + " END"



# The kinds every LLM call writes.  On SQLite the events_kind index leaves them out (migration 8): each kind of a
# transaction's events went to a page of its own in a (kind, …) index, and a commit writes every page it changed
# (half of a call's COMMIT in benchmarks/overhead.py).  Their frames read a job's events through events_job, or
# the whole table for every job, which costs as much as the index did (benchmarks/README.md).  A partial index
# serves a query only when the query repeats its condition word for word: the frames of the other kinds ask
# ``_kind(alias, kind)``, which does.  tests/test_frames.py checks this text against the index's own.
PER_CALL_KINDS_SQL = "kind NOT IN ('llm_request', 'llm_response', 'tool_call', 'tool_result')"


def _kind(alias: str, kind: str) -> str:
    """``alias.kind = 'kind'`` for a kind outside PER_CALL_KINDS_SQL, with that condition, so the partial
    events_kind index serves it on SQLite (on PostgreSQL the term is redundant)."""
    return f"{alias}.kind = '{kind}' AND {alias}.{PER_CALL_KINDS_SQL}"


def _build(d: _Dialect) -> FrameSQL:
    """Every frame's SQL in dialect ``d``."""
    _MOVEMENT_NAME = "LEFT JOIN movements m ON m.job_id = e.job_id AND m.seq = e.movement_seq"


    # A compaction's summarisation call (docs/context.md#compaction: its llm_response has purpose "compaction") is no turn of the
    # conversation: the ContextManager fires nothing on it, and its usage row's action is "compaction", ranked
    # after the four actions (frames.py maps rank 5 to that category).
    _COMPACTION_RANK = len(ACTIONS) + 1
    _IS_COMPACTION = d.same(d.jx('e', LLMResponse, 'purpose'), "'compaction'")
    # An LLM judge's call (docs/design-lab.md#llm-judge: purpose "judge", outside any movement run) scored the ended job:
    # a usage row of its own (priced by the judge's model, which its llm_response names), in no sum of the job's
    # own spending and no message of its conversation.
    _NOT_JUDGE = f"COALESCE({d.jx('e', LLMResponse, 'purpose')}, '') <> 'judge'"


    # ca and tr are small: MATERIALIZED builds each once (with an automatic index) instead of
    # probing the events index once per LLM call.  Rows come out of an index already in (job, id) order
    # (events_job on SQLite, events_kind (kind, job_id, id) on PostgreSQL), so there is no sort; call numbers and
    # running sums are added by pandas.
    _USAGE_SQL = f"""
    WITH ca AS MATERIALIZED (
        SELECT c.job_id, c.movement_seq, c.iteration,
               MAX({_action_rank(d.jx('c', ContextAction, 'action'))}) AS rank,
               {d.concat(d.jx('c', ContextAction, 'action'), 'c.id')} AS actions
        FROM events c WHERE {_kind('c', 'context_action')}{{job_c}}
        GROUP BY c.job_id, c.movement_seq, c.iteration
    ),
    tr AS MATERIALIZED (
        SELECT t.job_id, t.movement_seq, t.iteration,
               {d.jx('t', Transition, 'next_step')} AS next_step, {d.jx('t', Transition, 'forced')} AS forced
        FROM events t WHERE {_kind('t', 'transition')}{{job_t}}
    )
    SELECT e.job_id AS job, e.movement_seq AS seq, m.name AS movement, e.iteration, e.ts AS timestamp,
           {d.jx('e', LLMResponse, 'usage.prompt_tokens')} AS prompt_tokens,
           {d.jx('e', LLMResponse, 'usage.completion_tokens')} AS completion_tokens,
           {d.jx('e', LLMResponse, 'usage.total_tokens')} AS total_tokens,
           {d.jx('e', LLMResponse, 'usage.source')} AS source,
           {d.jx('e', LLMResponse, 'usage.window')} AS "window",
           {d.jx('e', LLMResponse, 'usage.ratio')} AS ratio,
           CASE WHEN {_IS_COMPACTION} THEN {_COMPACTION_RANK} ELSE ca.rank END AS action,
           CASE WHEN {_IS_COMPACTION} THEN 'compaction' ELSE ca.actions END AS actions,
           tr.next_step AS transition, tr.forced,
           {d.jx('e', LLMResponse, 'latency_s')} AS latency_s,
           {d.jx('e', LLMResponse, 'ttft_s')} AS ttft_s,
           {d.flag(d.jx('e', LLMResponse, 'replayed_from') + ' IS NOT NULL')} AS replayed,
           {d.flag(d.jx('e', LLMResponse, 'cached') + ' IS NOT NULL')} AS cached,
           {d.jx('e', LLMResponse, 'purpose')} AS purpose, {d.jx('e', LLMResponse, 'model')} AS call_model
    FROM events e
    LEFT JOIN movements m ON m.job_id = e.job_id AND m.seq = e.movement_seq
    LEFT JOIN ca ON ca.job_id = e.job_id AND ca.movement_seq = e.movement_seq AND ca.iteration = e.iteration
    LEFT JOIN tr ON tr.job_id = e.job_id AND tr.movement_seq = e.movement_seq AND tr.iteration = e.iteration
    WHERE e.kind = 'llm_response'{{job_e}}
    ORDER BY e.job_id, e.id
    """

    # each job's calls summed from its own events (events_job): a kind index of every call (SQLite has none,
    # PER_CALL_KINDS_SQL) is not needed, and a store of many jobs is read once
    _JOBS_SQL = f"""
    SELECT j.id AS job, j.parent_id AS parent, j.batch, j.batch_case AS "case", j.piece, j.model, j.status, {instruction_sql('j')} AS instruction,
           j.current_movement,
           (SELECT COUNT(*) FROM movements mv WHERE mv.job_id = j.id) AS movements,
           COUNT(e.id) AS llm_calls,
           (SELECT COUNT(*) FROM events t WHERE t.kind = 'tool_call' AND t.job_id = j.id) AS tool_calls,
           COALESCE(SUM({d.jx('e', LLMResponse, 'usage.prompt_tokens')}), 0) AS prompt_tokens,
           COALESCE(SUM({d.jx('e', LLMResponse, 'usage.completion_tokens')}), 0) AS completion_tokens,
           COALESCE(SUM({d.jx('e', LLMResponse, 'usage.total_tokens')}), 0) AS total_tokens,
           MAX({d.jx('e', LLMResponse, 'usage.ratio')}) AS peak_ratio,
           j.created, j.started, j.ended, j.error, j.id AS id,
           (SELECT {d.jx('s', JobStatusEvent, 'reason')} FROM events s WHERE s.kind = 'job_status' AND s.job_id = j.id
            ORDER BY s.id DESC LIMIT 1) AS status_reason, {d.day('MIN(e.ts)')} AS first_day, {d.day('MAX(e.ts)')} AS last_day,
           j.forked_from_job, j.forked_from_seq
    FROM jobs j
    LEFT JOIN events e ON e.job_id = j.id AND e.kind = 'llm_response' AND {_NOT_JUDGE}
    GROUP BY j.id
    ORDER BY j.id
    """

    # The jobs' cost (priced by views/frames.py): the jobs query gives each job's token sums and the UTC days of its
    # first and last call, enough for a job whose calls all fell on one day (a price holds for a day); the calls of
    # the rare others (over midnight, or a model priced call by call: tiered, time of day) are read one job at a
    # time.  ``job_models`` is each job's model spec, for pricing the usage rows without a join per call.
    _JOB_MODELS_SQL = "SELECT j.id AS job, j.model FROM jobs j {where_j}"

    _CALL_COSTS_SQL = f"""
    SELECT e.job_id AS job, e.ts AS ts,
           {d.jx('e', LLMResponse, 'usage.prompt_tokens')} AS prompt_tokens,
           {d.jx('e', LLMResponse, 'usage.completion_tokens')} AS completion_tokens
    FROM events e WHERE e.kind = 'llm_response' AND {_NOT_JUDGE}{{job_e}}
    """

    _MOVEMENTS_SQL = f"""
    SELECT m.job_id AS job, m.seq, m.name AS movement, m.status, m.started, m.ended,
           -- the row's count is written when the run ends: a run paused mid-way (stepped) has made calls already
           {d.greatest('m.iterations', 'COALESCE(a.last_iteration, 0)')} AS iterations,
           COALESCE(a.llm_calls, 0) AS llm_calls, COALESCE(a.tool_calls, 0) AS tool_calls,
           COALESCE(a.prompt_tokens, 0) AS prompt_tokens, COALESCE(a.completion_tokens, 0) AS completion_tokens,
           COALESCE(a.total_tokens, 0) AS total_tokens, a.peak_ratio, a.actions,
           m.next_step, m.forced, m.summary, m.name AS name, COALESCE(a.total_tokens, 0) AS tokens,
           COALESCE(a.replayed, 0) AS replayed,
           -- a loop monitor's judge (docs/context.md#loop-monitors): the run right after a loop_detected that named it as the judge
           {d.flag("EXISTS (SELECT 1 FROM events d WHERE d.kind = 'loop_detected' AND d.job_id = m.job_id "
                   "AND d.movement_seq = m.seq - 1 AND " + d.jx('d', LoopDetected, 'judge') + " = m.name)")} AS judge
    FROM movements m
    LEFT JOIN (
        SELECT e.job_id, e.movement_seq,
               SUM({d.flag("e.kind = 'llm_response'")}) AS llm_calls,
               MAX(CASE WHEN e.kind = 'llm_response' THEN e.iteration END) AS last_iteration,
               SUM({d.flag("e.kind = 'tool_call'")}) AS tool_calls,
               SUM(CASE WHEN e.kind = 'llm_response' THEN {d.jx('e', LLMResponse, 'usage.prompt_tokens')} END) AS prompt_tokens,
               SUM(CASE WHEN e.kind = 'llm_response' THEN {d.jx('e', LLMResponse, 'usage.completion_tokens')} END) AS completion_tokens,
               SUM(CASE WHEN e.kind = 'llm_response' THEN {d.jx('e', LLMResponse, 'usage.total_tokens')} END) AS total_tokens,
               MAX(CASE WHEN e.kind = 'llm_response' THEN {d.jx('e', LLMResponse, 'usage.ratio')} END) AS peak_ratio,
               {d.concat("CASE WHEN e.kind = 'context_action' THEN " + d.jx('e', ContextAction, 'action') + ' END', 'e.id')} AS actions,
               -- a fork's run re-served from the original's record: its movement_start names that job
               MAX({d.flag("e.kind = 'movement_start' AND " + d.jx('e', MovementStart, 'replayed_from') + ' IS NOT NULL')}) AS replayed
        FROM events e WHERE e.kind IN ('llm_response', 'tool_call', 'context_action', 'movement_start'){{job_e}}
        GROUP BY e.job_id, e.movement_seq
    ) a ON a.job_id = m.job_id AND a.movement_seq = m.seq
    {{where_m}}
    ORDER BY m.job_id, m.seq
    """

    _EVENT_HEAD = "e.job_id AS job, e.id AS event_id, e.movement_seq AS seq, m.name AS movement, e.iteration, e.ts AS timestamp"

    _MESSAGES_SQL = f"""
    SELECT * FROM (
        SELECT {_EVENT_HEAD}, 'system' AS role, e.kind, NULL AS tool, NULL AS call_id,
               {d.jx('e', MovementStart, 'system')} AS content, 0 AS part
        FROM events e {_MOVEMENT_NAME} WHERE {_kind('e', 'movement_start')}{{job_e}}
        UNION ALL
        SELECT {_EVENT_HEAD}, 'user', e.kind, NULL, NULL, {payload_text_sql('e', payload_path(MovementStart, 'user')[2:], d.name)}, 1
        FROM events e {_MOVEMENT_NAME} WHERE {_kind('e', 'movement_start')}{{job_e}}
        UNION ALL
        SELECT {_EVENT_HEAD}, 'assistant', e.kind,
               {d.tool_names('e')},
               NULL, {d.jx('e', LLMResponse, 'content')}, 0
        FROM events e {_MOVEMENT_NAME} WHERE e.kind = 'llm_response' AND {_NOT_JUDGE}{{job_e}}
        UNION ALL
        SELECT {_EVENT_HEAD}, 'tool', e.kind, {d.jx('e', ToolResult, 'tool')}, {d.jx('e', ToolResult, 'call_id')}, {d.jx('e', ToolResult, 'content')}, 0
        FROM events e {_MOVEMENT_NAME} WHERE e.kind = 'tool_result'{{job_e}}
        UNION ALL
        SELECT {_EVENT_HEAD}, 'user', e.kind, NULL, NULL, {d.jx('e', Reminder, 'text')}, 0
        FROM events e {_MOVEMENT_NAME} WHERE {_kind('e', 'reminder')}{{job_e}}
        UNION ALL
        -- the summary the compacted conversation goes on from (docs/context.md#compaction; the engine labels it in the message)
        SELECT {_EVENT_HEAD}, 'user', e.kind, NULL, NULL, {d.jx('e', Compaction, 'summary')}, 0
        FROM events e {_MOVEMENT_NAME} WHERE {_kind('e', 'compaction')}{{job_e}}
    ) AS msgs
    ORDER BY job, event_id, part
    """

    _TOOL_CALLS_SQL = f"""
    SELECT {_EVENT_HEAD}, {d.jx('e', ToolCallEvent, 'tool')} AS tool, {d.jx('e', ToolCallEvent, 'server')} AS server,
           {d.jx('e', ToolCallEvent, 'call_id')} AS call_id,
           {d.text_or_json('e', ToolCallEvent, 'arguments')} AS arguments,
           {d.jx('r', ToolResult, 'is_error')} AS is_error, {d.jx('r', ToolResult, 'truncated')} AS truncated,
           {d.jx('r', ToolResult, 'original_chars')} AS original_chars, {d.jx('r', ToolResult, 'returned_chars')} AS returned_chars,
           r.ts - e.ts AS duration, {d.jx('r', ToolResult, 'content')} AS result
    FROM events e {_MOVEMENT_NAME}
    LEFT JOIN events r ON r.id = (
        -- the first matching result after the call; ORDER BY … LIMIT 1 stops there (MIN would scan on)
        SELECT x.id FROM events x
        WHERE x.kind = 'tool_result' AND x.job_id = e.job_id AND x.id > e.id
          AND {d.same(d.jx('x', ToolResult, 'call_id'), d.jx('e', ToolCallEvent, 'call_id'))}
        ORDER BY x.id LIMIT 1
    )
    WHERE e.kind = 'tool_call'{{job_e}}
    ORDER BY e.job_id, e.id
    """

    # value as JSON text (``->``): json_extract would give true/false as 1/0, and pandas would make 3 a float
    _SCORES_SQL = f"""
    SELECT e.job_id AS job, j.batch, j.batch_case AS "case", {d.jx('e', ScoreEvent, 'name')} AS name,
           {d.json_text('e', ScoreEvent, 'value')} AS value,
           {d.jx('e', ScoreEvent, 'error')} AS error, e.ts AS ts, e.id AS event_id
    FROM events e LEFT JOIN jobs j ON j.id = e.job_id
    WHERE {_kind('e', 'score')}{{job_e}}
    ORDER BY e.job_id, e.id
    """

    _CONTEXT_ACTIONS_SQL = f"""
    SELECT {_EVENT_HEAD}, {d.jx('e', ContextAction, 'action')} AS action, {d.jx('e', ContextAction, 'ratio')} AS ratio,
           {d.jx('e', ContextAction, 'tokens')} AS tokens, {d.jx('e', ContextAction, 'window')} AS "window", {d.jx('e', ContextAction, 'threshold')} AS threshold
    FROM events e {_MOVEMENT_NAME}
    WHERE {_kind('e', 'context_action')}{{job_e}}
    ORDER BY e.job_id, e.id
    """

    # a fork's re-run tool whose result differed from the original's (payload ``seq`` is the row's movement_seq)
    _DIVERGENCES_SQL = f"""
    SELECT e.job_id AS job, e.id AS event_id, e.movement_seq AS seq, m.name AS movement, e.iteration, e.ts AS timestamp,
           {d.jx('e', ReplayDivergence, 'call_id')} AS call_id, {d.jx('e', ReplayDivergence, 'tool')} AS tool,
           {d.jx('e', ReplayDivergence, 'expected')} AS expected, {d.jx('e', ReplayDivergence, 'actual')} AS actual
    FROM events e {_MOVEMENT_NAME}
    WHERE e.kind = 'replay_divergence'{{job_e}}
    ORDER BY e.job_id, e.id
    """


    # one row per compaction (docs/context.md#compaction): a movement's messages replaced by a summary
    _COMPACTIONS_SQL = f"""
    SELECT {_EVENT_HEAD},
           {d.jx('e', Compaction, 'tokens_before')} AS tokens_before, {d.jx('e', Compaction, 'tokens_after')} AS tokens_after,
           {d.jx('e', Compaction, 'removed_messages')} AS removed_messages,
           {d.jx('e', Compaction, 'kept_messages')} AS kept_messages, {d.jx('e', Compaction, 'summary')} AS summary
    FROM events e {_MOVEMENT_NAME}
    WHERE {_kind('e', 'compaction')}{{job_e}}
    ORDER BY e.job_id, e.id
    """


    # one row per loop_detected (docs/context.md#loop-monitors): a loop monitor fired after the run that closed the loop; the lists as
    # JSON text (frames.py parses them)
    _LOOPS_SQL = f"""
    SELECT {_EVENT_HEAD}, {d.jx('e', LoopDetected, 'monitor')} AS monitor,
           {d.json_text('e', LoopDetected, 'cycle')} AS cycle, {d.jx('e', LoopDetected, 'count')} AS count,
           {d.json_text('e', LoopDetected, 'runs')} AS runs,
           {d.json_text('e', LoopDetected, 'summaries')} AS summaries,
           {d.jx('e', LoopDetected, 'judge')} AS judge, {d.jx('e', LoopDetected, 'next')} AS next
    FROM events e {_MOVEMENT_NAME}
    WHERE {_kind('e', 'loop_detected')}{{job_e}}
    ORDER BY e.job_id, e.id
    """


    return {
        # frame → (SQL with {job_<alias>}/{where_<alias>} slots, the aliases whose slots it has)
        "jobs": (_JOBS_SQL, ()),
        "movements": (_MOVEMENTS_SQL, ("e", "m")),
        "messages": (_MESSAGES_SQL, ("e",)),
        "tool_calls": (_TOOL_CALLS_SQL, ("e",)),
        "usage": (_USAGE_SQL, ("e", "c", "t")),
        "context_actions": (_CONTEXT_ACTIONS_SQL, ("e",)),
        "job_models": (_JOB_MODELS_SQL, ("j",)),
        "call_costs": (_CALL_COSTS_SQL, ("e",)),
        "scores": (_SCORES_SQL, ("e",)),
        "divergences": (_DIVERGENCES_SQL, ("e",)),
        "compactions": (_COMPACTIONS_SQL, ("e",)),
        "loops": (_LOOPS_SQL, ("e",)),
    }


def frame_sql(dialect: Dialect) -> FrameSQL:
    """Every frame's SQL for ``dialect``: frame → (SQL with ``{job_<alias>}``/``{where_<alias>}`` slots, the
    aliases whose slots it has); a slot's parameter is written ``?`` in both (the PostgreSQL store binds it)."""
    return _build(_Dialect(dialect))


FRAME_SQL = frame_sql("sqlite")
PG_FRAME_SQL = frame_sql("postgres")
