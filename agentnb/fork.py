"""Forks (docs/fork-compare.md#fork): a new job that re-serves an ended job's first movement runs and runs live from one.

:func:`plan_fork` checks everything a fork needs before anything is stored — the original has stopped, the
fork point is one of its runs, and the piece the fork runs on has the movement the fork point starts — and
gathers what the new job is made of: the original's instruction, its ``input/`` files as they are now, its
options, and the piece and model to run on from the fork point.  The re-serving itself is the engine's
(``JobRunner`` with a ``Recording``): a re-served question is answered with the original's replies, and
re-served subtasks are ``replay:`` jobs of the original's children.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .engine.jobfiles import stored_inputs
from .engine.pieces import Piece, load_piece
from .engine.runner import stored_piece
from .errors import PieceError, UsageError
from .store import reads
from .store.base import JobStatus

if TYPE_CHECKING:
    from .store.base import Store

__all__ = ["ForkPlan", "plan_fork"]

STRICT_OPTION = "strict_replay"  # the job option a strict fork runs with


@dataclass(frozen=True)
class ForkPlan:
    """A fork that passed every check: what its job is made of."""

    job_id: int  # the original
    at: int
    instruction: str
    piece: Piece
    model: str
    inputs: dict[str, bytes | os.PathLike[str]]
    options: dict[str, Any]
    # the movement the new job's run 1 starts when it is not the piece's initial one (a fork at 1, a replay)
    first: str | None = None


def plan_fork(store: Store, job_id: int, *, at: Any, piece: Any = None, model: Any = None,
              strict: bool = False, context: Any = None) -> ForkPlan:
    """Check a fork of job ``job_id`` at movement run ``at``; a :class:`UsageError` (or ``PieceError``) in one
    line naming what is wrong and what is allowed."""
    row = store.job(job_id)  # StoreError "no job …"
    status = row.status
    if status == JobStatus.running:
        raise UsageError(f"job {job_id} is running; a fork needs a job that has stopped: wait for it to end, or "
                         f"pause it (ws.stop({job_id}), the Stop button) and fork the paused job")
    if status in (JobStatus.waiting_human, JobStatus.waiting_subtasks):
        waits = "a human's reply" if status == JobStatus.waiting_human else "its subtasks"
        raise UsageError(f"job {job_id} is {status} (it waits for {waits}); a fork needs a job that has stopped: "
                         "reply or let its subtasks end first")
    runs = reads.movements(store, job_id)
    last = len(runs)
    if status == JobStatus.queued and (not runs or runs[-1].status == "done"):
        last += 1  # paused between runs: the run it would start next can be forked at too
    last = max(last, 1)
    if isinstance(at, bool) or not isinstance(at, int) or not 1 <= at <= last:
        allowed = f"a movement run from 1 to {last}" if last > 1 else "1"
        raise UsageError(f"at={at!r}: job {job_id} ran {len(runs)} movement run(s); allowed: {allowed} "
                         "(runs before it are re-served, it and the later ones run live)")
    if strict not in (True, False):
        raise UsageError(f"strict={strict!r}; allowed: True (a divergent re-run fails the fork) or False")
    p = stored_piece(row) if piece is None else load_piece(piece)
    # run `at` starts the movement the original's run `at` started (or, paused before it, would start), at
    # every position: at 1 too, where another piece's own initial movement would otherwise run unnoticed
    start = (runs[at - 1].name if at <= len(runs)
             else row.current_movement or stored_piece(row).initial_movement)
    if start not in p.run_names:  # a loop monitor's judge may be forked at too (docs/context.md#loop-monitors)
        raise PieceError(f"the fork starts run {at} with movement {start!r}, as job {job_id} did, but the piece "
                         f"has no such movement; movements: {', '.join(p.run_names)}", file=p.source, field="movements")
    spec = row.model if model is None else model
    if not isinstance(spec, str):
        raise UsageError(f"model={spec!r}; allowed: a model spec such as 'demo', 'scripted:PATH', 'openai:NAME'")
    # a fork asks its model anew from its fork point: the original's call cache (docs/design-lab.md#call-cache) would
    # answer it with the original's very responses
    options = row.options.without(STRICT_OPTION, "cache")
    if context is not None:  # the fork's own context settings, from its fork point on (merged over the original's)
        from .engine.context import check_context_options

        try:
            mine = check_context_options(context, p.thresholds)
            merged = {**(options.context or {}), **mine}
            if "thresholds" in mine:
                merged["thresholds"] = {**options.thresholds, **mine["thresholds"]}
            options = options.updated(context=check_context_options(merged, p.thresholds))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if strict:
        options = options.updated(**{STRICT_OPTION: True})
    # where files live in the store (PostgreSQL), the original's input/ is read there: its work directory may
    # be on another machine
    inputs: dict[str, bytes | os.PathLike[str]] = (
        dict(stored_inputs(store, job_id)) if store.keeps_files else dict(_inputs(Path(row.workdir) / "input")))
    return ForkPlan(job_id=job_id, at=at, instruction=row.instruction, piece=p, model=spec,
                    inputs=inputs, options=options.to_dict(),
                    first=start if at == 1 and start != p.initial_movement else None)



def _inputs(folder: Path) -> dict[str, os.PathLike[str]]:
    """The original's ``input/`` files (as they are now), name → path, for the fork's own ``input/``."""
    out: dict[str, os.PathLike[str]] = {}
    if not folder.is_dir() or folder.is_symlink():
        return out
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                out[path.relative_to(folder).as_posix()] = path
    return out
