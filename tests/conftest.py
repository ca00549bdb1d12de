from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# Every event the suite writes is type-checked against its dataclass (agentnb.events.check_event) before it is
# stored, so a wrong or missing payload value fails the test that wrote it.  Set before agentnb is imported;
# subprocesses (workers, the CLI, notebook kernels) inherit it.
os.environ.setdefault("AGENTNB_STRICT_EVENTS", "1")

from _postgres import PgServer, pg_server

from agentnb import Workspace

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

# What some tests need from the machine, and how to get it.  `@pytest.mark.needs("bwrap")` (or
# `needs("chromium")`, `needs("postgres")`) skips with one line on a developer's machine without it,
# and fails under CI, where .ci/run installs everything: a CI run must never skip them silently.
_NEEDS = {
    "bwrap": (lambda: shutil.which("bwrap") is not None,
              "bubblewrap (bwrap) is not installed: apt-get install bubblewrap"),
    "chromium": (lambda: (shutil.which("chromium") or shutil.which("chromium-browser")) is not None,
                 "no chromium on PATH: apt-get install chromium"),
    "postgres": (lambda: _pg_ctl() is not None, "PostgreSQL is not installed: apt-get install postgresql"),
    "psycopg": (lambda: importlib.util.find_spec("psycopg") is not None
                and importlib.util.find_spec("psycopg_pool") is not None,
                "psycopg 3 is not installed: pip install -e '.[postgres]'"),
}


def _pg_ctl() -> str | None:
    """The server's pg_ctl: on PATH, or in Debian's versioned folder when its client (psql) is on PATH."""
    found = shutil.which("pg_ctl")
    if found or shutil.which("psql") is None:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    return str(candidates[-1]) if candidates else None


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(what: str) -> None:
    """Skip (outside CI) or fail (under CI) the calling test when ``what`` is missing."""
    present, reason = _NEEDS[what]
    if present():
        return
    if in_ci():
        pytest.fail(f"{reason} (required under CI)")
    pytest.skip(reason)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs(what): the test needs bwrap, chromium, postgres or psycopg on the machine")


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        for what in mark.args:
            require(what)


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    return Workspace(tmp_path / "ws")


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[InteractiveShell]:
    """A real IPython shell with the magic loaded on a fresh workspace (the demo model, plan-implement-verify);
    the ``t_`` names a test leaves in it are removed after."""
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "agentnb")
    sh.run_line_magic("config", f"AgentMagic.workspace = {str(tmp_path / 'ws')!r}")
    sh.run_line_magic("config", "AgentMagic.model = 'demo'")
    sh.run_line_magic("config", "AgentMagic.piece = 'plan-implement-verify'")
    yield sh
    for name in [k for k in sh.user_ns if k.startswith("t_")]:
        del sh.user_ns[name]


@pytest.fixture(scope="session")
def pg() -> Iterator[PgServer]:
    """A real PostgreSQL server for the session (tests/_postgres.py: a throw-away cluster on a free loopback
    port, or the server AGENTNB_TEST_PG names).  Tests using it are marked ``needs("postgres", "psycopg")``."""
    with pg_server() as server:
        yield server


@pytest.fixture
def pg_url(pg: PgServer) -> Iterator[str]:
    """A fresh, empty database on the session's server (dropped after the test); its URL, password included."""
    url = pg.create_database()
    yield url
    pg.drop_database(url)


@pytest.fixture(autouse=True)
def _store_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``AGENTNB_TEST_BACKEND=postgres``: every test's workspaces keep their jobs in a fresh PostgreSQL database
    (through AGENTNB_STORE, which subprocesses inherit) — a first way to run the whole suite on the second
    backend.  Tests that read the SQLite file itself fail then, and so do module-scoped workspaces (made before
    this fixture runs)."""
    if os.environ.get("AGENTNB_TEST_BACKEND", "sqlite") != "postgres":
        yield
        return
    server: PgServer = request.getfixturevalue("pg")
    url = server.create_database()
    monkeypatch.setenv("AGENTNB_STORE", url)
    yield
    server.drop_database(url)
