"""What PostgreSQL takes differently from SQLite, for :mod:`agentnb.store.postgres`: the shared SQL's ``?``
placeholders, payload paths, the NULs its text cannot hold, and rows read by position as ``sqlite3.Row`` allows.

It imports no psycopg at run time (``store copy`` uses :func:`no_nul` between SQLite stores too).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg

__all__ = ["Row", "no_nul", "pg_path", "psycopg_sql", "row_factory"]


def pg_path(json_path: str) -> str:
    """``$.a.b`` (events.payload_path) as PostgreSQL's text-array path ``{a,b}``."""
    return "{" + json_path[2:].replace(".", ",") + "}"


# a NUL escape in JSON text: \u0000 after an even number of backslashes (after an odd number the backslash is
# itself escaped, and the text reads "\u0000" literally)
_NUL = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


def no_nul(payload: str) -> str:
    """``payload`` with each NUL character as U+FFFD.

    PostgreSQL cannot hold NUL in text, and a ``json`` value holding ``\\u0000`` fails every ``#>``/``#>>`` read of
    its row, which would break the frames of the whole workspace.  A NUL reaches a payload only from a command's
    output or a model's text (the file tools refuse binary files); SQLite keeps it, this store marks where it was.
    """
    return _NUL.sub(lambda m: m.group(1) + "\\ufffd", payload) if "\\u0000" in payload else payload


@functools.lru_cache(maxsize=512)
def psycopg_sql(sql: str) -> str:
    """SQL written with SQLite's ``?`` placeholders (as the shared frame SQL is) in psycopg's ``%s`` style."""
    return sql.replace("%", "%%").replace("?", "%s")


class Row(dict[str, Any]):
    """A row by column name, and by position as ``sqlite3.Row`` allows (``query(…)[0][0]`` reads the same on both)."""

    def __getitem__(self, key: str | int) -> Any:
        if isinstance(key, int):
            return list(self.values())[key]
        return super().__getitem__(key)


def row_factory(cursor: psycopg.Cursor[Any]) -> Any:
    names = [d.name for d in cursor.description or ()]
    return lambda values: Row(zip(names, values, strict=True))
