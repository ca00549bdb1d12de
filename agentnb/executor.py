"""Running many jobs at once in this process (``ws.batch``; DESIGN §10).

Each job runs in a thread of its own through the workspace (``ws.run``): LLM calls wait on the network,
so threads are enough, one job's events stay in order (a job is only ever run by the thread that
claimed it) and every write goes through the store's single connection.

Ctrl-C (a notebook's stop button) or SIGTERM pauses the batch: no further job starts, every running job
is asked to pause after its current LLM call (it goes back to ``queued``, as ``ws.stop`` leaves it),
the executor waits for them, prints one line saying how to resume, and re-raises.  A second Ctrl-C while
it waits is ignored (said once): leaving then would leave jobs ``running`` under a live process with no
thread of ours driving them to a pause.  A job another process is running is skipped and counted.
The ``openai:`` calls of all the jobs share one rate-limit gate per endpoint (``models/ratelimit.py``).

Progress is a ``tqdm.auto`` bar on stderr (a widget in Jupyter, text in a terminal) over the jobs to
run, with the succeeded/failed counts, tokens and US dollars so far (``models.prices``), refreshed as
jobs end and, at most every :data:`LIVE_EVERY` seconds, from the calls of the running jobs.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

from .errors import StoreError
from .events import LLMResponse
from .models.prices import call_costs
from .store.base import Store
from .worker import sigterm_interrupts

__all__ = ["LIVE_EVERY", "JobRunnerHost", "RunReport", "run_jobs"]

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

    def count(self, status: str) -> int:
        return sum(1 for s in self.statuses.values() if s == status)


class _Tally:
    """Tokens and dollars of the jobs, for the bar: fixed once a job has ended, read live while it runs."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.done: dict[int, tuple[int, float | None]] = {}
        self.live: dict[int, tuple[int, float | None]] = {}
        self.lock = threading.Lock()

    def usage(self, job_id: int) -> tuple[int, float | None]:
        row = self.store.job(job_id)
        events = self.store.events(job_id, kinds=["llm_response"])
        calls = [ev for ev in events if isinstance(ev, LLMResponse)]
        prompt = [int(ev.usage.prompt_tokens) for ev in calls]
        completion = [int(ev.usage.completion_tokens) for ev in calls]
        total = sum(int(ev.usage.total_tokens) for ev in calls)
        costs = call_costs(str(row["model"]), prompt, completion, [ev.ts for ev in calls])
        cost = None if any(c is None for c in costs) else float(sum(c for c in costs if c is not None))
        return total, cost

    def ended(self, job_id: int) -> None:
        figures = self.usage(job_id)
        with self.lock:
            self.done[job_id] = figures
            self.live.pop(job_id, None)

    def refresh(self, running: Sequence[int]) -> None:
        live = {job_id: self.usage(job_id) for job_id in running}
        with self.lock:
            self.live = {k: v for k, v in live.items() if k not in self.done}

    def totals(self) -> tuple[int, float | None]:
        with self.lock:
            figures = [*self.done.values(), *self.live.values()]
        tokens = sum(t for t, _ in figures)
        costs = [c for _, c in figures]
        return tokens, (None if any(c is None for c in costs) else float(sum(c for c in costs if c is not None)))


def _make_bar(total: int, desc: str, file: TextIO) -> Any:
    """A ``tqdm.auto`` bar (a widget in Jupyter), or a text one where the widget cannot be drawn."""
    try:
        from tqdm.auto import tqdm as auto_tqdm  # type: ignore[import-untyped]

        return auto_tqdm(total=total, desc=desc, unit="job", file=file, dynamic_ncols=True)
    except Exception:  # tqdm.notebook raises when ipywidgets is missing or too old
        from tqdm.std import tqdm as text_tqdm  # type: ignore[import-untyped]

        return text_tqdm(total=total, desc=desc, unit="job", file=file, dynamic_ncols=True)


def _postfix(statuses: dict[int, str], tokens: int, cost: float | None) -> str:
    ok = sum(1 for s in statuses.values() if s == "succeeded")
    failed = sum(1 for s in statuses.values() if s in ("failed", "aborted"))
    waiting = sum(1 for s in statuses.values() if s.startswith("waiting"))
    dollars = "$NA" if cost is None else f"${cost:,.4f}"
    text = f"{ok} ok, {failed} failed"
    if waiting:
        text += f", {waiting} waiting"
    return f"{text} · {tokens:,} tokens · {dollars}"


def run_jobs(ws: JobRunnerHost, job_ids: Sequence[int], *, concurrency: int, progress: bool = False,
             batch: Any = None, on_end: Callable[[Any], None] | None = None,
             file: TextIO | None = None, resume: str | None = None) -> RunReport:
    """Run ``job_ids`` with up to ``concurrency`` at once; ``on_end(job)`` after each, in its thread.

    ``batch`` (with a ``name``) names the bar and the resume hint (``resume``: the hint's own words, e.g.
    the command that resumes it in a terminal).  Raises what interrupted it
    (KeyboardInterrupt, :class:`~agentnb.worker.Terminated`) once every running job has paused.
    """
    name = getattr(batch, "name", None)
    out = file if file is not None else sys.stderr
    report = RunReport()
    lock = threading.Lock()
    stopping = threading.Event()
    active: set[int] = set()
    errors: list[BaseException] = []
    tally = _Tally(ws.store) if progress else None

    def one(job_id: int) -> None:
        with lock:
            if stopping.is_set():
                report.not_started.append(job_id)
                return
            active.add(job_id)
        try:
            try:
                job = ws.run(job_id)
            except StoreError:
                row = ws.store.job(job_id)
                if row["status"] != "running":
                    raise
                with lock:  # another process runs it: not ours to run, and not a reason to stop the rest
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
    bar = _make_bar(len(job_ids), f"batch {name}" if name else "jobs", out) if progress and job_ids else None
    shown = 0
    live_at = 0.0

    def refresh(final: bool = False) -> None:
        nonlocal shown, live_at
        if bar is None or tally is None:
            return
        with lock:
            statuses = dict(report.statuses)
            running = sorted(active)
        now = time.monotonic()
        if not final and now - live_at >= LIVE_EVERY:
            live_at = now
            tally.refresh(running)
        ended = len(statuses) + len(report.skipped)
        if ended > shown:
            bar.update(ended - shown)
            shown = ended
        tokens, cost = tally.totals()
        bar.set_postfix_str(_postfix(statuses, tokens, cost), refresh=True)

    pool = ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(job_ids) or 1)),
                              thread_name_prefix="agentnb-job")
    futures: list[Future[None]] = []
    try:
        with sigterm_interrupts():
            try:
                for job_id in job_ids:  # one by one: an interrupt meanwhile must see those already started
                    futures.append(pool.submit(one, job_id))
                pending = set(futures)
                while pending:
                    _done, pending = wait(pending, timeout=_TICK, return_when=FIRST_COMPLETED)
                    refresh()
            except BaseException:
                report.interrupted = True
                say = _sayer(bar, out)
                _pause(ws, futures, stopping, active, lock, say)
                _tell(report, name, job_ids, say, resume)
                raise
    finally:
        pool.shutdown(wait=True)
        if bar is not None:
            try:
                refresh(final=True)
            finally:
                bar.close()
    if errors:
        raise errors[0]
    return report


def _sayer(bar: Any, out: TextIO) -> Callable[[str], None]:
    """Print one line on ``out``, on a line of its own even while the text bar is drawn."""
    def say(text: str) -> None:
        if bar is not None:
            bar.write(text, file=out)  # clears the bar, prints, draws it again
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
    while pending:
        try:
            with lock:
                running = sorted(active)
            # asked again on every tick: a job whose thread had not yet begun its run when first asked
            # would otherwise clear the request as the run starts (ws.run forgets an earlier stop)
            for job_id in running:
                ws.stop(job_id)
            _done, pending = wait(pending, timeout=_TICK)
        except BaseException:  # a second Ctrl-C (or SIGTERM): keep waiting, the jobs are pausing
            if not said:
                said = True
                with lock:
                    n = len(active)
                say(f"agentnb: still pausing {n} running job(s); each stops after its current LLM call")


def _tell(report: RunReport, name: str | None, job_ids: Sequence[int], say: Callable[[str], None],
          resume: str | None = None) -> None:
    """The one line after an interrupt: how many jobs paused, and how to resume."""
    paused = report.count("queued") + report.count("running")
    skipped = set(report.skipped)
    left = sum(1 for j in job_ids if j not in skipped
               and report.statuses.get(j, "queued") in ("queued", "running", "waiting_subtasks"))
    how = resume or (f"ws.batch({name!r})" if name else "running them again")
    say(f"agentnb: interrupted: {paused} running job(s) paused, {left} not finished; resume with {how}")
