"""The usage timeline: ``agentnb.plot_usage(job_or_frame)`` → a matplotlib Figure.

Top panel: the context ratio (prompt tokens / window) of each LLM call, one line per
movement run coloured by the movement's name, the ContextManager threshold lines, a
marker at each call where an action fired (labelled with the action), a hollow diamond
at each call that ended a movement with a transition (red when forced), a vertical line
at each movement boundary, and the runs' names (``1. plan``) along the top.  Bottom
panel: cumulative total, prompt and completion tokens.  The legend names every line and
marker shape.  A job that failed or was aborted says so, with its error, above the top
panel; a job without any LLM call is a few lines of text saying why (its status and
error) instead of empty axes.

The x axis is the LLM call number within the job.  A frame holding several jobs
(``ws.frames.usage()``) draws one line per job in both panels, for comparisons.

The figure is a :class:`matplotlib.figure.Figure` built without pyplot, so plotting leaves
matplotlib's global state as it found it: backend, interactive mode, rcParams and pyplot's
current figure.  (Built through pyplot, the first plot of a kernel loaded the inline backend
inside the font ``rc_context``, whose exit reset ``interactive`` to False, and every later
plot of the notebook showed nothing.)  IPython shows it as a PNG at twice its pixel density
(``_repr_png_``) until the inline backend is loaded, and with that backend's formatter after.

With ``what_if=dict(window=…, thresholds=…)`` (or a ``ws.frames.what_if`` frame, passed there or as the
frame to plot) the ratio panel also shows the ContextManager simulated under those settings
(``views/what_if.py``): the recomputed ratio as a dashed line per job (legend ``what-if (window N)``), the
actions that would fire as hollow markers (labelled in italics), the what-if thresholds as thin long-dashed lines, and a dotted
red line at the first call where a movement would have been forced to transition (from there on the
simulation no longer describes what would have happened).  Without it the figure is what it was.  Labels
whose markers are at one call and near each other (the record's and the what-if's) are stacked in one
column (``views/plot_labels.py``), and the layout is fixed once they are placed.

A compaction (docs/context.md#compaction, ``context.on_pressure: compact``) is a teal down-pointing triangle at its
summarisation call (the usage row whose ``action`` is ``compaction``), labelled ``compaction 1: 920→582
tokens`` (the run's compactions numbered from 1; the sizes from ``frames.compactions()``, so only when a job
is plotted: a frame alone says ``compaction 1``), with an arrow from the context before (``tokens_before`` /
window) down to the compacted one (``tokens_after`` / window): the ratio drops there.  (The summarisation
call's own ratio is its request's: the whole conversation plus the request for a summary.)  A summarisation call that made no compaction (its
summary was empty) is labelled ``compaction failed``.  Where a loop monitor fired, a purple dotted line
follows the run that closed the loop, labelled ``⟳ loop review → fix ×3``.  A job without either is drawn
as before.

Artists carry a ``gid`` (``threshold:<action>``, ``movement:<seq>``, ``boundary:<seq>``,
``action:<job>``, ``transition:<job>``, ``cumulative:<job>``, ``label:action``,
``label:transition``, ``status``; with a compaction ``compaction:<job>``, ``compaction:drop``,
``label:compaction``; with a loop ``loop:<seq>``, ``label:loop``; with a what-if ``what_if:threshold:<action>``, ``what_if:ratio:<job>``,
``what_if:action:<job>``, ``what_if:first_forced``, ``label:what_if``) so tests and users can find them.
"""

from __future__ import annotations

import io
import math
import re
import struct
import textwrap
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..engine.pieces import DEFAULT_THRESHOLDS
from ..errors import UsageError
from ..models.base import short_spec
from ..store.base import JobStatus
from .plot_labels import NEAR as _NEAR
from .plot_labels import fit_labels as _fit_labels
from .plot_labels import leader as _leader
from .source import JobSource
from .style import ACTION_COLOURS, ACTIONS, COMPACTION, COMPACTION_COLOUR, ERROR_COLOUR, LOOP_COLOUR
from .timeline import fold
from .what_if import WHAT_IF_COLUMNS, simulate

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axes._secondary_axes import SecondaryAxis
    from matplotlib.text import Annotation
    from matplotlib.typing import RcKeyType

    from .frames import Frames

__all__ = ["UsageFigure", "UsageSource", "figure_png", "plot_usage"]

_ACTION_MARKER = {"warn": "^", "prompt": "s", "force_transition": "X", "exhausted": "P"}
_FORCED = "#c0392b"
_WHAT_IF = "#34495e"
_WHAT_IF_DASH = (0, (8, 4))  # longer than the recorded thresholds' "--", so the two sets stay apart


class UsageSource(JobSource, Protocol):
    """A workspace as the plot reads it: its jobs and its frames (the usage rows, the thresholds in force)."""

    @property
    def frames(self) -> Frames: ...


@runtime_checkable
class _AttachedJob(Protocol):
    """A job with the workspace it belongs to (an ``agentnb.Job``)."""

    @property
    def id(self) -> int: ...
    @property
    def workspace(self) -> UsageSource | None: ...
# x-small (7 pt) labels were unreadable at a notebook's 100 px per inch
_LABEL_SIZE = "small"
# room above the highest call, so the label of an action fired there fits inside the axes
_HEADROOM = 1.12
_NO_CALLS: dict[str, str] = {
    JobStatus.queued: "Queued: no LLM call yet. Run or step it, then plot it again.",
    JobStatus.running: "Running: its first LLM call has not returned yet.",
    JobStatus.waiting_human: "Waiting for a human: no LLM call yet.",
    JobStatus.waiting_subtasks: "Waiting for its subtasks: no LLM call of its own.",
    JobStatus.succeeded: "Succeeded without any LLM call.",
    JobStatus.failed: "Failed before its first LLM call.",
    JobStatus.aborted: "Aborted before its first LLM call.",
}
# Fonts with Japanese (and other CJK) glyphs, best first.  matplotlib's default DejaVu Sans has none, so
# a movement named 下書き would be drawn as boxes even where the system has such a font.
_CJK_FAMILIES = (
    "Noto Sans CJK JP", "Noto Sans JP", "Source Han Sans JP", "IPAexGothic", "IPAGothic", "IPAPGothic",
    "Hiragino Sans", "Hiragino Kaku Gothic ProN", "Yu Gothic", "Meiryo", "MS Gothic", "TakaoGothic",
    "VL Gothic", "Noto Sans CJK SC", "Noto Sans CJK KR", "WenQuanYi Zen Hei", "Droid Sans Fallback",
)
_CJK_FILES = re.compile(r"cjk|ipa|takao|vl-?gothic|hiragino|yugoth|meiryo|msgothic|sourcehan|notosansjp|wqy|droidsansfallback", re.I)
_WIDE = re.compile(r"[\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]")
_cjk_found: list[str] | None = None


class UsageFigure(Figure):
    """What :func:`plot_usage` returns: a plain Figure that IPython can show without pyplot."""

    def _repr_png_(self) -> tuple[bytes, dict[str, int]]:
        return figure_png(self)


def figure_png(fig: Figure, *, scale: float = 2.0) -> tuple[bytes, dict[str, int]]:
    """``fig`` as PNG at ``scale`` times its dpi, with the ``width``/``height`` (CSS px) to show it at.

    ``scale`` times the pixels shown at the figure's own size: sharp on a high-density screen, and as
    large on the page as the notebook's other plots (what IPython's "retina" format does).
    """
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=fig.dpi * scale)
    data = buf.getvalue()
    # the PNG's own size: savefig.bbox (an rcParam) may have cropped it
    width, height = struct.unpack(">II", data[16:24])
    return data, {"width": round(width / scale), "height": round(height / scale)}


@dataclass
class _Target:
    """What to draw: the usage rows, thresholds, heading and, for one job, its status and error."""

    frame: pd.DataFrame
    thresholds: dict[str, float]
    heading: str
    status: str | None = None  # None: a frame, perhaps of several jobs
    error: str | None = None
    what_if: dict[str, Any] | None = None  # the simulated settings; the frame then has the what-if columns
    ws: UsageSource | None = None  # the workspace of a job plotted (None for a frame)
    # a job's compactions (frames.compactions()), for the sizes in their labels; None for a frame
    compactions: pd.DataFrame | None = None
    loops: list[tuple[int, str]] = field(default_factory=list)  # (run that closed a loop, its label)


def plot_usage(
    job_or_frame: Any,
    *,
    ws: UsageSource | None = None,
    thresholds: Mapping[str, float] | None = None,
    title: str | None = None,
    figsize: tuple[float, float] = (10.0, 6.5),
    what_if: Mapping[str, Any] | pd.DataFrame | None = None,
) -> UsageFigure:
    """Draw the usage timeline of a :class:`~agentnb.Job` (or a job id with ``ws=``) or a usage DataFrame.

    Thresholds come from ``thresholds=``, else the job's piece (and ``context=`` given
    at submit), else the frame's ``attrs["thresholds"]``, else the defaults.

    ``what_if=dict(window=…, thresholds=…)`` overlays the ContextManager simulated under another window
    and/or thresholds (``ws.frames.what_if``): the recomputed ratio dashed, the actions that would fire
    hollow, the what-if thresholds long-dashed.  It may also be a ``ws.frames.what_if`` frame, and such a
    frame may be plotted directly.  A simulation of the ContextManager alone: a transition forced earlier
    would have changed every call after it.
    """
    target = _with_what_if(_resolve(job_or_frame, ws, thresholds), job_or_frame, ws, what_if)
    heading = title or target.heading
    df = target.frame
    import matplotlib

    labels = [heading, target.error or "", *df["movement"].dropna().astype(str),
              *df["transition"].dropna().astype(str)]
    # Text artists keep the font family in force when they are made, so the figure keeps it when drawn
    # later.  rc_context puts every rcParam back on exit; nothing inside it may load a backend.
    with matplotlib.rc_context(_font_for(labels)):
        if df.empty:
            return _draw_no_calls(target, heading, figsize)
        return _draw(target, heading, figsize)


def _draw_no_calls(t: _Target, heading: str, figsize: tuple[float, float]) -> UsageFigure:
    """What happened, in words: axes without a call would only show an empty 0–1 grid."""
    failed = t.status in (JobStatus.failed, JobStatus.aborted)
    first = "This frame has no LLM calls." if t.status is None else _NO_CALLS.get(
        t.status, f"{t.status}: no LLM calls.")
    blocks: list[tuple[str, dict[str, Any]]] = [
        (first, {"fontsize": "large", "color": ERROR_COLOUR if failed else "black", "gid": "status"})]
    if t.error:
        blocks.append((_wrap(t.error, lines=8), {"fontsize": "medium", "color": ERROR_COLOUR if failed else "black",
                                                 "gid": "error"}))
    shown = ", ".join(f"{n} {t.thresholds[n]:.0%}" for n in ACTIONS if n in t.thresholds)
    if shown:
        blocks.append((f"Context thresholds: {shown}", {"fontsize": "small", "color": "dimgrey"}))
    line = 0.24  # inches per line of text
    height = 0.75 + sum(line * (text.count("\n") + 1) + 0.1 for text, _ in blocks)
    fig = UsageFigure(figsize=(figsize[0], height))
    fig.suptitle(heading, y=1 - 0.12 / height, va="top")
    y = height - 0.6
    for text, style in blocks:
        fig.text(0.3, y, text, transform=fig.dpi_scale_trans, ha="left", va="top", **style)
        y -= line * (text.count("\n") + 1) + 0.1
    return fig


def _draw(t: _Target, heading: str, figsize: tuple[float, float]) -> UsageFigure:
    df = t.frame
    fig, ax, ax_cum = _usage_axes(t, heading, figsize)
    legend = _threshold_legend(ax, t)
    colours = _movement_colours(df["movement"])
    jobs = list(dict.fromkeys(df["job"].tolist()))
    several = len(jobs) > 1
    drawn = _Drawn()
    for n, job_id in enumerate(jobs):
        _draw_job(ax, ax_cum, df[df["job"] == job_id], job_id, colours, drawn, n if several else None)
        _draw_compactions(ax, df[df["job"] == job_id], job_id, t.compactions, drawn)
        if not several:
            _draw_loops(ax, df, t.loops, drawn)
        if t.what_if is not None:
            _draw_what_if(ax, df[df["job"] == job_id], job_id, drawn, n if several else None)
    legend += _marker_legend(t, drawn)
    _scale_axes(ax, ax_cum, t)
    # outside the axes: inside, the legend would hide the top thresholds and the late calls
    ax.legend([h for h, _ in legend], [s for _, s in legend], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize="small", borderaxespad=0)
    ax_cum.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0)

    runs_axis = _name_runs(ax, drawn.runs, colours) if not several else None
    points = df[["call", "ratio"]].dropna().to_numpy(dtype=float)
    if t.what_if is not None:  # the labels keep clear of the simulated markers too
        points = np.vstack([points, df[["call", "ratio_what_if"]].dropna().to_numpy(dtype=float)])
    _fit_labels(fig, ax, drawn.labels, runs_axis, points)
    return fig


def _usage_axes(t: _Target, heading: str, figsize: tuple[float, float]) -> tuple[UsageFigure, Any, Any]:
    """The figure with its two axes (context ratio above, cumulative tokens below), titled and labelled."""
    fig = UsageFigure(figsize=figsize, layout="constrained")
    ax, ax_cum = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    fig.suptitle(heading)
    if t.error:
        what = f"{t.status} after LLM call {int(t.frame['call'].max())}" if t.status else "error"
        ax.set_title(_wrap(f"{what}: {t.error}", lines=3), loc="left", fontsize="medium", color=ERROR_COLOUR, gid="status")
    ax.set_ylabel("context ratio (prompt / window)")
    ax_cum.set_ylabel("cumulative tokens")
    ax_cum.set_xlabel("LLM call")
    ax.grid(alpha=0.3)
    ax_cum.grid(alpha=0.3)
    return fig, ax, ax_cum


def _threshold_legend(ax: Any, t: _Target) -> list[tuple[Any, str]]:
    """The thresholds' dashed lines (and the what-if's), with their legend entries."""
    th = t.thresholds
    legend: list[tuple[Any, str]] = []
    for name in ACTIONS:
        if name in th:
            line = ax.axhline(th[name], color=ACTION_COLOURS[name], linestyle="--", linewidth=1,
                              gid=f"threshold:{name}")
            legend.append((line, f"{name} {th[name]:.0%}"))
    if t.what_if is not None:
        legend += _what_if_thresholds(ax, t.what_if["thresholds"], th)
    return legend


def _marker_legend(t: _Target, drawn: _Drawn) -> list[tuple[Any, str]]:
    """The legend entries of the marks drawn (only those some job has), then one per movement."""
    from matplotlib.lines import Line2D

    def proxy(**kw: Any) -> Line2D:
        return Line2D([], [], linestyle="none", markersize=8, **kw)

    legend: list[tuple[Any, str]] = []
    if drawn.transitions:
        legend.append((proxy(marker="D", markerfacecolor="none", markeredgecolor="black", markeredgewidth=1.5),
                       "transition (→ next step)"))
    if drawn.forced:
        legend.append((proxy(marker="D", markerfacecolor="none", markeredgecolor=_FORCED, markeredgewidth=1.5),
                       "forced transition"))
    for action in ACTIONS:
        if action in drawn.actions:
            legend.append((proxy(marker=_ACTION_MARKER[action], markerfacecolor=ACTION_COLOURS[action],
                                 markeredgecolor="black"), f"{action} fired"))
    if drawn.compactions:
        legend.append((proxy(marker="v", markerfacecolor=COMPACTION_COLOUR, markeredgecolor="black"),
                       "compaction (messages summarised)"))
    if drawn.loops:
        legend.append((Line2D([], [], color=LOOP_COLOUR, linestyle=":", linewidth=1.5), "loop detected"))
    if t.what_if is not None:
        legend += _what_if_legend(t.what_if, drawn, proxy)
    if drawn.boundaries:
        legend.append((Line2D([], [], color="grey", alpha=0.5, linewidth=1.5), "movement boundary"))
    if drawn.forced_boundaries:
        legend.append((Line2D([], [], color=_FORCED, alpha=0.5, linewidth=1.5), "forced boundary"))
    return legend + drawn.movements


def _what_if_legend(what_if: Mapping[str, Any], drawn: _Drawn, proxy: Callable[..., Any]) -> list[tuple[Any, str]]:
    """The what-if's legend entries: its ratio line, the actions it would fire, its first forced transition."""
    from matplotlib.lines import Line2D

    window = what_if.get("window")
    legend: list[tuple[Any, str]] = [(drawn.what_if_line or Line2D([], [], color=_WHAT_IF, linestyle="--"),
                                      f"what-if (window {window})" if window is not None else "what-if (recorded windows)")]
    for action in ACTIONS:
        if action in drawn.what_if_actions:
            legend.append((proxy(marker=_ACTION_MARKER[action], markerfacecolor="none",
                                 markeredgecolor=ACTION_COLOURS[action], markeredgewidth=1.5),
                           f"{action} would fire (what-if)"))
    if drawn.what_if_forced:
        legend.append((Line2D([], [], color=_FORCED, linestyle=":", linewidth=1.5), "what-if: first forced transition"))
    return legend


def _scale_axes(ax: Any, ax_cum: Any, t: _Target) -> None:
    """The ratio axis from a little below 0 % to above the highest call (simulated ones too), in percent; the
    calls axis one call past either end, in whole calls; the tokens axis in thousands."""
    from matplotlib.ticker import MaxNLocator, MultipleLocator

    df = t.frame
    highest = float(df["ratio"].max())
    if t.what_if is not None:
        simulated = float(pd.to_numeric(df["ratio_what_if"]).max())  # NaN when no call has a window
        highest = highest if math.isnan(simulated) else max(highest, simulated)
    top = max(1.0, highest) * _HEADROOM
    # a little room below 0 %: calls with a tiny ratio would otherwise have their markers cut in half
    ax.set_ylim(-0.04 * top, top)
    ax.yaxis.set_major_formatter(_percent())
    if top <= 3:
        ax.yaxis.set_major_locator(MultipleLocator(0.2))
    ax.set_xlim(float(df["call"].min()) - 0.5, float(df["call"].max()) + 0.5)
    # min_n_ticks=1: a job with one call would otherwise get ticks like 0.96, 0.98, 1.00
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax_cum.yaxis.set_major_formatter(_thousands())


@dataclass
class _Drawn:
    """What :func:`_draw_job` put on the axes, for the legend and the layout pass."""

    movements: list[tuple[Any, str]] = field(default_factory=list)  # (line, name), one per movement name
    labels: list[Annotation] = field(default_factory=list)
    runs: list[tuple[int, str, float]] = field(default_factory=list)  # (seq, movement, centre in calls)
    actions: set[str] = field(default_factory=set)
    transitions: bool = False
    forced: bool = False
    boundaries: bool = False
    forced_boundaries: bool = False
    what_if_line: Any = None  # the first job's what-if ratio line, for the legend
    what_if_actions: set[str] = field(default_factory=set)
    what_if_forced: bool = False
    compactions: bool = False
    loops: bool = False


def _draw_job(
    ax: Axes, ax_cum: Axes, rows: pd.DataFrame, job_id: int, colours: Mapping[str, Any],
    drawn: _Drawn, nth: int | None,
) -> None:
    """One job's series; ``nth`` is its position when the frame holds several jobs (else ``None``)."""
    import matplotlib

    several = nth is not None
    x = rows["call"].to_numpy()
    style = "-" if nth is None else ["-", "--", ":", "-."][nth % 4]
    named = {label for _, label in drawn.movements}
    # a thin line across movement runs keeps the sequence readable; runs are drawn on top
    ax.plot(x, rows["ratio"].to_numpy(), color="lightgrey", linewidth=1, zorder=1, linestyle=style)
    for seq, run in rows.groupby("seq", sort=True):
        name = str(run["movement"].iloc[0]) if pd.notna(run["movement"].iloc[0]) else "?"
        calls = run["call"].to_numpy()
        (line,) = ax.plot(calls, run["ratio"].to_numpy(), marker="o", markersize=4, linestyle=style,
                          color=colours.get(name, "grey"), gid=f"movement:{seq}", zorder=2)
        if name not in named:
            named.add(name)
            drawn.movements.append((line, name))
        drawn.runs.append((int(run["seq"].to_numpy()[0]), name, (float(calls.min()) + float(calls.max())) / 2))

    # a compaction's summarisation call is drawn apart (_draw_compactions): it is no ContextManager action
    acted = rows[rows["action"].notna() & (rows["action"] != COMPACTION)]
    for action, group in acted.groupby("action", observed=True):
        drawn.actions.add(str(action))
        ax.scatter(group["call"], group["ratio"], marker=_ACTION_MARKER.get(str(action), "*"), s=90,
                   color=ACTION_COLOURS.get(str(action), "black"), edgecolors="black", zorder=4,
                   gid=f"action:{job_id}")
    for _, r in acted.iterrows():
        # dark text on a white box edged in the action's colour: the threshold lines run right there
        drawn.labels.append(ax.annotate(
            str(r["actions"]), (r["call"], r["ratio"]), textcoords="offset points", xytext=(_NEAR, _NEAR), va="bottom",
            fontsize=_LABEL_SIZE, color="black", zorder=6, gid="label:action", arrowprops=_leader("dimgrey"),
            bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.9, "linewidth": 0.8,
                  "edgecolor": ACTION_COLOURS.get(str(r["action"]), "black")}))

    ended = rows[rows["transition"].notna()]
    if not ended.empty:
        forced = ended["forced"].fillna(False).to_numpy(dtype=bool)
        drawn.transitions |= bool((~forced).any())
        drawn.forced |= bool(forced.any())
        # hollow, and larger than the action markers, so an action fired at the same call shows through
        ax.scatter(ended["call"], ended["ratio"], marker="D", s=140, facecolors="none",
                   edgecolors=[_FORCED if f else "black" for f in forced], linewidths=1.5, zorder=5,
                   gid=f"transition:{job_id}")
        last = float(x.max())
        for (_, r), f in zip(ended.iterrows(), forced, strict=True):
            if several:  # one job's movement boundaries would mislead for the others
                continue
            if r["call"] < last:  # a boundary only between two runs, not after the job's last call
                for a in (ax, ax_cum):
                    a.axvline(r["call"] + 0.5, color=_FORCED if f else "grey", alpha=0.5, linewidth=1.5,
                              gid=f"boundary:{r['seq']}", zorder=0)
                drawn.forced_boundaries |= bool(f)
                drawn.boundaries |= not f
            drawn.labels.append(ax.annotate(
                f"→ {r['transition']}" + (" (forced)" if f else ""), (r["call"], r["ratio"]),
                textcoords="offset points", xytext=(_NEAR, -_NEAR), va="top", fontsize=_LABEL_SIZE,
                color=_FORCED if f else "dimgrey", zorder=6, gid="label:transition",
                arrowprops=_leader(_FORCED if f else "dimgrey"),
                bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "alpha": 0.8, "linewidth": 0}))

    dot: dict[str, Any] = {"marker": "o", "markersize": 3} if len(x) == 1 else {}  # a one-call line would be invisible
    if nth is not None:
        # per job only the total, in the job's own colour: three lines per job would be unreadable
        # 10 colours × 4 line styles: a job's colour and style pair repeats only after 20 jobs
        ax_cum.plot(x, rows["cumulative_tokens"].to_numpy(), color=matplotlib.colormaps["tab10"](nth % 10),
                    linestyle=style, linewidth=1.5, label=f"job {job_id} total", gid=f"cumulative:{job_id}", **dot)
        drawn.labels.append(ax.annotate(f"job {job_id}", (x[-1], rows["ratio"].iloc[-1]), textcoords="offset points",
                                        xytext=(6, 0), va="center", fontsize=_LABEL_SIZE))
        return
    ax_cum.plot(x, rows["cumulative_tokens"].to_numpy(), color="black", linewidth=1.5, label="total",
                gid=f"cumulative:{job_id}", **dot)
    ax_cum.plot(x, rows["prompt_tokens"].cumsum().to_numpy(), color="#2e86c1", linewidth=1, label="prompt", **dot)
    ax_cum.plot(x, rows["completion_tokens"].cumsum().to_numpy(), color="#28b463", linewidth=1, label="completion",
                **dot)


def _draw_compactions(ax: Axes, rows: pd.DataFrame, job_id: int, compactions: pd.DataFrame | None,
                      drawn: _Drawn) -> None:
    """Each compaction of one job: a marker at its summarisation call, an arrow from the context before down
    to the compacted one, and a label with the sizes before and after (when the job's compactions are known)."""
    summarising = rows[rows["action"] == COMPACTION]
    if summarising.empty:
        return
    drawn.compactions = True
    ax.scatter(summarising["call"], summarising["ratio"], marker="v", s=110, color=COMPACTION_COLOUR,
               edgecolors="black", zorder=4, gid=f"compaction:{job_id}")
    made: dict[tuple[int, int], Any] = {}
    if compactions is not None:
        for _, c in compactions[compactions["job"] == job_id].iterrows():
            made[(int(c["seq"]), int(c["iteration"]))] = c
    number: dict[int, int] = {}
    for _, r in summarising.iterrows():
        seq = int(r["seq"])
        number[seq] = number.get(seq, 0) + 1
        text = f"compaction {number[seq]}"
        c = made.get((seq, int(r["iteration"])))
        if compactions is not None and c is None:
            text = "compaction failed"  # the summarisation call answered, but nothing was compacted
        elif c is not None:
            before, after = int(c["tokens_before"]), int(c["tokens_after"])
            text += f": {before:,}→{after:,} tokens"
            window = r["window"]
            if pd.notna(window) and window and after < before:
                # the drop, drawn where it happens: from the context before to the compacted one
                ax.annotate("", xy=(r["call"], after / float(window)), xytext=(r["call"], before / float(window)),
                            arrowprops={"arrowstyle": "-|>", "color": COMPACTION_COLOUR, "linewidth": 1.5,
                                        "shrinkA": 6, "shrinkB": 0},
                            zorder=3, gid="compaction:drop")
        drawn.labels.append(ax.annotate(
            text, (r["call"], r["ratio"]), textcoords="offset points", xytext=(_NEAR, _NEAR), va="bottom",
            fontsize=_LABEL_SIZE, color="black", zorder=6, gid="label:compaction", arrowprops=_leader("dimgrey"),
            bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.9, "linewidth": 0.8,
                  "edgecolor": COMPACTION_COLOUR}))


def _draw_loops(ax: Axes, rows: pd.DataFrame, loops: list[tuple[int, str]], drawn: _Drawn) -> None:
    """A dotted line after each run that closed a loop a monitor caught, labelled with the cycle."""
    for seq, text in loops:
        calls = rows.loc[rows["seq"] == seq, "call"]
        if calls.empty:
            continue
        drawn.loops = True
        x = float(calls.max()) + 0.5
        ax.axvline(x, color=LOOP_COLOUR, linestyle=":", linewidth=1.5, zorder=0, gid=f"loop:{seq}")
        drawn.labels.append(ax.annotate(
            text, (x, 0.02), xycoords=("data", "axes fraction"), textcoords="offset points", xytext=(_NEAR, _NEAR),
            va="bottom", fontsize=_LABEL_SIZE, color=LOOP_COLOUR, zorder=6, gid="label:loop",
            bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.9, "linewidth": 0.8,
                  "edgecolor": LOOP_COLOUR}))


def _what_if_thresholds(ax: Axes, what_if: Mapping[str, float], recorded: Mapping[str, float]) -> list[tuple[Any, str]]:
    """The what-if thresholds as thin long-dashed lines; the legend names those that differ from the record's."""
    legend: list[tuple[Any, str]] = []
    for name in ACTIONS:
        if name not in what_if:
            continue
        line = ax.axhline(what_if[name], color=ACTION_COLOURS[name], linestyle=_WHAT_IF_DASH, linewidth=1.2,
                          alpha=0.8, gid=f"what_if:threshold:{name}")
        if recorded.get(name) != what_if[name]:
            legend.append((line, f"what-if {name} {what_if[name]:.0%}"))
    return legend


def _draw_what_if(ax: Axes, rows: pd.DataFrame, job_id: int, drawn: _Drawn, nth: int | None) -> None:
    """One job's simulated ContextManager: the recomputed ratio, the actions that would fire, the first
    forced transition."""
    x = rows["call"].to_numpy()
    style = "--" if nth is None else ["--", (0, (1, 1)), (0, (5, 1, 1, 1)), (0, (3, 3))][nth % 4]
    ratio = rows["ratio_what_if"].to_numpy(dtype=float, na_value=np.nan)
    (line,) = ax.plot(x, ratio, color=_WHAT_IF, linestyle=style, linewidth=1.3, marker=".", markersize=4,
                      zorder=3, gid=f"what_if:ratio:{job_id}")
    if drawn.what_if_line is None:
        drawn.what_if_line = line
    acted = rows[rows["action_what_if"].notna()]
    for action, group in acted.groupby("action_what_if", observed=True):
        drawn.what_if_actions.add(str(action))
        # hollow, so the recorded action's filled marker shows through where both fire at one call
        ax.scatter(group["call"], group["ratio_what_if"], marker=_ACTION_MARKER.get(str(action), "*"), s=110,
                   facecolors="none", edgecolors=ACTION_COLOURS.get(str(action), "black"), linewidths=1.6,
                   zorder=4, gid=f"what_if:action:{job_id}")
    for _, r in acted.iterrows():
        # italic on a dashed box: told apart from the record's labels; hidden where there is no room
        drawn.labels.append(ax.annotate(
            str(r["actions_what_if"]), (r["call"], r["ratio_what_if"]), textcoords="offset points",
            xytext=(_NEAR, _NEAR), va="bottom", fontsize=_LABEL_SIZE, fontstyle="italic", color="dimgrey", zorder=6,
            gid="label:what_if", arrowprops=_leader("dimgrey"),
            bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.9, "linewidth": 0.8,
                  "linestyle": "--", "edgecolor": ACTION_COLOURS.get(str(r["action_what_if"]), "black")}))
    first = rows[rows["first_forced"].fillna(False).to_numpy(dtype=bool)]
    if not first.empty:
        drawn.what_if_forced = True
        ax.axvline(float(first["call"].iloc[0]), color=_FORCED, linestyle=":", linewidth=1.5, alpha=0.8,
                   zorder=0, gid="what_if:first_forced")


def _name_runs(ax: Axes, runs: list[tuple[int, str, float]], colours: Mapping[str, Any]) -> SecondaryAxis:
    """The runs' names (``1. plan``) along the top of the ratio panel, in their movements' colours."""
    top = ax.secondary_xaxis("top")
    top.set_xticks([c for _, _, c in runs], labels=[f"{seq}. {name}" for seq, name, _ in runs])
    top.tick_params(length=0, labelsize=_LABEL_SIZE, pad=3)
    for label, (_, name, _) in zip(top.get_xticklabels(), runs, strict=False):
        label.set_color(colours.get(name, "grey"))
    return top


def _wrap(text: str, *, lines: int) -> str:
    return "\n".join(textwrap.wrap(" ".join(str(text).split()), width=100, max_lines=lines, placeholder=" …"))


def _font_for(labels: Iterable[str]) -> dict[RcKeyType, Any]:
    """rcParams that draw ``labels``: the default font, with a CJK font behind it when a label needs one."""
    global _cjk_found
    wide = next((t for t in labels if _WIDE.search(t)), None)
    if wide is None:
        return {}
    if _cjk_found is None:
        from matplotlib import font_manager as fm

        names = {f.name for f in fm.fontManager.ttflist}
        if not names.intersection(_CJK_FAMILIES):
            # matplotlib's font list is cached on disk and may predate the font's install: look once
            for path in fm.findSystemFonts():
                if _CJK_FILES.search(Path(path).name):
                    try:
                        fm.fontManager.addfont(path)
                    except (OSError, RuntimeError, ValueError):
                        continue
            names = {f.name for f in fm.fontManager.ttflist}
        _cjk_found = [n for n in _CJK_FAMILIES if n in names]
    if not _cjk_found:
        warnings.warn(
            f"plot_usage: no installed font has the glyphs of {wide!r}, which will show as boxes; "
            "install a CJK font (e.g. apt install fonts-noto-cjk, or fonts-ipaexfont)", stacklevel=3)
        return {}
    import matplotlib

    base = list(matplotlib.rcParams["font.family"])
    return {"font.family": base + [n for n in _cjk_found if n not in base]}


def _resolve(
    obj: Any, ws: UsageSource | None, thresholds: Mapping[str, float] | None
) -> _Target:
    if isinstance(obj, pd.DataFrame):
        missing = {"job", "call", "movement", "seq", "ratio", "cumulative_tokens"} - set(obj.columns)
        if missing:
            raise ValueError(
                f"plot_usage needs a ws.frames.usage() DataFrame; this one lacks {sorted(missing)}"
            )
        th = dict(thresholds or obj.attrs.get("thresholds") or DEFAULT_THRESHOLDS)
        obj = _own_calls(obj)
        jobs = obj["job"].unique().tolist()
        heading = f"Job {jobs[0]}: context usage" if len(jobs) == 1 else f"Context usage of {len(jobs)} jobs"
        return _Target(obj, th, heading)
    if isinstance(obj, _AttachedJob):
        if obj.workspace is None:
            raise ValueError("plot_usage: this Job is not attached to a workspace; pass ws=")
        ws = ws or obj.workspace
        job_id = obj.id
    elif isinstance(obj, (int, str)) and not isinstance(obj, bool):
        if ws is None:
            raise ValueError(f"plot_usage({obj!r}) needs ws= (a Workspace) to find the job")
        job_id = ws.job(obj).id
    else:
        raise TypeError(
            f"plot_usage takes a Job, a job id (with ws=) or a ws.frames.usage() DataFrame, not {type(obj).__name__}"
        )
    frames = ws.frames
    df = _own_calls(frames.usage(job_id))
    th = dict(thresholds or frames.thresholds(job_id))
    job = ws.job(job_id)
    heading = f"Job {job.id} · {job.piece} · {short_spec(job.model)} · {job.status}"
    compactions = frames.compactions(job_id) if (df["action"] == COMPACTION).any() else None
    loops = [(run.seq, f"⟳ loop {' → '.join(ev.cycle)} ×{ev.count}") for run in fold(ws.events(job_id)).runs.values()
             for ev in run.loops]
    return _Target(df, th, heading, status=str(job.status), error=job.error, ws=ws, compactions=compactions,
                   loops=loops)


def _own_calls(df: pd.DataFrame) -> pd.DataFrame:
    """The job's own calls: an LLM judge's (docs/design-lab.md#llm-judge) had no context to plot."""
    return df[df["purpose"].ne("judge").fillna(True).astype(bool)] if "purpose" in df else df


def _with_what_if(target: _Target, obj: Any, ws: UsageSource | None,
                  what_if: Mapping[str, Any] | pd.DataFrame | None) -> _Target:
    """``target`` with the what-if columns and settings: from ``what_if`` (settings or a what-if frame), or
    from the plotted frame itself when it is a what-if frame."""
    if what_if is None:
        if isinstance(obj, pd.DataFrame) and set(WHAT_IF_COLUMNS) <= set(obj.columns):
            return _what_if_frame(target, obj)
        return target
    if isinstance(what_if, pd.DataFrame):
        missing = [c for c in WHAT_IF_COLUMNS if c not in what_if.columns]
        if missing:
            raise UsageError(f"plot_usage: what_if= needs settings (window=, thresholds=) or a ws.frames.what_if() "
                             f"DataFrame; this one lacks {missing}")
        if not target.frame[["job", "call"]].reset_index(drop=True).equals(
                what_if[["job", "call"]].reset_index(drop=True)):
            raise UsageError("plot_usage: the what_if frame is not of the calls plotted; "
                             "allowed: ws.frames.what_if() of the same job")
        return _what_if_frame(target, what_if)
    if not isinstance(what_if, Mapping):
        raise UsageError(f"plot_usage: what_if={what_if!r}; allowed: a dict with window= and/or thresholds=, "
                         "or a ws.frames.what_if() DataFrame")
    unknown = sorted(set(what_if) - {"window", "thresholds"})
    if unknown:
        raise UsageError(f"plot_usage: what_if has unknown key(s) {unknown}; allowed: window, thresholds")
    window, thresholds = what_if.get("window"), what_if.get("thresholds")
    if target.ws is not None:  # a job: its frames know which calls a fork re-served
        # over the thresholds drawn as the job's (plot_usage's thresholds=, when given), as for a frame
        merged = {**target.thresholds, **(thresholds or {})} if isinstance(thresholds, Mapping | None) else thresholds
        what = target.ws.frames.what_if(target.frame.attrs["job"], window=window, thresholds=merged)
        return _what_if_frame(target, what)
    frame = target.frame.copy()
    frame.attrs = {**target.frame.attrs, "thresholds": target.thresholds}
    return _what_if_frame(target, simulate(frame, window=window, thresholds=thresholds))


def _what_if_frame(target: _Target, frame: pd.DataFrame) -> _Target:
    settings = frame.attrs.get("what_if") or {"window": None, "thresholds": dict(target.thresholds)}
    return _Target(frame, target.thresholds, target.heading, status=target.status, error=target.error, ws=target.ws,
                   compactions=target.compactions, loops=target.loops, what_if={"window": settings.get("window"), "thresholds": dict(settings["thresholds"])})


def _movement_colours(names: pd.Series) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    order = list(dict.fromkeys(names.fillna("?").tolist()))
    return {n: cmap(i % 10) for i, n in enumerate(order)}


def _percent() -> Any:
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(1.0)


def _thousands() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _pos: f"{v:,.0f}")
