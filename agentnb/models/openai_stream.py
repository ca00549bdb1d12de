"""A streamed Chat Completions answer (docs/models.md#streaming): its chunks added up, and the watchdog that cuts
a stream off when its job is stopped or it stalls.

:class:`Assembly` turns ``chat.completion.chunk`` objects (text deltas; tool-call deltas by ``index``: id and name
first, then argument fragments, several calls interleaved; usage in the last chunk) into the same message a
non-streamed answer holds, so ``models/openai.py`` builds the response from it with the code that reads a whole
answer, and the stored ``llm_response`` is the same either way.

:class:`SSEDecoder` splits the event stream's bytes into each event's data, more cheaply than the SDK's decoder;
:func:`chunked_body` reads a chunked HTTP/1.1 body straight from its connection, below httpx's per-chunk machinery.

The model's thread reads the stream; while it is blocked in a read, only another thread can end that read at
once.  :data:`WATCHDOG`, one thread for the process, wakes every few hundredths of a second while calls are open
(streamed ones, and plain ones that a Stop may cut), and shuts down the socket of one whose job's Stop is set or
that sent nothing for its read timeout (a streamed one): the
blocked read returns, and the model raises ``CallCancelled`` or retries it as a timeout.  It watches a call from
before its request is sent: while the endpoint has not answered with headers yet there is no response to take
the socket from, so the connections of the shared clients note which thread wrote a request on them
(:func:`track_sockets`).
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ._http1 import BodyBroken, Unchunker
from .base import ModelError
from .messages import Delta

__all__ = ["WATCHDOG", "Assembly", "BodyBroken", "BodyTimeout", "SSEDecoder", "Watch", "Watchdog", "chunked_body",
           "decode_all", "joined_text", "track_sockets"]

# how often the watchdog looks at the open streams: a Stop cuts a stream off within about this
POLL_S = 0.05
_SURROGATE = re.compile("[\ud800-\udfff]")


def joined_text(parts: list[str]) -> str:
    """The fragments of a text as one.  Each fragment is a JSON string of its own, so a character outside the BMP
    that a server split between two (``"\\ud83d"``, ``"\\ude00"``: each half a valid escape) comes as two lone
    surrogates: joined back into the character here, as a whole answer's JSON gives it; a half with no partner
    becomes U+FFFD (a lone surrogate is text that cannot be stored)."""
    text = "".join(parts)
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class Assembly:
    """The chunks of one streamed answer so far; :meth:`message` is the answer as a non-streamed call has it."""

    __slots__ = ("_by_id", "_held", "calls", "content", "finish_reason", "first_token", "head", "on_delta",
                 "saw_content", "spec", "started", "usage")

    def __init__(self, spec: str, on_delta: Callable[[Delta], None] | None, started: float) -> None:
        self.spec = spec
        self.on_delta = on_delta
        self.started = started
        self.content: list[str] = []
        self.saw_content = False  # a content field came, even "": the answer's content is text, not null
        self.calls: dict[int, dict[str, Any]] = {}  # index → {"id", "name", "arguments": [fragments]}
        self._by_id: dict[str, int] = {}
        self.usage: Any = None
        self.finish_reason: str | None = None
        self.first_token: float | None = None  # perf_counter of the first text or tool-call fragment
        self.head: dict[str, Any] = {}  # the first chunk's "id" and "model", as a whole answer's body has them
        self._held = ""  # the first half of a character split between two text fragments, not shown yet

    def _bad(self, what: str) -> ModelError:
        return ModelError(f"{self.spec}: malformed stream chunk: {what}")

    def add(self, chunk: Any, at: float | None = None) -> None:
        """Add one decoded chunk; a :class:`ModelError` (one line) when it is not a ``chat.completion.chunk``.
        ``at``: the ``perf_counter`` at which it arrived, when it is added later (else now)."""
        if not isinstance(chunk, dict):
            raise self._bad(f"a chunk is {_kind(chunk)}, not a JSON object")
        if not self.head:
            self.head = {k: chunk[k] for k in ("id", "model") if k in chunk}
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = chunk.get("choices")
        if choices is None:
            if usage is None:
                keys = ", ".join(sorted(map(str, chunk))[:8]) or "none"
                raise self._bad(f"a chunk has no choices (its keys: {keys})")
            return
        if not isinstance(choices, list):
            raise self._bad(f"choices is {_kind(choices)}, not a list")
        for choice in choices:
            if not isinstance(choice, dict):
                raise self._bad(f"a choice is {_kind(choice)}, not an object")
            if choice.get("index", 0) != 0:
                continue  # one answer is asked for (n=1)
            delta = choice.get("delta")
            if delta is not None:
                if not isinstance(delta, dict):
                    raise self._bad(f"choices[0].delta is {_kind(delta)}, not an object")
                self._delta(delta, at)
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])

    def _publish_text(self, text: str) -> None:
        """Hand a text fragment to ``on_delta`` as text a view can send on: a character split into two surrogate
        halves is held back until its second half (:func:`joined_text`)."""
        if self._held:
            text, self._held = self._held + text, ""
        if "\ud800" <= text[-1] <= "\udbff":
            text, self._held = text[:-1], text[-1]
        text = joined_text([text])
        if text and self.on_delta is not None:
            self.on_delta(Delta(text=text))

    def _delta(self, delta: dict[str, Any], at: float | None) -> None:
        if "content" in delta:
            text = delta["content"]
            if isinstance(text, list):  # content parts, as some compatible servers send
                text = "".join(p.get("text") or "" for p in text if isinstance(p, dict))
            if text is not None and not isinstance(text, str):
                raise self._bad(f"choices[0].delta.content is {_kind(text)}, not text")
            if text is not None:
                self.saw_content = True
                if text:
                    self.content.append(text)
                    self._token(at)
                    if self.on_delta is not None:
                        self._publish_text(text)
        raw = delta.get("tool_calls")
        if raw is None:
            return
        if not isinstance(raw, list):
            raise self._bad(f"choices[0].delta.tool_calls is {_kind(raw)}, not a list")
        for tc in raw:
            if not isinstance(tc, dict):
                raise self._bad(f"a tool-call delta is {_kind(tc)}, not an object")
            self._tool_delta(tc, at)

    def _tool_delta(self, tc: dict[str, Any], at: float | None) -> None:
        call_id = tc.get("id") or None
        index = tc.get("index")
        if isinstance(index, bool) or not isinstance(index, int):
            # no index (some compatible servers): a new id opens a call, else it goes on with the last one
            known = self._by_id.get(str(call_id)) if call_id else None
            index = known if known is not None else len(self.calls) if call_id or not self.calls else max(self.calls)
        fn = tc.get("function")
        fn = fn if isinstance(fn, dict) else {}
        name, args = fn.get("name"), fn.get("arguments")
        if args is not None and not isinstance(args, str):
            if isinstance(args, (dict, list)):  # an object at once, not JSON text: kept as the whole answer keeps it
                args_value: Any = args
            else:
                raise self._bad(f"tool call {index}'s arguments are {_kind(args)}, not text")
        else:
            args_value = None
        entry = self.calls.get(index)
        opened = entry is None
        if entry is None:
            entry = self.calls[index] = {"id": None, "name": None, "arguments": [], "object": None}
        new_id = bool(call_id) and not entry["id"]
        if new_id:
            entry["id"] = str(call_id)
            self._by_id[str(call_id)] = index
        # a name may come after the delta that opens the call, or in pieces ("Wr", "ite"), which are joined as the
        # openai SDK's accumulator joins them; a server that repeats the whole name in each delta is not doubled
        name = "" if name is None else str(name)  # as a whole answer's (openai._tool_call)
        named = name != "" and name != entry["name"]
        if named:
            entry["name"] = (entry["name"] or "") + name
        fragment = ""
        if args_value is not None:
            entry["object"] = args_value
        elif isinstance(args, str) and args:
            entry["arguments"].append(args)
            fragment = args
        self._token(at)
        if self.on_delta is not None and (opened or named or new_id or fragment):
            self.on_delta(Delta(tool_index=index, tool_id=entry["id"] if opened or new_id else None,
                                tool_name=entry["name"] if opened or named else None, arguments=fragment))

    def _token(self, at: float | None) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter() if at is None else at

    def message(self) -> dict[str, Any]:
        """The answer as ``choices[0].message`` of a whole one (content, tool calls in index order) and its usage."""
        # (its text's split characters are joined by the reader of any answer's message, openai._response)
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) if self.saw_content else None}
        if self.calls:
            msg["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"],
                              "arguments": c["object"] if c["object"] is not None else joined_text(c["arguments"])}}
                for _, c in sorted(self.calls.items())
            ]
        return msg

    def partial(self) -> tuple[str, str]:
        """The text and the tool calls' argument text that arrived (for a stopped call's token estimate)."""
        return joined_text(self.content), "".join(joined_text(c["arguments"]) for c in self.calls.values())

    def ttft(self) -> float:
        """Seconds from the call's start to its first fragment (to its end when none came)."""
        return round((self.first_token or time.perf_counter()) - self.started, 6)


class SSEDecoder:
    """The data of each server-sent event in the bytes given to :meth:`feed` as they arrive (cut anywhere), as the
    HTML standard reads an event stream: lines end at CR, LF or CRLF, a blank line ends an event, an event's
    ``data:`` lines are joined with LF, and an event with no data, comments and the other fields are skipped;
    :meth:`end` at the stream's end.

    Written here rather than the SDK's decoder: it splits a whole network read at once (several events when a
    busy process reads late) with ``bytes.splitlines``, where the SDK's decoder costs a regex match, a str decode
    and an object per line; this is most of what streaming costs per chunk."""

    __slots__ = ("data", "held")

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.held: list[bytes] = []  # the start of a line whose end has not come yet

    def feed(self, chunk: bytes) -> list[bytes]:
        out: list[bytes] = []
        if not chunk:
            return out
        if self.held:
            if b"\n" not in chunk and b"\r" not in chunk:
                self.held.append(chunk)
                return out
            chunk = b"".join(self.held) + chunk
            self.held.clear()
        lines = chunk.splitlines(True)
        if lines[-1][-1:] != b"\n":  # no line end yet, or a CR whose LF may be in the next read
            self.held.append(lines.pop())
        data = self.data
        for line in lines:
            line = line.rstrip(b"\r\n")
            if not line:
                if data:
                    out.append(data[0] if len(data) == 1 else b"\n".join(data))
                    data = self.data = []
            elif line[:5] == b"data:":
                data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif line == b"data":
                data.append(b"")
        return out

    def end(self) -> list[bytes]:
        """The last event, when its last line was ended by a lone CR held for its LF (an unfinished event is
        dropped, as the standard says)."""
        data = self.data
        if self.held and data and b"".join(self.held).splitlines(True)[-1] == b"\r":
            return [data[0] if len(data) == 1 else b"\n".join(data)]
        return []


def decode_all(data: list[bytes]) -> list[Any] | None:
    """Each event's JSON, from one parse of them all as an array: twenty small parses cost their calls more than
    their bytes.  None when they do not parse as one value each (one is malformed: decode them one by one to name
    it)."""
    if not data:
        return []
    try:
        values = json.loads(b"[" + b",".join(data) + b"]")
    except ValueError:
        return None
    return values if len(values) == len(data) else None


class BodyTimeout(Exception):
    """:func:`chunked_body`: no byte came for the read timeout."""


def chunked_body(response: Any, watch: Watch) -> Iterator[bytes] | None:
    """The body of a streamed HTTP/1.1 ``transfer-encoding: chunked`` response, read straight from its connection
    (``watch`` touched at each read); None when the response is not one this can read (HTTP/2, another framing,
    an httpx or httpcore laid out otherwise): then it is read through httpx.

    Why (benchmarks/README.md, "Streamed answers"): an SSE answer comes as one HTTP chunk per event, and through
    httpx each costs h11's parse of the chunk into an event object, then four generators and an exception-mapping
    context in httpcore and httpx; here one read of the socket (several chunks when they came together) is
    unframed with ``bytes.find`` and handed on as one piece.  h11 is left as it expects, through its public API
    only: it parses what it holds until it waits, with nothing held, at a chunk's end; from there the bytes are
    read here, and at the body's end h11 is given the CRLF it still waited for and the last chunk (``0``), so its
    connection goes back to the pool as after any read to the end.  Bytes after the last chunk (never sent by a
    server that waits for the next request) are not given to h11: its connection is closed rather than reused."""
    if "chunked" not in str(response.headers.get("transfer-encoding", "")).lower():
        return None
    # httpx's byte stream wraps httpcore's (a timer, exception mapping, the pool's), which reads one connection
    stream, conn = getattr(response, "stream", None), None
    for _ in range(8):
        conn = getattr(stream, "_connection", None)
        if conn is not None or stream is None:
            break
        stream = getattr(stream, "_httpcore_stream", None) or getattr(stream, "_stream", None)
    h11c = getattr(conn, "_h11_state", None)
    net = getattr(response, "extensions", {}).get("network_stream")
    import h11

    if not isinstance(h11c, h11.Connection) or h11c.their_state is not h11.SEND_BODY or not hasattr(net, "read"):
        return None
    timeouts = getattr(getattr(response, "request", None), "extensions", {}).get("timeout", {})
    read_timeout = timeouts.get("read") if isinstance(timeouts, dict) else None
    return _unchunk(h11, h11c, net, read_timeout, watch)


def _unchunk(h11: Any, h11c: Any, net: Any, timeout: float | None, watch: Watch) -> Iterator[bytes]:
    def read() -> bytes:
        try:
            data: bytes = net.read(65536, timeout)
        except Exception as exc:  # httpcore's ReadTimeout/ReadError (httpcore or httpcore2: told by name)
            if "Timeout" in type(exc).__name__:
                raise BodyTimeout(str(exc)) from None
            raise BodyBroken(f"{type(exc).__name__}: {exc}") from None
        if not data:
            raise BodyBroken("the connection closed before the body's end")
        watch.touch()
        return data

    # h11 parses what it holds (what came with the headers) until it is sure to wait for the next chunk-size line:
    # it needs data at a chunk's end (or the body's start) and held at most the CRLF after that chunk before, so
    # it has taken no part of the next line; the part of that CRLF it has not taken yet is owed to it
    ended: bool | None = None  # the last chunk h11 gave ended (None: no chunk yet)
    while True:
        held = h11c.trailing_data[0] if ended is not False else None
        try:
            event = h11c.next_event()
        except h11.RemoteProtocolError as exc:
            raise BodyBroken(f"malformed chunked body: {exc}") from None
        if event is h11.NEED_DATA:
            if ended is None and held == b"":
                owed = 0
                break
            if ended and held in (b"", b"\r", b"\r\n"):
                owed = 2 - len(held)
                break
            h11c.receive_data(read())
        elif isinstance(event, h11.Data):
            ended = bool(event.chunk_end)
            yield bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return
        else:
            raise BodyBroken(f"unexpected {type(event).__name__} in the body")
    unchunk = Unchunker(owed)
    while True:
        out = unchunk.feed(read())
        if out:
            yield out
        if unchunk.ended:
            if not unchunk.extra:  # h11 is given the end of the body, so the connection can be reused
                with contextlib.suppress(Exception):  # else it is closed, not reused
                    h11c.receive_data(b"\r\n"[2 - owed:] + b"0\r\n\r\n")
                    h11c.next_event()
            return


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


class Watch:
    """One streamed call as the watchdog sees it, from its request's first byte: :meth:`attach` when the answer's
    headers came, :meth:`touch` at each chunk; ``why`` says why it was cut off."""

    __slots__ = ("cancel", "last", "sock", "thread", "timeout", "why")

    def __init__(self, cancel: threading.Event | None, timeout: float = float("inf")) -> None:
        self.sock: socket.socket | None = None
        self.cancel = cancel
        self.timeout = timeout  # no stall limit while waiting for the headers: the call's own timeout holds
        self.last = time.monotonic()
        self.thread = threading.get_ident()
        self.why: str | None = None  # "cancelled" or "stalled", once cut off
        _sending.pop(self.thread, None)  # a socket this thread wrote to before belongs to an earlier call

    def attach(self, response: Any, timeout: float) -> None:
        """The answer's headers came: from now on its socket is the one to cut, and a stall counts."""
        self.sock = _socket_of(response) or _sent_on(self.thread)
        self.timeout = timeout
        self.touch()

    def touch(self) -> None:
        self.last = time.monotonic()

    def set_socket(self, sock: socket.socket | None) -> None:
        """The socket the call's request goes out on, known before it is sent (a plain connection's): the one to
        cut from then on."""
        self.sock = sock

    def cut(self, why: str) -> bool:
        """Shut the call's socket down; False when it is not known yet (the request is not written yet)."""
        sock = self.sock or _sent_on(self.thread)
        if sock is None:
            return False
        self.why = why
        # shutdown, not close: it wakes a read blocked in another thread (close does not), and the server sees
        # the connection end at once; an OSError: it is closed already
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        return True


class Watchdog:
    """One thread for the process that cuts off streamed calls whose job was stopped or that stalled."""

    def __init__(self) -> None:
        self._watches: set[Watch] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._tick = threading.Event()  # never set: its wait is the pause between looks
        self._thread: threading.Thread | None = None

    def watch(self, cancel: threading.Event | None) -> Watch:
        """Watch the call this thread is about to send (before its request: the wait for the answer's headers
        is cut off by a Stop too)."""
        w = Watch(cancel)
        with self._lock:
            self._watches.add(w)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="agentnb-stream-watchdog", daemon=True)
                self._thread.start()
        self._wake.set()
        return w

    def done(self, w: Watch) -> None:
        with self._lock:
            self._watches.discard(w)
        _sending.pop(w.thread, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                watches = list(self._watches)
            if not watches:
                self._wake.wait()
                self._wake.clear()
                continue
            now = time.monotonic()
            for w in watches:
                if w.why is not None:
                    continue
                if w.cancel is not None and w.cancel.is_set():
                    w.cut("cancelled")  # not sent yet: cut at the next look, once it is
                elif now - w.last > w.timeout:
                    w.cut("stalled")
            self._tick.wait(POLL_S)


# the connection each thread last wrote a request to: a call blocked waiting for its answer's headers (or a plain
# call's whole answer) has no response, so no socket, to cut yet; this is how the watchdog finds it.  Filled by the
# connections of shared clients (track_sockets); a thread's entry is dropped when its next call's watch starts.
_sending: dict[int, _TrackedStream] = {}


def _sent_on(thread: int) -> socket.socket | None:
    """The socket ``thread`` wrote its request to, while no other thread has written on it since: a connection
    given back to the pool and taken by another call belongs to that call, and must not be cut for this one."""
    stream = _sending.get(thread)
    return stream._sock if stream is not None and stream.writer == thread else None


class _TrackedStream:
    """An httpcore network stream that notes, at each write, that this thread's request went out on its socket."""

    __slots__ = ("_sock", "_stream", "writer")

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        sock = stream.get_extra_info("socket")
        self._sock = sock if isinstance(sock, socket.socket) else None
        self.writer = 0  # the thread that wrote the last request on it

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self._sock is not None:
            self.writer = me = threading.get_ident()
            _sending[me] = self
        self._stream.write(buffer, timeout)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, timeout)

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, *args: Any, **kwargs: Any) -> _TrackedStream:
        return _TrackedStream(self._stream.start_tls(*args, **kwargs))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _TrackingBackend:
    """An httpcore network backend whose streams are :class:`_TrackedStream`; everything else as the wrapped one."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def connect_tcp(self, *args: Any, **kwargs: Any) -> _TrackedStream:
        return _TrackedStream(self._backend.connect_tcp(*args, **kwargs))

    def connect_unix_socket(self, *args: Any, **kwargs: Any) -> _TrackedStream:
        return _TrackedStream(self._backend.connect_unix_socket(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def track_sockets(transport: Any) -> bool:
    """Make the connections of an httpx ``HTTPTransport`` note which thread writes on them, so a Stop can cut off
    a call still waiting for its answer's headers.  httpx has no public hook for its network backend: this reaches
    the pool's, and says False (a Stop is then seen when the headers come) where an httpx version lays it out
    otherwise."""
    pool = getattr(transport, "_pool", None)
    backend = getattr(pool, "_network_backend", None)
    if backend is None or not hasattr(backend, "connect_tcp"):
        return False
    if not isinstance(backend, _TrackingBackend):
        pool._network_backend = _TrackingBackend(backend)  # type: ignore[union-attr]
    return True


def _socket_of(response: Any) -> socket.socket | None:
    """The socket an httpx response streams from (None when the transport does not say)."""
    stream = getattr(response, "extensions", {}).get("network_stream")
    if stream is None:
        return None
    try:
        sock = stream.get_extra_info("socket")
    except Exception:
        return None
    return sock if isinstance(sock, socket.socket) else None


WATCHDOG = Watchdog()
