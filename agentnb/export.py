"""A job as a notebook transcript: ``ws.export_notebook(job, path)`` (also ``agentnb export``, ``%agent export``).

The notebook is built by :mod:`agentnb.views.transcript` (see there for its cells); this module is its
public face, and holds :func:`transcript`, the function every exported movement cell runs
(``from agentnb.export import transcript``) to draw its run again from the store.
"""

from __future__ import annotations

import os
from typing import Any

from .views.render import STYLE, movement_html
from .views.transcript import (
    COLLAPSED,
    EXPORT_MAX_CHARS,
    TRANSCRIPT_TAG,
    build_notebook,
    export_notebook,
    movement_text,
)
from .workspace import Workspace

__all__ = ["COLLAPSED", "EXPORT_MAX_CHARS", "TRANSCRIPT_TAG", "build_notebook", "export_notebook", "movement_text",
           "transcript"]


def transcript(workspace: str | os.PathLike[str] | Workspace, job: int, seq: int) -> Any:
    """Movement run ``seq`` of job ``job`` as HTML for a notebook (what an exported transcript cell runs)."""
    from IPython.display import HTML

    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    return HTML(STYLE + movement_html(ws, job, seq, max_calls=None))
