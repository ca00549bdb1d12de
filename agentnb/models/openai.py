"""The ``openai:<model>`` adapter: Chat Completions with tools, on any OpenAI-compatible endpoint."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._secrets import register_secret, scrub
from ..errors import CallCancelled, ModelSpecError
from . import _stream_pump
from ._http1 import BodyBroken, Connection, Head
from ._plain_http import PlainPost, Redirected, body_chunks, encode_body, inflating, plain_post_for, sdk_http
from .base import MAX_RETRIES, ModelError, ModelRequest, ModelResponse, ToolCall
from .messages import AssistantMessage, Delta, Message, SystemMessage, TokenUsage, ToolMessage, UserMessage
from .openai_stream import (
    WATCHDOG,
    Assembly,
    BodyTimeout,
    SSEDecoder,
    Watch,
    chunked_body,
    decode_all,
    joined_text,
    track_sockets,
)
from .ratelimit import gate_for

__all__ = ["OpenAIModel", "forget_refusals", "pause", "shared_client", "wire_message", "wire_messages"]


def _env_float(name: str, default: float, *, low: float = 0.0, above: bool = False, whole: bool = False,
               high: float = float("inf"), allowed: str = "a number of seconds ≥ 0") -> float:
    """The number an environment variable says (``default`` when unset or empty); one line naming what is allowed
    for anything else, rather than a call that stalls at once or never."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > low if above else value >= low) or not value < float("inf") or value > high \
            or (whole and value != int(value)):
        raise ModelSpecError(f"{name}={text!r}; allowed: {allowed}")
    return value


# Where a setting comes from when neither the job nor the workspace gives it.
RETRIES_ENV = "AGENTNB_OPENAI_RETRIES"
MAX_BACKOFF_ENV = "AGENTNB_OPENAI_MAX_BACKOFF"
DEFAULT_RETRIES = 4
DEFAULT_MAX_BACKOFF = 60.0
# streaming (docs/models.md#streaming): on unless the spec (openai:NAME?stream=0), the workspace or this says 0
STREAM_ENV = "AGENTNB_STREAM"
# the longest wait for a streamed answer's next chunk before it counts as a timeout (default: the call's timeout)
READ_TIMEOUT_ENV = "AGENTNB_OPENAI_READ_TIMEOUT"
SPEC_OPTIONS = ("stream", "read_timeout")
# after [DONE], the longest wait for the body's end (which gives the connection back to the pool)
DRAIN_S = 1.0

# (base URL, model) of endpoints that refused a streamed call in this process: asked plainly from then on
_plain_only: set[tuple[str | None, str]] = set()
_plain_lock = threading.Lock()


def forget_refusals(base_url: str | None = None) -> None:
    """Forget the endpoints this process remembers as refusing to stream (docs/models.md#streaming): all of them,
    or those at ``base_url``.  Their next calls ask to stream again, as after the endpoint at that URL was
    restarted or replaced by one that streams (a server started on a port another one used before is not it)."""
    with _plain_lock:
        if base_url is None:
            _plain_only.clear()
        else:
            _plain_only.difference_update({k for k in _plain_only if k[0] == base_url})


def _flag(value: str) -> bool | None:
    v = value.strip().lower()
    return True if v in ("1", "true", "yes", "on") else False if v in ("0", "false", "no", "off") else None


def _spec_options(name: str, query: str) -> dict[str, Any]:
    """The options after ``?`` in ``openai:NAME?stream=0&read_timeout=30``; one line naming what is allowed."""
    out: dict[str, Any] = {}
    for part in filter(None, query.split("&")):
        key, _, value = part.partition("=")
        if key in out:
            raise ModelSpecError(f"openai:{name}?{query}: {key} is given twice; give each option once")
        if key == "stream" and _flag(value) is not None:
            out["stream"] = _flag(value)
        elif key == "read_timeout":
            try:
                out["read_timeout"] = float(value)
            except ValueError:
                out["read_timeout"] = -1.0
            if not 0 < out["read_timeout"] < float("inf"):
                raise ModelSpecError(f"openai:{name}?{query}: read_timeout={value!r}; allowed: seconds > 0")
        else:
            raise ModelSpecError(f"openai:{name}?{query}: unknown option {part!r}; allowed: stream=0|1, "
                                 "read_timeout=SECONDS")
    return out


# Idle connections kept per client: a batch at concurrency N reuses up to N of them between calls.
# The number open at once is not capped (httpx's default of 100 would queue calls beyond it): the
# rate-limit gate (models/ratelimit.py) and the batch's concurrency are what bound the calls in flight.
KEEPALIVE_CONNECTIONS = 512

_clients: dict[tuple[str | None, str, float], Any] = {}
_clients_lock = threading.Lock()
# per (base URL, key digest, timeout), as the clients above: its plain calls' socket path, or None (the SDK's path)
_plain_posts: dict[tuple[str | None, str, float], PlainPost | None] = {}


def shared_client(base_url: str | None, api_key: str, timeout: float) -> Any:
    """The process's one ``openai.OpenAI`` client for (base URL, key, timeout), made on first use.

    The client and its httpx pool are thread-safe; one per job would each hold a pool of connections.
    The key is part of the lookup only as a SHA-256 digest, so it is not kept anywhere but in the client.
    """
    key = _endpoint_key(base_url, api_key, timeout)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            import openai

            http = sdk_http()
            limits = http.Limits(max_connections=None, max_keepalive_connections=KEEPALIVE_CONNECTIONS)
            transport = http.HTTPTransport(limits=limits)
            track_sockets(transport)  # a Stop cuts off a streamed call waiting for its headers too
            client = _clients[key] = openai.OpenAI(
                api_key=api_key, base_url=base_url, max_retries=0, timeout=timeout,
                http_client=openai.DefaultHttpxClient(transport=transport, timeout=timeout))
        return client


def _endpoint_key(base_url: str | None, api_key: str, timeout: float) -> tuple[str | None, str, float]:
    """What a process's client and plain path are shared by: the key only as its SHA-256 digest."""
    return base_url, hashlib.sha256(api_key.encode("utf-8")).hexdigest(), float(timeout)


def _sdk() -> Any:
    """The ``openai`` SDK, imported on first need: a plain call to an ``http://`` endpoint needs none of it
    (models/_plain_http.py), and its import costs a process 0.4-0.8 s of CPU."""
    import openai

    return openai


def _retried() -> tuple[type[Exception], ...]:
    """The failures a call is tried again after: the SDK's 429, 5xx, timeout and lost connection, and ours."""
    openai = _sdk()
    return (openai.RateLimitError, openai.InternalServerError, openai.APITimeoutError, openai.APIConnectionError,
            MalformedAnswer, StreamBroken, StreamStalled)


_RESPONSE: Any = None


def _response_class() -> Any:
    """The SDK's HTTP response class: ``client.post(cast_to=…)`` then returns the response itself, unparsed."""
    global _RESPONSE
    if _RESPONSE is None:
        _RESPONSE = sdk_http().Response
    return _RESPONSE


class MalformedAnswer(Exception):
    """An HTTP 200 whose body is not a chat completion; retried like a 5xx."""


class StreamBroken(Exception):
    """A stream that ended before its answer did (the connection closed, an error chunk); retried like a 5xx."""


class StreamStalled(Exception):
    """A stream that sent nothing for its read timeout; retried like a timeout."""


class OpenAIModel:
    """Calls ``client.chat.completions.create`` with retries and backoff on 429, 5xx, timeouts and malformed answers.

    The key comes from ``api_key`` or ``OPENAI_API_KEY`` and the endpoint from ``OPENAI_BASE_URL``;
    neither is ever recorded (the key is registered with ``_secrets``, so the store masks it).  ``max_retries`` tries follow the first one, each after
    a wait that doubles from ``backoff`` seconds (or what the server asks for), never
    longer than ``max_backoff`` seconds.
    """

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        max_retries: int | None = None,
        backoff: float | None = None,
        timeout: float | None = None,
        max_backoff: float | None = None,
        stream: bool | None = None,
        read_timeout: float | None = None,
    ) -> None:
        name, _, query = model.partition("?")
        options = _spec_options(name, query)
        self.model = name
        self.spec = f"openai:{model}"
        self.base_url = base_url or os.environ.get("OPENAI_BASE_URL") or None
        self._api_key = api_key or os.environ.get("OPENAI_API_KEY")
        # masked for the process from now on, wherever it came from: an endpoint's error may repeat it, and a
        # key given in code is in no environment variable the store's scrub would know it by
        register_secret(self._api_key)
        self.max_retries = int(max_retries if max_retries is not None else _env_float(
            RETRIES_ENV, DEFAULT_RETRIES, whole=True, high=MAX_RETRIES,
            allowed=f"a whole number from 0 to {MAX_RETRIES} (the tries after the first)"))
        self.backoff = backoff if backoff is not None else _env_float("AGENTNB_OPENAI_BACKOFF", 1.0)
        self.timeout = timeout if timeout is not None else _env_float(
            "AGENTNB_OPENAI_TIMEOUT", 120.0, above=True, allowed="a number of seconds > 0")
        self.max_backoff = float(max_backoff if max_backoff is not None
                                 else _env_float(MAX_BACKOFF_ENV, DEFAULT_MAX_BACKOFF))
        # the spec's word first, then the workspace's, then the environment's
        env_text = os.environ.get(STREAM_ENV, "").strip()
        env_stream = _flag(env_text)
        if env_text and env_stream is None:
            raise ModelSpecError(f"{STREAM_ENV}={env_text!r}; allowed: 1 or 0 (also true/false, yes/no, on/off)")
        self.stream: bool = options.get("stream", stream if stream is not None
                                        else env_stream if env_stream is not None else True)
        self.read_timeout = float(options.get("read_timeout") or read_timeout
                                  or _env_float(READ_TIMEOUT_ENV, 0.0, above=True, allowed="a number of seconds > 0")
                                  or self.timeout)
        self._client: Any = None
        self._plain: PlainPost | None = None  # a plain call's path below httpx (models/_plain_http.py), if any
        self._plain_checked = False
        # the last conversation sent and its wire form: the next call re-sends it with a few messages more
        self._sent: tuple[list[Message], list[dict[str, object]]] = ([], [])

    def __repr__(self) -> str:  # never show the key
        return f"OpenAIModel({self.model!r}, base_url={self.base_url!r})"

    def _check_key(self) -> str:
        if not self._api_key and self.base_url is None:
            raise ModelError(
                "openai model needs OPENAI_API_KEY (and OPENAI_BASE_URL for a non-OpenAI endpoint)"
            )
        return self._api_key or "not-needed"

    def _get_client(self) -> Any:
        """The SDK's client: for a call the plain path does not take (models/_plain_http.py says which)."""
        if self._client is None:
            self._client = shared_client(self.base_url, self._check_key(), self.timeout)
        return self._client

    def _plain_path(self) -> PlainPost | None:
        """This model's plain path below the SDK, decided on its first call (None: the SDK's client for all)."""
        if not self._plain_checked:
            key = self._check_key()
            lookup = _endpoint_key(self.base_url, key, self.timeout)
            with _clients_lock:
                if lookup not in _plain_posts:
                    _plain_posts[lookup] = (plain_post_for(self.base_url, key, self.timeout)
                                            if self.base_url is not None else None)
                self._plain = _plain_posts[lookup]
            self._plain_checked = True
        return self._plain

    def complete(self, request: ModelRequest) -> ModelResponse:
        self._plain_path()
        kwargs: dict[str, Any] = {"model": self.model, "messages": self._wire(request.messages)}
        if request.tools:
            kwargs["tools"] = request.tools
            # "auto", unless the caller names the one tool to call (an LLM judge its verdict, docs/design-lab.md#llm-judge)
            kwargs["tool_choice"] = request.extra.get("tool_choice", "auto")
        streaming = self.stream and (self.base_url, self.model) not in _plain_only
        if streaming:
            kwargs["stream"] = True
            kwargs["stream_options"] = {"include_usage": True}
        started = time.perf_counter()
        cancel = request.cancel
        attempts = self.max_retries + 1
        last: Exception | None = None
        # shared by every job of the process that calls this endpoint and model: a 429 slows them all
        gate = gate_for(self.base_url, self.model)
        waited_until: float | None = None
        attempt = 0
        while attempt < attempts:
            if cancel is not None and cancel.is_set():
                raise CallCancelled()
            ticket = gate.acquire(max_wait=self.max_backoff, waited_until=waited_until, cancel=cancel)
            if ticket is None:
                raise CallCancelled()  # stopped while the gate held it back (another call's 429): nothing sent
            answered, delay = False, 0.0
            # a streamed call is watched from before its request: a Stop cuts off the wait for its headers and its
            # answer at once, and a stall between chunks is seen.  A plain call is not cut: its whole answer is
            # kept and the job pauses after it (a worker's --grace waits for it; docs/models.md#streaming)
            watch = WATCHDOG.watch(cancel) if streaming else None
            try:
                # The raw body, read here: the SDK builds its objects without checking them, so a 200 that is
                # an HTML page, broken JSON or the wrong shape would only fail later, far from the cause.  A
                # plain post of the body (same auth, headers and error classes as chat.completions.create)
                # also skips the SDK's per-call rewrite of every message, ~1 ms of CPU per call.
                # a plain call to an http:// endpoint goes below httpx: the same request for an eighth of the CPU
                plain = self._plain
                http: Any
                if plain is not None and streaming and watch is not None:  # the answer's body is read as it comes
                    conn, head = plain.open(encode_body(kwargs), watch.set_socket)
                    answered = True
                    if head.get("content-type").split(";")[0].strip().lower() == "text/event-stream":
                        return self._read_plain_stream(plain, conn, head, request, started, watch)
                    http = plain.read(conn, head)  # the endpoint ignores `stream`: its answer is a whole one
                    streaming = self._refused(kwargs, "it answered "
                                              f"{http.headers.get('content-type') or 'no content type'}, not text/event-stream")
                    return _parse_completion(http, request)
                if plain is not None and not streaming:
                    http = plain.post(encode_body(kwargs))
                else:
                    http = self._get_client().post("/chat/completions", body=kwargs, cast_to=_response_class(), stream=streaming)
                answered = True
                if not streaming:  # whole: a Stop that comes now pauses the job after this call, as between calls
                    return _parse_completion(http, request)
                ctype = (http.headers.get("content-type") or "").split(";")[0].strip().lower()
                if ctype == "text/event-stream" and watch is not None:
                    return self._read_stream(http, request, started, watch)
                try:  # not a stream: the endpoint ignores `stream`; its answer is read as a whole one
                    http.read()
                finally:
                    http.close()
                streaming = self._refused(kwargs, f"it answered {ctype or 'no content type'}, not text/event-stream")
                return _parse_completion(http, request)
            # the cheap ones first: each except clause's classes are looked up when a failure reaches it, and the
            # SDK's are imported then (a Stop or Ctrl-C on a plain call does not wait for that)
            except (CallCancelled, ModelError):
                raise
            except Redirected:
                self._plain = None  # the SDK's client follows redirects: this model's calls go through it now
                continue
            except (KeyboardInterrupt, SystemExit) as exc:
                if cancel is None:
                    raise
                raise CallCancelled(interrupt=exc) from None  # before any answer came (see _assemble)
            except _retried() as exc:
                if cancel is not None and cancel.is_set():
                    raise CallCancelled() from None  # the watchdog cut the wait for the answer off
                last = exc
                delay = min(self._retry_after(exc) or self.backoff * (2 ** attempt) * (0.5 + random.random() / 2),
                            self.max_backoff)
                if isinstance(exc, _sdk().RateLimitError):
                    gate.throttle(delay, ticket)  # every other call to the endpoint waits it out too
            except _sdk().APIStatusError as exc:
                if streaming and exc.status_code == 400 and "stream" in _message(exc).lower():
                    streaming = self._refused(kwargs, f"HTTP 400: {_message(exc)}")
                    continue  # the same try again, plainly (the gate's slot is given back below)
                raise ModelError(f"{self.spec}: HTTP {exc.status_code}: {_message(exc)}") from None
            except _sdk().OpenAIError as exc:
                raise ModelError(f"{self.spec}: {type(exc).__name__}: {exc}") from None
            finally:
                if watch is not None:
                    WATCHDOG.done(watch)
                gate.release(ok=answered)  # before the wait: a call backing off holds no slot
            attempt += 1
            if streaming and request.on_delta is not None:
                # what this try streamed is void: a live view drops it, and shows the next try's afresh
                request.on_delta(Delta(restart=True))
            if attempt < attempts:
                waited_until = time.monotonic() + delay
                if pause(delay, cancel):
                    raise CallCancelled()
        status = getattr(last, "status_code", None)
        if isinstance(last, MalformedAnswer):
            what = f"malformed answer: {last}"
        elif isinstance(last, (StreamBroken, StreamStalled)):
            what = str(last)
        elif status:
            what = f"HTTP {status}: {_message(last)}"
        else:
            what = f"{type(last).__name__}: {last}"
        raise ModelError(f"{self.spec}: gave up after {attempts} tries; last error {what}")

    def _refused(self, kwargs: dict[str, Any], why: str) -> bool:
        """The endpoint does not stream: its calls go plainly from now on in this process, said once; False."""
        kwargs.pop("stream", None)
        kwargs.pop("stream_options", None)
        key = (self.base_url, self.model)
        with _plain_lock:
            first = key not in _plain_only
            _plain_only.add(key)
        if first:
            print(f"agentnb: warning: {self.spec} at {self.base_url or 'api.openai.com'} does not stream "
                  f"({scrub(why)[:200]}); its calls are not streamed from now on in this process",
                  file=sys.stderr, flush=True)
        return False

    def _read_stream(self, http: Any, request: ModelRequest, started: float, watch: Watch) -> ModelResponse:
        """Read a ``text/event-stream`` answer to its end, handing each fragment to ``request.on_delta``; the same
        response a whole answer gives.  The stream is closed however it ends: at its end, on a fault, on the
        job's Stop (:class:`CallCancelled`) and on Ctrl-C.

        The events are split and decoded here (``SSEDecoder``, ``json.loads`` into plain dicts), not by the SDK's
        ``Stream``: that costs a regex, a str and an object per line, and it closes the response at ``[DONE]``
        before the chunked body's end is read, so every streamed call lost its keep-alive connection and the next
        one opened a new one.  Reading to the body's end gives the connection back to the pool."""
        watch.attach(http, self.read_timeout)
        http_errors = sdk_http()
        # a chunked body read straight from the connection (chunked_body says why); else the transport's own
        # byte stream unless the body is compressed: iter_bytes and iter_raw add a re-chunker and two
        # generators to every read
        encoded = http.headers.get("content-encoding", "identity").strip().lower() not in ("", "identity")
        body = None if encoded else chunked_body(http, watch)
        if body is None:
            body = _touching(http.iter_bytes() if encoded else http.stream, watch)
        return self._assemble(_reading(body), request, started, watch, lambda: http.request, http.close,
                              timeouts=(http_errors.TimeoutException, BodyTimeout),
                              broken=(http_errors.TransportError, BodyBroken))

    def _read_plain_stream(self, plain: PlainPost, conn: Connection, head: Head, request: ModelRequest,
                           started: float, watch: Watch) -> ModelResponse:
        """:meth:`_read_stream` of an answer on a plain connection (models/_plain_http.py); the connection is kept
        for the next call when it was read to its end.  A chunked answer nobody watches (no ``on_delta``) is read
        by the process's stream pump (models/_stream_pump.py says why) when its connection stays open, any other in
        this thread."""
        with _stream_pump.PUMP.reading() as crowded:
            return self._read_plain_answer(plain, conn, head, request, started, watch, crowded)

    def _read_plain_answer(self, plain: PlainPost, conn: Connection, head: Head, request: ModelRequest,
                           started: float, watch: Watch, crowded: bool) -> ModelResponse:
        watch.timeout = self.read_timeout
        watch.touch()
        broken = (OSError, ValueError, zlib.error, BodyBroken)
        if not crowded or request.on_delta is not None or not head.chunked or not head.keep:
            return self._assemble(_reading(_touching(body_chunks(conn, head), watch)), request, started, watch,
                                  plain.request, lambda: plain.finish(conn, head), timeouts=(TimeoutError,),
                                  broken=broken)
        sock = conn.sock

        def pumped(take: Callable[[bytes], bool]) -> None:
            head.ended = _stream_pump.PUMP.read(sock, conn.taken(), inflating(take, head.get("content-encoding")),
                                                watch.touch)

        return self._assemble(pumped, request, started, watch, plain.request, lambda: plain.finish(conn, head),
                              timeouts=(TimeoutError,), broken=broken)

    def _assemble(self, read: Callable[[Callable[[bytes], bool]], None], request: ModelRequest, started: float,
                  watch: Watch, sent: Callable[[], Any], close: Any, *, timeouts: tuple[type[BaseException], ...],
                  broken: tuple[type[BaseException], ...]) -> ModelResponse:
        """The answer of a streamed body that ``read(take)`` hands to ``take`` (bytes as they come, until ``take``
        says True: stop), each fragment handed to ``request.on_delta``; ``close()`` however it ends; a read error
        in ``timeouts``/``broken`` is the SDK's timeout/connection error (``sent()``: the request they carry, built
        only then) unless the watchdog cut the stream off or its end had come."""
        acc = Assembly(self.spec, request.on_delta, started)
        cancel = request.cancel
        events = SSEDecoder()
        done = False
        # nobody watches: each event's data is kept with the time it came and decoded at the stream's end, all in
        # one parse (settle), so a read costs a line split and an append where a parse per event cost its calls
        held: list[tuple[bytes, float]] | None = [] if request.on_delta is None else None

        def add(chunk: Any, at: float | None) -> None:
            if isinstance(chunk, dict) and chunk.get("error"):
                # an error object in the stream (the server failed mid-answer): retried like a 5xx
                raise StreamBroken(f"an error in the middle of the stream: {_snippet(_error_text(chunk), 120)}")
            acc.add(chunk, at)

        def decode(data: bytes, at: float | None) -> None:
            try:
                chunk = json.loads(data)
            except ValueError as exc:
                raise ModelError(f"{self.spec}: malformed stream chunk: {exc}") from None
            add(chunk, at)

        def settle() -> None:
            """The events kept so far decoded, in the order they came, with what decoding each as it came raised."""
            if not held:
                return
            kept = held[:]
            held.clear()
            values = decode_all([data for data, _ in kept])
            for i, (data, at) in enumerate(kept):
                if values is None:  # one of them is malformed: one by one, to name it
                    decode(data, at)
                else:
                    add(values[i], at)

        def event(data: bytes, at: float) -> bool:
            nonlocal done
            if done:
                return False  # after [DONE]: read on to the body's end only, so the connection can be kept
            if data[:6] == b"[DONE]":
                done = True
                watch.timeout = min(watch.timeout, DRAIN_S)  # a server that leaves the body open is not waited on
                return False
            if held is None:
                decode(data, None)
            else:
                held.append((data, at))
                if b'"error"' in data:
                    settle()  # it may be an error object: the read stops at it, as when each event is decoded as it comes
            return cancel is not None and cancel.is_set()

        def take(data: bytes) -> bool:
            at = time.perf_counter()
            return any(event(d, at) for d in events.feed(data))

        failed: str | None = None  # the SDK's error to raise: its timeout or its lost connection
        try:
            read(take)
            if not (cancel is not None and cancel.is_set()):
                for data in events.end():
                    event(data, time.perf_counter())
        except timeouts:
            failed = "APITimeoutError"
        except broken:
            failed = "APIConnectionError"
        except (KeyboardInterrupt, SystemExit) as exc:
            if cancel is None:
                raise
            # Ctrl-C or SIGTERM in the thread reading it (a one-job worker, `agentnb run`): stopped as a Stop
            # stops it, with what had arrived (the engine records it, then raises the interrupt again)
            with contextlib.suppress(Exception):
                settle()
            text, arguments = acc.partial()
            raise CallCancelled(partial_text=text, partial_arguments=arguments, interrupt=exc) from None
        finally:
            WATCHDOG.done(watch)
            close()
        settle()  # what came before the stream's end or failure, which a malformed chunk there would have ended
        if failed is not None and watch.why is None and not done:
            raise getattr(_sdk(), failed)(request=sent())
        if watch.why == "cancelled" or (cancel is not None and cancel.is_set()):
            text, arguments = acc.partial()
            raise CallCancelled(partial_text=text, partial_arguments=arguments)
        if watch.why == "stalled" and not done:
            raise StreamStalled(f"stream stalled: no chunk for {self.read_timeout:g} s")
        if acc.finish_reason is None:
            raise StreamBroken("the stream ended before the answer did (no finish_reason)")
        return _response(acc.message(), acc.usage, request, ttft_s=acc.ttft(), head=acc.head,
                         finish_reason=acc.finish_reason)

    def _wire(self, messages: Sequence[Message]) -> list[dict[str, object]]:
        """``wire_messages(messages)``, each message converted once: the part that is the previous request's
        (the same frozen objects, in order) is taken from it, so a call costs what it added, not the whole
        conversation again."""
        sent, wire = self._sent  # one read: another thread's call may replace it meanwhile
        same, n = 0, min(len(sent), len(messages))
        while same < n and messages[same] is sent[same]:
            same += 1
        out = wire[:same] + [wire_message(m) for m in messages[same:]]
        self._sent = (list(messages), out)
        return out

    @staticmethod
    def _retry_after(exc: Exception) -> float | None:
        """The wait the server asked for: ``retry-after-ms``, ``retry-after`` in seconds or as an HTTP date."""
        response = getattr(exc, "response", None)
        if response is None:
            return None
        try:
            ms = response.headers.get("retry-after-ms")
            if ms:
                return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
        header = response.headers.get("retry-after")
        if not header:
            return None
        try:
            return max(0.0, float(header))
        except ValueError:
            pass
        try:
            from email.utils import parsedate_to_datetime

            return max(0.0, parsedate_to_datetime(header).timestamp() - time.time())
        except (TypeError, ValueError, IndexError):
            return None


def pause(delay: float, cancel: threading.Event | None) -> bool:
    """Wait ``delay`` seconds before the next try; True, at once, when the job's Stop comes meanwhile."""
    if cancel is None:
        time.sleep(delay)
        return False
    return cancel.wait(delay)


def wire_message(m: Message) -> dict[str, object]:
    """One message as Chat Completions takes it."""
    if isinstance(m, ToolMessage):
        return {"role": "tool", "tool_call_id": m.call_id, "content": m.text}
    if isinstance(m, AssistantMessage):
        out: dict[str, object] = {"role": "assistant", "content": m.text}
        if m.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments_text()}}
                                 for c in m.tool_calls]
        return out
    if isinstance(m, UserMessage):
        if not m.images:
            return {"role": "user", "content": m.text}
        return {"role": "user", "content": [{"type": "text", "text": m.text},
                                            *({"type": "image_url", "image_url": {"url": i.url}} for i in m.images)]}
    if isinstance(m, SystemMessage):
        return {"role": "system", "content": m.text}
    raise TypeError(f"not a message: {m!r}")


def wire_messages(messages: Sequence[Message]) -> list[dict[str, object]]:
    """A conversation as the ``messages`` of a Chat Completions request."""
    return [wire_message(m) for m in messages]


def _kind(value: Any) -> str:
    """What a JSON value is, for a one-line reason."""
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


def _snippet(text: str, limit: int = 60) -> str:
    # secrets masked before the cut: a key cut short here would be a piece the store's scrub cannot know
    one = " ".join(scrub(text).split())
    return repr(one if len(one) <= limit else one[:limit] + "…")


def _parse_completion(http: Any, request: ModelRequest) -> ModelResponse:
    """A chat completion's JSON body as a :class:`ModelResponse`; :class:`MalformedAnswer` says why it is not one."""
    text = http.text
    ctype = (http.headers.get("content-type") or "").split(";")[0].strip().lower()
    try:
        data = json.loads(text)
    except ValueError as exc:
        if ctype and "json" not in ctype:
            raise MalformedAnswer(f"HTTP 200 with content-type {ctype}, not JSON: {_snippet(text)}") from None
        reason = f"{exc.msg} at line {exc.lineno}, column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise MalformedAnswer(f"the body is not valid JSON ({reason}): {_snippet(text)}") from None
    if not isinstance(data, dict):
        raise MalformedAnswer(f"the body is {_kind(data)}, not a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list):
        if "choices" not in data:
            keys = ", ".join(sorted(map(str, data))[:8]) or "none"
            raise MalformedAnswer(f"the body has no choices (its keys: {keys})")
        raise MalformedAnswer(f"choices is {_kind(choices)}, not a list")
    if not choices:
        raise MalformedAnswer("choices is an empty list")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise MalformedAnswer(f"choices[0] is {_kind(choice)}, not an object")
    msg = choice.get("message")
    if not isinstance(msg, dict):
        raise MalformedAnswer("choices[0] has no message" if msg is None
                              else f"choices[0].message is {_kind(msg)}, not an object")
    return _response(msg, data.get("usage"), request, head=data, finish_reason=choice.get("finish_reason"))


def _response(msg: dict[str, Any], u: Any, request: ModelRequest, ttft_s: float | None = None,
              head: dict[str, Any] | None = None, finish_reason: Any = None) -> ModelResponse:
    """A chat completion's message and usage, whole or assembled from a stream, as a :class:`ModelResponse`;
    ``head``: the body's (or the first chunk's) ``id`` and ``model``."""
    content = msg.get("content")
    if isinstance(content, list):  # content parts, as some compatible servers send
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict)) or None
    elif content is not None and not isinstance(content, str):
        raise MalformedAnswer(f"choices[0].message.content is {_kind(content)}, not text")
    if content:
        content = joined_text([content])  # a lone surrogate (text that cannot be stored) is U+FFFD
    raw_calls = msg.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise MalformedAnswer(f"choices[0].message.tool_calls is {_kind(raw_calls)}, not a list")
    calls = []
    for i, tc in enumerate(raw_calls):
        if not isinstance(tc, dict):
            raise MalformedAnswer(f"choices[0].message.tool_calls[{i}] is {_kind(tc)}, not an object")
        calls.append(_tool_call(tc, i, request))
    usage = None
    if isinstance(u, dict) and _count(u.get("prompt_tokens")) is not None:
        usage = TokenUsage(_count(u["prompt_tokens"]) or 0, _count(u.get("completion_tokens")) or 0)
    details = u.get("prompt_tokens_details") if isinstance(u, dict) else None
    head = head or {}
    return ModelResponse(content=content, tool_calls=tuple(calls), usage=usage, ttft_s=ttft_s,
                         response_model=_text_or_none(head.get("model")), response_id=_text_or_none(head.get("id")),
                         finish_reason=_text_or_none(finish_reason),
                         cached_tokens=_count(details.get("cached_tokens")) if isinstance(details, dict) else None)


def _text_or_none(value: Any) -> str | None:
    """A short label the endpoint sent (a model name, an id), or None when it sent none or not text."""
    return value[:200] if isinstance(value, str) and value else None


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        return None
    return int(value)


def _tool_call(tc: dict[str, Any], i: int, request: ModelRequest) -> ToolCall:
    """One tool call.  A missing or null function name is kept as ``""``: the loop answers it with a tool
    error the model reads, as it does for a name that is not a tool."""
    fn = tc.get("function")
    fn = fn if isinstance(fn, dict) else {}
    name = fn.get("name")
    name = "" if name is None else str(name)
    call_id = tc.get("id")
    # the tool message must name the call it answers; ids unique within the movement, like scripted ones
    call_id = str(call_id) if call_id not in (None, "") else f"call_{request.movement_seq}_{request.iteration}_{i}"
    raw = fn.get("arguments")
    if isinstance(raw, (dict, list)):  # some compatible servers send an object, not JSON text
        args: Any = raw
        raw = json.dumps(raw, ensure_ascii=False)
    else:
        raw = raw if isinstance(raw, str) and raw.strip() else "{}"
        try:
            args = json.loads(raw)
        except json.JSONDecodeError:
            args = raw  # the tool reports it; the model's text is kept verbatim
        if isinstance(args, str):  # JSON text encoded twice: the object is one decode further
            try:
                inner = json.loads(args)
            except json.JSONDecodeError:
                inner = None
            if isinstance(inner, dict):
                args = inner
    return ToolCall(id=call_id, name=name, arguments=args, raw_arguments=raw)


def _reading(body: Iterator[bytes]) -> Callable[[Callable[[bytes], bool]], None]:
    """A streamed ``body`` read in the call's thread, for :meth:`OpenAIModel._assemble`: each piece to ``take``
    until it says stop."""
    def read(take: Callable[[bytes], bool]) -> None:
        for data in body:
            if take(data):
                return

    return read


def _touching(chunks: Iterator[bytes], watch: Watch) -> Iterator[bytes]:
    """``chunks``, telling the watchdog that the stream is alive at each one."""
    for chunk in chunks:
        watch.touch()
        yield chunk


def _error_text(chunk: dict[str, Any]) -> str:
    err = chunk.get("error")
    message = err.get("message") if isinstance(err, dict) else None
    return message if isinstance(message, str) and message else "An error occurred during streaming"


def _message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    return str(getattr(exc, "message", exc))
