"""Grep's line scan, shared by both of its engines, and the search process that runs Python-only patterns.

This file imports the standard library and `regex` only, never agentnb: :mod:`agentnb.tools._grep`
runs it as a script in a child process (``python -I``), which must start fast and cannot import the
package's heavy modules.  The parent opens every file itself (path confinement, regular files only) and
hands the child the open descriptor over a Unix socket, so the child decides nothing about paths.

Messages are JSON objects sent as one or more SEQPACKET datagrams of at most :data:`CHUNK` bytes, each
prefixed with ``+`` (more follow) or ``.`` (the last); descriptors travel with the first.

Parent to child: ``{"pattern": p}`` (compile; the answer is ``{"ok": true}`` or ``{"error": text}``), then
per file ``{"keep": bool}`` with its descriptor.  The child answers with ``{"recs": [...], "more": true}``
batches (the parent answers each with ``{"keep": bool}``) and a last ``{"recs": [...], "matches": n}``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

LINE = 500  # characters of a matching line Grep shows
CHUNK = 32 * 1024  # bytes of one datagram: well under a Unix socket's send buffer
BATCH = 32 * 1024  # characters of match records the child sends before asking whether to go on
MEMORY = 4 << 30  # bytes of address space the child may use: a pattern that explodes fails, not the machine

Record = list[Any]  # [n, line] for a short line; [n, line length, window start, window, byte offset] for a long one
Search = Callable[[str], "int | None"]  # where the first match in a line starts, or None
Emit = Callable[[int, str, bytes, int, int], None]  # line number, line, raw bytes, match start, byte offset


def scan(fh: BinaryIO, search: Search, emit: Emit) -> None:
    """Call ``emit`` for each line of ``fh`` that ``search`` matches; a file with a NUL byte early is skipped."""
    if b"\x00" in fh.read(4096):
        return
    fh.seek(0)
    pos = 0
    for n, raw in enumerate(fh, start=1):
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        at = search(line)
        if at is not None:
            emit(n, line, raw, at, pos)
        pos += len(raw)


def record(n: int, line: str, raw: bytes, at: int, pos: int) -> Record:
    """What Grep shows of a matching line: all of a short one, a window of a long one around the match."""
    if len(line) <= LINE:
        return [n, line]
    start = max(0, min(at - LINE // 4, len(line) - LINE))
    # the byte where the window starts (invalid UTF-8 counted byte for byte, as Read counts it)
    byte = pos + len(raw.decode("utf-8", errors="surrogateescape")[:start].encode("utf-8", errors="surrogateescape"))
    return [n, len(line), start, line[start:start + LINE], byte]


def send(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    data = json.dumps(obj, ensure_ascii=False).encode("utf-8", errors="surrogatepass")
    pieces = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
    for i, piece in enumerate(pieces):
        mark = b"." if i == len(pieces) - 1 else b"+"
        if i == 0 and fds:
            socket.send_fds(sock, [mark + piece], fds)
        else:
            sock.sendall(mark + piece)


def recv(sock: socket.socket, deadline: float | None = None) -> tuple[Any, list[int]]:
    """One message and the descriptors sent with it; EOFError when the other side is gone.

    With ``deadline`` (a :func:`time.monotonic` time) a message not complete by then is a TimeoutError.
    """
    parts: list[bytes] = []
    fds: list[int] = []
    while True:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
        data, got, _flags, _addr = socket.recv_fds(sock, CHUNK + 1, 4)
        fds += got
        if not data:
            for fd in fds:
                os.close(fd)
            raise EOFError
        parts.append(data[1:])
        if data[:1] == b".":
            return json.loads(b"".join(parts).decode("utf-8", errors="surrogatepass")), fds


def _watch_parent(parent: int) -> None:
    # a parent that dies (even by SIGKILL) leaves this process to init: end it rather than match on for hours
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


def serve(fd: int) -> None:
    """The child's loop: compile the pattern it is sent, then scan each file whose descriptor comes."""
    import regex  # here, not at the top: the parent imports this module without needing it

    try:
        import resource
        _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = MEMORY if hard == resource.RLIM_INFINITY else min(MEMORY, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):
        pass
    sock = socket.socket(fileno=fd)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    rx: Any = None
    while True:
        try:
            msg, fds = recv(sock)
        except (EOFError, OSError):
            return
        if "pattern" in msg:
            try:
                rx = regex.compile(msg["pattern"])
            except (regex.error, ValueError, OverflowError, MemoryError, RecursionError) as exc:
                send(sock, {"error": str(exc) or type(exc).__name__})
            else:
                send(sock, {"ok": True})
            continue
        try:
            _scan_one(sock, rx, fds[0], bool(msg["keep"]))
        except MemoryError:
            send(sock, {"error": "the search ran out of memory"})


def _scan_one(sock: socket.socket, rx: Any, fd: int, keep: bool) -> None:
    matches = 0
    batch: list[Record] = []
    chars = 0

    def search(line: str) -> int | None:
        # concurrent: the GIL is let go while matching, so the parent watch above can still run
        m = rx.search(line, concurrent=True)
        return None if m is None else int(m.start())

    def emit(n: int, line: str, raw: bytes, at: int, pos: int) -> None:
        nonlocal matches, chars, keep, batch
        matches += 1
        if not keep:
            return
        rec = record(n, line, raw, at, pos)
        batch.append(rec)
        chars += len(rec[1] if len(rec) == 2 else rec[3]) + 16
        if chars >= BATCH:
            send(sock, {"recs": batch, "more": True})
            batch, chars = [], 0
            keep = bool(recv(sock)[0]["keep"])

    try:
        with open(fd, "rb") as fh:
            scan(fh, search, emit)
    except OSError:
        pass  # what was found before the error stands, as it always has
    send(sock, {"recs": batch, "matches": matches})


if __name__ == "__main__":
    # python -I drops the user's site-packages and $PYTHONPATH: import `regex` from where the parent does
    sys.path[:] = json.loads(sys.argv[2])
    serve(int(sys.argv[1]))
