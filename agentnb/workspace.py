"""The public facade: a :class:`Workspace` folder holding the store and the jobs' files."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._job import Job, JobRef, JobStatus
from .batch import (
    DEFAULT_CONCURRENCY,
    Batch,
    Scorer,
    check_concurrency,
    check_score_names,
    check_scorers,
    open_batch,
    score_jobs,
)
from .engine.jobfiles import (
    FileCache,
    check_total,
    file_listing,
    local_workdir,
    materialise,
    parse_files_limit,
    pull_files,
    read_rows,
    workdir_column,
)
from .engine.pieces import Piece, load_piece
from .engine.prompts import activation_instruction, clock_block
from .engine.runner import JobRunner, stored_piece
from .engine.subtasks import notify_parent
from .engine.workdir import prepare_workdir
from .errors import PathNotFoundError, UsageError
from .events import ErrorEvent, Event
from .fork import plan_fork
from .leases import holding, lease_setting
from .models.base import check_model_spec, check_retry_settings, normalise_spec
from .models.factory import resolve_model
from .store import STORE_SCHEMES, Store, StoreError, Transaction, open_store, store_scheme
from .store.base import (
    MAX_INSTRUCTION_CHARS,
    TERMINAL_STATES,
    UNREACHABLE_REASON,
    LeaseLost,
    StoreUnreachable,
    can_name_a_job,
)
from .tools.base import ToolError, resolve_path
from .views.status import STOP_REASON
from .worker import Worker

if TYPE_CHECKING:
    from .compare import Comparison
    from .views.frames import Frames

__all__ = ["DEFAULT_WORKSPACE", "MAX_INSTRUCTION_CHARS", "Job", "JobRef", "JobStatus", "Workspace", "prepare_workdir"]

DEFAULT_WORKSPACE = "agentnb-data"


@dataclass(frozen=True)
class _Prepared:
    """A submit that passed every check (``Workspace._prepare``), ready to be stored by ``Workspace._create``."""

    instruction: str
    piece: Piece
    model: str
    options: dict[str, Any]
    inputs: dict[str, str | bytes | os.PathLike[str]]
    workdir: str | os.PathLike[str] | None


def _input_size(value: str | bytes | os.PathLike[str]) -> int:
    """The bytes an input will take (a file that cannot be read counts 0: writing it fails with its own line)."""
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, os.PathLike):
        try:
            return os.stat(value).st_size
        except OSError:
            return 0
    return len(str(value).encode("utf-8"))


def _remove_folders(folders: list[Path]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


class Workspace:
    """A folder with ``agentnb.sqlite`` and ``jobs/<id>/``; the way to submit, run, step and inspect jobs."""

    def __init__(self, path: str | os.PathLike[str] = DEFAULT_WORKSPACE, *, readonly: bool = False,
                 retries: int | None = None, max_backoff: float | None = None, store: str | None = None,
                 lease: float | None = None, files_limit: int | str | None = None) -> None:
        """Open (or create) the workspace folder ``path``.

        ``store`` (else the environment's ``AGENTNB_STORE``) keeps the jobs elsewhere than ``path/agentnb.sqlite``
        (docs/stores.md): ``postgresql://user@host:port/db`` or ``sqlite:///ABS/PATH``; ``path`` is then the local
        scratch folder where this process keeps the jobs' work directories.

        ``readonly=True`` only reads: nothing is created or written, so a read-only folder or mount
        works, and a folder without a store reads as an empty workspace.  ``retries`` and ``max_backoff``
        are the openai model's retry settings for jobs that set none themselves (None: the environment's).
        ``lease`` (else ``AGENTNB_LEASE``, else 30) is how many seconds a job this workspace claims stays its
        own without renewal; it renews every third of that while it runs the job (agentnb/leases.py).

        ``files_limit``: the most bytes of files a job may hold where files live in the store (PostgreSQL): bytes,
        or text such as ``"100MB"``; None: ``$AGENTNB_FILES_LIMIT``, else 100 MB.  Checked when this workspace
        submits a job (its ``input/`` files) and when it ends a movement of one (the whole work directory).
        """
        self.model_settings = check_retry_settings(retries, max_backoff)
        self.lease = lease_setting(lease)
        self.files_limit = parse_files_limit(files_limit)
        if store is None:
            store = os.environ.get("AGENTNB_STORE") or None
        # the scheme is checked before the folder is made: a mistyped URL leaves nothing behind
        if store is not None and store_scheme(store) not in (None, *STORE_SCHEMES):
            open_store(store)  # raises the one line naming the scheme and what is allowed
        self.store_url = store
        self.root = Path(path).expanduser().resolve()
        self.readonly = readonly
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"the workspace {self.root} is a file, not a folder: give a folder (it is created when missing)")
        for parent in self.root.parents:
            if parent.exists() and not parent.is_dir():
                raise StoreError(f"the workspace {self.root} cannot be made: {parent} is a file, not a folder")
        # a server's store is opened before the folder is made: a server that cannot be reached, refuses the
        # password or holds a newer schema leaves no empty workspace folder behind either
        on_server = store is not None and store_scheme(store) in ("postgresql", "postgres")
        if on_server:
            self.store: Store = open_store(store, readonly=readonly, lease=self.lease)  # type: ignore[arg-type]
        if not readonly:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                if on_server:
                    self.store.close()
                raise StoreError(f"cannot make the workspace folder {self.root}: {exc.strerror or exc}") from None
        if not on_server:
            self.store = open_store(self.root / "agentnb.sqlite" if store is None else store, readonly=readonly,
                                    lease=self.lease)
        self._runners: dict[int, tuple[JobRunner, tuple[Any, ...]]] = {}
        # job → its work directory's hashes as this process last saw them (engine/_filecache.py), from the claim's
        # materialise to the write-backs of its runner; forgotten when the job ends here
        self._file_caches: dict[int, FileCache] = {}
        self._lock = threading.RLock()
        self._stops: dict[int, threading.Event] = {}

    def close(self) -> None:
        """Close the store (a PostgreSQL store's connection pool and its threads); the workspace is unusable after.

        A workspace left open is closed when it is garbage-collected, but a PostgreSQL pool collected from one of
        its own threads cannot stop itself cleanly, so scripts and the CLI close theirs.
        """
        self.store.close()

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Workspace({str(self.root)!r})"

    # -- jobs --------------------------------------------------------------
    def _id(self, job: JobRef) -> int:
        if isinstance(job, Job):
            return job.id
        try:
            job_id = int(job)
        except (TypeError, ValueError):
            raise StoreError(f"job must be a Job or a job id, not {job!r}") from None
        if not can_name_a_job(job_id):  # every store query with it would raise OverflowError
            raise StoreError(f"no job {job_id} in {self.store.path}")
        return job_id

    def job(self, job: JobRef) -> Job:
        return Job.from_row(self.store.job(self._id(job)), self)

    def jobs(self, status: str | None = None) -> list[Job]:
        return [Job.from_row(r, self) for r in self.store.jobs(status=status)]

    def children(self, job: JobRef) -> list[Job]:
        return [Job.from_row(r, self) for r in self.store.jobs(parent_id=self._id(job))]

    def events(self, job: JobRef, kinds: list[str] | None = None) -> list[Event]:
        return self.store.events(self._id(job), kinds=kinds)

    def comments(self, job: JobRef) -> list[dict[str, Any]]:
        return self.store.comments(self._id(job))

    def movements(self, job: JobRef) -> list[dict[str, Any]]:
        return self.store.movements(self._id(job))

    def piece(self, job: JobRef) -> Piece:
        return stored_piece(self.store.job(self._id(job)))

    def submit(
        self,
        instruction: str,
        *,
        piece: str | os.PathLike[str] | Piece = "plan-implement-verify",
        model: str = "demo",
        inputs: Mapping[str, str | bytes | os.PathLike[str]] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        context: Mapping[str, Any] | None = None,
        retries: int | None = None,
        max_backoff: float | None = None,
    ) -> Job:
        """Queue a job.  Bad pieces, model specs and inputs are refused before anything is stored.

        ``retries`` and ``max_backoff`` (seconds) set how an ``openai:`` model retries 429s, 5xx, timeouts
        and malformed answers for this job; unset, the workspace's settings and then the environment apply.
        """
        prepared = self._prepare(instruction, piece=piece, model=model, inputs=inputs, workdir=workdir,
                                 context=context, retries=retries, max_backoff=max_backoff)
        return self.job(self._store_prepared(prepared))

    def _store_prepared(self, prepared: _Prepared, **tags: Any) -> int:
        """Store one prepared job in a transaction of its own; a failure leaves no row and no folder."""
        job_folders: list[Path] = []
        try:
            with self.store.transaction() as c:
                return self._create(c, prepared, job_folders, **tags)
        except BaseException:
            _remove_folders(job_folders)
            raise

    def _prepare(
        self,
        instruction: str,
        *,
        piece: str | os.PathLike[str] | Piece,
        model: str,
        inputs: Mapping[str, str | bytes | os.PathLike[str]] | None,
        workdir: str | os.PathLike[str] | None,
        context: Mapping[str, Any] | None,
        retries: int | None,
        max_backoff: float | None,
    ) -> _Prepared:
        """Every check of a submit, before anything is stored or written (a batch checks all its jobs first)."""
        if not isinstance(instruction, str) or not instruction.strip():
            raise UsageError("instruction must be non-empty text")
        if len(instruction) > MAX_INSTRUCTION_CHARS:
            raise UsageError(
                f"the instruction has {len(instruction):,} characters; at most {MAX_INSTRUCTION_CHARS:,} are allowed "
                "(MAX_INSTRUCTION_CHARS): put long material in a file and pass it with inputs= (--input FILE)"
            )
        settings = check_retry_settings(retries, max_backoff)
        p = load_piece(piece)
        model = normalise_spec(model)
        check_model_spec(model)
        # Build it once: a malformed script or an unknown replay job is refused now, not when a worker
        # claims the job (building an openai model makes no client and reads no key yet).
        resolve_model(model, store=self.store)
        opts: dict[str, Any] = dict(settings)
        if context:
            from .engine.context import check_context_options

            opts["context"] = check_context_options(context, p.thresholds)
        if workdir is not None and self.store.keeps_files:
            raise UsageError(f"workdir={str(workdir)!r} is a folder of this machine, and workers of {self.store.path} "
                             "may run on others (they share only the database): give the files with inputs= "
                             "instead; each job works in jobs/<id> under its worker's own folder")
        if workdir is not None and not Path(workdir).expanduser().is_dir():
            raise PathNotFoundError(f"workdir {str(workdir)!r} is not an existing directory")
        # Every input name is checked before the job exists, so a refused submit leaves nothing behind.
        # A fresh job's input/ is empty; an existing workdir's input/ may hold links that lead out.
        input_root = (Path(workdir).expanduser() if workdir is not None else self.root / "jobs" / "0") / "input"
        if inputs is not None and not isinstance(inputs, Mapping):
            raise TypeError(f"inputs must be a mapping of file name → content, not {type(inputs).__name__}")
        for name, value in (inputs or {}).items():
            if not isinstance(name, str) or ".." in Path(name).parts:
                raise UsageError(f"input name {name!r} must be a relative path inside input/ (no '..')")
            try:
                if resolve_path(input_root, name) == input_root.resolve():
                    raise UsageError(f"input name {name!r} is input/ itself; give a file name inside input/")
            except ToolError as exc:
                raise UsageError(f"input {name!r}: {exc}") from None
            if not isinstance(value, (str, bytes, os.PathLike)):
                raise TypeError(f"input {name!r}: the content is {type(value).__name__}; allowed: text (str), "
                                "bytes or a path of a file to copy")
        if self.store.keeps_files:  # the files go into the store: refused before anything is
            check_total("the job's input files", sum(_input_size(v) for v in (inputs or {}).values()),
                        self.files_limit, then="nothing was stored")
        return _Prepared(instruction=instruction, piece=p, model=model, options=opts, inputs=dict(inputs or {}),
                         workdir=workdir)

    def _create(self, c: Transaction, prepared: _Prepared, job_folders: list[Path], **tags: Any) -> int:
        """Store a prepared job and write its folder and inputs, in ``c`` (``tags``: extra job columns, e.g.
        a batch's).  A folder this made is added to ``job_folders``, for the caller to remove if ``c`` fails:
        a job whose folder or inputs cannot be written (a read-only jobs/, a full disk) is not left queued."""
        p = prepared.piece
        job_id = self.store.create_job(
            piece=p.name, piece_yaml=p.to_yaml(), piece_path=p.source, model=prepared.model,
            instruction=prepared.instruction, status="queued", workdir="", options=prepared.options, **tags,
        )
        job_folder = self.root / "jobs" / str(job_id)
        if not job_folder.exists():  # else not ours to remove if this fails
            job_folders.append(job_folder)
        wd = prepare_workdir(self.root, job_id, prepared.workdir)
        written: list[Path] = []
        for name, value in prepared.inputs.items():
            try:
                target = resolve_path(wd / "input", name)
            except ToolError as exc:
                raise UsageError(f"input {name!r}: {exc}") from None
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                if isinstance(value, bytes):
                    target.write_bytes(value)
                elif isinstance(value, os.PathLike):
                    target.write_bytes(Path(value).read_bytes())
                else:
                    target.write_text(str(value), encoding="utf-8")
            except OSError as exc:  # a name too long for the file system, a source file that is gone
                what = f"its source {os.fspath(value)!r}" if isinstance(value, os.PathLike) else "it"
                raise UsageError(f"input {name!r} cannot be written: {what}: "
                                 f"{exc.strerror or type(exc).__name__}") from None
            written.append(target)
        if self.store.keeps_files:  # workers elsewhere share only the database: input/ goes in with the job
            rows = read_rows(wd, written)
            check_total("the job's input files", sum(f.size for f in rows), self.files_limit,
                        then="nothing was stored")
            self.store.write_files(c, job_id, rows, [])
        self.store.update_job(c, job_id, workdir=workdir_column(self.store, job_id, wd))
        return job_id

    # -- running ------------------------------------------------------------
    def _runner(self, row: Mapping[str, Any]) -> JobRunner:
        job_id = int(row["id"])
        mark = self._runner_mark(job_id)
        cached = self._runners.get(job_id)
        if cached is not None and cached[1] == mark:
            return cached[0]
        opts = json.loads(row.get("options") or "{}")
        settings = {**self.model_settings, **{k: opts[k] for k in ("retries", "max_backoff") if k in opts}}
        model = resolve_model(row["model"], store=self.store, **settings)
        runner = JobRunner(self.store, dict(row), model, self.root / "jobs", files_limit=self.files_limit,
                           file_cache=self._file_caches.setdefault(job_id, FileCache()) if self.store.keeps_files else None)
        self._runners[job_id] = (runner, mark)
        return runner

    def _runner_mark(self, job_id: int) -> tuple[int, int, str | None]:
        """What a cached runner must match: the last movement event, the open movement (a retry
        reopens a failed one without writing a movement event) and the job's options (a retry may
        change its model's retry settings)."""
        return self.store.runner_mark(job_id)

    def _activate(self, row: dict[str, Any], runner: JobRunner) -> None:
        """Build the enriched instruction once per activation (first start, or after a wait)."""
        if row.get("enriched"):
            return
        job_id = int(row["id"])
        enriched = activation_instruction(self.store, row, language=runner.piece.language,
                                          clock=self._recorded_clock(row), workdir=runner.workdir)
        with self.store.transaction() as c:
            self.store.update_job(c, job_id, enriched=enriched)

    def _recorded_clock(self, row: Mapping[str, Any]) -> str | None:
        """The date and time a replay, or a fork up to its fork point, puts in its prompts: its original's
        for the movement run about to start, so that those prompts are the original's (docs/fork-compare.md)."""
        seq = int(row.get("movement_seq") or 0) + 1
        source: int | None = None
        if row.get("forked_from_job") and seq <= int(row.get("forked_from_seq") or 0):
            source = int(row["forked_from_job"])
        elif str(row.get("model") or "").startswith("replay:") and str(row["model"])[7:].isdigit():
            source = int(str(row["model"])[7:])
        if source is None:
            return None
        try:
            starts = self.store.events(source, kinds=["movement_start"], movement_seq=seq)
        except StoreError:
            return None
        user = getattr(starts[0], "user", "") if starts else ""
        return clock_block(user) if user else None

    def _run_claimed(self, row: dict[str, Any], unit: str) -> Job:
        """Run the job this process just claimed (``row``, from ``store.claim``), holding its lease meanwhile.

        A job whose lease was lost (this process was frozen or cut off past it, and another claimer took it
        back, or may have: the store did not answer for a whole lease) stops here, at its first write or its next
        LLM or tool call, whichever comes first: nothing more is run or written for it, it is not marked failed,
        and the caller goes on.
        """
        job_id = int(row["id"])
        try:
            with holding(self.store, row, self.lease) as held:
                try:
                    return self._run_leased(row, unit, held.check)
                except StoreUnreachable:
                    self._cut_off(job_id)
                    raise
        except LeaseLost:
            with self._lock:
                self._runners.pop(job_id, None)
            print(f"job {job_id}: lease lost to another worker; stopping", file=sys.stderr, flush=True)
            return self.job(job_id)

    def _cut_off(self, job_id: int) -> None:
        """The store became unreachable while this process ran the job (a server restart, a network cut): the job
        has not failed, and what it committed stands.  It goes back to the queue if the store answers again
        within the pool's wait, to go on from its last commit; else it stays ``running`` until its lease runs
        out and a claim takes it back (``recovered: lease expired``), as after a crash."""
        with self._lock:
            self._runners.pop(job_id, None)  # its state in memory may be ahead of the store's
        try:
            with self.store.transaction() as c:
                if self.store.job(job_id)["status"] == "running":
                    self.store.set_status(c, job_id, "queued", reason=UNREACHABLE_REASON)
        except StoreError:  # still unreachable, or the lease lost meanwhile: its lease decides
            pass

    def _run_leased(self, row: dict[str, Any], unit: str, lease: Callable[[], None]) -> Job:
        job_id = int(row["id"])
        if self.store.keeps_files:  # it may have run elsewhere: its files as of its last movement end
            try:
                prepare_workdir(self.root, job_id, None)
                materialise(self.store, job_id, local_workdir(self.root, row, True),
                            self._file_caches.setdefault(job_id, FileCache()))
            except StoreUnreachable:
                raise  # not the job's failure (_cut_off)
            except Exception as exc:
                return self._setup_failed(job_id, exc)
        with self._lock:
            try:
                runner = self._runner(row)
            except StoreUnreachable:
                raise
            except Exception as exc:  # the model or piece cannot be set up: the job fails, visibly
                return self._setup_failed(job_id, exc)
            stop = self._stops.setdefault(job_id, threading.Event())
        self._activate(row, runner)
        try:
            # a movement can take many calls: Stop pauses it after the current one, as it does a run
            # and the lease is checked before every LLM call and tool call (a lost one raises LeaseLost)
            status = runner.advance(unit, stop if unit != "call" else None, lease)
        except (LeaseLost, StoreUnreachable):
            raise  # nothing may be written for the job any more (_run_claimed, _cut_off)
        except BaseException:
            # A KeyboardInterrupt (a notebook's stop button) or SystemExit mid-call: give the job back
            # to the queue, resumable from its events.  A model call cut short is asked again; a tool
            # call cut short is completed as after a crash (a started one with effects is never rerun).
            runner.rec.pending.clear()
            with self._lock:
                self._runners.pop(job_id, None)
            with self.store.transaction() as c:
                if self.store.job(job_id)["status"] == "running":
                    self.store.set_status(c, job_id, "queued", reason="interrupted")
            raise
        stopped = stop.is_set()
        if stopped and status != "waiting_subtasks":
            stop.clear()  # a parent that just handed out subtasks keeps it: they do not start (_run_children)
        if status == "running":
            reason = STOP_REASON if stopped else f"paused after one {unit}"
            with self.store.transaction() as c:
                self.store.set_status(c, job_id, "queued", reason=reason)
        with self._lock:
            # Kept for the next claim in this process only while the job is still as this runner left it: the
            # mark is read before the claim generation, so an unchanged generation means no other claimer (a
            # slot here, which re-claimed a parent whose subtasks ended meanwhile, or another process) wrote
            # after it, and a stale runner never goes in under a newer mark.
            mark = self._runner_mark(job_id)
            if self.store.job(job_id).get("lease_gen") == row.get("lease_gen"):
                self._runners[job_id] = (runner, mark)
        if status in TERMINAL_STATES:
            self._file_caches.pop(job_id, None)  # a retry starts from a fresh claim
        return self.job(job_id)

    def _setup_failed(self, job_id: int, exc: Exception) -> Job:
        with self.store.transaction() as c:
            self.store.append([ErrorEvent(job_id=job_id, ts=time.time(), message=str(exc), where="setup")], c)
            self.store.set_status(c, job_id, "failed", reason=str(exc), error=str(exc))
            notify_parent(self.store, c, job_id)
        return self.job(job_id)

    def _claim(self, job_id: int) -> dict[str, Any] | None:
        row = self.store.claim(job_id)
        if row is None:
            current = self.store.job(job_id)
            if current["status"] == "running":
                raise StoreError(f"job {job_id} is already running ({current['claimed_by']})")
        return row

    def run(self, job: JobRef, *, subtasks: bool = True) -> Job:
        """Run a job until it ends or waits for a human; runs its subtasks too unless ``subtasks=False``."""
        job_id = self._id(job)
        with self._lock:  # jobs run in threads of their own (agentnb.executor): _stops is shared
            self._stops.pop(job_id, None)
        while True:
            row = self._claim(job_id)
            if row is None:
                current = self.job(job_id)
                if current.status == "waiting_subtasks" and subtasks and self._run_children(job_id):
                    continue
                return current
            result = self._run_claimed(row, unit="job")
            if result.status == "queued":  # stopped
                return result
            if result.status == "waiting_subtasks" and subtasks and self._run_children(job_id):
                continue
            return result

    def _run_children(self, job_id: int) -> bool:
        """Run the queued children of a waiting parent; True when the parent is queued again."""
        for child in self.children(job_id):
            stop = self._stops.get(job_id)
            if stop is not None and stop.is_set():
                break  # the parent was stopped: start no further subtask
            # a child waiting for its own subtasks may have grandchildren that are ready to run
            if child.status in ("queued", "waiting_subtasks"):
                try:
                    self.run(child)
                except StoreError:
                    continue  # claimed by another worker meanwhile
        return self.store.job(job_id)["status"] == "queued"

    def step(self, job: JobRef, unit: str = "movement") -> Job:
        """Run one movement (``unit="movement"``) or one LLM call with its tool calls (``unit="call"``)."""
        if unit not in ("movement", "call"):
            raise UsageError(f"unit={unit!r}; allowed: 'movement', 'call'")
        job_id = self._id(job)
        with self._lock:
            self._stops.pop(job_id, None)  # a Stop meant for an earlier run must not cut this step short
        row = self._claim(job_id)
        if row is None:
            return self.job(job_id)
        return self._run_claimed(row, unit=unit)

    def iter(self, job: JobRef, unit: str = "call") -> Iterator[Job]:
        """Step a job to its end, yielding it after every step (for notebooks that watch or pause)."""
        while True:
            current = self.step(job, unit=unit)
            yield current
            if current.status != "queued":
                return

    def stop(self, job: JobRef) -> list[int]:
        """Ask a job run by this workspace to pause after its current LLM call; it goes back to ``queued``.

        A job waiting for its subtasks stops them too: its running subtasks pause and no further
        one starts.  Returns the ids asked to pause (the job, then its running subtasks).
        """
        asked: list[int] = []
        pending = [self._id(job)]
        while pending:
            job_id = pending.pop(0)
            asked.append(job_id)
            with self._lock:
                self._stops.setdefault(job_id, threading.Event()).set()
            pending.extend(int(r["id"]) for r in self.store.jobs(parent_id=job_id)
                           if r["status"] in ("running", "waiting_subtasks"))
        return asked

    def reply(self, job: JobRef, text: str) -> Job:
        """Add the user's comment; a job waiting for a human goes back to the queue to resume.

        A job that has ended (succeeded, failed, aborted) takes no reply: nothing would read it.
        """
        if not isinstance(text, str) or not text.strip():
            raise UsageError("reply text must be non-empty")
        job_id = self._id(job)
        with self.store.transaction() as c:
            row = self.store.job(job_id)  # StoreError "no job …" when there is none
            if row["status"] in TERMINAL_STATES:
                then = ("submit a new job" if row["status"] == "succeeded"
                        else "retry it or submit a new job")
                raise StoreError(f"job {job_id} has ended ({row['status']}), so a reply would never be read; "
                                 f"to go on, {then}")
            self.store.add_comment(c, job_id, "user", text)
            if row["status"] == "waiting_human":
                self.store.set_status(
                    c, job_id, "queued", reason="the user replied",
                    current_movement=row["resume_movement"] or row["current_movement"], resume_movement=None,
                    enriched=None,
                )
        return self.job(job_id)

    def retry(self, job: JobRef, *, retries: int | None = None, max_backoff: float | None = None) -> Job:
        """Queue a failed or aborted job again (``job_status`` reason ``retried``); run it with :meth:`run`.

        A failed job goes on from its last complete LLM call: its failed movement is reopened and
        resumed from its events (the call that failed is asked again; a tool call cut short is
        completed as after a crash).  An aborted job starts a new run of the movement that aborted,
        with a fresh prompt (its movement count goes on, within ``max_movements``).  ``retries`` and
        ``max_backoff`` replace the job's retry settings for the ``openai:`` model.  Any other
        status is refused with a :class:`StoreError` naming it.
        """
        job_id = self._id(job)
        settings = check_retry_settings(retries, max_backoff)
        with self.store.transaction() as c:
            row = self.store.job(job_id)  # StoreError "no job …" when there is none
            status = row["status"]
            if status not in ("failed", "aborted"):
                raise StoreError(f"job {job_id} is {status}; only a failed or aborted job can be retried")
            if status == "failed":
                self.store.reopen_failed_movement(c, job_id)
            values: dict[str, Any] = {"error": None, "ended": None, "enriched": None}
            if settings:
                values["options"] = json.dumps({**json.loads(row["options"] or "{}"), **settings}, ensure_ascii=False)
            self.store.set_status(c, job_id, "queued", reason="retried", **values)
        with self._lock:
            self._runners.pop(job_id, None)
        return self.job(job_id)

    # -- forks and replays (docs/fork-compare.md#fork) ---------------------------------------------------------------------
    def fork(
        self,
        job: JobRef,
        *,
        at: int,
        piece: str | os.PathLike[str] | Piece | None = None,
        model: str | None = None,
        strict: bool = False,
        context: Mapping[str, Any] | None = None,
        run: bool = True,
    ) -> Job:
        """A new job that re-serves movement runs ``1 … at-1`` of ``job`` and runs live from run ``at`` on.

        The re-served runs ask no model and spend no tokens: each response is the original's, under the
        original's piece, while every tool runs again, so the work directory is what it was when run ``at``
        started.  A re-run tool whose result differs from the original's (a command reading the clock)
        is recorded as a ``replay_divergence`` event; the fork goes on, or with ``strict=True`` fails naming
        that call.  From run ``at`` on the job runs on ``piece`` (a name, path, YAML text or ``Piece``, e.g.
        ``ws.piece(job).replace_movement("implement", instruction=…)``; default: the original's) and
        ``model`` (default: the original's), with ``context`` (``window_tokens``, ``thresholds``,
        ``min_tool_tokens``, as ``submit``'s) over the original's: the real answer to a what-if
        (``frames.what_if``).  The fork starts from the original's ``input/`` files as they
        are now, with its options, and keeps its date and time in the prompts up to run ``at``.  A re-served
        run that asked a human goes on with the replies the original got; one that handed out subtasks queues
        ``replay:`` jobs of the original's children.  ``run=False`` only queues it (to step it).  A job that is
        running or waiting is refused.
        """
        plan = plan_fork(self.store, self._id(job), at=at, piece=piece, model=model, strict=strict, context=context)
        prepared = self._prepare(plan.instruction, piece=plan.piece, model=plan.model, inputs=plan.inputs,
                                 workdir=None, context=None, retries=None, max_backoff=None)
        job_id = self._store_prepared(replace(prepared, options=plan.options), forked_from_job=plan.job_id,
                                      forked_from_seq=plan.at, current_movement=plan.first)
        return self.run(job_id) if run else self.job(job_id)

    def replay(self, job: JobRef, *, piece: str | os.PathLike[str] | Piece | None = None, run: bool = True) -> Job:
        """A new job on ``replay:<job>`` with the original's instruction, ``input/`` files (as they are now),
        options and (unless ``piece`` is given) piece: every response is re-served in order and every tool
        runs again.  With the same piece its events are the original's apart from timestamps and ids, and
        its ``output/`` the same byte for byte, as long as the tools do what they did (docs/fork-compare.md)."""
        plan = plan_fork(self.store, self._id(job), at=1, piece=piece)
        prepared = self._prepare(plan.instruction, piece=plan.piece, model=f"replay:{plan.job_id}",
                                 inputs=plan.inputs, workdir=None, context=None, retries=None, max_backoff=None)
        job_id = self._store_prepared(replace(prepared, options=plan.options), current_movement=plan.first)
        return self.run(job_id) if run else self.job(job_id)

    def compare(self, a: JobRef, b: JobRef) -> Comparison:
        """Jobs ``a`` and ``b`` side by side, aligned by movement run: ``.frame``, ``.files()``, and in a notebook
        the two runs with the first point where they diverge marked (docs/fork-compare.md)."""
        from .compare import Comparison

        return Comparison(self, self.frames, self._id(a), self._id(b))

    # -- batches (docs/design-lab.md) ------------------------------------------------------------------------------
    def batch(
        self,
        cases: Any = None,
        *,
        piece: Any = None,
        model: str | Sequence[str] | None = None,
        name: str | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        scorers: Mapping[str, Scorer] | None = None,
        context: Mapping[str, Any] | None = None,
        retries: int | None = None,
        max_backoff: float | None = None,
        run: bool = True,
        progress: bool = True,
    ) -> Batch:
        """Run cases × variants as jobs, ``concurrency`` at once, scored and priced; a :class:`Batch`.

        ``cases``: a list of dicts or a DataFrame with ``instruction`` (required), ``inputs`` (a dict of
        file name → text or bytes, or a folder path) and ``expected`` (any JSON value); other columns are
        carried into the results.  Variants are every ``piece`` (a name, path, YAML text or ``Piece``, or a
        list) with every ``model`` (a spec or a list); a new batch defaults to ``plan-implement-verify`` on
        ``demo``.  ``ws.batch("exp-1")``, or the same call again with ``name="exp-1"``, resumes the batch:
        finished jobs are kept, unfinished ones run.  Given the same cases, pieces or models it does not have
        yet are added as new variants (an omitted ``piece=``/``model=`` then means the batch's own).
        ``run=False`` only creates (or looks up) the batch.
        """
        check_concurrency(concurrency)
        b = open_batch(self, cases, piece=piece, model=model, name=name, scorers=scorers, context=context,
                       retries=retries, max_backoff=max_backoff, check_model=self._checked_spec)
        if run:
            b.run(concurrency=concurrency, progress=progress)
        return b

    def batches(self) -> list[dict[str, Any]]:
        """Every batch: name, created, jobs and a count per status (``n_<status>``)."""
        return [{k: v for k, v in row.items() if k not in ("cases", "variants", "options", "fingerprint")}
                for row in self.store.batches()]

    def score(self, batch_or_jobs: Batch | str | JobRef | Sequence[JobRef], scorers: Mapping[str, Scorer]) -> list[Job]:
        """Score ended jobs (a batch, a batch name, a job or jobs) again without running them; the jobs scored.

        Each scorer's result is a new ``score`` event (the latest per name is the score in ``batch.frame``).
        Failed and aborted jobs are scored too; queued, running and waiting ones are skipped.
        """
        chosen = check_scorers(scorers)
        if not chosen:
            raise UsageError("no scorers: give scorers={'name': function(job)}")
        if isinstance(batch_or_jobs, str):
            if self.store.batch(batch_or_jobs) is None:
                known = ", ".join(b["name"] for b in self.store.batches()) or "none yet"
                raise UsageError(f"no batch {batch_or_jobs!r} in {self.store.path} (batches: {known})")
            batch_or_jobs = Batch(self, batch_or_jobs)
        if isinstance(batch_or_jobs, Batch):
            check_score_names(chosen, batch_or_jobs.cases)
            jobs = batch_or_jobs.jobs
        elif isinstance(batch_or_jobs, (bytes, Mapping)):
            raise UsageError(f"ws.score takes a Batch, a batch name, a job or a list of jobs, "
                             f"not {type(batch_or_jobs).__name__}")
        elif not isinstance(batch_or_jobs, Iterable):  # one job
            jobs = [self.job(batch_or_jobs)]
        else:
            jobs = [self.job(j) for j in batch_or_jobs]
        return score_jobs(self.store, jobs, chosen)

    def _checked_spec(self, spec: str) -> str:
        if not isinstance(spec, str):
            raise UsageError(f"model spec {spec!r} must be text (e.g. 'demo', 'scripted:PATH', 'openai:NAME')")
        spec = normalise_spec(spec)
        check_model_spec(spec)
        resolve_model(spec, store=self.store)
        return spec

    def _batch_case(self, name: str, index: int) -> dict[str, Any]:
        row = self.store.batch(name)
        if row is None:
            return {}
        cases = json.loads(row["cases"])
        return dict(cases[index]) if 0 <= index < len(cases) else {}

    def worker(self) -> Worker:
        return Worker(self)

    # -- a job's files (docs/stores.md#files) --------------------------------------------------------------------------
    def files(self, job: JobRef, *, under: str | None = None) -> Any:
        """A DataFrame of the job's files, one row per file (or symbolic link) of its work directory, by path:
        ``path`` (relative to the work directory, POSIX), ``size`` (bytes), ``sha256``, ``updated`` (naive UTC)
        and ``mode`` (the ``st_mode``: ``stat.S_ISLNK(mode)`` for a link, ``oct(mode)`` to read it).

        On PostgreSQL these are the files in the store as of the job's last movement end (what any worker
        materialises); on SQLite the work directory on disk, read the same way.  ``under="output"`` lists only
        that folder.  A link leading out of the work directory is never listed, nor stored."""
        import pandas as pd

        job_id = self._id(job)
        rows = file_listing(self.store, job_id, self._workdir(job_id), under)
        return pd.DataFrame({
            "path": pd.Series([r["path"] for r in rows], dtype="string"),
            "size": pd.Series([r["size"] for r in rows], dtype="Int64"),
            "sha256": pd.Series([r["sha256"] for r in rows], dtype="string"),
            "updated": pd.to_datetime(pd.Series([float(r["updated"]) for r in rows], dtype="float64"),
                                      unit="s").astype("datetime64[ns]"),
            "mode": pd.Series([r["mode"] for r in rows], dtype="Int64"),
        }, columns=["path", "size", "sha256", "updated", "mode"])

    def pull(self, job: JobRef, dest: str | os.PathLike[str], *, overwrite: bool = False,
             under: str | None = None) -> list[Path]:
        """Copy the job's files into folder ``dest`` (made when missing) at their paths in the work directory
        (``dest/output/report.md``), so a notebook on any machine can open ``output/``; ``under="output"`` copies
        only that folder.  Files already in ``dest`` with the same content are left alone; a different file in
        the way is refused in one line, nothing copied, unless ``overwrite=True``.  Returns the paths written.
        On PostgreSQL the files come from the store, on SQLite from the work directory on disk."""
        job_id = self._id(job)
        return pull_files(self.store, job_id, self._workdir(job_id), dest, overwrite=overwrite, under=under)

    def _workdir(self, job_id: int) -> Path:
        return local_workdir(self.root, self.store.job(job_id), self.store.keeps_files)

    # -- views -----------------------------------------------------------------
    @property
    def frames(self) -> Frames:
        from .views.frames import Frames

        return Frames(self.store, self.root, job_id=self._id, piece_thresholds=lambda job_id: self.piece(job_id).thresholds,
                      name=repr(self))

    def export_notebook(self, job: JobRef, path: str | os.PathLike[str]) -> Path:
        from .views.transcript import export_notebook

        return export_notebook(self, self._id(job), path)
