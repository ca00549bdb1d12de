"""Running many jobs at once in this process (``ws.batch``; DESIGN §10).

Each job runs in a thread of its own through the workspace (``ws.run``), so one job's events stay
in order and every write goes through the store's single connection.  Ctrl-C (a notebook's stop
button) asks every running job to pause after its current LLM call, waits for them, and re-raises.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

__all__ = ["JobRunnerHost", "run_jobs"]


class JobRunnerHost(Protocol):
    """What the executor drives: the workspace facade."""

    def run(self, job: Any, *, subtasks: bool = True) -> Any: ...

    def stop(self, job: Any) -> list[int]: ...


def run_jobs(ws: JobRunnerHost, job_ids: Sequence[int], *, concurrency: int, progress: bool = False,
             batch: Any = None, on_end: Callable[[Any], None] | None = None) -> None:
    """Run ``job_ids`` with up to ``concurrency`` at once; ``on_end(job)`` after each (in its thread)."""
    lock = threading.Lock()
    started: set[int] = set()

    def one(job_id: int) -> Any:
        with lock:
            started.add(job_id)
        job = ws.run(job_id)
        if on_end is not None:
            on_end(job)
        return job

    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="agentnb-job")
    futures: dict[Future[Any], int] = {}
    try:
        for job_id in job_ids:
            futures[pool.submit(one, job_id)] = job_id
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            for f in done:
                f.result()
    except BaseException:
        for f in futures:
            f.cancel()
        with lock:
            running = list(started)
        for job_id in running:
            ws.stop(job_id)
        pool.shutdown(wait=True)
        raise
    pool.shutdown(wait=True)
