"""The call cache (docs/design-lab.md#call-cache): an identical request answered from the store's recorded response —
0 tokens and $0, ``cached: true`` on its ``llm_response``, shown in the view and in ``frames.usage`` — on SQLite and
PostgreSQL, across processes, an hour later; ``agentnb cache stats`` / ``clear``; bad modes refused whole."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _batching import DRAFT_REVIEW, answering_model, draft_review
from _scripting import write_piece, write_script
from openai_server import OpenAIServer, reply

from agentnb import AgentnbError, Workspace
from agentnb.cli import main
from agentnb.engine.prompts import clock_block
from agentnb.events import LLMResponse, MovementStart
from agentnb.views.render import job_html

ROOT = Path(__file__).resolve().parents[1]


def _cases(n: int = 2) -> list[dict[str, Any]]:
    return [{"instruction": f"Answer question {i}", "expected": str(40 + i)} for i in range(n)]


def _responses(ws: Workspace, job_id: int) -> list[LLMResponse]:
    return [e for e in ws.events(job_id, ["llm_response"]) if isinstance(e, LLMResponse)]


def _clock(ws: Workspace, job_id: int) -> str | None:
    start = next(e for e in ws.events(job_id, ["movement_start"]) if isinstance(e, MovementStart))
    return clock_block(start.user)


# -- a second identical run, on both backends --------------------------------------------------------------------------

def test_a_second_identical_batch_costs_nothing_through_the_cache(store_url: str, tmp_path: Path) -> None:
    """The same cases on the same piece and model again, with ``cache=True``: every call is answered from the store
    (``cached: true``, 0 tokens, $0) with the first run's response, and the jobs end as the first run's did."""
    ws = Workspace(tmp_path / "ws", store=store_url)
    try:
        model = answering_model(tmp_path, "m", "41")
        first = ws.batch(_cases(), piece=draft_review(tmp_path), model=model, name="first", cache=True,
                         progress=False)
        second = ws.batch(_cases(), piece=draft_review(tmp_path), model=model, name="second", cache=True,
                          progress=False)
        f1, f2 = first.frame, second.frame
        assert list(f1["status"]) == list(f2["status"]) == ["succeeded"] * 2
        assert (f1["total_tokens"] > 0).all() and (f1["total_tokens"] == [110 + 113 + 211] * 2).all()
        assert (f2["total_tokens"] == 0).all() and (f2["cost_usd"] == 0).all()
        for a, b in zip(first.jobs, second.jobs, strict=True):
            ra, rb = _responses(ws, a.id), _responses(ws, b.id)
            assert len(ra) == len(rb) == 3
            assert all(r.cached is None for r in ra) and all(r.cached is True for r in rb)
            assert [(r.content, r.tool_calls) for r in ra] == [(r.content, r.tool_calls) for r in rb]
            assert all(r.usage.total_tokens == 0 and r.usage.ratio is not None for r in rb)
            assert (b.output / "answer.txt").read_text() == "41"
        usage = ws.frames.usage()
        assert list(usage.groupby("job")["cached"].all()) == [False, False, True, True]
        assert usage.loc[usage["cached"], "cost_usd"].eq(0).all()
        # the job's totals count nothing cached: frames.jobs and the job's numbers agree
        jobs = ws.frames.jobs().set_index("job")
        assert [int(jobs.loc[j.id, "total_tokens"]) for j in second.jobs] == [0, 0]
    finally:
        ws.close()


def test_the_view_and_the_frames_show_a_cached_call(ws: Workspace, tmp_path: Path) -> None:
    model = answering_model(tmp_path, "m", "41")
    a = ws.run(ws.submit("Answer question 1", piece="single", model=model, cache=True))
    b = ws.run(ws.submit("Answer question 1", piece="single", model=model, cache=True))
    assert "answered from the call cache" not in job_html(ws, a.id)
    html = job_html(ws, b.id)
    assert html.count("answered from the call cache, no tokens spent") == 2
    usage = ws.frames.usage(b)
    assert list(usage["cached"]) == [True, True] and list(usage["total_tokens"]) == [0, 0]
    assert list(ws.frames.usage(a)["cached"]) == [False, False]
    # stored only when true: the first job's responses have no `cached` key at all
    raw = ws.store.rows("SELECT payload FROM events WHERE kind='llm_response' AND job_id=?", (a.id,))[1]
    assert raw and all('"cached"' not in str(p[0]) for p in raw)


def test_without_cache_nothing_is_looked_up_or_recorded(ws: Workspace, tmp_path: Path) -> None:
    model = answering_model(tmp_path, "m", "41")
    ws.run(ws.submit("Answer question 1", piece="single", model=model))
    b = ws.run(ws.submit("Answer question 1", piece="single", model=model))
    assert ws.store.rows("SELECT COUNT(*) FROM call_cache")[1] == [(0,)]
    assert all(r.cached is None and r.usage.total_tokens > 0 for r in _responses(ws, b.id))
    # the workspace's default, and a job's own word over it
    cached_ws = Workspace(tmp_path / "ws", cache=True)
    c = cached_ws.run(cached_ws.submit("Answer question 1", piece="single", model=model))
    d = cached_ws.run(cached_ws.submit("Answer question 1", piece="single", model=model))
    e = cached_ws.run(cached_ws.submit("Answer question 1", piece="single", model=model, cache=False))
    assert all(r.cached is None for r in _responses(ws, c.id))
    assert all(r.cached is True for r in _responses(ws, d.id))
    assert all(r.cached is None and r.usage.total_tokens > 0 for r in _responses(ws, e.id))


def test_a_fork_of_a_cached_job_asks_its_model_anew(ws: Workspace, tmp_path: Path) -> None:
    model = answering_model(tmp_path, "m", "41")
    ws.run(ws.submit("Answer question 1", piece="single", model=model, cache=True))
    b = ws.run(ws.submit("Answer question 1", piece="single", model=model, cache=True))
    assert all(r.cached for r in _responses(ws, b.id))
    fork = ws.fork(b, at=1)
    assert fork.status == "succeeded" and "cache" not in ws.store.job(fork.id).options.extra
    assert all(r.cached is None and r.usage.total_tokens > 0 for r in _responses(ws, fork.id))


def test_a_recorded_response_keeps_no_secret(ws: Workspace, tmp_path: Path) -> None:
    """A response repeating a key-shaped secret is recorded scrubbed, as its llm_response is, and re-served so."""
    key = "sk-test0123456789abcdefghijKLMN"
    model = write_script(tmp_path, "leaky", {"work": [
        {"content": f"the key is {key}", "tool_calls": [{"name": "transition",
                                                          "arguments": {"next_step": "COMPLETE", "summary": "ok"}}]}]})
    ws.run(ws.submit("Say the key", piece="single", model=model, cache=True))
    b = ws.run(ws.submit("Say the key", piece="single", model=model, cache=True))
    bodies = [str(r[0]) for r in ws.store.rows("SELECT body FROM call_cache WHERE kind='call'")[1]]
    assert len(bodies) == 1 and key not in bodies[0] and "the key is" in bodies[0]
    (hit,) = _responses(ws, b.id)
    assert hit.cached is True and key not in (hit.content or "") and (hit.content or "").startswith("the key is ")


# -- only what changed spends tokens -------------------------------------------------------------------------------------

def _draft_review_answers(body: dict[str, Any]) -> dict[str, Any]:
    """An endpoint for the draft-review piece: the draft writes, then hands over; the review completes."""
    messages = body["messages"]
    answered = sum(1 for m in messages if m["role"] == "assistant")
    if "You draft." in str(messages[0]["content"]):
        if answered == 0:
            return reply(tool_calls=[("Write", {"path": "output/answer.txt", "content": "42"})], usage=(100, 10))
        return reply(tool_calls=[("transition", {"next_step": "review", "summary": "drafted"})], usage=(120, 10))
    return reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "reviewed"})], usage=(200, 11))


def test_changing_only_the_last_movements_prompt_spends_tokens_only_from_it_on(
        loopback: Callable[..., OpenAIServer], tmp_path: Path) -> None:
    """The endpoint counts what it is asked: a batch again with the review's instruction changed asks it only the
    review's calls; the draft's are answered from the cache, 0 tokens."""
    srv = loopback(responder=_draft_review_answers)
    ws = Workspace(tmp_path / "ws", cache=True)
    first = ws.batch(_cases(), piece=draft_review(tmp_path), model="openai:gpt-4o-mini", name="v1", progress=False)
    assert len(srv.received) == 6 and all(j.status == "succeeded" for j in first.jobs)
    changed = {**DRAFT_REVIEW, "movements": [DRAFT_REVIEW["movements"][0],
                                             {**DRAFT_REVIEW["movements"][1], "instruction": "Check it twice."}]}
    second = ws.batch(_cases(), piece=write_piece(tmp_path / "v2", "draft-review", changed),
                      model="openai:gpt-4o-mini", name="v2", progress=False)
    assert len(srv.received) == 6 + 2  # one review call per case
    assert all(j.status == "succeeded" for j in second.jobs)
    usage = ws.frames.usage()
    for job in second.jobs:
        rows = usage[usage["job"] == job.id]
        assert list(rows["movement"]) == ["draft", "draft", "review"]
        assert list(rows["cached"]) == [True, True, False]
        assert list(rows["total_tokens"]) == [0, 0, 211]
    assert list(second.frame["total_tokens"]) == [211, 211]
    assert (first.frame["cost_usd"] > 0).all() and (second.frame["cost_usd"] < first.frame["cost_usd"]).all()


# -- across processes, an hour later ---------------------------------------------------------------------------------

_RUN = textwrap.dedent("""
    import sys
    from agentnb import Workspace
    ws = Workspace(sys.argv[1], store=sys.argv[2])
    job = ws.run(ws.submit("Answer question 1", piece="single", model=sys.argv[3], cache=sys.argv[4] == "on"))
    print(job.id, job.status)
    ws.close()
""")


def _run_in_process(tmp_path: Path, folder: str, store: str, model: str, cache: str, tz: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTNB_STORE")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env["TZ"] = tz
    done = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path / folder), store, model, cache], env=env,
                          text=True, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    job_id, status = done.stdout.split()
    assert status == "succeeded"
    return int(job_id)


def test_another_process_an_hour_later_still_hits_the_cache(store_url: str, tmp_path: Path) -> None:
    """Two processes on one store, the second's wall clock an hour ahead (``TZ``: the same zone name, one hour
    east): its prompts would read an hour later, yet its job reuses the first one's clock, so its every call is
    answered from the cache.  A job without the cache in the same process shows that its clock did differ."""
    model = answering_model(tmp_path, "m", "41")
    first = _run_in_process(tmp_path, "p1", store_url, model, "on", "ANB0")
    later = _run_in_process(tmp_path, "p2", store_url, model, "on", "ANB-1")
    plain = _run_in_process(tmp_path, "p2", store_url, model, "off", "ANB-1")
    ws = Workspace(tmp_path / "reader", store=store_url)
    try:
        assert _clock(ws, later) == _clock(ws, first)
        assert _clock(ws, plain) != _clock(ws, first)
        hh = [int(str(_clock(ws, j)).splitlines()[1].split()[1][:2]) for j in (first, plain)]
        assert (hh[1] - hh[0]) % 24 == 1
        assert all(r.cached is None for r in _responses(ws, first))
        assert [r.cached for r in _responses(ws, later)] == [True, True]
        assert all(r.usage.total_tokens == 0 for r in _responses(ws, later))
    finally:
        ws.close()


# -- agentnb cache stats / clear ----------------------------------------------------------------------------------------

def test_cache_stats_and_clear_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(tmp_path / "ws")
    assert main(["--workspace", folder, "cache", "stats"]) == 0
    assert "empty" in capsys.readouterr().out
    for _ in range(2):  # the demo's report is long: its body is stored once in `texts`
        assert main(["--workspace", folder, "run", "--cache", "--no-follow", "Summarise the task"]) == 0
    capsys.readouterr()
    ws = Workspace(folder)
    long_bodies = ws.store.rows("SELECT COUNT(*) FROM call_cache WHERE body_ref IS NOT NULL")[1][0][0]
    responses = ws.store.rows("SELECT COUNT(*) FROM call_cache WHERE kind='call'")[1][0][0]
    assert long_bodies >= 1 and responses == len(_responses(ws, 1))
    saved = ws.store.rows("SELECT SUM(prompt_tokens + completion_tokens) FROM call_cache")[1][0][0]
    assert saved == int(ws.frames.jobs().set_index("job").loc[1, "total_tokens"]) != 0
    assert main(["--workspace", folder, "cache", "stats"]) == 0
    out = capsys.readouterr().out
    assert f"{responses} responses, 1 clock\n" in out and f"hits: {responses};" in out
    assert f"tokens saved: {saved:,}" in out and "models: demo" in out
    # nothing is a week old yet
    assert main(["--workspace", folder, "cache", "clear", "--older-than", "7d"]) == 0
    assert "cleared 0 cache entries older than 7d" in capsys.readouterr().out
    assert main(["--workspace", folder, "cache", "clear"]) == 0
    assert f"cleared {responses + 1} cache entries" in capsys.readouterr().out
    assert ws.store.rows("SELECT COUNT(*) FROM call_cache")[1] == [(0,)]
    # the long bodies went with their rows; a job's own long texts stay
    assert ws.store.rows("SELECT COUNT(*) FROM texts")[1] == [(0,)]
    assert main(["--workspace", folder, "cache", "clear", "--older-than", "a week"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("agentnb: error: --older-than 'a week' is not an age; allowed: a number and a unit s, m, h, d "
                   "or w (e.g. 7d, 12h)")
    # a third run asks the model again: the cache is empty
    assert main(["--workspace", folder, "run", "--cache", "--no-follow", "Summarise the task"]) == 0
    assert all(r.cached is None for r in _responses(ws, 3))


# -- bad input --------------------------------------------------------------------------------------------------------

def test_an_unknown_cache_mode_is_refused_in_one_line_and_nothing_is_created(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    allowed = "allowed: 'on' (or True), 'across-epochs' or 'off' (or False); not given, the workspace's mode"
    with pytest.raises(AgentnbError, match=r"^cache='sometimes' is not a cache mode; " + _re(allowed) + "$"):
        Workspace(tmp_path / "never", cache="sometimes")
    assert not (tmp_path / "never").exists()
    ws = Workspace(tmp_path / "ws")
    with pytest.raises(AgentnbError, match=r"^cache='epochs' is not a cache mode"):
        ws.submit("x", piece="single", model="demo", cache="epochs")
    with pytest.raises(AgentnbError, match=r"^cache=1 is not a cache mode"):
        ws.batch(_cases(), piece="single", model="demo", cache=1, name="b", progress=False)
    assert ws.jobs() == [] and ws.batches() == [] and not (tmp_path / "ws" / "jobs").exists()
    assert main(["--workspace", str(tmp_path / "ws"), "run", "--cache=bogus", "x"]) == 2
    assert capsys.readouterr().err.strip() == f"agentnb: error: --cache 'bogus' is not a cache mode; {allowed}"
    assert ws.jobs() == []


def _re(text: str) -> str:
    import re

    return re.escape(text)


# -- epochs (docs/design-lab.md#epochs) ------------------------------------------------------------------

def test_cached_responses_never_cross_epochs_unless_asked(tmp_path: Path) -> None:
    model = answering_model(tmp_path, "m", "41")
    ws = Workspace(tmp_path / "ws")
    on = ws.batch(_cases(1), piece="single", model=model, name="on", cache=True, progress=False, epochs=2)
    # epoch 2 asked the model again: its calls are not epoch 1's
    assert all(r.cached is None for j in on.jobs for r in _responses(ws, j.id))
    across = ws.batch(_cases(1), piece="single", model=model, name="across", cache="across-epochs",
                      concurrency=1, progress=False, epochs=2)
    cached = [all(r.cached for r in _responses(ws, j.id)) for j in across.jobs]
    assert sorted(cached) == [False, True]  # the epoch run first recorded, the other reused it
