"""The write-back after a tool call on PostgreSQL, with N MB of unchanged files in the work directory.

Where the store keeps a job's files (docs/stores.md#files), the work directory is compared with the store after every
tool call (``engine/jobfiles.plan_write_back``).  Before the running job kept a cache of its files' hashes
(``engine/_filecache.FileCache``), every file was read and hashed each time; now a file whose stat is the one
it was hashed at (and old enough to vouch for it) is not read.  The benchmark submits a job whose ``input/``
holds ``--files`` files of ``--mb`` MB in all, materialises it as a claim does, waits until the files are
older than the cache's 2 s margin, then times ``plan_write_back`` with nothing changed, ``--rounds`` times
each: without a cache (every file hashed, as before) and with the job's cache (as now).  It prints the median
of each and their ratio, and checks that both found nothing to write.

It starts a throw-away PostgreSQL cluster (``tests/_postgres.py``) unless ``AGENTNB_TEST_PG`` names a server.

    python benchmarks/files_writeback.py                 # 50 MB in 50 files, 9 rounds
    python benchmarks/files_writeback.py --mb 100 --files 1000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _postgres import pg_server  # noqa: E402

from agentnb import Workspace  # noqa: E402
from agentnb.engine import _filecache  # noqa: E402
from agentnb.engine.jobfiles import FileCache, WriteBack, materialise, plan_write_back  # noqa: E402

__all__ = ["main"]


def _timed(fn: Callable[[], WriteBack], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        started = time.perf_counter()
        plan = fn()
        out.append(time.perf_counter() - started)
        assert plan.empty, "nothing changed, yet the write-back found something to write"
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=50.0, help="megabytes of input files in all (default 50)")
    parser.add_argument("--files", type=int, default=50, help="how many files (default 50)")
    parser.add_argument("--rounds", type=int, default=9, help="write-backs timed each way (default 9)")
    args = parser.parse_args(argv)
    size = int(args.mb * 1000**2 / args.files)
    with tempfile.TemporaryDirectory(prefix="agentnb-files-bench-") as tmp, pg_server() as pg:
        url = pg.create_database()
        ws = Workspace(Path(tmp) / "submitter", store=url)
        inputs = {f"part{i:04d}.bin": os.urandom(size) for i in range(args.files)}
        job = ws.submit("benchmark", piece="single", model="demo", inputs=inputs)
        worker = Path(tmp) / "worker" / "jobs" / str(job.id)  # another machine's folder: written by the claim
        cache = FileCache()
        materialise(ws.store, job.id, worker, cache)
        newest = max(max(os.stat(p).st_mtime_ns, os.stat(p).st_ctime_ns) for p in worker.rglob("*") if p.is_file())
        time.sleep(max(0.0, (newest + _filecache.RACY_NS - time.time_ns()) / 1e9 + 0.05))
        plan_write_back(ws.store, job.id, worker, 10**12, cache)  # hashed once more, now old enough to trust
        reads: list[Path] = []
        _filecache.on_read = reads.append
        before = _timed(lambda: plan_write_back(ws.store, job.id, worker, 10**12), args.rounds)
        hashed_before = len(reads) // args.rounds
        reads.clear()
        after = _timed(lambda: plan_write_back(ws.store, job.id, worker, 10**12, cache), args.rounds)
        hashed_after = len(reads) // args.rounds
        _filecache.on_read = None
        ws.close()
    b, a = statistics.median(before), statistics.median(after)
    total = size * args.files
    print(f"{total / 1000**2:.0f} MB in {args.files} unchanged files, PostgreSQL, median of {args.rounds}")
    print(f"| write-back after a tool call | ms | files read |\n|---|---:|---:|\n"
          f"| before (every file hashed) | {b * 1000:.1f} | {hashed_before} |\n"
          f"| now (the job's cache) | {a * 1000:.1f} | {hashed_after} |")
    print(f"ratio before/now: {b / a:.0f}x")


if __name__ == "__main__":
    main()
