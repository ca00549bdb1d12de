"""Running many jobs at once in this process (``ws.batch``; docs/design-lab.md).

Each job runs in a thread of its own through the workspace (``ws.run``): LLM calls wait on the network,
so threads are enough, one job's events stay in order (a job is only ever run by the thread that
claimed it) and every write goes through the store's single connection.

Ctrl-C (a notebook's stop button) or SIGTERM pauses the batch: no further job starts, every running job
is asked to pause after its current LLM call (it goes back to ``queued``, as ``ws.stop`` leaves it),
the executor waits for them, prints one line saying how to resume, and re-raises.  A second Ctrl-C while
it waits is ignored (said once): leaving then would leave jobs ``running`` under a live process with no
thread of ours driving them to a pause.  A job another process is running is skipped and counted.
A batch's cost limit (``budget``, agentnb/budgets.py) pauses the run the same way once reached, without raising.
The ``openai:`` calls of all the jobs share one rate-limit gate per endpoint (``models/ratelimit.py``).

A queue worker (``agentnb worker --concurrency N``, :func:`run_queue`) runs the same way without a list:
each of N slot threads claims the next queued job, runs it and claims again; an idle slot waits for a job
to end here or, on PostgreSQL, for a ``NOTIFY`` that one was queued (:class:`Wake`).

Progress is a ``tqdm.auto`` bar on stderr (a widget in Jupyter, text in a terminal) over the jobs to
run, with the succeeded/failed counts, tokens and US dollars so far (``models.prices``), refreshed as
jobs end and, at most every :data:`LIVE_EVERY` seconds, from the calls of the running jobs.  When the run
ends, however it ends, the bar leaves one static final line in its place (``agentnb.progress``).
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from .errors import StoreError, UsageError
from .interrupts import sigterm_interrupts
from .progress import BatchProgress, Outcome
from .store.base import JobStatus, Store, StoreUnreachable
from .store.records import JobRecord
from .views.timeline import fold

if TYPE_CHECKING:
    from .execution import Execution

__all__ = ["GRACE", "LIVE_EVERY", "OUTAGE_FIRST", "Backoff", "JobRunnerHost", "QueueReport", "RunReport", "Tally", "Wake",
           "check_poll", "check_slots", "finish_run", "idle_wait", "run_jobs", "run_or_skip",
           "run_queue", "sayer", "tell_paused"]

# the running jobs' calls are read again at most this often for the bar (each read is one query per job)
LIVE_EVERY = 1.0
# how often the waiting main thread wakes (to refresh the bar, to ask the running jobs to stop again)
_TICK = 0.25


class JobRunnerHost(Protocol):
    """What the executor drives: the workspace facade."""

    @property
    def store(self) -> Store: ...

    def run(self, job: Any, *, subtasks: bool = True) -> Any: ...

    def stop(self, job: Any) -> list[int]: ...


@dataclass
class RunReport:
    """What one :func:`run_jobs` did: the jobs' statuses when their run returned, and the skipped ones."""

    statuses: dict[int, str] = field(default_factory=dict)
    # jobs that another process was running (their claim was refused)
    skipped: list[int] = field(default_factory=list)
    # jobs never started because the run was interrupted first
    not_started: list[int] = field(default_factory=list)
    interrupted: bool = False
    # the worker processes that ran the jobs (1: this one; agentnb/processes.py), and the CPU seconds they used
    processes: int = 1
    worker_cpu_s: float = 0.0

    def count(self, status: str) -> int:
        return sum(1 for s in self.statuses.values() if s == status)


class Tally:
    """Tokens and dollars of the jobs, for the bar: fixed once a job has ended, read live while it runs."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.done: dict[int, tuple[int, float | None]] = {}
        self.live: dict[int, tuple[int, float | None]] = {}
        self.lock = threading.Lock()
        self.live_at = 0.0  # when the running jobs' calls were last read

    def usage(self, job_id: int) -> tuple[int, float | None]:
        row = self.store.job(job_id)
        totals = fold(self.store.events(job_id, kinds=["llm_response"]), runs=False).totals
        cost = totals.cost_usd(row.model)
        return totals.total_tokens, None if cost is None else float(cost)

    def ended(self, job_id: int) -> None:
        figures = self.usage(job_id)
        with self.lock:
            self.done[job_id] = figures
            self.live.pop(job_id, None)

    def refresh(self, running: Sequence[int]) -> None:
        live = {job_id: self.usage(job_id) for job_id in running}
        with self.lock:
            self.live = {k: v for k, v in live.items() if k not in self.done}

    def draw(self, bar: BatchProgress, statuses: dict[int, str], skipped: int, running: Sequence[int], *,
             final: bool = False) -> None:
        """Bring ``bar`` up to date: the ended jobs' ``statuses`` and ``skipped`` ones, and the tokens and dollars
        so far, the ``running`` jobs' read again at most every :data:`LIVE_EVERY` seconds (not at the ``final``
        drawing: they have ended)."""
        now = time.monotonic()
        if not final and now - self.live_at >= LIVE_EVERY:
            self.live_at = now
            self.refresh(running)
        tokens, cost = self.totals()
        # a job that paused (back in the queue after a stop) has not come to a rest: the bar does not count it
        bar.update(Outcome(bar.total, statuses).counts()["done"] + skipped, statuses, tokens, cost)

    def totals(self) -> tuple[int, float | None]:
        with self.lock:
            figures = [*self.done.values(), *self.live.values()]
        tokens = sum(t for t, _ in figures)
        costs = [c for _, c in figures]
        return tokens, (None if any(c is None for c in costs) else float(sum(c for c in costs if c is not None)))


def run_jobs(ws: JobRunnerHost, job_ids: Sequence[int], *, concurrency: int, progress: bool = False,
             batch: Any = None, on_end: Callable[[Any], None] | None = None,
             file: TextIO | None = None, resume: str | None = None, budget: Any = None) -> RunReport:
    """Run ``job_ids`` with up to ``concurrency`` at once; ``on_end(job)`` after each, in its thread.

    ``batch`` (with a ``name``) names the bar and the resume hint (``resume``: the hint's own words, e.g.
    the command that resumes it in a terminal).  ``budget``: a batch's cost limit (``budgets.BatchBudget``): once
    reached, no job starts and the running ones pause after their current call.  Raises what interrupted it
    (KeyboardInterrupt, :class:`~agentnb.worker.Terminated`) once every running job has paused.
    """
    name = getattr(batch, "name", None)
    out = file if file is not None else sys.stderr
    report = RunReport()
    lock = threading.Lock()
    stopping = threading.Event()
    active: set[int] = set()
    errors: list[BaseException] = []
    tally = Tally(ws.store) if progress else None
    if budget is not None:
        budget.running = active  # read (copied) by its live callback to pause every running job at once

    # each job's id once its thread is done with it: the waiting thread takes them one by one (waiting on every pending
    # future instead locked them all at each completion: O(jobs) a job)
    finished: queue.SimpleQueue[int] = queue.SimpleQueue()

    def one(job_id: int) -> None:
        try:
            run_one(job_id)
        finally:
            finished.put(job_id)

    def run_one(job_id: int) -> None:
        with lock:
            if stopping.is_set() or (budget is not None and budget.reached.is_set()):
                report.not_started.append(job_id)
                return
            active.add(job_id)
        try:
            job = run_or_skip(ws, job_id)
            if job is None:
                with lock:
                    report.skipped.append(job_id)
                return
            with lock:
                report.statuses[job_id] = str(job.status)
            if on_end is not None:
                on_end(job)
            if tally is not None:
                tally.ended(job_id)
        except BaseException as exc:  # a store that fails, say: the other jobs go on, it is raised at the end
            with lock:
                errors.append(exc)
        finally:
            with lock:
                active.discard(job_id)

    # no bar over nothing: resuming a finished batch draws no empty "0job" bar
    bar = BatchProgress(len(job_ids), f"batch {name}" if name else "jobs", out) if progress and job_ids else None
    started = time.monotonic()

    def refresh(final: bool = False) -> None:
        if bar is None or tally is None:
            return
        with lock:
            statuses = dict(report.statuses)
            running = sorted(active)
        tally.draw(bar, statuses, len(report.skipped), running, final=final)

    pool = ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(job_ids) or 1)),
                              thread_name_prefix="agentnb-job")
    futures: list[Future[None]] = []
    stopped_by = ""  # a batch's cost limit reached (budgets.py)
    try:
        with sigterm_interrupts():
            try:
                for job_id in job_ids:  # one by one: an interrupt meanwhile must see those already started
                    futures.append(pool.submit(one, job_id))
                left = len(futures)
                while left:
                    with contextlib.suppress(queue.Empty):
                        finished.get(timeout=_TICK)
                        left -= 1
                        while left:  # every other one done meanwhile, then the bar once
                            finished.get_nowait()
                            left -= 1
                    refresh()
                    if budget is not None and _over(ws, budget, stopping, active, lock):
                        stopped_by = budget.reason()
            except BaseException:
                report.interrupted = True
                _pause(ws, futures, stopping, active, lock, sayer(bar, out))
                raise
    finally:
        pool.shutdown(wait=True)
        finish_run(report, job_ids, name=name, out=out, resume=resume, bar=bar, tally=tally, refresh=refresh,
                   started=started, failed=bool(errors), stopped_by=stopped_by)
    if errors:
        raise errors[0]
    return report


def run_or_skip(ws: JobRunnerHost, job_id: int) -> Any | None:
    """``ws.run(job_id)``: the job as its run left it, or None when another process runs it (its claim was refused):
    not ours to run, and not a reason to stop the rest."""
    try:
        return ws.run(job_id)
    except StoreError:
        if ws.store.job(job_id).status != JobStatus.running:
            raise
        return None


def finish_run(report: RunReport, job_ids: Sequence[int], *, name: str | None, out: TextIO, resume: str | None,
               bar: BatchProgress | None, tally: Tally | None, refresh: Callable[..., None], started: float,
               failed: bool, stopped_by: str) -> None:
    """The end of a run of jobs however it ended (here or in worker processes, agentnb/processes.py): the bar's last
    line, which stays (a widget does not outlive its kernel), then the one line after an interrupt or a cost limit
    saying what paused and how to resume (``resume``: the front end's words, ``ws.batch(NAME)`` by default)."""
    if stopped_by and not report.not_started and not any(
            s in (JobStatus.queued, JobStatus.running) for s in report.statuses.values()):
        stopped_by = ""  # the limit was reached by the last calls: nothing was left to pause
    try:
        if bar is not None and tally is not None:
            try:
                refresh(final=True)
            finally:
                tokens, cost = tally.totals()
                stopped = "paused" if report.interrupted else "error" if failed else stopped_by
                bar.finish(Outcome(len(job_ids), dict(report.statuses), skipped=len(report.skipped),
                                   tokens=tokens, cost=cost, seconds=time.monotonic() - started,
                                   stopped=stopped), resume=resume or (f"ws.batch({name!r})" if name else ""))
    finally:
        if report.interrupted:
            tell_paused(report, name, job_ids, sayer(None, out), resume)
        elif stopped_by:
            tell_paused(report, name, job_ids, sayer(None, out), f"{resume} and a higher cost limit" if resume
                        else f"ws.batch({name!r}, cost_limit=HIGHER)", what=f"batch {name}: {stopped_by}")


def sayer(bar: BatchProgress | None, out: TextIO) -> Callable[[str], None]:
    """Print one line on ``out``, on a line of its own even while the text bar is drawn."""
    def say(text: str) -> None:
        if bar is not None:
            bar.write(text)  # clears the bar, prints, draws it again
        else:
            print(text, file=out, flush=True)
    return say


def _pause(ws: JobRunnerHost, futures: list[Future[None]], stopping: threading.Event, active: set[int],
           lock: threading.Lock, say: Callable[[str], None]) -> None:
    """Start no further job, ask every running one to pause after its current call, and wait for them."""
    with lock:
        stopping.set()
    for f in futures:
        f.cancel()
    said = False
    pending = {f for f in futures if not f.done()}
    # ``active`` too, not only the futures: an interrupt that lands inside ``pool.submit`` (while it waits for
    # the thread it started) leaves that job's future out of ``futures`` and its thread out of the pool's
    # shutdown, though the job already runs
    while True:
        try:
            with lock:
                running = sorted(active)
            if not pending and not running:
                break
            # asked again on every tick: a job whose thread had not yet begun its run when first asked
            # would otherwise clear the request as the run starts (ws.run forgets an earlier stop)
            for job_id in running:
                ws.stop(job_id)
            if pending:
                _done, pending = wait(pending, timeout=_TICK)
            else:
                time.sleep(_TICK)
        except BaseException:  # a second Ctrl-C (or SIGTERM): keep waiting, the jobs are pausing
            if not said:
                said = True
                with lock:
                    n = len(active)
                say(f"agentnb: still pausing {n} running job(s); each stops after its current LLM call")


def _over(ws: JobRunnerHost, budget: Any, stopping: threading.Event, active: set[int], lock: threading.Lock) -> bool:
    """A batch's cost limit reached: start no further job and ask the running ones (and their subtasks) to pause
    after their current call; asked on every tick, as a job whose run had not yet begun would forget it."""
    budget.tick()
    if not budget.reached.is_set():
        return False
    with lock:
        stopping.set()
        running = sorted(active)
    for job_id in running:
        ws.stop(job_id)
    return True


def tell_paused(report: RunReport, name: str | None, job_ids: Sequence[int], say: Callable[[str], None],
          resume: str | None = None, what: str = "interrupted") -> None:
    """The one line after an interrupt: how many jobs paused, and how to resume."""
    paused = report.count(JobStatus.queued) + report.count(JobStatus.running)
    skipped = set(report.skipped)
    left = sum(1 for j in job_ids if j not in skipped
               and report.statuses.get(j, JobStatus.queued) in (JobStatus.queued, JobStatus.running, JobStatus.waiting_subtasks))
    how = resume or (f"ws.batch({name!r})" if name else "running them again")
    say(f"agentnb: {what}: {paused} running job(s) paused, {left} not finished; resume with {how}")


# -- a queue worker's slots (agentnb worker --concurrency N) -----------------------------------------------

# how long an interrupted worker waits for its running jobs to pause after their current call before it gives
# the rest back to the queue itself (a call can take minutes; SIGKILL follows SIGTERM after 10 s in Docker)
GRACE = 5.0
# the idle wait between two claims when nothing wakes the worker sooner: SQLite's poll; on PostgreSQL a
# NOTIFY wakes it, and this is the safety net (an expired lease sends no NOTIFY, a claim recovers it)
POLL_SQLITE = 1.0
POLL_LISTENING = 5.0
# how often the listening thread looks whether the worker is done
_LISTEN_TICK = 1.0
# the first wait of a --forever worker before it claims again from an unreachable store (Backoff)
OUTAGE_FIRST = 0.1


def check_slots(concurrency: Any) -> int:
    """``concurrency`` of a worker: a whole number ≥ 1, else one line."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise UsageError(f"concurrency={concurrency!r}; allowed: a whole number ≥ 1 (jobs a worker runs at once)")
    return concurrency


class Wake:
    """What wakes an idle worker: a job ended in this process, or (PostgreSQL) a ``NOTIFY`` that one was queued.

    A generation count, bumped on each wake-up, closes the race between a claim that found nothing and the
    wait after it: a waiter passes the generation it saw *before* claiming and returns at once if it moved.
    The store's :class:`~agentnb.store.base.JobWaiter` (a ``LISTEN`` connection) is driven by a daemon thread,
    connected before the first claim so that no NOTIFY sent after it is missed.
    """

    def __init__(self, store: Store) -> None:
        self.cond = threading.Condition()
        self.gen = 0
        self._done = threading.Event()
        self._waiter = store.job_waiter()
        self.listening = self._waiter is not None
        if self._waiter is not None:
            self._waiter.wait(0.0)  # LISTEN now, before the first claim
            threading.Thread(target=self._listen, name="agentnb-listen", daemon=True).start()

    def _listen(self) -> None:
        waiter = self._waiter
        assert waiter is not None
        try:
            while not self._done.is_set():
                if waiter.wait(_LISTEN_TICK):
                    self.bump()
        finally:
            waiter.close()  # here, in the thread that uses the connection

    def bump(self) -> None:
        with self.cond:
            self.gen += 1
            self.cond.notify_all()

    def seen(self) -> int:
        with self.cond:
            return self.gen

    def wait(self, seen: int, timeout: float) -> None:
        with self.cond:
            if self.gen == seen:
                self.cond.wait(timeout)

    def close(self) -> None:
        self._done.set()


def check_poll(poll: Any) -> float | None:
    """``poll`` of a worker: None (the default) or a number of seconds > 0, else one line."""
    if poll is not None and (isinstance(poll, bool) or not isinstance(poll, int | float) or not poll > 0):
        raise UsageError(f"poll={poll!r}; allowed: a number of seconds > 0")
    return None if poll is None else float(poll)


def idle_wait(poll: float | None, wake: Wake) -> float:
    """The idle wait between claims: ``poll`` as given, else :data:`POLL_LISTENING` where a NOTIFY wakes the
    worker, :data:`POLL_SQLITE` where it polls."""
    if poll is not None:
        return poll
    return POLL_LISTENING if wake.listening else POLL_SQLITE


class Backoff:
    """How long a ``--forever`` worker waits before it claims again while the store is unreachable
    (:class:`~agentnb.store.base.StoreUnreachable`: a server restart, a network cut): :data:`OUTAGE_FIRST` s,
    doubled at each failure, at most ``cap`` (the worker's idle wait), from the first claim after it is back.
    Thread-safe: the slots of one worker share it."""

    def __init__(self, cap: float) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._delay = 0.0

    def next(self) -> float:
        with self._lock:
            self._delay = min(self.cap, max(OUTAGE_FIRST, self._delay * 2))
            return self._delay

    def over(self) -> None:
        with self._lock:
            self._delay = 0.0


@dataclass
class QueueReport:
    """What one :func:`run_queue` did: the jobs it ran, in the order their runs returned, with their statuses."""

    ran: list[int] = field(default_factory=list)
    statuses: dict[int, str] = field(default_factory=dict)
    # jobs still running here when an interrupt's grace ran out, given back to the queue by this thread
    given_back: list[int] = field(default_factory=list)
    interrupted: bool = False


def run_queue(execution: Execution, *, concurrency: int, forever: bool = False, poll: float | None = None,
              max_jobs: int | None = None, grace: float = GRACE, report: QueueReport | None = None) -> QueueReport:
    """Run queued jobs in ``concurrency`` slot threads: each claims the next one, runs it to its end (or its
    wait, or its stop) and claims again, all through ``execution``.

    Without ``forever`` it returns once the queue is empty and none of its jobs is still running (a running
    job may queue subtasks, or its parent), and raises a :class:`StoreUnreachable` as any error.  With
    ``forever`` an outage is waited out: a claim it cut off is tried again (:class:`Backoff`), and a run it cut
    off ends that run only (the facade gave the job back, or its lease will).  Ctrl-C or SIGTERM (in the main thread) starts no further job, asks
    the running ones to pause after their current call (``execution.stop``), waits up to ``grace`` seconds for
    them, gives back to the queue those still running (reason ``interrupted``, as a one-job worker does) and
    re-raises; their threads are daemons, left blocked in their call, and die with the process.  ``report``,
    when given, is filled as jobs end (so that it tells what ran even when an interrupt is raised).
    """
    check_slots(concurrency)
    poll = check_poll(poll)
    report = report if report is not None else QueueReport()
    wake = Wake(execution.store)
    wait_s = idle_wait(poll, wake)
    cond = wake.cond  # one lock for the slots' state and the wake-ups: a job's end and its bump are one step
    active: set[int] = set()
    errors: list[BaseException] = []
    state = {"started": 0, "empty_gen": -1, "closed": False, "slots": concurrency}
    outage = Backoff(wait_s)
    all_done = threading.Event()

    def take() -> JobRecord | None:
        """The next job for this slot (claimed, under ``cond``), or None when the slot should end."""
        with cond:
            while True:
                if state["closed"] or (max_jobs is not None and state["started"] >= max_jobs):
                    return None
                seen = wake.gen
                if state["empty_gen"] != seen:  # a slot that found the queue empty since the last wake-up: skip
                    try:
                        row = execution.claim_next()
                    except StoreUnreachable:
                        if not forever:
                            raise
                        cond.wait(outage.next())  # an interrupt (state closed) wakes it
                        continue
                    outage.over()
                    if row is not None:
                        state["started"] += 1
                        active.add(row.id)
                        return row
                    state["empty_gen"] = seen
                if not forever and not active:
                    state["closed"] = True
                    cond.notify_all()
                    return None
                if not cond.wait(wait_s) and wake.gen == seen:
                    wake.gen += 1  # the safety net: claim again (it recovers expired leases), once per slot set
                    cond.notify_all()

    def slot() -> None:
        try:
            while True:
                try:
                    row = take()
                except BaseException as exc:  # a lost store: this slot ends, the others stop claiming
                    with cond:
                        errors.append(exc)
                        state["closed"] = True
                        cond.notify_all()
                    return
                if row is None:
                    return
                job_id = row.id
                try:
                    status = execution.run_claimed(row, unit="job")
                    with cond:
                        report.statuses[job_id] = status
                except StoreUnreachable as exc:
                    if not forever:
                        with cond:
                            errors.append(exc)
                            state["closed"] = True
                    # forever: the job was cut off mid-run, not failed; the store holds it as of its last commit
                except BaseException as exc:
                    with cond:
                        errors.append(exc)
                        state["closed"] = True
                finally:
                    with cond:
                        active.discard(job_id)
                        report.ran.append(job_id)
                        wake.gen += 1
                        cond.notify_all()
        finally:
            with cond:
                state["slots"] -= 1
                if state["slots"] == 0:
                    all_done.set()

    threads = [threading.Thread(target=slot, name=f"agentnb-slot-{n}", daemon=True) for n in range(concurrency)]
    try:
        with sigterm_interrupts():
            for t in threads:
                t.start()
            while not all_done.wait(_TICK):
                pass
    except BaseException:
        report.interrupted = True
        _give_back(execution, wake, state, active, all_done, grace, report)
        raise
    finally:
        wake.close()
    if errors:
        raise errors[0]
    return report


def _give_back(execution: Execution, wake: Wake, state: dict[str, Any], active: set[int],
               all_done: threading.Event, grace: float, report: QueueReport) -> None:
    """An interrupted worker: no further claim, the running jobs asked to pause, then the rest re-queued."""
    cond = wake.cond
    with cond:
        state["closed"] = True
        cond.notify_all()
    deadline = time.monotonic() + max(0.0, grace)
    try:
        while not all_done.is_set() and time.monotonic() < deadline:
            with cond:
                running = sorted(active)
            # asked again on every tick, as run_jobs does: a slot may have claimed one after the first ask
            for job_id in running:
                execution.stop(job_id)
            all_done.wait(min(_TICK, max(0.0, deadline - time.monotonic())))
    except BaseException:  # a second Ctrl-C (or SIGTERM): stop waiting, give them back now
        pass
    with cond:
        left = sorted(active)
    for job_id in left:
        if execution.give_back(job_id):  # still ours: a job that paused meanwhile may already run elsewhere
            report.given_back.append(job_id)
