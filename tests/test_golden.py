"""Characterisation: every golden case, built again, shows a user exactly what tests/golden/<case>.json holds.

The files were written by ``python tests/_golden.py --write`` from the code before the typed-events redesign,
and re-recorded once for the cost and batch columns with nothing but their additions (``cost_usd`` in ``frames.usage`` and
``frames.jobs``, ``batch``/``case`` in ``frames.jobs``, the cost in the job header) — checked by stripping
those from the new files and finding the old ones byte for byte; a difference is a change a user would
see (or a volatile value the harness should have masked).  Loop monitors re-recorded them for one addition,
``frames.movements()``'s ``judge`` column (False for every run of these pieces, which have no loop monitors):
stripped of it, every file equals the one before.  The views' symbols re-recorded them once more (each
emoji replaced by a character DejaVu Sans has, with an aria-label and title in HTML): with those replacements
undone, every file equals the one before.  MCP servers as tool sources re-recorded them for one addition,
``frames.tool_calls()``'s ``server`` column (null for every call of these jobs, which use no MCP server): stripped
of it, every file equals the one before.  The call cache re-recorded them for one addition, ``frames.usage()``'s
``cached`` column (False for every call of these jobs, which use no cache): stripped of it, every file equals the
one before.  LLM judges re-recorded them for one addition, ``frames.usage()``'s ``purpose`` column (null for every
call of these jobs, none of them a judge's or a compaction's): stripped of it, every file equals the one before.
A scripted call's request committed with its response (when nobody watches) re-recorded two cases, subtasks and
fanout-ja, for event ids alone: a parent's request now commits after the subtasks it creates, so the jobs' events
interleave differently in the store's one id sequence; 9 ids changed and nothing else.
"""

from __future__ import annotations

import json

import _golden
import _snapshots
import pytest


@pytest.mark.parametrize("case", sorted(_golden.CASES))
def test_case_matches_its_golden_file(case: str) -> None:
    stored = json.loads((_golden.GOLDEN / f"{case}.json").read_text(encoding="utf-8"))
    built = json.loads(_golden.dump(_golden.build(case)))
    diffs = list(_snapshots.differences(stored, built))
    if diffs:
        path, old, new = diffs[0]
        pytest.fail(f"golden case {case!r}: {len(diffs)} difference(s); first at {path}\n"
                    f"  golden: {_snapshots.excerpt(old, new)[0]}\n  now:    {_snapshots.excerpt(old, new)[1]}",
                    pytrace=False)


def test_every_golden_file_has_a_case() -> None:
    assert sorted(p.stem for p in _golden.GOLDEN.glob("*.json")) == sorted(_golden.CASES)
