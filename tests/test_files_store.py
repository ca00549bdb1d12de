"""A job's files without a shared filesystem (docs/stores.md#files): on PostgreSQL a job's ``input/`` goes into the
store at submit, each movement's changes go back at its end, a worker materialises the files in its own folder
when it claims the job, and ``ws.files``/``ws.pull`` read them from any machine; on SQLite the same two read the
work directory on disk.  A per-job size limit, at submit and at movement end."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, transition, write_piece, write_script

from agentnb import Workspace
from agentnb.engine.jobfiles import DEFAULT_FILES_LIMIT, parse_files_limit
from agentnb.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
needs_pg = pytest.mark.needs("postgres", "psycopg")

THREE_STEPS = """
name: three-steps
movements:
  - name: first
    instruction: Start.
    tools: [Read, Glob, Write]
    permission: edit
    rules:
      - {condition: started, next: second}
  - name: second
    instruction: Go on.
    tools: [Read, Glob, Write, files_test_tidy]
    permission: edit
    rules:
      - {condition: gone on, next: third}
  - name: third
    instruction: Finish.
    tools: [Read, Glob]
    rules:
      - {condition: done, next: COMPLETE}
"""


@pytest.fixture(autouse=True)
def tidy_tool() -> None:
    """A tool doing what a Bash command could (without needing bubblewrap): delete, chmod, link in and out."""
    import agentnb

    @agentnb.tool(name="files_test_tidy", permission="edit")
    def tidy(ctx: Any, outside: str) -> str:
        """Delete output/gone.txt, make output/tool.sh executable, link inside and outside."""
        out = Path(ctx.workdir) / "output"
        (out / "gone.txt").unlink()
        os.chmod(out / "tool.sh", 0o755)
        os.symlink("a.txt", out / "linked.txt")
        os.symlink(outside, out / "escape.txt")
        os.symlink("../../..", out / "up")
        return "tidied"


def _sql(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else []


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _results(ws: Workspace, job: Any) -> list[str]:
    return [str(e.payload.get("content") or e.payload.get("error") or e.payload) for e in
            ws.events(job, kinds=["tool_result"])]


# -- a worker on "another machine" ----------------------------------------------------------------------------

@needs_pg
def test_a_worker_in_its_own_folder_reads_the_inputs_and_its_output_reaches_the_submitter(
        pg_url: str, tmp_path: Path) -> None:
    submitter = Workspace(tmp_path / "laptop", store=pg_url)
    spec = write_script(tmp_path, "script", responses=[
        call("Read", path="input/notes.md"),
        call("Write", path="output/report.md", content="# Report\nthe notes said hello\n"),
        transition("COMPLETE", "reported"),
    ])
    blob = bytes(range(256)) * 3
    job = submitter.submit("Report on the notes", piece="single", model=spec,
                           inputs={"notes.md": "hello from the laptop", "data/blob.bin": blob})
    # the inputs are in the store with the job, and the job names no path of the submitter's machine
    assert submitter.store.job(job.id).workdir == f"jobs/{job.id}"
    assert _sql(pg_url, "SELECT path, size, sha256 FROM files WHERE job_id=%s ORDER BY path", (job.id,)) == [
        ("input/data/blob.bin", len(blob), _sha(blob)), ("input/notes.md", 21, _sha("hello from the laptop"))]

    host = tmp_path / "server-b"  # another "machine": its own folder, nothing shared but the database
    host.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTNB_")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    done = subprocess.run([sys.executable, "-m", "agentnb.cli", "worker", "--store", pg_url], cwd=host, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert job.status == "succeeded"
    assert "hello from the laptop" in _results(submitter, job)[0]  # the worker read the submitter's input
    worker_wd = host / "agentnb-data" / "jobs" / str(job.id)
    assert (worker_wd / "input" / "data" / "blob.bin").read_bytes() == blob
    assert (worker_wd / "output" / "report.md").is_file()
    assert not (submitter.root / "jobs" / str(job.id) / "output" / "report.md").exists()  # not on the laptop

    files = submitter.files(job)
    # logs/ is part of the work directory too: the lesson the movement left follows the job
    assert list(files["path"]) == ["input/data/blob.bin", "input/notes.md", "logs/lessons.jsonl", "output/report.md"]
    report = files.set_index("path").loc["output/report.md"]
    assert report["sha256"] == _sha("# Report\nthe notes said hello\n") and report["size"] == 30
    assert stat.S_ISREG(int(report["mode"]))
    assert str(files["updated"].dtype) == "datetime64[ns]"
    assert list(submitter.files(job, under="output")["path"]) == ["output/report.md"]

    lessons = submitter.frames.lessons(job)  # read from the store: the file is on the worker's disk
    assert lessons["summary"].tolist() == ["reported"]

    written = submitter.pull(job, tmp_path / "pulled", under="output")
    assert written == [tmp_path / "pulled" / "output" / "report.md"]
    assert written[0].read_text(encoding="utf-8") == "# Report\nthe notes said hello\n"


@needs_pg
def test_a_job_moved_between_workers_sees_their_files_deletions_modes_and_inside_links(
        pg_url: str, tmp_path: Path) -> None:
    a = Workspace(tmp_path / "worker-a", store=pg_url)
    b = Workspace(tmp_path / "worker-b", store=pg_url)
    secret = tmp_path / "secret.txt"
    secret.write_text("not the job's", encoding="utf-8")
    spec = write_script(tmp_path, "script", responses=[
        # first (on A)
        call("Write", path="output/a.txt", content="written on A"),
        call("Write", path="output/gone.txt", content="deleted on B"),
        call("Write", path="output/tool.sh", content="#!/bin/sh\n"),
        transition("second", "started"),
        # second (on B): one call, a pause, then the rest of the movement
        call("Read", path="output/a.txt"),
        call("files_test_tidy", outside=str(secret)),
        transition("third", "went on"),
        # third (on A again)
        call("Glob", pattern="output/*"),
        call("Read", path="output/linked.txt"),
        transition("COMPLETE", "done"),
    ])
    job = a.submit("Move around", piece=write_piece(tmp_path, "piece", THREE_STEPS), model=spec,
                   inputs={"in.txt": "in"})
    assert a.step(job).status == "queued"  # movement 1 on A

    assert b.step(job, unit="call").status == "queued"  # B claims it: A's files are materialised on B
    assert "written on A" in _results(b, job)[-1]
    assert b.step(job).status == "queued"  # the rest of movement 2 on B: it deletes, chmods, links
    assert _results(b, job)[-2] == "tidied"
    assert os.path.lexists(b.root / "jobs" / str(job.id) / "output" / "escape.txt")  # on B's disk, not stored

    stored = {r[0]: r[1] for r in _sql(pg_url, "SELECT path, mode FROM files WHERE job_id=%s", (job.id,))}
    assert set(stored) == {"input/in.txt", "output/a.txt", "output/tool.sh", "output/linked.txt"}
    assert stat.S_IMODE(stored["output/tool.sh"]) == 0o755 and stat.S_ISLNK(stored["output/linked.txt"])

    wd_a = a.root / "jobs" / str(job.id)
    assert (wd_a / "output" / "gone.txt").exists()  # A's disk is as A left it … until it claims the job again
    assert a.run(job).status == "succeeded"
    glob, read = _results(a, job)[-3:-1]  # then the transition's
    assert "a.txt" in glob and "gone.txt" not in glob and "escape" not in glob
    assert "written on A" in read  # the link B made, followed on A
    assert not (wd_a / "output" / "gone.txt").exists()
    assert stat.S_IMODE(os.stat(wd_a / "output" / "tool.sh").st_mode) == 0o755
    assert os.readlink(wd_a / "output" / "linked.txt") == "a.txt"
    assert not os.path.lexists(wd_a / "output" / "escape.txt") and not os.path.lexists(wd_a / "output" / "up")

    pulled = tmp_path / "pulled"
    a.pull(job, pulled)
    assert (pulled / "output" / "linked.txt").is_symlink()
    assert (pulled / "output" / "linked.txt").read_text(encoding="utf-8") == "written on A"
    assert sorted(p.relative_to(pulled).as_posix() for p in pulled.rglob("*") if not p.is_dir()) == [
        "input/in.txt", "logs/lessons.jsonl", "output/a.txt", "output/linked.txt", "output/tool.sh"]


@needs_pg
def test_a_fork_on_postgres_starts_from_the_originals_inputs_in_the_store(pg_url: str, tmp_path: Path) -> None:
    a = Workspace(tmp_path / "a", store=pg_url)
    spec = write_script(tmp_path, "script", responses=[call("Read", path="input/n.md"), transition("COMPLETE", "ok")])
    job = a.run(a.submit("Read", piece="single", model=spec, inputs={"n.md": "the original input"}))
    b = Workspace(tmp_path / "b", store=pg_url)  # another machine: the original's folder is not here
    fork = b.fork(job, at=1)
    assert fork.status == "succeeded"
    assert b.store.job(fork.id).workdir == f"jobs/{fork.id}"
    assert "the original input" in _results(b, fork)[0]
    assert list(b.files(fork, under="input")["sha256"]) == list(b.files(job, under="input")["sha256"]) == [
        _sha("the original input")]


@needs_pg
def test_workdir_is_refused_on_postgres_in_one_line(pg_url: str, tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws", store=pg_url)
    with pytest.raises(UsageError) as err:
        ws.submit("x", piece="single", workdir=tmp_path)
    assert "\n" not in str(err.value) and "inputs=" in str(err.value)
    assert ws.jobs() == []


# -- the size limit ----------------------------------------------------------------------------------------------

@needs_pg
def test_the_limit_at_submit_is_one_line_and_nothing_is_stored(pg_url: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ws = Workspace(tmp_path / "ws", store=pg_url, files_limit=1000)
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * 1500)
    with pytest.raises(UsageError) as err:
        ws.submit("x", piece="single", inputs={"a.txt": "y" * 600, "big.bin": big})
    message = str(err.value)
    assert "\n" not in message
    assert "2.1 kB (2,100 bytes)" in message and "1 kB (1,000 bytes)" in message and "nothing was stored" in message
    assert _sql(pg_url, "SELECT COUNT(*) FROM jobs") == [(0,)] and _sql(pg_url, "SELECT COUNT(*) FROM files") == [(0,)]
    assert not (ws.root / "jobs").exists() or not any((ws.root / "jobs").iterdir())
    ws.store.close()
    monkeypatch.setenv("AGENTNB_FILES_LIMIT", "2kB")
    ws = Workspace(tmp_path / "ws", store=pg_url)
    with pytest.raises(UsageError, match=r"over the limit of 2 kB \(2,000 bytes\)"):
        ws.submit("x", piece="single", inputs={"big.bin": big, "b": "z" * 501})
    assert ws.submit("x", piece="single", inputs={"big.bin": big}).status == "queued"
    ws.store.close()


@needs_pg
def test_the_limit_at_a_movement_end_fails_the_job_and_writes_nothing_back(pg_url: str, tmp_path: Path) -> None:
    spec = write_script(tmp_path, "script", responses=[
        call("Write", path="output/small.txt", content="fits"),
        call("Write", path="output/big.txt", content="z" * 900),
        transition("COMPLETE", "wrote"),
    ])
    ws = Workspace(tmp_path / "ws", store=pg_url, files_limit="1000")
    job = ws.run(ws.submit("Write", piece="single", model=spec, inputs={"in.txt": "i" * 100}))
    assert job.status == "failed"
    assert job.error is not None and "\n" not in job.error
    assert "1 kB (1,004 bytes)" in job.error and "1 kB (1,000 bytes)" in job.error and "nothing was written back" in job.error
    errors = [e.payload for e in ws.events(job, kinds=["error"])]
    assert errors == [{"message": job.error, "where": "files"}]
    # the inputs of the submit, and what the first Write (within the limit) left, stored with its tool result;
    # nothing of the Write that went over
    assert list(ws.files(job)["path"]) == ["input/in.txt", "output/small.txt"]


def test_limit_values() -> None:
    assert parse_files_limit(None) == DEFAULT_FILES_LIMIT == 100_000_000
    assert parse_files_limit(2048) == 2048
    assert parse_files_limit("100MB") == 100_000_000
    assert parse_files_limit("64 MiB") == 64 * 1024**2
    assert parse_files_limit("1.5gb") == 1_500_000_000
    assert parse_files_limit("512") == 512
    for bad in ("lots", "12XB", "-5", "0", 0, -1, True, 1.5, "", "1e9"):
        with pytest.raises(UsageError) as err:
            parse_files_limit(bad)
        assert "\n" not in str(err.value) and "'100MB'" in str(err.value)


def test_a_bad_limit_is_one_line_before_the_folder_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match=r"^files_limit='huge'; allowed: "):
        Workspace(tmp_path / "ws", files_limit="huge")
    monkeypatch.setenv("AGENTNB_FILES_LIMIT", "-3")
    with pytest.raises(UsageError, match=r"^AGENTNB_FILES_LIMIT='-3'; allowed: "):
        Workspace(tmp_path / "ws")
    assert not (tmp_path / "ws").exists()


# -- SQLite: the work directory on disk ----------------------------------------------------------------------------

@pytest.mark.sqlite_only("the work directory on disk is what a SQLite store's files are")
def test_files_and_pull_on_sqlite_read_the_work_directory(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    spec = write_script(tmp_path, "script", responses=[
        call("Write", path="output/report.md", content="the report"),
        transition("COMPLETE", "ok"),
    ])
    job = ws.run(ws.submit("Write", piece="single", model=spec, inputs={"notes.md": "notes"}))
    assert job.status == "succeeded"
    os.symlink(tmp_path, job.workdir / "output" / "escape")  # leads out: never listed or copied
    os.symlink("report.md", job.workdir / "output" / "again.md")
    files = ws.files(job)
    assert list(files["path"]) == ["input/notes.md", "logs/lessons.jsonl", "output/again.md", "output/report.md"]
    assert list(files["size"])[:1] + list(files["size"])[2:] == [5, 9, 10]
    assert files.set_index("path").loc["output/report.md", "sha256"] == _sha("the report")

    dest = tmp_path / "dest"
    written = ws.pull(job, dest)
    assert sorted(p.relative_to(dest).as_posix() for p in written) == list(files["path"])
    assert (dest / "output" / "report.md").read_text(encoding="utf-8") == "the report"
    assert os.readlink(dest / "output" / "again.md") == "report.md"
    assert ws.pull(job, dest) == []  # the same files are already there

    (dest / "output" / "report.md").write_text("edited here", encoding="utf-8")
    (dest / "input" / "notes.md").unlink()
    with pytest.raises(UsageError) as err:
        ws.pull(job, dest)
    assert "\n" not in str(err.value) and "output/report.md" in str(err.value) and "overwrite=True" in str(err.value)
    assert (dest / "output" / "report.md").read_text(encoding="utf-8") == "edited here"
    assert not (dest / "input" / "notes.md").exists()  # nothing copied on a refusal
    assert sorted(ws.pull(job, dest, overwrite=True)) == [dest / "input" / "notes.md", dest / "output" / "report.md"]
    assert (dest / "output" / "report.md").read_text(encoding="utf-8") == "the report"
    with pytest.raises(UsageError, match=r"under='\.\./x'"):
        ws.files(job, under="../x")
    with pytest.raises(UsageError, match="is a file"):
        ws.pull(job, dest / "output" / "report.md")


@needs_pg
def test_subtasks_on_postgres_keep_their_files_in_the_store(pg_url: str, tmp_path: Path) -> None:
    children = [{"instruction": f"Do part {n}", "piece": "single", "model": write_script(tmp_path, f"c{n}", {"work": [
        call("Write", path="output/part.md", content=f"part {n}"), transition("COMPLETE", summary=f"part {n}")]})}
        for n in (1, 2)]
    spec = write_script(tmp_path, "parent", {
        "split": [transition("WAIT_SUBTASKS", summary="split", subtasks=children)],
        "merge": [call("Write", path="output/result.md", content="merged"), transition("COMPLETE", "merged")],
    })
    a = Workspace(tmp_path / "a", store=pg_url)
    parent = a.run(a.submit("Do two parts", piece="fan-out", model=spec))
    assert parent.status == "succeeded"
    b = Workspace(tmp_path / "b", store=pg_url)  # reads them from elsewhere
    for n, child in enumerate(b.children(parent), start=1):
        assert b.store.job(child.id).workdir == f"jobs/{child.id}"
        assert child.workdir == b.root / "jobs" / str(child.id)
        assert b.files(child, under="output")["sha256"].tolist() == [_sha(f"part {n}")]
    assert b.files(parent, under="output")["path"].tolist() == ["output/result.md"]


@needs_pg
def test_compare_files_on_postgres_reads_both_outputs_from_the_store(pg_url: str, tmp_path: Path) -> None:
    def job_writing(ws: Workspace, text: str) -> Any:
        spec = write_script(tmp_path, text, responses=[call("Write", path="output/r.md", content=text),
                                                       transition("COMPLETE", "ok")])
        return ws.run(ws.submit("Write", piece="single", model=spec))

    one = job_writing(Workspace(tmp_path / "a", store=pg_url), "one\n")
    two = job_writing(Workspace(tmp_path / "b", store=pg_url), "two\n")
    elsewhere = Workspace(tmp_path / "c", store=pg_url)  # neither ran here
    frame = elsewhere.compare(one, two).files()
    assert frame["path"].tolist() == ["r.md"] and frame["change"].tolist() == ["changed"]
    assert "-one" in frame["diff"][0] and "+two" in frame["diff"][0]


# -- the write-back after each tool call reads only what changed (engine/_filecache.py) ------------------------

def _wait_until_settled(*paths: Path) -> None:
    """Wait (only as long as needed) until every path's mtime and ctime are RACY_NS in the past: from then on
    an unchanged stat is trusted."""
    import time

    from agentnb.engine._filecache import RACY_NS

    newest = max(max(os.stat(p).st_mtime_ns, os.stat(p).st_ctime_ns) for p in paths)
    left = newest + RACY_NS - time.time_ns()
    if left > 0:
        time.sleep(left / 1e9 + 0.05)


REWRITE = """
name: rewrite
movements:
  - name: work
    instruction: Work.
    tools: [Write, Glob, files_test_rewrite]
    permission: edit
    rules:
      - {condition: done, next: COMPLETE}
"""


@pytest.fixture
def rewrite_tool() -> Any:
    """A tool that rewrites a file in place with bytes of the same size and puts its mtime back, as a tool that
    keeps times (``cp -p``, ``tar``) or a file system whose clock ticks by the second would leave it."""
    import agentnb

    @agentnb.tool(name="files_test_rewrite", permission="edit")
    def rewrite(ctx: Any, path: str, content: str) -> str:
        """Rewrite a file in place, keeping its size and mtime."""
        full = Path(ctx.workdir) / path
        before = os.stat(full)
        with open(full, "r+b") as fh:
            fh.write(content.encode())
        os.utime(full, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = os.stat(full)
        same = (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
        return "rewritten, same inode, size and mtime" if same else "rewritten, but its stat changed"

    yield
    agentnb.tools.base.unregister("files_test_rewrite")


@needs_pg
def test_unchanged_files_are_not_read_again_and_a_same_size_rewrite_still_is(
        pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rewrite_tool: None) -> None:
    from agentnb.engine import _filecache

    ws = Workspace(tmp_path / "w", store=pg_url)
    spec = write_script(tmp_path, "script", responses=[
        call("Write", path="output/a.txt", content="aaaa"), call("Glob", pattern="*"), call("Glob", pattern="*"),
        call("files_test_rewrite", path="output/a.txt", content="AAAA"), call("Write", path="output/b.txt", content="b"),
        call("Glob", pattern="*"), transition("COMPLETE", "done"),
    ])
    big = os.urandom(1 << 20)
    job = ws.submit("Write two files", piece=write_piece(tmp_path, "piece", REWRITE), model=spec,
                    inputs={"big.bin": big, "notes.md": "n"})
    wd = ws.root / "jobs" / str(job.id)
    reads: list[str] = []
    monkeypatch.setattr(_filecache, "on_read", lambda p: reads.append(Path(p).relative_to(wd).as_posix()))

    def step() -> list[str]:
        reads.clear()
        assert ws.step(job, unit="call").status == "queued"
        return sorted(reads)

    def stored(path: str) -> str:
        return str(ws.files(job).set_index("path").loc[path, "sha256"])

    assert "output/a.txt" in step()  # call 1 writes a.txt: read to be stored
    assert stored("output/a.txt") == _sha("aaaa")
    files = [wd / "input" / "big.bin", wd / "input" / "notes.md", wd / "output" / "a.txt"]
    _wait_until_settled(*files)
    # each file hashed once more, now that its timestamps are old enough to vouch for it (at the claim)
    assert step() == ["input/big.bin", "input/notes.md", "output/a.txt"]
    assert step() == []  # a claim and a tool call that change nothing read nothing

    # call 4 rewrites a.txt in place: the same inode, size and mtime; only its ctime tells
    read = step()
    assert _results(ws, job)[-1] == "rewritten, same inode, size and mtime"
    assert "output/a.txt" in read and "input/big.bin" not in read
    assert stored("output/a.txt") == _sha("AAAA")

    # a.txt was changed less than 2 s before it was hashed: its stat cannot vouch for it yet (a rewrite in the
    # same clock tick would leave it the same), so the next tool call hashes it again, unchanged as it is
    a_stat = os.stat(files[2])
    read = step()  # call 5 writes b.txt
    assert read.count("output/a.txt") >= 1 and "output/b.txt" in read and "input/big.bin" not in read
    assert os.stat(files[2]) == a_stat
    assert stored("output/b.txt") == _sha("b")
    assert ws.run(job).status == "succeeded"
    assert stored("input/big.bin") == _sha(big) and stored("output/a.txt") == _sha("AAAA")
