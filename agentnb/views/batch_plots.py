"""``agentnb.plot_batch(batch)``: the variants of a batch compared, as a matplotlib Figure (docs/design-lab.md).

Left: one marker per variant, its mean score against its mean cost per job.  The score is the one named
by ``score=``; by default the first boolean or numeric score whose mean differs between the variants (a
score equal for all, such as "wrote a file" when every job did, says nothing about the choice), else the
first one.  The figure's title names the score plotted and the others ``score=`` can choose.  A boolean's
mean is the share true.  When every cost is 0 or unknown (offline models, unpriced endpoints) the x axis
is the mean total tokens per job instead, and its label says so.  Each marker has error bars both ways: the
95 % confidence intervals of its two means (``batch_summary``'s ``_ci_low``/``_ci_high``, a bootstrap over
cases; docs/design-lab.md#confidence-intervals), as the left panel's title says.  Right: the total tokens of each case,
one row per variant (a box with every case drawn over it).

Variants are named by their short ``variant_label`` (``batch_frames.variant_labels``), once, as the right
panel's row labels, each in its variant's colour after its marker's shape (``●■▲◆``), so the left panel
needs no labels that could overprint one another.  The figure's height grows with the number of variants
and matplotlib's constrained layout fits the labels, titles and ticks: it holds from 2 to 12 variants (and
stays distinct up to 20: 10 colours × 4 shapes).

Built without pyplot, like :mod:`agentnb.views.plots`: the Figure shows itself as a PNG and leaves
matplotlib's global state alone.  Artists carry a ``gid`` (``variant:<i>``, ``label:<i>``, ``tokens:<i>``,
``score-note``, ``no-score``, ``unscored``) so tests and users can find them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from ..errors import UsageError
from .batch_frames import batch_summary, score_columns
from .plots import figure_png

__all__ = ["BatchFigure", "plot_batch"]

_NUMERIC = ("boolean", "Int64", "Float64")
# the marker of a variant and the character that shows it in its row label (DejaVu Sans has all four)
_SHAPES = (("o", "●"), ("s", "■"), ("^", "▲"), ("D", "◆"))


class BatchFigure(Figure):
    """What :func:`plot_batch` returns: a plain Figure that IPython can show without pyplot."""

    def _repr_png_(self) -> tuple[bytes, dict[str, int]]:
        return figure_png(self)


def _numeric_scores(frame: pd.DataFrame) -> list[str]:
    return [n for n in score_columns(frame) if str(frame[n].dtype) in _NUMERIC]


def _choose_score(frame: pd.DataFrame, summary: pd.DataFrame, score: str | None) -> str | None:
    numeric = _numeric_scores(frame)
    if score is None:
        varying = [n for n in numeric if summary[f"mean_{n}"].dropna().astype(float).nunique() > 1]
        return (varying or numeric)[0] if numeric else None
    if score not in numeric:
        allowed = ", ".join(numeric) or "none (give scorers= to the batch or call ws.score)"
        what = "not numeric or boolean" if score in score_columns(frame) else "not a score of this batch"
        raise UsageError(f"score={score!r} is {what}; allowed: {allowed}")
    return score


def _style(i: int) -> tuple[str, str, str]:
    """Variant ``i``'s colour, marker and marker character: distinct for the first 20 variants."""
    marker, char = _SHAPES[(i // 10 + i) % len(_SHAPES)]
    return f"C{i % 10}", marker, char


def plot_batch(batch: Any, *, score: str | None = None, title: str | None = None,
               figsize: tuple[float, float] | None = None) -> BatchFigure:
    """Compare a batch's variants: mean ``score`` against mean cost (or tokens), and tokens per case.

    ``batch``: a :class:`~agentnb.batch.Batch`, or its ``frame`` (a DataFrame from ``batch.frame``).
    ``score``: the score to plot (default: the first that differs between the variants).  ``figsize``
    (inches): by default 10 wide and as tall as the number of variants needs.
    """
    if isinstance(batch, pd.DataFrame):
        frame, name = batch, str(batch.attrs.get("batch", "batch"))
    elif hasattr(batch, "frame") and hasattr(batch, "name"):
        frame, name = batch.frame, str(batch.name)
    else:
        raise UsageError(f"plot_batch takes a Batch (ws.batch(...)) or its frame, not {type(batch).__name__}")
    if frame.empty:
        raise UsageError(f"batch {name!r} has no jobs to plot")
    summary = batch_summary(None, frame)
    chosen = _choose_score(frame, summary, score)
    labels = [str(label) for label in summary["variant_label"]]
    n = len(summary)
    costs = summary["mean_cost_usd"]
    by_cost = bool(costs.notna().all() and (costs > 0).any())
    mean_x = "mean_cost_usd" if by_cost else "mean_tokens"
    x = summary[mean_x].astype(float).to_numpy()
    x_ci = [summary[f"{mean_x}_ci_{end}"].astype(float).to_numpy() for end in ("low", "high")]
    # a row of the right panel per variant: about a third of an inch each, on top of the titles and axes
    fig = BatchFigure(figsize=figsize or (10.0, max(4.0, 2.2 + 0.3 * n)), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(1.0, 1.0))
    epochs = int(frame["epoch"].max()) if "epoch" in frame.columns and len(frame) else 1
    heading = title or (f"batch {name}: {n} variants × {frame['case'].nunique()} cases"
                        + (f" × {epochs} epochs" if epochs > 1 else ""))

    left.set_xlabel("mean cost per job (US$)" if by_cost else
                    "mean total tokens per job\n(no cost: every price is 0 or unknown)")
    left.xaxis.set_major_locator(MaxNLocator(nbins=5))
    left.xaxis.set_major_formatter(FuncFormatter((lambda v, _p: f"${v:,.4g}") if by_cost else
                                                 (lambda v, _p: f"{v:,.0f}")))
    if chosen is None:
        left.text(0.5, 0.5, "No numeric or boolean score yet:\ngive scorers= or call ws.score(batch, …)",
                  ha="center", va="center", transform=left.transAxes, gid="no-score")
        left.set_yticks([])
        left.set_title(f"score against {'cost' if by_cost else 'tokens'}", fontsize="medium")
        fig.suptitle(heading, fontsize="large")
    else:
        y = summary[f"mean_{chosen}"].astype(float).to_numpy()
        y_ci = [summary[f"mean_{chosen}_ci_{end}"].astype(float).to_numpy() for end in ("low", "high")]
        boolean = str(frame[chosen].dtype) == "boolean"
        left.set_ylabel(f"share of {chosen} true" if boolean else f"mean {chosen}")
        others = [s for s in _numeric_scores(frame) if s != chosen]
        note = f"score plotted: {chosen}" + (f" · others: {', '.join(others)} (choose with score=)" if others else "")
        # in the figure's title, which has the figure's whole width (an axes' title may be clipped)
        fig.suptitle(f"{heading}\n{note}", fontsize="large", gid="score-note")
        left.set_title(f"{chosen} against {'cost' if by_cost else 'tokens'} · bars: {_level(summary)} CI",
                       fontsize="medium")
        unscored = [label for label, yi in zip(labels, y, strict=True) if np.isnan(yi)]
        if unscored:  # no job of these variants has this score yet (none ended, or the scorer always raised)
            left.text(0.01, 0.01, f"no {chosen} yet: {len(unscored)} variant(s)", transform=left.transAxes,
                      fontsize="small", va="bottom", gid="unscored")
        for i, (xi, yi) in enumerate(zip(x, y, strict=True)):
            if np.isnan(yi):
                continue
            colour, marker, _ = _style(i)
            left.scatter([xi], [yi], s=70, color=colour, marker=marker, alpha=0.85, edgecolors="white",
                         linewidths=0.8, zorder=3, gid=f"variant:{i}")
            # the mean's confidence interval each way (none where it cannot be had: one case, an unknown price)
            xerr = [[xi - x_ci[0][i]], [x_ci[1][i] - xi]] if not np.isnan(x_ci[0][i]) else None
            yerr = [[yi - y_ci[0][i]], [y_ci[1][i] - yi]] if not np.isnan(y_ci[0][i]) else None
            if xerr is not None or yerr is not None:
                bars = left.errorbar([xi], [yi], xerr=xerr, yerr=yerr, fmt="none", ecolor=colour, alpha=0.6,
                                     elinewidth=1.2, capsize=3, zorder=2)
                bars.set_label(f"ci:{i}")  # a container has a label, not a gid
                for part in bars.get_children():
                    part.set_gid(f"ci:{i}")
        if boolean:
            left.set_ylim(-0.05, 1.1)
        left.margins(x=0.15, y=0.15)
        left.grid(alpha=0.3)

    groups = [frame.loc[frame["variant"] == v, "total_tokens"].astype(float).to_numpy() for v in summary["variant"]]
    rows = np.arange(n)[::-1] + 1  # the first variant at the top, as in the summary
    boxes = right.boxplot(groups, positions=rows, showfliers=False, patch_artist=True, widths=0.6,
                          **_horizontal())
    rng = np.random.default_rng(0)  # the same jitter every time: the same batch draws the same figure
    for i, (box, values, row) in enumerate(zip(boxes["boxes"], groups, rows, strict=True)):
        colour, marker, _ = _style(i)
        box.set(facecolor=colour, alpha=0.25, gid=f"tokens:{i}")
        boxes["medians"][i].set(color=colour, linewidth=2)
        right.scatter(values, row + rng.uniform(-0.15, 0.15, len(values)), s=12, color=colour, marker=marker,
                      zorder=3)
    right.set_yticks(rows, labels=[f"{_style(i)[2]} {_two_lines(label)}" for i, label in enumerate(labels)])
    for i, tick in enumerate(right.get_yticklabels()):
        tick.set(color=_style(i)[0], gid=f"label:{i}")
    right.tick_params(axis="y", labelsize="small", length=0)
    right.set_ylim(0.4, n + 0.6)
    right.xaxis.set_major_locator(MaxNLocator(nbins=5))
    right.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:,.0f}"))
    # with epochs, each point is one run of a case (one job)
    right.set_xlabel("total tokens per case" if epochs == 1 else "total tokens per case and epoch")
    right.set_title("tokens per case, by variant", fontsize="medium")
    right.grid(axis="x", alpha=0.3)
    return fig


def _level(summary: pd.DataFrame) -> str:
    """The confidence of the summary's intervals, as its settings' text starts ("95% CI, …")."""
    return str(summary.attrs.get("stats", "95%")).split(" ", 1)[0]


def _two_lines(label: str) -> str:
    """A long label on two lines, the piece over the model: it would take the tokens panel's width."""
    piece, sep, model = label.partition(" · ")
    return f"{piece} ·\n   {model}" if sep and len(label) > 32 else label


def _horizontal() -> dict[str, Any]:
    import matplotlib

    # boxplot's orientation= arrived in matplotlib 3.10, which deprecates vert=
    major, minor = (int(p) for p in matplotlib.__version__.split(".")[:2])
    return {"orientation": "horizontal"} if (major, minor) >= (3, 10) else {"vert": False}
