"""Loop monitors (docs/context.md#loop-monitors): has a cycle of movements repeated ``threshold`` times since its monitor's last
judgement?

Everything here is derived from what the store already holds — the finished movement runs (their names and
summaries) and the ``loop_detected`` events (the judgements so far) — so a restarted runner or a fork that
re-serves the runs finds the same loops without any state of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..events import LoopDetected
from .pieces import LoopMonitor
from .prompts import text

__all__ = ["Loop", "Run", "find_loop", "judge_instruction", "last_judgements"]


@dataclass(frozen=True, slots=True)
class Run:
    """A finished movement run: its sequence number, movement name and transition summary."""

    seq: int
    name: str
    summary: str


@dataclass(frozen=True, slots=True)
class Loop:
    monitor: LoopMonitor
    runs: tuple[Run, ...]


def last_judgements(events: Sequence[object]) -> dict[str, int]:
    """Monitor name → the run that closed its last detected loop (the count starts again after it)."""
    return {ev.monitor: int(ev.movement_seq or 0) for ev in events if isinstance(ev, LoopDetected)}


def find_loop(monitors: Sequence[LoopMonitor], runs: Sequence[Run], judged: Mapping[str, int],
              going_to: str) -> Loop | None:
    """The first monitor whose cycle the finished ``runs`` end with ``threshold`` times over, counting only runs
    after that monitor's last judgement, when the job is about to go round again (``going_to`` is the cycle's
    first movement: a run that leaves the cycle ends the loop by itself, so nothing needs judging)."""
    for lm in monitors:
        if going_to != lm.cycle[0]:
            continue
        since = [r for r in runs if r.seq > judged.get(lm.name, 0)]
        need = len(lm.cycle) * lm.threshold
        tail = since[-need:]
        if len(tail) == need and [r.name for r in tail] == list(lm.cycle) * lm.threshold:
            return Loop(lm, tuple(tail))
    return None


def judge_instruction(instruction: str, event: LoopDetected, language: str = "en") -> str:
    """The judge's step instruction: the monitor's own, then the summaries of the runs in the loop."""
    lines = [text(language, "loop_run", seq=seq, name=name, summary=summary.strip() or "-")
             for seq, name, summary in zip(event.runs, _names(event), event.summaries, strict=False)]
    head = text(language, "loop", cycle=" → ".join(event.cycle), count=event.count)
    return f"{instruction.strip()}\n\n{head}\n" + "\n".join(lines)


def _names(event: LoopDetected) -> list[str]:
    return [event.cycle[i % len(event.cycle)] for i in range(len(event.runs))]
