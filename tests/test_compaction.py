"""Compaction (DESIGN §12, issue 16's "How this will be checked"), through the public API and real parts.

Most jobs run on ``openai:`` against the loopback server of ``tests/openai_server.py``, which keeps every
request body and answers with the ``usage.prompt_tokens`` each test chooses, so the thresholds are crossed
exactly where a test wants.  What the model was sent after each compaction is read from those bodies and
checked against the conversation as it was sent before: the prompts, the labelled summary, then exactly the
last ``compact_keep_last`` messages (more only when the cut fell inside a tool-call group), never a tool
result without its call nor a call without all its results.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, transition, write_piece, write_script
from openai_server import OpenAIServer, error, hold, reply

from agentnb import Workspace
from agentnb.engine.context import ContextManager
from agentnb.engine.pieces import PieceError, load_piece
from agentnb.engine.prompts import text

REPO = Path(__file__).resolve().parents[1]
MODEL = "openai:gpt-4o-mini"
WINDOW = 4_000  # prompt at 3,400 tokens, force_transition at 3,800
SUMMARY_LABEL = text("en", "compact_summary", n=0, summary="").split("(")[0]  # "[Summary of the earlier …"
ASK = "Summarise the conversation so far"


# -- the loopback endpoint ---------------------------------------------------------------------------------
@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[OpenAIServer]:
    with OpenAIServer() as srv:
        monkeypatch.setenv("OPENAI_BASE_URL", srv.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-compaction-test-0000")
        monkeypatch.setenv("AGENTNB_OPENAI_RETRIES", "0")  # a scripted 500 fails the call at once
        monkeypatch.setenv("AGENTNB_OPENAI_BACKOFF", "0.01")
        monkeypatch.setenv("AGENTNB_OPENAI_TIMEOUT", "30")
        yield srv


def globs(n: int, prompt: int, content: str | None = None) -> dict[str, Any]:
    """A response with ``n`` tool calls (Glob on distinct patterns) and the given prompt size."""
    return reply(content, [("Glob", {"pattern": p}) for p in ("*", "input/*", "output/*", "logs/*")[:n]],
                 usage=(prompt, 10))


def done(prompt: int = 1_000) -> dict[str, Any]:
    return reply(None, [("transition", {"next_step": "COMPLETE", "summary": "finished"})], usage=(prompt, 10))


def piece(tmp: Path, *, context: dict[str, Any] | None = None, movement_context: dict[str, Any] | None = None,
          tools: tuple[str, ...] = ("Glob",), persona: str | None = None, name: str = "long",
          max_iterations: int | None = None, default_next: str = "COMPLETE") -> Path:
    movement: dict[str, Any] = {"name": "work", "instruction": "Work.", "tools": list(tools),
                                "rules": [{"next": "COMPLETE"}], "default_next": default_next}
    if persona is not None:
        movement["persona"] = persona
    if movement_context is not None:
        movement["context"] = movement_context
    if max_iterations is not None:
        movement["max_iterations"] = max_iterations
    return write_piece(tmp, name, {"context": {"window_tokens": WINDOW, **(context or {})}, "movements": [movement]})


def compact(tmp: Path, **context: Any) -> Path:
    return piece(tmp, context={"on_pressure": "compact", **context})


def bodies(srv: OpenAIServer) -> list[dict[str, Any]]:
    return [r.body for r in srv.received]


def is_compaction(body: dict[str, Any]) -> bool:
    return "tools" not in body


def of(ws: Workspace, job: Any, kind: str) -> list[Any]:
    return ws.events(job, kinds=[kind])


def payloads(ws: Workspace, job: Any, kind: str) -> list[dict[str, Any]]:
    return [e.payload for e in of(ws, job, kind)]


# -- what a compaction must send -------------------------------------------------------------------------------
def is_attachment(m: dict[str, Any]) -> bool:
    return m["role"] == "user" and isinstance(m.get("content"), list)


def expected_start(conv: list[dict[str, Any]], keep: int) -> int:
    """Where the kept tail begins: the last ``keep`` messages, moved back to the assistant message whose tool
    calls the first of them answers (results and the images they attached stay with their call)."""
    k = max(2, len(conv) - keep)
    while 2 < k < len(conv) and (conv[k]["role"] == "tool" or is_attachment(conv[k])):
        k -= 1
    return k


def assert_pairs_whole(messages: list[dict[str, Any]]) -> None:
    """No tool result without the assistant message that called it just before, no call without its result."""
    open_ids: list[str] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            assert m["tool_call_id"] in open_ids, f"message {i}: a tool result without its call: {m}"
            open_ids.remove(m["tool_call_id"])
            continue
        if is_attachment(m):
            assert not open_ids and (messages[i - 1]["role"] == "tool" or is_attachment(messages[i - 1])), \
                f"message {i}: an image attachment away from its tool results"
            continue
        assert not open_ids, f"message {i}: tool calls {open_ids} have no result before it"
        if m["role"] == "assistant":
            open_ids = [c["id"] for c in m.get("tool_calls") or []]
    assert not open_ids, f"the last tool calls {open_ids} have no result"


def check_compactions(srv: OpenAIServer, ws: Workspace, job: Any, keep: int) -> list[dict[str, Any]]:
    """Check every compaction of ``job`` (one movement run) against what the server received, and return the
    compaction events' payloads.  Each compaction is: the conversation request before it (``prev``), the
    summarisation request (``ask``), the next conversation request (``after``)."""
    sent = bodies(srv)
    events = payloads(ws, job, "compaction")
    asks = [i for i, b in enumerate(sent) if is_compaction(b)]
    assert len(asks) == len([r for r in payloads(ws, job, "llm_request") if r.get("purpose") == "compaction"])
    counter = ContextManager(window=WINDOW, model=MODEL)
    succeeded = [i for i in asks if i + 1 < len(sent) and not is_compaction(sent[i + 1])]
    responses = {(e.iteration): e.payload for e in of(ws, job, "llm_response")}
    n = 0
    for i in asks:
        ask = sent[i]
        prev = sent[i - 1]
        assert "tools" not in ask and "tool_choice" not in ask
        conv, last = ask["messages"][:-1], ask["messages"][-1]
        assert last["role"] == "user" and last["content"].startswith("The context window is")
        assert ASK in last["content"]
        # the conversation as it was: the previous request, its answer, the results of its tool calls
        assert conv[: len(prev["messages"])] == prev["messages"]
        assert conv[len(prev["messages"])]["role"] == "assistant"
        assert_pairs_whole(conv)
        if i not in succeeded or n >= len(events):
            continue
        ev = events[n]
        n += 1
        after = sent[i + 1]["messages"]
        start = expected_start(conv, keep)
        assert after[0] == conv[0] and after[0]["role"] == "system"
        assert after[1] == conv[1] and after[1]["role"] == "user"
        assert after[2]["role"] == "user" and after[2]["content"].startswith(SUMMARY_LABEL)
        assert after[2]["content"].endswith("\n\n" + ev["summary"]) and f"compaction {n})" in after[2]["content"]
        assert after[3:] == conv[start:], "the kept tail is not the last messages as they were sent"
        assert len(after) - 3 >= min(keep, len(conv) - 2)
        assert_pairs_whole(after)
        assert (ev["removed_messages"], ev["kept_messages"]) == (start - 2, len(conv) - start)
        # tokens_before: the triggering answer's reported size plus the tool results added since
        trigger = responses[max(it for it in responses if it < ev["iteration"]
                                and responses[it].get("purpose") != "compaction")]
        added = conv[len(prev["messages"]) + 1:]
        usage = trigger["usage"]
        assert ev["tokens_before"] == usage["prompt_tokens"] + usage["completion_tokens"] + sum(
            counter.count_message(m) for m in added)
        # tokens_after: the new list as counted, with the tool schemas sent alongside
        schemas = counter.counter.count(json.dumps(sent[i + 1]["tools"], ensure_ascii=False))
        assert ev["tokens_after"] == schemas + sum(counter.count_message(m) for m in after)
    assert n == len(events)
    return events


# -- 1. the messages sent after each compaction ---------------------------------------------------------------
TWO_COMPACTIONS = [
    globs(2, 1_000), globs(3, 1_500), globs(1, 3_500, "looking"),  # prompt (87.5 %) at the third
    reply("SUMMARY-ONE: listed the folders.", usage=(3_600, 40)),
    globs(2, 1_200), globs(3, 3_500),  # prompt again: the actions were re-armed
    reply("SUMMARY-TWO: listed them again.", usage=(3_700, 40)),
    globs(1, 3_000), done(3_100),
]


@pytest.mark.parametrize("keep", [0, 1, 2, 4, 5, 6])
def test_messages_after_each_compaction_keep_the_last_n_with_tool_groups_whole(
        server: OpenAIServer, tmp_path: Path, keep: int) -> None:
    server.play(*TWO_COMPACTIONS)
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("List things.", piece=str(compact(tmp_path, compact_keep_last=keep)), model=MODEL))
    assert job.status == "succeeded", job.error
    events = check_compactions(server, ws, job, keep)
    assert [e["summary"] for e in events] == ["SUMMARY-ONE: listed the folders.", "SUMMARY-TWO: listed them again."]
    assert len(server.received) == len(TWO_COMPACTIONS)
    assert not payloads(ws, job, "reminder") and not [t for t in payloads(ws, job, "transition") if t["forced"]]


def test_a_cut_inside_a_tool_group_keeps_the_whole_group(server: OpenAIServer, tmp_path: Path) -> None:
    # keep 4 of [sys, user, a(2 calls), t, t, a(3 calls), t, t, t, a(1 call), t]: the 4th from the end is a
    # result of the 3-call answer, so that answer and all its results are kept (6 messages)
    server.play(*TWO_COMPACTIONS)
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("List things.", piece=str(compact(tmp_path)), model=MODEL))
    first = check_compactions(server, ws, job, 4)[0]
    assert (first["removed_messages"], first["kept_messages"]) == (3, 6)
    after = next(b for i, b in enumerate(bodies(server)) if i and is_compaction(bodies(server)[i - 1]))["messages"]
    assert [m["role"] for m in after] == ["system", "user", "user", "assistant", "tool", "tool", "tool",
                                          "assistant", "tool"]
    assert len(after[3]["tool_calls"]) == 3


def test_the_summarisation_request_has_no_tools_and_asks_last(server: OpenAIServer, tmp_path: Path) -> None:
    server.play(*TWO_COMPACTIONS)
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("List things.", piece=str(compact(tmp_path)), model=MODEL))
    sent = bodies(server)
    asks = [b for b in sent if is_compaction(b)]
    assert len(asks) == 2
    for b in asks:
        assert set(b) == {"model", "messages"} and b["model"] == "gpt-4o-mini"
        assert b["messages"][-1] == {"role": "user", "content": text("en", "compact_request", pct="88%")}
    assert all("tools" in b for b in sent if not is_compaction(b))
    reqs = payloads(ws, job, "llm_request")
    assert [r.get("purpose") for r in reqs] == [None, None, None, "compaction", None, None, "compaction", None, None]
    assert [r["tools"] for r in reqs if r.get("purpose")] == [[], []]
    assert [r["messages"] for r in reqs] == [len(b["messages"]) for b in sent]
    resp = [e for e in of(ws, job, "llm_response") if e.payload.get("purpose") == "compaction"]
    assert [e.iteration for e in resp] == [4, 7] == [e.iteration for e in of(ws, job, "compaction")]


# -- 2. counts, frames.usage, limits and fall-backs -------------------------------------------------------------
def test_usage_rows_count_the_summarisation_calls(server: OpenAIServer, tmp_path: Path) -> None:
    server.play(*TWO_COMPACTIONS)
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("List things.", piece=str(compact(tmp_path)), model=MODEL))
    usage = ws.frames.usage(job)
    assert list(usage["iteration"]) == list(range(1, 10))
    assert list(usage["prompt_tokens"]) == [a["usage"][0] for a in TWO_COMPACTIONS]
    assert list(usage["completion_tokens"]) == [a["usage"][1] for a in TWO_COMPACTIONS]
    assert list(usage["source"]) == ["usage"] * 9
    assert usage["cumulative_tokens"].iloc[-1] == sum(sum(a["usage"]) for a in TWO_COMPACTIONS)
    # the summarisation calls fire no action; the conversation calls after them fire warn/prompt again
    assert list(usage["actions"].fillna("")) == ["", "", "warn,prompt", "", "", "warn,prompt", "", "warn", ""]
    actions = [(a.iteration, a.payload["action"]) for a in of(ws, job, "context_action")]
    assert actions == [(3, "warn"), (3, "prompt"), (6, "warn"), (6, "prompt"), (8, "warn")]
    mv = ws.frames.movements(job)
    assert mv["total_tokens"].iloc[0] == usage["total_tokens"].sum() and mv["llm_calls"].iloc[0] == 9


def _pressing(n: int) -> list[dict[str, Any]]:
    """Rounds that each cross prompt, each followed by a summary, then a response at 96 % and a transition."""
    out: list[dict[str, Any]] = [globs(1, 1_000), globs(1, 1_100)]
    for k in range(n):
        out += [globs(1, 3_500), reply(f"SUMMARY-{k + 1}", usage=(3_600, 20))]
    return out


@pytest.mark.parametrize("limit", [0, 1, 2, 3])
def test_max_compactions_then_the_seeds_wrap_up_and_forced_transition(
        server: OpenAIServer, tmp_path: Path, limit: int) -> None:
    # each round crosses prompt; after `limit` compactions the next crossing gets the wrap-up reminder,
    # and the one after it (96 %) is forced
    server.play(*_pressing(limit), globs(1, 3_500), globs(1, 3_840))
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("List things.", piece=str(compact(tmp_path, max_compactions=limit)), model=MODEL))
    assert job.status == "succeeded"
    events = check_compactions(server, ws, job, 4)
    assert [e["summary"] for e in events] == [f"SUMMARY-{k + 1}" for k in range(limit)]
    reminders = payloads(ws, job, "reminder")
    assert [r["reason"] for r in reminders] == ["context prompt"]
    forced = payloads(ws, job, "transition")
    assert len(forced) == 1 and forced[0]["forced"] and "force_transition (95%)" in forced[0]["reason"]
    assert len(server.received) == 2 + 2 * limit + 2
    assert not server.actions


def test_a_crossing_of_95_percent_compacts_while_it_may_then_is_forced(server: OpenAIServer, tmp_path: Path) -> None:
    server.play(globs(1, 1_000), globs(1, 1_100), globs(2, 3_900),  # 97.5 %: compacts
                reply("SUMMARY-1", usage=(3_950, 20)),
                globs(2, 3_900), reply("SUMMARY-2", usage=(3_950, 20)),
                globs(2, 3_900))  # the third: max_compactions (2) reached → forced, no reminder first
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("List things.", piece=str(compact(tmp_path)), model=MODEL))
    assert len(check_compactions(server, ws, job, 4)) == 2
    assert not payloads(ws, job, "reminder")
    (t,) = payloads(ws, job, "transition")
    assert t["forced"] and t["next_step"] == "COMPLETE" and "97.5%" in t["reason"]
    assert job.status == "succeeded" and not server.actions


def test_a_compaction_that_stays_above_prompt_is_the_last(server: OpenAIServer, tmp_path: Path) -> None:
    # a persona of ~3,500 tokens: system + user prompt alone are above 85 % of the window, so the summary
    # cannot bring the ratio below prompt: no second compaction, the wrap-up next, forced at 95 %
    big = " ".join(f"rule{i}" for i in range(3_300))
    server.play(globs(1, 1_000), globs(1, 1_100), globs(1, 3_500), reply("SUMMARY-1", usage=(3_600, 20)),
                globs(1, 3_500), globs(1, 3_850))
    ws = Workspace(tmp_path / "ws")
    p = piece(tmp_path, context={"on_pressure": "compact"}, persona=big)
    job = ws.run(ws.submit("List things.", piece=str(p), model=MODEL))
    (ev,) = check_compactions(server, ws, job, 4)
    assert ev["tokens_after"] / WINDOW >= 0.85
    assert [r["reason"] for r in payloads(ws, job, "reminder")] == ["context prompt"]
    reminder = of(ws, job, "reminder")[0]
    assert reminder.iteration == 5  # the first conversation call after the compaction re-fired prompt
    (t,) = payloads(ws, job, "transition")
    assert t["forced"] and job.status == "succeeded"
    # the wrap-up reminder was sent as the last message of the call after it
    assert bodies(server)[-1]["messages"][-1]["content"] == reminder.payload["text"]


def test_a_large_keep_last_that_frees_too_little_is_the_last(server: OpenAIServer, tmp_path: Path) -> None:
    # long listings kept verbatim (keep_last 8): the summary replaces only the first answer, so the context stays
    # above prompt: no second compaction, the wrap-up next, forced at 95 %
    server.play(globs(1, 500), globs(2, 900), globs(2, 1_500), globs(2, 3_500),
                reply("SUMMARY-1", usage=(3_600, 20)), globs(1, 3_500), globs(1, 3_850))
    ws = Workspace(tmp_path / "ws")
    p = compact(tmp_path, compact_keep_last=8)
    job = ws.submit("List things.", piece=str(p), model=MODEL,
                    inputs={f"f{i:03d}_{'long-name-' * 6}.txt": "x" for i in range(80)})
    job = ws.run(job)
    (ev,) = check_compactions(server, ws, job, 8)
    assert (ev["removed_messages"], ev["kept_messages"]) == (2, 9)
    assert ev["tokens_after"] / WINDOW >= 0.85
    assert [r["reason"] for r in payloads(ws, job, "reminder")] == ["context prompt"]
    assert payloads(ws, job, "transition")[0]["forced"] and len(server.received) == 7


def test_nothing_to_remove_gives_the_wrap_up_without_a_call(server: OpenAIServer, tmp_path: Path) -> None:
    # the first answer already crosses prompt: its call and results are all there is after the prompts
    server.play(globs(3, 3_500), done(3_600))
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("List things.", piece=str(compact(tmp_path, compact_keep_last=2)), model=MODEL))
    assert job.status == "succeeded"
    assert not [b for b in bodies(server) if is_compaction(b)] and not payloads(ws, job, "compaction")
    assert [r["reason"] for r in payloads(ws, job, "reminder")] == ["context prompt"]
    assert len(server.received) == 2 and not payloads(ws, job, "error")


def test_actions_re_arm_after_a_compaction(server: OpenAIServer, tmp_path: Path) -> None:
    server.play(globs(1, 1_000), globs(1, 2_900), globs(1, 3_500), reply("SUMMARY-1", usage=(3_600, 20)),
                globs(1, 2_900), globs(1, 3_500), reply("SUMMARY-2", usage=(3_600, 20)),
                globs(1, 2_900), globs(1, 3_500), done(3_600))
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("List things.", piece=str(compact(tmp_path)), model=MODEL))
    actions = [(a.iteration, a.payload["action"]) for a in of(ws, job, "context_action")]
    assert actions == [(2, "warn"), (3, "prompt"), (5, "warn"), (6, "prompt"), (8, "warn"), (9, "prompt")]
    # after max_compactions the third prompt gets the wrap-up reminder, and the model's transition stands
    assert [(r.iteration, r.payload["reason"]) for r in of(ws, job, "reminder")] == [(9, "context prompt")]
    assert job.status == "succeeded" and not payloads(ws, job, "transition")[0]["forced"]
