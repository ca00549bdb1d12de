"""One worker process of a batch run in several processes (agentnb/processes.py; docs/design-lab.md#processes).

Started by the batch's process as ``python -m agentnb._batch_child``.  It reads JSON lines on stdin — its settings
first (the workspace to open, the modules of the batch's tools, its share of the concurrency), then ``run`` (a
job id), ``gate`` (a 429 another process got), ``stop``, ``done`` — and writes one JSON line per thing that
happened (``ready``, ``ended``, ``skipped``, ``not_started``, ``failed``, ``gate``, ``budget``) on what was its
stdout.  File descriptor 1 is pointed at stderr first, so a print anywhere in the process cannot break the
protocol, and stderr is shown by the batch's process.

The end of stdin without ``done`` means the batch's process is gone (or stopped the batch): the running jobs are
asked to pause after their current call, as ``stop`` asks.  Ctrl-C is ignored here: a terminal sends it to the
whole process group, and the batch's process decides what a Ctrl-C does.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_TICK = 0.25


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out_lock = threading.Lock()

    def send(msg: dict[str, Any]) -> None:
        # the batch's process gone: nobody to tell, the jobs still pause
        with out_lock, contextlib.suppress(BrokenPipeError, OSError, ValueError):
            proto.write(json.dumps(msg) + "\n")

    first = sys.stdin.readline()
    if not first:
        return 0
    config = json.loads(first)
    sys.path[:0] = [p for p in config.get("sys_path", []) if p not in sys.path]
    for how, what in config.get("imports", []):
        if how == "module":
            importlib.import_module(what)
        else:  # a script's __main__: its tools, not its main block (as multiprocessing runs it)
            sys.modules["__mp_main__"] = sys.modules["__main__"]
            runpy.run_path(what, run_name="__mp_main__")

    from .budgets import BatchBudget, batch_limit
    from .errors import StoreError
    from .models import ratelimit
    from .store.base import JobStatus
    from .workspace import Workspace

    args = dict(config["workspace"])
    ws = Workspace(args.pop("path"), **args)
    name = config.get("batch")
    stopping = threading.Event()
    active: set[int] = set()
    lock = threading.Lock()
    limit = batch_limit(ws.store, name, None) if name else None
    budget = None if limit is None else BatchBudget(ws.store, name, limit, {
        r.id: r.model for r in ws.store.jobs(batch=name)}, ws.execution.pause_soon)
    if budget is not None:
        budget.running = active
    stop_gate = ratelimit.on_throttle(lambda key, delay: send({"gate": [key[0], key[1], delay]}))

    def one(job_id: int) -> None:
        with lock:
            if stopping.is_set() or (budget is not None and budget.reached.is_set()):
                send({"not_started": job_id})
                return
            active.add(job_id)
        try:
            try:
                job = ws.run(job_id)
            except StoreError:
                if ws.store.job(job_id).status != JobStatus.running:
                    raise
                send({"skipped": job_id})  # another process (not of this batch) runs it
                return
            send({"ended": job_id, "status": str(job.status)})
        except BaseException as exc:
            send({"failed": job_id, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            with lock:
                active.discard(job_id)

    finished = threading.Event()

    def watch() -> None:
        told = False
        while not finished.wait(_TICK):
            if budget is not None:
                budget.tick()
                if budget.reached.is_set() and not told:
                    told = True
                    send({"budget": budget.reason()})
                    stopping.set()
            if stopping.is_set():
                # asked again on every tick: a job whose run had not yet begun would forget an earlier stop
                with lock:
                    running = sorted(active)
                for job_id in running:
                    ws.stop(job_id)

    watcher = threading.Thread(target=watch, daemon=True, name="agentnb-child-watch")
    watcher.start()
    pool = ThreadPoolExecutor(max_workers=max(1, int(config.get("concurrency", 1))), thread_name_prefix="agentnb-job")
    send({"ready": os.getpid()})
    try:
        done = False
        for line in sys.stdin:
            msg = json.loads(line)
            if "run" in msg:
                pool.submit(one, int(msg["run"]))
            elif "gate" in msg:
                endpoint, model, delay = msg["gate"]
                ratelimit.throttle_heard((endpoint, model), float(delay))
            elif "stop" in msg:
                stopping.set()
            elif "done" in msg:
                done = True
                break
        if not done:
            stopping.set()
        pool.shutdown(wait=True)
    finally:
        finished.set()
        watcher.join()
        stop_gate()
        if budget is not None:
            budget.close()
        ws.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
