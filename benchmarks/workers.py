"""Worker processes on one store: does throughput grow with workers?  A slow endpoint (issue 17), short jobs (issue 32).

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

3. short jobs (issue 32, ``--workload short``): 400 small ``scripted:`` jobs (one ``Write``, then ``transition``, each
   response with its usage) queued in a fresh store, SQLite and PostgreSQL, then emptied by 1, 2 and 4
   ``agentnb worker`` processes (one job at a time each), repeated (``--repeat``, medians printed).  Here the
   workers' start-up is *included*: jobs/s = jobs ÷ the wall time from starting the processes to their exit.
   Per process it reads how its main thread spent that time (``/proc/PID/schedstat`` of the exited process): on a
   core, waiting for a core (the machine is full), or off both (blocked: waiting for a store lock, mostly; on
   PostgreSQL also for the server's answers).  On PostgreSQL the sessions waiting for a lock are sampled as for 1.

The workers run with their bytecode compiled, as a pip install has it (``PYTHONPYCACHEPREFIX`` in the run's
temporary folder, filled by a first worker start): with ``PYTHONDONTWRITEBYTECODE=1`` and an editable install each
worker would compile agentnb from source (``--from-source`` measures that).

It starts a throw-away PostgreSQL cluster (``tests/_postgres.py``; fsync off there, as for the tests) unless
``AGENTNB_TEST_PG`` names a server (a superuser: it creates a database per run).  It checks that every job
succeeded and was claimed exactly once.

    python benchmarks/workers.py                        # 256 jobs, latency 0.2 s, 1/2/4 workers at 16
    python benchmarks/workers.py --jobs 128 --latency 0.1 --workers 1 2
    python benchmarks/workers.py --markdown             # the tables for benchmarks/README.md
    python benchmarks/workers.py --workload short --repeat 5   # short jobs only, 5 runs of each
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
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

__all__ = ["Run", "ShortRun", "main"]

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


# the workers' environment: set by main (_worker_env)
_ENV: dict[str, str] = {}


def _worker_env(tmp: Path, *, from_source: bool) -> dict[str, str]:
    """The environment of every worker process: no store or endpoint of the caller's, agentnb from this checkout, and
    its bytecode compiled once into ``tmp`` (unless ``from_source``: then as the caller's environment has it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTNB_STORE", "OPENAI_"))}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    if not from_source:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    return env


def _startup_cpu(store: str, folder: Path) -> float:
    """CPU seconds of a worker process that finds the queue empty: its interpreter start-up and imports,
    taken off each run's CPU so that the CPU columns count the jobs alone."""
    env = dict(_ENV)
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
    env = dict(_ENV, OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY="bench-key")
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
    # the workload is what it says: each job's Write wrote its note (a tool error would be a cheaper job)
    failed = [j for j in ids for ev in ws.events(j, kinds=["tool_result"]) if ev.payload.get("is_error")]
    if failed:
        raise SystemExit(f"a tool call failed in {len(failed)} job(s), e.g. job {failed[0]}")
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


# -- short jobs (issue 32) -------------------------------------------------------------------------------------

SHORT_PIECE = """\
name: short
movements:
  - name: work
    instruction: Write the note, then finish.
    tools: [Write]
    permission: edit
    rules:
      - {condition: done, next: COMPLETE}
"""
# each response reports its usage, as an endpoint does: nothing needs a tokenizer
SHORT_SCRIPT = """\
responses:
  - tool_calls: [{name: Write, arguments: {path: note.txt, content: "a short note"}}]
    usage: {prompt_tokens: 220, completion_tokens: 24}
  - tool_calls: [{name: transition, arguments: {next_step: COMPLETE, summary: written}}]
    usage: {prompt_tokens: 260, completion_tokens: 18}
"""


@dataclass
class ShortRun:
    backend: str
    workers: int
    jobs: int
    wall: float  # the processes' start → the last one's exit
    first_claim: float  # seconds from the start to the first claim (the first process's start-up)
    cpu: list[float]  # user + system seconds of each process
    startup: float  # CPU seconds of one worker that finds the queue empty
    # each process's main thread over its life (/proc/PID/schedstat): on a core, waiting for one, neither
    on_cpu: list[float]
    runqueue: list[float]
    life: list[float]
    ran: list[int]  # jobs each process ran
    lock_waiters: float | None = None  # PostgreSQL: sessions waiting for an advisory / another lock, on average
    row_waiters: float | None = None
    active: float | None = None
    machine: float | None = None  # cores busy over the wall time, the whole machine
    load: float = 0.0  # the 1-minute load average before the run

    @property
    def jobs_per_s(self) -> float:
        return self.jobs / self.wall

    @property
    def blocked(self) -> list[float]:
        return [max(0.0, life - run - wait) for life, run, wait in zip(self.life, self.on_cpu, self.runqueue, strict=True)]

    @property
    def cpu_per_job(self) -> float:
        """CPU seconds per job of the processes together, their start-up taken off."""
        return (sum(self.cpu) - self.workers * self.startup) / self.jobs


def _schedstat(pid: int) -> tuple[float, float]:
    """Seconds the process's main thread has run and waited for a core (0, 0 where /proc has no schedstat)."""
    try:
        with open(f"/proc/{pid}/schedstat", encoding="ascii") as f:
            run, wait = (int(x) / 1e9 for x in f.read().split()[:2])
    except (OSError, ValueError):
        return 0.0, 0.0
    return run, wait


def _short_run(store: str, folder: Path, *, workers: int, jobs: int, backend: str) -> ShortRun:
    folder.mkdir(parents=True)
    startup = _startup_cpu(store, folder / "empty")
    piece, script = folder / "short.yaml", folder / "script.yaml"
    piece.write_text(SHORT_PIECE, encoding="utf-8")
    script.write_text(SHORT_SCRIPT, encoding="utf-8")
    ws = Workspace(folder / "submitter", store=store)
    ids = [ws.submit(f"note {n}", piece=str(piece), model=f"scripted:{script}").id for n in range(jobs)]
    sampler = _LockSampler(store) if backend == "postgresql" else None
    load = os.getloadavg()[0]
    machine = _machine_busy()
    started, clock = time.monotonic(), time.time()
    procs = [subprocess.Popen([sys.executable, "-m", "agentnb.cli", "worker", "--store", store, "--workspace",
                               str(folder / f"worker-{n}")], env=_ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for n in range(workers)]
    cpu, on_cpu, runqueue, life, ran = [], [], [], [], []
    for proc in procs:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped: /proc still has it
        life.append(time.monotonic() - started)
        run, wait = _schedstat(proc.pid)
        on_cpu.append(run)
        runqueue.append(wait)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        cpu.append(usage.ru_utime + usage.ru_stime)
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"a worker failed ({proc.returncode}): {err.strip() or out.strip()}")
        ran.append(int(out.split()[1]))
    wall = max(life)
    machine_after = _machine_busy()
    waiters, rows_waiting, active = sampler.stop() if sampler is not None else (None, None, None)
    rows = [ws.store.job(j) for j in ids]
    statuses = Counter(r.status.value for r in rows)
    if statuses != {"succeeded": jobs} or sum(ran) != jobs:
        raise SystemExit(f"not every job succeeded once: {dict(statuses)}, ran {ran}")
    claims = Counter(ev.job_id for j in ids for ev in ws.events(j, kinds=["job_status"])
                     if ev.payload["status"] == "running")
    if set(claims.values()) != {1}:
        raise SystemExit("a job was claimed more than once")
    # the workload is what it says: each job's Write wrote its note (a tool error would be a cheaper job)
    failed = [j for j in ids for ev in ws.events(j, kinds=["tool_result"]) if ev.payload.get("is_error")]
    if failed:
        raise SystemExit(f"a tool call failed in {len(failed)} job(s), e.g. job {failed[0]}")
    first = min(float(r.started) for r in rows) - clock
    ws.store.close()
    return ShortRun(backend, workers, jobs, wall, first, cpu, startup, on_cpu, runqueue, life, ran, waiters,
                    rows_waiting, active,
                    None if machine is None or machine_after is None else (machine_after - machine) / wall, load)


def _short_runs(args: argparse.Namespace, top: Path, pg: Any) -> list[ShortRun]:
    """``--repeat`` rounds of every store × worker count, interleaved so that a change of the machine's load
    falls on all of them alike."""
    runs: list[ShortRun] = []
    for r in range(args.repeat):
        for backend in args.stores:
            for n in args.workers:
                folder = top / f"short-{backend}-{n}-{r}"
                url = pg.create_database() if backend == "postgresql" else f"sqlite:///{folder / 'store.sqlite'}"
                try:
                    run = _short_run(url, folder, workers=n, jobs=args.short_jobs, backend=backend)
                finally:
                    if backend == "postgresql":
                        pg.drop_database(url)
                runs.append(run)
                print(f"  short jobs, {backend}, {n} worker(s): {run.jobs_per_s:.1f} jobs/s "
                      f"(wall {run.wall:.2f} s, load {run.load:.1f})", flush=True)
    return runs


def _short_report(runs: list[ShortRun], args: argparse.Namespace, cores: int) -> None:
    med = statistics.median
    head = ["store", "workers", "jobs/s (median)", "speed-up vs 1", "every run's jobs/s", "wall s",
            "first claim s", "CPU per process s", "start-up CPU s", "CPU ms per job (start-up excluded)",
            "main thread on a core / waiting for a core / blocked s (per process)",
            "waiting for a write lock / a row lock (sessions)", "machine busy (cores)", "load before"]
    rows = []
    for backend in args.stores:
        one: float | None = None
        for n in args.workers:
            mine = [r for r in runs if r.backend == backend and r.workers == n]
            if not mine:
                continue
            rate = med([r.jobs_per_s for r in mine])
            one = rate if n == 1 else one
            per = [(med([statistics.mean(getattr(r, k)) for r in mine])) for k in ("on_cpu", "runqueue", "blocked")]
            pg = "—" if mine[0].lock_waiters is None else (
                f"{med([r.lock_waiters or 0.0 for r in mine]):.2f} / {med([r.row_waiters or 0.0 for r in mine]):.2f}")
            busy = [r.machine for r in mine if r.machine is not None]
            rows.append([backend, str(n), f"{rate:.1f}", "—" if one is None else f"{rate / one:.2f}",
                         " ".join(f"{r.jobs_per_s:.0f}" for r in mine), f"{med([r.wall for r in mine]):.2f}",
                         f"{med([r.first_claim for r in mine]):.2f}",
                         f"{med([statistics.mean(r.cpu) for r in mine]):.2f}", f"{med([r.startup for r in mine]):.2f}",
                         f"{1000 * med([r.cpu_per_job for r in mine]):.2f}",
                         " / ".join(f"{x:.2f}" for x in per), pg, f"{med(busy):.2f} of {cores}" if busy else "—",
                         " ".join(f"{r.load:.1f}" for r in mine)])
    _table(f"short jobs: {args.short_jobs} scripted jobs (Write, then transition), one job at a time per worker, "
           f"start-up included, {args.repeat} run(s) each", head, rows, args.markdown)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("all", "slow", "short"), default="all",
                   help="the slow endpoint (1, 2), the short jobs (3), or both (default)")
    p.add_argument("--jobs", type=int, default=256, help="jobs per throughput run (default 256)")
    p.add_argument("--latency", type=float, default=0.2, help="the endpoint's latency in seconds (default 0.2)")
    p.add_argument("--concurrency", type=int, default=16, help="jobs each worker runs at once (default 16)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="worker counts (default 1 2 4)")
    p.add_argument("--overhead-jobs", type=int, default=100, help="jobs per per-call overhead run (default 100)")
    p.add_argument("--short-jobs", type=int, default=400, help="jobs per short-jobs run (default 400)")
    p.add_argument("--stores", nargs="+", choices=("sqlite", "postgresql"), default=["sqlite", "postgresql"],
                   help="the stores of the short-jobs runs (default both)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each short-jobs setting (default 3; medians)")
    p.add_argument("--from-source", action="store_true",
                   help="workers compile agentnb as the caller's environment has it (no bytecode cache of the run's)")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    args = p.parse_args(argv)

    cores = os.cpu_count() or 1
    print(f"{platform.node()}: {cores} cores, Python {platform.python_version()}, "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    throughput: list[Run] = []
    overhead: list[Run] = []
    short: list[ShortRun] = []
    with tempfile.TemporaryDirectory(prefix="agentnb-workers-bench-") as tmp, pg_server() as pg, \
            OpenAIServer(latency=args.latency, responder=_answer) as server:
        top = Path(tmp)
        _ENV.clear()
        _ENV.update(_worker_env(top, from_source=args.from_source))
        _startup_cpu(f"sqlite:///{top / 'warm-up' / 'store.sqlite'}", top / "warm-up")  # compiles the bytecode once
        if args.workload in ("all", "short"):
            short = _short_runs(args, top, pg)
        if args.workload in ("all", "slow"):
            _slow_runs(args, top, pg, server, throughput, overhead)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if throughput:
        _report(throughput, overhead, args, cores)
    if short:
        _short_report(short, args, cores)
    return 0


def _slow_runs(args: argparse.Namespace, top: Path, pg: Any, server: OpenAIServer, throughput: list[Run],
               overhead: list[Run]) -> None:
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
    server.latency = args.latency


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
