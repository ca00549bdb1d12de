"""The public facade: a :class:`Workspace` folder holding the store and the jobs' files."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._job import Job, JobRef, JobStatus
from ._secrets import register_url_password
from .batch import (
    DEFAULT_CONCURRENCY,
    Batch,
    Scorer,
    check_concurrency,
    check_epochs,
    check_score_names,
    check_scorers,
    open_batch,
    score_jobs,
)
from .engine.callcache import cache_option, check_cache_mode
from .engine.jobfiles import file_listing, local_workdir, parse_files_limit, pull_files
from .engine.pieces import Piece
from .engine.runner import stored_piece
from .engine.workdir import prepare_workdir
from .errors import UsageError
from .events import Event
from .execution import Execution
from .fork import plan_fork
from .leases import lease_setting
from .models.base import check_model_spec, check_retry_settings, normalise_spec
from .models.factory import resolve_model
from .store import STORE_SCHEMES, Store, StoreError, open_store, reads, store_scheme
from .store.base import MAX_INSTRUCTION_CHARS, can_name_a_job
from .submission import Submitter
from .worker import Worker

if TYPE_CHECKING:
    from .compare import Comparison
    from .views.frames import Frames
    from .views.otel_live import LiveExport

__all__ = ["DEFAULT_WORKSPACE", "MAX_INSTRUCTION_CHARS", "Job", "JobRef", "JobStatus", "Workspace", "prepare_workdir"]

DEFAULT_WORKSPACE = "agentnb-data"


class Workspace:
    """A folder with ``agentnb.sqlite`` and ``jobs/<id>/``; the way to submit, run, step and inspect jobs."""

    def __init__(self, path: str | os.PathLike[str] = DEFAULT_WORKSPACE, *, readonly: bool = False,
                 retries: int | None = None, max_backoff: float | None = None, store: str | None = None,
                 lease: float | None = None, files_limit: int | str | None = None,
                 stream: bool | None = None, otel: str | bool | None = None,
                 otel_content: bool | None = None, cache: bool | str | None = None) -> None:
        """Open (or create) the workspace folder ``path``.

        ``store`` (else the environment's ``AGENTNB_STORE``) keeps the jobs elsewhere than ``path/agentnb.sqlite``
        (docs/stores.md): ``postgresql://user@host:port/db`` or ``sqlite:///ABS/PATH``; ``path`` is then the local
        scratch folder where this process keeps the jobs' work directories.

        ``readonly=True`` only reads: nothing is created or written, so a read-only folder or mount
        works, and a folder without a store reads as an empty workspace.  ``retries`` and ``max_backoff``
        are the openai model's retry settings for jobs that set none themselves (None: the environment's).
        ``stream=False`` turns off the streaming of ``openai:`` models' answers (None: ``AGENTNB_STREAM``, else on;
        a spec's ``?stream=`` wins; docs/models.md#streaming).
        ``lease`` (else ``AGENTNB_LEASE``, else 30) is how many seconds a job this workspace claims stays its
        own without renewal; it renews every third of that while it runs the job (agentnb/leases.py).

        ``files_limit``: the most bytes of files a job may hold where files live in the store (PostgreSQL): bytes,
        or text such as ``"100MB"``; None: ``$AGENTNB_FILES_LIMIT``, else 100 MB.  Checked when this workspace
        submits a job (its ``input/`` files) and when it ends a movement of one (the whole work directory).

        ``otel`` exports the spans of the jobs this workspace runs to an OpenTelemetry collector as each movement
        run ends (docs/otel.md#live): its base URL (``http://127.0.0.1:4318``), True for the standard
        ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``, False for none; None reads
        ``AGENTNB_OTEL`` (a URL, or 1).  ``otel_content=True`` (None: ``AGENTNB_OTEL_CONTENT``) adds the messages,
        tool arguments and results to those spans, scrubbed of secrets and cut (docs/otel.md#live-content).

        ``cache``: the call cache's mode for the jobs this workspace submits and batches that set none themselves
        (True, ``"across-epochs"``, False; docs/design-lab.md#call-cache).
        """
        self.cache = check_cache_mode(cache)  # a bad mode: one line, before anything is opened
        self.model_settings = check_retry_settings(retries, max_backoff)
        if stream is not None:
            if not isinstance(stream, bool):
                raise UsageError(f"stream={stream!r}; allowed: True, False or None (the environment's AGENTNB_STREAM)")
            self.model_settings["stream"] = stream
        self.lease = lease_setting(lease)
        otel_url, send_content = None, False
        if not readonly and (otel or otel_content or (otel is None and os.environ.get("AGENTNB_OTEL"))
                             or (otel_content is None and os.environ.get("AGENTNB_OTEL_CONTENT", "").strip())):
            from .views.otel_live import live_content, live_endpoint

            # a bad value: one line, before anything is opened
            otel_url, send_content = live_endpoint(otel, os.environ), live_content(otel_content, os.environ)
            if otel_url is None and otel_content:
                raise UsageError("otel_content=True sends content with the live export, and there is none: give "
                                 "otel=URL (or True), or set AGENTNB_OTEL")
        self.files_limit = parse_files_limit(files_limit)
        if store is None:
            store = os.environ.get("AGENTNB_STORE") or None
        # the scheme is checked before the folder is made: a mistyped URL leaves nothing behind
        if store is not None and store_scheme(store) not in (None, *STORE_SCHEMES):
            open_store(store)  # raises the one line naming the scheme and what is allowed
        if store is not None and store_scheme(store) is None:
            # a file named relative to the folder of this moment: the same file for worker processes, and after a
            # change of folder (what open_args gives them)
            store = os.path.abspath(store)
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
            # a password given in the URL is masked as the environment's secrets are: never stored nor exported
            register_url_password(str(store))
        if on_server:
            self.store: Store = open_store(store, readonly=readonly, lease=self.lease)  # type: ignore[arg-type]
        if not readonly:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                if on_server:
                    self.store.close()
                raise StoreError(f"cannot make the workspace folder {self.root}: {exc.strerror or exc}") from None
        # the store's file, or the server's URL (opened again by the live export's own process)
        location = self.root / "agentnb.sqlite" if store is None else store
        if not on_server:
            self.store = open_store(location, readonly=readonly, lease=self.lease)
        # a job's life in this process — claim, lease, files, activation, each step, release — is the Execution's
        self.submitter = Submitter(self.store, self.root, self.files_limit)
        self.execution = Execution(self.store, self.root, lease=self.lease, files_limit=self.files_limit,
                                   model_settings=self.model_settings)
        self.otel: LiveExport | None = None  # the live export (docs/otel.md#live), when one is set
        if otel_url is not None:
            from .views.otel_live import LiveExport

            self.otel = LiveExport(self.store, otel_url, content=send_content, reopen=str(location))

    @property
    def open_args(self) -> dict[str, Any]:
        """The arguments that open this workspace again, as it is, in another process (the worker processes of a
        batch, docs/design-lab.md#processes): JSON values, and no secret (keys stay in the environment)."""
        return {"path": str(self.root), "store": self.store_url, "lease": self.lease, "files_limit": self.files_limit,
                **self.model_settings, "otel": self.otel.url if self.otel is not None else False,
                "otel_content": self.otel.content if self.otel is not None else None, "cache": self.cache}

    @property
    def otel_dropped(self) -> int:
        """Spans the live export did not send (collector unreachable, slow or refusing; docs/otel.md#live)."""
        return self.otel.dropped if self.otel is not None else 0

    def close(self) -> None:
        """Close the store (a PostgreSQL store's connection pool and its threads); the workspace is unusable after.

        A workspace left open is closed when it is garbage-collected, but a PostgreSQL pool collected from one of
        its own threads cannot stop itself cleanly, so scripts and the CLI close theirs.  A live export sends what
        it still holds first, waiting a few seconds at most.
        """
        if self.otel is not None:
            self.otel.close()
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
        if isinstance(job, bool):  # an int to Python, never a job id
            raise StoreError(f"job must be a Job or a job id, not {job!r}")
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
        """The job's comments, oldest first, as plain dicts (docs/python-api.md#records)."""
        return [c.to_dict() for c in reads.comments(self.store, self._id(job))]

    def movements(self, job: JobRef) -> list[dict[str, Any]]:
        """The job's movement runs in the order they ran, as plain dicts (docs/python-api.md#records)."""
        return [m.to_dict() for m in reads.movements(self.store, self._id(job))]

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
        cache: bool | str | None = None,
        cost_limit: float | None = None,
        token_limit: int | None = None,
    ) -> Job:
        """Queue a job.  Bad pieces, model specs and inputs are refused before anything is stored.

        ``retries`` and ``max_backoff`` (seconds) set how an ``openai:`` model retries 429s, 5xx, timeouts
        and malformed answers for this job; unset, the workspace's settings and then the environment apply.
        ``cache=True`` answers its LLM calls from the call cache when an identical request was made before
        (``"across-epochs"``: from any epoch; None: the workspace's ``cache``; docs/design-lab.md#call-cache).
        ``cost_limit`` (US dollars) and ``token_limit`` abort the job once it and its subtasks have spent that
        much, after the call that reached it (docs/design-lab.md#budgets); they override the piece's.
        """
        cached = cache_option(cache, self.cache)
        prepared = self.submitter.prepare(instruction, piece=piece, model=model, inputs=inputs, workdir=workdir,
                                 context=context, retries=retries, max_backoff=max_backoff, cost_limit=cost_limit,
                                 token_limit=token_limit)
        prepared = replace(prepared, options={**prepared.options, **cached})
        return self.job(self.submitter.store_one(prepared))

    # -- running (agentnb/execution.py) ---------------------------------------------------------------------
    def run(self, job: JobRef, *, subtasks: bool = True) -> Job:
        """Run a job until it ends or waits for a human; runs its subtasks too unless ``subtasks=False``."""
        job_id = self._id(job)
        running = sys.modules.get("agentnb.processes")
        if running is not None:  # (imported by every batch's worker process; not on the way of a plain run)
            running.refuse_in_script_import("ws.run")
        self.execution.run(job_id, subtasks=subtasks)
        return self.job(job_id)

    def step(self, job: JobRef, unit: str = "movement") -> Job:
        """Run one movement (``unit="movement"``) or one LLM call with its tool calls (``unit="call"``)."""
        if unit not in ("movement", "call"):
            raise UsageError(f"unit={unit!r}; allowed: 'movement', 'call'")
        job_id = self._id(job)
        self.execution.step(job_id, unit)
        return self.job(job_id)

    def iter(self, job: JobRef, unit: str = "call") -> Iterator[Job]:
        """Step a job to its end, yielding it after every step (for notebooks that watch or pause)."""
        while True:
            current = self.step(job, unit=unit)
            yield current
            if current.status != JobStatus.queued:
                return

    def stop(self, job: JobRef) -> list[int]:
        """Ask a job run by this workspace to pause after its current LLM call (a streaming call is cut off at once
        and asked again on resume, docs/models.md#streaming); it goes back to ``queued``.

        A job waiting for its subtasks stops them too: its running subtasks pause and no further
        one starts.  Returns the ids asked to pause (the job, then its running subtasks).
        """
        return self.execution.stop(self._id(job))

    def reply(self, job: JobRef, text: str) -> Job:
        """Add the user's comment; a job waiting for a human goes back to the queue to resume.

        A job that has ended (succeeded, failed, aborted) takes no reply: nothing would read it.
        """
        if not isinstance(text, str) or not text.strip():
            raise UsageError("reply text must be non-empty")
        job_id = self._id(job)
        with self.store.transaction() as c:
            row = self.store.job(job_id)  # StoreError "no job …" when there is none
            if row.status.terminal:
                then = ("submit a new job" if row.status == JobStatus.succeeded
                        else "retry it or submit a new job")
                raise StoreError(f"job {job_id} has ended ({row.status}), so a reply would never be read; "
                                 f"to go on, {then}")
            self.store.add_comment(c, job_id, "user", text)
            if row.status == JobStatus.waiting_human:
                self.store.set_status(
                    c, job_id, JobStatus.queued, reason="the user replied",
                    current_movement=row.resume_movement or row.current_movement, resume_movement=None,
                    enriched=None,
                )
        return self.job(job_id)

    def retry(self, job: JobRef, *, retries: int | None = None, max_backoff: float | None = None,
              cost_limit: float | None = None, token_limit: int | None = None) -> Job:
        """Queue a failed or aborted job again (``job_status`` reason ``retried``); run it with :meth:`run`.

        A failed job goes on from its last complete LLM call: its failed movement is reopened and
        resumed from its events (the call that failed is asked again; a tool call cut short is
        completed as after a crash).  An aborted job starts a new run of the movement that aborted,
        with a fresh prompt (its movement count goes on, within ``max_movements``).  ``retries`` and
        ``max_backoff`` replace the job's retry settings for the ``openai:`` model, ``cost_limit`` and
        ``token_limit`` its limits (a job aborted at its limit goes on under a higher one,
        docs/design-lab.md#budgets).  Any other status is refused with a :class:`StoreError` naming it.
        """
        from .engine.budget import check_limits, check_priced

        job_id = self._id(job)
        settings = {**check_retry_settings(retries, max_backoff),
                    **check_limits(cost_limit=cost_limit, token_limit=token_limit)}
        with self.store.transaction() as c:
            row = self.store.job(job_id)  # StoreError "no job …" when there is none
            status = row.status
            if status not in (JobStatus.failed, JobStatus.aborted):
                raise StoreError(f"job {job_id} is {status}; only a failed or aborted job can be retried")
            check_priced(row.model, settings.get("cost_limit"))
            if status == JobStatus.failed:
                self.store.reopen_failed_movement(c, job_id)
            values: dict[str, Any] = {"error": None, "ended": None, "enriched": None}
            if settings:
                values["options"] = json.dumps(row.options.updated(**settings).to_dict(), ensure_ascii=False)
            self.store.set_status(c, job_id, JobStatus.queued, reason="retried", **values)
        self.execution.forget(job_id)
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
        prepared = self.submitter.prepare(plan.instruction, piece=plan.piece, model=plan.model, inputs=plan.inputs,
                                 workdir=None, context=None, retries=None, max_backoff=None)
        job_id = self.submitter.store_one(replace(prepared, options=plan.options), forked_from_job=plan.job_id,
                                      forked_from_seq=plan.at, current_movement=plan.first)
        return self.run(job_id) if run else self.job(job_id)

    def replay(self, job: JobRef, *, piece: str | os.PathLike[str] | Piece | None = None, run: bool = True) -> Job:
        """A new job on ``replay:<job>`` with the original's instruction, ``input/`` files (as they are now),
        options and (unless ``piece`` is given) piece: every response is re-served in order and every tool
        runs again.  With the same piece its events are the original's apart from timestamps and ids, and
        its ``output/`` the same byte for byte, as long as the tools do what they did (docs/fork-compare.md)."""
        plan = plan_fork(self.store, self._id(job), at=1, piece=piece)
        prepared = self.submitter.prepare(plan.instruction, piece=plan.piece, model=f"replay:{plan.job_id}",
                                 inputs=plan.inputs, workdir=None, context=None, retries=None, max_backoff=None)
        job_id = self.submitter.store_one(replace(prepared, options=plan.options), current_movement=plan.first)
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
        epochs: int | None = None,
        cache: bool | str | None = None,
        cost_limit: float | None = None,
        job_cost_limit: float | None = None,
        job_token_limit: int | None = None,
        processes: int | None = None,
    ) -> Batch:
        """Run cases × variants as jobs, ``concurrency`` at once, scored and priced; a :class:`Batch`.

        ``cases``: a list of dicts or a DataFrame with ``instruction`` (required), ``inputs`` (a dict of
        file name → text or bytes, or a folder path) and ``expected`` (any JSON value); other columns are
        carried into the results.  Variants are every ``piece`` (a name, path, YAML text or ``Piece``, or a
        list) with every ``model`` (a spec or a list); a new batch defaults to ``plan-implement-verify`` on
        ``demo``.  ``ws.batch("exp-1")``, or the same call again with ``name="exp-1"``, resumes the batch:
        finished jobs are kept, unfinished ones run.  Given the same cases, pieces or models it does not have
        yet are added as new variants (an omitted ``piece=``/``model=`` then means the batch's own).
        ``run=False`` only creates (or looks up) the batch.  ``epochs=k`` runs every case × variant k times
        (docs/design-lab.md#epochs; default 1, or the batch's own); more than the batch has adds the missing epochs.
        ``cache=True`` (None: the workspace's ``cache``) puts the jobs it creates behind the call cache
        (docs/design-lab.md#call-cache).
        ``cost_limit`` (US dollars, kept with the batch) pauses the whole batch when reached;
        ``job_cost_limit``/``job_token_limit`` abort each job at its own (docs/design-lab.md#budgets).
        ``processes=N`` runs the jobs in N worker processes on this store (None: one per 64 jobs at once, at most
        one per core but one; docs/design-lab.md#processes).
        """
        from .budgets import batch_limit, batch_models, check_batch_limits
        from .processes import check_processes, check_tools, refuse_in_script_import

        refuse_in_script_import("ws.batch")
        check_concurrency(concurrency)
        check_epochs(epochs)
        check_processes(processes)
        cached = cache_option(cache, self.cache)
        if isinstance(cases, str) and name is None and (job_cost_limit is not None or job_token_limit is not None):
            raise UsageError(f"job_cost_limit/job_token_limit are given to the jobs a call creates, and ws.batch({cases!r})"
                             " creates none; give the cases again with new pieces or models, or submit with cost_limit=")
        if isinstance(cases, str) and name is None and cache is not None:
            raise UsageError(f"cache is given to the jobs a call creates, and ws.batch({cases!r}) creates none (its jobs "
                             "keep the cache they were made with); give the cases again with new pieces or models")
        limits = check_batch_limits(cost_limit, job_cost_limit, job_token_limit,
                                    batch_models(self.store, cases if isinstance(cases, str) else name, model))
        b = open_batch(self, cases, piece=piece, model=model, name=name, scorers=scorers, context=context,
                       retries=retries, max_backoff=max_backoff, check_model=self._checked_spec, epochs=epochs,
                       options=cached, job_limits=limits,
                       # processes asked for jobs with a notebook's tool: refused before the batch is written
                       check_run=lambda tools, jobs: check_tools(processes, concurrency, jobs, tools))
        if "cost_limit" in limits:  # kept with the batch, so a later run (or a run=False batch's) keeps it
            batch_limit(self.store, b.name, float(limits["cost_limit"]))
        if run:
            b.run(concurrency=concurrency, progress=progress, processes=processes)
        return b

    def batches(self) -> list[dict[str, Any]]:
        """Every batch: name, created, jobs and a count per status (``n_<status>``)."""
        return [{k: v for k, v in b.to_dict().items() if k not in ("cases", "variants", "options", "fingerprint")}
                for b in reads.batches(self.store)]

    def score(self, batch_or_jobs: Batch | str | JobRef | Sequence[JobRef], scorers: Mapping[str, Scorer]) -> list[Job]:
        """Score ended jobs (a batch, a batch name, a job or jobs) again without running them; the jobs scored.

        Each scorer's result is a new ``score`` event (the latest per name is the score in ``batch.frame``).
        Failed and aborted jobs are scored too; queued, running and waiting ones are skipped.
        """
        chosen = check_scorers(scorers)
        if not chosen:
            raise UsageError("no scorers: give scorers={'name': function(job)}")
        jobs, batch = self._jobs_of(batch_or_jobs, "ws.score")
        if batch is not None:
            check_score_names(chosen, batch.cases)
        return score_jobs(self.store, jobs, chosen)

    def _jobs_of(self, batch_or_jobs: Batch | str | JobRef | Sequence[JobRef], what: str) -> tuple[list[Job], Batch | None]:
        """The jobs of a batch, a batch name, a job or jobs (and the batch, when one was given)."""
        if isinstance(batch_or_jobs, str):
            if reads.batch(self.store, batch_or_jobs) is None:
                known = ", ".join(b.name for b in reads.batches(self.store)) or "none yet"
                raise UsageError(f"no batch {batch_or_jobs!r} in {self.store.path} (batches: {known})")
            batch_or_jobs = Batch(self, batch_or_jobs)
        if isinstance(batch_or_jobs, Batch):
            return batch_or_jobs.jobs, batch_or_jobs
        if isinstance(batch_or_jobs, (bytes, Mapping)):
            raise UsageError(f"{what} takes a Batch, a batch name, a job or a list of jobs, "
                             f"not {type(batch_or_jobs).__name__}")
        if not isinstance(batch_or_jobs, Iterable):  # one job
            return [self.job(batch_or_jobs)], None
        return [self.job(j) for j in batch_or_jobs], None

    def _checked_spec(self, spec: str) -> str:
        if not isinstance(spec, str):
            raise UsageError(f"model spec {spec!r} must be text (e.g. 'demo', 'scripted:PATH', 'openai:NAME')")
        spec = normalise_spec(spec)
        check_model_spec(spec)
        resolve_model(spec, store=self.store)
        return spec

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

    def export_otel(self, jobs: Batch | str | JobRef | Sequence[JobRef], path: str | os.PathLike[str], *,
                    content: bool = False, max_chars: int | None = None) -> Path:
        """Write the OpenTelemetry GenAI traces of a batch (or its name), a job or jobs to ``path`` as OTLP JSON
        Lines, one ``TracesData`` per root job, subtasks nested (docs/otel.md).  ``content=True`` adds the
        messages and tool arguments and results, scrubbed and cut to ``max_chars`` per attribute."""
        from .views.otel import DEFAULT_MAX_CHARS, export_otel

        chosen, _ = self._jobs_of(jobs, "ws.export_otel")
        return export_otel(self.store, [j.id for j in chosen], path, content=content,
                           max_chars=DEFAULT_MAX_CHARS if max_chars is None else max_chars)

    def export_notebook(self, job: JobRef, path: str | os.PathLike[str]) -> Path:
        from .views.transcript import export_notebook

        return export_notebook(self, self._id(job), path)
