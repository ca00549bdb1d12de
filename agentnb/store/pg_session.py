"""The limits every PostgreSQL connection of the store is opened with, tied to the lease (docs/stores.md#leases).

A worker frozen (SIGSTOP, a long pause) or cut off by the network *inside* a write transaction holds its job's
row and the advisory write locks (see :mod:`agentnb.store.postgres`): without limits every other worker waits
for it until TCP gives up, which can be hours.  So each connection asks for:

* ``idle_in_transaction_session_timeout`` = the lease (at least 1 s), set on the server for the session
  (``options=-c …``): a transaction left waiting for its client that long is ended by the *server*, which
  rolls it back and frees its locks, so by the time a frozen holder's lease has run out its job can be taken
  back (a claim passes over a locked row) and the others write again.  No agentnb transaction waits on
  anything but the database: LLM calls and tools run outside transactions, and a work directory is scanned
  and hashed before the transaction that writes it back opens, so a gap of a whole lease between two
  statements means the client is frozen or gone — and its lease, hence its right to write, is then gone too.
  The frozen process gets an error on its next statement, and the rolled-back transaction wrote nothing.
* TCP keepalives (libpq ``keepalives``, ``keepalives_idle`` = a third of the lease, ``keepalives_interval`` =
  a ninth, ``keepalives_count`` = 3, each at least 1 s) and ``tcp_user_timeout`` = the lease: a client whose
  server went silent (a partition, a host gone) sees its call fail within about a lease instead of hanging on
  the socket, so its lease renewals fail and it gives the job up (agentnb/leases.py) rather than blocking.

A connection the pool hands out is checked by :func:`check_handed_out`.

Settings the URL (or ``PGOPTIONS``) already gives are kept: a URL's own ``keepalives_idle=…`` wins, and its
``options`` come after these, so its ``-c`` settings win too.  The LISTEN connection (:mod:`pg_notify`)
is never inside a transaction and keeps its own settings.
"""

from __future__ import annotations

import math
import os
from typing import Any

from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool

from .._sockets import has_input

__all__ = ["check_handed_out", "session_limits"]


def check_handed_out(conn: Any) -> None:
    """The pool's check of a connection it hands out: an exception when the server has ended it.

    A server that ends an idle connection (a restart, a terminated backend, an idle timeout) writes its last
    message and closes the socket, so the socket has something to read; only then is the round trip of
    ``ConnectionPool.check_connection`` made, which raises for such a connection.  A healthy idle connection has
    nothing to read (the store's pooled connections LISTEN to nothing), and making that round trip on every
    checkout was a quarter of the statements a job sent (benchmarks/README.md).  A server gone silent (a network
    cut) is seen by the first statement as by the round trip: by TCP, within the lease (above)."""
    if has_input(conn):  # a connection closed on this side raises here (its fileno()): discarded too
        ConnectionPool.check_connection(conn)


def session_limits(url: str, lease: float) -> dict[str, Any]:
    """The connection parameters (``psycopg.connect`` keywords) for a store whose claims hold ``lease`` seconds."""
    given = conninfo_to_dict(url)
    idle_ms = max(1000, math.ceil(lease * 1000))
    limits: dict[str, Any] = {
        "keepalives": 1,
        "keepalives_idle": max(1, int(lease // 3)),
        "keepalives_interval": max(1, int(lease // 9)),
        "keepalives_count": 3,
        "tcp_user_timeout": idle_ms,
    }
    params = {k: v for k, v in limits.items() if k not in given}
    theirs = given.get("options") or os.environ.get("PGOPTIONS") or ""
    params["options"] = f"-c idle_in_transaction_session_timeout={idle_ms} {theirs}".strip()
    return params
