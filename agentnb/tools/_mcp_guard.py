"""The first process of a stdio MCP server's process group (run as a script, ``python -I -S _mcp_guard.py CMD ARGS``):
it runs the server as its child (jailed: bwrap, which runs the server), with its own stdin and stdout and only the
variables ``AGENTNB_MCP_ENV`` names, and takes the whole group down when the worker dies, even by SIGKILL (the
kernel's parent-death signal), as ``Bash``'s guard does for a command.

Standard library only, and never imported by agentnb: it starts in a few milliseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1


def _down(*_: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGKILL)  # the server and whatever it started (this guard too)


def main() -> int:
    parent = int(os.environ.pop("AGENTNB_MCP_PARENT", "0") or 0)
    signal.signal(signal.SIGTERM, _down)
    # not Linux: no parent-death signal, and the group is still killed when the session closes
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if parent and os.getppid() != parent:  # the worker died before the request was made
        _down()
    # exactly the variables agentnb gave the server (the mcp package adds its own defaults, such as USER)
    keep = os.environ.pop("AGENTNB_MCP_ENV", None)
    env = None if keep is None else {k: v for k, v in os.environ.items() if k in keep.split(",")}
    try:
        child = subprocess.Popen(sys.argv[1:], env=env)
    except OSError as exc:
        print(f"cannot start {sys.argv[1]!r}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        return 127
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
