"""What this test process has open: the targets of its descriptors (``/proc/self/fd``, Linux), for tests that
check a closed workspace, store or export leaves no file or pipe behind."""

from __future__ import annotations

import contextlib
import os

__all__ = ["open_targets"]


def open_targets() -> list[str]:
    """What each of this process's descriptors points at (a path, ``pipe:[…]``, ``socket:[…]``)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed since
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
    return found
