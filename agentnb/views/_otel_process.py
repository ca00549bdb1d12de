"""The live export's own process (docs/otel.md#live): the reading, mapping and posting of spans off the jobs' core.

Mapping a job and encoding its spans is about half a millisecond of CPU a job.  Done in a thread of the process that
runs the jobs it took the GIL from them for milliseconds at a time, which a batch of many short calls felt as
latency on every call (benchmarks/README.md).  So :class:`ExporterProcess` starts a child (``python -m`` this module)
that opens the same store read-only and does that work with a :class:`~._otel_send.Sender`, on another core;
the workspace's process only writes the notes to it, a line of JSON for up to 64 of them.

The lines each way:

- to the child: its settings first (the store's path or URL, the collector's URL, ``content``, the request
  timeout, the store's identity in the ids, the SQLite file's device and inode as this process opened it: a child
  that finds another file at that path, or none — the workspace's folder moved or renamed since — says so and
  ends, and this process, whose connection follows the file, exports instead), then a request per line:
  ``{"n", "notes", "secrets"?}`` — the secrets this process knows, when they changed since the last request, so
  that the child scrubs what this process would; its standard input closing is its end;
- from the child: a report per request (``{"n", "sent", "dropped", "why"}``), ``{"error"}`` when it cannot start,
  and its CPU seconds as its last line.

A child that ends before it is told to (killed, out of memory, a store it cannot open) leaves the requests it did
not report on to the workspace's process, which exports them and what comes after in its own thread.  The
child ignores Ctrl-C and is in a session of its own: a terminal's Ctrl-C stops the jobs, not the export of their
spans; it ends when its standard input closes, also when the workspace's process dies without closing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from .._secrets import register_secret, scrub
from ._otel_send import Note, Report

__all__ = ["NICENESS", "ExporterProcess", "file_id", "main"]

NICENESS = 10  # added to the child's: it gets a core no job wants
# ``-c`` puts the working folder first on sys.path, where a user's queue.py or csv.py would be imported instead of
# the standard library's: it goes before the first import
_NICE_AND_RUN = ("import sys; del sys.path[0]; import os, runpy; "
                 f"os.nice({NICENESS}); runpy.run_module('agentnb.views._otel_process', run_name='__main__', "
                 "alter_sys=True)")

# the children's pipes, closed in a process forked from this one (multiprocessing's default on Linux): a fork
# that kept a child's input open would keep the child alive after this process closed it, or died
_OPEN: weakref.WeakSet[ExporterProcess] = weakref.WeakSet()


def file_id(store: Any) -> list[int] | None:
    """The (device, inode) of ``store``'s SQLite file at its path now; None for a PostgreSQL store or a file gone."""
    path = getattr(store, "path", None)
    if not isinstance(path, Path):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino]


class ExporterProcess:
    """The child that exports the spans of the store at ``location`` (a SQLite file's path or a PostgreSQL URL),
    as seen from the workspace's process: :meth:`send` hands it notes, ``on_report`` is called (in a reader
    thread) with each request's :class:`Report`."""

    def __init__(self, location: str, url: str, *, content: bool, timeout: float, identity: str,
                 environ: Mapping[str, str], on_report: Callable[[Report], None],
                 file: list[int] | None = None) -> None:
        env = dict(environ)
        # agentnb as this process imported it, whatever sys.path a notebook gave it; after the child's own paths
        here = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), here) if p)
        # niced before its first import: where the cores are all busy, the jobs come first and the spans wait
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _NICE_AND_RUN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env, start_new_session=True, text=True, encoding="utf-8")
        self._on_report = on_report
        self._lock = threading.Lock()
        self._unacked: dict[int, list[Note]] = {}
        self._n = 0
        self._gone = False
        self._forgotten = False  # in a process forked from the one that started it
        self.error: str | None = None  # the child's own line when it could not start
        self.cpu: float | None = None  # the child's CPU seconds, once it has ended
        self._write({"store": location, "url": url, "content": content, "timeout": timeout, "identity": identity,
                     "file": file})
        self._reader = threading.Thread(target=self._read, name="agentnb-otel-reader", daemon=True)
        self._reader.start()
        _OPEN.add(self)

    @property
    def alive(self) -> bool:
        return not self._gone

    def why_gone(self) -> str:
        """Why the child ended before it was told to, in a few words."""
        if self.error:
            return self.error
        code = self._proc.poll()
        return f"exit status {code}" if code is not None else "its output closed"

    def send(self, notes: list[Note], secrets: Sequence[str] | None) -> bool:
        """Hand ``notes`` to the child (with this process's ``secrets`` when they changed); False when it has ended:
        the notes are then among :meth:`take_unacked`'s."""
        with self._lock:
            self._n += 1
            n = self._n
            self._unacked[n] = notes
            if self._gone:
                return False
        message: dict[str, Any] = {"n": n, "notes": notes}
        if secrets is not None:
            message["secrets"] = list(secrets)
        return self._write(message)

    def take_unacked(self) -> list[Note]:
        """The notes handed to the child that it did not report on: once it has ended (:meth:`finish`), the ones left
        to this process."""
        with self._lock:
            notes = [note for batch in self._unacked.values() for note in batch]
            self._unacked.clear()
        return notes

    def close_input(self) -> None:
        """Close the child's input without waiting: it reports on what it has, then ends."""
        stdin = self._proc.stdin
        if stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                stdin.close()

    def kill(self) -> None:
        """End the child now (one that does not read its input: a write to it then fails at once)."""
        if self._forgotten:
            return
        with contextlib.suppress(OSError):
            self._proc.kill()

    def finish(self, deadline: float) -> bool:
        """Close the child's input, let it report on what it has until ``deadline`` (a ``time.monotonic()``), then
        end it; False when it had to be killed (its collector hanging), what it held then not reported on."""
        if self._forgotten:
            return True
        self.close_input()
        self._reader.join(max(0.0, deadline - time.monotonic()))
        ended = not self._reader.is_alive()
        if not ended:  # a collector that hangs: what it still holds is not sent
            self._proc.kill()
            self._reader.join(1.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(1.0)
        return ended

    def forget(self) -> None:
        """In a forked process: this child is the parent's; its pipes are let go and nothing is written to it."""
        self._gone = self._forgotten = True
        self._unacked.clear()  # the parent's to report on, or to export
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError, ValueError):
                    null = os.open(os.devnull, os.O_RDWR)
                    os.dup2(null, stream.fileno())
                    os.close(null)

    def _write(self, message: dict[str, Any]) -> bool:
        stdin = self._proc.stdin
        try:
            assert stdin is not None
            stdin.write(json.dumps(message) + "\n")
            stdin.flush()
        except (OSError, ValueError):  # the child has ended (a broken pipe), or its input was closed
            return False
        return True

    def _read(self) -> None:
        out = self._proc.stdout
        assert out is not None
        for line in out:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if "n" in message:
                with self._lock:
                    self._unacked.pop(message["n"], None)
                self._on_report(Report(message["sent"], tuple((int(j), int(k)) for j, k in message["dropped"]),
                                       message["why"]))
            elif "cpu" in message:
                self.cpu = float(message["cpu"])
            elif "error" in message:
                self.error = str(message["error"])
        with contextlib.suppress(OSError, ValueError):
            out.close()  # its end of the pipe, not kept open for as long as this object lives
        with self._lock:
            self._gone = True


def _forked() -> None:
    """In a forked process: let go of the children's pipes (onto /dev/null, so that the file objects that still
    name them close nothing else), and never write to them."""
    for process in list(_OPEN):
        process.forget()
    _OPEN.clear()


os.register_at_fork(after_in_child=_forked)


def _say(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def main() -> int:
    """The child: export what each request's notes name until standard input closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = sys.stdout
    line = sys.stdin.readline()
    if not line:
        return 0
    try:
        from ..errors import StoreError
        from ..store import open_store
        from ._otel_send import Sender

        config = json.loads(line)
        store = open_store(config["store"], readonly=True)
        if config.get("file") is not None and file_id(store) != config["file"]:
            # a read-only store at a path with no file reads as empty: its spans would silently be none
            raise StoreError(f"{store.path} is no longer the workspace's store file (its folder moved or renamed "
                             "since the workspace opened it)")
        sender = Sender(store, config["url"], content=bool(config["content"]), timeout=float(config["timeout"]),
                        identity=str(config["identity"]))
    except Exception as exc:
        text = (str(exc).strip().splitlines() or [""])[0]
        _say(out, {"error": scrub(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)})
        return 1
    for line in sys.stdin:
        request = json.loads(line)
        for value in request.get("secrets") or ():
            register_secret(value)
        report = sender.export([(str(w), int(j), None if s is None else int(s)) for w, j, s in request["notes"]])
        _say(out, {"n": request["n"], "sent": report.sent, "dropped": report.dropped, "why": report.why})
    sender.close()
    store.close()
    _say(out, {"cpu": time.process_time()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
