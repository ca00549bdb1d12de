from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

# first: it clears the machine's and the developer's PG*, DATABASE_URL, OPENAI_* and AGENTNB_* settings (but the
# suite's own AGENTNB_TEST_* switches) and sets AGENTNB_STRICT_EVENTS, before agentnb is imported
import _hermetic  # noqa: F401
import pytest
from _postgres import PgServer, pg_server
from openai_server import OpenAIServer, openai_env

from agentnb import Workspace
from agentnb.store import Store, open_store

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
    # Arize Phoenix lives in a venv of its own (it is large, and its pins are not agentnb's): the test runs that
    # venv's python as the server and as Phoenix's client (tests/test_otel_phoenix.py)
    "phoenix": (lambda: _phoenix_python() is not None,
                "Arize Phoenix is not installed: set AGENTNB_TEST_PHOENIX to the python of a venv made with "
                "pip install -c tests/phoenix-constraints.txt arize-phoenix"),
}


def _phoenix_python() -> str | None:
    """The python of the venv holding Arize Phoenix, as ``AGENTNB_TEST_PHOENIX`` names it (None: not set, or
    not a file)."""
    path = os.environ.get("AGENTNB_TEST_PHOENIX", "").strip()
    return path if path and Path(path).is_file() else None


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
    """Skip (outside CI) or fail (under CI) the calling test when ``what`` is missing.  The test must carry
    ``@pytest.mark.needs(what)`` (on the test or on the parameter that needs it): .ci/run's pass on a machine
    without bwrap, chromium and PostgreSQL runs only ``-m needs``, so an unmarked test would never be tried there."""
    if _current is not None and what not in _needs_of(_current):
        pytest.fail(f"{_current.nodeid} calls require({what!r}) without @pytest.mark.needs({what!r}): "
                    "mark the test (or its parameter) so that `pytest -m needs` selects it")
    present, reason = _NEEDS[what]
    if present():
        return
    if in_ci():
        pytest.fail(f"{reason} (required under CI)")
    pytest.skip(reason)


def pg_backend() -> bool:
    """Whether this run keeps the tests' workspaces on PostgreSQL (``AGENTNB_TEST_BACKEND=postgres``)."""
    return os.environ.get("AGENTNB_TEST_BACKEND", "sqlite") == "postgres"


# the test being set up or run, so that require() can tell whether it is marked
_current: pytest.Item | None = None
# fixtures that start or use the PostgreSQL server: a test using them must be marked needs("postgres")
_PG_FIXTURES = {"pg", "pg_url"}


def _needs_of(item: pytest.Item) -> set[str]:
    return {what for mark in item.iter_markers("needs") for what in mark.args}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs(what): the test needs bwrap, chromium, postgres, psycopg or phoenix on the machine")
    config.addinivalue_line("markers", "sqlite_only(reason): the test is about the SQLite file itself; "
                            "skipped when AGENTNB_TEST_BACKEND=postgres")


# The longest test files (minutes each, on 2 cores), started first when pytest-xdist spreads the files over its
# workers (`-n auto --dist loadfile`): started last, one of them would run alone at the end while the other
# workers idle.
_LONG_FILES = ("tests/test_browser.py", "tests/test_compaction.py", "tests/test_golden.py",
               "tests/test_loop_monitors.py", "tests/test_executor.py")


# notebooks that start stdio MCP servers, which run in bubblewrap's jail (docs/tools.md#mcp-tools)
_NOTEBOOKS_NEEDING_BWRAP = frozenset({"notebooks/08-mcp-tools.ipynb"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike, so the collections agree
        rank = {name: i for i, name in enumerate(_LONG_FILES)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
    # a notebook's cells: nbval's items take no decorator, and this file's runtest hooks do not reach notebooks/,
    # so the skip (outside CI) is decided here; under CI the cells run, and fail without bwrap
    present, reason = _NEEDS["bwrap"]
    for item in items:
        if item.nodeid.split("::", 1)[0] in _NOTEBOOKS_NEEDING_BWRAP:
            item.add_marker(pytest.mark.needs("bwrap"))
            if not in_ci() and not present():
                item.add_marker(pytest.mark.skip(reason=reason))
    # before `-m` deselects anything, so that the full pass checks every collected test
    unmarked = [item.nodeid for item in items
                if _PG_FIXTURES & set(getattr(item, "fixturenames", ())) and "postgres" not in _needs_of(item)]
    if unmarked:
        raise pytest.UsageError('tests use the PostgreSQL fixtures without @pytest.mark.needs("postgres", "psycopg"): '
                                + ", ".join(unmarked[:5]))


def pytest_runtest_setup(item: pytest.Item) -> None:
    global _current
    _current = item
    for what in sorted(_needs_of(item)):
        require(what)
    if pg_backend():
        for mark in item.iter_markers("sqlite_only"):
            pytest.skip(f"SQLite only: {mark.args[0] if mark.args else 'about the SQLite file itself'}")


def pytest_runtest_teardown(item: pytest.Item) -> None:
    global _current
    _current = None


def backend_store(request: pytest.FixtureRequest) -> str | None:
    """The store for a workspace made in a module-scoped fixture (which runs before the autouse
    ``_store_backend``): a fresh PostgreSQL database, dropped with the fixture, under
    ``AGENTNB_TEST_BACKEND=postgres``; else None (the folder's agentnb.sqlite)."""
    if not pg_backend():
        return None
    server: PgServer = request.getfixturevalue("pg")
    url = server.create_database()
    request.addfinalizer(lambda: server.drop_database(url))
    return url


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Workspace]:
    with Workspace(tmp_path / "ws") as w:  # closed: a worker process runs a thousand tests
        yield w


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


@pytest.fixture
def loopback(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., OpenAIServer]]:
    """Start tests/openai_server.py's loopback server and point this process's ``openai:`` models at it:
    ``srv = loopback(api_key, timeout=…, retries=…, backoff=…, **OpenAIServer fields)`` sets ``openai_env``'s
    variables for the test (the last server started wins) and closes every server it started after the test."""
    started: list[OpenAIServer] = []

    def start(api_key: str = "sk-test", *, backoff: str | None = "0.01", timeout: str | None = None,
              retries: str | None = None, **server: Any) -> OpenAIServer:
        srv = OpenAIServer(**server).__enter__()
        started.append(srv)
        for name, value in openai_env(srv, api_key, backoff=backoff, timeout=timeout, retries=retries).items():
            monkeypatch.setenv(name, value)
        return srv

    yield start
    for srv in reversed(started):
        srv.__exit__(None, None, None)


@pytest.fixture
def pump_from_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed answer nobody watches is read by the process's stream pump once a few others are being read
    (``CROWD``, models/_stream_pump.py); with this fixture, from the first, so a single call goes through it."""
    from agentnb.models import _stream_pump

    monkeypatch.setattr(_stream_pump, "CROWD", 0)


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


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.needs("postgres", "psycopg"))])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A test once per backend, given its store's URL: a SQLite file alone in its folder (``tmp_path/shared``, so
    that a test may read every file beside it), or a fresh PostgreSQL database (``pg_url``)."""
    if request.param == "sqlite":
        (tmp_path / "shared").mkdir()
        return f"sqlite:///{tmp_path / 'shared' / 'agentnb.sqlite'}"
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture(autouse=True)
def _store_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``AGENTNB_TEST_BACKEND=postgres``: every test's workspaces keep their jobs in a fresh PostgreSQL database
    (through AGENTNB_STORE, which subprocesses inherit: a test that builds a subprocess's environment keeps
    AGENTNB_STORE).  Tests about the SQLite file itself are marked ``sqlite_only``; module-scoped workspaces
    (made before this fixture runs) take their store from ``backend_store(request)``."""
    if not pg_backend():
        yield
        return
    server: PgServer = request.getfixturevalue("pg")
    url = server.create_database()
    monkeypatch.setenv("AGENTNB_STORE", url)
    yield
    server.drop_database(url)


def store_of(folder: Path) -> Store | None:
    """The store a subprocess working on the workspace ``folder`` used: the test's PostgreSQL database when
    AGENTNB_STORE names one (AGENTNB_TEST_BACKEND=postgres), else ``folder/agentnb.sqlite`` read-only — None when
    that file does not exist (nothing was stored).  The caller closes it."""
    url = os.environ.get("AGENTNB_STORE")
    if url:
        return open_store(url)  # a database the subprocess has not migrated yet is migrated here: still empty
    db = folder / "agentnb.sqlite"
    return open_store(db, readonly=True) if db.exists() else None
