"""A loopback TCP relay in front of a server that a test can cut and heal: a network partition as a client
sees one (nothing gets through, nothing is closed, its calls just hang), without touching the server."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Relay", "relay"]


class Relay:
    """Relays every connection made to ``127.0.0.1:port`` to ``target``; :meth:`cut` holds all traffic (in both
    directions, on open and new connections) until :meth:`heal`."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._open = threading.Event()
        self._open.set()
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def cut(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def close(self) -> None:
        """End every relayed connection (its client sees the server hang up) and stop listening."""
        self._closed = True
        self._open.set()
        with self._lock:
            for s in [self._listener, *self._sockets]:
                # shutdown, not only close: it wakes a thread blocked on the socket and sends the peer its FIN
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._open.wait()
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), name="relay-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self._open.wait()  # a cut holds what arrived: delivered only once healed
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


@contextmanager
def relay(host: str, port: int) -> Iterator[Relay]:
    r = Relay(host, port)
    try:
        yield r
    finally:
        r.close()
