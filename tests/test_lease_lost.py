"""A holder that lost its lease stops at once (docs/stores.md#leases; note17's limit): before each LLM call and each tool
call — between the tool calls of one response too — the running job checks the lease it holds, and stops as a
refused write does (``job N: lease lost to another worker; stopping``, not failed, nothing written).  A lease is
lost when another claimer took it, or when the store did not answer for a whole lease (a SQLite file locked by
someone else, a PostgreSQL server behind a network partition).  Both backends, real worker processes, the
loopback OpenAI server counting the calls and tools leaving marks outside the store."""

from __future__ import annotations

import os
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
from urllib.parse import urlsplit, urlunsplit

import pytest
from _freeze import finish, freeze, reap
from _partition import relay
from _tool_worker import lease_gate, lease_mark  # noqa: F401 (the tools, also defined in this process)
from engine_helpers import write_piece
from openai_server import OpenAIServer, reply

import agentnb
from agentnb import Workspace
from agentnb.leases import holding
from agentnb.store import open_store
from agentnb.store.base import LEASE_EXPIRED, LeaseLost

ROOT = Path(__file__).resolve().parent.parent
needs_pg = pytest.mark.needs("postgres", "psycopg")

GATED = """\
name: gated
movements:
  - name: work
    instruction: Open the gate, then leave a mark.
    tools: [{tools}]
    rules:
      - {{condition: done, next: COMPLETE}}
"""
DONE = reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "finished"})])


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[OpenAIServer]:
    with OpenAIServer() as srv:
        monkeypatch.setenv("OPENAI_BASE_URL", srv.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        yield srv


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


# -- the lease itself ------------------------------------------------------------------------------------------

def test_a_holder_cut_off_from_its_store_loses_its_lease_once_a_lease_has_gone_by(
        cut_store: CutStore, tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws", store=cut_store.url, lease=1)
    job_id = ws.submit("Go.", piece=write_piece(tmp_path, GATED.format(tools="LeaseMark")), model="demo").id
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
    job_id = ws.submit("Go.", piece=write_piece(tmp_path, GATED.format(tools="LeaseMark")), model="demo").id
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
    job_id = ws.submit("Go.", piece=write_piece(tmp_path, GATED.format(tools="LeaseWait")),
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
        _until("the lease to run out", lambda: float(reader.job(job_id)["lease_until"]) < time.time() - 0.05)
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


def _env(server: OpenAIServer, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTNB_")}
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
                "OPENAI_API_KEY": "sk-test", "OPENAI_BASE_URL": server.base_url, "AGENTNB_OPENAI_BACKOFF": "0.01",
                "LEASE_TEST_LOG": str(tmp_path / "tools.log"), "LEASE_TEST_GATE": str(tmp_path / "gate")})
    return env


def _worker(store_url: str, folder: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "_tool_worker.py"), "worker", "--workspace",
                             str(folder), "--store", store_url, "--lease", "2", *args], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)



def test_a_job_taken_over_while_a_tool_runs_starts_no_further_tool_of_that_response(
        store_url: str, tmp_path: Path, server: OpenAIServer, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env(server, tmp_path)
    for key in ("LEASE_TEST_LOG", "LEASE_TEST_GATE"):
        monkeypatch.setenv(key, env[key])
    log = Path(env["LEASE_TEST_LOG"])
    ws = Workspace(tmp_path / "submit", store=store_url)
    piece = write_piece(tmp_path, GATED.format(tools="LeaseGate, LeaseMark"))
    job_id = ws.submit("Go.", piece=piece, model="openai:gpt-4o-mini").id
    # one response asks for both tools: the gate (which waits), then the mark — read-only, so no commit (which
    # the fence would refuse) comes before it: only the lease check keeps a holder that lost the job from it
    server.play(reply(tool_calls=[("LeaseGate", {}), ("LeaseMark", {})]), DONE)
    first = _worker(store_url, tmp_path / "w1", env)
    second: subprocess.Popen[str] | None = None
    try:
        _until("the gate to be called", lambda: log.exists() and log.read_text().startswith("LeaseGate"))
        freeze(first, store_url, job_id)
        # frozen in its tool call past its lease: a second worker takes the job back and finishes it (the
        # gate's call was started, so it is not run again; the mark is run there)
        second = _worker(store_url, tmp_path / "w2", env, "--forever", "--poll", "0.1", "--max-jobs", "1")
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
