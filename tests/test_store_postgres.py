"""The PostgreSQL store (docs/stores.md) on a real server: opening and migrating (two processes at once), the same
events and frames as SQLite for the same jobs, claims from two processes, and the bad-input lines."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from _postgres import PgServer, _free_port
from _usage_jobs import demo_job, usage_job

from agentnb import Workspace
from agentnb.errors import StoreError
from agentnb.store import display_url, open_store, reads

ROOT = Path(__file__).resolve().parent.parent
needs_pg = pytest.mark.needs("postgres", "psycopg")


def _sql(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else []


def _tables(url: str) -> list[str]:
    return [r[0] for r in _sql(url, "SELECT tablename FROM pg_tables WHERE schemaname='public' ORDER BY 1")]


def _python(code: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# -- opening and migrating -------------------------------------------------------------------------------------

@needs_pg
def test_open_creates_the_schema_and_reopening_changes_nothing(pg_url: str) -> None:
    from agentnb.store.postgres import PG_SCHEMA_VERSION, PostgresStore

    store = open_store(pg_url)
    assert isinstance(store, PostgresStore)
    store.close()
    assert set(_tables(pg_url)) == {"agentnb_schema", "batches", "call_cache", "comments", "events", "files", "jobs",
                                    "movements", "texts"}
    assert _sql(pg_url, "SELECT version FROM agentnb_schema") == [(PG_SCHEMA_VERSION,)]
    open_store(pg_url.replace("postgresql://", "postgres://")).close()  # the short scheme too; no second row
    assert _sql(pg_url, "SELECT version FROM agentnb_schema") == [(PG_SCHEMA_VERSION,)]


@needs_pg
def test_processes_opening_a_new_database_at_once_migrate_it_once(pg_url: str) -> None:
    # each waits for the same moment, so the opens overlap (the advisory lock makes the second wait, then find
    # the schema done); without the lock the second CREATE TABLE fails
    start = time.time() + 1.5
    code = """
        import sys, time
        from agentnb.store import open_store
        time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
        open_store(sys.argv[1]).close()
        print("ok")
    """
    procs = [_python(code, pg_url, str(start)) for _ in range(4)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    assert _sql(pg_url, "SELECT COUNT(*) FROM agentnb_schema") == [(1,)]
    assert "jobs" in _tables(pg_url)


# -- the same jobs on both backends -------------------------------------------------------------------------

_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}(:\d{2}(\.\d+)?)?( ?UTC|Z|[+-]\d{2}:?\d{2})?")
_OWNER = re.compile(r"claimed by \S+")
# columns that hold times, durations or ids: they differ between any two runs, whatever the store
_VOLATILE = {"timestamp", "ts", "created", "started", "ended", "duration", "latency_s", "first_day", "last_day",
             "event_id", "status_reason", "cost_usd", "seconds"}


def _norm(value: Any) -> Any:
    if isinstance(value, str):
        return _OWNER.sub("claimed by OWNER", _TIME.sub("TIME", value))
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items() if k not in ("latency_s",)}
    if isinstance(value, list):
        return [_norm(v) for v in value]
    return value


def _record(ws: Workspace) -> dict[str, Any]:
    """Everything a notebook reads of the workspace, minus times, ids and owners."""
    events = {}
    for job in ws.jobs():
        events[job.id] = [(e.kind, e.movement_seq, e.iteration, _norm(e.payload)) for e in ws.events(job.id)]
    frames = {}
    for name in ("jobs", "movements", "messages", "tool_calls", "usage", "context_actions", "scores",
                 "divergences", "compactions", "loops"):
        df: pd.DataFrame = getattr(ws.frames, name)()
        frames[name] = df.drop(columns=[c for c in df.columns if c in _VOLATILE]).map(_norm)
    # workdir differs by design: SQLite's absolute path, PostgreSQL's jobs/<id> under each worker's own folder
    jobs = [{k: _norm(v) for k, v in ws.store.job(j).to_dict().items()
             if k not in _VOLATILE | {"updated", "claimed_by", "workdir"}} for j in ws.store.job_ids()]
    return {"events": events, "frames": frames, "jobs": jobs,
            "movements": [[{k: v for k, v in m.items() if k not in _VOLATILE} for m in ws.movements(j)]
                          for j in ws.store.job_ids()]}


@needs_pg
def test_scripted_jobs_give_the_same_events_and_frames_as_on_sqlite(pg_url: str, tmp_path: Path) -> None:
    # the same folder for both runs, so the paths in prompts and tool results are the same too
    root = tmp_path / "ws"
    long_instruction = "Report on input/notes.md. " + "Keep every detail. " * 300  # stored once, in texts

    def run(ws: Workspace) -> dict[str, Any]:
        usage_job(ws, tmp_path / "scripts", instruction=long_instruction)
        demo_job(ws)
        ws.submit("never run", piece="single", model="demo")
        return _record(ws)

    sqlite_ws = Workspace(root)
    on_sqlite = run(sqlite_ws)
    sqlite_ws.store.close()
    shutil.rmtree(root)

    pg_ws = Workspace(root, store=pg_url)
    assert not (root / "agentnb.sqlite").exists()
    on_pg = run(pg_ws)
    assert _sql(pg_url, "SELECT COUNT(*) FROM texts") == [(1,)]
    pg_ws.store.close()

    assert on_pg["events"].keys() == on_sqlite["events"].keys() == {1, 2, 3}
    kinds = {e[0] for evs in on_sqlite["events"].values() for e in evs}
    assert {"movement_start", "llm_request", "llm_response", "tool_call", "tool_result", "context_action",
            "transition", "job_status"} <= kinds, kinds
    for job_id, evs in on_sqlite["events"].items():
        assert on_pg["events"][job_id] == evs, f"job {job_id}"
    assert on_pg["jobs"] == on_sqlite["jobs"]
    assert _sql(pg_url, "SELECT id, workdir FROM jobs ORDER BY id") == [(j, f"jobs/{j}") for j in (1, 2, 3)]
    assert on_pg["movements"] == on_sqlite["movements"]
    for name, frame in on_sqlite["frames"].items():
        assert len(frame) or name in ("scores", "divergences", "compactions", "loops")
        pd.testing.assert_frame_equal(on_pg["frames"][name], frame, obj=f"frames.{name}()")


@needs_pg
def test_agentnb_store_in_the_environment_chooses_the_store(pg_url: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTNB_STORE", pg_url)
    ws = Workspace(tmp_path / "scratch")
    job = ws.submit("hello", piece="single", model="demo")
    ws.store.close()
    assert not (tmp_path / "scratch" / "agentnb.sqlite").exists()
    assert _sql(pg_url, "SELECT id, instruction FROM jobs") == [(job.id, "hello")]


# -- claims ------------------------------------------------------------------------------------------------

@needs_pg
def test_two_processes_claiming_never_take_the_same_job(pg_url: str) -> None:
    store = open_store(pg_url)
    ids = [store.create_job(piece="single", piece_yaml="", model="demo", instruction=f"job {i}", workdir="")
           for i in range(60)]
    store.close()
    # each claims until nothing is left, ending each job at once (as a worker does) so that a process that
    # finished first is never taken for a dead owner of running jobs
    code = """
        import json, sys, time
        from agentnb.store import open_store
        store = open_store(sys.argv[1])
        time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
        got = []
        while (row := store.claim()) is not None:
            got.append(row.id)
            if len(got) == 1:  # hold the first claim until the other process has one too (a late start under load)
                until = time.time() + 60
                while store.query("SELECT COUNT(*) FROM jobs WHERE status='running'")[0][0] < 2 and time.time() < until:
                    time.sleep(0.01)
            with store.transaction() as c:
                store.set_status(c, row.id, "succeeded", reason="done")
        store.close()
        print(json.dumps(got))
    """
    start = str(time.time() + 1.5)
    procs = [_python(code, pg_url, start) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    a, b = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert not set(a) & set(b)
    assert sorted(a + b) == ids
    assert a and b, "both processes should have claimed some jobs"
    claims = _sql(pg_url, "SELECT job_id, COUNT(*) FROM events WHERE kind='job_status' AND "
                          "payload->>'status' = 'running' GROUP BY job_id HAVING COUNT(*) > 1")
    assert claims == []


@needs_pg
def test_claim_of_a_given_job_and_of_none_left(pg_url: str) -> None:
    store = open_store(pg_url)
    first = store.create_job(piece="single", piece_yaml="", model="demo", instruction="a", workdir="")
    second = store.create_job(piece="single", piece_yaml="", model="demo", instruction="b", workdir="")
    row = store.claim(second)
    assert row is not None and row.id == second and row.status == "running"
    assert store.claim(second) is None  # already running
    assert store.claim(2**70) is None
    row = store.claim()
    assert row is not None and row.id == first
    assert store.claim() is None
    store.close()


# -- bad input: one line, store untouched -------------------------------------------------------------------

def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text and text, text
    return text


@needs_pg
def test_a_newer_schema_is_refused_and_left_as_it_is(pg_url: str) -> None:
    open_store(pg_url).close()
    _sql(pg_url, "UPDATE agentnb_schema SET version = 99")
    before = _tables(pg_url)
    with pytest.raises(StoreError) as exc:
        open_store(pg_url)
    text = _one_line(exc)
    assert "schema version 99, newer than" in text and "nothing was changed" in text
    assert _tables(pg_url) == before
    assert _sql(pg_url, "SELECT version FROM agentnb_schema") == [(99,)]
    with pytest.raises(StoreError):
        Workspace(Path("/nonexistent-not-made"), store=pg_url, readonly=True)


@needs_pg
def test_a_database_of_another_program_is_refused_and_left_as_it_is(pg_url: str, tmp_path: Path) -> None:
    """Tables of its own (one named as agentnb's) and no agentnb schema version: migrating would fail half-way
    ("relation batches already exists") or add agentnb's tables to someone else's database."""
    _sql(pg_url, "CREATE TABLE batches (id INTEGER, label TEXT); CREATE TABLE foo (x INTEGER); "
                 "INSERT INTO batches VALUES (1, 'mine')")
    for readonly in (False, True):
        with pytest.raises(StoreError) as exc:
            Workspace(tmp_path / "ws", store=pg_url, readonly=readonly)
        assert _one_line(exc) == (f"{display_url(pg_url)}: not an agentnb store (it has tables batches, foo but no "
                                  "agentnb schema version); use another database (nothing was changed)")
    assert _tables(pg_url) == ["batches", "foo"]
    assert _sql(pg_url, "SELECT * FROM batches") == [(1, "mine")]


@needs_pg
def test_a_read_only_open_of_an_empty_database_says_there_is_nothing_yet_and_creates_nothing(
        pg_url: str, tmp_path: Path) -> None:
    with pytest.raises(StoreError) as exc:
        Workspace(tmp_path / "ws", store=pg_url, readonly=True)
    assert "holds no agentnb workspace yet" in _one_line(exc) and "s3cret" not in _one_line(exc)
    assert _tables(pg_url) == []  # nothing created by reading
    proc = subprocess.run([sys.executable, "-m", "agentnb.cli", "--workspace", str(tmp_path / "ws"), "--store", pg_url,
                           "jobs"], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "holds no agentnb workspace yet" in proc.stderr
    assert _tables(pg_url) == []


@needs_pg
def test_a_wrong_password_is_one_line_that_never_shows_a_password(pg: PgServer, pg_url: str,
                                                                  tmp_path: Path) -> None:
    db = pg_url.rsplit("/", 1)[1]
    wrong = "not-the-Pa55word"
    with pytest.raises(StoreError) as exc:
        Workspace(tmp_path / "ws", store=pg.url(db, password=wrong))
    text = _one_line(exc)
    assert "refused the password for user" in text
    assert wrong not in text and pg.password not in text
    assert _tables(pg_url) == []  # nothing was created


@needs_pg
def test_an_unreachable_server_is_one_line(tmp_path: Path) -> None:
    url = f"postgresql://agentnb:pw-xyz@127.0.0.1:{_free_port()}/agentnb"  # nothing listens there
    with pytest.raises(StoreError) as exc:
        Workspace(tmp_path / "ws", store=url)
    text = _one_line(exc)
    assert text.startswith("cannot reach the PostgreSQL server at 127.0.0.1:") and "pw-xyz" not in text


@needs_pg
def test_a_missing_database_is_one_line(pg: PgServer) -> None:
    with pytest.raises(StoreError) as exc:
        open_store(pg.url("no_such_db"))
    text = _one_line(exc)
    assert "no_such_db" in text and "does not exist" in text and pg.password not in text


# -- URL resolution (no server needed) ----------------------------------------------------------------------

def test_an_unsupported_scheme_is_one_line_and_makes_nothing(tmp_path: Path) -> None:
    with pytest.raises(StoreError) as exc:
        Workspace(tmp_path / "ws", store="mysql://u@h/db")
    text = _one_line(exc)
    assert "'mysql'" in text and "postgresql://" in text and "sqlite:///" in text
    assert not (tmp_path / "ws").exists()
    with pytest.raises(StoreError, match="absolute path"):
        open_store("sqlite://relative/agentnb.sqlite")


def test_sqlite_urls_and_folders_open_the_sqlite_store(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "scratch", store=f"sqlite://{tmp_path}/shared/agentnb.sqlite")
    job = ws.submit("hello", piece="single", model="demo")
    ws.store.close()
    assert (tmp_path / "shared" / "agentnb.sqlite").is_file()
    assert not (tmp_path / "scratch" / "agentnb.sqlite").exists()
    store = open_store(tmp_path / "shared")  # a folder: its agentnb.sqlite
    assert [j.id for j in store.jobs()] == [job.id]
    store.close()
    store = open_store(f"SQLITE://{tmp_path}/shared")  # schemes are case-insensitive; a folder again
    assert store.job_ids() == [job.id]
    store.close()


# -- the CLI's --store ----------------------------------------------------------------------------------------

@needs_pg
def test_cli_store_option_runs_and_lists_jobs_on_the_server(pg_url: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from agentnb.cli import main

    scratch = str(tmp_path / "scratch")
    assert main(["run", "--workspace", scratch, "--store", pg_url, "--piece", "plan-implement-verify",
                 "--model", "demo", "Summarise the files in input/"]) == 0
    assert capsys.readouterr().out.startswith("job 1: succeeded")
    assert main(["--store", pg_url, "--workspace", scratch, "jobs"]) == 0
    listed = capsys.readouterr().out
    assert "succeeded" in listed and "plan-implement-verify" in listed
    assert not (tmp_path / "scratch" / "agentnb.sqlite").exists()
    assert _sql(pg_url, "SELECT status FROM jobs") == [("succeeded",)]


def test_cli_unsupported_store_scheme_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agentnb.cli import main

    assert main(["jobs", "--workspace", str(tmp_path / "ws"), "--store", "redis://h/0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'redis'" in err
    assert not (tmp_path / "ws").exists()


@needs_pg
def test_a_connection_lost_is_one_line_mid_transaction_and_replaced_when_idle(pg: PgServer, pg_url: str) -> None:
    store = open_store(pg_url)
    job = store.create_job(piece="single", piece_yaml="", model="demo", instruction="a", workdir="")
    db = pg_url.rsplit("/", 1)[1]
    with pytest.raises(StoreError) as exc, store.transaction() as c:
        # what a server restart or a network cut does to a connection in use
        _sql(pg.url(), "SELECT pg_terminate_backend(%s)", (c.info.backend_pid,))  # type: ignore[attr-defined]
        store.update_job(c, job, error="never written")
    assert pg.password not in _one_line(exc)
    assert store.job(job).error is None
    # and to the connections idle in the pool: each is checked when handed out, and replaced
    cut = _sql(pg.url(), "WITH idle AS MATERIALIZED (SELECT pid FROM pg_stat_activity WHERE datname = %s) "
                         "SELECT pid FROM idle WHERE pg_terminate_backend(pid)", (db,))
    assert cut
    # gone from the server's list: its socket is closed (the pool's check looks for that, as a restart leaves it)
    deadline = time.monotonic() + 30
    while _sql(pg.url(), "SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s)", ([p for p, in cut],)):
        assert time.monotonic() < deadline, "the terminated sessions did not end"
        time.sleep(0.01)
    assert store.job_ids() == [job]
    assert store.job(job).error is None
    store.close()


@needs_pg
def test_a_nul_in_an_event_is_kept_as_a_mark_and_the_frames_still_read(pg_url: str) -> None:
    from agentnb.events import ToolResult

    store = open_store(pg_url)
    job = store.create_job(piece="single", piece_yaml="", model="demo", instruction="a", workdir="")
    store.append([ToolResult(job_id=job, ts=time.time(), tool="Bash", call_id="c1", content="a\x00b \\u0000 c")])
    (event,) = store.events(job, kinds=["tool_result"])
    assert event.payload["content"] == "a\ufffdb \\u0000 c"  # the NUL marked, a literal backslash-u kept
    assert reads.frame_rows(store, "messages", job)[1][0][-2] == "a\ufffdb \\u0000 c"
    store.close()


# -- write locks: jobs of different trees write side by side, decisions within a tree stay ordered -------------

def _children_of_a_waiting_parent(store: Any, n: int) -> tuple[int, list[tuple[int, int]]]:
    """A parent waiting for ``n`` subtasks, each claimed (running, leased): the parent and (child, lease gen)."""
    parent = store.create_job(piece="single", piece_yaml="", model="demo", instruction="split", workdir="")
    with store.transaction() as c:
        kids = [store.create_child_job(c, parent, piece="single", piece_yaml="", piece_path=None, model="demo",
                                       instruction=f"part {k}", options="{}") for k in range(n)]
        store.set_status(c, parent, "waiting_subtasks", reason="split", resume_movement="merge")
    claimed = [store.claim(kid, lease=60) for kid in kids]
    return parent, [(int(r.id), int(r.lease_gen)) for r in claimed if r is not None]


@needs_pg
def test_subtasks_ending_at_once_in_threads_queue_their_parent_exactly_once(pg_url: str) -> None:
    """Many children of one parent end at the same moment, each in its own thread as its lease holder (as a
    worker's slots run them): exactly one of them — the last to commit — queues the parent.  Under READ
    COMMITTED without the tree's lock each would count the others as still open (nobody queues it) or two
    would both see none (twice).  Jobs of other trees write meanwhile."""
    import threading

    from agentnb.engine.subtasks import notify_parent
    from agentnb.store.postgres import PostgresStore

    store = PostgresStore(pg_url, pool_size=40)
    try:
        for _ in range(3):
            parent, kids = _children_of_a_waiting_parent(store, 12)
            other, other_kids = _children_of_a_waiting_parent(store, 4)
            start = threading.Barrier(len(kids) + len(other_kids))
            errors: list[BaseException] = []

            def end(kid: int, gen: int, start: threading.Barrier = start, errors: list[BaseException] = errors) -> None:
                try:
                    start.wait(timeout=30)
                    with store.fenced(kid, gen), store.transaction() as c:
                        store.set_status(c, kid, "succeeded", reason="done")
                        notify_parent(store, c, kid)
                        # the runner goes on writing before it commits: the others count meanwhile
                        time.sleep(0.01)
                except BaseException as exc:  # reported by the main thread
                    errors.append(exc)

            threads = [threading.Thread(target=end, args=kg) for kg in kids + other_kids]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert not errors, errors
            for p in (parent, other):
                queued = [ev for ev in store.events(p, kinds=["job_status"])
                          if ev.payload["reason"] == "every subtask has ended"]
                assert len(queued) == 1, f"parent {p} queued {len(queued)} times"
                row = store.job(p)
                assert (row.status, row.current_movement) == ("queued", "merge")
            # it was queued after every child had ended: the event follows each child's end
            ends = [ev.id for k, _ in kids for ev in store.events(k, kinds=["job_status"])
                    if ev.payload["status"] == "succeeded"]
            assert len(ends) == len(kids) and max(ends) < queued_id(store, parent)
    finally:
        store.close()


def queued_id(store: Any, parent: int) -> int:
    return max(ev.id for ev in store.events(parent, kinds=["job_status"])
               if ev.payload["reason"] == "every subtask has ended")


@needs_pg
def test_lease_holders_of_different_trees_write_at_once_and_others_wait_for_all(pg_url: str) -> None:
    """Two lease holders of different job trees hold write transactions open at the same time; a
    transaction that holds no lease (a submit, a comment) waits until both have ended; a second holder in
    the same tree waits for the first."""
    import threading

    from agentnb.store.postgres import PostgresStore

    store = PostgresStore(pg_url, pool_size=8)
    try:
        a = store.create_job(piece="single", piece_yaml="", model="demo", instruction="a", workdir="")
        b = store.create_job(piece="single", piece_yaml="", model="demo", instruction="b", workdir="")
        with store.transaction() as c:
            a_kid = store.create_child_job(c, a, piece="single", piece_yaml="", piece_path=None, model="demo",
                                           instruction="a's part", options="{}")
        rows = {r.id: int(r.lease_gen) for r in (store.claim(j, lease=60) for j in (a, b, a_kid)) if r}
        order: list[str] = []
        inside = {k: threading.Event() for k in ("a", "b")}
        release = threading.Event()

        def hold(name: str, job: int) -> None:
            with store.fenced(job, rows[job]), store.transaction() as c:
                store.update_job(c, job, current_movement=name)
                inside[name].set()
                release.wait(timeout=30)
                order.append(f"{name} ends")

        def later(name: str, work: Any) -> None:
            work()
            order.append(name)

        holders = [threading.Thread(target=hold, args=("a", a)), threading.Thread(target=hold, args=("b", b))]
        for t in holders:
            t.start()
        # both inside their transactions at once: different trees do not wait for each other
        assert inside["a"].wait(timeout=30) and inside["b"].wait(timeout=30)

        def same_tree() -> None:
            with store.fenced(a_kid, rows[a_kid]), store.transaction() as c:
                store.update_job(c, a_kid, current_movement="kid")

        def unleased() -> None:
            store.create_job(piece="single", piece_yaml="", model="demo", instruction="c", workdir="")

        def waiting_for_locks(n: int) -> None:  # asked of the server, not timed
            deadline = time.monotonic() + 30
            while _sql(pg_url, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND "
                               "wait_event_type = 'Lock' AND wait_event = 'advisory'")[0][0] < n:
                assert time.monotonic() < deadline, f"{order}: fewer than {n} transactions wait for a lock"
                time.sleep(0.02)

        waiters = [threading.Thread(target=later, args=("same tree", same_tree)),
                   threading.Thread(target=later, args=("submit", unleased))]
        # the same tree first (it holds the store-wide lock shared, then waits for its tree's), then the submit
        waiters[0].start()
        waiting_for_locks(1)
        waiters[1].start()
        waiting_for_locks(2)
        assert order == []
        release.set()
        for t in holders + waiters:
            t.join(timeout=30)
        assert sorted(order) == ["a ends", "b ends", "same tree", "submit"]
        assert order.index("same tree") > order.index("a ends")
        assert order.index("submit") > max(order.index("a ends"), order.index("b ends"))
        assert store.job(a_kid).current_movement == "kid"
    finally:
        store.close()


@needs_pg
def test_a_password_given_only_in_the_store_url_is_never_stored(pg_url: str, tmp_path: Path) -> None:
    import uuid

    user, password = f"u_{uuid.uuid4().hex[:10]}", f"pw-{uuid.uuid4().hex}"  # known to no other test
    _sql(pg_url, f"CREATE ROLE {user} LOGIN SUPERUSER PASSWORD '{password}'")
    try:
        url = re.sub(r"//[^@]*@", f"//{user}:{password}@", pg_url, count=1)
        with Workspace(tmp_path / "ws", store=url) as ws:
            job = ws.submit(f"Log in with {password} and read {url}", piece="single", model="demo")
        assert _sql(pg_url, "SELECT instruction FROM jobs WHERE id = %s", (job.id,)) == [
            ("Log in with *** and read ***",)]
    finally:
        _sql(pg_url, f"DROP OWNED BY {user}")
        _sql(pg_url, f"DROP ROLE {user}")
