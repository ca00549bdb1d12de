"""A job as the facade hands it out (``ws.submit``/``ws.job``/``ws.run``, ``%agent run``): :class:`Job`, whose
changing fields are read from its workspace's store on each access, and :class:`JobStatus` (defined in
``store/base.py``, where the store uses it too, and re-exported here).

``agentnb.workspace`` re-exports both (and ``JobRef``); a Job reads through its workspace as :class:`JobHost`,
which the facade satisfies, so this module does not import the facade.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .engine.jobfiles import local_workdir
from .store import StoreError, reads
from .store.base import JobStatus

if TYPE_CHECKING:
    from .engine.pieces import Piece
    from .events import Event
    from .store.base import Store
    from .store.records import JobRecord

__all__ = ["Job", "JobHost", "JobRef", "JobStatus"]


# The columns of a job that change while it runs; a Job reads them again on every access.
_CHANGING = ("status", "current_movement", "resume_movement", "movement_seq", "error", "updated", "started", "ended")


@dataclass(frozen=True, eq=False)
class Job:
    """One job of a workspace, as returned by ``ws.submit``/``ws.job``/``ws.run`` and ``%agent run``.

    ``id``, ``parent_id``, ``piece``, ``model``, ``instruction``, ``workdir`` and ``created`` are fixed
    when the job is submitted.  What changes while it runs — ``status``, ``current_movement``,
    ``resume_movement``, ``movement_seq``, ``error``, ``updated``, ``started``, ``ended`` — is read
    from the store each time it is asked for, as are ``repr(job)`` and the notebook view: a Job
    kept in a variable never goes stale (``bg.status`` says ``succeeded`` once a background run has
    ended).  :meth:`snapshot` freezes those values, for comparing a job's state across time.
    """

    id: int
    parent_id: int | None
    piece: str
    model: str
    instruction: str
    workdir: Path
    created: float
    workspace: JobHost | None = field(default=None, repr=False)
    # a batch's job (docs/design-lab.md): the batch name, the case index, the variant index and the epoch (from 1)
    batch: str | None = None
    case: int | None = None
    variant: int | None = field(default=None, repr=False)
    epoch: int | None = field(default=None, repr=False)
    # a fork (docs/fork-compare.md#fork): (the original job's id, the movement run it runs live from)
    forked_from: tuple[int, int] | None = None
    # the changing columns as last read; a snapshot (or a Job without a workspace) only ever shows these
    _row: Mapping[str, Any] = field(default_factory=dict, repr=False)
    _live: bool = field(default=True, repr=False)
    # set on the Job a live %agent run returns, while its cell runs: the live view above already shows it
    _shown_live: bool = field(default=False, repr=False)

    @classmethod
    def from_row(cls, row: JobRecord, ws: JobHost | None = None) -> Job:
        """The Job of a job's record (``Store.job``)."""
        workdir = Path(row.workdir) if ws is None else local_workdir(ws.root, row, ws.store.keeps_files)
        return cls(id=row.id, parent_id=row.parent_id, piece=row.piece, model=row.model,
                   instruction=row.instruction, workdir=workdir, created=row.created, workspace=ws,
                   batch=row.batch, case=row.batch_case, variant=row.batch_variant, epoch=row.epoch,
                   forked_from=row.forked_from,
                   _row={"status": row.status.value, "current_movement": row.current_movement,
                         "resume_movement": row.resume_movement, "movement_seq": row.movement_seq,
                         "error": row.error, "updated": row.updated, "started": row.started, "ended": row.ended})

    def _get(self, name: str) -> Any:
        if self._live and self.workspace is not None:
            row = self.workspace.store.job_columns(self.id, _CHANGING)
            if row is not None:  # a job is never deleted; a missing row (another store?) leaves the last values
                object.__setattr__(self, "_row", row)
        return self._row[name]

    @property
    def status(self) -> JobStatus:
        return JobStatus(self._get("status"))

    @property
    def current_movement(self) -> str | None:
        return self._get("current_movement")

    @property
    def resume_movement(self) -> str | None:
        return self._get("resume_movement")

    @property
    def movement_seq(self) -> int:
        return self._get("movement_seq")

    @property
    def error(self) -> str | None:
        return self._get("error")

    @property
    def updated(self) -> float:
        return self._get("updated")

    @property
    def started(self) -> float | None:
        return self._get("started")

    @property
    def ended(self) -> float | None:
        return self._get("ended")

    @property
    def output(self) -> Path:
        """The job's ``output/`` folder."""
        return self.workdir / "output"

    @property
    def events(self) -> list[Event]:
        """Every event of the job, oldest first (empty for a Job without a workspace)."""
        return [] if self.workspace is None else self.workspace.events(self.id)

    @property
    def summary(self) -> str | None:
        """The summary of the job's last finished movement run (its final summary once it has ended)."""
        if self.workspace is None:
            return None
        done = [m.summary for m in reads.movements(self.workspace.store, self.id) if m.summary is not None]
        return done[-1] if done else None

    @property
    def expected(self) -> Any:
        """The ``expected`` value of the job's batch case (None outside a batch or when the case has none)."""
        if self.workspace is None or self.batch is None or self.case is None:
            return None
        found = reads.batch(self.workspace.store, self.batch)
        cases = found.cases if found is not None else ()
        return cases[self.case].expected if 0 <= self.case < len(cases) else None

    @property
    def is_snapshot(self) -> bool:
        return not self._live or self.workspace is None

    def snapshot(self) -> Job:
        """This job with its changing fields read once now and then kept (``job.snapshot().status`` never changes)."""
        self._get("status")  # read the row again (when attached)
        return replace(self, _row=dict(self._row), _live=False, _shown_live=False)

    def shown_live_above(self, shown: bool) -> None:
        """While ``shown``, this Job's notebook view is one line pointing up to the live view of its run (the value
        of a ``%agent run --background`` cell, whose live view just above already shows the job in full)."""
        object.__setattr__(self, "_shown_live", shown)

    def refresh(self) -> Job:
        """The job read again from its workspace (a Job already reads its changing fields fresh; a snapshot does not)."""
        if self.workspace is None:
            raise StoreError("this Job is not attached to a workspace")
        return self.workspace.job(self.id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Job):
            return NotImplemented
        same = self.id == other.id and _root(self) == _root(other)
        return same and (not (self.is_snapshot or other.is_snapshot) or self._row == other._row)

    def __hash__(self) -> int:
        return hash((self.id, _root(self)))

    def __repr__(self) -> str:
        row = self.snapshot() if not self.is_snapshot else self
        kind = "snapshot of job" if self.is_snapshot else "Job"
        where = f", movement {row.current_movement!r}" if row.current_movement else ""
        return (f"<{kind} {self.id}: {row.status} · piece {self.piece!r} · model {self.model!r}{where}"
                f"{' · error: ' + _short(row.error) if row.error else ''}>")

    def _repr_html_(self) -> str:
        if self._shown_live:
            return _shown_above_html(self)
        if self.workspace is None:
            import html

            return f"<pre>{html.escape(repr(self))}</pre>"
        from .views.render import job_html

        return job_html(self.workspace, self.id)


def _root(job: Job) -> Path | None:
    return None if job.workspace is None else job.workspace.root


def _short(text: str, limit: int = 120) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _shown_above_html(job: Job) -> str:
    """The cell value of a live ``%agent run``: one line, since the live view just above shows the job."""
    import html

    st = job.snapshot()
    return (f'<div class="anb-shown-above">Job {job.id} <b>{html.escape(str(st.status))}</b> — its live view is '
            f"just above; later, <code>{html.escape('%agent show')} {job.id}</code> (or the variable holding "
            "the Job) shows it again.</div>")


JobRef = Job | int | str


class JobHost(Protocol):
    """What a :class:`Job` reads through: its workspace (:class:`agentnb.workspace.Workspace`)."""

    @property
    def root(self) -> Path: ...
    @property
    def store(self) -> Store: ...
    def job(self, job: JobRef) -> Job: ...
    def events(self, job: JobRef, kinds: list[str] | None = None) -> list[Event]: ...
    def piece(self, job: JobRef) -> Piece: ...
