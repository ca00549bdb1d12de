"""One line when the PostgreSQL server becomes unreachable and one when it is back, in place of psycopg_pool's
warnings: while a server restarts, the pool tries to reconnect with a backoff and logs every failed attempt on
the ``psycopg.pool`` logger as a two-line libpq message, which a worker printed on stderr for each attempt.

:func:`watch_outages` puts a filter on that logger (once per process, whichever stores open): a failed
(re)connection attempt is dropped and, the first time in an outage, ``agentnb: store unreachable, retrying…``
is logged on the ``agentnb.store`` logger instead; the next connection the pool makes (its ``configure`` hook,
:func:`connected`) logs ``agentnb: store reachable again``.  Both are warnings, so that Python's last-resort
handler prints them when the application configured no logging (the CLI does not), and a configured one
formats them its own way.  The pool's warnings that it threw away a connection the server had closed
(``discarding closed connection``, ``discarding broken connection``: every pooled connection, after a
restart; ``closing returned connection``, one cut off mid-command) are dropped too, as the next connection
tells whether the server is back, and so is psycopg's ``error ignored in rollback`` when the rollback failed
for the same outage (the error that ended the transaction is raised, and a worker waits it out).  Every other
record is left as it was.  The outage state is the process's, not a store's: the stores of one process all
talk to the one server in practice.

:func:`is_outage` tells such an outage (worth waiting out: a worker retries) from an error that waiting does
not mend (a refused password, a missing database).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg
from psycopg_pool import PoolClosed

__all__ = ["REACHABLE", "UNREACHABLE", "connected", "is_outage", "watch_outages"]

UNREACHABLE = "agentnb: store unreachable, retrying…"
REACHABLE = "agentnb: store reachable again"

# psycopg_pool's message templates for a connection attempt that failed (pool.py: _add_connection)
_ATTEMPT_FAILED = ("error connecting in ", "reconnection attempt in pool ")
# ... for a pooled connection the server closed, found so (pool.py: _return_connection, check) or given back
# in the middle of the command the server cut off (_reset_connection); and psycopg's for the rollback that
# then fails (connection.py, transaction.py), dropped when its error is an outage's
_CONNECTION_DROPPED = ("discarding closed connection", "discarding broken connection", "closing returned connection")
_ROLLBACK_FAILED = "error ignored in rollback"
_LOGGERS = ("psycopg.pool", "psycopg", "psycopg.transaction")

# SQLSTATEs of a server going away or not there yet: admin_shutdown, crash_shutdown, cannot_connect_now, and
# too_many_connections (others will disconnect); class 08 is the connection exceptions
_OUTAGE_STATES = frozenset({"57P01", "57P02", "57P03", "53300"})
# what libpq says, in an error without a SQLSTATE (a connection attempt's), when waiting will not help
_SETUP_ERRORS = ("password", "authentication", "does not exist", "pg_hba.conf", "permission denied",
                 "invalid connection option", "invalid dsn", "invalid uri")

_log = logging.getLogger("agentnb.store")


class _Outages(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._down = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str):
            return True
        if record.msg.startswith(_CONNECTION_DROPPED):
            return False
        if record.msg.startswith(_ROLLBACK_FAILED):
            args = record.args if isinstance(record.args, tuple) else ()
            return not (args and isinstance(args[-1], BaseException) and is_outage(args[-1]))
        if not record.msg.startswith(_ATTEMPT_FAILED):
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
    """Put the filter on the ``psycopg.pool`` logger, and psycopg's own (once)."""
    with _installed:
        for name in _LOGGERS:
            log = logging.getLogger(name)
            if _OUTAGES not in log.filters:
                log.addFilter(_OUTAGES)


def connected(conn: Any = None) -> None:
    """A connection was made: an outage, if one was reported, is over (the pool's ``configure`` hook)."""
    _OUTAGES.connected()


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` (a psycopg error) is the server being unreachable — refusing connections, shutting down
    or starting up, or a connection lost mid-call — rather than a setup the server refuses (password, database,
    permissions), which no wait mends."""
    if not isinstance(exc, psycopg.OperationalError) or isinstance(exc, PoolClosed):  # closed by this process
        return False
    state = exc.sqlstate
    if state is not None:
        return state in _OUTAGE_STATES or state.startswith("08")
    text = str(exc).lower()
    return not any(mark in text for mark in _SETUP_ERRORS)
