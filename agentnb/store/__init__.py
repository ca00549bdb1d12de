"""Where jobs, comments, movements and events are kept: the store interface, its SQLite backend
and (extra ``agentnb[postgres]``, imported only when a ``postgresql://`` URL is opened) its PostgreSQL backend.

No module outside this package runs SQL or imports ``sqlite3``: everything else is typed against
:class:`Store` (the interface, in ``base.py``) and gets one from :func:`open_store`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import StoreError
from .base import DEFAULT_LEASE, Store, Transaction
from .sqlite import BACKEND_ERRORS, SQLiteStore, describe_error
from .texts import instruction_sql, payload_text_sql

__all__ = [
    "BACKEND_ERRORS",
    "STORE_SCHEMES",
    "SQLiteStore",
    "Store",
    "StoreError",
    "Transaction",
    "copy_store",
    "describe_error",
    "display_url",
    "instruction_sql",
    "open_store",
    "payload_text_sql",
    "store_scheme",
    "summary_lines",
]


# a URL's scheme: letters, then digits, +, - or . (RFC 3986), then "://"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
STORE_SCHEMES = ("sqlite", "postgresql", "postgres")


def store_scheme(path_or_url: str | os.PathLike[str]) -> str | None:
    """The scheme of a store URL (lower case), or None for a plain path."""
    if not isinstance(path_or_url, str):
        return None
    found = _SCHEME.match(path_or_url)
    return found.group(1).lower() if found else None


def open_store(path_or_url: str | os.PathLike[str], *, readonly: bool = False, lease: float | None = None) -> Store:
    """The store at ``path_or_url`` (``readonly=True`` only reads; ``lease``: the seconds its claims hold a job,
    by default :data:`~agentnb.store.base.DEFAULT_LEASE`; on PostgreSQL its connections' limits follow it):

    * a path: the SQLite store in that file, or in ``agentnb.sqlite`` inside it when it is a folder;
    * ``sqlite:///ABS/PATH``: the same, for an absolute path (``sqlite:///tmp/ws/agentnb.sqlite``);
    * ``postgresql://user[:password]@host[:port]/db`` (or ``postgres://``): the PostgreSQL store (extra
      ``agentnb[postgres]``);
    * any other scheme: one :class:`StoreError` line naming it and what is allowed.
    """
    scheme = store_scheme(path_or_url)
    if scheme is None:
        path = Path(path_or_url)
        return _leasing(SQLiteStore(path / "agentnb.sqlite" if path.is_dir() else path, readonly=readonly), lease)
    url = str(path_or_url)
    if scheme == "sqlite":
        rest = url[len(scheme) + 3:]
        if not rest.startswith("/"):
            raise StoreError(f"the SQLite URL {url!r} needs an absolute path: sqlite:///abs/path/agentnb.sqlite "
                             "(three slashes, then the path)")
        path = Path(rest)
        return _leasing(SQLiteStore(path / "agentnb.sqlite" if path.is_dir() else path, readonly=readonly), lease)
    if scheme in ("postgresql", "postgres"):
        try:
            from .postgres import PostgresStore
        except ImportError as exc:
            raise StoreError(f"a PostgreSQL store needs psycopg 3 and psycopg-pool ({exc}): "
                             "pip install 'agentnb[postgres]'") from None
        return PostgresStore(url, readonly=readonly, lease=DEFAULT_LEASE if lease is None else lease)
    shown = url.split("://", 1)[0]
    raise StoreError(f"unsupported store URL scheme {shown!r}: give a folder path, sqlite:///ABS/PATH or "
                     "postgresql://user@host:port/db")


def _leasing(store: Store, lease: float | None) -> Store:
    if lease is not None:
        store.lease = lease
    return store


def copy_store(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, running: str = "refuse") -> dict[str, int]:
    """Copy the whole workspace in ``src`` (a path, ``sqlite:///…`` or ``postgresql://…``) into the empty store
    ``dst``: rows with their ids, and each job's files; the rows per table, ``files`` and ``file_bytes`` now in
    ``dst`` (checked against ``src`` before the copy commits).  See :mod:`agentnb.store.copy` for what is refused.
    """
    from .copy import copy_store as copy

    return copy(src, dst, running=running, opener=open_store, scheme_of=store_scheme)  # type: ignore[arg-type]


def summary_lines(counts: dict[str, int]) -> list[str]:
    """:func:`copy_store`'s counts as one line per table, then the files (what ``agentnb store copy`` prints)."""
    from .copy import summary_lines as lines

    return lines(counts)


def display_url(path_or_url: str | os.PathLike[str]) -> str:
    """A store's path or URL as it may be shown or written down (a notebook, a message): without a password."""
    text = os.fspath(path_or_url)
    if store_scheme(text) in ("postgresql", "postgres"):
        from .postgres import display_url as without_password

        return without_password(text)
    return text
