"""What an LLM call cost, in US dollars, from the ``genai-prices`` package's bundled data (docs/design-lab.md#cost).

Nothing is fetched: the prices are read from ``genai_prices.data`` (the snapshot that ships inside the
package) through a snapshot of our own, so neither genai-prices' auto-update (``UpdatePrices``, which
downloads) nor a snapshot someone else installed with ``set_custom_snapshot`` is ever used.

A model spec is priced by its model name (``openai:gpt-4o-mini`` → ``gpt-4o-mini``), the provider found
by genai-prices from that name, at the time the call was made (prices change over time, and some
providers price by the time of day); the offline models (``demo``, ``scripted:``, ``replay:``) cost 0;
a name genai-prices does not know costs NA (``None``, NaN in arrays), with one
:class:`UnknownPriceWarning` per model name and process.

:func:`cost_array` is the vectorised form the DataFrame views use: rates are looked up once per model
and day (per call only for the rare tiered or time-of-day prices), then applied with numpy;
:func:`summed_costs` prices calls made on one day from their token sums (``frames.jobs``).
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from .._secrets import scrub

if TYPE_CHECKING:  # numpy is imported where arrays are priced: a worker's start-up does not load it (~50 ms)
    import numpy as np
    import numpy.typing as npt

__all__ = ["FREE_PREFIXES", "UnknownPriceWarning", "call_cost", "call_costs", "cost_array", "dollars",
           "has_price", "is_free", "priced_name", "summed_costs"]

# specs that never reach a paid endpoint
FREE_PREFIXES = ("demo", "scripted:", "replay:")


class UnknownPriceWarning(UserWarning):
    """genai-prices has no price for a model: its calls' ``cost_usd`` is NA."""


_warned: set[str] = set()
_warn_lock = threading.Lock()


def is_free(spec: str) -> bool:
    """Whether ``spec`` is an offline model (its calls cost 0)."""
    return spec == "demo" or spec.startswith(FREE_PREFIXES)


def priced_name(spec: str) -> str | None:
    """The model name a spec is priced by; None for the offline (free) models."""
    if is_free(spec):
        return None
    _, _, name = spec.partition(":")
    name = name.partition("?")[0]  # a spec's options (openai:gpt-4o?stream=0) are no part of the name
    return name or spec


def has_price(spec: str) -> bool:
    """Whether a spec's calls have a known price: an offline model (0) or a model genai-prices knows (no warning)."""
    name = priced_name(spec)
    return name is None or _model(name) is not None


@functools.lru_cache(maxsize=1)
def _snapshot() -> Any:
    """genai-prices' bundled data as a snapshot of our own (never the auto-updated or a custom one)."""
    from genai_prices.data import providers
    from genai_prices.data_snapshot import DataSnapshot

    return DataSnapshot(providers=providers, from_auto_update=False)


@functools.lru_cache(maxsize=256)
def _model(name: str) -> Any:
    """genai-prices' ModelInfo for a model name, or None when it knows none."""
    try:
        return _snapshot().find_provider_model(name, None, None, None)[1]
    except LookupError:
        return None


@functools.lru_cache(maxsize=256)
def _by_time_of_day(name: str) -> bool:
    """Whether a model's price depends on the time of day (off-peak prices): then it is priced call by call."""
    from genai_prices.types import TimeOfDateConstraint

    prices = _model(name).prices
    return isinstance(prices, list) and any(isinstance(p.constraint, TimeOfDateConstraint) for p in prices)


_Rates = tuple[float, float, float]


@functools.lru_cache(maxsize=4096)
def _rates(name: str, when: float) -> _Rates | Any:
    """``(per_call, per_input_token, per_output_token)`` of a model at time ``when`` (epoch seconds) when its
    price is linear in tokens; the ModelPrice itself when it is tiered (priced call by call)."""
    from genai_prices.types import TieredPrices

    price = _model(name).get_prices(datetime.fromtimestamp(when, timezone.utc))
    if any(isinstance(getattr(price, f, None), TieredPrices) for f in ("input_mtok", "output_mtok")):
        return price
    base = _price(price, 0, 0)
    return base, (_price(price, 1_000_000, 0) - base) / 1e6, (_price(price, 0, 1_000_000) - base) / 1e6


def _price(price: Any, prompt: int, completion: int) -> float:
    from genai_prices import Usage

    return float(price.calc_price(Usage(input_tokens=prompt, output_tokens=completion))["total_price"])


def _warn_unknown(name: str) -> None:
    with _warn_lock:
        if name in _warned:
            return
        _warned.add(name)
    # masked: a key pasted as the model name would otherwise be printed in the notebook
    warnings.warn(f"genai-prices has no price for model {scrub(name)!r}: its calls' cost_usd is NA",
                  UnknownPriceWarning, stacklevel=4)


def _one_model(name: str, prompt: np.ndarray, completion: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """The costs of calls of one known model: linear rates per day (per second for time-of-day prices)."""
    import numpy as np

    out = np.empty(len(prompt), dtype="float64")
    # a day's rates hold for the whole UTC day (start dates are days); off-peak windows need the time itself
    bucket = np.floor(ts) if _by_time_of_day(name) else np.floor(ts / 86400.0) * 86400.0
    keys, inverse = np.unique(bucket, return_inverse=True)
    for k, when in enumerate(keys):
        rows = inverse == k
        rates = _rates(name, float(when))
        if isinstance(rates, tuple):
            out[rows] = rates[0] + prompt[rows] * rates[1] + completion[rows] * rates[2]
        else:  # tiered: the tier depends on each call's own tokens
            idx = np.flatnonzero(rows)
            out[idx] = [_price(rates, int(prompt[i]), int(completion[i])) for i in idx]
    return out


def cost_array(specs: npt.ArrayLike, prompt_tokens: npt.ArrayLike,
               completion_tokens: npt.ArrayLike, ts: npt.ArrayLike) -> np.ndarray:
    """The price in US dollars of each call (float64; NaN where the model has no price or a count is missing).

    ``specs`` is each call's model spec and ``ts`` when it was made (epoch seconds): calls are grouped by
    spec and by day, so the rates are looked up once per group and applied as array arithmetic.
    """
    import numpy as np

    spec_arr = np.asarray(specs, dtype=object)
    prompt = np.asarray(prompt_tokens, dtype="float64")
    completion = np.asarray(completion_tokens, dtype="float64")
    when = np.asarray(ts, dtype="float64")
    out = np.full(len(spec_arr), np.nan)
    if not len(spec_arr):
        return out
    uniques, inverse = np.unique(spec_arr.astype(str), return_inverse=True)
    for k, spec in enumerate(uniques):
        rows = inverse == k
        name = priced_name(str(spec))
        if name is None:
            out[rows] = 0.0
        elif _model(name) is None:
            _warn_unknown(name)
        else:
            # a call stamped without a time is priced now (it cannot be older than the data)
            t = np.where(np.isnan(when[rows]), datetime.now(timezone.utc).timestamp(), when[rows])
            out[rows] = _one_model(name, prompt[rows], completion[rows], t)
    return out


def summed_costs(specs: npt.ArrayLike, calls: npt.ArrayLike,
                 prompt_tokens: npt.ArrayLike, completion_tokens: npt.ArrayLike,
                 days: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """The price of groups of calls of one spec made on one UTC day, from their token sums alone.

    ``days`` is the start of each group's day (epoch seconds).  Returns the costs (float64, NaN when unknown)
    and whether each is exact: it is not for a model whose price is not linear in the sums (tiered by
    prompt size, or by time of day) — those calls must be priced one by one with :func:`cost_array`.
    """
    import numpy as np

    spec_arr = np.asarray(specs, dtype=object)
    n_calls = np.asarray(calls, dtype="float64")
    prompt = np.asarray(prompt_tokens, dtype="float64")
    completion = np.asarray(completion_tokens, dtype="float64")
    day = np.asarray(days, dtype="float64")
    out = np.full(len(spec_arr), np.nan)
    exact = np.ones(len(spec_arr), dtype=bool)
    if not len(spec_arr):
        return out, exact
    uniques, inverse = np.unique(spec_arr.astype(str), return_inverse=True)
    for k, spec in enumerate(uniques):
        rows = inverse == k
        name = priced_name(str(spec))
        if name is None:
            out[rows] = 0.0
            continue
        if _model(name) is None:
            _warn_unknown(name)
            continue
        if _by_time_of_day(name):
            exact[rows] = False
            continue
        for when in np.unique(day[rows]):
            group = rows & (day == when)
            rates = _rates(name, float(when))
            if isinstance(rates, tuple):
                out[group] = n_calls[group] * rates[0] + prompt[group] * rates[1] + completion[group] * rates[2]
            else:
                exact[group] = False
    return out, exact


def call_cost(spec: str, prompt_tokens: int, completion_tokens: int, ts: float | None = None) -> float | None:
    """The price in US dollars of one call of model ``spec`` made at ``ts`` (None: now); None when unknown."""
    return call_costs(spec, [prompt_tokens], [completion_tokens], [ts])[0]


def call_costs(spec: str, prompt_tokens: Sequence[int], completion_tokens: Sequence[int],
               ts: Sequence[float | None] | None = None) -> list[float | None]:
    """:func:`call_cost` for many calls of one model spec (the rates are looked up once per day)."""
    n = len(prompt_tokens)
    times = [math.nan if t is None else float(t) for t in ts] if ts is not None else [math.nan] * n
    costs = cost_array([spec] * n, prompt_tokens, completion_tokens, times)
    return [None if math.isnan(c) else float(c) for c in costs]


def dollars(cost: float) -> str:
    """A price as a reader scans it: ``$1.23``, ``$0.0123``, ``$0.00018`` (two significant digits below a cent)."""
    if cost == 0:
        return "$0"
    if cost >= 1:
        return f"${cost:,.2f}"
    if cost >= 0.01:
        return f"${cost:.4f}"
    # two significant digits in plain decimals: $0.000042, never 4.2e-05 (a price is read, not parsed)
    places = 1 - math.floor(math.log10(cost))
    return f"${cost:.{places}f}"
