"""``agentnb worker`` in a process that defines two tools of its own, as a notebook's ``@agentnb.tool`` does,
for the lease tests: ``LeaseGate`` notes its call and waits until the file ``$LEASE_TEST_GATE`` exists,
``LeaseMark`` notes its call.  ``LeaseMark`` is ``read_only`` (a look-up, say, that may cost or tell someone
something): no commit precedes it, so only the lease check, not the fence, keeps a lost holder from running it.  Each note is a line ``<tool> <pid>`` appended to ``$LEASE_TEST_LOG``.

Run as ``python tests/_tool_worker.py worker --workspace … --store …``; imported, it only defines the tools.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import agentnb


def _note(tool: str) -> None:
    with Path(os.environ["LEASE_TEST_LOG"]).open("a", encoding="utf-8") as log:
        log.write(f"{tool} {os.getpid()}\n")


@agentnb.tool(name="LeaseGate")
def lease_gate() -> str:
    """Wait until the test opens the gate."""
    _note("LeaseGate")
    gate = Path(os.environ["LEASE_TEST_GATE"])
    while not gate.exists():
        time.sleep(0.02)
    return "the gate opened"


@agentnb.tool(name="LeaseMark", read_only=True)
def lease_mark() -> str:
    """Leave a mark (an effect outside the store)."""
    _note("LeaseMark")
    return "marked"


if __name__ == "__main__":
    from agentnb.cli import main

    sys.exit(main(sys.argv[1:]))
