"""Imported first by tests/conftest.py: the suite is hermetic, it runs on what its fixtures set, never on the
machine's or the developer's settings.

libpq's PG* variables (PGSSLMODE=require, PGOPTIONS, a PGSERVICE …) would change how the tests' own servers are
reached, DATABASE_URL and AGENTNB_STORE or AGENTNB_WORKSPACE would move workspaces elsewhere, OPENAI_* would point
the ``openai:`` models at a real endpoint, and a proxy variable (HTTP_PROXY, ALL_PROXY …, which httpx and so the
``openai`` client follow) would send the loopback servers' requests elsewhere.  They are removed before anything is imported or started, so every
subprocess (workers, the CLI, notebook kernels, the PostgreSQL clusters) inherits the cleaned environment too.  The
suite's own switches stay: AGENTNB_TEST_BACKEND, AGENTNB_TEST_PG, AGENTNB_TEST_PG_DIR (tests/_postgres.py).

A suite started in the background by a shell without job control (``python -m pytest … &`` in a script) inherits
SIGINT ignored, and so would every process it starts: the tests that press Ctrl-C (a batch's, a worker's, a streamed
call's) would see nothing happen.  Python's own handler is put back; a process started after that gets the default.
"""

from __future__ import annotations

import os
import signal

__all__ = ["outside_setting"]


def outside_setting(name: str) -> bool:
    """Whether the environment variable ``name`` is a setting from outside that the tests must not see."""
    if name.startswith("AGENTNB_TEST_"):
        return False
    return (name.startswith(("PG", "AGENTNB_", "OPENAI_")) or name == "DATABASE_URL"
            or name.lower() in _PROXIES)


_PROXIES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


for _name in [name for name in os.environ if outside_setting(name)]:
    del os.environ[_name]
# Every event the suite writes is type-checked against its dataclass (agentnb.events.check_event) before it is
# stored, so a wrong or missing payload value fails the test that wrote it.  Subprocesses inherit it too.
os.environ["AGENTNB_STRICT_EVENTS"] = "1"
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
