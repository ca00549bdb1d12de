"""One worker process of a batch run in several processes (agentnb/processes.py; docs/design-lab.md#processes).

:func:`serve` runs in a process forked from multiprocessing's fork server (or spawned), with one end of a pipe to
the batch's process.  It receives its settings (the workspace to open, the environment, working folder, ``sys.path``
and secret values of the batch's process, the modules of the batch's tools, its share of the concurrency), then
messages — ``run`` (a job id), ``gate`` (a 429 another process got), ``stop``, ``done`` — and sends one message per
thing that happened: ``ready``, ``ended``, ``skipped``, ``not_started``, ``failed``, ``gate``, ``cost``,
``budget``, ``cpu`` (its CPU seconds, last), and
``log`` for each line written on ``sys.stderr`` (or ``sys.stdout``), which the batch's process shows.

The end of the pipe (the batch's process gone) asks the running jobs to pause after their current call, as
``stop`` does.  Ctrl-C is ignored here: a terminal sends it to the whole process group, and the batch's process
decides what a Ctrl-C does.

The imports are at the top, not in :func:`serve`: the fork server preloads this module, so a worker forked from it
starts with agentnb and the ``openai`` client already imported.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import runpy
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from . import processes
from ._secrets import register_secret
from .budgets import BatchBudget, batch_limit
from .executor import run_or_skip
from .models import openai as _openai  # noqa: F401  (preloaded: the client and its types)
from .models import ratelimit
from .workspace import Workspace

__all__ = ["serve"]

_TICK = 0.25
# once told that no more jobs come, the loop waits for its last jobs to end: a 0.25 s poll of the pipe held each
# worker up to a tick after its last job, 4–6% of a 4 s batch (benchmarks/README.md); 10 ms costs a few wake-ups
_CLOSING_TICK = 0.01


def _preload() -> None:
    """What every worker would otherwise load in its first job (a quarter of a worker's CPU in a 400-job batch): the
    ``openai`` package, which the model imports at its first call, and the bundled tokenizers.  Run when the fork
    server imports this module, once; the workers forked from it share them."""
    import openai  # noqa: F401

    from .engine.tokens import counter_for_model

    for model in ("gpt-4o", "gpt-4"):  # o200k_base, cl100k_base
        counter_for_model(model).count("warm")


_preload()


class _Lines:
    """A text stream that sends each whole line it is given to the batch's process."""

    def __init__(self, send: Any) -> None:
        self._send = send
        self._buffer = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._buffer += text
            *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            if line.strip():
                self._send({"log": line})
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def serve(conn: Connection, config: dict[str, Any]) -> None:
    """Run the jobs the batch's process hands over on ``conn`` until it says ``done`` or ``stop`` (or is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out_lock = threading.Lock()

    def send(msg: dict[str, Any]) -> None:
        # the batch's process gone: nobody to tell, the jobs still pause
        with out_lock, contextlib.suppress(BrokenPipeError, OSError, ValueError):
            conn.send(msg)

    # as a freshly started process would have them: the fork server keeps those of when it started
    os.environ.clear()
    os.environ.update(config["environ"])
    os.chdir(config["cwd"])
    sys.path[:0] = [p for p in config.get("sys_path", []) if p not in sys.path]
    for value in config.get("secrets", []):
        register_secret(value)
    sys.stdout = sys.stderr = _Lines(send)
    try:
        for how, what in config.get("imports", []):
            if how == "module":
                importlib.import_module(what)
            else:  # a script's __main__: its tools, not its main block (as multiprocessing runs it)
                processes.importing_script = what
                try:
                    runpy.run_path(what, run_name="__mp_main__")
                finally:
                    processes.importing_script = None
        args = dict(config["workspace"])
        ws = Workspace(args.pop("path"), **args)
    except Exception as exc:  # one line, as the batch's process says it (not a traceback a line at a time)
        send({"log": f"agentnb: a worker process of the batch could not start: {type(exc).__name__}: "
                     + " ".join(str(exc).split())})
        raise SystemExit(1) from None
    name = str(config["batch"]) if config.get("batch") else None
    stopping = threading.Event()
    active: set[int] = set()
    lock = threading.Lock()
    pending = [0]  # jobs handed over and not yet ended here
    limit = batch_limit(ws.store, name, None) if name else None
    budget = None if limit is None or name is None else BatchBudget(ws.store, name, limit, {
        r.id: r.model for r in ws.store.jobs(batch=name)}, ws.execution.pause_soon,
        on_cost=lambda cost: send({"cost": cost}))  # the batch's process adds up every process's calls
    if budget is not None:
        budget.running = active
    stop_gate = ratelimit.on_throttle(lambda key, delay: send({"gate": [key[0], key[1], delay]}))

    def one(job_id: int) -> None:
        try:
            with lock:
                if stopping.is_set() or (budget is not None and budget.reached.is_set()):
                    send({"not_started": job_id})
                    return
                active.add(job_id)
            try:
                job = run_or_skip(ws, job_id)
                # None: another process (not of this batch) runs it
                send({"skipped": job_id} if job is None else {"ended": job_id, "status": str(job.status)})
            except BaseException as exc:
                send({"failed": job_id, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            with lock:
                active.discard(job_id)
                pending[0] -= 1

    told: list[bool] = []  # the budget's reached: said once

    def watch() -> None:
        if budget is not None:
            budget.tick()
            if budget.reached.is_set() and not told:
                told.append(True)
                send({"budget": budget.reason()})
                stopping.set()
        if stopping.is_set():
            # asked again on every tick: a job whose run had not yet begun would forget an earlier stop
            with lock:
                running = sorted(active)
            for job_id in running:
                ws.stop(job_id)

    pool = ThreadPoolExecutor(max_workers=max(1, int(config.get("concurrency", 1))), thread_name_prefix="agentnb-job")
    send({"ready": os.getpid()})
    closing = gone = False
    try:
        while True:
            with lock:
                idle = pending[0] == 0
            if closing and idle:
                break
            watch()
            if gone:
                stopping.wait(_TICK)
                continue
            try:
                if not conn.poll(_CLOSING_TICK if closing else _TICK):
                    continue
                msg = conn.recv()
            except (EOFError, OSError):  # the batch's process is gone: pause what runs, start nothing more
                stopping.set()
                closing = gone = True
                continue
            if "run" in msg:
                with lock:
                    pending[0] += 1
                pool.submit(one, int(msg["run"]))
            elif "gate" in msg:
                endpoint, model, delay = msg["gate"]
                ratelimit.throttle_heard((endpoint, model), float(delay))
            elif "stop" in msg:
                stopping.set()
                closing = True
            elif "done" in msg:
                closing = True
        pool.shutdown(wait=True)
        # what this worker cost, for the batch's report: user + system time of all its threads (resource.getrusage
        # gives the same, but the resource module does not exist on Windows)
        send({"cpu": time.process_time()})
    finally:
        stop_gate()
        if budget is not None:
            budget.close()
        ws.close()
