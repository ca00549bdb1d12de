"""Stores that cannot be used: each is one ``agentnb: error:`` line (exit 2) and is left byte for byte as it was.

Real SQLite files damaged the way disks, copies and people damage them, the real
``agentnb`` command in a subprocess, and, for a read-only workspace, a real read-only
bind mount (``chmod`` stops nobody when the tests run as root).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from _scripting import transition, write_script

from agentnb import Workspace
from agentnb.store.sqlite import SCHEMA_VERSION, SQLiteStore, StoreError


def cli(cwd: Path, *args: str, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTNB_", "OPENAI_"))}
    return subprocess.run([*(prefix or []), sys.executable, "-m", "agentnb.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env=env)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def one_error_line(out: subprocess.CompletedProcess[str], *phrases: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentnb: error: "), out.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


def make_store(folder: Path) -> Path:
    """A workspace with two jobs (one ended, one waiting for a human), closed so that no WAL is left."""
    ws = Workspace(folder)
    ws.run(ws.submit("Make a list", piece="single", model="demo"))
    spec = write_script(folder.parent, "done", responses=[transition("COMPLETE", "done")])
    ws.run(ws.submit("Finish", piece="single", model=spec))
    ws.store.close()
    db = folder / "agentnb.sqlite"
    assert not Path(f"{db}-wal").exists()
    return db


def _not_a_database(db: Path) -> None:
    db.write_bytes(b"These are my notes, not a database.\n" * 200)


def _truncated(db: Path) -> None:
    os.truncate(db, db.stat().st_size // 2)


def _damaged_pages(db: Path) -> None:
    # every b-tree page but the first (the schema) gets a garbage page header
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    for start in range(page, len(data), page):
        data[start:start + 8] = b"\xff" * 8
    db.write_bytes(bytes(data))


def _newer_schema(db: Path) -> None:
    raw = sqlite3.connect(db)
    raw.execute("PRAGMA user_version=99")
    raw.close()


def _foreign_schema(db: Path) -> None:
    """Another program's database in its place: tables of its own (one named as agentnb's), no schema version."""
    db.unlink()
    raw = sqlite3.connect(db)
    raw.executescript("CREATE TABLE batches (id INTEGER, label TEXT); CREATE TABLE foo (x); "
                      "INSERT INTO batches VALUES (1, 'mine');")
    raw.close()


BROKEN: dict[str, tuple[Callable[[Path], None], str]] = {
    "not a database": (_not_a_database, "is not an agentnb store (not a SQLite database)"),
    "truncated": (_truncated, "is truncated"),
    "damaged pages": (_damaged_pages, "is damaged (database disk image is malformed)"),
    "newer schema": (_newer_schema, f"has schema version 99, newer than this agentnb's {SCHEMA_VERSION}"),
    "foreign schema": (_foreign_schema, ": not an agentnb store (it has tables batches, foo but no agentnb schema "
                                        "version); use another path or move it aside"),
}

COMMANDS = [
    ["jobs"], ["show", "1"], ["show", "1", "--events"], ["export", "1", "out.ipynb"],
    ["run", "--piece", "single", "--model", "demo", "A new task"], ["reply", "1", "A bullet list."], ["worker"],
]


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_store_is_one_line_for_every_command_and_stays_as_it_was(tmp_path: Path, case: str) -> None:
    damage, phrase = BROKEN[case]
    db = make_store(tmp_path / "ws")
    damage(db)
    before, listing = digest(db), sorted(p.name for p in db.parent.iterdir())
    # the store as its writers left it: the file, its writers' lock file (store/_write_turn.py), the jobs
    assert listing == ["agentnb.sqlite", "agentnb.sqlite-lock", "jobs"]
    for command in COMMANDS:
        line = one_error_line(cli(tmp_path, "--workspace", "ws", *command), str(db.resolve()), phrase)
        assert "restore it from a backup" in line or "move it aside" in line or "upgrade agentnb" in line
        assert digest(db) == before, command
    assert not (tmp_path / "out.ipynb").exists()
    assert sorted(p.name for p in db.parent.iterdir()) == listing  # no -wal, -shm or job left


@pytest.mark.parametrize("case", list(BROKEN))
def test_the_api_refuses_a_broken_store_before_writing(tmp_path: Path, case: str) -> None:
    damage, phrase = BROKEN[case]
    db = make_store(tmp_path / "ws")
    damage(db)
    before = digest(db)
    for readonly in (False, True):
        with pytest.raises(StoreError) as info:
            ws = Workspace(tmp_path / "ws", readonly=readonly)
            ws.jobs()  # damaged pages are found when they are read
        assert phrase in str(info.value) and "\n" not in str(info.value)
        assert digest(db) == before


def test_a_newer_store_names_both_versions_through_the_api(tmp_path: Path) -> None:
    db = make_store(tmp_path / "ws")
    _newer_schema(db)
    before = digest(db)
    with pytest.raises(StoreError, match=rf"schema version 99, newer than this agentnb's {SCHEMA_VERSION}: .*upgrade"):
        SQLiteStore(db)
    with pytest.raises(StoreError, match="schema version 99"):
        Workspace(tmp_path / "ws").submit("task", piece="single", model="demo")
    assert digest(db) == before
    raw = sqlite3.connect(db)
    assert raw.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 2  # no job was written
    raw.close()


@pytest.mark.parametrize("where, phrase", [
    ("afile", "is a file, not a folder"),
    ("afile/ws", "afile is a file, not a folder"),
])
def test_a_workspace_that_is_a_file_or_under_one(tmp_path: Path, where: str, phrase: str) -> None:
    (tmp_path / "afile").write_text("notes\n", encoding="utf-8")
    for command in COMMANDS:
        one_error_line(cli(tmp_path, "--workspace", where, *command), phrase)
    assert (tmp_path / "afile").read_text(encoding="utf-8") == "notes\n"
    with pytest.raises(StoreError, match=phrase):
        Workspace(tmp_path / where)


def test_a_constraint_error_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    db = make_store(tmp_path / "ws")
    raw = sqlite3.connect(db)
    raw.execute("CREATE UNIQUE INDEX one_job_per_model ON jobs(model)")  # added by hand, not by agentnb
    raw.close()
    before = digest(db)
    out = cli(tmp_path, "--workspace", "ws", "run", "--piece", "single", "--model", "demo", "Another")
    one_error_line(out, "refused a change (UNIQUE constraint failed: jobs.model)", "changed in it by hand")
    assert digest(db) == before
    assert not (tmp_path / "ws" / "jobs" / "3").exists()


def test_a_job_whose_folder_cannot_be_made_is_not_left_behind(tmp_path: Path) -> None:
    db = make_store(tmp_path / "ws")
    shutil.rmtree(tmp_path / "ws" / "jobs")
    (tmp_path / "ws" / "jobs").write_text("in the way\n", encoding="utf-8")  # jobs/<id>/ cannot be made
    before = digest(db)
    one_error_line(cli(tmp_path, "--workspace", "ws", "run", "--piece", "single", "--model", "demo", "Another"),
                   "ws/jobs")
    assert digest(db) == before
    ws = Workspace(tmp_path / "ws")
    with pytest.raises(OSError):
        ws.submit("Another", piece="single", model="demo")
    assert [j.id for j in ws.jobs()] == [1, 2]  # the job row went with its folder


def test_an_export_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    make_store(tmp_path / "ws")
    (tmp_path / "afile").write_text("x", encoding="utf-8")
    one_error_line(cli(tmp_path, "--workspace", "ws", "export", "1", "afile/run.ipynb"), "afile")


# -- read-only ---------------------------------------------------------------------------------


def readonly_mount(folder: Path) -> list[str]:
    """A command prefix that runs the command with ``folder`` bind-mounted read-only, in its own namespace."""
    script = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"'
    prefix = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, str(folder)]
    if shutil.which("unshare") is None:
        pytest.skip("no unshare (util-linux) to mount a folder read-only")
    probe = subprocess.run([*prefix, "sh", "-c", 'touch "$0/.probe"', str(folder)], capture_output=True, text=True)
    if probe.returncode == 0 or (folder / ".probe").exists():
        pytest.skip("cannot mount a folder read-only here (unshare --user --mount needs user namespaces)")
    return prefix


def test_a_read_only_workspace_reads_and_refuses_writes_in_one_line(tmp_path: Path) -> None:
    db = make_store(tmp_path / "ws")
    before = digest(db)
    ro = readonly_mount(tmp_path / "ws")
    listing = cli(tmp_path, "--workspace", "ws", "jobs", prefix=ro)
    assert listing.returncode == 0, listing.stderr
    assert "waiting_human" in listing.stdout and "succeeded" in listing.stdout
    show = cli(tmp_path, "--workspace", "ws", "show", "1", prefix=ro)
    assert show.returncode == 0 and show.stdout.startswith("job 1: waiting_human"), show.stderr
    events = cli(tmp_path, "--workspace", "ws", "show", "2", "--events", prefix=ro)
    assert events.returncode == 0 and '"status":"succeeded"' in events.stdout.replace(" ", ""), events.stderr
    export = cli(tmp_path, "--workspace", "ws", "export", "2", str(tmp_path / "run.ipynb"), prefix=ro)
    assert export.returncode == 0 and (tmp_path / "run.ipynb").is_file(), export.stderr
    for command in (["run", "--piece", "single", "--model", "demo", "task"], ["reply", "1", "A list."], ["worker"]):
        one_error_line(cli(tmp_path, "--workspace", "ws", *command, prefix=ro), "cannot be written", "read-only",
                       "agentnb jobs/show/export")
    assert digest(db) == before


def test_a_read_only_workspace_with_a_wal_left_by_a_crash_is_read_with_it(tmp_path: Path) -> None:
    # a writer that died without closing leaves its last transactions in -wal (and the -shm index)
    code = ("import os, sys; from agentnb import Workspace; ws = Workspace(sys.argv[1]); "
            "ws.run(ws.submit('Make a list', piece='single', model='demo')); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "ws")], check=True, timeout=120)
    assert Path(tmp_path / "ws" / "agentnb.sqlite-wal").stat().st_size > 0
    before = {p.name: digest(p) for p in (tmp_path / "ws").iterdir() if p.is_file()}
    out = cli(tmp_path, "--workspace", "ws", "jobs", prefix=readonly_mount(tmp_path / "ws"))
    assert out.returncode == 0 and "waiting_human" in out.stdout, out.stderr
    assert {p.name: digest(p) for p in (tmp_path / "ws").iterdir() if p.is_file()} == before


def test_readonly_workspace_through_the_api_writes_nothing(tmp_path: Path) -> None:
    db = make_store(tmp_path / "ws")
    before = digest(db)
    ws = Workspace(tmp_path / "ws", readonly=True)
    assert [(j.id, j.status) for j in ws.jobs()] == [(1, "waiting_human"), (2, "succeeded")]
    assert ws.events(2)[-1].payload["status"] == "succeeded"
    assert list(ws.frames.jobs()["status"]) == ["waiting_human", "succeeded"]
    with pytest.raises(StoreError, match="opened read-only"):
        ws.reply(1, "A list.")
    with pytest.raises(StoreError, match="opened read-only"):
        ws.submit("task", piece="single", model="demo")
    ws.store.close()
    assert digest(db) == before
    # a reader of a WAL store in a writable folder makes SQLite's companions, as any reader does; nothing in them
    wal = Path(f"{db}-wal")
    assert not wal.exists() or wal.stat().st_size == 0


def test_reading_a_workspace_that_has_no_store_creates_nothing(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "nothing-yet", readonly=True)
    assert ws.jobs() == []
    with pytest.raises(StoreError, match="no job 1 in"):
        ws.job(1)
    assert not (tmp_path / "nothing-yet").exists()
    out = cli(tmp_path, "--workspace", "nothing-yet", "jobs")
    assert out.returncode == 0 and out.stdout.strip() == "no jobs"
    assert not (tmp_path / "nothing-yet").exists()


@pytest.mark.parametrize("name, make, phrase", [
    ("agentnb.sqlite", os.mkfifo, "is a FIFO (named pipe), not a regular file"),
    ("agentnb.sqlite-wal", os.mkfifo, "is a FIFO (named pipe), not a regular file"),
    ("agentnb.sqlite-journal", os.mkfifo, "is a FIFO (named pipe), not a regular file"),
    ("agentnb.sqlite", lambda p: os.symlink("/dev/null", p), "is a character device, not a regular file"),
])
def test_a_special_file_in_place_of_the_store_is_one_line_not_a_hang(
        tmp_path: Path, name: str, make: Callable[[Path], None], phrase: str) -> None:
    # SQLite's open of a FIFO waits for a writer forever, and SIGTERM could not end it
    folder = tmp_path / "ws"
    if name != "agentnb.sqlite":
        make_store(folder)
    folder.mkdir(exist_ok=True)
    make(folder / name)
    for command in COMMANDS:
        one_error_line(cli(tmp_path, "--workspace", "ws", *command), phrase, name)
    for readonly in (False, True):
        with pytest.raises(StoreError, match=re.escape(phrase)):
            Workspace(folder, readonly=readonly)
    if name != "agentnb.sqlite":  # a side file planted before there is a store at all
        (tmp_path / "new").mkdir()
        make(tmp_path / "new" / name)
        one_error_line(cli(tmp_path, "--workspace", "new", *COMMANDS[4]), phrase, name)
        assert not (tmp_path / "new" / "agentnb.sqlite").exists()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.needs("postgres", "psycopg"))])
def test_a_new_store_opened_from_many_threads_at_once_is_never_taken_for_another_programs(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    # Another program's database is refused (it has tables but no agentnb version).  A new store's first
    # migration commits agentnb's tables and version together, so an opener that read the version before that
    # commit and the tables after it took agentnb's own new store for another program's (1 round in 10-40
    # refused, before both were read from one snapshot); and SQLite's switch to WAL, which does not wait for the
    # lock, failed at once ("database is locked").  Many rounds of six openers released at once.
    import threading

    from agentnb.store import open_store

    rounds = 200 if backend == "sqlite" else 30
    server = request.getfixturevalue("pg") if backend == "postgres" else None
    refused: list[str] = []
    for r in range(rounds):
        url = server.create_database() if server is not None else str(tmp_path / f"s{r}" / "agentnb.sqlite")
        gate = threading.Barrier(6)

        def open_it(url: str = url, gate: threading.Barrier = gate) -> None:
            gate.wait()
            try:
                open_store(url).close()
            except StoreError as exc:
                refused.append(str(exc))

        threads = [threading.Thread(target=open_it) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not refused, refused[0]
        if server is not None:
            server.drop_database(url)
