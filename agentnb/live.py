"""The in-process subscription to a job's life: each event as its transaction commits, and transient notices.

Both stores publish here right after a transaction that appended events commits, in commit order, and never for
a transaction that rolled back; the engine publishes notices that are not events (``call_started`` before it asks
the model; later, streamed text).  A subscriber names a store (its location: two Store objects on one SQLite file
or one database are one channel) and a job, or ``None`` for every job of that store::

    with agentnb.live.subscribe(ws.store, job.id, print):
        ws.run(job)

A subscriber is called in the thread that committed (a job's thread, a batch's worker thread), so it must be
quick and must not wait for another thread that writes to the store: note what arrived and let another thread
act on it (``notebook/liveview.py`` does so).  A subscriber that raises is logged once and never breaks the run.
Only jobs run in this process are published here; a job another process runs is seen through the store.

Without a subscriber every hook is one dictionary test, so a run nobody watches pays nothing measurable
(``benchmarks/overhead.py``).  A subscriber to some ``kinds`` of every job's events (live OpenTelemetry export
wants only transitions and statuses) gets no notices and makes the stores decode and publish only the
transactions holding such an event, so a run pays for it only at those commits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .events import Event

__all__ = ["Item", "Notice", "Subscription", "channel", "listening", "notice", "publish", "subscribe", "wants",
           "wants_rows"]

_log = logging.getLogger("agentnb.live")


@dataclass(frozen=True, slots=True)
class Notice:
    """Something a running job did that is not an event (nothing is stored for it): ``what`` is ``call_started``
    (the engine is about to ask the model for call ``iteration`` of movement run ``movement_seq``)."""

    job_id: int
    what: str
    movement_seq: int | None = None
    iteration: int | None = None
    ts: float = field(default_factory=time.time)
    detail: Mapping[str, Any] = field(default_factory=dict)


Item = Event | Notice
Subscriber = Callable[[Item], None]


class _Located(Protocol):
    @property
    def path(self) -> Path | str: ...


def channel(store: _Located) -> str:
    """The channel of ``store``: its file's absolute path (SQLite) or its URL without the password (PostgreSQL)."""
    where = store.path
    return os.path.abspath(where) if isinstance(where, Path) else str(where)


class Subscription:
    """One subscriber on one channel and job (None: every job); :meth:`close` (or leaving ``with``) ends it."""

    def __init__(self, key: tuple[str, int | None], fn: Subscriber, kinds: frozenset[str] | None = None,
                 origin: object | None = None) -> None:
        self.key = key
        self.fn = fn
        self.kinds = kinds  # None: every event and notice; else only events of these kinds
        self.origin = origin  # a kinds subscription's store object, when only its own commits are wanted
        self.failed = False  # logged once already

    def close(self) -> None:
        _unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def deliver(self, item: Item) -> None:
        try:
            self.fn(item)
        except Exception:
            if not self.failed:
                self.failed = True
                _log.exception("agentnb: a live subscriber (%r) raised; the run goes on, and its later errors "
                               "are not logged", self.fn)


# (channel, job id or None) → its subscriptions.  Replaced whole under _LOCK, never changed in place, so that
# publishers read it without a lock; empty when nobody listens (the publishers' one test).
_SUBSCRIBERS: dict[tuple[str, int | None], tuple[Subscription, ...]] = {}
# channel → the subscriptions to some kinds of every job's events there (the same discipline)
_PICKY: dict[str, tuple[Subscription, ...]] = {}
# every kind any of them wants, on any channel: a transaction with none of these is let go at one set test, before
# its store's channel (an absolute path) is worked out
_PICKY_KINDS: frozenset[str] = frozenset()
_LOCK = threading.Lock()


def subscribe(store: _Located, job_id: int | None, fn: Subscriber, *,
              kinds: Iterable[str] | None = None, own: bool = False) -> Subscription:
    """Call ``fn(item)`` for each event of job ``job_id`` (None: of every job) that ``store``'s channel commits from
    now on, and for each notice of it, until the subscription is closed.  With ``kinds`` (and ``job_id`` None):
    only the events of those kinds, and no notices; with ``own`` too, only those ``store`` itself commits, not
    another store object on its channel (two workspaces on one file, each exporting what it runs)."""
    global _SUBSCRIBERS
    if kinds is not None:
        if job_id is not None:
            raise ValueError("kinds= is for a subscription to every job (job_id None)")
        sub = Subscription((channel(store), None), fn, frozenset(kinds), store if own else None)
        with _LOCK:
            picky = dict(_PICKY)
            picky[sub.key[0]] = (*picky.get(sub.key[0], ()), sub)
            _set_picky(picky)
        return sub
    if own:
        raise ValueError("own= is for a subscription to some kinds of every job (kinds=)")
    sub = Subscription((channel(store), job_id), fn)
    with _LOCK:
        subs = dict(_SUBSCRIBERS)
        subs[sub.key] = (*subs.get(sub.key, ()), sub)
        _SUBSCRIBERS = subs
    return sub


def _set_picky(picky: dict[str, tuple[Subscription, ...]]) -> None:
    """Replace the kind subscriptions (under _LOCK), the union of their kinds first: a publisher that reads the new
    union with the old table only looks a little further."""
    global _PICKY, _PICKY_KINDS
    _PICKY_KINDS = frozenset(k for subs in picky.values() for sub in subs for k in sub.kinds or ())
    _PICKY = picky


def _unsubscribe(sub: Subscription) -> None:
    global _SUBSCRIBERS
    if sub.kinds is not None:
        with _LOCK:
            picky = dict(_PICKY)
            rest = tuple(s for s in picky.get(sub.key[0], ()) if s is not sub)
            if rest:
                picky[sub.key[0]] = rest
            else:
                picky.pop(sub.key[0], None)
            _set_picky(picky)
        return
    with _LOCK:
        subs = dict(_SUBSCRIBERS)
        rest = tuple(s for s in subs.get(sub.key, ()) if s is not sub)
        if rest:
            subs[sub.key] = rest
        else:
            subs.pop(sub.key, None)
        _SUBSCRIBERS = subs


def listening() -> bool:
    """Whether anyone listens at all (the publishers' first, cheapest test)."""
    return bool(_SUBSCRIBERS) or bool(_PICKY)


def wants(store: _Located, job_ids: Iterable[int]) -> bool:
    """Whether anyone listens to any of ``job_ids`` on ``store``'s channel (the stores collect events only then)."""
    subs = _SUBSCRIBERS
    if not subs:
        return False
    where = channel(store)
    return (where, None) in subs or any((where, j) in subs for j in job_ids)


def wants_rows(store: _Located, job_ids: Iterable[int], kinds: Iterable[str]) -> bool:
    """Whether anyone listens to events of ``job_ids`` (of these ``kinds``) on ``store``'s channel: a store asks it
    of a transaction's event rows."""
    if _PICKY:
        wanted = set(kinds)  # read once: ``kinds`` may be an iterator
        if not _PICKY_KINDS.isdisjoint(wanted) and any(
                sub.kinds is not None and not sub.kinds.isdisjoint(wanted) for sub in _PICKY.get(channel(store), ())):
            return True
    return wants(store, job_ids)


def publish(store: _Located, items: Iterable[Item]) -> None:
    """Hand ``items`` (committed events in commit order, or notices) to their subscribers, one by one."""
    subs, picky_all = _SUBSCRIBERS, _PICKY
    if not subs and not picky_all:
        return
    where = channel(store)
    every = subs.get((where, None), ())
    picky = picky_all.get(where, ()) if picky_all else ()
    for item in items:
        for sub in (*subs.get((where, item.job_id), ()), *every):
            sub.deliver(item)
        if picky and not isinstance(item, Notice):
            for sub in picky:
                if sub.kinds is not None and item.kind in sub.kinds and (sub.origin is None or sub.origin is store):
                    sub.deliver(item)


def notice(store: _Located, job_id: int, what: str, *, movement_seq: int | None = None,
           iteration: int | None = None, **detail: Any) -> None:
    """Publish a :class:`Notice` of job ``job_id``, when anyone listens to it (else nothing is built)."""
    if _SUBSCRIBERS and wants(store, (job_id,)):
        publish(store, (Notice(job_id, what, movement_seq, iteration, time.time(), detail),))
