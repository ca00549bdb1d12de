"""The queue worker: claims queued jobs and runs each through the workspace, one at a time or N at once.

One at a time (the default) the job runs in the calling thread, and SIGTERM (:func:`sigterm_interrupts`) cuts
its current call short and gives it back to the queue.  With ``concurrency=N`` the jobs run in N slot threads
(:func:`agentnb.executor.run_queue`, the executor ``ws.batch`` uses), each claiming the next queued job.  An
idle worker on PostgreSQL waits on ``LISTEN agentnb_jobs`` (woken when a job is queued) rather than polling.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from .executor import GRACE, Backoff, QueueReport, Wake, check_poll, check_slots, idle_wait, run_queue
from .interrupts import Terminated, sigterm_interrupts
from .store.base import StoreUnreachable

if TYPE_CHECKING:
    from .execution import Execution
    from .store.base import Store

__all__ = ["JobQueue", "Terminated", "Worker", "sigterm_interrupts"]

JobT = TypeVar("JobT", covariant=True)


class JobQueue(Protocol[JobT]):
    """What a worker drives: the workspace facade (:class:`agentnb.workspace.Workspace`), named here by
    what it does so that this module does not import the facade that imports it.  Its jobs run through its
    :class:`~agentnb.execution.Execution`."""

    @property
    def store(self) -> Store: ...

    @property
    def execution(self) -> Execution: ...

    def job(self, job: Any) -> JobT: ...


class Worker(Generic[JobT]):
    """Claims queued jobs and runs each until it ends or waits.

    SIGTERM (like Ctrl-C) gives the running jobs back to the queue, resumable, and raises
    :class:`Terminated`.  :attr:`ran` lists the jobs this worker ran, in the order their runs returned.
    """

    def __init__(self, workspace: JobQueue[JobT]) -> None:
        self.ws = workspace
        self.ran: list[int] = []

    def run_once(self) -> JobT | None:
        """Claim the oldest queued job and run it; ``None`` when the queue is empty."""
        with sigterm_interrupts():
            job_id = self._run_next()
            return None if job_id is None else self.ws.job(job_id)

    def _run_next(self) -> int | None:
        """:meth:`run_once` without reading the job back: the loop of :meth:`run` needs only whether one ran (two
        store reads a job fewer, each a fresh read of a file that other workers write).  Both callers hold
        ``sigterm_interrupts()`` around it."""
        row = self.ws.execution.claim_next()
        if row is None:
            return None
        try:
            self.ws.execution.run_claimed(row, unit="job")
            return row.id
        finally:
            # listed even when a SIGTERM lands between the job's last commit and here (as run_queue does)
            self.ran.append(row.id)

    def run(self, *, forever: bool = False, poll: float | None = None, max_jobs: int | None = None,
            concurrency: int = 1, grace: float = GRACE) -> int:
        """Run queued jobs until none is left and none of them runs (or forever); returns how many ran.

        ``concurrency``: jobs run at once (slot threads).  ``poll``: the idle wait between two claims (default
        1 s on SQLite; on PostgreSQL 5 s, a safety net, since a NOTIFY wakes the worker when a job is queued).
        ``grace``: on SIGTERM or Ctrl-C with several jobs running, how long they get to pause after their
        current call before the worker gives them back to the queue itself.
        """
        check_slots(concurrency)
        poll = check_poll(poll)
        if concurrency > 1:
            report = QueueReport()
            try:
                run_queue(self.ws.execution, concurrency=concurrency, forever=forever, poll=poll, max_jobs=max_jobs,
                          grace=grace, report=report)
            finally:
                self.ran.extend(report.ran)
            return len(report.ran)
        done = 0
        with sigterm_interrupts():
            wake = Wake(self.ws.store) if forever else None  # LISTEN only for a worker that waits
            outage = Backoff(idle_wait(poll, wake)) if wake is not None else None
            try:
                while max_jobs is None or done < max_jobs:
                    seen = wake.seen() if wake is not None else 0
                    try:
                        ran = self._run_next()
                    except StoreUnreachable:
                        if wake is None or outage is None:
                            raise  # a worker that drains the queue ends with the line (exit 2)
                        time.sleep(outage.next())
                        continue
                    if outage is not None:
                        outage.over()
                    if ran is None:
                        if wake is None:
                            break
                        wake.wait(seen, idle_wait(poll, wake))
                        continue
                    done += 1
            finally:
                if wake is not None:
                    wake.close()
        return done
