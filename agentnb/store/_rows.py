"""The rows both stores build the same way, so that SQLite and PostgreSQL hold the same rows.

* a job's columns (``JOB_COLUMNS``), those a caller may update (``UPDATABLE``) and the ``UPDATE`` of its row;
* an event's ``events`` row: its payload data (events.py), the job's long instruction put by reference
  (texts.py), then encoded by events.py's one encoder — and, read back, the references expanded again;
* the large texts stored once: a job's long instruction in ``texts``, ``TEXT_REF`` in its ``jobs`` row, its
  enriched instruction and the payloads that repeat it;
* no secret in any of it: every text the store keeps — a job's texts (``error``, the instruction, the
  enriched instruction, the options), every event's payload (a ``job_status`` reason, an ``error`` message,
  a comment, …), a comment row, a movement's summary, a batch's cases and options — passes :func:`agentnb._secrets.scrub` here on its way
  in (the values of the environment's secrets, the keys registered in code, key-shaped text), so that an
  endpoint's error repeating the API key reaches neither SQLite nor a PostgreSQL database others share.

:class:`StoreRows` holds that machinery for a store class; each store supplies its own SQL and locking through
the few methods it overrides (``_instruction_ref``, ``_put_text``, ``_text``; PostgreSQL also
``_payload_text``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

from .. import live
from .._secrets import might_hold_secret, scrub, scrub_data
from ..errors import StoreError
from ..events import (
    CommentEvent,
    Event,
    EventBase,
    JobStatusEvent,
    check_event,
    encode_payload,
    event_from_row,
    payload_dict,
)
from .base import TERMINAL_STATES, Dialect, FrameRows, JobStatus, PreparedRow
from .records import JOB_COLUMNS, JobRecord
from .texts import REF_FIELDS, TEXT_REF, TEXT_REF_MIN_CHARS

__all__ = ["JOB_COLUMNS", "UPDATABLE", "StoreRows", "events_query"]

# lease_gen moves only by claims and recoveries (a fence compares against it)
UPDATABLE = frozenset(JOB_COLUMNS) - {"id", "created", "lease_gen"}
# the job columns that hold free text (an endpoint's error, what a user or a model wrote), scrubbed of secrets;
# the piece's YAML is not: `***` would make YAML of it that no longer parses (an alias), and it is the user's file
SCRUBBED_TEXTS = ("instruction", "enriched", "error")


def events_query(payload: str, job_id: int, after_id: int, kinds: Sequence[str] | None,
                 movement_seq: int | None) -> tuple[str, list[Any]]:
    """The query of :meth:`Store.events` (``?`` placeholders) and its parameters; ``payload`` is the column as the
    store reads it as text."""
    sql = f"SELECT id, job_id, movement_seq, iteration, ts, kind, {payload} FROM events WHERE job_id=? AND id>?"
    params: list[Any] = [job_id, after_id]
    if kinds:
        sql += f" AND kind IN ({','.join('?' for _ in kinds)})"
        params.extend(kinds)
    if movement_seq is not None:
        sql += " AND movement_seq=?"
        params.append(movement_seq)
    return sql, params


C = TypeVar("C")  # the store's connection: the transaction a row is built in

# PostgreSQL commits in many threads at once: a transaction with events to publish (live.py) takes this lock before
# its commit and keeps it until they are published, so subscribers see them in commit order (SQLite's store lock
# does that already).  Taken only when somebody listens, so unwatched jobs commit side by side.
_PUBLISHING = threading.RLock()
_log = logging.getLogger("agentnb.live")


class StoreRows(ABC, Generic[C]):
    """Job rows, event rows and large texts, for a store whose transactions hand out connections of type ``C``."""

    # set by the store's __init__
    _strict: bool  # every appended event is type-checked (events.strict_events, read once)
    _texts: dict[str, str]  # a few texts by hash (they never change)
    _texts_lock: AbstractContextManager[Any]  # guards _texts

    dialect: Dialect  # the SQL this backend speaks (a class attribute of each store)

    def rows(self, sql: str, params: Sequence[Any] = ()) -> FrameRows:
        """Column names and row tuples of a read-only query written once for both backends (``?`` placeholders,
        SQL both engines take); the derived reads of :mod:`agentnb.store.reads` are built on it."""
        return self._tuples(sql, params)

    @abstractmethod
    def _tuples(self, sql: str, params: Sequence[Any]) -> FrameRows: ...

    # -- each store's own SQL ---------------------------------------------------------------------------------
    @abstractmethod
    def _instruction_ref(self, c: C, job_id: int) -> str | None:
        """The hash of job ``job_id``'s stored instruction, or None when it is kept inline."""

    @abstractmethod
    def _put_text(self, c: C, body: str) -> str:
        """Store ``body`` once in ``texts`` (in transaction ``c``); its hash."""

    @abstractmethod
    def _text(self, ref: str) -> str:
        """The text stored under hash ``ref``."""

    def _payload_text(self, data: dict[str, Any]) -> str:
        """A payload as the ``events.payload`` text."""
        return encode_payload(data)

    # -- secrets: every text passes here on its way into the store ----------------------------------------------
    @staticmethod
    def _clean(text: str) -> str:
        """``text`` as the store keeps it: without secrets (``_secrets.scrub``)."""
        return scrub(text) if isinstance(text, str) else text

    @staticmethod
    def _clean_json(text: Any) -> Any:
        """JSON text (a job's options) without secrets, re-encoded only when it held one."""
        if not isinstance(text, str) or not might_hold_secret(text):
            return text
        try:
            data = json.loads(text)
        except ValueError:
            return scrub(text)
        return encode_payload(scrub_data(data))

    def _clean_job(self, values: dict[str, Any]) -> None:
        """A job row's ``values`` (to insert or update) without secrets, in place."""
        for key in SCRUBBED_TEXTS:
            if key in values:
                values[key] = self._clean(values[key])
        if "options" in values:
            values["options"] = self._clean_json(values["options"])

    def _clean_batch(self, values: dict[str, Any]) -> dict[str, Any]:
        """A batch row's ``values`` without secrets: its cases and options (JSON).  Not its variants, whose pieces'
        YAML must parse again and match the pieces a resumed batch is given; nor its fingerprint, made of the
        cases as given, which a resume recomputes from them."""
        for key in ("cases", "options"):
            if key in values:
                values[key] = self._clean_json(values[key])
        return values

    def _new_job(self, c: C, values: dict[str, Any]) -> None:
        """A new job's row ``values`` as stored (in transaction ``c``): no secrets, a long instruction by reference."""
        self._clean_job(values)
        self._ref_instruction(c, values)

    def _comment_row(self, job_id: int, author: str, body: str, ts: float | None) -> tuple[tuple[Any, ...], Event]:
        """A comment's ``comments`` row ``(job_id, author, body, ts)`` and its ``comment`` event, without secrets."""
        now = time.time()
        body = self._clean(body)
        return (job_id, author, body, now if ts is None else ts), CommentEvent(job_id=job_id, ts=now, author=author,
                                                                               body=body)

    # -- jobs --------------------------------------------------------------------------------------------------
    def _job_update(self, c: C, job_id: int, values: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
        """The ``UPDATE`` of job ``job_id``'s row to ``values`` (``?`` placeholders) and its parameters, the
        instruction and the enriched instruction put by reference (in transaction ``c``)."""
        bad = set(values) - UPDATABLE
        if bad:
            raise StoreError(f"cannot update job columns {sorted(bad)}")
        values["updated"] = time.time()
        self._clean_job(values)
        if "instruction" in values:
            self._ref_instruction(c, values)
        if "enriched" in values:
            self._ref_enriched(c, job_id, values)
        sets = ", ".join(f"{k}=?" for k in values)
        return f"UPDATE jobs SET {sets} WHERE id=?", (*values.values(), job_id)

    def _status_change(self, job_id: int, status: str, reason: str, values: dict[str, Any]) -> JobStatusEvent:
        """The ``job_status`` event of job ``job_id`` moving to ``status``, and the row ``values`` that go with
        it filled in: the end time of a job that ends, no claim or lease on a job that is not running."""
        now = time.time()
        if status in TERMINAL_STATES:
            values.setdefault("ended", now)
        if status != JobStatus.running:
            values.setdefault("claimed_by", None)
            values.setdefault("lease_until", None)
        return JobStatusEvent(job_id=job_id, ts=now, status=status, reason=reason)

    # -- events ------------------------------------------------------------------------------------------------
    def _event_row(self, c: C | None, ev: Event) -> tuple[Any, ...]:
        """The ``events`` row of ``ev``: its payload data (events.py) without secrets, the job's long instruction
        put by reference (texts.py; needs the transaction ``c``), then encoded by events.py's one encoder."""
        if not isinstance(ev, EventBase):
            raise StoreError(f"not an event: {ev!r}; the store appends only agentnb.events objects")
        if self._strict:
            check_event(ev)
        data = payload_dict(ev)
        if ev.kind in REF_FIELDS:  # a movement's start: once per movement, its strings scrubbed one by one
            assert c is not None, "a referencing payload is built inside its transaction"
            text = self._payload_text(self._ref_payload(c, ev.job_id, ev.kind, scrub_data(data)))
        else:
            # every event passes here: the encoded text is searched once, and the payload walked only when it
            # may hold a secret (a value, or something shaped like a key)
            text = self._payload_text(data)
            if might_hold_secret(text):
                cleaned = scrub_data(data)
                if cleaned is not data:
                    text = self._payload_text(cleaned)
        return ev.job_id, ev.movement_seq, ev.iteration, ev.ts or time.time(), ev.kind, text

    def prepare(self, events: Iterable[Event | PreparedRow]) -> list[Event | PreparedRow]:
        """The rows of ``events`` built (and checked) before any transaction, each but the payloads that refer
        to the job's stored instruction (they read its reference): those stay events, for :meth:`_rows_in`.
        Rows built already stay as they are."""
        return [ev if isinstance(ev, PreparedRow) or (isinstance(ev, EventBase) and ev.kind in REF_FIELDS)
                else PreparedRow(self._event_row(None, ev)) for ev in events]

    def _rows_in(self, c: C, rows: Iterable[Event | PreparedRow]) -> list[tuple[Any, ...]]:
        """The rows of ``rows`` (events, or rows :meth:`prepare` built) with the rest built, in the
        transaction ``c``."""
        return [r if isinstance(r, PreparedRow) else self._event_row(c, r) for r in rows]

    def _ref_payload(self, c: C, job_id: int, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        """The payload to store: the job's long instruction replaced by TEXT_REF in the fields that repeat it."""
        ref = self._instruction_ref(c, job_id)
        if ref is None:
            return payload
        refs = {}
        out = dict(payload)
        for key in REF_FIELDS[kind]:
            replaced = self._replace(out.get(key), ref)
            if replaced is not None:
                out[key], refs[key] = replaced, ref
        if refs:
            out["_texts"] = refs
        return out

    def _expand(self, row: tuple[Any, ...]) -> tuple[Any, ...]:
        """An event row with the texts its payload refers to put back, as it was recorded."""
        if '"_texts"' not in row[6]:
            return row
        data = json.loads(row[6])
        refs = data.pop("_texts", None)
        if isinstance(refs, dict):
            for key, ref in refs.items():
                if isinstance(data.get(key), str):
                    data[key] = data[key].replace(TEXT_REF, self._text(ref))
        return (*row[:6], data)

    # -- the live subscription (live.py) --------------------------------------------------------------------
    # thread → the (event id, row…) its open transaction appended that a subscriber wants, published once the
    # transaction commits; and the threads holding _PUBLISHING.  Made on the first event anyone wants: until then a
    # commit's only cost here is reading this None.
    _live_pending: dict[int, list[tuple[Any, ...]]] | None = None
    _live_held: set[int] | None = None

    def _live_wants(self, rows: Sequence[tuple[Any, ...]]) -> bool:
        """Whether a subscriber listens to the job of any of these event rows (one test when nobody listens)."""
        # a row is (job_id, movement_seq, iteration, ts, kind, payload)
        return live.listening() and live.wants_rows(self, [r[0] for r in rows], [r[4] for r in rows])  # type: ignore[arg-type]

    def _live_rows(self, rows: Sequence[tuple[Any, ...]], ids: Iterable[int]) -> None:
        """Keep the event rows just inserted, with their ids, to publish when the transaction commits."""
        pending = self.__dict__.setdefault("_live_pending", {})  # setdefault: one dict even if two threads race
        pending.setdefault(threading.get_ident(), []).extend((i, *row) for i, row in zip(ids, rows, strict=True))

    def _live_ready(self) -> None:
        """Just before the commit (PostgreSQL): take the publishing lock if this transaction has events to publish."""
        pending, me = self._live_pending, threading.get_ident()
        if pending and me in pending:
            held = self.__dict__.setdefault("_live_held", set())
            if me not in held:
                _PUBLISHING.acquire()
                held.add(me)

    def _live_end(self, committed: bool) -> None:
        """When the thread's outermost transaction has ended: publish what it appended if it committed (never what
        a rollback undid), then let the next committer publish.  Nothing here raises into the committed write."""
        pending = self._live_pending
        if not pending:
            return
        me = threading.get_ident()
        rows = pending.pop(me, None)
        if rows is None:
            return
        try:
            if committed:
                live.publish(self, [event_from_row(self._expand(r)) for r in rows])  # type: ignore[arg-type]
        except Exception:  # the events are stored: a subscriber reads them from the store instead
            _log.exception("agentnb: the committed events of a transaction could not be published")
        finally:
            held = self._live_held
            if held and me in held:
                held.discard(me)
                _PUBLISHING.release()

    # -- large texts, stored once (see texts.py) --------------------------------------
    def _ref_instruction(self, c: C, values: dict[str, Any]) -> None:
        text = values.get("instruction")
        values["instruction_ref"] = None
        if isinstance(text, str) and len(text) >= TEXT_REF_MIN_CHARS:
            values["instruction_ref"] = self._put_text(c, text)
            values["instruction"] = TEXT_REF

    def _ref_enriched(self, c: C, job_id: int, values: dict[str, Any]) -> None:
        values["enriched_ref"] = None
        ref = self._instruction_ref(c, job_id)
        if ref is not None:
            replaced = self._replace(values["enriched"], ref)
            if replaced is not None:
                values["enriched"], values["enriched_ref"] = replaced, ref

    def _replace(self, value: Any, ref: str) -> str | None:
        """``value`` with the text ``ref`` replaced by TEXT_REF, or None when it cannot be (or need not be).

        A value that already holds TEXT_REF is kept as it is: on reading, every TEXT_REF in a
        referencing value is expanded, so it must hold none of its own.
        """
        if not isinstance(value, str) or TEXT_REF in value:
            return None
        body = self._text(ref)
        return value.replace(body, TEXT_REF) if body in value else None

    def _remember(self, ref: str, body: str) -> None:
        # texts never change (a hash names each), so a few are kept: Store.job runs once per step
        with self._texts_lock:
            if len(self._texts) >= 8:
                self._texts.pop(next(iter(self._texts)))
            self._texts[ref] = body

    def _job_record(self, row: Any) -> JobRecord:
        """A ``jobs`` row (a mapping of column → value) as the job it stores: its texts put back."""
        job = dict(row)
        ref, enriched_ref = job.pop("instruction_ref", None), job.pop("enriched_ref", None)
        if ref is not None:
            job["instruction"] = self._text(ref)
        if enriched_ref is not None and job.get("enriched"):
            job["enriched"] = job["enriched"].replace(TEXT_REF, self._text(enriched_ref))
        return JobRecord.from_mapping(job)
