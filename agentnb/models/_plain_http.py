"""A chat-completion POST to an ``http://`` endpoint over kept-alive HTTP/1.1 connections (models/_http1.py), below
httpx, with no need of the ``openai`` SDK.

The ``openai`` SDK's ``client.post`` goes through its request options, httpx's request and client layers, httpcore's
pool and h11: about 1.3 ms of CPU per call against an endpoint 50 ms away, where the same request written to a
kept socket and its answer read back costs about a tenth of that (benchmarks/README.md, "CPU per LLM call").
And a process that imports the SDK spends 0.4-0.8 s of CPU on it (its ``openai.types`` tree of pydantic models),
which every worker process paid before its first call.  So a call to an ``http://`` endpoint (a local server, a
gateway on the same network) is sent here: the same bytes the SDK sends (its headers, built by
:func:`sdk_headers` as its client builds them, and its JSON encoding), the same exception classes for the same
failures (:func:`status_error` builds the SDK's error for a status, with its message; the SDK is imported then,
on the first failure), read with the same timeout per socket operation.  Anything else keeps the SDK's path
(:func:`plain_post_for` says which): ``https://``, a proxy in the environment, a URL with credentials, a query or
a path with characters a URL must quote, ``OPENAI_CUSTOM_HEADERS`` (the SDK's own parsing of it is kept), headers
that are not ASCII, a redirect (the call is asked again through the SDK), or ``AGENTNB_OPENAI_HTTP=sdk``
(docs/models.md#plain-http).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import platform
import re
import sys
import urllib.request
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

from .._sockets import has_input
from ._http1 import BodyBroken, Connection, Head

__all__ = ["HTTP_ENV", "PlainPost", "Redirected", "Reply", "body_chunks", "encode_body", "inflating", "plain_post_for",
           "sdk_headers", "sdk_http", "status_error"]

HTTP_ENV = "AGENTNB_OPENAI_HTTP"  # "sdk": every call through the openai SDK's own HTTP stack
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


def plain_post_for(base_url: str, api_key: str, timeout: float) -> PlainPost | None:
    """The socket path for chat completions at ``base_url`` with ``api_key``, or None where the SDK's own path is
    kept."""
    if os.environ.get(HTTP_ENV, "").strip().lower() == "sdk":
        return None
    url = base_url.strip().rstrip("/") + "/chat/completions"
    parts = urlsplit(url)
    if parts.scheme.lower() != "http" or not parts.hostname or "@" in parts.netloc or parts.query or parts.fragment:
        return None  # https, or a URL httpx reads more into (credentials in it, a query the SDK merges its own way)
    if not _PLAIN_PATH.fullmatch(parts.path) or not _PLAIN_NETLOC.fullmatch(parts.netloc):
        return None  # httpx quotes such a URL in its own way
    proxies = urllib.request.getproxies()
    if ("http" in proxies or "all" in proxies) and not urllib.request.proxy_bypass(parts.hostname):
        return None  # httpx would go through the proxy (trust_env)
    headers = sdk_headers(api_key, timeout)
    if headers is None or not all(k.isascii() and v.isascii() and "\n" not in k + v and "\r" not in k + v
                                  for k, v in headers.items()):
        return None  # httpx refuses such a header with its own error: keep that
    netloc = parts.netloc.lower()
    if parts.port == 80:
        netloc = netloc.rpartition(":")[0]  # as httpx writes the URL and its Host header: no default port
    return PlainPost(f"http://{netloc}{parts.path}", headers, timeout)


# a URL's path and host as httpx sends them unchanged (anything else it would quote or refuse)
_PLAIN_PATH = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/]*(?:%[0-9A-Fa-f]{2}[A-Za-z0-9\-._~!$&'()*+,;=:@/]*)*")
_PLAIN_NETLOC = re.compile(r"(?:[A-Za-z0-9\-.]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")


def sdk_headers(api_key: str, timeout: float) -> dict[str, str] | None:
    """The headers the installed ``openai`` SDK's client sends with a chat completion, built as it builds them
    (``default_headers``, ``auth_headers`` and ``_build_headers`` of openai 3.x; tests/test_openai_http.py compares
    the two) without importing it; None when ``OPENAI_CUSTOM_HEADERS`` is set (its parsing stays the SDK's)."""
    if os.environ.get("OPENAI_CUSTOM_HEADERS") is not None:
        return None
    version = _sdk_version()
    headers = {"Authorization": f"Bearer {api_key}", "Accept": "application/json",
               "Content-Type": "application/json", "User-Agent": f"OpenAI/Python {version}",
               "X-Stainless-Lang": "python", "X-Stainless-Package-Version": version,
               "X-Stainless-OS": _os_name(), "X-Stainless-Arch": _arch(),
               "X-Stainless-Runtime": platform.python_implementation(),
               "X-Stainless-Runtime-Version": platform.python_version(), "X-Stainless-Async": "false"}
    for name, variable in (("OpenAI-Organization", "OPENAI_ORG_ID"), ("OpenAI-Project", "OPENAI_PROJECT_ID")):
        if os.environ.get(variable) is not None:
            headers[name] = os.environ[variable]
    headers["x-stainless-retry-count"] = "0"
    headers["x-stainless-read-timeout"] = str(timeout)
    return headers


def _sdk_version() -> str:
    """The installed SDK's version, read from its package metadata (importing it is what this module avoids)."""
    from importlib import metadata

    return metadata.version("openai")


_BSDS = {"freebsd": "FreeBSD", "openbsd": "OpenBSD"}
_ARCHS = {"arm64": "arm64", "aarch64": "arm64", "arm": "arm", "x86_64": "x64"}


def _os_name() -> str:
    """The SDK's ``X-Stainless-OS`` (its ``get_platform``, tested in the same order)."""
    try:
        system = platform.system().lower()
        name = platform.platform().lower()
    except Exception:
        return "Unknown"
    if "iphone" in name or "ipad" in name:
        return "iOS"
    if system in ("darwin", "windows"):
        return "MacOS" if system == "darwin" else "Windows"
    if "android" in name:
        return "Android"
    if system in _BSDS:
        return _BSDS[system]
    if system == "linux":
        try:
            distro = platform.freedesktop_os_release().get("ID", "").lower()
        except OSError:
            distro = ""
        return _BSDS.get(distro, "Linux")
    return f"other:{name}" if name else "Unknown"


def _arch() -> str:
    """The SDK's ``X-Stainless-Arch`` (its ``get_architecture``)."""
    try:
        machine = platform.machine().lower()
    except Exception:
        return "unknown"
    if machine in _ARCHS:
        return _ARCHS[machine]
    if sys.maxsize <= 2**32:
        return "x32"
    return f"other:{machine}" if machine else "unknown"


def sdk_http() -> Any:
    """The HTTP library the installed openai SDK's client is built on (``httpx2`` in recent SDKs, ``httpx`` before),
    whose request and response its errors carry; imports the SDK."""
    import openai

    base = next(c for c in openai.DefaultHttpxClient.__mro__ if c.__name__ == "Client")
    return importlib.import_module(base.__module__.partition(".")[0])


class PlainPost:
    """POSTs to one URL over HTTP/1.1 (models/_http1.py), each connection kept for the next call (any thread's) when
    the answer allows."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float) -> None:
        parts = urlsplit(url)
        self.url = url
        self.host, self.port = parts.hostname or "", parts.port or 80
        self.timeout = timeout
        sent = {"Host": parts.netloc, "Accept-Encoding": "gzip, deflate", "Connection": "keep-alive", **headers}
        # the request's head is the same for every call but its length: built once
        lines = [f"POST {parts.path or '/'} HTTP/1.1", *(f"{k}: {v}" for k, v in sent.items()), "Content-Length: "]
        self.start = "\r\n".join(lines).encode("ascii")
        self.idle: deque[Connection] = deque()
        _pools.append(self)

    def post(self, body: bytes) -> Reply:
        """The answer to ``body``; the SDK's ``APITimeoutError`` or ``APIConnectionError`` when there is none, its
        status error for a status ≥ 400, :class:`Redirected` for a 3xx."""
        conn, head = self.open(body)
        return self.read(conn, head)

    def open(self, body: bytes, on_socket: Any = None) -> tuple[Connection, Head]:
        """Send ``body`` and wait for the answer's status and headers only (a streamed answer's body is read by the
        caller, then handed back with :meth:`finish`); ``on_socket(sock)`` is told the connection's socket before
        the request goes out (the watchdog cuts it on a Stop).  The errors of :meth:`post`; a status ≥ 300 is read
        whole and raised here as there."""
        conn = self._connection()
        head: Head | None = None
        try:
            with self._sdk_errors():
                if conn is None:
                    conn = Connection.to(self.host, self.port, self.timeout)
                if on_socket is not None:
                    on_socket(conn.sock)
                conn.sock.sendall(b"%s%d\r\n\r\n%s" % (self.start, len(body), body))
                head = conn.head()
        finally:
            if head is None and conn is not None:
                conn.close()  # a failed or cut off (Ctrl-C) exchange leaves nothing to reuse
        if head.status >= 300:
            reply = self.read(conn, head)
            if reply.status_code >= 400:
                raise status_error(reply, self.request())
            raise Redirected(reply.headers.get("location", ""))
        return conn, head

    def read(self, conn: Connection, head: Head) -> Reply:
        """The rest of the answer of ``head``, whole and decoded; its connection kept for the next call or closed."""
        try:
            with self._sdk_errors():
                content = conn.body(head)
                reply = Reply(head.status, head.headers, _decoded(content, head.get("content-encoding")))
        except BaseException:
            conn.close()  # cut off in the middle of the body (or it does not decode): nothing to reuse
            raise
        self.finish(conn, head)
        return reply

    @contextlib.contextmanager
    def _sdk_errors(self) -> Iterator[None]:
        """A failed exchange as the SDK's ``APITimeoutError`` or ``APIConnectionError`` (the SDK imported only then)."""
        try:
            yield
        except TimeoutError:
            import openai

            raise openai.APITimeoutError(request=self.request()) from None
        except (OSError, ValueError, BodyBroken):
            import openai

            raise openai.APIConnectionError(request=self.request()) from None

    def finish(self, conn: Connection, head: Head) -> None:
        """Keep ``conn`` for the next call when ``head``'s answer was read to its end and the server keeps it open."""
        if conn.reusable(head) and len(self.idle) < KEEP_IDLE:
            self.idle.append(conn)
        else:
            conn.close()

    def _connection(self) -> Connection | None:
        """An idle connection the server has not closed meanwhile, or None (a new one is opened)."""
        while True:
            try:
                conn = self.idle.pop()
            except IndexError:
                return None
            if not has_input(conn.sock):
                return conn
            conn.close()  # closed by the server (or bytes nobody asked for): not reusable

    def request(self) -> Any:
        """The request an SDK error about this call carries (an httpx request of this URL)."""
        return sdk_http().Request("POST", self.url)


def body_chunks(conn: Connection, head: Head) -> Iterator[bytes]:
    """A streamed answer's body as it arrives (unchunked; gzip or deflate undone as it comes)."""
    undo = _undoer(head.get("content-encoding"))
    for data in conn.chunks(head):
        if undo is not None:
            data = undo(data)
        if data:
            yield data


def inflating(take: Callable[[bytes], bool], encoding: str | None) -> Callable[[bytes], bool]:
    """``take`` (a stream pump's sink) given a body of content ``encoding`` as it was before it (gzip or deflate
    undone as it comes)."""
    undo = _undoer(encoding)
    if undo is None:
        return take

    def sink(data: bytes) -> bool:
        data = undo(data)
        return bool(data) and take(data)

    return sink


def _undoer(encoding: str | None) -> Callable[[bytes], bytes] | None:
    """What undoes a body's content ``encoding`` piece by piece (gzip or deflate); None for any other."""
    encoding = (encoding or "").strip().lower()
    if encoding not in _COMPRESSED:
        return None
    inflate: Any = None

    def undo(data: bytes) -> bytes:
        nonlocal inflate
        if inflate is None:
            inflate = zlib.decompressobj(_wbits(encoding, data))
        return bytes(inflate.decompress(data))

    return undo


_COMPRESSED = ("gzip", "x-gzip", "deflate")  # the content encodings undone here


def _wbits(encoding: str, head: bytes) -> int:
    """zlib's ``wbits`` for a body of ``encoding`` starting with ``head``: gzip or zlib by their headers (47), or a
    raw deflate stream, as some servers send "deflate" (-15)."""
    return 47 if encoding != "deflate" or head[:1] == b"\x78" else -15


def _decoded(content: bytes, encoding: str) -> bytes:
    """The body as sent before its content encoding (gzip or deflate)."""
    encoding = encoding.strip().lower()
    if encoding not in _COMPRESSED or not content:
        return content
    try:
        return zlib.decompress(content, _wbits(encoding, content))
    except zlib.error:
        raise BodyBroken(f"the {encoding} body does not decode") from None


def status_error(reply: Reply, request: Any) -> Exception:
    """The SDK's exception for an HTTP error, with the message and body it gives them
    (``_make_status_error_from_response`` and ``OpenAI._make_status_error`` in openai 3.x)."""
    import openai

    # the body is decoded already: the response must not decode it again
    headers = [(k, v) for k, v in reply.headers.items() if k != "content-encoding"]
    response = sdk_http().Response(reply.status_code, headers=headers, content=reply.content, request=request)
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
