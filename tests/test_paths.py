"""Tools never leave the job's work directory: `..`, absolute paths, `~` and escaping symlinks are refused."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import pytest
from _scripting import transition, write_piece, write_script

from agentnb import Workspace
from agentnb.tools.base import ToolError, resolve_path

ALL_TOOLS = """
name: all-tools
movements:
  - name: work
    instruction: Try everything.
    tools: [Read, Write, Edit, Glob, Grep, ReadImage]
    permission: edit
    max_iterations: 40
    rules:
      - {condition: done, next: COMPLETE}
"""
SECRET = "TOP-SECRET-OUTSIDE-7731"
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder next to the workspace holding things no tool may reach."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.txt").write_text(SECRET + "\n", encoding="utf-8")
    (out / "secret.png").write_bytes(PNG)
    return out


def _stored(ws: Workspace) -> bytes:
    """Everything the store holds: the SQLite file's bytes, or every row of every table on PostgreSQL."""
    if ws.store_url is None:
        return (ws.root / "agentnb.sqlite").read_bytes()
    tables = ("jobs", "events", "texts", "comments", "movements", "batches", "files", "call_cache")
    return repr([[dict(r) for r in ws.store.query(f"SELECT * FROM {t}")] for t in tables]).encode()


def _run_calls(ws: Workspace, tmp_path: Path, calls: list[tuple[str, dict[str, Any]]], setup=None, **submit: Any):
    """Run one job whose single movement makes ``calls`` (one LLM call each), then completes."""
    piece = write_piece(tmp_path, "piece", ALL_TOOLS)
    responses = [{"tool_calls": [{"name": n, "arguments": a}]} for n, a in calls]
    model = write_script(tmp_path, "script", responses=[*responses, transition("COMPLETE")])
    job = ws.submit("escape", piece=piece, model=model, **submit)
    if setup is not None:
        setup(Path(job.workdir))
    job = ws.run(job)
    assert job.status == "succeeded", job.error
    results = [e.payload for e in ws.events(job, kinds=["tool_result"]) if e.payload["tool"] != "transition"]
    assert len(results) == len(calls)
    return job, results


def _links(outside: Path):
    def setup(wd: Path) -> None:
        (wd / "input" / "notes.md").write_text("inside\n", encoding="utf-8")
        os.symlink(outside / "secret.txt", wd / "input" / "link_file")
        os.symlink(outside, wd / "input" / "link_dir")
        os.symlink(outside / "secret.png", wd / "input" / "link.png")
        os.symlink("../../../outside/secret.txt", wd / "input" / "relative_link")  # relative target, same escape
        os.symlink(wd / "input" / "notes.md", wd / "output" / "inner_link")  # stays inside: allowed
    return setup


ESCAPES = [
    ("Read", {"path": "../../../outside/secret.txt"}, "leaves the work directory"),
    ("Read", {"path": "input/../../../../outside/secret.txt"}, "leaves the work directory"),
    ("Read", {"path": "/etc/passwd"}, "is absolute"),
    ("Read", {"path": "~/secret.txt"}, "is absolute"),
    ("Read", {"path": "input/link_file"}, "leaves the work directory"),
    ("Read", {"path": "input/relative_link"}, "leaves the work directory"),
    ("Read", {"path": "input/link_dir/secret.txt"}, "leaves the work directory"),
    ("Write", {"path": "../escape.txt", "content": "x"}, "leaves the work directory"),
    ("Write", {"path": "/tmp/agentnb-escape.txt", "content": "x"}, "is absolute"),
    ("Write", {"path": "input/link_dir/new.txt", "content": "x"}, "leaves the work directory"),
    ("Write", {"path": "input/link_file", "content": "overwritten"}, "leaves the work directory"),
    ("Edit", {"path": "input/link_file", "old": "TOP", "new": "BOTTOM"}, "leaves the work directory"),
    ("Edit", {"path": "~/x", "old": "a", "new": "b"}, "is absolute"),
    ("Glob", {"pattern": "../*"}, "must stay inside the work directory"),
    ("Glob", {"pattern": "/etc/*"}, "must stay inside the work directory"),
    ("Glob", {"pattern": "~/*"}, "must stay inside the work directory"),
    ("Grep", {"pattern": "SECRET", "path": ".."}, "leaves the work directory"),
    ("Grep", {"pattern": "SECRET", "path": "/etc"}, "is absolute"),
    ("Grep", {"pattern": "SECRET", "path": "input/link_dir"}, "leaves the work directory"),
    ("Grep", {"pattern": "SECRET", "path": "input/link_file"}, "leaves the work directory"),
    ("ReadImage", {"path": "input/link.png"}, "leaves the work directory"),
    ("ReadImage", {"path": "../../../outside/secret.png"}, "leaves the work directory"),
    ("ReadImage", {"path": "/tmp/x.png"}, "is absolute"),
]


@pytest.mark.sqlite_only("puts links and files into the job's work directory on disk, or uses workdir=; on PostgreSQL the work directory is materialised from the store (test_files_store covers links there)")
def test_every_escape_is_a_clear_tool_error(ws: Workspace, tmp_path: Path, outside: Path) -> None:
    _job, results = _run_calls(ws, tmp_path, [(t, a) for t, a, _ in ESCAPES], setup=_links(outside))
    for (tool, args, expected), res in zip(ESCAPES, results, strict=False):
        assert res["is_error"], (tool, args, res["content"])
        assert res["content"].startswith("Error: "), res["content"]
        assert expected in res["content"], (tool, args, res["content"])
        assert "\n" not in res["content"]
    # nothing outside was read, written or changed
    assert (outside / "secret.txt").read_text(encoding="utf-8") == SECRET + "\n"
    assert sorted(p.name for p in outside.iterdir()) == ["secret.png", "secret.txt"]
    assert not (tmp_path / "ws" / "jobs" / "escape.txt").exists()
    assert not Path("/tmp/agentnb-escape.txt").exists()
    assert SECRET.encode() not in _stored(ws)


@pytest.mark.sqlite_only("puts links and files into the job's work directory on disk, or uses workdir=; on PostgreSQL the work directory is materialised from the store (test_files_store covers links there)")
def test_searching_the_whole_workdir_skips_links_that_leave_it(ws: Workspace, tmp_path: Path, outside: Path) -> None:
    calls = [("Grep", {"pattern": "SECRET|inside"}), ("Glob", {"pattern": "**/*"}), ("Glob", {"pattern": "input/link_dir/*"}),
             ("Read", {"path": "output/inner_link"})]
    _job, (grep, glob_all, glob_link, inner) = _run_calls(ws, tmp_path, calls, setup=_links(outside))
    assert "input/notes.md:1:inside" in grep["content"]
    assert SECRET not in grep["content"]
    assert "input/notes.md" in glob_all["content"]
    assert "secret" not in glob_all["content"]
    assert "secret" not in glob_link["content"]
    assert not inner["is_error"] and "inside" in inner["content"]  # a link that stays inside is fine
    assert SECRET.encode() not in _stored(ws)


@pytest.mark.sqlite_only("puts links and files into the job's work directory on disk, or uses workdir=; on PostgreSQL the work directory is materialised from the store (test_files_store covers links there)")
def test_workdir_jobs_are_confined_to_that_directory(ws: Workspace, tmp_path: Path, outside: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("project notes\n", encoding="utf-8")
    calls = [
        ("Read", {"path": "notes.txt"}),
        ("Write", {"path": "output/result.txt", "content": "written"}),
        ("Read", {"path": "../outside/secret.txt"}),
        ("Write", {"path": "../outside/new.txt", "content": "x"}),
        ("Grep", {"pattern": "notes|SECRET"}),
    ]
    job, (read, _write, escape_read, escape_write, grep) = _run_calls(ws, tmp_path, calls, workdir=project)
    assert Path(job.workdir) == project.resolve()
    assert "project notes" in read["content"] and not read["is_error"]
    assert (project / "output" / "result.txt").read_text(encoding="utf-8") == "written"
    assert escape_read["is_error"] and "leaves the work directory" in escape_read["content"]
    assert escape_write["is_error"] and not (outside / "new.txt").exists()
    assert "notes.txt:1:project notes" in grep["content"] and SECRET not in grep["content"]
    # the job's logs stay in the workspace, not in the user's directory
    assert (ws.root / "jobs" / str(job.id) / "logs").is_dir()


@pytest.mark.parametrize("name", ["../x.md", "/etc/x.md", "~/x.md", "a/../../x.md", "", "  ", "a/\x00b"])
def test_input_names_that_escape_are_refused_at_submit(ws: Workspace, name: str) -> None:
    with pytest.raises(ValueError, match="input"):
        ws.submit("task", piece="single", model="demo", inputs={name: "x"})
    assert ws.jobs() == []


@pytest.mark.sqlite_only("puts links and files into the job's work directory on disk, or uses workdir=; on PostgreSQL the work directory is materialised from the store (test_files_store covers links there)")
def test_input_through_a_symlink_of_a_workdir_is_refused_at_submit(ws: Workspace, tmp_path: Path, outside: Path) -> None:
    project = tmp_path / "project"
    (project / "input").mkdir(parents=True)
    os.symlink(outside, project / "input" / "away")
    with pytest.raises(ValueError, match=r"input 'away/x\.md'.*leaves"):
        ws.submit("task", piece="single", model="demo", workdir=project, inputs={"away/x.md": "x"})
    assert ws.jobs() == []
    assert not (outside / "x.md").exists()
    job = ws.submit("task", piece="single", model="demo", workdir=project, inputs={"sub/ok.md": "fine"})
    assert (project / "input" / "sub" / "ok.md").read_text(encoding="utf-8") == "fine"
    assert job.status == "queued"


def test_resolve_path_directly(tmp_path: Path, outside: Path) -> None:
    wd = tmp_path / "wd"
    (wd / "sub").mkdir(parents=True)
    os.symlink(outside, wd / "away")
    assert resolve_path(wd, "sub/../sub/a.txt") == (wd / "sub" / "a.txt").resolve()
    assert resolve_path(wd, ".") == wd.resolve()
    for bad, why in [("..", "leaves"), ("sub/../../x", "leaves"), ("/x", "absolute"), ("~", "absolute"),
                     ("away", "leaves"), ("away/secret.txt", "leaves"), ("", "non-empty"), ("a\x00b", "NUL")]:
        with pytest.raises(ToolError, match=why):
            resolve_path(wd, bad)


def _odd_links(outside: Path):
    def setup(wd: Path) -> None:
        (wd / "output" / "kept.md").write_text("kept\n", encoding="utf-8")
        os.symlink("loop", wd / "loop")                  # a link to itself
        os.symlink("ping", wd / "pong")
        os.symlink("pong", wd / "ping")                  # two links to each other
        os.symlink("nothing-here", wd / "dangling")      # broken, but inside
        os.rename(wd / "input", wd / "input-old")
        os.symlink(outside, wd / "input")                # the whole input/ folder leads out
    return setup


ODD = [
    ("Read", {"path": "..\\..\\..\\outside\\secret.txt"}, "leaves the work directory"),
    ("Write", {"path": "..\\..\\..\\outside\\new.txt", "content": "x"}, "leaves the work directory"),
    ("Read", {"path": "C:\\Windows\\win.ini"}, "is absolute"),
    ("Write", {"path": "\\\\server\\share\\x.txt", "content": "x"}, "is absolute"),
    ("Grep", {"pattern": "SECRET", "path": "..\\..\\.."}, "leaves the work directory"),
    ("Glob", {"pattern": "..\\*"}, "must stay inside the work directory"),
    ("Glob", {"pattern": "**/../.."}, "must stay inside the work directory"),
    ("Glob", {"pattern": "C:\\*"}, "must stay inside the work directory"),
    ("Glob", {"pattern": "input/*"}, "path 'input' leaves the work directory"),
    ("Glob", {"pattern": "."}, "names no files"),
    ("Read", {"path": "loop"}, "symbolic link that loops"),
    ("Write", {"path": "ping", "content": "x"}, "symbolic link that loops"),
    ("Read", {"path": "input/secret.txt"}, "leaves the work directory"),
    ("Read", {"path": "a\x00/../../etc/passwd"}, "NUL byte"),
]


@pytest.mark.sqlite_only("puts links and files into the job's work directory on disk, or uses workdir=; on PostgreSQL the work directory is materialised from the store (test_files_store covers links there)")
def test_backslashes_loops_and_a_linked_input_folder_are_clear_errors(
    ws: Workspace, tmp_path: Path, outside: Path
) -> None:
    calls = [(t, a) for t, a, _ in ODD] + [
        ("Write", {"path": "output\\sub\\made.md", "content": "made"}),  # Windows separators mean folders
        ("Glob", {"pattern": "**/*"}),                                    # broken links do not hide the rest
        ("Grep", {"pattern": "SECRET|kept", "path": "."}),
    ]
    job, results = _run_calls(ws, tmp_path, calls, setup=_odd_links(outside))
    for (tool, args, expected), res in zip(ODD, results, strict=False):
        assert res["is_error"] and expected in res["content"], (tool, args, res["content"])
        assert "\n" not in res["content"] and "raised" not in res["content"]
    made, glob_all, grep = results[len(ODD):]
    wd = Path(job.workdir)
    assert not made["is_error"] and (wd / "output" / "sub" / "made.md").read_text(encoding="utf-8") == "made"
    assert not glob_all["is_error"], glob_all["content"]
    assert "output/kept.md" in glob_all["content"] and "loop  (broken link)" in glob_all["content"]
    assert "output/kept.md:1:kept" in grep["content"] and SECRET not in grep["content"]
    assert sorted(p.name for p in outside.iterdir()) == ["secret.png", "secret.txt"]
    assert not any("\\" in p.name for p in wd.rglob("*"))
    assert SECRET.encode() not in _stored(ws)


@pytest.mark.sqlite_only("puts links and files into the job's work directory on disk, or uses workdir=; on PostgreSQL the work directory is materialised from the store (test_files_store covers links there)")
def test_links_left_in_logs_never_make_the_engine_write_or_read_outside(
    ws: Workspace, tmp_path: Path, outside: Path
) -> None:
    # A Bash command (jailed) can still leave links in the default work directory, which holds logs/;
    # the engine writes lessons and checklists there on the host, so it must not follow them.
    piece = write_piece(tmp_path, "piece", """
name: logs-links
movements:
  - name: a
    instruction: go
    tools: [Checklist]
    rules: [{next: b}]
  - name: b
    instruction: go
    rules: [{next: COMPLETE}]
""")
    model = write_script(tmp_path, "script", responses=[
        {"tool_calls": [{"name": "Checklist", "arguments": {"name": "todo", "items": [{"text": "x"}]}}]},
        {"tool_calls": [{"name": "Checklist", "arguments": {"name": "secret", "items": [{"text": "y"}]}}]},
        transition("b", lessons="a lesson"),
        transition("COMPLETE"),
    ])
    (outside / "todo.json").write_text('{"items": [{"text": "' + SECRET + '", "done": false}]}', encoding="utf-8")
    job = ws.submit("go", piece=piece, model=model)
    logs = ws.root / "jobs" / str(job.id) / "logs"
    os.symlink(outside / "secret.txt", logs / "lessons.jsonl")
    (logs / "checklists").mkdir()
    os.symlink(outside / "secret.txt", logs / "checklists" / "secret.json")
    os.symlink(outside / "todo.json", logs / "checklists" / "linked.json")
    job = ws.run(job)
    assert job.status == "succeeded", job.error
    results = [e.payload["content"] for e in ws.events(job, kinds=["tool_result"]) if e.payload["tool"] == "Checklist"]
    assert results[0].startswith("Checklist todo: 0/1 done")
    assert results[1] == "Error: logs/checklists/secret.json is a symbolic link; agentnb does not follow links in its log folder"
    errors = [e.payload for e in ws.events(job, kinds=["error"])]
    assert [e["where"] for e in errors] == ["lessons", "lessons"]
    assert "logs/lessons.jsonl is a symbolic link" in errors[0]["message"]
    assert (outside / "secret.txt").read_text(encoding="utf-8") == SECRET + "\n"
    assert sorted(p.name for p in outside.iterdir()) == ["secret.png", "secret.txt", "todo.json"]
    assert SECRET.encode() not in _stored(ws)  # no linked checklist in a prompt
    # the lessons are still in the events
    assert [e.payload["lessons"] for e in ws.events(job, kinds=["lesson"])] == ["a lesson", "done"]


@pytest.mark.parametrize("inputs, error, phrase", [
    (["notes.md"], TypeError, "inputs must be a mapping of file name → content, not list"),
    ({"a.txt": 5}, TypeError, "input 'a.txt': the content is int; allowed: text (str), bytes or a path"),
    ({".": "x"}, ValueError, "input name '.' is input/ itself; give a file name inside input/"),
    ({"d" * 300: "x"}, ValueError, "cannot be written: it: File name too long"),
    ({"copy.txt": Path("/nonexistent/source.txt")}, ValueError,
     "input 'copy.txt' cannot be written: its source '/nonexistent/source.txt': No such file or directory"),
])
def test_bad_inputs_at_submit_are_one_clear_error_and_leave_no_job(
        ws: Workspace, inputs: Any, error: type[Exception], phrase: str) -> None:
    # these were an AttributeError, an int silently written as text, and raw OSErrors naming the host path
    with pytest.raises(error) as info:
        ws.submit("Task", piece="single", model="demo", inputs=inputs)
    assert phrase in str(info.value) and str(ws.root) not in str(info.value)
    assert ws.jobs() == [] and not any((ws.root / "jobs").glob("*"))


def test_a_glob_with_double_star_inside_a_name_is_a_clear_tool_error(tmp_path: Path) -> None:
    from agentnb.tools.base import ToolContext, get_tool

    out = get_tool("Glob").invoke(ToolContext(workdir=tmp_path, logs_dir=tmp_path / "logs"),  # type: ignore[union-attr]
                                  {"pattern": "input/a**b"})
    assert out.is_error
    assert out.content.startswith("Error: pattern 'input/a**b' is not a valid glob") and "'**/*.md'" in out.content
