"""The jail around ``Bash``: the command sees the work directory read-write, the system read-only, nothing else.

Built on bubblewrap (``bwrap``), which needs no root.  Other jobs' folders, the
store, the home directory and the rest of the file system are not mounted, so a
command cannot read or write outside the job's work directory, and the network is
off unless ``AGENTNB_BASH_NETWORK=1``.  ``AGENTNB_BASH_SANDBOX=off`` runs commands
unconfined (the user's explicit choice; never the default).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from .tools import ToolError

__all__ = ["sandbox_argv", "run_bounded", "Captured", "SANDBOX_ENV"]

SANDBOX_ENV = "AGENTNB_BASH_SANDBOX"
# Read-only system folders the shell needs; a folder that is a symlink (merged /usr) stays a symlink.
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")


def sandbox_argv(workdir: str) -> list[str]:
    """The argv prefix that runs a command jailed in ``workdir`` (empty when the sandbox is switched off)."""
    mode = os.environ.get(SANDBOX_ENV, "auto").strip().lower()
    if mode in ("off", "0", "no", "false"):
        return []
    if mode not in ("auto", "on", "1", "yes", "true"):
        raise ToolError(f"{SANDBOX_ENV}={mode!r}; allowed: auto (default) or off")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise ToolError(
            "Bash runs only inside a bubblewrap sandbox so that commands stay in the work directory, and `bwrap` "
            "is not installed (Debian/Ubuntu: apt-get install bubblewrap). The user can set "
            f"{SANDBOX_ENV}=off to run commands unconfined."
        )
    argv = [bwrap]
    for path in _SYSTEM:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    # the running Python's installation, so `python3` in a command finds the same interpreter
    for prefix in {sys.base_prefix, sys.prefix}:
        if os.path.isdir(prefix) and not prefix.startswith(("/usr", "/opt")):
            argv += ["--ro-bind", prefix, prefix]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    argv += ["--bind", workdir, workdir, "--chdir", workdir, "--setenv", "HOME", workdir]
    argv += ["--unshare-all", "--die-with-parent", "--new-session"]
    if os.environ.get("AGENTNB_BASH_NETWORK") == "1":
        argv.append("--share-net")
    return argv


@dataclass
class Captured:
    """What a command wrote, kept up to a bound: the head of each stream and how much there was in all."""

    returncode: int | None  # None when the command timed out
    stdout: bytes
    stderr: bytes
    stdout_bytes: int
    stderr_bytes: int
    dropped_chars: int  # characters beyond the kept heads (both streams)
    dropped_lines: int
    dropped: dict[str, int]  # characters beyond the kept head, per stream ("out", "err")
    last: dict[str, bytes]  # the last byte each stream wrote ("out", "err")


def run_bounded(argv: list[str], *, cwd: str, env: dict[str, str], timeout: float, keep: int) -> Captured:
    """Run ``argv`` keeping at most ``keep`` bytes of each stream; the rest is counted, never held.

    A command that prints gigabytes costs a bounded amount of memory.
    """
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    heads: dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}
    totals = {"out": 0, "err": 0}
    dropped = {"chars": 0, "lines": 0, "out": 0, "err": 0}
    last = {"out": b"", "err": b""}
    lock = threading.Lock()

    def drain(name: str, stream: Any) -> None:
        head = heads[name]
        while True:
            chunk = stream.read(1 << 16)
            if not chunk:
                break
            room = keep - len(head)
            if room > 0:
                head += chunk[:room]
            rest = chunk[room:] if room > 0 else chunk
            last[name] = chunk[-1:]
            with lock:
                totals[name] += len(chunk)
                if rest:
                    # characters: every byte that is not a UTF-8 continuation byte starts one
                    chars = len(rest.translate(None, _CONTINUATION))
                    dropped["chars"] += chars
                    dropped[name] += chars
                    dropped["lines"] += rest.count(b"\n")
        stream.close()

    readers = [threading.Thread(target=drain, args=("out", proc.stdout), daemon=True),
               threading.Thread(target=drain, args=("err", proc.stderr), daemon=True)]
    for t in readers:
        t.start()
    try:
        returncode: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        returncode = None
    for t in readers:
        t.join()
    return Captured(returncode, bytes(heads["out"]), bytes(heads["err"]), totals["out"], totals["err"],
                    dropped["chars"], dropped["lines"], {"out": dropped["out"], "err": dropped["err"]}, last)


_CONTINUATION = bytes(range(0x80, 0xC0))
