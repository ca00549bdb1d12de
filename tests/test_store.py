"""The SQLite store: WAL, migrations, atomic claims across processes, status events."""

from __future__ import annotations

import ast
import inspect
import multiprocessing as mp
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from _scripting import transition, write_script

import agentnb
import agentnb.store
from agentnb import Workspace
from agentnb.events import CommentEvent, JobStatusEvent, LLMResponse, ToolResult, payload_dict, payload_path
from agentnb.store import Store, open_store
from agentnb.store.migrations import MIGRATIONS
from agentnb.store.sqlite import SQLiteStore, StoreError


def _new_job(store: SQLiteStore, n: int = 0) -> int:
    return store.create_job(piece="p", piece_yaml="name: p", model="demo", instruction=f"task {n}", workdir="")


def test_wal_mode_and_migrations_applied_on_open(tmp_path: Path) -> None:
    path = tmp_path / "agentnb.sqlite"
    store = SQLiteStore(path)
    store.close()
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"jobs", "comments", "movements", "events"} <= tables
    raw.close()


def test_reopen_is_idempotent_and_keeps_data(tmp_path: Path) -> None:
    path = tmp_path / "agentnb.sqlite"
    store = SQLiteStore(path)
    job_id = _new_job(store)
    store.close()
    for _ in range(3):  # re-opening must not re-run migrations (they would fail on existing tables)
        store = SQLiteStore(path)
        assert store.job(job_id).instruction == "task 0"
        assert store.query("PRAGMA user_version")[0][0] == len(MIGRATIONS)
        store.close()


def test_a_reset_file_is_migrated_again(tmp_path: Path) -> None:
    path = tmp_path / "agentnb.sqlite"
    SQLiteStore(path).close()
    raw = sqlite3.connect(path)
    raw.execute("PRAGMA user_version=0")  # pretend an old file: migration 1 would run again and fail
    raw.execute("DROP TABLE events")
    raw.execute("DROP TABLE movements")
    raw.execute("DROP TABLE comments")
    raw.execute("DROP TABLE jobs")
    raw.execute("DROP TABLE texts")
    raw.execute("DROP TABLE batches")
    raw.commit()
    raw.close()
    store = SQLiteStore(path)
    assert store.query("PRAGMA user_version")[0][0] == len(MIGRATIONS)
    assert _new_job(store) == 1


def _claim_all(path: str, barrier: mp.synchronize.Barrier, out: mp.Queue[list[int]]) -> None:
    store = SQLiteStore(path)
    barrier.wait()
    got = []
    while True:
        row = store.claim()
        if row is None:
            break
        got.append(int(row.id))
    out.put(got)
    # Stay alive until every process has finished claiming: a process that has exited owns nothing, so
    # the others would rightly take its running jobs over (even while it waits, unreaped, as a zombie).
    barrier.wait()


def _claim_one(path: str, job_ids: list[int], barrier: mp.synchronize.Barrier, out: mp.Queue[list[int]]) -> None:
    store = SQLiteStore(path)
    got = []
    for job_id in job_ids:
        barrier.wait()  # every process asks for the same job at the same moment
        if store.claim(job_id) is not None:
            got.append(job_id)
    out.put(got)
    barrier.wait()  # see _claim_all


def _ctx() -> mp.context.BaseContext:
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


@pytest.mark.parametrize("procs", [4])
def test_claim_is_atomic_across_processes(tmp_path: Path, procs: int) -> None:
    path = tmp_path / "agentnb.sqlite"
    store = SQLiteStore(path)
    ids = [_new_job(store, n) for n in range(60)]
    store.close()
    ctx = _ctx()
    barrier = ctx.Barrier(procs)
    out = ctx.Queue()
    workers = [ctx.Process(target=_claim_all, args=(str(path), barrier, out)) for _ in range(procs)]
    for w in workers:
        w.start()
    results = [out.get(timeout=60) for _ in workers]
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    claimed = [i for r in results for i in r]
    assert sorted(claimed) == ids  # every job claimed exactly once
    assert len(set(claimed)) == len(claimed)
    store = SQLiteStore(path)
    for job_id in ids:
        running = [e for e in store.events(job_id, kinds=["job_status"]) if e.payload["status"] == "running"]
        assert len(running) == 1


def test_racing_for_the_same_job_only_one_process_wins(tmp_path: Path) -> None:
    path = tmp_path / "agentnb.sqlite"
    store = SQLiteStore(path)
    ids = [_new_job(store, n) for n in range(15)]
    store.close()
    ctx = _ctx()
    procs = 4
    barrier = ctx.Barrier(procs)
    out = ctx.Queue()
    workers = [ctx.Process(target=_claim_one, args=(str(path), ids, barrier, out)) for _ in range(procs)]
    for w in workers:
        w.start()
    results = [out.get(timeout=60) for _ in workers]
    for w in workers:
        w.join(timeout=60)
    claimed = [i for r in results for i in r]
    assert sorted(claimed) == ids


def test_claim_of_a_job_that_is_not_queued_returns_none(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.sqlite")
    job_id = _new_job(store)
    assert store.claim(job_id) is not None
    assert store.claim(job_id) is None
    assert store.claim() is None
    with pytest.raises(StoreError, match="no job 99"):
        store.job(99)


def test_only_typed_events_are_appended(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.sqlite")
    job_id = _new_job(store)
    before = store.events(job_id)
    with pytest.raises(StoreError, match=r"not an event: .*'bogus'"):
        store.append([CommentEvent(job_id=job_id, author="user", body="kept only with the rest"),
                      (job_id, None, None, 0.0, "bogus", {})])  # type: ignore[list-item]
    assert store.events(job_id) == before


def test_every_status_change_is_a_job_status_event(ws: Workspace, tmp_path: Path) -> None:
    """Replay the job_status events: they must pass through every status the row had."""
    model = write_script(tmp_path, "script", responses=[
        transition("ASK", "need input", question="Which one?"),
        transition("COMPLETE", "finished"),
    ])
    job = ws.submit("task", piece="single", model=model)
    seen = [job.status.value]
    job = ws.step(job, unit="call")
    seen.append(job.status.value)
    job = ws.reply(job, "the first one")
    seen.append(job.status.value)
    job = ws.run(job)
    seen.append(job.status.value)
    assert seen == ["queued", "waiting_human", "queued", "succeeded"]
    statuses = [e.payload["status"] for e in ws.events(job, kinds=["job_status"])]
    assert statuses == ["queued", "running", "waiting_human", "queued", "running", "succeeded"]
    assert all(e.payload["reason"] for e in ws.events(job, kinds=["job_status"]))
    # the row agrees with the last event
    assert ws.store.job(job.id).status == statuses[-1]


def test_paused_and_failed_jobs_record_their_status_changes(ws: Workspace, tmp_path: Path) -> None:
    model = write_script(tmp_path, "script", responses=[{"content": "thinking"}])
    job = ws.submit("task", piece="single", model=model)
    job = ws.step(job, unit="call")
    assert job.status == "queued"
    job = ws.run(job)
    assert job.status == "failed"
    statuses = [e.payload["status"] for e in ws.events(job, kinds=["job_status"])]
    assert statuses == ["queued", "running", "queued", "running", "failed"]


def _exited_unreaped(proc: subprocess.Popen[bytes]) -> None:
    """Wait until ``proc`` has exited while leaving it unreaped: a zombie whose pid still answers kill(pid, 0)."""
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    with open(f"/proc/{proc.pid}/stat", "rb") as f:
        assert f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    os.kill(proc.pid, 0)  # what the old liveness check asked: no error, so it looked alive


@pytest.mark.skipif(not Path("/proc/self/stat").exists() or not hasattr(os, "waitid"), reason="needs Linux /proc")
def test_a_job_whose_owner_is_a_zombie_is_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "agentnb.sqlite"
    store = SQLiteStore(path)
    job_id = _new_job(store)
    code = "import sys; from agentnb.store.sqlite import SQLiteStore; s = SQLiteStore(sys.argv[1]); assert s.claim(int(sys.argv[2])); s.close()"
    owner = subprocess.Popen([sys.executable, "-c", code, str(path), str(job_id)])
    try:
        _exited_unreaped(owner)
        row = store.job(job_id)
        assert row.status == "running" and f":{owner.pid}:" in row.claimed_by
        assert store.claim(job_id) is not None  # not "already running" for ever
        reasons = [e.payload["reason"] for e in store.events(job_id, kinds=["job_status"])]
        assert reasons[-2].startswith("recovered: the process that ran it") and reasons[-2].endswith("is gone")
    finally:
        owner.wait()


# -- the store interface ---------------------------------------------------------------------------------

AGENTNB = Path(agentnb.__file__).parent


def _imports_sqlite3(path: Path) -> list[int]:
    """The lines of ``path`` that import sqlite3 (at any depth: under TYPE_CHECKING, inside functions)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(n.split(".")[0] == "sqlite3" for n in names):
            lines.append(node.lineno)
    return lines


def test_only_the_store_imports_sqlite3() -> None:
    offenders = [f"{p.relative_to(AGENTNB.parent)}:{line}" for p in sorted(AGENTNB.rglob("*.py"))
                 if p.parent.name != "store" for line in _imports_sqlite3(p)]
    assert not offenders, f"sqlite3 imported outside agentnb/store/: {offenders}"
    # the check sees what it looks for
    assert _imports_sqlite3(AGENTNB / "store" / "sqlite.py")


def test_the_sqlite_store_implements_every_operation_of_the_interface(tmp_path: Path) -> None:
    members = {n for n, v in vars(Store).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    assert {"path", "transaction", "append", "events", "claim", "set_status", "frame_rows"} <= members
    store = open_store(tmp_path / "s.sqlite")
    assert isinstance(store, SQLiteStore)
    for name in sorted(members):
        assert hasattr(store, name), f"SQLiteStore has no {name}"
        if not isinstance(vars(Store)[name], property):
            want = list(inspect.signature(getattr(Store, name)).parameters)
            assert list(inspect.signature(getattr(SQLiteStore, name)).parameters)[: len(want)] == want, name
    assert agentnb.store.Store is Store  # the package's Store is the interface


def test_a_mistyped_event_is_refused_before_it_is_stored(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.sqlite")
    job_id = _new_job(store)
    before = store.events(job_id)
    with pytest.raises(TypeError, match=r"tool_result\.content"):
        store.append([ToolResult(job_id=job_id, tool="Read", call_id="c1", content=5)])  # type: ignore[arg-type]
    assert store.events(job_id) == before
    ev = ToolResult(job_id=job_id, movement_seq=None, tool="Read", call_id="c1", content="ok", ts=1.5)
    store.append([ev])
    (back,) = store.events(job_id, kinds=["tool_result"])
    assert back == ToolResult(job_id=job_id, tool="Read", call_id="c1", content="ok", ts=1.5, id=back.id)


def test_the_stores_own_events_are_typed(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.sqlite")
    job_id = _new_job(store)
    with store.transaction() as c:
        store.add_comment(c, job_id, "user", "hello")
    assert store.claim(job_id) is not None
    evs = store.events(job_id)
    assert [type(e) for e in evs] == [JobStatusEvent, CommentEvent, JobStatusEvent]
    assert [payload_dict(e) for e in evs] == [
        {"status": "queued", "reason": "submitted"}, {"author": "user", "body": "hello"},
        {"status": "running", "reason": evs[2].reason},
    ]
    # stored as the compact JSON of those fields
    assert store.query("SELECT payload FROM events WHERE id=?", (evs[1].id,))[0][0] == '{"author":"user","body":"hello"}'


def test_job_columns_reads_only_known_columns(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.sqlite")
    job_id = _new_job(store)
    assert store.job_columns(job_id, ("status", "movement_seq")) == {"status": "queued", "movement_seq": 0}
    assert store.job_columns(job_id + 1, ("status",)) is None
    with pytest.raises(StoreError, match="no job columns"):
        store.job_columns(job_id, ("status; DROP TABLE jobs",))


def test_frame_queries_name_payload_fields_the_events_have() -> None:
    assert payload_path(LLMResponse, "usage", "prompt_tokens") == "$.usage.prompt_tokens"
    assert payload_path(LLMResponse, "tool_calls") == "$.tool_calls"
    for cls, names in ((ToolResult, ("is_eror",)), (LLMResponse, ("usage", "prompt")), (ToolResult, ("job_id",))):
        with pytest.raises(LookupError, match="has no payload field"):
            payload_path(cls, *names)


def test_the_store_names_every_payload_field_through_the_event_dataclasses() -> None:
    """A JSON path written by hand in the store's SQL would read NULL after a field is renamed in events.py."""
    store_dir = Path(agentnb.store.__file__).parent
    by_hand = [f"{p.name}:{i}: {line.strip()}" for p in sorted(store_dir.glob("*.py")) if p.name != "texts.py"
               for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
               if re.search(r"""['"]\$\.""", line)]
    assert by_hand == []


def test_rows_are_encoded_before_the_store_lock_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every job thread of a batch waits for the store's lock, so encoding a payload must not hold it;
    only a payload that refers to the stored instruction is built inside the transaction."""
    import threading

    import agentnb.store._rows as rows_module  # where both stores encode an event's payload
    from agentnb.events import MovementStart
    from agentnb.store.sqlite import TEXT_REF, TEXT_REF_MIN_CHARS

    store = SQLiteStore(tmp_path / "s.sqlite")
    instruction = "Summarise the report. " * (TEXT_REF_MIN_CHARS // 10)
    job_id = store.create_job(piece="p", piece_yaml="name: p", model="demo", instruction=instruction, workdir="")
    held: list[bool] = []
    encode = rows_module.encode_payload

    def spying(data: dict) -> str:
        free: list[bool] = []

        def probe() -> None:  # from another thread, as a waiting job thread would
            got = store._lock.acquire(blocking=False)
            if got:
                store._lock.release()
            free.append(got)

        t = threading.Thread(target=probe)
        t.start()
        t.join()
        held.append(not free[0])
        return encode(data)

    monkeypatch.setattr(rows_module, "encode_payload", spying)
    store.append([CommentEvent(job_id=job_id, author="user", body="hi"),
                  ToolResult(job_id=job_id, tool="Read", call_id="c1", content="ok")])
    assert held == [False, False]
    user = f"## Task\n{instruction}\n"
    store.append([MovementStart(job_id=job_id, movement_seq=1, movement="work", seq=1, system="s", user=user)])
    assert held == [False, False, True]
    raw = store.query("SELECT payload FROM events WHERE kind='movement_start'")[0][0]
    assert TEXT_REF in raw and instruction not in raw  # still stored by reference
    (back,) = store.events(job_id, kinds=["movement_start"])
    assert isinstance(back, MovementStart) and back.user == user
    assert [e.kind for e in store.events(job_id)][-3:] == ["comment", "tool_result", "movement_start"]


@pytest.mark.parametrize("text", ["{}", '{"retries":3,"max_backoff":2.0}', '{"context":{"window_tokens":9000,"thresholds":'
                                  '{"prompt":0.8}},"strict_replay":true,"subtask_cap":{"tools":["Read"],"permission":"read"}}',
                                  '{"zukunft":"ä","retries":1,"nested":[1,{"a":null}]}'])
def test_job_options_are_decoded_and_written_back_to_the_same_text(text: str) -> None:
    from agentnb.store.base import JobOptions

    options = JobOptions.from_json(text)
    assert options.to_json() == text
    assert JobOptions.from_json(options.updated(retries=5).to_json()).retries == 5
    assert "zukunft" not in options.without("zukunft").to_dict()
