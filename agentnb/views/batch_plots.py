"""``agentnb.plot_batch(batch)``: the variants of a batch compared, as a matplotlib Figure (DESIGN §10).

Left: one point per variant, its mean score against its mean cost per job, labelled ``piece · model``.
The score is the one named by ``score=``, by default the first boolean or numeric score of the batch
(a boolean's mean is the share true).  When every cost is 0 or unknown (offline models, unpriced
endpoints) the x axis is the mean total tokens per job instead, and its label says so.  Right: the
total tokens of each case, per variant (a box per variant with every case drawn over it).

Built without pyplot, like :mod:`agentnb.views.plots`: the Figure shows itself as a PNG and leaves
matplotlib's global state alone.  Artists carry a ``gid`` (``variant:<i>``, ``label:<i>``,
``tokens:<i>``) so tests and users can find them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..errors import UsageError
from .batch_frames import batch_summary, score_columns
from .plots import figure_png

__all__ = ["BatchFigure", "plot_batch"]

_NUMERIC = ("boolean", "Int64", "Float64")


class BatchFigure(Figure):
    """What :func:`plot_batch` returns: a plain Figure that IPython can show without pyplot."""

    def _repr_png_(self) -> tuple[bytes, dict[str, int]]:
        return figure_png(self)


def _choose_score(frame: pd.DataFrame, score: str | None) -> str | None:
    numeric = [n for n in score_columns(frame) if str(frame[n].dtype) in _NUMERIC]
    if score is None:
        return numeric[0] if numeric else None
    if score not in numeric:
        allowed = ", ".join(numeric) or "none (give scorers= to the batch or call ws.score)"
        what = "not numeric or boolean" if score in score_columns(frame) else "not a score of this batch"
        raise UsageError(f"score={score!r} is {what}; allowed: {allowed}")
    return score


def plot_batch(batch: Any, *, score: str | None = None, title: str | None = None,
               figsize: tuple[float, float] = (11.0, 4.5)) -> BatchFigure:
    """Compare a batch's variants: mean ``score`` against mean cost (or tokens), and tokens per case.

    ``batch``: a :class:`~agentnb.batch.Batch`, or its ``frame`` (a DataFrame from ``batch.frame``).
    """
    if isinstance(batch, pd.DataFrame):
        frame, name = batch, str(batch.attrs.get("batch", "batch"))
    elif hasattr(batch, "frame") and hasattr(batch, "name"):
        frame, name = batch.frame, str(batch.name)
    else:
        raise UsageError(f"plot_batch takes a Batch (ws.batch(...)) or its frame, not {type(batch).__name__}")
    if frame.empty:
        raise UsageError(f"batch {name!r} has no jobs to plot")
    chosen = _choose_score(frame, score)
    summary = batch_summary(None, frame)
    labels = [f"{p} · {m}" for p, m in zip(summary["piece"], summary["model"], strict=True)]
    costs = summary["mean_cost_usd"]
    by_cost = bool(costs.notna().all() and (costs > 0).any())
    x = (costs if by_cost else summary["mean_tokens"]).astype(float).to_numpy()
    fig = BatchFigure(figsize=figsize, layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(1.1, 1.0))
    fig.suptitle(title or f"batch {name}: {len(summary)} variants × {frame['case'].nunique()} cases")

    left.set_xlabel("mean cost per job (US$)" if by_cost else
                    "mean total tokens per job (no cost: every price is 0 or unknown)")
    if chosen is None:
        left.text(0.5, 0.5, "No numeric or boolean score yet:\ngive scorers= or call ws.score(batch, …)",
                  ha="center", va="center", transform=left.transAxes, gid="no-score")
        left.set_yticks([])
    else:
        y = summary[f"mean_{chosen}"].astype(float).to_numpy()
        boolean = str(frame[chosen].dtype) == "boolean"
        left.set_ylabel(f"share of {chosen} true" if boolean else f"mean {chosen}")
        unscored = [label for label, yi in zip(labels, y, strict=True) if np.isnan(yi)]
        if unscored:  # no job of these variants has this score yet (none ended, or the scorer always raised)
            left.text(0.01, 0.01, "no score yet: " + ", ".join(unscored), transform=left.transAxes,
                      fontsize="small", va="bottom", gid="unscored")
        for i, (xi, yi, label) in enumerate(zip(x, y, labels, strict=True)):
            if np.isnan(yi):
                continue
            colour = f"C{i % 10}"
            left.scatter([xi], [yi], s=60, color=colour, zorder=3, gid=f"variant:{i}")
            left.annotate(label, (xi, yi), xytext=(6, 6), textcoords="offset points", fontsize="small",
                          color=colour, gid=f"label:{i}")
        if boolean:
            left.set_ylim(-0.05, 1.1)
        left.margins(x=0.25, y=0.15)
        left.grid(alpha=0.3)
    left.set_title(f"{chosen or 'score'} against {'cost' if by_cost else 'tokens'}", fontsize="medium")

    groups = [frame.loc[frame["variant"] == v, "total_tokens"].astype(float).to_numpy() for v in summary["variant"]]
    boxes = right.boxplot(groups, tick_labels=labels, showfliers=False, patch_artist=True)
    rng = np.random.default_rng(0)  # the same jitter every time: the same batch draws the same figure
    for i, (box, values) in enumerate(zip(boxes["boxes"], groups, strict=True)):
        box.set(facecolor=f"C{i % 10}", alpha=0.25, gid=f"tokens:{i}")
        right.scatter(i + 1 + rng.uniform(-0.12, 0.12, len(values)), values, s=14, color=f"C{i % 10}", zorder=3)
    right.set_ylabel("total tokens per case")
    right.set_title("tokens per case", fontsize="medium")
    right.tick_params(axis="x", labelrotation=20, labelsize="small")
    right.grid(axis="y", alpha=0.3)
    return fig
