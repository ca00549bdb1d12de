"""The suite is hermetic: the machine's or a developer's PostgreSQL, store, workspace and OpenAI settings in the
environment change nothing (tests/conftest.py clears them before anything starts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# what a developer's shell may well have set: libpq's defaults for another server (PGSSLMODE=require alone fails
# every connection to the tests' own cluster, which has no SSL), a DATABASE_URL, a store and workspace of their
# own, a real OpenAI endpoint
HOSTILE = {
    "PGHOST": "/nonexistent",
    "PGPORT": "1",
    "PGUSER": "nobody",
    "PGPASSWORD": "not-the-password",
    "PGDATABASE": "x",
    "PGSSLMODE": "require",
    "PGOPTIONS": "-c statement_timeout=1",
    "PGSERVICE": "no-such-service",
    "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/x",
    "AGENTNB_STORE": "postgresql://nobody@127.0.0.1:1/x",
    "AGENTNB_WORKSPACE": "/nonexistent",
    "AGENTNB_OPENAI_RETRIES": "0",
    "OPENAI_API_KEY": "sk-not-for-tests",
    "OPENAI_BASE_URL": "http://127.0.0.1:1/v1",
    # a proxy for everything, loopback included: the `openai:` tests' requests to their own server would go there
    "HTTP_PROXY": "http://127.0.0.1:1",
    "ALL_PROXY": "http://127.0.0.1:1",
    "http_proxy": "http://127.0.0.1:1",
}


@pytest.mark.parametrize("test", [
    # SQLite: the `ws` fixture's workspace, which AGENTNB_STORE would move to the unreachable server
    "tests/test_demo.py::test_demo_job_succeeds_with_every_behaviour",
    # an `openai:` model on the loopback server, which a proxy variable would send elsewhere
    "tests/test_models.py::test_full_job_through_an_openai_compatible_server",
    # PostgreSQL: the tests' own throw-away cluster, and a SQLite workspace beside it
    pytest.param("tests/test_store_postgres.py::test_scripted_jobs_give_the_same_events_and_frames_as_on_sqlite",
                 marks=pytest.mark.needs("postgres", "psycopg")),
])
def test_outside_settings_in_the_environment_change_nothing(test: str) -> None:
    env = {**os.environ, **HOSTILE}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", test], cwd=REPO, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    summary = done.stdout.strip().splitlines()[-1:]
    assert done.returncode == 0 and summary and summary[0].startswith("1 passed"), done.stdout[-3000:] + done.stderr[-2000:]
