"""Cutting tool output to a token budget, and reading files in budgeted pieces.

Every cut result is the head of the output plus a note saying that it was cut
automatically, how much was returned of how much, and how to get the rest.  The
note is part of the budget: ``count(result) <= budget_tokens`` holds for every
cut result (measured with the job's tokenizer, not guessed from characters).

Files are streamed, never loaded whole: a 1 GB file is readable piece by piece
through the ``offset`` / ``byte_offset`` named in the note.  The pieces put together
are exactly the file's text; bytes that are not UTF-8 read as U+FFFD, and then the
pieces equal the whole file decoded with ``errors="replace"`` (a cut never falls
where it would change that decoding).  Character counts in notes treat such bytes
approximately.  A small per-process
index (line and character counts at a few byte positions, keyed by the file's
identity, size and mtime) makes each following piece cost O(piece), not
O(position in the file).
"""

from __future__ import annotations

import bisect
import io
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..errors import ToolError
from .context import Counter, ToolContext, ToolOutput, fit_prefix
from .paths import open_regular

__all__ = ["HINTS", "NOTE_PREFIX", "cut_text", "fit_prefix", "read_file", "read_text_stream"]

NOTE_PREFIX = "\n\n[agentnb: output truncated automatically"
_CHUNK = 1 << 20
_MARK_EVERY = 4 << 20  # the index keeps a position every 4 MB (and at every piece's end)
_MAX_MARKS = 4096
# Files whose lines average more than this many bytes are read by bytes, not lines.
_LONG_LINES = 2000
_CONTINUATION_BYTES = bytes(range(0x80, 0xC0))

HINTS = {
    "bash": "Narrow the output: pipe it through head, tail, grep, awk or sed "
    "(for example `… | head -n 100`, `… | tail -n 50`, `… | grep PATTERN`, `… | awk '{print $1}'` "
    "or `… | sed -n '200,400p'`).",
    "grep": "Narrow the search with a more specific pattern or a smaller path, then Read the lines you need "
    "with offset and limit.",
    "glob": "Narrow the pattern (for example a subdirectory or an extension).",
    "generic": "Ask for a smaller part of the result.",
}



# ---------------------------------------------------------------------------
# Measuring against the budget


def _counter(ctx: ToolContext) -> Counter:
    if ctx.count_tokens is not None:
        return ctx.count_tokens
    cpt = ctx.chars_per_token or 4.0
    return lambda text: int(len(text) / cpt + 0.999)


def _fits(ctx: ToolContext, text: str) -> bool:
    return len(text) * 4 <= ctx.budget_tokens or _counter(ctx)(text) <= ctx.budget_tokens


# ---------------------------------------------------------------------------
# Text already in memory (Bash, Grep, Glob, user tools)


def cut_text(
    text: str,
    budget: ToolContext | int,
    *,
    hint: str = "generic",
    extra: str = "",
    more_chars: int = 0,
    more_lines: int = 0,
    ends_with_newline: bool | None = None,
) -> ToolOutput:
    """Return ``text`` whole, or its head (cut at a line boundary when one is near) with a note.

    ``budget`` is the tool's context (a token budget measured with the job's
    tokenizer) or a number of characters.  ``extra`` is appended to the note.
    ``more_chars`` / ``more_lines``: how much followed ``text`` that was never kept
    (a bounded capture), so the note and ``original_chars`` tell the real size;
    ``ends_with_newline`` then says how the whole text ended.
    """
    if isinstance(budget, int):
        count: Counter = len
        limit = budget
    else:
        count = _counter(budget)
        limit = budget.budget_tokens
    if not more_chars and (len(text) * 4 <= limit or (len(text) <= limit * 16 and count(text) <= limit)):
        return ToolOutput(text)
    total_chars = len(text) + more_chars
    ends = text.endswith("\n") if ends_with_newline is None else ends_with_newline
    total_lines = text.count("\n") + more_lines + (0 if ends else 1)
    hint_text = HINTS.get(hint, HINTS["generic"])
    # search a window big enough for any plausible characters-per-token ratio
    window = text[: limit * 16]
    reserve = count(_cut_note(total_chars, total_chars, total_lines, total_lines, hint_text, extra)) + 8
    for _ in range(8):
        n = max(1, fit_prefix(count, window, max(1, limit - reserve)))
        head = window[:n]
        nl = head.rfind("\n")
        if nl + 1 >= n // 2 and nl >= 0:
            head = head[: nl + 1]
        note = _cut_note(len(head), total_chars, head.count("\n"), total_lines, hint_text, extra)
        if count(head + note) <= limit or n == 1:
            break
        reserve += max(8, count(head + note) - limit)
    return ToolOutput(head + note, truncated=True, original_chars=total_chars, returned_chars=len(head))


def _cut_note(returned: int, total: int, lines: int, total_lines: int, hint: str, extra: str) -> str:
    tail = f" {extra}" if extra else ""
    return (
        f"{NOTE_PREFIX}: returned the first {returned:,} of {total:,} characters "
        f"({lines:,} of {total_lines:,} lines). {hint}{tail}]"
    )


# ---------------------------------------------------------------------------
# The per-file index


def _chars_in(data: bytes) -> int:
    """Characters in UTF-8 ``data``: every byte that is not a continuation byte (10xxxxxx) starts one."""
    return len(data.translate(None, _CONTINUATION_BYTES))


@dataclass
class _Index:
    """Line and character counts of one file, and a few positions to resume scanning from."""

    size: int
    lines: int  # a last line without a newline counts
    chars: int
    marks: list[tuple[int, int, int]] = field(default_factory=list)  # (byte, newlines before, chars before)

    def add_mark(self, pos: int, newlines: int, chars: int) -> None:
        i = bisect.bisect_left(self.marks, (pos, -1, -1))
        if i < len(self.marks) and self.marks[i][0] == pos:
            return
        if len(self.marks) < _MAX_MARKS:
            self.marks.insert(i, (pos, newlines, chars))


_indexes: OrderedDict[tuple[Any, ...], _Index] = OrderedDict()
_index_lock = threading.Lock()


def _build_index(f: IO[bytes], size: int) -> _Index:
    f.seek(0)
    marks = [(0, 0, 0)]
    pos = newlines = chars = 0
    next_mark = _MARK_EVERY
    last = b""
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            break
        pos += len(chunk)
        newlines += chunk.count(b"\n")
        chars += _chars_in(chunk)
        last = chunk[-1:]
        if pos >= next_mark:
            marks.append((pos, newlines, chars))
            next_mark = pos + _MARK_EVERY
    lines = newlines + (1 if size and last != b"\n" else 0)
    return _Index(size=size, lines=lines, chars=chars, marks=marks)


def _index(key: tuple[Any, ...], f: IO[bytes], size: int) -> _Index:
    with _index_lock:
        idx = _indexes.get(key)
        if idx is not None:
            _indexes.move_to_end(key)
            return idx
    idx = _build_index(f, size)
    with _index_lock:
        _indexes[key] = idx
        while len(_indexes) > 32:
            _indexes.popitem(last=False)
    return idx


def _position(f: IO[bytes], idx: _Index, pos: int) -> tuple[int, int]:
    """(newlines before ``pos``, characters before ``pos``), scanning from the nearest mark."""
    i = bisect.bisect_right(idx.marks, (pos, float("inf"), float("inf"))) - 1
    at, newlines, chars = idx.marks[i]
    f.seek(at)
    while at < pos:
        chunk = f.read(min(_CHUNK, pos - at))
        if not chunk:
            break
        at += len(chunk)
        newlines += chunk.count(b"\n")
        chars += _chars_in(chunk)
    return newlines, chars


def _line_start(f: IO[bytes], idx: _Index, line: int) -> tuple[int, int]:
    """(byte position, characters before it) of the start of ``line`` (1-based; must exist)."""
    want = line - 1  # newlines before the line
    keys = [m[1] for m in idx.marks]
    i = max(0, bisect.bisect_left(keys, want) - 1)  # the last mark before the line for sure
    at, newlines, chars = idx.marks[i]
    j = i + 1
    if j < len(keys) and keys[j] == want:
        # a mark with as many newlines may lie inside the line; it is the line's start if a newline precedes it
        f.seek(idx.marks[j][0] - 1)
        if f.read(1) == b"\n":
            at, newlines, chars = idx.marks[j]
    f.seek(at)
    while newlines < want:
        chunk = f.read(_CHUNK)
        if not chunk:
            break
        n = chunk.count(b"\n")
        if newlines + n < want:
            newlines += n
            chars += _chars_in(chunk)
            at += len(chunk)
            continue
        cut = -1
        for _ in range(want - newlines):
            cut = chunk.index(b"\n", cut + 1)
        chars += _chars_in(chunk[: cut + 1])
        at += cut + 1
        newlines = want
    return at, chars


# ---------------------------------------------------------------------------
# Reading


def _seq_len(lead: int) -> int:
    """Bytes of the UTF-8 sequence ``lead`` starts (1 for ASCII, stray continuation bytes and invalid leads)."""
    if lead < 0xC2:
        return 1
    return 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4 if lead < 0xF5 else 1


def _utf8_cut(data: bytes, n: int) -> int:
    """A cut point ≤ ``n`` in ``data`` that does not split a UTF-8 character (at least one character).

    The cut is always where decoding can restart: before a byte that is not a continuation byte, or
    at a stray continuation byte that no lead byte claims.  So the pieces, each decoded with
    ``errors="replace"``, put together are exactly the whole data decoded so, invalid bytes included.
    """
    if n >= len(data):
        return len(data)
    cut = n
    # back over at most 3 continuation bytes (10xxxxxx) to a lead byte; cut before it if it claims byte n
    for i in range(n, max(-1, n - 4), -1):
        if (data[i] & 0xC0) != 0x80:
            if i + _seq_len(data[i]) > n:
                cut = i
            break
    if cut > 0:
        return cut
    # the budget is smaller than the first character: return that character whole
    j = 1
    while j < min(len(data), _seq_len(data[0])) and (data[j] & 0xC0) == 0x80:
        j += 1
    return j


@dataclass
class _Piece:
    data: bytes
    lines: int  # whole lines taken
    partial: bool  # the piece ends inside a line that is longer than the budget


def _take_lines(f: IO[bytes], start: int, max_bytes: int, limit: int | None) -> _Piece:
    f.seek(start)
    parts: list[bytes] = []
    used = 0
    while limit is None or len(parts) < limit:
        line = f.readline(max_bytes - used + 1)
        if not line:
            break
        if used + len(line) > max_bytes:
            if not parts:
                keep = line
                if len(keep) <= max_bytes + 4:  # make sure the whole character at the cut can be seen
                    keep = keep + f.read(4)
                return _Piece(keep[: _utf8_cut(keep, max_bytes)], 0, True)
            break
        parts.append(line)
        used += len(line)
    return _Piece(b"".join(parts), len(parts), False)


def _take_bytes(f: IO[bytes], start: int, max_bytes: int) -> _Piece:
    f.seek(start)
    data = f.read(max_bytes + 4)  # up to 3 more bytes, to see the whole character at the cut
    if len(data) <= max_bytes:  # the end of the stream is within the budget
        return _Piece(data, data.count(b"\n"), False)
    data = data[: _utf8_cut(data, max_bytes)]
    nl = data.rfind(b"\n")
    if nl >= 0 and nl + 1 >= len(data) // 2:  # a newline near the end: a cleaner place to stop
        data = data[: nl + 1]
    return _Piece(data, data.count(b"\n"), True)


def _read_note(rel: str, kind: str, *, first_line: int, last_line: int, lines: int, start: int, end: int,
               size: int, returned: int, original: int, cont: dict[str, Any]) -> str:
    what = "the document's text" if kind == "document" else rel
    how = " and ".join(f"{k}={v}" for k, v in cont.items() if k != "path")
    if "offset" in cont:
        got = f"lines {first_line:,}–{last_line:,} of the {lines:,} lines"
    else:
        got = f"bytes {start:,}–{end - 1:,} of the {size:,} bytes"
    return (
        f"{NOTE_PREFIX}: returned {got} of {what} ({returned:,} of {original:,} characters requested). "
        f"To read on, call Read with path={rel!r} and {how}; or use Grep to find the part you need.]"
    )


def read_text_stream(
    f: IO[bytes],
    key: tuple[Any, ...],
    size: int,
    rel: str,
    ctx: ToolContext | int,
    *,
    offset: int | None = None,
    limit: int | None = None,
    byte_offset: int | None = None,
    kind: str = "file",
) -> ToolOutput:
    """Read a budgeted piece of a UTF-8 stream; the note (and ``continuation``) says how to read on.

    Line-oriented text is cut at a line boundary; text with few newlines (or a
    read from ``byte_offset``) at a byte boundary that never splits a character.
    """
    _check_read_args(offset, limit, byte_offset)
    read = _locate(f, _index(key, f, size), size, rel, kind, offset=offset, limit=limit, byte_offset=byte_offset)
    measure: Counter
    if isinstance(ctx, int):
        budget_chars, measure, tokens = ctx, len, ctx
    else:
        budget_chars, measure, tokens = ctx.budget_chars, _counter(ctx), ctx.budget_tokens
    search = _Search(tokens, measure, rest=read.end - read.start)
    max_bytes = max(1, budget_chars)
    for _ in range(16):
        piece = (_take_lines(f, read.start, max_bytes, limit) if read.by_lines
                 else _take_bytes(f, read.start, max_bytes))
        out, note = read.output(piece)
        used = measure(out.content)
        step = search.fits(out, note, len(piece.data), used) if used <= tokens else search.too_big(out, piece, used)
        if isinstance(step, ToolOutput):
            return step
        max_bytes = step
    return out


def _check_read_args(offset: int | None, limit: int | None, byte_offset: int | None) -> None:
    for name, value in (("offset", offset), ("limit", limit), ("byte_offset", byte_offset)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ToolError(f"{name}={value!r}; allowed: a whole number")
    if offset is not None and byte_offset is not None:
        raise ToolError("give either offset (a line number) or byte_offset (a byte position), not both")
    if offset is not None and offset < 1:
        raise ToolError(f"offset={offset}: lines are numbered from 1")
    if limit is not None and limit < 1:
        raise ToolError(f"limit={limit}: give at least 1 line")


@dataclass(frozen=True)
class _Read:
    """One Read request located in a stream: where it starts, where the requested range ends, and how to cut."""

    idx: _Index
    rel: str
    kind: str
    size: int
    limit: int | None
    start: int  # byte position of the first byte returned
    newlines_before: int
    chars_before: int
    by_lines: bool  # cut at line ends (else at a byte, never inside a character)
    end: int  # byte position where the requested range ends: the stream's end, or after `limit` lines
    end_chars: int

    def output(self, piece: _Piece) -> tuple[ToolOutput, str]:
        """The tool output for ``piece`` read from :attr:`start`, and its note (empty when nothing was cut)."""
        end = self.start + len(piece.data)
        text = piece.data.decode("utf-8", errors="replace")
        if end >= self.end:
            return ToolOutput(text), ""
        first_line = self.newlines_before + 1
        cont: dict[str, Any] = ({"path": self.rel, "offset": first_line + piece.lines}
                                if self.by_lines and not piece.partial else {"path": self.rel, "byte_offset": end})
        if self.limit is not None:
            cont["limit"] = self.limit - piece.lines
        original = self.end_chars - self.chars_before
        note = _read_note(self.rel, self.kind, first_line=first_line, last_line=first_line + piece.lines - 1,
                          lines=self.idx.lines, start=self.start, end=end, size=self.size, returned=len(text),
                          original=original, cont=cont)
        with _index_lock:  # remember where the next piece starts
            self.idx.add_mark(end, self.newlines_before + piece.data.count(b"\n"),
                              self.chars_before + _chars_in(piece.data))
        out = ToolOutput(text + note, truncated=True, original_chars=original, returned_chars=len(text),
                         continuation=cont)
        return out, note


def _locate(f: IO[bytes], idx: _Index, size: int, rel: str, kind: str, *, offset: int | None,
            limit: int | None, byte_offset: int | None) -> _Read:
    """Where a read from ``byte_offset`` (or line ``offset``, by default the first) starts and ends."""
    if byte_offset is not None:
        if byte_offset < 0 or (byte_offset >= size and not (size == 0 and byte_offset == 0)):
            raise ToolError(f"byte_offset={byte_offset} is outside {rel!r}, which has {size:,} bytes "
                            f"(allowed: 0–{max(0, size - 1):,})")
        start = byte_offset
        newlines_before, chars_before = _position(f, idx, start)
        by_lines = limit is not None
    else:
        line = offset or 1
        if line > max(1, idx.lines):
            raise ToolError(f"offset={line} is past the end of {rel!r}, which has {idx.lines:,} lines")
        start, chars_before = _line_start(f, idx, line)
        newlines_before = line - 1
        # a file of very long lines (minified, one-line JSON) is read by bytes unless lines were asked for
        by_lines = not (offset is None and limit is None and size / max(1, idx.lines) > _LONG_LINES)
    if limit is not None and newlines_before + limit < idx.lines:
        end, end_chars = _line_start(f, idx, newlines_before + limit + 1)
    else:
        end, end_chars = size, idx.chars
    return _Read(idx, rel, kind, size, limit, start, newlines_before, chars_before, by_lines, end, end_chars)


@dataclass
class _Search:
    """The search for the largest piece that fits in ``tokens``: the byte budget is only a guess from
    characters per token, so each piece read is measured and the next byte budget set from it.

    Each step returns the result, or the byte budget to read the next piece with.
    """

    tokens: int
    measure: Counter
    rest: int  # bytes from the start to the end of the requested range
    fitting: ToolOutput | None = None  # a cut result that fits, kept while trying a larger one
    fitting_rate: tuple[int, int] = (1, 1)  # (bytes, tokens) of that result
    fitting_chars: int = -1
    tried_whole: bool = False
    scaled: bool = False

    def fits(self, out: ToolOutput, note: str, data_bytes: int, used: int) -> ToolOutput | int:
        """A piece that fits in the tokens: the result, or a larger byte budget to try."""
        if not out.truncated or self.scaled:
            return out
        returned = len(out.content) - len(note)
        if returned > self.fitting_chars:
            self.fitting, self.fitting_rate, self.fitting_chars = out, (data_bytes, used), returned
        # When the rest of the requested range would take about the budget at this piece's rate (its text,
        # without the note), try it whole: a range that fits in the tokens is returned whole, never cut
        # because of the guess or the note.
        text_tokens = max(1, used - self.measure(note))
        if not self.tried_whole and self.rest * text_tokens <= data_bytes * self.tokens * 1.05:
            self.tried_whole = True
            return self.rest
        if used >= self.tokens * 0.85:
            return out
        # the first guess of bytes per token was low (plain English runs ~4): try once to fill the budget
        self.scaled = True
        return int(data_bytes * self.tokens / used * 0.95)

    def too_big(self, out: ToolOutput, piece: _Piece, used: int) -> ToolOutput | int:
        """A piece over the tokens: an earlier piece that fitted, or a smaller byte budget to try."""
        if self.fitting is not None:
            if self.scaled or self.fitting_rate[1] >= self.tokens * 0.85:
                return self.fitting
            # the whole range did not fit after all: fill the budget from the fitting piece's rate instead
            self.scaled = True
            return int(self.fitting_rate[0] * self.tokens / self.fitting_rate[1] * 0.95)
        if _utf8_cut(piece.data, 1) >= len(piece.data):
            return out  # one character already: progress matters more than the budget
        # too many tokens: shrink the byte budget in proportion and read again
        smaller = int(len(piece.data) * self.tokens / used * 0.95)
        return max(1, min(smaller, len(piece.data) - 1))


def read_file(
    path: Path,
    rel: str,
    budget: ToolContext | int,
    *,
    offset: int | None = None,
    limit: int | None = None,
    byte_offset: int | None = None,
) -> ToolOutput:
    """Read a piece of a text file: whole when it fits, else cut to the budget with a continuation note.

    Only a regular file is read (see :func:`~agentnb.tools.open_regular`): a FIFO would block the worker.
    """
    fd = open_regular(path, rel)
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        key = ("file", str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        head = f.read(8192)
        if b"\x00" in head:
            raise_binary(rel, path)
        return read_text_stream(f, key, st.st_size, rel, budget, offset=offset, limit=limit,
                                byte_offset=byte_offset)


def read_document_text(text: str, key: tuple[Any, ...], rel: str, budget: ToolContext | int, *,
                       offset: int | None = None, limit: int | None = None,
                       byte_offset: int | None = None) -> ToolOutput:
    """Serve the extracted text of a document exactly like a text file (offsets into that text)."""
    data = text.encode("utf-8")
    return read_text_stream(io.BytesIO(data), ("doc", *key, len(data)), len(data), rel, budget, offset=offset,
                            limit=limit, byte_offset=byte_offset, kind="document")


def raise_binary(rel: str, path: Path) -> None:
    if path.suffix.lower() in (".png", ".jpg", ".jpeg", ".gif", ".webp"):
        raise ToolError(f"{rel!r} is an image; use ReadImage to look at it")
    raise ToolError(f"{rel!r} is a binary file; Read returns text only (try Bash with `file` or `xxd | head`)")

