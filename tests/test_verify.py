"""Verify feedback sent back to the target movement, and the git excerpt after a verify movement."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from _scripting import call, transition, user_prompts, write_piece, write_script
from conftest import require

from agentnb import Workspace

FIRST = "The summary misses the second note."
SECOND = "The title is still missing."


def _loop_script(tmp_path: Path, name: str = "loop", *, edits: list[dict[str, str]] | None = None) -> str:
    edits = edits or [{"path": "output/report.md", "content": f"v{n}"} for n in (1, 2, 3)]
    return write_script(tmp_path, name, {
        "plan": [transition("implement", summary="planned", feedback="not from a verifier", lessons="keep it short")],
        "implement": [x for e in edits for x in (call("Write", **e), transition("verify", summary="implemented"))],
        "verify": [
            transition("implement", summary="incomplete", feedback=FIRST),
            transition("implement", summary="still incomplete", feedback=SECOND),
            transition("COMPLETE", summary="all good"),
        ],
    })


def test_verify_sends_work_back_twice_then_completes(ws: Workspace, tmp_path: Path) -> None:
    job = ws.run(ws.submit("Summarise the notes", piece="plan-implement-verify", model=_loop_script(tmp_path)))
    assert job.status == "succeeded", job.error
    names = [e.payload["movement"] for e in ws.events(job, kinds=["movement_start"])]
    assert names == ["plan", "implement", "verify", "implement", "verify", "implement", "verify"]
    steps = [(e.payload["movement"], e.payload["next_step"], e.payload["feedback"])
             for e in ws.events(job, kinds=["transition"])]
    assert steps[2] == ("verify", "implement", FIRST) and steps[4] == ("verify", "implement", SECOND)

    first, second, third = user_prompts(ws, job, "implement")
    heading = "## Feedback from verification (newest last)"
    # feedback from a movement that does not verify implement is not shown as verification feedback
    assert heading not in first and "not from a verifier" not in first
    assert f"{heading}\n\n### Feedback 1 from `verify`\n{FIRST}" in second
    assert SECOND not in second
    assert (f"{heading}\n\n### Feedback 1 from `verify`\n{FIRST}\n\n"
            f"### Feedback 2 from `verify`\n{SECOND}") in third
    assert "## Lessons from previous steps\n- [plan] keep it short" in third
    # the feedback is labelled and sits before the step's own instruction
    assert third.index(SECOND) < third.index("## Current step: implement")
    for prompt in user_prompts(ws, job, "verify") + user_prompts(ws, job, "plan"):
        assert heading not in prompt
    # no git block: the work directory is not a git repository
    assert all("(git)" not in p for p in user_prompts(ws, job))
    assert (Path(job.workdir) / "output" / "report.md").read_text(encoding="utf-8") == "v3"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.name", "Test User")
    _git(repo, "config", "user.email", "test@example.invalid")
    _git(repo, "config", "commit.gpgsign", "false")
    (repo / "notes.md").write_text("alpha\nbeta\n", encoding="utf-8")
    (repo / "big.txt").write_text("".join(f"line {i}\n" for i in range(400)), encoding="utf-8")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "initial")
    return repo


def test_git_excerpt_follows_verify_only_in_a_git_workdir(ws: Workspace, tmp_path: Path, repo: Path) -> None:
    edits = [
        {"path": "notes.md", "content": "alpha\nbeta\ngamma\n"},
        {"path": "big.txt", "content": "".join(f"changed {i}\n" for i in range(400))},
        {"path": "notes.md", "content": "ALPHA\n"},
    ]
    job = ws.run(ws.submit("Extend the notes", piece="plan-implement-verify",
                           model=_loop_script(tmp_path, edits=edits), workdir=repo))
    assert job.status == "succeeded", job.error
    assert Path(job.workdir) == repo.resolve()
    heading = "## Changes in the work directory (git)"
    plan, = user_prompts(ws, job, "plan")
    first, second, third = user_prompts(ws, job, "implement")
    assert heading not in plan and heading not in first  # plan is not a verify movement
    for prompt in user_prompts(ws, job, "verify"):
        assert heading not in prompt
    # after the first verify: notes.md changed by a small diff, shown whole
    block = second.split(heading, 1)[1].split("\n## ", 1)[0]
    assert "$ git status --short\n M notes.md" in block
    assert "$ git diff --stat\n notes.md | 1 +" in block
    assert "```diff\ndiff --git a/notes.md b/notes.md" in block and "+gamma" in block
    assert "diff cut" not in block
    assert block.index("git status") < block.index("git diff --stat") < block.index("```diff")
    # after the second: big.txt rewritten; the diff is cut and says so
    block = third.split(heading, 1)[1].split("\n## ", 1)[0]
    assert " M big.txt" in block and " M notes.md" in block
    assert "big.txt  | 800" in block
    assert "[diff cut: 3,000 of " in block
    assert len(block) < 5000
    assert third.index(heading) < third.index("## Current step: implement")
    assert _git(repo, "log", "--oneline").count("\n") == 1  # the excerpt never commits anything


def test_git_excerpt_reports_a_clean_tree(
    ws: Workspace, tmp_path: Path, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a GIT_DIR left in the environment must not point the excerpt at another repository
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "elsewhere"))
    spec = write_script(tmp_path, "clean", {
        "plan": [transition("implement")],
        "implement": [transition("verify"), transition("verify", summary="nothing to change")],
        "verify": [transition("implement", feedback="Look again."), transition("COMPLETE")],
    })
    job = ws.run(ws.submit("Check", piece="plan-implement-verify", model=spec, workdir=repo))
    assert job.status == "succeeded"
    second = user_prompts(ws, job, "implement")[1]
    assert "## Changes in the work directory (git)\n$ git status --short\n(clean)" in second
    assert "git diff --stat" not in second


def test_git_block_ignores_a_repository_above_the_workdir(ws: Workspace, tmp_path: Path, repo: Path) -> None:
    inner = repo / "sub"
    inner.mkdir()
    (repo / "notes.md").write_text("changed outside the work directory\n", encoding="utf-8")
    job = ws.run(ws.submit("Extend", piece="plan-implement-verify", model=_loop_script(tmp_path), workdir=inner))
    assert job.status == "succeeded"
    assert all("(git)" not in p for p in user_prompts(ws, job))


def test_japanese_headings_for_feedback_and_git(ws: Workspace, tmp_path: Path, repo: Path) -> None:
    import yaml

    from agentnb.engine.pieces import load_piece

    data = yaml.safe_load(load_piece("plan-implement-verify").to_yaml())
    data["language"] = "ja"
    ja_piece = write_piece(tmp_path, "piv-ja", data)
    job = ws.run(ws.submit("ノートを要約", piece=str(ja_piece), model=_loop_script(tmp_path), workdir=repo))
    assert job.status == "succeeded", job.error
    second = user_prompts(ws, job, "implement")[1]
    assert f"## 検証からのフィードバック (新しいものが最後)\n\n### `verify` からのフィードバック 1\n{FIRST}" in second
    assert "## 作業ディレクトリの変更 (git)\n$ git status --short" in second
    assert "## 前のステップで得た教訓\n- [plan] keep it short" in second
    assert "## 現在のステップ: implement" in second


@pytest.mark.parametrize("jail", ["off", pytest.param("auto", marks=pytest.mark.needs("bwrap"))])
def test_git_excerpt_never_runs_commands_the_repository_config_names(
    ws: Workspace, tmp_path: Path, repo: Path, monkeypatch: pytest.MonkeyPatch, jail: str
) -> None:
    # implement may only edit files, but .git/config and .gitattributes are files in its work directory:
    # git would run an fsmonitor, a filter driver or an included config's command on the host
    if jail == "auto":
        require("bwrap")
    monkeypatch.setenv("AGENTNB_BASH_SANDBOX", jail)
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "included").write_text(f"[core]\n\tfsmonitor = touch {marks}/included; false\n", encoding="utf-8")
    config = (repo / ".git" / "config").read_text(encoding="utf-8") + (
        f'[core]\n\tfsmonitor = "touch {marks}/fsmonitor; false"\n\thooksPath = {marks}\n'
        f'[filter "evil"]\n\tclean = sh -c "touch {marks}/clean; cat"\n\tsmudge = sh -c "touch {marks}/smudge; cat"\n'
        f'\tprocess = sh -c "touch {marks}/process"\n\trequired = true\n'
        f'[diff "evil"]\n\ttextconv = sh -c "touch {marks}/textconv; cat"\n'
        f'[diff]\n\texternal = sh -c "touch {marks}/external"\n[include]\n\tpath = {tmp_path}/included\n'
    )
    (repo / ".gitattributes").write_text("*.md filter=evil diff=evil\n", encoding="utf-8")
    edits = [
        {"path": ".git/config", "content": config},
        {"path": "notes.md", "content": "alpha\nbeta\ngamma\n"},
        {"path": "notes.md", "content": "ALPHA\n"},
    ]
    job = ws.run(ws.submit("Extend the notes", piece="plan-implement-verify",
                           model=_loop_script(tmp_path, edits=edits), workdir=repo))
    assert job.status == "succeeded", job.error
    assert sorted(p.name for p in marks.iterdir()) == []
    third = user_prompts(ws, job, "implement")[2]
    assert "$ git status --short\n M notes.md" in third and "+gamma" in third  # the excerpt still works
