"""Where jobs, comments, movements and events are kept: the store interface and its SQLite backend.

No module outside this package runs SQL or imports ``sqlite3``: everything else is typed against
:class:`Store` (the interface, in ``base.py``) and gets one from :func:`open_store`.
"""

from __future__ import annotations

import os

from ..errors import StoreError
from .base import Store, Transaction
from .sqlite import BACKEND_ERRORS, SQLiteStore, describe_error
from .texts import instruction_sql, payload_text_sql

__all__ = [
    "BACKEND_ERRORS",
    "SQLiteStore",
    "Store",
    "StoreError",
    "Transaction",
    "describe_error",
    "instruction_sql",
    "open_store",
    "payload_text_sql",
]


def open_store(path: str | os.PathLike[str], *, readonly: bool = False) -> Store:
    """The store at ``path`` (today always a SQLite file; ``readonly=True`` only reads)."""
    return SQLiteStore(path, readonly=readonly)
