"""Freezing a worker process (SIGSTOP) at a moment it holds no lock in the store, for the lease tests.

A process frozen inside a write transaction would hold up every other worker, which is not what those tests
are about: they freeze a worker between its writes, as a long pause or a partition that heals does.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path


def holds_a_lock(store_url: str, job_id: int) -> bool:
    """Whether a write of the store's (SQLite: any; PostgreSQL: the job's row) is held by someone else now."""
    if store_url.startswith("sqlite:"):
        import sqlite3

        conn = sqlite3.connect(store_url.removeprefix("sqlite://"), timeout=0.05, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError:
            return True
        finally:
            conn.close()
    import psycopg

    with psycopg.connect(store_url) as pconn:
        try:
            pconn.execute("SELECT 1 FROM jobs WHERE id=%s FOR UPDATE NOWAIT", (job_id,))
            return False
        except psycopg.errors.LockNotAvailable:
            return True
        finally:
            pconn.rollback()


def process_state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rfind(b")") + 2:].split()[0].decode()


def freeze(proc: subprocess.Popen[str], store_url: str, job_id: int) -> None:
    """SIGSTOP ``proc`` at a moment it holds no lock in the store (its renewer writes every lease/3): a process
    frozen inside a write transaction would hold up every other worker, which is not what this test is about."""
    for _ in range(100):
        proc.send_signal(signal.SIGSTOP)
        while process_state(proc.pid) != "T":  # the signal is delivered asynchronously
            time.sleep(0.005)
        if not holds_a_lock(store_url, job_id):
            return
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.01)
    raise AssertionError("the worker always held a lock in the store")


def reap(procs: Iterable[subprocess.Popen[str] | None]) -> None:
    """Kill what is left of ``procs`` after a test, frozen ones included (a SIGSTOPped process takes SIGKILL,
    but is continued first so nothing of it lingers stopped)."""
    for p in procs:
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[str, str]:
    """The output of worker ``proc`` once it ends (killed, frozen or not, if it has not after ``timeout`` s)."""
    try:
        return proc.communicate(timeout=timeout)
    finally:
        reap([proc])
