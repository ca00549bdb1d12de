"""``--context KEY=VALUE`` of ``agentnb run``/``fork`` and ``%agent run``/``fork``: a job's context settings
(the compaction keys of docs/context.md#compaction among them) from a terminal or a notebook, as ``submit(context=…)``
takes them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, transition, write_piece, write_script
from conftest import store_of
from IPython.core.error import UsageError

from agentnb import Workspace
from agentnb.engine.context import context_items
from agentnb.errors import UsageError as AgentnbUsageError

AGENTNB = shutil.which("agentnb")
needs_cli = pytest.mark.skipif(AGENTNB is None, reason="the agentnb entry point is not installed")


def agentnb(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # AGENTNB_STORE stays: under AGENTNB_TEST_BACKEND=postgres the subprocess must use the test's database
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AGENTNB_", "OPENAI_")) or k == "AGENTNB_STORE"}
    assert AGENTNB is not None
    return subprocess.run([AGENTNB, *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


def _glob(prompt_tokens: int) -> dict[str, Any]:
    return {**call("Glob", pattern="*"), "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 10}}


def _job_files(folder: Path) -> tuple[Path, str]:
    """A one-movement piece with the seed's behaviour (no on_pressure) and a script that crosses `prompt` at its
    second call, then answers the summarisation call, reads on and completes."""
    piece = write_piece(folder, "long", {"context": {"window_tokens": 1000}, "movements": [
        {"name": "work", "instruction": "Work.", "tools": ["Glob"], "rules": [{"next": "COMPLETE"}],
         "default_next": "COMPLETE"}]})
    script = write_script(folder, "script", {"work": [
        _glob(500), _glob(900), {"content": "the summary so far"}, _glob(300), transition("COMPLETE")]})
    return piece, script


def _query(folder: Path, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
    """Rows of ``sql`` in the store the CLI wrote for the workspace ``folder`` (SQLite's file or the test's
    PostgreSQL database)."""
    store = store_of(folder)
    assert store is not None, f"nothing stored for {folder}"
    try:
        return store.query(sql, params)
    finally:
        store.close()


def _kinds(folder: Path, job: int) -> list[str]:
    return [r[0] for r in _query(folder, "SELECT kind FROM events WHERE job_id=? ORDER BY id", (job,))]


def _options(folder: Path, job: int) -> dict[str, Any]:
    (row,) = _query(folder, "SELECT options FROM jobs WHERE id=?", (job,))
    return dict(json.loads(row[0] or "{}"))


def test_items_become_submits_context_mapping() -> None:
    assert context_items(["on_pressure=compact", "compact_keep_last=2", "max_compactions = 3",
                          "window_tokens=64000", "thresholds.prompt=0.8", "thresholds={warn: 0.6}",
                          "min_tool_tokens=500"]) == {
        "on_pressure": "compact", "compact_keep_last": 2, "max_compactions": 3, "window_tokens": 64000,
        "thresholds": {"prompt": 0.8, "warn": 0.6}, "min_tool_tokens": 500}
    assert context_items([]) == {}


@pytest.mark.parametrize(("item", "words"), [
    ("on_pressure=sometimes", "--context on_pressure=sometimes: context.on_pressure='sometimes'; allowed: "
                              "transition, compact"),
    ("compact_keep_last=-1", "--context compact_keep_last=-1: context.compact_keep_last=-1; allowed: a whole number ≥ 0"),
    ("max_compactions=two", "--context max_compactions=two: context.max_compactions='two'; allowed: a whole number ≥ 0"),
    ("max_compactions=true", "allowed: a whole number ≥ 0"),
    ("nope=1", "--context nope=1: context: unknown key(s) ['nope']; allowed: window_tokens, thresholds"),
    ("thresholds.later=0.5", "unknown action(s) ['later']; allowed: warn, prompt, force_transition, exhausted"),
    ("thresholds.prompt=2", "context.thresholds.prompt=2; allowed: a number between 0 (excluded) and 1"),
    ("on_pressure", "--context 'on_pressure': expected KEY=VALUE, e.g. on_pressure=compact; keys: window_tokens"),
    ("on_pressure=", "expected KEY=VALUE"),
    ("thresholds={prompt: 0.8", "is not a value"),
])
def test_a_bad_item_is_one_line_naming_it_and_what_is_allowed(item: str, words: str) -> None:
    with pytest.raises(AgentnbUsageError) as info:
        context_items([item])
    assert words in str(info.value)
    assert "\n" not in str(info.value)


@needs_cli
def test_run_context_turns_compaction_on_for_a_job_and_is_stored(tmp_path: Path) -> None:
    piece, script = _job_files(tmp_path)
    out = agentnb(tmp_path, "run", "--workspace", "ws", "--piece", str(piece), "--model", script,
                  "--context", "on_pressure=compact", "--context", "compact_keep_last=2", "Do it")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("job 1: succeeded")
    assert " 1. work" in out.stdout and "→ COMPLETE (1 compaction)  done" in out.stdout  # run's job lines say so
    kinds = _kinds(tmp_path / "ws", 1)
    assert kinds.count("compaction") == 1 and "reminder" not in kinds
    assert _options(tmp_path / "ws", 1)["context"] == {"on_pressure": "compact",
                                                                          "compact_keep_last": 2}
    ws = Workspace(tmp_path / "ws", readonly=True)
    (compaction,) = ws.events(1, kinds=["compaction"])
    assert compaction.payload["summary"] == "the summary so far"
    assert compaction.payload["kept_messages"] == 2


@needs_cli
def test_without_context_the_same_job_keeps_the_seeds_wrap_up(tmp_path: Path) -> None:
    piece, script = _job_files(tmp_path)
    out = agentnb(tmp_path, "run", "--workspace", "ws", "--piece", str(piece), "--model", script, "Do it")
    assert out.returncode == 0, out.stderr
    assert "compaction)" not in out.stdout
    kinds = _kinds(tmp_path / "ws", 1)
    assert "compaction" not in kinds and "reminder" in kinds


@needs_cli
def test_a_job_context_overrides_the_movements_on_pressure(tmp_path: Path) -> None:
    """long-research's verify movement compacts; the job's on_pressure=transition wins (job > movement)."""
    (tmp_path / "notes.md").write_text("alpha\nbeta\n", encoding="utf-8")
    out = agentnb(tmp_path, "run", "--workspace", "ws", "--piece", "long-research", "--model", "demo",
                  "--input", "notes.md", "--context", "on_pressure=transition", "Summarise input/notes.md")
    assert out.returncode == 0, out.stderr
    kinds = _kinds(tmp_path / "ws", 1)
    assert "compaction" not in kinds and "reminder" in kinds


@needs_cli
@pytest.mark.parametrize("item", ["on_pressure=sometimes", "compact_keep_last", "thresholds.prompt=0.5"])
def test_run_refuses_a_bad_context_with_one_line_and_stores_nothing(tmp_path: Path, item: str) -> None:
    piece, script = _job_files(tmp_path)
    out = agentnb(tmp_path, "run", "--workspace", "ws", "--piece", str(piece), "--model", script,
                  "--context", item, "Do it")
    assert out.returncode == 2
    assert out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith("agentnb: error: ")
    # thresholds.prompt=0.5 is a fine ratio, but below the piece's warn (0.7): refused when merged, by submit
    assert item.split("=")[0].split(".")[-1] in line
    store = store_of(tmp_path / "ws")
    if store is not None:
        try:
            assert store.query("SELECT count(*) FROM jobs")[0][0] == 0
        finally:
            store.close()


@needs_cli
def test_fork_context_applies_from_the_fork_point(tmp_path: Path) -> None:
    piece, script = _job_files(tmp_path)
    # the original on the seed's behaviour: its script's third entry is taken as an answer without a tool call
    first = agentnb(tmp_path, "run", "--workspace", "ws", "--piece", str(piece), "--model", script, "Do it")
    assert first.returncode == 0, first.stderr
    # forked at run 1 (live from the start) with compaction on, on a script that answers the summarisation call
    fork_script = write_script(tmp_path, "fork", {"work": [
        _glob(500), _glob(900), {"content": "forked summary"}, _glob(300), transition("COMPLETE")]})
    out = agentnb(tmp_path, "fork", "1", "--workspace", "ws", "--at", "1", "--model", fork_script,
                  "--context", "on_pressure=compact", "--context", "compact_keep_last=2")
    assert out.returncode == 0, out.stderr
    assert "forked from job 1 at run 1" in out.stdout
    assert _kinds(tmp_path / "ws", 2).count("compaction") == 1
    assert _options(tmp_path / "ws", 2)["context"] == {"on_pressure": "compact",
                                                                          "compact_keep_last": 2}
    bad = agentnb(tmp_path, "fork", "1", "--workspace", "ws", "--at", "1", "--context", "max_compactions=-2")
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("agentnb: error: --context max_compactions=-2: context.max_compactions=-2; "
                                  "allowed: a whole number ≥ 0")


def test_magic_run_context(shell: Any, tmp_path: Path) -> None:
    piece, script = _job_files(tmp_path)
    shell.user_ns["t_keep"] = 2
    job = shell.run_line_magic(
        "agent", f'run --piece {piece} --model {script} --context on_pressure=compact -c compact_keep_last={{t_keep}} "Do it"')
    assert job.status == "succeeded", job.error
    ws = Workspace(tmp_path / "ws")
    assert ws.store.job(job.id).options.context == {"on_pressure": "compact", "compact_keep_last": 2}
    (compaction,) = ws.events(job, kinds=["compaction"])
    assert compaction.payload["kept_messages"] == 2
    assert not ws.events(job, kinds=["reminder"])


@pytest.mark.parametrize(("line", "words"), [
    ('run --context on_pressure=sometimes "Do it"',
     "%agent run: --context on_pressure=sometimes: context.on_pressure='sometimes'; allowed: transition, compact"),
    ('run --context window_tokens "Do it"', "%agent run: --context 'window_tokens': expected KEY=VALUE"),
    # a fine ratio, but below the piece's warn (0.7) once merged: refused by submit, still one line
    ('run --context thresholds.prompt=0.5 "Do it"', "%agent run: context.thresholds: warn (0.7) is above prompt (0.5)"),
    ("run --job 1 --context on_pressure=compact", "remove --context"),
])
def test_magic_refuses_a_bad_context_with_one_line(shell: Any, tmp_path: Path, line: str, words: str) -> None:
    if "--job" in line:
        shell.run_line_magic("agent", 'run --queue "Summarise the files"')
    with pytest.raises(UsageError) as info:
        shell.run_line_magic("agent", line)
    assert words in str(info.value)
    assert "\n" not in str(info.value)
    if "--job" not in line:
        assert Workspace(tmp_path / "ws").jobs() == []


def test_magic_fork_context(shell: Any, tmp_path: Path) -> None:
    piece, script = _job_files(tmp_path)
    original = shell.run_line_magic("agent", f'run --piece {piece} --model {script} "Do it"')
    assert original.status == "succeeded", original.error
    fork_script = write_script(tmp_path, "fork", {"work": [
        _glob(500), _glob(900), {"content": "forked summary"}, _glob(300), transition("COMPLETE")]})
    fork = shell.run_line_magic("agent", f"fork {original.id} --at 1 --model {fork_script} --context on_pressure=compact -c compact_keep_last=2")
    assert fork.status == "succeeded", fork.error
    ws = Workspace(tmp_path / "ws")
    assert [e.payload["summary"] for e in ws.events(fork, kinds=["compaction"])] == ["forked summary"]


@needs_cli
def test_show_marks_the_run_that_closed_a_loop(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parent.parent / "notebooks" / "compaction-loops" / "review-loop-script.yaml"
    out = agentnb(tmp_path, "run", "--workspace", "ws", "--piece", "review-loop", "--model", f"scripted:{script}",
                  "Write an abstract to output/abstract.md")
    assert out.returncode == 1  # the judge aborted it
    lines = out.stdout.splitlines()
    assert lines[0].startswith("job 1: aborted")
    marked = [line for line in lines if "(loop detected)" in line]
    assert len(marked) == 1 and marked[0].lstrip().startswith("7. fix") and "→ review (loop detected)" in marked[0]
    assert any(line.lstrip().startswith("8. judge") and "→ ABORT" in line for line in lines)
    assert "compaction)" not in out.stdout
