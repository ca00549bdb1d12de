"""A plain ``openai:`` call's HTTP below httpx (models/_plain_http.py): the request the SDK sends, kept-alive
connections, the SDK's errors, and the answers an HTTP/1.x server may give, against real loopback servers."""

from __future__ import annotations

import gzip
import json
import select
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
from openai_server import OpenAIServer, error, midway, raw, reply

from agentnb.models.base import ModelError, ModelRequest, ModelResponse
from agentnb.models.messages import UserMessage
from agentnb.models.openai import OpenAIModel

KEY = "sk-test-plain-http-7d2e"
TOOLS = [{"type": "function", "function": {"name": "echo", "description": "Échoes the text — unchanged.",
                                           "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}]


def _ask(model: OpenAIModel, text: str = "Say “hi” ✓") -> ModelResponse:
    return model.complete(ModelRequest(messages=[UserMessage(text)], tools=TOOLS))


def _model(url: str, **kw: Any) -> OpenAIModel:
    return OpenAIModel("m?stream=0", base_url=url, api_key=KEY, backoff=0.01, **kw)


@pytest.mark.parametrize("env", [{}, {"OPENAI_ORG_ID": "org-7f", "OPENAI_PROJECT_ID": "proj_3c"}],
                         ids=["plain", "organization-and-project"])
def test_a_plain_call_sends_what_the_sdk_sends(loopback: Callable[..., OpenAIServer],
                                              monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    below = loopback(KEY, actions=[reply("hi", usage=(7, 2))])
    assert _ask(_model(below.base_url)).content == "hi"
    monkeypatch.setenv("AGENTNB_OPENAI_HTTP", "sdk")  # the openai SDK's own HTTP stack, for the comparison
    sdk = loopback(KEY, actions=[reply("hi", usage=(7, 2))])
    assert _ask(_model(sdk.base_url)).content == "hi"
    (ours,), (theirs,) = below.received, sdk.received
    assert ours.body == theirs.body and ours.path == theirs.path
    assert ours.body["messages"] == [{"role": "user", "content": "Say “hi” ✓"}]

    def headers(r: Any) -> dict[str, str]:
        return {k: v for k, v in r.headers.items() if k not in ("host", "content-length")}

    assert headers(ours) == headers(theirs)
    assert headers(ours)["authorization"] == f"Bearer {KEY}"
    # the same bytes: the SDK's JSON (compact, not ASCII-escaped) for the same body
    assert int(ours.headers["content-length"]) == int(theirs.headers["content-length"])
    for name, value in env.items():
        header = {"OPENAI_ORG_ID": "openai-organization", "OPENAI_PROJECT_ID": "openai-project"}[name]
        assert ours.headers[header] == value


def test_headers_from_openai_custom_headers_are_sent_as_the_sdk_reads_them(
        loopback: Callable[..., OpenAIServer], monkeypatch: pytest.MonkeyPatch) -> None:
    # the SDK's own parsing of the variable is kept: such a call goes through its client
    monkeypatch.setenv("OPENAI_CUSTOM_HEADERS", "X-Gateway-Route: eu-2\nX-Team:  lab ")
    server = loopback(KEY, actions=[reply("hi"), reply("again")])
    model = _model(server.base_url)
    assert [_ask(model).content, _ask(model).content] == ["hi", "again"]
    for received in server.received:
        assert (received.headers["x-gateway-route"], received.headers["x-team"]) == ("eu-2", "lab")
        assert received.headers["authorization"] == f"Bearer {KEY}"


_FRESH_PROCESS = """
import json, sys
from agentnb.models.base import ModelRequest
from agentnb.models.messages import UserMessage
from agentnb.models.openai import OpenAIModel
seen = []
for spec in ("m?stream=0", "m?stream=1", "m?stream=0"):
    model = OpenAIModel(spec, base_url=sys.argv[1], api_key="sk-test", backoff=0.01)
    seen.append((model.complete(ModelRequest(messages=[UserMessage("hi")], tools=[])).content,
                 sorted({m.partition(".")[0] for m in sys.modules} & {"openai", "httpx", "httpx2", "pydantic"})))
print(json.dumps(seen))
"""


def test_a_process_s_plain_calls_to_an_http_endpoint_never_import_the_sdk(
        loopback: Callable[..., OpenAIServer]) -> None:
    # the SDK's import costs a process 0.4-0.8 s of CPU (each worker paid it before its first call): a plain or
    # streamed call to an http:// endpoint needs none of it; the first failure imports it for its exception
    server = loopback(KEY, actions=[reply("plain"), reply("streamed"), *error(503, "busy"), reply("after a 503")])
    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, server.base_url], capture_output=True, text=True,
                          timeout=120, check=True)
    (plain, plain_sdk), (streamed, streamed_sdk), (retried, retried_sdk) = json.loads(done.stdout)
    assert (plain, plain_sdk, streamed, streamed_sdk) == ("plain", [], "streamed", [])
    assert retried == "after a 503" and "openai" in retried_sdk
    assert server.streamed == 1 and [a.status for a in server.log] == [200, 200, 503, 200]


def test_plain_calls_keep_their_connection(loopback: Callable[..., OpenAIServer]) -> None:
    server = loopback(KEY, chunked=True, actions=[reply(f"answer {i}") for i in range(5)])
    model = _model(server.base_url)
    assert [_ask(model).content for _ in range(5)] == [f"answer {i}" for i in range(5)]
    assert server.connections == 1


@pytest.mark.parametrize("actions", [
    error(400, "bad tool schema"), error(401, "Incorrect API key"), error(404, "no such model"),
    error(422, "unprocessable"), raw("<html>teapot</html>", "text/html", status=418),
    raw('["not", "an object"]', status=409), error(503, "overloaded", times=2),
], ids=["400", "401", "404", "422", "418-html", "409-list", "503-gave-up"])
def test_an_error_reads_as_through_the_sdk(loopback: Callable[..., OpenAIServer], monkeypatch: pytest.MonkeyPatch,
                                           actions: list[dict[str, Any]]) -> None:
    messages = []
    for path in ("below", "sdk"):
        if path == "sdk":
            monkeypatch.setenv("AGENTNB_OPENAI_HTTP", "sdk")
        server = loopback(KEY, actions=[dict(a) for a in actions])
        with pytest.raises(ModelError) as caught:
            _ask(_model(server.base_url, max_retries=1))
        messages.append(str(caught.value).replace(server.base_url, "URL"))
    assert messages[0] == messages[1]


def test_a_429_is_retried_after_what_the_server_asks(loopback: Callable[..., OpenAIServer]) -> None:
    server = loopback(KEY, actions=[*error(429, "slow down", headers={"retry-after-ms": "30"}), reply("ok")])
    assert _ask(_model(server.base_url)).content == "ok"
    assert [a.status for a in server.log] == [429, 200]


# -- answers the test server does not give: a socket server that plays raw HTTP answers -------------------------


@contextmanager
def _raw_server(answers: list[bytes | tuple[bytes, str] | list[bytes | float]]) -> Iterator[tuple[str, list[int]]]:
    """Plays ``answers`` in order, one per request (a connection is kept until the client or the answer closes it;
    ``(answer, "then close")`` closes it after that answer without saying so, as a server ending an idle
    keep-alive connection; a list is sent piece by piece, 20 ms apart, a number in it a pause of that many
    seconds); yields the base URL and the counts so far of connections accepted and closed by it."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = [0, 0]
    todo = list(answers)

    def serve_one(conn: socket.socket) -> None:
        try:
            _serve(conn)
        finally:
            conn.close()
            accepted[1] += 1

    def _serve(conn: socket.socket) -> None:
        buf = b""
        while todo:
            while b"\r\n\r\n" not in buf:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            while len(buf) < length:
                buf += conn.recv(65536)
            buf = buf[length:]
            answer = todo.pop(0)
            if isinstance(answer, list):
                for piece in answer:
                    if isinstance(piece, float):
                        time.sleep(piece)
                        continue
                    conn.sendall(piece)
                    time.sleep(0.02)
                continue
            conn.sendall(answer[0] if isinstance(answer, tuple) else answer)
            if isinstance(answer, tuple) or b"connection: close" in answer.lower() or b"HTTP/1.0" in answer[:8]:
                return

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted[0] += 1
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1", accepted
    finally:
        listener.close()


def _completion(text: str) -> bytes:
    return json.dumps({"id": "c1", "model": "m", "choices": [{"index": 0, "message": {"role": "assistant",
                      "content": text}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 3,
                      "completion_tokens": 1}}).encode()


def _answer(body: bytes, *head: str, status: str = "200 OK", version: str = "HTTP/1.1") -> bytes:
    lines = [f"{version} {status}", "content-type: application/json", *head]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _chunked(body: bytes, size: int) -> bytes:
    parts = [b"%x;ext=1\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\nx-trailer: 1\r\n\r\n"


def test_the_answers_an_http_server_may_give() -> None:
    one, two, three = _completion("one"), _completion("two ✓"), _completion("three")
    zipped = gzip.compress(one)
    deflate = zlib.compressobj(wbits=-15)
    deflated = deflate.compress(three) + deflate.flush()
    answers = [
        # an interim 100, then a gzip body by content-length
        b"HTTP/1.1 100 Continue\r\n\r\n" + _answer(zipped, "content-encoding: gzip", f"content-length: {len(zipped)}"),
        # chunked, with chunk extensions and a trailer; on the same connection
        _answer(_chunked(two, 7), "transfer-encoding: chunked"),
        # a raw deflate stream, as some servers send "deflate"
        _answer(deflated, "content-encoding: deflate", f"content-length: {len(deflated)}"),
    ]
    # the body ends with the connection (no length): then a new connection for the next call
    answers.append(_answer(_completion("four"), "connection: close"))
    answers.append(_answer(_completion("five"), f"content-length: {len(_completion('five'))}", version="HTTP/1.0"))
    answers.append(_answer(_completion("six"), f"content-length: {len(_completion('six'))}"))
    with _raw_server(answers) as (url, accepted):
        model = _model(url)
        assert [_ask(model).content for _ in range(6)] == ["one", "two ✓", "three", "four", "five", "six"]
        assert accepted[0] == 3  # kept after 1–3; closed by "four" and by the HTTP/1.0 "five"


def test_header_lines_the_way_old_servers_write_them() -> None:
    one, two = _completion("bare LF"), _completion("folded")
    answers = [
        # lines ended by a bare LF
        f"HTTP/1.1 200 OK\ncontent-type: application/json\ncontent-length: {len(one)}\n\n".encode() + one,
        # a folded continuation line, a field repeated, space before the colon; no reason phrase
        (f"HTTP/1.1 200\r\ncontent-type: application/json\r\nx-note: a\r\n  b\r\nx-note: c\r\n"
         f"content-length : {len(two)}\r\n\r\n").encode() + two,
    ]
    with _raw_server(answers) as (url, accepted):
        model = _model(url)
        assert [_ask(model).content for _ in range(2)] == ["bare LF", "folded"]
        assert accepted[0] == 1


def test_a_connection_the_server_closed_while_idle_is_not_reused() -> None:
    first, second = _completion("first"), _completion("second")
    answers: list[bytes | tuple[bytes, str]] = [(_answer(first, f"content-length: {len(first)}"), "then close"),
                                                _answer(second, f"content-length: {len(second)}")]
    with _raw_server(answers) as (url, accepted):
        model = _model(url, max_retries=0)  # a stale connection's failure would fail the call
        assert _ask(model).content == "first"
        deadline = time.monotonic() + 30
        while accepted[1] < 1 and time.monotonic() < deadline:  # the server closed it, unasked
            time.sleep(0.01)
        assert _ask(model).content == "second"
        assert accepted[0] == 2


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\nconnection: close\r\n\r\n{\"id\"",
    b"not HTTP at all\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: twelve\r\nconnection: close\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\n" + b"x-many: 1\r\n" * 101 + b"connection: close\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nx-long: " + b"y" * 70_000 + b"\r\nconnection: close\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nno colon on this line\r\nconnection: close\r\n\r\n",
], ids=["cut-short", "not-http", "bad-chunk", "bad-length", "too-many-fields", "too-long-head", "bad-field"])
def test_a_broken_answer_is_a_connection_error_and_retried(answer: bytes) -> None:
    fine = _completion("fine")
    with _raw_server([answer, _answer(fine, f"content-length: {len(fine)}")]) as (url, _):
        assert _ask(_model(url)).content == "fine"
    with _raw_server([answer]) as (url, _), pytest.raises(ModelError) as caught:
        _ask(_model(url, max_retries=0))
    assert "APIConnectionError: Connection error." in str(caught.value)


def test_a_redirect_is_followed_through_the_sdk(loopback: Callable[..., OpenAIServer]) -> None:
    target = loopback(KEY, actions=[reply("moved")])
    moved = _answer(b"", f"location: {target.base_url}/chat/completions", "content-length: 0",
                    status="307 Temporary Redirect")
    with _raw_server([moved, moved]) as (url, _):
        model = _model(url)
        assert _ask(model).content == "moved"  # asked again through the SDK, which follows the 307
    assert [r.body["messages"][0]["content"] for r in target.received] == ["Say “hi” ✓"]


def test_a_timeout_is_the_sdks_timeout() -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (the backlog), never answers
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        with pytest.raises(ModelError) as caught:
            _ask(_model(url, max_retries=0, timeout=0.2))
        assert "APITimeoutError: Request timed out." in str(caught.value)
    finally:
        listener.close()


def test_a_refused_connection_is_the_sdks_connection_error() -> None:
    spare = socket.create_server(("127.0.0.1", 0))
    port = spare.getsockname()[1]
    spare.close()
    with pytest.raises(ModelError) as caught:
        _ask(_model(f"http://127.0.0.1:{port}/v1", max_retries=0))
    assert "APIConnectionError: Connection error." in str(caught.value)


# -- streamed answers nobody watches: read by the process's stream pump (models/_stream_pump.py) -----------------


def _events(*parts: str, usage: bool = True) -> bytes:
    """A streamed answer's event stream: ``parts`` of text, the end, the usage chunk, ``[DONE]``."""
    chunks: list[dict[str, Any]] = [{"id": "c1", "model": "m", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": p} if i == 0 else {"content": p},
         "finish_reason": None}]} for i, p in enumerate(parts)]
    chunks.append({"id": "c1", "model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if usage:
        chunks.append({"id": "c1", "model": "m", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _streamed(body: bytes, *head: str) -> bytes:
    return ("\r\n".join(["HTTP/1.1 200 OK", "content-type: text/event-stream", *head]) + "\r\n\r\n").encode() + body


def _streaming(url: str, **kw: Any) -> OpenAIModel:
    return OpenAIModel("m", base_url=url, api_key=KEY, backoff=0.01, **kw)


@pytest.mark.usefixtures("pump_from_the_first")
def test_the_streamed_answers_an_http_server_may_give() -> None:
    texts = ["un ✓", "deux — 😀", "trois", "quatre", "cinq"]
    zipped = gzip.compress(_events("deux", " — 😀"))
    deflate = zlib.compressobj(wbits=-15)
    deflated = deflate.compress(_events("tr", "ois")) + deflate.flush()
    answers = [
        # chunked in pieces of 7 bytes, with extensions and a trailer, the framing cut anywhere
        _streamed(_chunked(_events("un", " ✓"), 7), "transfer-encoding: chunked"),
        # gzip, then a raw deflate stream, each in chunks of 5 bytes; on the same connection
        _streamed(_chunked(zipped, 5), "transfer-encoding: chunked", "content-encoding: gzip"),
        _streamed(_chunked(deflated, 5), "transfer-encoding: chunked", "content-encoding: deflate"),
        # one chunk holding the whole stream, no usage (counted by the tokenizer)
        _streamed(_chunked(_events("quatre", usage=False), 10_000), "transfer-encoding: chunked"),
        # not chunked: the stream ends with the connection (read in the call's thread)
        _streamed(_events("ci", "nq"), "connection: close"),
    ]
    with _raw_server(answers) as (url, accepted):
        model = _streaming(url)
        got = [_ask(model) for _ in texts]
        assert [r.content for r in got] == texts
        assert accepted[0] == 1  # each chunked stream read to its end: the next call went on the same connection
    assert got[0].usage.prompt_tokens == 3 and got[0].ttft_s is not None and got[0].ttft_s >= 0


@pytest.mark.usefixtures("pump_from_the_first")
def test_a_streamed_request_answered_with_an_error_an_interim_100_a_split_head_or_a_whole_answer(
        capsys: pytest.CaptureFixture[str]) -> None:
    # the call's thread reads the head (in as many pieces as it comes); the pump only a chunked event stream's body
    busy = json.dumps({"error": {"message": "slow down"}}).encode()
    answers: list[bytes | tuple[bytes, str] | list[bytes | float]] = [
        # a 429 (retried), then an interim 100 before a stream
        b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 0\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(busy), busy),
        b"HTTP/1.1 100 Continue\r\n\r\n" + _streamed(_chunked(_events("after ", "continue"), 9),
                                                     "transfer-encoding: chunked"),
        # the head in pieces, cut inside a field and between its two line ends
        [b"HTTP/1.1 200 OK\r\ncontent-", b"type: text/event-stream\r\ntransfer-enc",
         b"oding: chunked\r\n\r", b"\n" + _chunked(_events("split ", "head ✓"), 11)],
        # a whole answer to a streamed request: given back, read whole, and the model streams no more
        _answer(_completion("whole"), f"content-length: {len(_completion('whole'))}"),
    ]
    with _raw_server(answers) as (url, accepted):
        model = _streaming(url)
        assert [_ask(model).content for _ in range(3)] == ["after continue", "split head ✓", "whole"]
        assert accepted[0] == 1  # every answer was read to its end: each call went on the same connection
    assert "does not stream" in capsys.readouterr().err


@pytest.mark.usefixtures("pump_from_the_first")
def test_no_head_within_the_timeout_is_a_timeout_retried() -> None:
    good = _streamed(_chunked(_events("in time"), 9), "transfer-encoding: chunked")
    with _raw_server([[1.0], good]) as (url, accepted):
        assert _ask(_streaming(url, timeout=0.3)).content == "in time"
        assert accepted[0] == 2  # the silent connection was given up
    with _raw_server([[1.0]]) as (url, _), pytest.raises(ModelError) as caught:
        _ask(_streaming(url, timeout=0.3, max_retries=0))
    assert "last error APITimeoutError: Request timed out." in str(caught.value)


@pytest.mark.parametrize("broken", [b"zz\r\n", b"5\r\nabcdeXY", b"f" * 5000], ids=["not-hex", "no-crlf", "long-line"])
@pytest.mark.usefixtures("pump_from_the_first")
def test_a_streamed_answer_whose_framing_breaks_midway_is_a_connection_error_and_retried(broken: bytes) -> None:
    start = _chunked(_events("never", " seen"), 9)[:40]
    answer = (_streamed(start + broken, "transfer-encoding: chunked"), "then close")  # kept alive, then broken
    good = _streamed(_chunked(_events("fine"), 9), "transfer-encoding: chunked")
    with _raw_server([answer, good]) as (url, _):
        assert _ask(_streaming(url)).content == "fine"
    with _raw_server([answer]) as (url, _), pytest.raises(ModelError) as caught:
        _ask(_streaming(url, max_retries=0))
    assert "APIConnectionError: Connection error." in str(caught.value)


@pytest.mark.parametrize("busy", [100, 0], ids=["each-read-at-once", "paced"])
@pytest.mark.usefixtures("pump_from_the_first")  # on a busy machine the calls may overlap less than CROWD asks
def test_many_streamed_calls_at_once_are_read_by_one_thread(loopback: Callable[..., OpenAIServer], busy: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from agentnb.models import _stream_pump

    monkeypatch.setattr(_stream_pump, "BUSY", busy)  # paced: the pump takes what came every PACE_S at most
    server = loopback(KEY, chunked=True, chunk_chars=2, actions=[reply(f"answer number {i} ✓") for i in range(24)])
    model = _streaming(server.base_url)
    got: list[str] = []
    together = threading.Barrier(8)  # eight streams open at once: from the fourth on, the pump reads them

    def ask() -> None:
        for _ in range(3):
            together.wait(30)
            got.append(_ask(model).content or "")

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got) == sorted(f"answer number {i} ✓" for i in range(24))
    assert server.streamed == 24
    assert [t.name for t in threading.enumerate()].count("agentnb-stream-pump") == 1
    assert server.connections <= 8  # every stream read to its end: its connection went back to the pool


@pytest.mark.parametrize("waits", ["epoll", "selector"])
@pytest.mark.parametrize("reads", ["gil-holding", "socket-module"])
@pytest.mark.usefixtures("pump_from_the_first")
def test_the_pump_reads_with_or_without_a_gil_holding_recv(loopback: Callable[..., OpenAIServer], reads: str,
                                                            waits: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the pump's reads keep the GIL where libc's recv can be called so (MSG_DONTWAIT); elsewhere the socket module's.
    # It waits on an epoll set the calls' threads add their sockets to (Linux), else on a selector and a bell.
    from agentnb.models import _stream_pump

    if waits == "epoll" and not hasattr(select, "epoll"):
        pytest.skip("epoll is Linux's")
    if reads == "socket-module":
        monkeypatch.delattr(socket, "MSG_DONTWAIT")
    if waits == "selector":
        monkeypatch.setattr(_stream_pump._Epoll, "made", classmethod(lambda cls: None))
    assert (_stream_pump._gil_holding_recv() is None) == (reads == "socket-module")
    pump = _stream_pump.Pump()
    monkeypatch.setattr(_stream_pump, "PUMP", pump)  # a pump of its own, started with that reader and that wait
    monkeypatch.setattr(_stream_pump, "BUSY", 2)  # paced from the third answer on: each wait's two ways of looking
    server = loopback(KEY, chunked=True, chunk_chars=2, actions=[reply(f"réponse {i} ✓") for i in range(12)])
    model = _streaming(server.base_url)
    with ThreadPoolExecutor(6) as pool:  # six threads adding their sockets to the one set, each answer its own
        got = sorted(pool.map(lambda _: _ask(model).content or "", range(12)))
    assert got == sorted(f"réponse {i} ✓" for i in range(12))
    assert type(pump._poller).__name__ == {"epoll": "_Epoll", "selector": "_Selected"}[waits]
    assert pump._reads == {}  # every answer's socket was let go at its end
    assert server.connections <= 6  # read to their ends: the connections went back to the pool


def test_the_pumps_selector_takes_a_socket_whose_number_a_closed_one_left_registered() -> None:
    # elsewhere than Linux the pump's selector keeps a key per socket number: a socket closed while registered (a
    # Ctrl-C the pump did not see in time) leaves its key, and the next socket given that number must be watched
    from agentnb.models._stream_pump import _Selected

    poller = _Selected()
    old, _ = socket.socketpair()
    number = old.fileno()
    poller.add(number)
    poller.ready(wait=False)  # taken in
    old.close()
    new, peer = socket.socketpair()
    if new.fileno() != number:
        pytest.skip("the system gave the new socket another number")
    poller.add(number)
    poller.ready(wait=False)  # taken in again
    assert poller.ready(wait=False) == []  # nothing has come yet
    peer.send(b"x")
    time.sleep(0.05)
    assert poller.ready(wait=False) == [number]
    new.close()
    peer.close()


@pytest.mark.usefixtures("pump_from_the_first")
def test_ctrl_c_while_a_streamed_answer_is_read_by_the_pump_closes_it(loopback: Callable[..., OpenAIServer]) -> None:
    import signal

    server = loopback(KEY, chunked=True, chunk_chars=2, actions=[midway("hold", after=6), reply("after")])
    main = threading.get_ident()
    threading.Thread(target=lambda: server.holding.wait(30) and (time.sleep(0.2),
                                                                 signal.pthread_kill(main, signal.SIGINT))).start()
    model = _streaming(server.base_url)
    with pytest.raises(KeyboardInterrupt):
        _ask(model)  # no on_delta: the pump reads it while this thread waits
    assert server.disconnected.wait(2)
    assert _ask(model).content == "after"  # and the next call is fine


@pytest.mark.usefixtures("pump_from_the_first")
def test_a_forked_process_streams_through_a_pump_of_its_own(loopback: Callable[..., OpenAIServer]) -> None:
    import multiprocessing

    server = loopback(KEY, chunked=True, chunk_chars=3, actions=[reply("in the parent"), reply("in the child")])
    model = _streaming(server.base_url)
    assert _ask(model).content == "in the parent"  # the parent's pump runs (and holds no socket now)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=lambda: out.put(_ask(_streaming(server.base_url)).content))
    child.start()
    assert out.get(timeout=30) == "in the child"
    child.join(30)
    assert child.exitcode == 0
