"""HTTP/1.1 on a kept-alive socket: a request written in one send, an answer's status line and headers split here,
its body read by its framing (content-length, chunked, or to the connection's close).

This is the wire of a plain ``http://`` call (models/_plain_http.py) and of a streamed one (the chunked framing,
:class:`Unchunker`, is also what the stream pump and the httpx path undo).  The standard library's
``http.client`` did this before and costs about 0.3–0.45 ms more CPU a call, a fifth of a call at concurrency 1
(benchmarks/README.md, "CPU per LLM call"): its request goes through 17 ``putheader`` checks and two sends, its
answer's headers through ``email.parser``.  Here the request's head is built once per endpoint, and an answer is
read with as few ``recv`` calls as it came in.

What it reads: an interim 1xx answer (skipped), a status line of HTTP/1.0 or 1.1, header lines ended by CRLF or a
bare LF (a folded continuation joins the field before it, a repeated field is joined with commas as httpx does),
a body by ``content-length``, ``transfer-encoding: chunked`` (extensions and trailers read past), or up to the
close.  What it refuses with :class:`BodyBroken` (one line, which the caller reports as the SDK's connection
error): a first line that is not an HTTP/1.x status, headers past 64 KiB or 100 fields, a content-length that is
not a number, a chunked framing that breaks, and a connection that ends before the answer's end.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

__all__ = ["MAX_CHUNK_LINE", "BodyBroken", "Connection", "Head", "Unchunker"]

# the largest chunk-size line (with its extensions) read before the framing is called broken
MAX_CHUNK_LINE = 4096
# an answer's status line and headers: at most this many bytes and fields (http.client's limits)
MAX_HEAD = 65536
MAX_FIELDS = 100
_READ = 65536


class BodyBroken(Exception):
    """The answer breaks HTTP/1.1's framing, or its connection failed or closed before the answer's end."""


class Unchunker:
    """A ``transfer-encoding: chunked`` body's framing undone as its bytes arrive, cut anywhere: :meth:`feed`
    returns the body's bytes in what it is given; at the last chunk's end (after its trailer lines, which are
    dropped, as httpx drops them) ``ended`` is set and any bytes after it are in ``extra``.  ``owed``: bytes of
    the CRLF after a chunk's data that are still to come (a body taken over in the middle)."""

    __slots__ = ("crlf", "ended", "extra", "held", "left", "trailer")

    def __init__(self, owed: int = 0) -> None:
        self.held = b""  # the start of a chunk-size (or trailer) line whose end has not come yet
        self.left = 0  # data bytes of the current chunk still to come
        self.crlf = owed
        self.trailer = False  # after the last chunk (size 0): trailer lines until an empty one
        self.ended = False
        self.extra = b""

    def feed(self, data: bytes) -> bytes:
        buf = self.held + data if self.held else data
        self.held = b""
        pos, end, out = 0, len(buf), []
        while pos < end:
            if self.left:
                n = min(self.left, end - pos)
                out.append(buf[pos:pos + n] if n != end else buf)
                pos += n
                self.left -= n
                self.crlf = 0 if self.left else 2
                continue
            if self.crlf:
                n = min(self.crlf, end - pos)
                if buf[pos:pos + n] != b"\r\n"[2 - self.crlf:2 - self.crlf + n]:
                    raise BodyBroken(f"malformed chunked body: no CRLF after a chunk: {buf[pos:pos + 8]!r}")
                pos += n
                self.crlf -= n
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if end - pos > MAX_CHUNK_LINE:
                    raise BodyBroken("malformed chunked body: a chunk-size line too long")
                self.held = buf[pos:]
                break
            line = buf[pos:eol]
            pos = eol + 2
            if self.trailer:
                if line:
                    continue  # a trailer field
                self.ended = True
                self.extra = buf[pos:]
                break
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                size = -1
            if size < 0:
                raise BodyBroken(f"malformed chunked body: a chunk-size line {line[:40]!r}")
            self.trailer = size == 0
            if size and buf[pos + size:pos + size + 2] == b"\r\n":  # the whole chunk is here: one turn, not three
                out.append(buf[pos:pos + size])
                pos += size + 2
                continue
            self.left = size
        return out[0] if len(out) == 1 else b"".join(out)


class Head:
    """An answer's status and headers (names in lower case, a repeated field joined with commas), and how its body
    is framed: ``chunked``, else ``length`` bytes, else (``length`` None) up to the connection's close.  ``keep``:
    the server lets the connection be used again once the body is read; ``ended``: the body has been read to its
    end."""

    __slots__ = ("chunked", "ended", "headers", "keep", "length", "status")

    def __init__(self, status: int, headers: dict[str, str], *, http10: bool) -> None:
        self.status = status
        self.headers = headers
        self.ended = False
        coding = headers.get("transfer-encoding", "")
        self.chunked = False
        self.length: int | None = None
        if status < 200 or status in (204, 304):
            self.length = 0
        elif coding:
            # chunked last: its framing ends the body; any other transfer coding runs to the close (RFC 9112 6.3)
            self.chunked = coding.rsplit(",", 1)[-1].strip().lower() == "chunked"
        elif "content-length" in headers:
            sizes = {v.strip() for v in headers["content-length"].split(",")}
            size = sizes.pop() if len(sizes) == 1 else ""
            if not (size.isascii() and size.isdigit()):  # isdigit alone takes "²", which int() refuses
                raise BodyBroken(f"the answer's content-length is not a number: {headers['content-length'][:40]!r}")
            self.length = int(size)
        tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        framed = self.chunked or self.length is not None
        self.keep = framed and ("keep-alive" in tokens if http10 else "close" not in tokens)

    def get(self, name: str, default: str = "") -> str:
        return self.headers.get(name, default)


class Connection:
    """A socket to one server and the bytes read from it that no answer has taken yet."""

    __slots__ = ("buf", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    @classmethod
    def to(cls, host: str, port: int, timeout: float) -> Connection:
        sock = socket.create_connection((host, port), timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a request is one send: nothing to coalesce
        return cls(sock)

    def close(self) -> None:
        self.sock.close()

    def reusable(self, head: Head) -> bool:
        """Whether the next request may go on this connection: ``head``'s body was read to its end, the server
        keeps the connection open, and nothing came after the answer."""
        return head.ended and head.keep and not self.buf and self.sock.fileno() >= 0

    def _recv(self, what: str) -> bytes:
        data = self.sock.recv(_READ)
        if not data:
            raise BodyBroken(f"the connection closed before {what}")
        return data

    def head(self) -> Head:
        """The next answer's status and headers (an interim 1xx answer skipped); the body is left to read."""
        while True:
            head = self._head()
            if head.status >= 200 or head.status == 101:
                return head

    def _head(self) -> Head:
        buf, start = self.buf, 0
        while True:
            crlf, lf = buf.find(b"\n\r\n", start), buf.find(b"\n\n", start)
            end = min(crlf, lf) if crlf >= 0 and lf >= 0 else max(crlf, lf)
            if end > MAX_HEAD or (end < 0 and len(buf) > MAX_HEAD):
                raise BodyBroken(f"the answer's headers pass {MAX_HEAD} bytes")
            if end >= 0:
                break
            start = max(0, len(buf) - 2)
            buf += self._recv("the answer's headers" if buf else "an answer")
        self.buf = buf[end + (3 if end == crlf else 2):]
        lines = buf[:end].decode("latin-1").split("\n")
        if len(lines) > MAX_FIELDS + 1:
            raise BodyBroken(f"the answer has more than {MAX_FIELDS} header fields")
        first = lines[0].rstrip("\r")
        version, _, rest = first.partition(" ")
        code = rest[:3]
        if version not in ("HTTP/1.1", "HTTP/1.0") or not (code.isdigit() and rest[3:4] in ("", " ")):
            raise BodyBroken(f"not an HTTP/1.x answer: {first[:40]!r}")
        headers: dict[str, str] = {}
        name = ""
        for line in lines[1:]:
            line = line.rstrip("\r")
            if line[:1] in (" ", "\t"):  # an obsolete folded continuation of the field before
                if name:
                    headers[name] = f"{headers[name]} {line.strip()}".strip()
                continue
            field, sep, value = line.partition(":")
            name = field.strip().lower()
            if not sep or not name:
                raise BodyBroken(f"a malformed header line in the answer: {line[:40]!r}")
            value = value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        return Head(int(code), headers, http10=version == "HTTP/1.0")

    def body(self, head: Head) -> bytes:
        """``head``'s body, whole (still in its content encoding)."""
        if head.length is not None:
            buf, need = self.buf, head.length
            if len(buf) < need:
                parts, have = [buf], len(buf)
                while have < need:
                    data = self._recv("the answer's end")
                    parts.append(data)
                    have += len(data)
                buf = b"".join(parts)
            body, self.buf = buf[:need], buf[need:]
            head.ended = True
            return body
        return b"".join(self.chunks(head))

    def chunks(self, head: Head) -> Iterator[bytes]:
        """``head``'s body as its bytes arrive (the chunked framing undone), until its end."""
        if head.length is not None:
            if head.length:
                yield self.body(head)
            head.ended = True
            return
        data, self.buf = self.buf, b""
        if not head.chunked:  # up to the close
            while True:
                if data:
                    yield data
                data = self.sock.recv(_READ)
                if not data:
                    head.ended = True
                    return
        unchunk = Unchunker()
        while True:
            out = unchunk.feed(data) if data else b""
            if out:
                yield out
            if unchunk.ended:
                self.buf = unchunk.extra
                head.ended = True
                return
            data = self._recv("the answer's end")

    def taken(self) -> bytes:
        """The bytes read past the last answer's headers, taken off the connection (a caller that reads the body
        from the socket itself starts with them)."""
        data, self.buf = self.buf, b""
        return data
