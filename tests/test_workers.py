"""Workers that run several jobs at once (``agentnb worker --concurrency N``), on PostgreSQL and SQLite.

Real worker processes on a real PostgreSQL server (the ``pg_url`` fixture) or a real SQLite file: jobs are
counted from the store (each claim is a ``job_status`` event ``running``, whose reason names the claiming
process) and compared with what each worker says it ran.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _scripting import QUICK, transition, write_script
from openai_server import OpenAIServer, hold, reply

from agentnb import Workspace
from agentnb.errors import UsageError
from agentnb.store.base import STOP_CUT_REASON
from agentnb.views.status import STOP_REASON

ROOT = Path(__file__).resolve().parents[1]


PG = pytest.mark.needs("postgres", "psycopg")
_CLAIMED_BY = re.compile(r"^claimed by [^:]*:(\d+):")


@pytest.fixture
def submitter(tmp_path: Path) -> Iterator[Callable[[str | None], Workspace]]:
    """Opens the workspace jobs are submitted from (on the given store), and closes its store after the test:
    a PostgreSQL pool left to the garbage collector would be closed from one of its own threads."""
    opened: list[Workspace] = []

    def open_(store: str | None) -> Workspace:
        ws = Workspace(tmp_path / "submitter", store=store)
        opened.append(ws)
        return ws

    yield open_
    for ws in opened:
        ws.store.close()


def _quick_piece(tmp_path: Path) -> str:
    path = tmp_path / "quick.yaml"
    path.write_text(QUICK, encoding="utf-8")
    return str(path)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTNB_STORE", "OPENAI_"))}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env.update(extra)
    return env


def _worker(scratch: Path, store: str | None, *args: str, **env: str) -> subprocess.Popen[str]:
    """``agentnb worker`` in a process of its own, with its own scratch folder."""
    where = ["--store", store] if store else []
    return subprocess.Popen([sys.executable, "-m", "agentnb.cli", "worker", "--workspace", str(scratch), *where,
                             "--list", *args], env=_env(**env), cwd=scratch.parent, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _reported(out: str) -> list[int]:
    """The job ids a worker printed (``ran N job(s): ID …``), checked against its count."""
    match = re.search(r"^ran (\d+) job\(s\)(?:: ([\d ]+))?$", out, re.M)
    assert match, out
    ids = [int(x) for x in (match.group(2) or "").split()]
    assert len(ids) == int(match.group(1)), out
    return ids


def _claims(ws: Workspace, job_ids: list[int]) -> dict[int, list[int]]:
    """Per job, the pids of the processes that claimed it (one ``running`` job_status event per claim)."""
    claims: dict[int, list[int]] = {}
    for job_id in job_ids:
        running = [ev for ev in ws.events(job_id, kinds=["job_status"]) if ev.payload["status"] == "running"]
        pids = []
        for ev in running:
            match = _CLAIMED_BY.match(ev.payload["reason"])
            assert match, ev.payload
            pids.append(int(match.group(1)))
        claims[job_id] = pids
    return claims


def _run_workers(tmp_path: Path, store: str | None, n_workers: int, job_ids: list[int], ws: Workspace,
                 *args: str) -> dict[int, list[int]]:
    """Run ``n_workers`` worker processes to the end of the queue; each one's reported jobs, by pid."""
    procs = [_worker(tmp_path / f"scratch-{n}", store, *args) for n in range(n_workers)]
    reported: dict[int, list[int]] = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err
            assert "Traceback" not in err, err
            reported[proc.pid] = _reported(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return reported


def _check_each_job_ran_once(ws: Workspace, job_ids: list[int], reported: dict[int, list[int]]) -> None:
    every = [j for ids in reported.values() for j in ids]
    assert len(every) == len(set(every)), "a job was run by two workers"
    assert sorted(every) == sorted(job_ids), "a job was lost (or a stranger run)"
    claims = _claims(ws, job_ids)
    twice = {j: pids for j, pids in claims.items() if len(pids) != 1}
    assert not twice, f"jobs claimed other than once: {twice}"
    # what the store says each process claimed is what each process says it ran
    by_pid: dict[int, set[int]] = {}
    for job_id, (pid,) in claims.items():
        by_pid.setdefault(pid, set()).add(job_id)
    assert by_pid == {pid: set(ids) for pid, ids in reported.items() if ids}
    assert Counter(ws.job(j).status.value for j in job_ids) == {"succeeded": len(job_ids)}


# -- many workers, many jobs ----------------------------------------------------------------------------------


@PG
def test_four_workers_at_concurrency_four_share_500_jobs_on_postgresql(tmp_path: Path, pg_url: str,
                                                                       submitter: Any) -> None:
    ws = submitter(pg_url)
    piece = _quick_piece(tmp_path)
    job_ids = [ws.submit(f"task {n}", piece=piece, model="demo").id for n in range(500)]
    started = time.monotonic()
    reported = _run_workers(tmp_path, pg_url, 4, job_ids, ws, "--concurrency", "4")
    elapsed = time.monotonic() - started
    _check_each_job_ran_once(ws, job_ids, reported)
    # for the record (not asserted: the machine is shared): how the jobs spread, and how long it took
    print(f"500 jobs, 4 workers x 4: {elapsed:.1f} s; per worker {sorted(len(v) for v in reported.values())}")


def test_two_workers_at_concurrency_four_share_the_jobs_on_sqlite(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    piece = _quick_piece(tmp_path)
    job_ids = [ws.submit(f"task {n}", piece=piece, model="demo").id for n in range(40)]
    # (AGENTNB_TEST_BACKEND=postgres gives the workspace a database: the workers then use it too)
    reported = _run_workers(tmp_path, ws.store_url or f"sqlite:///{ws.root}", 2, job_ids, ws, "--concurrency", "4")
    _check_each_job_ran_once(ws, job_ids, reported)


def test_a_worker_in_this_process_runs_subtasks_and_their_parent_to_the_end(ws: Workspace, tmp_path: Path) -> None:
    """Without --forever a worker ends only when the queue is empty *and* none of its jobs runs: a parent
    that hands out subtasks queues them while it runs, and the last child to end queues the parent again."""
    child = write_script(tmp_path, "child", {"work": [transition("COMPLETE", summary="part done")]})
    parent = write_script(tmp_path, "parent", {
        "split": [transition("WAIT_SUBTASKS", summary="split", subtasks=[
            {"instruction": f"Part {n}", "piece": "single", "model": child} for n in range(4)])],
        "merge": [transition("COMPLETE", summary="merged")],
        "check": [transition("COMPLETE", summary="checked")],
    })
    jobs = [ws.submit(f"Split {n}", piece="fan-out", model=parent) for n in range(2)]
    worker = ws.worker()
    assert worker.run(concurrency=3) == 2 * (1 + 4 + 1)  # each parent runs twice: before and after its children
    assert [ws.job(j).status.value for j in jobs] == ["succeeded", "succeeded"]
    assert all(c.status.value == "succeeded" for j in jobs for c in ws.children(j))
    assert sorted(Counter(worker.ran).values()) == [1] * 8 + [2] * 2
    assert ws.worker().run(concurrency=3) == 0  # nothing left


@PG
def test_four_workers_end_many_subtasks_at_once_and_each_parent_is_queued_once_on_postgresql(
        tmp_path: Path, pg_url: str, submitter: Any) -> None:
    """Subtasks of one parent end at the same moment in different worker processes and slots: the last to
    end queues the parent exactly once (the decision is made under the job tree's lock), the parent's next
    movement sees every child's result, and no transaction deadlocks (a deadlock fails a job)."""
    ws = submitter(pg_url)
    n_children = 8
    child = write_script(tmp_path, "child", {"work": [transition("COMPLETE", summary="part done")]})
    parent = write_script(tmp_path, "parent", {
        "split": [transition("WAIT_SUBTASKS", summary="split", subtasks=[
            {"instruction": f"Part {n}", "piece": "single", "model": child} for n in range(n_children)])],
        "merge": [transition("COMPLETE", summary="merged")],
        "check": [transition("COMPLETE", summary="checked")],
    })
    parents = [ws.submit(f"Split {n}", piece="fan-out", model=parent).id for n in range(4)]
    procs = [_worker(tmp_path / f"scratch-{n}", pg_url, "--concurrency", "8") for n in range(4)]
    said: list[str] = []  # what each worker printed: shown with any failure below, whichever assertion it is
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            said.append(f"worker {proc.pid} (exit {proc.returncode}): {out.strip()} {err.strip()}")
            assert proc.returncode == 0, err
            assert "Traceback" not in err and "deadlock" not in err.lower(), err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for p in parents:
        children = ws.children(p)
        statuses = ws.events(p, kinds=["job_status"])
        told = "\n".join([f"parent {p}: " + "; ".join(f"{ev.payload['status']} ({ev.payload['reason']})"
                                                      for ev in statuses), *said])
        assert ws.job(p).status.value == "succeeded", told
        assert len(children) == n_children and all(c.status.value == "succeeded" for c in children), told
        assert sum(ev.payload["reason"] == "every subtask has ended" for ev in statuses) == 1, told
        assert len(_claims(ws, [p])[p]) == 2, told  # before its children, and once after them
        assert all(len(pids) == 1 for pids in _claims(ws, [c.id for c in children]).values()), told
        # the movement after the split (run 2) was told every child's result
        merge = next(ev.payload["user"] for ev in ws.events(p, kinds=["movement_start"]) if ev.movement_seq == 2)
        assert all(f"job {c.id} (succeeded)" in merge for c in children), merge


# -- waiting on LISTEN ----------------------------------------------------------------------------------------


def _listening(url: str) -> int:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND query = 'LISTEN agentnb_jobs'").fetchone()
    return int(row[0]) if row else 0


def _until(what: Any, proc: subprocess.Popen[str], limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not what():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


@PG
@pytest.mark.parametrize("concurrency", ["1", "2"])
def test_an_idle_worker_on_listen_starts_a_job_queued_later(tmp_path: Path, pg_url: str, concurrency: str,
                                                            submitter: Any) -> None:
    """--poll 3600: the safety-net wake-up cannot come within the test, so only the NOTIFY of the new job can
    have woken the worker (the test waits for the job to end, it does not time it)."""
    ws = submitter(pg_url)
    piece = _quick_piece(tmp_path)
    proc = _worker(tmp_path / "scratch", pg_url, "--forever", "--concurrency", concurrency, "--poll", "3600")
    try:
        _until(lambda: _listening(pg_url) == 1, proc)
        first = ws.submit("queued while the worker waits", piece=piece, model="demo")
        _until(lambda: ws.job(first).status.value == "succeeded", proc)
        # a second one, after the worker went back to waiting
        second = ws.submit("and another", piece=piece, model="demo")
        _until(lambda: ws.job(second).status.value == "succeeded", proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, err
        assert sorted(_reported(out)) == [first.id, second.id]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@PG
def test_a_job_put_back_in_the_queue_wakes_an_idle_worker(tmp_path: Path, pg_url: str, submitter: Any) -> None:
    """Queued again (here by a reply to a job that asked), not only newly submitted: the NOTIFY is sent by
    set_status as well."""
    ws = submitter(pg_url)
    job = ws.run(ws.submit("ask me", piece="single", model="demo"))  # the demo model asks on this piece
    assert job.status.value == "waiting_human"
    proc = _worker(tmp_path / "scratch", pg_url, "--forever", "--concurrency", "2", "--poll", "3600")
    try:
        _until(lambda: _listening(pg_url) == 1, proc)
        ws.reply(job, "go on")
        _until(lambda: ws.job(job).status.value != "queued" and ws.job(job).status.value != "running", proc)
        proc.send_signal(signal.SIGTERM)
        out, _err = proc.communicate(timeout=60)
        assert _reported(out) == [job.id]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- SIGTERM with several jobs running ------------------------------------------------------------------------


@pytest.fixture
def held_server() -> Iterator[OpenAIServer]:
    """The loopback endpoint, holding every request until the test releases them."""
    with OpenAIServer() as server:
        server.responder = lambda body: hold(reply(tool_calls=[("Glob", {"pattern": "*"})]))
        yield server


def _held_workers_jobs(tmp_path: Path, submitter: Any, store: str | None, server: OpenAIServer, n: int,
                       *args: str, **env: str) -> tuple[Workspace, list[int], subprocess.Popen[str]]:
    ws = submitter(store)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPENAI_API_KEY", "test-key")  # refused at submit without a key
        job_ids = [ws.submit(f"job {k}", piece="single", model="openai:test-model").id for k in range(n)]
    proc = _worker(tmp_path / "scratch", ws.store_url or f"sqlite:///{ws.root}", "--concurrency", str(n), *args,
                   OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY="test-key", AGENTNB_OPENAI_TIMEOUT="300", **env)
    _until(lambda: len(server.received) == n, proc)
    assert [ws.job(j).status.value for j in job_ids] == ["running"] * n
    return ws, job_ids, proc


@pytest.mark.parametrize("backend", [pytest.param("postgres", marks=PG), "sqlite"])
def test_sigterm_gives_every_running_job_back_to_the_queue(tmp_path: Path, held_server: OpenAIServer,
                                                            backend: str, request: pytest.FixtureRequest,
                                                            submitter: Any) -> None:
    """Their calls never answer: after the grace the worker puts them back itself, as a one-job worker does.
    Plain calls: a streamed one is cut off at once, even before its headers (the test below)."""
    store = request.getfixturevalue("pg_url") if backend == "postgres" else None
    ws, job_ids, proc = _held_workers_jobs(tmp_path, submitter, store, held_server, 3, "--grace", "0.2",
                                           AGENTNB_STREAM="0")
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, err
        assert "Traceback" not in err, err
        assert _reported(out) == []  # none of them ran to an end here
        for job_id in job_ids:
            assert ws.job(job_id).status.value == "queued"
            assert ws.store.job(job_id).claimed_by is None
            assert ws.events(job_id, kinds=["job_status"])[-1].payload == {"status": "queued", "reason": "interrupted"}
        # resumable: the interrupted calls are asked again, here answered at once
        held_server.responder = lambda body: reply(tool_calls=[("transition", {"next_step": "COMPLETE",
                                                                               "summary": "done"})])
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OPENAI_BASE_URL", held_server.base_url)
            mp.setenv("OPENAI_API_KEY", "test-key")
            assert ws.worker().run(concurrency=3) == 3
        assert [ws.job(j).status.value for j in job_ids] == ["succeeded"] * 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@PG
@pytest.mark.parametrize("stream", ["0", "1"])
def test_sigterm_lets_running_jobs_pause_after_their_current_call(tmp_path: Path, held_server: OpenAIServer,
                                                                  pg_url: str, submitter: Any, stream: str) -> None:
    """Calls that answer within the grace: each job pauses there, as ws.stop pauses.  A plain call's answer is
    kept; a streamed call is cut off at once instead (docs/models.md#streaming): nothing is made of its partial
    answer, it is recorded as interrupted and asked again on resume."""
    ws, job_ids, proc = _held_workers_jobs(tmp_path, submitter, pg_url, held_server, 3, "--grace", "120",
                                           AGENTNB_STREAM=stream)
    try:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)  # let the signal land before the answers do (either order ends the same way)
        held_server.release()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, err
        assert sorted(_reported(out)) == sorted(job_ids)  # each run returned, paused
        for job_id in job_ids:
            job = ws.job(job_id)
            assert job.status.value == "queued" and ws.store.job(job_id).claimed_by is None
            # the reason says whether the call was cut off (docs/models.md#streaming)
            reason = STOP_REASON if stream == "0" else STOP_CUT_REASON
            assert ws.events(job_id, kinds=["job_status"])[-1].payload["reason"] == reason
            answers = ws.events(job_id, kinds=["llm_response"])
            cut = [e for e in ws.events(job_id, kinds=["error"]) if e.payload["where"] == "interrupted"]
            if stream == "0":
                assert (len(answers), cut) == (1, [])  # the answer was kept
            else:
                assert (answers, len(cut)) == ([], 1)  # cut off at once, recorded as interrupted
        assert len(held_server.received) == 3  # and no further call was made
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-2", "many", "1.5"])
def test_a_bad_concurrency_is_one_line(tmp_path: Path, value: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "agentnb.cli", "worker", "--workspace", str(tmp_path / "ws"),
                           "--concurrency", value], env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "concurrency" in lines[0], proc.stderr
    assert not (tmp_path / "ws").exists()  # refused before the store is opened


@pytest.mark.parametrize("kwargs", [{"concurrency": 0}, {"concurrency": -1}, {"concurrency": "4"},
                                    {"concurrency": True}, {"poll": 0}, {"poll": "soon"}])
def test_worker_run_refuses_bad_settings_in_one_line(ws: Workspace, kwargs: dict[str, Any]) -> None:
    job = ws.submit("never run", piece="single", model="demo")
    with pytest.raises(UsageError) as info:
        ws.worker().run(**kwargs)
    assert "\n" not in str(info.value) and next(iter(kwargs)) in str(info.value)
    assert ws.job(job).status.value == "queued"
