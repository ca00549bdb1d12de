"""A streamed Chat Completions answer (docs/models.md#streaming): its chunks added up, and the watchdog that cuts
a stream off when its job is stopped or it stalls.

:class:`Assembly` turns ``chat.completion.chunk`` objects (text deltas; tool-call deltas by ``index``: id and name
first, then argument fragments, several calls interleaved; usage in the last chunk) into the same message a
non-streamed answer holds, so ``models/openai.py`` builds the response from it with the code that reads a whole
answer, and the stored ``llm_response`` is the same either way.

The model's thread reads the stream; while it is blocked in a read, only another thread can end that read at
once.  :data:`WATCHDOG`, one thread for the process, wakes every few hundredths of a second while streams are
open, and shuts down the socket of one whose job's Stop is set or that sent nothing for its read timeout: the
blocked read returns, and the model raises ``CallCancelled`` or retries it as a timeout.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .base import ModelError
from .messages import Delta

__all__ = ["WATCHDOG", "Assembly", "Watch", "Watchdog"]

# how often the watchdog looks at the open streams: a Stop cuts a stream off within about this
POLL_S = 0.05


class Assembly:
    """The chunks of one streamed answer so far; :meth:`message` is the answer as a non-streamed call has it."""

    __slots__ = ("_by_id", "calls", "content", "finish_reason", "first_token", "on_delta", "saw_content", "spec",
                 "started", "usage")

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

    def _bad(self, what: str) -> ModelError:
        return ModelError(f"{self.spec}: malformed stream chunk: {what}")

    def add(self, chunk: Any) -> None:
        """Add one decoded chunk; a :class:`ModelError` (one line) when it is not a ``chat.completion.chunk``."""
        if not isinstance(chunk, dict):
            raise self._bad(f"a chunk is {_kind(chunk)}, not a JSON object")
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
                self._delta(delta)
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])

    def _delta(self, delta: dict[str, Any]) -> None:
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
                    self._token()
                    if self.on_delta is not None:
                        self.on_delta(Delta(text=text))
        raw = delta.get("tool_calls")
        if raw is None:
            return
        if not isinstance(raw, list):
            raise self._bad(f"choices[0].delta.tool_calls is {_kind(raw)}, not a list")
        for tc in raw:
            if not isinstance(tc, dict):
                raise self._bad(f"a tool-call delta is {_kind(tc)}, not an object")
            self._tool_delta(tc)

    def _tool_delta(self, tc: dict[str, Any]) -> None:
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
        if call_id and not entry["id"]:
            entry["id"] = str(call_id)
            self._by_id[str(call_id)] = index
        if name and not entry["name"]:
            entry["name"] = str(name)
        fragment = ""
        if args_value is not None:
            entry["object"] = args_value
        elif isinstance(args, str) and args:
            entry["arguments"].append(args)
            fragment = args
        self._token()
        if self.on_delta is not None and (opened or fragment):
            self.on_delta(Delta(tool_index=index, tool_id=entry["id"] if opened else None,
                                tool_name=entry["name"] if opened else None, arguments=fragment))

    def _token(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()

    def message(self) -> dict[str, Any]:
        """The answer as ``choices[0].message`` of a whole one (content, tool calls in index order) and its usage."""
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) if self.saw_content else None}
        if self.calls:
            msg["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"],
                              "arguments": c["object"] if c["object"] is not None else "".join(c["arguments"])}}
                for _, c in sorted(self.calls.items())
            ]
        return msg

    def partial(self) -> tuple[str, str]:
        """The text and the tool calls' argument text that arrived (for a stopped call's token estimate)."""
        return "".join(self.content), "".join("".join(c["arguments"]) for c in self.calls.values())

    def ttft(self) -> float:
        """Seconds from the call's start to its first fragment (to its end when none came)."""
        return round((self.first_token or time.perf_counter()) - self.started, 6)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


class Watch:
    """One open stream as the watchdog sees it: :meth:`touch` at each chunk; ``why`` says why it was cut off."""

    __slots__ = ("cancel", "last", "sock", "timeout", "why")

    def __init__(self, sock: socket.socket | None, cancel: threading.Event | None, timeout: float) -> None:
        self.sock = sock
        self.cancel = cancel
        self.timeout = timeout
        self.last = time.monotonic()
        self.why: str | None = None  # "cancelled" or "stalled", once cut off

    def touch(self) -> None:
        self.last = time.monotonic()

    def cut(self, why: str) -> None:
        self.why = why
        if self.sock is not None:
            # shutdown, not close: it wakes a read blocked in another thread (close does not), and the server sees
            # the connection end at once; an OSError: it is closed already
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)


class Watchdog:
    """One thread for the process that cuts off streams whose job was stopped or that stalled."""

    def __init__(self) -> None:
        self._watches: set[Watch] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, response: Any, cancel: threading.Event | None, timeout: float) -> Watch:
        w = Watch(_socket_of(response), cancel, timeout)
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
                    w.cut("cancelled")
                elif now - w.last > w.timeout:
                    w.cut("stalled")
            time.sleep(POLL_S)


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
