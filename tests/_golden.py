"""Golden "before/after" harness: a fixed set of scripted jobs and everything a user sees of them.

``python tests/_golden.py --write`` stores one ``tests/golden/<case>.json`` per case; ``test_golden.py``
builds every case again and compares.  A case runs in a fresh ``Workspace`` in a temporary folder
with ``scripted:`` models (and one ``demo`` job), so its jobs, ids and events are the same every time;
what still changes between two builds (clocks, latencies, the temporary folder) is masked, as
narrowly as possible, by ``normalise``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pkgutil
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _scripting import write_piece, write_script
from _snapshots import env, fixed_clock, locked_folder, normalise

import agentnb
from agentnb import Workspace

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"

# -- internals: the ONLY place that names agentnb modules below the top-level package -------------------
# Modules are about to move; each name is tried in order and the first module that has it wins.


def _internal(name: str, *modules: str) -> Any:
    for module in modules:
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise ImportError(f"golden harness: no {name} in any of {modules}")


job_html = _internal("job_html", "agentnb.render", "agentnb.views.render", "agentnb.views.html")
movement_html = _internal("movement_html", "agentnb.render", "agentnb.views.render", "agentnb.views.html")
unregister_tool = _internal("unregister", "agentnb.tools", "agentnb.tools.base", "agentnb.tools.registry")
# -----------------------------------------------------------------------------------------------------

Snap = Callable[[str, Any], None]


def call(tool: str, usage: int | None = None, said: str | None = None, **arguments: Any) -> dict[str, Any]:
    item: dict[str, Any] = {"tool_calls": [{"name": tool, "arguments": arguments}]}
    if said is not None:
        item["content"] = said
    if usage is not None:
        item["usage"] = {"prompt_tokens": usage, "completion_tokens": 17}
    return item


def transition(next_step: str, summary: str = "done", usage: int | None = None, **extra: Any) -> dict[str, Any]:
    return call("transition", usage=usage, next_step=next_step, summary=summary, **extra)


NOTES = "".join(f"note {i}: the quick brown fox jumps over the lazy dog\n" for i in range(2500))

CTX_PIECE = """\
name: ctx-golden
description: A custom-threshold piece written as YAML text.
max_movements: 5
context:
  window_tokens: 10000
  thresholds: {warn: 0.6, prompt: 0.75, force_transition: 0.9, exhausted: 0.97}
movements:
  - name: work
    persona: You work on notes.
    instruction: Work on the notes.
    tools: [Read, Grep]
    permission: readonly
    max_iterations: 12
    rules:
      - {condition: done, next: COMPLETE}
      - {condition: wrap up, next: wrap}
    default_next: wrap
  - name: wrap
    persona: You wrap up.
    instruction: Wrap up.
    tools: [Read]
    max_iterations: 4
    rules:
      - {condition: done, next: COMPLETE}
    default_next: ASK
"""


# -- the cases: each builds jobs in a fresh workspace and calls snap(label, job) where a user would look --


def case_demo(ws: Workspace, tmp: Path, snap: Snap) -> None:
    job = ws.run(ws.submit("Summarise input/notes.md", model="demo",
                           inputs={"notes.md": "- alpha\n- beta\n- gamma\n"}))
    snap("demo", job)


def case_single_tools(ws: Workspace, tmp: Path, snap: Snap) -> None:
    """single: every file tool, a truncated Read read on, tool errors, a reply without a tool call."""
    model = write_script(tmp, "single", responses=[
        call("Glob", usage=900, said="Looking around.", pattern="input/*"),
        call("Read", path="input/notes.md", limit=4000),
        call("Read", path="input/notes.md", offset=2400, limit=20),
        call("Grep", pattern="note 12[0-9]:", path="input"),
        call("Read", path="input/missing.md"),
        {"content": "Let me think about it."},
        call("Write", path="output/summary.md", content="# Summary\n\n2500 notes.\n"),
        call("Edit", path="output/summary.md", old="no such text", new="x"),
        call("Edit", path="output/summary.md", old="2500 notes", new="2,500 notes"),
        call("Checklist", name="todo", items=[{"text": "read", "done": True}, {"text": "write", "done": False}]),
        call("Bash", command="echo hi"),
        transition("COMPLETE", "summary written", lessons="the notes are uniform"),
    ])
    job = ws.run(ws.submit("Summarise input/notes.md into output/summary.md", piece="single", model=model,
                           inputs={"notes.md": NOTES}))
    snap("single", job)


def case_context(ws: Workspace, tmp: Path, snap: Snap) -> None:
    """A YAML-text piece with custom thresholds: warn, prompt (+ reminder), forced transition, then exhausted."""
    piece = agentnb.parse_piece(CTX_PIECE)  # a Piece object from YAML text; case_job_context uses the file
    model = write_script(tmp, "ctx", movements={
        "work": [call("Read", usage=u, path="input/notes.md", limit=3) for u in (1000, 6100, 6500, 7600, 8000, 9100)],
        "wrap": [call("Read", usage=500, path="input/notes.md", limit=2),
                 call("Read", usage=9800, path="input/notes.md", limit=2)],
    })
    job = ws.run(ws.submit("Work on input/notes.md", piece=piece, model=model, inputs={"notes.md": NOTES}))
    snap("forced", job)


def case_job_context(ws: Workspace, tmp: Path, snap: Snap) -> None:
    """A job's own context= overrides the piece file's; a model's own transition in the crossing response."""
    path = tmp / "ctx-golden.yaml"
    path.write_text(CTX_PIECE, encoding="utf-8")
    model = write_script(tmp, "jctx", movements={
        "work": [call("Read", usage=1000, path="input/notes.md", limit=3),
                 call("Read", usage=6500, path="input/notes.md", limit=3),
                 transition("COMPLETE", "done early", usage=19500, lessons="stop early")]})
    job = ws.run(ws.submit("Work on input/notes.md", piece=path, model=model, inputs={"notes.md": NOTES},
                           context={"window_tokens": 20000, "thresholds": {"warn": 0.3}}))
    snap("overridden", job)


def case_chars(ws: Workspace, tmp: Path, snap: Snap) -> None:
    """Token counts from characters (no tokenizer) and from tiktoken, on the same script."""
    model = write_script(tmp, "chars", responses=[
        call("Read", path="input/a.txt"), transition("COMPLETE", "read it", lessons="a is short")])
    with env("AGENTNB_TOKENIZER", "chars"):
        job = ws.run(ws.submit("Read input/a.txt", piece="single", model=model, inputs={"a.txt": "a\n"}))
    snap("chars", job)
    job = ws.run(ws.submit("Read input/a.txt", piece="single", model=model, inputs={"a.txt": "a\n"}))
    snap("tiktoken", job)


def case_ask_reply(ws: Workspace, tmp: Path, snap: Snap) -> None:
    model = write_script(tmp, "ask", movements={
        "clarify": [call("Glob", pattern="input/*"),
                    transition("ASK", "need the format", question="Short or long summary?", lessons="notes.md is a list"),
                    transition("work", "format is clear")],
        "work": [call("Write", path="output/summary.md", content="Résumé court."),
                 transition("COMPLETE", "written")]})
    job = ws.run(ws.submit("Summarise input/notes.md", piece="ask-first", model=model,
                           inputs={"notes.md": "- a\n- b\n"}))
    snap("waiting", job)
    ws.reply(job, "Short, please.")
    snap("replied", ws.job(job.id))
    snap("resumed", ws.run(job))


def case_verify(ws: Workspace, tmp: Path, snap: Snap) -> None:
    """plan-implement-verify: verify sends work back with feedback once, then completes."""
    model = write_script(tmp, "piv", movements={
        "plan": [transition("implement", "plan: write it", lessons="keep it short")],
        "implement": [call("Write", path="output/r.md", content="draft"), transition("verify", "drafted"),
                      call("Edit", path="output/r.md", old="draft", new="final"), transition("verify", "fixed")],
        "verify": [call("Read", path="output/r.md"),
                   transition("implement", "not final", feedback="Say final, not draft."),
                   transition("COMPLETE", "all good", lessons="feedback was used")]})
    job = ws.run(ws.submit("Write output/r.md", model=model))
    snap("verified", job)


def case_subtasks(ws: Workspace, tmp: Path, snap: Snap) -> None:
    """fan-out: three children (one runs out of script and fails), then the merge."""
    def child(name: str) -> str:
        return write_script(tmp, name, movements={"work": [
            call("Write", path="output/part.md", content=f"{name} result"), transition("COMPLETE", f"{name} done")]})

    broken = write_script(tmp, "broken", movements={"work": [call("Glob", pattern="*")]})
    subtasks = [{"instruction": "Do part one", "piece": "single", "model": child("one")},
                {"instruction": "Do part two", "piece": "single", "model": broken},
                {"instruction": "Do part three", "piece": "single", "model": child("three")}]
    model = write_script(tmp, "parent", movements={
        "split": [transition("WAIT_SUBTASKS", "split in parts", subtasks=subtasks, lessons="parts are independent")],
        "merge": [call("Glob", pattern="**"), transition("COMPLETE", "merged")]})
    parent = ws.submit("Do three parts", piece="fan-out", model=model)
    snap("waiting", ws.run(parent, subtasks=False))
    parent = ws.run(parent)
    snap("parent", parent)
    for i, c in enumerate(ws.children(parent), 1):
        snap(f"child{i}", c)


def case_retry(ws: Workspace, tmp: Path, snap: Snap) -> None:
    """A failed job (script ran out) retried from its movement; an aborted one retried at its movement."""
    piece = write_piece(tmp, "wr", {"name": "wr", "movements": [
        {"name": "work", "persona": "You work.", "instruction": "Work.", "tools": ["Write"], "permission": "edit",
         "rules": [{"condition": "done", "next": "review"}, {"condition": "impossible", "next": "ABORT"}]},
        {"name": "review", "persona": "You review.", "instruction": "Review.", "tools": [],
         "rules": [{"condition": "ok", "next": "COMPLETE"}]}]})
    model = write_script(tmp, "runs-out", responses=[call("Write", path="output/a.txt", content="A")])
    job = ws.run(ws.submit("task", piece=piece, model=model))
    snap("failed", job)
    write_script(tmp, "runs-out", responses=[call("Write", path="output/a.txt", content="A"),
                                             transition("review"), transition("COMPLETE")])
    snap("retried", ws.run(ws.retry(job)))
    model = write_script(tmp, "abort", responses=[transition("ABORT", "the input is missing"),
                                                  transition("review", "found it"), transition("COMPLETE")])
    job = ws.run(ws.submit("task", piece=piece, model=model))
    snap("aborted", job)
    snap("abort-retried", ws.run(ws.retry(job)))


def case_stepping(ws: Workspace, tmp: Path, snap: Snap) -> None:
    """step(unit="call"), step() by movement, a stop asked for by a tool (paused), then run to the end."""
    pause: dict[str, Any] = {}

    @agentnb.tool
    def pause_here() -> str:
        """Ask the workspace to pause this job, as a notebook's stop button would."""
        pause["ws"].stop(pause["job"])
        return "pausing"

    try:
        piece = write_piece(tmp, "steps", {"name": "steps", "movements": [
            {"name": "gather", "persona": "You gather.", "instruction": "Gather facts.",
             "tools": ["Read", "Glob", "Write", "pause_here"], "permission": "edit",
             "rules": [{"condition": "gathered", "next": "report"}]},
            {"name": "report", "persona": "You report.", "instruction": "Report.", "tools": ["Read"],
             "rules": [{"condition": "reported", "next": "COMPLETE"}]}]})
        model = write_script(tmp, "steps-model", responses=[
            call("Glob", pattern="input/*"), call("Read", path="input/a.txt"), call("pause_here"),
            call("Write", path="output/facts.txt", content="a is one"),
            transition("report", "gathered", lessons="a is one"),
            call("Read", path="output/facts.txt"), transition("COMPLETE", "reported")])
        job = ws.submit("collect", piece=piece, model=model, inputs={"a.txt": "one\n"})
        snap("queued", job)
        snap("one-call", ws.step(job, unit="call"))
        pause.update(ws=ws, job=job)
        snap("paused", ws.run(job))
        snap("one-movement", ws.step(job))
        snap("done", ws.run(job))
    finally:
        unregister_tool("pause_here")


def case_openai(ws: Workspace, tmp: Path, snap: Snap) -> None:
    """openai: through a loopback server speaking the OpenAI protocol: the endpoint's usage, a 500 retried,
    a reply without a tool call (reminder), then a transition."""
    from openai_server import OpenAIServer, error, reply

    actions = [
        reply("Looking.", [("Read", {"path": "input/notes.md", "limit": 5})], usage=(1200, 30)),
        *error(500, times=1),
        reply(None, [("Write", {"path": "output/a.md", "content": "x"})], usage=(1500, 20)),
        reply("Nothing to call.", usage=(1600, 5)),
        reply(None, [("transition", {"next_step": "COMPLETE", "summary": "done"})], usage=(1800, 15)),
    ]
    with OpenAIServer(actions=actions) as srv, env("OPENAI_BASE_URL", srv.base_url), \
            env("OPENAI_API_KEY", "sk-golden-test-key-0000"), env("AGENTNB_OPENAI_BACKOFF", "0.01"), \
            env("AGENTNB_OPENAI_TIMEOUT", "5"), env("AGENTNB_OPENAI_RETRIES", "3"):
        job = ws.run(ws.submit("Copy a line of input/notes.md to output/a.md", piece="single",
                               model="openai:gpt-4o-mini", inputs={"notes.md": NOTES}))
    snap("openai", job)


def case_fanout_ja(ws: Workspace, tmp: Path, snap: Snap) -> None:
    """A Japanese fan-out piece from a file: two children (one aborts), a lesson, then the merge."""
    piece = write_piece(tmp, "bunkatsu", {
        "name": "bunkatsu", "description": "分割して統合する。", "language": "ja", "max_movements": 4,
        "movements": [
            {"name": "split", "persona": "あなたは作業を分割します。", "instruction": "作業を分割してください。",
             "tools": ["Read", "Glob", "Grep", "Write", "Edit", "Checklist"], "permission": "edit",
             "rules": [{"condition": "分割できた", "next": "WAIT_SUBTASKS"}], "default_next": "merge"},
            {"name": "merge", "persona": "あなたは結果をまとめます。", "instruction": "結果を output/結果.md にまとめる。",
             "tools": ["Read", "Glob", "Write"], "permission": "edit",
             "rules": [{"condition": "書けた", "next": "COMPLETE"}]}]})
    ok = write_script(tmp, "ko-ok", movements={"work": [
        call("Write", path="output/部分.md", content="第一部の結果"), transition("COMPLETE", "第一部 完了")]})
    gives_up = write_script(tmp, "ko-abort", movements={"work": [
        call("Read", path="input/無い.md"), transition("ABORT", "入力がありません")]})
    model = write_script(tmp, "oya", movements={
        "split": [call("Checklist", name="計画", items=[{"text": "分割", "done": True}]),
                  transition("WAIT_SUBTASKS", "二つに分割", lessons="部分は独立している",
                             subtasks=[{"instruction": "第一部をやる", "piece": "single", "model": ok},
                                       {"instruction": "第二部をやる", "piece": "single", "model": gives_up}])],
        "merge": [call("Glob", pattern="**"), call("Write", path="output/結果.md", content="統合 ✓"),
                  transition("COMPLETE", "統合した", lessons="一つは中止された")]})
    parent = ws.run(ws.submit("二つの部分を作る", piece=piece, model=model, inputs={"メモ.md": "- 一\n- 二\n"}))
    snap("parent", parent)


def case_forced_ask(ws: Workspace, tmp: Path, snap: Snap) -> None:
    """A job's context= overrides (window, thresholds, tool minimum) force an ASK; the reply resumes it."""
    piece = write_piece(tmp, "asker", {
        "name": "asker", "max_movements": 3,
        "context": {"window_tokens": 50000, "thresholds": {"warn": 0.7, "prompt": 0.8}},
        "movements": [{"name": "dig", "persona": "You dig.", "instruction": "Dig through the notes.",
                       "tools": ["Read", "Grep"], "permission": "readonly", "max_iterations": 9,
                       "rules": [{"condition": "found", "next": "COMPLETE"}], "default_next": "ASK"}]})
    model = write_script(tmp, "asker-model", responses=[
        call("Read", usage=800, path="input/notes.md", limit=40),
        call("Grep", usage=2600, pattern="note 7[0-9]:", path="input"),
        call("Read", usage=3300, path="input/notes.md", offset=100, limit=30),
        call("Read", usage=4100, path="input/notes.md", offset=300, limit=5),
        call("Read", usage=900, path="input/notes.md", limit=1),
        transition("COMPLETE", "found it", usage=1000, lessons="ask early")])
    job = ws.run(ws.submit("Find note 77", piece=piece, model=model, inputs={"notes.md": NOTES},
                           context={"window_tokens": 5000, "min_tool_tokens": 300,
                                    "thresholds": {"warn": 0.4, "prompt": 0.5, "force_transition": 0.75}}))
    snap("asked", job)
    ws.reply(job, "Look again from the top.")
    snap("resumed", ws.run(job))


def case_crash_retry(ws: Workspace, tmp: Path, snap: Snap) -> None:
    """A run interrupted inside a tool with an effect (not run again on restart: the model is told), resumed
    by a fresh Workspace; then the script runs out (failed) and a retry finishes the job."""
    state = {"left": 1}

    @agentnb.tool
    def stamp(text: str) -> str:
        """Stamp a text (interrupted the first time, after its effect)."""
        (tmp / "stamps.txt").open("a", encoding="utf-8").write(text + "\n")
        if state["left"]:
            state["left"] -= 1
            raise KeyboardInterrupt
        return f"stamped {text}"

    try:
        piece = write_piece(tmp, "stamper", {"name": "stamper", "movements": [
            {"name": "stamp", "persona": "You stamp.", "instruction": "Stamp twice.",
             "tools": ["stamp", "Read", "Write"], "permission": "edit",
             "rules": [{"condition": "stamped", "next": "COMPLETE"}]}]})
        model = write_script(tmp, "stamper-model", responses=[
            {"content": "Stamping.", "tool_calls": [{"name": "stamp", "arguments": {"text": "one"}},
                                                    {"name": "Read", "arguments": {"path": "input/a.txt"}}]},
            call("stamp", text="two")])
        job = ws.submit("stamp things", piece=piece, model=model, inputs={"a.txt": "a\n"})
        with contextlib.suppress(KeyboardInterrupt):
            ws.run(job)
        snap("interrupted", ws.job(job.id))
        job = Workspace(ws.root).run(job.id)
        snap("failed", job)
        write_script(tmp, "stamper-model", responses=[
            {"content": "Stamping.", "tool_calls": [{"name": "stamp", "arguments": {"text": "one"}},
                                                    {"name": "Read", "arguments": {"path": "input/a.txt"}}]},
            call("stamp", text="two"), call("Write", path="output/done.txt", content="2 stamps"),
            transition("COMPLETE", "stamped", lessons="stamps are not idempotent")])
        snap("retried", ws.run(ws.retry(job)))
    finally:
        unregister_tool("stamp")


CASES: dict[str, Callable[[Workspace, Path, Snap], None]] = {
    name[len("case_"):].replace("_", "-"): fn for name, fn in globals().items() if name.startswith("case_")}


# -- what a user sees of one job ---------------------------------------------------------------------------


def _stored_events(ws: Workspace, job_id: int) -> list[dict[str, Any]]:
    """Every stored event, read with sqlite3 (the stored JSON is the contract), long texts put back."""
    db = sqlite3.connect(f"file:{ws.root / 'agentnb.sqlite'}?mode=ro", uri=True)
    try:
        texts = dict(db.execute("SELECT hash, body FROM texts").fetchall())
        rows = db.execute("SELECT kind, movement_seq, iteration, ts, payload FROM events WHERE job_id=? ORDER BY id",
                          (job_id,)).fetchall()
    finally:
        db.close()
    out = []
    for kind, seq, iteration, ts, payload in rows:
        data = json.loads(payload)
        for key, ref in data.pop("_texts", {}).items():
            data[key] = texts[ref]
        out.append({"kind": kind, "movement_seq": seq, "iteration": iteration, "ts": ts, "payload": data})
    return out


def _frame(df: Any) -> dict[str, Any]:
    return {"columns": [str(c) for c in df.columns], "dtypes": [str(t) for t in df.dtypes],
            "records": json.loads(df.to_json(orient="records", date_format="iso", default_handler=str)),
            "attrs": json.loads(json.dumps(dict(df.attrs), default=str))}


def _frames(ws: Workspace, job: Any) -> dict[str, Any]:
    names = ("movements", "messages", "tool_calls", "usage", "context_actions", "lessons")
    out = {n: _frame(getattr(ws.frames, n)(job)) for n in names}
    out["thresholds"] = ws.frames.thresholds(job)
    return out


def _cli(ws: Workspace, *args: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120", "AGENTNB_WORKSPACE": str(ws.root)}
    exe = shutil.which("agentnb") or "agentnb"
    p = subprocess.run([exe, *args], check=False, capture_output=True, text=True, env=env, cwd=ws.root, timeout=60)
    return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}


def _json_lines(out: dict[str, Any]) -> dict[str, Any]:
    """CLI output that is JSON is compared parsed (key order ignored, volatile keys masked)."""
    return {**out, "stdout": [json.loads(line) for line in out["stdout"].splitlines()]}


def _plot_labels(job: Any) -> list[str]:
    from matplotlib.text import Text

    fig = agentnb.plot_usage(job)
    return sorted(t.get_text() for t in fig.findobj(Text) if t.get_text())


def _notebook(ws: Workspace, job: Any, tmp: Path) -> list[dict[str, Any]]:
    path = ws.export_notebook(job, tmp / f"export-{job.id}.ipynb")
    cells = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        outputs = []
        for o in cell.get("outputs", []):
            data = dict(o.get("data", {}))
            if "image/png" in data:
                data["image/png"] = "<png>"  # pixels are not compared; the plot's labels are
            outputs.append({**o, "data": data})
        cells.append({"cell_type": cell["cell_type"], "source": cell["source"], "metadata": cell["metadata"],
                      "outputs": outputs})
    return cells


def snapshot(ws: Workspace, job: Any, tmp: Path | None = None) -> dict[str, Any]:
    """Everything a user sees of ``job`` (normalise() masks what changes from run to run)."""
    job = ws.job(job.id if hasattr(job, "id") else job)
    seqs = sorted({m["seq"] for m in ws.movements(job)})
    snap: dict[str, Any] = {
        **glance(ws, job),
        "events": _stored_events(ws, job.id),
        "comments": ws.comments(job),
        "movements": ws.movements(job),
        "frames": _frames(ws, job),
        "html_full": job_html(ws, job.id, full=True),
        "movement_html": {str(s): movement_html(ws, job.id, s) for s in seqs},
        "plot_labels": _plot_labels(job),
        "cli_events": _json_lines(_cli(ws, "show", str(job.id), "--events")),
    }
    if tmp is not None:
        snap["notebook"] = _notebook(ws, job, tmp)
    return snap


def glance(ws: Workspace, job: Any) -> dict[str, Any]:
    """What a user sees of a job part-way (its final state is in the full snapshot): fields, views, CLI show."""
    job = ws.job(job.id if hasattr(job, "id") else job)
    fields = ("id", "parent_id", "piece", "model", "instruction", "status", "current_movement", "resume_movement",
              "movement_seq", "error", "workdir")
    # status is an enum and workdir a Path: a user reads both as their text
    return {"job": {f: str(getattr(job, f)) if f in ("status", "workdir") else getattr(job, f) for f in fields},
            "repr": repr(job), "html": job._repr_html_(), "cli_show": _cli(ws, "show", str(job.id)),
            "event_count": len(ws.events(job))}


def workspace_views(ws: Workspace) -> dict[str, Any]:
    return {"jobs_frame": _frame(ws.frames.jobs()), "cli_jobs": _cli(ws, "jobs"),
            "cli_jobs_json": _json_lines(_cli(ws, "jobs", "--json"))}


def build(name: str) -> dict[str, Any]:
    """Run one case in a fresh workspace and return its normalised snapshots."""
    for info in pkgutil.walk_packages(agentnb.__path__, "agentnb."):
        with contextlib.suppress(ImportError):
            importlib.import_module(info.name)  # all loaded before fixed_clock() looks for who holds datetime
    with locked_folder("agentnb-golden", name) as tmp, fixed_clock():
        ws = Workspace(tmp / "ws")
        steps: dict[str, Any] = {}

        def snap(label: str, job: Any) -> None:
            steps[label] = glance(ws, job)

        CASES[name](ws, tmp, snap)
        out = {"steps": steps, "workspace": workspace_views(ws),
               "jobs": {str(j.id): snapshot(ws, j, tmp) for j in sorted(ws.jobs(), key=lambda j: j.id)}}
        return json.loads(json.dumps(normalise(out, str(tmp)), sort_keys=True, default=str))


def dump(data: Any) -> str:
    return json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    names = [a for a in argv if not a.startswith("--")] or list(CASES)
    for name in names:
        text = dump(build(name))
        if "--write" in argv:
            GOLDEN.mkdir(exist_ok=True)
            (GOLDEN / f"{name}.json").write_text(text, encoding="utf-8")
        print(f"{name}: {len(text):,} bytes")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main(sys.argv[1:]))
