"""The built-in scorers and the LLM judge (docs/design-lab.md#built-in-scorers, #llm-judge): what each reads, the
one-line refusals when one is built wrong, and the judge's calls — recorded on the scored job with
``purpose: "judge"``, priced apart (``judge_cost_usd``), shown in the job view's scores section, re-scored without
running the job.  Real workspaces (SQLite; PostgreSQL with AGENTNB_TEST_BACKEND=postgres), scripted models, and the
loopback OpenAI-protocol server for a real endpoint."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from _batching import answering_model
from _scripting import call, transition, write_script
from genai_prices import Usage, calc_price
from openai_server import OpenAIServer, reply

from agentnb import ModelSpecError, UsageError, Workspace
from agentnb.events import LLMRequest, LLMResponse, ScoreEvent
from agentnb.scorers import (
    contains,
    equals_expected,
    file_exists,
    file_matches,
    json_valid,
    llm_judge,
    regex,
)
from agentnb.store import reads
from agentnb.views.render import job_html
from agentnb.views.usage_table import usage_table


def _verdict(score: Any, reason: str = "fine", usage: tuple[int, int] | None = (300, 25)) -> dict[str, Any]:
    """A scripted judge's answer: one call of the verdict tool."""
    out: dict[str, Any] = {"tool_calls": [{"name": "verdict", "arguments": {"score": score, "reason": reason}}]}
    if usage is not None:
        out["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1]}
    return out


def _judge(folder: Path, *responses: dict[str, Any], name: str = "judge") -> str:
    return write_script(folder, name, responses=list(responses))


def _scores(ws: Workspace, job: Any) -> list[tuple[str, Any, str | None]]:
    return [(e.name, e.value, e.error) for e in ws.events(job, kinds=["score"]) if isinstance(e, ScoreEvent)]


def _judge_events(ws: Workspace, job: Any) -> list[Any]:
    return [e for e in ws.events(job, kinds=["llm_request", "llm_response"]) if e.purpose == "judge"]


def _answers(tmp_path: Path, *answers: str) -> list[dict[str, Any]]:
    """Cases whose job (the ``single`` piece on an answering model per case) writes ``answers[i]`` to
    output/answer.txt; each case expects "41"."""
    return [{"instruction": f"Answer {i}", "expected": "41", "answer": a} for i, a in enumerate(answers)]


# -- the built-in scorers -------------------------------------------------------------------------------------

def test_text_scorers_read_the_final_summary_or_the_file_given(ws: Workspace, tmp_path: Path) -> None:
    # the job writes "41" to output/answer.txt and ends with the summary "answered 41"
    cases = [{"instruction": "Answer", "expected": "41"}, {"instruction": "Answer", "expected": 41},
             {"instruction": "Answer", "expected": {"n": 41}}]
    scorers = {
        "eq": equals_expected, "eq_file": equals_expected(path="output/answer.txt"),
        "has": contains("41"), "has_case": contains("ANSWERED", ignore_case=True), "has_cased": contains("ANSWERED"),
        "digits": regex(r"\d+"), "exact": regex(r"^41$", path="output/answer.txt"),
        "file_has": contains("4", path="output/answer.txt"), "missing": contains("41", path="output/none.txt"),
    }
    b = ws.batch(cases, piece="single", model=answering_model(tmp_path, "m", "41"), name="text", scorers=scorers,
                 progress=False)
    f = b.frame
    assert list(f["eq"]) == [False, False, False]  # "answered 41" is not "41"
    # the file's "41": equal to the text "41" and, read as JSON, to the number 41; not to a dict
    assert list(f["eq_file"]) == [True, True, False]
    assert f["has"].all() and f["has_case"].all() and not f["has_cased"].any()
    assert f["digits"].all() and f["exact"].all() and f["file_has"].all()
    assert not f["missing"].any()  # no such file: False, not an error
    assert f[[f"{n}_error" for n in scorers]].isna().all().all()
    assert repr(scorers["exact"]) == "regex('^41$', path='output/answer.txt')"


def test_file_scorers_read_the_work_directory(ws: Workspace, tmp_path: Path) -> None:
    model = write_script(tmp_path, "files", {"work": [
        call("Write", path="output/data.json", content='{"a": [1, 2]}'),
        call("Write", path="output/broken.json", content='{"a": '),
        call("Write", path="output/report.md", content="# Report\n\n## Conclusion\nAll good.\n"),
        transition("COMPLETE", summary="wrote three files")]})
    job = ws.run(ws.submit("Write the files", piece="single", model=model))
    assert job.status == "succeeded", job.error
    (job.workdir / "output" / "latin1.txt").write_bytes("café".encode("latin-1"))
    ws.score(job, {
        "json": json_valid("output/data.json"), "broken": json_valid("output/broken.json"),
        "no_json": json_valid("output/none.json"), "report": file_exists("output/report.md"),
        "folder": file_exists("output"), "none": file_exists("output/none.md"),
        "conclusion": file_matches("output/report.md", r"(?m)^## Conclusion$"),
        "wrong": file_matches("output/report.md", "Introduction"), "gone": file_matches("output/none.md", "x"),
        "dotted": file_exists("output/../output/report.md"), "latin1": file_matches("output/latin1.txt", "caf"),
    })
    got = {name: (value, error) for name, value, error in _scores(ws, job)}
    assert {n: v for n, (v, e) in got.items() if e is None} == {
        "json": True, "broken": False, "no_json": False, "report": True, "folder": False, "none": False,
        "conclusion": True, "wrong": False, "gone": False, "dotted": True}
    assert got["latin1"][1] is not None and "output/latin1.txt is not UTF-8 text" in got["latin1"][1]


def test_a_link_leading_out_of_the_work_directory_is_the_scores_error(ws: Workspace, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("password: hunter2\n", encoding="utf-8")
    model = write_script(tmp_path, "m", {"work": [transition("COMPLETE", summary="nothing")]})
    job = ws.run(ws.submit("Do nothing", piece="single", model=model))
    (job.workdir / "output").mkdir(exist_ok=True)
    os.symlink(secret, job.workdir / "output" / "leak.txt")  # planted after the job: the scorers must not follow it
    ws.score(job, {"matches": file_matches("output/leak.txt", "hunter2"), "exists": file_exists("output/leak.txt"),
                   "json": json_valid("output/leak.txt"), "has": contains("hunter2", path="output/leak.txt")})
    for name, value, error in _scores(ws, job):
        assert value is None and error is not None and "leaves the work directory" in error, (name, error)
        assert "hunter2" not in error


def test_equals_expected_needs_an_expected_value(ws: Workspace, tmp_path: Path) -> None:
    model = answering_model(tmp_path, "m", "41")
    job = ws.run(ws.submit("Answer", piece="single", model=model))  # no batch: no case, no expected
    b = ws.batch([{"instruction": "Answer"}], piece="single", model=model, name="no-expected",
                 scorers={"eq": equals_expected}, progress=False)
    ws.score(job, {"eq": equals_expected})
    [(_, value, error)] = _scores(ws, job)
    assert value is None and error == f"ScorerError: job {job.id}: it is not in a batch, so it has no 'expected' value to compare with"
    assert b.frame["eq_error"].tolist() == [
        f"ScorerError: job {b.jobs[0].id}: case 0 of batch 'no-expected' has no 'expected' value to compare with"]


@pytest.mark.parametrize(("build", "message"), [
    (lambda: regex("(unclosed"), "regex('(unclosed'): '(unclosed' is not a valid regular expression"),
    (lambda: file_matches("output/a.md", "[z-a]"), "file_matches('output/a.md', …): '[z-a]' is not a valid regular expression"),
    (lambda: file_exists("../outside.txt"), "file_exists: path '../outside.txt' leaves the job's work directory"),
    (lambda: file_exists("output/../../x"), "file_exists: path 'output/../../x' leaves the job's work directory"),
    (lambda: json_valid("/etc/passwd"), "json_valid: path '/etc/passwd' is absolute"),
    (lambda: file_exists("."), "file_exists: path '.' is the work directory itself"),
    (lambda: contains(""), "contains(''): allowed: non-empty text"),
    (lambda: contains("x", path="~/x"), "contains('x'): path '~/x' is absolute"),
    (lambda: equals_expected(path="../a"), "equals_expected: path '../a' leaves the job's work directory"),
    (lambda: llm_judge("Good?", model="gpt-4o"), "llm_judge: unknown model spec 'gpt-4o'; allowed: demo, "
                                                 "scripted:<file.yaml>, openai:<model>"),
    (lambda: llm_judge("Good?", model="scripted:/no/such/judge.yaml"), "llm_judge: scripted model file not found"),
    (lambda: llm_judge("Good?", model="replay:3"), "llm_judge: model='replay:3': a replay re-serves"),
    (lambda: llm_judge("Good?", model="demo", scale=(5, 1)), "llm_judge: scale=(5, 1); allowed: (low, high)"),
    (lambda: llm_judge("Good?", model="demo", scale=(1.0, 5.0)), "llm_judge: scale=(1.0, 5.0); allowed"),
    (lambda: llm_judge("Good?", model="demo", scale="yes/no"), "llm_judge: scale='yes/no'; allowed"),
    (lambda: llm_judge("Good?", model="demo", scale=(1, 2, 3)), "llm_judge: scale=(1, 2, 3); allowed"),
    (lambda: llm_judge("  ", model="demo"), "llm_judge: rubric '  '; allowed: non-empty text"),
    (lambda: llm_judge("Good?", model="demo", reference="output/x"), "llm_judge: reference='output/x'; allowed"),
])
def test_a_scorer_built_wrong_is_refused_in_one_line_and_nothing_is_created(
        ws: Workspace, build: Callable[[], Any], message: str) -> None:
    with pytest.raises((UsageError, ModelSpecError)) as info:
        ws.batch([{"instruction": "Answer", "expected": "41"}], model="demo", name="never",
                 scorers={"s": build()}, progress=False)
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text, text
    assert ws.batches() == [] and ws.jobs() == []


def test_an_unknown_openai_judge_needs_its_key_when_it_is_built(ws: Workspace,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ModelSpecError, match=r"^llm_judge: openai:gpt-4o-mini needs OPENAI_API_KEY"):
        llm_judge("Good?", model="openai:gpt-4o-mini")


# -- the LLM judge --------------------------------------------------------------------------------------------

def test_a_scripted_judge_is_recorded_on_the_job_apart_from_its_own_numbers(ws: Workspace, tmp_path: Path) -> None:
    judge = llm_judge("Is the answer 41?", model=_judge(tmp_path, _verdict(4, "close enough")))
    model = answering_model(tmp_path, "m", "41")  # two calls: 100 + 10 and 107 + 10 tokens
    b = ws.batch([{"instruction": "What is 6 × 7 − 1?", "expected": "41"}], piece="single", model=model,
                 name="judged", scorers={"quality": judge}, progress=False)
    job = b.jobs[0]
    assert _scores(ws, job) == [("quality", 4, None)]
    request, response = _judge_events(ws, job)
    assert isinstance(request, LLMRequest) and isinstance(response, LLMResponse)
    assert (request.movement_seq, request.iteration, request.tools, request.messages) == (None, None, ["verdict"], 2)
    assert response.movement_seq is None and response.model == judge.model and judge.model.startswith("scripted:/")
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (300, 25, 325)
    assert response.latency_s is not None and response.latency_s >= 0
    assert response.tool_calls[0].arguments == {"score": 4, "reason": "close enough"}
    assert request.id is not None and response.id is not None and request.id < response.id
    # the job's own numbers leave the judge out: in the batch's frame, frames.jobs and the header's totals
    row = b.frame.iloc[0]
    assert (row["llm_calls"], row["total_tokens"], row["cost_usd"], row["judge_cost_usd"]) == (2, 227, 0.0, 0.0)
    jobs = ws.frames.jobs().set_index("job")
    assert (jobs.loc[job.id, "llm_calls"], jobs.loc[job.id, "total_tokens"]) == (2, 227)
    assert "judge_cost_usd" in b.summary().columns and b.summary()["judge_cost_usd"].tolist() == [0.0]
    # frames.usage shows the judge's call with its purpose, outside any run, not in the job's running sum
    usage = ws.frames.usage(job)
    assert usage["purpose"].tolist()[:2] == [None, None] or usage["purpose"].isna().tolist()[:2] == [True, True]
    judged = usage[usage["purpose"] == "judge"]
    assert len(judged) == 1 and judged["seq"].isna().all() and judged["movement"].isna().all()
    assert judged["total_tokens"].tolist() == [325] and judged["cumulative_tokens"].tolist() == [227]
    assert usage["cumulative_tokens"].iloc[-1] == 227
    # the context views leave it out: the what-if simulation and the usage plot see the job's own two calls
    assert len(ws.frames.what_if(job)) == 2 and len(usage) == 3
    table = usage_table(usage)
    assert "(judge)" in (table if isinstance(table, str) else table.to_html())
    # and the job's messages are its own conversation
    assert "close enough" not in " ".join(ws.frames.messages(job)["content"].dropna())
    # nor does a budget count it (docs/design-lab.md#budgets): the calls a limit adds up are the job's two
    assert [c[3] for c in reads.tree_calls(ws.store, job.id)] == [110, 117]
    assert [c[3] for c in reads.tree_calls(ws.store, batch="judged")] == [110, 117]


def test_the_judge_is_shown_in_the_jobs_view_under_scores(ws: Workspace, tmp_path: Path) -> None:
    judge = llm_judge("Is the answer 41?", model=_judge(tmp_path, _verdict(2, "the <answer> is off by one")))
    job = ws.run(ws.submit("Answer", piece="single", model=answering_model(tmp_path, "m", "40")))
    ws.score(job, {"quality": judge, "has": contains("40")})
    html = job_html(ws, job.id)
    section = html[html.index('class="anb-scores"'):]
    assert "<b>scores</b>" in section and "1 judge call" in section
    assert "<b>quality</b> = 2" in section and "<b>has</b> = true" in section
    assert "score 2 — the &lt;answer&gt; is off by one" in section and "<answer>" not in section
    assert "325 tokens" in section and "(300 + 25)" in section and "$0" in section
    assert "judge.yaml" in section
    # the view of a job never scored has no such section
    other = ws.run(ws.submit("Answer", piece="single", model=answering_model(tmp_path, "m2", "41")))
    assert "anb-scores" not in job_html(ws, other.id)


def test_a_verdict_that_cannot_be_read_is_the_scores_error_never_a_guess(ws: Workspace, tmp_path: Path) -> None:
    script = _judge(tmp_path,
                    {"content": "I would say 4 out of 5."},  # text, no verdict call
                    _verdict(9),  # off the scale
                    _verdict("four"),  # not a whole number
                    _verdict(3.5),  # not a whole number either
                    {"tool_calls": [{"name": "verdict", "arguments": {"reason": "no score"}}]},
                    {"tool_calls": [{"name": "verdict", "arguments": {"score": 2, "reason": "a"}},
                                    {"name": "verdict", "arguments": {"score": 3, "reason": "b"}}]},
                    {"tool_calls": [{"name": "Read", "arguments": {"path": "output/answer.txt"}}]},
                    _verdict(5.0),  # JSON's 5.0 is 5
                    _verdict(1))
    judge = llm_judge("Is the answer 41?", model=script)
    job = ws.run(ws.submit("Answer", piece="single", model=answering_model(tmp_path, "m", "41")))
    for _ in range(9):
        ws.score(job, {"q": judge})
    got = [(v, e) for _, v, e in _scores(ws, job)]
    assert got == [
        (None, "JudgeError: the judge did not call verdict (it said 'I would say 4 out of 5.'); no verdict"),
        (None, "JudgeError: the judge's score 9 is not on the scale; allowed: a whole number from 1 to 5"),
        (None, "JudgeError: the judge's score 'four' is not on the scale; allowed: a whole number from 1 to 5"),
        (None, "JudgeError: the judge's score 3.5 is not on the scale; allowed: a whole number from 1 to 5"),
        (None, """JudgeError: the judge's verdict has no score: arguments '{"reason": "no score"}'"""),
        (None, "JudgeError: the judge called verdict 2 times; one verdict is needed"),
        (None, "JudgeError: the judge did not call verdict (it called Read instead); no verdict"),
        (5, None), (1, None)]
    assert len(_judge_events(ws, job)) == 18  # every call recorded, answered or not read
    # a call that fails is the score's error too (the script has no tenth answer), and leaves no response
    ws.score(job, {"q": judge})
    assert _scores(ws, job)[-1][2].startswith(
        "JudgeError: the judge's call to scripted:") and "ran out of responses" in _scores(ws, job)[-1][2]
    assert [type(e).__name__ for e in _judge_events(ws, job)[-2:]] == ["LLMResponse", "LLMRequest"]


def test_pass_fail_and_the_demo_judge(ws: Workspace, tmp_path: Path) -> None:
    script = _judge(tmp_path, _verdict("pass"), _verdict("fail"), _verdict("PASS"), _verdict(True))
    judge = llm_judge("Correct?", model=script, scale="pass/fail")
    demo = {"demo": llm_judge("Correct?", model="demo"), "demo_pf": llm_judge("Correct?", model="demo",
                                                                                 scale="pass/fail"),
            "demo_wide": llm_judge("Correct?", model="demo", scale=(0, 10))}
    job = ws.run(ws.submit("Answer", piece="single", model=answering_model(tmp_path, "m", "41")))
    for _ in range(4):
        ws.score(job, {"pf": judge})
    ws.score(job, demo)
    values = [(n, v, e) for n, v, e in _scores(ws, job)]
    assert values[:2] == [("pf", True, None), ("pf", False, None)]
    assert [e for _, _, e in values[2:4]] == [
        "JudgeError: the judge's score 'PASS' is not on the scale; allowed: 'pass' or 'fail'",
        "JudgeError: the judge's score True is not on the scale; allowed: 'pass' or 'fail'"]
    assert values[4:] == [("demo", 5, None), ("demo_pf", True, None), ("demo_wide", 10, None)]


def test_a_job_with_nothing_to_judge_scores_the_lowest_without_a_call(ws: Workspace, tmp_path: Path) -> None:
    broken = write_script(tmp_path, "broken", {"work": []})  # the first call fails: no movement ends, no summary
    job = ws.run(ws.submit("Answer", piece="single", model=broken))
    assert job.status == "failed" and job.summary is None
    judge = llm_judge("Correct?", model=_judge(tmp_path, _verdict(5)))
    ws.score(job, {"q": judge, "pf": llm_judge("Correct?", model="demo", scale="pass/fail"),
                   "file": llm_judge("Correct?", model="demo", path="output/answer.txt")})
    assert _scores(ws, job) == [("q", 1, None), ("pf", False, None), ("file", 1, None)]
    assert _judge_events(ws, job) == []


def test_rescoring_with_a_judge_runs_no_job_and_the_latest_verdict_counts(ws: Workspace, tmp_path: Path) -> None:
    script = _judge(tmp_path, _verdict(2), _verdict(5))
    model = answering_model(tmp_path, "m", "41")
    b = ws.batch([{"instruction": "Answer", "expected": "41"}] * 2, piece="single", model=model, name="again",
                 progress=False)
    own = [len([e for e in ws.events(j, kinds=["llm_response"]) if e.purpose is None]) for j in b.jobs]
    ws.score(b, {"q": llm_judge("Right?", model=script)})
    assert b.frame["q"].tolist() == [2, 2]  # each job's first judge call: the script's first answer
    ws.score("again", {"q": llm_judge("Right?", model=script)})
    assert b.frame["q"].tolist() == [5, 5] and b.summary()["mean_q"].tolist() == [5.0]
    assert [len([e for e in ws.events(j, kinds=["llm_response"]) if e.purpose is None]) for j in b.jobs] == own
    assert [len(_judge_events(ws, j)) for j in b.jobs] == [4, 4]
    assert b.counts()["succeeded"] == 2


def test_an_openai_judge_on_a_real_endpoint_is_priced_apart(ws: Workspace, tmp_path: Path,
                                                             loopback: Callable[..., OpenAIServer]) -> None:
    server = loopback("sk-judge-test", timeout="5", retries="0")
    server.actions = [reply(None, [("verdict", {"score": 4, "reason": "correct, terse"})], usage=(1500, 40)),
                      reply(None, [("verdict", '{"score": 4, "reason": ')], usage=(1500, 10))]
    judge = llm_judge("Is the answer the right number?", model="openai:gpt-4o-mini")
    b = ws.batch([{"instruction": "What is 6 × 7 − 1?", "expected": "41"}], piece="single",
                 model=answering_model(tmp_path, "m", "41"), name="priced", scorers={"q": judge}, progress=False)
    job = b.jobs[0]
    assert _scores(ws, job) == [("q", 4, None)]
    # what the endpoint was sent: the verdict tool, forced; the rubric, the task, the reference and the answer
    sent = server.received[0].body
    assert sent["model"] == "gpt-4o-mini" and sent["tool_choice"] == {"type": "function", "function": {"name": "verdict"}}
    [tool] = sent["tools"]
    assert tool["function"]["name"] == "verdict"
    assert tool["function"]["parameters"]["properties"]["score"] == {
        "type": "integer", "minimum": 1, "maximum": 5, "description": "a whole number from 1 (worst) to 5 (best)"}
    user = sent["messages"][-1]["content"]
    for part in ("Is the answer the right number?", "What is 6 × 7 − 1?", "## Reference answer\n41",
                 "## The agent's answer (its final summary)\nanswered 41"):
        assert part in user, part
    # priced by genai-prices at the call's time, apart from the job's own cost (0: a scripted model)
    response = next(e for e in _judge_events(ws, job) if isinstance(e, LLMResponse))
    assert response.response_model is not None and response.finish_reason is not None
    price = float(calc_price(Usage(input_tokens=1500, output_tokens=40), "gpt-4o-mini",
                             genai_request_timestamp=datetime.fromtimestamp(response.ts, timezone.utc)).total_price)
    assert price > 0
    row = b.frame.iloc[0]
    assert row["cost_usd"] == 0.0 and row["judge_cost_usd"] == pytest.approx(price, rel=1e-12)
    assert b.summary()["judge_cost_usd"].tolist() == pytest.approx([price], rel=1e-12)
    assert "LLM judges $" in b._repr_html_()  # the summary's cost cell says it, apart from the jobs' own
    usage = ws.frames.usage(job)
    judged = usage[usage["purpose"] == "judge"]
    assert judged["cost_usd"].tolist() == pytest.approx([price], rel=1e-12)
    assert usage[usage["purpose"] != "judge"]["cost_usd"].sum() == 0.0
    assert ws.frames.jobs().set_index("job").loc[job.id, "cost_usd"] == 0.0
    # an answer whose arguments are not JSON is no verdict
    ws.score(job, {"q": judge})
    assert _scores(ws, job)[-1] == ("q", None, """JudgeError: the judge's verdict has no score: arguments '{"score": 4, "reason": '""")
    assert b.frame["judge_cost_usd"].iloc[0] > price  # the second call was spent too


def test_a_judge_judges_a_file_and_sees_no_reference_when_told(ws: Workspace, tmp_path: Path,
                                                               loopback: Callable[..., OpenAIServer]) -> None:
    server = loopback("sk-judge-test", timeout="5", retries="0")
    server.actions = [reply(None, [("verdict", {"score": "pass", "reason": "ok"})])]
    judge = llm_judge("Is it a number?", model="openai:gpt-4o-mini", scale="pass/fail", reference=None,
                      path="output/answer.txt", max_chars=100)
    model = write_script(tmp_path, "long", {"work": [call("Write", path="output/answer.txt", content="4" * 250),
                                                     transition("COMPLETE", summary="wrote it")]})
    b = ws.batch([{"instruction": "Answer", "expected": {"secret": "reference"}}], piece="single", model=model,
                 name="file", scorers={"ok": judge}, progress=False)
    assert b.frame["ok"].tolist() == [True]
    body = json.dumps(server.received[0].body)
    assert "reference" not in body.replace("the reference answer when there is one", "")
    user = server.received[0].body["messages"][-1]["content"]
    assert "## The agent's answer (output/answer.txt)\n" + "4" * 100 + "\n[… 150 more characters not shown]" in user
    assert server.received[0].body["tools"][0]["function"]["parameters"]["properties"]["score"]["enum"] == ["pass", "fail"]
