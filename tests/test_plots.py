"""``agentnb.plot_usage``: a Figure with the ratio panel (thresholds, actions, transitions) and cumulative tokens."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display in tests; must precede any pyplot import

import numpy as np
import pytest
from _scripting import write_piece, write_script
from _usage_jobs import PROMPTS, demo_job, usage_job
from matplotlib.figure import Figure

import agentnb
from agentnb import Workspace


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
    fig = agentnb.plot_usage(job)  # no calls yet: a few lines saying so, not an error
    texts = [t.get_text() for t in fig.texts]
    assert "Queued: no LLM call yet. Run or step it, then plot it again." in texts
    assert any(t.startswith("Context thresholds: warn 40%, prompt 85%") for t in texts)
    fig = agentnb.plot_usage(ws.run(job))
    lines = {line.get_gid(): line for line in fig.axes[0].lines if line.get_gid()}
    assert lines["threshold:warn"].get_ydata()[0] == pytest.approx(0.4)


def test_plot_refuses_what_it_cannot_draw(ws: Workspace) -> None:
    with pytest.raises(ValueError, match="needs ws="):
        agentnb.plot_usage(1)
    with pytest.raises(ValueError, match=r"lacks \['call'"):
        agentnb.plot_usage(ws.frames.jobs())
    with pytest.raises(TypeError, match="takes a Job, a job id"):
        agentnb.plot_usage([1, 2])


def _japanese_job(ws: Workspace, folder: Path) -> agentnb.Job:
    """Two movements with Japanese names (a ``language: ja`` piece), on a scripted model with usage."""
    piece = write_piece(folder, "ja", {"name": "ja-review", "language": "ja", "movements": [
        {"name": "下書き", "persona": "書き手", "instruction": "書く", "tools": ["Glob"], "permission": "readonly",
         "rules": [{"condition": "書けた", "next": "査読"}]},
        {"name": "査読", "persona": "査読者", "instruction": "読む", "tools": [], "permission": "readonly",
         "rules": [{"condition": "良い", "next": "COMPLETE"}]},
    ]})
    script = write_script(folder, "ja-script", responses=[
        {"tool_calls": [{"name": "Glob", "arguments": {"pattern": "*"}}], "usage": {"prompt_tokens": 900, "completion_tokens": 9}},
        {"tool_calls": [{"name": "transition", "arguments": {"next_step": "査読", "summary": "書けた"}}],
         "usage": {"prompt_tokens": 1200, "completion_tokens": 9}},
        {"tool_calls": [{"name": "transition", "arguments": {"next_step": "COMPLETE", "summary": "合格"}}],
         "usage": {"prompt_tokens": 1500, "completion_tokens": 9}},
    ])
    job = ws.run(ws.submit("報告を書く", piece=piece, model=script))
    assert job.status == "succeeded", job.error
    return job


def test_japanese_movement_names_are_drawn_with_a_font_that_has_their_glyphs(ws: Workspace, tmp_path: Path) -> None:
    """matplotlib's default font has no kana or kanji; a CJK font installed on the machine is put behind it."""
    import warnings

    from agentnb.views import plots

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
    from agentnb.views import plots

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


# -- legibility -----------------------------------------------------------------


def _failing_job(ws: Workspace, folder: Path, responses: list[dict]) -> agentnb.Job:
    """The ``single`` piece on a script that runs out after ``responses``: the job fails, saying why."""
    job = ws.run(ws.submit("fail", piece="single", model=write_script(folder, "short", responses=responses)))
    assert job.status == "failed" and "ran out of responses" in (job.error or "")
    return job


def _text_box(t):  # type: ignore[no-untyped-def]
    """The extent of a text alone (an annotation's own extent includes its leader line)."""
    from matplotlib.text import Text

    return Text.get_window_extent(t)


def _drawn_texts(fig):  # type: ignore[no-untyped-def]
    """The figure's visible texts, without the labels of ticks outside the axes' limits (those are not drawn)."""
    from matplotlib.text import Text

    hidden: set[int] = set()
    for ax in fig.axes + [c for a in fig.axes for c in a.child_axes]:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo - 1e-9 <= tick.get_loc() <= hi + 1e-9:
                    hidden |= {id(tick.label1), id(tick.label2)}
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text() and id(t) not in hidden]


@pytest.mark.parametrize("which", ["usage", "demo", "several", "crowded"])
def test_call_labels_are_readable_inside_the_axes_and_apart(ws: Workspace, tmp_path: Path, which: str) -> None:
    """Labels sit on white boxes (threshold lines run through them), inside the axes (→ COMPLETE was cut at
    the right edge), clear of each other, and no text of the figure is cut by its edge.  A crowded plot
    leaves some labels out rather than writing them over each other."""
    import pandas as pd
    from matplotlib.colors import to_rgba

    if which == "usage":
        fig = agentnb.plot_usage(usage_job(ws, tmp_path / "scripts"))
    elif which == "demo":
        fig = agentnb.plot_usage(demo_job(ws))
    elif which == "several":
        usage_job(ws, tmp_path / "scripts")
        demo_job(ws)
        fig = agentnb.plot_usage(ws.frames.usage())
    else:  # one job of 60 movement runs, 150 calls
        one = ws.frames.usage(usage_job(ws, tmp_path / "scripts"))
        fig = agentnb.plot_usage(pd.concat([one.assign(call=one["call"] + 5 * n, seq=one["seq"] + 2 * n)
                                            for n in range(30)], ignore_index=True))
    fig.savefig(tmp_path / f"{which}.png", dpi=100)  # lays the figure out, as a notebook would
    ax = fig.axes[0]
    inside = ax.get_window_extent()
    labels = [t for t in ax.texts if t.get_text() and t.get_visible()]
    assert len(labels) >= 3
    if which != "crowded":
        assert len(labels) == len(ax.texts)  # room for every label
    else:
        names = [t for t in ax.child_axes[0].get_xticklabels() if t.get_visible()]
        assert 3 <= len(names) < 60 and all(t.get_rotation() == 30 for t in names)
        # tilted and parallel, two names clear each other when their starts are two line heights apart
        line = names[0].get_fontsize() * fig.dpi / 72
        starts = [t.get_window_extent().x0 for t in names]
        assert min(b - a for a, b in itertools.pairwise(starts)) >= 2 * line
    threshold_colours = {to_rgba(line.get_color()) for line in ax.lines if (line.get_gid() or "").startswith("threshold:")}
    for t in labels:
        box = _text_box(t)
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, t.get_text()
        if t.get_gid() == "label:action":  # dark text, not the colour of the threshold line running there
            assert to_rgba(t.get_color()) not in threshold_colours
        if t.get_gid() in ("label:action", "label:transition"):
            patch = t.get_bbox_patch()
            assert patch is not None and to_rgba(patch.get_facecolor())[:3] == (1.0, 1.0, 1.0)
            assert patch.get_facecolor()[3] >= 0.8
    boxes = [(t.get_text(), _text_box(t)) for t in labels]
    for i, (a, ba) in enumerate(boxes):
        for b, bb in boxes[i + 1:]:
            assert not ba.overlaps(bb), f"{a!r} overlaps {b!r}"
    whole = fig.bbox
    for t in _drawn_texts(fig):
        box = _text_box(t)
        assert whole.x0 - 1 <= box.x0 and box.x1 <= whole.x1 + 1 and whole.y0 - 1 <= box.y0 and box.y1 <= whole.y1 + 1, t.get_text()
    if which == "demo":
        assert "→ COMPLETE" in [t.get_text() for t in labels]


def test_legend_explains_markers_and_boundaries_and_the_runs_are_named(ws: Workspace, tmp_path: Path) -> None:
    from matplotlib.colors import to_hex

    job = usage_job(ws, tmp_path / "scripts")
    fig = agentnb.plot_usage(job)
    ax = fig.axes[0]
    legend = ax.get_legend()
    entries = dict(zip([t.get_text() for t in legend.get_texts()], legend.legend_handles, strict=False))
    assert list(entries)[:4] == ["warn 70%", "prompt 85%", "force_transition 95%", "exhausted 99%"]
    # the marker shapes: transitions (hollow diamonds, red when forced) and the highest action fired at a call
    assert entries["transition (→ next step)"].get_marker() == "D"
    assert entries["forced transition"].get_marker() == "D"
    assert to_hex(entries["forced transition"].get_markeredgecolor()) == "#c0392b"
    assert entries["prompt fired"].get_marker() == "s" and entries["force_transition fired"].get_marker() == "X"
    assert "warn fired" not in entries  # warn fired only at a call where prompt fired too: no ▲ is drawn
    assert "movement boundary" in entries and "forced boundary" not in entries
    assert list(entries)[-2:] == ["gather", "write"]
    # one boundary, between the two runs; none after the job's last call
    boundaries = [line for line in ax.lines if (line.get_gid() or "").startswith("boundary:")]
    assert [line.get_xdata()[0] for line in boundaries] == [3.5]
    # the runs' names along the top, over their calls
    (top,) = ax.child_axes
    assert [t.get_text() for t in top.get_xticklabels()] == ["1. gather", "2. write"]
    assert list(top.get_xticks()) == [2.0, 4.5]


def test_a_failed_job_without_calls_says_what_happened_instead_of_empty_axes(ws: Workspace, tmp_path: Path) -> None:
    job = _failing_job(ws, tmp_path / "scripts", [])
    fig = agentnb.plot_usage(job)
    assert fig.axes == []  # no 0–1 ticks around nothing
    texts = [t.get_text() for t in fig.texts]
    assert "Failed before its first LLM call." in texts
    assert any("scripted model ran out of responses" in t for t in texts)
    assert "failed" in fig._suptitle.get_text()
    fig.savefig(tmp_path / "failed.png", dpi=100)
    for t in fig.texts:
        box = t.get_window_extent()
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1


def test_a_failed_job_with_calls_shows_its_error_and_whole_call_numbers(ws: Workspace, tmp_path: Path) -> None:
    job = _failing_job(ws, tmp_path / "scripts", [
        {"tool_calls": [{"name": "Glob", "arguments": {"pattern": "*"}}], "usage": {"prompt_tokens": 3000, "completion_tokens": 9}}])
    fig = agentnb.plot_usage(job)
    ax, cum = fig.axes[:2]
    status = ax.get_title(loc="left")
    assert status.startswith("failed after LLM call 1: scripted model ran out of responses")
    fig.savefig(tmp_path / "failed-later.png", dpi=100)
    assert [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]] == [1.0]  # not 0.96, 0.98, …
    (total,) = [line for line in cum.lines if line.get_gid() == f"cumulative:{job.id}"]
    assert total.get_marker() == "o"  # a line of one point would draw nothing


# -- in a real kernel -------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


def _run_in_kernel(cells: list[str], cwd: Path) -> list[list[dict]]:
    """Run ``cells`` in a fresh IPython kernel (as JupyterLab starts one); return each cell's outputs."""
    import os

    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # the kernel picks its inline backend
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    client = NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(cwd)}})
    client.execute(env=env)
    return [c.outputs for c in nb.cells]


def _images(outputs: list[dict]) -> list[dict]:
    return [o for o in outputs if "image/png" in o.get("data", {})]


def _printed(outputs: list[dict]) -> str:
    return "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")


def test_in_a_kernel_plot_usage_leaves_matplotlib_as_it_found_it(tmp_path: Path) -> None:
    """The first plot of a fresh kernel used to load the inline backend inside plot_usage's rc_context, which
    then reset interactive mode: the notebook's later plots (notebook 03's last bar chart) showed nothing."""
    state = ("import json\nprint(json.dumps([matplotlib.is_interactive(), matplotlib.get_backend(), "
             "sorted(k for k in matplotlib.rcParams if matplotlib.rcParams[k] != rc[k])]))")
    outputs = _run_in_kernel([
        f"import matplotlib, pandas as pd, agentnb\nws = agentnb.Workspace({str(tmp_path / 'ws')!r})\n"
        "job = ws.run(ws.submit('Summarise', piece='plan-implement-verify', model='demo'))\n"
        "rc = dict(matplotlib.rcParams)\n" + state,
        "agentnb.plot_usage(job)",
        state,
        "pd.Series([3, 1, 2]).plot()",
        # now with pyplot in use: a current figure of the user's and an rcParam of their own
        "import matplotlib.pyplot as plt\nplt.rcParams['lines.linewidth'] = 3\nmine = plt.figure()\n"
        "rc = dict(matplotlib.rcParams)\nfigs = plt.get_fignums()\n"
        "shown = agentnb.plot_usage(job)\n"
        "print(plt.gcf() is mine, plt.get_fignums() == figs, shown not in [plt.figure(n) for n in figs])\n"
        + state + "\nplt.close(mine)",
        "shown",
        "pd.Series([1, 2]).plot.bar()",
    ], tmp_path)
    before = json.loads(_printed(outputs[0]))
    assert before[2] == []
    assert _images(outputs[1]), "plot_usage shows its figure"
    assert json.loads(_printed(outputs[2])) == before  # interactive mode, backend, rcParams: as they were
    assert _images(outputs[3]), "a pandas plot made after plot_usage shows nothing"
    flags, state_after = _printed(outputs[4]).splitlines()
    assert flags == "True True True"  # the user's figure is still current, and ours is not pyplot's
    interactive, backend, changed = json.loads(state_after)
    assert interactive is True and backend.endswith("backend_inline") and changed == []
    assert _images(outputs[5]) and _images(outputs[6])


def test_after_only_load_ext_the_readme_snippets_and_agent_plot_show_the_plot(tmp_path: Path) -> None:
    """`%load_ext agentnb` alone, then the README's plot snippets as written: `agentnb` was a NameError."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    analysing = [b for b in blocks if "agentnb.plot_usage(job)" in b]
    assert analysing, "the README shows agentnb.plot_usage(job)"
    outputs = _run_in_kernel([
        "%load_ext agentnb",
        # the default workspace, ./agentnb-data, is the one the README's snippet opens
        'job = %agent run --piece plan-implement-verify --model demo "Summarise the inputs"',
        "agentnb.plot_usage(job)",
        "%agent plot",
        "%agent plot job",
        *analysing,
        "import glob\nprint(sorted(glob.glob('*.ipynb')))",
    ], tmp_path)
    assert _images(outputs[2]) and _images(outputs[3]) and _images(outputs[4])
    assert _printed(outputs[-1]).strip() == "['run.ipynb']"


@pytest.fixture
def shell(tmp_path: Path):  # type: ignore[no-untyped-def]
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "agentnb")
    sh.run_line_magic("config", f"AgentMagic.workspace = {str(tmp_path / 'ws')!r}")
    sh.run_line_magic("config", "AgentMagic.model = 'demo'")
    yield sh
    for name in [k for k in sh.user_ns if k.startswith("t_")]:
        del sh.user_ns[name]


def test_agent_plot_takes_the_job_like_the_other_sub_commands(shell, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from IPython.core.error import UsageError
    from IPython.utils.capture import capture_output

    with pytest.raises(UsageError, match=r"^%agent plot: no job yet in this session; give a job id"):
        shell.run_line_magic("agent", "plot")
    with capture_output():
        shell.run_cell('t_first = %agent run --piece plan-implement-verify "Summarise the inputs"')
        second = shell.run_line_magic("agent", 'run --piece single "List the files"')
    first = shell.user_ns["t_first"]
    shell.user_ns["t_jid"] = first.id
    for line, job in (("plot", second), (f"plot {first.id}", first), ("plot t_first", first),
                      ("plot {t_jid}", first), ("plot $t_jid", first), ("plot t_jid", first)):
        fig = shell.run_line_magic("agent", line)
        assert isinstance(fig, Figure) and fig._suptitle.get_text().startswith(f"Job {job.id} · "), line
    # as a cell's value it is shown as an image, whether or not pyplot was ever used
    data, metadata = shell.display_formatter.format(fig)
    assert data["image/png"][:4] == b"\x89PNG" and metadata["image/png"]["width"] == 1000
    with pytest.raises(UsageError, match=r"^%agent plot: no job 999 in workspace "):
        shell.run_line_magic("agent", "plot 999")
    with pytest.raises(UsageError, match=r"^%agent plot: unrecognized arguments: 2"):
        shell.run_line_magic("agent", "plot 1 2")
    shell.run_line_magic("agent", "plot --help")
    assert "%agent plot [job]" in capsys.readouterr().out
    shell.run_line_magic("agent", "--help")
    assert "\n  plot [JOB] " in capsys.readouterr().out


def test_in_a_kernel_a_batch_of_2_or_8_variants_on_deep_script_paths_shows_short_labels(tmp_path: Path) -> None:
    """Notebook 05's plot_batch labels were once the full scripted: paths, overprinted, and the summary was
    1,700-1,900 px wide.  In a real kernel, a batch's HTML and its plot name each variant by its short label."""
    deep = tmp_path / "clients" / "acme-corporation" / "experiments" / "2026-q4" / "release-notes-evaluation"
    setup = (
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "from pathlib import Path\nimport agentnb\nfrom _batching import answering_model, draft_review\n"
        f"deep = Path({str(deep)!r}); (deep / 'other').mkdir(parents=True)\n"
        f"ws = agentnb.Workspace({str(tmp_path / 'ws')!r})\n"
        "cases = [{'instruction': f'Answer question {i}', 'expected': str(40 + i)} for i in range(3)]\n"
        "scorers = {'has_answer': lambda j: (j.output / 'answer.txt').is_file(),\n"
        "           'right': lambda j: (j.output / 'answer.txt').read_text() == j.expected}\n"
        # one script answers no case right: `right` differs between the variants, has_answer does not
        "models = [answering_model(deep, f'draft-script-{k}', '41' if k else '99', prompt=100 + 50 * k)\n"
        "          for k in range(3)]\n"
        "models.append(answering_model(deep / 'other', 'draft-script-0', '42', prompt=400))\n"
        "pieces = ['single', draft_review(deep)]\n"
        "b2 = ws.batch(cases, piece=pieces, model=models[0], name='two', scorers=scorers, progress=False)\n"
        "b8 = ws.batch(cases, piece=pieces, model=models, name='eight', scorers=scorers, progress=False)"
    )
    outputs = _run_in_kernel([setup, "b2", "agentnb.plot_batch(b2)", "b8", "fig = agentnb.plot_batch(b8)\nfig",
                              "print(fig.get_suptitle())"], tmp_path)
    for shown, n in ((outputs[1], 2), (outputs[3], 8)):
        (page,) = [o["data"]["text/html"] for o in shown if "text/html" in o.get("data", {})]
        assert "<table class='agentnb-batch-summary'" in page
        visible = re.sub(r"title='[^']*'", "", page)  # the full spec is in the tooltips only
        assert str(deep) not in visible and page.count("title='variant ") == n
        assert ">draft-review</span> · <span style='white-space:nowrap'>scripted:" in visible
    text = re.sub(r"<[^>]+>", "", outputs[3][0]["data"]["text/html"])
    assert "single · scripted:other/draft-script-0.yaml" in text  # lengthened: another draft-script-0.yaml exists
    assert "single · scripted:draft-script-1.yaml" in text
    for shown in (outputs[2], outputs[4]):
        (image,) = _images(shown)
        assert image["data"]["image/png"]  # base64 PNG of the figure
    assert _printed(outputs[5]).splitlines() == [
        "batch eight: 8 variants × 3 cases", "score plotted: right · others: has_answer (choose with score=)"]
