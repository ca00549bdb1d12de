"""Where a fork (docs/fork-compare.md#fork) came from, in plain text: which job and run it forked from, and which of its runs
were re-served from which job; the job view's header, the transcript's title and the compare view say it.
``render`` re-exports ``reserved_runs`` and ``fork_lines``.

``demo_note``: a fork (or any second job) on the built-in ``demo`` model with an edited persona or
instruction gives the same answers as the original, since ``models/demo.py`` never reads them; the fork's view
and the compare view say so, lest the edit look ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..events import Event
from .source import JobRecord, JobSource
from .timeline import Timeline, fold

__all__ = ["DEMO_MODEL", "demo_note", "fork_lines", "reserved_runs", "runs_text"]

DEMO_MODEL = "demo"


def reserved_runs(events: Timeline | Iterable[Event]) -> dict[int, int]:
    """Movement run → the job it was re-served from, for every run of a fork (or a ``replay:`` job) whose
    ``movement_start`` names one (its responses came from that job's record; no tokens were spent)."""
    return (events if isinstance(events, Timeline) else fold(events)).reserved_runs()


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


def fork_lines(job: JobRecord, events: Timeline | Iterable[Event]) -> list[str]:
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


def demo_note(source: JobSource, a: int, b: int) -> str | None:
    """One line when jobs ``a`` and ``b`` both ran on the ``demo`` model and a movement both ran live has another
    persona or instruction in one job's piece than in the other's: the demo model does not read them, so the
    edit cannot show in its answers.  None otherwise (another model reads them; an edit only in runs one job
    re-served was never asked of a model)."""
    try:
        # demo?pace=… is the demo model too, only slower
        if {source.job(a).model.partition("?")[0], source.job(b).model.partition("?")[0]} != {DEMO_MODEL}:
            return None
        pieces = source.piece(a), source.piece(b)
    except Exception:  # a job deleted, or a stored piece that no longer parses: no note rather than no view
        return None

    def live(job: int) -> set[str]:
        return {run.name for run in fold(source.events(job)).runs.values()
                if run.start is not None and run.replayed_from is None}

    both = live(a) & live(b)
    edited: list[str] = []
    for name in pieces[1].run_names:
        if name not in both or name not in pieces[0].run_names:
            continue
        mine, theirs = pieces[0].movement(name), pieces[1].movement(name)
        changed = [key for key in ("persona", "instruction") if getattr(mine, key) != getattr(theirs, key)]
        if changed:
            edited.append(f"{' and '.join(changed)} of {name}")
    if not edited:
        return None
    # what models/demo.py reads: the movement's name (plan, implement, verify each have a script), the rules'
    # next steps listed in the prompt, the task, the input files' names and the tool results
    return (f"job {a} and job {b} both ran on the demo model, which does not read instructions the way a real "
            f"model does: it answers from the piece (movement names, next steps), the task, the input files and "
            f"the tool results, not from the wording of a persona or instruction; the edited "
            f"{', '.join(edited)} reached its prompt but cannot change its answers. Fork onto a real model to "
            f"see what the edit does.")
