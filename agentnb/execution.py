"""A job's life in this process, in one place: claim → lease → work directory → activate → advance → release.

:class:`Execution` is what the facade (``ws.run``/``ws.step``/``ws.iter``/``ws.stop``), the queue worker and
the executor's slots run jobs through.  It claims a job (:meth:`Store.claim`), holds its lease while it runs
(:func:`agentnb.leases.holding`), materialises its work directory where files live in the store
(:mod:`agentnb.engine.jobfiles`), builds the enriched instruction once per activation, advances the job by one
LLM call, one movement or to its end (:meth:`agentnb.engine.runner.JobRunner.advance`), and then writes what
becomes of it: released to the queue (paused after a unit, stopped, interrupted, cut off from the store), or
failed (its model or piece cannot be set up).  Every status this process writes about running a job is
written here; what the job itself decides (a movement's transition, an abort, a wait) the engine writes.

It sits below the facade, the worker and the executor (which use it; tests/test_architecture.py checks that it
imports none of them) and above the engine, the leases and the store, which it drives.  It is not in
``agentnb/engine/``: the engine runs one claimed job and knows nothing of claims and leases, which are
:mod:`agentnb.leases`' (beside it, above the store); and the worker must not import the engine's internals to run
a job, only this.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import live
from .engine.callcache import reuse_clock, with_cache
from .engine.jobfiles import FileCache, local_workdir, materialise
from .engine.prompts import activation_instruction, clock_block
from .engine.runner import JobRunner
from .engine.subtasks import notify_parent
from .engine.workdir import prepare_workdir
from .errors import StoreError
from .events import ErrorEvent
from .leases import holding
from .models.factory import resolve_model
from .store import reads
from .store.base import (
    INTERRUPTED_REASON,
    STOP_CUT_REASON,
    STOP_REASON,
    TERMINAL_STATES,
    UNREACHABLE_REASON,
    JobStatus,
    LeaseLost,
    Store,
    StoreUnreachable,
    owned_by_this_process,
)
from .store.records import JobRecord

__all__ = ["Execution"]
# the statuses of a job whose run has not ended, for a stop to reach its subtasks
_ACTIVE = (JobStatus.running, JobStatus.waiting_subtasks)


class Execution:
    """Runs the jobs of one store in this process: ``root/jobs/<id>`` are their work directories, ``lease``
    the seconds a claim holds a job without renewal, ``files_limit`` the bytes of files a job may keep in the
    store, ``model_settings`` the retry settings of a model whose job sets none.

    Thread-safe: the executor runs jobs in threads of their own through one Execution.  Between two claims in
    this process it keeps a job's runner (its state in memory) while the job is as that runner left it.
    """

    def __init__(self, store: Store, root: Path, *, lease: float, files_limit: int,
                 model_settings: Mapping[str, Any]) -> None:
        self.store = store
        self.root = root
        self.lease = lease
        self.files_limit = files_limit
        self.model_settings = dict(model_settings)
        self._runners: dict[int, tuple[JobRunner, tuple[Any, ...]]] = {}
        # job → its work directory's hashes as this process last saw them (engine/_filecache.py), from the claim's
        # materialise to the write-backs of its runner; forgotten when the job ends here
        self._file_caches: dict[int, FileCache] = {}
        self._lock = threading.RLock()
        self._stops: dict[int, threading.Event] = {}

    # -- claims --------------------------------------------------------------------------------------------
    def claim(self, job_id: int) -> JobRecord | None:
        """Claim job ``job_id``: its row, or None when it is not queued; a :class:`StoreError` when another
        process (or thread) runs it, or when there is no such job."""
        row = self.store.claim(job_id)
        if row is None:
            current = self.store.job(job_id)
            if current.status == JobStatus.running:
                raise StoreError(f"job {job_id} is already running ({current.claimed_by})")
        return row

    def claim_next(self) -> JobRecord | None:
        """Claim the oldest queued job (recovering expired leases first): its row, or None when none is queued."""
        return self.store.claim()

    # -- whole runs ----------------------------------------------------------------------------------------
    def run(self, job_id: int, *, subtasks: bool = True) -> str:
        """Run a job until it ends, waits for a human or is stopped, with its subtasks unless ``subtasks=False``;
        its status then."""
        with self._lock:
            self._stops.pop(job_id, None)  # a Stop meant for an earlier run must not end this one
        while True:
            row = self.claim(job_id)
            status = self.status(job_id) if row is None else self.run_claimed(row, unit="job")
            if row is not None and status == JobStatus.queued:  # stopped
                return status
            if status == JobStatus.waiting_subtasks and subtasks and self._run_children(job_id):
                continue
            return status

    def _run_children(self, job_id: int) -> bool:
        """Run the queued children of a waiting parent; True when the parent is queued again."""
        for child in self.store.jobs(parent_id=job_id):
            stop = self._stops.get(job_id)
            if stop is not None and stop.is_set():
                break  # the parent was stopped: start no further subtask
            # a child waiting for its own subtasks may have grandchildren that are ready to run
            if self.status(child.id) in (JobStatus.queued, JobStatus.waiting_subtasks):
                try:
                    self.run(child.id)
                except StoreError:
                    continue  # claimed by another worker meanwhile
        return self.status(job_id) == JobStatus.queued

    def step(self, job_id: int, unit: str) -> str:
        """Run one ``movement`` or one ``call`` of a queued job; its status then (unchanged when not queued)."""
        with self._lock:
            self._stops.pop(job_id, None)  # a Stop meant for an earlier run must not cut this step short
        row = self.claim(job_id)
        return self.status(job_id) if row is None else self.run_claimed(row, unit=unit)

    def status(self, job_id: int) -> str:
        row = self.store.job_columns(job_id, ("status",))
        if row is None:
            raise StoreError(f"no job {job_id} in {self.store.path}")
        return str(row["status"])

    # -- one claimed run -----------------------------------------------------------------------------------
    def run_claimed(self, row: JobRecord, unit: str) -> str:
        """Run the job this process just claimed (``row``, from a claim) by ``unit``, holding its lease
        meanwhile; its status then.

        A job whose lease was lost (this process was frozen or cut off past it, and another claimer took it
        back, or may have: the store did not answer for a whole lease) stops here, at its first write or its next
        LLM or tool call, whichever comes first: nothing more is run or written for it, it is not marked failed,
        and the caller goes on.
        """
        job_id = row.id
        try:
            with holding(self.store, row, self.lease) as held:
                try:
                    return self._run_leased(row, unit, held.check)
                except StoreUnreachable:
                    self._cut_off(job_id)
                    raise
        except LeaseLost:
            self.forget(job_id)
            print(f"job {job_id}: lease lost to another worker; stopping", file=sys.stderr, flush=True)
            return self.status(job_id)

    def _run_leased(self, row: JobRecord, unit: str, lease: Callable[[], None]) -> str:
        job_id = row.id
        if self.store.keeps_files:  # it may have run elsewhere: its files as of its last movement end
            try:
                prepare_workdir(self.root, job_id, None)
                materialise(self.store, job_id, local_workdir(self.root, row, True),
                            self._file_caches.setdefault(job_id, FileCache()))
            except StoreUnreachable:
                raise  # not the job's failure (_cut_off)
            except Exception as exc:
                return self._fail_setup(job_id, exc)
        # built outside the lock: only the thread that claimed the job builds its runner, and under the lock every
        # job start (and end: forget) of a batch waited for each other's store reads and model set-up, and for
        # as long again when the builder lost the GIL (benchmarks/README.md)
        try:
            runner = self._runner(row)
        except StoreUnreachable:
            raise
        except Exception as exc:  # the model or piece cannot be set up: the job fails, visibly
            return self._fail_setup(job_id, exc)
        with self._lock:
            stop = self._stops.setdefault(job_id, threading.Event())
        self._activate(row, runner)
        try:
            # a movement can take many calls: Stop pauses it after the current one, as it does a run
            # and the lease is checked before every LLM call and tool call (a lost one raises LeaseLost)
            # and a streaming model call stops at once when it is set (docs/models.md#streaming), whatever the unit
            status = runner.advance(unit, stop if unit != "call" else None, lease, cancel=stop)
        except (LeaseLost, StoreUnreachable):
            raise  # nothing may be written for the job any more (run_claimed, _cut_off)
        except BaseException:
            # A KeyboardInterrupt (a notebook's stop button) or SystemExit mid-call: give the job back
            # to the queue, resumable from its events.  A model call cut short is asked again; a tool
            # call cut short is completed as after a crash (a started one with effects is never rerun).
            runner.rec.pending.clear()
            self.forget(job_id)
            # a streamed call the interrupt cut off is recorded as a Stop's (engine/loop.py): said as one
            self._release(job_id, STOP_CUT_REASON if runner.rec.cut else INTERRUPTED_REASON)
            raise
        stopped = stop.is_set()
        if stopped and status != JobStatus.waiting_subtasks:
            stop.clear()  # a parent that just handed out subtasks keeps it: they do not start (_run_children)
        cut, runner.rec.cut = runner.rec.cut, False
        if status == JobStatus.running:
            reason = (STOP_CUT_REASON if cut else STOP_REASON) if stopped else f"paused after one {unit}"
            with self.store.transaction() as c:
                self.store.set_status(c, job_id, JobStatus.queued, reason=reason)
        if status in TERMINAL_STATES:
            # nothing claims an ended job again but a retry, which builds its runner from the store: a batch or a
            # worker that runs thousands of jobs keeps none of theirs (nor reads the job back to keep it)
            self._file_caches.pop(job_id, None)
            self.forget(job_id)
        else:
            self._keep(row, runner)
        return self.status(job_id)

    def _runner(self, row: JobRecord) -> JobRunner:
        """The job's runner: the one kept from its last claim here while the job is as it left it, else a new one."""
        job_id = row.id
        mark = reads.runner_mark(self.store, job_id)
        with self._lock:
            cached = self._runners.get(job_id)
        if cached is not None and cached[1] == mark:
            return cached[0]
        opts = row.options
        mine = {"retries": opts.retries, "max_backoff": opts.max_backoff}
        settings = {**self.model_settings, **{k: v for k, v in mine.items() if v is not None}}
        model = with_cache(resolve_model(row.model, store=self.store, epoch=reads.epoch_of(self.store, row), **settings),
                           self.store, row)
        runner = JobRunner(self.store, row, model, self.root / "jobs", files_limit=self.files_limit,
                           file_cache=self._file_caches.setdefault(job_id, FileCache()) if self.store.keeps_files else None,
                           options=opts)
        with self._lock:
            self._runners[job_id] = (runner, mark)
        return runner

    def _keep(self, row: JobRecord, runner: JobRunner) -> None:
        # Kept for the next claim in this process only while the job is still as this runner left it: the mark
        # (the last movement event, the open movement — a retry reopens a failed one without writing a movement
        # event — and the options, which a retry may change) is read before the claim generation, so an unchanged
        # generation means no other claimer (a slot here, which re-claimed a parent whose subtasks ended
        # meanwhile, or another process) wrote after it, and a stale runner never goes in under a newer mark.
        job_id = row.id
        with self._lock:
            mark = reads.runner_mark(self.store, job_id)
            if self.store.job(job_id).lease_gen == row.lease_gen:
                self._runners[job_id] = (runner, mark)

    def _activate(self, row: JobRecord, runner: JobRunner) -> None:
        """Build the enriched instruction once per activation (first start, or after a wait); the runner stores
        it with the next movement it starts (JobRunner.activation)."""
        if row.enriched:
            runner.activation = None
            return
        clock = self._recorded_clock(row)
        enriched = activation_instruction(self.store, row, language=runner.piece.language, clock=clock,
                                          workdir=runner.workdir)
        if clock is None:  # a cached job's first activation of its kind records its clock, the others reuse it
            enriched = reuse_clock(self.store, row, enriched)
        runner.activation = enriched

    def _recorded_clock(self, row: JobRecord) -> str | None:
        """The date and time a replay, or a fork up to its fork point, puts in its prompts: its original's
        for the movement run about to start, so that those prompts are the original's (docs/fork-compare.md)."""
        seq = row.movement_seq + 1
        source: int | None = None
        if row.forked_from_job and seq <= (row.forked_from_seq or 0):
            source = row.forked_from_job
        elif row.model.startswith("replay:") and row.model[7:].isdigit():
            source = int(row.model[7:])
        if source is None:
            return None
        try:
            starts = self.store.events(source, kinds=["movement_start"], movement_seq=seq)
        except StoreError:
            return None
        user = getattr(starts[0], "user", "") if starts else ""
        return clock_block(user) if user else None

    # -- what becomes of a job that does not go on here ------------------------------------------------------
    def _release(self, job_id: int, reason: str) -> None:
        """Give a job this process was running back to the queue, resumable from its events."""
        with self.store.transaction() as c:
            if self.store.job(job_id).status == JobStatus.running:
                self.store.set_status(c, job_id, JobStatus.queued, reason=reason)

    def _cut_off(self, job_id: int) -> None:
        """The store became unreachable while this process ran the job (a server restart, a network cut): the job
        has not failed, and what it committed stands.  It goes back to the queue if the store answers again
        within the pool's wait, to go on from its last commit; else it stays ``running`` until its lease runs
        out and a claim takes it back (``recovered: lease expired``), as after a crash."""
        self.forget(job_id)  # its state in memory may be ahead of the store's
        with contextlib.suppress(StoreError):  # still unreachable, or the lease lost meanwhile: its lease decides
            self._release(job_id, UNREACHABLE_REASON)

    def _fail_setup(self, job_id: int, exc: Exception) -> str:
        """The job's model, piece or files cannot be set up: it fails, with the reason as an error event."""
        with self.store.transaction() as c:
            self.store.append([ErrorEvent(job_id=job_id, ts=time.time(), message=str(exc), where="setup")], c)
            self.store.set_status(c, job_id, JobStatus.failed, reason=str(exc), error=str(exc))
            notify_parent(self.store, c, job_id)
        return JobStatus.failed

    def give_back(self, job_id: int) -> bool:
        """An interrupted worker's job whose run did not pause in time: back to the queue (reason
        ``interrupted``) if it is still running under this process (else it may already run elsewhere).
        True when it was given back."""
        with self.store.transaction() as c:
            row = self.store.job(job_id)
            if row.status == JobStatus.running and owned_by_this_process(row.claimed_by):
                self.store.set_status(c, job_id, JobStatus.queued, reason=INTERRUPTED_REASON)
                return True
        return False

    # -- requests from other threads -----------------------------------------------------------------------
    def stop(self, job_id: int) -> list[int]:
        """Ask a job run here to pause after its current LLM call, and its running subtasks with it; the ids
        asked (the job, then its running subtasks)."""
        asked: list[int] = []
        pending = [job_id]
        while pending:
            current = pending.pop(0)
            asked.append(current)
            with self._lock:
                self._stops.setdefault(current, threading.Event()).set()
            pending.extend(r.id for r in self.store.jobs(parent_id=current) if r.status in _ACTIVE)
        return asked

    def pause_soon(self, job_id: int) -> None:
        """Ask job ``job_id`` to pause after its current LLM call as :meth:`stop` does, but from any thread with no
        lock or store read (a live subscriber calls it under the store's lock); its subtasks are not reached."""
        self._stops.setdefault(job_id, threading.Event()).set()

    def forget(self, job_id: int) -> None:
        """Drop the job's runner kept in memory (a retry, an interrupt, a lost lease): the next claim builds
        one from the store."""
        with self._lock:
            self._runners.pop(job_id, None)

    # -- watching a job run here -----------------------------------------------------------------------------
    def subscribe(self, job_id: int | None, fn: Callable[[live.Item], None]) -> live.Subscription:
        """Call ``fn`` with each event of job ``job_id`` (None: of every job of this store) right after it commits
        in this process, in commit order, and with the engine's notices (a call started), until the returned
        subscription is closed (:mod:`agentnb.live`; docs/python-api.md#live-events).  A job another process
        runs publishes nothing here: read it from the store."""
        return live.subscribe(self.store, job_id, fn)
