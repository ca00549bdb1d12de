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

import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import pandas as pd

from .pieces import DEFAULT_THRESHOLDS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .workspace import Workspace

__all__ = ["plot_usage"]

_THRESHOLD_STYLE = {"warn": "#d9a400", "prompt": "#e67e22", "force_transition": "#c0392b", "exhausted": "#6c0b0b"}
_ACTION_MARKER = {"warn": "^", "prompt": "s", "force_transition": "X", "exhausted": "P"}
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
    import matplotlib

    labels = [title or heading, *df["movement"].dropna().astype(str), *df["transition"].dropna().astype(str)]
    # Text artists keep the font family in force when they are made, so the figure keeps it when drawn later.
    with matplotlib.rc_context(_font_for(labels)):
        return _draw(df, th, title or heading, figsize)


def _draw(df: pd.DataFrame, th: Mapping[str, float], heading: str, figsize: tuple[float, float]) -> "Figure":
    import matplotlib.pyplot as plt

    fig, (ax, ax_cum) = plt.subplots(
        2, 1, figsize=figsize, sharex=True, gridspec_kw={"height_ratios": [2, 1]}, layout="constrained"
    )
    # Closing detaches the figure from pyplot, so a notebook shows it once (as the returned value).
    plt.close(fig)
    fig.suptitle(heading)
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
    # a little room below 0 %: calls with a tiny ratio would otherwise have their markers cut in half
    ax.set_ylim(-0.04 * top, top)
    ax_cum.yaxis.set_major_formatter(_thousands())
    ax.xaxis.set_major_locator(_integers())
    # outside the axes: inside, the legend would hide the top thresholds and the late calls
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0)
    ax_cum.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0)
    return fig


def _font_for(labels: Iterable[str]) -> dict[str, Any]:
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
                        # under the marker, unless that would put it under the axis (a call near 0 %)
                        textcoords="offset points", xytext=(4, -12 if r["ratio"] >= 0.06 else 6), fontsize="x-small",
                        color="#c0392b" if f else "dimgrey")

    if several:
        # per job only the total, in the job's own colour: three lines per job would be unreadable
        # 10 colours × 4 line styles: a job's colour and style pair repeats only after 20 jobs
        ax_cum.plot(x, rows["cumulative_tokens"].to_numpy(), color=matplotlib.colormaps["tab10"](nth % 10),
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
