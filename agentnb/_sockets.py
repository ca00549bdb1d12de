"""Whether an idle connection has something to read, for the pools that keep connections between uses: the plain
HTTP path's (models/_plain_http.py) and the PostgreSQL store's (store/pg_session.py)."""

from __future__ import annotations

import select
from typing import Any

__all__ = ["has_input"]


def has_input(conn: Any) -> bool:
    """Whether ``conn`` (a socket, or anything with ``fileno()``) has something to read now: on an idle connection,
    the other side's close or its last words (or bytes nobody asked for).  True when that cannot be told."""
    try:
        if hasattr(select, "poll"):  # select.select fails on descriptors past 1024
            poller = select.poll()
            poller.register(conn, select.POLLIN)
            return bool(poller.poll(0))
        return bool(select.select([conn], [], [], 0)[0])
    except (OSError, ValueError):
        return True
