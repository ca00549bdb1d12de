"""What the views read, as structural types: a job's fields, its events and its piece.

The facade (:class:`agentnb.Workspace` and its ``Job``) offers all of it, but the views sit below
the facade and must not import it: they are typed against these Protocols, which the facade (or
any other source, e.g. a test's) satisfies without naming them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..engine.pieces import Piece
    from ..events import Event
    from ..store.base import Store

__all__ = ["JobRecord", "JobSource", "LiveJob"]


class JobRecord(Protocol):
    """The fields of a job the views show (a ``Job`` or its snapshot)."""

    @property
    def id(self) -> int: ...
    @property
    def parent_id(self) -> int | None: ...
    @property
    def piece(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def instruction(self) -> str: ...
    @property
    def created(self) -> float: ...
    @property
    def status(self) -> str: ...
    @property
    def movement_seq(self) -> int: ...
    @property
    def error(self) -> str | None: ...
    @property
    def updated(self) -> float: ...
    @property
    def started(self) -> float | None: ...
    @property
    def ended(self) -> float | None: ...
    @property
    def forked_from(self) -> tuple[int, int] | None: ...


class LiveJob(JobRecord, Protocol):
    """A job whose changing fields are read again on access; ``snapshot()`` freezes them for one view."""

    def snapshot(self) -> JobRecord: ...


class JobSource(Protocol):
    """A workspace as the views see it: its jobs, their events and pieces."""

    @property
    def store(self) -> Store: ...

    def job(self, job: int | str) -> LiveJob: ...

    def events(self, job: int) -> list[Event]: ...

    def piece(self, job: int) -> Piece: ...
