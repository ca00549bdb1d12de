"""Cost in US dollars (docs/design-lab.md#cost): every LLM call priced from genai-prices' bundled data, shown in
``frames.usage``, ``frames.jobs``, the job header, the panel's job list and the ``%agent usage`` table; and the
batch/case columns and score events in the views.

Paid models run through the loopback OpenAI-protocol server with known usage numbers; the expected dollars
are computed by genai-prices' own ``calc_price`` at each call's recorded time.
"""

from __future__ import annotations

import math
import re
import socket
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import genai_prices
import pandas as pd
import pytest
from _scripting import call, transition, write_script
from genai_prices import Usage, calc_price
from genai_prices.data_snapshot import DataSnapshot, set_custom_snapshot
from genai_prices.update_prices import UpdatePrices
from openai_server import OpenAIServer, reply

from agentnb import Workspace
from agentnb.models import prices
from agentnb.models.prices import UnknownPriceWarning, call_cost, dollars
from agentnb.notebook.panel import Panel
from agentnb.views.render import header_html
from agentnb.views.usage_table import UsageFrame

KEY = "sk-cost-test-key-0000"
USAGE = [(1200, 30), (1500, 20), (1800, 15)]


@pytest.fixture
def server(loopback: Callable[..., OpenAIServer]) -> OpenAIServer:
    return loopback(KEY, timeout="5", retries="1")


def _openai_job(ws: Workspace, server: OpenAIServer, model: str, usage: list[tuple[int, int]] = USAGE) -> Any:
    """A finished ``single`` job of ``len(usage)`` calls answered with exactly those token counts."""
    server.actions = [reply("Looking.", [("Glob", {"pattern": "*"})], usage=u) for u in usage[:-1]]
    server.actions.append(reply(None, [("transition", {"next_step": "COMPLETE", "summary": "done"})], usage=usage[-1]))
    job = ws.run(ws.submit("look around", piece="single", model=model))
    assert job.status == "succeeded", job.error
    return job


def _expected(model_name: str, ws: Workspace, job: Any) -> list[float]:
    """genai-prices' own price of each call of ``job``, at the time the call was recorded."""
    out = []
    for ev in ws.events(job, kinds=["llm_response"]):
        u = ev.payload["usage"]
        when = datetime.fromtimestamp(ev.ts, timezone.utc)
        price = calc_price(Usage(input_tokens=u["prompt_tokens"], output_tokens=u["completion_tokens"]),
                           model_name, genai_request_timestamp=when)
        out.append(float(price.total_price))
    return out


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No network, no price download, and a custom genai-prices snapshot with no prices at all: whatever is
    priced here came from the bundled data, looked up afresh (the lookups are cached per process)."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a socket was opened while pricing: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(UpdatePrices, "start", refuse)
    monkeypatch.setattr(genai_prices, "wait_prices_updated_sync", refuse)
    for cached in (prices._snapshot, prices._model, prices._rates, prices._by_time_of_day):
        cached.cache_clear()
    set_custom_snapshot(DataSnapshot(providers=[], from_auto_update=True))
    try:
        yield
    finally:
        set_custom_snapshot(None)


def test_a_known_model_is_priced_per_call_from_the_bundled_data(ws: Workspace, server: OpenAIServer,
                                                                 request: pytest.FixtureRequest) -> None:
    job = _openai_job(ws, server, "openai:gpt-4o-mini")
    expected = _expected("gpt-4o-mini", ws, job)
    assert all(e > 0 for e in expected)
    request.getfixturevalue("offline")  # from here on: no socket, no download, no custom snapshot used
    usage = ws.frames.usage(job)
    assert usage["cost_usd"].dtype == "float64"
    assert usage["cost_usd"].tolist() == pytest.approx(expected, rel=1e-12)
    # per-call sums = the job's cost, in frames.jobs() and in the header
    jobs = ws.frames.jobs().set_index("job")
    assert jobs.loc[job.id, "cost_usd"] == pytest.approx(sum(expected), rel=1e-12)
    assert jobs.loc[job.id, "cost_usd"] == pytest.approx(usage["cost_usd"].sum(), rel=1e-12)
    assert f" · {dollars(sum(expected))} · running time" in header_html(ws, job.id)


def test_a_cheap_job_reads_as_plain_dollars_never_in_scientific_notation(ws: Workspace,
                                                                          server: OpenAIServer) -> None:
    # a few gpt-4o-mini calls cost a few hundred-thousandths of a dollar: "$0.000042", not "$4.2e-05"
    job = _openai_job(ws, server, "openai:gpt-4o-mini")
    cost = float(ws.frames.jobs().set_index("job").loc[job.id, "cost_usd"])
    assert 0 < cost < 0.001
    shown = dollars(cost)
    assert re.fullmatch(r"\$0\.0{3,}[1-9]\d?", shown), shown
    assert float(shown[1:]) == pytest.approx(cost, rel=0.05)
    assert f" · {shown} · running time" in header_html(ws, job.id)
    assert [dollars(c) for c in (0.00018, 0.0000042, 0.0123, 2.5)] == ["$0.00018", "$0.0000042", "$0.0123", "$2.50"]


def test_each_call_is_priced_at_its_own_time(ws: Workspace, server: OpenAIServer,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """o3's price fell on 2025-06-10: the same calls cost 5x more before, and a job running over that
    midnight pays both prices; a tiered model (gpt-5.6-luna) is priced call by call; each job's total is
    the sum of its calls."""
    real_time = time.time
    jobs = {}
    for label, day in (("before", datetime(2025, 6, 1, 12, tzinfo=timezone.utc)),
                       ("after", datetime(2025, 7, 1, 12, tzinfo=timezone.utc))):
        shift = day.timestamp() - real_time()
        monkeypatch.setattr(time, "time", lambda shift=shift: real_time() + shift)
        jobs[label] = _openai_job(ws, server, "openai:o3")
    # a job whose calls cross midnight into the day of the new price: each clock reading is an hour later
    hours = iter(range(10_000))
    start = datetime(2025, 6, 9, 10, tzinfo=timezone.utc).timestamp()  # calls ≈ 21:00, 02:00, 07:00
    monkeypatch.setattr(time, "time", lambda: start + 3600 * next(hours))
    jobs["over midnight"] = _openai_job(ws, server, "openai:o3")
    monkeypatch.setattr(time, "time", real_time)
    jobs["tiered"] = _openai_job(ws, server, "openai:gpt-5.6-luna", usage=[(300_000, 100), (1000, 50)])
    table = ws.frames.jobs().set_index("job")
    for label, job in jobs.items():
        model = job.model.partition(":")[2]
        expected = _expected(model, ws, job)
        assert ws.frames.usage(job)["cost_usd"].tolist() == pytest.approx(expected, rel=1e-12), label
        assert table.loc[job.id, "cost_usd"] == pytest.approx(sum(expected), rel=1e-12), label
    assert table.loc[jobs["before"].id, "cost_usd"] == pytest.approx(5 * table.loc[jobs["after"].id, "cost_usd"])
    midnight = ws.frames.usage(jobs["over midnight"])
    assert midnight["timestamp"].dt.date.nunique() > 1 and midnight["cost_usd"].nunique() > 1
    # all jobs at once: the same prices as one by one
    every = ws.frames.usage()
    assert every.groupby("job")["cost_usd"].sum().to_dict() == pytest.approx(table["cost_usd"].to_dict())


def test_an_unknown_model_is_na_with_one_warning_naming_it(ws: Workspace, server: OpenAIServer) -> None:
    name = f"no-such-model-{uuid.uuid4().hex[:8]}"  # unseen in this process: its one warning is still to come
    job = _openai_job(ws, server, f"openai:{name}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        usage = ws.frames.usage(job)
        jobs = ws.frames.jobs().set_index("job")
        html = header_html(ws, job.id)
    assert usage["cost_usd"].isna().all() and len(usage) == len(USAGE)
    assert math.isnan(jobs.loc[job.id, "cost_usd"])
    found = [w for w in caught if issubclass(w.category, UnknownPriceWarning)]
    assert len(found) == 1, [str(w.message) for w in found]
    assert name in str(found[0].message)
    assert f"cost unknown (model {name} has no price)" in html
    # its usage table says so too, and leaves the cells blank
    table = UsageFrame.of(usage)._repr_html_()
    assert table is not None and "cost unknown" in table


def test_offline_models_cost_nothing(ws: Workspace, tmp_path: Path) -> None:
    demo = ws.run(ws.submit("hello", model="demo"))
    scripted = ws.run(ws.submit("hello", piece="single", model=write_script(tmp_path, "s.yaml", {"work": [
        call("Glob", pattern="*"), transition("COMPLETE", "done")]})))
    for job in (demo, scripted):
        usage = ws.frames.usage(job)
        assert len(usage) > 0 and (usage["cost_usd"] == 0.0).all()
        assert "· $0 (offline model) ·" in header_html(ws, job.id)
    assert (ws.frames.jobs()["cost_usd"] == 0.0).all()
    assert call_cost("replay:1", 1000, 100) == 0.0
    # offline runs get no cost column in the compact usage table (every cell would read $0)
    table = UsageFrame.of(ws.frames.usage(demo))._repr_html_()
    assert table is not None and "cost" not in table


def test_the_panel_job_list_and_usage_table_show_the_cost(ws: Workspace, server: OpenAIServer) -> None:
    job = _openai_job(ws, server, "openai:gpt-4o-mini")
    cost = sum(_expected("gpt-4o-mini", ws, job))
    panel = Panel(ws)
    try:
        label = next(label for label, value in panel.jobs.options if value == job.id)
    finally:
        panel.close()
    assert label.endswith(f" tokens · {dollars(cost)}"), label
    table = UsageFrame.of(ws.frames.usage(job))._repr_html_()
    assert table is not None and f"{len(USAGE)} LLM calls" in table and dollars(cost) in table


def test_jobs_frame_has_batch_and_case(ws: Workspace) -> None:
    plain = ws.run(ws.submit("plain", model="demo"))
    b = ws.batch([{"instruction": "first"}, {"instruction": "second"}], piece="single", model="demo", name="exp",
                 progress=False)
    jobs = ws.frames.jobs().set_index("job")
    assert jobs["batch"].dtype == "string" and jobs["case"].dtype == "Int64"
    assert jobs.loc[plain.id, ["batch", "case"]].isna().all()
    mine = jobs.loc[[j.id for j in b.jobs]]
    assert mine["batch"].tolist() == ["exp", "exp"]
    assert sorted(mine["case"].tolist()) == [0, 1]
    assert mine["instruction"].tolist() == ["first", "second"]


def test_scores_frame_and_header(ws: Workspace) -> None:
    job = ws.run(ws.submit("hello", model="demo"))
    before = {name: len(getattr(ws.frames, name)(job)) for name in ("usage", "messages", "tool_calls")}

    def broken(j: Any) -> bool:
        raise ValueError("no output/")

    ws.score([job], {"ok": lambda j: True, "n": lambda j: 3, "ratio": lambda j: 0.25, "broken": broken})
    ws.score([job], {"ok": lambda j: False, "label": lambda j: "good"})
    s = ws.frames.scores(job)
    assert s["value"].dtype == object and s["ts"].dtype == "datetime64[ns]"
    rows = list(zip(s["name"], s["value"], s["latest"], strict=True))
    assert rows == [("ok", True, False), ("n", 3, True), ("ratio", 0.25, True), ("broken", None, True),
                    ("ok", False, True), ("label", "good", True)]
    assert type(s["value"][1]) is int and type(s["value"][0]) is bool
    assert s.loc[s["name"] == "broken", "error"].item() == "ValueError: no output/"
    assert s["error"].isna().sum() == 5 and s["batch"].isna().all() and s["case"].isna().all()
    assert (s["job"] == job.id).all() and len(ws.frames.scores()) == 6
    # score events are not calls, messages or tool calls
    assert {name: len(getattr(ws.frames, name)(job)) for name in before} == before
    html = header_html(ws, job.id)
    assert "ok = False" in html and "ok = True" not in html  # the latest score of each name
    assert "n = 3" in html and "ratio = 0.25" in html and "label = good" in html
    assert '<span class="anb-error"' in html and "broken: ValueError: no output/" in html


def test_scores_of_a_batch_carry_its_name_and_case(ws: Workspace, tmp_path: Path) -> None:
    script = write_script(tmp_path, "b.yaml", {"work": [transition("COMPLETE", "done")]})
    b = ws.batch([{"instruction": "a"}, {"instruction": "b"}], piece="single", model=script, name="scored",
                 scorers={"done": lambda j: j.status == "succeeded"}, progress=False)
    s = ws.frames.scores()
    assert len(s) == len(b.jobs) == 2
    assert s["batch"].tolist() == ["scored", "scored"] and sorted(s["case"].tolist()) == [0, 1]
    assert s["value"].tolist() == [True, True] and s["latest"].all()
    assert isinstance(s, pd.DataFrame)
