"""Where a fork (DESIGN §11) came from, in plain text: which job and run it forked from, and which of its runs
were re-served from which job; the job view's header, the transcript's title and the compare view say it.
``render`` re-exports ``reserved_runs`` and ``fork_lines``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..events import Event, MovementStart
from .source import JobRecord

__all__ = ["fork_lines", "reserved_runs", "runs_text"]


def reserved_runs(events: Iterable[Event]) -> dict[int, int]:
    """Movement run → the job it was re-served from, for every run of a fork (or a ``replay:`` job) whose
    ``movement_start`` names one (its responses came from that job's record; no tokens were spent)."""
    return {int(ev.movement_seq): ev.replayed_from for ev in events
            if isinstance(ev, MovementStart) and ev.replayed_from is not None and ev.movement_seq is not None}


def runs_text(seqs: Sequence[int]) -> str:
    """``run 1``, ``runs 1–2``, ``runs 1–2, 4``: sorted movement runs with consecutive ones joined."""
    spans: list[list[int]] = []
    for seq in sorted(seqs):
        if spans and seq == spans[-1][1] + 1:
            spans[-1][1] = seq
        else:
            spans.append([seq, seq])
    text = ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in spans)
    return ("runs " if len(seqs) > 1 else "run ") + text


def fork_lines(job: JobRecord, events: Iterable[Event]) -> list[str]:
    """Where a job came from, in plain text: ``forked from job 1 at run 3`` for a fork, then which runs were
    re-served from which job (``runs 1–2 re-served from job 1``; a fork at run 1 re-serves none)."""
    lines: list[str] = []
    origin = getattr(job, "forked_from", None)  # a JobRecord of a source written before forks: none
    if origin is not None:
        lines.append(f"forked from job {origin[0]} at run {origin[1]}")
    by_source: dict[int, list[int]] = {}
    for seq, source in reserved_runs(events).items():
        by_source.setdefault(source, []).append(seq)
    lines.extend(f"{runs_text(seqs)} re-served from job {source}" for source, seqs in by_source.items())
    if origin is not None and not by_source:
        lines.append("no run re-served: every run is live")
    return lines
