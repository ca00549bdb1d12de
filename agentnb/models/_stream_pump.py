"""Streamed answers nobody watches, read by one thread for the whole process (docs/models.md#streaming).

A streamed answer comes as one small HTTP chunk per server-sent event, about twenty a call.  Read by the call's
own thread, each chunk wakes that thread: a context switch and a turn at the GIL, which at 32 calls at once cost
more than the events' decoding and took a fifth of a batch's throughput (benchmarks/README.md, "Streamed
answers").  :data:`PUMP` is one thread with a selector over the sockets of every streamed answer on a plain
connection (models/_plain_http.py) that no live view watches: it reads whatever has come on each, undoes the
chunked framing (:class:`Unchunker`) and hands the body's bytes to the call's sink (the event decoding and the
:class:`~agentnb.models.openai_stream.Assembly`), in its own thread; the call's thread sleeps until the answer's
end.  Under load one wake-up of the pump takes the events of several answers.

Everything else stays with the call's thread and the watchdog: a Stop or a stall shuts the socket down, which the
pump reads as the connection's end; what the sink raises (a malformed chunk, an error in the stream) is raised in
the call's thread.  A call whose deltas are watched (a live view, ``agentnb run --follow``) reads its own socket as
before, so no subscriber is ever called from here.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterator

__all__ = ["PUMP", "BodyBroken", "Pump", "Unchunker"]

# streamed answers already being read in the process from which the next one is read by the pump: below it a call's
# own thread reads it for less (benchmarks/README.md, "Streamed answers")
CROWD = 3
# the largest chunk-size line (with its extensions) read before the framing is called broken
MAX_CHUNK_LINE = 4096


class BodyBroken(Exception):
    """The connection failed or closed, or the chunked framing is broken, before the body's end."""


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
            self.left = size
        return out[0] if len(out) == 1 else b"".join(out)


Sink = Callable[[bytes], bool]  # takes the body's bytes as they come; True: read no more


class _Read:
    __slots__ = ("clean", "done", "error", "sink", "sock", "touch", "unchunk")

    def __init__(self, sock: socket.socket, sink: Sink, touch: Callable[[], None]) -> None:
        self.sock, self.sink, self.touch = sock, sink, touch
        self.unchunk = Unchunker()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.clean = False  # read to the body's end with nothing after it: the connection can be kept

    def take(self, data: bytes) -> bool:
        """Feed ``data``; True when this read is over (its end, the sink's stop or an error)."""
        try:
            body = self.unchunk.feed(data)
            if body and self.sink(body):
                return True
        except BaseException as exc:  # the call's thread raises it
            self.error = exc
            return True
        if self.unchunk.ended:
            self.clean = not self.unchunk.extra
            return True
        return False


class Pump:
    """The thread that reads the streamed bodies handed to :meth:`read`, started at the first."""

    def __init__(self) -> None:
        self.open = 0  # streamed answers being read in this process (by the pump or by their own threads)
        self._lock = threading.Lock()
        self._new: deque[_Read] = deque()
        self._thread: threading.Thread | None = None
        self._bell: tuple[socket.socket, socket.socket] | None = None

    @contextlib.contextmanager
    def reading(self) -> Iterator[bool]:
        """Count a streamed answer being read for as long as the block lasts; True when at least :data:`CROWD`
        others are: the pump is then worth a call's two extra hand-overs (alone, a call read by its own thread
        costs less: 1.5 against 1.7 ms of CPU)."""
        with self._lock:
            crowded = self.open >= CROWD
            self.open += 1
        try:
            yield crowded
        finally:
            with self._lock:
                self.open -= 1

    def read(self, sock: socket.socket, head: bytes, sink: Sink, touch: Callable[[], None]) -> bool:
        """Read the chunked body on ``sock`` (non-blocking: the caller read ``head``, its first bytes, without
        waiting) into ``sink`` until its end or the sink's stop, ``touch()`` at each read, while this thread waits;
        True when the body was read to its end with nothing after it (the connection can be kept once the caller
        gives the socket its timeout back).
        Raises what the sink raised, or :class:`BodyBroken` (the connection ended or failed first: a Stop's or a
        stall's shutdown too)."""
        r = _Read(sock, sink, touch)
        if not (head and r.take(head)):
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._start()
                self._new.append(r)
                assert self._bell is not None
                with contextlib.suppress(BlockingIOError):  # a full bell has rung already
                    self._bell[1].send(b"\0")
            try:
                r.done.wait()
            except BaseException:
                # Ctrl-C while waiting: the pump lets go of the socket before the caller closes it
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                r.done.wait(1.0)
                raise
        if r.error is not None:
            raise r.error
        return r.clean

    def _start(self) -> None:
        selector = selectors.DefaultSelector()
        self._bell = socket.socketpair()
        for end in self._bell:
            end.setblocking(False)
        selector.register(self._bell[0], selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, args=(selector, self._bell[0]),
                                        name="agentnb-stream-pump", daemon=True)
        self._thread.start()

    def _run(self, selector: selectors.BaseSelector, bell: socket.socket) -> None:
        while True:
            for key, _ in selector.select():
                r: _Read | None = key.data
                if r is None:
                    with contextlib.suppress(OSError):
                        bell.recv(4096)
                    self._admit(selector)
                    continue
                try:
                    data = r.sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    self._end(selector, r, BodyBroken(f"{type(exc).__name__}: {exc}"))
                    continue
                if not data:
                    self._end(selector, r, BodyBroken("the connection closed before the body's end"))
                    continue
                r.touch()
                if r.take(data):
                    self._end(selector, r, None)

    def _admit(self, selector: selectors.BaseSelector) -> None:
        while True:
            with self._lock:
                if not self._new:
                    return
                r = self._new.popleft()
            try:
                selector.register(r.sock, selectors.EVENT_READ, r)
            except (OSError, ValueError, KeyError) as exc:  # closed meanwhile
                r.error = BodyBroken(f"the connection could not be read: {exc}")
                r.done.set()

    @staticmethod
    def _end(selector: selectors.BaseSelector, r: _Read, error: BaseException | None) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            selector.unregister(r.sock)
        if r.error is None:
            r.error = error
        r.done.set()


PUMP = Pump()


def _forked() -> None:
    """A forked child has no pump thread, and the sockets it read are the parent's."""
    global PUMP
    PUMP = Pump()


os.register_at_fork(after_in_child=_forked)
