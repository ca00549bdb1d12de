"""The built-in tools of DESIGN §5 (names and arguments are a public contract).

``transition`` is not here: the agent loop handles it, since it ends the movement.
"""

from __future__ import annotations

import base64
import fnmatch
import json
import os
import re
from pathlib import Path
from typing import Any

from ._office import OFFICE_SUFFIXES, extract_text
from ._sandbox import run_bounded, sandbox_argv
from ._truncate import cut_text, read_document_text, read_file
from .tools import ToolContext, ToolError, ToolOutput, normalise_rel, resolve_path, tool, unlinked_path

_IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif", ".webp": "image/webp"}
_MAX_IMAGE_BYTES = 5 * 1024 * 1024
_SECRET_ENV = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)


@tool(_builtin=True, read_only=True)
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
    if not p.exists():
        raise ToolError(f"no such file: {path!r}")
    if p.is_dir():
        raise ToolError(f"{path!r} is a directory; use Glob to list it")
    if p.suffix.lower() in OFFICE_SUFFIXES:
        st = p.stat()
        text = extract_text(p)
        return read_document_text(text, (str(p), st.st_ino, st.st_size, st.st_mtime_ns), path, ctx,
                                  offset=offset, limit=limit, byte_offset=byte_offset)
    return read_file(p, path, ctx, offset=offset, limit=limit, byte_offset=byte_offset)


@tool(_builtin=True, read_only=True)
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
    for p in sorted(root.glob("/".join(parts))):
        real = os.path.realpath(p)
        if real != str(root) and not real.startswith(str(root) + os.sep):
            continue  # a symlink that points outside
        rel = p.relative_to(root).as_posix()
        try:
            found.append(rel + ("/" if p.is_dir() else f"  ({p.stat().st_size:,} bytes)"))
        except OSError:  # a broken or looping link must not hide every other match
            found.append(rel + "  (broken link)")
    if not found:
        return ToolOutput(f"No files match {pattern!r}.")
    return cut_text("\n".join(found), ctx, hint="glob")


@tool(_builtin=True, read_only=True)
def Grep(ctx: ToolContext, pattern: str, path: str = ".") -> ToolOutput:
    """Search files for lines matching a regular expression.

    Args:
        pattern: A Python regular expression.
        path: A file or directory relative to the work directory (default: all of it).
    """
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise ToolError(f"pattern {pattern!r} is not a valid regular expression: {exc}") from None
    base = ctx.path(path)
    if not base.exists():
        raise ToolError(f"no such file or directory: {path!r}")
    root = os.path.realpath(ctx.workdir)
    files: list[Path] = []
    if base.is_file():
        files = [base]
    else:
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".git"))
            for name in sorted(filenames):
                files.append(Path(dirpath) / name)
    out: list[str] = []
    budget = ctx.budget_chars
    size = 0
    matches = 0
    hidden = 0  # characters of long lines left out of the shown entries
    for fp in files:
        real = os.path.realpath(fp)
        if not real.startswith(root + os.sep):
            continue
        rel = os.path.relpath(real, root)
        try:
            with open(fp, "rb") as fh:
                if b"\x00" in fh.read(4096):
                    continue
                fh.seek(0)
                pos = 0
                for n, raw in enumerate(fh, start=1):
                    line = raw.decode("utf-8", errors="replace").rstrip("\n")
                    m = rx.search(line)
                    if m:
                        matches += 1
                        if size <= budget * 2:  # keep only what can be shown; still count the rest
                            if len(line) > _GREP_LINE:
                                shown, note = _long_line(line, raw, m.start(), pos, rel)
                                hidden += len(line) - len(shown)
                                entry = f"{rel}:{n}:{shown}{note}"
                            else:
                                entry = f"{rel}:{n}:{line}"
                            out.append(entry)
                            size += len(entry) + 1
                    pos += len(raw)
        except OSError:
            continue
    if not out:
        return ToolOutput(f"No lines match {pattern!r}.")
    result = cut_text("\n".join(out), ctx, hint="grep", extra=f"({matches:,} matching lines in all.)")
    if hidden and not result.truncated:  # every entry is shown, but some long lines only in part
        result.truncated = True
        result.original_chars = (result.original_chars or 0) + hidden
    return result


_GREP_LINE = 500  # characters of a matching line Grep shows


def _long_line(line: str, raw: bytes, at: int, pos: int, rel: str) -> tuple[str, str]:
    """A part of a long matching line around the match, and a note saying where to Read the rest."""
    start = max(0, min(at - _GREP_LINE // 4, len(line) - _GREP_LINE))
    shown = line[start:start + _GREP_LINE]
    # the byte where the shown part starts (invalid UTF-8 counted byte for byte, as Read counts it)
    byte = pos + len(raw.decode("utf-8", errors="surrogateescape")[:start].encode("utf-8", errors="surrogateescape"))
    lead = "…" if start else ""
    trail = "…" if start + len(shown) < len(line) else ""
    return f"{lead}{shown}", (f"{trail} [a line of {len(line):,} characters, cut around the match; "
                               f"Read path={rel!r} byte_offset={byte} to read on from here]")


@tool(_builtin=True, read_only=True)
def ReadImage(ctx: ToolContext, path: str) -> ToolOutput:
    """Attach an image file (png, jpg, gif, webp) so that a vision model can look at it.

    Args:
        path: Image path relative to the work directory.
    """
    p = ctx.path(path)
    if not p.is_file():
        raise ToolError(f"no such file: {path!r}")
    mime = _IMAGE_TYPES.get(p.suffix.lower())
    if mime is None:
        raise ToolError(f"{path!r} is not an image ReadImage can attach; allowed: {', '.join(_IMAGE_TYPES)}")
    size = p.stat().st_size
    if size > _MAX_IMAGE_BYTES:
        raise ToolError(f"{path!r} is {size:,} bytes; images up to {_MAX_IMAGE_BYTES:,} bytes can be attached")
    data = base64.b64encode(p.read_bytes()).decode("ascii")
    return ToolOutput(f"Image {path} ({size:,} bytes, {mime}) is attached below.",
                      image=f"data:{mime};base64,{data}")


@tool(_builtin=True, permission="edit")
def Write(ctx: ToolContext, path: str, content: str) -> str:
    """Create or overwrite a text file in the work directory.

    Args:
        path: File path relative to the work directory; missing folders are created.
        content: The whole new content of the file.
    """
    p = ctx.path(path)
    if p.is_dir():
        raise ToolError(f"{path!r} is a directory")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(content, encoding="utf-8")
    return f"Wrote {len(content):,} characters to {path}."


@tool(_builtin=True, permission="edit")
def Edit(ctx: ToolContext, path: str, old: str, new: str) -> str:
    """Replace one exact occurrence of ``old`` with ``new`` in a file.

    Args:
        path: File path relative to the work directory.
        old: The exact text to replace; it must occur exactly once.
        new: The replacement text.
    """
    p = ctx.path(path)
    if not p.is_file():
        raise ToolError(f"no such file: {path!r}")
    text = p.read_text(encoding="utf-8")
    count = text.count(old) if old else 0
    if count == 0:
        raise ToolError(f"the text to replace was not found in {path!r}")
    if count > 1:
        raise ToolError(f"the text to replace occurs {count} times in {path!r}; include more context so it is unique")
    p.write_text(text.replace(old, new, 1), encoding="utf-8")
    return f"Edited {path}: replaced {len(old):,} characters with {len(new):,}."


@tool(_builtin=True)
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
    if target.exists():
        # the default work directory holds logs/, so the model may have written this file itself
        try:
            data = json.loads(target.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
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
    tmp.write_text(json.dumps({"name": name, "items": current}, ensure_ascii=False, indent=1), encoding="utf-8")
    os.replace(tmp, target)
    done_count = sum(1 for i in current if i["done"])
    lines = [f"Checklist {name}: {done_count}/{len(current)} done"]
    lines += [f"- [{'x' if i['done'] else ' '}] {i['text']}" for i in current]
    return "\n".join(lines)


@tool(_builtin=True, permission="full")
def Bash(ctx: ToolContext, command: str, timeout: int = 120) -> ToolOutput:
    """Run a shell command in the work directory and return its output (stdout and stderr).

    The command runs in a sandbox: it sees the work directory and a read-only system, nothing else, and no network.

    Args:
        command: The command line, run by bash in the work directory.
        timeout: Seconds before the command is stopped (1–600).
    """
    if not isinstance(timeout, (int, float)) or not 1 <= timeout <= 600:
        raise ToolError(f"timeout={timeout!r}; allowed: 1 to 600 seconds")
    # The model's shell never sees credentials from the notebook's environment.
    env = {k: v for k, v in os.environ.items() if not _SECRET_ENV.search(k)}
    workdir = os.path.realpath(ctx.workdir)
    # Keep enough of each stream for any cut the budget can ask for (16 chars a token, 4 bytes a char);
    # the rest is only counted, so a command printing gigabytes costs bounded memory.
    keep = max(1 << 16, ctx.budget_tokens * 64)
    run = run_bounded([*sandbox_argv(workdir), "bash", "-c", command], cwd=workdir, env=env, timeout=timeout,
                      keep=keep)
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

__all__ = ["Read", "Glob", "Grep", "ReadImage", "Write", "Edit", "Checklist", "Bash"]
