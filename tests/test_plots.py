"""``agentnb.plot_usage``: a Figure with the ratio panel (thresholds, actions, transitions) and cumulative tokens."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display in tests; must precede any pyplot import

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import agentnb  # noqa: E402
from _usage_jobs import PROMPTS, demo_job, usage_job  # noqa: E402
from agentnb import Workspace  # noqa: E402


def _gids(artists: list) -> list[str]:
    return [a.get_gid() for a in artists if a.get_gid()]


def test_plot_of_a_job_has_both_panels_and_every_marker(ws: Workspace, tmp_path: Path) -> None:
    job = usage_job(ws, tmp_path / "scripts", instruction="plot me")
    fig = agentnb.plot_usage(job)
    assert isinstance(fig, Figure)
    ratio_ax, cum_ax = fig.axes
    # threshold lines at the piece's thresholds
    lines = {line.get_gid(): line for line in ratio_ax.lines if line.get_gid()}
    for name, value in {"warn": 0.70, "prompt": 0.85, "force_transition": 0.95, "exhausted": 0.99}.items():
        assert lines[f"threshold:{name}"].get_ydata()[0] == pytest.approx(value)
    # one line per movement run, holding that run's ratios
    assert np.allclose(lines["movement:1"].get_ydata(), [p / 10000 for p in PROMPTS[:3]])
    assert np.allclose(lines["movement:2"].get_ydata(), [p / 10000 for p in PROMPTS[3:]])
    # markers: actions at calls 4 (warn+prompt) and 5 (force_transition); transitions at calls 3 and 5
    actions = [c for c in ratio_ax.collections if c.get_gid() == f"action:{job.id}"]
    assert sorted(x for c in actions for x in c.get_offsets()[:, 0]) == [4, 5]
    (transitions,) = [c for c in ratio_ax.collections if c.get_gid() == f"transition:{job.id}"]
    assert transitions.get_offsets()[:, 0].tolist() == [3, 5]
    texts = [t.get_text() for t in ratio_ax.texts]
    assert "warn,prompt" in texts and "→ COMPLETE (forced)" in texts
    # cumulative tokens end at the job's total
    (cum,) = [line for line in cum_ax.lines if line.get_gid() == f"cumulative:{job.id}"]
    assert cum.get_ydata()[-1] == ws.frames.jobs().set_index("job").loc[job.id, "total_tokens"]
    assert [t.get_text() for t in ratio_ax.get_legend().get_texts()][-2:] == ["gather", "write"]

    out = tmp_path / "usage.png"
    fig.savefig(out, dpi=80)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plot_takes_a_frame_of_several_jobs_and_custom_thresholds(ws: Workspace, tmp_path: Path) -> None:
    a = usage_job(ws, tmp_path / "scripts")
    b = demo_job(ws)
    fig = agentnb.plot_usage(ws.frames.usage(), thresholds={"warn": 0.5})
    ratio_ax, cum_ax = fig.axes
    assert _gids(ratio_ax.lines).count("threshold:warn") == 1
    assert "threshold:prompt" not in _gids(ratio_ax.lines)  # only the thresholds asked for
    assert {f"cumulative:{a.id}", f"cumulative:{b.id}"} <= set(_gids(cum_ax.lines))
    assert "2 jobs" in fig._suptitle.get_text()
    # a job id with ws= works too, and uses the job's thresholds
    fig2 = agentnb.plot_usage(b.id, ws=ws)
    assert "demo" in fig2._suptitle.get_text()
    fig2.savefig(tmp_path / "demo.png", dpi=60)
    assert (tmp_path / "demo.png").stat().st_size > 10_000


def test_plot_thresholds_follow_the_submitted_context(ws: Workspace) -> None:
    job = ws.submit("x", piece="single", model="demo", context={"thresholds": {"warn": 0.4}})
    fig = agentnb.plot_usage(job)  # no calls yet: an empty timeline, not an error
    lines = {line.get_gid(): line for line in fig.axes[0].lines if line.get_gid()}
    assert lines["threshold:warn"].get_ydata()[0] == pytest.approx(0.4)
    assert any("no LLM calls" in t.get_text() for t in fig.axes[0].texts)


def test_plot_refuses_what_it_cannot_draw(ws: Workspace) -> None:
    with pytest.raises(ValueError, match="needs ws="):
        agentnb.plot_usage(1)
    with pytest.raises(ValueError, match=r"lacks \['call'"):
        agentnb.plot_usage(ws.frames.jobs())
    with pytest.raises(TypeError, match="takes a Job, a job id"):
        agentnb.plot_usage([1, 2])
