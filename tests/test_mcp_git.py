"""``mcp-server-git`` from the package registry, as a user runs it (``python -m mcp_server_git``), on a git
repository made here: the shipped ``git-review`` piece (pieces/git-review.yaml) lists and calls its tools, the
results are in the store, and every view shows the server beside the tool's name (docs/tools.md#mcp-tools);
``agentnb tools`` and ``%agent tools`` list each movement's tools with their source (docs/tools.md#listing-tools).
Never a mock of the protocol."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from _scripting import call, transition, write_piece, write_script

from agentnb import Workspace
from agentnb.engine.pieces import load_piece
from agentnb.engine.tool_list import list_tools
from agentnb.tools.base import unregister
from agentnb.views.tool_table import ToolTable

# mcp-server-git runs in bubblewrap's jail (docs/tools.md#mcp-tools)
pytestmark = pytest.mark.needs("bwrap")

REPO = Path(__file__).resolve().parent.parent
PIECE = REPO / "pieces" / "git-review.yaml"

if importlib.util.find_spec("mcp_server_git") is None:  # in the test extra: CI must have it
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        raise RuntimeError("mcp-server-git is not installed: pip install -c constraints.txt -e '.[test]'")
    pytest.skip("mcp-server-git is not installed: pip install -e '.[test]'", allow_module_level=True)

# fixed names and dates: the same commits (and hashes) every time
GIT_ENV = {"GIT_AUTHOR_NAME": "Ada", "GIT_AUTHOR_EMAIL": "ada@example.org", "GIT_COMMITTER_NAME": "Ada",
           "GIT_COMMITTER_EMAIL": "ada@example.org", "GIT_AUTHOR_DATE": "2026-01-02T03:04:05+00:00",
           "GIT_COMMITTER_DATE": "2026-01-02T03:04:05+00:00", "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_CONFIG_NOSYSTEM": "1"}


def make_repo(folder: Path) -> Path:
    """``folder/input/repo``: two commits of ``notes.md`` and an uncommitted change to it."""
    repo = folder / "input" / "repo"
    repo.mkdir(parents=True)
    env = {**os.environ, **GIT_ENV}

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "init.defaultBranch=main", *args], cwd=repo, env=env, check=True,
                       capture_output=True, timeout=30)

    git("init", "-q", "--template=")
    (repo / "notes.md").write_text("# Notes\n\nThe first line.\n", encoding="utf-8")
    git("add", "notes.md")
    git("commit", "-q", "-m", "Start the notes")
    (repo / "notes.md").write_text("# Notes\n\nThe first line.\nA second line.\n", encoding="utf-8")
    git("commit", "-q", "-am", "Add a second line")
    (repo / "notes.md").write_text("# Notes\n\nThe first line, reworded.\nA second line.\n", encoding="utf-8")
    return repo


def repo_inputs(folder: Path) -> dict[str, Any]:
    """Every file under ``folder/input`` (the repository with its .git) as a job's inputs."""
    base = folder / "input"
    return {str(p.relative_to(base)): p for p in sorted(base.rglob("*")) if p.is_file()}


def _script(tmp_path: Path) -> str:
    return write_script(tmp_path, "review-script", responses=[
        call("git_status", repo_path="input/repo"),
        call("git_log", repo_path="input/repo", max_count=5),
        call("git_diff_unstaged", repo_path="input/repo"),
        call("git_commit", repo_path="input/repo", message="not allowed"),  # outside the piece's allow-list
        call("Write", path="output/review.md", content="# Review\n\nTwo commits; one line reworded, uncommitted.\n"),
        transition("COMPLETE", summary="reviewed the repository"),
    ])


def test_a_job_reviews_a_repository_with_mcp_server_git_and_every_view_names_the_server(
        ws: Workspace, tmp_path: Path) -> None:
    from agentnb.follow import Follower

    make_repo(tmp_path / "src")
    job = ws.submit("Review the repository in input/repo", piece=str(PIECE), model=_script(tmp_path),
                    inputs=repo_inputs(tmp_path / "src"))
    followed = io.StringIO()  # what `agentnb run --follow` prints
    with Follower(ws.execution, followed, job_id=job.id):
        job = ws.run(job)
    assert job.status == "succeeded", job.error
    assert "← git_log · git: Commit history:" in followed.getvalue() and "← Write: Wrote" in followed.getvalue()
    # the server's tools were listed and shown to the model, within the piece's allow-list
    shown = set(ws.events(job, kinds=["llm_request"])[0].tools)
    assert {"git_status", "git_log", "git_diff_unstaged", "git_show", "Write", "transition"} <= shown
    assert "git_commit" not in shown
    calls = ws.events(job, kinds=["tool_call"])
    results = {r.call_id: r for r in ws.events(job, kinds=["tool_result"])}
    by_tool = {c.tool: results[c.call_id] for c in calls}
    assert [(c.tool, c.server) for c in calls] == [
        ("git_status", "git"), ("git_log", "git"), ("git_diff_unstaged", "git"), ("git_commit", None),
        ("Write", None), ("transition", None)]
    assert "modified:" in by_tool["git_status"].content and "notes.md" in by_tool["git_status"].content
    log = by_tool["git_log"].content
    assert "Add a second line" in log and "Start the notes" in log and log.index("Add a second") < log.index("Start")
    assert "-The first line." in by_tool["git_diff_unstaged"].content
    assert "+The first line, reworded." in by_tool["git_diff_unstaged"].content
    assert not any(by_tool[t].is_error for t in ("git_status", "git_log", "git_diff_unstaged"))
    assert by_tool["git_commit"].is_error and "not available in this step" in by_tool["git_commit"].content
    assert (job.output / "review.md").read_text(encoding="utf-8").startswith("# Review")

    # frames.tool_calls(): the server column, NA for the built-in tools
    tc = ws.frames.tool_calls(job)
    assert isinstance(tc["server"].dtype, pd.CategoricalDtype)
    assert [None if pd.isna(s) else s for s in tc["server"]] == ["git", "git", "git", None, None, None]
    assert list(tc.columns).index("server") == list(tc.columns).index("tool") + 1

    # the job view: the server beside the tool's name; the transcript and the text view too
    from agentnb.views.render import job_html
    from agentnb.views.transcript import movement_text

    html = job_html(ws, job.id, full=True)
    assert re.search(r'<b>git_log</b> <span class="anb-dim anb-server" title="MCP server git"[^>]*>· git</span>', html)
    assert "<b>Write</b><div>" in html  # a built-in tool has nothing beside its name
    text = movement_text(ws.events(job))
    assert "> git_log · git {" in text and "< git_log · git" in text and "> Write {" in text


def test_agentnb_tools_lists_each_movements_tools_with_their_source_and_parameters(tmp_path: Path) -> None:
    make_repo(tmp_path / "work")
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)}

    def tools(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agentnb.cli", "tools", str(PIECE), *args], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120)

    done = tools("--workdir", str(tmp_path / "work"))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[2:]}
    assert done.stdout.splitlines()[0] == "review (permission edit)"
    assert rows["Write"][0] == "built-in" and rows["transition"][0] == "built-in"
    assert rows["git_log"][:3] == ["git", "repo_path:", "string,"]
    assert "max_count?: integer" in done.stdout
    assert "git_commit" not in rows  # the piece's allow-list
    # a server that cannot start (no input/repo in an empty work directory): one line naming it, on stderr,
    # exit 1, and the other tools still listed
    failed = tools()
    assert failed.returncode == 1
    (line,) = failed.stderr.splitlines()
    assert line.startswith("agentnb: error: MCP server 'git' could not be started") and "input/repo" in line
    assert "Write" in failed.stdout and "transition" in failed.stdout and "git_log" not in failed.stdout
    # no server is left behind by the listing that started one
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _runs_git_server(p, tmp_path / "work")]


def _runs_git_server(proc: Path, cwd: Path) -> bool:
    try:
        return "mcp_server_git" in (proc / "cmdline").read_text() and os.readlink(proc / "cwd") == str(cwd)
    except OSError:
        return False


def test_agent_tools_in_a_notebook_shows_a_table_per_movement_with_python_and_server_tools(
        shell: Any, tmp_path: Path) -> None:
    make_repo(tmp_path / "work")
    shell.run_cell("import agentnb\n@agentnb.tool\ndef t_shout(text: str, times: int = 2) -> str:\n"
                   "    '''Say it louder.'''\n    return text.upper() * times\n")
    piece = write_piece(tmp_path, "mixed", {
        "mcp_servers": {"git": {"command": sys.executable,
                                "args": ["-m", "mcp_server_git", "--repository", "input/repo"],
                                "permission": "readonly", "tools": ["git_log", "git_status"]}},
        "movements": [
            {"name": "look", "instruction": "Look.", "tools": ["Read", "t_shout", "git.*"], "rules": [{"next": "tell"}]},
            {"name": "tell", "instruction": "Tell.", "tools": ["git.git_log"], "permission": "edit", "rules": [{"next": "COMPLETE"}]},
        ]})
    try:
        shell.user_ns["t_work"] = str(tmp_path / "work")
        table = shell.run_line_magic("agent", f"tools {piece} --workdir $t_work")
        frame = table.frame()
        assert frame[frame.movement == "look"][["tool", "source"]].values.tolist() == [
            ["Read", "built-in"], ["t_shout", "Python"], ["git_status", "git"], ["git_log", "git"],
            ["transition", "built-in"]]
        assert frame[frame.movement == "tell"]["tool"].tolist() == ["git_log", "transition"]
        shout = frame[frame.tool == "t_shout"].iloc[0]
        assert (shout.parameters, shout.description) == ("text: string, times?: integer", "Say it louder.")
        html = table._repr_html_()
        assert html.count("<table") == 2 and "<b>look</b>" in html and "<code>git_status</code>" in html
        assert "look (permission readonly)" in repr(table)
        # without the repository the server fails: one line naming it, the other tools still listed
        empty = shell.run_line_magic("agent", f"tools {piece}")
        assert len(empty.listing.failures) == 1 and "MCP server 'git'" in empty.listing.failures[0]
        assert "MCP server &#x27;git&#x27; could not be started" in empty._repr_html_()
        assert empty.frame()["tool"].tolist() == ["Read", "t_shout", "transition", "transition"]
    finally:
        unregister("t_shout")


def test_the_listing_starts_no_server_for_a_piece_without_one_and_refuses_a_missing_workdir(tmp_path: Path) -> None:
    listing = list_tools(load_piece("single"))
    (work,) = listing.movements
    assert [t.name for t in work.tools] == ["Read", "Glob", "Grep", "Write", "Edit", "Checklist", "transition"]
    assert {t.source for t in work.tools} == {"built-in"} and not listing.failures
    assert "Read" in ToolTable(listing).text(width=80)
    with pytest.raises(Exception, match="is not an existing directory"):
        list_tools(load_piece("single"), tmp_path / "nowhere")
