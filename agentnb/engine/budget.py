"""A job's cost and token limits (docs/design-lab.md#budgets): checked values, and the check after each call.

A limit comes from the job (``submit(cost_limit=, token_limit=)``, a batch's ``job_cost_limit=``, kept in the job's
``options``) or else from its piece (the top-level ``cost_limit``/``token_limit`` keys).  It counts the LLM calls of
the job *and of its subtasks*, every generation — the same calls a batch's row and ``frames.jobs`` add up for it —
so a subtask is also held to every limit of its ancestors.  The runner asks :meth:`JobBudget.exceeded` before a
job's first call of each run and after every call (once the call's tools have run): a job that has reached a limit
(spent ≥ limit) makes no further call and is aborted with the reason ``budget: $0.52 of $0.50``.

A price that genai-prices does not know is unknown, never 0: a cost limit on such a model is refused at submit
(:func:`check_priced`), and a call of an unpriced model met later (a subtask that names another model) stops the
job as a limit reached would, with the reason saying the cost is unknown.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..events import LLMResponse
from ..models.prices import cost_array, has_price, priced_name
from ..store import reads

if TYPE_CHECKING:
    from ..store.base import Store
    from ..store.records import JobRecord

__all__ = ["LIMIT_KEYS", "JobBudget", "Limit", "Overrun", "check_limits", "check_priced", "limit_problem", "money"]

LIMIT_KEYS = ("cost_limit", "token_limit")
# how far up a subtask's ancestors are searched for limits (subtasks nest a few levels, never this deep)
_MAX_DEPTH = 100


JOB_CALLS = "the job's and its subtasks' calls"


def limit_problem(name: str, value: Any, counts: str = JOB_CALLS) -> str | None:
    """What is wrong with a limit's value (None: nothing); ``name`` is a cost limit's or a token limit's key
    (``cost_limit``, ``job_token_limit``…), named in the message; ``counts``: the calls the limit counts."""
    if name.endswith("token_limit"):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            return f"{name}={value!r}; allowed: a whole number of tokens ≥ 1 ({counts})"
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < math.inf:
        return f"{name}={value!r}; allowed: a number of US dollars > 0 ({counts})"
    return None


def check_limits(counts: str = JOB_CALLS, **limits: Any) -> dict[str, float | int]:
    """The given limits (``cost_limit``, ``token_limit``, ``job_cost_limit``…; None: not set), checked and made
    plain numbers; :class:`UsageError` of one line for a bad one (``counts``: the calls they count, as it says)."""
    out: dict[str, float | int] = {}
    for key, value in limits.items():
        if value is None:
            continue
        problem = limit_problem(key, value, counts)
        if problem is not None:
            raise UsageError(problem)
        out[key] = int(value) if key.endswith("token_limit") else float(value)
    return out


def check_priced(model: str, cost_limit: float | None, *, what: str = "cost_limit") -> None:
    """Refuse a cost limit on a model whose price is unknown (it would never count against the limit)."""
    if cost_limit is not None and not has_price(model):
        raise UsageError(f"{what}={money(cost_limit)} cannot be kept on {model}: genai-prices has no price for "
                         f"{priced_name(model)!r}, and an unknown price never counts as 0; use token_limit= instead")


def money(value: float) -> str:
    """A dollar amount as a limit's reason shows it: ``$0.52``, ``$12.00``, ``$0.016`` (two significant digits
    below $0.10, with no trailing zeros past the cents)."""
    if value >= 0.1 or value == 0:
        return f"${value:,.2f}"
    places = 1 - math.floor(math.log10(value))
    text = f"{value:.{places}f}".rstrip("0")
    return "$" + (text if len(text.split(".")[1]) >= 2 else f"{value:.2f}")


@dataclass(frozen=True)
class Limit:
    """The limits job ``job_id`` sets (either may be None), which cover it and all its subtasks."""

    job_id: int
    cost: float | None
    tokens: int | None


@dataclass(frozen=True)
class Overrun:
    """A limit reached: what was measured, spent (None: unknown) and allowed, whose limit, and the reason text."""

    measure: str
    spent: float | None
    limit: float
    limit_job: int
    reason: str


def job_limit(row: JobRecord, piece_limits: Mapping[str, Any]) -> Limit | None:
    """The limits a job sets: its own (``options``) over its piece's; None when it sets none."""
    own = row.options.extra
    cost = own.get("cost_limit", piece_limits.get("cost_limit"))
    tokens = own.get("token_limit", piece_limits.get("token_limit"))
    return None if cost is None and tokens is None else Limit(row.id, cost, tokens)


class JobBudget:
    """The limits that hold a job (its own and its ancestors'), and the check of what their trees have spent."""

    def __init__(self, store: Store, job_id: int, model: str, limits: list[Limit]) -> None:
        self.store = store
        self.job_id = job_id
        self.model = model
        self.limits = limits

    @classmethod
    def of(cls, store: Store, row: JobRecord, piece_limits: Callable[[JobRecord], Mapping[str, Any]]) -> JobBudget | None:
        """The budget of job ``row`` (``piece_limits(row)``: the limits its stored piece sets); None when no
        limit holds it, so a job without limits pays nothing per call."""
        limits: list[Limit] = []
        current: JobRecord | None = row
        for _ in range(_MAX_DEPTH):
            if current is None:
                break
            found = job_limit(current, piece_limits(current))
            if found is not None:
                limits.append(found)
            current = store.job(current.parent_id) if current.parent_id else None
        return cls(store, row.id, row.model, limits) if limits else None

    def exceeded(self, pending: Iterable[Any] = ()) -> Overrun | None:
        """The first limit that the calls so far have reached, or None; ``pending``: this job's events not yet
        committed (a reply without tool calls is committed only with the next call's request)."""
        mine = [(self.model, e.usage.prompt_tokens, e.usage.completion_tokens, e.usage.total_tokens, e.ts)
                for e in pending if isinstance(e, LLMResponse)]
        for limit in self.limits:
            calls = reads.tree_calls(self.store, limit.job_id) + mine
            whose = "" if limit.job_id == self.job_id else f" (the limit of job {limit.job_id}, with its subtasks)"
            if limit.tokens is not None:
                spent = sum(c[3] for c in calls)
                if spent >= limit.tokens:
                    return Overrun("tokens", float(spent), float(limit.tokens), limit.job_id,
                                   f"budget: {spent:,} of {limit.tokens:,} tokens{whose}")
            if limit.cost is not None and calls:
                costs = cost_array([c[0] for c in calls], [c[1] for c in calls], [c[2] for c in calls],
                                   [c[4] for c in calls])
                unpriced = sorted({calls[i][0] for i, cost in enumerate(costs) if math.isnan(cost)})
                if unpriced:  # an unpriced call: its cost is unknown, never 0
                    return Overrun("cost_usd", None, float(limit.cost), limit.job_id,
                                   f"budget: cost unknown ({', '.join(unpriced)} has no price) against "
                                   f"{money(limit.cost)}{whose}")
                total = float(costs.sum())
                if total >= limit.cost:
                    return Overrun("cost_usd", total, float(limit.cost), limit.job_id,
                                   f"budget: {money(total)} of {money(limit.cost)}{whose}")
        return None
