"""Comparable snapshots of what a user sees: a fixed clock and folder to build them in, masks for what still
changes between two builds, and the walk that lists their differences.

Shared by the golden tests (``tests/_golden.py``: stored snapshots against today's code) and
``benchmarks/parity.py`` (two checkouts against each other), so that both mask and compare the same way.
Nothing here imports agentnb: parity loads whichever version the interpreter finds.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["CLOCK_START", "STYLER_MASK", "VOLATILE_KEYS", "differences", "env", "excerpt", "fixed_clock",
           "locked_folder", "normalise"]

# keys whose values are clock readings or measured durations, wherever they appear (events, rows, frames)
VOLATILE_KEYS = frozenset({"ts", "created", "started", "updated", "ended", "latency_s", "ttft_s", "duration",
                           "timestamp"})
CLOCK_MASKS: list[tuple[re.Pattern[str], str]] = [
    # dates the CLI process (real clock) and files written outside the fixed clock show
    (re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(:\d\d(\.\d+)?)?( \(\w+, [^)]*\))?"), "<time>"),
    # the claiming process: host:pid:random
    (re.compile(r"claimed by \S+:\d+:[0-9a-f]{8}"), "claimed by <owner>"),
    # measured times in views ("412 ms", "<1 ms", "0.6 s", "2 min 5 s"); the clock itself is fixed
    (re.compile(r"(?<![\w.,])(?:&lt;1|<1|\d+(?:\.\d+)?) (?:ms|s)\b"), "<dur>"),
    (re.compile(r"(?<![\w.,])\d+ (?:min|h) <dur>"), "<dur>"),
]
# a pandas Styler's random table id (the batch and comparison tables parity dumps)
STYLER_MASK = (re.compile(r"\bT_[0-9a-f]{5}(?![0-9a-f])"), "T_<styler>")
# Token counts (tiktoken or chars) depend on every character of a prompt, and prompts hold the date, the
# comments' times and the paths of scripts: so the clock is fixed, TZ is UTC and each build runs in the same
# folder (a lock keeps two builds on this machine apart).  Masking those would not make the counts equal.
CLOCK_START = 1_736_150_400.0  # 2025-01-06 08:00:00 UTC, a Monday; each build takes far less than a minute


def normalise(value: Any, tmp: str, *, volatile: Iterable[str] = VOLATILE_KEYS,
              masks: Iterable[tuple[re.Pattern[str], str]] = ()) -> Any:
    """``value`` with the temporary folder as ``<TMP>``, clock readings and durations masked (``volatile`` keys
    wherever they are; ``CLOCK_MASKS`` and ``masks`` in text)."""
    keys, patterns = frozenset(volatile), [*CLOCK_MASKS, *masks]

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            return {str(k): "<masked>" if k in keys and x is not None else walk(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [walk(x) for x in v]
        if isinstance(v, str):
            v = v.replace(tmp, "<TMP>")
            for pattern, mask in patterns:
                v = pattern.sub(mask, v)
        return v

    return walk(value)


def differences(old: Any, new: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """Each place where ``new`` differs from ``old``: (path, old value, new value), in document order."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(old.keys() | new.keys()):
            yield from differences(old.get(key, "<absent>"), new.get(key, "<absent>"), f"{path}/{key}")
    elif isinstance(old, list) and isinstance(new, list):
        for i, (a, b) in enumerate(zip(old, new, strict=False)):
            yield from differences(a, b, f"{path}[{i}]")
        if len(old) != len(new):
            yield f"{path} (length)", len(old), len(new)
    elif old != new or type(old) is not type(new):
        yield path, old, new


def excerpt(old: Any, new: Any, width: int = 160) -> tuple[str, str]:
    """Both values around where they first differ, short enough to read in a failure or a report."""
    a, b = (v if isinstance(v, str) else json.dumps(v, sort_keys=True, ensure_ascii=False) for v in (old, new))
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    start = max(0, i - width // 2)
    return tuple(("…" if start else "") + repr(v[start:start + width])[1:-1] + ("…" if len(v) > start + width else "")
                 for v in (a, b))  # type: ignore[return-value]


@contextlib.contextmanager
def env(name: str, value: str) -> Iterator[None]:
    """Environment variable ``name`` set to ``value`` inside the block, as it was after it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


@contextlib.contextmanager
def fixed_clock() -> Iterator[None]:
    """``time.time`` and the ``datetime.now`` of every loaded agentnb module start at ``CLOCK_START``, TZ=UTC."""
    real_time, started = time.time, time.monotonic()

    def fake_time() -> float:
        return CLOCK_START + (time.monotonic() - started)

    class FixedDatetime(datetime.datetime):
        @classmethod
        def now(cls, tz: datetime.tzinfo | None = None) -> Any:
            return datetime.datetime.fromtimestamp(fake_time(), tz)

    patched = [m for n, m in list(sys.modules.items())
               if n.split(".")[0] == "agentnb" and getattr(m, "datetime", None) is datetime.datetime]
    with env("TZ", "UTC"):
        time.tzset()
        time.time = fake_time  # type: ignore[assignment]
        for m in patched:
            m.datetime = FixedDatetime  # type: ignore[attr-defined]
        try:
            yield
        finally:
            time.time = real_time  # type: ignore[assignment]
            for m in patched:
                m.datetime = datetime.datetime  # type: ignore[attr-defined]
    time.tzset()


@contextlib.contextmanager
def locked_folder(base_name: str, name: str) -> Iterator[Path]:
    """An empty ``<tmp>/<base_name>/<name>`` (the same path every time), held under a lock, removed after."""
    base = Path(tempfile.gettempdir()) / base_name
    base.mkdir(exist_ok=True)
    with open(base / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tmp = base / name
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            yield tmp.resolve()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
