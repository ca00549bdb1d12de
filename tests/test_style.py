"""One colour per ContextManager action, the same in the HTML view, the panel's context bar and the plot."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display in tests

from _usage_jobs import usage_job
from matplotlib.colors import to_hex

import agentnb
from agentnb import Workspace
from agentnb.notebook.panel import context_bar_html

ACTIONS = ("warn", "prompt", "force_transition", "exhausted")


def test_each_action_has_one_colour_in_every_view(ws: Workspace, tmp_path: Path) -> None:
    job = usage_job(ws, tmp_path / "scripts")  # fires warn, prompt and force_transition
    view = job._repr_html_()
    # the job view's badges, as inline styles (what a saved notebook keeps)
    badges = {a: re.search(rf'class="anb-badge anb-{a}" style="[^"]*background:(#[0-9a-f]{{6}})', view)
              for a in ("warn", "prompt", "force_transition")}
    html = {a: m.group(1) for a, m in badges.items() if m}
    assert set(html) == {"warn", "prompt", "force_transition"}, view
    bar = context_bar_html(0.5, ws.frames.thresholds(job))
    panel = dict(re.findall(r'data-mark="(\w+)" style="[^"]*border-left:2px solid (#[0-9a-f]{6})', bar))
    assert set(panel) == set(ACTIONS)
    fig = agentnb.plot_usage(job)
    lines = {line.get_gid().split(":", 1)[1]: to_hex(line.get_color()) for line in fig.axes[0].lines
             if (line.get_gid() or "").startswith("threshold:")}
    assert set(lines) == set(ACTIONS)
    for action in ACTIONS:
        assert lines[action] == panel[action] == html.get(action, panel[action]), action
    assert len(set(panel.values())) == len(ACTIONS)  # and the actions stay told apart


def test_the_shared_colours_are_written_only_in_views_style() -> None:
    """A shared colour copied into another module drifts when style.py changes (the magic's error line did)."""
    from agentnb.views import style

    package = Path(agentnb.__file__).parent
    shared = {c.lower() for c in (*style.ACTION_COLOURS.values(), style.OK_COLOUR, style.ERROR_COLOUR)}
    copies = [f"{p.relative_to(package)}:{i}: {c}" for p in sorted(package.rglob("*.py")) if p.name != "style.py"
              for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
              for c in re.findall(r"#[0-9a-fA-F]{6}\b", line) if c.lower() in shared]
    assert copies == []
