"""Budgets (docs/design-lab.md#budgets): a job's cost and token limits, and a batch's cost limit.

Run on SQLite, and on PostgreSQL with ``AGENTNB_TEST_BACKEND=postgres`` (the ``ws`` fixture's store).  Costs come
from a real priced model name (``gpt-4o-mini``) served by the loopback OpenAI server, priced by genai-prices' data.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, transition, write_piece, write_script
from openai_server import OpenAIServer, reply

from agentnb import AgentnbError, Workspace
from agentnb.engine.budget import money
from agentnb.models.prices import call_cost

WORK = {"movements": [{"name": "work", "persona": "p", "instruction": "i", "tools": ["Write"], "permission": "edit",
                       "max_iterations": 30, "rules": [{"condition": "done", "next": "COMPLETE"}]}]}
PROMPT, COMPLETION = 100_000, 1_000  # per loopback call: about $0.0156 on gpt-4o-mini
MODEL = "openai:gpt-4o-mini"


def _runaway(tmp_path: Path, calls: int = 6) -> str:
    """A script that writes one file per call (call k writes out/k.txt with 1000·k prompt tokens), then completes."""
    responses = [{**call("Write", path=f"output/{k}.txt", content=str(k)),
                  "usage": {"prompt_tokens": 1000 * k, "completion_tokens": 100}} for k in range(1, calls + 1)]
    return write_script(tmp_path, "runaway-script", responses=[*responses, transition("COMPLETE")])


def _writes_then_completes(body: dict[str, Any]) -> dict[str, Any]:
    """The loopback model: a Write first, then COMPLETE once a tool result is in the conversation."""
    done = any(m.get("role") == "tool" for m in body["messages"])
    if done:
        return reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "ok"})], usage=(PROMPT, COMPLETION))
    return reply(tool_calls=[("Write", {"path": "output/a.txt", "content": "a"})], usage=(PROMPT, COMPLETION))


def test_a_runaway_job_stops_after_the_call_that_reached_its_token_limit(ws: Workspace, tmp_path: Path) -> None:
    """The piece's token_limit: call 2 brings the total to 3,200 ≥ 3,000; its Write runs, call 3 is never asked."""
    piece = write_piece(tmp_path, "runaway", {**WORK, "token_limit": 3000})
    job = ws.run(ws.submit("write", piece=piece, model=_runaway(tmp_path)))
    assert job.status == "aborted"
    assert job.error == "budget: 3,200 of 3,000 tokens"
    assert len(ws.events(job, kinds=["llm_response"])) == 2
    assert sorted(p.name for p in (job.workdir / "output").iterdir()) == ["1.txt", "2.txt"]  # the call's tool ran
    (ev,) = ws.events(job, kinds=["budget"])
    assert ev.payload == {"measure": "tokens", "spent": 3200.0, "limit": 3000.0, "limit_job": job.id,
                          "reason": "budget: 3,200 of 3,000 tokens"}
    assert (ev.movement_seq, ev.iteration) == (1, 2)
    status = ws.events(job, kinds=["job_status"])[-1]
    assert status.payload == {"status": "aborted", "reason": "budget: 3,200 of 3,000 tokens"}
    (tr,) = ws.events(job, kinds=["transition"])
    assert (tr.payload["next_step"], tr.payload["forced"], tr.payload["reason"]) == ("ABORT", True, job.error)
    row = ws.frames.jobs().set_index("job").loc[job.id]
    assert (row["status"], row["error"], row["total_tokens"]) == ("aborted", job.error, 3200)
    assert "budget: 3,200 of 3,000 tokens" in job._repr_html_()
    # submit's own limit overrides the piece's
    free = ws.run(ws.submit("write", piece=piece, model=_runaway(tmp_path), token_limit=1_000_000))
    assert free.status == "succeeded" and free.error is None


def test_a_step_by_call_aborts_at_once_and_a_resumed_job_over_its_limit_asks_nothing(ws: Workspace,
                                                                                       tmp_path: Path) -> None:
    job = ws.submit("write", piece=write_piece(tmp_path, "w", WORK), model=_runaway(tmp_path), token_limit=1000)
    assert ws.step(job, unit="call").status == "aborted"  # 1,100 ≥ 1,000 after call 1: not left paused
    assert ws.job(job).error == "budget: 1,100 of 1,000 tokens"
    assert len(ws.events(job, kinds=["llm_request"])) == 1


def test_a_cost_limit_stops_a_priced_model_at_the_right_call(ws: Workspace, tmp_path: Path,
                                                             loopback: Callable[..., OpenAIServer]) -> None:
    server = loopback("sk-test-budget")
    server.play(*[reply(tool_calls=[("Write", {"path": f"output/{k}.txt", "content": "x"})], usage=(PROMPT, COMPLETION))
                  for k in range(5)])
    one = call_cost(MODEL, PROMPT, COMPLETION)
    assert one is not None and 0.015 < one < 0.016  # genai-prices' gpt-4o-mini: the test's premise
    job = ws.run(ws.submit("write", piece=write_piece(tmp_path, "w", WORK), model=MODEL, cost_limit=0.04))
    # calls 1 and 2 make $0.031, call 3 $0.047 ≥ $0.04: aborted after call 3, whose Write ran
    assert job.status == "aborted"
    assert len(ws.events(job, kinds=["llm_response"])) == 3
    spent = float(ws.frames.jobs().set_index("job").loc[job.id, "cost_usd"])
    assert spent == pytest.approx(3 * one)
    assert job.error == f"budget: {money(spent)} of $0.04" == "budget: $0.047 of $0.04"
    (ev,) = ws.events(job, kinds=["budget"])
    assert ev.payload["measure"] == "cost_usd" and ev.payload["spent"] == pytest.approx(spent)
    assert (job.workdir / "output" / "2.txt").exists() and not (job.workdir / "output" / "3.txt").exists()


def test_a_cost_limit_on_an_unpriced_model_is_refused_at_submit(ws: Workspace, tmp_path: Path,
                                                                loopback: Callable[..., OpenAIServer]) -> None:
    loopback("sk-test-unpriced")
    piece = write_piece(tmp_path, "w", WORK)
    with pytest.raises(AgentnbError) as err:
        ws.submit("x", piece=piece, model="openai:no-such-model-priced", cost_limit=1.0)
    assert str(err.value) == ("cost_limit=$1.00 cannot be kept on openai:no-such-model-priced: genai-prices has no "
                              "price for 'no-such-model-priced', and an unknown price never counts as 0; use "
                              "token_limit= instead")
    with pytest.raises(AgentnbError, match=r"the piece's cost_limit .* no price"):
        ws.submit("x", piece=write_piece(tmp_path, "c", {**WORK, "cost_limit": 0.5}), model="openai:no-such-model")
    with pytest.raises(AgentnbError, match=r"job_cost_limit=.* no price"):
        ws.batch([{"instruction": "x"}], piece=piece, model="openai:no-such-model", job_cost_limit=1.0, name="u")
    with pytest.raises(AgentnbError, match=r"^cost_limit=.* no price"):
        ws.batch([{"instruction": "x"}], piece=piece, model="openai:no-such-model", cost_limit=1.0, name="u")
    # a token limit is fine, and so is a cost limit on the free offline models
    ws.submit("x", piece=piece, model="openai:no-such-model-priced", token_limit=100)
    ws.submit("x", piece=piece, model="demo", cost_limit=0.01)
    assert len(ws.jobs()) == 2 and ws.batches() == []


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"cost_limit": -0.5}, "cost_limit=-0.5; allowed: a number of US dollars > 0"),
    ({"cost_limit": "0.5"}, "cost_limit='0.5'; allowed: a number of US dollars > 0"),
    ({"cost_limit": 0}, "cost_limit=0; allowed: a number of US dollars > 0"),
    ({"cost_limit": float("nan")}, "cost_limit=nan; allowed"),
    ({"token_limit": -3}, "token_limit=-3; allowed: a whole number of tokens ≥ 1"),
    ({"token_limit": 10.5}, "token_limit=10.5; allowed: a whole number of tokens ≥ 1"),
    ({"token_limit": True}, "token_limit=True; allowed"),
])
def test_a_bad_limit_is_one_line_and_creates_nothing(ws: Workspace, tmp_path: Path, kwargs: dict[str, Any],
                                                     message: str) -> None:
    with pytest.raises(AgentnbError) as err:
        ws.submit("x", piece="single", model="demo", **kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    batch_kwargs = {f"job_{k}": v for k, v in kwargs.items()}
    with pytest.raises(AgentnbError, match=f"^job_{message.split('=')[0]}="):
        ws.batch([{"instruction": "x"}], piece="single", model="demo", name="b", **batch_kwargs)
    if "cost_limit" in kwargs:
        with pytest.raises(AgentnbError, match=r"^cost_limit="):
            ws.batch([{"instruction": "x"}], piece="single", model="demo", name="b", **kwargs)
    assert ws.jobs() == [] and ws.batches() == []
    if "cost_limit" in kwargs:  # given to the run of a batch: refused before it is kept with the batch
        b = ws.batch([{"instruction": "x"}], piece="single", model="demo", name="kept", run=False)
        options = ws.store.query("SELECT options FROM batches WHERE name='kept'")[0][0]
        with pytest.raises(AgentnbError, match=r"^cost_limit=.*\(every call of the batch's jobs and their subtasks\)"):
            b.run(progress=False, **kwargs)
        assert ws.store.query("SELECT options FROM batches WHERE name='kept'")[0][0] == options
        assert [j.status for j in ws.jobs()] == ["queued"]


@pytest.mark.parametrize(("value", "found"), [("-1", "found -1, expected a number of US dollars > 0"),
                                               ("lots", "found 'lots', expected a number of US dollars > 0"),
                                               ("[1]", "found a list, expected a number of US dollars > 0")])
def test_a_bad_cost_limit_in_a_piece_names_its_file_and_line(ws: Workspace, tmp_path: Path, value: str,
                                                             found: str) -> None:
    text = ("name: p\ncost_limit: " + value + "\nmovements:\n  - name: work\n    persona: p\n    instruction: i\n"
            "    rules: [{condition: done, next: COMPLETE}]\n")
    path = write_piece(tmp_path, "p", text)
    with pytest.raises(AgentnbError) as err:
        ws.submit("x", piece=path, model="demo")
    assert str(err.value) == f"{path}:2: cost_limit: {found}"
    bad_tokens = write_piece(tmp_path, "q", text.replace("cost_limit: " + value, "token_limit: 0.5"))
    with pytest.raises(AgentnbError, match=r"token_limit.*expected a whole number ≥ 1"):
        ws.submit("x", piece=bad_tokens, model="demo")
    assert ws.jobs() == []


def test_a_piece_keeps_its_limits_through_its_stored_yaml(ws: Workspace, tmp_path: Path) -> None:
    job = ws.submit("x", piece=write_piece(tmp_path, "p", {**WORK, "cost_limit": 0.25, "token_limit": 5000}),
                    model="demo")
    piece = ws.piece(job)
    assert (piece.cost_limit, piece.token_limit) == (0.25, 5000)
    assert ws.submit("y", piece=piece, model="demo").status == "queued"


def test_each_batch_job_is_held_to_its_own_token_limit(ws: Workspace, tmp_path: Path) -> None:
    piece = write_piece(tmp_path, "w", WORK)
    cases = [{"instruction": "a"}, {"instruction": "b"}]
    b = ws.batch(cases, piece=piece, model=_runaway(tmp_path, 3), job_token_limit=2500, name="jobs", progress=False)
    frame = b.frame
    assert frame["status"].tolist() == ["aborted", "aborted"]
    assert frame["llm_calls"].tolist() == [2, 2] and frame["total_tokens"].tolist() == [3200, 3200]
    assert {json.loads(r.options_text)["token_limit"] for r in ws.store.jobs(batch="jobs")} == {2500}
    errors = ws.frames.jobs().set_index("job").loc[frame["job"], "error"].tolist()
    assert errors == ["budget: 3,200 of 2,500 tokens"] * 2


def test_a_batch_cost_limit_pauses_the_batch_and_a_higher_one_resumes_it(
        ws: Workspace, tmp_path: Path, loopback: Callable[..., OpenAIServer], capsys: pytest.CaptureFixture[str]) -> None:
    loopback("sk-test-batch-budget", responder=_writes_then_completes)
    one = call_cost(MODEL, PROMPT, COMPLETION)
    assert one is not None
    cases = [{"instruction": f"case {i}"} for i in range(4)]
    # each job makes 2 calls ($0.031); the limit is reached by job 2's first call ($0.047 ≥ $0.04)
    b = ws.batch(cases, piece=write_piece(tmp_path, "w", WORK), model=MODEL, concurrency=1, cost_limit=0.04,
                 name="capped", progress=True)
    rows = b.frame
    assert rows["status"].tolist() == ["succeeded", "queued", "queued", "queued"]
    assert rows["llm_calls"].tolist() == [2, 1, 0, 0]  # job 2 paused right after the call that reached it
    assert [str(s) for s in ws.frames.jobs().set_index("job").loc[rows["job"], "display_status"]] == [
        "succeeded", "paused", "queued", "queued"]
    assert b.last_run.not_started == [int(j) for j in rows["job"][2:]]
    err = capsys.readouterr().err
    assert f"cost limit reached: {money(3 * one)} of $0.04" in err
    assert "resume with ws.batch('capped', cost_limit=HIGHER)" in err
    note = "cost limit $0.04 reached ($0.047 spent): 3 job(s) paused or not started; resume with " \
           "ws.batch('capped', cost_limit=HIGHER)"
    assert note in repr(b) and html.escape(note) in b._repr_html_()
    # resumed under the stored limit: nothing runs
    again = ws.batch("capped", progress=False)
    assert again.frame["llm_calls"].tolist() == [2, 1, 0, 0]
    # a higher limit: the paused job goes on from its call, the others start; all four end within $0.20
    done = ws.batch("capped", cost_limit=0.2, progress=False)
    assert done.frame["status"].tolist() == ["succeeded"] * 4
    assert done.frame["llm_calls"].tolist() == [2, 2, 2, 2]
    assert repr(done).endswith(f"cost limit $0.20: {money(8 * one)} spent>")


def test_subtasks_spend_toward_their_parents_limit(ws: Workspace, tmp_path: Path) -> None:
    """The parent's token_limit counts its children's calls: child 1 ends (800 tokens in all), child 2 is stopped
    after the call that brings the tree to 1,050, child 3 never calls, and the parent is aborted when it resumes."""
    def child(name: str) -> str:
        return write_script(tmp_path, name, {"work": [
            {**call("Write", path="output/part.md", content=name), "usage": {"prompt_tokens": 200, "completion_tokens": 50}},
            {**transition("COMPLETE", summary=f"{name} done"), "usage": {"prompt_tokens": 200, "completion_tokens": 50}},
        ]})

    subtasks = [{"instruction": f"part {n}", "piece": "single", "model": child(f"child-{n}")} for n in (1, 2, 3)]
    parent_model = write_script(tmp_path, "parent", {
        "split": [{**transition("WAIT_SUBTASKS", summary="split", subtasks=subtasks),
                   "usage": {"prompt_tokens": 250, "completion_tokens": 50}}],
        "merge": [transition("COMPLETE", summary="merged")],
    })
    parent = ws.run(ws.submit("three parts", piece="fan-out", model=parent_model, token_limit=1000))
    one, two, three = ws.children(parent)
    whose = f" (the limit of job {parent.id}, with its subtasks)"
    assert [c.status.value for c in (one, two, three)] == ["succeeded", "aborted", "aborted"]
    assert (two.error, three.error) == (f"budget: 1,050 of 1,000 tokens{whose}",) * 2
    assert [len(ws.events(c, kinds=["llm_response"])) for c in (one, two, three)] == [2, 1, 0]
    assert (two.workdir / "output" / "part.md").read_text() == "child-2"  # the call's tool ran
    assert [ev.payload["limit_job"] for c in (two, three) for ev in ws.events(c, kinds=["budget"])] == [parent.id] * 2
    assert parent.status == "aborted" and parent.error == "budget: 1,050 of 1,000 tokens"
    assert [e.payload["movement"] for e in ws.events(parent, kinds=["movement_start"])] == ["split"]
    assert ws.events(parent, kinds=["budget"])[0].payload["spent"] == 1050.0


def test_the_command_and_the_magic_take_the_limits(tmp_path: Path, shell: Any) -> None:
    import os
    import shutil
    import subprocess

    exe = shutil.which("agentnb")
    assert exe is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}  # AGENTNB_STORE: the test's store

    def agentnb(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([exe, "--workspace", "cli-ws", *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env=env)

    piece, model = str(write_piece(tmp_path, "w", WORK)), _runaway(tmp_path, 3)
    out = agentnb("run", "--piece", piece, "--model", model, "--token-limit", "3000", "--no-follow", "write")
    assert out.returncode == 1 and "budget: 3,200 of 3,000 tokens" in out.stdout, out.stderr
    bad = agentnb("run", "--piece", piece, "--model", model, "--cost-limit", "-1", "write")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
        "--cost-limit -1.0; allowed: a number of US dollars > 0 (the job's and its subtasks' calls)")
    (tmp_path / "cases.jsonl").write_text('{"instruction": "a"}\n{"instruction": "b"}\n', encoding="utf-8")
    ran = agentnb("batch", "cases.jsonl", "--piece", piece, "--model", model, "--job-token-limit", "2500",
                  "--name", "cli", "--no-progress")
    assert ran.returncode == 0, ran.stderr
    cli_ws = Workspace(tmp_path / "cli-ws")
    assert [j.error for j in cli_ws.batch("cli", progress=False).jobs] == ["budget: 3,200 of 2,500 tokens"] * 2
    shell.user_ns["t_cases"] = [{"instruction": "a"}]
    b = shell.run_line_magic("agent", f"batch t_cases --piece {piece} --model {model} --job-token-limit 1000 "
                                      "--name magic")
    assert [j.error for j in b.jobs] == ["budget: 1,100 of 1,000 tokens"]


def test_job_limits_on_a_batch_resumed_by_name_are_refused(ws: Workspace, tmp_path: Path) -> None:
    ws.batch([{"instruction": "a"}], piece="single", model="demo", name="r", run=False)
    with pytest.raises(AgentnbError, match=r"^job_cost_limit/job_token_limit are given to the jobs a call creates"):
        ws.batch("r", job_token_limit=10)
    assert [json.loads(r.options_text) for r in ws.store.jobs(batch="r")] == [{}]


def test_a_job_aborted_at_its_limit_goes_on_when_retried_with_a_higher_one(ws: Workspace, tmp_path: Path) -> None:
    job = ws.run(ws.submit("write", piece=write_piece(tmp_path, "w", WORK), model=_runaway(tmp_path, 3),
                           token_limit=1000))
    assert job.error == "budget: 1,100 of 1,000 tokens"
    again = ws.run(ws.retry(job))  # the same limit: aborted before any call
    assert again.status == "aborted" and len(ws.events(job, kinds=["llm_request"])) == 1
    with pytest.raises(AgentnbError, match=r"^token_limit=0; allowed"):
        ws.retry(job, token_limit=0)
    done = ws.run(ws.retry(job, token_limit=100_000))
    assert done.status == "succeeded", done.error
    assert json.loads(ws.store.job(job.id).options_text) == {"token_limit": 100_000}
    assert [e.payload["reason"] for e in ws.events(job, kinds=["budget"])] == ["budget: 1,100 of 1,000 tokens"] * 2


def test_a_batch_cost_limit_with_jobs_running_at_once(ws: Workspace, tmp_path: Path,
                                                      loopback: Callable[..., OpenAIServer]) -> None:
    """Three jobs at a time: once the limit is reached no job starts and the running ones pause after their
    current call; what was spent overshoots by at most the calls in flight, and a higher limit finishes it."""
    loopback("sk-test-batch-parallel", responder=_writes_then_completes, latency=0.05)
    one = call_cost(MODEL, PROMPT, COMPLETION)
    assert one is not None
    cases = [{"instruction": f"case {i}"} for i in range(9)]
    b = ws.batch(cases, piece=write_piece(tmp_path, "w", WORK), model=MODEL, concurrency=3, cost_limit=0.1,
                 name="parallel", progress=False)
    frame = b.frame
    spent = float(frame["cost_usd"].sum())
    assert 0.1 <= spent <= 0.1 + 3 * one + 1e-9  # reached, and no more than one call per running job past it
    assert set(frame["status"]) <= {"succeeded", "queued"} and (frame["status"] == "queued").any()
    idle = {int(j) for j in frame.loc[frame["llm_calls"] == 0, "job"]}  # never started, or paused before a call
    assert b.last_run.not_started and set(b.last_run.not_started) <= idle
    done = ws.batch("parallel", cost_limit=1.0, concurrency=3, progress=False)
    assert done.frame["status"].tolist() == ["succeeded"] * 9
    assert done.frame["cost_usd"].sum() == pytest.approx(18 * one)  # no call made twice


def test_a_call_without_tool_calls_is_counted_at_once(ws: Workspace, tmp_path: Path) -> None:
    """A reply with no tool call (the model is reminded) is not yet committed when the limit is checked: it counts."""
    chatty = write_script(tmp_path, "chatty", responses=[
        {"content": f"thinking {k}", "usage": {"prompt_tokens": 1000 * k, "completion_tokens": 100}} for k in (1, 2, 3)])
    job = ws.run(ws.submit("talk", piece=write_piece(tmp_path, "w", WORK), model=chatty, token_limit=1500))
    assert job.error == "budget: 3,200 of 1,500 tokens"
    assert len(ws.events(job, kinds=["llm_response"])) == 2
