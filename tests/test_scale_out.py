"""Scaling out, end to end: a batch queued on a PostgreSQL store and run by several
``agentnb worker`` processes, each in a scratch folder of its own (cwd and workspace; nothing shared but the
database), one SIGKILLed mid-movement and one frozen with SIGSTOP past its lease and resumed later; then the
events, claims, files and frames are compared with the same batch run on SQLite by one process."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from _freeze import freeze, reap
from _postgres import OwnPgServer, own_pg_server
from _scripting import QUICK, TWO_STEPS, call, transition, write_piece, write_script
from _waiting import wait_for
from openai_server import OpenAIServer, hold, openai_env, reply

from agentnb import Workspace
from agentnb.store.base import LEASE_EXPIRED, TERMINAL_STATES, UNREACHABLE_REASON
from agentnb.store.pg_outage import REACHABLE, UNREACHABLE

ROOT = Path(__file__).resolve().parent.parent
needs_pg = pytest.mark.needs("postgres", "psycopg")



SECOND = reply(tool_calls=[("transition", {"next_step": "second", "summary": "looked"})])
DONE = reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "finished"})])

_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}(:\d{2}(\.\d+)?)?( ?UTC|Z|[+-]\d{2}:?\d{2})?")
_CALL_ID = re.compile(r"\bcall_\d+_")  # the loopback server numbers its tool calls by request
_OWNER = re.compile(r"claimed by \S+")
# columns that hold times, durations, owners or paths of one machine: they differ between any two runs
_VOLATILE = {"timestamp", "ts", "created", "started", "ended", "duration", "latency_s", "ttft_s", "first_day", "last_day",
             "event_id", "status_reason", "cost_usd", "seconds", "updated", "claimed_by", "workdir",
             "lease_until", "lease_gen"}


@pytest.fixture
def server(loopback: Callable[..., OpenAIServer]) -> OpenAIServer:
    return loopback()


def _env(server: OpenAIServer, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTNB_", "OPENAI_"))}
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                **openai_env(server), **extra})
    return env


def _worker(url: str, scratch: Path, server: OpenAIServer, *args: str, **env: str) -> subprocess.Popen[str]:
    scratch.mkdir(parents=True)
    return subprocess.Popen([sys.executable, "-m", "agentnb.cli", "worker", "--workspace", str(scratch / "ws"),
                             "--store", url, "--lease", "2", "--list", *args], cwd=scratch,
                            env=_env(server, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _sql(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else []


def _submit_batch(ws: Workspace, tmp_path: Path) -> dict[str, list[int]]:
    """The same batch on either store, in the same order: two two-movement jobs on the loopback server (the ones
    killed and frozen on PostgreSQL), three jobs that read their input/ and write output/, three demo jobs."""
    scripts = tmp_path / "scripts"
    scripts.mkdir(exist_ok=True)
    two = write_piece(scripts, "piece", TWO_STEPS)
    quick = write_piece(scripts, "quick", QUICK)
    jobs: dict[str, list[int]] = {"openai": [], "files": [], "demo": []}
    for n in range(2):
        jobs["openai"].append(ws.submit(f"Do thing {n}.", piece=two, model="openai:gpt-4o-mini").id)
    for n in range(3):
        model = write_script(scripts, f"files-{n}", responses=[
            call("Read", path="input/notes.md"),
            call("Write", path=f"output/report-{n}.md", content=f"# Report {n}\n"),
            call("Write", path="output/data/table.csv", content=f"a,b\n{n},{n * n}\n"),
            transition("COMPLETE", f"reported {n}"),
        ])
        jobs["files"].append(ws.submit(f"Report {n}", piece="single", model=model,
                                       inputs={"notes.md": f"notes of case {n}", "raw.bin": bytes([n]) * 300}).id)
    for n in range(3):
        jobs["demo"].append(ws.submit(f"Demo {n}", piece=quick, model="demo").id)
    return jobs


def _norm(value: Any, roots: tuple[str, ...]) -> Any:
    if isinstance(value, str):
        for root in roots:
            value = value.replace(root, "ROOT")
        return _OWNER.sub("claimed by OWNER", _CALL_ID.sub("call_N_", _TIME.sub("TIME", value)))
    if isinstance(value, dict):
        return {k: _norm(v, roots) for k, v in value.items() if k not in ("latency_s", "ttft_s", "response_id")}
    if isinstance(value, list):
        return [_norm(v, roots) for v in value]
    return value


def _events(ws: Workspace, job_id: int, roots: tuple[str, ...]) -> list[tuple[Any, ...]]:
    return [(e.kind, e.movement_seq, e.iteration, _norm(e.payload, roots)) for e in ws.events(job_id)]


def _statuses(ws: Workspace, job_id: int) -> list[tuple[str, str]]:
    out = []
    for e in ws.events(job_id, kinds=["job_status"]):
        reason = str(e.payload["reason"])
        out.append((str(e.payload["status"]), "claimed" if reason.startswith("claimed by ") else reason))
    return out


def _without_recovery(events: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """A recovered job's events minus what the recovery adds: the ``queued``/``running`` job_status pair of the
    take-back, and the one ``llm_request`` the cut-short call left (recorded before the call, docs/events.md, while
    its holder still held the lease; the resumed run asks the same again)."""
    out = list(events)
    back = [i for i, e in enumerate(out) if e[0] == "job_status" and e[3]["reason"] == LEASE_EXPIRED]
    assert len(back) == 1, out
    assert out[back[0] + 1][0] == "job_status" and out[back[0] + 1][3]["status"] == "running"
    del out[back[0]:back[0] + 2]
    cut = [i for i in range(len(out) - 1) if out[i][0] == "llm_request" and out[i] == out[i + 1]]
    assert len(cut) == 1, out
    del out[cut[0]]
    return out


def _frames(ws: Workspace, roots: tuple[str, ...]) -> dict[str, pd.DataFrame]:
    frames = {}
    for name in ("jobs", "movements", "messages", "tool_calls", "usage", "context_actions", "scores",
                 "divergences", "compactions", "loops"):
        df: pd.DataFrame = getattr(ws.frames, name)()
        frames[name] = df.drop(columns=[c for c in df.columns if c in _VOLATILE]).map(lambda v: _norm(v, roots))
    return frames


def _files(ws: Workspace, job_id: int) -> list[tuple[Any, ...]]:
    """Path, size, hash and mode of each file; the lesson log holds the time it was written: no hash for it."""
    df = ws.files(job_id)
    return [(r.path, r.size, None if r.path.startswith("logs/") else r.sha256, r.mode) for r in df.itertuples()]


def _content(path: Path) -> str:
    return _TIME.sub("TIME", path.read_bytes().decode("latin-1"))


@needs_pg
def test_a_batch_on_workers_killed_and_frozen_matches_the_same_batch_on_sqlite(
        pg_url: str, tmp_path: Path, server: OpenAIServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # -- SQLite, one process ----------------------------------------------------------------------------------
    monkeypatch.delenv("AGENTNB_STORE", raising=False)
    sq = Workspace(tmp_path / "sqlite-ws", store=f"sqlite:///{tmp_path / 'sqlite-ws' / 'agentnb.sqlite'}")
    sq_jobs = _submit_batch(sq, tmp_path)
    server.play(SECOND, DONE, SECOND, DONE)
    assert sq.worker().run(concurrency=1) == 8

    # -- PostgreSQL: four workers in folders of their own ---------------------------------------------------------
    pg = Workspace(tmp_path / "laptop", store=pg_url)
    jobs = _submit_batch(pg, tmp_path)
    assert jobs == sq_jobs
    killed, frozen = jobs["openai"]
    # each two-movement job: the first movement's call, then the second's, held: the holder is cut mid-movement
    # there; each is resumed later by another worker, which asks the second call again
    server.play(SECOND, hold(DONE), SECOND, hold(DONE), DONE, DONE)
    procs: list[subprocess.Popen[str]] = []
    try:
        # w1 names another host in its claims, so only the lease (not the same-host pid check) brings its job back
        w1 = _worker(pg_url, tmp_path / "w1", server, "--concurrency", "1", AGENTNB_HOST="elsewhere-1")
        procs.append(w1)
        wait_for("w1's held call", server.holding.is_set, [w1])
        assert pg.store.job(killed).claimed_by.startswith("elsewhere-1:")
        # w2 starts while w1 still renews its lease, so it takes the next job (not w1's, had its lease run out
        # during a slow start); w1 is killed once w2's call is held too
        server.holding.clear()
        w2 = _worker(pg_url, tmp_path / "w2", server, "--concurrency", "1")
        procs.append(w2)
        wait_for("w2's held call", server.holding.is_set, [w2])
        assert pg.store.job(frozen).claimed_by.split(":")[1] == str(w2.pid)
        w1.send_signal(signal.SIGKILL)
        w1.wait()
        freeze(w2, pg_url, frozen)
        # both leases run out (on the server's clock); then the other workers take everything
        wait_for("both leases to expire", lambda: _sql(
            pg_url, "SELECT count(*) FROM jobs WHERE status='running' AND lease_until < extract(epoch FROM now())"
        ) == [(2,)], [w2])
        w3 = _worker(pg_url, tmp_path / "w3", server, "--concurrency", "3")
        w4 = _worker(pg_url, tmp_path / "w4", server, "--concurrency", "2")
        procs += [w3, w4]
        outs = {}
        for w in (w3, w4):
            out, err = w.communicate(timeout=120)
            assert w.returncode == 0, err
            assert "Traceback" not in err, err
            outs[w.pid] = out
        done_events = {j: [e.id for e in pg.store.events(j)] for ids in jobs.values() for j in ids}
        # the frozen worker's call is answered now, and it comes back: it must write nothing for its lost job
        server.release()
        w2.send_signal(signal.SIGCONT)
        _, err2 = w2.communicate(timeout=120)
    finally:
        reap(procs)
    assert w2.returncode == 0, err2
    assert f"job {frozen}: lease lost to another worker; stopping" in err2
    assert "Traceback" not in err2
    assert {j: [e.id for e in pg.store.events(j)] for ids in jobs.values() for j in ids} == done_events

    every = sorted(jobs["openai"] + jobs["files"] + jobs["demo"])
    # -- status and claims ----------------------------------------------------------------------------------------
    for j in every:
        assert pg.job(j).status == sq.job(j).status == "succeeded", (j, pg.job(j).error)
        row = pg.store.job(j)
        assert row.lease_until is None
        recovered = j in (killed, frozen)
        # one claim (gen 1, ended: 2) for a job run once; a take-back and a second claim for a recovered one
        assert row.lease_gen == (3 if recovered else 1), row
        expected = [("queued", "submitted"), ("running", "claimed")]
        if recovered:
            expected += [("queued", LEASE_EXPIRED), ("running", "claimed")]
        assert _statuses(pg, j)[:-1] == expected, j
        assert _statuses(pg, j)[-1] == _statuses(sq, j)[-1]
    ran = [int(x) for out in outs.values() for x in re.search(r"^ran \d+ job\(s\):?([\d ]*)$", out, re.M)
           .group(1).split()]  # type: ignore[union-attr]
    assert sorted(ran) == every, outs  # w3 and w4 between them ran every job to its end, each once
    # -- events -----------------------------------------------------------------------------------------------------
    sq_roots = (str(sq.root),)
    pg_roots = (*(str(tmp_path / w / "ws") for w in ("w1", "w2", "w3", "w4")), str(pg.root))
    for j in every:
        on_pg, on_sq = _events(pg, j, pg_roots), _events(sq, j, sq_roots)
        if j in (killed, frozen):
            on_pg = _without_recovery(on_pg)
        assert on_pg == on_sq, f"job {j}"
    for j in (killed, frozen):
        assert len(pg.events(j, kinds=["llm_response"])) == len(sq.events(j, kinds=["llm_response"])) == 2
    # -- files ------------------------------------------------------------------------------------------------------
    for j in jobs["files"]:
        assert _files(pg, j) == _files(sq, j), j
        a, b = pg.pull(j, tmp_path / "pulled-pg" / str(j)), sq.pull(j, tmp_path / "pulled-sq" / str(j))
        assert [p.relative_to(tmp_path / "pulled-pg" / str(j)) for p in a] == \
            [p.relative_to(tmp_path / "pulled-sq" / str(j)) for p in b]
        assert [_content(x) for x in a] == [_content(y) for y in b]
        assert (tmp_path / "pulled-pg" / str(j) / "output" / "data" / "table.csv").is_file()
    # -- frames -----------------------------------------------------------------------------------------------------
    on_pg_frames, on_sq_frames = _frames(pg, pg_roots), _frames(sq, sq_roots)
    for name, frame in on_sq_frames.items():
        pd.testing.assert_frame_equal(on_pg_frames[name], frame, obj=f"frames.{name}()")
    pg.close()
    sq.close()


# -- bad inputs, against a real server, through the CLI ----------------------------------------------------------

def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTNB_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "agentnb.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


def _refused(done: subprocess.CompletedProcess[str], *secrets: str) -> str:
    """The one line a refused command printed (and nothing else), without any password."""
    assert done.returncode not in (0, None), done
    assert "Traceback" not in done.stderr and done.stdout == "", done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for secret in secrets:
        assert secret not in done.stderr, done.stderr
    return lines[0]


def _snapshot(url: str) -> list[Any]:
    tables = [t for (t,) in _sql(url, "SELECT tablename FROM pg_tables WHERE schemaname='public' ORDER BY 1")]
    return [(t, _sql(url, f"SELECT count(*) FROM {t}")) for t in tables] + \
        [_sql(url, "SELECT version FROM agentnb_schema")] if "agentnb_schema" in tables else tables


@needs_pg
def test_bad_stores_through_the_cli_are_one_line_and_leave_the_server_as_it_was(
        pg: Any, pg_url: str, tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws", store=pg_url)
    ws.submit("kept", piece="single", model="demo")
    ws.close()
    before = _snapshot(pg_url)
    db = pg_url.rsplit("/", 1)[1]
    wrong = "not-the-Pa55word"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    port = _sql(pg_url, "SELECT current_setting('port')")[0][0]

    line = _refused(_cli(cwd, "run", "x", "--detach", "--store", pg.url(db, password=wrong)), wrong, pg.password)
    assert "refused the password" in line, line
    line = _refused(_cli(cwd, "worker", "--store", pg.url(db, password=wrong)), wrong, pg.password)
    assert "refused the password" in line, line
    dead = f"postgresql://agentnb:pw-xyz@127.0.0.1:{int(port) + 1}/agentnb"
    assert "cannot reach the PostgreSQL server" in _refused(_cli(cwd, "jobs", "--store", dead), "pw-xyz")
    assert "'mysql'" in _refused(_cli(cwd, "run", "x", "--store", "mysql://u:pw-abc@h/db"), "pw-abc")
    assert sorted(p.name for p in cwd.iterdir()) == []  # no workspace folder made for a store that failed

    # store copy into a non-empty store (the server's own), from a SQLite workspace with a job
    src = Workspace(tmp_path / "src", store=f"sqlite:///{tmp_path / 'src' / 'agentnb.sqlite'}")  # whatever the pass
    src.submit("copied?", piece="single", model="demo")
    src.close()
    line = _refused(_cli(cwd, "store", "copy", str(tmp_path / "src"), pg_url), pg.password)
    assert "not empty" in line or "non-empty" in line or "refus" in line, line
    assert _snapshot(pg_url) == before

    # a newer schema: refused by every kind of command, left at its version
    _sql(pg_url, "UPDATE agentnb_schema SET version = 99")
    newer = _snapshot(pg_url)
    for args in (["jobs"], ["run", "x", "--detach"], ["worker"]):
        line = _refused(_cli(cwd, *args, "--store", pg_url), pg.password)
        assert "schema version 99" in line, line
    assert _snapshot(pg_url) == newer
    assert sorted(p.name for p in cwd.iterdir()) == []


# -- an idle worker's LISTEN connection through a server restart --------------------------------------------------

def _listening(url: str) -> int:
    return int(_sql(url, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                         "AND query = 'LISTEN agentnb_jobs'")[0][0])


@needs_pg
def test_an_idle_worker_listens_again_after_its_connections_are_cut(pg_url: str, tmp_path: Path,
                                                                    server: OpenAIServer) -> None:
    """Every connection of the database ended by the server (as a restart does): the worker, polling only once
    an hour, is still woken by the NOTIFY of a job queued after it listened again, and runs it."""
    ws = Workspace(tmp_path / "laptop", store=pg_url)
    quick = write_piece(tmp_path, "quick", QUICK)
    proc = _worker(pg_url, tmp_path / "w", server, "--forever", "--poll", "3600")
    try:
        wait_for("the worker to listen", lambda: _listening(pg_url) == 1, [proc])
        first = ws.submit("before", piece=quick, model="demo")
        wait_for("the first job", lambda: ws.job(first).status == "succeeded", [proc])
        cut = _sql(pg_url, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                           "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        assert cut[0][0] >= 1
        wait_for("the worker to listen again", lambda: _listening(pg_url) == 1, [proc])
        second = ws.submit("after", piece=quick, model="demo")
        wait_for("the second job", lambda: ws.job(second).status == "succeeded", [proc])
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert "Traceback" not in err, err
    assert re.search(rf"^ran 2 job\(s\): {first.id} {second.id}$", out, re.M), out
    ws.close()


def _just_claimed(url: str) -> bool:
    """Whether a worker's pooled connection (not its LISTEN one) ended a query less than 0.3 s ago."""
    return bool(_sql(url, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                          "AND pid <> pg_backend_pid() AND query <> 'LISTEN agentnb_jobs' AND state = 'idle' "
                          "AND clock_timestamp() - state_change < interval '300 milliseconds'")[0][0])


def _one_job_then_sigterm(ws: Workspace, piece: Path, proc: subprocess.Popen[str],
                          limit: float = 60.0) -> tuple[int, str, str]:
    """Submit a job, wait until ``proc`` (a worker, after the server's restarts) has run it, stop the worker: the
    job's id and the worker's stdout and stderr."""
    job = ws.submit("after the restarts", piece=str(piece), model="demo")
    wait_for("the job after the restarts", lambda: ws.job(job).status == "succeeded", [proc], limit=limit)
    ws.close()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return job.id, out, err


@needs_pg
def test_a_worker_through_a_server_restart_says_so_in_one_line_each_way(tmp_path: Path,
                                                                        server: OpenAIServer) -> None:
    """The pool's failed reconnection attempts were each a two-line libpq trace on the worker's stderr: now one
    line when the store goes, one when it is back, and the worker goes on with the next job."""
    quick = write_piece(tmp_path, "quick", QUICK)
    with own_pg_server() as own:  # a cluster of this test's own: it is stopped and started again
        url = own.create_database()
        Workspace(tmp_path / "laptop", store=url).close()
        proc = _worker(url, tmp_path / "w", server, "--forever", "--poll", "1")
        try:
            wait_for("the worker to listen", lambda: _listening(url) == 1, [proc])
            # stopped right after a claim, so that exactly one outage is seen (a claim cut off mid-way is
            # test_an_idle_forever_worker_rides_out_restarts_at_any_moment's)
            wait_for("a claim just made", lambda: _just_claimed(url), [proc])
            own.stop()
            time.sleep(2)  # the worker claims every second: its pool tries to reconnect (and fails) meanwhile
            own.start()
            _, _, err = _one_job_then_sigterm(Workspace(tmp_path / "laptop", store=url), quick, proc)
        finally:
            reap([proc])
    assert proc.returncode == 143, err
    assert [ln for ln in err.splitlines() if "store" in ln] == [UNREACHABLE, REACHABLE], err
    assert "error connecting" not in err and "Traceback" not in err and "Is the server running" not in err, err


@needs_pg
def test_an_outage_is_told_from_a_setup_no_wait_mends() -> None:
    """What a worker waits out (a server refusing connections, shutting down under a connection) and what ends
    it (a refused password, a missing database), told from the errors psycopg raises for each."""
    import psycopg
    from psycopg_pool import PoolClosed

    from agentnb.store.pg_outage import is_outage

    def error(call: Callable[[], object]) -> BaseException:
        with pytest.raises(psycopg.Error) as got:
            call()
        return got.value

    with own_pg_server() as own:
        url = own.create_database()
        assert not is_outage(error(lambda: psycopg.connect(own.url(url.rsplit("/", 1)[1], password="wrong"))))
        assert not is_outage(error(lambda: psycopg.connect(own.url("no_such_db"))))
        conn = psycopg.connect(url, autocommit=True)
        own.stop()
        assert is_outage(error(lambda: conn.execute("SELECT 1")))  # terminating connection (57P01)
        assert is_outage(error(lambda: conn.execute("SELECT 1")))  # the connection is closed
        assert is_outage(error(lambda: psycopg.connect(url, connect_timeout=2)))  # connection refused
        own.start()
    assert not is_outage(PoolClosed("the pool 'agentnb' is already closed"))


def _lock_waiters(url: str) -> int:
    return int(_sql(url, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                         "AND wait_event_type = 'Lock'")[0][0])


def _stop_inside_a_transaction(own: OwnPgServer, url: str, table: str, proc: subprocess.Popen[str],
                               then: Callable[[], None] = lambda: None) -> None:
    """Stop the server while a transaction of the worker's waits for ``table``, which this test holds locked
    (and then calls ``then``, to set off that transaction): the shutdown cuts that transaction off mid-way.  An
    immediate one: in a fast shutdown the lock holder's session may end first, and the waiting transaction then
    commits before its own session's end comes (seen on a loaded machine)."""
    import psycopg

    conn = psycopg.connect(url)
    try:
        conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        then()
        wait_for(f"a transaction of the worker's waiting for {table}", lambda: _lock_waiters(url) >= 1, [proc])
        own.stop("immediate")
    finally:
        conn.close()  # ended by the server


def _restart_at_moments(own: OwnPgServer, url: str, proc: subprocess.Popen[str], seed: int) -> None:
    """Stop the server and start it again at five moments of an idle worker's loop: inside a claim's
    transaction (its recovery of expired leases, held up by a lock), at once after the previous start (the pool
    reconnecting, the LISTEN connection cut), and after a short delay picked by ``seed``."""
    rng = random.Random(seed)
    for moment in ("claim", "now", "delay", "claim", "delay"):
        if moment == "claim":
            _stop_inside_a_transaction(own, url, "jobs", proc)
        else:
            time.sleep(rng.uniform(0.0, 0.3) if moment == "delay" else 0.0)
            own.stop()
        time.sleep(rng.uniform(0.0, 0.5))
        own.start()
        assert proc.poll() is None, proc.communicate()


@needs_pg
@pytest.mark.parametrize("slots", [1, 2])
def test_an_idle_forever_worker_rides_out_restarts_at_any_moment(tmp_path: Path, server: OpenAIServer,
                                                                 slots: int) -> None:
    """A server stopped in the middle of a claim ended a --forever worker with exit 2: now it waits for the
    server through every restart, says only the outage lines, and runs the next job."""
    quick = write_piece(tmp_path, "quick", QUICK)
    with own_pg_server() as own:
        url = own.create_database()
        Workspace(tmp_path / "laptop", store=url).close()
        # claims every 0.05 s: whatever the moment, the worker is in a claim, in its wait, or reconnecting
        proc = _worker(url, tmp_path / "w", server, "--forever", "--poll", "0.05", "--concurrency", str(slots))
        try:
            wait_for("the worker to listen", lambda: _listening(url) == 1, [proc])
            _restart_at_moments(own, url, proc, seed=slots)
            job_id, out, err = _one_job_then_sigterm(Workspace(tmp_path / "laptop", store=url), quick, proc, limit=30)
        finally:
            reap([proc])
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "error" not in err, err
    lines = [ln for ln in err.splitlines() if "store" in ln]
    assert lines and lines == [UNREACHABLE, REACHABLE] * (len(lines) // 2), err
    assert re.search(rf"^ran 1 job\(s\): {job_id}$", out, re.M), out


@needs_pg
def test_a_job_cut_off_mid_write_by_a_restart_goes_on_instead_of_failing(tmp_path: Path,
                                                                         server: OpenAIServer) -> None:
    """A running job whose write the server's shutdown cut off was marked failed (the engine took the lost
    connection for its own error): now its worker gives it back to the queue once the server is back, and it
    goes on from its last commit, asking the call whose answer was lost again."""
    two = write_piece(tmp_path, "piece", TWO_STEPS)
    server.play(SECOND, hold(DONE), DONE)
    with own_pg_server() as own:
        url = own.create_database()
        ws = Workspace(tmp_path / "laptop", store=url)
        job = ws.submit("cut off", piece=two, model="openai:gpt-4o-mini").id
        ws.close()
        # a lease longer than the outage can last on a loaded machine (a crash's recovery at the start): past its lease
        # a holder stops writing for the job, which then comes back at the lease's end (not what this test is about)
        proc = _worker(url, tmp_path / "w", server, "--forever", "--poll", "0.2", "--lease", "15")
        try:
            wait_for("the second movement's call", server.holding.is_set, [proc])
            # its answer is written while this test holds the events table
            _stop_inside_a_transaction(own, url, "events", proc, then=server.release)
            time.sleep(0.5)
            own.start()
            ws = Workspace(tmp_path / "laptop", store=url)
            wait_for("the job to end", lambda: ws.job(job).status in TERMINAL_STATES, [proc], limit=30)
            statuses = [(e.status, e.reason) for e in ws.store.events(job, kinds=["job_status"])]
            final = ws.store.job(job)
            ws.close()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            reap([proc])
    assert final.status == "succeeded", (final.error, statuses, err)
    assert "failed" not in [s for s, _ in statuses], statuses
    assert ("queued", UNREACHABLE_REASON) in statuses, statuses
    assert "Traceback" not in err and "error" not in err, err
    assert len(server.received) == 3  # the lost answer's call asked once more, nothing else repeated


# -- a batch made in a notebook, run by workers, scored back in the notebook --------------------------------------

@needs_pg
def test_a_batch_queued_on_postgresql_and_run_by_workers_reads_as_on_sqlite(
        pg_url: str, tmp_path: Path, server: OpenAIServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTNB_STORE", raising=False)
    quick = write_piece(tmp_path, "quick", QUICK)
    model = write_script(tmp_path, "files", responses=[
        call("Read", path="input/case.md"),
        call("Write", path="output/report.md", content="# Report\n"),
        transition("COMPLETE", "reported"),
    ])
    cases = [{"instruction": f"Case {n}", "inputs": {"case.md": f"case {n}"}, "expected": n} for n in range(4)]

    def scored(ws: Workspace) -> pd.DataFrame:
        b = ws.batch("exp").score({"wrote": lambda job: bool(ws.files(job, under="output")["path"].tolist())})
        frame = b.frame.drop(columns=[c for c in b.frame.columns if c in _VOLATILE | {"job"}])
        return frame.map(lambda v: _norm(v, ()))

    sq = Workspace(tmp_path / "sq")
    sq.batch(cases, piece=["single", str(quick)], model=[model, "demo"], name="exp", concurrency=1, progress=False)
    on_sq = scored(sq)

    pg = Workspace(tmp_path / "laptop", store=pg_url)
    b = pg.batch(cases, piece=["single", str(quick)], model=[model, "demo"], name="exp", run=False, progress=False)
    assert b.counts()["queued"] == 16, b.counts()
    procs = [_worker(pg_url, tmp_path / f"w{n}", server, "--concurrency", "2") for n in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "Traceback" not in err, err
    on_pg = scored(pg)
    pd.testing.assert_frame_equal(on_pg, on_sq)
    # the scripted variant on "single" wrote its report, in a worker's folder; the notebook scored it from the store
    assert on_pg.loc[on_pg["variant"] == 0, "wrote"].tolist() == [True] * 4
    for job in pg.batch("exp").jobs:
        assert _files(pg, job.id) == _files(sq, job.id), job.id
    pg.close()
    sq.close()


# -- a file written before a holder was killed mid-movement ------------------------------------------------------

WRITE = reply(tool_calls=[("Write", {"path": "output/a.txt", "content": "written before the kill\n"})])


@needs_pg
def test_a_file_written_before_the_holder_died_mid_movement_is_in_the_job_s_files(
        pg_url: str, tmp_path: Path, server: OpenAIServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The killed worker wrote output/a.txt, then was cut off in the same movement's next call: the resumed run
    does not write it again (its tool_result is in the events and is not re-run), so the file must come from the
    store, as on SQLite it stays in the one work directory."""
    ws = Workspace(tmp_path / "laptop", store=pg_url)
    job = ws.submit("Do the thing.", piece=write_piece(tmp_path, "piece", TWO_STEPS), model="openai:gpt-4o-mini")
    server.play(WRITE, hold(SECOND), SECOND, DONE)
    w1 = _worker(pg_url, tmp_path / "w1", server, AGENTNB_HOST="elsewhere-1")
    try:
        wait_for("w1's held call", server.holding.is_set, [w1])
        assert (tmp_path / "w1" / "ws" / "jobs" / str(job.id) / "output" / "a.txt").is_file()
        w1.send_signal(signal.SIGKILL)
        w1.wait()
    finally:
        if w1.poll() is None:
            w1.kill()
            w1.wait()
    server.release()
    w2 = _worker(pg_url, tmp_path / "w2", server, "--forever", "--poll", "0.2", "--max-jobs", "1")
    _, err = w2.communicate(timeout=120)
    assert w2.returncode == 0, err
    assert ws.job(job).status == "succeeded", ws.job(job).error
    assert [e.payload["status"] for e in ws.events(job, kinds=["job_status"])][:3] == ["queued", "running", "queued"]
    assert list(ws.files(job, under="output")["path"]) == ["output/a.txt"]
    ws.close()
