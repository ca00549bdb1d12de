"""Leases and fencing (docs/stores.md#leases) on both backends: a claim leases its job, its holder renews the lease, a
job whose lease ran out goes back to the queue (``recovered: lease expired``) and resumes from its events, and a
holder that lost its lease writes nothing more for the job (SIGKILL and SIGSTOP of real worker processes, each in a
scratch folder of its own, sharing only the store).

A holder that lost its lease stops at once: before each LLM call and each tool call — between the tool calls of one
response too — the running job checks the lease it holds, and stops as a refused write does (``job N: lease lost to
another worker; stopping``, not failed, nothing written).  A lease is lost when another claimer took it, or when the
store did not answer for a whole lease (a SQLite file locked by someone else, a PostgreSQL server behind a network
partition): tools leaving marks outside the store show what ran."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit, urlunsplit

import pytest
from _freeze import finish, freeze, reap
from _partition import relay
from _scripting import TWO_STEPS, call, transition, write_piece, write_script
from _tool_worker import lease_gate, lease_mark  # noqa: F401 (the tools, also defined in this process)
from _waiting import wait_for
from openai_server import OpenAIServer, hold, openai_env, reply

import agentnb
from agentnb import Workspace
from agentnb.errors import UsageError
from agentnb.leases import check_lease, holding
from agentnb.store import open_store, reads
from agentnb.store.base import DEFAULT_LEASE, LEASE_EXPIRED, LeaseLost

ROOT = Path(__file__).resolve().parent.parent
needs_pg = pytest.mark.needs("postgres", "psycopg")



def _counts(ws: Workspace, job_id: int) -> dict[str, Any]:
    s = ws.store
    return {"events": len(s.events(job_id)), "movements": reads.movements(s, job_id), "comments": reads.count_comments(s, job_id),
            "jobs": s.job_ids(), "job": {k: v for k, v in s.job(job_id).to_dict().items() if k != "lease_until"},
            "batch": reads.batch(s, "b")}


_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}(:\d{2}(\.\d+)?)?( ?UTC|Z|[+-]\d{2}:?\d{2})?")
_JOB_PATH = re.compile(r"jobs/\d+")
_CALL_ID = re.compile(r"\bcall_\d+_")  # the loopback server numbers its answers' tool calls by request


def _norm(value: Any) -> Any:
    if isinstance(value, str):
        return _CALL_ID.sub("call_N_", _JOB_PATH.sub("jobs/N", _TIME.sub("TIME", value)))
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items() if k not in ("latency_s", "ttft_s", "response_id")}
    if isinstance(value, list):
        return [_norm(v) for v in value]
    return value


def _trace(ws: Workspace, job_id: int) -> list[tuple[Any, ...]]:
    """The job's events minus times, ids and its claims (job_status events, compared on their own)."""
    return [(e.kind, e.movement_seq, e.iteration, _norm(e.payload)) for e in ws.events(job_id)
            if e.kind != "job_status"]


def _resumed(trace: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``trace`` without the one ``llm_request`` a cut-short call left: it was made, and recorded (durable
    before the call, docs/events.md) while its holder still held the lease; the resumed run asks the same again."""
    cut = [i for i in range(len(trace) - 1) if trace[i][0] == "llm_request" and trace[i] == trace[i + 1]]
    assert len(cut) == 1, trace
    return trace[:cut[0]] + trace[cut[0] + 1:]


def _statuses(ws: Workspace, job_id: int) -> list[tuple[str, str]]:
    out = []
    for e in ws.events(job_id, kinds=["job_status"]):
        reason = str(e.payload["reason"])
        out.append((str(e.payload["status"]), "claimed" if reason.startswith("claimed by ") else reason))
    return out


# -- the setting -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, "soon", "nan", "inf", True])
def test_a_bad_lease_is_one_line_naming_what_is_allowed(bad: Any, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match=r"^lease=.*: the lease must be a number of seconds greater than 0") as exc:
        Workspace(tmp_path / "ws", lease=bad)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "ws").exists()  # refused before anything is made
    monkeypatch.setenv("AGENTNB_LEASE", str(bad))
    with pytest.raises(UsageError, match=r"^AGENTNB_LEASE=.*greater than 0"):
        Workspace(tmp_path / "ws")
    assert not (tmp_path / "ws").exists()


def test_the_lease_setting_comes_from_the_argument_then_the_environment(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    assert Workspace(tmp_path / "a").lease == DEFAULT_LEASE == 30
    monkeypatch.setenv("AGENTNB_LEASE", "7.5")
    ws = Workspace(tmp_path / "b")
    assert ws.lease == ws.store.lease == 7.5
    assert Workspace(tmp_path / "c", lease=3).store.lease == 3
    assert check_lease("2") == 2.0


def test_the_worker_command_refuses_a_bad_lease_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "agentnb.cli", "worker", "--workspace", str(tmp_path / "ws"),
                           "--lease", "-3"], capture_output=True, text=True, timeout=60, env=_env(None))
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "lease" in lines[0] and "greater than 0" in lines[0], proc.stderr
    assert not (tmp_path / "ws").exists()


# -- claims, renewal, fencing ------------------------------------------------------------------------------------

def _job(ws: Workspace, tmp_path: Path) -> int:
    piece = write_piece(tmp_path, "piece", TWO_STEPS)
    model = write_script(tmp_path, "script", responses=[
        call("Write", path="output/a.txt", content="a"), transition("second", "looked"),
        transition("COMPLETE", "finished")])
    return ws.submit("Do the thing.", piece=piece, model=model).id


def test_a_claim_leases_the_job_and_renewal_extends_it(store_url: str, tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws", store=store_url, lease=5)
    job_id = _job(ws, tmp_path)
    assert ws.store.job(job_id).lease_gen == 0 and ws.store.job(job_id).lease_until is None
    before = time.time()
    row = ws.store.claim()
    assert row is not None and row.id == job_id and row.lease_gen == 1
    assert before + 5 - 1 <= row.lease_until <= time.time() + 5 + 1  # PostgreSQL: the server's (same) clock
    assert ws.store.renew_lease(job_id, 1, 100)
    assert ws.store.job(job_id).lease_until >= before + 99
    assert not ws.store.renew_lease(job_id, 0, 100)  # another generation's renewal finds nothing
    # a release (the holder pauses it) ends the lease; the next claim is the next generation
    with ws.store.transaction() as c:
        ws.store.set_status(c, job_id, "queued", reason="paused")
    assert ws.store.job(job_id).lease_until is None
    assert not ws.store.renew_lease(job_id, 1, 100)  # not running: nothing to renew
    assert ws.store.claim(job_id).lease_gen == 2  # type: ignore[union-attr]
    # a claim of a given job takes a lease too (ws.run, ws.step, a batch)
    ws.store.close()


def test_the_holder_renews_its_lease_while_it_runs(store_url: str, tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws", store=store_url, lease=0.6)
    job_id = _job(ws, tmp_path)
    row = ws.store.claim()
    assert row is not None
    first = float(row.lease_until)
    # another store, opened first: on a loaded machine opening one can take longer than the 0.6 s lease
    other = open_store(store_url)
    with holding(ws.store, row) as held:
        # a renewal made more than a lease after the claim (lease_until > claim + 0.6 + 0.7): unrenewed, the
        # lease would have run out by now
        deadline = time.time() + 30
        while ws.store.job(job_id).lease_until <= first + 0.7 and time.time() < deadline:
            time.sleep(0.05)
        renewed = ws.store.job(job_id).lease_until
        # and nobody can take it back while the holder renews it (asked while it still does: after the block
        # nothing renews, and a claim a lease later would rightly take the job back)
        assert other.claim(job_id) is None
    assert renewed > first + 0.7 and not held.lost.is_set()
    other.close()


@needs_pg
def test_on_postgresql_leases_follow_the_server_s_clock_not_the_worker_s(pg_url: str, tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws", store=pg_url, lease=30)
    job_id = _job(ws, tmp_path)
    assert ws.store.claim() is not None
    # a claimer whose clock runs an hour ahead does not take back a lease that has 30 s left
    other = Workspace(tmp_path / "other", store=pg_url, lease=30)
    ahead = time.time() + 3600
    with mock.patch("time.time", return_value=ahead):
        assert other.store.claim(job_id) is None
        assert other.store.renew_lease(job_id, 1, 30)
    assert ws.store.job(job_id).lease_until < ahead
    assert ws.store.job(job_id).status == "running"
    ws.store.close()
    other.store.close()


def test_a_stale_generation_writes_nothing(store_url: str, tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws", store=store_url, lease=5)
    job_id = _job(ws, tmp_path)
    with ws.store.transaction() as c:
        ws.store.create_batch(c, "b", fingerprint="f", cases="[]", variants="[]", options="{}")
    row = ws.store.claim(lease=0.05)
    assert row is not None and row.lease_gen == 1
    time.sleep(0.1)
    # another process (a second store) takes the job back once the lease ran out, and claims it again
    other = Workspace(tmp_path / "other", store=store_url, lease=5)
    taken = other.store.claim()
    assert taken is not None and taken.id == job_id and taken.lease_gen == 3  # recovery + claim
    assert reads.last_status_reason(ws.store, job_id) is not None
    assert [s for s in _statuses(ws, job_id)][-2:] == [("queued", LEASE_EXPIRED), ("running", "claimed")]

    s = ws.store
    before = _counts(ws, job_id)
    from agentnb.events import ErrorEvent

    writes = {
        "append": lambda: s.append([ErrorEvent(job_id=job_id, ts=time.time(), message="late", where="x")]),
        "append in a transaction": lambda: _in_tx(s, lambda c: s.append(
            [ErrorEvent(job_id=job_id, ts=time.time(), message="late", where="x")], c)),
        "status": lambda: _in_tx(s, lambda c: s.set_status(c, job_id, "failed", reason="late", error="late")),
        "job update": lambda: _in_tx(s, lambda c: s.update_job(c, job_id, current_movement="late")),
        "movement": lambda: _in_tx(s, lambda c: s.start_movement(c, job_id, 1, "first")),
        "comment": lambda: _in_tx(s, lambda c: s.add_comment(c, job_id, "agent", "late")),
        "child job": lambda: _in_tx(s, lambda c: s.create_child_job(
            c, job_id, piece="p", piece_yaml="", piece_path=None, model="demo", instruction="x", options="{}")),
        "batch": lambda: _in_tx(s, lambda c: s.update_batch(c, "b", options='{"late": 1}')),
    }
    with s.fenced(job_id, 1):
        for what, write in writes.items():
            with pytest.raises(LeaseLost, match=rf"job {job_id}: lease lost to another worker"):
                write()
            assert _counts(ws, job_id) == before, what
    # the new holder's writes go through, and so do writes of non-holders (a user's comment)
    with other.store.fenced(job_id, 3), other.store.transaction() as c:
        other.store.update_job(c, job_id, current_movement="first")
    with s.transaction() as c:
        s.add_comment(c, job_id, "user", "a user's note")
    assert reads.count_comments(s, job_id) == 1 and s.job(job_id).current_movement == "first"
    ws.store.close()
    other.store.close()


def _in_tx(store: Any, write: Any) -> None:
    with store.transaction() as c:
        write(c)


# -- expiry: the job is taken back and resumes from its events ------------------------------------------------------

def test_an_expired_job_is_taken_back_and_resumes_to_the_same_events(store_url: str, tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws", store=store_url, lease=1)
    straight = _job(ws, tmp_path)
    assert ws.run(straight).status == "succeeded"
    job_id = _job(ws, tmp_path)
    assert ws.step(job_id, unit="call").status == "queued"  # one call done: mid-movement
    assert ws.store.job(job_id).lease_gen == 1  # ws.step's claim took a lease too
    # this holder claims it again and then stops renewing (a crash on another host, say)
    assert ws.store.claim(job_id) is not None
    time.sleep(1.1)
    other = Workspace(tmp_path / "other", store=store_url, lease=1)
    done = other.run(job_id)
    assert done.status == "succeeded", done.error
    assert (LEASE_EXPIRED in [r for _, r in _statuses(other, job_id)])
    assert _trace(other, job_id) == _trace(other, straight)
    assert [m.name for m in reads.movements(other.store, job_id)] == ["first", "second"]
    ws.store.close()
    other.store.close()


# -- worker processes: SIGKILL and SIGSTOP -----------------------------------------------------------------------

def _env(server: OpenAIServer | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTNB_")}
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                "OPENAI_API_KEY": "sk-test", **(openai_env(server) if server is not None else {}), **extra})
    return env


def _worker(store_url: str, folder: Path, server: OpenAIServer, *args: str, **env: str) -> subprocess.Popen[str]:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "agentnb.cli", "worker", "--workspace", str(folder),
                             "--store", store_url, "--lease", "2", *args], cwd=folder, env=_env(server, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)



@pytest.fixture
def server(loopback: Callable[..., OpenAIServer]) -> OpenAIServer:
    return loopback()


SECOND = reply(tool_calls=[("transition", {"next_step": "second", "summary": "looked"})])
DONE = reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "finished"})])


def _openai_jobs(store_url: str, tmp_path: Path, server: OpenAIServer,
                 monkeypatch: pytest.MonkeyPatch) -> tuple[Workspace, int, int]:
    """A straight run of the two-movement job through the loopback server, and a second one, queued."""
    ws = Workspace(tmp_path / "submit", store=store_url)
    piece = write_piece(tmp_path, "piece", TWO_STEPS)
    server.play(SECOND, DONE)
    straight = ws.submit("Do the thing.", piece=piece, model="openai:gpt-4o-mini").id
    assert ws.run(straight).status == "succeeded"
    job_id = ws.submit("Do the thing.", piece=piece, model="openai:gpt-4o-mini").id
    return ws, straight, job_id


def test_a_killed_worker_s_job_is_finished_by_another_after_the_lease(
        store_url: str, tmp_path: Path, server: OpenAIServer, monkeypatch: pytest.MonkeyPatch) -> None:
    ws, straight, job_id = _openai_jobs(store_url, tmp_path, server, monkeypatch)
    # the first worker names another host in its claims: the pid check (a dead process on this host is taken
    # back at once) cannot decide, as on a real second machine, so only the lease brings the job back
    server.play(SECOND, hold(DONE), DONE)
    first = _worker(store_url, tmp_path / "w1", server, AGENTNB_HOST="elsewhere-1")
    try:
        wait_for("the second call", server.holding.is_set, [first])  # mid-movement, mid-call
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        finish(first)
    server.release()
    assert ws.job(job_id).status == "running"
    assert ws.store.job(job_id).claimed_by.startswith("elsewhere-1:")
    second = _worker(store_url, tmp_path / "w2", server, "--forever", "--poll", "0.1", "--max-jobs", "1")
    _, err = finish(second)
    assert second.returncode == 0, err
    job = ws.job(job_id)
    assert job.status == "succeeded", job.error
    assert _statuses(ws, job_id) == [("queued", "submitted"), ("running", "claimed"), ("queued", LEASE_EXPIRED),
                                     ("running", "claimed"), _statuses(ws, straight)[-1]]
    assert _resumed(_trace(ws, job_id)) == _trace(ws, straight)
    assert ws.store.job(job_id).lease_gen == 3 and ws.store.job(job_id).lease_until is None
    ws.store.close()


def test_the_time_a_killed_worker_s_job_sat_running_is_not_running_time(
        store_url: str, tmp_path: Path, server: OpenAIServer) -> None:
    """A batch job whose worker was SIGKILLed mid-call looks ``running`` until its lease runs out; that span is
    nobody's running time: the batch's ``seconds`` and the job view's running time end the killed run at its
    worker's last event."""
    ws = Workspace(tmp_path / "submit", store=store_url)
    b = ws.batch([{"instruction": "Do the thing."}], piece=write_piece(tmp_path, "piece", TWO_STEPS),
                 model="openai:gpt-4o-mini", name="b", run=False, progress=False)
    job_id = b.jobs[0].id
    server.play(SECOND, hold(DONE), DONE)
    first = _worker(store_url, tmp_path / "w1", server, AGENTNB_HOST="elsewhere-1")  # only the lease recovers it
    try:
        wait_for("the second call", server.holding.is_set, [first])
        first.send_signal(signal.SIGKILL)
        first.wait()
        killed = time.time()
    finally:
        finish(first)
    server.release()
    second = _worker(store_url, tmp_path / "w2", server, "--forever", "--poll", "0.1", "--max-jobs", "1")
    _, err = finish(second)
    assert second.returncode == 0 and ws.job(job_id).status == "succeeded", err
    statuses = ws.events(job_id, kinds=["job_status"])
    assert [e.payload["reason"] for e in statuses][2] == LEASE_EXPIRED
    claimed, recovered, ended = statuses[1].ts, statuses[2].ts, statuses[-1].ts
    dead = recovered - killed  # at least most of the 2 s lease: the killed worker renewed it last before then
    assert dead > 0.5
    # the job was running from its first claim to its end, less the dead span (and the moment it was queued)
    bound = ended - claimed - dead
    seconds = float(b.frame["seconds"].iloc[0])
    assert 0 < seconds <= bound, (seconds, bound, dead)
    assert float(b.summary()["p95_seconds"].iloc[0]) == seconds
    from agentnb.views.render import job_stats

    assert job_stats(ws, job_id).running_s == seconds
    ws.store.close()


def test_a_frozen_worker_past_its_lease_writes_nothing_more(
        store_url: str, tmp_path: Path, server: OpenAIServer, monkeypatch: pytest.MonkeyPatch) -> None:
    ws, straight, job_id = _openai_jobs(store_url, tmp_path, server, monkeypatch)
    server.play(SECOND, hold(DONE), DONE)
    first = _worker(store_url, tmp_path / "w1", server)
    second: subprocess.Popen[str] | None = None
    try:
        wait_for("the second call", server.holding.is_set, [first])
        freeze(first, store_url, job_id)
        # it is alive (stopped, not gone): only the lease running out lets the second worker take the job
        second = _worker(store_url, tmp_path / "w2", server, "--forever", "--poll", "0.1", "--max-jobs", "1")
        _, err2 = finish(second)
        assert second.returncode == 0, err2
        assert ws.job(job_id).status == "succeeded"
        after_takeover = ws.store.events(job_id)
        # another job for the frozen worker to go on with once it has given up the lost one
        server.play(SECOND, DONE)
        later = ws.submit("Do the thing.", piece=tmp_path / "piece.yaml", model="openai:gpt-4o-mini").id
        # the frozen worker's call is answered now, and it comes back
        server.release()
        first.send_signal(signal.SIGCONT)
        out1, err1 = finish(first)
    finally:
        reap((first, second))
    assert first.returncode == 0, err1
    assert f"job {job_id}: lease lost to another worker; stopping" in err1
    assert "Traceback" not in err1
    # nothing from the old holder: no event after the takeover's, no duplicate, no extra row
    assert [e.id for e in ws.store.events(job_id)] == [e.id for e in after_takeover]
    assert _resumed(_trace(ws, job_id)) == _trace(ws, straight)
    assert _statuses(ws, job_id) == [("queued", "submitted"), ("running", "claimed"), ("queued", LEASE_EXPIRED),
                                     ("running", "claimed"), _statuses(ws, straight)[-1]]
    assert [m.status for m in reads.movements(ws.store, job_id)] == ["done", "done"]
    assert ws.job(job_id).status == "succeeded"
    # it went on with the next job, whole
    assert ws.job(later).status == "succeeded" and _trace(ws, later) == _trace(ws, straight)
    assert f":{first.pid}:" in str(ws.events(later, kinds=["job_status"])[1].payload["reason"])
    assert "ran 2 job(s)" in out1
    assert len(ws.events(job_id, kinds=["llm_response"])) == len(ws.events(straight, kinds=["llm_response"]))
    ws.store.close()


# -- a holder that lost its lease stops at once ---------------------------------------------------------------

GATED = """\
name: gated
movements:
  - name: work
    instruction: Open the gate, then leave a mark.
    tools: [{tools}]
    rules:
      - {{condition: done, next: COMPLETE}}
"""


@dataclass
class CutStore:
    """A store the holder reaches through ``url`` and the test reads through ``direct``; ``cut()`` makes it stop
    answering the holder (SQLite: another process's exclusive lock; PostgreSQL: a partitioned connection)."""

    url: str
    direct: str
    cut: Callable[[], None]
    heal: Callable[[], None]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=needs_pg)])
def cut_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CutStore]:
    if request.param == "sqlite":
        (tmp_path / "shared").mkdir()
        path = tmp_path / "shared" / "agentnb.sqlite"
        url = f"sqlite:///{path}"
        open_store(url).close()  # made and migrated before anyone locks it
        locker = sqlite3.connect(path, isolation_level=None)
        yield CutStore(url, url, lambda: locker.execute("BEGIN EXCLUSIVE") and None,
                       lambda: locker.in_transaction and locker.execute("ROLLBACK") and None)
        locker.close()
        return
    direct = str(request.getfixturevalue("pg_url"))
    parts = urlsplit(direct)
    with relay(parts.hostname or "127.0.0.1", parts.port or 5432) as r:
        netloc = parts.netloc.rsplit(":", 1)[0] + f":{r.port}"
        yield CutStore(urlunsplit(parts._replace(netloc=netloc)), direct, r.cut, r.heal)


def _until(what: str, done: Callable[[], Any], limit: float = 60) -> Any:
    deadline = time.monotonic() + limit
    while not (got := done()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return got


# -- the lease itself -------------------------------------------------------------------------------------------

def test_a_holder_cut_off_from_its_store_loses_its_lease_once_a_lease_has_gone_by(
        cut_store: CutStore, tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws", store=cut_store.url, lease=1)
    job_id = ws.submit("Go.", piece=write_piece(tmp_path, "piece", GATED.format(tools="LeaseMark")), model="demo").id
    claimed_at = time.monotonic()
    row = ws.store.claim(job_id)
    assert row is not None
    try:
        with holding(ws.store, row) as held:
            cut_store.cut()  # the renewal under way from now on hangs: no answer, no error
            lost = _until("the lease to be given up", lambda: _raises(held.check))
            waited = time.monotonic() - claimed_at
    finally:
        cut_store.heal()
    # never before a whole lease since the last renewal the store confirmed (at the latest, the claim)
    assert waited >= 1
    assert held.lost.is_set()
    assert f"job {job_id}: lease lost (not renewed for" in str(lost) and "did not answer" in str(lost)
    ws.close()


def _raises(check: Callable[[], None]) -> LeaseLost | None:
    try:
        check()
    except LeaseLost as exc:
        return exc
    return None


def test_a_renewer_whose_every_attempt_fails_marks_the_lease_lost_after_one_lease(
        store_url: str, tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws", store=store_url, lease=1)
    job_id = ws.submit("Go.", piece=write_piece(tmp_path, "piece", GATED.format(tools="LeaseMark")), model="demo").id
    claimed_at = time.monotonic()
    row = ws.store.claim(job_id)
    assert row is not None
    with holding(ws.store, row) as held:
        ws.store.close()  # every renewal now fails at once
        # the renewer itself decides, with nobody calling check()
        assert held.lost.wait(60)
        waited = time.monotonic() - claimed_at
    assert waited >= 1
    assert "the store could not be reached" in held.why


# -- a running job -----------------------------------------------------------------------------------------------

def test_a_job_cut_off_from_its_store_while_a_tool_runs_makes_no_further_llm_call(
        cut_store: CutStore, tmp_path: Path, server: OpenAIServer, capsys: pytest.CaptureFixture[str]) -> None:
    opened, started = threading.Event(), threading.Event()

    @agentnb.tool(name="LeaseWait")
    def lease_wait() -> str:
        """Wait for the test."""
        started.set()
        opened.wait(60)
        return "done waiting"

    ws = Workspace(tmp_path / "ws", store=cut_store.url, lease=1)
    job_id = ws.submit("Go.", piece=write_piece(tmp_path, "piece", GATED.format(tools="LeaseWait")),
                       model="openai:gpt-4o-mini").id
    server.play(reply(tool_calls=[("LeaseWait", {})]), DONE)
    ran: list[Any] = []
    runner = threading.Thread(target=lambda: ran.append(ws.run(job_id)), daemon=True)
    runner.start()
    reader = open_store(cut_store.direct)
    err = ""
    try:
        assert started.wait(60)
        cut_store.cut()
        # the lease has run out in the store: another host could claim the job from now on
        _until("the lease to run out", lambda: float(reader.job(job_id).lease_until) < time.time() - 0.05)
        opened.set()

        def stopped() -> bool:
            nonlocal err
            err += capsys.readouterr().err
            return f"job {job_id}: lease lost to another worker; stopping" in err
        _until("the job to stop", stopped)
        assert len(server.received) == 1  # the call that asked for the tool; not the next one
    finally:
        opened.set()
        cut_store.heal()
    runner.join(60)
    assert ran and ran[0].status == "running"  # not failed: the next claim after the lease takes it back
    assert len(server.received) == 1
    assert "Traceback" not in err
    assert not reader.events(job_id, kinds=["error"])
    reader.close()
    ws.close()


def _gated_env(server: OpenAIServer, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTNB_")}
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
                "OPENAI_API_KEY": "sk-test", "OPENAI_BASE_URL": server.base_url, "AGENTNB_OPENAI_BACKOFF": "0.01",
                "LEASE_TEST_LOG": str(tmp_path / "tools.log"), "LEASE_TEST_GATE": str(tmp_path / "gate")})
    return env


def _gated_worker(store_url: str, folder: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "_tool_worker.py"), "worker", "--workspace",
                             str(folder), "--store", store_url, "--lease", "2", *args], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)



def test_a_job_taken_over_while_a_tool_runs_starts_no_further_tool_of_that_response(
        store_url: str, tmp_path: Path, server: OpenAIServer, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _gated_env(server, tmp_path)
    for key in ("LEASE_TEST_LOG", "LEASE_TEST_GATE"):
        monkeypatch.setenv(key, env[key])
    log = Path(env["LEASE_TEST_LOG"])
    ws = Workspace(tmp_path / "submit", store=store_url)
    piece = write_piece(tmp_path, "piece", GATED.format(tools="LeaseGate, LeaseMark"))
    job_id = ws.submit("Go.", piece=piece, model="openai:gpt-4o-mini").id
    # one response asks for both tools: the gate (which waits), then the mark — read-only, so no commit (which
    # the fence would refuse) comes before it: only the lease check keeps a holder that lost the job from it
    server.play(reply(tool_calls=[("LeaseGate", {}), ("LeaseMark", {})]), DONE)
    first = _gated_worker(store_url, tmp_path / "w1", env)
    second: subprocess.Popen[str] | None = None
    try:
        _until("the gate to be called", lambda: log.exists() and log.read_text().startswith("LeaseGate"))
        freeze(first, store_url, job_id)
        # frozen in its tool call past its lease: a second worker takes the job back and finishes it (the
        # gate's call was started, so it is not run again; the mark is run there)
        second = _gated_worker(store_url, tmp_path / "w2", env, "--forever", "--poll", "0.1", "--max-jobs", "1")
        _, err2 = finish(second)
        assert second.returncode == 0, err2
        assert ws.job(job_id).status == "succeeded"
        after_takeover = [e.id for e in ws.store.events(job_id)]
        # the first worker comes back, its gate opens: it must not go on to the mark
        (tmp_path / "gate").touch()
        first.send_signal(signal.SIGCONT)
        out1, err1 = finish(first)
    finally:
        reap((first, second))
    assert first.returncode == 0, err1
    assert f"job {job_id}: lease lost to another worker; stopping" in err1 and "Traceback" not in err1
    assert log.read_text().split("\n") == [f"LeaseGate {first.pid}", f"LeaseMark {second.pid}", ""]
    assert len(server.received) == 2  # the first worker's one call, the second worker's last one
    assert [e.id for e in ws.store.events(job_id)] == after_takeover
    reasons = [str(e.payload["reason"]) for e in ws.events(job_id, kinds=["job_status"])]
    assert [r.split(" by ")[0] for r in reasons[:4]] == ["submitted", "claimed", LEASE_EXPIRED, "claimed"]
    assert f":{first.pid}:" in reasons[1] and f":{second.pid}:" in reasons[3]
    assert "ran 1 job(s)" in out1
    ws.close()
