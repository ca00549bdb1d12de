"""Batches (docs/design-lab.md): cases × variants, each an ordinary job, run concurrently, scored and compared.

``ws.batch(cases, piece=[…], model=[…], name=…)`` checks every case and variant before anything is
stored, then creates the batch row and all its jobs in one transaction (a refused batch leaves nothing
behind).  Calling it again with the same name resumes: finished jobs are kept, unfinished ones run.
This module does not import the facade (which imports it): what it needs of the workspace is
:class:`BatchHost`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .engine.pieces import Piece, load_piece, parse_piece
from .errors import UsageError
from .events import ScoreEvent
from .models.base import check_retry_settings
from .store import reads
from .store.base import JOB_STATES, TERMINAL_STATES, JobStatus, Store
from .store.records import BatchRecord
from .submission import Submitter, remove_folders

if TYPE_CHECKING:
    import pandas as pd

    from .batch_compare import BatchComparison

__all__ = ["DEFAULT_CONCURRENCY", "RESERVED_COLUMNS", "Batch", "BatchHost", "Case", "Scorer", "Variant", "batch_names",
           "batch_of_cases", "check_cases", "check_concurrency", "check_epochs", "check_score_names", "check_scorers",
           "check_variants", "open_batch",
           "record_scores", "score_jobs", "score_value"]

DEFAULT_CONCURRENCY = 4
# the statuses a batch run starts or resumes, and the order its summary counts them in
_PENDING = (JobStatus.queued, JobStatus.running, JobStatus.waiting_subtasks)
_COUNTED = (JobStatus.succeeded, JobStatus.failed, JobStatus.aborted, JobStatus.running, JobStatus.queued)
Scorer = Callable[[Any], Any]
# what a scorer may return; anything else is recorded as the score's error
SCORE_TYPES = (bool, int, float, str)


class BatchHost(Protocol):
    """What a batch needs of the workspace facade (:class:`agentnb.workspace.Workspace`)."""

    @property
    def store(self) -> Store: ...

    @property
    def root(self) -> Path: ...

    def job(self, job: Any) -> Any: ...

    def run(self, job: Any, *, subtasks: bool = True) -> Any: ...

    def stop(self, job: Any) -> list[int]: ...

    @property
    def submitter(self) -> Submitter: ...

    @property
    def execution(self) -> Any: ...

    @property
    def open_args(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Case:
    """One case of a batch: the instruction, its input files, the expected value and the other columns."""

    index: int
    instruction: str
    inputs: dict[str, str | bytes | os.PathLike[str]] = field(default_factory=dict)
    expected: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def stored(self) -> dict[str, Any]:
        """What the batch row keeps of the case (input files by name, size and hash; their bytes are in
        each job's ``input/``); also what its fingerprint is made of."""
        files = {name: _file_digest(value) for name, value in sorted(self.inputs.items())}
        return {"instruction": self.instruction, "inputs": files, "expected": self.expected, "extra": self.extra}


@dataclass(frozen=True)
class Variant:
    """One piece × model of a batch; ``label`` is the piece's name, made unique within the batch."""

    index: int
    label: str
    piece: Piece
    model: str

    def stored(self) -> dict[str, Any]:
        return {"piece": self.label, "piece_yaml": self.piece.to_yaml(), "piece_source": self.piece.source,
                "model": self.model}


def _file_digest(value: str | bytes | os.PathLike[str]) -> dict[str, Any]:
    if isinstance(value, os.PathLike):
        data = Path(value).read_bytes()
    elif isinstance(value, bytes):
        data = value
    else:
        data = str(value).encode("utf-8")
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


# -- checking the input -------------------------------------------------------------------------------------

def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON data (numpy/pandas scalars unwrapped, a missing value as None), or a UsageError."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return None if math.isnan(value) else float(value)
    if type(value).__module__ == "numpy":
        tolist = getattr(value, "tolist", None)  # a numpy array (a list column read from parquet, say) or scalar
        if callable(tolist):
            return _plain(tolist(), where)
    try:
        import pandas as pd

        if value is pd.NA or value is pd.NaT:
            return None
        if isinstance(value, pd.Timestamp):
            return value.isoformat()
    except ImportError:  # pragma: no cover - pandas is a dependency
        pass
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise UsageError(f"{where} is a {type(value).__name__}; allowed: JSON values (text, numbers, true/false, "
                     "None, lists and dicts of them), so that the batch can be resumed from its store")


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or (
        type(value).__module__.startswith("pandas") and str(value) in ("<NA>", "NaT"))


def _inputs(value: Any, where: str) -> dict[str, str | bytes | os.PathLike[str]]:
    if _missing(value):
        return {}
    if isinstance(value, Mapping):
        out: dict[str, str | bytes | os.PathLike[str]] = {}
        for name, content in value.items():
            if not isinstance(name, str):
                raise UsageError(f"{where}: file name {name!r} is a {type(name).__name__}; allowed: text, a path "
                                 "relative to input/")
            if isinstance(content, os.PathLike) and not Path(content).is_file():
                raise UsageError(f"{where}[{name!r}]: {os.fspath(content)!r} is not an existing file")
            if not isinstance(content, (str, bytes, os.PathLike)):
                raise UsageError(f"{where}[{name!r}] is a {type(content).__name__}; allowed: text, bytes or a "
                                 "pathlib.Path of a file to copy")
            out[name] = content
        return out
    if isinstance(value, (str, os.PathLike)):
        folder = Path(value).expanduser()
        if not folder.is_dir():
            what = "a file, not a folder" if folder.exists() else "not an existing folder"
            raise UsageError(f"{where}: {os.fspath(value)!r} is {what}; allowed: a dict of file name → text "
                             "or bytes, or the path of a folder whose files are copied into input/")
        return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
    raise UsageError(f"{where} is a {type(value).__name__}; allowed: a dict of file name → text or bytes, "
                     "or the path of a folder")


def check_cases(cases: Any) -> list[Case]:
    """The cases as :class:`Case` objects: a list of dicts or a DataFrame, each with an ``instruction``."""
    records: list[Any]
    if hasattr(cases, "to_dict") and hasattr(cases, "columns"):  # a DataFrame
        records = cases.to_dict("records")
    elif isinstance(cases, (str, bytes, Mapping)) or not isinstance(cases, Iterable):
        raise UsageError(f"cases must be a list of dicts or a DataFrame, not {type(cases).__name__}")
    else:
        records = list(cases)
    if not records:
        raise UsageError("cases is empty; give at least one case with an 'instruction'")
    out = []
    for i, rec in enumerate(records):
        if not isinstance(rec, Mapping):
            raise UsageError(f"case {i} is a {type(rec).__name__}; allowed: a dict with an 'instruction'")
        instruction = rec.get("instruction")
        if _missing(instruction) or not isinstance(instruction, str) or not instruction.strip():
            got = "has none" if _missing(instruction) else f"is {instruction!r}"
            raise UsageError(f"case {i} needs an 'instruction' (non-empty text); it {got}")
        extra = {str(k): _plain(v, f"case {i} column {k!r}") for k, v in rec.items()
                 if k not in ("instruction", "inputs", "expected")}
        reserved = sorted(set(extra) & set(RESERVED_COLUMNS))
        if reserved:
            raise UsageError(f"case {i} has column(s) {', '.join(map(repr, reserved))}, which the batch's frame "
                             f"uses itself; rename them (reserved: {', '.join(RESERVED_COLUMNS)})")
        out.append(Case(index=i, instruction=instruction, inputs=_inputs(rec.get("inputs"), f"case {i} inputs"),
                        expected=_plain(rec.get("expected"), f"case {i} expected"), extra=extra))
    return out


# the columns of Batch.frame that a case's own columns may not take
RESERVED_COLUMNS = ("case", "instruction", "expected", "variant", "variant_label", "epoch", "piece", "model", "job",
                    "status", "subtasks", "movements", "llm_calls", "prompt_tokens", "completion_tokens", "total_tokens",
                    "cost_usd", "judge_cost_usd", "seconds")


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _load_variant_piece(ref: Any) -> Piece:
    return load_piece(ref)  # a name, a path, YAML text or a Piece


def check_variants(pieces: Any, models: Any, check_model: Callable[[str], str]) -> list[Variant]:
    """Pieces × models, every piece loaded and every model spec checked (``check_model`` normalises one)."""
    loaded = [_load_variant_piece(p) for p in _as_list(pieces)]
    specs = [check_model(m) for m in _as_list(models)]
    if not loaded:
        raise UsageError("piece= is an empty list; give at least one piece")
    if not specs:
        raise UsageError("model= is an empty list; give at least one model spec")
    labels: list[str] = []
    for p in loaded:
        label, n = p.name, 2
        while label in labels:  # two pieces of the same name (say, a piece and an edited copy)
            label, n = f"{p.name}#{n}", n + 1
        labels.append(label)
    out: list[Variant] = []
    for (label, p) in zip(labels, loaded, strict=True):
        for m in specs:
            out.append(Variant(index=len(out), label=label, piece=p, model=m))
    keys = [(v.piece.to_yaml(), v.model) for v in out]
    if len(set(keys)) != len(keys):
        raise UsageError("the same piece and model are given twice; each variant must differ")
    return out


def check_scorers(scorers: Any) -> dict[str, Scorer]:
    if scorers is None:
        return {}
    if not isinstance(scorers, Mapping):
        raise UsageError(f"scorers must be a dict of name → function(job), not {type(scorers).__name__}")
    for name, fn in scorers.items():
        if not isinstance(name, str) or not name.strip():
            raise UsageError(f"scorer name {name!r} must be non-empty text")
        if not callable(fn):
            raise UsageError(f"scorer {name!r} is a {type(fn).__name__}, which is not callable; "
                             "allowed: a function taking the finished Job")
        if name in RESERVED_COLUMNS:
            raise UsageError(f"scorer name {name!r} is a column of the batch's frame; choose another name")
        if name.endswith("_error") and name[:-len("_error")] in scorers:
            raise UsageError(f"scorer name {name!r} is the error column of scorer {name[:-6]!r}; choose another name")
    return dict(scorers)


def check_score_names(scorers: Mapping[str, Scorer], cases: Iterable[Mapping[str, Any]]) -> None:
    """Refuse a scorer named like a case's own column: both would be a column of the batch's frame."""
    columns = {k for case in cases for k in case.get("extra", {})}
    clash = sorted(n for n in scorers if n in columns or f"{n}_error" in columns)
    if clash:
        raise UsageError(f"scorer name(s) {', '.join(map(repr, clash))} clash with the cases' own columns "
                         f"({', '.join(sorted(columns))}); choose other names")


def check_concurrency(concurrency: Any) -> int:
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise UsageError(f"concurrency={concurrency!r}; allowed: a whole number ≥ 1 (jobs run at once)")
    return concurrency


def check_epochs(epochs: Any) -> int | None:
    """``epochs=`` as given (None: the batch's own, 1 for a new batch), or a UsageError (docs/design-lab.md#epochs)."""
    if epochs is None:
        return None
    if type(epochs).__module__ == "numpy" and callable(getattr(epochs, "item", None)):
        epochs = epochs.item()  # a whole number read from a DataFrame or numpy
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise UsageError(f"epochs={epochs!r}; allowed: a whole number ≥ 1 (how many times each case × variant runs)")
    return epochs


def _canonical(value: Any) -> Any:
    # A DataFrame turns a column of whole numbers with a gap into floats: 1 and 1.0 are the same case.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def fingerprint(stored_cases: Sequence[Mapping[str, Any]]) -> str:
    """What tells the same cases from other ones (1 and 1.0 count as equal)."""
    text = json.dumps(_canonical(list(stored_cases)), ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def batch_names(store: Store) -> list[str]:
    return [b.name for b in reads.batches(store)]


def batch_of_cases(store: Store, cases: Any) -> str | None:
    """The latest batch made of exactly these cases (checked as :func:`check_cases` does), or None."""
    print_ = fingerprint([c.stored() for c in check_cases(cases)])
    found = [b.name for b in reads.batches(store) if b.fingerprint == print_]
    return found[-1] if found else None


# -- scoring ---------------------------------------------------------------------------------------------------

def score_value(fn: Scorer, job: Any) -> tuple[Any, str | None]:
    """Run one scorer: ``(value, None)``, or ``(None, error)`` when it raised or returned another type."""
    try:
        value = fn(job)
    except Exception as exc:  # a scorer's bug is recorded on the job, never stops the batch
        text = " ".join(str(exc).split())
        return None, f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None, "returned NaN; allowed: bool, int, float or str"
    if not isinstance(value, SCORE_TYPES):
        return None, f"returned {type(value).__name__} {value!r:.80}; allowed: bool, int, float or str"
    return value, None


def record_scores(store: Store, job: Any, scorers: Mapping[str, Scorer], now: Callable[[], float]) -> list[ScoreEvent]:
    """Run each scorer on the finished ``job`` and record one ``score`` event per scorer."""
    events = []
    for name, fn in scorers.items():
        value, error = score_value(fn, job)
        events.append(ScoreEvent(job_id=job.id, ts=now(), name=name, value=value, error=error))
    if events:
        store.append(events)
    return events


def score_jobs(store: Store, jobs: Iterable[Any], scorers: Mapping[str, Scorer]) -> list[Any]:
    """Score the jobs among ``jobs`` that have ended (succeeded, failed or aborted); the jobs scored."""
    scored = [job for job in jobs if str(job.status) in TERMINAL_STATES]
    for job in scored:
        record_scores(store, job, scorers, _now)
    return scored


# -- the batch ---------------------------------------------------------------------------------------------

class Batch:
    """A named batch of a workspace: its cases, variants and jobs; results as DataFrames.

    Built by ``ws.batch(...)``; everything it shows is read from the store, so a Batch kept in a
    variable never goes stale.
    """

    def __init__(self, ws: BatchHost, name: str, scorers: Mapping[str, Scorer] | None = None) -> None:
        self.ws = ws
        self.name = name
        self.scorers: dict[str, Scorer] = dict(scorers or {})

    def __repr__(self) -> str:
        counts = self.counts()
        done = sum(counts[s] for s in TERMINAL_STATES)
        note = self.limit_note(counts['jobs'] - done)
        return f"<Batch {self.name!r}: {done}/{counts['jobs']} ended · {self._counts_text(counts)}{note and ' · ' + note}>"

    def limit_note(self, unfinished: int | None = None) -> str:
        """What the batch's cost limit has come to (docs/design-lab.md#budgets); "" without one."""
        from .budgets import limit_note

        if unfinished is None:
            counts = self.counts()
            unfinished = counts["jobs"] - sum(counts[s] for s in TERMINAL_STATES)
        return limit_note(self.ws.store, self.name, self._record().options, unfinished)

    @staticmethod
    def _counts_text(counts: Mapping[str, int]) -> str:
        parts = [f"{counts[s]} {s}" for s in _COUNTED if counts[s]]
        waiting = counts[JobStatus.waiting_human] + counts[JobStatus.waiting_subtasks]
        if waiting:
            parts.append(f"{waiting} waiting")
        return ", ".join(parts) or "no jobs"

    # -- what it is ---------------------------------------------------------------------------------------
    @property
    def store(self) -> Store:
        return self.ws.store

    def _record(self) -> BatchRecord:
        """The batch as stored now (its cases and variants typed); a UsageError when the store has none of
        this name."""
        found = reads.batch(self.ws.store, self.name)
        if found is None:
            raise UsageError(f"no batch {self.name!r} in {self.ws.store.path}")
        return found

    @property
    def cases(self) -> list[dict[str, Any]]:
        """The stored cases: instruction, inputs (name → bytes and sha256), expected, extra columns."""
        return [c.to_dict() for c in self._record().cases]

    @property
    def variants(self) -> list[dict[str, Any]]:
        """The variants, in order: piece (its label), piece_yaml, piece_source, model."""
        return [v.to_dict() for v in self._record().variants]

    @property
    def epochs(self) -> int:
        """How many times each case × variant runs (docs/design-lab.md#epochs)."""
        return self._record().epochs

    @property
    def jobs(self) -> list[Any]:
        """The batch's jobs, by case, then variant, then epoch."""
        rows = sorted(self.ws.store.jobs(batch=self.name), key=lambda r: r.batch_position)
        return [self.ws.job(r.id) for r in rows]

    def counts(self) -> dict[str, int]:
        """How many jobs the batch has (``jobs``) and how many are in each status."""
        rows = self.ws.store.jobs(batch=self.name)
        out = {s: 0 for s in JOB_STATES}
        for r in rows:
            out[r.status.value] = out.get(r.status.value, 0) + 1
        out["jobs"] = len(rows)
        return out

    # -- running ----------------------------------------------------------------------------------------------
    def pending(self) -> list[int]:
        """Ids of the jobs a run would start or resume: queued ones (new, paused, interrupted) and running
        ones whose process is gone; jobs waiting for their subtasks are included (their children run).  Epoch by
        epoch: every case × variant of epoch 1 first, so that a run cut short has whole epochs to compare."""
        rows = sorted(self.ws.store.jobs(batch=self.name), key=_epoch_first)
        return [r.id for r in rows if r.status in _PENDING]

    def run(self, *, concurrency: int = DEFAULT_CONCURRENCY, scorers: Mapping[str, Scorer] | None = None,
            progress: bool = True, resume: str | None = None, cost_limit: float | None = None,
            processes: int | None = None) -> Batch:
        """Run every unfinished job, ``concurrency`` at once, and score each as it ends (see :meth:`score`).

        Ctrl-C (or the notebook's stop button) pauses the running jobs after their current call and
        re-raises; ``ws.batch(name)`` resumes.  A job another process is running is skipped
        (``last_run.skipped``).  ``progress``: a tqdm bar on stderr (see ``agentnb.executor``).  ``resume``: how
        the line after an interrupt says to resume (default ``ws.batch(name)``).  ``cost_limit``: the batch's
        (kept with it; None: the one it has) — once reached, the batch pauses (docs/design-lab.md#budgets).
        ``processes``: worker processes that run the jobs (None: chosen from the cores; docs/design-lab.md#processes)."""
        from .processes import check_processes, refuse_in_script_import, run_batch

        refuse_in_script_import("Batch.run")
        concurrency, processes = check_concurrency(concurrency), check_processes(processes)
        if scorers is not None:
            self.scorers = check_scorers(scorers)
        from .budgets import BatchBudget, batch_limit, batch_models, check_batch_limits

        if cost_limit is not None:  # checked before it is kept with the batch
            cost_limit = float(check_batch_limits(cost_limit, None, None,
                                                  batch_models(self.ws.store, self.name, None))["cost_limit"])
        limit = batch_limit(self.ws.store, self.name, cost_limit)  # docs/design-lab.md#budgets: kept with the batch
        budget = None if limit is None else BatchBudget(self.ws.store, self.name, limit, {
            r.id: r.model for r in self.ws.store.jobs(batch=self.name)}, self.ws.execution.pause_soon)
        try:  # what the run did (the jobs it skipped because another process runs them, say), for the curious
            self.last_run = run_batch(self.ws, self.pending(), self._record().variants, processes=processes,
                                      concurrency=concurrency, progress=progress, batch=self,
                                      on_end=self._scored_once, resume=resume, budget=budget)
        finally:
            if budget is not None:
                budget.close()
        self._score_unscored()
        return self

    def _scored_once(self, job: Any) -> None:
        """Score a job that just ended with every scorer it has no score from yet."""
        if not self.scorers or str(job.status) not in TERMINAL_STATES:
            return
        have = {ev.name for ev in self.ws.store.events(job.id, kinds=["score"]) if isinstance(ev, ScoreEvent)}
        todo = {n: fn for n, fn in self.scorers.items() if n not in have}
        if todo:
            record_scores(self.ws.store, job, todo, _now)

    def _score_unscored(self) -> None:
        # a job that ended while no scorer was given (or in a run that was killed before it scored)
        if not self.scorers:
            return  # not a Job object built for each of the batch's jobs for nothing (17 ms at 400 jobs)
        for job in self.jobs:
            self._scored_once(job)

    def score(self, scorers: Mapping[str, Scorer] | None = None) -> Batch:
        """Score every ended job again (new ``score`` events; the latest per name counts), without running any.

        Failed and aborted jobs are scored too (a scorer that checks ``output/`` says False for them, so a
        variant's mean score counts its failures); jobs still queued, running or waiting are not.
        """
        chosen = check_scorers(scorers) if scorers is not None else self.scorers
        if not chosen:
            raise UsageError("no scorers: give scorers={'name': function(job)}")
        check_score_names(chosen, self.cases)
        score_jobs(self.ws.store, self.jobs, chosen)
        return self

    # -- results (views of the store) -----------------------------------------------------------------------------
    @property
    def frame(self) -> pd.DataFrame:
        """One row per case × variant × epoch (docs/design-lab.md): ``case``, ``instruction``, the case's own columns,
        ``expected``, ``variant``, ``variant_label`` (short: the piece and the model's short spec), ``epoch`` (from
        1; docs/design-lab.md#epochs), ``piece``,
        ``model`` (the full spec), ``job``, ``status``, then the totals of the job and
        its subtasks (``subtasks``, ``movements``, ``llm_calls``, the tokens, ``cost_usd``, ``seconds`` of
        running time), then one column per scorer (its latest score; NA when it raised) and ``<name>_error``.
        See :mod:`agentnb.views.batch_frames`."""
        from .views.batch_frames import batch_frame

        return batch_frame(self)

    def summary(self, *, confidence: float = 0.95, n_resamples: int = 9999, seed: int | None = 0) -> pd.DataFrame:
        """One row per variant (docs/design-lab.md): ``variant``, ``variant_label``, counts by status,
        ``mean_<score>`` of each boolean or numeric score, mean/median tokens, total and mean cost, mean/p50/p95
        running seconds of the ended jobs, then the full ``piece`` and ``model``; each mean followed by its
        ``_se``, ``_ci_low``, ``_ci_high`` (docs/design-lab.md#confidence-intervals: a bootstrap over cases,
        ``n_resamples`` draws from ``seed``; None: fresh draws)."""
        from .views.batch_frames import batch_summary
        from .views.batch_stats import settings

        return batch_summary(self, stats=settings(confidence, n_resamples, seed))

    def compare(self, baseline: Any, *, confidence: float = 0.95, n_resamples: int = 9999,
                seed: int | None = 0) -> BatchComparison:
        """Every other variant against ``baseline`` (a variant's number or label, or a piece or model only it
        has), paired by case: a :class:`~agentnb.batch_compare.BatchComparison` (docs/design-lab.md#paired-comparison)."""
        from .batch_compare import compare_batch

        return compare_batch(self, baseline, confidence=confidence, n_resamples=n_resamples, seed=seed)

    def _repr_html_(self) -> str:
        from html import escape

        from .views.batch_frames import batch_html

        note = self.limit_note()
        return batch_html(self) + (f'<div class="anb-batch-budget">{escape(note)}</div>' if note else "")


def _epoch_first(row: Any) -> tuple[int, int, int]:
    case, variant, epoch = row.batch_position
    return epoch, case, variant


def _now() -> float:
    import time

    return time.time()


def _call_variants(existing: BatchRecord | None, piece: Any, model: Any,
                   check_model: Callable[[str], str]) -> list[Variant]:
    """The variants a call names.  A new batch defaults to ``plan-implement-verify`` on ``demo``; for an
    existing batch, an omitted ``piece=`` or ``model=`` means the batch's own (so repeating the call without
    them adds nothing, and ``model=`` alone adds that model to every piece of the batch)."""
    if existing is None:
        return check_variants("plan-implement-verify" if piece is None else piece,
                              "demo" if model is None else model, check_model)
    if piece is None and model is None:
        return []
    if piece is None:
        seen: dict[str, Piece] = {}
        for v in existing.variants:
            seen.setdefault(v.piece_yaml, parse_piece(v.piece_yaml, source=v.piece_source or "<piece>"))
        piece = list(seen.values())
    if model is None:
        model = list(dict.fromkeys(v.model for v in existing.variants))
    return check_variants(piece, model, check_model)


class _Raced(Exception):
    """The batch changed (or its name was taken) between reading it and the write transaction."""


# how often a call is tried again when other processes keep changing the same batch under it
_RACE_TRIES = 5


def open_batch(ws: BatchHost, cases: Any, *, piece: Any, model: Any, name: str | None, scorers: Any,
               context: Mapping[str, Any] | None, retries: int | None, max_backoff: float | None,
               check_model: Callable[[str], str], epochs: int | None = None,
               options: Mapping[str, Any] | None = None, job_limits: Mapping[str, Any] | None = None,
               check_run: Callable[[set[str], int], None] | None = None) -> Batch:
    """Create the batch ``name`` (every job of it, in one transaction), or extend/resume the one of that name.

    What the call decides from (the batch as it was read, a free name) is checked again inside the write
    transaction, which the store orders against every other: when another process created or extended the
    batch meanwhile, nothing is written and the call is made again on the batch as it now is.
    ``check_run(tool names, jobs)``: told, before anything is written, the tools and the number of the jobs the
    batch will then have to run; what it raises leaves the store as it was."""
    for _ in range(_RACE_TRIES):
        try:
            return _open_batch(ws, cases, piece=piece, model=model, name=name, scorers=scorers, context=context,
                               retries=retries, max_backoff=max_backoff, check_model=check_model, epochs=epochs,
                               options=options, job_limits=job_limits or {}, check_run=check_run)
        except _Raced:
            continue
    raise UsageError(f"batch {name!r} was changed by other processes {_RACE_TRIES} times while this call "
                     "was adding to it: nothing was added; call again")


def _open_batch(ws: BatchHost, cases: Any, *, piece: Any, model: Any, name: str | None, scorers: Any,
                context: Mapping[str, Any] | None, retries: int | None, max_backoff: float | None,
                check_model: Callable[[str], str], epochs: int | None,
                options: Mapping[str, Any] | None = None, job_limits: Mapping[str, Any] | None = None,
                check_run: Callable[[set[str], int], None] | None = None) -> Batch:
    chosen = check_scorers(scorers)
    epochs = check_epochs(epochs)
    # checked here too, not only with each new job: a batch that is resumed or complete makes none
    check_retry_settings(retries, max_backoff)
    if isinstance(cases, str) and name is None:  # ws.batch("exp-1"): resume by name
        name, cases = cases, None
    _check_name(ws.store, name, given_cases=cases is not None)
    existing = reads.batch(ws.store, name) if name is not None else None
    if cases is None:
        return _resumed(ws, str(name), existing, chosen, piece=piece, model=model, epochs=epochs)
    checked = check_cases(cases)
    variants = _call_variants(existing, piece, model, check_model)
    stored_cases = [c.stored() for c in checked]
    check_score_names(chosen, stored_cases)
    print_ = fingerprint(stored_cases)
    if name is None:
        name = _free_name(ws.store)
    total = epochs or 1
    runs = [(e, v) for e in range(1, total + 1) for v in variants]
    if existing is not None:
        _check_same_cases(name, existing, stored_cases, print_)
        variants = _added_variants(existing, variants)
        # more epochs than the batch has add the missing ones to every variant; fewer remove none (as variants)
        total = max(existing.epochs, epochs or 0)
        runs = [(e, v) for e in range(existing.epochs + 1, total + 1) for v in _stored_variants(existing)]
        runs += [(e, v) for e in range(1, total + 1) for v in variants]
        if not runs:
            return Batch(ws, name, chosen)
    prepared = _prepared_jobs(ws, checked, runs, context=context, retries=retries, max_backoff=max_backoff,
                              options=options, job_limits=job_limits or {})
    if check_run is not None:
        from .processes import batch_tools

        tools = {t for _, v in runs for m in v.piece.movements for t in m.tools}
        pending = 0
        if existing is not None:
            tools |= batch_tools(existing.variants)
            pending = len(Batch(ws, name, chosen).pending())
        check_run(tools, pending + len(prepared))
    _write_batch(ws, name, existing, prepared, fingerprint=print_, stored_cases=stored_cases, variants=variants,
                 context=context, epochs=total)
    return Batch(ws, name, chosen)


def _check_name(store: Store, name: Any, *, given_cases: bool) -> None:
    """Refuse a malformed batch name, and a call with neither cases nor a name."""
    if name is not None and (not isinstance(name, str) or not name.strip() or name != name.strip()):
        raise UsageError(f"batch name {name!r} must be non-empty text without surrounding spaces")
    if not given_cases and name is None:
        known = ", ".join(batch_names(store)) or "none yet"
        raise UsageError(f"ws.batch needs cases (a list of dicts or a DataFrame) or the name of a batch to resume "
                         f"(batches: {known})")


def _resumed(ws: BatchHost, name: str, existing: BatchRecord | None, chosen: dict[str, Scorer], *, piece: Any,
             model: Any, epochs: int | None) -> Batch:
    """The batch ``name`` resumed as it is (a call without cases)."""
    if existing is not None and (piece is not None or model is not None):
        # its input files are kept by digest only: new variants' jobs need the cases themselves
        given = " and ".join(k for k, v in (("piece=", piece), ("model=", model)) if v is not None)
        raise UsageError(f"ws.batch({name!r}) resumes the batch as it is, without {given}; to add pieces or "
                         f"models, give its cases again: ws.batch(cases, piece=…, model=…, name={name!r})")
    if existing is not None and epochs is not None and epochs > existing.epochs:
        # in words for every front end (ws.batch, the magic's and the command's --epochs)
        raise UsageError(f"batch {name!r} has {existing.epochs} epoch(s); adding epochs needs its cases again (its "
                         f"input files are kept by digest only): give the cases, the batch's name and epochs {epochs}")
    if existing is None:
        known = ", ".join(batch_names(ws.store)) or "none yet"
        raise UsageError(f"no batch {name!r} in {ws.store.path} (batches: {known}); "
                         "give cases to create it")
    check_score_names(chosen, [c.to_dict() for c in existing.cases])
    return Batch(ws, name, chosen)


def _free_name(store: Store) -> str:
    """The first ``batch-<n>`` no batch has, from the number of batches on."""
    taken = set(batch_names(store))
    n = len(taken) + 1
    while f"batch-{n}" in taken:
        n += 1
    return f"batch-{n}"


def _check_same_cases(name: str, existing: BatchRecord, stored_cases: list[dict[str, Any]], print_: str) -> None:
    """Refuse to add to the batch ``name`` cases other than its own."""
    if existing.fingerprint == print_:
        return
    old = [c.to_dict() for c in existing.cases]
    if not _same_cases(old, stored_cases):
        raise UsageError(_differs(name, old, stored_cases))


def _added_variants(existing: BatchRecord, variants: list[Variant]) -> list[Variant]:
    """The ``variants`` the batch has not got yet, numbered after its own and labelled apart from them (a piece
    of the same name but other YAML gets ``name#2``)."""
    have = {(v.piece_yaml, v.model) for v in existing.variants}
    labels = {v.piece for v in existing.variants}
    added: list[Variant] = []
    for v in variants:
        if (v.piece.to_yaml(), v.model) in have:
            continue
        label, n = v.label, 2
        while label in labels and not _labels_piece(existing, label, v.piece.to_yaml()):
            label, n = f"{v.piece.name}#{n}", n + 1
        labels.add(label)
        added.append(Variant(index=len(existing.variants) + len(added), label=label, piece=v.piece, model=v.model))
    return added


def _labels_piece(existing: BatchRecord, label: str, piece_yaml: str) -> bool:
    """Whether ``label`` is the batch's label of this very piece (then a new model of it shares the label)."""
    return any(o.piece == label and o.piece_yaml == piece_yaml for o in existing.variants)


def _stored_variants(existing: BatchRecord) -> list[Variant]:
    """The batch's own variants, their pieces parsed again (to add epochs to them)."""
    return [Variant(index=i, label=v.piece, piece=parse_piece(v.piece_yaml, source=v.piece_source or "<piece>"),
                    model=v.model) for i, v in enumerate(existing.variants)]


# one job to create: its epoch, case and variant, and the job as prepared
_Prepared = tuple[int, Case, Variant, Any]


def _prepared_jobs(ws: BatchHost, cases: list[Case], runs: list[tuple[int, Variant]], *,
                   context: Mapping[str, Any] | None, retries: int | None,
                   max_backoff: float | None, options: Mapping[str, Any] | None = None,
                   job_limits: Mapping[str, Any] | None = None) -> list[_Prepared]:
    """Every job of cases × ``runs`` (epoch, variant) checked and prepared, before anything is stored: epoch by
    epoch (a worker takes the oldest queued job first), each case × variant prepared once for all its epochs;
    ``options``: more job options for each (the call cache's mode)."""
    once: dict[tuple[int, int], Any] = {}
    for case in cases:
        for _epoch, variant in runs:
            if (case.index, variant.index) in once:
                continue
            try:
                limits = job_limits or {}
                prep = ws.submitter.prepare(case.instruction, piece=variant.piece, model=variant.model,
                                            inputs=case.inputs, workdir=None, context=context, retries=retries,
                                            max_backoff=max_backoff, cost_limit=limits.get("job_cost_limit"),
                                            token_limit=limits.get("job_token_limit"))
            except UsageError as exc:  # say which case (the same check fails for every variant of it)
                raise UsageError(f"case {case.index}: {exc}") from exc
            once[case.index, variant.index] = replace(prep, options={**prep.options, **options}) if options else prep
    ordered = sorted(((e, c, v) for c in cases for e, v in runs), key=lambda t: (t[0], t[1].index, t[2].index))
    return [(e, c, v, once[c.index, v.index]) for e, c, v in ordered]


def _write_batch(ws: BatchHost, name: str, existing: BatchRecord | None, prepared: list[_Prepared],
                 *, fingerprint: str, stored_cases: list[dict[str, Any]], variants: list[Variant],
                 context: Mapping[str, Any] | None, epochs: int) -> None:
    """Create the batch (or add ``variants`` and epochs up to ``epochs`` to it) and its ``prepared`` jobs in one
    transaction; :class:`_Raced` when the batch is no longer as it was read."""
    folders: list[Path] = []
    try:
        with ws.store.transaction() as c:
            if reads.batch(ws.store, name) != existing:  # another process created or extended it since it was read
                raise _Raced(name)
            if existing is None:
                ws.store.create_batch(c, name, fingerprint=fingerprint,
                                      cases=json.dumps(stored_cases, ensure_ascii=False),
                                      variants=json.dumps([v.stored() for v in variants], ensure_ascii=False),
                                      options=json.dumps({"context": dict(context or {}), "epochs": epochs},
                                                         ensure_ascii=False))
            else:
                old = [v.to_dict() for v in existing.variants]
                # the epochs go into the row even when only they grew: a process adding the same epochs meanwhile
                # then finds the batch changed (_Raced above) instead of adding them twice
                options = {**json.loads(existing.options or "{}"), "epochs": epochs}
                ws.store.update_batch(c, name, variants=json.dumps(old + [v.stored() for v in variants],
                                                                   ensure_ascii=False),
                                      options=json.dumps(options, ensure_ascii=False))
            for epoch, case, variant, prep in prepared:
                ws.submitter.create(c, prep, folders, batch=name, batch_case=case.index, batch_variant=variant.index,
                                    batch_epoch=epoch)
    except BaseException:
        remove_folders(folders)
        raise


def _without_gaps(case: Mapping[str, Any]) -> Any:
    # a column a case lacks and one it has empty are the same: a DataFrame of a list of dicts fills the gaps
    extra = {k: v for k, v in (case.get("extra") or {}).items() if v is not None}
    return _canonical({**case, "extra": extra})


def _same_cases(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> bool:
    """The same cases up to the gaps a DataFrame fills (and 1 against 1.0): the batch resumes, not refused."""
    return len(old) == len(new) and all(_without_gaps(a) == _without_gaps(b) for a, b in zip(old, new, strict=True))


def _differs(name: str, old: list[dict[str, Any]], new: list[dict[str, Any]]) -> str:
    if len(old) != len(new):
        what = f"it has {len(old)} cases, these are {len(new)}"
    else:
        i = next(k for k, (a, b) in enumerate(zip(old, new, strict=True)) if _without_gaps(a) != _without_gaps(b))
        a, b = _without_gaps(old[i]), _without_gaps(new[i])
        field_ = next((f for f in ("instruction", "inputs", "expected") if a.get(f) != b.get(f)), "")
        if not field_:
            columns = sorted(k for k in set(a["extra"]) | set(b["extra"]) if a["extra"].get(k) != b["extra"].get(k))
            field_ = f"column {', '.join(map(repr, columns))}" if columns else "its columns"
        what = f"case {i} differs in {field_}"
    # in words for every front end (ws.batch's name=, the magic's and the command's --name)
    return (f"batch {name!r} already exists with different cases ({what}); give another batch name, "
            f"or its own cases to resume it")
