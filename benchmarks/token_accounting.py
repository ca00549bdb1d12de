"""Token-accounting cost per LLM call as a movement grows from 10 to 1,000 calls (issue 3).

The ContextManager tokenizes each message once, when it is appended, so a call
costs the size of what that call added — not the size of the whole history.
This prints, for each movement length N, the accounting time per call and the
ratio of the per-call cost at the largest N to the smallest (1.0 = flat).

Two measurements:

* ``direct`` — a ContextManager driven by hand: per call one assistant message
  (a tool call) and one ~1.5 kB tool result, no usage (so it counts with the
  offline tiktoken encoding).  A ``naive`` column estimates re-counting the whole
  history on every call, as a reference for what flat is not.
* ``movement`` — a real job: a scripted model makes N Read calls of a small file
  in one movement (SQLite store, tools, events), and the time spent inside the
  ContextManager (``add``, ``after_response``, ``tool_budget``) is summed.

    python benchmarks/token_accounting.py                 # N = 10, 100, 1000
    python benchmarks/token_accounting.py --sizes 10,200,1000 --repeat 5

Not a test: timings vary by machine; read the ratios.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentnb import Workspace
from agentnb.engine.context import ContextManager
from agentnb.engine.tokens import counter_for_model
from agentnb.models.messages import AssistantMessage, SystemMessage, ToolCallPart, ToolMessage, UserMessage

RESULT = ("src/module.py:{i}: def handler_{i}(request, response): return process(request.payload, "
          "retries=3)  # the quick brown fox jumps over the lazy dog\n") * 12


def _messages(i: int) -> tuple[AssistantMessage, ToolMessage]:
    assistant = AssistantMessage(None, (ToolCallPart(f"c{i}", "Read", {"path": f"input/file_{i}.py", "offset": i},
                                                     f'{{"path": "input/file_{i}.py", "offset": {i}}}'),))
    tool = ToolMessage(f"c{i}", RESULT.format(i=i))
    return assistant, tool


def direct(n: int) -> tuple[float, float]:
    """Seconds per call: incremental accounting, and a naive full recount (reference)."""
    counter = counter_for_model("gpt-4o")
    cm = ContextManager(window=100_000_000, counter=counter)
    cm.add(SystemMessage("You work."))
    cm.add(UserMessage("Do the task."))
    t0 = time.perf_counter()
    for i in range(n):
        # built inside the loop, as a movement would: prebuilt messages sit in the CPU cache for small N only
        assistant, tool = _messages(i)
        cm.after_response(assistant, None)
        cm.tool_budget()
        cm.add(tool)
    incremental = (time.perf_counter() - t0) / n
    # A per-call recount of the history costs, on average, one recount of half of it: time that once
    # (timing every recount would make the 1,000-call run take minutes).
    half = [m for i in range(max(1, n // 2)) for m in _messages(i)]
    t0 = time.perf_counter()
    sum(cm.count_message(m) for m in half)
    naive = time.perf_counter() - t0
    return incremental, naive


def movement(n: int) -> tuple[float, float]:
    """Seconds per call in a real scripted movement: inside the ContextManager, and the whole call."""
    spent = [0.0]

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t
        return wrapper

    originals = {name: getattr(ContextManager, name) for name in ("add", "after_response", "tool_budget")}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        piece = root / "long.yaml"
        piece.write_text(yaml.safe_dump({"name": "long", "context": {"window_tokens": 100_000_000}, "movements": [{
            "name": "work", "persona": "You work.", "instruction": "Read the file many times.", "tools": ["Read"],
            "max_iterations": n + 1, "rules": [{"condition": "done", "next": "COMPLETE"}]}]}))
        script = root / "script.yaml"
        responses = [{"tool_calls": [{"name": "Read", "arguments": {"path": "input/f.py"}}]} for _ in range(n)]
        responses.append({"tool_calls": [{"name": "transition", "arguments": {"next_step": "COMPLETE",
                                                                              "summary": "done"}}]})
        script.write_text(yaml.safe_dump({"responses": responses}))
        ws = Workspace(root / "ws")
        job = ws.submit("Read input/f.py", piece=str(piece), model=f"scripted:{script}",
                        inputs={"f.py": RESULT.format(i=0)})
        for name, fn in originals.items():
            setattr(ContextManager, name, timed(fn))
        try:
            t0 = time.perf_counter()
            job = ws.run(job)
            wall = time.perf_counter() - t0
        finally:
            for name, fn in originals.items():
                setattr(ContextManager, name, fn)
        if job.status != "succeeded":
            raise SystemExit(f"the benchmark job ended {job.status}: {job.error}")
    return spent[0] / (n + 1), wall / (n + 1)


def _best(fn: Callable[[int], tuple[float, ...]], n: int, repeat: int) -> tuple[float, ...]:
    fn(min(n, 10))  # warm-up: tokenizer load, imports
    runs = [fn(n) for _ in range(repeat)]
    # the minimum: on a shared machine noise only ever adds time
    return tuple(min(r[i] for r in runs) for i in range(len(runs[0])))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10,100,1000", help="movement lengths (calls), comma-separated")
    ap.add_argument("--repeat", type=int, default=3, help="runs per size; the fastest is printed")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"tokenizer: {counter_for_model('gpt-4o').encoding}")
    print(f"{'calls':>6} | {'direct µs/call':>14} | {'naive µs/call':>13} | {'movement: ctx µs/call':>21} | "
          f"{'movement: whole µs/call':>23}")
    rows = []
    for n in sizes:
        inc, naive = _best(direct, n, args.repeat)
        ctx, whole = _best(movement, n, args.repeat)
        rows.append((n, inc, naive, ctx, whole))
        print(f"{n:>6} | {inc * 1e6:>14.1f} | {naive * 1e6:>13.1f} | {ctx * 1e6:>21.1f} | {whole * 1e6:>23.1f}")
    first, last = rows[0], rows[-1]
    print(f"\nper-call cost at {last[0]:,} calls ÷ at {first[0]:,} calls (1.0 = flat):")
    print(f"  direct (incremental) {last[1] / first[1]:.2f}   naive recount {last[2] / first[2]:.2f}   "
          f"movement ContextManager {last[3] / first[3]:.2f}   movement whole call {last[4] / first[4]:.2f}")


if __name__ == "__main__":
    main()
