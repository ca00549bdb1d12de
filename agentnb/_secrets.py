"""Secrets: which environment variables hold one, and masking their values wherever text leaves a tool.

One name pattern for the whole project: the git excerpt's environment, the exported
notebook's masking and the redaction of tool results all use :data:`SECRET_NAME`, so a
name that one of them treats as a secret is a secret for all of them.

Redaction works on values, not names: a command can print a key however it got it
(``/proc/$PPID/environ`` with the sandbox off, a ``.env`` file, a URL with a password).
So every tool result is scrubbed of the values of the secret-named variables in the
process's environment, and of the password part of any ``scheme://user:password@``
value, before it is stored or shown to the model.
"""

from __future__ import annotations

import os
import re

__all__ = ["MASK", "MIN_SECRET_CHARS", "SECRET_NAME", "is_secret_name", "redact", "secret_values"]

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


def is_secret_name(name: str) -> bool:
    return SECRET_NAME.search(name) is not None


_cache: tuple[object, tuple[str, ...]] | None = None


def _environ_snapshot() -> object:
    # os.environ's own dict of bytes: comparing it is ~0.4 µs, rebuilding the values ~30 µs a call
    data = getattr(os.environ, "_data", None)
    return dict(data) if isinstance(data, dict) else dict(os.environ)


def secret_values() -> tuple[str, ...]:
    """The secret values in this process's environment, longest first (so a longer one masks whole)."""
    global _cache
    data = getattr(os.environ, "_data", None)
    cached = _cache
    if cached is not None and isinstance(data, dict) and data == cached[0]:
        return cached[1]
    found: set[str] = set()
    for name, value in os.environ.items():
        if is_secret_name(name) and len(value) >= MIN_SECRET_CHARS:
            found.add(value)
        m = _URL_PASSWORD.match(value)
        if m:
            found.add(value)  # the whole URL names the account too
            if len(m.group(1)) >= MIN_SECRET_CHARS:
                found.add(m.group(1))
    values = tuple(sorted(found, key=len, reverse=True))
    _cache = (_environ_snapshot(), values)
    return values


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
            text = text.replace(value, MASK)
    if cut_end:
        text = _mask_end(text, values)
    if cut_start:
        text = _mask_start(text, values)
    return text


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
