"""The recorder: a job's typed events, collected as they happen and written in one transaction per LLM call
(with the work directory's changes when tool results changed it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..events import Event, ToolResult, check_event, strict_events

if TYPE_CHECKING:
    from ..store.base import PreparedRow, Store

__all__ = ["Recorder"]


class Recorder:
    """Collects a job's typed events and hands them to the store in one transaction per LLM call.

    Each event is stamped (``ts``) by whoever builds it, when it happens, not when it is written.
    """

    __slots__ = ("_built", "cancel", "cut", "job_id", "lease", "pending", "store", "strict", "write_back")

    def __init__(self, store: Store, job_id: int) -> None:
        self.store = store
        self.job_id = job_id
        self.pending: list[Event] = []
        # the rows prepare() built for the first pending events, and the last of those events: they are used only
        # while pending still begins with them (a caller that clears pending drops them too)
        self._built: tuple[list[Event | PreparedRow], Event] | None = None
        # where the store keeps a job's files: what the work directory changed since the store last had it
        # (engine/jobfiles.WriteBack), written with the tool results that changed it
        self.write_back: Callable[[], Any] | None = None
        # while a process runs the job under its lease (JobRunner.advance): raises LeaseLost once that lease is
        # lost (leases.Held.check), so that nothing more is done for the job here, not only nothing written
        self.lease: Callable[[], None] | None = None
        # while a process runs the job: the job's Stop, handed to each model call as ``ModelRequest.cancel`` so a
        # streaming answer is cut off at once (docs/models.md#streaming)
        self.cancel: threading.Event | None = None
        self.cut = False  # a Stop cut a model call off (its pause reason says so: execution.STOP_CUT_REASON)
        # the test suite checks every field's type where the event is made, so a failure names the writer
        self.strict = strict_events()

    def add(self, event: Event) -> None:
        if self.strict:
            check_event(event)
        self.pending.append(event)

    def cancelled(self) -> bool:
        """Whether the job was asked to stop during this run (a call may have been cut off)."""
        return self.cancel is not None and self.cancel.is_set()

    def still_held(self) -> None:
        """Before an outside effect (an LLM call, a tool call): :class:`LeaseLost` when the lease is lost."""
        if self.lease is not None:
            self.lease()

    def prepare(self) -> None:
        """Build the stored rows of the events pending so far, before the caller opens the transaction that
        :meth:`flush` will write them in: the store's write lock is then held for the writes, not for encoding
        them (the events added inside the transaction are built there)."""
        if self.pending:
            self._built = (self.store.prepare(self.pending), self.pending[-1])

    def _rows(self) -> list[Event | PreparedRow]:
        built, self._built = self._built, None
        if built is not None:
            rows, last = built
            n = len(rows)
            if n <= len(self.pending) and self.pending[n - 1] is last:
                return rows + self.pending[n:]
        return list(self.pending)

    def flush(self, c: Any = None) -> None:
        if not self.pending:
            return
        if c is None and self.write_back is not None and any(isinstance(e, ToolResult) for e in self.pending):
            # planned before the events leave ``pending``: a work directory over the files limit raises
            # here (FilesOverLimit) with nothing lost
            files = self.write_back()
            if files is not None and not files.empty:
                with self.store.transaction() as tx:
                    rows, self.pending = self._rows(), []
                    self.store.append(rows, tx)
                    files.apply(self.store, tx, self.job_id)
                return
        rows, self.pending = self._rows(), []
        self.store.append(rows, c)
