"""How long the views of a long job take: one scripted job of N LLM calls (each an ``echo`` tool call, the last
one ``transition``), then the median of ``--repeat`` renders of each view, all read from a real SQLite store.

    python benchmarks/views.py                 # 1,000 calls, 5 renders each
    python benchmarks/views.py --calls 200 --repeat 9
    python benchmarks/views.py --keep /tmp/x   # build the job once in /tmp/x and reuse it on the next runs

The views timed: ``job_html`` (bounded, as a notebook shows it), ``job_html(full=True)``, ``job_stats``
(the panel's and the magic's numbers), the transcript notebook without its plot, and ``ws.compare`` of the job
with itself (its frame and its HTML).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["build", "main"]


def build(root: Path, n: int) -> tuple[Any, int]:
    """The workspace under ``root`` and the id of its job of ``n`` calls (made on the first call)."""
    import yaml

    import agentnb
    from agentnb import Workspace

    @agentnb.tool
    def echo(text: str) -> str:
        """Return the text."""
        return text

    ws = Workspace(root / "ws")
    done = [j for j in ws.jobs() if j.status == "succeeded"] if (root / "ws").exists() else []
    if done:
        return ws, done[0].id
    responses: list[dict[str, Any]] = [
        {"content": f"step {i}", "tool_calls": [{"name": "echo", "arguments": {"text": f"hello {i}"}}]}
        for i in range(n - 1)
    ]
    responses.append({"tool_calls": [{"name": "transition", "arguments": {"next_step": "COMPLETE", "summary": "done"}}]})
    script = root / "script.yaml"
    script.write_text(yaml.safe_dump({"responses": responses}), encoding="utf-8")
    piece = agentnb.parse_piece(
        "name: bench\nmovements:\n  - name: work\n    instruction: echo\n    tools: [echo]\n"
        f"    max_iterations: {n + 5}\n    rules: [{{next: COMPLETE}}]\n")
    job = ws.run(ws.submit("echo the greetings", piece=piece, model=f"scripted:{script}"))
    if job.status != "succeeded":
        raise RuntimeError(f"the benchmark job ended {job.status}: {job.error}")
    return ws, job.id


def _median(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Median wall and CPU seconds of ``fn`` (CPU time is the steadier figure on a shared machine)."""
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--keep", type=Path, help="a folder to build the job in once and reuse")
    args = parser.parse_args(argv)
    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="agentnb-views-")
    root = args.keep or Path(tmp.name)  # type: ignore[union-attr]
    root.mkdir(parents=True, exist_ok=True)
    from agentnb.views.render import job_html, job_stats
    from agentnb.views.transcript import build_notebook

    ws, job = build(root, args.calls)
    cases: dict[str, Callable[[], object]] = {
        "job_html": lambda: job_html(ws, job),
        "job_html full": lambda: job_html(ws, job, full=True),
        "job_stats": lambda: job_stats(ws, job),
        "transcript (no plot)": lambda: build_notebook(ws, job, plot=False),
        "compare frame": lambda: ws.compare(job, job).frame,
        "compare html": lambda: ws.compare(job, job).html(),
    }
    print(f"{args.calls:,} calls, median of {args.repeat}: wall ms, CPU ms")
    for name, fn in cases.items():
        wall, cpu = _median(fn, args.repeat)
        print(f"  {name:<22} {wall * 1000:8.1f} {cpu * 1000:8.1f}")
    ws.store.close()
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
