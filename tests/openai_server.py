"""A small OpenAI-compatible HTTP server on loopback, scripted per test.

It speaks ``POST /v1/chat/completions`` (tool calls and usage included) and plays
a list of actions, one per request: a response, an HTTP error, a stall long
enough to make the client time out, a hold until the test releases it (or kills the client meanwhile),
or a raw body sent as it is.  Every request body and its headers are kept
so tests can check what the model was sent.  An error's message or a raw body may hold ``{api_key}``
(:data:`ECHO_KEY`): it is sent with the key the request carried in its ``Authorization`` header, as some
proxies repeat it ("Incorrect API key provided: sk-…").

For many jobs at once (batches): ``latency`` delays every answer, ``responder(body)`` chooses the
action when the list is empty (say, from the job's instruction), ``max_concurrent`` answers 429 with
``retry-after`` to a request that arrives while that many are already being answered, and the server
counts the requests in flight (``in_flight``, ``max_in_flight``) and logs each one's status and the
number in flight when it arrived (``log``); ``gather=N`` holds the first requests until N are in flight together.

Streaming, as real endpoints do it: a request with ``stream: true`` gets its answer as server-sent
``chat.completion.chunk`` events (``text/event-stream``): the role, the text in pieces, each tool call opened with its id
and name and its argument text in pieces (several calls interleaved by index), the finish reason, the usage in a
last chunk (when ``stream_options.include_usage`` asks for it and the reply has usage), then ``[DONE]``.  The
pieces are ``chunk_chars`` characters long (cutting inside JSON strings and escaped characters), or a size that
gives about ``chunks`` chunks per answer; ``write_size`` writes the bytes in slices that cut UTF-8 characters.
:func:`midway` plays a fault after some chunks: a connection reset, a stall, a malformed chunk, an error chunk, or
a hold until :meth:`OpenAIServer.release` (or the client hanging up, which :attr:`OpenAIServer.disconnected` tells).
``streams=False`` answers a streamed request with plain JSON; ``refuses_stream=True`` with HTTP 400 naming it.
``chunked=True`` speaks HTTP/1.1 with keep-alive, as real endpoints do, and sends a stream with
``transfer-encoding: chunked``, one HTTP chunk per event (``write_size`` cuts the chunks' framing too); by default a
stream is HTTP/1.0, its end the connection's close.
"""

from __future__ import annotations

import json
import math
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agentnb.models.openai import forget_refusals
from agentnb.models.ratelimit import forget_gates

__all__ = ["ECHO_KEY", "AsObject", "OpenAIServer", "error", "hold", "midway", "openai_env", "raw", "reply", "stall"]

ECHO_KEY = "{api_key}"  # in an error's message or a raw body: replaced by the key the request was sent with


def _readable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` has something to read (its end too) within ``timeout`` seconds; poll, not select, which
    refuses a descriptor past 1,023 (a test process with many files open)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


class AsObject(dict):
    """Tool-call arguments sent as a JSON object instead of JSON text, as some compatible servers do."""


def reply(content: str | None = None, tool_calls: list[tuple[str, dict[str, Any] | str]] | None = None,
          usage: tuple[int, int] | None = (100, 10), cached: int | None = None) -> dict[str, Any]:
    """A chat completion answer: text and/or ``(name, arguments)`` tool calls, with usage (and ``cached``: the
    prompt tokens read from the endpoint's cache, as ``usage.prompt_tokens_details.cached_tokens``).

    Arguments given as a string are sent as they are (to play a model that writes broken JSON).
    """
    return {"kind": "reply", "content": content, "tool_calls": tool_calls or [], "usage": usage, "cached": cached}


def error(status: int, message: str = "scripted failure", times: int = 1,
          headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    return [{"kind": "error", "status": status, "message": message, "headers": headers or {}} for _ in range(times)]


def stall(seconds: float) -> dict[str, Any]:
    """Wait before answering (with a valid reply), so a client with a shorter timeout gives up."""
    return {"kind": "stall", "seconds": seconds}


def hold(then: dict[str, Any] | list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Keep the request unanswered until the test calls :meth:`OpenAIServer.release` (or the server closes),
    then play ``then`` (a reply by default); :attr:`OpenAIServer.holding` is set while a request is held, so a
    test can kill the client in the middle of that call."""
    chosen = then[0] if isinstance(then, list) else then
    return {"kind": "hold", "then": chosen if chosen is not None else reply("late answer")}


def raw(body: str | bytes | Any, content_type: str = "application/json", status: int = 200,
        times: int = 1) -> list[dict[str, Any]]:
    """Send ``body`` as it is (text, or any JSON value encoded as is), to play a broken endpoint."""
    data = body.encode() if isinstance(body, str) else body if isinstance(body, bytes) else json.dumps(body).encode()
    return [{"kind": "raw", "body": data, "content_type": content_type, "status": status} for _ in range(times)]


def midway(fault: str, after: int = 3, *, seconds: float = 0.0,
           then: dict[str, Any] | None = None) -> dict[str, Any]:
    """Stream ``then`` (a long text reply by default) to a streamed request, and after ``after`` chunks play
    ``fault``: ``"reset"`` (the connection reset), ``"stall"`` (``seconds`` without a byte, then the rest),
    ``"malformed"`` (a chunk that is not JSON), ``"error"`` (an error object in the stream, as a server failing
    mid-answer sends), ``"hold"`` (nothing more until :meth:`OpenAIServer.release` or the client hangs up) or, with
    ``chunked``, ``"framing"`` (a chunk-size line that is not hex, then the connection closed)."""
    assert fault in ("reset", "stall", "malformed", "error", "hold", "framing"), fault
    answer = then if then is not None else reply("A long answer that streams in many small pieces, " * 4)
    return {"kind": "midway", "fault": fault, "after": after, "seconds": seconds, "then": answer}


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass(frozen=True)
class Arrival:
    """One request as the server saw it: its number, the requests in flight when it came (itself
    included), the HTTP status it got and the test's key of it (``key(body)``, say the job)."""

    n: int
    in_flight: int
    status: int
    key: Any = None


class _Listener(ThreadingHTTPServer):
    # socketserver's listen backlog is 5: with more clients connecting at once than the accept loop takes in, the
    # kernel drops the others' connection requests and their clients try again only 1 s (then 3 s) later — a
    # benchmark of 64 jobs at once then timed the retries, not the client (benchmarks/README.md)
    request_queue_size = 1024
    daemon_threads = True


@dataclass
class OpenAIServer:
    actions: list[dict[str, Any]] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    latency: float = 0.0
    responder: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    max_concurrent: int | None = None
    retry_after: str = "0.05"
    key: Callable[[dict[str, Any]], Any] | None = None
    log: list[Arrival] = field(default_factory=list)
    # Hold the first requests until this many are in flight at once (for at most gather_timeout s), so a test of
    # concurrency sees them together however slowly a loaded machine starts the client's threads
    gather: int = 0
    gather_timeout: float = 60.0
    # streaming: pieces of this many characters (None: a size giving about ``chunks`` chunks per answer), bytes
    # written in slices of ``write_size`` (None: each event at once), and how the server treats ``stream: true``
    chunks: int = 20
    chunk_chars: int | None = None
    write_size: int | None = None
    streams: bool = True
    refuses_stream: bool = False
    chunked: bool = False
    # a tool call's name in the delta that opens it: whole (None, as OpenAI sends it), or only its first ``name_split``
    # characters (0: none), the rest in the call's next delta (as some compatible servers send it)
    name_split: int | None = None
    port: int = 0  # 0: any free one

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self.holding = threading.Event()  # a request is held by a ``hold()`` action
        self._released = threading.Event()
        self._gathered = threading.Event()
        self._count = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.streamed = 0  # answers sent as a stream
        self.connections = 0  # connections accepted (with ``chunked``, a client that keeps them alive reuses them)
        self.disconnected = threading.Event()  # a client hung up in a held call or in the middle of a streamed answer
        self.disconnects: list[float] = []  # when (time.monotonic()) each such hang-up was seen
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if self.chunked else "HTTP/1.0"

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def setup(self) -> None:
                super().setup()
                with server._lock:
                    server.connections += 1

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                with server._lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    arrived = server.in_flight
                    server._count += 1
                    n = server._count
                self._counted = True
                try:
                    self._gather(arrived)
                    self._answer(body, n, arrived)
                finally:
                    self._leave()

            def _gather(self, arrived: int) -> None:
                if not server.gather or server._gathered.is_set():
                    return
                if arrived >= server.gather:
                    server._gathered.set()
                    return
                deadline = time.monotonic() + server.gather_timeout
                while not (server._gathered.is_set() or server._closing.is_set()) and time.monotonic() < deadline:
                    server._gathered.wait(0.05)

            def _leave(self) -> None:
                # A request stops being in flight before its answer is written: once the client has the answer
                # it may send its next request, which could otherwise arrive before this thread counts down
                if getattr(self, "_counted", False):
                    self._counted = False
                    with server._lock:
                        server.in_flight -= 1

            def _answer(self, body: dict[str, Any], n: int, arrived: int) -> None:
                key = server.key(body) if server.key is not None else None
                with server._lock:
                    server.received.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                if body.get("stream") and server.refuses_stream:  # refused before the script is read: no action used
                    with server._lock:
                        server.log.append(Arrival(n, arrived, 400, key))
                    return self._send(400, {"error": {"message": "Unsupported parameter: 'stream' is not supported "
                                                                 "by this model", "type": "invalid_request_error",
                                                      "param": "stream"}})
                if server.max_concurrent is not None and arrived > server.max_concurrent:
                    with server._lock:
                        server.log.append(Arrival(n, arrived, 429, key))
                    return self._send(429, {"error": {"message": "too many requests in flight", "type": "rate_limit"}},
                                      {"retry-after": server.retry_after})
                with server._lock:
                    action = server.actions.pop(0) if server.actions else None
                if action is None and server.responder is not None:
                    action = server.responder(body)
                if server.latency:
                    server._closing.wait(server.latency)
                with server._lock:
                    status = action.get("status", 200) if action is not None else 400
                    server.log.append(Arrival(n, arrived, status, key))
                if self.path.rstrip("/") != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                if action is None:
                    return self._send(400, {"error": {"message": "the test server's script ran out",
                                                      "type": "invalid_request_error"}})
                if action["kind"] == "hold":
                    server.holding.set()
                    while not (server._released.is_set() or server._closing.is_set()):
                        readable = _readable(self.connection, 0.01)
                        if readable and not self.connection.recv(1, socket.MSG_PEEK):
                            self._leave()
                            self.close_connection = True
                            server._hung_up()  # the client gave up waiting for the headers: nothing to answer
                            return None
                    action = action["then"]
                sent_key = self.headers.get("authorization", "").removeprefix("Bearer ")
                if action["kind"] == "error":
                    message = action["message"].replace(ECHO_KEY, sent_key)
                    return self._send(action["status"], {"error": {"message": message, "type": "server_error"}},
                                      action.get("headers"))
                if action["kind"] == "raw":
                    return self._send_bytes(action["status"], action["body"].replace(ECHO_KEY.encode(), sent_key.encode()),
                                            action["content_type"])
                if action["kind"] == "stall":
                    server._closing.wait(action["seconds"])
                    action = reply("late answer")
                wants_stream = bool(body.get("stream"))
                fault = action if action["kind"] == "midway" else None
                if fault is not None:
                    action = fault["then"]
                if wants_stream and server.streams:
                    return self._stream(body, server._completion(body, action, n), fault)
                self._send(200, server._completion(body, action, n))

            def _stream(self, body: dict[str, Any], completion: dict[str, Any],
                        fault: dict[str, Any] | None) -> None:
                self._leave()
                with server._lock:
                    server.streamed += 1
                events = server._chunks(body, completion)
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream; charset=utf-8")
                    self.send_header("cache-control", "no-cache")
                    if server.chunked:
                        self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for i, event in enumerate(events):
                        if fault is not None and i == fault["after"] and not self._fault(fault):
                            self.close_connection = True  # the body is not ended: the connection is
                            return
                        self._event(b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n")
                    self._event(b"data: [DONE]\n\n")
                    if server.chunked:
                        self._write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    server._hung_up()

            def _event(self, data: bytes) -> None:
                self._write(b"%x\r\n%s\r\n" % (len(data), data) if server.chunked else data)

            def _write(self, data: bytes) -> None:
                size = server.write_size
                if not size:
                    self.wfile.write(data)
                    return
                for at in range(0, len(data), size):
                    self.wfile.write(data[at:at + size])
                    time.sleep(0.0005)  # each slice its own segment: the client reads characters cut in two

            def _fault(self, fault: dict[str, Any]) -> bool:
                """Play a fault mid-stream; True when the rest of the answer follows."""
                kind = fault["fault"]
                if kind == "stall":
                    server._closing.wait(fault["seconds"])
                    return True
                if kind == "hold":
                    server.holding.set()
                    while not (server._released.is_set() or server._closing.is_set()):
                        readable = _readable(self.connection, 0.01)
                        if readable and not self.connection.recv(1, socket.MSG_PEEK):
                            server._hung_up()
                            return False
                    return True
                if kind == "malformed":
                    self._event(b'data: {"id": "chatcmpl-x", "choices": [{"delta": {"content": "broken\n\n')
                elif kind == "framing":
                    self._write(b"zz\r\ndata: {}\r\n")
                elif kind == "error":
                    self._event(b'data: {"error": {"message": "the server failed mid-answer", "type": "server_error"}}'
                                b"\n\n")
                else:  # reset: an RST, not a clean close
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                return False

            def _send(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
                self._send_bytes(status, json.dumps(payload).encode(), "application/json", headers)

            def _send_bytes(self, status: int, data: bytes, content_type: str,
                            headers: dict[str, str] | None = None) -> None:
                self._leave()
                try:
                    self.send_response(status)
                    for name, value in (headers or {}).items():
                        self.send_header(name, value)
                    self.send_header("content-type", content_type)
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a stall): nothing to answer

        self.httpd = _Listener(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def _hung_up(self) -> None:
        with self._lock:
            self.disconnects.append(time.monotonic())
        self.disconnected.set()

    def _pieces(self, text: str, size: int) -> list[str]:
        return [text[i:i + size] for i in range(0, len(text), size)] or [""]

    def _chunks(self, request: dict[str, Any], completion: dict[str, Any]) -> list[dict[str, Any]]:
        """The ``chat.completion.chunk`` objects of ``completion`` streamed."""
        choice = completion["choices"][0]
        message = choice["message"]
        content, calls = message["content"], message.get("tool_calls") or []
        texts = [content or ""] + [c["function"]["arguments"] for c in calls if isinstance(c["function"]["arguments"], str)]
        size = self.chunk_chars or max(1, math.ceil(sum(map(len, texts)) / max(1, self.chunks - 3)))
        head = {k: completion[k] for k in ("id", "created", "model")}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        out = [chunk({"role": "assistant", "content": "" if content is not None else None})]
        if content:
            out += [chunk({"content": piece}) for piece in self._pieces(content, size)]
        queues = []
        for i, c in enumerate(calls):
            args = c["function"]["arguments"]
            pieces = self._pieces(args, size) if isinstance(args, str) else [args]
            name = c["function"]["name"]
            first = {"index": i, "id": c["id"], "type": "function", "function": {"name": name, "arguments": pieces[0]}}
            queue = [first] + [{"index": i, "function": {"arguments": p}} for p in pieces[1:]]
            if self.name_split is not None:
                head = {"name": name[:self.name_split]} if self.name_split else {}
                queue = [{"index": i, "id": c["id"], "type": "function", "function": head},
                         {"index": i, "function": {"name": name[self.name_split:]}},
                         *({"index": i, "function": {"arguments": p}} for p in pieces)]
            queues.append(queue)
        while any(queues):  # several calls interleaved, as parallel tool calls stream
            for q in queues:
                if q:
                    out.append(chunk({"tool_calls": [q.pop(0)]}))
        out.append(chunk({}, choice["finish_reason"]))
        if "usage" in completion and (request.get("stream_options") or {}).get("include_usage"):
            out.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": completion["usage"]})
        return out

    @staticmethod
    def _completion(request: dict[str, Any], action: dict[str, Any], n: int) -> dict[str, Any]:
        calls = [
            {"id": f"call_{n}_{i}", "type": "function",
             "function": {"name": name, "arguments": args if isinstance(args, (str, AsObject)) else json.dumps(args)}}
            for i, (name, args) in enumerate(action["tool_calls"])
        ]
        message: dict[str, Any] = {"role": "assistant", "content": action["content"]}
        if calls:
            message["tool_calls"] = calls
        out: dict[str, Any] = {
            "id": f"chatcmpl-{n}", "object": "chat.completion", "created": 1_700_000_000,
            "model": request.get("model", "test"),
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
        }
        if action["usage"] is not None:
            p, c = action["usage"]
            out["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
            if action.get("cached") is not None:
                out["usage"]["prompt_tokens_details"] = {"cached_tokens": action["cached"]}
        return out

    # -- lifecycle ------------------------------------------------------------
    @property
    def base_url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def play(self, *actions: dict[str, Any] | list[dict[str, Any]]) -> None:
        for a in actions:
            self.actions.extend(a if isinstance(a, list) else [a])

    def release(self) -> None:
        """Answer the requests held by ``hold()`` actions (and let later ones through at once)."""
        self._released.set()

    def __enter__(self) -> OpenAIServer:
        # A port is often one an earlier server of this process had (the kernel hands freed ports out again): what
        # the process remembers of that one (that it refused to stream, its 429 gate) is not true of this one, so it
        # is forgotten
        forget_refusals(self.base_url)
        forget_gates(self.base_url)
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def openai_env(server: OpenAIServer, api_key: str = "sk-test", *, backoff: str | None = "0.01",
               timeout: str | None = None, retries: str | None = None) -> dict[str, str]:
    """The environment that points ``openai:`` models at ``server``: its URL, an API key (never a real one), and
    the client's settings a test chooses (``backoff`` short by default, so a retried call does not wait; a
    ``timeout``/``retries`` of None leaves the client's own).  For a subprocess's env, or the ``loopback``
    fixture (conftest), which sets it in this process for the test."""
    env = {"OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": api_key}
    for name, value in (("BACKOFF", backoff), ("TIMEOUT", timeout), ("RETRIES", retries)):
        if value is not None:
            env[f"AGENTNB_OPENAI_{name}"] = value
    return env
