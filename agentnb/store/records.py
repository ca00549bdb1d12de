"""The store's rows as frozen, typed records: a job, a movement run, a comment, a batch.

The store builds them; the rest of the package reads their fields instead of looking up columns by name.  Each
has ``to_dict()``, which gives the row as the plain dict the public API returned before
(docs/python-api.md#records), so a user's notebook that reads ``ws.movements(job)[0]["name"]`` keeps working.
"""

from __future__ import annotations

__all__: list[str] = []
