"""Secrets: which environment variables hold one, and masking their values wherever text leaves a tool.

One name pattern for the whole project: the git excerpt's environment, the exported
notebook's masking and the redaction of tool results all use :data:`SECRET_NAME`, so a
name that one of them treats as a secret is a secret for all of them.

Redaction works on values, not names: a command can print a key however it got it
(``/proc/$PPID/environ`` with the sandbox off, a ``.env`` file, a URL with a password).
So every tool result is scrubbed of the values of the secret-named variables in the
process's environment, and of the password part of any ``scheme://user:password@``
value, before it is stored or shown to the model.

The same values, with the keys registered in code (:func:`register_secret`: an ``openai:`` model
adds the key it calls with, however it was given), are masked by :func:`scrub` in every text the
store keeps (store/_rows.py) and in an exported notebook; :func:`scrub` also masks what has the
shape of a key whatever its origin (:data:`KEY_SHAPED`: ``sk-…`` keys, ``Bearer`` tokens), since an
endpoint's error may repeat a key this process never saw (``Incorrect API key provided: sk-…``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from typing import Any
from urllib.parse import unquote

__all__ = ["KEY_SHAPED", "MASK", "MIN_SECRET_CHARS", "SECRET_NAME", "is_secret_name", "mask_key_shaped",
           "mask_streamed", "might_hold_secret", "redact", "register_secret", "register_url_password", "scrub",
           "scrub_data", "secret_values", "settled", "shown_so_far", "streamed_values"]

# Substrings that name a secret wherever they appear (GITHUB_TOKEN, AWS_SECRET_ACCESS_KEY, X_CREDENTIALS),
# and short words that name one only as a whole `_`-separated word: MYSQL_PWD but not PWD/OLDPWD (the
# current directory), SMTP_PASS but not PASSENGER, NPM_CONFIG__AUTH but not GIT_AUTHOR_NAME,
# GITHUB_PAT but not PATH, SENTRY_DSN.
SECRET_NAME = re.compile(
    r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIAL"
    r"|(?:^|_)(?:PASS|AUTH|DSN|PAT)(?:_|$)|_PWD(?:_|$)",
    re.IGNORECASE,
)
MASK = "***"
# Shorter values would mask ordinary words ("admin", "secret1") all over the output.
MIN_SECRET_CHARS = 8
# the password of a URL such as postgresql://app:s3cr3t-pw@db/prod (DATABASE_URL, HTTPS_PROXY, …)
_URL_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://[^/@:\s]*:([^/@\s]+)@")
# A cut (Read's pieces, a truncated output) can split a value; an end piece this long is masked too.
_MIN_PART = 6

# Text shaped like a key, masked wherever it comes from: an OpenAI-style key (sk-…, sk-proj-…, sk-ant-…; 20+ key
# characters with a digit, not inside a longer word: "task-list", "risk-2024-…" stay; after a written escape, as
# a pattern's "\nsk-…", too) and the token after "Bearer " (16+ token characters with a digit: "bearer of bad
# news" stays).  The key characters hold no quote or backslash, so a match never reaches past the JSON string it
# is in.
KEY_SHAPED = re.compile(
    r"(?:(?<![A-Za-z0-9_])|(?<=\\[nrtbf]))sk-(?=[A-Za-z0-9_\-]*[0-9])[A-Za-z0-9_\-]{20,}"
    r"|(?<=[Bb]earer )(?=[A-Za-z0-9._~+/\-]*[0-9])[A-Za-z0-9._~+/\-]{16,}=*"
)
# What every KEY_SHAPED match contains: a text without either cannot match, and `in` is far cheaper than a search.
_KEY_TRIGGERS = ("sk-", "earer ")
# KEY_SHAPED without its word boundary, for a JSON text: there a key may follow an escape ("\nsk-…")
_KEY_SHAPED_LOOSE = re.compile(
    r"sk-(?=[A-Za-z0-9_\-]*[0-9])[A-Za-z0-9_\-]{20,}|[Bb]earer (?=[A-Za-z0-9._~+/\-]*[0-9])[A-Za-z0-9._~+/\-]{16,}"
)

# Secrets given in code rather than the environment (an API key passed to a model): kept for the process.
_registered: frozenset[str] = frozenset()
_registered_lock = threading.Lock()


def is_secret_name(name: str) -> bool:
    return SECRET_NAME.search(name) is not None


def register_secret(value: str | None) -> None:
    """Mask ``value`` wherever :func:`scrub`/:func:`redact` mask the environment's secrets, for the rest of the
    process: a key given in code never reaches the store, an export or a tool result either."""
    global _registered, _cache
    if not isinstance(value, str) or len(value) < MIN_SECRET_CHARS or value in _registered:
        return
    with _registered_lock:
        _registered = _registered | {value}
        _cache = None


def register_url_password(url: str) -> None:
    """Mask a URL that carries a password (a PostgreSQL store's, given in code or on the command line) as the
    environment's are: the whole URL, and its password alone."""
    m = _URL_PASSWORD.match(url)
    if m:
        register_secret(url)
        register_secret(m.group(1))
        register_secret(unquote(m.group(1)))


_cache: tuple[object, frozenset[str], tuple[str, ...], tuple[str, ...]] | None = None


def _environ_snapshot() -> object:
    # os.environ's own dict of bytes: comparing it is ~0.4 µs, rebuilding the values ~30 µs a call
    data = getattr(os.environ, "_data", None)
    return dict(data) if isinstance(data, dict) else dict(os.environ)


def secret_values() -> tuple[str, ...]:
    """The secret values in this process's environment and those registered in code (:func:`register_secret`),
    longest first (so a longer one masks whole)."""
    return _values()[0]


def _values() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The secret values (:func:`secret_values`) and those of them that JSON writes otherwise, as it writes them."""
    global _cache
    data = getattr(os.environ, "_data", None)
    cached, registered = _cache, _registered
    if cached is not None and isinstance(data, dict) and cached[1] is registered and data == cached[0]:
        return cached[2], cached[3]
    found: set[str] = set(registered)
    for name, value in os.environ.items():
        if is_secret_name(name) and len(value) >= MIN_SECRET_CHARS:
            found.add(value)
        m = _URL_PASSWORD.match(value)
        if m:
            found.add(value)  # the whole URL names the account too
            if len(m.group(1)) >= MIN_SECRET_CHARS:
                found.add(m.group(1))
    values = tuple(sorted(found, key=len, reverse=True))
    escaped = tuple(e for v in values if (e := json.dumps(v, ensure_ascii=False)[1:-1]) != v)
    _cache = (_environ_snapshot(), registered, values, escaped)
    return values, escaped


def scrub(text: str) -> str:
    """``text`` with every secret value (:func:`secret_values`, registered keys included) and everything
    :data:`KEY_SHAPED` replaced by ``***``; ``text`` itself (no copy) when it holds none."""
    if not text:
        return text
    values = _values()[0]
    if values:
        text = redact(text, values)
    return mask_key_shaped(text)


def mask_key_shaped(text: str) -> str:
    """``text`` with everything :data:`KEY_SHAPED` replaced by ``***`` (the secret values are :func:`redact`'s);
    ``text`` itself when it holds none."""
    if _KEY_TRIGGERS[0] in text or _KEY_TRIGGERS[1] in text:
        masked, n = KEY_SHAPED.subn(MASK, text)
        if n:
            return masked
    return text


def might_hold_secret(json_text: str) -> bool:
    """Whether the JSON text ``json_text`` may hold something :func:`scrub` masks in the data it encodes (never
    False when it does; rarely True when it does not): the cheap check before :func:`scrub_data` walks it."""
    values, escaped = _values()
    for value in values:
        if value in json_text:
            return True
    for value in escaped:
        if value in json_text:
            return True
    return ((_KEY_TRIGGERS[0] in json_text or _KEY_TRIGGERS[1] in json_text)
            and _KEY_SHAPED_LOOSE.search(json_text) is not None)


def scrub_data(data: Any) -> Any:
    """JSON-like ``data`` (dicts, lists, tuples, strings, …) with :func:`scrub` applied to every string in it,
    keys included; ``data`` itself when nothing changed, else a copy (dicts and lists rebuilt; a tuple as a list)."""
    if isinstance(data, str):
        return scrub(data)
    if isinstance(data, dict):
        out = {scrub(k) if isinstance(k, str) else k: scrub_data(v) for k, v in data.items()}
        return data if _same_dict(data, out) else out
    if isinstance(data, (list, tuple)):
        items = [scrub_data(v) for v in data]
        return data if all(a is b for a, b in zip(data, items, strict=True)) else items
    return data


def _same_dict(a: dict[Any, Any], b: dict[Any, Any]) -> bool:
    # two keys masked alike make one: then the lengths differ
    return len(a) == len(b) and all(ka is kb and va is vb for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True))


def redact(text: str, values: tuple[str, ...] | None = None, *, cut_start: bool = False,
           cut_end: bool = False) -> str:
    """``text`` with every secret value (``values``, by default :func:`secret_values`) replaced by ``***``.

    ``cut_end`` / ``cut_start``: the text is a piece of something longer that was cut there, so a
    secret's first (last) characters at that end are masked as well.
    """
    if values is None:
        values = secret_values()
    if not values or not text:
        return text
    for value in values:
        if value in text:
            text = _as_word(value).sub(MASK, text) if value.isalpha() else text.replace(value, MASK)
    if cut_end:
        text = _mask_end(text, values)
    if cut_start:
        text = _mask_start(text, values)
    return text


@functools.lru_cache(maxsize=64)
def _as_word(value: str) -> re.Pattern[str]:
    """A secret of letters alone (a weak password: ``postgres``, ``changeme``) where it stands as a word: masked
    inside a longer word it would garble every ``postgresql`` of the process's texts, and it is no longer itself
    there; any other secret is masked wherever it appears."""
    return re.compile(rf"(?<!\w){re.escape(value)}(?!\w)")


def _mask_end(text: str, values: tuple[str, ...]) -> str:
    """Mask a tail of ``text`` that is the start of a secret (the rest of it was cut off)."""
    for value in values:
        tail = text[-(len(value) - 1):]
        at = tail.find(value[:_MIN_PART])
        while at >= 0:
            if value.startswith(tail[at:]):
                return text[: len(text) - len(tail) + at] + MASK
            at = tail.find(value[:_MIN_PART], at + 1)
    return text


def _mask_start(text: str, values: tuple[str, ...]) -> str:
    """Mask a head of ``text`` that is the end of a secret (its start was in the piece before)."""
    for value in values:
        head = text[: len(value) - 1]
        end = value[-_MIN_PART:]
        at = head.rfind(end)
        while at >= 0:
            if value.endswith(head[: at + len(end)]):
                return MASK + text[at + len(end):]
            at = head.rfind(end, 0, at + len(end) - 1)
    return text


# -- streamed text (docs/models.md#streaming): shown as it arrives, never stored, so masked where it is shown -------
#
# A streamed answer is shown before it is whole: the end of it that could still grow into something masked is held
# back until a later fragment settles it (or the call is recorded, and the store's masked text is shown).

# where a key-shaped text (KEY_SHAPED) may still be forming at the end of a text: "sk-" or its beginning at a word
# boundary or right after a JSON escape ("\nsk-…" in a tool call's argument text), and the token after "Bearer "
_KEY_BEGINNING = re.compile(r"(?:(?<![A-Za-z0-9_])|(?<=\\[nrtbf])|(?<=\\u[0-9a-fA-F]{4}))(?:sk?|sk-[A-Za-z0-9_\-]*)\Z")
_BEARER_TOKEN = re.compile(r"(?<=[Bb]earer )[A-Za-z0-9._~+/\-]*=*\Z")
# the characters a key or a token is made of (and JSON's backslash): a key still forming is in the trailing run
_KEY_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._~+/=\\-"
# a key right after a JSON text's \uXXXX escape, which KEY_SHAPED's word boundary skips (it takes the one-letter
# escapes, "\nsk-…", and a Bearer token whatever comes before "Bearer ")
_ESCAPED_KEY = re.compile(r"(?<=\\u[0-9a-fA-F]{4})sk-(?=[A-Za-z0-9_\-]*[0-9])[A-Za-z0-9_\-]{20,}")


def streamed_values(json_text: bool) -> tuple[str, ...]:
    """The secret values (:func:`secret_values`), and for a JSON text (a tool call's arguments) also each as JSON
    writes it inside a string."""
    values, escaped = _values()
    return values + escaped if json_text else values


def mask_streamed(text: str, values: tuple[str, ...], json_text: bool) -> str:
    """``text`` masked as the store masks what it keeps (:func:`scrub`), ``values`` from :func:`streamed_values`."""
    text = mask_key_shaped(redact(text, values))
    if json_text and "\\" in text:
        text = _ESCAPED_KEY.sub(MASK, text)
    return text


def settled(text: str, values: tuple[str, ...]) -> int:
    """How much of streamed ``text`` may be masked and shown now: up to where a key-shaped text may still be
    forming at its end, and before any end of it that begins a secret value (the rest may still become one)."""
    cut = len(text)
    while True:
        start = cut
        run = len(text[:cut].rstrip(_KEY_CHARS))  # (however long: a key is looked for in the run, not before)
        for pattern in (_BEARER_TOKEN, _KEY_BEGINNING):
            m = pattern.search(text, run, cut)
            if m is not None:
                start = min(start, m.start())
        for value in values:
            # the longest end of text[:start] that is the beginning of ``value`` (of a word's, the whole of it too:
            # the next letter, not come yet, decides whether it is masked)
            lo = max(0, start - len(value) + (0 if value.isalpha() else 1))
            at = text.find(value[0], lo, start)
            while at >= 0:
                if value.startswith(text[at:start]):
                    start = at
                    break
                at = text.find(value[0], at + 1, start)
        if start == cut:
            return cut
        cut = start


def shown_so_far(text: str, *, json_text: bool) -> str:
    """What of a streamed ``text`` may be shown now, masked (a tool call's arguments: ``json_text``)."""
    values = streamed_values(json_text)
    return mask_streamed(text[:settled(text, values)], values, json_text)
