"""A job run again one call per fresh Python process, and compared with a straight run of the same steps: what a
worker that dies or stops between any two calls must leave (docs/job-states.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from agentnb import Workspace

__all__ = ["CHILD", "NOW", "REPO", "comparable", "step_in_children", "timeless"]

REPO = Path(__file__).resolve().parents[1]
# the prompts' clock, to the minute
NOW = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d \(\w+, UTC\)")
CALL_ID = re.compile(r"call_\d+_\d+")
# a fresh process: `python -c CHILD <workspace> <job id> call|run` steps the job one call, or runs it to its end
CHILD = ("import sys; from agentnb import Workspace; ws = Workspace(sys.argv[1]); job = int(sys.argv[2]); "
         "print(ws.step(job, unit='call').status if sys.argv[3] == 'call' else ws.run(job).status)")


def timeless(value: Any) -> Any:
    """``value`` with the prompts' clock masked and the loopback server's tool-call ids (``call_<request>_<i>``: a
    request asked again moves them on) numbered by first appearance, so two runs of the same steps compare."""
    ids: dict[str, str] = {}
    masked = NOW.sub("<now>", json.dumps(value))
    return json.loads(CALL_ID.sub(lambda m: ids.setdefault(m.group(0), f"id{len(ids)}"), masked))


def comparable(ws: Workspace, job: Any) -> list[tuple[Any, ...]]:
    """Events minus what differs between two runs of the same steps (times, latency, claim owners, the endpoint's
    id for each answer, which counts its requests, the job_status events stepping adds), the prompts' clock
    masked."""
    out = []
    for e in ws.events(job):
        if e.kind == "job_status":
            continue
        payload = {k: v for k, v in e.payload.items() if k not in ("latency_s", "ttft_s", "ts", "owner", "response_id")}
        out.append((e.kind, e.movement_seq, e.iteration, NOW.sub("<now>", json.dumps(payload, sort_keys=True,
                                                                                    default=str))))
    return out


def step_in_children(ws: Workspace, job: Any, env: dict[str, str] | None = None, limit: int = 80) -> list[str]:
    """Step ``job`` one call per fresh Python process until it ends; the statuses each step left."""
    statuses: list[str] = []
    child_env = {**(env or os.environ), "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    while len(statuses) < limit:
        done = subprocess.run([sys.executable, "-c", CHILD, str(ws.root), str(job.id), "call"], capture_output=True,
                              text=True, cwd=REPO, timeout=120, env=child_env)
        assert done.returncode == 0, done.stderr[-3000:]
        statuses.append(done.stdout.strip())
        if statuses[-1] != "queued":
            return statuses
    raise AssertionError(f"job {job.id} did not end within {limit} steps: {statuses[-5:]}")
