"""What one SQLite file shared by worker processes costs, with no agentnb code running (issue 32's short jobs).

``benchmarks/workers.py --workload short`` asks 2 workers for 1.6× the jobs/s of one.  This script measures how
far the store alone lets that go.  It

1. records the SQL one worker sends for short jobs (the same piece and script as ``workers.py``), with
   ``sqlite3``'s trace callback: every statement with its values, job by job, in the order sent, with the
   ``BEGIN IMMEDIATE`` / ``COMMIT`` of each write transaction;
2. replays it on fresh copies of the queued store, in 1, 2 and 4 processes (process i replays jobs i, i + N, …),
   each with one connection set up as agentnb sets up its own (WAL, ``synchronous=NORMAL``, foreign keys), and
   each write transaction preceded by the store's write turn (an exclusive ``flock`` on ``<store>-lock``,
   docs/stores.md#sqlite-writers);
3. prints, for each process count, the jobs/s of the replay (from the processes' start to the last one's end,
   interpreter start-up excluded: each process waits for a common start time) and the CPU a job's SQL cost.

So the replay is the workload's store work and nothing else: no events built, no prompts, no tools.  With CPU
per job ``c1`` alone and ``cN`` beside N−1 others, N processes on N free cores can run at most N·c1 ÷ cN times
the jobs/s of one; the figure printed is what this machine gives.  Pure Python work (the rest of a job) shares
nothing and scales with the cores (the control printed last: the same loop of dataclasses and JSON in 1 and 2
processes).

    python benchmarks/sqlite_sharing.py                   # 400 jobs, 1/2/4 processes, 3 rounds
    python benchmarks/sqlite_sharing.py --jobs 800 --repeat 5
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

__all__ = ["main"]


def record(folder: Path, jobs: int) -> tuple[Path, list[list[str]]]:
    """Queue ``jobs`` short jobs in a fresh store in ``folder``, copy it (the replays start from the copy), run
    them with one in-process worker and return the copy and each job's statements."""
    from workers import SHORT_PIECE, SHORT_SCRIPT

    from agentnb import Workspace
    from agentnb.worker import Worker

    piece, script = folder / "short.yaml", folder / "script.yaml"
    piece.write_text(SHORT_PIECE, encoding="utf-8")
    script.write_text(SHORT_SCRIPT, encoding="utf-8")
    store = folder / "store.db"
    ws = Workspace(folder / "submitter", store=str(store))
    for n in range(jobs):
        ws.submit(f"note {n}", piece=str(piece), model=f"scripted:{script}")
    ws.store.close()
    queued = folder / "queued.db"
    shutil.copy(store, queued)
    log: list[str] = []
    connect = sqlite3.connect

    def traced(*args: object, **kwargs: object) -> sqlite3.Connection:
        conn = connect(*args, **kwargs)  # type: ignore[arg-type]
        conn.set_trace_callback(log.append)
        return conn

    sqlite3.connect = traced  # type: ignore[assignment]
    try:
        worker = Worker(Workspace(folder / "worker", store=str(store)))
        per_job: list[list[str]] = []
        for _ in range(jobs):
            log.clear()
            if worker.run_once() is None:
                raise SystemExit("the queue ran dry before every job ran")
            per_job.append(list(log))
    finally:
        sqlite3.connect = connect  # type: ignore[assignment]
    return queued, per_job


def replay(store: str, script: str, index: int, step: int, start: float) -> None:
    """Replay every ``step``-th job of ``script`` from the ``index``-th on: one process's part (``--replay``)."""
    jobs = json.loads(Path(script).read_text(encoding="utf-8"))[index::step]
    conn = sqlite3.connect(store, isolation_level=None, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA wal_autocheckpoint=10000")
    conn.execute("PRAGMA foreign_keys=ON")
    turn = os.open(store + "-lock", os.O_RDWR | os.O_CREAT, 0o644)
    while time.time() < start:
        time.sleep(0.001)
    cpu, held, since = time.process_time(), 0.0, 0.0
    for statements in jobs:
        for sql in statements:
            if sql.startswith("BEGIN IMMEDIATE"):
                fcntl.flock(turn, fcntl.LOCK_EX)
                since = time.perf_counter()
                conn.execute(sql)
            elif sql.startswith(("COMMIT", "ROLLBACK")):
                conn.execute(sql)
                held += time.perf_counter() - since
                fcntl.flock(turn, fcntl.LOCK_UN)
            else:
                conn.execute(sql).fetchall()
    print(json.dumps({"cpu": time.process_time() - cpu, "end": time.time(), "jobs": len(jobs), "held": held}))


def _python_control(start: float) -> None:
    """The same pure-Python loop in each process: what the machine gives work that shares nothing (``--control``)."""
    from dataclasses import asdict, dataclass

    @dataclass(frozen=True)
    class Row:
        job_id: int
        kind: str
        payload: dict[str, int]

    while time.time() < start:
        time.sleep(0.001)
    cpu = time.process_time()
    for n in range(200_000):
        json.dumps(asdict(Row(n, "tool_call", {"n": n})))
    print(json.dumps({"cpu": time.process_time() - cpu, "end": time.time(), "jobs": 200_000, "held": 0.0}))


def _run(args: list[str], processes: int, extra: list[list[str]]) -> tuple[float, float, float]:
    """Start ``processes`` children together; (wall seconds from the common start to the last end, CPU seconds,
    seconds the write turn was held)."""
    start = time.time() + 0.5  # past every child's interpreter start-up
    procs = [subprocess.Popen([sys.executable, __file__, *args, *extra[i], "--start", repr(start)],
                              stdout=subprocess.PIPE, text=True) for i in range(processes)]
    outs = [json.loads(p.communicate()[0]) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("a replay process failed")
    return max(o["end"] for o in outs) - start, sum(o["cpu"] for o in outs), sum(o["held"] for o in outs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--replay", nargs=4, metavar=("STORE", "SCRIPT", "INDEX", "STEP"), help=argparse.SUPPRESS)
    ap.add_argument("--control", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.replay:
        store, script, index, step = args.replay
        replay(store, script, int(index), int(step), args.start)
        return 0
    if args.control:
        _python_control(args.start)
        return 0
    top = Path(tempfile.mkdtemp(prefix="agentnb-sharing-"))
    try:
        (top / "recorded").mkdir()
        queued, per_job = record(top / "recorded", args.jobs)
        script = top / "script.json"
        script.write_text(json.dumps(per_job), encoding="utf-8")
        # the first job's statements include the worker's first look at the store; the others are alike
        counts = [len(s) for s in per_job[1:]]
        writes = [sum(1 for q in s if q.startswith("BEGIN IMMEDIATE")) for s in per_job[1:]]
        print(f"{args.jobs} short jobs recorded: {statistics.median(counts):.0f} statements and "
              f"{statistics.median(writes):.0f} write transactions a job (median)")
        print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        results: dict[int, list[tuple[float, float, float]]] = {n: [] for n in args.processes}
        control: dict[int, list[tuple[float, float, float]]] = {1: [], 2: []}
        for r in range(args.repeat):
            for n in args.processes:
                store = top / f"replay-{r}-{n}.db"
                shutil.copy(queued, store)
                results[n].append(_run(["--replay", str(store), str(script)], n,
                                       [[str(i), str(n)] for i in range(n)]))
            for n in control:
                control[n].append(_run(["--control"], n, [[] for _ in range(n)]))
        print(f"\nthe SQL of {args.jobs} short jobs replayed, {args.repeat} round(s), medians")
        print(f"{'processes':>9}  {'jobs/s':>8}  {'÷ 1 process':>11}  {'CPU ms a job':>12}  "
              f"{'write turn held ms a job':>24}  every run's jobs/s")
        base = statistics.median(args.jobs / w for w, _, _ in results[args.processes[0]])
        for n, runs in results.items():
            rate = statistics.median(args.jobs / w for w, _, _ in runs)
            cpu = statistics.median(c / args.jobs * 1000 for _, c, _ in runs)
            held = statistics.median(h / args.jobs * 1000 for _, _, h in runs)
            every = " ".join(f"{args.jobs / w:.0f}" for w, _, _ in runs)
            print(f"{n:>9}  {rate:>8.0f}  {rate / base:>10.2f}×  {cpu:>12.3f}  {held:>24.3f}  {every}")
        one = statistics.median(w for w, _, _ in control[1])
        two = statistics.median(w for w, _, _ in control[2])
        cpu1 = statistics.median(c for _, c, _ in control[1])
        cpu2 = statistics.median(c for _, c, _ in control[2]) / 2
        print(f"\ncontrol, pure Python (no shared file): 2 processes ÷ 1 = {2 * one / two:.2f}× the work a second; "
              f"CPU of one process's share {cpu2 / cpu1:.2f}× alone")
        print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        shutil.rmtree(top, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
