"""The usage timeline: ``agentnb.plot_usage(job_or_frame)`` → a matplotlib Figure.

Top panel: the context ratio (prompt tokens / window) of each LLM call, one line
per movement run coloured by the movement's name, the ContextManager threshold
lines, a marker at each call where an action fired (labelled with the action)
and a diamond at each call that ended a movement with a transition (red when
forced).  Bottom panel: cumulative total, prompt and completion tokens.

The x axis is the LLM call number within the job.  A frame holding several jobs
(``ws.frames.usage()``) draws one line per job in both panels, for comparisons.

Artists carry a ``gid`` (``threshold:<action>``, ``movement:<seq>``,
``action:<job>``, ``transition:<job>``, ``cumulative:<job>``) so tests and users can find them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import pandas as pd

from .pieces import DEFAULT_THRESHOLDS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .workspace import Workspace

__all__ = ["plot_usage"]

_THRESHOLD_STYLE = {"warn": "#d9a400", "prompt": "#e67e22", "force_transition": "#c0392b", "exhausted": "#6c0b0b"}
_ACTION_MARKER = {"warn": "^", "prompt": "s", "force_transition": "X", "exhausted": "P"}


def plot_usage(
    job_or_frame: Any,
    *,
    ws: "Workspace | None" = None,
    thresholds: Mapping[str, float] | None = None,
    title: str | None = None,
    figsize: tuple[float, float] = (10.0, 6.5),
) -> "Figure":
    """Draw the usage timeline of a :class:`~agentnb.Job` (or a job id with ``ws=``) or a usage DataFrame.

    Thresholds come from ``thresholds=``, else the job's piece (and ``context=`` given
    at submit), else the frame's ``attrs["thresholds"]``, else the defaults.
    """
    df, th, heading = _resolve(job_or_frame, ws, thresholds)
    import matplotlib.pyplot as plt

    fig, (ax, ax_cum) = plt.subplots(
        2, 1, figsize=figsize, sharex=True, gridspec_kw={"height_ratios": [2, 1]}, layout="constrained"
    )
    # Closing detaches the figure from pyplot, so a notebook shows it once (as the returned value).
    plt.close(fig)
    fig.suptitle(title or heading)
    ax.set_ylabel("context ratio (prompt / window)")
    ax_cum.set_ylabel("cumulative tokens")
    ax_cum.set_xlabel("LLM call")
    ax.grid(alpha=0.3)
    ax_cum.grid(alpha=0.3)

    for name in ("warn", "prompt", "force_transition", "exhausted"):
        if name in th:
            ax.axhline(th[name], color=_THRESHOLD_STYLE.get(name, "grey"), linestyle="--", linewidth=1,
                       gid=f"threshold:{name}", label=f"{name} {th[name]:.0%}")
    ax.yaxis.set_major_formatter(_percent())
    if df.empty:
        ax.text(0.5, 0.5, "no LLM calls yet", transform=ax.transAxes, ha="center", va="center", color="grey")
        ax.set_ylim(0, 1.05)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0)
        return fig

    colours = _movement_colours(df["movement"])
    jobs = list(dict.fromkeys(df["job"].tolist()))
    several = len(jobs) > 1
    seen_movements: set[str] = set()
    for n, job_id in enumerate(jobs):
        rows = df[df["job"] == job_id]
        _draw_job(ax, ax_cum, rows, job_id, colours, seen_movements, n if several else None)

    top = max(1.0, float(df["ratio"].max()) * 1.08)
    ax.set_ylim(0, top)
    ax_cum.yaxis.set_major_formatter(_thousands())
    ax.xaxis.set_major_locator(_integers())
    # outside the axes: inside, the legend would hide the top thresholds and the late calls
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0)
    ax_cum.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0)
    return fig


def _resolve(
    obj: Any, ws: "Workspace | None", thresholds: Mapping[str, float] | None
) -> tuple[pd.DataFrame, dict[str, float], str]:
    from .workspace import Job

    if isinstance(obj, pd.DataFrame):
        missing = {"job", "call", "movement", "seq", "ratio", "cumulative_tokens"} - set(obj.columns)
        if missing:
            raise ValueError(
                f"plot_usage needs a ws.frames.usage() DataFrame; this one lacks {sorted(missing)}"
            )
        th = dict(thresholds or obj.attrs.get("thresholds") or DEFAULT_THRESHOLDS)
        jobs = obj["job"].unique().tolist()
        heading = f"Job {jobs[0]}: context usage" if len(jobs) == 1 else f"Context usage of {len(jobs)} jobs"
        return obj, th, heading
    if isinstance(obj, Job):
        if obj.workspace is None:
            raise ValueError("plot_usage: this Job is not attached to a workspace; pass ws=")
        ws = ws or obj.workspace
        job_id = obj.id
    elif isinstance(obj, (int, str)) and not isinstance(obj, bool):
        if ws is None:
            raise ValueError(f"plot_usage({obj!r}) needs ws= (a Workspace) to find the job")
        job_id = ws._id(obj)
    else:
        raise TypeError(
            f"plot_usage takes a Job, a job id (with ws=) or a ws.frames.usage() DataFrame, not {type(obj).__name__}"
        )
    frames = ws.frames
    df = frames.usage(job_id)
    th = dict(thresholds or frames.thresholds(job_id))
    job = ws.job(job_id)
    model = job.model
    if model.startswith("scripted:"):  # the script's full path would crowd the title
        model = "scripted:" + Path(model.split(":", 1)[1]).name
    heading = f"Job {job.id} · {job.piece} · {model} · {job.status}"
    return df, th, heading


def _movement_colours(names: pd.Series) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    order = list(dict.fromkeys(names.fillna("?").tolist()))
    return {n: cmap(i % 10) for i, n in enumerate(order)}


def _draw_job(
    ax: Any, ax_cum: Any, rows: pd.DataFrame, job_id: int, colours: Mapping[str, Any],
    seen: set[str], nth: int | None,
) -> None:
    """One job's series; ``nth`` is its position when the frame holds several jobs (else ``None``)."""
    import matplotlib

    several = nth is not None
    x = rows["call"].to_numpy()
    style = "-" if nth is None else ["-", "--", ":", "-."][nth % 4]
    # a thin line across movement runs keeps the sequence readable; runs are drawn on top
    ax.plot(x, rows["ratio"].to_numpy(), color="lightgrey", linewidth=1, zorder=1, linestyle=style)
    for seq, run in rows.groupby("seq", sort=True):
        name = str(run["movement"].iloc[0]) if pd.notna(run["movement"].iloc[0]) else "?"
        label = name if name not in seen else None
        seen.add(name)
        ax.plot(run["call"].to_numpy(), run["ratio"].to_numpy(), marker="o", markersize=4, linestyle=style,
                color=colours.get(name, "grey"), label=label, gid=f"movement:{seq}", zorder=2)

    acted = rows[rows["action"].notna()]
    for action, group in acted.groupby("action", observed=True):
        ax.scatter(group["call"], group["ratio"], marker=_ACTION_MARKER.get(str(action), "*"), s=90,
                   color=_THRESHOLD_STYLE.get(str(action), "black"), edgecolors="black", zorder=4,
                   gid=f"action:{job_id}", label=None)
    for _, r in acted.iterrows():
        ax.annotate(str(r["actions"]), (r["call"], r["ratio"]), textcoords="offset points", xytext=(4, 8),
                    fontsize="x-small", color=_THRESHOLD_STYLE.get(str(r["action"]), "black"))

    ended = rows[rows["transition"].notna()]
    if not ended.empty:
        forced = ended["forced"].fillna(False).to_numpy(dtype=bool)
        # hollow, and larger than the action markers, so an action fired at the same call shows through
        ax.scatter(ended["call"], ended["ratio"], marker="D", s=140, facecolors="none",
                   edgecolors=["#c0392b" if f else "black" for f in forced], linewidths=1.5, zorder=5,
                   gid=f"transition:{job_id}")
        for (_, r), f in zip(ended.iterrows(), forced):
            if several:  # one job's movement boundaries would mislead for the others
                continue
            ax.axvline(r["call"] + 0.5, color="#c0392b" if f else "grey", alpha=0.35, linewidth=1)
            ax.annotate(f"→ {r['transition']}" + (" (forced)" if f else ""), (r["call"], r["ratio"]),
                        textcoords="offset points", xytext=(4, -12), fontsize="x-small",
                        color="#c0392b" if f else "dimgrey")

    if several:
        # per job only the total, in the job's own colour: three lines per job would be unreadable
        ax_cum.plot(x, rows["cumulative_tokens"].to_numpy(), color=matplotlib.colormaps["Dark2"](nth % 8),
                    linestyle=style, linewidth=1.5, label=f"job {job_id} total", gid=f"cumulative:{job_id}")
        ax.annotate(f"job {job_id}", (x[-1], rows["ratio"].iloc[-1]), textcoords="offset points", xytext=(6, 0),
                    fontsize="x-small")
        return
    ax_cum.plot(x, rows["cumulative_tokens"].to_numpy(), color="black", linewidth=1.5, label="total",
                gid=f"cumulative:{job_id}")
    ax_cum.plot(x, rows["prompt_tokens"].cumsum().to_numpy(), color="#2e86c1", linewidth=1, label="prompt")
    ax_cum.plot(x, rows["completion_tokens"].cumsum().to_numpy(), color="#28b463", linewidth=1, label="completion")


def _percent() -> Any:
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(1.0)


def _integers() -> Any:
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _thousands() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _pos: f"{v:,.0f}")
