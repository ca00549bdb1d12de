"""The piece runner: a resumable state machine that drives one job through its movements.

:meth:`JobRunner.advance` runs one LLM call, one movement or the whole job: it starts a movement
(its prompts from :mod:`agentnb.engine.prompts`), makes calls (:class:`~agentnb.engine.loop.AgentLoop`),
finishes the movement (transition, lesson) and applies the typed next step
(:mod:`agentnb.engine.steps`).  Everything it decides is an event, written with the store's
bookkeeping of the job in one transaction.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from ..events import BudgetExceeded, ErrorEvent, Lesson, LoopDetected, Subtask, Transition
from ..models.base import Model, ModelError
from ..models.replay import Recording
from ..store import reads
from ..store.base import JobOptions, JobStatus, LeaseLost, StoreUnreachable
from ..store.records import JobRecord
from ..tools.base import ToolError, open_regular, unlinked_path
from ..tools.mcp import McpSession, McpStartError
from .budget import JobBudget
from .context import ContextManager, job_thresholds, window_for_model
from .jobfiles import (
    DEFAULT_FILES_LIMIT,
    FileCache,
    FilesOverLimit,
    WriteBack,
    local_workdir,
    logs_folder,
    plan_write_back,
)
from .loop import AgentLoop, CallCounters, Outcome, Recorder, ReplayDiverged
from .loops import Run, find_loop, judge_instruction, last_judgements
from .pieces import Movement, Piece, parse_piece
from .prompts import activation_instruction, clock_block, user_prompt
from .steps import Abort, Ask, Complete, Fail, GoTo, NextStep, WaitSubtasks, next_step
from .subtasks import Subtasks, capped, notify_parent

if TYPE_CHECKING:
    from ..store.base import Store

__all__ = ["JobRunner", "parse_stored_piece", "stored_piece"]


class JobRunner:
    """Drives one job; one instance per job per process, rebuilt from the store when needed."""

    def __init__(self, store: Store, job: JobRecord, model: Model, jobs_root: Path, *,
                 files_limit: int = DEFAULT_FILES_LIMIT, file_cache: FileCache | None = None,
                 options: JobOptions | None = None) -> None:
        self.store = store
        self.job_id = job.id
        self.model = model
        self.piece: Piece = stored_piece(job)
        # the caller may have decoded them already (the execution, for the model's retry settings)
        self.options = job.options if options is None else options
        self.model_spec = job.model
        # where files live in the store, the job works under this process's own folder (engine/jobfiles.py)
        self.workdir = local_workdir(jobs_root.parent, job, store.keeps_files)
        self.files_limit = files_limit
        # what this process last hashed of the work directory (the claim's materialise filled it): the write-back
        # after each tool call reads only the files whose stat changed
        self.file_cache = FileCache() if file_cache is None else file_cache
        self.logs_dir = logs_folder(jobs_root.parent, job, store.keeps_files)
        self.rec = Recorder(store, self.job_id)
        if store.keeps_files:
            # a tool's result and the files it changed are stored together: a movement resumed on another
            # worker does not run a recorded tool again, so its effect on the files must be in the store
            self.rec.write_back = self._files
        self.subtasks = Subtasks(store, job_id=self.job_id, piece=self.piece, model_spec=self.model_spec,
                                 workdir=self.workdir, logs_dir=self.logs_dir)
        self.loop: AgentLoop | None = None
        # this activation's enriched instruction (Execution builds it at the claim) until the next movement start
        # stores it with the movement's row: only a movement's user prompt reads it, and a job that starts no
        # movement in this claim has it built again at the next one, so it costs no transaction of its own
        self.activation: str | None = None
        # the piece's MCP servers (docs/tools.md#mcp-tools): started when a run first needs them, stopped when
        # each advance() ends (the run ended, paused or failed)
        self.mcp = McpSession(self.piece.mcp_servers, self.workdir, self.logs_dir) if self.piece.mcp_servers else None
        # A fork (docs/fork-compare.md#fork) re-serves runs 1 … fork_seq-1 of job forked_from_job, each under the piece,
        # context settings and tokenizer of the job that ran it live, and runs live from fork_seq on.
        self.fork_seq = job.forked_from_seq or 0
        self.recording = (Recording(store, job.forked_from_job, before=self.fork_seq)
                          if job.forked_from_job else None)
        self.strict = bool(self.options.strict_replay)
        # the cost and token limits that hold the job (docs/design-lab.md#budgets): None when none does
        self.budget = JobBudget.of(store, job, lambda row: _piece_limits(self.piece if row.id == job.id else
                                                                           stored_piece(row)))
        by_movement = reads.calls_by_movement(store, self.job_id)
        self.counters = CallCounters(call_index=sum(by_movement.values()), by_movement=by_movement)
        open_mv = reads.open_movement(store, self.job_id)
        if open_mv is not None:
            seq = open_mv.seq
            self.loop = self._make_loop(self._movement(self._piece_at(seq), open_mv.name), seq)
            self.loop.resume(store.events(self.job_id, movement_seq=seq))

    # -- state ------------------------------------------------------------
    def job(self) -> JobRecord:
        return self.store.job(self.job_id)

    def _replayed(self, seq: int) -> bool:
        return self.recording is not None and seq < self.fork_seq

    def _live_row(self, seq: int) -> JobRecord:
        """The row of the job that ran re-served run ``seq`` live (the original, or its own original …)."""
        assert self.recording is not None
        return self.store.job(self.recording.live_job(seq))

    def _piece_at(self, seq: int) -> Piece:
        return stored_piece(self._live_row(seq)) if self._replayed(seq) else self.piece

    def _context_manager(self, seq: int, movement: Movement) -> ContextManager:
        piece, options, spec = self.piece, self.options, self.model.spec
        if self._replayed(seq):  # re-served: the ContextManager the run had, so budgets and actions match
            row = self._live_row(seq)
            piece, options, spec = stored_piece(row), row.options, row.model
        opts = options.context or {}
        window = opts.get("window_tokens") or piece.window_tokens or window_for_model(spec)
        thresholds = job_thresholds(piece.thresholds, options)
        # compaction (docs/context.md#compaction): the job's context= over the movement's context: over the piece's
        compaction = {key: next(v for v in (opts.get(key), getattr(movement, key), getattr(piece, key))
                                if v is not None)
                      for key in ("on_pressure", "compact_keep_last", "max_compactions")}
        return ContextManager(
            window=window, thresholds=thresholds, model=spec,
            min_tool_tokens=opts.get("min_tool_tokens") or piece.min_tool_tokens, **compaction,
        )

    def _make_loop(self, movement: Movement, seq: int) -> AgentLoop:
        # A subtask runs within the rights of the movement that created it, whatever its stored piece says:
        # the check at transition time is the first line, this is the second (a row written any other way).
        movement = capped(movement, self.options.subtask_cap)
        return AgentLoop(
            recorder=self.rec, movement=movement, seq=seq, model=self.model, ctx=self._context_manager(seq, movement),
            workdir=self.workdir, logs_dir=self.logs_dir, language=self._piece_at(seq).language,
            counters=self.counters, check_subtasks=lambda subtasks: self.subtasks.check(subtasks, movement),
            reserve=self.recording if self._replayed(seq) else None, strict=self.strict, mcp=self.mcp,
        )

    # -- driving ---------------------------------------------------------------
    def advance(self, unit: str = "job", stop: threading.Event | None = None,
                lease: Callable[[], None] | None = None, cancel: threading.Event | None = None) -> str:
        """Run one ``call``, one ``movement`` or the whole ``job`` (until it ends or waits).

        The job must be claimed (``running``).  Returns the job's status afterwards;
        a job with more to do is left ``running`` for the caller to release.  ``lease``, the check of the lease
        this process holds on the job (``leases.Held.check``), is called before every LLM call and tool call:
        the :class:`LeaseLost` it raises stops the job here as a refused write does.
        """
        self.rec.lease = lease
        self.rec.cancel = cancel
        try:
            return self._advance(unit, stop)
        finally:
            self.rec.lease = None
            self.rec.cancel = None
            if self.mcp is not None:
                self.mcp.close()

    def _advance(self, unit: str, stop: threading.Event | None) -> str:
        try:
            # a job at its limit makes no further call: checked before this run's first and after each (its tools done)
            if (over := self._over_budget()) is not None:
                return over
            while True:
                if self.loop is None and not self._start_movement():
                    return self.job().status
                assert self.loop is not None
                outcome = self.loop.call()
                if outcome is not None:
                    status = self._finish_movement(outcome)
                    if status == JobStatus.running and (over := self._over_budget()) is not None:
                        return over
                    if unit != "job" or status != JobStatus.running:
                        return status
                elif (over := self._over_budget()) is not None:
                    return over
                elif unit == "call":
                    return self._pause()
                if (stop is not None and stop.is_set()) or self.rec.cancelled():
                    return self._pause()
        except (LeaseLost, StoreUnreachable):
            # another claimer holds the job now, or the store went away mid-write (a server restart): not a
            # failure of the job, and nothing more is written for it here; the caller stops quietly, or gives
            # it back to go on from its last commit
            self.loop = None
            raise
        except ReplayDiverged as exc:
            return self._fail(str(exc), where="replay")
        except ModelError as exc:
            return self._fail(str(exc), where="model")
        except McpStartError as exc:
            return self._fail(str(exc), where="mcp")
        except FilesOverLimit as exc:  # a tool grew the work directory past the limit (Recorder.flush)
            return self._fail(str(exc), where="files", write_files=False)
        except Exception as exc:  # an engine bug must not lose the events or leave the job running
            return self._fail(f"{type(exc).__name__}: {exc}", where="engine")

    def _files(self) -> WriteBack | None:
        """What the work directory changed since the store last had it, where the store keeps files (None
        otherwise); :class:`FilesOverLimit` when it holds more than the limit."""
        if not self.store.keeps_files:
            return None
        return plan_write_back(self.store, self.job_id, self.workdir, self.files_limit, self.file_cache)

    def _pause(self) -> str:
        """Mid-movement (after one call, or stopped): the events so far and the files as they are, so that a
        worker elsewhere resumes the movement on them."""
        try:
            files = self._files()
        except FilesOverLimit as exc:
            return self._fail(str(exc), where="files", write_files=False)
        with self.store.transaction() as c:
            self.rec.flush(c)
            if files is not None:
                files.apply(self.store, c, self.job_id)
        return JobStatus.running

    def _fail(self, message: str, where: str, *, write_files: bool = True) -> str:
        loop = self.loop
        files: WriteBack | None = None
        note: str | None = None
        if write_files:  # the job ends: its files as it left them (not over the limit: then none, and say so)
            try:
                files = self._files()
            except FilesOverLimit as exc:
                note = str(exc)
            except OSError as exc:
                note = f"the work directory's files were not written back: {exc}"
        with self.store.transaction() as c:
            if note is not None:
                self.rec.add(ErrorEvent(job_id=self.job_id, movement_seq=loop.seq if loop else None,
                                        iteration=loop.iteration if loop else None, ts=time.time(),
                                        message=note, where="files"))
            if files is not None:
                files.apply(self.store, c, self.job_id)
            self.rec.add(ErrorEvent(job_id=self.job_id, movement_seq=loop.seq if loop else None,
                                    iteration=loop.iteration if loop else None, ts=time.time(),
                                    message=message, where=where))
            self.rec.flush(c)
            if loop is not None:
                self.store.fail_movement(c, self.job_id, loop.seq, iterations=loop.iteration)
            self.store.set_status(c, self.job_id, JobStatus.failed, reason=message, error=message)
            notify_parent(self.store, c, self.job_id)
        self.loop = None
        return JobStatus.failed

    def _over_budget(self) -> str | None:
        """Abort the job when it has reached a limit (docs/design-lab.md#budgets): its open movement ends with a
        forced ABORT, a ``budget`` event says which limit, and the status reason is ``budget: …``; None otherwise."""
        over = self.budget.exceeded(self.rec.pending) if self.budget is not None else None
        if over is None:
            return None
        loop, now = self.loop, time.time()
        try:
            files = self._files()
        except FilesOverLimit as exc:
            return self._fail(str(exc), where="files", write_files=False)
        with self.store.transaction() as c:
            if files is not None:
                files.apply(self.store, c, self.job_id)
            if loop is not None:
                self.rec.add(Transition(job_id=self.job_id, movement_seq=loop.seq, iteration=loop.iteration, ts=now,
                                        movement=loop.movement.name, next_step="ABORT", summary=f"Stopped: {over.reason}.",
                                        forced=True, reason=over.reason))
            self.rec.add(BudgetExceeded(job_id=self.job_id, movement_seq=loop.seq if loop else None,
                                        iteration=loop.iteration if loop else None, ts=now, measure=over.measure,
                                        spent=over.spent, limit=over.limit, limit_job=over.limit_job,
                                        reason=over.reason))
            self.rec.flush(c)
            if loop is not None:
                self.store.finish_movement(c, self.job_id, loop.seq, iterations=loop.iteration, next_step="ABORT",
                                           forced=True, summary=f"Stopped: {over.reason}.")
            self.store.set_status(c, self.job_id, JobStatus.aborted, reason=over.reason, error=over.reason)
            notify_parent(self.store, c, self.job_id)
        self.loop = None
        return JobStatus.aborted

    def _start_movement(self) -> bool:
        job = self.job()
        enriched = self.activation
        if enriched is not None:
            job = dataclasses.replace(job, enriched=enriched)
        seq = job.movement_seq + 1
        piece = self._piece_at(seq)
        name = job.current_movement or piece.initial_movement
        if self.recording is not None and self._replayed(seq) and self.recording.movements.get(seq) != name:
            self._fail(f"the fork's run {seq} would be {name!r} but job {self.recording.job_id} ran "
                       f"{self.recording.movements.get(seq)!r}: the re-served runs took another path", where="replay")
            return False
        if seq > piece.max_movements:
            message = (
                f"max_movements ({piece.max_movements}) exceeded: the piece ran {seq - 1} movements "
                f"and wanted to start {name!r}"
            )
            self._fail(message, where="runner")
            return False
        movement = self._movement(piece, name)
        system = movement.persona
        user = user_prompt(self.store, job, piece, movement, logs_dir=self.logs_dir, workdir=self.workdir)
        loop = self._make_loop(movement, seq)
        loop.start(system, user)
        with self.store.transaction() as c:
            self.store.start_movement(c, self.job_id, seq, name)
            self.store.update_job(c, self.job_id, current_movement=name, movement_seq=seq,
                                  **({} if enriched is None else {"enriched": enriched}))
            self.rec.flush(c)
        self.activation = None
        self.loop = loop
        return True

    def _finish_movement(self, out: Outcome) -> str:
        loop = self.loop
        assert loop is not None
        mv = loop.movement
        seq, it = loop.seq, loop.iteration
        # The seed turns the summary of a COMPLETE without lessons into the lesson, whatever ended the movement:
        # a forced COMPLETE (default_next: COMPLETE under context pressure or max_iterations) too.  A forced move
        # to another step carries none, as it is no claim about the work (its lessons are always empty).
        lesson_text = out.lessons or (out.summary if out.next_step == "COMPLETE" else "")
        step = next_step(out, mv)
        why = f"{mv.name} → {out.next_step}" + (" (forced)" if out.forced else "")
        loop_event: LoopDetected | None = None
        if isinstance(step, GoTo):
            loop_event, step, why = self._check_loop(seq, it, mv.name, out.summary, step, why)
        try:  # the files the movement changed are written back with it, in its transaction: both or neither
            files = self._files()
        except FilesOverLimit as exc:
            return self._fail(str(exc), where="files", write_files=False)
        self.rec.prepare()  # the last call's events, encoded before the store's write lock is taken
        with self.store.transaction() as c:
            if files is not None:
                files.apply(self.store, c, self.job_id)
            children: list[Subtask] = []
            if isinstance(step, WaitSubtasks) and self.recording is not None and self._replayed(seq):
                ended = self.recording.transitions.get(seq)
                children = self.subtasks.replay(c, list(ended.subtasks or []) if ended is not None else [])
            elif isinstance(step, WaitSubtasks) and (same := self._replayed_children(seq, step)) is not None:
                children = self.subtasks.replay(c, same)
            elif isinstance(step, WaitSubtasks):
                children = self.subtasks.create(c, step.requests, mv)
            now = time.time()
            self.rec.add(Transition(
                job_id=self.job_id, movement_seq=seq, iteration=it, ts=now, movement=mv.name,
                next_step=out.next_step, summary=out.summary, lessons=out.lessons, forced=out.forced,
                reason=out.reason, question=out.question, feedback=out.feedback, subtasks=children or None,
            ))
            if lesson_text:
                self.rec.add(Lesson(job_id=self.job_id, movement_seq=seq, iteration=it, ts=now,
                                    lessons=lesson_text, summary=out.summary, movement=mv.name))
            if loop_event is not None:  # after the transition, in its transaction: a restart finds both or neither
                self.rec.add(loop_event)
            self.rec.flush(c)
            self.store.finish_movement(c, self.job_id, seq, iterations=it, next_step=out.next_step,
                                       forced=out.forced, summary=out.summary)
            if isinstance(step, Ask) and self._replayed(seq):
                status = self._reserve_reply(c, seq, step)
            else:
                status = self._apply(c, step, why=why)
        if lesson_text:
            try:
                self._append_lesson_file(mv.name, seq, lesson_text, out.summary)
            except (ToolError, OSError) as exc:  # the lesson is in the events; say why the file lacks it
                self.rec.add(ErrorEvent(job_id=self.job_id, movement_seq=seq, iteration=it, ts=time.time(),
                                        message=f"lesson not written to logs/lessons.jsonl: {exc}",
                                        where="lessons"))
                self.rec.flush()
            self._write_lesson_file_back(seq, it)
        self.loop = None
        return status

    def _check_loop(self, seq: int, it: int, name: str, summary: str, step: GoTo,
                    why: str) -> tuple[LoopDetected | None, NextStep, str]:
        """After run ``seq`` (movement ``name``) sent the job to ``step``: has a loop monitor's cycle repeated
        ``threshold`` times since its last judgement?  Then the ``loop_detected`` event to record and the step
        that replaces ``step`` — the judge's run, or the monitor's ``next``."""
        piece = self._piece_at(seq)  # a re-served run detects what its original detected
        if not piece.loop_monitors:
            return None, step, why
        runs = [Run(r.seq, r.name, r.summary or "") for r in reads.movements(self.store, self.job_id)
                if r.seq < seq and r.next_step is not None]
        runs.append(Run(seq, name, summary))
        judged = last_judgements(self.store.events(self.job_id, kinds=["loop_detected"]))
        found = find_loop(piece.loop_monitors, runs, judged, step.movement)
        if found is None:
            return None, step, why
        lm = found.monitor
        event = LoopDetected(
            job_id=self.job_id, movement_seq=seq, iteration=it, ts=time.time(), monitor=lm.name,
            cycle=list(lm.cycle), count=lm.threshold, summaries=[r.summary for r in found.runs],
            runs=[r.seq for r in found.runs], judge=lm.judge.name if lm.judge is not None else None, next=lm.next,
        )
        why = f"{why}; loop {' → '.join(lm.cycle)} ×{lm.threshold}"
        if lm.judge is not None:
            return event, GoTo(lm.judge.name), f"{why}: {lm.judge.name} judges"
        why = f"{why}: {lm.name} → {lm.next}"
        if lm.next == "COMPLETE":
            return event, Complete(), why
        if lm.next == "ABORT":
            return event, Abort(f"loop monitor {lm.name}: {' → '.join(lm.cycle)} repeated {lm.threshold} times"), why
        return event, GoTo(str(lm.next)), why

    def _movement(self, piece: Piece, name: str) -> Movement:
        """Movement ``name`` of ``piece``; a loop monitor's judge with the summaries of the loop it judges."""
        movement = piece.movement(name)
        if any(lm.judge is movement for lm in piece.loop_monitors):
            movement = self._judge_movement(movement)
        return movement

    def _judge_movement(self, judge: Movement) -> Movement:
        """The judge's movement with the summaries of the loop it judges (the latest ``loop_detected``)."""
        events = [e for e in self.store.events(self.job_id, kinds=["loop_detected"])
                  if isinstance(e, LoopDetected) and e.judge == judge.name]
        if not events:
            return judge
        return dataclasses.replace(judge, instruction=judge_instruction(judge.instruction, events[-1],
                                                                        self.piece.language))

    def _replayed_children(self, seq: int, step: WaitSubtasks) -> list[Subtask] | None:
        """A ``replay:<job>`` job hands out what its original handed out at this run: ``replay:`` jobs of the
        original's children (its own model would re-serve the parent's responses to them).  None when this job
        is no replay, or its original did not hand out the same instructions at this run (another piece)."""
        if not self.model_spec.startswith("replay:"):
            return None
        try:
            original = Recording(self.store, int(self.model_spec.split(":", 1)[1]), before=seq + 1)
        except (ValueError, StoreError):
            return None
        ended = original.transitions.get(seq)
        subs = list(ended.subtasks or []) if ended is not None else []
        if not subs or [s.instruction for s in subs] != [str(r.get("instruction")) for r in step.requests]:
            return None
        return subs

    def _apply(self, c: Any, step: NextStep, why: str) -> str:
        """Move the job to ``step`` in the store's transaction ``c``; the job's status afterwards."""
        match step:
            case Complete():
                self.store.set_status(c, self.job_id, JobStatus.succeeded, reason=why)
                notify_parent(self.store, c, self.job_id)
                return JobStatus.succeeded
            case Abort(reason=reason):
                self.store.set_status(c, self.job_id, JobStatus.aborted, reason=why, error=reason)
                notify_parent(self.store, c, self.job_id)
                return JobStatus.aborted
            case Ask(question=question, resume=resume):
                self.store.add_comment(c, self.job_id, "agent", question)
                self.store.set_status(c, self.job_id, JobStatus.waiting_human, reason=why, resume_movement=resume,
                                      enriched=None)
                return JobStatus.waiting_human
            case Fail(message=message):
                self.store.set_status(c, self.job_id, JobStatus.failed, reason=why, error=message)
                notify_parent(self.store, c, self.job_id)
                return JobStatus.failed
            case WaitSubtasks(resume=resume):
                self.store.set_status(c, self.job_id, JobStatus.waiting_subtasks, reason=why, resume_movement=resume,
                                      enriched=None)
                return JobStatus.waiting_subtasks
            case GoTo(movement=movement):
                self.store.update_job(c, self.job_id, current_movement=movement)
                return JobStatus.running

    def _reserve_reply(self, c: Any, seq: int, step: Ask) -> str:
        """A re-served run asked a human: re-serve the conversation its original had before its next run (the
        question and the replies, with their times) and go on at once, as the original did when answered."""
        assert self.recording is not None
        # the job that asked and was answered live: a fork's own re-served question was answered in its original
        rec = Recording(self.store, self.recording.live_job(seq), before=seq + 2)
        begun, then = rec.starts[seq].ts, rec.starts.get(seq + 1)
        for cm in reads.comments(self.store, rec.job_id):
            if cm.ts >= begun and (then is None or cm.ts < then.ts):
                self.store.add_comment(c, self.job_id, cm.author, cm.body, ts=cm.ts)
        # the answer starts a new activation: its enriched instruction, with the original's clock
        job = self.store.job(self.job_id)
        enriched = activation_instruction(self.store, job, language=self.piece.language,
                                          clock=clock_block(then.user) if then is not None else None,
                                          workdir=self.workdir)
        self.store.update_job(c, self.job_id, current_movement=step.resume, enriched=enriched)
        return JobStatus.running

    # -- lessons --------------------------------------------------------------
    def _write_lesson_file_back(self, seq: int, it: int) -> None:
        """``logs/lessons.jsonl`` is appended after the movement's transaction (the lesson event comes first):
        where files live in the store it follows in a transaction of its own, so that the next worker has it."""
        try:
            files = self._files()
        except (FilesOverLimit, OSError) as exc:  # the movement has ended: say why the store lacks the line
            self.rec.add(ErrorEvent(job_id=self.job_id, movement_seq=seq, iteration=it, ts=time.time(),
                                    message=f"logs/lessons.jsonl not written back: {exc}", where="files"))
            self.rec.flush()
            return
        if files is not None and not files.empty:
            with self.store.transaction() as c:
                files.apply(self.store, c, self.job_id)

    def _append_lesson_file(self, movement: str, seq: int, lessons: str, summary: str) -> None:
        path = unlinked_path(self.logs_dir.parent, self.logs_dir.name, "lessons.jsonl")
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        record = {"job": self.job_id, "movement": movement, "seq": seq, "lessons": lessons, "summary": summary,
                  "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        # a link made after the check above is refused too, and a FIFO planted here (Bash can) never blocks
        fd = open_regular(path, "logs/lessons.jsonl", append=True)
        with open(fd, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")


def stored_piece(job: JobRecord) -> Piece:
    """The piece a job was submitted with (its YAML is kept in the store, files inlined)."""
    return parse_stored_piece(job.piece_yaml, job.piece_path or job.piece)


def _piece_limits(piece: Piece) -> dict[str, Any]:
    return {"cost_limit": piece.cost_limit, "token_limit": piece.token_limit}


def parse_stored_piece(piece_yaml: str, source: str) -> Piece:
    """A piece's stored YAML parsed and checked as the runner does it (``submit`` checks a Python-made piece so)."""
    from ..tools.base import registered_tool_names

    return _parsed_piece(piece_yaml, source, tuple(registered_tool_names()))


@functools.lru_cache(maxsize=64)
def _parsed_piece(piece_yaml: str, source: str, registered: tuple[str, ...]) -> Piece:
    # A batch's jobs share their piece: parsed once per process, not once per job (a Piece is frozen).
    # Tools named by the piece were checked at submit; a later process may lack a
    # notebook's custom tool, which the loop then reports to the model.
    return parse_piece(piece_yaml, source=source, known_tools=_all_names(piece_yaml) + list(registered))


def _all_names(piece_yaml: str) -> list[str]:
    import yaml

    data = yaml.load(piece_yaml, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}  # libyaml: ~10x faster
    names: list[str] = []
    for m in data.get("movements") or []:
        if isinstance(m, dict):
            names += [t for t in m.get("tools") or [] if isinstance(t, str)]
    return names
