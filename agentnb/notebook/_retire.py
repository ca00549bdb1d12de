"""Closing the workspaces a notebook's ``%agent`` settings replaced, once nothing started from it runs on them.

A :class:`~agentnb.Workspace` on PostgreSQL holds a connection pool and its threads.  When
``%config AgentMagic.store`` (or ``.workspace``) changes, the magic opens another workspace; the old one is
closed here, at once when nothing the notebook started uses it, else when the last such run ends (a
``%agent run --background`` job, a step, or a panel's action): closing it under a running job would fail that
job's next store write mid-movement, and refusing the setting would leave the user waiting on a job they may
not be watching.  Panels opened on the old workspace are closed with it (their watchers would otherwise poll a
closed pool for ever).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..workspace import Workspace

__all__ = ["Retirement"]


class Retirement:
    """Who uses which workspace, and which replaced workspaces wait to be closed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._uses: dict[int, int] = {}  # id(workspace) → runs in flight on it
        self._waiting: dict[int, tuple[Workspace, Callable[[], None]]] = {}  # retired, closed when unused

    @contextmanager
    def using(self, ws: Workspace) -> Iterator[None]:
        """Hold ``ws`` open while the block runs (a run started from the notebook)."""
        self.enter(ws)
        try:
            yield
        finally:
            self.leave(ws)

    def enter(self, ws: Workspace) -> None:
        with self._lock:
            self._uses[id(ws)] = self._uses.get(id(ws), 0) + 1

    def leave(self, ws: Workspace) -> None:
        with self._lock:
            left = self._uses.get(id(ws), 0) - 1
            if left > 0:
                self._uses[id(ws)] = left
                return
            self._uses.pop(id(ws), None)
            waiting = self._waiting.pop(id(ws), None)
        if waiting is not None:
            _close(*waiting)

    def in_use(self, ws: Workspace) -> bool:
        with self._lock:
            return id(ws) in self._uses

    def retire(self, ws: Workspace, before: Callable[[], None]) -> bool:
        """Close ``ws`` (after ``before()``) now when nothing uses it, else when its last user leaves; True when
        it was closed now."""
        with self._lock:
            if id(ws) in self._uses:
                self._waiting[id(ws)] = (ws, before)
                return False
        _close(ws, before)
        return True


def _close(ws: Workspace, before: Callable[[], None]) -> None:
    try:
        before()
    finally:
        ws.close()
