"""A job as a notebook transcript: ``ws.export_notebook(job, path)`` (also ``agentnb export``, ``%agent export``).

The notebook is built by :mod:`agentnb.views.transcript` (see there for its cells); this module is its
public face, and holds :func:`transcript`, the function every exported movement cell runs
(``from agentnb.export import transcript``) to draw its run again from the store.
"""

from __future__ import annotations

import os
from typing import Any

from .store import display_url
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


def transcript(workspace: str | os.PathLike[str] | Workspace, job: int, seq: int, *,
               store: str | None = None) -> Any:
    """Movement run ``seq`` of job ``job`` as HTML for a notebook (what an exported transcript cell runs).

    ``store``: the store URL the jobs are kept in (docs/stores.md; None: ``$AGENTNB_STORE``, else the folder's
    ``agentnb.sqlite``).  An exported cell names it without its password: when ``$AGENTNB_STORE`` is that
    same URL with a password, the environment's is used (else psycopg looks in ``PGPASSWORD``/``~/.pgpass``).
    """
    from IPython.display import HTML

    if isinstance(workspace, Workspace):
        ws = workspace
    else:
        env = os.environ.get("AGENTNB_STORE") or None
        if store is not None and env is not None and display_url(env) == store:
            store = env
        with Workspace(workspace, store=store) as opened:  # closed here: a PostgreSQL pool must not linger
            return HTML(STYLE + movement_html(opened, job, seq, max_calls=None))
    return HTML(STYLE + movement_html(ws, job, seq, max_calls=None))
