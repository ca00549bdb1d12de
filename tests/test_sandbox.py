"""Bash stays in the job's work directory: a bubblewrap jail, no secrets, no network."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
from _scripting import call, transition, write_piece, write_script

from agentnb import Workspace

pytestmark = pytest.mark.needs("bwrap")


def _run_bash(ws: Workspace, tmp_path: Path, *commands: str) -> list[dict]:
    piece = write_piece(tmp_path, "shell", {"movements": [{
        "name": "work", "instruction": "Use the shell.", "tools": ["Bash"], "permission": "full",
        "rules": [{"next": "COMPLETE"}],
    }]})
    script = write_script(tmp_path, "bash-" + uuid.uuid4().hex[:6],
                          {"work": [call("Bash", command=c) for c in commands] + [transition("COMPLETE")]})
    job = ws.run(ws.submit("shell", piece=str(piece), model=script))
    assert job.status == "succeeded", job.error
    return [e.payload for e in ws.events(job, kinds=["tool_result"]) if e.payload["tool"] == "Bash"]


def test_commands_work_inside_the_work_directory(ws: Workspace, tmp_path: Path) -> None:
    out = _run_bash(ws, tmp_path, "echo hello > output/made.txt && cat output/made.txt && pwd")
    assert not out[0]["is_error"]
    assert "hello" in out[0]["content"]
    job_dir = ws.root / "jobs" / "1"
    assert (job_dir / "output" / "made.txt").read_text() == "hello\n"
    assert str(job_dir.resolve()) in out[0]["content"]


def test_nothing_outside_the_work_directory_is_reachable(ws: Workspace, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT")
    marker = f"agentnb-escape-{uuid.uuid4().hex}"
    out = _run_bash(
        ws, tmp_path,
        "cat ../../agentnb.sqlite | head -c 100; echo; ls ../..",
        f"cat {secret}",
        f"echo x > /tmp/{marker}; ls /tmp",
        "echo x > /etc/agentnb-escape",
        f"ls -A {Path.home()}",
    )
    # the folders above the work directory are empty mount points: no store, no other jobs
    assert "SQLite format" not in out[0]["content"] and "No such file or directory" in out[0]["content"]
    assert out[1]["is_error"] and "TOP-SECRET-CONTENT" not in out[1]["content"]
    assert not Path("/tmp", marker).exists()  # the command's /tmp is its own
    assert out[3]["is_error"] and "Read-only file system" in out[3]["content"]
    assert not Path("/etc/agentnb-escape").exists()
    # the home folder holds at most the mount point of the Python installation the shell may run
    import sys

    allowed = {Path(p).relative_to(Path.home()).parts[0] for p in (sys.prefix, sys.base_prefix)
               if Path(p).is_relative_to(Path.home())}
    listed = set(out[4]["content"].split()) - {"[stderr]"}
    assert out[4]["is_error"] or listed <= allowed, listed


def test_a_python_installation_under_tmp_stays_visible(ws: Workspace, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # a virtual environment made under /tmp (as CI's clone may be): the jail's own /tmp must not hide it, or
    # `python3` in a command runs another interpreter than the one running agentnb
    venv = Path("/tmp") / f"agentnb-venv-{uuid.uuid4().hex[:8]}"
    (venv / "bin").mkdir(parents=True)
    try:
        (venv / "bin" / "marker").write_text("the installation\n")
        monkeypatch.setattr("sys.prefix", str(venv))
        out = _run_bash(ws, tmp_path, f"cat {venv}/bin/marker")
    finally:
        shutil.rmtree(venv)
    assert not out[0]["is_error"] and "the installation" in out[0]["content"], out[0]


def test_secrets_and_network_stay_out(ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-never-shown-123")
    out = _run_bash(ws, tmp_path, "echo key=[$OPENAI_API_KEY]; env | grep -c sk-test || true",
                    "cat /sys/class/net/*/address 2>/dev/null | wc -l; ls /sys/class/net 2>/dev/null || ip -o link 2>/dev/null | wc -l")
    assert "key=[]" in out[0]["content"] and "sk-test-never-shown-123" not in out[0]["content"]
    assert "eth0" not in out[1]["content"]


def test_without_bubblewrap_bash_refuses_unless_switched_off(
    ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    (empty / "bash").symlink_to(shutil.which("bash"))  # a PATH with bash but no bwrap
    monkeypatch.setenv("PATH", str(empty))
    out = _run_bash(ws, tmp_path, "echo ran")
    assert out[0]["is_error"]
    assert "bubblewrap" in out[0]["content"] and "AGENTNB_BASH_SANDBOX=off" in out[0]["content"]
    assert "ran" not in out[0]["content"].replace("unconfined", "")
    monkeypatch.setenv("AGENTNB_BASH_SANDBOX", "off")
    out = _run_bash(ws, tmp_path, "echo ran")
    assert not out[0]["is_error"] and "ran" in out[0]["content"]
