"""A throw-away PostgreSQL cluster for the tests (see /work/shared/notes/postgresql.md): Debian's binaries, run
as user ``postgres`` when the tests run as root (the server refuses root), on a free loopback port, with a
password (so a wrong one is refused: host connections use scram-sha-256), stopped at the end.

``AGENTNB_TEST_PG`` (a ``postgresql://`` URL of a superuser) uses a server started elsewhere instead (.ci/run).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OwnPgServer", "PgServer", "own_pg_server", "pg_server"]

USER = "agentnb"
PASSWORD = "s3cret-test-pw"


@dataclass(frozen=True)
class PgServer:
    """A running server: ``url(db)`` names a database on it (with the password)."""

    host: str
    port: int
    user: str
    password: str

    def url(self, db: str = "postgres", *, password: str | None = None) -> str:
        pw = self.password if password is None else password
        return f"postgresql://{self.user}:{pw}@{self.host}:{self.port}/{db}"

    def create_database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        import psycopg

        name = url.rsplit("/", 1)[1]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _bin(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    if not candidates:
        raise RuntimeError(f"no {name}: apt-get install postgresql")
    return str(candidates[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(argv: list[str], *, as_postgres: bool) -> None:
    # the server and initdb refuse to run as root: run them as the postgres user then
    if as_postgres:
        argv = ["runuser", "-u", "postgres", "--", *argv]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)


@contextmanager
def pg_server() -> Iterator[PgServer]:
    given = os.environ.get("AGENTNB_TEST_PG")
    if given:
        from urllib.parse import urlsplit

        parts = urlsplit(given)
        yield PgServer(parts.hostname or "127.0.0.1", parts.port or 5432, parts.username or USER,
                       parts.password or "")
        return
    with own_pg_server() as server:
        yield server


@dataclass(frozen=True)
class OwnPgServer(PgServer):
    """A cluster this process started: it can be stopped and started again on the same port (a restart)."""

    data: Path = Path()
    opts: str = ""
    log: Path = Path()
    as_postgres: bool = False

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``fast`` ends every session cleanly; ``immediate`` as a crash does (no session's work is
        finished, and the next start recovers)."""
        _run([_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"], as_postgres=self.as_postgres)

    def start(self) -> None:
        _run([_bin("pg_ctl"), "-D", str(self.data), "-o", self.opts, "-l", str(self.log), "-w", "start"],
             as_postgres=self.as_postgres)


@contextmanager
def own_pg_server() -> Iterator[OwnPgServer]:
    """A throw-away cluster of this process's own, whatever AGENTNB_TEST_PG says (a test that restarts it)."""
    as_postgres = os.geteuid() == 0
    # AGENTNB_TEST_PG_DIR: the folder for the clusters (.ci/run's own, to stop any a killed run leaves behind)
    top = Path(tempfile.mkdtemp(prefix="agentnb-pg-", dir=os.environ.get("AGENTNB_TEST_PG_DIR") or None))
    data = top / "data"
    pwfile = top / "pw"
    pwfile.write_text(PASSWORD + "\n")
    if as_postgres:
        shutil.chown(top, "postgres")
        shutil.chown(pwfile, "postgres")
    port = _free_port()
    _run([_bin("initdb"), "-D", str(data), "-U", USER, f"--pwfile={pwfile}", "--auth-local=trust",
          "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8" if Path("/usr/lib/locale/C.utf8").exists()
          else "--no-locale"], as_postgres=as_postgres)
    # fsync off: a throw-away cluster need not survive a power cut, and the tests then spend no time in fsync
    opts = f"-k {top} -c listen_addresses=127.0.0.1 -p {port} -c fsync=off -c synchronous_commit=off"
    server = OwnPgServer("127.0.0.1", port, USER, PASSWORD, data=data, opts=opts, log=top / "log",
                         as_postgres=as_postgres)
    server.start()
    try:
        yield server
    finally:
        try:
            if (data / "postmaster.pid").exists():
                _run([_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"], as_postgres=as_postgres)
        finally:
            shutil.rmtree(top, ignore_errors=True)
