"""A batch's results as DataFrames and HTML (docs/design-lab.md): ``batch.frame``, ``batch.summary()``, its view.

Everything is read from the store when asked for, so a Batch kept in a variable never goes stale.

Choices the design leaves open, made here:

- **A job's subtasks count into its row.**  ``movements``, ``llm_calls``, the tokens, ``cost_usd`` and
  ``seconds`` are sums over the job *and every job below it* (a fan-out's children), so that "is
  fan-out worth it" compares what each variant really spent; ``subtasks`` says how many jobs were
  below it.  ``status`` is the batch job's own.
- **seconds** is the time the job tree was ``running``: for each job, the sum of the intervals from a
  ``job_status`` running event to the job's next ``job_status`` event (an interval still open counts
  up to now); one that a recovery ended (``recovered: …``: its worker was killed or cut off) ends at that
  worker's last event, not when its lease ran out.  Queued, paused, waiting and idle time are not counted.
  Children's running time is added (compute time, not wall time of the tree).
- **cost_usd** prices each ``llm_response`` of the tree with the model spec of the job that made it
  (``agentnb.models.prices``); NA as soon as one call's price is unknown; 0 for offline models.
- **judge_cost_usd** is what the LLM judges' calls on the job cost (``purpose: "judge"``, each priced by the judge's
  own model; docs/design-lab.md#llm-judge), every judging counted (a re-score spends again); those calls count in
  no other column (``llm_calls``, the tokens and ``cost_usd`` are the job's own spending).
- **Scores**: one column per scorer, the value of the latest ``score`` event of that name; a scorer
  that raised (or returned a value of another type) leaves NA there and its error text in
  ``<name>_error`` (NA when it did not fail).  A score column is ``boolean`` when every value is a
  bool, ``Int64`` when every value is an int, ``Float64`` when they are numbers (a bool counted as
  0/1) and ``string`` otherwise.
- The frame also carries each case's ``instruction`` and ``expected`` (object: any JSON value), so a
  row can be read on its own.
- **variant_label** names a variant wherever one is shown (the HTML summary, ``plot_batch``): the piece
  and the model's short spec (``models.base.short_spec``: a ``scripted:`` file by its name), lengthened
  only where two variants would read the same.  ``piece`` and ``model`` keep the full spec.
"""

from __future__ import annotations

import html
import math
import re
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pandas as pd

from ..events import ScoreEvent
from ..models.base import short_spec
from ..store import reads
from ..store.base import TERMINAL_STATES, WAITING_STATES, JobStatus, Store
from ..store.records import BatchCase, BatchVariant
from .batch_stats import Settings, interval_columns, summary_intervals
from .timeline import fold

__all__ = ["BatchSource", "JobTotals", "batch_frame", "batch_html", "batch_summary", "job_totals",
           "score_columns", "summary_table", "variant_labels"]

_COUNTS = ("subtasks", "movements", "llm_calls", "prompt_tokens", "completion_tokens", "total_tokens")


class BatchSource(Protocol):
    """What the views read of a batch (an :class:`agentnb.batch.Batch`)."""

    name: str

    @property
    def scorers(self) -> Mapping[str, Any]: ...

    @property
    def store(self) -> Store: ...


@dataclass
class JobTotals:
    """What one batch job's tree (the job and its subtasks) used."""

    subtasks: int = 0
    movements: int = 0
    llm_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cost_usd: float | None = 0.0
    judge_cost_usd: float | None = 0.0
    seconds: float = 0.0


def job_totals(store: Store, root: int, children: Mapping[int, list[int]], models: Mapping[int, str],
               now: float) -> JobTotals:
    """The totals of job ``root`` and every job below it (``children``: parent id → child ids).

    The one place the batch views price and count calls: when ``ws.frames.usage()`` carries
    ``cost_usd`` this is what would read it instead.
    """
    out = JobTotals()
    tree, stack = [], [root]
    while stack:
        job_id = stack.pop()
        tree.append(job_id)
        stack.extend(children.get(job_id, ()))
    out.subtasks = len(tree) - 1
    for job_id in tree:
        t = fold(store.events(job_id, kinds=["job_status", "movement_start", "llm_response"]), runs=False).totals
        if t.recovered:  # a recovered interval ends at its dead holder's last event, of whatever kind (rare)
            t = fold(store.events(job_id), runs=False).totals
        out.movements += t.movements
        out.llm_calls += t.calls
        out.prompt_tokens += t.prompt_tokens
        out.completion_tokens += t.completion_tokens
        out.total_tokens += t.total_tokens
        out.seconds += t.running_seconds(now)
        cost = t.cost_usd(models[job_id])
        if out.cost_usd is not None:
            out.cost_usd = None if cost is None else out.cost_usd + cost
        judged = t.judge_cost_usd(models[job_id])
        if out.judge_cost_usd is not None:
            out.judge_cost_usd = None if judged is None else out.judge_cost_usd + judged
    return out


def _latest_scores(store: Store, job_id: int) -> dict[str, ScoreEvent]:
    return dict(fold(store.events(job_id, kinds=["score"]), runs=False).totals.scores)  # the last one of each name


def _score_dtype(values: Iterable[Any]) -> str:
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return "boolean"
    if present and all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return "Int64"
    if all(isinstance(v, (bool, int, float)) for v in present):
        return "Float64"
    return "string"


def _score_series(values: list[Any], index: pd.Index) -> pd.Series:
    dtype = _score_dtype(values)
    if dtype == "Float64":
        values = [None if v is None else float(v) for v in values]
    elif dtype == "string":
        values = [None if v is None else str(v) for v in values]
    return pd.Series(values, index=index, dtype=dtype)


def variant_labels(variants: Sequence[tuple[str, str]]) -> list[str]:
    """A short, unique label per ``(piece, model spec)``: ``piece · short spec``.  Where two would read the
    same (two ``draft.yaml`` scripts in different folders), those two show more of their paths, one folder
    at a time, until they differ; two that still do (the same piece name and model, added to a batch by two
    calls) get their variant number."""
    depth = [1] * len(variants)
    while True:
        labels = [f"{piece} · {short_spec(model, d)}" for (piece, model), d in zip(variants, depth, strict=True)]
        seen = Counter(labels)
        longer = [i for i, label in enumerate(labels)
                  if seen[label] > 1 and short_spec(variants[i][1], depth[i]) != variants[i][1]]
        if not longer:
            break
        for i in longer:
            depth[i] += 1
    return [f"{label} #{i}" if seen[label] > 1 else label for i, label in enumerate(labels)]


def score_columns(frame: pd.DataFrame) -> list[str]:
    """The score columns of a batch frame (in order), from its ``attrs``."""
    return list(frame.attrs.get("scores", []))


def _case_cells(cases: Sequence[BatchCase], index: int, extra_cols: list[str]) -> dict[str, Any]:
    """A batch frame row's cells of case ``index``: its instruction, its own columns, its expected value (all
    None for a case the batch does not have)."""
    if not 0 <= index < len(cases):
        return {"instruction": None, **dict.fromkeys(extra_cols), "expected": None}
    case = cases[index]
    return {"instruction": case.instruction, **{k: case.extra.get(k) for k in extra_cols}, "expected": case.expected}


def batch_frame(batch: BatchSource) -> pd.DataFrame:
    """One row per case × variant × epoch, by case, variant and epoch (see the module's notes for the columns)."""
    store = batch.store
    record = reads.batch(store, batch.name)
    cases: tuple[BatchCase, ...] = record.cases if record else ()
    variants: tuple[BatchVariant, ...] = record.variants if record else ()
    jobs = sorted(store.jobs(batch=batch.name), key=lambda r: r.batch_position)
    everything = store.jobs()
    children: dict[int, list[int]] = {}
    for r in everything:
        if r.parent_id is not None:
            children.setdefault(r.parent_id, []).append(r.id)
    models = {r.id: r.model for r in everything}
    extra_cols: list[str] = []
    for each in cases:
        extra_cols.extend(k for k in each.extra if k not in extra_cols)
    labels = variant_labels([(v.piece, v.model) for v in variants])
    now = time.time()
    records: list[dict[str, Any]] = []
    scores: list[dict[str, ScoreEvent]] = []
    for job in jobs:
        # a batch's job has both (the batch's own rows)
        ci, vi = job.batch_case or 0, job.batch_variant or 0
        known = 0 <= vi < len(variants)
        label = labels[vi] if known else f"{job.piece} · {short_spec(job.model)}"
        totals = job_totals(store, job.id, children, models, now)
        records.append({"case": job.batch_case, **_case_cells(cases, ci, extra_cols),
                        "variant": job.batch_variant, "variant_label": label, "epoch": job.epoch,
                        "piece": variants[vi].piece if known else job.piece,
                        "model": job.model, "job": job.id, "status": job.status.value,
                        **{k: getattr(totals, k) for k in _COUNTS}, "cost_usd": totals.cost_usd,
                        "judge_cost_usd": totals.judge_cost_usd, "seconds": totals.seconds})
        scores.append(_latest_scores(store, job.id))
    names = list(batch.scorers)
    for found in scores:
        names.extend(n for n in found if n not in names)
    df = pd.DataFrame.from_records(records, columns=[
        "case", "instruction", *extra_cols, "expected", "variant", "variant_label", "epoch", "piece", "model", "job",
        "status",
        *_COUNTS,
        "cost_usd", "judge_cost_usd", "seconds"])
    types: dict[str, Any] = {"case": "Int64", "instruction": "string", "variant": "Int64", "epoch": "Int64",
                             "variant_label": "string", "piece": "string",
                             "model": "string", "job": "Int64", "status": "string", "cost_usd": "Float64",
                             "judge_cost_usd": "Float64", "seconds": "Float64", **dict.fromkeys(_COUNTS, "Int64")}
    df = df.astype(types)
    # any JSON value, kept as it is (pandas would make a None among numbers NaN)
    df["expected"] = pd.Series([r["expected"] for r in records], index=df.index, dtype=object)
    for col in extra_cols:  # the case's own columns keep pandas' own inference (numbers, text, …)
        df[col] = df[col].convert_dtypes()
    for name in names:
        ev = [found.get(name) for found in scores]
        df[name] = _score_series([e.value if e is not None and e.error is None else None for e in ev], df.index)
    for name in names:
        ev = [found.get(name) for found in scores]
        df[f"{name}_error"] = pd.array([e.error if e is not None else None for e in ev], dtype="string")
    df.attrs["batch"] = batch.name
    df.attrs["scores"] = names
    return df


def _mean_score(col: pd.Series) -> Any:
    values = col.dropna()
    if values.empty:
        return pd.NA
    return float(values.astype("Float64").mean())


def _total(values: pd.Series) -> Any:
    # one unknown price makes the total unknown (a partial sum would look cheaper than it was)
    return pd.NA if values.isna().any() else float(values.sum())


def batch_summary(batch: BatchSource | None, frame: pd.DataFrame | None = None, *,
                  stats: Settings | None = None) -> pd.DataFrame:
    """One row per variant, in variant order, its columns in the order they are read: the variant and its
    ``variant_label``, ``n`` jobs, how many ``succeeded``/``failed``/``aborted``/``waiting`` (for a human or
    for subtasks) and ``unfinished`` (queued or running); ``mean_<score>`` for each score whose column is
    boolean (the share true) or numeric, over the jobs that have a value; ``mean_tokens``/``median_tokens``
    of ``total_tokens``; ``cost_usd`` (total)/``mean_cost_usd`` over every job of the variant (what it spent
    so far; NA when a price is unknown); ``judge_cost_usd``, what its LLM judges cost (total, apart from the jobs'
    own); ``p50_seconds``/``p95_seconds`` over the jobs that ended (pandas'
    linear quantiles; NA before any ended) and their ``mean_seconds``; last the full ``piece`` and ``model``.
    Each mean is followed by its ``_se``, ``_ci_low`` and ``_ci_high`` (``batch_stats``: a bootstrap over cases
    with the ``stats`` settings).  ``frame`` (a ``batch_frame``) is summarised instead of reading the batch again.
    """
    if frame is None:
        if batch is None:
            raise TypeError("batch_summary needs a batch or its frame")
        frame = batch_frame(batch)
    df = frame
    numeric = [n for n in score_columns(df) if str(df[n].dtype) in ("boolean", "Int64", "Float64")]
    groups = list(df.groupby("variant", sort=True))
    if "variant_label" in df.columns:
        labels = [str(g["variant_label"].iloc[0]) for _, g in groups]
    else:  # a frame of the user's making
        labels = variant_labels([(str(g["piece"].iloc[0]), str(g["model"].iloc[0])) for _, g in groups])
    rows = []
    for (variant, group), label in zip(groups, labels, strict=True):
        status = group["status"].astype(str)
        ended = group[status.isin(TERMINAL_STATES)]
        rows.append({
            "variant": variant, "variant_label": label,
            "n": len(group), "succeeded": int((status == JobStatus.succeeded).sum()),
            "failed": int((status == JobStatus.failed).sum()), "aborted": int((status == JobStatus.aborted).sum()),
            "waiting": int(status.isin(WAITING_STATES).sum()),
            "unfinished": int(status.isin((JobStatus.queued, JobStatus.running)).sum()),
            **{f"mean_{n}": _mean_score(group[n]) for n in numeric},
            "mean_tokens": float(group["total_tokens"].mean()),
            "median_tokens": float(group["total_tokens"].median()),
            "cost_usd": _total(group["cost_usd"]),
            "mean_cost_usd": pd.NA if group["cost_usd"].isna().any() else float(group["cost_usd"].mean()),
            # the LLM judges' calls, apart from what the jobs spent (a frame of the user's making may lack it)
            "judge_cost_usd": _total(group["judge_cost_usd"]) if "judge_cost_usd" in group else 0.0,
            "mean_seconds": float(ended["seconds"].mean()) if len(ended) else pd.NA,
            "p50_seconds": float(ended["seconds"].quantile(0.5)) if len(ended) else pd.NA,
            "p95_seconds": float(ended["seconds"].quantile(0.95)) if len(ended) else pd.NA,
            "piece": group["piece"].iloc[0], "model": group["model"].iloc[0],
        })
    ended_rows = df["status"].astype(str).isin(TERMINAL_STATES)
    means = [*[(f"mean_{n}", n, None) for n in numeric], ("mean_tokens", "total_tokens", None),
             ("mean_cost_usd", "cost_usd", None), ("mean_seconds", "seconds", ended_rows)]
    intervals = summary_intervals(df, means, stats or Settings())
    for row in rows:
        for name, _column, _rows in means:
            found = intervals[name].get(row["variant"])
            row.update(zip(interval_columns(name), (found.se, found.low, found.high) if found else (pd.NA,) * 3,
                           strict=True))
    measures = [*[c for n in numeric for c in (f"mean_{n}", *interval_columns(f"mean_{n}"))], "mean_tokens",
                *interval_columns("mean_tokens"), "median_tokens", "cost_usd", "mean_cost_usd",
                *interval_columns("mean_cost_usd"), "judge_cost_usd", "mean_seconds", *interval_columns("mean_seconds"),
                "p50_seconds", "p95_seconds"]
    columns = ["variant", "variant_label", *_OUTCOMES, *measures, "piece", "model"]
    out = pd.DataFrame.from_records(rows, columns=columns)
    types = {"variant": "Int64", "variant_label": "string", "piece": "string", "model": "string",
             **dict.fromkeys(_OUTCOMES, "Int64"), **dict.fromkeys(measures, "Float64")}
    out = out.astype(types)
    for col in measures:  # an interval that cannot be had (one case, an unknown price) is NA, not NaN
        out[col] = out[col].mask(out[col].isna(), pd.NA)
    out.attrs["stats"] = (stats or Settings()).text()
    return out


# n and the outcome counts of a summary row
_OUTCOMES = ("n", "succeeded", "failed", "aborted", "waiting", "unfinished")


def _money(value: Any) -> str:
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return "cost unknown"
    return f"${value:,.4f}"


# how much of a failed job's error its line in the batch's view shows (the job's view has all of it)
_ERROR_CHARS = 160


def batch_html(batch: BatchSource) -> str:
    """The progress line, the summary table, the jobs that failed or were aborted (each with its error and the
    ``%agent show JOB`` that opens its view, then the retry and resume commands) and those waiting for a reply
    (each with its question, the ``%agent reply`` that answers it and the command that resumes the batch);
    every text escaped."""
    df = batch_frame(batch)
    status = df["status"].astype(str)
    n, ended = len(df), int(status.isin(TERMINAL_STATES).sum())
    counts = [f"{int((status == s).sum())} {s}" for s in (JobStatus.succeeded, JobStatus.failed, JobStatus.aborted,
                                                                  JobStatus.running, JobStatus.queued)
              if (status == s).any()]
    waiting = int(status.isin(WAITING_STATES).sum())
    if waiting:
        counts.append(f"{waiting} waiting")
    tokens = int(df["total_tokens"].sum()) if n else 0
    cost = _total(df["cost_usd"]) if n else 0.0
    epochs = int(df["epoch"].max()) if n else 1
    line = (f"batch {batch.name}: {ended} of {n} ended{f' · {epochs} epochs' if epochs > 1 else ''} · "
            f"{', '.join(counts) or 'no jobs'} · {tokens:,} tokens · {_money(cost)}")

    def which(r: Any) -> str:  # a row's case (and epoch, when there are several), as the lists below name it
        return f"case {r['case']}" + (f", epoch {r['epoch']}" if epochs > 1 else "")

    parts = [f"<div class='agentnb-batch'><p><b>{html.escape(line)}</b></p>",
             summary_table(batch_summary(batch, df))]
    bad = df[status.isin((JobStatus.failed, JobStatus.aborted))]
    if len(bad):
        ids = [int(j) for j in bad["job"]]
        # as the waiting jobs below: why each stopped, and the commands that go on from there
        parts.append(f"<p>failed or aborted jobs: {html.escape(', '.join(map(str, ids)))} — "
                     "<code>%agent retry JOB</code> queues one again from its last complete call, then <code>"
                     f"%agent batch {html.escape(batch.name)}</code> resumes the batch</p><ul>")
        for _, r in bad.iterrows():
            error = " ".join(str(batch.store.job(int(r["job"])).error or "").split())
            what = (f"{which(r)}, {r['variant_label']}: {r['status']}"
                    + (f": {error[:_ERROR_CHARS]}{'…' if len(error) > _ERROR_CHARS else ''}" if error else ""))
            parts.append(f"<li><code>%agent show {int(r['job'])}</code> — {html.escape(what)}</li>")
        parts.append("</ul>")
    asking = df[status == JobStatus.waiting_human]
    if len(asking):
        # what each asks, and the two commands that go on: a waiting job is not lost, but nothing else says so
        parts.append(f"<p>jobs waiting for your reply: reply to each, then <code>%agent batch "
                     f"{html.escape(batch.name)}</code> (or <code>ws.batch({html.escape(repr(batch.name))})</code>) "
                     "resumes the batch</p><ul>")
        for _, r in asking.iterrows():
            job_id = int(r["job"])
            what = f"{which(r)}, {r['variant_label']} asks: {_question(batch.store, job_id) or '(no question)'}"
            parts.append(f"<li><code>%agent reply {job_id} YOUR ANSWER</code> — {html.escape(what)}</li>")
        parts.append("</ul>")
    parts.append("</div>")
    return "".join(parts)


_CELL = "padding:2px 6px;text-align:right;vertical-align:top"
_HEAD = "padding:2px 6px;text-align:right;vertical-align:bottom;font-weight:bold"
_NOWRAP = "white-space:nowrap"


def _na(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def _number(value: Any, kind: str) -> str:
    if _na(value):
        return "NA"
    if kind == "money":
        return f"${value:,.4f}"
    if kind == "count":
        return f"{value:,.0f}"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def summary_table(summary: pd.DataFrame) -> str:
    """A ``batch_summary`` as a table narrow enough to scan in a notebook's output (about 1,000 px with four
    scores): the variant's short label (its full piece and model in the tooltip), n, the outcome counts (a
    count that is 0 for every variant is left out), each score, the mean tokens, cost and running seconds per
    job, each as "mean ± half its confidence interval's width" (the interval and standard error in the
    tooltip), and the p95 running seconds; the median tokens, total cost and p50 seconds in the tooltips, and
    below the table what ± is.  The DataFrame has it all."""
    scores = [c for c in summary.columns if c.startswith("mean_") and c not in _MEANS and not c.endswith(_CI)]
    outcomes = ["n", "succeeded", *[c for c in ("failed", "aborted", "waiting", "unfinished") if summary[c].any()]]
    e = html.escape
    # a header breaks only at an underscore or where a <br> says: "mentions_<wbr>plugins", never "releas-/e"
    heads = [f"<th style='{_HEAD};text-align:left'>variant</th>",
             *[f"<th style='{_HEAD}'>{c}</th>" for c in outcomes],
             *[f"<th style='{_HEAD}' title='{e(_score_tip(c[5:]), quote=True)}'>"
               f"{'_<wbr>'.join(e(p) for p in c[5:].split('_'))}</th>" for c in scores],
             f"<th style='{_HEAD}' title='mean total tokens per job'>tokens<br>/job</th>",
             f"<th style='{_HEAD}' title='mean cost per job in US$ (NA: a price is unknown)'>cost<br>/job</th>",
             f"<th style='{_HEAD}' title='mean running seconds of the jobs that ended'>s<br>/job</th>",
             f"<th style='{_HEAD}' title='running seconds of the jobs that ended, 95th percentile'>p95<br>s</th>"]
    rows = []
    for _, r in summary.iterrows():
        piece, _sep, model = str(r["variant_label"]).partition(" · ")
        full = f"variant {r['variant']}: {r['piece']} × {r['model']}"
        # nowrap on the piece and on each folder of the model's path: the label breaks only between the piece
        # and the model, or after a "/", never inside a name ("release-/notes")
        folders = [f"<span style='{_NOWRAP}'>{e(p)}</span>" for p in re.split(r"(?<=/)", model) if p]
        label = f"<span style='{_NOWRAP}'>{e(piece)}</span>" + (f" · {'<wbr>'.join(folders)}" if _sep else "")
        cells = [f"<td style='{_CELL};text-align:left' title='{e(full, quote=True)}'>{label}</td>",
                 *[f"<td style='{_CELL}'>{_number(r[c], 'count')}</td>" for c in outcomes],
                 *[_pm_cell(r, c, "score") for c in scores],
                 _pm_cell(r, "mean_tokens", "count", f"median {_number(r['median_tokens'], 'count')}"),
                 _pm_cell(r, "mean_cost_usd", "money", f"total {_number(r['cost_usd'], 'money')}{_judged(r)}"),
                 _pm_cell(r, "mean_seconds", "score", f"p50 {_number(r['p50_seconds'], 'score')}"),
                 f"<td style='{_CELL}'>{_number(r['p95_seconds'], 'score')}</td>"]
        rows.append(f"<tr data-variant='{int(r['variant'])}'>{''.join(cells)}</tr>")
    note = (f"<p class='agentnb-batch-ci' style='font-size:11px;color:#777;margin:2px 0'>± is half the width of "
            f"the {e(str(summary.attrs.get('stats', Settings().text())))} (clustered by case when cases ran several "
            "epochs); hover a cell for the interval and the standard error</p>")
    return (f"<table class='agentnb-batch-summary' style='width:auto;max-width:100%'><thead><tr>{''.join(heads)}"
            f"</tr></thead><tbody>{''.join(rows)}</tbody></table>{note}")


# the summary's means that have a column of their own in the table (the others are scores), and the suffixes
# of the interval columns that follow each mean
_MEANS = ("mean_tokens", "mean_cost_usd", "mean_seconds")
_CI = ("_se", "_ci_low", "_ci_high")


def _pm_cell(r: pd.Series, mean: str, kind: str, extra: str = "") -> str:
    """A table cell ``mean ± half-width``, its interval and standard error in the tooltip (with ``extra``)."""
    value, low, high, se = r[mean], r[f"{mean}_ci_low"], r[f"{mean}_ci_high"], r[f"{mean}_se"]
    text = _number(value, kind)
    tip = [extra] if extra else []
    if not _na(value) and not _na(low):
        half = _number((float(high) - float(low)) / 2, kind).lstrip("$")  # the mean's cell says it is dollars
        # the ± part smaller, and a line of its own where the table would not fit the output's width
        text = f"<span style='{_NOWRAP}'>{text}</span> <span style='{_NOWRAP};font-size:85%;color:#666'>± {half}</span>"
        tip.append(f"CI {_number(low, kind)} to {_number(high, kind)} · SE {_number(se, kind)}")
    elif not _na(value):
        tip.append("no interval: fewer than 2 cases")
    title = f" title='{html.escape(' · '.join(tip), quote=True)}'" if tip else ""
    return f"<td style='{_CELL}'{title}>{text}</td>"


def _judged(row: pd.Series) -> str:
    """The cost cell's tooltip on what the LLM judges cost, apart (docs/design-lab.md#llm-judge); empty without any."""
    judged = row.get("judge_cost_usd", 0.0)
    return "" if not _na(judged) and not judged else f" · LLM judges {_number(judged, 'money')}"


def _score_tip(name: str) -> str:
    return f"mean of {name} over the jobs that have it (a yes/no score: the share yes)"


def _question(store: Store, job_id: int) -> str | None:
    """The question a job waiting for a human asked: its last ``ASK`` transition's."""
    return fold(store.events(job_id, kinds=["transition"]), runs=False).totals.question
