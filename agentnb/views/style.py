"""The colours every view shares, defined once: the HTML view's CSS, the panel's marks and the plots."""

from __future__ import annotations

from typing import Final

from ..events import ACTIONS
from ..store.base import JobStatus

__all__ = ["ACTIONS", "ACTION_COLOURS", "COMPACTION", "COMPACTION_COLOUR", "DIVERGENCE_COLOUR", "ERROR_COLOUR",
           "LOOP_COLOUR", "OK_COLOUR", "RESERVED_COLOUR", "STATUS_COLOURS", "USAGE_ACTIONS"]

# One colour per action: its badge in the HTML view, its mark on the panel's context bar, its threshold
# line and markers in the usage plot.
ACTION_COLOURS: Final[dict[str, str]] = {
    "warn": "#c9a200", "prompt": "#e07b00", "force_transition": "#d03a3a", "exhausted": "#8b0000",
}
# a job that succeeded, and the context bar below every threshold
OK_COLOUR: Final = "#2e8b57"
ERROR_COLOUR: Final = "#b00020"
# a job's status as the job view's badges draw it (views/render.py), and the batch's progress line its outcomes
STATUS_COLOURS: Final[dict[str, str]] = {
    JobStatus.succeeded: OK_COLOUR, JobStatus.failed: "#c0392b", JobStatus.aborted: "#c0392b",
    JobStatus.queued: "#2f6fb0", JobStatus.running: "#2f6fb0",
    JobStatus.waiting_human: "#8e44ad", JobStatus.waiting_subtasks: "#8e44ad", "paused": "#b7791f",  # shown, never stored (views/status.py)
}
# a fork's movement run re-served from the original's record (no tokens spent): a calm blue-grey, apart from
# the status and action colours, so it reads as "not live" rather than as a state or a warning
RESERVED_COLOUR: Final = "#5b7083"
# a tool re-run in a re-served run gave another result than the original's: a warning, not an error
DIVERGENCE_COLOUR: Final = "#b35900"
# a loop monitor fired (docs/context.md#loop-monitors): a cycle of movements repeated; purple, apart from warnings and errors
LOOP_COLOUR: Final = "#6d4c9f"
# a movement's messages were replaced by a summary (docs/context.md#compaction): teal, a relief rather than a warning
COMPACTION_COLOUR: Final = "#1f8a8a"
# ``frames.usage()``'s ``action``: the ContextManager's four, in firing order, then the summarisation call of
# a compaction (not a ContextManager action: the call that compacted the messages)
COMPACTION: Final = "compaction"
USAGE_ACTIONS: Final[tuple[str, ...]] = (*ACTIONS, COMPACTION)
