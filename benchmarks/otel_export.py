"""What OpenTelemetry export costs (issue 30's performance targets, docs/otel.md): a file, and live.

* **File** — ``ws.export_otel`` of one finished 1,000-call job (``overhead.py``'s workload: 2,002 spans) to a
  file, the whole path: reading the job's events, the fold, the mapping, the OTLP JSON encoding and the
  writing.  CPU milliseconds per span (target: at most 0.1), the median of ``--repeat`` runs after a
  warm-up, with the share of each stage.
* **Live** — the same workloads with and without ``Workspace(otel=URL)``, URL a loopback OTLP/HTTP receiver in a
  child process (its CPU is not this process's; it decodes each request and counts the spans, which must be
  every span of every job): ``overhead.py``'s runs of 200 and 1,000 calls and ``batch_throughput.py``'s 400 jobs
  at concurrency 32 (target: at most +5%).  Runs alternate plain / live, pairs in turn plain-first and
  live-first; each figure is the median of ``--repeat``.  Four costs are given: what the benchmark itself
  measures (the run's CPU and wall time, with the export's work that overlaps it), the live exporter thread's
  own CPU (``time.thread_time``: in the run's process it only hands the notes to the export's process, or does
  the export's work where there is none), all the CPU the export adds to the run's process, the spans still
  queued at the end of the run included (``ws.close()`` waits for them), and the CPU of the export's own process
  (reading, mapping and posting the spans, on another core) — each ÷ the plain run's CPU.

CPU time (``time.process_time``, every thread of the process) is what the targets are checked on: the machine
these figures come from is shared, and wall times there swing by ±30% between identical runs.

    python benchmarks/otel_export.py                   # file, then live (about 5 minutes)
    python benchmarks/otel_export.py --only file --repeat 5
    python benchmarks/otel_export.py --only overhead,batch --jobs 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import batch_throughput
import overhead

__all__ = ["main"]


# ---------------------------------------------------------------------------
# the receiver: a child process, so its CPU is not counted as agentnb's


def serve() -> None:
    """A loopback OTLP/HTTP receiver: answers 200 to every ``POST /v1/traces`` and counts the spans in it
    (``GET /count``: the spans so far)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans = 0

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            nonlocal spans
            request = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
            spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            self._answer(b"")

        def do_GET(self) -> None:
            self._answer(str(spans).encode())

        def _answer(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


class Receiver:
    def __enter__(self) -> Receiver:
        self.proc, port = batch_throughput.start_server([__file__, "--serve"], "the receiver")
        self.url = f"http://127.0.0.1:{port}"
        return self

    def spans(self) -> int:
        import urllib.request

        with urllib.request.urlopen(self.url + "/count", timeout=10) as r:
            return int(r.read())

    def __exit__(self, *exc: Any) -> None:
        self.proc.kill()
        self.proc.wait()


# ---------------------------------------------------------------------------
# file export


def file_export(n: int, repeat: int) -> dict[str, float]:
    """CPU ms per span of ``ws.export_otel`` of one ``n``-call job, and of its stages (medians)."""
    from google.protobuf import json_format  # noqa: F401  (imported before timing, as export_otel's are)

    from agentnb.views import otel
    from agentnb.views._otel_spans import trace_of

    run = overhead.agentnb_run(n)
    count = run()
    cells = dict(zip(run.__code__.co_freevars, (c.cell_contents for c in run.__closure__ or ()), strict=True))
    ws, job = cells["ws"], cells["job"]  # the prepared run's workspace and job
    path = Path(overhead._TMP[-1].name) / "traces.jsonl"
    record = ws.store.job(job.id)

    def cpu(f: Callable[[], Any]) -> tuple[float, Any]:
        f()  # warm-up
        times, out = [], None
        for _ in range(repeat):
            c0 = time.process_time()
            out = f()
            times.append(time.process_time() - c0)
        return statistics.median(times), out

    total, _ = cpu(lambda: ws.export_otel(job, path))
    spans = sum(len(ss.spans) for d in otel.read_traces(path) for rs in d.resource_spans for ss in rs.scope_spans)
    events, _ = cpu(lambda: ws.store.events(job.id))
    mapped, trace = cpu(lambda: trace_of(ws.store, record))
    encoded, _ = cpu(lambda: otel.traces_json(trace))
    count()
    overhead._cleanup()
    ms = 1000 / spans
    return {"spans": spans, "total": total * ms, "events": events * ms, "fold_map": (mapped - events) * ms,
            "encode": encoded * ms, "rest": (total - mapped - encoded) * ms}


# ---------------------------------------------------------------------------
# live export

EXPORTER_CPU: list[float] = []  # CPU seconds of each live exporter thread, when it ended
PROCESS_CPU: list[float] = []  # CPU seconds of each live export's own process, when it ended


def _count_exporter_cpu() -> None:
    """Have each live exporter thread add its own CPU time (``time.thread_time``) to EXPORTER_CPU as it ends, and
    each export's process its CPU to PROCESS_CPU when its workspace closes: the export's work measured apart from
    the run's, which a difference of two noisy process times is not."""
    from agentnb.views import otel_live
    from agentnb.views.otel_live import LiveExport

    work = otel_live._work

    def counted(*args: Any) -> None:
        try:
            work(*args)
        finally:
            EXPORTER_CPU.append(time.thread_time())

    otel_live._work = counted  # type: ignore[assignment]
    close = LiveExport.close

    def closed(self: LiveExport, wait: float | None = None) -> None:
        close(self, wait)
        PROCESS_CPU.append(self.process_cpu or 0.0)

    LiveExport.close = closed  # type: ignore[method-assign]


def _overhead_run(n: int, url: str | None) -> tuple[float, float, float]:
    """One overhead.py agentnb run of n calls: (wall s, CPU s) of the run as overhead.py times it, and the CPU s
    of the run and its export together (up to ws.close(), which sends what is still queued)."""
    overhead.OTEL_URL = url
    run = overhead.agentnb_run(n)
    import gc

    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    count = run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    calls = count()  # closes the workspace: waits for the export
    everything = time.process_time() - c0
    overhead._cleanup()
    if calls != n:
        raise RuntimeError(f"made {calls} LLM calls, expected {n}")
    return wall, cpu, everything


def _batch_run(base_url: str, jobs: int, url: str | None) -> tuple[float, float, float]:
    """One batch_throughput.py agentnb batch of ``jobs`` at concurrency 32: (wall s, CPU s) of the batch as the
    benchmark times it, and the CPU s of the whole call (building the batch and ws.close() included)."""
    batch_throughput.OTEL_URL = url
    c0 = time.process_time()
    out = batch_throughput.agentnb_run(base_url, jobs, 32)
    everything = time.process_time() - c0
    batch_throughput._cleanup()
    if out.calls != jobs * batch_throughput.CALLS_PER_RUN:
        raise RuntimeError(f"{out.calls} LLM calls recorded, expected {jobs * batch_throughput.CALLS_PER_RUN}")
    return out.seconds, out.cpu, everything


def live(name: str, one: Callable[[str | None], tuple[float, float, float]], spans_per_run: int, repeat: int,
         receiver: Receiver) -> list[str]:
    one(None)  # warm-up: imports, the tokenizer, the first connections
    one(receiver.url)
    plain: list[tuple[float, float, float]] = []
    otel: list[tuple[float, float, float]] = []
    exporter: list[float] = []
    process: list[float] = []

    def live_run() -> None:
        before, threads, processes = receiver.spans(), len(EXPORTER_CPU), len(PROCESS_CPU)
        otel.append(one(receiver.url))
        exporter.append(sum(EXPORTER_CPU[threads:]))
        process.append(sum(PROCESS_CPU[processes:]))
        got = receiver.spans() - before
        if got != spans_per_run:
            raise RuntimeError(f"{name}: the receiver got {got} spans, expected {spans_per_run}")

    for i in range(repeat):
        # plain first, then live first: the second run of a pair is not always as fast as the first
        if i % 2 == 0:
            plain.append(one(None))
            live_run()
        else:
            live_run()
            plain.append(one(None))
    med = [statistics.median(x[i] for x in plain) for i in range(3)]
    liv = [statistics.median(x[i] for x in otel) for i in range(3)]
    added = statistics.median(o[2] - p[2] for p, o in zip(plain, otel, strict=True))
    thread = statistics.median(exporter)
    child = statistics.median(process)
    print(f"  {name}: CPU {med[1]:.3f} → {liv[1]:.3f} s ({liv[1] / med[1] - 1:+.1%}), wall {med[0]:.3f} → "
          f"{liv[0]:.3f} s ({liv[0] / med[0] - 1:+.1%}); the exporter thread's CPU {thread * 1000:.0f} ms "
          f"({thread / med[1]:.1%} of the run's), all the CPU the export adds to the run's process {added * 1000:.0f} "
          f"ms ({added / med[1]:+.1%}), the export process's CPU {child * 1000:.0f} ms ({child / med[1]:.1%}); "
          f"{spans_per_run} spans received per run", flush=True)
    return [name, f"{med[1]:.3f} / {liv[1]:.3f}", f"{liv[1] / med[1] - 1:+.1%}", f"{med[0]:.3f} / {liv[0]:.3f}",
            f"{liv[0] / med[0] - 1:+.1%}", f"{thread / med[1]:.1%}", f"{added / med[1]:+.1%}", f"{child / med[1]:.1%}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="file,overhead,batch", help="any of: file, overhead, batch (default: all)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each; medians are shown (default 3)")
    p.add_argument("--calls", type=int, default=1000, help="calls of the file export's job (default 1,000)")
    p.add_argument("--jobs", type=int, default=400, help="jobs of the batch at concurrency 32 (default 400)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve()
        return 0
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    if only - {"file", "overhead", "batch"}:
        p.error(f"--only: unknown {', '.join(sorted(only - {'file', 'overhead', 'batch'}))}; allowed: file, "
                "overhead, batch")
    print(f"# {overhead.machine()}; medians of {args.repeat} (CPU = time.process_time, all threads)", flush=True)
    if "file" in only:
        f = file_export(args.calls, args.repeat)
        print(f"file export of a {args.calls}-call job ({f['spans']} spans): {f['total']:.3f} ms CPU per span "
              f"(target 0.1): reading the events {f['events']:.3f}, fold + mapping {f['fold_map']:.3f}, OTLP JSON "
              f"{f['encode']:.3f}, the rest (the file, the root jobs) {f['rest']:.3f}", flush=True)
    rows = [["workload", "CPU s plain / live", "CPU", "wall s plain / live", "wall", "exporter thread CPU ÷ run CPU",
             "all CPU added to the process ÷ run CPU", "export process CPU ÷ run CPU"]]
    _count_exporter_cpu()
    with Receiver() as receiver:
        if "overhead" in only:
            print("live export, overhead.py (one run, agentnb alone):", flush=True)
            for n in (200, 1000):
                rows.append(live(f"overhead.py @{n}", lambda url, n=n: _overhead_run(n, url), 2 * n + 2,
                                 args.repeat, receiver))
        if "batch" in only:
            print(f"live export, batch_throughput.py ({args.jobs} jobs at concurrency 32, 50 ms latency):", flush=True)
            with batch_throughput.Endpoint(0.05) as endpoint:
                spans = args.jobs * (2 + 2 * batch_throughput.CALLS_PER_RUN)
                rows.append(live("batch_throughput.py c=32", lambda url: _batch_run(endpoint.base_url, args.jobs, url),
                                 spans, args.repeat, receiver))
    if len(rows) > 1:
        print(f"\nload average {os.getloadavg()[0]:.1f}\n")
        print("| " + " | ".join(rows[0]) + " |")
        print("|---" + "|---:" * (len(rows[0]) - 1) + "|")
        for row in rows[1:]:
            print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
