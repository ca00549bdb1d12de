"""A batch's cost limit (docs/design-lab.md#budgets): ``ws.batch(..., cost_limit=…)`` for the whole batch.

The limit counts every LLM call of the batch's jobs and of their subtasks, from the batch's first run on (a resumed
batch starts from what it had spent).  While the batch runs, :class:`BatchBudget` adds the price of each call as it
commits (a ``live`` subscription to ``llm_response`` events, so no store read per call): once the total reaches the
limit, every running job of the batch is asked at once to pause after its current call (the one whose call reached it:
after that call, its tools run), no further job starts, and the executor asks the running jobs and their subtasks again on
each tick (``ws.stop``) and says so.  Nothing is aborted:
``ws.batch(name, cost_limit=HIGHER)`` resumes the paused and unstarted jobs.  The limit is kept with the batch
(its ``options``), so ``ws.batch(name)`` alone resumes under the same limit, which stops it again at once.  A reply
without tool calls is committed with its job's next request, so it is counted (and the job paused) one call later.

Per-job limits (``job_cost_limit=``, ``job_token_limit=``) are :mod:`agentnb.engine.budget`'s: each job keeps its own
in its ``options`` and is aborted when it reaches it.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from . import live
from .engine.budget import check_limits, check_priced, money
from .events import LLMResponse
from .models.prices import call_cost, cost_array
from .store import reads
from .store.base import Store

__all__ = ["BatchBudget", "batch_limit", "batch_models", "check_batch_limits", "limit_note", "spent", "stored_limit"]


def check_batch_limits(cost_limit: Any, job_cost_limit: Any, job_token_limit: Any,
                       models: Iterable[str]) -> dict[str, float | int]:
    """The limits of a ``ws.batch`` call, checked (one line for a bad value, or a cost limit on an unpriced model)."""
    limits = {**check_limits("every call of the batch's jobs and their subtasks", cost_limit=cost_limit),
              **check_limits(job_cost_limit=job_cost_limit, job_token_limit=job_token_limit)}
    for model in models:
        for key in ("cost_limit", "job_cost_limit"):
            check_priced(model, limits.get(key), what=key)
    return limits


def batch_models(store: Store, name: Any, model: Any) -> list[str]:
    """The model specs a ``ws.batch`` call runs: those it names and those of the batch ``name`` already has."""
    given = [] if model is None else list(model) if isinstance(model, (list, tuple)) else [model]
    record = reads.batch(store, name) if isinstance(name, str) else None
    return [str(m) for m in given] + ([v.model for v in record.variants] if record is not None else [])


def stored_limit(options_json: str) -> float | None:
    """The batch-wide cost limit kept in a batch's ``options`` (None: none)."""
    try:
        value = json.loads(options_json or "{}").get("cost_limit")
    except (ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def batch_limit(store: Store, name: str, given: float | None) -> float | None:
    """The cost limit a run of batch ``name`` keeps: ``given`` (then kept with the batch), else the stored one."""
    record = reads.batch(store, name)
    if record is None:
        return given
    if given is None:
        return stored_limit(record.options)
    options = json.loads(record.options or "{}")
    if options.get("cost_limit") != given:
        with store.transaction() as c:
            store.update_batch(c, name, options=json.dumps({**options, "cost_limit": given}, ensure_ascii=False))
    return given


def spent(store: Store, batch: str) -> float | None:
    """What the batch's jobs and their subtasks have spent in US dollars (None: some call's price is unknown)."""
    calls = reads.tree_calls(store, batch=batch)
    if not calls:
        return 0.0
    costs = cost_array([c[0] for c in calls], [c[1] for c in calls], [c[2] for c in calls], [c[4] for c in calls])
    return None if bool(math.isnan(costs.sum())) else float(costs.sum())


def limit_note(store: Store, name: str, options_json: str, unfinished: int) -> str:
    """What a batch's repr and view say of its cost limit: ``cost limit $1.00: $0.52 spent``, and, when it is
    reached with jobs left, that they are paused and how to resume."""
    limit = stored_limit(options_json)
    if limit is None:
        return ""
    total = spent(store, name)
    shown = "cost unknown" if total is None else f"{money(total)} spent"
    if (total is None or total >= limit) and unfinished:
        return (f"cost limit {money(limit)} reached ({shown}): {unfinished} job(s) paused or not started; resume "
                f"with ws.batch({name!r}, cost_limit=HIGHER)")
    return f"cost limit {money(limit)}: {shown}"


class BatchBudget:
    """The running total of a batch's spending against its cost limit, kept up to date as calls commit."""

    def __init__(self, store: Store, name: str, limit: float, jobs: Mapping[int, str],
                 pause: Callable[[int], None], on_cost: Callable[[float | None], None] | None = None) -> None:
        self.store = store
        self.on_cost = on_cost  # told each call's price as it is added (a batch's worker process tells the batch's)
        self.name = name
        self.limit = limit
        self.pause = pause  # asks one job to pause after its current call, without reading the store
        self.roots = dict(jobs)  # the batch's jobs (all of them) and their models
        total = spent(store, name)
        self.total: float | None = total
        self.reached = threading.Event()
        self.unknown: set[int] = set()  # calls of jobs not yet known (subtasks): priced by :meth:`tick`
        self._lock = threading.Lock()
        self._specs: dict[int, str | None] = dict(self.roots)  # job → its model, None: not of this batch
        self.running: Collection[int] = ()  # the batch's jobs running now (the executor's own set)
        if total is None or total >= limit:
            self.reached.set()
        self._sub = live.subscribe(store, None, self._on_event, kinds=("llm_response",))

    def _on_event(self, item: Any) -> None:
        # in the committing thread, under the store's lock: no store read here (subtasks are looked up by tick)
        if not isinstance(item, LLMResponse) or item.purpose == "judge":  # a judge's call: priced apart (judge_cost_usd)
            return
        spec = self._specs.get(item.job_id, "")
        if spec == "":
            with self._lock:
                self.unknown.add(item.job_id)
            return
        if spec is not None:
            self._add(item.job_id, spec, item)

    def _add(self, job_id: int, spec: str, ev: LLMResponse) -> None:
        cost = call_cost(spec, ev.usage.prompt_tokens, ev.usage.completion_tokens, ev.ts)
        if self.on_cost is not None:
            self.on_cost(None if cost is None else float(cost))
        self.add(cost, job_id)

    def add(self, cost: float | None, job_id: int | None = None) -> None:
        """Add a call's price (None: unknown) — here from :meth:`_add`, or a call another process of the batch made
        (agentnb/processes.py) — and, when that reaches the limit, ask the running jobs to pause."""
        with self._lock:
            self.total = None if cost is None or self.total is None else self.total + cost
            crossed = not self.reached.is_set() and (self.total is None or self.total >= self.limit)
            if crossed:
                self.reached.set()
        if crossed:  # at once, not at the executor's next tick: a job's next call may be a few ms away
            # the one whose call reached it pauses after it (its tools run), the others after their current call
            for running in {*([] if job_id is None else [job_id]), *list(self.running)}:
                self.pause(running)

    def tick(self) -> None:
        """From the executor's thread: price the calls of subtasks first seen since the last tick (a store read)."""
        with self._lock:
            todo, self.unknown = self.unknown, set()
        for job_id in todo:
            row = self.store.job(job_id)
            root = row
            while root.parent_id and root.id not in self.roots:
                root = self.store.job(root.parent_id)
            self._specs[job_id] = row.model if root.id in self.roots else None
            if root.id in self.roots:  # its calls so far, all at once (later ones arrive as they commit)
                self.recount()

    def recount(self) -> None:
        """Read the batch's spending from the store."""
        self.settle(spent(self.store, self.name))

    def settle(self, *totals: float | None) -> None:
        """Set the total to the highest of ``totals`` (None, unknown, when any is): a batch run by worker processes
        (agentnb/processes.py) knows two lower bounds of its spending — the calls the workers reported, and the
        store's rows (with subtasks' calls, which no worker reports) — whose calls overlap in time, so they are not
        added."""
        total = None if any(t is None for t in totals) else max(t for t in totals if t is not None)
        with self._lock:
            self.total = total
            if total is None or total >= self.limit:
                self.reached.set()

    def reason(self) -> str:
        shown = "cost unknown" if self.total is None else f"{money(self.total)} of {money(self.limit)}"
        return f"cost limit reached: {shown}"

    def close(self) -> None:
        self._sub.close()

