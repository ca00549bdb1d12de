"""Parity check: unseen scripted jobs, built by two versions of agentnb, compared for everything a user sees.

A refactor that must not change behaviour (issue 27: one execution path, one view model, typed records) is
checked here the way a reviewer checks it: jobs that are *not* in ``tests/golden`` are generated at random
(seeded, so both versions build the same ones), each version runs them in a fresh workspace, and what a user
sees of them is dumped and compared.  The jobs cover: every packaged piece (``agentnb/pieces/``) on a random
walk of its rules (multi-movement, ASK answered by a reply, WAIT_SUBTASKS fan-out with a failing child,
ABORT), a piece with Bash/Write/Read/Edit/Grep/Checklist and a custom tool that fails, tools a movement does
not have, replies without a tool call, context pressure (warn, prompt, forced transition) and compaction,
a loop monitor and its judge, comments, a failed job retried, an aborted one retried, an ``openai:`` job on
a loopback server answering 500 and 429 (the client's retries), stepping by call and movement, a fork
and its comparison, a replay, a small batch with scores (Python and CLI) and a what-if.

For every job: its stored events (ids, clocks and latencies masked), every ``ws.frames.*`` DataFrame
(``what_if`` included), the job view (``_repr_html_``, ``job_html(full=True)``, ``movement_html``), the
nbformat transcript (``ws.export_notebook``), the usage plot's labels, and the ``agentnb`` CLI's ``show``
and ``show --events``; for the workspace: ``frames.jobs()``, ``agentnb jobs``/``jobs --json``/``batches``,
the batch's frame, summary and HTML, ``agentnb batch``'s table, and the comparison's frame, files and HTML.

The script imports whatever ``agentnb`` the interpreter finds, so one file checks any two checkouts::

    OLD=/path/to/old/checkout   # with its own venv, or PYTHONPATH=$OLD
    /old/venv/bin/python benchmarks/parity.py dump /tmp/old.json
    /new/venv/bin/python benchmarks/parity.py dump /tmp/new.json
    python benchmarks/parity.py diff /tmp/old.json /tmp/new.json     # each difference, grouped; rc 1 if any

``--seed`` picks another set of jobs, ``--jobs`` how many random walks (default 14; the special cases are
always built), ``--postgres`` keeps the jobs in a throw-away PostgreSQL cluster (``tests/_postgres.py``).  The CLI runs in-process (``agentnb.cli.main``) so it is the imported version's.  Token
counts hang on every character of a prompt (the date, the paths), so the clock is fixed, TZ is UTC and the
jobs run in the same folder for both versions; what still changes between two runs is masked by
``normalise`` (clock readings, durations, the temporary folder, the claiming process).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import pkgutil
import random
import re
import sqlite3
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

import agentnb
from agentnb import Workspace

TESTS = Path(__file__).resolve().parent.parent / "tests"  # the loopback OpenAI server and the masks, not agentnb code
sys.path.insert(0, str(TESTS))
from _snapshots import (  # type: ignore[import-not-found]  # noqa: E402
    STYLER_MASK,
    VOLATILE_KEYS,
    differences,
    env,
    excerpt,
    fixed_clock,
    locked_folder,
    normalise,
)

# besides the golden tests' keys: the batch's and the comparison's measured seconds
VOLATILE = VOLATILE_KEYS | {"elapsed_s", "seconds", "p50_seconds", "p95_seconds", "mean_seconds", "mean_seconds_se",
                            "mean_seconds_ci_low", "mean_seconds_ci_high"}
NOTES = "".join(f"note {i}: alpha beta gamma delta\n" for i in range(300))
TERMINAL = ("COMPLETE", "ABORT")
STORE: list[str] = []  # the PostgreSQL URL of a --postgres run (the CLI and the magic open it too)


# -- scripts --------------------------------------------------------------------------------------------------


def _dump_yaml(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


def script(folder: Path, name: str, movements: dict[str, list[dict[str, Any]]] | None = None,
           responses: list[dict[str, Any]] | None = None) -> str:
    data: dict[str, Any] = {}
    if responses is not None:
        data["responses"] = responses
    if movements is not None:
        data["movements"] = movements
    return f"scripted:{_dump_yaml(folder / f'{name}.yaml', data)}"


def call(tool: str, usage: int | None = None, said: str | None = None, **arguments: Any) -> dict[str, Any]:
    item: dict[str, Any] = {"tool_calls": [{"name": tool, "arguments": arguments}]}
    if said is not None:
        item["content"] = said
    if usage is not None:
        item["usage"] = {"prompt_tokens": usage, "completion_tokens": 11 + usage % 29}
    return item


def transition(next_step: str, summary: str = "done", usage: int | None = None, **extra: Any) -> dict[str, Any]:
    return call("transition", usage=usage, next_step=next_step, summary=summary, **extra)


def random_call(rng: random.Random, tools: tuple[str, ...] | list[str], usage: int | None = None) -> dict[str, Any]:
    """One random response: a tool of the movement (or, now and then, one it does not have, or none)."""
    roll = rng.random()
    if roll < 0.08:
        return {"content": rng.choice(["Thinking.", "Let me see…", "Nothing to call yet."])}
    tool = rng.choice(["Frobnicate", "Bash"]) if roll < 0.14 or not tools else rng.choice(list(tools))
    said = rng.choice([None, None, "Looking.", "Next: «check» & <verify>."])
    n = rng.randint(0, 400)
    args: dict[str, Any] = {
        "Read": lambda: rng.choice([{"path": "input/notes.md", "limit": rng.randint(1, 30)},
                                    {"path": "input/notes.md", "offset": n, "limit": 5},
                                    {"path": "input/missing.md"}, {"path": "output/out.md"}]),
        "Write": lambda: {"path": rng.choice(["output/out.md", "output/b.txt", "../escape.txt"]),
                          "content": f"result {n}\nline two ✓\n"},
        "Edit": lambda: rng.choice([{"path": "output/out.md", "old": "result", "new": "Result"},
                                    {"path": "output/out.md", "old": "no such text", "new": "x"},
                                    {"path": "input/notes.md", "old": f"note {n}:", "new": "NOTE:"}]),
        "Glob": lambda: {"pattern": rng.choice(["**", "input/*", "output/*.md", "nothing/*"])},
        "Grep": lambda: rng.choice([{"pattern": f"note {n % 50}[0-9]:", "path": "input"},
                                    {"pattern": "([unclosed", "path": "input"}, {"pattern": "zzz"}]),
        "Checklist": lambda: {"name": "todo", "items": [{"text": "read", "done": True},
                                                       {"text": f"write {n}", "done": rng.random() < 0.5}]},
        "Bash": lambda: {"command": rng.choice(["echo hi", "wc -l input/notes.md", "exit 3",
                                                "printf 'a\\nb\\n' > output/b.txt && cat output/b.txt",
                                                "ls output"])},
        "flaky": lambda: {"text": rng.choice(["ok", "fail", "boom"])},
        "Frobnicate": lambda: {"x": 1},
    }
    return call(tool, usage=usage, said=said, **args.get(tool, lambda: {})())


@agentnb.tool
def flaky(text: str) -> str:
    """Echo a text; 'fail' raises a ToolError, 'boom' an unexpected error."""
    if text == "fail":
        raise agentnb.ToolError("flaky: asked to fail")
    if text == "boom":
        raise RuntimeError("flaky exploded")
    return f"flaky: {text}"


TICKS = [0]


@agentnb.tool
def tick() -> str:
    """A counter: a fork that runs it again gets another answer (a replay_divergence)."""
    TICKS[0] += 1
    return f"tick {TICKS[0]}"


TOOLBOX = {
    "max_movements": 6,
    "context": {"window_tokens": 12000},
    "movements": [
        {"name": "build", "persona": "You build.", "instruction": "Build output/out.md.",
         "tools": ["Read", "Write", "Edit", "Bash", "Glob", "Grep", "Checklist", "flaky", "tick"], "permission": "full",
         "max_iterations": 12, "rules": [{"condition": "built", "next": "check"},
                                          {"condition": "impossible", "next": "ABORT"}], "default_next": "check"},
        {"name": "check", "persona": "You check.", "instruction": "Check output/out.md.",
         "tools": ["Read", "Bash", "Grep"], "permission": "readonly", "max_iterations": 8,
         "rules": [{"condition": "good", "next": "COMPLETE"}, {"condition": "bad", "next": "build"}]},
    ],
}


def walk(rng: random.Random, piece: Any, folder: Path, tag: str, *, usage: bool, depth: int = 0
         ) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """A random walk over ``piece``'s rules as a script: each visit some tool calls, then a transition."""
    moves: dict[str, list[dict[str, Any]]] = defaultdict(list)
    default: list[dict[str, Any]] = []  # loop monitors' judges (and anything else not named)
    current = piece.movements[0].name
    prompt = rng.randint(300, 2000)
    for _ in range(piece.max_movements):
        mv = piece.movement(current)
        out = moves[current]
        for _ in range(rng.randint(0, 4)):
            prompt += rng.randint(50, 900)
            out.append(random_call(rng, mv.tools, usage=prompt if usage else None))
        options = [r.next for r in mv.rules] + ([mv.default_next] if mv.default_next else [])
        nxt = rng.choice(options + ["ASK"] * (rng.random() < 0.15) + ["ABORT"] * (rng.random() < 0.05))
        extra: dict[str, Any] = {}
        if rng.random() < 0.4:
            extra["lessons"] = f"lesson {rng.randint(1, 99)} of {current}"
        if nxt == "ASK":
            extra["question"] = f"Which part of {current} first?"
        if nxt == "WAIT_SUBTASKS":
            extra["subtasks"] = [child(rng, folder, f"{tag}-c{i}", depth) for i in range(rng.randint(1, 3))]
        if nxt in ("fix", "implement") and rng.random() < 0.5:
            extra["feedback"] = "Say final, not draft."
        out.append(transition(nxt, f"{current} → {nxt}", usage=prompt if usage and rng.random() < 0.5 else None,
                              **extra))
        if nxt in TERMINAL:
            break
        if nxt == "ASK":
            continue  # the reply resumes the same movement
        current = (mv.default_next or piece.movements[-1].name) if nxt == "WAIT_SUBTASKS" else nxt
        if current not in piece.names:  # a judge: the monitor's rules decide, the default list answers
            break
    for lm in piece.loop_monitors:
        if lm.judge is not None:
            moves[lm.judge.name] = [transition(r.next, "judged") for r in lm.judge.rules]
    return dict(moves), default


def child(rng: random.Random, folder: Path, name: str, depth: int) -> dict[str, Any]:
    piece = agentnb.load_piece("single")
    moves, _ = walk(rng, piece, folder, name, usage=False, depth=depth + 1)
    if rng.random() < 0.25:
        moves["work"] = moves["work"][:-1]  # runs out of script: the child fails
    return {"instruction": f"Do {name}", "piece": "single", "model": script(folder, name, moves)}


# -- the jobs ---------------------------------------------------------------------------------------------------


def finish(ws: Workspace, job: Any, rng: random.Random) -> Any:
    """Run a job until it stops, answering each question it or its subtasks ask (at most five rounds)."""
    job = ws.run(job)
    for _ in range(5):
        asking = [j for j in [job, *ws.children(job)] if str(j.status) == "waiting_human"]
        if not asking:
            break
        for j in asking:
            ws.reply(j, rng.choice(["Short, please.", "Start with «part one».", "Go on."]))
            if j.id != job.id:
                ws.run(j)
        job = ws.run(job)
    return job


def build_jobs(ws: Workspace, tmp: Path, seed: int, walks: int) -> dict[str, Any]:
    """Every job of the set; returns what is built besides the jobs (batch, comparison)."""
    rng = random.Random(seed)
    extra: dict[str, Any] = {}
    toolbox = _dump_yaml(tmp / "toolbox.yaml", {"name": "toolbox", **TOOLBOX})
    choices: list[Any] = [*agentnb.available_pieces(), str(toolbox), str(toolbox)]
    for i in range(walks):
        name = choices[i % len(choices)] if i < len(choices) else rng.choice(choices)
        piece = agentnb.load_piece(name)
        moves, default = walk(rng, piece, tmp, f"w{i}", usage=rng.random() < 0.6)
        model = script(tmp, f"w{i}", moves, default or None)
        finish(ws, ws.submit(f"Walk {i} through {piece.name}", piece=name, model=model,
                             inputs={"notes.md": NOTES, "a.txt": "alpha\n"}), rng)

    # context pressure: a window the usage ramps through (warn, prompt + reminder, forced transition)
    window = rng.choice([4000, 6000])
    ramp = sorted(rng.sample(range(window // 5, window), 6))
    pressure = finish(ws, ws.submit("Under pressure", piece=str(toolbox), model=script(tmp, "pressure", {
        "build": [random_call(rng, ["Read", "Bash", "Write", "flaky"], usage=u) for u in ramp],
        "check": [call("Read", usage=window // 2, path="output/out.md"), transition("COMPLETE", "ok", usage=window)]}),
        inputs={"notes.md": NOTES}, context={"window_tokens": window,
                                             "thresholds": {"warn": 0.5, "prompt": 0.7, "force_transition": 0.85}}),
        rng)
    extra["what_if"] = [pressure.id, {"window": window * 2}, {"window": window // 2,
                                                              "thresholds": {"warn": 0.3}}]

    # compaction: twice, then forced
    def glob(p: int) -> dict[str, Any]:
        return call("Glob", usage=p, pattern="*")

    work = {"name": "work", "instruction": "Work.", "tools": ["Glob", "Read"], "rules": [{"next": "COMPLETE"}],
            "default_next": "COMPLETE"}
    compact = _dump_yaml(tmp / "compact.yaml", {"name": "compact", "context": {
        "window_tokens": 1000, "on_pressure": "compact", "compact_keep_last": rng.choice([1, 2])},
        "movements": [work]})
    finish(ws, ws.submit("Compact it", piece=str(compact), model=script(tmp, "compact-script", {"work": [
        glob(500), glob(rng.randint(880, 940)), {"content": "summary one", "usage": {"prompt_tokens": 950,
                                                                                     "completion_tokens": 20}},
        glob(300), glob(rng.randint(860, 900)), {"content": "summary two"}, glob(400), glob(960),
        transition("COMPLETE")]})), rng)

    # a loop monitor: review ⇄ fix until the judge stops it
    loop_piece = agentnb.load_piece("review-loop")
    rounds = 3
    moves = {"write": [call("Write", path="output/out.md", content="draft"), transition("review", "wrote")],
             "review": [transition("fix", f"review {r}", feedback=f"issue {r}") for r in range(rounds)],
             "fix": [transition("review", f"fix {r}") for r in range(rounds)]}
    judge = loop_piece.loop_monitors[0].judge
    assert judge is not None
    moves[judge.name] = [transition(rng.choice([r.next for r in judge.rules]), "judged")]
    moves["review"].append(transition("COMPLETE", "fine at last"))
    finish(ws, ws.submit("Loop", piece="review-loop", model=script(tmp, "loop", moves)), rng)

    # a fan-out whose children run (one failing, some asking), then a reply to it refused
    fan = agentnb.load_piece("fan-out")
    moves, _ = walk(rng, fan, tmp, "fan", usage=False)
    moves["split"] = [call("Checklist", name="plan", items=[{"text": "split", "done": True}]),
                      transition("WAIT_SUBTASKS", "split", subtasks=[child(rng, tmp, f"fan-c{i}", 0)
                                                                      for i in range(3)])]
    moves["merge"] = [call("Glob", pattern="**"), transition("COMPLETE", "merged")]
    parent = finish(ws, ws.submit("Fan out", piece="fan-out", model=script(tmp, "fan", moves)), rng)
    extra["cli_reply_ended"] = cli(ws, "reply", str(parent.id), "Thanks — looks fine.")  # refused: it ended

    # a job left waiting for its answer, and one waiting for a subtask that waits for its answer
    asks = script(tmp, "asks", {"clarify": [call("Glob", pattern="input/*"),
                                            transition("ASK", "unclear", question="Which format?")]})
    ws.run(ws.submit("Ask and wait", piece="ask-first", model=asks))
    asker = {"instruction": "Ask", "piece": "ask-first", "model": asks}
    ws.run(ws.submit("Wait on a child", piece="fan-out", model=script(tmp, "waits", {
        "split": [transition("WAIT_SUBTASKS", "one part", subtasks=[asker])]})))

    # a failed job retried, an aborted one retried
    model = script(tmp, "runs-out", {"build": [call("Write", path="output/out.md", content="A")]})
    failed = ws.run(ws.submit("Run out", piece=str(toolbox), model=model))
    script(tmp, "runs-out", {"build": [call("Write", path="output/out.md", content="A"), transition("check")],
                             "check": [transition("COMPLETE", "fine")]})
    retried = ws.run(ws.retry(failed))
    model = script(tmp, "aborts", {"build": [transition("ABORT", "input missing"), call("Bash", command="echo again"),
                                             transition("check", "found it")], "check": [transition("COMPLETE")]})
    aborted = ws.run(ws.retry(ws.run(ws.submit("Abort then retry", piece=str(toolbox), model=model))))

    # an openai: job on a loopback server: a 500 and a 429 retried by the client
    from openai_server import OpenAIServer, error, reply  # type: ignore[import-not-found]

    actions = [reply("Looking.", [("Read", {"path": "input/notes.md", "limit": 3})], usage=(1200, 30)),
               *error(500, times=1), *error(429, times=1),
               reply(None, [("Write", {"path": "output/a.md", "content": "x"})], usage=(1500, 20)),
               reply(None, [("transition", {"next_step": "COMPLETE", "summary": "done"})], usage=(1800, 15))]
    with OpenAIServer(actions=actions) as srv, env("OPENAI_BASE_URL", srv.base_url), \
            env("OPENAI_API_KEY", "sk-parity-test-key-0000"), env("AGENTNB_OPENAI_BACKOFF", "0.01"), \
            env("AGENTNB_OPENAI_TIMEOUT", "5"), env("AGENTNB_OPENAI_RETRIES", "3"):
        ws.run(ws.submit("Copy a line", piece="single", model="openai:gpt-4o-mini", inputs={"notes.md": NOTES},
                         retries=3))

    # stepping: one call, one movement, then the rest
    moves, _ = walk(rng, agentnb.load_piece("plan-implement-verify"), tmp, "step", usage=True)
    job = ws.submit("Step it", piece="plan-implement-verify", model=script(tmp, "step", moves),
                    inputs={"notes.md": NOTES})
    ws.step(job, unit="call")
    ws.step(job)
    for _ in ws.iter(job, unit="call"):
        pass
    finish(ws, job, rng)

    # a fork (live from run 2 on another script) and its comparison; a replay
    base_moves = {"build": [call("Write", path="output/out.md", content="v1"), call("tick"),
                            transition("check", "built")],
                  "check": [call("Bash", command="cat output/out.md"), transition("build", "redo", feedback="v2"),
                            transition("COMPLETE", "good")]}
    base_moves["build"] += [call("Edit", path="output/out.md", old="v1", new="v2"), transition("check", "rebuilt")]
    original = ws.run(ws.submit("Fork me", piece=str(toolbox), model=script(tmp, "orig", base_moves)))
    fork = ws.fork(original, at=2, model=script(tmp, "forked", {"check": [
        call("Read", path="output/out.md"), transition("COMPLETE", "good at once")]}))
    extra["compare"] = [(original.id, fork.id), (retried.id, aborted.id)]
    ws.replay(original)

    # a small batch with scores, then the same cases through the CLI
    cases = [{"instruction": f"Case {i}", "inputs": {"notes.md": NOTES[: 200 * (i + 1)]}, "expected": i}
             for i in range(2)]
    models = [script(tmp, "batch-a", {"work": [call("Write", path="output/out.md", content="A"),
                                               transition("COMPLETE", "a")]}),
              script(tmp, "batch-b", {"work": [call("Read", path="input/notes.md", limit=2)]})]
    batch = ws.batch(cases, piece="single", model=models, name="parity", concurrency=1, progress=False,
                     scorers={"ok": lambda j: str(j.status) == "succeeded",
                              "size": lambda j: len(ws.events(j))})
    ws.score(batch, {"steps": lambda j: float(len(ws.movements(j)))})
    extra["batch"] = batch
    lines = tmp / "cases.jsonl"
    lines.write_text("".join(json.dumps({"instruction": f"CLI case {i}", "expected": i}) + "\n" for i in range(2)),
                     encoding="utf-8")
    extra["cli_batch"] = cli(ws, "batch", str(lines), "--piece", "single", "--model", models[0], "--model",
                             models[1], "--concurrency", "1", "--no-progress", "--name", "cli")
    extra["magic"] = magic(ws, tmp, rng, extra)
    return extra


def magic(ws: Workspace, tmp: Path, rng: random.Random, extra: dict[str, Any]) -> dict[str, Any]:
    """The %agent magic in a real IPython shell on this workspace: a job run (its view once it ended: how many
    times a live view redraws depends on timing), a reply, a step, then the views of existing jobs."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "agentnb")
    sh.run_line_magic("config", f"AgentMagic.workspace = {str(ws.root)!r}")
    sh.run_line_magic("config", f"AgentMagic.store = {STORE[0] if STORE else ''!r}")
    moves, _ = walk(rng, agentnb.load_piece("ask-first"), tmp, "magic", usage=True)
    moves["clarify"].insert(0, transition("ASK", "which length?", question="Short or long?"))
    sh.user_ns["p_model"] = script(tmp, "magic", moves)
    (tmp / "magic-notes.md").write_text(NOTES[:500], encoding="utf-8")
    out: dict[str, Any] = {}

    def cell(label: str, src: str, *, last_only: bool = False) -> None:
        with capture_output() as cap:
            result = sh.run_cell(src)
        value = result.result
        shown = [{k: v for k, v in o.data.items() if k in ("text/html", "text/plain")} for o in cap.outputs]
        out[label] = {"error": None if result.success else repr(result.error_in_exec or result.error_before_exec),
                      "outputs": shown[-1:] if last_only else shown,
                      # the Out[] echo is the value's text (measured latencies in it): the value is kept below
                      "stdout": "" if cap.stdout.startswith("Out[") else cap.stdout,
                      "value": value._repr_html_() if hasattr(value, "_repr_html_") else repr(value)}

    cell("run", f'p_job = %agent run --piece ask-first --model $p_model --input {tmp / "magic-notes.md"} '
                '"Summarise magic-notes.md"', last_only=True)
    if str(sh.user_ns["p_job"].status) == "waiting_human":
        cell("reply", '%agent reply --run p_job "Short, please."', last_only=True)
    queued = ws.submit("Stepped", piece="plan-implement-verify", model=script(tmp, "magic-step", walk(
        rng, agentnb.load_piece("plan-implement-verify"), tmp, "magic-step", usage=False)[0]))
    cell("step-call", f"%agent step {queued.id} --call", last_only=True)
    cell("step", f"%agent step {queued.id}", last_only=True)
    for job in ws.jobs():
        cell(f"show {job.id}", f"%agent show {job.id}")
    cell("show --movement", f"%agent show {queued.id} --movement 1 --full")
    cell("jobs", "%agent jobs")
    cell("usage", "%agent usage p_job")
    cell("usage --all", "%agent usage --all")
    cell("lessons --all", "%agent lessons --all")
    cell("batches", "%agent batches")
    for a, b in extra["compare"]:
        cell(f"compare {a} {b}", f"%agent compare {a} {b}")
    return out


# -- what a user sees ---------------------------------------------------------------------------------------------


def _internal(name: str, *modules: str) -> Any:
    for module in modules:
        with contextlib.suppress(ImportError):
            found = getattr(importlib.import_module(module), name, None)
            if found is not None:
                return found
    raise ImportError(f"parity: no {name} in any of {modules}")


def stored_events(ws: Workspace, job_id: int) -> list[dict[str, Any]]:
    """Every stored event as the store holds it (no id), long texts put back: the stored JSON is the contract."""
    sql = "SELECT kind, movement_seq, iteration, payload FROM events WHERE job_id={} ORDER BY id"
    if STORE:
        import psycopg

        with psycopg.connect(STORE[0]) as conn:
            texts = dict(conn.execute("SELECT hash, body FROM texts").fetchall())
            rows = conn.execute(sql.format("%s"), (job_id,)).fetchall()
    else:
        db = sqlite3.connect(f"file:{ws.root / 'agentnb.sqlite'}?mode=ro", uri=True)
        try:
            texts = dict(db.execute("SELECT hash, body FROM texts").fetchall())
            rows = db.execute(sql.format("?"), (job_id,)).fetchall()
        finally:
            db.close()
    out = []
    for kind, seq, iteration, payload in rows:
        data = json.loads(payload) if isinstance(payload, str) else payload
        for key, ref in data.pop("_texts", {}).items():
            data[key] = texts[ref]
        out.append({"kind": kind, "movement_seq": seq, "iteration": iteration, "payload": data})
    return out


def frame(df: Any) -> dict[str, Any]:
    return {"columns": [str(c) for c in df.columns], "dtypes": [str(t) for t in df.dtypes],
            "index": [str(i) for i in df.index],
            "records": json.loads(df.to_json(orient="records", date_format="iso", default_handler=str)),
            "attrs": json.loads(json.dumps(dict(df.attrs), default=str))}


FRAMES = ("movements", "messages", "tool_calls", "usage", "context_actions", "divergences", "compactions", "loops",
          "scores", "lessons")


def cli(ws: Workspace, *args: str) -> dict[str, Any]:
    """``agentnb ARGS`` in this process (the imported version's CLI), its exit code and output."""
    from agentnb.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), env("COLUMNS", "120"):
        try:
            rc = main(["--workspace", str(ws.root), *(["--store", STORE[0]] if STORE else []), *args])
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
    return {"rc": rc, "stdout": _readable(out.getvalue()), "stderr": err.getvalue()}


def _readable(text: str) -> Any:
    """JSON lines parsed (so that their clocks and latencies are masked by key); a batch table's measured
    seconds (its last three columns, mean_seconds ± half its interval, p50_seconds and p95_seconds) masked;
    anything else as it is."""
    lines = text.splitlines()
    with contextlib.suppress(ValueError):
        if lines and all(line.startswith(("{", "[")) for line in lines):
            return [json.loads(line) for line in lines]
    timed = False
    for i, line in enumerate(lines):
        if line.rstrip().endswith("p50_seconds  p95_seconds"):
            timed = True
        elif timed and re.search(r"\d\s+[\d.]+\s+[\d.]+$", line):
            lines[i] = re.sub(r"\s+(?:NA|[\d.e-]+(?: ± [\d.e-]+)?)\s+[\d.]+\s+[\d.]+$", " <seconds>", line)
        else:
            timed = False
    return "\n".join(lines)


def job_view(ws: Workspace, job: Any, tmp: Path) -> dict[str, Any]:
    from matplotlib.text import Text

    job_html = _internal("job_html", "agentnb.views.render")
    movement_html = _internal("movement_html", "agentnb.views.render")
    job = ws.job(job.id)
    seqs = sorted({m["seq"] for m in ws.movements(job)})
    fig = agentnb.plot_usage(job)
    labels = sorted(t.get_text() for t in fig.findobj(Text) if t.get_text())
    import matplotlib.pyplot as plt

    plt.close(fig)
    path = ws.export_notebook(job, tmp / f"export-{job.id}.ipynb")
    cells = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        outputs = [{**o, "data": {k: "<png>" if k == "image/png" else v for k, v in o.get("data", {}).items()}}
                   for o in cell.get("outputs", [])]
        cells.append({"cell_type": cell["cell_type"], "source": cell["source"], "metadata": cell["metadata"],
                      "outputs": outputs})
    return {
        "job": {f: str(getattr(job, f)) for f in ("id", "parent_id", "piece", "model", "instruction", "status",
                                                  "current_movement", "resume_movement", "movement_seq", "error")},
        "repr": repr(job), "summary": job.summary, "events": stored_events(ws, job.id),
        "comments": ws.comments(job), "movements": ws.movements(job),
        "frames": {**{n: frame(getattr(ws.frames, n)(job)) for n in FRAMES},
                   "thresholds": ws.frames.thresholds(job)},
        "html": job._repr_html_(), "html_full": job_html(ws, job.id, full=True),
        "movement_html": {str(s): movement_html(ws, job.id, s) for s in seqs},
        "plot_labels": labels, "notebook": cells,
        "cli_show": cli(ws, "show", str(job.id)), "cli_events": cli(ws, "show", str(job.id), "--events"),
    }


# the batch summary's last two cells of a row: the jobs' measured running seconds (the mean ± half its interval,
# with the p50 and the interval in its tooltip; the p95)
_BATCH_SECONDS = re.compile(r"<td[^>]*>(?:(?!</td>).)*</td><td[^>]*>[^<]*</td></tr>")


def snapshot(ws: Workspace, tmp: Path, extra: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"jobs": {str(j.id): job_view(ws, j, tmp) for j in sorted(ws.jobs(), key=lambda j: j.id)}}
    job_id, *settings = extra["what_if"]
    out["what_if"] = [frame(ws.frames.what_if(job_id, **s)) for s in settings]
    out["compare"] = []
    for a, b in extra["compare"]:  # a fork and its original; two unrelated jobs
        comparison = ws.compare(a, b)
        out["compare"].append({"frame": frame(comparison.frame), "files": frame(comparison.files()),
                               "first_divergence": comparison.first_divergence, "html": comparison._repr_html_()})
    batch = extra["batch"]
    out["batch"] = {"frame": frame(batch.frame), "summary": frame(batch.summary()),
                    "html": _BATCH_SECONDS.sub("<td><seconds></td><td><seconds></td></tr>", batch._repr_html_()),
                    "counts": batch.counts()}
    out["workspace"] = {"jobs_frame": frame(ws.frames.jobs()), "cli_jobs": cli(ws, "jobs"),
                        "cli_jobs_json": cli(ws, "jobs", "--json"), "cli_batches": cli(ws, "batches"),
                        "cli_batch": extra["cli_batch"],
                        "cli_reply_ended": extra["cli_reply_ended"], "magic": extra["magic"], "batches": ws.batches()}
    return out


# -- building and comparing (the fixed clock and folder, the masks: tests/_snapshots.py) ------------------------

def build(seed: int, walks: int, postgres: bool = False) -> dict[str, Any]:
    for info in pkgutil.walk_packages(agentnb.__path__, "agentnb."):
        with contextlib.suppress(ImportError):
            importlib.import_module(info.name)  # loaded before fixed_clock() looks for who holds datetime
    with contextlib.ExitStack() as stack:
        if postgres:  # a throw-away cluster (tests/_postgres.py), a fresh database in it
            from _postgres import pg_server  # type: ignore[import-not-found]

            STORE.append(stack.enter_context(pg_server()).create_database())
        tmp = stack.enter_context(locked_folder("agentnb-parity", f"seed-{seed}"))
        stack.enter_context(fixed_clock())
        stack.enter_context(env("AGENTNB_TOKENIZER", "chars"))
        ws = Workspace(tmp / "ws", store=STORE[0] if STORE else None)
        extra = build_jobs(ws, tmp, seed, walks)
        out = snapshot(ws, tmp, extra)
        out["agentnb"] = str(Path(agentnb.__file__).parent)
        ws.close()
        masked = normalise(out, str(tmp), volatile=VOLATILE, masks=[STYLER_MASK])
        text = json.dumps(masked, sort_keys=True, default=str)
        if STORE:  # its random database name and port
            text = text.replace(STORE[0], "<STORE>").replace(STORE[0].split("@", 1)[1], "<STORE>")
        data: dict[str, Any] = json.loads(text)
        return data


def report(old: dict[str, Any], new: dict[str, Any], limit: int) -> int:
    """Print each difference, grouped by where it is (job numbers folded); the number of differences."""
    diffs = [d for d in differences(old, new) if d[0] != "/agentnb"]
    groups: dict[str, list[tuple[str, Any, Any]]] = defaultdict(list)
    for d in diffs:
        groups[re.sub(r"^/jobs/\d+", "/jobs/*", re.sub(r"\[\d+\]", "[]", d[0]))].append(d)
    for where, found in sorted(groups.items()):
        print(f"{where}: {len(found)} difference(s)")
        for path, a, b in found[:limit]:
            ea, eb = excerpt(a, b)
            print(f"  {path}\n    old: {ea}\n    new: {eb}")
    print(f"{len(diffs)} difference(s) in {len(groups)} place(s); old {old.get('agentnb')}, new {new.get('agentnb')}")
    return len(diffs)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("dump", help="build the jobs with the imported agentnb; write what a user sees as JSON")
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=27)
    p.add_argument("--jobs", type=int, default=14, help="random walks over the pieces (besides the special jobs)")
    p.add_argument("--postgres", action="store_true", help="keep the jobs in a throw-away PostgreSQL cluster")
    p = sub.add_parser("diff", help="compare two dumps")
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--limit", type=int, default=3, help="differences printed per place")
    args = parser.parse_args(argv)
    if args.command == "dump":
        started = time.monotonic()
        data = build(args.seed, args.jobs, args.postgres)
        Path(args.out).write_text(json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n",
                                  encoding="utf-8")
        print(f"{len(data['jobs'])} jobs from {data['agentnb']} in {time.monotonic() - started:.0f} s → {args.out}")
        return 0
    old, new = (json.loads(Path(p).read_text(encoding="utf-8")) for p in (args.old, args.new))
    return 1 if report(old, new, args.limit) else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
