"""What an LLM call cost, in US dollars, from the ``genai-prices`` package's bundled data (DESIGN §10).

Nothing is fetched: ``genai_prices.calc_price``'s snapshot ships inside the package, and its
auto-update (which would download) is never started.  A model spec is priced by its model name
(``openai:gpt-4o-mini`` → ``gpt-4o-mini``), the provider found by genai-prices from that name; the
offline models (``demo``, ``scripted:``, ``replay:``) cost 0; a name genai-prices does not know
costs ``None`` (NA in the frames), with one warning per model name and process.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

__all__ = ["FREE_PREFIXES", "UnknownPriceWarning", "call_cost", "call_costs", "priced_name"]

# specs that never reach a paid endpoint
FREE_PREFIXES = ("demo", "scripted:", "replay:")


class UnknownPriceWarning(UserWarning):
    """genai-prices has no price for a model: its calls' ``cost_usd`` is NA."""


_warned: set[str] = set()
_warn_lock = threading.Lock()


def priced_name(spec: str) -> str | None:
    """The model name a spec is priced by; None for the offline (free) models."""
    if spec == "demo" or spec.startswith(FREE_PREFIXES):
        return None
    _, _, name = spec.partition(":")
    return name or spec


@functools.lru_cache(maxsize=256)
def _model(name: str) -> Any:
    """genai-prices' (provider, model) for a model name, or None when it knows none."""
    from genai_prices import data_snapshot

    try:
        return data_snapshot.get_snapshot().find_provider_model(name, None, None, None)
    except LookupError:
        return None


@functools.lru_cache(maxsize=1024)
def _rates(name: str, day: str) -> tuple[float, float, float] | Any | None:
    """``(per_call, per_input_token, per_output_token)`` of a model on a day when its price is linear in
    tokens; the ModelPrice itself when it is tiered (priced call by call); None when unknown."""
    from genai_prices import Usage
    from genai_prices.types import TieredPrices

    found = _model(name)
    if found is None:
        return None
    _, model = found
    price = model.get_prices(datetime.fromisoformat(day).replace(tzinfo=timezone.utc))
    if any(isinstance(getattr(price, f, None), TieredPrices) for f in ("input_mtok", "output_mtok")):
        return price

    def total(inp: int, out: int) -> float:
        return float(price.calc_price(Usage(input_tokens=inp, output_tokens=out))["total_price"])

    base = total(0, 0)
    return base, (total(1_000_000, 0) - base) / 1e6, (total(0, 1_000_000) - base) / 1e6


def _warn_unknown(name: str) -> None:
    with _warn_lock:
        if name in _warned:
            return
        _warned.add(name)
    warnings.warn(f"genai-prices has no price for model {name!r}: its calls' cost_usd is NA",
                  UnknownPriceWarning, stacklevel=3)


def _day(ts: float | None) -> str:
    when = datetime.now(timezone.utc) if ts is None else datetime.fromtimestamp(ts, timezone.utc)
    return when.date().isoformat()


def call_cost(spec: str, prompt_tokens: int, completion_tokens: int, ts: float | None = None) -> float | None:
    """The price in US dollars of one call of model ``spec`` made at ``ts`` (None: now); None when unknown."""
    return call_costs(spec, [prompt_tokens], [completion_tokens], [ts])[0]


def call_costs(spec: str, prompt_tokens: Sequence[int], completion_tokens: Sequence[int],
               ts: Sequence[float | None] | None = None) -> list[float | None]:
    """:func:`call_cost` for many calls of one model spec (the rates are looked up once per day)."""
    n = len(prompt_tokens)
    name = priced_name(spec)
    if name is None:
        return [0.0] * n
    if _model(name) is None:
        if n:
            _warn_unknown(name)
        return [None] * n
    from genai_prices import Usage

    times = list(ts) if ts is not None else [None] * n
    out: list[float | None] = []
    for p, c, t in zip(prompt_tokens, completion_tokens, times, strict=True):
        rates = _rates(name, _day(t))
        if rates is None:
            out.append(None)
        elif isinstance(rates, tuple):
            out.append(rates[0] + int(p) * rates[1] + int(c) * rates[2])
        else:
            out.append(float(rates.calc_price(Usage(input_tokens=int(p), output_tokens=int(c)))["total_price"]))
    return out
