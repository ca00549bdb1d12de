"""The SQLite store: WAL, migrations, atomic claims across processes, status events."""

from __future__ import annotations

import ast
import dataclasses
import gc
import importlib.util
import inspect
import multiprocessing as mp
import os
import re
import sqlite3
import subprocess
import sys
import threading
import typing
from pathlib import Path
from typing import Any

import pytest
from _descriptors import open_targets
from _scripting import transition, write_script
from _waiting import wait_for

import agentnb
import agentnb.store
from agentnb import Workspace
from agentnb.events import (
    CommentEvent,
    JobStatusEvent,
    LLMRequest,
    LLMResponse,
    ToolResult,
    Usage,
    payload_dict,
    payload_path,
)
from agentnb.store import Store, open_store, reads
from agentnb.store.migrations import MIGRATIONS
from agentnb.store.records import JOB_COLUMNS, CommentRecord, JobOptions, JobRecord, JobStatus, MovementRecord
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


def test_a_write_waits_for_another_writers_lock_then_goes_ahead(tmp_path: Path) -> None:
    import threading

    store = SQLiteStore(tmp_path / "agentnb.sqlite")
    other = sqlite3.connect(str(store.path), isolation_level=None, timeout=0)  # another writer, holding the lock
    other.execute("BEGIN IMMEDIATE")
    made: list[int] = []
    failed: list[BaseException] = []

    def write() -> None:
        try:
            made.append(_new_job(store))
        except BaseException as exc:
            failed.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    writer.join(0.5)
    assert writer.is_alive() and not failed, failed  # waiting, not failed at once ("database is locked")
    other.execute("COMMIT")
    writer.join(10)
    assert not failed and made == [1]
    assert store.conn.execute("PRAGMA busy_timeout").fetchone()[0] == 30000
    other.close()
    store.close()


_HOLDER = """
import sys
from agentnb.store.sqlite import SQLiteStore
store = SQLiteStore(sys.argv[1])
with store.transaction():
    store.create_job(piece="p", piece_yaml="name: p", model="demo", instruction="the holder's", workdir="")
    print("in", flush=True)
    sys.stdin.readline()
store.close()
"""


def test_writers_in_other_processes_wait_their_turn_in_the_kernel_and_go_on_when_it_is_let_go(
        tmp_path: Path) -> None:
    import fcntl
    import threading

    store = SQLiteStore(tmp_path / "agentnb.sqlite")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(store.path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "in\n"
        # the holder's turn is a flock on the file beside the store: nobody else gets it meanwhile
        fd = os.open(f"{store.path}-lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        made: list[int] = []
        writer = threading.Thread(target=lambda: made.append(_new_job(store)))
        writer.start()
        writer.join(0.5)
        assert writer.is_alive() and not made  # waiting for its turn, not failed
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        writer.join(10)
        assert made == [2]
        assert [j.instruction for j in store.jobs()] == ["the holder's", "task 0"]
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody writes: the turn is free
        os.close(fd)
    finally:
        holder.kill()
        holder.wait()
        store.close()


def test_store_objects_of_one_process_share_its_turn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.setattr(agentnb.store.sqlite, "_BUSY_WAIT", 0.3)
    one, two = SQLiteStore(tmp_path / "agentnb.sqlite"), SQLiteStore(tmp_path / "agentnb.sqlite")
    try:
        with one.transaction():
            _new_job(one)
            # the same thread writing through the other object waits the store's time, then fails as SQLite
            # would: two turns of one process would wait for each other for ever
            with pytest.raises(sqlite3.OperationalError, match=r"^database is locked$"):
                _new_job(two)
        made: list[int] = []
        with one.transaction():
            writer = threading.Thread(target=lambda: made.append(_new_job(two)))
            writer.start()
            writer.join(0.1)
            assert writer.is_alive()  # another thread waits for the turn …
        writer.join(10)
        assert made == [2]  # … and takes it when the first lets go
    finally:
        one.close()
        two.close()


def _open_files(under: Path) -> list[str]:
    """This process's descriptors open on files under ``under``."""
    return [target for target in open_targets() if target.startswith(str(under))]


def test_a_closed_store_keeps_no_file_open_and_the_turn_stays_with_the_objects_still_open(tmp_path: Path) -> None:
    # the turn's lock file was kept open for the process's life: a notebook opening workspace after workspace ran
    # out of descriptors (select() refuses one past 1,023)
    for i in range(5):
        with Workspace(tmp_path / f"ws{i}") as ws:
            ws.submit("x", piece="single", model="demo")
    assert _open_files(tmp_path) == []
    one, two = SQLiteStore(tmp_path / "agentnb.sqlite"), SQLiteStore(tmp_path / "agentnb.sqlite")
    one.close()
    one.close()  # twice: let go of once
    assert _new_job(two) == 1  # the other object still takes its turn
    assert f"{two.path}-lock" in _open_files(tmp_path)
    two.close()
    assert _open_files(tmp_path) == []
    # dropped unclosed (a notebook cell that opens it again): let go of once collected
    dropped = Workspace(tmp_path / "dropped")
    dropped.submit("x", piece="single", model="demo")
    del dropped
    gc.collect()
    assert _open_files(tmp_path) == []


def test_without_a_lock_file_writers_wait_for_sqlites_lock_alone(tmp_path: Path) -> None:
    (tmp_path / "agentnb.sqlite-lock").mkdir()  # a folder in the way: no turns, the store still works
    store = SQLiteStore(tmp_path / "agentnb.sqlite")
    other = sqlite3.connect(str(store.path), isolation_level=None, timeout=0)
    other.execute("BEGIN IMMEDIATE")
    import threading
    made: list[int] = []
    writer = threading.Thread(target=lambda: made.append(_new_job(store)))
    writer.start()
    writer.join(0.3)
    assert writer.is_alive()
    other.execute("COMMIT")
    writer.join(10)
    assert made == [1]
    other.close()
    store.close()


def test_the_turn_is_let_go_before_the_live_subscribers_run(tmp_path: Path) -> None:
    import fcntl

    from agentnb import live

    store = SQLiteStore(tmp_path / "agentnb.sqlite")
    job_id = _new_job(store)
    fd = os.open(f"{store.path}-lock", os.O_RDWR)
    free: list[bool] = []

    def subscriber(item: object) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open of the file: as another process would
        except BlockingIOError:
            free.append(False)
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            free.append(True)

    with live.subscribe(store, job_id, subscriber):
        store.append([CommentEvent(job_id=job_id, author="user", body="hello")])
    assert free == [True]
    os.close(fd)
    store.close()


def _checkpointers() -> set[threading.Thread]:
    """The store checkpoint threads alive in this process (store/_checkpoints.py)."""
    return {t for t in threading.enumerate() if t.name == "agentnb-checkpoint" and t.is_alive()}


def test_wal_checkpoints_run_in_a_thread_of_the_store_not_in_a_writers_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentnb.store import _checkpoints

    monkeypatch.setattr(_checkpoints, "EVERY", 5)
    before = _checkpointers()
    store = SQLiteStore(tmp_path / "agentnb.sqlite")
    job_id = _new_job(store)  # the first commit
    size = os.path.getsize(store.path)
    for _ in range(3):  # 4.5 MB in the log: past SQLite's own default (1,000 pages), which would copy it back
        with store.transaction() as c:
            store.add_comment(c, job_id, "user", "x" * 1_500_000)
    assert os.path.getsize(store.path) == size  # no commit checkpointed: the log still holds them all
    assert _checkpointers() == before
    with store.transaction() as c:  # the fifth commit: a checkpoint is due, in the store's own thread
        store.add_comment(c, job_id, "user", "last")
    [thread] = _checkpointers() - before
    wait_for("the log copied back into the database file", lambda: os.path.getsize(store.path) >= size + 4_500_000,
             [], limit=10)
    assert thread.is_alive()  # it waits for the next one …
    assert len(reads.comments(store, job_id)) == 4
    store.close()
    assert not thread.is_alive()  # … until the store is closed


def test_a_checkpoint_thread_with_nothing_due_ends_and_the_next_checkpoint_starts_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentnb.store import _checkpoints

    monkeypatch.setattr(_checkpoints, "EVERY", 2)
    monkeypatch.setattr(_checkpoints, "IDLE_S", 0.5)
    before = _checkpointers()
    store = SQLiteStore(tmp_path / "agentnb.sqlite")
    try:
        _new_job(store)
        _new_job(store)
        [first] = _checkpointers() - before
        # a store dropped without close() keeps no thread for long
        wait_for("the idle checkpoint thread to end", lambda: not first.is_alive(), [], limit=10)
        assert _checkpointers() == before
        _new_job(store)
        _new_job(store)
        [second] = _checkpointers() - before  # the next checkpoint due has a thread again
        assert second is not first
    finally:
        store.close()
    wait_for("the checkpoint thread to end with the store", lambda: _checkpointers() == before, [], limit=10)


def test_a_write_that_waits_too_long_fails_with_sqlites_line_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agentnb.store.sqlite, "_BUSY_WAIT", 0.3)
    store = SQLiteStore(tmp_path / "agentnb.sqlite")
    other = sqlite3.connect(str(store.path), isolation_level=None, timeout=0)
    other.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.OperationalError, match=r"^database is locked$"):
        _new_job(store)
    other.execute("COMMIT")
    assert store.conn.execute("PRAGMA busy_timeout").fetchone()[0] == 300
    assert store.query("SELECT COUNT(*) FROM jobs")[0][0] == 0
    assert _new_job(store) == 1  # the store is usable once the lock is let go
    other.close()
    store.close()


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
    raw.execute("DROP TABLE call_cache")
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
    assert {"path", "transaction", "append", "events", "claim", "set_status", "rows"} <= members
    store = open_store(tmp_path / "s.sqlite")
    assert isinstance(store, SQLiteStore)
    for name in sorted(members):
        assert hasattr(store, name), f"SQLiteStore has no {name}"
        if not isinstance(vars(Store)[name], property):
            want = list(inspect.signature(getattr(Store, name)).parameters)
            assert list(inspect.signature(getattr(SQLiteStore, name)).parameters)[: len(want)] == want, name
    assert agentnb.store.Store is Store  # the package's Store is the interface


def test_batches_are_read_by_functions_of_a_store_not_by_store_methods(tmp_path: Path) -> None:
    from agentnb.store import reads

    # the Protocol keeps the batch writes; the reads are written once in store/reads.py for both backends
    assert {"create_batch", "update_batch"} <= set(vars(Store))
    for name in ("batch", "batches"):
        assert name not in vars(Store), f"Store still declares {name}"
        assert not hasattr(SQLiteStore, name), f"SQLiteStore still has {name}"
    if importlib.util.find_spec("psycopg") is not None:
        from agentnb.store.postgres import PostgresStore

        assert not hasattr(PostgresStore, "batch") and not hasattr(PostgresStore, "batches")
    store = open_store(tmp_path / "s.sqlite")
    assert reads.batch(store, "none") is None and reads.batches(store) == []


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


# -- movement runs and comments as records (store/records.py), read once for both backends (store/reads.py) --

def _runs_and_comments(ws: Workspace) -> int:
    """A job with three movement runs (done and forced, failed, open), two LLM calls of the first and one of the
    second, and three comments: through the store's own writes, on the test's backend."""
    s = ws.store
    job_id = s.create_job(piece="p", piece_yaml="name: p", model="demo", instruction="task", workdir="")
    with s.transaction() as c:
        s.start_movement(c, job_id, 1, "plan")
        s.finish_movement(c, job_id, 1, iterations=2, next_step="work", forced=True, summary="planned")
        s.start_movement(c, job_id, 2, "work")
        s.fail_movement(c, job_id, 2, iterations=1)
        s.start_movement(c, job_id, 3, "work")
        for author, body in [("agent", "Which file?"), ("user", "a.md"), ("user", "and b.md")]:
            s.add_comment(c, job_id, author, body)
    s.append([LLMResponse(job_id=job_id, movement_seq=seq, iteration=1, content="x", tool_calls=[], usage=Usage())
              for seq in (1, 1, 2)])
    return job_id


def _typed(d: dict[str, Any]) -> list[tuple[str, type, Any]]:
    # True == 1 in Python: the type is compared too, so a bool where the row has 0/1 is told apart
    return [(k, type(v), v) for k, v in d.items()]


def test_movement_runs_are_frozen_typed_records_read_the_same_on_both_backends(ws: Workspace) -> None:
    job_id = _runs_and_comments(ws)
    runs = reads.movements(ws.store, job_id)
    assert all(isinstance(r, MovementRecord) for r in runs)
    assert [(r.seq, r.name, r.status, r.iterations, r.next_step, r.forced, r.summary) for r in runs] == [
        (1, "plan", "done", 2, "work", True, "planned"), (2, "work", "failed", 1, None, False, None),
        (3, "work", "running", 0, None, False, None)]
    first = runs[0]
    assert (type(first.job_id), type(first.seq), type(first.iterations), type(first.forced), type(first.started),
            type(first.ended)) == (int, int, int, bool, float, float)
    assert runs[2].ended is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.status = "running"  # type: ignore[misc]
    assert not hasattr(first, "__dict__")  # slots
    assert reads.open_movement(ws.store, job_id) == runs[2]
    assert reads.calls_by_movement(ws.store, job_id) == {"plan": 2, "work": 1}
    assert reads.runner_mark(ws.store, job_id)[1] == 3  # the open run's seq
    with ws.store.transaction() as c:
        ws.store.fail_movement(c, job_id, 3, iterations=0)
    assert reads.open_movement(ws.store, job_id) is None
    assert reads.runner_mark(ws.store, job_id)[1] == 0


def test_comments_are_frozen_typed_records_read_the_same_on_both_backends(ws: Workspace) -> None:
    job_id = _runs_and_comments(ws)
    every = reads.comments(ws.store, job_id)
    assert all(isinstance(c, CommentRecord) for c in every)
    assert [(c.author, c.body) for c in every] == [("agent", "Which file?"), ("user", "a.md"), ("user", "and b.md")]
    assert [(type(c.id), type(c.job_id), type(c.ts)) for c in every] == [(int, int, float)] * 3
    assert [c.id for c in every] == sorted(c.id for c in every)
    with pytest.raises(dataclasses.FrozenInstanceError):
        every[0].body = "changed"  # type: ignore[misc]
    assert reads.comments(ws.store, job_id, last=2) == every[1:]  # the newest two, still oldest first
    assert reads.comments(ws.store, job_id, last=5) == every
    assert reads.count_comments(ws.store, job_id) == 3
    other = ws.store.create_job(piece="p", piece_yaml="name: p", model="demo", instruction="other", workdir="")
    assert reads.comments(ws.store, other) == [] and reads.count_comments(ws.store, other) == 0
    assert reads.movements(ws.store, other) == [] and reads.calls_by_movement(ws.store, other) == {}


def test_to_dict_is_the_row_ws_movements_and_ws_comments_give(ws: Workspace) -> None:
    job_id = _runs_and_comments(ws)
    for table, order, public, records in [
            ("movements", "seq", ws.movements(job_id), reads.movements(ws.store, job_id)),
            ("comments", "id", ws.comments(job_id), reads.comments(ws.store, job_id))]:
        cols, rows = ws.store.rows(f"SELECT * FROM {table} WHERE job_id=? ORDER BY {order}", (job_id,))
        stored = [dict(zip(cols, r, strict=True)) for r in rows]  # the table's row, as the store returned it
        assert [_typed(d) for d in public] == [_typed(d) for d in stored], table  # keys, their order, types
        assert [_typed(r.to_dict()) for r in records] == [_typed(d) for d in stored], table
        assert all(type(d) is dict for d in public)
    assert ws.movements(job_id)[0]["forced"] == 1 and type(ws.movements(job_id)[0]["forced"]) is int


def test_the_store_interface_keeps_no_derived_read_of_movements_or_comments() -> None:
    from agentnb.store.postgres import PostgresStore

    moved = {"comments", "count_comments", "movements", "open_movement", "calls_by_movement", "runner_mark"}
    for cls in (Store, SQLiteStore, PostgresStore):
        assert not {n for n in moved if hasattr(cls, n)}, cls.__name__
        assert {"add_comment", "start_movement", "finish_movement", "fail_movement",
                "reopen_failed_movement"} <= set(dir(cls)), cls.__name__  # the writes stay persistence core
    assert moved <= set(reads.__all__)


# -- the job row as a record (store/records.py) and the reads derived from a job's events (store/reads.py) -------

# long enough to be stored once in `texts` (the row then holds TEXT_REF): the record holds the text itself
_LONG = "Summarise every file under input/. " * 200
_OPTIONS_TEXT = '{"future":{"x":1},"retries":3,"context":{"window_tokens":9000}}'


def _job_with_refs(ws: Workspace) -> int:
    """A job whose instruction and enriched instruction are stored by reference, with options this version does
    not all know, claimed once (lease_gen 1, a lease and an owner set) and started a movement."""
    s = ws.store
    job_id = s.create_job(piece="p", piece_yaml="name: p", model="demo", instruction=_LONG, workdir="w",
                          options=_OPTIONS_TEXT)
    assert s.claim(job_id, owner="host:1:abcd", lease=60) is not None
    with s.transaction() as c:
        s.update_job(c, job_id, enriched=f"Now: 09:00\n\n{_LONG}", current_movement="plan", movement_seq=1)
    return job_id


def test_a_job_is_a_frozen_typed_record_the_same_on_both_backends(ws: Workspace) -> None:
    job_id = _job_with_refs(ws)
    job = ws.store.job(job_id)
    assert isinstance(job, JobRecord)
    assert type(job.status) is JobStatus and job.status is JobStatus.running
    assert type(job.options) is JobOptions and job.options.retries == 3
    assert job.options.context == {"window_tokens": 9000} and job.options.extra == {"future": {"x": 1}}
    assert job.options_text == _OPTIONS_TEXT  # the stored text itself, not re-encoded
    assert job.instruction == _LONG and job.enriched == f"Now: 09:00\n\n{_LONG}"  # references expanded
    assert [type(v) for v in (job.id, job.movement_seq, job.lease_gen, job.created, job.lease_until)] == [
        int, int, int, float, float]
    assert (job.parent_id, job.batch_case, job.forked_from_job, job.forked_from, job.ended) == (None,) * 5
    assert (job.lease_gen, job.claimed_by, job.current_movement) == (1, "host:1:abcd", "plan")
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.status = JobStatus.queued  # type: ignore[misc]
    assert not hasattr(job, "__dict__")  # slots
    assert ws.store.jobs() == [job] and ws.store.jobs(status="running") == [job]
    assert ws.store.jobs(status="queued") == [] and ws.store.jobs(parent_id=job_id) == []
    with ws.store.transaction() as c:
        kid = ws.store.create_child_job(c, job_id, piece="p", piece_yaml="name: p", piece_path=None, model="demo",
                                        instruction="part", options="{}")
    child = ws.store.jobs(parent_id=job_id)
    assert [(r.id, r.parent_id, r.status, r.options) for r in child] == [(kid, job_id, "queued", JobOptions())]
    claimed = ws.store.claim(kid)
    assert isinstance(claimed, JobRecord) and (claimed.status, claimed.lease_gen) == (JobStatus.running, 1)


def test_a_job_records_to_dict_is_the_stored_row_as_the_store_returned_it(ws: Workspace) -> None:
    job_id = _job_with_refs(ws)
    cols, rows = ws.store.rows("SELECT * FROM jobs WHERE id=?", (job_id,))
    stored = dict(zip(cols, rows[0], strict=True))
    # what Store.job returned before it returned records: the row without its text references, texts put back
    assert stored.pop("instruction_ref") and stored.pop("enriched_ref") and stored["instruction"] != _LONG
    expected = {**stored, "instruction": _LONG, "enriched": f"Now: 09:00\n\n{_LONG}"}
    assert list(expected) == list(JOB_COLUMNS)  # the table's columns, in its order
    assert [_typed(r.to_dict()) for r in (ws.store.job(job_id), *ws.store.jobs())] == [_typed(expected)] * 2
    assert type(ws.store.job(job_id).to_dict()["status"]) is str  # the stored text, not the enum member
    assert JobRecord.from_row(list(expected), list(expected.values())) == ws.store.job(job_id)


def test_the_reads_of_a_jobs_events_give_the_same_on_both_backends(ws: Workspace) -> None:
    s = ws.store
    job_id = s.create_job(piece="p", piece_yaml="name: p", model="demo", instruction="task", workdir="")
    assert (reads.total_tokens(s, job_id), reads.latest_request(s, job_id)) == (0, None)
    assert reads.last_status_reason(s, job_id) == "submitted" and reads.subtask_depth(s, job_id) == 0
    s.append([LLMRequest(job_id=job_id, movement_seq=1, iteration=1, messages=2, tools=[]),
              LLMResponse(job_id=job_id, movement_seq=1, iteration=1, content="a", tool_calls=[],
                          usage=Usage(prompt_tokens=100, completion_tokens=20, total_tokens=120)),
              LLMRequest(job_id=job_id, movement_seq=2, iteration=3, messages=4, tools=["Read"]),
              LLMResponse(job_id=job_id, movement_seq=2, iteration=3, content="b", tool_calls=[],
                          usage=Usage(prompt_tokens=300, completion_tokens=7, total_tokens=307))])
    with s.transaction() as c:
        s.set_status(c, job_id, JobStatus.queued, reason="paused after one call")
        kid = s.create_child_job(c, job_id, piece="p", piece_yaml="name: p", piece_path=None, model="demo",
                                 instruction="part", options="{}")
        grandchild = s.create_child_job(c, kid, piece="p", piece_yaml="name: p", piece_path=None, model="demo",
                                        instruction="part of it", options="{}")
    total = reads.total_tokens(s, job_id)
    assert total == 427 and type(total) is int
    assert reads.latest_request(s, job_id) == (2, 3)
    assert reads.last_status_reason(s, job_id) == "paused after one call"
    assert [reads.subtask_depth(s, j) for j in (job_id, kid, grandchild)] == [0, 1, 2]
    assert (reads.total_tokens(s, kid), reads.latest_request(s, kid), reads.last_status_reason(s, kid)) == (0, None, None)


def test_the_store_interface_keeps_no_derived_read_of_a_jobs_events() -> None:
    from agentnb.store.postgres import PostgresStore

    moved = {"total_tokens", "last_status_reason", "latest_request", "subtask_depth"}
    for cls in (Store, SQLiteStore, PostgresStore):
        assert not {n for n in moved if hasattr(cls, n)}, cls.__name__
        assert {"job", "jobs", "claim", "job_columns", "set_status"} <= set(dir(cls)), cls.__name__
    assert moved <= set(reads.__all__)
    # the interface is typed with the record: what a backend returns is what the package reads
    for name in ("job", "jobs", "claim"):
        assert "JobRecord" in str(typing.get_type_hints(getattr(Store, name))["return"]), name
