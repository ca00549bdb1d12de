"""The colours every view shares, defined once: the HTML view's CSS, the panel's marks and the plots."""

from __future__ import annotations

from typing import Final

from ..events import ACTIONS

__all__ = ["ACTIONS", "ACTION_COLOURS", "ERROR_COLOUR", "OK_COLOUR"]

# One colour per action: its badge in the HTML view, its mark on the panel's context bar, its threshold
# line and markers in the usage plot.
ACTION_COLOURS: Final[dict[str, str]] = {
    "warn": "#c9a200", "prompt": "#e07b00", "force_transition": "#d03a3a", "exhausted": "#8b0000",
}
# a job that succeeded, and the context bar below every threshold
OK_COLOUR: Final = "#2e8b57"
ERROR_COLOUR: Final = "#b00020"
