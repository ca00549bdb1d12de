"""Compaction (docs/context.md#compaction) in every view: ``frames.usage``' ``action``, ``frames.compactions``,
``what_if``, ``plot_usage``, the job view, the exported notebook and ``compare``; and loop monitors in the plot.

The main job is one movement in a 1,000-token window with ``on_pressure: compact`` and
``compact_keep_last: 2``, whose scripted model reports its own usage:

====  =======  ====================================================================
call  prompt   what happens
====  =======  ====================================================================
1     500
2     900      warn, prompt → the next step is a compaction
3     950      summarisation call: "summary one"; compaction 1 (920 → 582 tokens)
4     300
5     880      warn, prompt again (the ContextManager re-armed) → compaction
6     (count)  summarisation call: "summary two"; compaction 2 (900 → 582 tokens)
7     400
8     960      warn, prompt, force_transition: no compaction left → forced COMPLETE
====  =======  ====================================================================
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display in tests; must precede any pyplot import

import pandas as pd
import pytest
from _scripting import call, transition, write_piece, write_script
from matplotlib.text import Annotation
from openai_server import OpenAIServer, error, reply

import agentnb
from agentnb import Job, Workspace
from agentnb.views.render import job_html, job_stats, movement_html
from agentnb.views.transcript import movement_text

_CONTEXT = {"window_tokens": 1000, "on_pressure": "compact", "compact_keep_last": 2}
_WORK = {"name": "work", "instruction": "Work.", "tools": ["Glob"], "rules": [{"next": "COMPLETE"}],
         "default_next": "COMPLETE"}


def _glob(prompt: int) -> dict[str, Any]:
    return {**call("Glob", pattern="*"), "usage": {"prompt_tokens": prompt, "completion_tokens": 10}}


def _compacted(ws: Workspace, tmp: Path, *, second: str = "summary two", name: str = "s") -> Job:
    """The job of the module docstring (``second``: the second summary)."""
    piece = write_piece(tmp, "long", {"context": _CONTEXT, "movements": [_WORK]})
    script = write_script(tmp, name, {"work": [
        _glob(500), _glob(900), {"content": "summary one", "usage": {"prompt_tokens": 950, "completion_tokens": 20}},
        _glob(300), _glob(880), {"content": second}, _glob(400), _glob(960), transition("COMPLETE")]})
    job = ws.run(ws.submit("do it", piece=str(piece), model=script))
    assert job.status == "succeeded", job.error
    return job


def _empty_summary(ws: Workspace, tmp: Path) -> Job:
    """A summarisation call that answers with no text: recorded, then the seed's wrap-up; the job goes on."""
    piece = write_piece(tmp, "long", {"context": _CONTEXT, "movements": [_WORK]})
    script = write_script(tmp, "empty", {"work": [
        _glob(500), _glob(900), {"content": "", "usage": {"prompt_tokens": 950, "completion_tokens": 1}},
        {**transition("COMPLETE", "wrapped up"), "usage": {"prompt_tokens": 930, "completion_tokens": 10}}]})
    job = ws.run(ws.submit("do it", piece=str(piece), model=script))
    assert job.status == "succeeded", job.error
    return job


def _plain(ws: Workspace, tmp: Path) -> Job:
    """The same shape with the seed's behaviour (no compaction): prompt → wrap-up reminder."""
    piece = write_piece(tmp, "plain", {"context": {"window_tokens": 1000}, "movements": [_WORK]})
    script = write_script(tmp, "plain-script", {"work": [
        _glob(500), _glob(900), {**transition("COMPLETE"), "usage": {"prompt_tokens": 920, "completion_tokens": 5}}]})
    job = ws.run(ws.submit("do it", piece=str(piece), model=script))
    assert job.status == "succeeded", job.error
    return job


def _text(markup: str) -> str:
    """The words of some HTML, tags removed and whitespace squeezed."""
    import html

    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", markup)).split())


# -- frames -----------------------------------------------------------------------------------------------------


def test_usage_marks_each_summarisation_call_as_compaction(ws: Workspace, tmp_path: Path) -> None:
    job = _compacted(ws, tmp_path)
    u = ws.frames.usage(job)
    assert list(u["action"].dtype.categories) == ["warn", "prompt", "force_transition", "exhausted", "compaction"]
    assert u["action"].dtype.ordered
    assert u["action"].astype(object).where(u["action"].notna(), None).tolist() == [
        None, "prompt", "compaction", None, "prompt", "compaction", None, "force_transition"]
    assert u.loc[u["action"] == "compaction", "actions"].tolist() == ["compaction", "compaction"]
    # a summarisation call is a call like any: its tokens, its place in the cumulative sum
    summarising = u[u["action"] == "compaction"]
    assert summarising["iteration"].tolist() == [3, 6]
    assert summarising["prompt_tokens"].iloc[0] == 950 and summarising["total_tokens"].iloc[0] == 970
    assert u["cumulative_tokens"].iloc[-1] == u["total_tokens"].sum()
    # a job that never compacted has no compaction row
    plain = ws.frames.usage(_plain(ws, tmp_path))
    assert "compaction" not in set(plain["action"].dropna().astype(str))


def test_compactions_frame_and_the_sums_that_count_the_summarisation_calls(ws: Workspace, tmp_path: Path) -> None:
    job = _compacted(ws, tmp_path)
    c = ws.frames.compactions(job)
    assert c[["seq", "movement", "iteration", "tokens_before", "tokens_after", "removed_messages",
              "kept_messages", "summary"]].to_dict("records") == [
        {"seq": 1, "movement": "work", "iteration": 3, "tokens_before": 920, "tokens_after": 582,
         "removed_messages": 2, "kept_messages": 2, "summary": "summary one"},
        {"seq": 1, "movement": "work", "iteration": 6, "tokens_before": 900, "tokens_after": 582,
         "removed_messages": 5, "kept_messages": 2, "summary": "summary two"},
    ]
    events = [e for e in ws.events(job, kinds=["llm_response"])]
    spent = sum(e.payload["usage"]["total_tokens"] for e in events)
    mv = ws.frames.movements(job)
    assert (int(mv["llm_calls"].iloc[0]), int(mv["total_tokens"].iloc[0])) == (8, spent)
    jobs = ws.frames.jobs().set_index("job")
    assert (jobs.loc[job.id, "llm_calls"], jobs.loc[job.id, "total_tokens"]) == (8, spent)
    # messages: the summary the conversation went on from, after the summarisation call's answer
    m = ws.frames.messages(job)
    rows = m[m["kind"] == "compaction"]
    assert rows[["iteration", "role", "content"]].to_dict("records") == [
        {"iteration": 3, "role": "user", "content": "summary one"},
        {"iteration": 6, "role": "user", "content": "summary two"}]
    # every job, and a job without any
    assert len(ws.frames.compactions()) == 2
    assert ws.frames.compactions(_plain(ws, tmp_path)).empty


def test_a_failed_compaction_has_a_usage_row_but_no_compaction(ws: Workspace, tmp_path: Path) -> None:
    job = _empty_summary(ws, tmp_path)
    u = ws.frames.usage(job)
    assert u["action"].astype(object).where(u["action"].notna(), None).tolist() == [None, "prompt", "compaction", None]
    assert ws.frames.compactions(job).empty


def test_what_if_passes_summarisation_calls_through_and_rearms_after_each(ws: Workspace, tmp_path: Path) -> None:
    job = _compacted(ws, tmp_path)
    w = ws.frames.what_if(job)  # the job's own settings: the simulation must give back the record
    conversation = w["action_recorded"] != "compaction"
    assert w.loc[conversation, "action_what_if"].astype(object).where(
        w.loc[conversation, "action_what_if"].notna(), None).tolist() == [None, "prompt", None, "prompt", None,
                                                                          "force_transition"]
    assert (w.loc[conversation, "actions_what_if"].fillna("").tolist()
            == w.loc[conversation, "actions"].fillna("").tolist())
    summarising = w[~conversation]
    assert summarising["action_recorded"].astype(str).tolist() == ["compaction", "compaction"]
    assert summarising["action_what_if"].isna().all() and summarising["actions_what_if"].isna().all()
    assert not summarising["forced_what_if"].any()
    assert w["first_forced"].tolist() == [False] * 7 + [True]
    assert w["action_what_if"].dtype == w["action_recorded"].dtype == w["action"].dtype
    # a larger window: nothing fires, the compaction rows still say what they were
    wide = ws.frames.what_if(job, window=4000)
    assert wide.loc[wide["action_recorded"] != "compaction", "action_what_if"].isna().all()
    assert (wide["action_recorded"] == "compaction").sum() == 2
    # and the plot of it draws
    fig = agentnb.plot_usage(job, what_if={"window": 4000})
    assert any(a.get_gid() == f"compaction:{job.id}" for a in fig.axes[0].collections)


# -- plot ---------------------------------------------------------------------------------------------------------


def _labels(fig: Any, gid: str) -> list[str]:
    return [t.get_text() for t in fig.axes[0].texts if t.get_gid() == gid]


def test_plot_marks_each_compaction_with_its_sizes_and_the_drop(ws: Workspace, tmp_path: Path) -> None:
    job = _compacted(ws, tmp_path)
    fig = agentnb.plot_usage(job)
    ax = fig.axes[0]
    (marks,) = [c for c in ax.collections if c.get_gid() == f"compaction:{job.id}"]
    assert marks.get_offsets()[:, 0].tolist() == [3, 6]
    assert marks.get_offsets()[:, 1].tolist() == pytest.approx([0.95, 0.558])
    assert _labels(fig, "label:compaction") == ["compaction 1: 920→582 tokens", "compaction 2: 900→582 tokens"]
    drops = [t for t in ax.texts if isinstance(t, Annotation) and t.get_gid() == "compaction:drop"]
    # each arrow from the context before (tokens_before / window) down to the compacted one
    assert [(d.xy, d.xyann) for d in drops] == [((3, 0.582), (3, 0.92)), ((6, 0.582), (6, 0.9))]
    # the ContextManager's own markers leave the summarisation calls out
    actions = [c for c in ax.collections if c.get_gid() == f"action:{job.id}"]
    assert sorted(x for c in actions for x in c.get_offsets()[:, 0]) == [2, 5, 8]
    assert "compaction (messages summarised)" in [t.get_text() for t in ax.get_legend().get_texts()]
    # the ratio line itself drops after each compaction
    (line,) = [ln for ln in ax.lines if ln.get_gid() == "movement:1"]
    ratio = list(line.get_ydata())
    assert ratio[3] < ratio[2] - 0.5 and ratio[6] < ratio[5]

    # a frame alone knows the calls but not the sizes
    frame_fig = agentnb.plot_usage(ws.frames.usage(job))
    assert _labels(frame_fig, "label:compaction") == ["compaction 1", "compaction 2"]


def test_plot_without_compaction_has_no_compaction_artist(ws: Workspace, tmp_path: Path) -> None:
    fig = agentnb.plot_usage(_plain(ws, tmp_path))
    gids = {a.get_gid() for a in fig.findobj() if a.get_gid()}
    assert not {g for g in gids if "compaction" in g or g.startswith("loop")}
    assert "compaction (messages summarised)" not in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_plot_labels_a_summarisation_call_that_compacted_nothing(ws: Workspace, tmp_path: Path) -> None:
    fig = agentnb.plot_usage(_empty_summary(ws, tmp_path))
    assert _labels(fig, "label:compaction") == ["compaction failed"]
    assert not [t for t in fig.axes[0].texts if t.get_gid() == "compaction:drop"]


# -- job view -----------------------------------------------------------------------------------------------------


def test_job_view_shows_each_compaction_as_a_block_with_its_summary(ws: Workspace, tmp_path: Path) -> None:
    job = _compacted(ws, tmp_path, second="the <b>second</b> summary")
    page = job_html(ws, job.id)
    run = movement_html(ws, job.id, 1)
    summary_line = _text(run[: run.index("</summary>")])
    assert "⇊ compacted ×2" in summary_line
    assert "8 calls (2 summarisation)" in summary_line
    text = _text(page)
    assert "Compaction 1: 2 messages summarised, 2 kept · 920 → 582 tokens" in text
    after = int(ws.frames.compactions(job)["tokens_after"].iloc[1])  # a longer summary than the table's
    assert f"Compaction 2: 5 messages summarised, 2 kept · 900 → {after} tokens" in text
    # the summary folded in a <details> of the compaction block, escaped
    blocks = re.findall(r'<div class="anb-compacted".*?</details></div>', page, flags=re.S)
    assert len(blocks) == 2
    assert re.search(r"<details><summary[^>]*>summary .*?</summary>.*summary one", blocks[0], flags=re.S)
    assert "the &lt;b&gt;second&lt;/b&gt; summary" in blocks[1] and "<b>second</b>" not in page
    # the summarisation call is headed as such, and its answer is not shown as a turn of the conversation
    assert "summarisation call 3 (compaction, no tools)" in text and "summarisation call 6" in text
    assert "call 3 ·" not in text
    assert page.count("summary one") == 1
    assert "assistant summary one" not in text
    # the run is done and not failed; the job view keeps its bounds (one detailed call, the rest a line)
    assert "anb-st-failed" not in run
    small = _text(job_html(ws, job.id, max_calls=2))
    assert "⇊ compacted ×2" in small and "calls 2–7 not shown" in small


def test_a_failed_compaction_is_a_warning_not_a_failure(ws: Workspace, tmp_path: Path) -> None:
    job = _empty_summary(ws, tmp_path)
    (err,) = ws.events(job, kinds=["error"])
    assert err.payload["where"] == "compaction"
    run = movement_html(ws, job.id, 1)
    text = _text(run)
    head = _text(run[: run.index("</summary>")])
    assert head.startswith("1. work done") and "⚠ compaction failed" in head
    assert "✖" not in text and "anb-st-failed" not in run and "anb-error" not in run
    assert f"compaction failed — {err.payload['message']}" in text
    assert "summarisation call 3" in text and "summary: (empty)" in text
    assert "Compaction 1" not in text


def test_summarisation_call_that_raised_is_a_warning(ws: Workspace, tmp_path: Path,
                                                     loopback: Callable[..., OpenAIServer]) -> None:
    """openai: through the loopback server; the summarisation call gets an HTTP 400 (not retried)."""
    srv = loopback()
    srv.play(reply(None, [("Glob", {"pattern": "*"})], usage=(500, 10)),
             reply(None, [("Glob", {"pattern": "*"})], usage=(900, 10)),
             error(400, "no summaries today"),
             reply(None, [("transition", {"next_step": "COMPLETE", "summary": "done"})], usage=(920, 10)))
    piece = write_piece(tmp_path, "long", {"context": _CONTEXT, "movements": [_WORK]})
    job = ws.run(ws.submit("do it", piece=str(piece), model="openai:m"))
    assert job.status == "succeeded", job.error
    purposes = [e.payload.get("purpose") for e in ws.events(job, kinds=["llm_request"])]
    assert purposes == [None, None, "compaction", None]
    page = job_html(ws, job.id)
    assert "compaction failed —" in _text(page) and "no summaries today" in page
    assert "anb-badge anb-st-failed" not in page and "✖" not in _text(page)
    # no response was recorded for it: the usage frame has the three conversation calls
    assert ws.frames.usage(job)["action"].astype(str).tolist().count("compaction") == 0
    assert "⚠ compaction failed" in movement_text(ws.store.events(job.id, movement_seq=1))


# -- exported notebook and compare -------------------------------------------------------------------------------


def test_transcript_has_a_compaction_line_with_its_summary(ws: Workspace, tmp_path: Path) -> None:
    job = _compacted(ws, tmp_path)
    text = movement_text(ws.store.events(job.id, movement_seq=1))
    assert "--- summarisation call 3 (compaction, no tools): 950 prompt + 20 completion tokens" in text
    assert "⇊ compaction 1: 2 messages summarised, 2 kept, 920 → 582 tokens\n  summary:\n    summary one" in text
    assert "⇊ compaction 2: 5 messages summarised, 2 kept, 900 → 582 tokens" in text
    assert "[assistant]\n    summary one" not in text
    path = ws.export_notebook(job, tmp_path / "export.ipynb")
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    outputs = [o["data"] for c in cells for o in c.get("outputs", []) if "text/plain" in o.get("data", {})]
    plain = "\n".join("".join(d["text/plain"]) for d in outputs)
    assert "⇊ compaction 1" in plain and "summary two" in plain
    headings = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    assert "compacted 2×" in headings


def test_compare_counts_summarisation_calls_and_tells_compactions_apart(ws: Workspace, tmp_path: Path) -> None:
    a = _compacted(ws, tmp_path, name="a")
    same = _compacted(ws, tmp_path, name="b")
    other = _compacted(ws, tmp_path, second="another summary", name="c")
    frame = ws.compare(a, same).frame
    assert frame["identical"].tolist() == [True]
    assert int(frame["llm_calls_a"].iloc[0]) == 8
    assert int(frame["total_tokens_a"].iloc[0]) == int(ws.frames.usage(a)["total_tokens"].sum())
    diff = ws.compare(a, other)
    assert diff.frame["identical"].tolist() == [False] and diff.first_divergence == 1
    # a run whose model said the same words as turns of the conversation (the seed's behaviour: no compaction)
    # is not the same conversation: a summarisation call is told apart by its purpose
    piece = write_piece(tmp_path, "talky", {"context": {"window_tokens": 1000}, "movements": [_WORK]})
    script = write_script(tmp_path, "talk", {"work": [
        _glob(500), _glob(900), {"content": "summary one", "usage": {"prompt_tokens": 800, "completion_tokens": 20}},
        _glob(300), _glob(880), {"content": "summary two"}, _glob(400), _glob(960), transition("COMPLETE")]})
    talk = ws.run(ws.submit("do it", piece=str(piece), model=script))
    assert ws.frames.movements(talk)["llm_calls"].tolist() == [8] and ws.frames.compactions(talk).empty
    assert ws.compare(a, talk).frame["identical"].tolist() == [False]


# -- loop monitors in the plot ----------------------------------------------------------------------------------


_JUDGE = "judge:review/fix"


def _looping(ws: Workspace, tmp: Path) -> Job:
    """review ⇄ fix twice, then the monitor's judge aborts the job."""
    piece = write_piece(tmp, "loopy", {"max_movements": 20, "movements": [
        {"name": "review", "instruction": "Review it.",
         "rules": [{"condition": "good", "next": "COMPLETE"}, {"condition": "bad", "next": "fix"}]},
        {"name": "fix", "instruction": "Fix it.", "rules": [{"next": "review"}]},
    ], "loop_monitors": [{"cycle": ["review", "fix"], "threshold": 2, "judge": {
        "persona": "You judge loops.", "instruction": "Decide.",
        "rules": [{"condition": "progress", "next": "review"}, {"condition": "stuck", "next": "ABORT"}]}}]})
    script = write_script(tmp, "loop", {"review": [transition("fix", "bad"), transition("fix", "bad")],
                                        "fix": [transition("review", "fixed"), transition("review", "fixed")],
                                        _JUDGE: [transition("ABORT", "stuck")]})
    job = ws.run(ws.submit("t", piece=str(piece), model=script))
    assert job.status == "aborted"
    return job


def test_plot_marks_where_a_loop_monitor_fired(ws: Workspace, tmp_path: Path) -> None:
    judge = _JUDGE
    job = _looping(ws, tmp_path)
    fig = agentnb.plot_usage(job)
    (line,) = [ln for ln in fig.axes[0].lines if ln.get_gid() == "loop:4"]
    assert line.get_xdata()[0] == pytest.approx(4.5)  # after run 4's one call, before the judge's
    assert _labels(fig, "label:loop") == ["⟳ loop review → fix ×2"]
    assert "loop detected" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    # and the exported notebook says so (the transcript line of the run that closed the loop)
    assert "⟳ loop review → fix ×2" in movement_text(ws.store.events(job.id, movement_seq=4))
    (row,) = ws.frames.loops(job).to_dict("records")
    assert (row["seq"], row["monitor"], row["cycle"], row["count"], row["runs"], row["summaries"], row["judge"]) == (
        4, judge, ["review", "fix"], 2, [1, 2, 3, 4], ["bad", "fixed", "bad", "fixed"], judge)
    assert pd.isna(row["next"])
    assert ws.frames.movements(job)["judge"].tolist() == [False] * 4 + [True]


def test_panel_lists_compacted_and_looping_jobs_with_a_mark(ws: Workspace, tmp_path: Path) -> None:
    from agentnb.notebook.panel import Panel

    compacted = _compacted(ws, tmp_path)
    plain = _plain(ws, tmp_path)
    failed = _empty_summary(ws, tmp_path)
    panel = Panel(ws)
    try:
        labels = {value: label for label, value in panel.jobs.options}
        assert labels[compacted.id].startswith(f"#{compacted.id} ⇊2 · succeeded")
        assert "⇊" not in labels[plain.id] and "⇊" not in labels[failed.id]  # no compaction was made there
        assert "⟳" not in labels[compacted.id]
        looping = _looping(ws, tmp_path)
        panel.refresh()
        labels = {value: label for label, value in panel.jobs.options}
        assert labels[looping.id].startswith(f"#{looping.id} ⟳1 · aborted")
    finally:
        panel.close()


def test_context_of_a_job_paused_after_a_compaction_is_the_compacted_one(ws: Workspace, tmp_path: Path) -> None:
    """The panel's context bar and the magic read ``job_stats``: after a compaction the context is the compacted
    list (``tokens_after``), not the summarisation request's size, and the ContextManager's actions re-armed."""
    piece = write_piece(tmp_path, "long", {"context": _CONTEXT, "movements": [_WORK]})
    script = write_script(tmp_path, "s", {"work": [
        _glob(500), _glob(900), {"content": "summary one", "usage": {"prompt_tokens": 950, "completion_tokens": 20}},
        transition("COMPLETE")]})
    job = ws.submit("do it", piece=str(piece), model=script)
    for _ in range(2):
        ws.step(job, unit="call")
    before = job_stats(ws, job.id)
    assert (before.last_tokens, before.actions) == (900, ["warn", "prompt"])
    ws.step(job, unit="call")  # the summarisation call
    st = job_stats(ws, job.id)
    (c,) = ws.frames.compactions(job).to_dict("records")
    assert (st.last_tokens, st.last_ratio, st.actions) == (c["tokens_after"], c["tokens_after"] / 1000, [])
    assert st.calls == 3 and not st.errors
    # the view of the paused job shows the compaction already
    assert "Compaction 1: 2 messages summarised, 2 kept" in _text(job_html(ws, job.id))
    assert ws.run(job).status == "succeeded"
