"""The static HTML view of a job: built from the events, escaped, and bounded in size."""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
from pathlib import Path

import pytest
from _scripting import call, transition, write_piece, write_script

from agentnb import Workspace
from agentnb.views.render import STYLE, header_html, job_html, job_stats, movement_html, timeline_html
from agentnb.views.timeline import fold

XSS = "<script>alert('x')</script>"


def _piece(tmp_path: Path, **movement: object) -> Path:
    mv = {"name": "work", "persona": "You work.", "instruction": "Do it.", "tools": ["Read", "Write"],
          "permission": "edit", "rules": [{"condition": "done", "next": "COMPLETE"},
                                          {"condition": "unclear", "next": "ASK"}],
          "default_next": "COMPLETE"}
    mv.update(movement)
    return write_piece(tmp_path, "work", {"max_movements": 4, "movements": [mv]})


def _text(html: str) -> str:
    """The visible text of the view (tags dropped), to check that payloads appear escaped."""
    return re.sub(r"<[^>]+>", "", html)


def test_demo_job_view_has_header_and_one_section_per_movement(ws: Workspace) -> None:
    job = ws.run(ws.submit("Summarise input/notes.md", piece="plan-implement-verify", model="demo",
                           inputs={"notes.md": "alpha\nbeta\n"}))
    html = job_html(ws, job.id)
    assert html.startswith(STYLE)
    assert job._repr_html_() == html
    head = header_html(ws, job.id)
    assert "plan-implement-verify" in head and "<code>demo</code>" in head and "succeeded" in head
    st = job_stats(ws, job.id)
    assert st.movements == 3 and st.calls == len(ws.events(job, kinds=["llm_response"]))
    assert f"{st.total_tokens:,} tokens" in head and "movements 3 / 12" in head
    sections = re.findall(r'<details class="anb-mv" data-seq="(\d+)"( open)? style="[^"]*">', html)
    assert [s for s, _ in sections] == ["1", "2", "3"]
    assert [bool(o) for _, o in sections] == [False, False, True]  # only the newest run opens
    # prompts, messages, tool calls with arguments, results, transition with summary and lessons
    assert "system prompt" in html and "You are a careful planner." in html
    assert "Let me see which files I was given." in html
    assert 'aria-label="tool call" title="tool call">⚒</span> <b>Glob</b>' in html and "input/**/*" in html
    assert "➜ next step <b>implement</b>" in html
    assert "The inputs are notes.md; the first one shows 2 lines." in html
    # the demo's truncated Read shows the sizes and where to continue
    assert re.search(r"cut for the model: [\d,]+ of 15,949 chars returned; continue with path=output/report.md", html)
    # context actions are visible badges with their ratio and threshold
    assert re.search(r'class="anb-badge anb-warn" style="[^"]*">⚠ context warn · 8\d% ≥ 70% · 6,\d{3} / 8,192 tokens', html)
    assert re.search(r'class="anb-badge anb-prompt" style="[^"]*">⚠ context prompt · 9\d% ≥ 85%', html)
    mv3 = movement_html(ws, job.id, 3)
    assert mv3 in html and mv3.startswith('<details class="anb-mv" data-seq="3" open style="')


def test_model_tool_and_user_text_is_escaped(ws: Workspace, tmp_path: Path) -> None:
    script = write_script(tmp_path, "xss", {"work": [
        {"content": f"assistant says {XSS}", "tool_calls": [{"name": "Read", "arguments": {"path": "input/x.html"}}]},
        call("Write", path="output/o.txt", content=XSS),
        transition("ASK", summary=f"summary {XSS}", lessons=f"lesson {XSS}", question=f"which? {XSS}"),
    ]})
    job = ws.submit(f"task {XSS}", piece=_piece(tmp_path), model=script, inputs={"x.html": f"file {XSS}"})
    job = ws.run(job)
    assert job.status == "waiting_human"
    waiting = job_html(ws, job.id)
    assert 'aria-label="question"' in waiting and "waiting for you:</b> which? &lt;script&gt;" in waiting and f"%agent reply {job.id}" in waiting
    ws.reply(job, f"reply {XSS}")
    html = job_html(ws, job.id)
    assert "<script>" not in html
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    text = _text(html)
    for what in ("assistant says ", "file ", "summary ", "lesson ", "which? ", "reply ", "task "):
        assert what + "&lt;script&gt;" in text, what
    assert "waiting for you:" not in html  # answered: the job is queued again


def test_error_inside_a_job_is_part_of_its_view(ws: Workspace, tmp_path: Path) -> None:
    script = write_script(tmp_path, "short", {"work": [call("Read", path="input/a.txt")]})
    job = ws.run(ws.submit("t", piece=_piece(tmp_path), model=script, inputs={"a.txt": "a"}))
    assert job.status == "failed"
    html = job_html(ws, job.id)
    assert 'class="anb-error"' in html and job.error and job.error[:40] in html
    assert "anb-st-failed" in html


def test_forced_transition_is_marked(ws: Workspace, tmp_path: Path) -> None:
    script = write_script(tmp_path, "forced", {"work": [call("Read", path="input/a.txt")] * 2})
    job = ws.run(ws.submit("t", piece=_piece(tmp_path, max_iterations=2), model=script, inputs={"a.txt": "a"}))
    tr = ws.events(job, kinds=["transition"])[-1]
    assert tr.payload["forced"] is True
    html = movement_html(ws, job.id, 1)
    assert "forced</span>" in html and "max_iterations (2)" in html


def test_long_bodies_are_cut_with_size_and_full_view_keeps_all(ws: Workspace, tmp_path: Path) -> None:
    long = "".join(f"line {i:05d}\n" for i in range(3000))  # 33,000 chars
    script = write_script(tmp_path, "long", {"work": [
        {"content": long, "tool_calls": []},
        transition("COMPLETE"),
    ]})
    job = ws.run(ws.submit("t", piece=_piece(tmp_path), model=script))
    html = job_html(ws, job.id)
    assert "line 00000" in html and "line 02999" not in html
    assert f"showing the first 2,000 of {len(long):,} chars" in html
    assert f"%agent show {job.id} --movement 1 --full" in html
    full = job_html(ws, job.id, full=True)
    assert "line 02999" in full and "showing the first" not in full
    assert "line 00100" in job_html(ws, job.id, max_chars=5000)


def _loop_job(ws: Workspace, tmp_path: Path, calls_per_movement: int, movements: int) -> int:
    piece = write_piece(tmp_path, "loop", {"max_movements": movements, "movements": [{
        "name": "work", "persona": "p", "instruction": "i", "tools": ["Read"], "permission": "readonly",
        "max_iterations": calls_per_movement,
        "rules": [{"condition": "more", "next": "work"}, {"condition": "done", "next": "COMPLETE"}]}]})
    responses = []
    for m in range(movements):
        responses += [{"content": f"step {m}.{i} {XSS}", "usage": {"prompt_tokens": 1000, "completion_tokens": 10},
                       "tool_calls": [{"name": "Read", "arguments": {"path": "input/big.txt"}}]}
                      for i in range(calls_per_movement - 1)]
        responses.append({**transition("work" if m < movements - 1 else "COMPLETE", summary=f"part {m}"),
                          "usage": {"prompt_tokens": 1000, "completion_tokens": 10}})
    job = ws.run(ws.submit("go", piece=piece, model=write_script(tmp_path, "loop-script", responses=responses),
                           inputs={"big.txt": "a line of <b>input</b>\n" * 200}))
    assert job.status == "succeeded", job.error
    return job.id


def test_a_thousand_call_job_renders_within_a_size_bound(ws: Workspace, tmp_path: Path) -> None:
    job_id = _loop_job(ws, tmp_path, calls_per_movement=100, movements=10)
    events = ws.events(job_id)
    assert len([e for e in events if e.kind == "llm_response"]) == 1000
    transcript = sum(len(str(e.payload)) for e in events)
    html = job_html(ws, job_id)
    assert len(html) < 450_000 < transcript / 8
    assert "&lt;b&gt;input&lt;/b&gt;" in html and "<b>input</b>" not in html
    # every movement run still has its section and summary line; old ones are reduced, the newest is not
    assert len(re.findall(r'<details class="anb-mv"', html)) == 10
    assert "details left out to keep this view small" in html
    newest = movement_html(ws, job_id, 10)
    assert newest in html
    # inside the newest run the middle calls are summarised in one line with how to see them
    assert re.search(r"… calls \d+–\d+ not shown \(60 calls, [\d,]+ tokens; tools Read×60\)", newest)
    assert "step 9.0 " in newest and "step 9.98 " in newest and "step 9.50 " not in newest
    # nothing is lost: the full view holds every call
    assert "step 9.50 " in movement_html(ws, job_id, 10, full=True)


def test_the_view_keeps_its_look_without_the_style_block(ws: Workspace) -> None:
    # Untrusted notebooks (JupyterLab, nbviewer, GitHub) drop <style> blocks but keep style attributes.
    job = ws.run(ws.submit("Summarise the inputs", piece="plan-implement-verify", model="demo"))
    html = job_html(ws, job.id, style=False)
    assert "<style>" not in html
    assert re.search(r'<span class="anb-badge anb-st-succeeded" style="[^"]*background:#2e8b57', html)
    assert re.search(r'<span class="anb-badge anb-warn" style="[^"]*background:#c9a200', html)
    assert re.search(r'<pre style="white-space:pre-wrap', html)
    assert f'class="anb-job" data-job="{job.id}" style="font-family' in html


def test_running_time_leaves_out_the_idle_time_and_wall_time_counts_it(ws: Workspace) -> None:
    # A stepped job waits between steps, and an asking job waits for its human: neither is running time.
    job = ws.submit("Summarise the inputs", piece="plan-implement-verify", model="demo")
    ws.step(job, unit="call")
    time.sleep(1.2)
    ws.step(job, unit="call")
    time.sleep(1.2)
    job = ws.run(job)
    st = job_stats(ws, job.id)
    running = [e for e in ws.events(job, kinds=["job_status"])]
    spans = sum(b.ts - a.ts for a, b in itertools.pairwise(running) if a.payload["status"] == "running")
    # the 2.4 s of sleeps are wall time only (bounds, not timings: a loaded machine runs the steps slower)
    assert st.running_s == pytest.approx(spans) and st.running_s <= st.wall_s - 2.4
    assert st.wall_s >= 2.4 and st.wall_s == pytest.approx(job.ended - job.created)
    head = header_html(ws, job.id)
    wall = re.search(r"wall (\d+\.\d) s from submit to end", head)
    assert re.search(r"running time \d+\.\d s", head) and wall and float(wall[1]) == pytest.approx(st.wall_s, abs=0.06)

    asker = ws.run(ws.submit("Summarise the meeting", piece="ask-first", model="demo"))
    assert asker.status == "waiting_human"
    time.sleep(1.2)
    assert job_stats(ws, asker.id).wall_s >= 1.2 and "since submit" in header_html(ws, asker.id)
    ws.reply(asker, "Bullets.")
    asker = ws.run(asker)
    st = job_stats(ws, asker.id)
    # the 1.2 s waiting for the human is wall time only (a bound, not a timing: the demo runs may be slow)
    assert asker.status == "succeeded" and st.running_s <= st.wall_s - 1.2


def test_each_call_shows_its_latency_and_the_header_links_the_latest_call(ws: Workspace) -> None:
    job = ws.run(ws.submit("Summarise the inputs", piece="plan-implement-verify", model="demo"))
    html = job_html(ws, job.id)
    responses = ws.events(job, kinds=["llm_response"])
    assert all(e.payload["latency_s"] >= 0 for e in responses)
    assert html.count('aria-label="how long the model took to answer"') == len(responses)
    # the newest call carries the anchor the header links to (one of each)
    last = responses[-1]
    assert html.count(f'id="anb-latest-{job.id}"') == 1 and html.count(f'href="#anb-latest-{job.id}"') == 1
    assert f"↓ last call ({last.movement_seq}.{last.iteration})" in html
    newest = re.search(rf'<div class="anb-call" id="anb-latest-{job.id}"[^>]*><div>call (\d+)', html)
    assert newest and int(newest.group(1)) == last.iteration


def test_a_call_under_a_millisecond_shows_its_latency_as_escaped_text(ws: Workspace) -> None:
    job = ws.run(ws.submit("Summarise the inputs", piece="plan-implement-verify", model="demo"))
    quick = [dataclasses.replace(e, latency_s=0.0001, ttft_s=0.0002)
             if e.kind == "llm_response" else e for e in ws.events(job)]
    html = timeline_html(ws, ws.store.job(job.id), fold(quick))
    calls = len(ws.events(job, kinds=["llm_response"]))
    # a bare "<1" would open a tag that is not one: the browser drops or mangles the text after it
    assert "<1 ms" not in html and html.count("&lt;1 ms") == 2 * calls


def test_collapsible_parts_keep_their_names_as_the_job_grows(ws: Workspace) -> None:
    # The live views' keeper gives the user's open/closed choice back to each redrawn part by its key:
    # a part must keep its key, and no two parts may share one.
    job = ws.submit("Summarise the inputs", piece="plan-implement-verify", model="demo")
    seen: set[str] = set()
    steps = 0
    while job.status == "queued":
        keys = re.findall(r'<summary data-anb-key="([^"]+)"', job_html(ws, job.id))
        assert len(keys) == len(set(keys)), "two parts share a key"
        seen.update(keys)
        job = ws.step(job, unit="call")
        steps += 1
    final = set(re.findall(r'<summary data-anb-key="([^"]+)"', job_html(ws, job.id)))
    assert steps > 5 and seen <= final  # nothing drawn while the job ran changed its key later
    assert {f"{job.id}:1", f"{job.id}:2", f"{job.id}:3", f"{job.id}:1:user"} <= final
    assert any(k.endswith(":result") for k in final) and any(k.endswith(":arguments") for k in final)


# -- the view model: a job's events folded once (views/timeline.py), incrementally for a live view


def test_folding_a_job_a_few_events_at_a_time_gives_the_same_timeline_and_view(ws: Workspace) -> None:
    from agentnb.views.render import timeline_html
    from agentnb.views.timeline import Fold, fold

    job = ws.run(ws.submit("Summarise input/notes.md", piece="plan-implement-verify", model="demo",
                           inputs={"notes.md": "alpha\nbeta\n"}))
    events = ws.events(job)
    whole = fold(events)
    assert [run.seq for run in whole.runs.values()] == [1, 2, 3]
    assert whole.totals.calls == len(ws.events(job, kinds=["llm_response"])) == sum(
        run.llm_calls for run in whole.runs.values())
    # every tool call is paired with its result in its call
    uses = [item for run in whole.runs.values() for call in run.calls for item in call.items
            if type(item).__name__ == "ToolUse"]
    assert uses and all(u.call is not None and u.result is not None and u.call.call_id == u.result.call_id
                        for u in uses)
    for size in (1, 3, 17):
        live = Fold()
        seen = []
        for at in range(0, len(events), size):
            tl = live.add(ws.store.events(job.id, after_id=live.last_id) if at + size >= len(events)
                          else events[at:at + size])
            seen.append(tl)
        assert tl == whole
        # a run that no new event touched is the same object in the next snapshot: only what changed is rebuilt
        assert any(a.runs[1] is b.runs[1] for a, b in itertools.pairwise(seen) if 2 in a.runs)
        assert timeline_html(ws, job.snapshot(), tl) == job_html(ws, job.id)
    # one event after another, as a live view receives them, until the job's last one
    live = Fold()
    for ev in events:
        live.add([ev])
    assert live.timeline() == whole and live.last_id == events[-1].id
