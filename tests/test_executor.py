"""Batches run concurrently, and show their progress, against a real OpenAI-protocol server.

The server (tests/openai_server.py) answers on loopback after a fixed latency, counts the requests in
flight and, when told, refuses those over a limit with 429 and ``retry-after``.  Each job's answers
depend only on the request (its case number and how many answers its movement has had), so a job that
is paused, killed and resumed gets the same answers as one that runs straight through.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _scripting import write_piece
from openai_server import OpenAIServer, error, openai_env, reply

from agentnb import Workspace
from agentnb.errors import UsageError
from agentnb.events import LLMResponse
from agentnb.executor import run_jobs
from agentnb.models.openai import OpenAIModel
from agentnb.models.ratelimit import Gate
from agentnb.progress import Outcome, final_html, final_line
from agentnb.store import reads
from agentnb.store.base import STOP_CUT_REASON
from agentnb.views.status import STOP_REASON
from agentnb.views.style import OK_COLOUR

CALLS = 3  # LLM calls each job needs: CALLS-1 tool calls, then the transition
PIECE = """
name: lab
movements:
  - name: work
    persona: You work.
    instruction: Work.
    tools: [Write]
    permission: edit
    max_iterations: 10
    rules: [{next: COMPLETE}]
"""
ROOT = Path(__file__).resolve().parent.parent


def _case(body: dict[str, Any]) -> str | None:
    """The case a request belongs to ("case-7"), read from the job's instruction in the messages."""
    for m in body.get("messages", []):
        found = re.search(r"case-\d+|doomed", str(m.get("content") or ""))
        if found:
            return found.group(0)
    return None


def _answers(tool: str) -> Any:
    def respond(body: dict[str, Any]) -> dict[str, Any]:
        case = _case(body)
        if case == "doomed":
            return error(429, "slow down", headers={"retry-after": "0.01"})[0]
        k = sum(1 for m in body["messages"] if m.get("role") == "assistant")  # answers so far in this movement
        if k < CALLS - 1:
            args = ({"path": f"output/{k}.txt", "content": f"{case} {k}"} if tool == "Write"
                    else {"line": f"{case} {k}"})
            return reply(tool_calls=[(tool, args)])
        return reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": f"{case} done"})])
    return respond


@pytest.fixture
def server(loopback: Callable[..., OpenAIServer]) -> OpenAIServer:
    return loopback("sk-test-executor", timeout="20", latency=0.2, responder=_answers("Write"), key=_case)


def _cases(n: int) -> list[dict[str, Any]]:
    return [{"instruction": f"do case-{i}", "expected": i} for i in range(n)]


def _answered(srv: OpenAIServer) -> collections.Counter[Any]:
    return collections.Counter(a.key for a in srv.log if a.status == 200)


def _interrupted(ws: Workspace, job_id: int) -> list[Any]:
    """The calls of a job that a Stop cut off mid-answer (docs/models.md#streaming)."""
    return [e for e in ws.events(job_id, kinds=["error"]) if e.where == "interrupted"]


def _check_events(ws: Workspace, job_id: int) -> list[LLMResponse]:
    """A job's events are in order: ids increasing, movement runs and their iterations never going back."""
    events = ws.events(job_id)
    ids = [e.id for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert [e.ts for e in events] == sorted(e.ts for e in events)
    place = [(e.movement_seq, e.iteration) for e in events if e.movement_seq is not None and e.iteration is not None]
    assert place == sorted(place)
    return [e for e in events if isinstance(e, LLMResponse)]


# -- running at once ----------------------------------------------------------------------------------


def test_jobs_overlap_up_to_the_concurrency_and_every_event_is_kept(tmp_path: Path, server: OpenAIServer) -> None:
    # the first calls wait at the server until 8 are in flight: on a loaded machine the 8 job threads could
    # otherwise start too far apart to overlap (a batch limited to fewer would leave them waiting, and fail below)
    server.gather = 8
    ws = Workspace(tmp_path / "ws")
    b = ws.batch(_cases(24), piece=str(write_piece(tmp_path, "piece", PIECE)), model="openai:m", name="wide",
                 concurrency=8, progress=False)
    assert server.max_in_flight == 8  # really at once, and never more than asked
    assert b.counts()["succeeded"] == 24
    answered = _answered(server)
    for job in b.jobs:
        responses = _check_events(ws, job.id)
        assert len(responses) == CALLS == answered[f"case-{job.case}"]
        assert sorted(p.name for p in job.output.iterdir()) == [f"{k}.txt" for k in range(CALLS - 1)]
    assert sum(reads.total_tokens(ws.store, j.id) for j in b.jobs) == 110 * sum(answered.values())
    assert b.last_run.count("succeeded") == 24 and not b.last_run.skipped


def test_a_rate_limit_slows_the_whole_batch_and_fails_no_job(tmp_path: Path, server: OpenAIServer) -> None:
    server.max_concurrent = 3
    server.retry_after = "0.05"
    ws = Workspace(tmp_path / "ws")
    b = ws.batch(_cases(16), piece=str(write_piece(tmp_path, "piece", PIECE)), model="openai:m", name="limited",
                 concurrency=8, retries=30, progress=False)
    assert b.counts()["succeeded"] == 16, [j.error for j in b.jobs]
    refused = [a for a in server.log if a.status == 429]
    answered = [a for a in server.log if a.status == 200]
    assert refused and len(answered) == 16 * CALLS
    # the gate cut the calls in flight: after the first 429 the batch settles under the endpoint's limit
    # instead of sending all 8 again and again (which would earn more 429s than answers)
    first = server.log.index(refused[0])
    later = server.log[first + 8:]
    assert max(a.in_flight for a in later) < 8
    assert len(refused) < len(answered) / 2
    for job in b.jobs:
        assert len(_check_events(ws, job.id)) == CALLS


def test_a_job_whose_retries_run_out_fails_in_one_line_and_the_others_go_on(tmp_path: Path,
                                                                            server: OpenAIServer) -> None:
    ws = Workspace(tmp_path / "ws")
    cases = [*_cases(5), {"instruction": "the doomed one"}]
    b = ws.batch(cases, piece=str(write_piece(tmp_path, "piece", PIECE)), model="openai:m", name="doom", concurrency=4,
                 retries=2, max_backoff=0.05, progress=False)
    by_case = {j.case: j for j in b.jobs}
    assert str(by_case[5].status) == "failed"
    assert by_case[5].error == "openai:m: gave up after 3 tries; last error HTTP 429: slow down"
    assert all(str(by_case[i].status) == "succeeded" for i in range(5))


def test_a_job_another_process_runs_is_skipped_and_counted(tmp_path: Path, server: OpenAIServer) -> None:
    ws = Workspace(tmp_path / "ws")
    b = ws.batch(_cases(4), piece=str(write_piece(tmp_path, "piece", PIECE)), model="openai:m", name="shared",
                 run=False)
    taken = b.pending()[1]
    assert ws.store.claim(taken) is not None  # this process, alive: as if another worker were running it
    b.run(concurrency=2, progress=False)
    assert b.last_run.skipped == [taken]
    assert b.counts()["succeeded"] == 3 and str(ws.job(taken).status) == "running"


def test_concurrency_must_be_a_whole_number_of_at_least_one(tmp_path: Path, server: OpenAIServer) -> None:
    ws = Workspace(tmp_path / "ws")
    for bad in (0, True, -2, 1.5):
        with pytest.raises(UsageError) as caught:
            ws.batch(_cases(2), piece=str(write_piece(tmp_path, "piece", PIECE)), model="openai:m", name="bad",
                     concurrency=bad)
        assert "\n" not in str(caught.value) and f"concurrency={bad!r}" in str(caught.value)
        assert "≥ 1" in str(caught.value)
    assert ws.batches() == [] and ws.jobs() == []
    b = ws.batch(_cases(2), piece=str(write_piece(tmp_path, "piece", PIECE)), model="openai:m", name="ok", run=False)
    with pytest.raises(UsageError, match="concurrency=True"):
        b.run(concurrency=True)
    assert server.log == []


def test_the_gate_halves_the_calls_in_flight_on_a_429_and_grows_back_by_one_per_round() -> None:
    gate = Gate()
    tickets = [gate.acquire() for _ in range(8)]
    assert gate.limit is None and gate.peak == 8
    gate.throttle(0.0, tickets[0])
    assert gate.limit == 4
    gate.throttle(0.0, tickets[1])  # sent before the gate reacted: no second cut
    assert gate.limit == 4
    for _ in range(8):
        gate.release(ok=False)
    assert gate.in_flight == 0 and gate.limit == 4
    fresh = [gate.acquire() for _ in range(4)]  # up to the cap, then a fifth would wait
    gate.throttle(0.0, fresh[0])  # a call sent after the cut brings news: halved again
    assert gate.limit == 2
    for _ in range(4):
        gate.release(ok=True)  # 2 + 1/2 + 1/2.5 + …: about one more per round of answered calls
    assert 3 <= gate.limit < 4  # type: ignore[operator]
    while gate.limit is not None:  # answered calls raise it back to the most seen in flight, then no cap
        gate.acquire()
        gate.release(ok=True)
    assert gate.in_flight == 0


def test_the_pause_after_a_429_holds_every_caller_but_never_longer_than_its_max_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import agentnb.models.ratelimit as rl

    slept: list[float] = []
    monkeypatch.setattr(rl.time, "sleep", slept.append)
    gate = Gate()
    ticket = gate.acquire()
    gate.throttle(30.0, ticket)
    gate.release(ok=False)
    gate.acquire(max_wait=2.0)  # another job's call: waits the pause out, capped by its max_backoff
    gate.release(ok=True)
    gate.acquire(max_wait=None)
    gate.release(ok=True)
    assert 1.9 < slept[0] <= 2.0 and 29 < slept[1] <= 30
    gate.acquire(waited_until=time.monotonic() + 60)  # the caller that got the 429 has slept it already
    assert len(slept) == 2


def test_a_call_waiting_for_a_slot_waits_out_the_pause_of_the_429_that_freed_it() -> None:
    gate = Gate()
    first, _ = gate.acquire(), gate.acquire()
    gate.throttle(0.0, first)  # an earlier 429 asked for no wait: the cap is one call
    gate.release(ok=False)
    gate.release(ok=False)
    asked = gate.acquire()  # the one call in flight
    went: list[float] = []

    def another_job() -> None:  # waits for the slot
        gate.acquire()
        went.append(time.monotonic())
        gate.release(ok=True)

    waiting = threading.Thread(target=another_job)
    waiting.start()
    time.sleep(0.05)
    assert not went and gate.waiting == 1
    gate.throttle(0.4, asked)  # the call in flight gets a 429 asking for 0.4 s, and frees its slot
    freed = time.monotonic()
    gate.release(ok=False)
    waiting.join(5)
    assert went and went[0] - freed >= 0.35  # not sent into the new pause


# -- the openai client ----------------------------------------------------------------------------------


def test_one_client_per_endpoint_key_and_timeout_is_shared(server: OpenAIServer) -> None:
    a, b = OpenAIModel("m"), OpenAIModel("other")
    assert a._get_client() is b._get_client()
    assert OpenAIModel("m", api_key="sk-another")._get_client() is not a._get_client()
    assert OpenAIModel("m", timeout=3)._get_client() is not a._get_client()
    import agentnb.models.openai as oa

    assert "sk-test-executor" not in repr(list(oa._clients))  # looked up by a digest of the key


# -- progress ----------------------------------------------------------------------------------------------


def test_the_progress_bar_counts_jobs_tokens_and_dollars_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ws = Workspace(tmp_path / "ws")
    ws.batch(_cases(3), piece="single", model="demo", name="shown", concurrency=2)
    captured = capsys.readouterr()
    assert captured.out == ""
    drawn = captured.err.replace("\r", "\n").strip().splitlines()
    tokens = sum(reads.total_tokens(ws.store, j.id) for j in ws.jobs())
    # the live bar: jobs, the counts so far, tokens and dollars (the demo model costs nothing)
    assert any("batch shown: 100%" in line and f"0 ok, 0 failed, 3 waiting · {tokens:,} tokens · $0" in line
               for line in drawn), drawn
    # then the bar is cleared and its final line is the last one: the demo model asks on `single`, so all wait
    assert re.fullmatch(rf"batch shown · 3/3 · 0 ok · 3 waiting · {tokens:,} tokens · \$0 · \d+\.\d s", drawn[-1])
    ws.batch(_cases(3), piece="plan-implement-verify", model="demo", name="quiet", progress=False)
    assert capsys.readouterr().err == ""
    ws.batch("shown")  # resumed with nothing left to run: no empty bar
    assert capsys.readouterr().err == ""


def test_the_bar_does_not_count_the_jobs_a_stop_paused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ws = Workspace(tmp_path / "ws")

    running = threading.Event()

    def interrupt() -> None:  # Ctrl-C once a job has ended, the others in the middle of their runs
        while not any(j.status == "succeeded" for j in ws.jobs()):
            time.sleep(0.02)
        if running.is_set():  # (never once the batch has returned: it would hit the test run)
            os.kill(os.getpid(), signal.SIGINT)

    running.set()
    threading.Thread(target=interrupt, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ws.batch(_cases(6), piece="plan-implement-verify", model="demo?pace=0.003", name="cut", concurrency=3)
    finally:
        running.clear()
    ended = sum(1 for j in ws.jobs() if j.status == "succeeded")
    frames = [int(m) for m in re.findall(r"\| (\d+)/6 \[", capsys.readouterr().err)]
    assert ended < 6 and frames and max(frames) == ended, (frames, ended)


def test_a_bar_that_cannot_be_drawn_as_a_widget_falls_back_to_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import tqdm.auto

    def no_widget(*args: Any, **kwargs: Any) -> Any:
        raise ImportError("IProgress not found. Please update jupyter and ipywidgets.")

    monkeypatch.setattr(tqdm.auto, "tqdm", no_widget)
    ws = Workspace(tmp_path / "ws")
    b = ws.batch(_cases(2), piece="single", model="demo", name="plain")
    assert b.counts()["queued"] == b.counts()["running"] == 0 and len(b.last_run.statuses) == 2
    err = capsys.readouterr().err
    assert "batch plain: 100%" in err and err.splitlines()[-1].startswith("batch plain · 2/2 · ")


def test_the_final_line_says_how_the_run_ended_and_is_never_green_over_waiting_or_failed_jobs() -> None:
    statuses = {1: "succeeded", 2: "waiting_human", 3: "succeeded", 4: "waiting_human"}
    done = Outcome(4, statuses, tokens=12340, cost=0.04, seconds=8.24)
    assert final_line("batch exp-1", done) == "batch exp-1 · 4/4 · 2 ok · 2 waiting · 12,340 tokens · $0.0400 · 8.2 s"
    page = final_html("batch exp-1", done, resume="%agent batch exp-1")
    assert 'data-state="waiting"' in page and OK_COLOUR in page  # the ok segment is green, the run is not
    assert re.search(r'data-outcome="waiting" title="2 waiting" style="flex:2 0 0;background:#8e44ad"', page)
    assert ("job(s) 2, 4 wait for a reply: answer each (%agent reply JOB &quot;…&quot; or ws.reply(JOB, "
            "&quot;…&quot;); the batch&#x27;s view lists their questions), then resume with %agent batch exp-1") in page
    assert Outcome(2, {1: "succeeded", 2: "succeeded"}).state() == "ok"
    # failed and aborted: red, each counted
    bad = Outcome(3, {1: "succeeded", 2: "failed", 3: "aborted"}, cost=None, seconds=125)
    assert final_line("jobs", bad) == "jobs · 3/3 · 1 ok · 1 failed · 1 aborted · 0 tokens · cost unknown · 2 min 05 s"
    assert bad.state() == "failed" and 'data-state="failed"' in final_html("jobs", bad)
    # paused by Ctrl-C: the paused job, the ones never started and the one another process runs
    paused = Outcome(6, {1: "succeeded", 2: "queued"}, skipped=1, seconds=3, stopped="paused")
    assert final_line("batch b", paused) == ("batch b · paused · 1/6 · 1 ok · 1 paused · 1 skipped · 3 not started · "
                                             "0 tokens · $0 · 3.0 s")
    assert paused.state() == "paused"
    stopped = Outcome(2, {1: "succeeded"}, seconds=7200, stopped="error")
    assert final_line("batch b", stopped) == "batch b · stopped by an error · 1/2 · 1 ok · 1 not started · 0 tokens · $0 · 2 h 00 min"
    assert stopped.state() == "failed"
    # every text escaped: a batch's name is the user's
    assert "<b>batch &lt;x&gt;</b>" in final_html("batch <x>", done) and "<x>" not in final_html("batch <x>", done)


README = (ROOT / "README.md").read_text(encoding="utf-8")


def _readme_recipe() -> list[str]:
    """The README's batch recipe, each ```python block a cell: a batch that completes, one that waits, the
    replies and the resume."""
    start = README.index("From a notebook, on the built-in `demo` model")
    section = README[start:README.index("The other forms", start)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_in_a_kernel_the_readme_batch_recipe_leaves_its_final_lines_in_the_saved_notebook(tmp_path: Path) -> None:
    """The bar is a widget, which does not outlive its kernel ("Error displaying widget: model not found",
    and the saved text was its first state, "0%| | 0/4"): each batch leaves its final line in the notebook."""
    import nbformat
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell, new_notebook

    recipe = _readme_recipe()
    assert len(recipe) == 3, recipe
    nb = new_notebook(cells=[new_code_cell(c) for c in ["%load_ext agentnb", *recipe]])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute(env=env)
    # the bar turned purple while the jobs of `asks` waited (the widget models' state, as the kernel sent it)
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    assert "#8e44ad" in [m["state"].get("bar_color") for m in state.values() if m["model_name"] == "ProgressStyleModel"]
    # what a reopened notebook, GitHub or nbviewer has: the saved file, read back, no kernel and no widget
    nbformat.write(nb, tmp_path / "saved.ipynb")
    saved = nbformat.read(tmp_path / "saved.ipynb", as_version=4)
    nbformat.validate(saved)

    def final(cell: int) -> dict[str, Any]:
        outputs = saved.cells[cell].outputs
        assert not [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
        text = "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in outputs)
        assert "0%|" not in text and "| 0/" not in text, text  # never the bar's first state, "0%| | 0/4"
        [line] = [o for o in outputs if "anb-batch-end" in str(o.get("data", {}).get("text/html", ""))]
        return dict(line["data"])

    done = final(1)
    assert re.fullmatch(r"batch exp-1 · 4/4 · 4 ok · [\d,]+ tokens · \$0 · \d+\.\d s", done["text/plain"])
    assert 'data-state="ok"' in done["text/html"] and "4 ok" in done["text/html"]
    waiting = final(2)
    line, hint = waiting["text/plain"].splitlines()
    assert re.fullmatch(r"batch asks · 2/2 · 0 ok · 2 waiting · [\d,]+ tokens · \$0 · \d+\.\d s", line)
    assert hint.startswith("job(s) 5, 6 wait for a reply") and hint.endswith("then resume with %agent batch asks")
    assert 'data-state="waiting"' in waiting["text/html"]
    # the batch's view below it: each question and the reply the README then gives (jobs 5 and 6)
    view = "".join(str(o.get("data", {}).get("text/html", "")) for o in saved.cells[2].outputs)
    assert view.count("asks: Which format should the result have") == 2
    assert "<code>%agent reply 5 YOUR ANSWER</code>" in view and "<code>%agent reply 6 YOUR ANSWER</code>" in view
    resumed = final(3)
    assert re.fullmatch(r"batch asks · 2/2 · 2 ok · [\d,]+ tokens · \$0 · \d+\.\d s", resumed["text/plain"])
    ws = Workspace(tmp_path / "agentnb-data", readonly=True)
    assert [str(j.status) for j in ws.jobs()] == ["succeeded"] * 6


def test_run_jobs_reports_each_jobs_status(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    jobs = [ws.submit(f"t{i}", piece="single", model="demo") for i in range(3)]
    ended: list[int] = []
    report = run_jobs(ws, [j.id for j in jobs], concurrency=3, on_end=lambda job: ended.append(job.id))
    assert sorted(ended) == [j.id for j in jobs]
    assert report.statuses == {j.id: str(j.status) for j in jobs} and set(report.statuses.values()) <= {
        "succeeded", "waiting_human"}  # the demo model asks the user about a task this vague


# -- Ctrl-C, SIGTERM and SIGKILL, in a real process ----------------------------------------------------

SCRIPT = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    import agentnb

    @agentnb.tool(permission="edit")
    def append_line(ctx, line: str) -> str:
        """Append a line to output/log.txt.

        Args:
            line: the line
        """
        with open(Path(ctx.workdir) / "output" / "log.txt", "a", encoding="utf-8") as f:
            f.write(line + "\\n")
        time.sleep(0.05)  # a kill may land after the effect, before its result is recorded
        return "appended"

    ws = agentnb.Workspace(sys.argv[1])
    if sys.argv[2] == "start":
        cases = [{"instruction": f"do case-{i}"} for i in range(int(sys.argv[4]))]
        ws.batch(cases, piece=sys.argv[3], model="openai:m", name="exp", concurrency=4)
    else:
        b = ws.batch("exp", concurrency=4)
        print("RESUMED", b.counts())
''')

TOOL_PIECE = PIECE.replace("tools: [Write]", "tools: [append_line]")


def _start(tmp_path: Path, srv: OpenAIServer, *args: str) -> subprocess.Popen[str]:
    script = tmp_path / "batch_script.py"
    script.write_text(SCRIPT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           **openai_env(srv, timeout="20")}
    return subprocess.Popen([sys.executable, str(script), str(tmp_path / "ws"), *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _when_seen(srv: OpenAIServer, proc: subprocess.Popen[str], n: int) -> None:
    deadline = time.monotonic() + 60  # a guard against a hung child, not a timing assertion
    while len(srv.received) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the batch never reached the server"
        time.sleep(0.01)


def _resume_and_check(tmp_path: Path, srv: OpenAIServer, n: int) -> None:
    proc = _start(tmp_path, srv, "resume")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "RESUMED" in out
    ws = Workspace(tmp_path / "ws", readonly=True)
    jobs = ws.jobs()
    assert len(jobs) == n and all(str(j.status) == "succeeded" for j in jobs), [(j.id, j.status, j.error) for j in jobs]
    for job in jobs:
        assert len(_check_events(ws, job.id)) == CALLS  # no LLM call recorded twice
        lines = (job.output / "log.txt").read_text(encoding="utf-8").splitlines()
        assert len(lines) == len(set(lines)), lines  # no completed tool call run twice


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGINT twice"])
def test_ctrl_c_pauses_every_running_job_and_the_batch_resumes(tmp_path: Path, how: str) -> None:
    answers = _answers("append_line")
    with OpenAIServer(latency=0.15, responder=answers, key=_case) as srv:
        piece = write_piece(tmp_path, "piece", TOOL_PIECE)
        proc = _start(tmp_path, srv, "start", str(piece), "10")
        _when_seen(srv, proc, 8)
        proc.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGINT)
        if how == "SIGINT twice":  # impatient: the jobs are still finishing their calls
            time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=120)
        assert proc.returncode != 0
        if how != "SIGTERM":
            assert "KeyboardInterrupt" in err
        assert "resume with ws.batch('exp')" in err
        ws = Workspace(tmp_path / "ws", readonly=True)
        statuses = collections.Counter(str(j.status) for j in ws.jobs())
        assert statuses["running"] == 0 and statuses["queued"] > 0
        started_and_paused = [j for j in ws.jobs() if str(j.status) == "queued" and ws.events(j.id, kinds=["llm_response"])]
        assert started_and_paused
        # the reason says whether the Stop cut the job's call off or came between its calls
        assert all(reads.last_status_reason(ws.store, j.id) == (STOP_CUT_REASON if _interrupted(ws, j.id) else STOP_REASON)
                   for j in started_and_paused)
        # a streamed call is cut off at once (docs/models.md#streaming): every answer the server began is either
        # recorded or recorded as interrupted, and an interrupted one is asked again on resume
        # the server notes an answer after its latency: one the batch cut off while it waited is noted once the
        # wait is over, which may be after the batch process has gone
        deadline = time.monotonic() + 10
        while srv.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        before = _answered(srv)
        cut = {f"case-{j.id - 1}": len(_interrupted(ws, j.id)) for j in ws.jobs()}
        for j in ws.jobs():
            assert len(ws.events(j.id, kinds=["llm_response"])) + cut[f"case-{j.id - 1}"] == before[f"case-{j.id - 1}"]
        _resume_and_check(tmp_path, srv, 10)
        assert all(count == CALLS + cut[case] for case, count in _answered(srv).items())  # each call answered once


def test_a_killed_batch_resumes_without_repeating_a_completed_tool_call(tmp_path: Path) -> None:
    with OpenAIServer(latency=0.1, responder=_answers("append_line"), key=_case) as srv:
        piece = write_piece(tmp_path, "piece", TOOL_PIECE)
        proc = _start(tmp_path, srv, "start", str(piece), "8")
        _when_seen(srv, proc, 9)
        proc.kill()
        proc.communicate(timeout=60)
        ws = Workspace(tmp_path / "ws", readonly=True)
        assert any(str(j.status) == "running" for j in ws.jobs())  # its owner is gone: the resume takes it over
        _resume_and_check(tmp_path, srv, 8)
