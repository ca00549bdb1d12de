"""The compact, styled table ``%agent usage`` shows (the value it returns stays the full DataFrame).

``ws.frames.usage`` has 18 columns — right for pandas, too wide to read in a cell.  The table
shows the few a reader scans a run by: the movement run, the call, its tokens, the context
ratio as a percentage, the ContextManager action, the transition, the model's latency, and
the cost when it is worth a column (some call cost something or has no price; offline runs
cost 0), with its total in the caption.  Missing values are blank (never ``NaN`` next to ``<NA>``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pandas as pd

from ..models.prices import dollars

__all__ = ["UsageFrame", "usage_table"]


def _int(v: Any) -> str:
    return "" if pd.isna(v) else f"{int(v):,}"


def _latency(v: Any) -> str:
    if pd.isna(v):
        return ""
    if v < 0.0005:
        return "<1 ms"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.1f} s"


def _compact(df: pd.DataFrame) -> pd.DataFrame:
    """The readable columns of a ``frames.usage`` frame, as text (blank where a value is missing)."""
    out = pd.DataFrame(index=df.index)
    if df["job"].nunique() > 1:
        out["job"] = df["job"].map(_int)
    # an LLM judge's call (docs/design-lab.md#llm-judge) belongs to no movement run
    purpose = df["purpose"] if "purpose" in df else pd.Series(pd.NA, index=df.index)
    out["movement"] = [f"{s}. {m}" if not pd.isna(m) else f"{s}." if not pd.isna(s) else f"({p})"
                       for s, m, p in zip(df["seq"], df["movement"], purpose, strict=True)]
    out["call"] = df["call"].map(_int)
    out["tokens"] = [f"{_int(t)}  ({_int(p)} + {_int(c)})" for t, p, c in
                     zip(df["total_tokens"], df["prompt_tokens"], df["completion_tokens"], strict=True)]
    out["context"] = ["" if pd.isna(r) else f"{r:.0%}" for r in df["ratio"]]
    out["action"] = ["" if pd.isna(a) else str(a).replace(",", ", ") for a in df["actions"]]
    out["next"] = ["" if pd.isna(t) else f"→ {t}" + (" (forced)" if f is True else "")
                   for t, f in zip(df["transition"], df["forced"].astype(object), strict=True)]
    if "latency_s" in df:
        out["latency"] = df["latency_s"].map(_latency)
    if _priced(df):
        out["cost"] = ["" if pd.isna(c) else dollars(c) for c in df["cost_usd"]]
    return out


def _priced(df: pd.DataFrame) -> bool:
    """Whether the cost is worth a column: some call cost something or has no price (offline runs cost 0)."""
    return "cost_usd" in df and bool((df["cost_usd"].fillna(1.0) != 0).any())


def _caption(df: pd.DataFrame) -> str:
    if not len(df):
        return "no LLM calls yet"
    totals = f"{len(df):,} LLM calls · {int(df['total_tokens'].sum()):,} tokens"
    if _priced(df):
        cost = df["cost_usd"]
        totals += " · " + (dollars(float(cost.sum())) if cost.notna().all() else "cost unknown (a model has no price)")
    return totals + " — the value of this cell is the full DataFrame (every column)"


def usage_table(df: pd.DataFrame) -> Any:
    """A pandas Styler of ``df`` (a ``frames.usage`` frame) with the compact columns; plain HTML without jinja2."""
    view = _compact(df)
    caption = _caption(df)
    try:
        styler = view.style
    except ImportError:  # pandas' Styler needs jinja2; the table is still readable without it
        return view.to_html(index=False)
    numbers: list[Hashable] = ["tokens", "context", "call", *[c for c in ("latency", "cost") if c in view]]
    cell: dict[str, Any] = {"white-space": "nowrap", "text-align": "left", "font-size": "12px"}
    return (styler.hide(axis="index")
            .set_caption(caption)
            .set_properties(None, **cell)
            .set_properties(numbers, **{"text-align": "right"})
            .set_table_styles([{"selector": "th", "props": "text-align:left;font-size:12px;white-space:nowrap"},
                               {"selector": "caption", "props": "caption-side:top;text-align:left;color:#777;"
                                                                "font-size:12px"}]))


class UsageFrame(pd.DataFrame):
    """The full ``frames.usage`` DataFrame, displayed in a notebook as :func:`usage_table`.

    Anything derived from it (a selection, ``.copy()``, arithmetic) is a plain DataFrame again.
    """

    @property
    def _constructor(self) -> type[pd.DataFrame]:
        return pd.DataFrame

    @classmethod
    def of(cls, df: pd.DataFrame) -> UsageFrame:
        out = cls(df)
        out.attrs.update(df.attrs)
        return out

    def _repr_html_(self) -> str | None:
        table = usage_table(self)
        return table if isinstance(table, str) else table.to_html()
