"""Long texts stored once: a job's long instruction lives in the ``texts`` table and ``TEXT_REF`` stands
for it in the columns and payload fields that repeat it (migration 2).

Rewriting a jobs row rewrites all of it: with a long instruction inline, every status change copied it
into the WAL again.  In ``texts`` it is written once and never touched again.
"""

from __future__ import annotations

__all__ = ["REF_FIELDS", "TEXT_REF", "TEXT_REF_MIN_CHARS", "instruction_sql", "payload_text_sql"]

# A job's instruction this long or longer is stored once, in `texts`; elsewhere (the enriched instruction,
# each movement's user prompt) TEXT_REF stands for it.  Shorter ones are stored as they are: copies of a
# few kB cost less than the indirection.
TEXT_REF_MIN_CHARS = 4096
TEXT_REF = "\u27e6agentnb:text\u27e7"  # ⟦agentnb:text⟧
# event kind → payload keys in which the job's instruction is replaced by TEXT_REF
REF_FIELDS: dict[str, tuple[str, ...]] = {"movement_start": ("user",)}


def instruction_sql(alias: str) -> str:
    """SQL for the instruction of job row ``alias`` (stored once in ``texts`` when it is long)."""
    return (f"COALESCE((SELECT t.body FROM texts t WHERE t.hash = {alias}.instruction_ref), {alias}.instruction)")


def payload_text_sql(alias: str, key: str, dialect: str = "sqlite") -> str:
    """SQL for payload ``key`` of event row ``alias`` as :meth:`Store.events` returns it (references expanded);
    ``dialect`` "sqlite" (TEXT payloads, json_extract) or "postgres" (``json`` payloads, ``#>>``)."""
    if dialect == "sqlite":
        value = f"json_extract({alias}.payload, '$.{key}')"
        ref = f"json_extract({alias}.payload, '$._texts.{key}')"
    else:
        value = f"({alias}.payload #>> '{{{key}}}')"
        ref = f"({alias}.payload #>> '{{_texts,{key}}}')"
    return (f"(CASE WHEN {ref} IS NULL THEN {value} ELSE replace({value}, '{TEXT_REF}', "
            f"(SELECT t.body FROM texts t WHERE t.hash = {ref})) END)")
