"""What a tool knows about the job it runs in (:class:`ToolContext`) and what it returns (:class:`ToolOutput`).

The context carries the tool output's token budget; :func:`fit_prefix` measures text against it
with the job's tokenizer.  The cutting itself is :mod:`agentnb.tools.truncate`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .paths import resolve_path

__all__ = ["IMAGE_TYPES", "MAX_IMAGE_BYTES", "Counter", "ToolContext", "ToolOutput", "fit_prefix"]

# the images a tool can attach for the model (ReadImage's files, an MCP server's image content): suffix → MIME type
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif", ".webp": "image/webp"}
MAX_IMAGE_BYTES = 5 * 1024 * 1024

Counter = Callable[[str], int]


@dataclass
class ToolContext:
    """What a tool may know about the job it runs in."""

    workdir: Path
    logs_dir: Path
    budget_tokens: int = 60_000
    chars_per_token: float = 4.0
    job_id: int = 0
    movement: str = ""
    count_tokens: Callable[[str], int] | None = None
    # seconds Grep may spend matching in one call; None: $AGENTNB_GREP_TIMEOUT, else 5
    grep_timeout: float | None = None

    @property
    def budget_chars(self) -> int:
        return max(1, int(self.budget_tokens * self.chars_per_token))

    def fit(self, text: str) -> int:
        """How many leading characters of ``text`` fit in the token budget (measured, not guessed)."""
        if self.count_tokens is None:
            return min(len(text), self.budget_chars)
        return fit_prefix(self.count_tokens, text, self.budget_tokens)

    def path(self, rel: str) -> Path:
        return resolve_path(self.workdir, rel)

    def rel(self, path: Path) -> str:
        return os.path.relpath(path, os.path.realpath(self.workdir))


@dataclass
class ToolOutput:
    """A tool's result, with the bookkeeping recorded in the ``tool_result`` event."""

    content: str
    is_error: bool = False
    truncated: bool = False
    original_chars: int | None = None
    returned_chars: int | None = None
    continuation: dict[str, Any] | None = None
    image: str | None = None  # a data: URL, sent to the model as an image part

    def __post_init__(self) -> None:
        if self.original_chars is None:
            self.original_chars = len(self.content)
        if self.returned_chars is None:
            self.returned_chars = len(self.content)


def fit_prefix(count: Counter, text: str, tokens: int) -> int:
    """The length of the longest prefix of ``text`` found to fit in ``tokens`` (always verified).

    Proportional steps first (a tokenizer is close to linear), then bisection, so
    the answer is never an unchecked guess.
    """
    if tokens <= 0 or not text:
        return 0
    if len(text) * 4 <= tokens or count(text) <= tokens:  # a token is at least one UTF-8 byte
        return len(text)
    good, bad = 0, len(text)  # count(text[:good]) fits, count(text[:bad]) does not
    n = len(text)
    for _ in range(4):
        n = max(good + 1, min(bad - 1, int(n * tokens / max(1, count(text[:n])) * 0.98)))
        if n <= good or n >= bad:
            break
        if count(text[:n]) <= tokens:
            good = n
            break
        bad = n
    while bad - good > max(1, good // 200):  # within 0.5 %: close enough, and verified
        mid = (good + bad) // 2
        if count(text[:mid]) <= tokens:
            good = mid
        else:
            bad = mid
    return good
