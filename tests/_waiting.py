"""Waiting on real progress of worker processes: a condition polled until it holds, failing early (with the
worker's output) when a worker ends first.  The limit only keeps a broken test from hanging; it is generous
because CI's 2 cores are loaded."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

__all__ = ["wait_for"]


def wait_for(what: str, done: Callable[[], object], procs: list[subprocess.Popen[str]], limit: float = 90) -> None:
    """Poll ``done()`` until it is true; fail naming ``what`` if one of ``procs`` ends first or ``limit`` s pass."""
    deadline = time.monotonic() + limit
    while not done():
        for p in procs:
            if p.poll() is not None:
                out, err = p.communicate()
                raise AssertionError(f"a worker ended before {what}: {p.returncode}\n{out}\n{err}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
