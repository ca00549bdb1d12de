"""Grep's two engines: RE2 in the worker for the patterns it reads as Python does, a search process for the rest.

A backtracking engine can take exponential time on a pattern such as ``(a|a)+$``, and the `regex`
package's own timeout counts CPU time, not wall time (a busy machine stretched a 2 s limit to 16 s).  So:

* a pattern that RE2 (linear time, through ``google-re2``) accepts and reads as `regex` does runs here,
  with its matching time counted against the limit between lines;
* any other pattern (backreferences, lookarounds, possessive repeats, ``\\b``, ...) is compiled and run by
  `regex` in a separate process (:mod:`agentnb.tools._grepscan`), which is killed when the limit passes in
  wall time.  Such processes are kept for the next call (a few idle ones, one per concurrent call) and
  replaced when killed; each ends when its parent does.
"""

from __future__ import annotations

import array
import atexit
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import re2
import regex

from ._grepscan import Record, record, recv, scan, send

__all__ = ["GrepTimeout", "Matcher", "PatternError", "SearchFailed", "matcher", "to_re2"]

Keep = Callable[[], bool]  # whether Grep still keeps what it finds (its output budget is not spent)
Add = Callable[[Record], None]
_IDLE = 2  # search processes kept for the next call
_SCAN = str(Path(__file__).resolve().with_name("_grepscan.py"))


class GrepTimeout(Exception):
    """The search took longer than the limit."""


class PatternError(Exception):
    """The pattern is not a valid (Python) regular expression; the text is `regex`'s reason."""


class SearchFailed(Exception):
    """The search process ended or failed without an answer."""


# -- RE2 ---------------------------------------------------------------------------------------------

_SHORTHANDS = {"d": r"\d", "s": r"\s", "w": r"\w"}
_CASELESS = re.compile(r"\(\?[a-zA-Z-]*i[a-zA-Z-]*[:)]")


@cache
def _ranges() -> dict[str, tuple[tuple[int, int], ...]]:
    """The code points `regex` matches with ``\\d``, ``\\s`` and ``\\w``, as ranges (its installed tables)."""
    codes = array.array("I", range(0xD800))
    codes.extend(range(0xE000, 0x110000))  # no surrogates: no line Grep reads has one
    text = codes.tobytes().decode("utf-32-le" if sys.byteorder == "little" else "utf-32-be")

    def point(i: int) -> int:
        return i if i < 0xD800 else i + 0x800

    return {e: tuple((point(m.start()), point(m.end() - 1)) for m in regex.finditer(rx + "+", text))
            for e, rx in _SHORTHANDS.items()}


@cache
def _class_body(escape: str) -> str:
    """The inside of an RE2 character class matching what `regex` matches with ``escape`` (``\\d``, ``\\W``, ...)."""
    ranges = list(_ranges()[escape.lower()])
    if escape.isupper():  # the complement, over every code point
        edges = [-1] + [x for a, b in ranges for x in (a, b)] + [0x110000]
        ranges = [(edges[i] + 1, edges[i + 1] - 1) for i in range(0, len(edges), 2) if edges[i] + 1 <= edges[i + 1] - 1]
    return "".join(f"\\x{{{a:X}}}" if a == b else f"\\x{{{a:X}}}-\\x{{{b:X}}}" for a, b in ranges)


def to_re2(pattern: str) -> str | None:
    """``pattern`` in RE2 syntax with the meaning `regex` gives it, or None where the two may differ.

    RE2's ``\\d``, ``\\s``, ``\\w`` and ``[[:alpha:]]`` are ASCII-only and its ``\\b`` too, where Python's are
    Unicode; ``x{,3}`` is a repeat in Python and text in RE2; ``\\10`` may be a backreference.  The
    shorthands are spelled out as the code points `regex` gives them; the rest is left to `regex`.
    """
    out: list[str] = []
    caseless = bool(_CASELESS.search(pattern))
    i, n = 0, len(pattern)
    in_class = False
    first = 0  # in a class: where a ']' would close it (one right after '[' or '[^' is a literal)
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 >= n:
                return None
            e = pattern[i + 1]
            if e in "dDsSwW":
                if not in_class:
                    # (?-i:...): Python never case-folds a shorthand; RE2 would fold the spelled-out ranges
                    out.append(f"(?-i:[{'^' if e.isupper() else ''}{_class_body(e.lower())}])")
                elif caseless or (out and out[-1] == "-" and i > first) or pattern[i + 2:i + 3] == "-":
                    return None  # a range bound, or folding inside a class: not spelled out safely
                else:
                    out.append(_class_body(e))
                i += 2
                continue
            if e in "bBpPNuU123456789" or (e == "Z" and in_class):
                return None
            out.append("\\z" if e == "Z" else pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "]" and i >= first:
                in_class = False
            elif c == "[" and pattern[i + 1:i + 2] in (":", "=", "."):
                return None  # POSIX classes: ASCII in RE2, Unicode in `regex`
            out.append(c)
            i += 1
            continue
        if c == "[":
            in_class = True
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            first = j + 1 if pattern[j:j + 1] == "]" else j
            out.append(pattern[i:j])
            i = j
            continue
        if c == "{" and pattern[i + 1:i + 2] == ",":
            return None
        out.append(c)
        i += 1
    return "".join(out)


def _re2_options() -> Any:
    options = re2.Options()
    options.log_errors = False  # a pattern RE2 cannot take goes to `regex`; nothing for stderr
    return options


@lru_cache(maxsize=128)
def re2_compile(pattern: str) -> Any | None:
    """The RE2 program for ``pattern`` if RE2 reads it as `regex` does and `regex` accepts it, else None."""
    translated = to_re2(pattern)
    if translated is None:
        return None
    try:
        compiled = re2.compile(translated, _re2_options())
    except (re2.error, UnicodeError, TypeError, ValueError):
        return None
    try:  # RE2 takes a few things Python rejects (\Q...\E, \C, \x{41}): `regex` decides what is valid
        regex.compile(pattern)  # safe here: RE2 bounds the size of what it accepted
    except (regex.error, ValueError, OverflowError):
        return None  # the search process reports it, in `regex`'s words
    return compiled


# -- the matchers ------------------------------------------------------------------------------------


class Matcher(ABC):
    """Scans one file at a time for one Grep call."""

    @abstractmethod
    def scan(self, fd: int, keep: Keep, add: Add) -> int:
        """Scan the open file ``fd`` (closed here), pass ``add`` what to show while ``keep()``; the match count."""


class _Re2Matcher(Matcher):
    def __init__(self, compiled: Any, limit: float) -> None:
        self.rx, self.left = compiled, limit  # seconds of matching still allowed in this call

    def scan(self, fd: int, keep: Keep, add: Add) -> int:
        matches = 0

        def search(line: str) -> int | None:
            started = time.monotonic()
            m = self.rx.search(line)
            self.left -= time.monotonic() - started
            if self.left <= 0:
                raise GrepTimeout
            return None if m is None else int(m.start())

        def emit(n: int, line: str, raw: bytes, at: int, pos: int) -> None:
            nonlocal matches
            matches += 1
            if keep():
                add(record(n, line, raw, at, pos))

        try:
            with open(fd, "rb") as fh:
                scan(fh, search, emit)
        except OSError:
            pass  # what was found before the error stands
        return matches


class _Worker:
    """A search process and the socket to it."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        path = [p for p in sys.path if p and os.path.isabs(p)]
        try:
            # a session of its own: a Ctrl-C at the terminal is the worker's to handle, not this process's
            self.proc = subprocess.Popen(
                [sys.executable, "-I", _SCAN, str(theirs.fileno()), json.dumps(path)], pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self.sock = mine
        self.pid = os.getpid()  # a forked copy of this process must not share the socket

    def kill(self) -> None:
        with suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        self.sock.close()


_idle: list[_Worker] = []
_lock = threading.Lock()


def _take() -> _Worker:
    with _lock:
        if _idle and _idle[0].pid != os.getpid():  # a forked copy: those processes are the parent's to use
            for w in _idle:
                w.sock.close()
            _idle.clear()
        while _idle:
            w = _idle.pop()
            if w.proc.poll() is None:
                return w
            w.kill()
    return _Worker()


def _give_back(w: _Worker) -> None:
    with _lock:
        if len(_idle) < _IDLE and w.pid == os.getpid() and w.proc.poll() is None:
            _idle.append(w)
            return
    w.kill()


@atexit.register
def _end_idle() -> None:
    with _lock:
        workers, _idle[:] = list(_idle), []
    for w in workers:
        if w.pid == os.getpid():
            w.kill()


class _ProcessMatcher(Matcher):
    def __init__(self, worker: _Worker, pattern: str, deadline: float) -> None:
        self.worker, self.deadline = worker, deadline
        self.clean = True  # no question is waiting for its answer: the process can serve the next call
        reply = self._ask({"pattern": pattern})
        if "error" in reply:
            raise PatternError(reply["error"])

    def _ask(self, msg: dict[str, Any], fds: list[int] | None = None) -> Any:
        self.clean = False
        try:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.worker.sock.settimeout(left)  # a child that stopped reading must not block the send either
            send(self.worker.sock, msg, fds)
            reply, _ = recv(self.worker.sock, self.deadline)
        except TimeoutError:
            raise GrepTimeout from None
        except (EOFError, OSError):
            raise SearchFailed("the search process ended without an answer") from None
        if "error" in reply and "pattern" not in msg:
            raise SearchFailed(reply["error"])
        self.clean = "more" not in reply
        return reply

    def scan(self, fd: int, keep: Keep, add: Add) -> int:
        try:
            reply = self._ask({"keep": keep()}, [fd])
        finally:
            os.close(fd)  # the child has its own copy
        while True:
            for rec in reply["recs"]:
                if keep():
                    add(rec)
            if not reply.get("more"):
                return int(reply["matches"])
            reply = self._ask({"keep": keep()})


@contextmanager
def matcher(pattern: str, limit: float) -> Iterator[Matcher]:
    """The matcher for one Grep call: RE2 here, else a search process killed once ``limit`` seconds pass.

    Raises :class:`PatternError` for an invalid pattern, :class:`GrepTimeout` when the limit passes.
    """
    compiled = re2_compile(pattern)
    if compiled is not None:
        yield _Re2Matcher(compiled, limit)
        return
    deadline = time.monotonic() + limit
    try:
        worker = _take()
    except OSError as exc:
        raise SearchFailed(f"the search process could not start: {exc.strerror or exc}") from None
    m: _ProcessMatcher | None = None
    try:
        m = _ProcessMatcher(worker, pattern, deadline)
        yield m
    except BaseException as exc:
        if (m is None and not isinstance(exc, PatternError)) or (m is not None and not m.clean):
            worker.kill()  # stopped mid-answer (the limit, an error): it cannot serve the next call
        else:
            _give_back(worker)
        raise
    else:
        _give_back(worker)
