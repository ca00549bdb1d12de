"""Submitting jobs: every check of a submit before anything is stored, then the job row, its folder and inputs.

:class:`Submitter` is what ``ws.submit``, ``ws.fork``, ``ws.replay`` and a batch (``agentnb/batch.py``, which checks
all its jobs first and stores them in one transaction) create jobs through.  Running them is
:mod:`agentnb.execution`'s.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .engine.budget import check_limits, check_priced
from .engine.jobfiles import check_total, read_rows, workdir_column
from .engine.pieces import Piece, load_piece
from .engine.runner import parse_stored_piece
from .engine.workdir import prepare_workdir
from .errors import PathNotFoundError, UsageError
from .models.base import check_model_spec, check_retry_settings, normalise_spec
from .models.factory import resolve_model
from .store.base import MAX_INSTRUCTION_CHARS, JobStatus, Store, Transaction
from .tools.base import ToolError, resolve_path

__all__ = ["Prepared", "Submitter", "input_size", "remove_folders"]


@dataclass(frozen=True)
class Prepared:
    """A submit that passed every check (:meth:`Submitter.prepare`), ready to be stored (:meth:`Submitter.create`)."""

    instruction: str
    piece: Piece
    model: str
    options: dict[str, Any]
    inputs: dict[str, str | bytes | os.PathLike[str]]
    workdir: str | os.PathLike[str] | None


def input_size(value: str | bytes | os.PathLike[str]) -> int:
    """The bytes an input will take (a file that cannot be read counts 0: writing it fails with its own line)."""
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, os.PathLike):
        try:
            return os.stat(value).st_size
        except OSError:
            return 0
    return len(str(value).encode("utf-8"))


def remove_folders(folders: list[Path]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


class Submitter:
    """Creates the jobs of ``store``, their folders under ``root/jobs``; ``files_limit`` bounds a job's input
    files where files live in the store."""

    def __init__(self, store: Store, root: Path, files_limit: int) -> None:
        self.store = store
        self.root = root
        self.files_limit = files_limit

    def store_one(self, prepared: Prepared, **tags: Any) -> int:
        """Store one prepared job in a transaction of its own; a failure leaves no row and no folder."""
        job_folders: list[Path] = []
        try:
            with self.store.transaction() as c:
                return self.create(c, prepared, job_folders, **tags)
        except BaseException:
            remove_folders(job_folders)
            raise

    def prepare(
        self,
        instruction: str,
        *,
        piece: str | os.PathLike[str] | Piece,
        model: str,
        inputs: Mapping[str, str | bytes | os.PathLike[str]] | None,
        workdir: str | os.PathLike[str] | None,
        context: Mapping[str, Any] | None,
        retries: int | None,
        max_backoff: float | None,
        cost_limit: float | None = None,
        token_limit: int | None = None,
    ) -> Prepared:
        """Every check of a submit, before anything is stored or written (a batch checks all its jobs first)."""
        if not isinstance(instruction, str) or not instruction.strip():
            raise UsageError("instruction must be non-empty text")
        if len(instruction) > MAX_INSTRUCTION_CHARS:
            raise UsageError(
                f"the instruction has {len(instruction):,} characters; at most {MAX_INSTRUCTION_CHARS:,} are allowed "
                "(MAX_INSTRUCTION_CHARS): put long material in a file and pass it with inputs= (--input FILE)"
            )
        settings = check_retry_settings(retries, max_backoff)
        limits = check_limits(cost_limit=cost_limit, token_limit=token_limit)  # docs/design-lab.md#budgets
        p = load_piece(piece)
        if isinstance(piece, Piece):
            # a Piece built or changed in Python (dataclasses.replace) is checked now as its stored YAML will be
            # when a worker runs it: refused at submit with file, line and field, never a job that fails later
            parse_stored_piece(p.to_yaml(), p.source)
        if p.mcp_servers:  # a worker without the extra could not start them (docs/pieces.md#mcp-servers)
            from .tools.mcp import check_installed

            check_installed(p.mcp_servers)
        model = normalise_spec(model)
        check_model_spec(model)
        # Build it once: a malformed script or an unknown replay job is refused now, not when a worker
        # claims the job (building an openai model makes no client and reads no key yet).
        resolve_model(model, store=self.store)
        check_priced(model, limits.get("cost_limit", p.cost_limit), what="cost_limit" if "cost_limit" in limits
                     else f"the piece's cost_limit ({p.source})")
        opts: dict[str, Any] = {**settings, **limits}
        if context:
            from .engine.context import check_context_options

            opts["context"] = check_context_options(context, p.thresholds)
        if workdir is not None and self.store.keeps_files:
            raise UsageError(f"workdir={str(workdir)!r} is a folder of this machine, and workers of {self.store.path} "
                             "may run on others (they share only the database): give the files with inputs= "
                             "instead; each job works in jobs/<id> under its worker's own folder")
        if workdir is not None and not Path(workdir).expanduser().is_dir():
            raise PathNotFoundError(f"workdir {str(workdir)!r} is not an existing directory")
        # Every input name is checked before the job exists, so a refused submit leaves nothing behind.
        # A fresh job's input/ is empty; an existing workdir's input/ may hold links that lead out.
        input_root = (Path(workdir).expanduser() if workdir is not None else self.root / "jobs" / "0") / "input"
        if inputs is not None and not isinstance(inputs, Mapping):
            raise TypeError(f"inputs must be a mapping of file name → content, not {type(inputs).__name__}")
        for name, value in (inputs or {}).items():
            if not isinstance(name, str) or ".." in Path(name).parts:
                raise UsageError(f"input name {name!r} must be a relative path inside input/ (no '..')")
            try:
                if resolve_path(input_root, name) == input_root.resolve():
                    raise UsageError(f"input name {name!r} is input/ itself; give a file name inside input/")
            except ToolError as exc:
                raise UsageError(f"input {name!r}: {exc}") from None
            if not isinstance(value, (str, bytes, os.PathLike)):
                raise TypeError(f"input {name!r}: the content is {type(value).__name__}; allowed: text (str), "
                                "bytes or a path of a file to copy")
        if self.store.keeps_files:  # the files go into the store: refused before anything is
            check_total("the job's input files", sum(input_size(v) for v in (inputs or {}).values()),
                        self.files_limit, then="nothing was stored")
        return Prepared(instruction=instruction, piece=p, model=model, options=opts, inputs=dict(inputs or {}),
                         workdir=workdir)

    def create(self, c: Transaction, prepared: Prepared, job_folders: list[Path], **tags: Any) -> int:
        """Store a prepared job and write its folder and inputs, in ``c`` (``tags``: extra job columns, e.g.
        a batch's).  A folder this made is added to ``job_folders``, for the caller to remove if ``c`` fails:
        a job whose folder or inputs cannot be written (a read-only jobs/, a full disk) is not left queued."""
        p = prepared.piece
        job_id = self.store.create_job(
            piece=p.name, piece_yaml=p.to_yaml(), piece_path=p.source, model=prepared.model,
            instruction=prepared.instruction, status=JobStatus.queued, workdir="", options=prepared.options, **tags,
        )
        job_folder = self.root / "jobs" / str(job_id)
        if not job_folder.exists():  # else not ours to remove if this fails
            job_folders.append(job_folder)
        wd = prepare_workdir(self.root, job_id, prepared.workdir)
        written: list[Path] = []
        for name, value in prepared.inputs.items():
            try:
                target = resolve_path(wd / "input", name)
            except ToolError as exc:
                raise UsageError(f"input {name!r}: {exc}") from None
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                if isinstance(value, bytes):
                    target.write_bytes(value)
                elif isinstance(value, os.PathLike):
                    target.write_bytes(Path(value).read_bytes())
                else:
                    target.write_text(str(value), encoding="utf-8")
            except OSError as exc:  # a name too long for the file system, a source file that is gone
                what = f"its source {os.fspath(value)!r}" if isinstance(value, os.PathLike) else "it"
                raise UsageError(f"input {name!r} cannot be written: {what}: "
                                 f"{exc.strerror or type(exc).__name__}") from None
            written.append(target)
        if self.store.keeps_files:  # workers elsewhere share only the database: input/ goes in with the job
            rows = read_rows(wd, written)
            check_total("the job's input files", sum(f.size for f in rows), self.files_limit,
                        then="nothing was stored")
            self.store.write_files(c, job_id, rows, [])
        self.store.update_job(c, job_id, workdir=workdir_column(self.store, job_id, wd))
        return job_id
