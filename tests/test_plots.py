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


def _japanese_job(ws: Workspace, folder: Path) -> agentnb.Job:
    """Two movements with Japanese names (a ``language: ja`` piece), on a scripted model with usage."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    piece = folder / "ja.yaml"
    piece.write_text(yaml.safe_dump({"name": "ja-review", "language": "ja", "movements": [
        {"name": "下書き", "persona": "書き手", "instruction": "書く", "tools": ["Glob"], "permission": "readonly",
         "rules": [{"condition": "書けた", "next": "査読"}]},
        {"name": "査読", "persona": "査読者", "instruction": "読む", "tools": [], "permission": "readonly",
         "rules": [{"condition": "良い", "next": "COMPLETE"}]},
    ]}, allow_unicode=True), encoding="utf-8")
    script = folder / "ja-script.yaml"
    script.write_text(yaml.safe_dump({"responses": [
        {"tool_calls": [{"name": "Glob", "arguments": {"pattern": "*"}}], "usage": {"prompt_tokens": 900, "completion_tokens": 9}},
        {"tool_calls": [{"name": "transition", "arguments": {"next_step": "査読", "summary": "書けた"}}],
         "usage": {"prompt_tokens": 1200, "completion_tokens": 9}},
        {"tool_calls": [{"name": "transition", "arguments": {"next_step": "COMPLETE", "summary": "合格"}}],
         "usage": {"prompt_tokens": 1500, "completion_tokens": 9}},
    ]}, allow_unicode=True), encoding="utf-8")
    job = ws.run(ws.submit("報告を書く", piece=piece, model=f"scripted:{script}"))
    assert job.status == "succeeded", job.error
    return job


def test_japanese_movement_names_are_drawn_with_a_font_that_has_their_glyphs(ws: Workspace, tmp_path: Path) -> None:
    """matplotlib's default font has no kana or kanji; a CJK font installed on the machine is put behind it."""
    import warnings

    from agentnb import plots

    job = _japanese_job(ws, tmp_path / "scripts")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = agentnb.plot_usage(job)
        fig.savefig(tmp_path / "ja.png", dpi=60)
    legend = {t.get_text(): t for t in fig.axes[0].get_legend().get_texts()}
    assert {"下書き", "査読"} <= set(legend)
    missing = [str(w.message) for w in caught if "missing from font" in str(w.message)]
    if plots._cjk_found:  # the machine has one (IPAex, Noto CJK, Hiragino, Yu Gothic, …): no box is drawn
        assert plots._cjk_found[0] in legend["下書き"].get_fontfamily()
        assert not missing, missing[:2]
    else:  # none installed: the user is told what to install, once, instead of only seeing boxes
        assert [str(w.message) for w in caught if "install a CJK font" in str(w.message)]


def test_with_no_cjk_font_the_plot_says_what_to_install(ws: Workspace, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from agentnb import plots

    job = _japanese_job(ws, tmp_path / "scripts")
    monkeypatch.setattr(plots, "_cjk_found", [])  # as on a machine without any CJK font
    with pytest.warns(UserWarning, match=r"no installed font has the glyphs of '.*下書き.*'.*install a CJK font"):
        agentnb.plot_usage(job)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ASCII labels only: nothing to say
        agentnb.plot_usage(ws.frames.usage(job).assign(movement="plan", transition=None), title="Job")


def test_calls_near_zero_keep_whole_markers_and_readable_labels(ws: Workspace, tmp_path: Path) -> None:
    """A 128k window with small prompts: ratios near 0 % must not be cut by the axis."""
    job = ws.run(ws.submit("Summarise input/notes.md", piece="plan-implement-verify", model="demo",
                           inputs={"notes.md": "alpha\nbeta\n"}, context={"window_tokens": 1_000_000}))
    fig = agentnb.plot_usage(job)
    ax = fig.axes[0]
    assert ax.get_ylim()[0] < 0 < ax.get_ylim()[1]
    labels = [t for t in ax.texts if t.get_text().startswith("→ ")]
    assert labels and all(t.xyann[1] > 0 for t in labels)  # above the marker: below it would leave the axes


def test_many_jobs_get_distinct_cumulative_lines(ws: Workspace, tmp_path: Path) -> None:
    import pandas as pd
    from matplotlib.colors import to_hex

    one = ws.frames.usage(usage_job(ws, tmp_path / "scripts"))
    frame = pd.concat([one.assign(job=100 + n) for n in range(12)], ignore_index=True)
    _, cum_ax = agentnb.plot_usage(frame).axes
    lines = [line for line in cum_ax.lines if (line.get_gid() or "").startswith("cumulative:")]
    assert len(lines) == 12
    assert len({(to_hex(line.get_color()), line.get_linestyle()) for line in lines}) == 12
