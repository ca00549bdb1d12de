"""Framework overhead per LLM call: agentnb side by side with LangGraph, pydantic-ai and the OpenAI Agents SDK.

The workload (issue 8): one agent run of N sequential LLM calls, each of the first
N-1 asking for one call of a trivial ``echo`` tool and the last one ending the run,
answered by an instant in-process fake model — so everything measured is the
framework's own cost.  Each framework uses its own fake-model facility, no HTTP:

* agentnb — a custom ``@agentnb.tool`` echo, the ``scripted:`` model, every event
  persisted to a real SQLite store (WAL) in a temporary directory, token accounting on;
* LangGraph — ``create_react_agent`` with a small ``BaseChatModel`` that emits tool
  calls, with and without an in-memory checkpointer;
* pydantic-ai — ``FunctionModel``;
* OpenAI Agents SDK — a ``Model`` subclass (tracing disabled, so nothing is exported);
* a bare Python loop (messages list, dict tool calls) as the floor.

Per call = wall time of one run / N.  Building the agent (or submitting the job) is
outside the timed region; the run itself — for agentnb the scripted model's YAML
parse, the runner, every commit — is inside.  Each size is measured ``--repeat``
times after a warm-up run and the median is printed, with the growth from the
smallest to the largest size (1.0 = flat, linear total cost) and agentnb ÷ peer.

    pip install -e '.[bench]'          # the peers; never part of the main install
    python benchmarks/overhead.py                        # 200 and 1,000 calls, 3 runs each
    python benchmarks/overhead.py --calls 200 --repeat 5 --only agentnb,langgraph
    python benchmarks/overhead.py --profile 1000         # cProfile of one agentnb run
    python benchmarks/overhead.py --only agentnb --otel  # with live OpenTelemetry export to a loopback receiver
    python benchmarks/overhead.py --otel-file 1000       # ws.export_otel of a 1,000-call job, per span
    python benchmarks/overhead.py --markdown --json run.json   # also as Markdown, and saved
    python benchmarks/overhead.py --from-json run.json --markdown   # re-print a saved run

A peer that is not installed is reported as such and skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FRAMEWORKS", "Result", "main", "measure"]

# A prepared run: calling it performs one agent run; what it returns tells (after the timer stops)
# how many LLM calls the run made, so a broken workload cannot pass for a fast one.
Run = Callable[[], Callable[[], int]]
# Builds a prepared run of n calls (agent built, job submitted), or raises ImportError for a missing peer.
Factory = Callable[[int], Run]

NOT_INSTALLED = "not installed (pip install -e '.[bench]')"
OTEL_URL: str | None = None  # --otel: agentnb's jobs export their spans live to this loopback receiver


def otlp_receiver() -> tuple[str, list[int]]:
    """A loopback OTLP/HTTP receiver that takes every request (200) and counts the bytes: its URL and the counts."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    got: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            got.append(len(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", got
PROMPT = "Echo the numbered greetings, one tool call at a time."


def _text(i: int) -> str:
    return f"hello {i}"


# ---------------------------------------------------------------------------
# bare loop: the floor


def bare_loop(n: int) -> Run:
    def echo(text: str) -> str:
        return text

    def model(i: int) -> dict[str, Any]:
        if i < n - 1:
            return {"role": "assistant", "content": None,
                    "tool_calls": [{"id": f"call_{i}", "name": "echo", "arguments": {"text": _text(i)}}]}
        return {"role": "assistant", "content": "done", "tool_calls": []}

    def run() -> Callable[[], int]:
        messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
        calls = 0
        while True:
            reply = model(calls)
            calls += 1
            messages.append(reply)
            if not reply["tool_calls"]:
                return lambda: calls
            for call in reply["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": echo(**call["arguments"])})

    return run


# ---------------------------------------------------------------------------
# agentnb


_AGENTNB_TOOL: Any = None
_TMP: list[tempfile.TemporaryDirectory[str]] = []


def _agentnb_tool() -> Any:
    global _AGENTNB_TOOL
    if _AGENTNB_TOOL is None:
        import agentnb

        @agentnb.tool
        def echo(text: str) -> str:
            """Return the text unchanged."""
            return text

        _AGENTNB_TOOL = echo
    return _AGENTNB_TOOL


def agentnb_run(n: int) -> Run:
    import yaml

    import agentnb
    from agentnb import Workspace

    _agentnb_tool()
    tmp = tempfile.TemporaryDirectory(prefix="agentnb-bench-")
    _TMP.append(tmp)  # removed by _cleanup once the run is done
    root = Path(tmp.name)
    responses: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "echo", "arguments": {"text": _text(i)}}]} for i in range(n - 1)
    ]
    responses.append({"tool_calls": [{"name": "transition",
                                      "arguments": {"next_step": "COMPLETE", "summary": "done"}}]})
    script = root / "script.yaml"
    script.write_text(yaml.safe_dump({"responses": responses}), encoding="utf-8")
    piece = agentnb.parse_piece(
        "name: bench\n"
        "movements:\n"
        "  - name: work\n"
        f"    instruction: {PROMPT}\n"
        "    tools: [echo]\n"
        f"    max_iterations: {n + 5}\n"
        "    rules: [{next: COMPLETE}]\n"
    )
    ws = Workspace(root / "ws", otel=OTEL_URL or False)
    job = ws.submit(PROMPT, piece=piece, model=f"scripted:{script}")

    def run() -> Callable[[], int]:
        done = ws.run(job)

        def count() -> int:
            try:
                if done.status != "succeeded":
                    raise RuntimeError(f"agentnb job ended {done.status}: {done.error}")
                return len(ws.events(job, kinds=["llm_response"]))  # what the store holds, not what we hoped
            finally:
                ws.close()  # before _cleanup removes the folder; a live export sends what it holds first

        return count

    return run


# ---------------------------------------------------------------------------
# LangGraph


def _langgraph(n: int, checkpointer: bool) -> Run:
    from langchain_core.language_models.chat_models import BaseChatModel
    from langchain_core.messages import AIMessage
    from langchain_core.outputs import ChatGeneration, ChatResult
    from langchain_core.tools import tool as lc_tool

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_react_agent is deprecated in favour of langchain.agents
        from langgraph.prebuilt import create_react_agent

    @lc_tool
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    class FakeToolModel(BaseChatModel):
        """Answers instantly: n-1 echo tool calls, then a final text."""

        total: int
        calls: int = 0

        @property
        def _llm_type(self) -> str:
            return "fake-tool-calls"

        def bind_tools(self, tools: Any, **kwargs: Any) -> FakeToolModel:
            return self

        def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> ChatResult:
            i = self.calls
            self.calls += 1
            if i < self.total - 1:
                msg = AIMessage(content="", tool_calls=[{"name": "echo", "args": {"text": _text(i)},
                                                         "id": f"call_{i}", "type": "tool_call"}])
            else:
                msg = AIMessage(content="done")
            return ChatResult(generations=[ChatGeneration(message=msg)])

    model = FakeToolModel(total=n)
    config: dict[str, Any] = {"recursion_limit": 2 * n + 10}
    saver = None
    if checkpointer:
        from langgraph.checkpoint.memory import InMemorySaver

        saver = InMemorySaver()
        config["configurable"] = {"thread_id": "bench"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = create_react_agent(model, [echo], checkpointer=saver)

    def run() -> Callable[[], int]:
        agent.invoke({"messages": [("user", PROMPT)]}, config)
        return lambda: model.calls

    return run


def langgraph_run(n: int) -> Run:
    return _langgraph(n, checkpointer=False)


def langgraph_saver_run(n: int) -> Run:
    return _langgraph(n, checkpointer=True)


# ---------------------------------------------------------------------------
# pydantic-ai


def pydantic_ai_run(n: int) -> Run:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import FunctionModel
    from pydantic_ai.usage import UsageLimits

    state = {"calls": 0}

    def respond(messages: Any, info: Any) -> ModelResponse:
        i = state["calls"]
        state["calls"] += 1
        if i < n - 1:
            return ModelResponse(parts=[ToolCallPart("echo", {"text": _text(i)}, tool_call_id=f"call_{i}")])
        return ModelResponse(parts=[TextPart("done")])

    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    agent = Agent(FunctionModel(respond), tools=[echo])
    limits = UsageLimits(request_limit=None)  # the default stops a run at 50 requests

    def run() -> Callable[[], int]:
        agent.run_sync(PROMPT, usage_limits=limits)
        return lambda: state["calls"]

    return run


# ---------------------------------------------------------------------------
# OpenAI Agents SDK


def openai_agents_run(n: int) -> Run:
    from agents import Agent, Model, ModelResponse, Runner, Usage, function_tool, set_tracing_disabled
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

    set_tracing_disabled(True)  # the default tracer exports spans over HTTP

    class FakeModel(Model):
        def __init__(self) -> None:
            self.calls = 0

        async def get_response(self, system_instructions: Any, input: Any, model_settings: Any, tools: Any,
                               output_schema: Any, handoffs: Any, tracing: Any, *, previous_response_id: Any = None,
                               conversation_id: Any = None, prompt: Any = None, **kwargs: Any) -> ModelResponse:
            i = self.calls
            self.calls += 1
            if i < n - 1:
                item: Any = ResponseFunctionToolCall(
                    type="function_call", id=f"fc_{i}", call_id=f"call_{i}", name="echo",
                    arguments=json.dumps({"text": _text(i)}), status="completed",
                )
            else:
                item = ResponseOutputMessage(
                    type="message", id="msg_done", role="assistant", status="completed",
                    content=[ResponseOutputText(type="output_text", text="done", annotations=[])],
                )
            return ModelResponse(output=[item], usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("the benchmark does not stream")

    @function_tool
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    model = FakeModel()
    agent = Agent(name="bench", instructions=PROMPT, model=model, tools=[echo])

    def run() -> Callable[[], int]:
        Runner.run_sync(agent, PROMPT, max_turns=n + 5)
        return lambda: model.calls

    return run


# ---------------------------------------------------------------------------


@dataclass
class Framework:
    key: str
    label: str
    factory: Factory


FRAMEWORKS = [
    Framework("agentnb", "agentnb (SQLite, every event)", agentnb_run),
    Framework("bare", "bare Python loop", bare_loop),
    Framework("langgraph", "LangGraph create_react_agent", langgraph_run),
    Framework("langgraph-saver", "LangGraph + InMemorySaver", langgraph_saver_run),
    Framework("pydantic-ai", "pydantic-ai FunctionModel", pydantic_ai_run),
    Framework("openai-agents", "OpenAI Agents SDK", openai_agents_run),
]


@dataclass
class Result:
    key: str
    label: str
    error: str | None = None  # "not installed …" or a failure
    per_call: dict[int, float] = field(default_factory=dict)  # calls → median seconds per call
    runs: dict[int, list[float]] = field(default_factory=dict)  # calls → every run's seconds per call
    cpu_per_call: dict[int, float] = field(default_factory=dict)  # calls → median CPU seconds per call


def _cleanup() -> None:
    while _TMP:
        _TMP.pop().cleanup()


def _timed(factory: Factory, n: int) -> tuple[float, float]:
    """Wall and CPU seconds per call of one run of n calls."""
    run = factory(n)
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    count = run()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    calls = count()
    _cleanup()
    if calls != n:
        raise RuntimeError(f"made {calls} LLM calls, expected {n}")
    return elapsed / n, cpu / n


def measure(fw: Framework, sizes: list[int], repeat: int, warmup: int = 20) -> Result:
    """Warm up once, then ``repeat`` runs at each size; the median per call is kept."""
    res = Result(fw.key, fw.label)
    try:
        _timed(fw.factory, warmup)
    except ImportError:
        res.error = NOT_INSTALLED
        return res
    except Exception as exc:  # a peer's API changed: report it and go on with the others
        res.error = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        return res
    for n in sizes:
        timings = [_timed(fw.factory, n) for _ in range(repeat)]
        res.runs[n] = [wall for wall, _ in timings]
        res.per_call[n] = statistics.median(res.runs[n])
        res.cpu_per_call[n] = statistics.median(cpu for _, cpu in timings)
    return res


def _fmt_time(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:,.1f} µs" if us < 1000 else f"{us / 1000:,.2f} ms"


def _rows(results: list[Result], sizes: list[int]) -> list[list[str]]:
    """Header and one row per framework: wall per call at each size, growth, agentnb ÷ it, CPU per call."""
    ours = next((r for r in results if r.key == "agentnb" and not r.error), None)
    lo, hi = sizes[0], sizes[-1]
    head = ["framework"] + [f"per call @{n:,}" for n in sizes]
    if len(sizes) > 1:
        head.append(f"growth {hi:,}/{lo:,}")
    head += [f"agentnb ÷ it @{n:,}" for n in sizes]
    head += [f"CPU per call @{n:,}" for n in sizes]
    rows = [head]
    for r in results:
        if r.error:
            rows.append([r.label, r.error])
            continue
        row = [r.label] + [_fmt_time(r.per_call[n]) for n in sizes]
        if len(sizes) > 1:
            row.append(f"{r.per_call[hi] / r.per_call[lo]:.2f}")
        for n in sizes:
            row.append("—" if ours is None or r is ours else f"{ours.per_call[n] / r.per_call[n]:.3f}")
        row += [_fmt_time(r.cpu_per_call[n]) if n in r.cpu_per_call else "—" for n in sizes]
        rows.append(row)
    return rows


def table(results: list[Result], sizes: list[int]) -> str:
    rows = _rows(results, sizes)
    head = rows[0]
    widths = [max(len(row[i]) for row in rows if len(row) == len(head)) for i in range(len(head))]
    lines = []
    for row in rows:
        if len(row) != len(head):
            lines.append(f"{row[0]:<{widths[0]}}  {row[1]}")
        else:
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=False))))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def markdown(results: list[Result], sizes: list[int]) -> str:
    rows = _rows(results, sizes)
    n = len(rows[0])
    out = ["| " + " | ".join(rows[0]) + " |", "|---" + "|---:" * (n - 1) + "|"]
    for row in rows[1:]:
        cells = row if len(row) == n else [row[0], row[1]] + [""] * (n - 2)
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def load_json(path: str) -> tuple[list[Result], list[int], str]:
    """Results saved with --json, to print again (e.g. as Markdown) without re-running."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    results = []
    for r in data["results"]:
        res = Result(r["key"], r["label"], r.get("error"))
        res.per_call = {int(k): v for k, v in r.get("per_call_s", {}).items()}
        res.cpu_per_call = {int(k): v for k, v in r.get("cpu_per_call_s", {}).items()}
        res.runs = {int(k): v for k, v in r.get("runs_s", {}).items()}
        results.append(res)
    return results, [int(n) for n in data["calls"]], f"{data.get('date', '')}, {data.get('machine', '')}"


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ""
    if hasattr(os, "getloadavg"):
        load = f", load {os.getloadavg()[0]:.2f}"
    return f"{os.cpu_count()} CPUs, {cpu}, Python {sys.version.split()[0]}{load}"


def profile(n: int, sort: str = "cumulative") -> None:
    """cProfile one agentnb run of n calls (after a warm-up), the top 40 entries."""
    import cProfile
    import pstats

    _timed(agentnb_run, 20)
    run = agentnb_run(n)
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    _cleanup()
    pstats.Stats(prof).sort_stats(sort).print_stats(40)


def otel_file(n: int, repeat: int) -> None:
    """Print the best of ``repeat`` file exports (docs/otel.md) of one agentnb job of ``n`` calls, per span."""
    from agentnb.views.otel import read_traces

    run = agentnb_run(n)
    count = run()
    cells = dict(zip(run.__code__.co_freevars, (c.cell_contents for c in run.__closure__ or ()), strict=True))
    ws, job = cells["ws"], cells["job"]  # the prepared run's workspace and job
    path = Path(_TMP[-1].name) / "traces.jsonl"
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        ws.export_otel(job, path)
        times.append(time.perf_counter() - t0)
    spans = sum(len(ss.spans) for d in read_traces(path) for rs in d.resource_spans for ss in rs.scope_spans)
    best = min(times[1:]) if repeat else times[0]
    print(f"# {machine()}")
    print(f"file export of a {n}-call job: {spans} spans in {best * 1000:.0f} ms, {best / spans * 1000:.3f} ms per span")
    count()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", default="200,1000", help="comma-separated run lengths (default: 200,1000)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per size; the median is shown (default: 3)")
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join(f.key for f in FRAMEWORKS))
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--profile", type=int, metavar="N", help="cProfile one agentnb run of N calls instead")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown too")
    ap.add_argument("--from-json", metavar="PATH", help="print the table of a run saved with --json instead")
    ap.add_argument("--otel-file", type=int, metavar="N",
                    help="instead: time ws.export_otel of one agentnb job of N calls (ms per span)")
    ap.add_argument("--otel", action="store_true",
                    help="agentnb exports its spans live to a loopback OTLP/HTTP receiver (docs/otel.md#live)")
    args = ap.parse_args(argv)
    if args.otel:
        global OTEL_URL
        OTEL_URL, received = otlp_receiver()
    if args.otel_file:
        otel_file(args.otel_file, args.repeat)
        return 0
    if args.profile:
        profile(args.profile)
        return 0
    if args.from_json:
        saved, saved_sizes, where = load_json(args.from_json)
        print(f"# {where}")
        print(markdown(saved, saved_sizes) if args.markdown else table(saved, saved_sizes))
        return 0
    try:
        sizes = sorted({int(x) for x in args.calls.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--calls {args.calls!r}: expected whole numbers separated by commas, e.g. 200,1000")
    if not sizes or sizes[0] < 2:
        ap.error("--calls: each run needs at least 2 calls (tool calls, then the final answer)")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    chosen = [f for f in FRAMEWORKS if not args.only or f.key in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {f.key for f in FRAMEWORKS}
    if unknown:
        ap.error(f"--only: unknown framework(s) {sorted(unknown)}; allowed: {', '.join(f.key for f in FRAMEWORKS)}")

    print(f"# {machine()}")
    print(f"# one run of N sequential LLM calls (N-1 echo tool calls), median of {args.repeat} after a warm-up")
    if args.otel:
        print(f"# agentnb exports its spans live to {OTEL_URL}")
    results = []
    for fw in chosen:
        t0 = time.perf_counter()
        res = measure(fw, sizes, args.repeat)
        results.append(res)
        status = res.error or ", ".join(
            f"{n}: {_fmt_time(res.per_call[n])}/call (CPU {_fmt_time(res.cpu_per_call[n])})" for n in sizes
        )
        print(f"#   {fw.label}: {status}  [{time.perf_counter() - t0:.0f} s]", flush=True)
        asyncio.set_event_loop(asyncio.new_event_loop())  # peers may close the loop they used
    if args.otel:
        print(f"# the receiver took {len(received)} requests, {sum(received):,} bytes")
    print()
    print(table(results, sizes))
    if args.markdown:
        print()
        print(markdown(results, sizes))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "repeat": args.repeat, "calls": sizes,
             "results": [{"key": r.key, "label": r.label, "error": r.error,
                          "per_call_s": {str(k): v for k, v in r.per_call.items()},
                          "cpu_per_call_s": {str(k): v for k, v in r.cpu_per_call.items()},
                          "runs_s": {str(k): v for k, v in r.runs.items()}} for r in results]},
            indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
