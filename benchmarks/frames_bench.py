"""How fast are the DataFrame views on a large store?

Fills a fresh workspace with 500 jobs × 200 LLM calls = 100,000 ``llm_response``
events (plus the ``llm_request``, ``tool_call``, ``tool_result``, ``context_action``,
``movement_start``, ``transition``, ``lesson`` and ``job_status`` events around them,
in the shapes the engine writes), then times

* ``ws.frames.usage()`` (every job), ``ws.frames.usage(job)`` (one job) and ``ws.frames.jobs()``,
  and, on its own, the pricing behind their ``cost_usd`` column (``prices.cost_array`` on 100,000 calls)

against two baselines:

* ``pandas.read_sql("SELECT * FROM events")`` — the bare read of the events table;
* ``pandas.read_sql("SELECT * FROM events WHERE kind='llm_response'")`` — only the rows
  ``usage()`` needs, still with their JSON unparsed (the stricter baseline).

Each timing is the best of ``--repeat`` runs.  Run::

    python benchmarks/frames_bench.py                 # 500 jobs × 200 calls
    python benchmarks/frames_bench.py --jobs 50 --calls 100 --keep /tmp/bench-ws

Prints the times and the ratios (view time / baseline time); lower is better.
"""

from __future__ import annotations

import argparse
import platform
import random
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentnb import Workspace
from agentnb.engine.pieces import DEFAULT_THRESHOLDS, load_piece
from agentnb.events import event_from_row
from agentnb.models.prices import cost_array

MOVEMENTS = ("plan", "implement", "verify", "implement")
TOOLS = ("Read", "Grep", "Glob", "Write")


def fill(ws: Workspace, jobs: int, calls: int, seed: int = 7) -> None:
    """Write ``jobs`` finished jobs of ``calls`` LLM calls each, straight through the store."""
    rng = random.Random(seed)
    piece = load_piece("plan-implement-verify")
    store = ws.store
    window = 128_000
    per_movement = max(1, calls // len(MOVEMENTS))
    for j in range(jobs):
        t = 1_700_000_000.0 + j * 600
        job_id = store.create_job(piece=piece.name, piece_yaml=piece.to_yaml(), piece_path=piece.source,
                                  model="openai:gpt-4o", instruction=f"Benchmark task {j}", status="running",
                                  workdir=str(ws.root / "jobs" / str(j + 1)), options={}, created=t, updated=t,
                                  started=t)
        rows: list[Any] = []
        movement_rows: list[Any] = []
        made = 0
        for m, name in enumerate(MOVEMENTS, start=1):
            n = per_movement if m < len(MOVEMENTS) else calls - made
            if n <= 0:
                break
            started = t
            rows.append((job_id, m, 0, t, "movement_start",
                         {"movement": name, "seq": m, "system": f"You are the {name} step.",
                          "user": "## Task\n" + "Do the benchmark task carefully. " * 40}))
            fired: set[str] = set()
            prompt = 1500
            for it in range(1, n + 1):
                t += 1.5
                rows.append((job_id, m, it, t, "llm_request", {"messages": 2 + 3 * (it - 1), "tools": [*list(TOOLS), "transition"]}))
                prompt += rng.randint(800, 3600)  # most runs cross warn, many prompt
                completion = rng.randint(20, 400)
                ratio = round(prompt / window, 6)
                last = it == n
                tool = "transition" if last else rng.choice(TOOLS)
                args: dict[str, Any] = ({"next_step": "verify", "summary": "done", "lessons": "keep it short"}
                                        if last else {"path": f"input/file{it}.md"})
                call_id = f"call_{m}_{it}_0"
                rows.append((job_id, m, it, t, "llm_response",
                             {"content": "Looking at the next file. " * rng.randint(1, 6),
                              "tool_calls": [{"id": call_id, "name": tool, "arguments": args}],
                              "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                        "total_tokens": prompt + completion, "source": "usage",
                                        "window": window, "ratio": ratio}}))
                for action, limit in DEFAULT_THRESHOLDS.items():
                    if ratio >= limit and action not in fired:
                        fired.add(action)
                        rows.append((job_id, m, it, t, "context_action",
                                     {"action": action, "ratio": ratio, "tokens": prompt, "window": window,
                                      "iteration": it, "threshold": limit}))
                rows.append((job_id, m, it, t, "tool_call", {"tool": tool, "arguments": args, "call_id": call_id}))
                content = "line of a file that the tool read back to the model\n" * rng.randint(2, 8)
                rows.append((job_id, m, it, t + 0.01, "tool_result",
                             {"tool": tool, "call_id": call_id, "content": content, "is_error": False,
                              "truncated": False, "original_chars": len(content), "returned_chars": len(content),
                              "continuation": None, "image": None}))
            rows.append((job_id, m, n, t, "transition",
                         {"movement": name, "next_step": "verify", "summary": "done", "lessons": "keep it short",
                          "forced": False, "reason": "", "question": None, "feedback": None, "subtasks": None}))
            rows.append((job_id, m, n, t, "lesson", {"lessons": "keep it short", "summary": "done", "movement": name}))
            movement_rows.append((job_id, m, name, "done", started, t, n, "verify", 0, "done"))
            made += n
        with store.transaction() as c:
            store.append([event_from_row((None, *r)) for r in rows], c)
            c.executemany("INSERT INTO movements (job_id, seq, name, status, started, ended, iterations, next_step, "
                          "forced, summary) VALUES (?,?,?,?,?,?,?,?,?,?)", movement_rows)
            store.set_status(c, job_id, "succeeded", reason="benchmark", ended=t)


def best(fn: Callable[[], Any], repeat: int) -> tuple[tuple[float, float], Any]:
    """Best wall-clock and best CPU seconds of ``repeat`` runs (CPU time is steadier on a shared machine)."""
    wall, cpu = [], []
    out = None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return (min(wall), min(cpu)), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--calls", type=int, default=200, help="LLM calls per job")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", help="build the store in this folder and keep it (reused when it exists)")
    args = ap.parse_args(argv)

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="agentnb-bench-"))
    try:
        reuse = (root / "agentnb.sqlite").exists()
        ws = Workspace(root)
        if not reuse:
            t0 = time.perf_counter()
            fill(ws, args.jobs, args.calls)
            print(f"filled {args.jobs} jobs × {args.calls} calls in {time.perf_counter() - t0:.1f} s")
        n_events, n_calls = ws.store.query(
            "SELECT COUNT(*), SUM(kind='llm_response') FROM events")[0]
        size = (root / "agentnb.sqlite").stat().st_size / 1e6
        print(f"store: {n_events:,} events, {n_calls:,} LLM calls, {size:.0f} MB")
        print(f"python {platform.python_version()}, pandas {pd.__version__}, sqlite {sqlite3.sqlite_version}, "
              f"{platform.machine()} {platform.processor() or ''}".rstrip())

        conn = sqlite3.connect(str(root / "agentnb.sqlite"))
        t_all, _ = best(lambda: pd.read_sql("SELECT * FROM events", conn), args.repeat)
        t_llm, _ = best(lambda: pd.read_sql("SELECT * FROM events WHERE kind='llm_response'", conn), args.repeat)
        conn.close()
        t_usage, usage = best(lambda: ws.frames.usage(), args.repeat)
        middle = int(usage["job"].iloc[len(usage) // 2])
        t_one, one = best(lambda: ws.frames.usage(middle), args.repeat)
        t_jobs, jobs = best(lambda: ws.frames.jobs(), args.repeat)
        assert len(usage) == n_calls and int(jobs["llm_calls"].sum()) == n_calls
        assert int(jobs["total_tokens"].sum()) == int(usage["total_tokens"].sum())
        # the cost column on its own: pricing every call (grouped by model and day) from the frame's columns
        specs = usage["job"].map(jobs.set_index("job")["model"].astype(object)).to_numpy(dtype=object)
        epoch = usage["timestamp"].to_numpy(dtype="datetime64[ns]").astype("int64") / 1e9
        t_cost, cost = best(lambda: cost_array(specs, usage["prompt_tokens"], usage["completion_tokens"], epoch),
                            args.repeat)
        assert np.allclose(usage["cost_usd"].to_numpy(), cost, rtol=1e-12, atol=0)
        assert np.isclose(jobs["cost_usd"].sum(), usage["cost_usd"].sum(), rtol=1e-9)

        print(f"\n{'':34}{'wall s':>8}{'cpu s':>8}   ratio to read_sql(events) / read_sql(llm rows)")
        print(f"{'':34}{'':16}   {'wall':>8}{'cpu':>7}   {'wall':>8}{'cpu':>7}")
        for label, (w, c) in (("read_sql: SELECT * FROM events", t_all),
                              ("read_sql: llm_response rows", t_llm),
                              ("frames.usage()   (every job)", t_usage),
                              (f"frames.usage({middle})  ({len(one)} rows)", t_one),
                              ("frames.jobs()", t_jobs),
                              ("  cost_usd alone (cost_array)", t_cost)):
            print(f"{label:34}{w:8.3f}{c:8.3f}   {w / t_all[0]:8.2f}{c / t_all[1]:7.2f}   "
                  f"{w / t_llm[0]:8.2f}{c / t_llm[1]:7.2f}")
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
