"""Leases and fencing (docs/stores.md#leases, issue 17) on both backends: a claim leases its job, its holder renews the
lease, a job whose lease ran out goes back to the queue (``recovered: lease expired``) and resumes from its
events, and a holder that lost its lease writes nothing more for the job (SIGKILL and SIGSTOP of real worker
processes, each in a scratch folder of its own, sharing only the store)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from _freeze import finish, freeze, reap
from _scripting import TWO_STEPS
from _waiting import wait_for
from engine_helpers import call, transition, write_piece, write_script
from openai_server import OpenAIServer, hold, openai_env, reply

from agentnb import Workspace
from agentnb.errors import UsageError
from agentnb.leases import check_lease, holding
from agentnb.store import open_store
from agentnb.store.base import DEFAULT_LEASE, LEASE_EXPIRED, LeaseLost

ROOT = Path(__file__).resolve().parent.parent
needs_pg = pytest.mark.needs("postgres", "psycopg")



@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=needs_pg)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The store the test's workspaces share: a SQLite file (by URL, so folders elsewhere use it) or a fresh
    PostgreSQL database."""
    if request.param == "sqlite":
        (tmp_path / "shared").mkdir()
        return f"sqlite:///{tmp_path / 'shared' / 'agentnb.sqlite'}"
    return str(request.getfixturevalue("pg_url"))


def _counts(ws: Workspace, job_id: int) -> dict[str, Any]:
    s = ws.store
    return {"events": len(s.events(job_id)), "movements": s.movements(job_id), "comments": s.count_comments(job_id),
            "jobs": s.job_ids(), "job": {k: v for k, v in s.job(job_id).items() if k != "lease_until"},
            "batch": s.batch("b")}


_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}(:\d{2}(\.\d+)?)?( ?UTC|Z|[+-]\d{2}:?\d{2})?")
_JOB_PATH = re.compile(r"jobs/\d+")
_CALL_ID = re.compile(r"\bcall_\d+_")  # the loopback server numbers its answers' tool calls by request


def _norm(value: Any) -> Any:
    if isinstance(value, str):
        return _CALL_ID.sub("call_N_", _JOB_PATH.sub("jobs/N", _TIME.sub("TIME", value)))
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items() if k != "latency_s"}
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
    piece = write_piece(tmp_path, TWO_STEPS)
    model = write_script(tmp_path, {"responses": [
        call("Write", path="output/a.txt", content="a"), transition("second", "looked"),
        transition("COMPLETE", "finished")]})
    return ws.submit("Do the thing.", piece=piece, model=model).id


def test_a_claim_leases_the_job_and_renewal_extends_it(store_url: str, tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws", store=store_url, lease=5)
    job_id = _job(ws, tmp_path)
    assert ws.store.job(job_id)["lease_gen"] == 0 and ws.store.job(job_id)["lease_until"] is None
    before = time.time()
    row = ws.store.claim()
    assert row is not None and row["id"] == job_id and row["lease_gen"] == 1
    assert before + 5 - 1 <= row["lease_until"] <= time.time() + 5 + 1  # PostgreSQL: the server's (same) clock
    assert ws.store.renew_lease(job_id, 1, 100)
    assert ws.store.job(job_id)["lease_until"] >= before + 99
    assert not ws.store.renew_lease(job_id, 0, 100)  # another generation's renewal finds nothing
    # a release (the holder pauses it) ends the lease; the next claim is the next generation
    with ws.store.transaction() as c:
        ws.store.set_status(c, job_id, "queued", reason="paused")
    assert ws.store.job(job_id)["lease_until"] is None
    assert not ws.store.renew_lease(job_id, 1, 100)  # not running: nothing to renew
    assert ws.store.claim(job_id)["lease_gen"] == 2  # type: ignore[index]
    # a claim of a given job takes a lease too (ws.run, ws.step, a batch)
    ws.store.close()


def test_the_holder_renews_its_lease_while_it_runs(store_url: str, tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws", store=store_url, lease=0.6)
    job_id = _job(ws, tmp_path)
    row = ws.store.claim()
    assert row is not None
    first = float(row["lease_until"])
    # another store, opened first: on a loaded machine opening one can take longer than the 0.6 s lease
    other = open_store(store_url)
    with holding(ws.store, row) as held:
        # a renewal made more than a lease after the claim (lease_until > claim + 0.6 + 0.7): unrenewed, the
        # lease would have run out by now
        deadline = time.time() + 30
        while ws.store.job(job_id)["lease_until"] <= first + 0.7 and time.time() < deadline:
            time.sleep(0.05)
        renewed = ws.store.job(job_id)["lease_until"]
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
    assert ws.store.job(job_id)["lease_until"] < ahead
    assert ws.store.job(job_id)["status"] == "running"
    ws.store.close()
    other.store.close()


def test_a_stale_generation_writes_nothing(store_url: str, tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws", store=store_url, lease=5)
    job_id = _job(ws, tmp_path)
    with ws.store.transaction() as c:
        ws.store.create_batch(c, "b", fingerprint="f", cases="[]", variants="[]", options="{}")
    row = ws.store.claim(lease=0.05)
    assert row is not None and row["lease_gen"] == 1
    time.sleep(0.1)
    # another process (a second store) takes the job back once the lease ran out, and claims it again
    other = Workspace(tmp_path / "other", store=store_url, lease=5)
    taken = other.store.claim()
    assert taken is not None and taken["id"] == job_id and taken["lease_gen"] == 3  # recovery + claim
    assert ws.store.last_status_reason(job_id) is not None
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
    assert s.count_comments(job_id) == 1 and s.job(job_id)["current_movement"] == "first"
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
    assert ws.store.job(job_id)["lease_gen"] == 1  # ws.step's claim took a lease too
    # this holder claims it again and then stops renewing (a crash on another host, say)
    assert ws.store.claim(job_id) is not None
    time.sleep(1.1)
    other = Workspace(tmp_path / "other", store=store_url, lease=1)
    done = other.run(job_id)
    assert done.status == "succeeded", done.error
    assert (LEASE_EXPIRED in [r for _, r in _statuses(other, job_id)])
    assert _trace(other, job_id) == _trace(other, straight)
    assert [m["name"] for m in other.store.movements(job_id)] == ["first", "second"]
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
    piece = write_piece(tmp_path, TWO_STEPS)
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
    assert ws.store.job(job_id)["claimed_by"].startswith("elsewhere-1:")
    second = _worker(store_url, tmp_path / "w2", server, "--forever", "--poll", "0.1", "--max-jobs", "1")
    _, err = finish(second)
    assert second.returncode == 0, err
    job = ws.job(job_id)
    assert job.status == "succeeded", job.error
    assert _statuses(ws, job_id) == [("queued", "submitted"), ("running", "claimed"), ("queued", LEASE_EXPIRED),
                                     ("running", "claimed"), _statuses(ws, straight)[-1]]
    assert _resumed(_trace(ws, job_id)) == _trace(ws, straight)
    assert ws.store.job(job_id)["lease_gen"] == 3 and ws.store.job(job_id)["lease_until"] is None
    ws.store.close()


def test_the_time_a_killed_worker_s_job_sat_running_is_not_running_time(
        store_url: str, tmp_path: Path, server: OpenAIServer) -> None:
    """A batch job whose worker was SIGKILLed mid-call looks ``running`` until its lease runs out; that span is
    nobody's running time: the batch's ``seconds`` and the job view's running time end the killed run at its
    worker's last event."""
    ws = Workspace(tmp_path / "submit", store=store_url)
    b = ws.batch([{"instruction": "Do the thing."}], piece=write_piece(tmp_path, TWO_STEPS),
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
    assert [m["status"] for m in ws.store.movements(job_id)] == ["done", "done"]
    assert ws.job(job_id).status == "succeeded"
    # it went on with the next job, whole
    assert ws.job(later).status == "succeeded" and _trace(ws, later) == _trace(ws, straight)
    assert f":{first.pid}:" in str(ws.events(later, kinds=["job_status"])[1].payload["reason"])
    assert "ran 2 job(s)" in out1
    assert len(ws.events(job_id, kinds=["llm_response"])) == len(ws.events(straight, kinds=["llm_response"]))
    ws.store.close()
