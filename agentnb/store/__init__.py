"""Where jobs, comments, movements and events are kept: the store interface and its SQLite backend.

No module outside this package runs SQL or imports ``sqlite3``."""

from .sqlite import Store, StoreError, instruction_sql, payload_text_sql

__all__ = ["Store", "StoreError", "instruction_sql", "payload_text_sql"]
