"""``agentnb store copy SRC DST`` (docs/stores.md#moving-between-stores): a whole workspace (rows with their ids, and
each job's files) from SQLite to PostgreSQL and back, event for event; the refusals (non-empty DST, same store, empty or missing
SRC, running jobs, bad URLs) leave DST as it was; the CLI; ``%agent`` and the export on a store URL."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from _usage_jobs import demo_job, usage_job

from agentnb import Workspace
from agentnb.errors import AgentnbError, StoreError, UsageError
from agentnb.store import copy_store, open_store, reads

ROOT = Path(__file__).resolve().parent.parent
needs_pg = pytest.mark.needs("postgres", "psycopg")
TABLES = ("texts", "batches", "jobs", "comments", "movements", "events")
FRAMES = ("jobs", "movements", "messages", "tool_calls", "usage", "context_actions", "scores", "divergences",
          "compactions", "loops")


def _lite(folder: Path) -> Workspace:
    """A workspace on its folder's own SQLite file, also when AGENTNB_TEST_BACKEND=postgres sets AGENTNB_STORE."""
    return Workspace(folder, store=str(folder / "agentnb.sqlite"))


def _sql(url: str, sql: str) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(sql)
        return cur.fetchall() if cur.description else []


def _build(ws: Workspace, tmp: Path) -> dict[str, int]:
    """Jobs covering several pieces, a long instruction (in texts), a fork, a batch of two epochs, a comment, input
    files (text and binary, one executable)."""
    usage = usage_job(ws, tmp / "scripts", instruction="Report on input/notes.md. " + "Every detail. " * 400)
    demo = demo_job(ws)
    fork = ws.fork(demo, at=2)
    assert fork.status == "succeeded", fork.error
    queued = ws.submit("never run", piece="single", model="demo",
                       inputs={"a.txt": "hello", "sub/bin.dat": bytes(range(256))})
    os.chmod(queued.workdir / "input" / "a.txt", 0o750)
    (queued.workdir / "input" / "link.txt").symlink_to("a.txt")  # inside: kept as a link
    (queued.workdir / "input" / "out.txt").symlink_to(tmp / "scripts")  # leads out: never stored
    ws.reply(queued, "a comment on the queued job")
    ws.batch([{"instruction": "case one"}, {"instruction": "case two"}], piece="single", model="demo", name="b1",
             concurrency=1, progress=False, epochs=2)
    return {"usage": usage.id, "demo": demo.id, "fork": fork.id, "queued": queued.id}


def _rows(store: Any) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every copied table, as the store holds it (the payload as its text), minus ``workdir``."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for table, order in (("texts", "hash"), ("batches", "name"), ("jobs", "id"), ("comments", "id"),
                         ("movements", "job_id, seq"), ("events", "id")):
        if table == "events":
            sql = "SELECT id, job_id, movement_seq, iteration, ts, kind, CAST(payload AS TEXT) FROM events ORDER BY id"
        else:
            sql = f"SELECT * FROM {table} ORDER BY {order}"
        rows = store.query(sql)
        out[table] = [tuple(v for k, v in dict(r).items() if k != "workdir") for r in rows] if table == "jobs" \
            else [tuple(dict(r).values()) for r in rows]
    return out


def _disk_files(root: Path) -> dict[tuple[int, str], tuple[bytes, int]]:
    """Every file and link under each job folder: its bytes (a link's: its target) and its whole st_mode."""
    out = {}
    for job_dir in (root / "jobs").iterdir():
        for p in job_dir.rglob("*"):
            mode = p.lstat().st_mode
            if stat.S_ISLNK(mode):
                out[(int(job_dir.name), p.relative_to(job_dir).as_posix())] = (os.fsencode(os.readlink(p)), mode)
            elif stat.S_ISREG(mode):
                out[(int(job_dir.name), p.relative_to(job_dir).as_posix())] = (p.read_bytes(), mode)
    return out


def _pg_files(url: str) -> dict[tuple[int, str], tuple[bytes, int]]:
    return {(int(j), p): (bytes(d), int(m)) for j, p, d, m in _sql(url, "SELECT job_id, path, data, mode FROM files")}


def _frames(ws: Workspace) -> dict[str, pd.DataFrame]:
    return {name: getattr(ws.frames, name)() for name in FRAMES}


def _same_frames(a: dict[str, pd.DataFrame], b: dict[str, pd.DataFrame]) -> None:
    for name in FRAMES:
        pd.testing.assert_frame_equal(a[name], b[name], obj=name)


# -- both ways, event for event -----------------------------------------------------------------------------------

@needs_pg
def test_sqlite_to_postgres_and_back_keeps_every_row_event_and_file(pg_url: str, pg: Any, tmp_path: Path) -> None:
    src = _lite(tmp_path / "src")
    ids = _build(src, tmp_path)
    rows, frames, files = _rows(src.store), _frames(src), _disk_files(src.root)
    lessons = src.frames.lessons()
    assert ("logs/lessons.jsonl" in {p for _j, p in files}) and len(lessons)
    assert files[(ids["queued"], "input/sub/bin.dat")][0] == bytes(range(256))
    assert files[(ids["queued"], "input/link.txt")][0] == b"a.txt"
    del files[(ids["queued"], "input/out.txt")]
    src.store.close()

    counts = copy_store(tmp_path / "src", pg_url)
    assert {t: counts[t] for t in TABLES} == {t: len(rows[t]) for t in TABLES}
    assert counts["files"] == len(files) and counts["file_bytes"] == sum(len(d) for d, _m in files.values())
    assert _pg_files(pg_url) == files  # every file with its bytes and mode, by job and path
    on_pg = Workspace(tmp_path / "pg-scratch", store=pg_url)
    assert _rows(on_pg.store) == rows
    _same_frames(_frames(on_pg), frames)
    # each batch job keeps its epoch (docs/design-lab.md#epochs)
    assert sorted(r.batch_position for r in on_pg.store.jobs(batch="b1")) == [(0, 0, 1), (0, 0, 2), (1, 0, 1), (1, 0, 2)]
    # new rows take ids after the copied ones (the sequences were set)
    new = on_pg.submit("after the copy", piece="single", model="demo")
    assert new.id == max(ids.values()) + 5  # the batch's four jobs (two cases × two epochs) came last
    on_pg.store.close()
    _sql(pg_url, f"DELETE FROM events WHERE job_id={new.id}")
    _sql(pg_url, f"DELETE FROM jobs WHERE id={new.id}")

    counts_back = copy_store(pg_url, f"sqlite://{tmp_path / 'back'}/agentnb.sqlite")
    assert counts_back == counts
    back = _lite(tmp_path / "back")
    assert _rows(back.store) == rows
    assert list(back.batch("b1", run=False).frame["epoch"]) == [1, 2, 1, 2]
    _same_frames(_frames(back), frames)
    pd.testing.assert_frame_equal(back.frames.lessons(), lessons)  # read from the files written back
    assert _disk_files(back.root) == files
    assert _sql(pg_url, "SELECT DISTINCT workdir LIKE 'jobs/%' FROM jobs") == [(True,)]  # as PostgreSQL's own jobs
    assert (back.root / "jobs" / str(ids["queued"]) / "input" / "link.txt").read_text() == "hello"
    for job in back.jobs():  # each work directory is under DST's folder, as prepare_workdir makes it
        assert job.workdir == back.root / "jobs" / str(job.id)
        assert (job.workdir / "input").is_dir() and (job.workdir / "output").is_dir()
    # the copied queued job runs in DST, reading its copied input
    assert back.run(ids["queued"]).status == "succeeded"
    new = back.submit("after the copy", piece="single", model="demo")
    assert new.id == max(r[0] for r in rows["jobs"]) + 1  # AUTOINCREMENT follows the copied ids
    back.store.close()


@needs_pg
def test_postgres_to_postgres_copies_rows_and_files(pg: Any, tmp_path: Path) -> None:
    a, b = pg.create_database(), pg.create_database()
    try:
        ws = Workspace(tmp_path / "a", store=a)
        demo_job(ws)
        ws.submit("queued", piece="single", model="demo")
        rows = _rows(ws.store)
        ws.store.close()
        _sql(a, "INSERT INTO files (job_id, path, mode, size, sha256, data, updated) VALUES "
                "(1, 'output/x.txt', 33188, 3, 'ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad', "
                "'abc'::bytea, 1.5)")
        files = _pg_files(a)  # the demo job's own files (written back at each movement end) and the one added
        assert (1, "output/x.txt") in files and len(files) > 1
        counts = copy_store(a, b)
        assert counts["jobs"] == 2 and counts["files"] == len(files)
        assert counts["file_bytes"] == _sql(a, "SELECT sum(size) FROM files")[0][0]
        assert _rows(open_store(b)) == rows
        assert _pg_files(b) == _pg_files(a)
    finally:
        pg.drop_database(a)
        pg.drop_database(b)


def test_sqlite_to_sqlite_copies_the_work_directories(tmp_path: Path) -> None:
    src = _lite(tmp_path / "src")
    demo_job(src)
    rows, files = _rows(src.store), _disk_files(src.root)
    src.store.close()
    counts = copy_store(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert counts["events"] == len(rows["events"]) and counts["files"] == len(files)
    dst = _lite(tmp_path / "dst")
    assert _rows(dst.store) == rows and _disk_files(dst.root) == files
    assert dst.job(1).workdir == dst.root / "jobs" / "1"


# -- refusals: one line, DST as it was ----------------------------------------------------------------------------

def test_a_non_empty_destination_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    src, dst = _lite(tmp_path / "src"), _lite(tmp_path / "dst")
    src.submit("one", piece="single", model="demo")
    kept = dst.submit("already here", piece="single", model="demo")
    before = _rows(dst.store)
    src.store.close()
    dst.store.close()
    with pytest.raises(StoreError, match=r"DST .*dst.* is not empty \(1 jobs, 1 events\).*nothing was written"):
        copy_store(tmp_path / "src", tmp_path / "dst")
    reopened = _lite(tmp_path / "dst")
    assert _rows(reopened.store) == before and [j.id for j in reopened.jobs()] == [kept.id]


def test_a_leftover_jobs_folder_in_the_destination_is_refused(tmp_path: Path) -> None:
    _lite(tmp_path / "src").submit("one", piece="single", model="demo").workspace.store.close()
    (tmp_path / "dst" / "jobs" / "1").mkdir(parents=True)
    with pytest.raises(StoreError, match="already has job folders"):
        copy_store(tmp_path / "src", tmp_path / "dst")
    assert not (tmp_path / "dst" / "agentnb.sqlite").exists()


def test_same_store_missing_and_empty_sources_and_bad_urls(tmp_path: Path) -> None:
    ws = _lite(tmp_path / "ws")
    ws.submit("one", piece="single", model="demo")
    ws.store.close()
    file = tmp_path / "ws" / "agentnb.sqlite"
    for dst in (tmp_path / "ws", str(file), f"sqlite://{file}"):
        with pytest.raises(UsageError, match="SRC and DST are the same store"):
            copy_store(tmp_path / "ws", dst)
    with pytest.raises(StoreError, match=r"SRC .*nowhere.* does not exist: nothing to copy"):
        copy_store(tmp_path / "nowhere", tmp_path / "d1")
    _lite(tmp_path / "empty").store.close()
    with pytest.raises(StoreError, match=r"SRC .* is empty .*nothing to copy"):
        copy_store(tmp_path / "empty", tmp_path / "d2")
    with pytest.raises(StoreError, match="unsupported store URL scheme 'mysql'"):
        copy_store(tmp_path / "ws", "mysql://x@y/z")
    with pytest.raises(StoreError, match="needs an absolute path"):
        copy_store("sqlite://relative/agentnb.sqlite", tmp_path / "d3")
    with pytest.raises(UsageError, match="running='later'"):
        copy_store(tmp_path / "ws", tmp_path / "d4", running="later")
    assert not any((tmp_path / d).exists() for d in ("d1", "d2", "d3", "d4"))


def test_a_running_job_is_refused_or_copied_as_queued_without_its_claim(tmp_path: Path) -> None:
    src = _lite(tmp_path / "src")
    job = src.submit("one", piece="single", model="demo")
    claimed = src.store.claim(job.id, owner="otherhost:1:abcd")
    assert claimed and claimed.status == "running"
    n_events = len(src.events(job))
    src.store.close()
    with pytest.raises(StoreError, match=rf"has running jobs \({job.id}\).*--running queue"):
        copy_store(tmp_path / "src", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()

    counts = copy_store(tmp_path / "src", tmp_path / "dst", running="queue")
    assert counts["events"] == n_events + 1
    dst = _lite(tmp_path / "dst")
    row = dst.store.job(job.id)
    assert (row.status, row.claimed_by) == ("queued", None)
    assert reads.last_status_reason(dst.store, job.id) == "copied: was running in SRC"
    # a claim in DST takes it at once, and it runs (the demo model asks its human about so short a task)
    assert dst.run(job.id).status == "waiting_human" and dst.events(job.id, kinds=["llm_response"])
    assert _lite(tmp_path / "src").job(job.id).status == "running"  # SRC untouched


@needs_pg
def test_a_copy_failing_midway_leaves_the_destination_as_it_was(pg_url: str, pg: Any, tmp_path: Path) -> None:
    src = _lite(tmp_path / "src")
    first = src.submit("fine", piece="single", model="demo")
    src.submit("has a NUL\x00 in its instruction", piece="single", model="demo")  # PostgreSQL text cannot hold it
    src.store.close()
    assert first.id == 1
    with pytest.raises(StoreError, match=r"DST postgresql://agentnb@.* cannot hold a row of jobs .*nothing was written"):
        copy_store(tmp_path / "src", pg_url)
    assert _sql(pg_url, "SELECT COUNT(*) FROM jobs") == [(0,)] and _sql(pg_url, "SELECT COUNT(*) FROM texts") == [(0,)]
    # and into SQLite: a damaged file row (its data does not match its sha256) fails the copy after the first
    # job's files are written; neither they nor the store file are left
    other = pg.create_database()
    try:
        ws = Workspace(tmp_path / "scratch", store=other)
        ids = [ws.submit(f"job {i}", piece="single", model="demo").id for i in (1, 2)]
        ws.store.close()
        digest = hashlib.sha256(b"abc").hexdigest()
        _sql(other, f"INSERT INTO files (job_id, path, mode, size, sha256, data, updated) VALUES "
                    f"({ids[0]}, 'input/a.txt', 33188, 3, '{digest}', 'abc'::bytea, 1.5), "
                    f"({ids[1]}, 'input/b.txt', 33188, 3, '{digest}', 'abd'::bytea, 1.5)")
        with pytest.raises(StoreError, match=f"job {ids[1]}'s file 'input/b.txt' does not match its sha256"):
            copy_store(other, tmp_path / "dst2")
        assert not (tmp_path / "dst2").exists()
        _sql(other, f"UPDATE files SET path='../escape.txt', data='abc'::bytea WHERE job_id={ids[1]}")
        with pytest.raises(StoreError, match=r"'\.\./escape\.txt' that does not stay inside its work directory"):
            copy_store(other, tmp_path / "dst3")
        assert not (tmp_path / "dst3").exists() and not (tmp_path / "escape.txt").exists()
        link = b"../../../outside"
        _sql(other, f"UPDATE files SET path='input/l', mode={0o120777}, data='{link.decode()}'::bytea, size={len(link)}, "
                    f"sha256='{hashlib.sha256(link).hexdigest()}' WHERE job_id={ids[1]}")
        with pytest.raises(StoreError, match=r"link 'input/l' leads out of its work directory"):
            copy_store(other, tmp_path / "dst4")
        assert not (tmp_path / "dst4").exists()
    finally:
        pg.drop_database(other)


@needs_pg
def test_copy_into_a_postgres_store_that_has_rows_is_refused(pg_url: str, tmp_path: Path) -> None:
    _lite(tmp_path / "src").submit("one", piece="single", model="demo").workspace.store.close()
    on_pg = Workspace(tmp_path / "scratch", store=pg_url)
    on_pg.submit("already here", piece="single", model="demo")
    on_pg.store.close()
    with pytest.raises(StoreError, match=r"is not empty \(1 jobs, 1 events\)") as info:
        copy_store(tmp_path / "src", pg_url)
    assert "s3cret" not in str(info.value)
    assert _sql(pg_url, "SELECT instruction FROM jobs") == [("already here",)]
    with pytest.raises(AgentnbError, match="holds no agentnb store"):
        fresh = pg_url.rsplit("/", 1)[0] + "/postgres"
        copy_store(fresh, tmp_path / "never")


# -- the CLI ---------------------------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "agentnb.cli", *args], env=env, text=True, capture_output=True,
                          timeout=120)


@needs_pg
def test_cli_store_copy_prints_one_line_per_table_and_refuses_a_second_time(pg_url: str, tmp_path: Path) -> None:
    ws = _lite(tmp_path / "src")
    demo_job(ws)
    n_events = len(ws.events(1))
    ws.store.close()
    done = _cli("store", "copy", str(tmp_path / "src"), pg_url)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(None, 1) for line in done.stdout.splitlines())
    assert list(lines) == [*TABLES, "files"]
    assert lines["jobs"].strip() == "1" and lines["events"].strip() == str(n_events)
    assert lines["files"].split()[0] == str(len(_pg_files(pg_url))) != "0"
    again = _cli("store", "copy", str(tmp_path / "src"), pg_url)
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.count("\n") == 1 and "is not empty" in again.stderr and "s3cret" not in again.stderr
    shown = _cli("--store", pg_url, "show", "1")
    assert shown.returncode == 0 and "succeeded" in shown.stdout
    usage = _cli("store", "copy", str(tmp_path / "src"))
    assert usage.returncode == 2 and "store copy: the following arguments are required: DST" in usage.stderr


# -- %agent and the export on a store URL ------------------------------------------------------------------------

@needs_pg
def test_magic_reaches_the_postgres_store_through_its_store_setting(shell: Any, pg_url: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTNB_STORE", raising=False)
    shell.run_line_magic("config", f"AgentMagic.store = {pg_url!r}")
    magic = shell.magics_manager.registry["AgentMagic"]
    try:
        job = shell.run_line_magic("agent", "run --piece single hello from the notebook")
        assert job.status == "waiting_human"  # the demo model asks its human about so short a task
        assert _sql(pg_url, "SELECT instruction FROM jobs") == [("hello from the notebook",)]
        assert not (Path(magic.workspace) / "agentnb.sqlite").exists()
        frame = shell.run_line_magic("agent", "jobs")
        assert list(frame["status"]) == ["waiting_human"]
        shell.run_line_magic("agent", f"reply {job.id} go on --run")
        assert _sql(pg_url, "SELECT status FROM jobs") == [("succeeded",)]
    finally:
        shell.run_line_magic("config", "AgentMagic.store = ''")
    # back on the folder's own SQLite store: the PostgreSQL job is not there
    assert magic.ws.store_url is None and magic.ws.jobs() == []


def test_magic_store_defaults_to_the_environment(shell: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "elsewhere" / "agentnb.sqlite"
    monkeypatch.setenv("AGENTNB_STORE", f"sqlite://{other}")
    magic = shell.magics_manager.registry["AgentMagic"]
    shell.run_line_magic("config", "AgentMagic.workspace = " + repr(str(tmp_path / "ws2")))
    assert magic.store == ""
    assert shell.run_line_magic("agent", "run --piece single hi").status == "waiting_human"
    assert other.exists() and not (tmp_path / "ws2" / "agentnb.sqlite").exists()
    shell.run_line_magic("agent", "--help")
    assert "%config AgentMagic.store = 'postgresql://" in capsys.readouterr().out


@needs_pg
def test_export_and_its_transcript_read_the_store_url(pg_url: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from agentnb.export import transcript

    ws = Workspace(tmp_path / "scratch", store=pg_url)
    job = demo_job(ws)
    ws.store.close()
    html = transcript(tmp_path / "elsewhere", job.id, 1, store=pg_url).data
    assert "plan" in html
    out = tmp_path / "t.ipynb"
    done = _cli("--store", pg_url, "--workspace", str(tmp_path / "scratch"), "export", str(job.id), str(out))
    assert done.returncode == 0, done.stderr
    nb = json.loads(out.read_text())
    sources = "\n".join("".join(c["source"]) for c in nb["cells"])
    assert "s3cret" not in out.read_text()  # the URL without its password
    cell = next(line for line in sources.splitlines() if "transcript(" in line and "store=" in line)
    # the cell runs where AGENTNB_STORE holds the same URL with its password
    monkeypatch.setenv("AGENTNB_STORE", pg_url)
    scope: dict[str, Any] = {}
    exec(cell.replace("transcript(", "html = transcript("), scope)
    assert "plan" in scope["html"].data
