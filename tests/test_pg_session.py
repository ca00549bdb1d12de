"""A worker frozen inside a PostgreSQL transaction cannot stall the others (docs/stores.md#workers): every
store connection asks the server to end a transaction idle for a whole lease
(``idle_in_transaction_session_timeout``) and uses TCP keepalives within a lease (agentnb/store/pg_session.py).
A real process is frozen (SIGSTOP) in the middle of a transaction through the store API; the others go on once
the server has ended it, and the frozen one, thawed, gets one error line and has written nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _freeze import process_state, reap
from _scripting import QUICK, write_piece

from agentnb import Workspace
from agentnb.store import reads

pytestmark = pytest.mark.needs("postgres", "psycopg")
ROOT = Path(__file__).resolve().parent.parent

# the frozen process: opens a write transaction through the store API, writes in it, says so, waits for a line
# on stdin (the test freezes it meanwhile), then writes again and commits
FROZEN = textwrap.dedent("""
    import sys, time
    from agentnb import Workspace
    from agentnb.events import ErrorEvent
    from agentnb.leases import holding

    folder, url, job = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ws = Workspace(folder, store=url, lease=1)
    def write(c, what):
        if sys.argv[4] == "holder":  # for its job
            ws.store.append([ErrorEvent(job_id=job, ts=time.time(), message=what, where="frozen")], c)
        elif what.endswith("freeze"):  # a batch of its own (a job's event would lock the job's row)
            ws.store.create_batch(c, "frozen", fingerprint="f", cases="[]", variants="[]", options="{}")
        else:
            ws.store.update_batch(c, "frozen", options='{"thawed": 1}')
    def frozen_transaction():
        with ws.store.transaction() as c:
            write(c, "written before the freeze")
            print("in", flush=True)
            sys.stdin.readline()
            write(c, "written after the thaw")
    try:
        if sys.argv[4] == "holder":  # the job's lease holder: its transaction holds the job's row too
            with holding(ws.store, ws.store.claim(job)):
                frozen_transaction()
        else:  # any other writer (a submit, a batch, a comment): it holds the store-wide write lock
            frozen_transaction()
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    print("committed", flush=True)
""")


@pytest.fixture
def frozen_writer(pg_url: str, tmp_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen[str]] = []

    def start(job_id: int, role: str) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen([sys.executable, "-c", FROZEN, str(tmp_path / "frozen"), pg_url, str(job_id), role],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == "in\n", (line, proc.stderr.read() if proc.stderr else "")
        # frozen inside its transaction: its locks are held, its connection idle
        proc.send_signal(signal.SIGSTOP)
        while process_state(proc.pid) != "T":
            time.sleep(0.005)
        return proc

    yield start
    reap(procs)


def _thaw(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate("go on\n", timeout=60)
    return proc.returncode, out, err


def _in_thread(work: Any) -> list[Any]:
    """Run ``work`` in a thread and wait for it (generously: without the server's limit it would wait forever)."""
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(work()), daemon=True)
    t.start()
    t.join(60)
    assert got, "still waiting for the frozen process's locks after 60 s"
    return got


def _job(ws: Workspace, tmp_path: Path) -> int:
    return ws.submit("Do the task.", piece=write_piece(tmp_path, "quick", QUICK), model="demo").id


def test_a_writer_frozen_inside_its_transaction_stalls_nobody_past_the_lease(
        pg_url: str, tmp_path: Path, frozen_writer: Any) -> None:
    ws = Workspace(tmp_path / "ws", store=pg_url, lease=1)
    job_id = _job(ws, tmp_path)
    frozen = frozen_writer(job_id, "writer")
    # it holds the store-wide write lock: every write waits for it, until the server ends its transaction
    other = Workspace(tmp_path / "other", store=pg_url, lease=1)
    [done] = _in_thread(lambda: other.run(job_id))
    assert done.status == "succeeded"
    [later] = _in_thread(lambda: other.submit("Another.", piece=tmp_path / "quick.yaml", model="demo"))
    code, said, err = _thaw(frozen)
    assert code == 3, (said, err)
    lines = said.strip().splitlines()  # "in" was read before the freeze
    assert len(lines) == 1 and lines[0].startswith("StoreError: "), (said, err)
    assert "the server ended this process's transaction" in said and "nothing of it was written" in said
    assert "s3cret" not in said + err and "Traceback" not in err
    # neither of its writes is in the store, before the freeze or after
    assert reads.batch(ws.store, "frozen") is None and ws.job(later.id).status == "queued"
    ws.close()
    other.close()


def test_a_holder_frozen_inside_its_transaction_loses_its_job_to_another_worker(
        pg_url: str, tmp_path: Path, frozen_writer: Any) -> None:
    ws = Workspace(tmp_path / "ws", store=pg_url, lease=1)
    job_id = _job(ws, tmp_path)
    frozen = frozen_writer(job_id, "holder")
    # it holds the job's row (a claim passes over a locked row) past its lease: once the server has ended its
    # transaction, another worker's claim takes the job back and runs it
    worker = subprocess.run([sys.executable, "-m", "agentnb.cli", "worker", "--workspace", str(tmp_path / "w2"),
                             "--store", pg_url, "--lease", "1", "--forever", "--poll", "0.1", "--max-jobs", "1"],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                                              os.environ.get("PYTHONPATH", "")])})
    assert worker.returncode == 0, worker.stderr
    assert ws.job(job_id).status == "succeeded"
    code, said, err = _thaw(frozen)
    assert code == 3, (said, err)
    assert said.startswith(f"LeaseLost: job {job_id}: ") and "the server ended this process's transaction" in said
    assert not ws.events(job_id, kinds=["error"])
    ws.close()


def test_the_limits_follow_the_lease_and_leave_the_url_s_own_settings_alone() -> None:
    from agentnb.store.pg_session import session_limits  # needs psycopg: imported by the test that is marked so

    got = session_limits("postgresql://u:pw@db.example:5432/agentnb", 30)
    assert got == {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 3, "keepalives_count": 3,
                   "tcp_user_timeout": 30000, "options": "-c idle_in_transaction_session_timeout=30000"}
    # a short lease still leaves the server a second; the URL's own settings win
    got = session_limits("postgresql://u@h/db?keepalives_idle=60&options=-c%20idle_in_transaction_session_timeout%3D0",
                         0.2)
    assert got["options"] == "-c idle_in_transaction_session_timeout=1000 -c idle_in_transaction_session_timeout=0"
    assert "keepalives_idle" not in got and got["tcp_user_timeout"] == 1000 and got["keepalives_interval"] == 1


def test_every_store_connection_has_them(pg_url: str, tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws", store=pg_url, lease=2.5)
    [row] = ws.store.query("SELECT current_setting('idle_in_transaction_session_timeout') AS t")  # type: ignore[attr-defined]
    assert row["t"] == "2500ms"
    ws.close()
