"""The status a job is *shown* with: ``paused`` for a queued job that was stopped or stepped mid-run.

The store keeps such a job ``queued`` (that is what makes it resumable and claimable), but
"queued" reads as "has not started" to a user who just pressed Stop.  The difference is in
the reason of the job's last ``job_status`` event, so every view (the panel, the HTML view,
``frames.jobs()``) derives the shown status from the stored one with :func:`display_status`,
here and nowhere else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..store import reads
from ..store.base import INTERRUPTED_REASON, JOB_STATES, STOP_REASON, JobStatus

if TYPE_CHECKING:
    from ..store.base import Store

__all__ = ["DISPLAY_STATES", "PAUSED", "STOP_REASON", "display_status", "last_status_reason"]

PAUSED = "paused"
# STOP_REASON (store/base.py): the job_status reason written when a Stop paused a job.
# Reasons that leave a job queued part-way through its run: a step ("paused after one call"),
# a Stop (STOP_REASON) and a KeyboardInterrupt (INTERRUPTED_REASON).  Others that requeue a job
# (a reply, the end of its subtasks, a recovered worker crash) mean "ready to go on": queued.
_PAUSE_PREFIXES = ("paused", INTERRUPTED_REASON)

DISPLAY_STATES = (*JOB_STATES, PAUSED)


def display_status(status: Any, reason: Any) -> str:
    """``paused`` for a queued job whose last ``job_status`` reason says it was paused; else ``status``."""
    text = str(status)
    if text == JobStatus.queued and isinstance(reason, str) and reason.startswith(_PAUSE_PREFIXES):
        return PAUSED
    return text


def last_status_reason(store: Store, job_id: int) -> str | None:
    """The reason of the job's newest ``job_status`` event (``None`` before the first one)."""
    return reads.last_status_reason(store, job_id)
