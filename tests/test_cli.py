"""The real ``agentnb`` command, run as a subprocess: exit codes, output and the SQLite file it leaves."""

from __future__ import annotations

import io
import json
import os
import shutil
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from _scripting import transition, write_piece, write_script
from openai_server import OpenAIServer, midway, openai_env, reply

AGENTNB = shutil.which("agentnb")
pytestmark = pytest.mark.skipif(AGENTNB is None, reason="the agentnb entry point is not installed")


def agentnb(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTNB_", "OPENAI_"))}
    full_env.update(env or {})
    return subprocess.run([AGENTNB, *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=full_env)


def _db(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path / "agentnb.sqlite")


def test_run_demo_succeeds_with_its_events_in_the_sqlite_file(tmp_path: Path) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text("alpha\nbeta\n", encoding="utf-8")
    out = agentnb(tmp_path, "run", "--workspace", "ws", "--piece", "plan-implement-verify", "--model", "demo",
                  "--input", "notes.md", "Summarise the files in input/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("job 1: succeeded  piece=plan-implement-verify model=demo")
    assert "verify" in out.stdout and "→ COMPLETE" in out.stdout
    db = _db(tmp_path / "ws")
    status, = db.execute("SELECT status FROM jobs WHERE id=1").fetchone()
    assert status == "succeeded"
    kinds = [k for (k,) in db.execute("SELECT kind FROM events WHERE job_id=1 ORDER BY id")]
    assert kinds[0] == "job_status" and kinds[-1] == "job_status"
    assert {"movement_start", "llm_request", "llm_response", "tool_call", "tool_result", "transition", "lesson",
            "context_action"} <= set(kinds)
    last = json.loads(db.execute("SELECT payload FROM events WHERE job_id=1 ORDER BY id DESC LIMIT 1").fetchone()[0])
    assert last["status"] == "succeeded"
    assert (tmp_path / "ws" / "jobs" / "1" / "input" / "notes.md").read_text() == "alpha\nbeta\n"
    assert (tmp_path / "ws" / "jobs" / "1" / "output" / "report.md").is_file()


@pytest.mark.parametrize(("args", "line"), [
    ([b"run", b"caf\xe9 au lait"], "instruction: not valid UTF-8 (byte 0xe9 at position 3)"),
    ([b"run", b"--detach", b"make", b"caf\xc3"], "instruction: not valid UTF-8 (byte 0xc3 at position 8)"),
    ([b"reply", b"1", b"\xff yes"], "text: not valid UTF-8 (byte 0xff at position 0)"),
    ([b"batch", b"cases.csv", b"--name", b"exp-\xe9"], "--name: not valid UTF-8 (byte 0xe9 at position 4)"),
    ([b"run", b"--context", b"note=\xe9t\xe9", b"task"], "--context: not valid UTF-8 (byte 0xe9 at position 5)"),
])
def test_an_argument_that_is_not_utf8_is_one_line_naming_it(tmp_path: Path, args: list[bytes], line: str) -> None:
    """A Latin-1 terminal's bytes reach Python as lone surrogates, which no store can keep: refused by name
    before anything is opened, not Python's codec message from the middle of a write."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTNB_", "OPENAI_"))}
    out = subprocess.run([str(AGENTNB).encode(), b"--workspace", b"ws", *args], cwd=tmp_path, capture_output=True,
                         timeout=120, env=env)
    assert out.returncode == 2
    assert out.stderr.decode() == f"agentnb: error: {line}; pass UTF-8 text\n"
    assert not (tmp_path / "ws").exists()


def test_run_waiting_for_a_human_exits_0_and_reply_resumes(tmp_path: Path) -> None:
    out = agentnb(tmp_path, "--workspace", "ws", "run", "--piece", "ask-first", "--model", "demo", "Make a list")
    assert out.returncode == 0, out.stderr
    assert "job 1: waiting_human" in out.stdout
    assert "question: Which format" in out.stdout
    assert 'agentnb reply 1 "…"' in out.stdout
    out = agentnb(tmp_path, "--workspace", "ws", "reply", "1", "A", "bullet", "list.", "--run")
    assert out.returncode == 0, out.stderr
    assert "job 1: succeeded" in out.stdout
    bodies = [b for (b,) in _db(tmp_path / "ws").execute("SELECT body FROM comments WHERE job_id=1 ORDER BY id")]
    assert bodies[-1] == "A bullet list."


def test_options_go_anywhere_among_a_sub_commands_words(tmp_path: Path) -> None:
    """`reply 1 A --run bullet list.`: an option between the words of the text, as shells' commands take it
    (argparse alone ends the text at the first option and refuses the words after it)."""
    out = agentnb(tmp_path, "--workspace", "ws", "run", "Make", "--piece", "ask-first", "a", "list", "--model", "demo")
    assert out.returncode == 0, out.stderr
    assert "job 1: waiting_human" in out.stdout
    out = agentnb(tmp_path, "--workspace", "ws", "reply", "1", "A", "--run", "bullet", "list.")
    assert out.returncode == 0, out.stderr
    assert "job 1: succeeded" in out.stdout
    db = _db(tmp_path / "ws")
    assert db.execute("SELECT instruction FROM jobs WHERE id=1").fetchone() == ("Make a list",)
    assert db.execute("SELECT body FROM comments WHERE job_id=1 ORDER BY id DESC").fetchone() == ("A bullet list.",)


def test_run_exits_1_when_the_job_fails_or_aborts(tmp_path: Path) -> None:
    failing = write_script(tmp_path, "empty", responses=[])
    out = agentnb(tmp_path, "--workspace", "ws", "run", "--piece", "single", "--model", failing, "task")
    assert out.returncode == 1
    assert "job 1: failed" in out.stdout
    assert "error: scripted model ran out of responses" in out.stdout
    aborting = write_script(tmp_path, "abort", responses=[transition("ABORT", "cannot be done")])
    out = agentnb(tmp_path, "--workspace", "ws", "run", "--piece", "single", "--model", aborting, "task")
    assert out.returncode == 1
    assert "job 2: aborted" in out.stdout and "error: cannot be done" in out.stdout


@pytest.mark.parametrize("piece_text, line, field", [
    ("name: x\nmovements:\n  - name: a\n    instruction: do\n    tools: Read\n", 5, "movements[0] (a).tools"),
    ("name: x\nmovements:\n  - name: a\n    instruction: [do\n", 4, "movements[0].instruction"),
    ("name: x\nmovements:\n  - name: a\n    instruction: do\n    rules:\n      - {next: nowhere}\n", 6,
     "movements[0] (a).rules[0].next"),
])
def test_a_bad_piece_exits_2_with_one_line_and_no_job(tmp_path: Path, piece_text: str, line: int, field: str) -> None:
    write_piece(tmp_path, "bad", piece_text)
    out = agentnb(tmp_path, "--workspace", "ws", "run", "--piece", "bad.yaml", "--model", "demo", "task")
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"agentnb: error: bad.yaml:{line}: {field}: "), lines[0]
    assert "Traceback" not in out.stderr
    assert _db(tmp_path / "ws").execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0


@pytest.mark.parametrize("args, message", [
    (["run", "--piece", "single", "--model", "gpt", "task"], "unknown model spec 'gpt'; allowed: demo"),
    (["run", "--piece", "nope", "task"], "unknown piece 'nope'; available:"),
    (["run", "--piece", "single"], "run: the instruction is missing"),
    (["run", "--input", "missing.txt", "task"], "--input missing.txt: no such file"),
    (["show", "7"], "no job 7 in"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    # beyond SQLite's 64-bit integers the lookup itself raised OverflowError (a traceback)
    (["show", "99999999999999999999999"], "no job 99999999999999999999999 in"),
    (["reply", "99999999999999999999999", "hi"], "no job 99999999999999999999999 in"),
    (["retry", "--", "-99999999999999999999999"], "no job -99999999999999999999999 in"),
    (["run", "--model", "replay:99999999999999999999999", "task"], "no job 99999999999999999999999 in"),
    (["worker", "--max-jobs", "-1"], "--max-jobs -1; allowed: a whole number ≥ 1"),
    (["run", "--detach", "--follow", "task"], "run: --detach queues the job for a worker and --follow prints"),
    (["worker", "--max-jobs", "0"], "--max-jobs 0; allowed: a whole number ≥ 1"),
])
def test_usage_errors_exit_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    out = agentnb(tmp_path, "--workspace", "ws", *args)
    assert out.returncode == 2
    assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith("agentnb: error: ")
    assert message in out.stderr, out.stderr
    assert "agentnb: error: agentnb" not in out.stderr


def test_detach_worker_jobs_and_show(tmp_path: Path) -> None:
    model = write_script(tmp_path, "script", responses=[transition("COMPLETE", "done")])
    ids = []
    for n in range(2):
        out = agentnb(tmp_path, "run", "--piece", "single", "--model", model, "--detach", f"task {n}",
                      env={"AGENTNB_WORKSPACE": str(tmp_path / "envws")})
        assert out.returncode == 0, out.stderr
        ids.append(int(out.stdout.strip()))
    assert ids == [1, 2]
    env = {"AGENTNB_WORKSPACE": str(tmp_path / "envws")}
    listing = agentnb(tmp_path, "jobs", env=env).stdout
    assert listing.count("queued") == 2
    out = agentnb(tmp_path, "worker", env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ran 2 job(s)"
    jobs = json.loads(agentnb(tmp_path, "jobs", "--json", env=env).stdout)
    assert [(j["id"], j["status"], j["piece"], j["model"]) for j in jobs] == [
        (1, "succeeded", "single", model), (2, "succeeded", "single", model)]
    show = agentnb(tmp_path, "show", "2", env=env)
    assert show.returncode == 0
    assert show.stdout.startswith("job 2: succeeded")
    assert "1. work" in show.stdout and "tokens:" in show.stdout
    events = [json.loads(line) for line in agentnb(tmp_path, "show", "2", "--events", env=env).stdout.splitlines()]
    assert events[0] == {**events[0], "kind": "job_status", "status": "queued"}
    assert events[-1]["kind"] == "job_status" and events[-1]["status"] == "succeeded"
    assert [e["id"] for e in events] == sorted(e["id"] for e in events)
    starts = [e for e in events if e["kind"] == "movement_start"]
    assert starts[0]["movement"] == "work" and "## Task\ntask 1" in starts[0]["user"]
    assert not (tmp_path / "agentnb-data").exists()  # the env var was used, not the default folder


def test_pieces_lists_local_and_shipped_pieces(tmp_path: Path) -> None:
    (tmp_path / "pieces").mkdir()
    write_piece(tmp_path / "pieces", "mine", "name: mine\nmovements:\n  - name: only\n    instruction: x\n")
    write_piece(tmp_path / "pieces", "broken", "name: broken\nmovements: 3\n")
    out = agentnb(tmp_path, "pieces")
    assert out.returncode == 0
    assert "mine" in out.stdout and "plan-implement-verify" in out.stdout
    assert "broken" in out.stdout and "INVALID" in out.stdout and "broken.yaml:2: movements:" in out.stdout


def test_a_parent_waiting_on_a_child_that_asks_says_so_and_reply_run_finishes_both(tmp_path: Path) -> None:
    child = write_script(tmp_path, "child", movements={"work": [
        transition("ASK", question="Which year?"), transition("COMPLETE", summary="used 2024")]})
    parent = write_script(tmp_path, "parent", movements={
        "split": [transition("WAIT_SUBTASKS", subtasks=[{"instruction": "Ask first", "piece": "single", "model": child}])],
        "merge": [transition("COMPLETE", summary="merged")],
    })
    out = agentnb(tmp_path, "--workspace", "ws", "run", "--piece", "fan-out", "--model", parent, "Do it")
    assert out.returncode == 0, out.stderr
    assert "job 1: waiting_subtasks" in out.stdout
    assert "  subtask job 2: waiting_human  Ask first\n    question: Which year?\n" in out.stdout
    assert 'agentnb reply 2 "…" --run' in out.stdout
    out = agentnb(tmp_path, "--workspace", "ws", "reply", "2", "2024", "--run")
    assert out.returncode == 0, out.stderr
    assert "job 2: succeeded" in out.stdout and "job 1: succeeded" in out.stdout
    statuses = dict(_db(tmp_path / "ws").execute("SELECT id, status FROM jobs").fetchall())
    assert statuses == {1: "succeeded", 2: "succeeded"}


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_output_to_a_closed_pipe_is_not_a_traceback(tmp_path: Path, buffered: bool) -> None:
    # buffered (a pipe, no PYTHONUNBUFFERED: a fresh machine's shell), the output may fail only when flushed at exit
    agentnb(tmp_path, "--workspace", "ws", "run", "--piece", "single", "--model", "demo", "Do it")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTNB_", "OPENAI_", "PYTHONUNBUFFERED"))}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen([AGENTNB, "--workspace", "ws", "show", "1", "--events"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # like `| head` that has already gone: every write fails
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


@pytest.mark.parametrize("text, line, problem", [
    ("responses:\n  - content: fine\n    tool_calls: [unclosed\n  - content: next\n", 4,
     "did not find expected ',' or ']' (while parsing a flow sequence)"),
    ("responses:\n  - content: \"never closed\n", 3, "found unexpected end of stream (while scanning a quoted scalar)"),
    ("responses: a: b\n", 1, "mapping values are not allowed"),
])
def test_a_scripted_file_that_is_not_yaml_is_one_line_with_its_position(
        tmp_path: Path, text: str, line: int, problem: str) -> None:
    import re

    from agentnb.models.base import ModelSpecError
    from agentnb.models.factory import resolve_model

    script = tmp_path / "broken.yaml"
    script.write_text(text, encoding="utf-8")
    out = agentnb(tmp_path, "--workspace", "ws", "run", "--piece", "single", "--model", "scripted:broken.yaml", "task")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    # file:line:column, as compilers say it (the column depends on the YAML parser: libyaml or PyYAML's own)
    assert re.fullmatch(rf"agentnb: error: {re.escape(str(script))}:{line}:\d+: not valid YAML: {re.escape(problem)}.*",
                        lines[0]), lines[0]
    with pytest.raises(ModelSpecError) as info:
        resolve_model(f"scripted:{script}")
    assert f"agentnb: error: {info.value}" == lines[0]
    assert _db(tmp_path / "ws").execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0


def test_reply_to_a_job_that_has_ended_exits_2_naming_its_status(tmp_path: Path) -> None:
    done = write_script(tmp_path, "done", responses=[transition("COMPLETE", "done")])
    assert agentnb(tmp_path, "--workspace", "ws", "run", "--piece", "single", "--model", done, "task").returncode == 0
    out = agentnb(tmp_path, "--workspace", "ws", "reply", "1", "More", "please")
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["agentnb: error: job 1 has ended (succeeded), so a reply would never be "
                                       "read; to go on, submit a new job"]
    assert _db(tmp_path / "ws").execute("SELECT COUNT(*) FROM comments").fetchone()[0] == 0

def test_run_on_openai_without_a_key_is_refused_at_submit(tmp_path: Path) -> None:
    out = agentnb(tmp_path, "run", "--workspace", "ws", "--piece", "single", "--model", "openai:gpt-4o-mini", "hi")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "openai:gpt-4o-mini needs OPENAI_API_KEY" in lines[0], out.stderr
    assert not (tmp_path / "ws" / "jobs" / "1").exists()
    if (tmp_path / "ws" / "agentnb.sqlite").exists():
        assert _db(tmp_path / "ws").execute("SELECT COUNT(*) FROM jobs").fetchone() == (0,)


# -- following a run (docs/cli.md#following-a-run) ----------------------------------------------------------------

def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTNB_", "OPENAI_"))}
    return {**env, **(extra or {})}


def _read_live(cwd: Path, *args: str, tty: bool = False,
               env: dict[str, str] | None = None) -> tuple[list[tuple[float, int]], str, float, int]:
    """Run ``agentnb`` with stdout a pipe (or a terminal: a pty) and read it as it comes: the time of each read
    with the characters read so far, the whole output, the exit time and the exit code."""
    import pty

    if tty:
        reader, writer = pty.openpty()
    else:
        reader, writer = os.pipe()
    proc = subprocess.Popen([AGENTNB, *args], cwd=cwd, env=_clean_env(env), stdout=writer, stderr=subprocess.PIPE)
    os.close(writer)
    reads: list[tuple[float, int]] = []
    data = b""
    while True:
        try:
            chunk = os.read(reader, 65536)
        except OSError:  # a pty whose other end closed
            break
        if not chunk:
            break
        data += chunk
        reads.append((time.monotonic(), len(data.decode("utf-8", "replace"))))
    os.close(reader)
    code = proc.wait(timeout=120)
    ended = time.monotonic()
    assert proc.stderr is not None
    assert code in (0, 1), proc.stderr.read().decode()
    text = data.decode("utf-8")
    return reads, text.replace("\r\n", "\n") if tty else text, ended, code


def _when(reads: list[tuple[float, int]], upto: int) -> float:
    """When the first ``upto`` characters of the output had been read."""
    return next(t for t, n in reads if n >= upto)


def _recorded_calls(ws: Path) -> list[dict[str, Any]]:
    rows = _db(ws).execute("SELECT payload FROM events WHERE kind='llm_response' ORDER BY id").fetchall()
    return [json.loads(p) for (p,) in rows]


def _printed_in_order(out: str, calls: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Where each recorded call's text and each of its tool calls (``→ NAME ARGUMENTS``, whose JSON parses to the
    recorded arguments) are in ``out``, found in order: (start, end) of each."""
    spans, at = [], 0
    for c in calls:
        if c["content"]:
            start = out.index(c["content"], at)
            at = start + len(c["content"])
            spans.append((start, at))
        for tc in c["tool_calls"]:
            start = out.index(f"→ {tc['name']} ", at)
            line_end = out.index("\n", start)
            assert json.loads(out[start + len(tc["name"]) + 3:line_end]) == tc["arguments"]
            spans.append((start, line_end))
            at = line_end
    return spans


def test_run_follow_prints_a_paced_demo_as_it_streams_then_the_jobs_lines(tmp_path: Path) -> None:
    reads, out, ended, code = _read_live(tmp_path, "--workspace", "ws", "run", "--follow", "--model", "demo?pace=0.01",
                                         "--piece", "plan-implement-verify", "Summarise the files in input/")
    assert code == 0
    calls = _recorded_calls(tmp_path / "ws")
    spans = _printed_in_order(out, calls)  # every call's text as recorded, every tool call with its arguments
    assert "\x1b" not in out  # a pipe gets plain text: no colours, no cursor movement
    assert [line for line in out.splitlines() if line.startswith("──")] == [
        "── 1. plan ──", "── 2. implement ──", "── 3. verify ──"]
    assert "  ← Write: Wrote " in out and "  ← Read: # Report … (" in out  # each result in one short line
    # the job's lines as without --follow, after a blank line
    followed, classic = out.split("\n\njob 1: succeeded  piece=plan-implement-verify model=demo?pace=0.01\n")
    assert followed.startswith("── 1. plan ──\n") and followed.endswith("  ← transition: Transition to COMPLETE recorded.")
    assert "   3. verify" in classic and "work directory:" in classic
    # as it streams: the first text well before the run ends, and the long Write call's arguments over many reads
    assert _when(reads, 1) < ended - 1.0
    (write,) = [(s, e) for s, e in spans if out.startswith("→ Write ", s)]
    began, done = _when(reads, write[0] + 20), _when(reads, write[1])
    assert done - began >= 0.1 and len([t for t, _ in reads if began <= t <= done]) >= 3, (began, done)


@pytest.mark.parametrize("chunk", [1, 4])
def test_run_follow_prints_a_scripted_stream_as_recorded_with_no_secret(tmp_path: Path, chunk: int) -> None:
    secret = "s3cr3t-value-7734"
    key = "sk-" + "a1" * 12
    text = f"The token is {secret}, the key {key}; Ünïcode — done."
    model = write_script(tmp_path, "script", responses=[
        {"content": text, "tool_calls": [{"name": "Write", "arguments": {
            "path": "out.md", "content": f"line one\n{secret}\nkey\n{key}\n"}}], "chunk": chunk},
        {**transition("COMPLETE", "wrote out.md"), "stream": True},
    ])
    _, out, _, code = _read_live(tmp_path, "--workspace", "ws", "run", "--follow", "--piece", "single",
                                 "--model", model, "task", env={"FOLLOW_API_KEY": secret})
    assert code == 0
    assert secret not in out and key not in out and "a1a1a1a1" not in out
    calls = _recorded_calls(tmp_path / "ws")
    assert calls[0]["content"] == "The token is ***, the key ***; Ünïcode — done."  # as the store masked it
    _printed_in_order(out, calls)
    assert "── 1. work ──\nThe token is ***, the key ***; Ünïcode — done.\n→ Write {" in out
    assert "  ← Write: Wrote " in out and "  ← transition: " in out


def test_run_follow_says_when_a_streamed_answer_broke_off_and_prints_the_next_try(tmp_path: Path) -> None:
    answer = reply("Looked around; all done.", [("transition", {"next_step": "COMPLETE", "summary": "done"})])
    with OpenAIServer(chunk_chars=4) as srv:
        srv.play(midway("reset", after=3, then=answer), answer)
        _, out, _, code = _read_live(tmp_path, "--workspace", "ws", "run", "--follow", "--piece", "single",
                                     "--model", "openai:m", "task", env=openai_env(srv, retries="2"))
    assert code == 0, out
    # (what the broken try streamed may not have been printed yet: the follower holds a fragment back a moment)
    broke, _, rest = out.partition("(the answer broke off; asked again)\n")
    assert broke.startswith("── 1. work ──\n") and rest.startswith("Looked around; all done.\n→ transition"), out
    assert out.count("Looked around; all done.") == 1  # the next try, printed afresh


def test_run_follow_prints_interleaved_parallel_calls_named_with_no_secret(tmp_path: Path) -> None:
    # parallel calls streamed interleaved, each name coming after the delta that opens its call: each call is
    # named, a call's line is not broken at every switch, and the secret in both is never printed, not in part
    secret = "Zq9SECRETvalueXYZ2024ab"
    calls = [("Write", {"path": f"{n}.md", "content": f"token {secret} in {n}"}) for n in ("one", "two")]
    answers = [reply(None, calls), reply("Wrote both.", [("transition", {"next_step": "COMPLETE", "summary": "ok"})])]
    with OpenAIServer(chunk_chars=3, name_split=0) as srv:
        srv.play(*answers)
        _, out, _, code = _read_live(tmp_path, "--workspace", "ws", "run", "--follow", "--piece", "single", "--model",
                                     "openai:m", "task", env={**openai_env(srv), "FOLLOW_API_KEY": secret})
    assert code == 0, out
    assert not any(secret[i:i + 3] in out for i in range(len(secret) - 2)), out
    followed = out.split("\n\njob 1:")[0]
    arrows = [line for line in followed.splitlines() if line.startswith("→")]
    # the first call until the second begins, the second whole, the rest of the first once the answer is recorded
    assert [line[:9] for line in arrows] == ["→ Write {", "→ Write {", "→ Write …", "→ transit"], followed
    first = arrows[0].removeprefix("→ Write ") + arrows[2].removeprefix("→ Write … ")
    assert json.loads(first) == {"path": "one.md", "content": "token *** in one"}
    assert json.loads(arrows[1].removeprefix("→ Write ")) == {"path": "two.md", "content": "token *** in two"}


def test_run_follows_by_default_on_a_terminal_and_a_worker_stays_quiet(tmp_path: Path) -> None:
    model = write_script(tmp_path, "script", responses=[
        {"content": "Looking.", "tool_calls": [{"name": "Glob", "arguments": {"pattern": "*"}}], "chunk": 3},
        {**transition("COMPLETE", "done"), "stream": True},
    ])
    _, out, _, _ = _read_live(tmp_path, "--workspace", "ws", "run", "--piece", "single", "--model", model, "task",
                              tty=True, env={"NO_COLOR": "1"})
    assert out.startswith('── 1. work ──\nLooking.\n→ Glob {"pattern": "*"}\n  ← Glob: ')
    assert "\n\njob 1: succeeded" in out and "\x1b" not in out  # NO_COLOR: no colours either
    _, out, _, _ = _read_live(tmp_path, "--workspace", "ws", "run", "--piece", "single", "--model", model, "task",
                              tty=True)
    assert out.startswith("\x1b[1m── 1. work ──\x1b[0m\n")
    _, out, _, _ = _read_live(tmp_path, "--workspace", "ws", "run", "--no-follow", "--piece", "single", "--model",
                              model, "task", tty=True)
    assert out.startswith("job 3: succeeded")
    # a worker prints only its own line, on a terminal too
    for tty in (True, False):
        queued = agentnb(tmp_path, "--workspace", "ws", "run", "--detach", "--piece", "single", "--model", model, "t")
        assert queued.returncode == 0, queued.stderr
        _, out, _, _ = _read_live(tmp_path, "--workspace", "ws", "worker", tty=tty)
        assert out == "ran 1 job(s)\n"
    statuses = [s for (s,) in _db(tmp_path / "ws").execute("SELECT status FROM jobs ORDER BY id")]
    assert statuses == ["succeeded"] * 5


class _Writes(io.StringIO):
    """An output that keeps each write apart."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def test_a_secret_split_across_streamed_pieces_is_never_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentnb import Workspace, live
    from agentnb.follow import Follower

    secret, quoted = "s3cr3t-value-7734", 'q"uoted-secret-42'  # JSON writes the second one otherwise: q\"uoted…
    monkeypatch.setenv("FOLLOW_API_KEY", secret)
    monkeypatch.setenv("FOLLOW_TOKEN", quoted)
    key = "sk-" + "a1" * 12
    text = f"The token is {secret}, the key {key} and Bearer abcdefgh12345678xyz; done."
    model = write_script(tmp_path, "script", responses=[
        {"content": text, "tool_calls": [{"name": "Write", "arguments": {
            "path": "out.md", "content": f"{quoted}\n{key}"}}], "chunk": 1},  # a key after a JSON escape: \nsk-…
        transition("COMPLETE", "done"),
    ])
    ws = Workspace(tmp_path / "ws")
    job = ws.submit("task", piece="single", model=model)
    out = _Writes()
    # a watcher that takes its time on each piece (it runs in the job's thread): the stream is drawn in many writes
    slow = live.subscribe(ws.store, job.id, lambda item: time.sleep(0.006) if isinstance(item, live.Notice) else None)
    try:
        with Follower(ws.execution, out, job_id=job.id):
            ws.run(job)
    finally:
        slow.close()
        ws.close()
    printed = out.getvalue()
    assert secret[:6] not in printed and "uoted-" not in printed and key[:8] not in printed
    assert "abcdefgh" not in printed
    assert "The token is ***, the key *** and Bearer ***; done.\n" in printed
    assert '→ Write {"path": "out.md", "content": "***\\n***"}\n' in printed
    # it was printed as it streamed, in many writes
    so_far = ["".join(out.writes[:i + 1]) for i in range(len(out.writes))]
    first = next(i for i, w in enumerate(so_far) if "The " in w)
    last = next(i for i, w in enumerate(so_far) if "done." in w)
    assert last - first >= 3, out.writes
