"""The pandas views, cross-checked against the raw events of real jobs (scripted, tokenizer-counted, demo)."""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
from _usage_jobs import COMPLETIONS, PROMPTS, demo_job, raw_usage, tiktoken_job, usage_job
from conftest import backend_store
from openai_server import OpenAIServer, reply, stall
from pandas.api import types as pt

from agentnb import Job, Workspace
from agentnb.store.frames_sql import PER_CALL_KINDS_SQL
from agentnb.store.sqlite import StoreError
from agentnb.views.frames import ACTION_DTYPE, COLUMNS


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> tuple[Workspace, dict[str, Job]]:
    """One workspace holding three finished jobs and one that never ran (read-only for the tests)."""
    root = tmp_path_factory.mktemp("frames")
    ws = Workspace(root / "ws", store=backend_store(request))
    jobs = {
        "usage": usage_job(ws, root / "scripts"),
        "tiktoken": tiktoken_job(ws, root / "scripts"),
        "demo": demo_job(ws),
        "queued": ws.submit("never run", piece="single", model="demo"),
    }
    return ws, jobs


# dtype checks by kind, so the table below reads like the documentation
def _int(s: pd.Series) -> bool:
    return s.dtype == "int64"


def _nint(s: pd.Series) -> bool:
    return s.dtype == "Int64"


def _time(s: pd.Series) -> bool:
    return s.dtype == "datetime64[ns]"


def _text(s: pd.Series) -> bool:
    return isinstance(s.dtype, pd.StringDtype)


def _cat(s: pd.Series) -> bool:
    return isinstance(s.dtype, pd.CategoricalDtype)


EXPECTED = {
    "jobs": {"job": _int, "parent": _nint, "batch": _text, "case": _nint, "cost_usd": pt.is_float_dtype, "piece": _text, "status": _cat, "movements": _int, "llm_calls": _int,
             "tool_calls": _int, "prompt_tokens": _int, "completion_tokens": _int, "total_tokens": _int,
             "peak_ratio": pt.is_float_dtype, "created": _time, "started": _time, "ended": _time, "error": _text,
             "forked_from_job": _nint, "forked_from_seq": _nint},
    "movements": {"job": _int, "seq": _int, "movement": _text, "status": _cat, "started": _time, "ended": _time,
                  "iterations": _int, "llm_calls": _int, "total_tokens": _int, "next_step": _text,
                  "forced": pt.is_bool_dtype, "summary": _text, "replayed": pt.is_bool_dtype,
                  "judge": pt.is_bool_dtype},
    "messages": {"job": _int, "event_id": _int, "seq": _nint, "iteration": _nint, "timestamp": _time,
                 "role": _cat, "kind": _cat, "content": _text, "chars": _int},
    "tool_calls": {"event_id": _int, "timestamp": _time, "tool": _cat, "server": _cat, "arguments": _text,
                   "is_error": lambda s: s.dtype == "boolean", "truncated": lambda s: s.dtype == "boolean",
                   "original_chars": _nint, "returned_chars": _nint, "duration": pt.is_timedelta64_dtype},
    "usage": {"job": _int, "call": _int, "seq": _int, "movement": _text, "iteration": _int, "timestamp": _time,
              "prompt_tokens": _int, "completion_tokens": _int, "total_tokens": _int, "cumulative_tokens": _int,
              "source": _cat, "window": _int, "ratio": pt.is_float_dtype,
              "action": lambda s: s.dtype == ACTION_DTYPE, "actions": _text, "transition": _text,
              "forced": lambda s: s.dtype == "boolean", "latency_s": pt.is_float_dtype, "cost_usd": pt.is_float_dtype,
              "replayed": pt.is_bool_dtype, "purpose": _text},
    "lessons": {"job": _int, "movement": _text, "seq": _nint, "lessons": _text, "summary": _text,
                "timestamp": _time},
    "context_actions": {"job": _int, "timestamp": _time, "action": lambda s: s.dtype == ACTION_DTYPE,
                        "ratio": pt.is_float_dtype, "tokens": _int, "window": _int, "threshold": pt.is_float_dtype},
    "scores": {"job": _int, "batch": _text, "case": _nint, "name": _text, "value": pt.is_object_dtype,
               "error": _text, "ts": _time, "latest": pt.is_bool_dtype},
    "divergences": {"job": _int, "event_id": _int, "seq": _nint, "movement": _text, "iteration": _nint,
                    "timestamp": _time, "call_id": _text, "tool": _text, "expected": _text, "actual": _text},
    "compactions": {"job": _int, "event_id": _int, "seq": _nint, "movement": _text, "iteration": _nint,
                    "timestamp": _time, "tokens_before": _int, "tokens_after": _int, "removed_messages": _int,
                    "kept_messages": _int, "summary": _text},
    "loops": {"job": _int, "event_id": _int, "seq": _nint, "movement": _text, "iteration": _nint,
              "timestamp": _time, "monitor": _text, "cycle": pt.is_object_dtype, "count": _int,
              "runs": pt.is_object_dtype, "summaries": pt.is_object_dtype, "judge": _text, "next": _text},
}


def _frame(ws: Workspace, name: str, job: Job | None) -> pd.DataFrame:
    return ws.frames.jobs() if name == "jobs" else getattr(ws.frames, name)(job)


@pytest.mark.parametrize("name", sorted(COLUMNS))
@pytest.mark.parametrize("which", ["usage", "demo", "queued"])
def test_columns_and_dtypes_are_stable(store: tuple[Workspace, dict[str, Job]], name: str, which: str) -> None:
    ws, jobs = store
    df = _frame(ws, name, jobs[which])
    assert tuple(df.columns) == COLUMNS[name]
    for column, check in EXPECTED[name].items():
        assert check(df[column]), f"{name}.{column} has dtype {df[column].dtype}"
    if which == "queued" and name != "jobs":
        assert df.empty  # right columns and dtypes on an empty frame too


def test_empty_workspace_gives_typed_empty_frames(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "empty")
    for name in COLUMNS:
        df = _frame(ws, name, None)
        assert df.empty and tuple(df.columns) == COLUMNS[name]
        for column, check in EXPECTED[name].items():
            assert check(df[column]), f"{name}.{column} has dtype {df[column].dtype}"


def test_usage_numbers_match_the_raw_events_of_every_job(store: tuple[Workspace, dict[str, Job]]) -> None:
    ws, jobs = store
    every = ws.frames.usage()
    table = ws.frames.jobs().set_index("job")
    for job in jobs.values():
        raw = raw_usage(ws, job)
        mine = ws.frames.usage(job)
        assert len(mine) == len(raw) == int(table.loc[job.id, "llm_calls"])
        for key in ("prompt_tokens", "completion_tokens", "total_tokens", "window"):
            assert mine[key].tolist() == [u[key] for u in raw], key
            assert int(every.loc[every["job"] == job.id, key].sum()) == sum(u[key] for u in raw)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert int(table.loc[job.id, key]) == sum(u[key] for u in raw), key
        assert mine["source"].astype(str).tolist() == [u["source"] for u in raw]
        assert mine["ratio"].tolist() == pytest.approx([u["ratio"] for u in raw])
        assert mine["call"].tolist() == list(range(1, len(raw) + 1))
        assert mine["cumulative_tokens"].tolist() == list(pd.Series([u["total_tokens"] for u in raw]).cumsum())
        starts = {e.payload["seq"]: e.payload["movement"] for e in ws.events(job, kinds=["movement_start"])}
        responses = ws.events(job, kinds=["llm_response"])
        assert mine["movement"].tolist() == [starts[e.movement_seq] for e in responses]
        assert mine["iteration"].tolist() == [e.iteration for e in responses]
        assert int(table.loc[job.id, "tool_calls"]) == len(ws.events(job, kinds=["tool_call"]))
        assert int(table.loc[job.id, "movements"]) == len(starts)
    # the all-jobs frame is the per-job frames stacked
    stacked = pd.concat([ws.frames.usage(j) for j in jobs.values()], ignore_index=True)
    pd.testing.assert_frame_equal(every.sort_values(["job", "call"], ignore_index=True),
                                  stacked.sort_values(["job", "call"], ignore_index=True), check_dtype=False)


def test_usage_of_the_scripted_job_is_exact(store: tuple[Workspace, dict[str, Job]]) -> None:
    ws, jobs = store
    u = ws.frames.usage(jobs["usage"])
    assert u["prompt_tokens"].tolist() == PROMPTS
    assert u["completion_tokens"].tolist() == COMPLETIONS
    assert u["movement"].tolist() == ["gather"] * 3 + ["write"] * 2
    assert u["seq"].tolist() == [1, 1, 1, 2, 2]
    assert (u["source"] == "usage").all() and (u["window"] == 10000).all()
    assert u["ratio"].tolist() == pytest.approx([p / 10000 for p in PROMPTS])
    # warn and prompt fired at the same call: the highest is `action`, both are in `actions`
    assert u["action"].astype(object).where(u["action"].notna(), None).tolist() == [
        None, None, None, "prompt", "force_transition"]
    assert u["actions"].tolist()[3:] == ["warn,prompt", "force_transition"]
    assert u["action"].max() == "force_transition"  # ordered category
    assert u["transition"].fillna("").tolist() == ["", "", "write", "", "COMPLETE"]
    assert u["forced"].tolist()[2] is False and u["forced"].tolist()[4] is True
    assert u.attrs["thresholds"]["warn"] == 0.70
    tiktoken = ws.frames.usage(jobs["tiktoken"])
    assert (tiktoken["source"] == "tiktoken").all()


def test_context_actions_and_movements_match_the_events(store: tuple[Workspace, dict[str, Job]]) -> None:
    ws, jobs = store
    for job in jobs.values():
        ca = ws.frames.context_actions(job)
        events = ws.events(job, kinds=["context_action"])
        assert ca["action"].astype(str).tolist() == [e.payload["action"] for e in events]
        assert ca["event_id"].tolist() == [e.id for e in events]
        assert ca["tokens"].tolist() == [e.payload["tokens"] for e in events]
        assert ca["threshold"].tolist() == pytest.approx([e.payload["threshold"] for e in events])
        mv = ws.frames.movements(job)
        rows = ws.movements(job)
        assert mv["seq"].tolist() == [r["seq"] for r in rows]
        assert mv["iterations"].tolist() == [r["iterations"] for r in rows]
        transitions = ws.events(job, kinds=["transition"])
        assert mv["next_step"].tolist() == [e.payload["next_step"] for e in transitions]
        assert mv["forced"].tolist() == [bool(e.payload["forced"]) for e in transitions]
        u = ws.frames.usage(job)
        assert mv["total_tokens"].tolist() == [int(u.loc[u["seq"] == s, "total_tokens"].sum()) for s in mv["seq"]]
    mv = ws.frames.movements(jobs["usage"])
    assert mv["actions"].fillna("").tolist() == ["", "warn,prompt,force_transition"]
    assert mv["llm_calls"].tolist() == [3, 2]


def test_tool_calls_pair_each_call_with_its_result(store: tuple[Workspace, dict[str, Job]]) -> None:
    ws, jobs = store
    for job in jobs.values():
        tc = ws.frames.tool_calls(job)
        calls = ws.events(job, kinds=["tool_call"])
        results = {e.payload["call_id"]: e.payload for e in ws.events(job, kinds=["tool_result"])}
        assert tc["event_id"].tolist() == [e.id for e in calls]
        assert tc["tool"].astype(str).tolist() == [e.payload["tool"] for e in calls]
        assert [json.loads(a) for a in tc["arguments"]] == [e.payload["arguments"] for e in calls]
        for row in tc.itertuples():
            res = results[row.call_id]
            assert (row.is_error, row.truncated) == (res["is_error"], res["truncated"])
            assert (row.original_chars, row.returned_chars) == (res["original_chars"], res["returned_chars"])
            assert row.result == res["content"]
            assert row.duration >= pd.Timedelta(0)
    tc = ws.frames.tool_calls(jobs["usage"])
    assert tc["tool"].astype(str).tolist() == ["Glob", "Read", "transition", "Write", "Read"]
    assert tc["is_error"].tolist() == [False, False, False, False, True]
    assert bool(ws.frames.tool_calls(jobs["demo"])["truncated"].any())  # the demo cuts a long Read


def test_messages_follow_the_conversation(store: tuple[Workspace, dict[str, Job]]) -> None:
    ws, jobs = store
    for job in jobs.values():
        msgs = ws.frames.messages(job)
        count = collections.Counter(e.kind for e in ws.events(job))
        assert len(msgs) == 2 * count["movement_start"] + count["llm_response"] + count["tool_result"] + count["reminder"]
        assert msgs["event_id"].is_monotonic_increasing
    msgs = ws.frames.messages(jobs["usage"])
    first = msgs[msgs["seq"] == 1]
    assert first["role"].astype(str).tolist() == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                  "assistant", "tool"]
    assert first["content"].iloc[0] == "You gather facts."
    assert first["tool"].iloc[2] == "Glob" and first["content"].iloc[2] == "Looking around."
    reminder = msgs[msgs["kind"] == "reminder"]
    assert len(reminder) == 1 and reminder["role"].iloc[0] == "user"  # the `prompt` action's wrap-up
    assert (msgs["chars"] == msgs["content"].str.len().fillna(0)).all()


def test_lessons_come_from_the_jsonl_and_match_the_lesson_events(store: tuple[Workspace, dict[str, Job]]) -> None:
    ws, jobs = store
    for job in jobs.values():
        lessons = ws.frames.lessons(job)
        events = ws.events(job, kinds=["lesson"])
        assert lessons["lessons"].tolist() == [e.payload["lessons"] for e in events]
        assert lessons["summary"].tolist() == [e.payload["summary"] for e in events]
        assert lessons["movement"].tolist() == [e.payload["movement"] for e in events]
        assert lessons["seq"].tolist() == [e.movement_seq for e in events]
        assert (lessons["job"] == job.id).all()
        for stamp, e in zip(lessons["timestamp"], events, strict=False):  # second resolution in the file
            assert abs(stamp - pd.to_datetime(e.ts, unit="s")) < pd.Timedelta(seconds=2)
    # write ends in a forced COMPLETE: its summary is a lesson too
    assert ws.frames.lessons(jobs["usage"])["lessons"].tolist() == [
        "notes.md holds two lines",
        "Forced transition: context at 96.0% of 10,000 tokens reached force_transition (95%)."]
    assert ws.frames.lessons(jobs["queued"]).empty
    every = ws.frames.lessons()
    assert len(every) == sum(len(ws.events(j, kinds=["lesson"])) for j in jobs.values())
    assert sorted(set(every["job"])) == sorted(j.id for j in jobs.values() if ws.events(j, kinds=["lesson"]))


@pytest.mark.sqlite_only("writes logs/lessons.jsonl on disk; on PostgreSQL the lessons file lives in the store (test_files_store covers it)")
def test_lessons_read_the_file_not_the_events(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    job = ws.submit("x", piece="single", model="demo")
    logs = ws.root / "jobs" / str(job.id) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    line = {"job": job.id, "movement": "work", "seq": 1, "lessons": "from the file", "summary": "s",
            "timestamp": "2024-05-01T09:00:00+0900"}
    (logs / "lessons.jsonl").write_text(json.dumps(line) + "\n" + '{"job": 1, "torn', encoding="utf-8")
    df = ws.frames.lessons(job)
    assert df["lessons"].tolist() == ["from the file"]  # the torn last line is skipped
    assert df["timestamp"].iloc[0] == pd.Timestamp("2024-05-01 00:00:00")  # naive UTC


def test_lesson_timestamps_are_utc_whatever_the_local_zone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        ws = Workspace(tmp_path / "ws")
        job = tiktoken_job(ws, tmp_path / "scripts")
        stamp = ws.frames.lessons(job)["timestamp"].iloc[0]
        event = ws.events(job, kinds=["lesson"])[0]
        assert abs(stamp - pd.to_datetime(event.ts, unit="s")) < pd.Timedelta(seconds=2)
    finally:
        monkeypatch.undo()
        time.tzset()


def test_frames_across_jobs_compare_runs(store: tuple[Workspace, dict[str, Job]]) -> None:
    ws, jobs = store
    per_job = ws.frames.usage().groupby("job")["total_tokens"].sum()
    table = ws.frames.jobs().set_index("job")
    assert per_job.to_dict() == {j: t for j, t in table["total_tokens"].items() if t}
    assert table.loc[jobs["queued"].id, "llm_calls"] == 0
    assert pd.isna(table.loc[jobs["queued"].id, "ended"])
    assert table.loc[jobs["usage"].id, "status"] == "succeeded"
    assert table.loc[jobs["usage"].id, "peak_ratio"] == pytest.approx(0.96)
    assert len(ws.frames.movements()) == sum(len(ws.movements(j)) for j in jobs.values())
    assert len(ws.frames.context_actions()) == sum(len(ws.events(j, kinds=["context_action"])) for j in jobs.values())


def test_unknown_job_is_an_error(store: tuple[Workspace, dict[str, Job]]) -> None:
    ws, _ = store
    with pytest.raises(StoreError, match="no job 999"):
        ws.frames.usage(999)
    with pytest.raises(StoreError, match="job must be a Job or a job id"):
        ws.frames.movements("first")


@pytest.mark.sqlite_only("SQLite's EXPLAIN QUERY PLAN and its statement trace")
def test_frame_queries_reach_events_through_indexes(store: tuple[Workspace, dict[str, Job]]) -> None:
    """No frame reads the whole events table: every events access is an index search."""
    ws, jobs = store
    seen: list[str] = []
    ws.store.conn.set_trace_callback(seen.append)  # statements arrive with their parameters bound
    try:
        ws.frames.jobs()
        for name in ("movements", "messages", "tool_calls", "usage", "context_actions", "scores"):
            getattr(ws.frames, name)(jobs["usage"])
    finally:
        ws.store.conn.set_trace_callback(None)
    statements = [s for s in seen if "FROM events" in s]
    assert len(statements) == 7  # one query per frame
    events_aliases = {"e", "c", "t", "r", "x", "events"}
    for sql in statements:
        plan = [row[3] for row in ws.store.conn.execute("EXPLAIN QUERY PLAN " + sql)]
        scans = [p for p in plan if p.startswith("SCAN ") and p.split()[1] in events_aliases]
        assert not scans, (sql[:80], plan)



@pytest.mark.sqlite_only("SQLite's partial index, EXPLAIN QUERY PLAN and its statement trace")
def test_every_job_s_events_of_a_rarer_kind_are_found_through_the_kind_index(
        store: tuple[Workspace, dict[str, Job]]) -> None:
    """On SQLite events_kind leaves out the kinds every call writes (a commit then writes fewer pages); the frames of
    every job that read the other kinds repeat its condition, so the index still finds them."""
    ws, _ = store
    (index,) = ws.store.conn.execute("SELECT sql FROM sqlite_master WHERE name = 'events_kind'").fetchone()
    assert " ".join(index.split()).endswith("WHERE " + PER_CALL_KINDS_SQL)  # the frames' text is the index's
    seen: list[str] = []
    ws.store.conn.set_trace_callback(seen.append)
    try:
        for name in ("context_actions", "compactions", "loops", "scores"):
            getattr(ws.frames, name)()
    finally:
        ws.store.conn.set_trace_callback(None)
    statements = [s for s in seen if "FROM events" in s]
    assert len(statements) == 4
    for sql in statements:
        plan = [row[3] for row in ws.store.conn.execute("EXPLAIN QUERY PLAN " + sql)]
        assert any("USING INDEX events_kind" in p for p in plan), (sql[:80], plan)
        assert not [p for p in plan if p.startswith("SCAN ") and p.split()[1] in {"e", "c", "t", "d"}], (sql[:80], plan)


def test_a_run_paused_mid_way_counts_its_calls_so_far(tmp_path: Path) -> None:
    """A movement row gets its iteration count when the run ends; a stepped job paused inside one shows its calls."""
    ws = Workspace(tmp_path / "ws")
    job = usage_job(ws, tmp_path / "scripts")  # a finished job beside it, whose counts must not move
    paused = ws.submit("step me", piece=ws.piece(job).source or "", model=job.model,
                       inputs={"notes.md": "alpha\nbeta\n"})
    for _ in range(4):  # gather's three calls, then the first call of write
        paused = ws.step(paused, unit="call")
    assert paused.status == "queued"
    mv = ws.frames.movements(paused)
    assert mv["status"].astype(str).tolist() == ["done", "running"]
    assert mv["iterations"].tolist() == [3, 1] == mv["llm_calls"].tolist()
    assert mv["iterations"].dtype == "int64"
    assert ws.frames.movements(job)["iterations"].tolist() == [3, 2]


def test_id_name_and_tokens_are_offered_as_column_aliases_too(store: tuple[Workspace, dict[str, Job]]) -> None:
    """Users who write jobs' ``id``, movements' ``name`` and ``tokens`` (the names a user asked for) get the same values."""
    ws, _jobs = store
    table = ws.frames.jobs()
    assert table["id"].tolist() == table["job"].tolist() and table["id"].dtype == "int64"
    mv = ws.frames.movements()
    assert mv["name"].tolist() == mv["movement"].tolist()
    assert mv["tokens"].tolist() == mv["total_tokens"].tolist() and mv["tokens"].dtype == "int64"
    assert COLUMNS["jobs"][-1] == "id" and COLUMNS["movements"][-2:] == ("name", "tokens")


def test_lessons_do_not_follow_a_link_planted_in_logs(tmp_path: Path) -> None:
    # logs/ sits in the work directory, where a Bash command can leave a symbolic link
    outside = tmp_path / "outside.jsonl"
    outside.write_text(json.dumps({"job": 1, "movement": "x", "seq": 1, "lessons": "planted", "summary": "",
                                   "timestamp": "2024-05-01T09:00:00+0900"}) + "\n", encoding="utf-8")
    ws = Workspace(tmp_path / "ws")
    job = ws.submit("x", piece="single", model="demo")
    logs = ws.root / "jobs" / str(job.id) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "lessons.jsonl").symlink_to(outside)
    assert ws.frames.lessons(job).empty


def test_usage_has_each_calls_latency(ws: Workspace, tmp_path: Path, loopback: Callable[..., OpenAIServer]) -> None:
    """``latency_s`` is the time the model took to answer: a loopback server that stalls 0.4 s shows it."""
    from _scripting import write_piece

    piece = write_piece(tmp_path, "one", {"movements": [{
        "name": "work", "persona": "p", "instruction": "i", "tools": [], "permission": "readonly",
        "rules": [{"condition": "done", "next": "COMPLETE"}]}]})
    server = loopback("sk-test-latency")
    server.play(stall(0.4), reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "ok"})]))
    job = ws.run(ws.submit("t", piece=piece, model="openai:m"))
    assert job.status == "succeeded", job.error
    recorded = [e.payload["latency_s"] for e in ws.events(job, kinds=["llm_response"])]
    u = ws.frames.usage(job)
    assert u["latency_s"].tolist() == pytest.approx(recorded)
    assert recorded[0] >= 0.4 and recorded[1] >= 0  # lower bounds only: a loaded machine answers later
    # a store written before latencies were recorded reads as NaN, not as an error
    if ws.store_url is None:
        ws.store.conn.execute("UPDATE events SET payload = json_remove(payload, '$.latency_s') WHERE job_id = ?",
                              (job.id,))
        ws.store.conn.commit()
    else:  # PostgreSQL's payload column is json
        with ws.store.transaction() as c:
            c.execute("UPDATE events SET payload = (payload::jsonb - 'latency_s')::json WHERE job_id = %s", (job.id,))
    assert ws.frames.usage(job)["latency_s"].isna().all()
