"""Streamable HTTP MCP servers (docs/pieces.md#mcp-servers, docs/tools.md#mcp-tools): a server's ``url`` and
``headers`` as the piece gives them, their values read from the worker's environment, and the transport
:class:`~agentnb.tools.mcp.McpSession` connects with.

A header's value in the piece names the worker's environment variables; the value sent is read when the server
is connected and never stored (the piece keeps the names).  Standard library only at import: the ``mcp`` package
and its HTTP client are imported when a server is connected.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

__all__ = ["HEADER_REF", "RESERVED_HEADERS", "check_header_name", "check_header_value", "check_url",
           "header_values", "http_transport"]

# a ``${NAME}`` inside a header's value: the worker's variable NAME
HEADER_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_BARE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_UNSENDABLE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # what a header's value cannot hold (a tab it can)
_TOKEN = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,100}$")  # an HTTP header name (RFC 9110's token)
# headers the transport sets itself: one from the piece would break the protocol, not configure the server
RESERVED_HEADERS = ("accept", "connection", "content-length", "content-type", "host", "last-event-id",
                    "mcp-protocol-version", "mcp-session-id", "transfer-encoding")
_CONNECT_SECONDS = 30.0  # to open a connection (a server that is not there is refused long before)
_STREAM_SECONDS = 300.0  # the SDK's read timeout for a response stream; a longer call timeout raises it


def check_url(url: str) -> str | None:
    """Why ``url`` cannot be a server's address, or None: http or https with a host, and no credentials (the URL
    is stored with the piece; give secrets in ``headers``)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port that is not a number in range
    except ValueError as exc:
        return f"found {url!r}, which is not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
        return f"found {url!r}; allowed: an http:// or https:// URL with a host, e.g. http://127.0.0.1:8931/mcp"
    if parts.username is not None or parts.password is not None:
        return ("found credentials in the URL, which is stored with the piece; give them in headers, whose "
                "values name the worker's environment variables")
    return None


def check_header_name(name: str) -> str | None:
    """Why ``name`` cannot be a header the piece sets, or None."""
    if not _TOKEN.match(name):
        return f"found header name {name!r}; allowed: letters, digits and !#$%&'*+.^_`|~-"
    if name.lower() in RESERVED_HEADERS:
        return f"header {name!r} is set by the MCP transport itself; not allowed: {', '.join(RESERVED_HEADERS)}"
    return None


def check_header_value(value: str) -> str | None:
    """Why ``value`` cannot be a header's value, or None: a value names the worker's environment variables, as a
    bare NAME (the header is the variable's value) or as ``${NAME}`` inside text (``Bearer ${API_TOKEN}``)."""
    if _BARE_NAME.match(value):
        return None
    rest = HEADER_REF.sub("", value)
    if HEADER_REF.search(value) and "${" not in rest and "\n" not in value and "\r" not in value:
        return None
    return (f"found {value!r}; a header's value names the worker's environment variables: NAME (the header is "
            "the variable's value) or text with ${NAME} in it, e.g. 'Bearer ${API_TOKEN}' (values are never stored)")


def header_values(headers: Iterable[tuple[str, str]], environ: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """The headers to send, read from ``environ`` now; or why not, naming the header and the variable, never the
    value (``"headers.Authorization names the worker's variable 'API_TOKEN', which is not set"``)."""
    out: dict[str, str] = {}
    for name, value in headers:
        refs = [value] if _BARE_NAME.match(value) else HEADER_REF.findall(value)
        for ref in refs:
            if ref not in environ:
                return {}, f"headers.{name} names the worker's variable {ref!r}, which is not set"
            if _UNSENDABLE.search(environ[ref]):
                # the HTTP client would refuse it with an error that quotes the value
                return {}, f"headers.{name} names the worker's variable {ref!r}, whose value has a line break or " \
                           "another control character, which a header cannot hold"
        out[name] = environ[value] if _BARE_NAME.match(value) else HEADER_REF.sub(lambda m: environ[m.group(1)], value)
    return out, None


@asynccontextmanager
async def http_transport(url: str, headers: dict[str, str], call_timeout: float,
                         on_refusal: Callable[[str], None]) -> AsyncIterator[Any]:
    """The ``mcp`` package's Streamable HTTP transport to ``url``, sending ``headers`` with every request, whose
    response streams may stay silent for a whole call (``call_timeout``; the session cancels a call past it).

    The SDK turns an HTTP error into "Server returned an error response"; ``on_refusal`` is told the status
    (``"HTTP 401 Unauthorized"``), which says what went wrong (a wrong token, a wrong path, not an MCP server)."""
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    async def seen(response: Any) -> None:
        # a message's POST only: a server without the optional GET stream answers that one 405, which is no fault
        if response.status_code >= 400 and response.request.method == "POST":
            on_refusal(f"HTTP {response.status_code} {response.reason_phrase}".strip())

    timeout = httpx2.Timeout(_CONNECT_SECONDS, read=max(_STREAM_SECONDS, call_timeout + 30))
    async with httpx2.AsyncClient(headers=headers, timeout=timeout, event_hooks={"response": [seen]}) as http, \
            streamable_http_client(url, http_client=http) as streams:
        yield streams
