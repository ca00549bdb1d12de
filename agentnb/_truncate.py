"""Cutting tool output to a budget, and reading files in budgeted pieces.

Files are read by streaming, never whole: a 1 GB file is readable piece by piece
through the ``offset`` / ``byte_offset`` given in the continuation note.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .tools import ToolContext, ToolOutput

NOTE_PREFIX = "\n\n[agentnb: output truncated automatically"
_CHUNK = 1 << 20
# Files whose lines average more than this many bytes are read by bytes, not lines.
_LONG_LINES = 2000

_HINTS = {
    "bash": "Narrow the output: pipe it through head, tail, grep, awk or sed "
    "(for example `… | grep PATTERN` or `… | sed -n '200,400p'`).",
    "grep": "Narrow the search with a more specific pattern or a smaller path.",
    "glob": "Narrow the pattern (for example a subdirectory or an extension).",
    "generic": "Ask for a smaller part of the result.",
}


def cut_text(text: str, budget: "ToolContext | int", *, hint: str = "generic") -> ToolOutput:
    """Return ``text`` whole, or its head cut at a line boundary with a note on how to get the rest.

    ``budget`` is the tool's context (its token budget, measured with its tokenizer) or a character count.
    """
    if isinstance(budget, int):
        budget_chars = budget
    else:
        budget_chars = budget.budget_chars
        if len(text) <= budget_chars // 3:  # certainly fits; skip counting
            return ToolOutput(text)
        budget_chars = budget.fit(text[: budget_chars * 2])
    if len(text) <= budget_chars:
        return ToolOutput(text)
    head = text[:budget_chars]
    nl = head.rfind("\n")
    if nl > budget_chars // 2:
        head = head[: nl + 1]
    total_lines = text.count("\n") + (0 if text.endswith("\n") else 1)
    lines = head.count("\n")
    note = (
        f"{NOTE_PREFIX}: returned the first {len(head):,} of {len(text):,} characters "
        f"({lines:,} of {total_lines:,} lines). {_HINTS.get(hint, _HINTS['generic'])}]"
    )
    return ToolOutput(
        head + note,
        truncated=True,
        original_chars=len(text),
        returned_chars=len(head),
    )


def _utf8_boundary(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that does not split a UTF-8 character."""
    end = len(data)
    i = end - 1
    # walk back over continuation bytes (10xxxxxx) to the lead byte
    while i >= 0 and end - i <= 4 and (data[i] & 0xC0) == 0x80:
        i -= 1
    if i < 0:
        return end
    lead = data[i]
    need = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
    return end if end - i >= need else i


def _count_newlines(f: Any, stop: int | None = None) -> int:
    """Newlines from the current position to EOF (or ``stop`` bytes), reading in chunks."""
    count = 0
    remaining = stop
    while True:
        size = _CHUNK if remaining is None else min(_CHUNK, remaining)
        if size <= 0:
            break
        chunk = f.read(size)
        if not chunk:
            break
        count += chunk.count(b"\n")
        if remaining is not None:
            remaining -= len(chunk)
    return count


def _skip_lines(f: Any, n: int) -> bool:
    """Advance ``f`` past ``n`` newlines; False when the file has fewer lines."""
    while n > 0:
        pos = f.tell()
        chunk = f.read(_CHUNK)
        if not chunk:
            return False
        idx = -1
        for _ in range(min(n, chunk.count(b"\n"))):
            idx = chunk.index(b"\n", idx + 1)
            n -= 1
        if n == 0:
            f.seek(pos + idx + 1)
            return True
    return True


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def read_file(
    path: Path,
    rel: str,
    budget: "ToolContext | int",
    *,
    offset: int | None = None,
    limit: int | None = None,
    byte_offset: int | None = None,
) -> ToolOutput:
    """Read a file piece: whole when it fits, else cut to the token budget with a continuation note."""
    if isinstance(budget, int):
        return _read_file(path, rel, budget, offset=offset, limit=limit, byte_offset=byte_offset)
    chars = budget.budget_chars
    out = _read_file(path, rel, chars, offset=offset, limit=limit, byte_offset=byte_offset)
    body = out.content[: out.returned_chars]
    for _ in range(4):  # shrink until the returned text really fits the token budget
        allowed = budget.fit(body)
        if allowed >= len(body):
            return out
        chars = max(1, len(body[:allowed].encode("utf-8")))
        out = _read_file(path, rel, chars, offset=offset, limit=limit, byte_offset=byte_offset)
        body = out.content[: out.returned_chars]
    return out


def _read_file(
    path: Path,
    rel: str,
    budget_chars: int,
    *,
    offset: int | None = None,
    limit: int | None = None,
    byte_offset: int | None = None,
) -> ToolOutput:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8192)
        if b"\x00" in head:
            raise_binary(rel, path)
        if byte_offset is not None:
            return _read_bytes(f, rel, size, byte_offset, budget_chars)
        if offset is None and limit is None:
            f.seek(0)
            sample = f.read(min(size, 1 << 16))
            newlines = sample.count(b"\n")
            if len(sample) > budget_chars and len(sample) / (newlines + 1) > _LONG_LINES:
                return _read_bytes(f, rel, size, 0, budget_chars)
        return _read_lines(f, rel, size, offset or 1, limit, budget_chars)


def raise_binary(rel: str, path: Path) -> None:
    from .tools import ToolError

    if path.suffix.lower() in (".png", ".jpg", ".jpeg", ".gif", ".webp"):
        raise ToolError(f"{rel!r} is an image; use ReadImage to look at it")
    raise ToolError(f"{rel!r} is a binary file; Read returns text only (try Bash with `file` or `xxd | head`)")


def _read_bytes(f: Any, rel: str, size: int, byte_offset: int, budget_chars: int) -> ToolOutput:
    from .tools import ToolError

    if byte_offset < 0 or byte_offset > size:
        raise ToolError(f"byte_offset={byte_offset} is outside the file {rel!r} (0–{size:,})")
    f.seek(byte_offset)
    data = f.read(budget_chars)
    end = byte_offset + len(data)
    if end < size:
        data = data[: _utf8_boundary(data)] or data
        end = byte_offset + len(data)
    text = _decode(data)
    if end >= size:
        return ToolOutput(text, original_chars=size - byte_offset, returned_chars=len(text))
    note = (
        f"{NOTE_PREFIX}: returned bytes {byte_offset:,}–{end - 1:,} of {size:,} "
        f"({len(data):,} of {size - byte_offset:,} bytes from byte_offset={byte_offset}). "
        f"To read on, call Read with path={rel!r} and byte_offset={end}; or use Grep to find the part you need.]"
    )
    return ToolOutput(
        text + note,
        truncated=True,
        original_chars=size - byte_offset,
        returned_chars=len(text),
        continuation={"path": rel, "byte_offset": end},
    )


def _read_lines(
    f: Any, rel: str, size: int, offset: int, limit: int | None, budget_chars: int
) -> ToolOutput:
    from .tools import ToolError

    if offset < 1:
        raise ToolError(f"offset={offset}: lines are numbered from 1")
    if limit is not None and limit < 1:
        raise ToolError(f"limit={limit}: give at least 1 line")
    f.seek(0)
    if not _skip_lines(f, offset - 1):
        f.seek(0)
        total = _count_newlines(f)
        raise ToolError(f"offset={offset} is past the end of {rel!r}, which has {total:,} lines")
    start = f.tell()
    taken: list[bytes] = []
    used = 0
    cut_in_line = False
    while limit is None or len(taken) < limit:
        line = f.readline(budget_chars - used + 1)
        if not line:
            break
        if used + len(line) > budget_chars:
            if not taken:
                # one line longer than the budget: cut it at a byte boundary
                line = line[: _utf8_boundary(line[:budget_chars])]
                taken.append(line)
                used += len(line)
                cut_in_line = True
            else:
                f.seek(f.tell() - len(line))
            break
        taken.append(line)
        used += len(line)
    stop = start + used
    data = b"".join(taken)
    text = _decode(data)
    f.seek(stop)
    more_bytes = size - stop
    requested_end_reached = limit is not None and len(taken) >= limit and not cut_in_line
    if more_bytes == 0 or requested_end_reached:
        return ToolOutput(text, original_chars=len(data), returned_chars=len(text))
    # how much was asked for: the rest of the file (or the limit's lines)
    if limit is None:
        rest_lines = _count_newlines(f)
        total_lines = offset - 1 + len([t for t in taken if t.endswith(b"\n")]) + rest_lines + (
            0 if size and _last_byte_is_newline(f, size) else 1
        )
        original = size - start
    else:
        original = used + _bytes_of_lines(f, limit - len(taken))
        total_lines = None
    last_line = offset + len(taken) - 1
    if cut_in_line:
        note = (
            f"{NOTE_PREFIX}: line {offset:,} is longer than the budget; returned its first {len(data):,} bytes. "
            f"To read on, call Read with path={rel!r} and byte_offset={stop}; or use Grep to find the part you need.]"
        )
        cont: dict[str, Any] = {"path": rel, "byte_offset": stop}
    else:
        of_lines = f" of {total_lines:,}" if total_lines is not None else ""
        note = (
            f"{NOTE_PREFIX}: returned lines {offset:,}–{last_line:,}{of_lines} "
            f"({len(data):,} of {original:,} bytes). To read on, call Read with path={rel!r} and "
            f"offset={last_line + 1} (add limit= for fewer lines); or use Grep to find the part you need.]"
        )
        cont = {"path": rel, "offset": last_line + 1, "byte_offset": stop}
    return ToolOutput(text + note, truncated=True, original_chars=original, returned_chars=len(text), continuation=cont)


def _last_byte_is_newline(f: Any, size: int) -> bool:
    f.seek(size - 1)
    return f.read(1) == b"\n"


def _bytes_of_lines(f: Any, n: int) -> int:
    total = 0
    for _ in range(n):
        line = f.readline(_CHUNK)
        while line and not line.endswith(b"\n"):
            more = f.readline(_CHUNK)
            if not more:
                break
            total += len(line)
            line = more
        if not line:
            break
        total += len(line)
    return total
