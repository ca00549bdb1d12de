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


# -- every symbol has a glyph without an emoji font ---------------------------------------------------------------


def _dejavu_sans() -> set[int]:
    """The code points DejaVu Sans draws: the sans-serif font of nearly every Linux desktop, and matplotlib's."""
    from matplotlib.ft2font import FT2Font

    return set(FT2Font(str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf")).get_charmap())


def _widget_texts(widget: object) -> list[str]:
    """Every text a widget tree shows: descriptions, values, tooltips, placeholders and option labels."""
    import ipywidgets as w

    out = [str(getattr(widget, name)) for name in ("description", "tooltip", "placeholder", "value")
           if isinstance(getattr(widget, name, None), str)]
    out += [str(label) for label in getattr(widget, "_options_labels", ())]
    if isinstance(widget, w.Box):
        for child in widget.children:
            out += _widget_texts(child)
    return out


def _showcase(ws: Workspace, shell: object, tmp: Path) -> dict[str, list[str]]:
    """Every view of a workspace holding one job of each kind a user meets, by where it was seen.

    The jobs: tool calls, latency, the context's warn/prompt/force_transition with a reminder and a tool error
    (``usage_job``); two compactions; a loop judged and aborted; a job waiting for an answer, and one answered;
    a fork of the first job; a batch with waiting jobs.
    """
    from _batching import answering_model, asking_model
    from _scripting import call, transition, write_piece, write_script
    from IPython.utils.capture import capture_output
    from matplotlib.text import Text

    from agentnb.notebook.panel import Panel
    from agentnb.views.transcript import movement_text

    usage = usage_job(ws, tmp / "scripts")
    glob = [{**call("Glob", pattern="*"), "usage": {"prompt_tokens": p, "completion_tokens": 10}} for p in (500, 900)]
    compacting = write_piece(tmp, "long", {"context": {"window_tokens": 1000, "on_pressure": "compact",
                                                       "compact_keep_last": 2},
                                           "movements": [{"name": "work", "instruction": "Work.", "tools": ["Glob"],
                                                          "rules": [{"next": "COMPLETE"}]}]})
    compacted = ws.run(ws.submit("compact", piece=str(compacting), model=write_script(tmp, "compact", {"work": [
        *glob, {"content": "summary one", "usage": {"prompt_tokens": 950, "completion_tokens": 20}},
        transition("COMPLETE")]})))
    judge = {"persona": "You judge loops.", "instruction": "Decide.", "rules": [{"condition": "stuck", "next": "ABORT"}]}
    loopy = write_piece(tmp, "loopy", {"max_movements": 20, "loop_monitors": [
        {"cycle": ["review", "fix"], "threshold": 2, "judge": judge}], "movements": [
        {"name": "review", "instruction": "Review it.", "rules": [{"condition": "bad", "next": "fix"}]},
        {"name": "fix", "instruction": "Fix it.", "rules": [{"next": "review"}]}]})
    looped = ws.run(ws.submit("loop", piece=str(loopy), model=write_script(tmp, "loop", {
        "review": [transition("fix")] * 2, "fix": [transition("review")] * 2,
        "judge:review/fix": [transition("ABORT", "stuck")]})))
    asker = asking_model(tmp)
    waiting = ws.run(ws.submit("ask me", piece="single", model=asker))
    answered = ws.reply(ws.run(ws.submit("ask me too", piece="single", model=asker)), "Python, please.")
    fork = ws.fork(usage, at=2)
    batch = ws.batch([{"instruction": f"Answer {i}"} for i in range(2)], piece="single",
                     model=[asker, answering_model(tmp, "answers", "42")], name="mixed", progress=False)
    assert (str(compacted.status), str(looped.status), str(waiting.status), str(fork.status)) == (
        "succeeded", "aborted", "waiting_human", "succeeded")
    assert len(ws.frames.compactions(compacted)) == 1 and len(ws.frames.loops(looped)) == 1
    jobs = [usage, compacted, looped, waiting, answered, fork]

    seen: dict[str, list[str]] = {
        "job view": [j._repr_html_() for j in jobs],
        "text transcript": [movement_text(ws.store.events(j.id)) for j in jobs],
        "exported notebook": [ws.export_notebook(j, tmp / f"export-{j.id}.ipynb").read_text(encoding="utf-8")
                              for j in jobs],
        "comparison": [ws.compare(usage, fork)._repr_html_()],
        "batch": [batch._repr_html_(), repr(batch), batch.summary().to_html(), batch.frame.to_html()],
        "what-if": [ws.frames.what_if(usage, window=8000).to_html()],
        "plots": [t.get_text() for fig in (agentnb.plot_usage(usage), agentnb.plot_usage(compacted),
                                           agentnb.plot_usage(looped), agentnb.plot_batch(batch))
                  for t in fig.findobj(Text)],
    }
    panel = Panel(ws)
    try:
        seen["panel"] = _widget_texts(panel)
    finally:
        panel.close()
    with capture_output() as cap:
        shell.run_cell(f't_job = %agent run --piece single --model {asker} "ask me again"')  # type: ignore[attr-defined]
        shell.user_ns["t_cases"] = [{"instruction": "Answer 1"}]  # type: ignore[attr-defined]
        for line in (f"%agent show {fork.id}", f"%agent batch t_cases --piece single --model {asker} --name asks",
                     "%agent batches", f"%agent usage {usage.id}", "%agent jobs"):
            shell.run_cell(line)  # type: ignore[attr-defined]
    seen["magic"] = [cap.stdout, cap.stderr, *(str(v) for o in cap.outputs for v in o.data.values())]
    return seen


def test_every_symbol_of_the_views_has_a_glyph_in_dejavu_sans(ws: Workspace, shell: object, tmp_path: Path) -> None:
    """Without an emoji font 🔧, ⏱, ❓ and ⑂ were once boxes ("#12 □1@2").  Every non-ASCII character any
    view shows must be one DejaVu Sans draws, so a future emoji in a view fails here."""
    seen = _showcase(ws, shell, tmp_path)
    glyphs = _dejavu_sans()
    missing = sorted({f"{ch!r} U+{ord(ch):04X} in the {where}" for where, texts in seen.items() for text in texts
                      for ch in text if ord(ch) > 127 and ord(ch) not in glyphs})
    assert missing == [], "\n".join(missing)
    # the showcase showed what it is meant to: the symbols replacing the emoji are all there
    from agentnb.views import icons

    everything = "".join(t for texts in seen.values() for t in texts)
    for symbol in (icons.TOOL, icons.LATENCY, icons.FORK, icons.REMINDER, icons.COMMENT, icons.STOP, "⇊", "⟳"):
        assert symbol in everything, symbol
    assert 'aria-label="question"' in "".join(seen["job view"]) and 'aria-label="question"' in "".join(seen["magic"])
    assert any(f"{icons.FORK}1@2" in label for label in seen["panel"])
    assert "<Batch 'asks': 0/1 ended · 1 waiting>" in "".join(seen["magic"])  # %agent batch ran
