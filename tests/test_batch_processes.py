"""A batch run by several worker processes (``processes=N``; docs/design-lab.md#processes), on real SQLite files
and a real PostgreSQL server: the same jobs and frames as one process, nothing run twice, a killed worker's jobs
taken over, Ctrl-C then resume from a terminal, and a 429 that one process gets slowing them all."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, transition, write_piece, write_script
from IPython.core.error import UsageError as IPythonUsageError
from openai_server import OpenAIServer, error, openai_env, reply

from agentnb import Workspace
from agentnb.errors import AgentnbError, UsageError
from agentnb.processes import PER_PROCESS, processes_for

ROOT = Path(__file__).resolve().parents[1]

ONE_WRITE = {"max_movements": 2, "movements": [
    {"name": "work", "persona": "p", "instruction": "Write the answer.", "tools": ["Write"],
     "permission": "edit", "rules": [{"condition": "done", "next": "COMPLETE"}]}]}


def _claims(ws: Workspace, job: Any) -> int:
    return sum(1 for e in ws.events(job, kinds=["job_status"]) if getattr(e, "status", None) == "running")


_CLAIMED_BY = re.compile(r"^claimed by [^:]*:(\d+):")


def _claimers(ws: Workspace, jobs: Any = None) -> set[int]:
    """The pids of the processes that claimed ``jobs`` (None: every job), read from their claims."""
    pids = set()
    for j in ws.jobs() if jobs is None else jobs:
        for e in ws.events(j, kinds=["job_status"]):
            m = _CLAIMED_BY.match(getattr(e, "reason", None) or "")
            if getattr(e, "status", None) == "running" and m:
                pids.add(int(m.group(1)))
    return pids


def _alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_a_batch_in_processes_runs_every_job_once_with_the_frame_of_one_process(
        store_url: str, tmp_path: Path) -> None:
    script = write_script(tmp_path, "w", responses=[
        call("Write", path="output/answer.txt", content="42"), transition("COMPLETE")])
    piece = str(write_piece(tmp_path, "one-write", ONE_WRITE))
    cases = [{"instruction": f"Answer question {i}", "expected": "42"} for i in range(200)]
    scored_in: set[int] = set()

    def right(job: Any) -> bool:  # a notebook function: it runs in the batch's own process
        scored_in.add(os.getpid())
        return (job.output / "answer.txt").read_text() == job.expected

    ws = Workspace(tmp_path / "ws", store=store_url)
    try:
        one = ws.batch(cases, piece=piece, model=script, name="one", concurrency=6, processes=1, progress=False,
                       scorers={"right": right})
        assert one.last_run.processes == 1
        reference = one.frame.drop(columns=["job", "seconds"])
        kinds = {j.case: [e.kind for e in ws.events(j)] for j in one.jobs}
        for n in (2, 3):
            b = ws.batch(cases, piece=piece, model=script, name=f"in-{n}", concurrency=6, processes=n,
                         progress=False, scorers={"right": right})
            assert b.last_run.processes == n
            assert 0 < b.last_run.worker_cpu_s < 600  # each worker reported the CPU it used
            assert b.counts()["succeeded"] == b.counts()["jobs"] == 200
            assert sorted(b.last_run.statuses) == sorted(j.id for j in b.jobs)
            frame = b.frame
            assert frame["right"].all()
            assert frame.drop(columns=["job", "seconds"]).equals(reference), n
            for j in b.jobs:
                assert _claims(ws, j) == 1  # claimed once: nothing ran twice
                assert [e.kind for e in ws.events(j)] == kinds[j.case]  # one ordered stream, as in one process
                ids = [e.id for e in ws.events(j)]
                assert ids == sorted(ids)
        assert scored_in == {os.getpid()}
    finally:
        ws.close()


def test_a_relative_store_file_is_the_workers_store_after_a_change_of_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = write_script(tmp_path, "w", responses=[
        call("Write", path="output/answer.txt", content="42"), transition("COMPLETE")])
    piece = str(write_piece(tmp_path, "one-write", ONE_WRITE))
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(here)
    with Workspace(tmp_path / "ws", store="rel.sqlite") as ws:
        monkeypatch.chdir(elsewhere)
        b = ws.batch([{"instruction": f"Answer {i}"} for i in range(4)], piece=piece, model=script, concurrency=2,
                     processes=2, progress=False)
        assert b.counts()["succeeded"] == 4
    assert not (elsewhere / "rel.sqlite").exists()
    with Workspace(tmp_path / "ws", store=str(here / "rel.sqlite")) as ws:
        assert len(ws.jobs("succeeded")) == 4


def test_processes_are_checked_and_chosen_from_the_cores(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(UsageError, match=r"^processes=.*; allowed: a whole number ≥ 1"):
            ws.batch([{"instruction": "x"}], processes=bad, progress=False)
    assert ws.batches() == []  # nothing created
    monkeypatch.delenv("AGENTNB_PROCESSES", raising=False)
    assert processes_for(None, 4, 100, (), cores=8) == (1, "")
    assert processes_for(None, PER_PROCESS, 100, (), cores=8) == (1, "")
    assert processes_for(None, 2 * PER_PROCESS, 500, (), cores=8) == (2, "")
    assert processes_for(None, 8 * PER_PROCESS, 900, (), cores=4) == (3, "")  # never more than the cores but one
    assert processes_for(None, 4 * PER_PROCESS, 900, (), cores=2) == (1, "")
    assert processes_for(None, 4 * PER_PROCESS, 1, (), cores=8) == (1, "")  # nor than the jobs
    assert processes_for(3, 2, 100, (), cores=8) == (2, "")  # nor than the concurrency
    monkeypatch.setenv("AGENTNB_PROCESSES", "3")
    assert processes_for(None, 8, 100, (), cores=8) == (3, "")
    monkeypatch.setenv("AGENTNB_PROCESSES", "many")
    with pytest.raises(UsageError, match="AGENTNB_PROCESSES='many'; allowed"):
        processes_for(None, 8, 100, ())
    for bad in ("many", "0", "-1", "1.5"):  # the variable is refused before the batch is written, too
        monkeypatch.setenv("AGENTNB_PROCESSES", bad)
        with pytest.raises(UsageError, match=rf"^AGENTNB_PROCESSES='{re.escape(bad)}'; allowed"):
            ws.batch([{"instruction": "x"}], progress=False)
    assert ws.batches() == [] and ws.jobs() == []


def test_a_tool_defined_in_the_notebook_keeps_the_batch_in_one_process(ws: Workspace, tmp_path: Path) -> None:
    import agentnb
    from agentnb.tools.base import unregister

    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec("import agentnb\n@agentnb.tool\ndef shout(text: str) -> str:\n    'Shout.'\n    return text.upper()\n",
         namespace)  # as a notebook cell defines it: in __main__, which has no file
    try:
        main = sys.modules["__main__"]
        had_file = getattr(main, "__file__", None)
        if had_file is not None:
            del main.__file__
        try:
            assert processes_for(None, 4 * PER_PROCESS, 900, ["shout"], cores=4) == (1, "tool(s) shout defined in the notebook")
            with pytest.raises(UsageError, match=r"^processes=2: the tool\(s\) shout are defined in this notebook"):
                processes_for(2, 64, 100, ["shout", "Write"], cores=4)
            assert processes_for(2, 64, 100, ["Write"], cores=4) == (2, "")  # a built-in is everywhere
            # asked of a batch: refused before the batch and its jobs are written
            piece = str(write_piece(tmp_path, "shouting", {"movements": [
                {"name": "work", "instruction": "Shout.", "tools": ["shout"], "rules": [{"next": "COMPLETE"}]}]}))
            with pytest.raises(UsageError, match=r"^processes=2: the tool\(s\) shout are defined in this notebook"):
                ws.batch([{"instruction": f"x{i}"} for i in range(4)], piece=piece, processes=2, progress=False)
            assert ws.batches() == [] and ws.jobs() == []
            # a script read from stdin has no file to run again either
            main.__file__ = "<stdin>"
            assert processes_for(None, 4 * PER_PROCESS, 900, ["shout"], cores=4)[0] == 1
        finally:
            if had_file is not None:
                main.__file__ = had_file
    finally:
        unregister("shout")
    assert agentnb


def _one_write_responder(body: dict[str, Any]) -> dict[str, Any]:
    """A Write, then (once its result is in the conversation) the transition."""
    if any(m.get("role") == "tool" for m in body["messages"]):
        return reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "done"})])
    return reply(tool_calls=[("Write", {"path": "output/a.txt", "content": "x"})])


def test_a_killed_worker_process_s_jobs_are_taken_over_and_the_batch_completes(
        loopback: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    server = loopback(latency=0.15, responder=_one_write_responder)
    piece = str(write_piece(tmp_path, "one-write", ONE_WRITE))
    ws = Workspace(tmp_path / "ws")
    cases = [{"instruction": f"task {i}"} for i in range(40)]
    ws.batch(cases, piece=piece, model="openai:m", name="k", run=False)
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["batch"] = ws.batch("k", concurrency=4, processes=2, progress=False)
        except BaseException as exc:  # pragma: no cover - shown by the assertion below
            result["error"] = exc

    runner = threading.Thread(target=run)
    runner.start()
    deadline = time.monotonic() + 60
    while len(server.log) < 12:  # a few waves in: every worker holds jobs
        assert time.monotonic() < deadline and runner.is_alive(), result
        time.sleep(0.02)
    running = [j for j in ws.jobs() if str(j.status) == "running"]
    workers = _claimers(ws, running)
    assert len(workers) == 2 and os.getpid() not in workers  # the jobs run in two other processes
    os.kill(min(workers), signal.SIGKILL)
    runner.join(120)
    assert not runner.is_alive() and "error" not in result, result
    b = result["batch"]
    assert b.counts()["succeeded"] == b.counts()["jobs"] == 40
    err = capfd.readouterr().err
    assert re.search(r"agentnb: a worker process of the batch ended \(exit code -9\) with \d job\(s\) in hand; "
                     r"a new one takes them over", err), err
    taken_over = 0
    for j in b.jobs:
        # a Write is never run twice: one cut off by the kill is a tool error the model sees, not a second run
        assert [e.tool for e in ws.events(j, kinds=["tool_call", "tool_result"])] == ["Write", "Write", "transition", "transition"]
        taken_over += _claims(ws, j) == 2
        assert _claims(ws, j) in (1, 2)
    assert taken_over >= 1
    ws.close()


def test_ctrl_c_reaches_a_worker_process_that_was_already_handed_its_last_jobs(tmp_path: Path) -> None:
    # six jobs for two workers at four at once: each is handed all of its jobs at the start (and told that is
    # all); a Ctrl-C must still pause theirs, and the one each holds must not start
    ws = Workspace(tmp_path / "ws")
    running = threading.Event()
    signalled: list[float] = []

    def interrupt() -> None:
        while sum(1 for j in ws.jobs() if j.status == "running") < 4:
            time.sleep(0.02)
        if running.is_set():  # (never once the batch has returned)
            signalled.append(time.time())
            os.kill(os.getpid(), signal.SIGINT)

    running.set()
    threading.Thread(target=interrupt, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ws.batch([{"instruction": f"Summarise case {i}"} for i in range(6)], piece="plan-implement-verify",
                     model="demo?pace=0.01", name="late", concurrency=4, processes=2, progress=False)
    finally:
        running.clear()
    assert signalled and [j.status for j in ws.jobs()] == ["queued"] * 6
    claims = [e.ts for j in ws.jobs() for e in ws.events(j, kinds=["job_status"]) if e.status == "running"]
    assert len(claims) == 4 and max(claims) < signalled[0]  # the two held back never started
    b = ws.batch("late", progress=False)
    assert b.counts()["succeeded"] == 6


@pytest.mark.parametrize("ended", [18, 24], ids=["jobs-running", "all-jobs-ended"])
def test_ctrl_c_does_not_wait_for_the_scorers_not_started_and_the_resume_scores_their_jobs(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], ended: int) -> None:
    # the scorers run in this process as the workers' jobs end; a slow one (an LLM judge, say) must neither hold
    # a Ctrl-C up until every ended job is scored nor go on scoring after the batch returned, whether the Ctrl-C
    # comes while jobs run or once they all have ended and only scorers are left
    script = write_script(tmp_path, "w", responses=[
        call("Write", path="output/answer.txt", content="42"), transition("COMPLETE")])
    piece = str(write_piece(tmp_path, "one-write", ONE_WRITE))
    cases = [{"instruction": f"Answer question {i}"} for i in range(24)]
    scores: Counter[int] = Counter()
    first, resumed = threading.Event(), threading.Event()
    at_signal: list[int] = []

    def slow(job: Any) -> bool:
        first.set()
        time.sleep(0 if resumed.is_set() else 1.0)
        scores[job.id] += 1
        return True

    ws = Workspace(tmp_path / "ws")

    def interrupt() -> None:  # once that many jobs have ended, their scorers queued behind the first four
        first.wait(60)
        while sum(1 for j in ws.jobs() if j.status == "succeeded") < ended:
            time.sleep(0.05)
        if ended == len(cases):  # the worker processes gone too: the batch only waits for its scorers now
            while multiprocessing.active_children():
                time.sleep(0.05)
            time.sleep(0.3)
        at_signal.append(sum(scores.values()))
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        ws.batch(cases, piece=piece, model=script, name="judged", concurrency=4, processes=2, progress=False,
                 scorers={"slow": slow})
    assert not [t for t in threading.enumerate() if t.name.startswith("agentnb-score") and t.is_alive()]
    assert "resume with" in capfd.readouterr().err
    # only those already running were waited for (four at once: as many as jobs run)
    assert sum(scores.values()) <= at_signal[0] + 4 < 24, (at_signal, scores)
    resumed.set()
    b = ws.batch("judged", scorers={"slow": slow}, progress=False)
    assert b.counts()["succeeded"] == 24 and set(scores) == {j.id for j in b.jobs} and set(scores.values()) == {1}


def test_a_ctrl_c_while_the_batch_waits_for_a_scorer_waits_for_it_still_and_the_resume_scores_no_job_again(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # every job has ended and the worker processes are gone: the batch's process is waiting for the one scorer
    # still running when the Ctrl-C comes.  It must not return before that scorer has written its score (a Ctrl-C
    # inside Thread.join on Python < 3.13 marks the thread joined as ended though it runs on: the batch returned,
    # the score came after, and the resume, finding none, scored the job again)
    script = write_script(tmp_path, "w", responses=[
        call("Write", path="output/answer.txt", content="42"), transition("COMPLETE")])
    piece = str(write_piece(tmp_path, "one-write", ONE_WRITE))
    scores: Counter[int] = Counter()
    held, signalled = threading.Event(), threading.Event()
    slow: list[int] = []

    def judge(job: Any) -> bool:
        if not slow:  # the first job scored is held until well after the Ctrl-C; the others are scored at once
            slow.append(job.id)
            held.set()
            signalled.wait(60)
            time.sleep(0.5)
        scores[job.id] += 1
        return True

    ws = Workspace(tmp_path / "ws")

    def interrupt() -> None:
        held.wait(60)
        while sum(1 for j in ws.jobs() if j.status == "succeeded") < 6 or multiprocessing.active_children():
            time.sleep(0.05)
        time.sleep(0.3)  # the batch is waiting for its scorers now
        os.kill(os.getpid(), signal.SIGINT)
        signalled.set()

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        ws.batch([{"instruction": f"Answer question {i}"} for i in range(6)], piece=piece, model=script,
                 name="judged", concurrency=2, processes=2, progress=False, scorers={"slow": judge})
    assert signalled.is_set() and scores[slow[0]] == 1  # the batch waited for the scorer running at the Ctrl-C
    assert len(ws.events(slow[0], kinds=["score"])) == 1
    assert "waiting for the scorers already running" in capfd.readouterr().err
    b = ws.batch("judged", scorers={"slow": judge}, progress=False)
    assert b.counts()["succeeded"] == 6 and set(scores) == {j.id for j in b.jobs} and set(scores.values()) == {1}


_CTRL_C_IN = """
import os, signal, sys, traceback
from agentnb import Workspace

fired = []


def at(frame, event, arg):  # a Ctrl-C that lands at the chosen point of the batch's own process
    if event == {event!r} and not fired and frame.f_code.co_name == {point!r} \\
            and frame.f_code.co_filename.endswith({where!r}) and ({when}):
        fired.append([f.name for f in traceback.extract_stack(frame)])
        os.kill(os.getpid(), signal.SIGINT)


ws = Workspace("ws")
sys.setprofile(at)
try:
    ws.batch([{{"instruction": f"t{{i}}"}} for i in range(8)], piece={piece!r}, model={model!r}, name="b",
             concurrency=4, processes=2, progress=False)
except KeyboardInterrupt:
    print("interrupted")
finally:
    sys.setprofile(None)
print("fired in", fired[0][-2])
"""

_AT = {  # the event, the function, its module, and which of its calls
    "taking-a-child-s-end": ("call", "join", os.path.join("multiprocessing", "process.py"), "True"),
    # the message just taken from the queue: a job's end
    "taking-a-job-s-end": ("return", "_get", "queue.py", "isinstance(arg, tuple) and 'ended' in (arg[1] or {})"),
}


@pytest.mark.parametrize("at", list(_AT))
def test_a_ctrl_c_while_the_batch_takes_a_message_from_its_workers_loses_none(tmp_path: Path, at: str) -> None:
    # a Ctrl-C that cut the batch's process between taking a worker's message and acting on it lost the message:
    # a job's end lost was counted as not finished; a worker's end lost was waited for for ever
    script = write_script(tmp_path, "w", responses=[
        call("Write", path="output/answer.txt", content="42"), transition("COMPLETE")])
    piece = str(write_piece(tmp_path, "one-write", ONE_WRITE))
    event, point, where, when = _AT[at]
    (tmp_path / "run.py").write_text(_CTRL_C_IN.format(event=event, point=point, where=where, when=when,
                                                       piece=piece, model=script), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["interrupted", f"fired in {'handle' if point == 'join' else 'get'}"]
    ws = Workspace(tmp_path / "ws")
    m = re.search(r"agentnb: interrupted: \d+ running job\(s\) paused, (\d+) not finished", out.stderr)
    assert m, out.stderr
    assert int(m.group(1)) == sum(1 for j in ws.jobs() if str(j.status) != "succeeded"), out.stderr
    b = ws.batch("b", progress=False)
    assert b.counts()["succeeded"] == 8
    for j in b.jobs:  # none run twice
        assert [e.tool for e in ws.events(j, kinds=["tool_call"])] == ["Write", "transition"]
    ws.close()


FORKING_TOOL_MODULE = """
import os, time, warnings
import agentnb


@agentnb.tool
def fork_and_die(text: str) -> str:
    \"\"\"Once in the batch: leave a process of our own holding this worker's files open, and die.\"\"\"
    try:
        fd = os.open(os.environ["FORK_MARK"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return text
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pid = os.fork()
    if pid == 0:
        time.sleep(90)
        os._exit(0)
    os.write(fd, str(pid).encode())
    os.close(fd)
    os._exit(3)
"""


def test_a_worker_process_that_dies_while_a_process_it_forked_holds_its_pipe_is_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    # the end of a worker's messages never comes while a process it forked holds its end of the pipe: the batch
    # sees the worker's process gone instead
    name = f"forking_tool_{os.getpid()}"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"{name}.py").write_text(FORKING_TOOL_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    mark = tmp_path / "forked.pid"
    monkeypatch.setenv("FORK_MARK", str(mark))
    import importlib

    from agentnb.tools.base import unregister

    importlib.import_module(name)
    script = write_script(tmp_path, "s", responses=[call("fork_and_die", text="hi"), transition("COMPLETE")])
    piece = write_piece(tmp_path, "forking", {"movements": [
        {"name": "work", "persona": "p", "instruction": "i", "tools": ["fork_and_die"], "permission": "readonly",
         "rules": [{"condition": "done", "next": "COMPLETE"}]}]})
    ws = Workspace(tmp_path / "ws")
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["batch"] = ws.batch([{"instruction": f"t{i}"} for i in range(6)], piece=str(piece), model=script,
                                       concurrency=2, processes=2, name="forking", progress=False)
        except BaseException as exc:  # pragma: no cover - shown by the assertion below
            result["error"] = exc

    runner = threading.Thread(target=run)
    runner.start()
    try:
        runner.join(45)
        assert not runner.is_alive() and "error" not in result, result
        assert result["batch"].counts()["succeeded"] == 6
        assert "a worker process of the batch ended (exit code 3) with" in capfd.readouterr().err
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(mark.read_text()), signal.SIGKILL)
        runner.join()
        unregister("fork_and_die")
        sys.modules.pop(name, None)
        ws.close()


def test_a_worker_process_that_cannot_start_says_why_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    # the batch's tool module is gone from disk once this process has imported it: the workers cannot import it
    import importlib

    name = f"vanishing_tool_{os.getpid()}"
    module = tmp_path / "mods" / f"{name}.py"
    module.parent.mkdir()
    module.write_text(f"import agentnb\n\n@agentnb.tool\ndef {name}(text: str) -> str:\n"
                      f"    \"\"\"Shout.\n\n    Args:\n        text: what\n    \"\"\"\n    return text.upper()\n")
    monkeypatch.syspath_prepend(str(module.parent))
    importlib.import_module(name)
    module.unlink()
    piece = write_piece(tmp_path, "p", {**ONE_WRITE, "movements": [{**ONE_WRITE["movements"][0],
                                                                      "tools": ["Write", name]}]})
    script = write_script(tmp_path, "w", responses=[transition("COMPLETE")])
    ws = Workspace(tmp_path / "ws")
    with pytest.raises(AgentnbError, match=r"could not start .*ModuleNotFoundError"):
        ws.batch([{"instruction": f"t{i}"} for i in range(4)], piece=str(piece), model=script, name="bad",
                 concurrency=2, processes=2, progress=False)
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "could not start" in line]
    assert 1 <= len(lines) <= 2 and all(f"No module named '{name}'" in line for line in lines), err


def test_ctrl_c_in_a_terminal_pauses_every_process_s_jobs_and_the_same_command_resumes(tmp_path: Path) -> None:
    agentnb = ROOT / "agentnb"
    assert agentnb.is_dir()
    piece = write_piece(tmp_path, "one-write", ONE_WRITE)
    n = 24
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"instruction": f"task {i}"}) + "\n" for i in range(n)))
    argv = [sys.executable, "-m", "agentnb.cli", "--workspace", "ws", "batch", "c.jsonl", "--piece", str(piece),
            "--model", "openai:m", "--concurrency", "4", "--processes", "2", "--name", "slow", "--no-progress"]
    with OpenAIServer(latency=0.2, responder=_one_write_responder) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTNB_STORE", "OPENAI_"))}
        env.update(openai_env(server), PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        # a terminal's Ctrl-C goes to the whole process group: the batch's process and its workers
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        deadline = time.monotonic() + 60
        while len(server.log) < 10:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the batch never got going"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 130, (stdout, stderr)
        [said] = [line for line in stderr.splitlines() if "interrupted" in line]
        assert re.fullmatch(r"agentnb: interrupted: \d+ running job\(s\) paused, \d+ not finished; resume with the "
                            r"same command again \(batch 'slow'\)", said), stderr
        ws = Workspace(tmp_path / "ws", readonly=True)
        first = {j.id: str(j.status) for j in ws.jobs()}
        assert set(first.values()) <= {"succeeded", "queued"} and "queued" in first.values()  # none left running
        workers = _claimers(ws)
        assert len(workers) == 2 and proc.pid not in workers
        assert not [pid for pid in workers if _alive(pid)]  # the workers are gone with the batch's process
        out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"<Batch 'slow': {n}/{n} ended · {n} succeeded>")
    ws = Workspace(tmp_path / "ws", readonly=True)
    for j in ws.jobs():
        assert [e.tool for e in ws.events(j, kinds=["tool_call", "tool_result"])] == ["Write", "Write", "transition", "transition"]
    # every call the endpoint received was recorded; a recorded one it never received was cut off by the Ctrl-C
    # between its commit and its sending, and says so ("stopped before its answer began"), asked again on resume
    requests = sum(len(ws.events(j, kinds=["llm_request"])) for j in ws.jobs())
    unsent = sum(1 for j in ws.jobs() for e in ws.events(j, kinds=["error"])
                 if e.payload["where"] == "interrupted" and "before its answer began" in e.payload["message"])
    assert requests - unsent <= len(server.received) <= requests


def test_a_429_one_process_gets_pauses_the_calls_of_every_process(loopback: Any, tmp_path: Path) -> None:
    arrived: list[float] = []

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        arrived.append(time.monotonic())
        time.sleep(0.3)  # answered after the 429, which goes out at once: the word of it has time to spread
        return reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "done"})])

    # the first four calls (two per process) are held until all are in flight, so both processes are running;
    # then one of them gets a 429 asking for 1.5 s at once, and the other three their answer 0.3 s later (the 429
    # travels from one worker through the batch's process to the other: a few ms, tens on a loaded machine)
    server = loopback(responder=answer, gather=4, backoff="0.01")
    server.play(*error(429, "slow down", headers={"retry-after": "1.5"}))
    piece = write_piece(tmp_path, "talk", {"max_movements": 2, "movements": [
        {"name": "work", "persona": "p", "instruction": "i", "tools": [], "permission": "readonly",
         "rules": [{"condition": "done", "next": "COMPLETE"}]}]})
    ws = Workspace(tmp_path / "ws", max_backoff=5.0)
    b = ws.batch([{"instruction": f"t{i}"} for i in range(12)], piece=str(piece), model="openai:m", concurrency=4,
                 processes=2, progress=False)
    assert b.counts()["succeeded"] == b.counts()["jobs"] == 12
    assert Counter(a.status for a in server.log) == {200: 12, 429: 1}
    first_wave = sorted(arrived)[:3]
    later = sorted(arrived)[3:]
    # the three answered calls' jobs end and new jobs start in both processes: none of them calls before the
    # pause the 429 asked for is (nearly) over, in the process that got it or in the other one
    assert later and min(later) - max(first_wave) > 1.2, [round(t - first_wave[0], 2) for t in arrived]
    ws.close()


def _one_write_priced(body: dict[str, Any]) -> dict[str, Any]:
    """:func:`_one_write_responder` with a priced usage: about $0.0156 a call on gpt-4o-mini."""
    answer = _one_write_responder(body)
    answer["usage"] = (100_000, 1_000)
    return answer


def test_a_batch_cost_limit_pauses_every_process(loopback: Any, tmp_path: Path,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    from agentnb.models.prices import call_cost

    loopback(latency=0.05, responder=_one_write_priced)
    one = call_cost("openai:gpt-4o-mini", 100_000, 1_000)
    assert one is not None
    ws = Workspace(tmp_path / "ws")
    cases = [{"instruction": f"case {i}"} for i in range(30)]
    b = ws.batch(cases, piece=str(write_piece(tmp_path, "one-write", ONE_WRITE)), model="openai:gpt-4o-mini",
                 concurrency=4, processes=2, cost_limit=0.2, name="capped", progress=False)
    frame = b.frame
    spent = float(frame["cost_usd"].sum())
    # reached; past it, at most the calls in flight in every process and those of the second it takes this
    # process to read the others' spending from the store
    assert 0.2 <= spent <= 0.2 + 12 * one
    assert set(frame["status"]) <= {"succeeded", "queued"} and (frame["status"] == "queued").any()
    assert re.search(r"agentnb: batch capped: cost limit reached: \$0\.\d+ of \$0\.20: \d+ running job\(s\) paused, "
                     r"\d+ not finished; resume with ws\.batch\('capped', cost_limit=HIGHER\)", capfd.readouterr().err)
    done = ws.batch("capped", cost_limit=5.0, concurrency=4, processes=2, progress=False)
    assert done.frame["status"].tolist() == ["succeeded"] * 30
    assert done.frame["cost_usd"].sum() == pytest.approx(60 * one)  # no call made twice
    ws.close()


TOOL_MODULE = '''
import sys
import agentnb

@agentnb.tool
def stamp(text: str) -> str:
    """Stamp the text with the process that ran the tool."""
    print(f"stamping {text} in a worker", file=sys.stderr)
    import os
    return f"{text} by {os.getpid()}"
'''


def test_a_tool_from_a_module_runs_in_the_workers_whose_lines_show_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "stamping.py").write_text(TOOL_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))  # as a notebook next to its module finds it
    import importlib

    from agentnb.tools.base import unregister

    importlib.import_module("stamping")
    try:
        script = write_script(tmp_path, "s", responses=[call("stamp", text="hello"), transition("COMPLETE")])
        piece = write_piece(tmp_path, "stamp", {"movements": [
            {"name": "work", "persona": "p", "instruction": "i", "tools": ["stamp"], "permission": "readonly",
             "rules": [{"condition": "done", "next": "COMPLETE"}]}]})
        ws = Workspace(tmp_path / "ws")
        b = ws.batch([{"instruction": f"t{i}"} for i in range(12)], piece=str(piece), model=script, concurrency=4,
                     processes=2, name="stamped")
        assert b.counts()["succeeded"] == 12
        results = [e.content for j in b.jobs for e in ws.events(j, kinds=["tool_result"]) if e.tool == "stamp"]
        pids = {int(r.rsplit(" ", 1)[1]) for r in results}
        assert len(results) == 12 and os.getpid() not in pids and 1 <= len(pids) <= 2
        err = capfd.readouterr().err
        assert err.count("stamping hello in a worker") == 12  # each worker's stderr lines, shown here
        assert "batch stamped · 12/12 · 12 ok" in err  # the bar counted every process's jobs
        ws.close()
    finally:
        unregister("stamp")
        sys.modules.pop("stamping", None)


def test_a_script_without_a_main_guard_runs_its_batch_once(tmp_path: Path) -> None:
    """The workers never import the calling script: one with no ``if __name__ == "__main__"`` runs once."""
    script = write_script(tmp_path, "s", responses=[call("Write", path="output/a.txt", content="x"),
                                                    transition("COMPLETE")])
    piece = write_piece(tmp_path, "one-write", ONE_WRITE)
    (tmp_path / "run.py").write_text(
        "from agentnb import Workspace\n"
        "print('script started')\n"
        f"b = Workspace('ws').batch([{{'instruction': f't{{i}}'}} for i in range(10)], piece={str(piece)!r}, "
        f"model={script!r}, concurrency=4, processes=2, progress=False)\n"
        "print(b.counts()['succeeded'], b.last_run.processes)\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["script started", "10 2"]


def test_a_script_whose_tool_the_workers_import_must_guard_its_main_code(tmp_path: Path) -> None:
    """A tool defined in the running script: the workers run the script for it, so unguarded code that starts a
    batch would start batches inside the batch; it is refused there, in one line, and the batch runs once."""
    script = write_script(tmp_path, "s", responses=[call("stamp", text="hi"), transition("COMPLETE")])
    piece = write_piece(tmp_path, "stamp", {"movements": [
        {"name": "work", "persona": "p", "instruction": "i", "tools": ["stamp"], "permission": "readonly",
         "rules": [{"condition": "done", "next": "COMPLETE"}]}]})
    (tmp_path / "run.py").write_text(TOOL_MODULE + (
        "from agentnb import Workspace\n"
        f"b = Workspace('ws').batch([{{'instruction': f't{{i}}'}} for i in range(6)], piece={str(piece)!r}, "
        f"model={script!r}, concurrency=4, processes=2, progress=False, name='once')\n"
        "print(b.counts()['succeeded'])\n"), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    last = out.stderr.strip().splitlines()[-1]
    assert "ws.batch was called while a batch's worker process imported this script for its tools; put the " \
           "script's own code under `if __name__ == \"__main__\":`" in last, out.stderr
    with Workspace(tmp_path / "ws") as ws:  # the batch of the script's own run, nothing nested
        assert [x["name"] for x in ws.batches()] == ["once"] and len(ws.jobs()) == 6


def test_the_magic_runs_a_batch_in_processes_and_scores_with_the_notebook_s_functions(
        shell: Any, tmp_path: Path) -> None:
    shell.user_ns["t_cases"] = [{"instruction": f"Answer {i}", "expected": "42"} for i in range(8)]
    shell.user_ns["t_spec"] = write_script(tmp_path, "w", responses=[
        call("Write", path="output/answer.txt", content="42"), transition("COMPLETE")])
    shell.user_ns["t_piece"] = str(write_piece(tmp_path, "one-write", ONE_WRITE))
    shell.user_ns["t_right"] = lambda job: (job.output / "answer.txt").read_text() == job.expected
    b = shell.run_line_magic("agent", "batch t_cases --piece {t_piece} --model {t_spec} --concurrency 4 "
                                      "--processes 2 --name nb --scorer t_right")
    assert b.last_run.processes == 2 and b.counts()["succeeded"] == 8
    assert b.frame["t_right"].tolist() == [True] * 8  # a lambda of the notebook's, run in the kernel
    with pytest.raises(IPythonUsageError, match=r"^%agent batch: --processes 0; allowed: a whole number ≥ 1"):
        shell.run_line_magic("agent", "batch t_cases --piece {t_piece} --model {t_spec} --processes 0 --name nb2")
    assert [x["name"] for x in b.ws.batches()] == ["nb"]
