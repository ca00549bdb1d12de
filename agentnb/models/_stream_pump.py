"""Streamed answers nobody watches, read by one thread for the whole process (docs/models.md#streaming).

A streamed answer comes as one small HTTP chunk per server-sent event, about twenty a call.  Read by the call's
own thread, each chunk wakes that thread: a context switch and a turn at the GIL, which at 32 calls at once cost
more than the events' decoding and took a fifth of a batch's throughput (benchmarks/README.md, "Streamed
answers").  :data:`PUMP` is one thread that waits on the sockets of every streamed answer on a plain connection
(models/_plain_http.py) that no live view watches: it reads whatever has come on each, undoes the chunked framing
(models/_http1.py's ``Unchunker``) and hands the body's bytes to the call's sink (which splits the events and keeps
them, with their arrival times, for the call's thread to decode at the end: ``OpenAIModel._assemble``), in its own
thread; the call's thread sleeps until the answer's end.  Under load one wake-up of the pump takes the events of
several answers.  On Linux it waits on an epoll set that the calls' threads add their sockets to themselves
(:class:`_Epoll`); elsewhere on a selector that only the pump changes, told of a new socket by a bell
(:class:`_Selected`).

Everything else stays with the call's thread and the watchdog: a Stop or a stall shuts the socket down, which the
pump reads as the connection's end; what the sink raises (a malformed chunk, an error in the stream) is raised in
the call's thread.  A call whose deltas are watched (a live view, ``agentnb run --follow``) reads its own socket as
before, so no subscriber is ever called from here.
"""

from __future__ import annotations

import contextlib
import os
import platform
import select
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from ._http1 import BodyBroken, Unchunker

__all__ = ["PUMP", "Pump"]

# streamed answers already being read in the process from which the next one is read by the pump: below it a call's
# own thread reads it for less (benchmarks/README.md, "Streamed answers")
CROWD = 3
# with this many answers or more on the pump, it takes what has come at most every PACE_S seconds: at 32 answers at
# once one wake-up (a turn at the GIL taken from the jobs' threads) then takes about ten sockets' chunks instead of
# three or four, for at most PACE_S more on an answer's end and on its first fragment's arrival time
BUSY = 8
PACE_S = 0.002
_READ = 65536  # the most bytes one read takes from a socket
_MAX_EVENTS = 256  # the most sockets one look of the pump takes (the rest at the next)
_EPOLLIN, _EPOLL_CTL_ADD, _EPOLL_CTL_DEL = 0x001, 1, 2  # <sys/epoll.h>

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
        self._reads: dict[int, _Read] = {}  # the socket (its fd) of each answer the pump reads
        self._thread: threading.Thread | None = None
        self._poller: _Epoll | _Selected | None = None
        self._recv: Callable[[socket.socket], bytes] = _socket_recv  # the thread's read, chosen when it starts

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
        """Read the chunked body on ``sock`` (the caller read ``head``, its first bytes, without waiting) into
        ``sink`` until its end or the sink's stop, ``touch()`` at each read, while this thread waits; True when the
        body was read to its end with nothing after it (the connection can be kept).  The socket's timeout is as it
        was when this returns.
        Raises what the sink raised, or :class:`BodyBroken` (the connection ended or failed first: a Stop's or a
        stall's shutdown too)."""
        r = _Read(sock, sink, touch)
        if not (head and r.take(head)):
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._start()
            # the socket module's read needs a non-blocking socket; the GIL-holding one asks not to wait itself,
            # which spares this thread two calls that each let go of the GIL
            timeout, unblocked = sock.gettimeout(), self._recv is _socket_recv
            if unblocked:
                sock.setblocking(False)
            try:
                fd = sock.fileno()
                self._reads[fd] = r  # before the poller has it: the pump may see its first bytes at once
                assert self._poller is not None
                try:
                    self._poller.add(fd)
                except BodyBroken:
                    del self._reads[fd]
                    raise
                try:
                    r.done.wait()
                except BaseException:
                    # Ctrl-C while waiting: the pump lets go of the socket before the caller closes it
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                    r.done.wait(1.0)
                    raise
            finally:
                if unblocked:
                    with contextlib.suppress(OSError):  # closed meanwhile
                        sock.settimeout(timeout)
        if r.error is not None:
            raise r.error
        return r.clean

    def _start(self) -> None:
        self._poller = _Epoll.made() or _Selected()
        self._recv = _gil_holding_recv() or _socket_recv
        self._thread = threading.Thread(target=self._run, args=(self._poller,), name="agentnb-stream-pump",
                                        daemon=True)
        self._thread.start()

    def _run(self, poller: _Epoll | _Selected) -> None:
        recv, reads = self._recv, self._reads
        woke = 0.0
        while True:
            ready: list[int] = []
            if len(reads) >= BUSY:
                rest = woke + PACE_S - time.monotonic()
                if rest > 0:
                    time.sleep(rest)
                ready = poller.ready(wait=False)  # what has come meanwhile, without a second wait
            if not ready:
                ready = poller.ready(wait=True)
            woke = time.monotonic()
            for fd in ready:
                r = reads.get(fd)
                if r is None:
                    continue
                try:
                    data = recv(r.sock)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    self._end(poller, fd, r, BodyBroken(f"{type(exc).__name__}: {exc}"))
                    continue
                if not data:
                    self._end(poller, fd, r, BodyBroken("the connection closed before the body's end"))
                    continue
                r.touch()
                if r.take(data):
                    self._end(poller, fd, r, None)

    def _end(self, poller: _Epoll | _Selected, fd: int, r: _Read, error: BaseException | None) -> None:
        poller.remove(fd)
        if self._reads.get(fd) is r:
            del self._reads[fd]
        if r.error is None:
            r.error = error
        r.done.set()


class _Epoll:
    """The pump's wait on Linux: an epoll set, which any thread may add a socket to (the kernel's table is shared by
    the threads), so a new answer needs no bell to wake the pump, and no turn of the pump to be taken in.  Its changes
    and its look without waiting go through libc with the GIL kept (``ctypes.PyDLL``, as :func:`_gil_holding_recv`
    says why): none of them waits, and each that let go of the GIL had to take it back behind the jobs' threads."""

    def __init__(self, libc: Any, event_type: Any, get_errno: Callable[[], int]) -> None:
        self.ep = select.epoll()
        self.fd = self.ep.fileno()
        self._ctl, self._wait, self._errno = libc.epoll_ctl, libc.epoll_wait, get_errno
        self._event_type = event_type
        self._events = (event_type * _MAX_EVENTS)()  # the pump's own

    @classmethod
    def made(cls) -> _Epoll | None:
        """One, where epoll and libc's functions can be had so; else None (the pump then uses :class:`_Selected`)."""
        if not hasattr(select, "epoll"):
            return None
        try:
            import ctypes

            class Event(ctypes.Structure):  # struct epoll_event
                _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]
                if platform.machine().lower() in ("x86_64", "amd64"):  # packed there alone (glibc's __EPOLL_PACKED)
                    _layout_, _pack_ = "ms", 1  # "ms": as Python 3.14 asks of a packed structure; the same here

            libc = ctypes.PyDLL(None, use_errno=True)
            libc.epoll_ctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(Event)]
            libc.epoll_ctl.restype = ctypes.c_int
            libc.epoll_wait.argtypes = [ctypes.c_int, ctypes.POINTER(Event), ctypes.c_int, ctypes.c_int]
            libc.epoll_wait.restype = ctypes.c_int
        except (ImportError, OSError, AttributeError):
            return None
        return cls(libc, Event, ctypes.get_errno)

    def add(self, fd: int) -> None:
        # an event of its own: callers' threads may add at once (the GIL may pass between two statements)
        if self._ctl(self.fd, _EPOLL_CTL_ADD, fd, self._event_type(_EPOLLIN, fd)) < 0:
            err = self._errno()
            raise BodyBroken(f"the connection could not be read: {os.strerror(err)}")

    def remove(self, fd: int) -> None:
        self._ctl(self.fd, _EPOLL_CTL_DEL, fd, None)  # an fd gone already (closed meanwhile) needs nothing more

    def ready(self, *, wait: bool) -> list[int]:
        if wait:
            return [fd for fd, _ in self.ep.poll()]
        n = self._wait(self.fd, self._events, _MAX_EVENTS, 0)
        return [int(self._events[i].data) for i in range(n)] if n > 0 else []


class _Selected:
    """The pump's wait elsewhere: a selector that only the pump changes; a new answer's socket is handed over through
    a queue, and a byte on a socket pair (the bell) wakes the pump to take it in."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.bell = socket.socketpair()
        for end in self.bell:
            end.setblocking(False)
        self.selector.register(self.bell[0], selectors.EVENT_READ)
        self.new: deque[int] = deque()

    def add(self, fd: int) -> None:
        self.new.append(fd)
        with contextlib.suppress(BlockingIOError):  # a full bell has rung already
            self.bell[1].send(b"\0")

    def remove(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.selector.unregister(fd)

    def ready(self, *, wait: bool) -> list[int]:
        out: list[int] = []
        for key, _ in self.selector.select(None if wait else 0):
            if key.fileobj is not self.bell[0]:
                out.append(key.fd)
                continue
            with contextlib.suppress(OSError):
                self.bell[0].recv(4096)
            while self.new:
                fd = self.new.popleft()
                try:
                    with contextlib.suppress(KeyError):  # a key left by a socket closed while registered: its fd is reused
                        self.selector.unregister(fd)
                    self.selector.register(fd, selectors.EVENT_READ)
                except (OSError, ValueError, KeyError):  # closed meanwhile: the pump's read of it fails
                    out.append(fd)
        return out


def _socket_recv(sock: socket.socket) -> bytes:
    return sock.recv(_READ)


def _gil_holding_recv() -> Callable[[socket.socket], bytes] | None:
    """A read of what has come on a socket that neither waits (``MSG_DONTWAIT``, whatever the socket's own mode)
    nor lets go of the GIL; None where libc's ``recv`` cannot be called so (the pump then reads through the socket
    module, on a socket made non-blocking for it).

    Why: the socket module lets go of the GIL around every ``recv`` and must take it back after, and with 32 jobs'
    threads wanting it each take back waits for one of them to let go, up to the switch interval (5 ms).  The pump
    reads about ten sockets a wake-up for every streamed answer of the process, so it fell behind by that at each
    one (benchmarks/README.md, "the pump's reads keep the GIL").  A ``recv`` with ``MSG_DONTWAIT`` on a socket
    with something to read cannot block, so holding the GIL through it stops nobody; ``ctypes.PyDLL`` calls a C
    function without letting go of it."""
    flags = getattr(socket, "MSG_DONTWAIT", None)
    if flags is None:
        return None
    try:
        import ctypes

        libc = ctypes.PyDLL(None, use_errno=True)
        c_recv = libc.recv
    except (ImportError, OSError, AttributeError):
        return None
    c_recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    c_recv.restype = ctypes.c_ssize_t
    buf = ctypes.create_string_buffer(_READ)  # the pump's own: one thread reads into it
    string_at, get_errno = ctypes.string_at, ctypes.get_errno

    def recv(sock: socket.socket) -> bytes:
        n = c_recv(sock.fileno(), buf, _READ, flags)
        if n >= 0:
            return string_at(buf, n)
        err = get_errno()
        raise OSError(err, os.strerror(err))  # BlockingIOError, InterruptedError, … by its errno, as the socket's

    return recv


PUMP = Pump()


def _forked() -> None:
    """A forked child has no pump thread, and the sockets it read are the parent's."""
    global PUMP
    PUMP = Pump()


os.register_at_fork(after_in_child=_forked)
