"""The built-in tools of docs/tools.md (names and arguments are a public contract).

``transition`` is not here: the agent loop handles it, since it ends the movement.
"""

from __future__ import annotations

import base64
import json
import os
import re
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._fs import special_kind
from .._secrets import redact
from ..errors import ToolError
from .base import builtin_tool
from .context import IMAGE_TYPES, MAX_IMAGE_BYTES, ToolContext, ToolOutput
from .office import OFFICE_SUFFIXES, extract_text
from .paths import normalise_rel, open_regular, resolve_path, unlinked_path
from .sandbox import bash_argv, bash_env, run_bounded
from .truncate import cut_text, read_document_text, read_file

if TYPE_CHECKING:
    from ._grep import Matcher
    from ._grepscan import Record

GREP_TIMEOUT_ENV = "AGENTNB_GREP_TIMEOUT"
_GREP_TIMEOUT = 5.0  # seconds per Grep call (of matching with RE2; of the search process, wall clock)


@contextmanager
def _os_errors(rel: str, doing: str = "read") -> Iterator[None]:
    """An OSError as a tool error naming the model's own (relative) path, never the host's absolute one."""
    try:
        yield
    except OSError as exc:
        raise ToolError(f"cannot {doing} {rel!r}: {exc.strerror or type(exc).__name__}") from None


def _read_fd(fd: int, limit: int = -1) -> bytes:
    with open(fd, "rb") as f:
        return f.read(limit)


def _write_text(p: Path, rel: str, content: str) -> None:
    """Write ``content`` to ``p`` whole or not at all: into a new file beside it, then renamed over it.

    Writing in place empties the file first, so a worker killed mid-write (a crash, a SIGKILL) left an
    edited file empty.  A kill before the rename leaves the old file as it was (and a stray
    ``.agentnb-*.tmp`` beside it).  The target is checked as before (a FIFO or device is refused) and
    keeps its permission bits.
    """
    mode: int | None = None  # a new file gets 0o666 less the umask, as any new file
    try:
        fd = open_regular(p, rel)  # refuses what is not a regular file, without blocking on it
    except ToolError:
        if os.path.lexists(p):
            raise
    else:
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
    tmp = p.with_name(f".agentnb-{uuid.uuid4().hex[:12]}.tmp")  # short: p's own name may be at the length limit
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with open(fd, "w", encoding="utf-8") as f:
            f.write(content)
        os.replace(tmp, p)  # a link swapped in at p is replaced itself, never followed
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


@builtin_tool(read_only=True)
def Read(ctx: ToolContext, path: str, offset: int | None = None, limit: int | None = None,
         byte_offset: int | None = None) -> ToolOutput:
    """Read a text file (or the text of a .docx, .xlsx, .pptx or .pdf) in the work directory.

    Large results are cut to fit the context; the note at the end says how to read on.

    Args:
        path: File path relative to the work directory.
        offset: First line to return, numbered from 1.
        limit: Number of lines to return.
        byte_offset: Byte position to start from (for files with few newlines).
    """
    p = ctx.path(path)
    with _os_errors(path):
        if p.suffix.lower() in OFFICE_SUFFIXES:
            fd = open_regular(p, path)  # a FIFO named like a document is refused before a library opens it
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            text = extract_text(p)
            return read_document_text(text, (str(p), st.st_ino, st.st_size, st.st_mtime_ns), path, ctx,
                                      offset=offset, limit=limit, byte_offset=byte_offset)
        return read_file(p, path, ctx, offset=offset, limit=limit, byte_offset=byte_offset)


@builtin_tool(read_only=True)
def Glob(ctx: ToolContext, pattern: str) -> ToolOutput:
    """List files in the work directory matching a glob pattern (``**`` matches any depth).

    Args:
        pattern: A glob pattern relative to the work directory, such as ``input/*.md`` or ``**/*.py``.
    """
    given = pattern
    outside = f"pattern {given!r} must stay inside the work directory (no absolute paths or '..')"
    if "\x00" in pattern:
        raise ToolError("pattern contains a NUL byte")
    try:
        pattern = normalise_rel(pattern, what="pattern")
    except ToolError:
        raise ToolError(outside) from None
    if ".." in Path(pattern).parts:
        raise ToolError(outside)
    parts = [part for part in Path(pattern).parts if part != "."]
    if not parts:
        raise ToolError(f"pattern {given!r} names no files; give a pattern such as '*', '**/*' or 'input/*.md'")
    root = Path(os.path.realpath(ctx.workdir))
    # the literal folders before the first wildcard must not lead out (a linked folder would be listed
    # and scanned, only for its entries to be dropped below)
    literal = list(parts[:-1])
    for i, part in enumerate(literal):
        if any(ch in part for ch in "*?["):
            literal = literal[:i]
            break
    if literal:
        resolve_path(root, "/".join(literal))
    found: list[str] = []
    special: list[str] = []  # FIFOs, sockets, devices: no tool reads them, so they are not offered
    with _os_errors(given, "search for"):
        try:
            matches = sorted(root.glob("/".join(parts)))
        except ValueError as exc:  # e.g. "a**b": pathlib allows ** only as a whole path component
            raise ToolError(f"pattern {given!r} is not a valid glob: {exc}; use ** as a whole component, "
                            "e.g. '**/*.md'") from None
    for p in matches:
        real = os.path.realpath(p)
        if real != str(root) and not real.startswith(str(root) + os.sep):
            continue  # a symlink that points outside
        rel = p.relative_to(root).as_posix()
        try:
            st = os.stat(p)
        except OSError:  # a broken or looping link must not hide every other match
            found.append(rel + "  (broken link)")
            continue
        if stat.S_ISDIR(st.st_mode):
            found.append(rel + "/")
        elif stat.S_ISREG(st.st_mode):
            found.append(rel + f"  ({st.st_size:,} bytes)")
        else:
            special.append(f"{rel} ({special_kind(st.st_mode)})")
    if special and not found:
        raise ToolError(f"pattern {given!r} matches only special files, which no tool reads: {', '.join(special[:5])}"
                        f"{' …' if len(special) > 5 else ''}; tools read regular files and list directories only")
    if not found:
        return ToolOutput(f"No files match {pattern!r}.")
    extra = (f"(left out {len(special)} special file(s) that no tool reads: {', '.join(special[:5])}"
             f"{' …' if len(special) > 5 else ''})") if special else ""
    result = cut_text("\n".join(found) + (f"\n{extra}" if extra else ""), ctx, hint="glob")
    return result


@builtin_tool(read_only=True)
def Grep(ctx: ToolContext, pattern: str, path: str = ".") -> ToolOutput:
    """Search files for lines matching a regular expression.

    Args:
        pattern: A Python regular expression.
        path: A file or directory relative to the work directory (default: all of it).
    """
    if not isinstance(pattern, str):
        raise ToolError(f"pattern must be text (a regular expression), not {type(pattern).__name__}")
    from ._grep import matcher  # RE2 and `regex`: imported by the first search, not by every process's start

    limit = _grep_timeout(ctx)
    with _grep_errors(pattern, limit), matcher(pattern, limit) as found:
        return _grep(ctx, found, pattern, path)


@contextmanager
def _grep_errors(pattern: str, limit: float) -> Iterator[None]:
    from ._grep import GrepTimeout, PatternError, SearchFailed

    try:
        yield
    except PatternError as exc:
        raise ToolError(f"pattern {pattern!r} is not a valid regular expression: {exc}") from None
    except GrepTimeout:
        raise ToolError(
            f"Grep: the pattern {pattern!r} took longer than {limit:g} s and was stopped; it probably backtracks "
            "catastrophically (nested or overlapping repeats such as (a+)+ or (a|aa)+, or a backreference). "
            "Use a simpler pattern: drop the nested repeat (a+ instead of (a+)+), use a literal word, or anchor "
            "it; or search a smaller path.") from None
    except SearchFailed as exc:
        raise ToolError(f"Grep: the search for {pattern!r} failed ({exc}); try a simpler pattern") from None


def _grep(ctx: ToolContext, scanner: Matcher, pattern: str, path: str) -> ToolOutput:
    base = ctx.path(path)
    root = os.path.realpath(ctx.workdir)
    with _os_errors(path, "search"):
        try:
            mode = os.stat(base).st_mode
        except FileNotFoundError:
            raise ToolError(f"no such file or directory: {path!r}") from None
        files: list[Path] = []
        if stat.S_ISDIR(mode):
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith(".git"))
                for name in sorted(filenames):
                    files.append(Path(dirpath) / name)
        else:
            files = [base]  # a FIFO, socket or device given by name is refused when it is opened below
    single = not stat.S_ISDIR(mode)
    out: list[str] = []
    budget = ctx.budget_chars
    size = 0
    matches = 0
    hidden = 0  # characters of long lines left out of the shown entries
    rel = ""

    def keep() -> bool:  # keep only what can be shown; still count the rest
        return size <= budget * 2

    def add(rec: Record) -> None:
        nonlocal size, hidden
        if len(rec) == 2:
            entry = f"{rel}:{rec[0]}:{rec[1]}"
        else:
            shown, note = _long_line(rec, rel)
            hidden += rec[1] - len(shown)
            entry = f"{rel}:{rec[0]}:{shown}{note}"
        out.append(entry)
        size += len(entry) + 1

    for fp in files:
        real = os.path.realpath(fp)
        if not real.startswith(root + os.sep):
            continue
        rel = os.path.relpath(real, root)
        try:
            fd = open_regular(Path(real), rel)
        except ToolError:
            if single:
                raise
            continue  # a FIFO, socket or device met while walking is skipped, never opened for reading
        matches += scanner.scan(fd, keep, add)
    if not out:
        return ToolOutput(f"No lines match {pattern!r}.")
    result = cut_text("\n".join(out), ctx, hint="grep", extra=f"({matches:,} matching lines in all.)")
    if hidden and not result.truncated:  # every entry is shown, but some long lines only in part
        result.truncated = True
        result.original_chars = (result.original_chars or 0) + hidden
    return result


def _grep_timeout(ctx: ToolContext) -> float:
    """Seconds one Grep call may take matching: the context's, else $AGENTNB_GREP_TIMEOUT, else 5."""
    if ctx.grep_timeout is not None:
        return float(ctx.grep_timeout)
    raw = os.environ.get(GREP_TIMEOUT_ENV, "").strip()
    if not raw:
        return _GREP_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise ToolError(f"{GREP_TIMEOUT_ENV}={raw!r}; allowed: a number of seconds greater than 0 (default 5)")
    return value


def _long_line(rec: Record, rel: str) -> tuple[str, str]:
    """The window of a long matching line around the match, and a note saying where to Read the rest."""
    _, length, start, window, byte = rec
    lead = "…" if start else ""
    trail = "…" if start + len(window) < length else ""
    # the window's edges are cuts: a secret split there is masked here, where the cut is made
    shown = redact(window, cut_start=bool(lead), cut_end=bool(trail))
    return f"{lead}{shown}", (f"{trail} [a line of {length:,} characters, cut around the match; "
                               f"Read path={rel!r} byte_offset={byte} to read on from here]")


@builtin_tool(read_only=True)
def ReadImage(ctx: ToolContext, path: str) -> ToolOutput:
    """Attach an image file (png, jpg, gif, webp) so that a vision model can look at it.

    Args:
        path: Image path relative to the work directory.
    """
    p = ctx.path(path)
    with _os_errors(path):
        fd = open_regular(p, path)
        try:
            mime = IMAGE_TYPES.get(p.suffix.lower())
            if mime is None:
                raise ToolError(f"{path!r} is not an image ReadImage can attach; allowed: {', '.join(IMAGE_TYPES)}")
            size = os.fstat(fd).st_size
            if size > MAX_IMAGE_BYTES:
                raise ToolError(f"{path!r} is {size:,} bytes; images up to {MAX_IMAGE_BYTES:,} bytes can be attached")
        except BaseException:
            os.close(fd)
            raise
        data = base64.b64encode(_read_fd(fd, MAX_IMAGE_BYTES)).decode("ascii")
    return ToolOutput(f"Image {path} ({size:,} bytes, {mime}) is attached below.",
                      image=f"data:{mime};base64,{data}")


@builtin_tool(permission="edit")
def Write(ctx: ToolContext, path: str, content: str) -> str:
    """Create or overwrite a text file in the work directory.

    Args:
        path: File path relative to the work directory; missing folders are created.
        content: The whole new content of the file.
    """
    if not isinstance(content, str):
        raise ToolError(f"content must be text, not {type(content).__name__}")
    p = ctx.path(path)
    with _os_errors(path, "write"):
        if p.is_dir():
            raise ToolError(f"{path!r} is a directory")
        p.parent.mkdir(parents=True, exist_ok=True)
        _write_text(p, path, content)
    return f"Wrote {len(content):,} characters to {path}."


@builtin_tool(permission="edit")
def Edit(ctx: ToolContext, path: str, old: str, new: str) -> str:
    """Replace one exact occurrence of ``old`` with ``new`` in a file.

    Args:
        path: File path relative to the work directory.
        old: The exact text to replace; it must occur exactly once.
        new: The replacement text.
    """
    p = ctx.path(path)
    with _os_errors(path, "edit"):
        try:
            with open(open_regular(p, path), encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            raise ToolError(f"{path!r} is not UTF-8 text; Edit changes text files only") from None
        count = text.count(old) if old else 0
        if count == 0:
            raise ToolError(f"the text to replace was not found in {path!r}")
        if count > 1:
            raise ToolError(f"the text to replace occurs {count} times in {path!r}; include more context so it is "
                            "unique")
        _write_text(p, path, text.replace(old, new, 1))
    return f"Edited {path}: replaced {len(old):,} characters with {len(new):,}."


@builtin_tool()
def Checklist(ctx: ToolContext, name: str, items: list[dict[str, Any]]) -> str:
    """Create or update a named checklist; items with the same text are updated, new ones appended.

    The current state of every checklist is shown to the next movement.

    Args:
        name: Checklist name (letters of any script, digits, '-' and '_').
        items: A list of {"text": str, "done": bool}.
    """
    # \w takes any script's letters and digits (a ja piece names its lists in Japanese); no '/', '.' or
    # spaces, so the name is always one plain file in logs/checklists/
    if not isinstance(name, str) or not re.fullmatch(r"[\w-]{1,64}", name):
        raise ToolError(f"checklist name {name!r} must be 1–64 letters, digits, '-' or '_' "
                        "(letters of any script; no spaces, dots or slashes)")
    if not isinstance(items, list):
        raise ToolError("items must be a list of {text, done}")
    # logs_dir is <job>/logs; nothing below <job> may be a link (see unlinked_path)
    target = unlinked_path(ctx.logs_dir.parent, ctx.logs_dir.name, "checklists", f"{name}.json")
    unlinked_path(ctx.logs_dir.parent, ctx.logs_dir.name, "checklists", f"{name}.json.tmp")
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    current: list[dict[str, Any]] = []
    if os.path.lexists(target):
        # the default work directory holds logs/, so the model may have written this file itself (even a FIFO)
        try:
            data = json.loads(_read_fd(open_regular(target, f"logs/checklists/{name}.json")).decode("utf-8"))
        except (OSError, ValueError, ToolError) as exc:
            raise ToolError(f"logs/checklists/{name}.json cannot be read as a checklist ({exc}); "
                            "remove it or use another name") from None
        raw = data.get("items") if isinstance(data, dict) else None
        current = [{"text": i["text"], "done": bool(i.get("done"))} for i in raw if isinstance(i, dict)
                   and isinstance(i.get("text"), str)] if isinstance(raw, list) else []
    index = {item["text"]: item for item in current}
    # check every item first: a bad call changes nothing
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("text"), str) or not item["text"].strip():
            raise ToolError(f"items[{i}] must be an object with a non-empty 'text' and a boolean 'done'")
        if not isinstance(item.get("done", False), bool):
            raise ToolError(f"items[{i}].done is {item['done']!r}; allowed: true or false")
        extra = set(item) - {"text", "done"}
        if extra:
            raise ToolError(f"items[{i}]: unknown key(s) {sorted(extra)}; allowed: text, done")
    for item in items:
        done = item.get("done", False)
        if item["text"] in index:
            index[item["text"]]["done"] = done
        else:
            entry = {"text": item["text"], "done": done}
            current.append(entry)
            index[item["text"]] = entry
    tmp = target.with_suffix(".json.tmp")
    with _os_errors(f"logs/checklists/{name}.json", "write"):
        _write_text(tmp, f"logs/checklists/{name}.json.tmp",
                    json.dumps({"name": name, "items": current}, ensure_ascii=False, indent=1))
        os.replace(tmp, target)
    done_count = sum(1 for i in current if i["done"])
    lines = [f"Checklist {name}: {done_count}/{len(current)} done"]
    lines += [f"- [{'x' if i['done'] else ' '}] {i['text']}" for i in current]
    return "\n".join(lines)


@builtin_tool(permission="full")
def Bash(ctx: ToolContext, command: str, timeout: int = 120) -> ToolOutput:
    """Run a shell command in the work directory and return its output (stdout and stderr).

    The command runs in a sandbox: it sees the work directory and a read-only system, nothing else, and no network.

    Args:
        command: The command line, run by bash in the work directory.
        timeout: Seconds before the command is stopped (1–600).
    """
    if not isinstance(timeout, (int, float)) or not 1 <= timeout <= 600:
        raise ToolError(f"timeout={timeout!r}; allowed: 1 to 600 seconds")
    # The model's shell sees an allow-list of the notebook's environment, never its credentials.
    env = bash_env()
    workdir = os.path.realpath(ctx.workdir)
    # Keep enough of each stream for any cut the budget can ask for (16 chars a token, 4 bytes a char);
    # the rest is only counted, so a command printing gigabytes costs bounded memory.
    keep = max(1 << 16, ctx.budget_tokens * 64)
    argv, death_signal = bash_argv(workdir, command)
    run = run_bounded(argv, cwd=workdir, env=env, timeout=timeout, keep=keep, death_signal=death_signal)
    stdout = run.stdout.decode("utf-8", errors="replace")
    if run.returncode is None:
        kept_all = run.stdout_bytes == len(run.stdout)
        out = cut_text(stdout, ctx, hint="bash", more_chars=run.dropped_chars, more_lines=run.dropped_lines,
                       ends_with_newline=None if kept_all else run.last["out"] == b"\n")
        out.content = f"Error: the command timed out after {timeout} s. Partial output:\n{out.content}"
        out.is_error = True
        return out
    text = stdout
    err = run.stderr.decode("utf-8", errors="replace")
    if err:
        text = f"{text}\n[stderr]\n{err}" if text else f"[stderr]\n{err}"
    if run.returncode != 0:
        text = f"{text}\n[exit code {run.returncode}]" if text else f"[exit code {run.returncode}]"
    # stderr and the exit code come last, so a cut drops them: the note keeps them known
    facts = f"exit code {run.returncode}"
    if err:
        out_chars, err_chars = len(stdout) + run.dropped["out"], len(err) + run.dropped["err"]
        facts += (f"; stdout {out_chars:,} characters, then stderr {err_chars:,} characters after the [stderr] "
                  f"line; to see only stderr: `… 2>&1 >/dev/null | tail -n 50`")
    # how the whole output ends, when only its head was kept
    whole_end = None if not run.dropped_chars or run.returncode != 0 else \
        (run.last["err"] if run.stderr_bytes else run.last["out"]) == b"\n"
    result = cut_text(text or "(no output)", ctx, hint="bash", extra=f"({facts}.)",
                      more_chars=run.dropped_chars, more_lines=run.dropped_lines, ends_with_newline=whole_end)
    result.is_error = run.returncode != 0
    return result

__all__ = ["Bash", "Checklist", "Edit", "Glob", "Grep", "Read", "ReadImage", "Write"]
