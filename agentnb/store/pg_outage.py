"""One line when the PostgreSQL server becomes unreachable and one when it is back, in place of psycopg_pool's
warnings: while a server restarts, the pool tries to reconnect with a backoff and logs every failed attempt on
the ``psycopg.pool`` logger as a two-line libpq message, which a worker printed on stderr for each attempt.

:func:`watch_outages` puts a filter on that logger (once per process, whichever stores open): a failed
(re)connection attempt is dropped and, the first time in an outage, ``agentnb: store unreachable, retrying…``
is logged on the ``agentnb.store`` logger instead; the next connection the pool makes (its ``configure`` hook,
:func:`connected`) logs ``agentnb: store reachable again``.  Both are warnings, so that Python's last-resort
handler prints them when the application configured no logging (the CLI does not), and a configured one
formats them its own way.  Every other record of the pool's is left as it was.  The outage state is the
process's, not a store's: the stores of one process all talk to the one server in practice.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["REACHABLE", "UNREACHABLE", "connected", "watch_outages"]

UNREACHABLE = "agentnb: store unreachable, retrying…"
REACHABLE = "agentnb: store reachable again"

# psycopg_pool's message templates for a connection attempt that failed (pool.py: _add_connection)
_ATTEMPT_FAILED = ("error connecting in ", "reconnection attempt in pool ")

_log = logging.getLogger("agentnb.store")


class _Outages(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._down = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(_ATTEMPT_FAILED)):
            return True
        with self._lock:
            first, self._down = not self._down, True
        if first:
            _log.warning(UNREACHABLE)
        return False

    def connected(self) -> None:
        with self._lock:
            was, self._down = self._down, False
        if was:
            _log.warning(REACHABLE)


_OUTAGES = _Outages()
_installed = threading.Lock()


def watch_outages() -> None:
    """Put the filter on the ``psycopg.pool`` logger (once)."""
    pool_log = logging.getLogger("psycopg.pool")
    with _installed:
        if _OUTAGES not in pool_log.filters:
            pool_log.addFilter(_OUTAGES)


def connected(conn: Any = None) -> None:
    """A connection was made: an outage, if one was reported, is over (the pool's ``configure`` hook)."""
    _OUTAGES.connected()
