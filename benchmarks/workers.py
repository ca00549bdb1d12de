"""Worker processes on PostgreSQL against a slow endpoint: does throughput grow with workers? (issue 17)

The loopback OpenAI-protocol endpoint (``tests/openai_server.py``, in this process) answers every call after a
fixed latency (default 0.2 s).  It keeps no state: it counts the tool results in the request and answers
with a ``Glob`` call until there are two, then with ``transition`` to COMPLETE, so every job is 3 LLM calls
of a one-movement piece on ``openai:bench``.  The benchmark

1. throughput: queues the same batch of jobs (default 256) in a fresh PostgreSQL database, then starts 1, 2
   and 4 ``agentnb worker --store URL --concurrency 16`` processes, each with its own scratch folder, and
   waits for them to empty the queue.  It prints jobs/s over the span from the first claim to the last job's
   end (read from the store: ``started``/``ended``; the processes' start-up is left out, and printed apart
   as the wall time), the speed-up over 1 worker, the ideal (workers × concurrency ÷ (3 × latency) jobs/s)
   and the CPU the worker processes used, in cores, against the machine's;
2. per-call overhead: the same workers with latency 0, one worker at concurrency 1, on PostgreSQL and on
   SQLite: seconds per call over the span = what the engine, the HTTP round trip and the store cost per
   call; the difference between the two is the PostgreSQL store's extra cost.

It starts a throw-away PostgreSQL cluster (``tests/_postgres.py``; fsync off there, as for the tests) unless
``AGENTNB_TEST_PG`` names a server (a superuser: it creates a database per run).  It checks that every job
succeeded and was claimed exactly once.

    python benchmarks/workers.py                        # 256 jobs, latency 0.2 s, 1/2/4 workers at 16
    python benchmarks/workers.py --jobs 128 --latency 0.1 --workers 1 2
    python benchmarks/workers.py --markdown             # the tables for benchmarks/README.md
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _postgres import pg_server  # noqa: E402
from openai_server import OpenAIServer, reply  # noqa: E402

from agentnb import Workspace  # noqa: E402

__all__ = ["Run", "main"]

TOOL_CALLS = 2
CALLS_PER_JOB = TOOL_CALLS + 1
PIECE = """\
name: bench
movements:
  - name: work
    instruction: Look around, then finish.
    tools: [Glob]
    rules:
      - {condition: done, next: COMPLETE}
"""


def _answer(body: dict[str, Any]) -> dict[str, Any]:
    done = sum(1 for m in body.get("messages") or [] if isinstance(m, dict) and m.get("role") == "tool")
    if done < TOOL_CALLS:
        return reply(tool_calls=[("Glob", {"pattern": "*"})])
    return reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "done"})])


@dataclass
class Run:
    backend: str
    workers: int
    concurrency: int
    latency: float
    jobs: int
    calls: int
    span: float  # first claim → last end, from the store
    wall: float  # the worker processes' start → their exit
    cpu: float  # user + system seconds of the worker processes, less their start-up's (see _startup_cpu)
    # PostgreSQL: sampled every 20 ms, the mean number of sessions waiting for an advisory lock (the write
    # locks: store-wide, or a job tree's), for a row lock, and running a statement
    lock_waiters: float | None = None
    active: float | None = None
    row_waiters: float | None = None
    # cores busy over the wall time, from /proc (None elsewhere): the whole machine (other users included),
    # the PostgreSQL server's processes, and this process (the endpoint, the sampler)
    machine: float | None = None
    server_cpu: float | None = None
    endpoint_cpu: float | None = None

    @property
    def jobs_per_s(self) -> float:
        return self.jobs / self.span

    @property
    def per_call(self) -> float:
        return self.span / self.calls


def _startup_cpu(store: str, folder: Path) -> float:
    """CPU seconds of a worker process that finds the queue empty: its interpreter start-up and imports,
    taken off each run's CPU so that the CPU columns count the jobs alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTNB_STORE")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "agentnb.cli", "worker", "--store", store, "--workspace", str(folder)],
                   env=env, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _run(store: str, folder: Path, server: OpenAIServer, *, workers: int, concurrency: int, jobs: int,
         backend: str) -> Run:
    folder.mkdir(parents=True)
    startup = _startup_cpu(store, folder / "empty")
    piece = folder / "bench.yaml"
    piece.write_text(PIECE, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTNB_STORE", "OPENAI_"))}
    env.update(OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY="bench-key",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    os.environ["OPENAI_API_KEY"] = "bench-key"  # submit refuses an openai: model without a key
    ws = Workspace(folder / "submitter", store=store)
    ids = [ws.submit(f"job {n}", piece=str(piece), model="openai:bench").id for n in range(jobs)]
    sampler = _LockSampler(store) if backend == "postgresql" else None
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    me = resource.getrusage(resource.RUSAGE_SELF)
    machine = _machine_busy()
    server_before = sampler.server_cpu() if sampler is not None else None
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "agentnb.cli", "worker", "--store", store, "--workspace",
                               str(folder / f"worker-{n}"), "--concurrency", str(concurrency)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in range(workers)]
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"a worker failed ({proc.returncode}): {err.strip() or out.strip()}")
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    me_after = resource.getrusage(resource.RUSAGE_SELF)
    machine_after = _machine_busy()
    server_after = sampler.server_cpu() if sampler is not None else None
    endpoint_cpu = ((me_after.ru_utime - me.ru_utime) + (me_after.ru_stime - me.ru_stime)) / wall
    machine_cores = None if machine is None or machine_after is None else (machine_after - machine) / wall
    server_cores = None if server_before is None or server_after is None else (server_after - server_before) / wall
    waiters, rows_waiting, active = sampler.stop() if sampler is not None else (None, None, None)
    rows = [ws.store.job(j) for j in ids]
    statuses = Counter(r.status.value for r in rows)
    if statuses != {"succeeded": jobs}:
        raise SystemExit(f"not every job succeeded: {dict(statuses)}")
    claims = Counter(ev.job_id for j in ids for ev in ws.events(j, kinds=["job_status"])
                     if ev.payload["status"] == "running")
    if set(claims.values()) != {1}:
        raise SystemExit("a job was claimed more than once")
    calls = sum(len(ws.events(j, kinds=["llm_response"])) for j in ids)
    span = max(float(r.ended) for r in rows) - min(float(r.started) for r in rows)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime) - workers * startup
    ws.store.close()
    return Run(backend, workers, concurrency, server.latency, jobs, calls, span, wall, cpu, waiters, active,
               rows_waiting, machine_cores, server_cores, endpoint_cpu)


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy() -> float | None:
    """CPU seconds the whole machine has spent busy (not idle, not waiting for I/O) since boot, from /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / _TICK


def _proc_cpu(pid: int, *, reaped: bool) -> tuple[int, float]:
    """The parent pid of ``pid`` and its CPU seconds (with its reaped children's when ``reaped``)."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ppid, times = int(fields[1]), [int(x) for x in fields[11:15]]
    return ppid, (sum(times) if reaped else times[0] + times[1]) / _TICK


class _LockSampler:
    """Samples ``pg_stat_activity`` of the run's database in a thread: how many sessions wait for an advisory
    lock (the store's write locks), how many for another lock (a row's) and how many run a statement, on
    average."""

    def __init__(self, url: str) -> None:
        import psycopg

        self._conn = psycopg.connect(url, autocommit=True)
        # the server's main process, when it runs on this machine: the parent of this session's backend
        self._postmaster: int | None = None
        try:
            row = self._conn.execute("SELECT pg_backend_pid()").fetchone()
            self._postmaster = _proc_cpu(int(row[0]), reaped=False)[0] if row else None
        except (OSError, ValueError):
            pass
        self._samples: list[tuple[int, int, int]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        sql = ("SELECT count(*) FILTER (WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'), "
               "count(*) FILTER (WHERE wait_event_type = 'Lock' AND wait_event <> 'advisory'), "
               "count(*) FILTER (WHERE state = 'active') - 1 FROM pg_stat_activity "
               "WHERE datname = current_database()")
        while not self._done.wait(0.02):
            row = self._conn.execute(sql).fetchone()
            if row is not None:
                self._samples.append((int(row[0]), int(row[1]), int(row[2])))

    def server_cpu(self) -> float | None:
        """CPU seconds of the server's processes so far: the main process with the backends it has reaped,
        plus the backends alive now (this sampler's own included)."""
        if self._postmaster is None:
            return None
        try:
            total = _proc_cpu(self._postmaster, reaped=True)[1]
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    try:
                        ppid, cpu = _proc_cpu(int(entry), reaped=False)
                    except (OSError, ValueError, IndexError):
                        continue
                    if ppid == self._postmaster:
                        total += cpu
            return total
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> tuple[float, float, float]:
        self._done.set()
        self._thread.join()
        self._conn.close()
        n = max(1, len(self._samples))
        return tuple(sum(s[i] for s in self._samples) / n for i in range(3))  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=256, help="jobs per throughput run (default 256)")
    p.add_argument("--latency", type=float, default=0.2, help="the endpoint's latency in seconds (default 0.2)")
    p.add_argument("--concurrency", type=int, default=16, help="jobs each worker runs at once (default 16)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="worker counts (default 1 2 4)")
    p.add_argument("--overhead-jobs", type=int, default=100, help="jobs per per-call overhead run (default 100)")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    args = p.parse_args(argv)

    cores = os.cpu_count() or 1
    print(f"{platform.node()}: {cores} cores, Python {platform.python_version()}, "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    throughput: list[Run] = []
    overhead: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="agentnb-workers-bench-") as tmp, pg_server() as pg, \
            OpenAIServer(latency=args.latency, responder=_answer) as server:
        top = Path(tmp)
        for n in args.workers:
            url = pg.create_database()
            try:
                run = _run(url, top / f"pg-{n}", server, workers=n, concurrency=args.concurrency, jobs=args.jobs,
                           backend="postgresql")
            finally:
                pg.drop_database(url)
            throughput.append(run)
            print(f"  {n} worker(s) x {args.concurrency}: {run.jobs_per_s:.1f} jobs/s", flush=True)
        # the same at one worker on SQLite: does the PostgreSQL store cost one worker anything?
        throughput.append(_run(f"sqlite:///{top / 'sqlite-throughput'}", top / "sqlite-throughput", server,
                               workers=1, concurrency=args.concurrency, jobs=args.jobs, backend="sqlite"))
        server.latency = 0.0
        for backend in ("sqlite", "postgresql"):
            url = pg.create_database() if backend == "postgresql" else f"sqlite:///{top / 'sqlite-store'}"
            try:
                overhead.append(_run(url, top / f"overhead-{backend}", server, workers=1, concurrency=1,
                                     jobs=args.overhead_jobs, backend=backend))
            finally:
                if backend == "postgresql":
                    pg.drop_database(url)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    _report(throughput, overhead, args, cores)
    return 0


def _report(throughput: list[Run], overhead: list[Run], args: argparse.Namespace, cores: int) -> None:
    base = throughput[0].jobs_per_s / throughput[0].workers if throughput else 1.0
    head = ["store", "workers × concurrency", "jobs/s", "speed-up vs 1", "ideal jobs/s", "of ideal", "worker CPU (cores)",
            "worker CPU ms per call", "waiting for a write lock / a row lock / running SQL (sessions)",
            "wall s (with start-up)", "machine busy / PostgreSQL / endpoint (cores, over the wall)"]
    rows = []
    for r in throughput:
        ideal = r.workers * r.concurrency / (CALLS_PER_JOB * r.latency)
        rows.append([r.backend, f"{r.workers} × {r.concurrency}", f"{r.jobs_per_s:.1f}", f"{r.jobs_per_s / base:.2f}",
                     f"{ideal:.1f}", f"{r.jobs_per_s / ideal:.0%}", f"{r.cpu / r.span:.2f} of {cores}",
                     f"{1000 * r.cpu / r.calls:.1f}",
                     "—" if r.lock_waiters is None else f"{r.lock_waiters:.2f} / {r.row_waiters:.2f} / {r.active:.2f}",
                     f"{r.wall:.1f}", " / ".join("—" if x is None else f"{x:.2f}"
                                                 for x in (r.machine, r.server_cpu, r.endpoint_cpu))])
    _table(f"{args.jobs} jobs × {CALLS_PER_JOB} calls, endpoint latency {args.latency:g} s", head, rows,
           args.markdown)
    head2 = ["store", "ms per call", "worker CPU ms per call (start-up excluded)", "÷ SQLite"]
    sqlite = next((r for r in overhead if r.backend == "sqlite"), None)
    rows2 = [[r.backend, f"{1000 * r.per_call:.1f}", f"{1000 * r.cpu / r.calls:.1f}",
              f"{r.per_call / sqlite.per_call:.2f}" if sqlite else "—"] for r in overhead]
    _table(f"per call, latency 0, 1 worker × 1, {args.overhead_jobs} jobs × {CALLS_PER_JOB} calls", head2, rows2,
           args.markdown)
    if sqlite and len(overhead) == 2:
        extra = overhead[1].per_call - sqlite.per_call
        print(f"PostgreSQL's extra cost per call over SQLite: {1000 * extra:+.1f} ms")


def _table(title: str, head: list[str], rows: list[list[str]], markdown: bool) -> None:
    print(f"\n{title}")
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---:" if i else "---" for i in range(len(head))) + "|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    sys.exit(main())
