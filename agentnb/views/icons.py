"""The symbols the views show, each one a character that DejaVu Sans has.

An emoji (🔧, ⏱, ❓, ⑂ and the like) is drawn only where an emoji font is installed: a minimal Linux desktop
or a locked-down corporate image has none, and showed "#12 □1@2".  DejaVu Sans is the sans-serif font of
nearly every Linux desktop (and matplotlib's), and the fonts JupyterLab asks for on macOS and Windows fall back
to system fonts that have these characters too.  A character rather than an inline SVG: JupyterLab's
sanitizer drops ``<svg>`` from untrusted outputs and from Markdown (an exported transcript), and a character
also serves the text views, the panel's job list (a ``<select>``, text only) and the plots.
tests/test_style.py checks every non-ASCII character of the rendered views against DejaVu Sans's charmap.

In HTML, :func:`icon` gives the symbol its meaning as ``aria-label`` (screen readers) and ``title`` (a
tooltip); it takes the colour of the text around it, so the dark theme needs nothing.
"""

from __future__ import annotations

import html
from typing import Final

from ..store.base import JobStatus
from .style import STATUS_COLOURS

__all__ = ["COMMENT", "FORK", "LATENCY", "REMINDER", "STOP", "TOOL", "icon", "question_badge"]

TOOL: Final = "\u2692"  # ⚒ hammer and pick: a tool call
LATENCY: Final = "\u25f7"  # ◷ a clock face: how long the model took to answer
FORK: Final = "\u2387"  # ⎇ the "alternative" (branch) key: a fork of another job
REMINDER: Final = "\u261e"  # ☞ a reminder put into the conversation
COMMENT: Final = "\u270e"  # ✎ a comment or a reply written into the job
STOP: Final = "\u2298"  # ⊘ the context forced a transition, or the window is exhausted

# "?" on the waiting status's colour, styled inline (a saved view keeps style attributes, not <style>)
_ASK_STYLE: Final = ("display:inline-block;min-width:1.1em;padding:0 4px;margin:0 2px;border-radius:8px;"
                     f"font-size:11px;font-weight:700;text-align:center;color:#fff;background:{STATUS_COLOURS[JobStatus.waiting_human]}")


def icon(symbol: str, label: str) -> str:
    """``symbol`` as HTML, with ``label`` read by screen readers and shown on hover."""
    text = html.escape(label, quote=True)
    return f'<span class="anb-icon" role="img" aria-label="{text}" title="{text}">{html.escape(symbol)}</span>'


def question_badge() -> str:
    """The mark of a job waiting for the user's answer: "?" in a badge of the waiting status's colour."""
    return ('<span class="anb-icon anb-ask" role="img" aria-label="question" title="the job asks you a question" '
            f'style="{_ASK_STYLE}">?</span>')
