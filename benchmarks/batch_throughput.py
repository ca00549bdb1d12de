"""Batch throughput against a slow endpoint: agentnb's ``ws.batch`` beside LangGraph and pydantic-ai (issue 14).

An OpenAI-compatible endpoint runs on loopback in a separate process (so it does not compete with the
frameworks for the GIL) and answers every ``POST /v1/chat/completions`` after a fixed latency (default
50 ms).  It is stateless: it counts the tool results in the request's messages and answers with a call of
the ``echo`` tool until there are four, then with the end of the run — a ``transition`` call when the
request offers that tool (agentnb), a plain text answer otherwise (the peers).  So every run is 5 LLM
calls: 4 tool calls and the end.  (To see where the CPU goes, profile every thread, not only the main one:
the py-spy line below samples only threads holding the GIL.)

* agentnb — ``ws.batch(cases, piece=<one movement with echo>, model="openai:bench", concurrency=N)``,
  real HTTP to the server (``OPENAI_BASE_URL`` points at it; an ``http://`` endpoint is written to and read by
  agentnb's own HTTP/1.1 path, ``models/_plain_http.py``, with the ``openai`` SDK's headers), every event
  persisted in a real SQLite file.  Afterwards the benchmark checks that every job succeeded and that the
  store holds jobs × 5 ``llm_response`` events.
* LangGraph — ``create_react_agent`` on langchain-openai's ``ChatOpenAI``, ``asyncio.gather`` of
  ``ainvoke`` bounded by ``asyncio.Semaphore(N)``, no checkpointer.
* pydantic-ai — ``Agent(OpenAIChatModel(...), tools=[echo])``, ``asyncio.gather`` of ``agent.run``
  bounded by ``asyncio.Semaphore(N)``, no persistence.
* floor — the same requests over raw asyncio sockets: what the endpoint and the machine allow.
* agentnb, streamed (``--stream``) — the same batch with streamed answers (``openai:bench``; the row above asks
  plainly, ``openai:bench?stream=0``): the endpoint answers a ``stream: true`` request with about
  ``STREAM_CHUNKS`` server-sent ``chat.completion.chunk`` events (HTTP chunked), the first after half the
  latency and the others spread over the second half, the body's end at the latency, as a plain answer's.  The two rows run
  in turns, level by level (plain then streamed, then streamed then plain, …), so that the machine's drift over
  the minutes weighs on both alike.  Printed after the table: at each level, streamed ÷ plain calls/s (of the
  medians, and each turn's own ratio with their median) and CPU a call.  (The peers can stream,
  pydantic-ai with ``agent.run_stream`` and LangGraph with ``stream_mode="messages"``, but are run plainly here.)

"CPU ms a call" is this process's CPU (every thread, ``time.process_time``) over the runs ÷ the LLM calls made:
on a shared machine the calls/s of a CPU-bound level move with the other jobs' load, the CPU a call much less.

A framework that is not installed prints one line and the others go on.

Ideal throughput is concurrency ÷ latency calls per second; the ratio is measured ÷ ideal.  Jobs come in
whole runs of 5 calls, so when jobs is not a multiple of the concurrency the last wave runs part-empty:
the "bound" column is the best ratio that wave structure allows (ceil(jobs / N) waves of 5 latencies).

    pip install -e '.[bench]'                               # the peers; never part of the main install
    python benchmarks/batch_throughput.py                   # 400 jobs at 8, 32, 64; 100 at concurrency 1
    python benchmarks/batch_throughput.py --levels 32 --jobs 200 --only agentnb      # a quick run
    python benchmarks/batch_throughput.py --jobs-c1 400     # the full 400 at concurrency 1 (100 s)
    python benchmarks/batch_throughput.py --markdown --json run.json
    py-spy record --gil -f raw -o spy.txt -- python benchmarks/batch_throughput.py --levels 32 --only agentnb
    python benchmarks/batch_throughput.py --serve --port 8050   # only the endpoint (prints PORT n)
    python benchmarks/batch_throughput.py --stream --levels 8,32 --only agentnb   # streamed beside plain
    AGENTNB_OPENAI_HTTP=sdk python benchmarks/batch_throughput.py --levels 1,32 --only agentnb  # plain calls through
                                                            # the openai SDK's HTTP stack (before issue 32)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FRAMEWORKS", "Level", "main", "serve", "start_server", "stream_vs_plain"]

CALLS_PER_RUN = 5  # 4 echo tool calls + the end of the run
TOOL_CALLS = CALLS_PER_RUN - 1
NOT_INSTALLED = "not installed (pip install -e '.[bench]')"
MODEL = "bench"
STREAM_CHUNKS = 20  # server-sent events per streamed answer


# ---------------------------------------------------------------------------
# the endpoint (its own process): a minimal asyncio HTTP/1.1 server with keep-alive


def _answer(request: dict[str, Any], n: int) -> dict[str, Any]:
    """The chat completion for ``request``, decided from its messages alone (the server keeps no state)."""
    messages = request.get("messages") or []
    done = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "tool")
    tools = {t.get("function", {}).get("name") for t in request.get("tools") or [] if isinstance(t, dict)}
    message: dict[str, Any] = {"role": "assistant", "content": None}
    if done < TOOL_CALLS:
        call = {"name": "echo", "arguments": json.dumps({"text": f"hello {done}"})}
    elif "transition" in tools:
        call = {"name": "transition", "arguments": json.dumps({"next_step": "COMPLETE", "summary": "done"})}
    else:
        call = None
        message["content"] = "done"
    if call is not None:
        message["tool_calls"] = [{"id": f"call_{n}", "type": "function", "function": call}]
    return {
        "id": f"chatcmpl-{n}", "object": "chat.completion", "created": 1_700_000_000,
        "model": request.get("model", MODEL),
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if call else "stop"}],
        "usage": {"prompt_tokens": 100 + 20 * done, "completion_tokens": 10, "total_tokens": 110 + 20 * done},
    }


def _events(answer: dict[str, Any]) -> list[bytes]:
    """``answer`` as about :data:`STREAM_CHUNKS` server-sent ``chat.completion.chunk`` events, as HTTP chunks."""
    message = answer["choices"][0]["message"]
    head = {k: answer[k] for k in ("id", "created", "model")}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta,
                                                                        "finish_reason": finish}]}

    pieces = STREAM_CHUNKS - 3  # the role, the finish reason and the usage take one event each
    out = [chunk({"role": "assistant", "content": message["content"] and ""})]
    for call in message.get("tool_calls") or []:
        args = call["function"]["arguments"]
        size = max(1, math.ceil(len(args) / pieces))
        parts = [args[i:i + size] for i in range(0, len(args), size)]
        out.append(chunk({"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                                          "function": {"name": call["function"]["name"], "arguments": parts[0]}}]}))
        out += [chunk({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}) for p in parts[1:]]
    if message["content"]:
        size = max(1, math.ceil(len(message["content"]) / pieces))
        out += [chunk({"content": message["content"][i:i + size]}) for i in range(0, len(message["content"]), size)]
    out.append(chunk({}, answer["choices"][0]["finish_reason"]))
    out.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": answer["usage"]})
    data = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in out] + [b"data: [DONE]\n\n"]
    return [b"%x\r\n%s\r\n" % (len(d), d) for d in data] + [b"0\r\n\r\n"]


async def _serve(port: int, latency: float, ready: Callable[[int], None]) -> None:
    count = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                arrived = time.monotonic()
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                length = 0
                for line in lines[1:]:
                    if line[:15].lower() == "content-length:":
                        length = int(line[15:])
                body = await reader.readexactly(length) if length else b""
                count += 1
                request = json.loads(body or b"{}") if method == "POST" else {}
                if method == "POST" and path.rstrip("/").endswith("/chat/completions") and request.get("stream"):
                    events = _events(_answer(request, count))
                    await asyncio.sleep(max(0.0, latency / 2 - (time.monotonic() - arrived)))
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n" + events[0])
                    # the body's last bytes leave at the latency, as a plain answer's do (spread over len(events)
                    # gaps, the last left a gap early: 3% of the latency, which every streamed call gained)
                    gap = latency / 2 / max(1, len(events) - 1)
                    for k, event in enumerate(events[1:], start=1):
                        await writer.drain()
                        # to a deadline from the arrival: a late wake-up does not delay the ones after it
                        await asyncio.sleep(max(0.0, arrived + latency / 2 + k * gap - time.monotonic()))
                        writer.write(event)
                    await writer.drain()
                    continue
                if method == "POST" and path.rstrip("/").endswith("/chat/completions"):
                    status, payload = "200 OK", _answer(request, count)
                elif path.rstrip("/").endswith("/count"):
                    status, payload = "200 OK", {"requests": count}
                else:
                    status, payload = "404 Not Found", {"error": {"message": f"no route {path}"}}
                data = json.dumps(payload).encode()
                # the latency runs from the request's arrival, so the server's own work is inside it
                await asyncio.sleep(max(0.0, latency - (time.monotonic() - arrived)))
                writer.write(f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}"
                             "\r\nconnection: keep-alive\r\n\r\n".encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    ready(server.sockets[0].getsockname()[1])
    async with server:
        await server.serve_forever()


def serve(port: int = 0, latency: float = 0.05) -> None:
    """Run the endpoint in this process until killed; prints ``PORT <n>`` once it listens."""

    def ready(p: int) -> None:
        print(f"PORT {p}", flush=True)

    with suppress(KeyboardInterrupt):
        asyncio.run(_serve(port, latency, ready))


def start_server(argv: list[str], what: str) -> tuple[subprocess.Popen[str], int]:
    """A loopback server in a process of its own (``python ARGV``, which prints ``PORT n`` once it listens): the
    process and its port."""
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"{what} did not start: {line!r}")
    return proc, int(line.split()[1])


class Endpoint:
    """The endpoint in a child process, for a ``with`` block."""

    def __init__(self, latency: float) -> None:
        self.latency = latency
        self.proc: subprocess.Popen[str] | None = None
        self.base_url = ""

    def __enter__(self) -> Endpoint:
        self.proc, port = start_server([__file__, "--serve", "--latency", str(self.latency)], "the endpoint")
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self

    def requests(self) -> int:
        """How many requests the endpoint has answered (one plain HTTP GET)."""
        host, port = self.base_url.split("//")[1].split("/")[0].split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"GET /count HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
            data = b""
            while not data.endswith(b"}"):
                data += s.recv(4096)
        return int(json.loads(data.split(b"\r\n\r\n", 1)[1])["requests"])

    def cpu(self) -> float | None:
        """The endpoint process's CPU seconds so far (None where /proc does not tell): on the same machine, a
        streamed answer costs the endpoint more too, and that CPU is not the client's."""
        try:
            fields = Path(f"/proc/{self.proc.pid if self.proc else 0}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


# ---------------------------------------------------------------------------
# the frameworks: each runs `jobs` runs at `concurrency` and returns (seconds, LLM calls made)

@dataclass
class Outcome:
    seconds: float  # wall time of the runs
    cpu: float  # this process's CPU seconds over the same span
    calls: int  # LLM calls made (agentnb: llm_response events in the store)


Runner = Callable[[str, int, int], Outcome]
_TMP: list[tempfile.TemporaryDirectory[str]] = []


def _echo_tool() -> Any:
    sys.path.insert(0, str(Path(__file__).parent))
    from _bench_tools import echo  # a module, so the worker processes of --processes import it too

    return echo


PIECE = (
    "name: bench\n"
    "movements:\n"
    "  - name: work\n"
    "    instruction: Echo the greetings, one tool call at a time, then finish.\n"
    "    tools: [echo]\n"
    "    max_iterations: 20\n"
    "    rules: [{next: COMPLETE}]\n"
)


def agentnb_run(base_url: str, jobs: int, concurrency: int) -> Outcome:
    return _agentnb(base_url, jobs, concurrency, f"openai:{MODEL}?stream=0")


def agentnb_stream_run(base_url: str, jobs: int, concurrency: int) -> Outcome:
    return _agentnb(base_url, jobs, concurrency, f"openai:{MODEL}")


PROCESSES = 1  # --processes N: agentnb's rows run their batch in N worker processes (docs/design-lab.md#processes)


OTEL_URL: str | None = None  # --otel: agentnb's jobs export their spans live to this loopback receiver


def _agentnb(base_url: str, jobs: int, concurrency: int, model: str) -> Outcome:
    import agentnb
    from agentnb import Workspace

    _echo_tool()
    os.environ["OPENAI_BASE_URL"] = base_url
    os.environ.setdefault("OPENAI_API_KEY", "not-needed")
    tmp = tempfile.TemporaryDirectory(prefix="agentnb-throughput-")
    _TMP.append(tmp)
    ws = Workspace(Path(tmp.name) / "ws", otel=OTEL_URL or False)
    cases = [{"instruction": f"Echo greeting number {i}."} for i in range(jobs)]
    piece = agentnb.parse_piece(PIECE)
    # creating the batch (400 job rows and folders) is outside the timed region: the run is what is measured
    b = ws.batch(cases, piece=piece, model=model, name=f"c{concurrency}", run=False, progress=False)
    c0, t0 = time.process_time(), time.perf_counter()
    b.run(concurrency=concurrency, progress=False, processes=PROCESSES)
    # with processes: the worker processes' CPU too, as each reported it
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0 + b.last_run.worker_cpu_s
    counts = b.counts()
    if counts.get("succeeded") != jobs:
        bad = [j for j in b.jobs if str(j.status) != "succeeded"][:1]
        why = f"; e.g. job {bad[0].id}: {bad[0].status} {bad[0].error}" if bad else ""
        raise RuntimeError(f"agentnb: not every job succeeded: {counts}{why}")
    # what the store holds, not what we hoped: one llm_response row per call
    calls = int(ws.store.query("SELECT COUNT(*) FROM events WHERE kind='llm_response' AND job_id IN "
                               "(SELECT id FROM jobs WHERE batch=?)", (b.name,))[0][0])
    ws.close()  # a live export (--otel) sends what it still holds first
    return Outcome(elapsed, cpu, calls)


async def _gathered(run_one: Callable[[int], Any], jobs: int, concurrency: int) -> Outcome:
    """``run_one(i)`` for every job, ``concurrency`` at once; each returns the LLM calls it made."""
    gate = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> Any:
        async with gate:
            return await run_one(i)

    c0, t0 = time.process_time(), time.perf_counter()
    results = await asyncio.gather(*(bounded(i) for i in range(jobs)))
    return Outcome(time.perf_counter() - t0, time.process_time() - c0, sum(results))


def floor_run(base_url: str, jobs: int, concurrency: int) -> Outcome:
    """The same 5 requests per run over raw asyncio sockets (no HTTP library, no framework): what the
    endpoint and the machine allow."""
    host, port = base_url.split("//")[1].split("/")[0].split(":")

    async def go() -> Outcome:
        async def one(i: int) -> int:
            reader, writer = await asyncio.open_connection(host, int(port))
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"Echo greeting number {i}."}]
            calls = 0
            try:
                while True:
                    body = json.dumps({"model": MODEL, "messages": messages}).encode()
                    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: "
                                 b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:"))
                    message = json.loads(await reader.readexactly(length))["choices"][0]["message"]
                    calls += 1
                    messages.append(message)
                    if not message.get("tool_calls"):
                        return calls
                    messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "x"})
            finally:
                writer.close()

        return await _gathered(one, jobs, concurrency)

    return asyncio.run(go())


def langgraph_run(base_url: str, jobs: int, concurrency: int) -> Outcome:
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool as lc_tool
    from langchain_openai import ChatOpenAI

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_react_agent is deprecated in favour of langchain.agents
        from langgraph.prebuilt import create_react_agent

    @lc_tool
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    async def go() -> Outcome:
        import openai

        # a client of this event loop: langchain-openai's cached default one would outlive asyncio.run
        http = openai.DefaultAsyncHttpxClient()
        llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key="not-needed", max_retries=0,  # type: ignore[arg-type]
                         http_async_client=http)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            agent = create_react_agent(llm, [echo])

        async def one(i: int) -> int:
            out = await agent.ainvoke({"messages": [("user", f"Echo greeting number {i}.")]},
                                      {"recursion_limit": 4 * CALLS_PER_RUN})
            return sum(isinstance(m, AIMessage) for m in out["messages"])  # type: ignore[no-any-return]

        try:
            return await _gathered(one, jobs, concurrency)
        finally:
            await http.aclose()

    return asyncio.run(go())


def pydantic_ai_run(base_url: str, jobs: int, concurrency: int) -> Outcome:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    async def go() -> Outcome:
        model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key="not-needed"))
        agent = Agent(model, tools=[echo])

        async def one(i: int) -> int:
            result = await agent.run(f"Echo greeting number {i}.")
            return int(result.usage().requests)

        return await _gathered(one, jobs, concurrency)

    return asyncio.run(go())


@dataclass
class Framework:
    key: str
    label: str
    run: Runner


FRAMEWORKS = [
    Framework("floor", "floor: raw asyncio sockets, no HTTP library", floor_run),
    Framework("agentnb", "agentnb ws.batch (SQLite, every event)", agentnb_run),
    Framework("agentnb-stream", "agentnb ws.batch, streamed answers (--stream)", agentnb_stream_run),
    Framework("langgraph", "LangGraph create_react_agent + ChatOpenAI (gather of ainvoke)", langgraph_run),
    Framework("pydantic-ai", "pydantic-ai Agent + OpenAIChatModel (gather of run)", pydantic_ai_run),
]


# ---------------------------------------------------------------------------


@dataclass
class Level:
    concurrency: int
    jobs: int
    seconds: list[float] = field(default_factory=list)  # one per repeat
    cpu: list[float] = field(default_factory=list)  # process CPU seconds per repeat
    load: list[float] = field(default_factory=list)  # 1-minute load average before each repeat

    def calls_per_s(self) -> float:
        return self.jobs * CALLS_PER_RUN / statistics.median(self.seconds)

    def cpu_ms_per_call(self) -> float:
        """This process's CPU (every thread; time.process_time) per LLM call, in ms: the median over the repeats."""
        return statistics.median(self.cpu) * 1000 / (self.jobs * CALLS_PER_RUN)


@dataclass
class Result:
    key: str
    label: str
    error: str | None = None
    levels: list[Level] = field(default_factory=list)


def _warm_up(fw: Framework, base_url: str, res: Result) -> bool:
    """One small run (imports, the tokenizer, the first connections); False, with ``res.error`` said, when the
    framework cannot run."""
    try:
        fw.run(base_url, 4, 2)
    except ImportError:
        res.error = NOT_INSTALLED
        return False
    except Exception as exc:  # a peer's API changed: report it and go on with the others
        res.error = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return False
    finally:
        _cleanup()
    return True


def _run_once(fw: Framework, base_url: str, level: Level, latency: float, endpoint: Endpoint) -> None:
    """One timed run of ``fw`` at ``level``, checked against what the endpoint served, added to ``level``."""
    concurrency, jobs = level.concurrency, level.jobs
    load = os.getloadavg()[0]
    before, served_cpu = endpoint.requests(), endpoint.cpu()
    out = fw.run(base_url, jobs, concurrency)
    after_cpu = endpoint.cpu()
    elapsed, cpu, calls = out.seconds, out.cpu, out.calls
    served = endpoint.requests() - before - 1  # minus the count request itself
    _cleanup()
    if calls != jobs * CALLS_PER_RUN or served != jobs * CALLS_PER_RUN:
        raise RuntimeError(f"{fw.key} at concurrency {concurrency}: {calls} LLM calls recorded and "
                           f"{served} served, expected {jobs * CALLS_PER_RUN}")
    level.seconds.append(elapsed)
    level.cpu.append(cpu)
    level.load.append(load)
    ideal = concurrency / latency
    print(f"  {fw.key:14} c={concurrency:<3} jobs={jobs:<4} {elapsed:7.2f} s  "
          f"{jobs * CALLS_PER_RUN / elapsed:7.1f} calls/s  ratio {jobs * CALLS_PER_RUN / elapsed / ideal:.2f}  "
          f"CPU {cpu:6.2f} s ({cpu / elapsed:.0%} of wall, {cpu * 1000 / calls:.2f} ms a call)  load {load:.1f}"
          + (f"  endpoint CPU {after_cpu - served_cpu:.2f} s" if served_cpu is not None and after_cpu is not None
             else ""), file=sys.stderr, flush=True)


def measure(fw: Framework, base_url: str, plan: list[tuple[int, int]], repeat: int, latency: float,
            endpoint: Endpoint) -> Result:
    res = Result(fw.key, fw.label)
    if not _warm_up(fw, base_url, res):
        return res
    for concurrency, jobs in plan:
        level = Level(concurrency, jobs)
        for _ in range(repeat):
            _run_once(fw, base_url, level, latency, endpoint)
        res.levels.append(level)
    return res


def measure_paired(plain: Framework, streamed: Framework, base_url: str, plan: list[tuple[int, int]], repeat: int,
                   latency: float, endpoint: Endpoint) -> list[Result]:
    """``--stream``: agentnb's plain and streamed rows run in turns, level by level (plain then streamed, then the
    other way round, …), so that a machine that speeds up or slows down over the minutes weighs on both alike;
    :func:`stream_vs_plain` then also gives the median of each turn's own ratio."""
    results = [Result(plain.key, plain.label), Result(streamed.key, streamed.label)]
    if not all(_warm_up(fw, base_url, r) for fw, r in zip((plain, streamed), results, strict=True)):
        return results
    for concurrency, jobs in plan:
        levels = [Level(concurrency, jobs), Level(concurrency, jobs)]
        for i in range(repeat):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for k in order:
                _run_once((plain, streamed)[k], base_url, levels[k], latency, endpoint)
        for r, level in zip(results, levels, strict=True):
            r.levels.append(level)
    return results


def _cleanup() -> None:
    while _TMP:
        _TMP.pop().cleanup()


def _bound(jobs: int, concurrency: int) -> float:
    """The best ratio whole runs allow: the last wave of runs may be part-empty."""
    waves = math.ceil(jobs / concurrency)
    return (jobs / concurrency) / waves


def rows(results: list[Result], latency: float) -> list[list[str]]:
    head = ["framework", "concurrency", "jobs", "seconds (median)", "calls/s", "ideal calls/s", "ratio",
            "bound", "CPU ÷ wall", "CPU ms a call", "load avg"]
    out = [head]
    for r in results:
        if r.error:
            out.append([r.label, r.error] + [""] * (len(head) - 2))
            continue
        for lv in r.levels:
            ideal = lv.concurrency / latency
            cps = lv.calls_per_s()
            sec = statistics.median(lv.seconds)
            cpu = statistics.median(c / s for c, s in zip(lv.cpu, lv.seconds, strict=True))
            out.append([r.label, str(lv.concurrency), str(lv.jobs), f"{sec:.2f}", f"{cps:.1f}", f"{ideal:.0f}",
                        f"{cps / ideal:.2f}", f"{_bound(lv.jobs, lv.concurrency):.2f}", f"{cpu:.0%}",
                        f"{lv.cpu_ms_per_call():.2f}", "/".join(f"{x:.1f}" for x in lv.load)])
    return out


def stream_vs_plain(results: list[Result]) -> list[str]:
    """With ``--stream``: at each level, streamed ÷ plain calls/s and CPU a call, both rows of the same run."""
    by_key = {r.key: r for r in results if not r.error}
    plain, streamed = by_key.get("agentnb"), by_key.get("agentnb-stream")
    if plain is None or streamed is None:
        return []
    out = ["", "streamed ÷ plain, same run, in turns (issue 28's target: at most 10% fewer calls/s at 8 and 32):"]
    for p, s in zip(plain.levels, streamed.levels, strict=False):
        turns = [ps / ss - 1 for ps, ss in zip(p.seconds, s.seconds, strict=False)]  # calls/s ratio of each turn
        out.append(f"  concurrency {p.concurrency}: calls/s {s.calls_per_s():.1f} ÷ {p.calls_per_s():.1f} = "
                   f"{s.calls_per_s() / p.calls_per_s() - 1:+.0%}; CPU a call {s.cpu_ms_per_call():.2f} ms ÷ "
                   f"{p.cpu_ms_per_call():.2f} ms = {s.cpu_ms_per_call() / p.cpu_ms_per_call() - 1:+.0%}"
                   + (f"; each turn's calls/s ratio {' '.join(f'{t:+.0%}' for t in turns)}, median "
                      f"{statistics.median(turns):+.0%}" if len(turns) > 1 else ""))
    return out


def _print(table: list[list[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(table[0]) + " |")
        print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(table[0]))) + "|")
        for row in table[1:]:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(row[i]) for row in table if i < len(row)) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=False))))


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "sqlite": __import__("sqlite3").sqlite_version}
    for name in ("agentnb", "openai", "httpx", "langgraph", "langchain-openai", "pydantic-ai-slim"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="1,8,32,64", help="concurrency levels, comma-separated (default 1,8,32,64)")
    p.add_argument("--jobs", type=int, default=400, help="jobs (runs) per level (default 400)")
    p.add_argument("--jobs-c1", type=int, default=100,
                   help="jobs at concurrency 1 (default 100: 400 would take 400×5×latency = 100 s)")
    p.add_argument("--latency", type=float, default=0.05, help="the endpoint's latency in seconds (default 0.05)")
    p.add_argument("--repeat", type=int, default=1, help="runs per level; the median is shown (default 1)")
    p.add_argument("--only", default="", help="frameworks to run, comma-separated: " +
                   ", ".join(f.key for f in FRAMEWORKS))
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--json", metavar="PATH", help="also save the results as JSON")
    p.add_argument("--serve", action="store_true", help="only run the endpoint (prints PORT n)")
    p.add_argument("--port", type=int, default=0, help="with --serve: the port (default: any free one)")
    p.add_argument("--stream", action="store_true",
                   help=f"also run agentnb with streamed answers (about {STREAM_CHUNKS} chunks each)")
    p.add_argument("--processes", type=int, metavar="N",
                   help="agentnb's rows run in N worker processes (default 1: this one; their CPU is counted too)")
    p.add_argument("--otel", action="store_true",
                   help="agentnb exports its spans live to a loopback OTLP/HTTP receiver (docs/otel.md#live)")
    args = p.parse_args(argv)
    if args.otel:
        global OTEL_URL
        sys.path.insert(0, str(Path(__file__).parent))
        from overhead import otlp_receiver

        OTEL_URL, received = otlp_receiver()
    if args.serve:
        serve(args.port, args.latency)
        return 0
    if args.processes:
        global PROCESSES
        PROCESSES = args.processes
        for i, f in enumerate(FRAMEWORKS):
            if f.key.startswith("agentnb"):
                FRAMEWORKS[i] = dataclasses.replace(f, label=f"{f.label}, processes={PROCESSES}")
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    plan = [(c, args.jobs_c1 if c == 1 else args.jobs) for c in levels]
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = only - {f.key for f in FRAMEWORKS}
    if unknown:
        p.error(f"--only: unknown {', '.join(sorted(unknown))}; allowed: {', '.join(f.key for f in FRAMEWORKS)}")
    chosen = [f for f in FRAMEWORKS if (not only or f.key in only or (args.stream and f.key == "agentnb-stream"
                                                                       and "agentnb" in only))
              and (f.key != "agentnb-stream" or args.stream or f.key in only)]
    results = []
    with Endpoint(args.latency) as endpoint:
        if PROCESSES > 1 and any(f.key.startswith("agentnb") for f in chosen):
            # the fork server starts with a process's first batch in processes (about a second, once): started here,
            # untimed, as a notebook's later batches find it
            _agentnb(endpoint.base_url, PROCESSES, PROCESSES, f"openai:{MODEL}?stream=0")
            _cleanup()
        keys = [f.key for f in chosen]
        paired = "agentnb" in keys and "agentnb-stream" in keys
        for fw in chosen:
            if paired and fw.key == "agentnb-stream":
                continue  # measured in turns with the plain row, below it
            print(f"{fw.label}:", file=sys.stderr, flush=True)
            start = len(results)
            if paired and fw.key == "agentnb":
                streamed = chosen[keys.index("agentnb-stream")]
                print(f"{streamed.label}, in turns with it:", file=sys.stderr, flush=True)
                results.extend(measure_paired(fw, streamed, endpoint.base_url, plan, args.repeat, args.latency,
                                              endpoint))
            else:
                results.append(measure(fw, endpoint.base_url, plan, args.repeat, args.latency, endpoint))
            for r in results[start:]:
                if r.error:
                    print(f"  {r.key}: {r.error}", file=sys.stderr, flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
            "machine": platform.machine(), "latency_s": args.latency, "calls_per_run": CALLS_PER_RUN,
            "versions": _versions()}
    c1 = [c for c, j in plan if c == 1 and j != args.jobs]
    print(f"\n{meta['date']}, {meta['cpus']} CPUs, latency {args.latency * 1000:.0f} ms, {CALLS_PER_RUN} calls per "
          f"run ({TOOL_CALLS} echo tool calls + the end); ideal = concurrency ÷ latency; bound = the best ratio "
          f"whole runs allow (ceil(jobs ÷ concurrency) waves)"
          + (f"; concurrency 1 ran {args.jobs_c1} jobs, not {args.jobs}" if c1 else ""))
    print("versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + "\n")
    if args.otel:
        print(f"agentnb exported its spans live to {OTEL_URL}: {len(received)} requests, {sum(received):,} bytes\n")
    _print(rows(results, args.latency), args.markdown)
    for line in stream_vs_plain(results):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=1),
                                   encoding="utf-8")
    return 0 if all(r.error is None or r.error == NOT_INSTALLED for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
