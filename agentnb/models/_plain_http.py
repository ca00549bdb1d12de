"""A plain (not streamed) chat-completion POST to an ``http://`` endpoint over kept-alive sockets, below httpx.

The ``openai`` SDK's ``client.post`` goes through its request options, httpx's request and client layers, httpcore's
pool and h11: about 1.3 ms of CPU per call against an endpoint 50 ms away, where writing the same request to a kept
socket and reading the answer back takes about 0.15 ms (benchmarks/README.md, "CPU per LLM call").  So a plain call
to an ``http://`` endpoint (a local server, a gateway on the same network) is sent here: the same bytes the SDK
sends (its own headers, read from the client once, and its JSON encoding), the same exception classes for the
same failures (:func:`status_error` builds the SDK's error for a status, with its message), read with the same
timeout per socket operation.  Anything else keeps the SDK's path (:func:`plain_post_for` says which): ``https://``,
a proxy in the environment, a URL with credentials or a query, headers that are not ASCII, a redirect (the call is
asked again through the SDK), or ``AGENTNB_OPENAI_HTTP=sdk`` (docs/models.md#plain-http).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import urllib.request
import zlib
from collections import deque
from typing import Any
from urllib.parse import urlsplit

__all__ = ["HTTP_ENV", "PlainPost", "Redirected", "Reply", "encode_body", "plain_post_for", "status_error"]

HTTP_ENV = "AGENTNB_OPENAI_HTTP"  # "sdk": every call through the openai SDK's own HTTP stack
MAX_HEAD = 256 * 1024  # a status line and headers longer than this are not an HTTP answer
KEEP_IDLE = 512  # idle connections kept per endpoint, as models/openai.py's KEEPALIVE_CONNECTIONS

_pools: list[PlainPost] = []  # every endpoint's idle sockets, dropped in a forked child (they are the parent's)


def _forked() -> None:
    for pool in _pools:
        pool.idle = deque()


def _close_idle() -> None:
    """At exit: the idle connections closed, not left to the garbage collector (a ResourceWarning each)."""
    for pool in _pools:
        while pool.idle:
            pool.idle.pop().close()


os.register_at_fork(after_in_child=_forked)
atexit.register(_close_idle)


class Redirected(Exception):
    """A 3xx answer: the SDK's client follows redirects, so the call is asked again through it."""


class Reply:
    """An answer: what ``_parse_completion`` reads of an httpx response (``text``, ``headers``)."""

    __slots__ = ("content", "headers", "status_code")

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code = status_code
        self.headers = headers  # names in lower case
        self.content = content

    @property
    def text(self) -> str:
        # as httpx decodes it: the content type's charset, else UTF-8, bad bytes replaced
        charset = "utf-8"
        for part in self.headers.get("content-type", "").split(";")[1:]:
            key, _, value = part.strip().partition("=")
            if key.lower() == "charset" and value.strip('"\' '):
                charset = value.strip('"\' ')
        try:
            return self.content.decode(charset, errors="replace")
        except LookupError:
            return self.content.decode("utf-8", errors="replace")


def encode_body(body: dict[str, Any]) -> bytes:
    """``body`` as the SDK encodes a JSON request (``openai._utils.openapi_dumps``, for plain values)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def plain_post_for(client: Any, timeout: float, http: Any) -> PlainPost | None:
    """The socket path for the SDK ``client``'s chat completions, or None where the SDK's own path is kept;
    ``http``: the SDK's HTTP library (httpx or httpx2), whose request and response its errors carry."""
    if os.environ.get(HTTP_ENV, "").strip().lower() == "sdk":
        return None
    url = str(client.base_url).rstrip("/") + "/chat/completions"
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or "@" in parts.netloc or parts.query or parts.fragment:
        return None  # https, or a URL httpx reads more into (credentials in it, a query the SDK merges its own way)
    proxies = urllib.request.getproxies()
    if ("http" in proxies or "all" in proxies) and not urllib.request.proxy_bypass(parts.hostname):
        return None  # httpx would go through the proxy (trust_env)
    # what the SDK sends with every request (_build_headers): its defaults, the key, the retry count and timeout
    headers = {**client.default_headers, **client.auth_headers, "x-stainless-retry-count": "0",
               "x-stainless-read-timeout": str(timeout)}
    sent = {k: v for k, v in headers.items() if isinstance(v, str)}  # the SDK's Omit() drops a header
    if not all(k.isascii() and v.isascii() and "\n" not in k + v and "\r" not in k + v for k, v in sent.items()):
        return None  # httpx refuses such a header with its own error: keep that
    return PlainPost(url, sent, timeout, http)


class PlainPost:
    """POSTs to one URL over HTTP/1.1, each connection kept for the next call (any thread's) when the answer allows."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float, http: Any) -> None:
        parts = urlsplit(url)
        self.http = http
        self.url = url
        self.address = (parts.hostname or "", parts.port or 80)
        self.timeout = timeout
        target = parts.path or "/"
        lines = [f"POST {target} HTTP/1.1", f"Host: {parts.netloc}", "Accept-Encoding: gzip, deflate",
                 "Connection: keep-alive", *(f"{k}: {v}" for k, v in headers.items())]
        self.head = ("\r\n".join(lines) + "\r\nContent-Length: ").encode("ascii")
        self.idle: deque[socket.socket] = deque()
        _pools.append(self)

    def post(self, body: bytes) -> Reply:
        """The answer to ``body``; the SDK's ``APITimeoutError`` or ``APIConnectionError`` when there is none, its
        status error for a status ≥ 400, :class:`Redirected` for a 3xx."""
        import openai

        sock = self._connection()
        reply: Reply | None = None
        try:
            if sock is None:
                sock = socket.create_connection(self.address, timeout=self.timeout)
            sock.sendall(self.head + b"%d\r\n\r\n" % len(body) + body)
            reply, keep = _read(sock)
        except TimeoutError:
            raise openai.APITimeoutError(request=self._request()) from None
        except (OSError, _Broken):
            raise openai.APIConnectionError(request=self._request()) from None
        finally:
            if sock is not None and (reply is None or not keep or len(self.idle) >= KEEP_IDLE):
                sock.close()  # a failed, cut off (Ctrl-C) or closing exchange leaves nothing to reuse
            elif sock is not None:
                self.idle.append(sock)
        if reply.status_code >= 400:
            raise status_error(reply, self._request(), self.http)
        if reply.status_code >= 300:
            raise Redirected(reply.headers.get("location", ""))
        return reply

    def _connection(self) -> socket.socket | None:
        """An idle connection the server has not closed meanwhile, or None (a new one is opened)."""
        while True:
            try:
                sock = self.idle.pop()
            except IndexError:
                return None
            if not _readable(sock):
                return sock
            sock.close()  # closed by the server (or bytes nobody asked for): not reusable

    def _request(self) -> Any:
        return self.http.Request("POST", self.url)


def _readable(sock: socket.socket) -> bool:
    """Whether an idle connection has something to read: the server's close (or bytes nobody asked for)."""
    try:
        if hasattr(select, "poll"):  # select.select fails on descriptors past 1024
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return bool(poller.poll(0))
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True


class _Broken(Exception):
    """Not an HTTP answer, or the connection closed before the answer's end."""


def _read(sock: socket.socket) -> tuple[Reply, bool]:
    """One answer from ``sock`` (after any 1xx): the reply, and whether the connection can be kept."""
    buf = b""
    while True:
        end = buf.find(b"\r\n\r\n")
        while end < 0:
            if len(buf) > MAX_HEAD:
                raise _Broken("the answer's headers are too long")
            data = sock.recv(65536)
            if not data:
                raise _Broken("the server closed the connection without sending a complete answer")
            buf += data
            end = buf.find(b"\r\n\r\n")
        head, buf = buf[:end].decode("latin-1").split("\r\n"), buf[end + 4:]
        version, _, rest = head[0].partition(" ")
        try:
            status = int(rest[:3])
        except ValueError:
            raise _Broken(f"not an HTTP status line: {head[0][:80]!r}") from None
        if not version.startswith("HTTP/"):
            raise _Broken(f"not an HTTP status line: {head[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            headers[name] = f"{headers[name]}, {value.strip()}" if name in headers else value.strip()
        if not 100 <= status < 200:
            break
    connection = headers.get("connection", "").lower()
    keep = ("close" not in connection) if version == "HTTP/1.1" else ("keep-alive" in connection)
    if status in (204, 304):
        content = b""
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        content, buf = _unchunk(sock, buf)
    elif "content-length" in headers:
        try:
            length = int(headers["content-length"].split(",")[0])
        except ValueError:
            raise _Broken(f"content-length {headers['content-length'][:40]!r}") from None
        parts, have = [buf], len(buf)
        while have < length:
            data = sock.recv(max(65536, length - have))
            if not data:
                raise _Broken("the server closed the connection before the answer's end")
            parts.append(data)
            have += len(data)
        whole = b"".join(parts)
        content, buf = whole[:length], whole[length:]
    else:  # the body ends when the connection does
        parts = [buf]
        while data := sock.recv(65536):
            parts.append(data)
        content, buf, keep = b"".join(parts), b"", False
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding in ("gzip", "deflate", "x-gzip"):
        try:  # gzip or zlib by their headers (wbits 47); a raw deflate stream as some servers send it
            if content:
                content = zlib.decompress(content, 47 if encoding != "deflate" or content[:1] == b"\x78" else -15)
        except zlib.error:
            raise _Broken(f"the {encoding} body does not decode") from None
    return Reply(status, headers, content), keep and not buf


def _unchunk(sock: socket.socket, buf: bytes) -> tuple[bytes, bytes]:
    """A chunked body from ``buf`` and then ``sock``: the body and the bytes after it."""
    out: list[bytes] = []
    while True:
        line_end = buf.find(b"\r\n")
        while line_end < 0:
            buf = _more(sock, buf)
            line_end = buf.find(b"\r\n")
        try:
            size = int(buf[:line_end].split(b";")[0].strip(), 16)
        except ValueError:
            raise _Broken("a chunk size that is not hexadecimal") from None
        buf = buf[line_end + 2:]
        if size == 0:
            trailer = buf.find(b"\r\n\r\n") if not buf.startswith(b"\r\n") else -2
            while trailer == -1:
                buf = _more(sock, buf)
                trailer = buf.find(b"\r\n\r\n") if not buf.startswith(b"\r\n") else -2
            return b"".join(out), buf[2:] if trailer == -2 else buf[trailer + 4:]
        while len(buf) < size + 2:
            buf = _more(sock, buf)
        out.append(buf[:size])
        buf = buf[size + 2:]


def _more(sock: socket.socket, buf: bytes) -> bytes:
    data = sock.recv(65536)
    if not data:
        raise _Broken("the server closed the connection in the middle of a chunked body")
    return buf + data


def status_error(reply: Reply, request: Any, http: Any) -> Exception:
    """The SDK's exception for an HTTP error, with the message and body it gives them
    (``_make_status_error_from_response`` and ``OpenAI._make_status_error`` in openai 3.x)."""
    import openai

    # the body is decoded already: the response must not decode it again
    headers = [(k, v) for k, v in reply.headers.items() if k != "content-encoding"]
    response = http.Response(reply.status_code, headers=headers, content=reply.content, request=request)
    message = f"Error code: {reply.status_code}"
    text = response.text.strip()
    body: Any = text
    try:
        body = json.loads(text)
    except Exception:
        pass
    else:
        error = body.get("error", body) if isinstance(body, dict) else None
        said = error.get("message") if isinstance(error, dict) else None
        if isinstance(said, str) and said:
            message += f" - {said}"
    data = body.get("error", body) if isinstance(body, dict) else body
    kind = {400: openai.BadRequestError, 401: openai.AuthenticationError, 403: openai.PermissionDeniedError,
            404: openai.NotFoundError, 409: openai.ConflictError, 422: openai.UnprocessableEntityError,
            429: openai.RateLimitError}.get(reply.status_code)
    if kind is None:
        kind = openai.InternalServerError if reply.status_code >= 500 else openai.APIStatusError
    return kind(message, response=response, body=data)
