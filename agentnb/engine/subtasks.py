"""Subtasks: child jobs a movement hands out with ``WAIT_SUBTASKS``, and the parent woken when they end.

A subtask runs only a piece that ``agentnb pieces`` lists (never a path), on this job's model or a plain
spec, within the tools and permission of the movement that created it: checked when the transition is
made (:meth:`Subtasks.check`, a tool error the model reads), again when the children are created, and
the cap is kept with the child (:data:`CAP_OPTION`) and applied to every movement it runs (:func:`capped`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..events import JobStatusEvent, Subtask
from ..models.base import ModelSpecError, check_model_spec, normalise_spec
from ..store.base import MAX_INSTRUCTION_CHARS, JobStatus
from ..store.reads import subtask_depth
from ..tools.base import PERMISSION_RANK
from .jobfiles import workdir_column
from .pieces import Movement, Piece, PieceError, available_pieces, load_piece
from .workdir import prepare_workdir

if TYPE_CHECKING:
    from ..store.base import Store

__all__ = ["CAP_OPTION", "MAX_SUBTASKS_PER_CALL", "MAX_SUBTASK_DEPTH", "Subtasks", "capped", "notify_parent"]

# A model can hand out subtasks whose piece hands out subtasks again: without a bound that is a job
# tree without end (and ws.run recursing into it until Python gives up).
MAX_SUBTASK_DEPTH = 4
MAX_SUBTASKS_PER_CALL = 50
# The key of a subtask's options that holds the tools and permission of the movement that created it.
CAP_OPTION = "subtask_cap"


class Refused(ValueError):
    """A subtask that may not be created; ``field`` is the subtask key at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Subtasks:
    """Checks and creates the subtasks of one job (``job_id``, running ``piece`` on ``model_spec``)."""

    def __init__(self, store: Store, *, job_id: int, piece: Piece, model_spec: str, workdir: Path,
                 logs_dir: Path) -> None:
        self.store = store
        self.job_id = job_id
        self.piece = piece
        self.model_spec = model_spec
        self.workdir = workdir
        self.logs_dir = logs_dir  # <workspace>/jobs/<id>/logs

    def check(self, subtasks: Any, creator: Movement) -> str | None:
        """Why these subtasks cannot be created by movement ``creator`` (a tool error the model reads), or None."""
        if not isinstance(subtasks, list) or not subtasks:
            return "next_step WAIT_SUBTASKS needs subtasks: a non-empty list of {instruction, piece?}"
        if len(subtasks) > MAX_SUBTASKS_PER_CALL:
            return (f"{len(subtasks)} subtasks given; at most {MAX_SUBTASKS_PER_CALL} per transition "
                    "(group the work into fewer subtasks)")
        depth = subtask_depth(self.store, self.job_id)
        if depth >= MAX_SUBTASK_DEPTH:
            return (f"this job is already a subtask {depth} levels deep; subtasks may nest at most "
                    f"{MAX_SUBTASK_DEPTH} levels: do this work here instead of handing it out")
        for i, sub in enumerate(subtasks):
            if not isinstance(sub, dict) or not isinstance(sub.get("instruction"), str) or not sub["instruction"].strip():
                return f"subtasks[{i}] needs a non-empty instruction"
            if len(sub["instruction"]) > MAX_INSTRUCTION_CHARS:
                return (f"subtasks[{i}].instruction has {len(sub['instruction']):,} characters; at most "
                        f"{MAX_INSTRUCTION_CHARS:,} are allowed: write long material to a file and name it instead")
            extra = set(sub) - {"instruction", "piece", "model"}
            if extra:
                return f"subtasks[{i}]: unknown key(s) {sorted(extra)}; allowed: instruction, piece, model"
            try:
                self._piece(sub, creator)
                self._model(sub)
            except Refused as exc:
                return f"subtasks[{i}].{exc.field}: {exc}"
        return None

    def create(self, c: Any, requests: tuple[dict[str, Any], ...], creator: Movement) -> list[Subtask]:
        """Queue one child job per request, in the store's transaction ``c``, each capped to ``creator``'s rights."""
        parent = self.store.job(self.job_id)
        # what the child may never exceed, kept with it and enforced again by its loop (see capped)
        options = parent.options.updated(
            **{CAP_OPTION: {"tools": list(creator.tools), "permission": creator.permission}})
        created = []
        for sub in requests:
            try:  # checked when the transition was made; checked again, as the piece file may have changed since
                piece = self._piece(sub, creator)
                model = self._model(sub)
            except Refused as exc:
                raise RuntimeError(f"subtask refused when created: {exc.field}: {exc}") from None
            piece_path: str | None
            if sub.get("piece") is not None:
                piece_name, piece_yaml, piece_path = piece.name, piece.to_yaml(), piece.source
            else:
                piece_name, piece_yaml, piece_path = parent.piece, parent.piece_yaml, parent.piece_path
            child_id = self.store.create_child_job(
                c, self.job_id, piece=piece_name, piece_yaml=piece_yaml, piece_path=piece_path, model=model,
                instruction=sub["instruction"], options=json.dumps(options.to_dict()),
            )
            workdir = prepare_workdir(self.logs_dir.parents[2], child_id, None)
            self.store.update_job(c, child_id, workdir=workdir_column(self.store, child_id, workdir))
            self.store.append([JobStatusEvent(job_id=child_id, ts=time.time(), status=JobStatus.queued,
                                              reason=f"subtask of job {self.job_id}")], c)
            created.append(Subtask(instruction=sub["instruction"], piece=piece_name, model=model, job_id=child_id))
        return created

    def replay(self, c: Any, originals: list[Subtask]) -> list[Subtask]:
        """Queue, in ``c``, one child per child of a re-served run (docs/fork-compare.md#fork): each a ``replay:`` of the
        original child, with its piece, instruction and options (its rights included), so the fork's subtasks
        spend nothing and bring back what the original's did."""
        created = []
        for sub in originals:
            row = self.store.job(sub.job_id)
            model = f"replay:{sub.job_id}"
            child_id = self.store.create_child_job(
                c, self.job_id, piece=row.piece, piece_yaml=row.piece_yaml, piece_path=row.piece_path,
                model=model, instruction=row.instruction, options=row.options_text or "{}",
            )
            workdir = prepare_workdir(self.logs_dir.parents[2], child_id, None)
            self.store.update_job(c, child_id, workdir=workdir_column(self.store, child_id, workdir))
            self.store.append([JobStatusEvent(job_id=child_id, ts=time.time(), status=JobStatus.queued,
                                              reason=f"subtask of job {self.job_id}, re-served from job {sub.job_id}")],
                              c)
            created.append(Subtask(instruction=row.instruction, piece=row.piece, model=model, job_id=child_id))
        return created

    def _piece(self, sub: dict[str, Any], creator: Movement) -> Piece:
        """The piece a subtask runs, checked: a name ``agentnb pieces`` lists (never a path), whose every
        movement fits within ``creator``'s tools and permission.  No piece named: this job's own piece."""
        ref = sub.get("piece")
        piece = self.piece if ref is None else self._named_piece(ref)
        has = (f"step {creator.name!r} has tools: {', '.join(creator.tools) or 'none'} "
               f"and permission {creator.permission!r}")
        for mv in piece.movements:
            more = [t for t in mv.tools if t not in creator.tools]
            if more:
                raise Refused("piece", f"piece {piece.name!r}: movement {mv.name!r} uses {', '.join(more)}, beyond "
                                       f"this step's tools ({has}); a subtask never gets more tools or permission "
                                       "than the step that creates it: name a piece that fits, or do the work here")
            if PERMISSION_RANK[mv.permission] > PERMISSION_RANK[creator.permission]:
                raise Refused("piece", f"piece {piece.name!r}: movement {mv.name!r} has permission "
                                       f"{mv.permission!r}, above this step's ({has}); a subtask never gets more "
                                       "tools or permission than the step that creates it: name a piece that "
                                       "fits, or do the work here")
        return piece

    def _named_piece(self, ref: Any) -> Piece:
        available = available_pieces()
        listing = ", ".join(sorted(available)) or "none"
        if not isinstance(ref, str) or not ref.strip():
            raise Refused("piece", f"found {ref!r}; allowed: the name of a piece: {listing}")
        # A path would let the job run a piece it wrote itself (any tools, any instruction_file on the host).
        if (any(sep in ref for sep in ("/", "\\", os.sep)) or ref.lower().endswith((".yaml", ".yml"))
                or ref.startswith(".")):
            raise Refused("piece", f"{ref!r} is a path; a subtask's piece is a name that `agentnb pieces` lists: "
                                   f"{listing}")
        if ref not in available:
            raise Refused("piece", f"unknown piece {ref!r}; available: {listing}")
        path = available[ref].resolve()
        for root, what in ((self.workdir.resolve(), "this job's work directory"),
                           (self.logs_dir.parents[1].resolve(), "the workspace's job folders")):
            if path == root or root in path.parents:
                raise Refused("piece", f"piece {ref!r} ({path.name}) lies inside {what}, where a job could have "
                                       "written it; keep pieces outside work directories")
        try:
            return load_piece(path)
        except PieceError as exc:  # worded without the file's host path, which the model has no need of
            where = f"line {exc.line}: " if exc.line else ""
            raise Refused("piece", f"piece {ref!r} is not valid: {where}{exc.field + ': ' if exc.field else ''}"
                                   f"{exc.detail}") from None
        except OSError as exc:
            raise Refused("piece", f"piece {ref!r} cannot be read: {exc.strerror or exc}") from None

    def _model(self, sub: dict[str, Any]) -> str:
        """The model a subtask runs on: this job's own, or a plain spec.  ``scripted:`` names a file and
        ``replay:`` another job, so an LLM may not choose them; a job that itself runs on a ``scripted:``
        model may, since then the user's script, not a model, names them."""
        spec = sub.get("model")
        if spec is None or spec == self.model_spec:
            return self.model_spec
        if not isinstance(spec, str) or not spec.strip():
            raise Refused("model", f"found {spec!r}; allowed: a model spec such as demo or openai:<model>")
        kind = spec.partition(":")[0]
        if kind in ("scripted", "replay") and not self.model_spec.startswith("scripted:"):
            raise Refused("model", f"{spec!r} names a file or another job; allowed: this job's own model "
                                   f"({self.model_spec}), demo or openai:<model>")
        try:
            check_model_spec(spec)
        except ModelSpecError as exc:
            raise Refused("model", str(exc)) from None
        # a relative scripted: path means the same file for a worker started elsewhere
        return normalise_spec(spec)


def capped(movement: Movement, cap: Any) -> Movement:
    """``movement`` with no tool and no permission beyond ``cap`` (``{tools, permission}``; None: as it is)."""
    if not isinstance(cap, dict):
        return movement
    allowed = cap.get("tools") or []
    tools = tuple(t for t in movement.tools if t in allowed)
    permission = movement.permission
    ceiling = cap.get("permission")
    if ceiling not in PERMISSION_RANK or PERMISSION_RANK[permission] > PERMISSION_RANK[ceiling]:
        permission = ceiling if ceiling in PERMISSION_RANK else "readonly"
    if tools == movement.tools and permission == movement.permission:
        return movement
    return replace(movement, tools=tools, permission=permission)


def notify_parent(store: Store, c: Any, job_id: int) -> None:
    """Job ``job_id`` has ended (in transaction ``c``): when it was the last open child of a
    parent waiting for subtasks, queue the parent again at the movement it named.

    Every way a job ends (COMPLETE, ABORT, a failure) must call this, or the parent waits forever.
    """
    parent_id = store.parent_of(c, job_id)
    if parent_id is None:
        return
    waiting, resume = store.subtask_wait(c, parent_id)
    if waiting and store.open_children(c, parent_id) == 0:
        store.set_status(c, parent_id, JobStatus.queued, reason="every subtask has ended",
                         current_movement=resume, resume_movement=None)
