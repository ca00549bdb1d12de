"""A batch run by several worker processes on the same store (``processes=N``; docs/design-lab.md#processes).

One process holds one GIL, so a batch whose calls come back fast (a local endpoint, a fast model) is bound by one
core however high its concurrency.  With ``processes=N`` the batch's process starts N worker processes
(``agentnb._batch_child.serve``), splits ``concurrency`` between them, and coordinates:

* **which job runs where**: it hands each child one job at a time from the batch's ordered list (epoch by epoch),
  up to the child's share running at once (and a quarter more waiting there, so a freed slot does not wait for a
  round trip), and the next as each ends — so nothing runs twice and a slow child gets fewer jobs.  Each child claims and runs its jobs through its own ``Workspace`` on the same store (one
  ordered event stream per job, as ever: a job is only run by the thread that claimed it);
* **what the notebook sees**: the progress bar (read from the store, as a single-process batch's), the children's
  stderr lines, the scorers (notebook functions: they run here, as each job ends) and the one line after a stop;
* **stops**: Ctrl-C, SIGTERM or a reached cost limit sends every child ``stop``: its running jobs pause after
  their current call and go back to ``queued``, jobs not yet handed out are not started, and the batch resumes
  as ever.  A child ignores Ctrl-C itself (a terminal sends it to the whole process group): this process decides;
* **a 429**: a child that gets one tells this process, which tells the others, whose gates pause and halve their
  calls in flight as if they had got it (``models/ratelimit.py``), so the whole batch backs off;
* **a child that dies** (killed, out of memory): the jobs it held are handed to a replacement child; their claims
  name a process that is gone, so the replacement claims them again at once (docs/stores.md#leases) and each
  resumes from its last committed step.  A child that dies before it is ready (its tools cannot be imported, the
  store cannot be opened) ends the batch with its last stderr line; children that keep dying stop it too.

The workers are forked from multiprocessing's fork server, which imports agentnb and the ``openai`` client once, when
the first batch of the process starts it (about a second): a worker then starts in milliseconds instead of paying
that import itself (a quarter of a worker's CPU in an 800-job batch, when each was a fresh interpreter), and is
forked from a process with no threads of the notebook's.  Where there is no fork server (Windows), each worker is a
fresh interpreter (``spawn``).  A worker gets this process's environment, working folder, ``sys.path`` and secret
values with its settings, as a freshly started one would (the fork server keeps those of when it started).

Workers import the modules of the batch's own tools (``@agentnb.tool`` functions) by name; a tool defined in a
notebook (``__main__`` without a file) cannot be imported by another process, so such a batch runs in this one
(:func:`processes_for` says why).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import queue
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any, Protocol, TextIO

from ._secrets import secret_values
from .budgets import spent
from .errors import AgentnbError, UsageError
from .executor import LIVE_EVERY, RunReport, Tally, finish_run, sayer
from .interrupts import held_interrupts, sigterm_interrupts
from .progress import BatchProgress
from .store.base import Store

__all__ = ["PER_PROCESS", "ProcessesHost", "batch_tools", "check_processes", "check_tools", "processes_for",
           "refuse_in_script_import", "run_batch", "run_in_processes", "unimportable_tools"]

# the concurrency one process is given before ``processes=None`` asks for another one: one process turns ~800 calls
# a second (about 1.2 ms of CPU each; benchmarks/README.md), which 64 jobs at once reach only against an endpoint
# answering in ~80 ms; and one core is left to the calling process, the endpoint and the store (on 2 cores a second
# worker process measured no faster than one)
PER_PROCESS = 64
# children that die with jobs in hand before the batch gives up (each is replaced until then)
_MAX_DEATHS = 3
_TICK = 0.25
# a child whose process has exited with no end of its messages read this long after (a process it forked holds its
# pipe open) is taken as ended: its last messages were read long before (its reader takes each at once)
_GONE_AFTER = 2.0
_CHILD = "agentnb._batch_child"
_context: BaseContext | None = None


class ProcessesHost(Protocol):
    """What the coordinator needs of the workspace facade."""

    @property
    def store(self) -> Store: ...

    @property
    def open_args(self) -> dict[str, Any]: ...

    def job(self, job: Any) -> Any: ...


# the script a batch's worker process is running for its tools (as __mp_main__), while it runs it
importing_script: str | None = None


def refuse_in_script_import(what: str) -> None:
    """Refuse ``what`` (``ws.batch``, ``ws.run``) called by a script that a batch's worker process is importing for
    its tools: its main code runs again there, unguarded, and would start batches inside the batch."""
    if importing_script is not None:
        raise UsageError(f"{importing_script}: {what} was called while a batch's worker process imported this script "
                         "for its tools; put the script's own code under `if __name__ == \"__main__\":` (its tools "
                         "stay at the top level)")


def check_processes(value: Any) -> int | None:
    """``processes=`` checked: None (chosen from the cores, :func:`processes_for`, or ``AGENTNB_PROCESSES``, checked
    here too) or a whole number ≥ 1."""
    if value is None:
        _env_processes()
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"processes={value!r}; allowed: a whole number ≥ 1 (worker processes for the batch); "
                         "not given, the number is chosen from the machine's cores")
    return value


def _custom_tools(tool_names: Iterable[str]) -> Iterator[tuple[str, types.ModuleType | None]]:
    """Each of ``tool_names`` that is a registered ``@agentnb.tool`` (not a built-in), with the module its function
    was defined in (None: one no longer imported)."""
    from .tools.base import get_tool

    for name in sorted(set(tool_names)):
        t = get_tool(name)
        if t is not None and not t.builtin:
            yield name, sys.modules.get(getattr(t.fn, "__module__", "") or "")


def _env_processes() -> int | None:
    """``AGENTNB_PROCESSES`` (the default of ``processes=``), checked; None when unset or empty."""
    env = os.environ.get("AGENTNB_PROCESSES", "").strip()
    if not env:
        return None
    try:
        return check_processes(int(env))
    except (ValueError, UsageError):
        raise UsageError(f"AGENTNB_PROCESSES={env!r}; allowed: a whole number ≥ 1") from None


def unimportable_tools(tool_names: Iterable[str]) -> list[str]:
    """Of the tools ``tool_names``, those registered from a notebook, a console or a script read from stdin
    (``__main__`` without a file to run again): another process cannot import them."""
    return [name for name, module in _custom_tools(tool_names)
            if module is None or (module.__name__ == "__main__"
                                  and not os.path.isfile(str(getattr(module, "__file__", None) or "")))]


def check_tools(processes: int | None, concurrency: int, jobs: int, tool_names: Iterable[str]) -> None:
    """Refuse, before a batch's jobs are written, ``processes`` asked for ``jobs`` that use a tool other processes
    cannot import (the :class:`UsageError` :func:`processes_for` gives when the batch runs)."""
    if processes is not None:
        processes_for(processes, concurrency, jobs, tool_names)


def tool_imports(tool_names: Iterable[str]) -> list[list[str]]:
    """How a child gets the tools ``tool_names`` registered: ``["module", NAME]`` or ``["path", FILE]`` (a script's
    ``__main__``, run there as ``__mp_main__`` the way multiprocessing does, so its main block does not run)."""
    out: list[list[str]] = []
    for _name, module in _custom_tools(tool_names):
        if module is None:
            continue
        how = ["path", str(module.__file__)] if module.__name__ == "__main__" else ["module", module.__name__]
        if how not in out:
            out.append(how)
    return out


def batch_tools(variants: Iterable[Any]) -> set[str]:
    """The tools the movements of a batch's variants (``BatchRecord.variants``) list (a subtask's piece aside)."""
    from .engine.runner import parse_stored_piece

    names: set[str] = set()
    for v in variants:
        piece = parse_stored_piece(v.piece_yaml, v.piece_source or v.piece)
        for movement in piece.movements:
            names.update(movement.tools)
    return names


def processes_for(processes: int | None, concurrency: int, jobs: int, tool_names: Iterable[str],
                  cores: int | None = None) -> tuple[int, str]:
    """How many processes run a batch of ``jobs`` at ``concurrency`` (``processes``: what was asked, None: choose),
    and, when fewer than asked, why.  Never more than the jobs or the concurrency; None gives one process per
    :data:`PER_PROCESS` jobs at once, at most one per core but one (``AGENTNB_PROCESSES`` sets the default).  A batch with a
    tool defined in a notebook runs in one process: asked for more, that is a :class:`UsageError`."""
    asked = processes if processes is not None else _env_processes()
    if asked is None:
        cores = cores or os.cpu_count() or 1
        n = min(cores - 1, -(-concurrency // PER_PROCESS))
    else:
        n = asked
    n = max(1, min(n, concurrency, max(jobs, 1)))
    if n > 1:
        local = unimportable_tools(tool_names)
        if local:
            if processes is not None:
                raise UsageError(f"processes={processes}: the tool(s) {', '.join(local)} are defined in this notebook or console, "
                                 "which worker processes cannot import; define them in a module (a .py file) and "
                                 "import it, or use processes=1")
            return 1, f"tool(s) {', '.join(local)} defined in the notebook"
    return n, ""


def run_batch(ws: Any, job_ids: Sequence[int], variants: Iterable[Any], *, processes: int | None, concurrency: int,
              **options: Any) -> RunReport:
    """Run a batch's ``job_ids`` in this process (:func:`agentnb.executor.run_jobs`) or in worker processes
    (:func:`run_in_processes`), as :func:`processes_for` decides from ``processes`` (None: choose)."""
    tools = batch_tools(variants)
    n, _why = processes_for(processes, concurrency, len(job_ids), tools)
    if n == 1:
        from .executor import run_jobs

        return run_jobs(ws, job_ids, concurrency=concurrency, **options)
    return run_in_processes(ws, job_ids, processes=n, concurrency=concurrency, tool_names=tools, **options)


@dataclass
class _Child:
    index: int
    share: int
    proc: Any  # a multiprocessing Process
    conn: Connection
    assigned: list[int] = field(default_factory=list)
    ready: bool = False
    closed: bool = False  # told "done" or "stop": no more jobs
    stopped: bool = False  # told "stop": its running jobs pause
    broken: bool = False
    last_err: str = ""
    exited_at: float | None = None  # when its process was first seen exited (``_GONE_AFTER``)

    def send(self, msg: dict[str, Any]) -> None:
        if self.broken:
            return
        try:
            self.conn.send(msg)
        except (BrokenPipeError, OSError, ValueError):  # it died: the end of its messages says so to the loop
            self.broken = True

    def close(self, msg: dict[str, Any]) -> None:
        """Tell it ``{"done": True}`` (no more jobs: it ends once its own have) or ``{"stop": True}`` (its jobs
        pause), once each; a stop reaches a worker told it was done too (its last jobs still run)."""
        stop = "stop" in msg
        if self.stopped or (self.closed and not stop):
            return
        self.closed = True
        self.stopped = stop
        self.send(msg)


def _mp_context() -> BaseContext:
    """The fork server's context, preloading the worker's module (agentnb, the openai client); else spawn."""
    global _context
    if _context is None:
        if "forkserver" in multiprocessing.get_all_start_methods():
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload([_CHILD])
        else:
            _context = multiprocessing.get_context("spawn")
    return _context


def _serve(conn: Connection, settings: dict[str, Any]) -> None:
    """A worker's entry: :func:`agentnb._batch_child.serve`, named rather than imported here — it opens a
    workspace, a layer above this module (as ``agentnb worker`` is started by name)."""
    importlib.import_module(_CHILD).serve(conn, settings)


@contextlib.contextmanager
def _no_main_script() -> Iterator[None]:
    """While a worker starts: a bare ``__main__``, so that multiprocessing does not make the worker import the calling
    script (run again, its unguarded top level would start the batch again): the worker needs none of it, the
    batch's tools come by name (:func:`tool_imports`)."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _shares(concurrency: int, n: int) -> list[int]:
    base, extra = divmod(concurrency, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def run_in_processes(ws: ProcessesHost, job_ids: Sequence[int], *, processes: int, concurrency: int,
                     progress: bool = False, batch: Any = None, on_end: Callable[[Any], None] | None = None,
                     file: TextIO | None = None, resume: str | None = None, budget: Any = None,
                     tool_names: Iterable[str] = ()) -> RunReport:
    """Run ``job_ids`` in ``processes`` child processes, ``concurrency`` at once in all; ``on_end(job)`` here, after
    each.  The same contract as :func:`agentnb.executor.run_jobs` (``batch``, ``resume``, ``budget``: a
    ``budgets.BatchBudget``; raises what interrupted it once every child has paused its jobs)."""
    name = getattr(batch, "name", None)
    out = file if file is not None else sys.stderr
    report = RunReport(processes=processes)
    todo: deque[int] = deque(job_ids)
    inbox: queue.Queue[tuple[_Child, dict[str, Any] | None]] = queue.Queue()
    children: list[_Child] = []
    errors: list[BaseException] = []
    tally = Tally(ws.store) if progress else None
    bar = BatchProgress(len(job_ids), f"batch {name}" if name else "jobs", out) if progress and job_ids else None
    say = sayer(bar, out)
    # the scorers run here (notebook functions) as each job ends, as many at once as jobs run: one process runs
    # each in the thread of the job that ended
    scoring = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="agentnb-score")
    scored: list[Future[None]] = []  # one a job handed to the scorers, made before it is submitted (_wait_scorers)
    config = {"workspace": ws.open_args, "imports": tool_imports(tool_names), "sys_path": list(sys.path),
              "batch": name}
    # the batch's spending as the workers report their calls, and as the store last said (docs/design-lab.md#budgets)
    known = None if budget is None else budget.total
    state: dict[str, Any] = {"stopping": False, "deaths": 0, "stopped_by": "", "reported": known, "stored": known}
    started = time.monotonic()
    budget_at = time.monotonic()

    def spawn(index: int, share: int) -> _Child:
        ctx = _mp_context()
        ours, theirs = ctx.Pipe()
        settings = {**config, "concurrency": share, "index": index, "environ": dict(os.environ), "cwd": os.getcwd(),
                    "secrets": list(secret_values())}
        proc = ctx.Process(target=_serve, args=(theirs, settings), name=f"agentnb-batch-{name}-{index}")  # type: ignore[attr-defined]
        with _no_main_script():
            proc.start()
        theirs.close()
        child = _Child(index, share, proc, ours)
        threading.Thread(target=_read_messages, args=(child, inbox), daemon=True,
                         name=f"agentnb-proc{index}").start()
        children.append(child)
        return child

    def feed(child: _Child) -> None:
        # a few more than it runs at once: a slot that frees takes the next job at once, not after a round trip here
        while not state["stopping"] and todo and len(child.assigned) < child.share + max(1, child.share // 4) \
                and not child.closed:
            job_id = todo.popleft()
            child.assigned.append(job_id)
            child.send({"run": job_id})
        if not todo and not state["stopping"]:
            child.close({"done": True})  # it ends once its jobs have

    def stop_all(reason: str = "") -> None:
        if reason and not state["stopped_by"]:
            state["stopped_by"] = reason
        state["stopping"] = True
        for c in children:
            c.close({"stop": True})

    def ended(job_id: int) -> None:
        try:
            if on_end is not None:
                on_end(ws.job(job_id))
            if tally is not None:
                tally.ended(job_id)
        except BaseException as exc:  # a scorer's own failure is its score's error; this is the store's
            errors.append(exc)

    def handle(child: _Child, msg: dict[str, Any] | None) -> None:
        if msg is None:  # the end of its messages: the child has exited
            if child not in children:  # taken as ended already (``gone``)
                return
            child.proc.join()
            rc = child.proc.exitcode
            left = list(child.assigned)
            child.assigned.clear()
            children.remove(child)
            if rc == 0 and not left:
                return
            if not child.ready:
                errors.append(AgentnbError(f"a worker process of the batch could not start (exit code {rc})"
                                           + (f": {child.last_err}" if child.last_err else "")))
                stop_all()
                return
            if left:
                todo.extendleft(reversed(left))  # first again, in their order
            if state["stopping"]:
                return
            state["deaths"] += 1
            if state["deaths"] > _MAX_DEATHS:
                errors.append(AgentnbError(f"worker processes of the batch died {state['deaths']} times (the last "
                                           f"with exit code {rc}); see their lines above"))
                stop_all()
                return
            say(f"agentnb: a worker process of the batch ended (exit code {rc}) with {len(left)} job(s) in hand; "
                "a new one takes them over")
            feed(spawn(child.index, child.share))
            return
        kind = next(iter(msg))
        if kind == "log":  # a line it wrote on stderr (a warning, say)
            child.last_err = str(msg["log"])
            say(child.last_err)
        elif kind == "ready":
            child.ready = True
        elif kind in ("ended", "skipped", "not_started", "failed"):
            job_id = int(msg[kind])
            if job_id in child.assigned:
                child.assigned.remove(job_id)
            if kind == "ended":
                # a job's end comes once, but for one whose worker was taken as ended (``gone``) before its last
                # messages came, handed out again and found ended by another: scored once all the same
                again = job_id in report.statuses
                report.statuses[job_id] = str(msg["status"])
                if not again:
                    done: Future[None] = Future()
                    scored.append(done)
                    scoring.submit(_scoring, done, ended, job_id)
            elif kind == "skipped":
                report.skipped.append(job_id)
            elif kind == "not_started":
                report.not_started.append(job_id)
            else:
                errors.append(AgentnbError(f"job {job_id} (worker process {child.index}): {msg['error']}"))
            if child in children:  # not one taken as ended already (``gone``), whose last messages come late
                feed(child)
        elif kind == "cpu":
            report.worker_cpu_s += float(msg["cpu"])
        elif kind == "gate":  # a 429 one child got: every other one backs off too
            for other in children:
                if other is not child:
                    other.send(msg)
        elif kind == "cost" and budget is not None:  # a call of that child's, priced: the batch's total grows
            cost = msg["cost"]
            state["reported"] = None if cost is None or state["reported"] is None else state["reported"] + cost
            settle(budget)
        elif kind == "budget":
            stop_all(str(msg["budget"]))

    def settle(budget: Any) -> None:
        # the workers' reported calls and the store's rows are two lower bounds of one spending (BatchBudget.settle)
        budget.settle(state["reported"], state["stored"])
        if budget.reached.is_set() and not state["stopping"]:
            stop_all(budget.reason())

    def refresh(final: bool = False) -> None:
        if bar is not None and tally is not None:
            running = sorted(j for c in children for j in c.assigned)
            tally.draw(bar, dict(report.statuses), len(report.skipped), running, final=final)

    def gone() -> None:
        # a child's end normally comes as the end of its messages; a child that exited without it still ends
        now = time.monotonic()
        for child in list(children):
            if child.proc.exitcode is None:
                continue
            if child.exited_at is None:
                child.exited_at = now
            elif now - child.exited_at >= _GONE_AFTER:
                handle(child, None)

    def loop() -> None:
        nonlocal budget_at
        looked = time.monotonic()
        while children:
            # a message is taken and acted on whole: a Ctrl-C cutting in between would lose it (a child's end lost
            # so is waited for ever), or cut a message to a child in half
            with held_interrupts():
                try:
                    child, msg = inbox.get(timeout=_TICK)
                except queue.Empty:
                    pass
                else:
                    handle(child, msg)
                if time.monotonic() - looked >= _TICK:
                    looked = time.monotonic()
                    gone()
            refresh()
            # each child's calls are added here as they commit ("cost"); the store's total, which also has the calls
            # of subtasks, is read again every second (docs/design-lab.md#budgets)
            if budget is not None and not state["stopping"] and time.monotonic() - budget_at >= LIVE_EVERY:
                budget_at = time.monotonic()
                state["stored"] = spent(ws.store, budget.name)
                settle(budget)

    try:
        with sigterm_interrupts():
            try:
                if job_ids:
                    with held_interrupts():  # each child started and told its first jobs whole
                        for index, share in enumerate(_shares(concurrency, processes)):
                            spawn(index, share)
                        for child in list(children):
                            feed(child)
                loop()
            except BaseException:
                report.interrupted = True
                _wait_paused(stop_all, loop, children, say)
                raise
    finally:
        report.not_started.extend(todo)
        todo.clear()
        late = _wait_scorers(scoring, scored, report.interrupted, say)  # a Ctrl-C once every job had ended
        report.interrupted = report.interrupted or late is not None
        for child in children:  # only after an error of our own: told to stop, they pause their jobs and exit
            child.close({"stop": True})
            child.proc.join()
        finish_run(report, job_ids, name=name, out=out, resume=resume, bar=bar, tally=tally, refresh=refresh,
                   started=started, failed=bool(errors), stopped_by=state["stopped_by"])
    if late is not None:
        raise late
    if errors:
        raise errors[0]
    return report


def _scoring(done: Future[None], ended: Callable[[int], None], job_id: int) -> None:
    """Score ``job_id`` (``ended``) in a scorer thread, unless ``done`` was cancelled first; ``done`` says when."""
    if not done.set_running_or_notify_cancel():
        return
    try:
        ended(job_id)
    finally:
        done.set_result(None)


def _wait_scorers(scoring: ThreadPoolExecutor, scored: list[Future[None]], interrupted: bool,
                  say: Callable[[str], None]) -> BaseException | None:
    """Wait for the scorers: after a stop only for those already running, the others are not started (the batch
    scores its ended jobs that have no score when it is resumed).  A Ctrl-C while they run (every job has ended)
    drops those not started too, and is returned, to be raised once the batch's line is said; any further one is
    said once and ignored: a scorer cannot be cut off, and one left running would write its score after the batch
    returned (and the resume, finding none yet, would score its job again).

    ``scored`` are waited for, not the pool's threads: on Python before 3.13 a Ctrl-C that lands in
    ``Thread.join`` marks the thread it waited for as ended though it runs on (CPython issue 90882), so a
    ``shutdown(wait=True)`` asked again returned with that scorer still running.  They are made before each job is
    submitted, so one whose ``submit`` a Ctrl-C cut short is waited for or cancelled too (each is waited for by its
    ``result``: ``concurrent.futures.wait`` would wait for ever for one cancelled that no thread takes)."""
    def cancel() -> None:
        for done in scored:
            done.cancel()  # those not started; a running one goes on

    def settled() -> None:
        for done in scored:
            with contextlib.suppress(CancelledError):
                done.result()

    if interrupted:
        cancel()
    scoring.shutdown(wait=False)
    came: BaseException | None = None
    said = False
    while True:
        try:
            settled()
            scoring.shutdown(wait=True)  # each thread done with its scorer: they only end now
            return came
        except BaseException as exc:
            if came is None and not interrupted:
                came = exc
                cancel()
            if not said:
                said = True
                say("agentnb: waiting for the scorers already running (they end by themselves); the jobs not scored "
                    "yet are scored when the batch is resumed")


def _wait_paused(stop_all: Callable[[], None], loop: Callable[[], None], children: list[_Child],
                 say: Callable[[str], None]) -> None:
    """After a stop: tell every child to stop, then go on handling their messages until each has paused its jobs and
    exited.  A second Ctrl-C (or SIGTERM) meanwhile is said once and ignored: leaving now would leave jobs running
    unwatched."""
    said = False
    stopped = False
    while children:
        try:
            if not stopped:
                with held_interrupts():  # each child told whole
                    stop_all()
                    stopped = True
            loop()
        except BaseException:
            if not said:
                said = True
                n = sum(len(c.assigned) for c in children)
                # handed out, started or not (the children say when a job ends, not when it starts)
                say(f"agentnb: still pausing the {n} job(s) handed to {len(children)} worker process(es); each "
                    "running one stops after its current LLM call")


def _read_messages(child: _Child, inbox: queue.Queue[tuple[_Child, dict[str, Any] | None]]) -> None:
    try:
        while True:
            try:
                msg = child.conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, dict) and msg:
                inbox.put((child, msg))
    finally:
        inbox.put((child, None))
