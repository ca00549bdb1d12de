"""Compaction (docs/context.md#compaction), through the public API and real parts.

Most jobs run on ``openai:`` against the loopback server of ``tests/openai_server.py``, which keeps every
request body and answers with the ``usage.prompt_tokens`` each test chooses, so the thresholds are crossed
exactly where a test wants.  What the model was sent after each compaction is read from those bodies and
checked against the conversation as it was sent before: the prompts, the labelled summary, then exactly the
last ``compact_keep_last`` messages (more only when the cut fell inside a tool-call group), never a tool
result without its call nor a call without all its results.

Then compaction in the middle movement of three, set on that movement only and overridden per job, with tool mixes,
a reminder at the crossing and ``max_iterations`` right after a compaction; the same jobs resumed in another process
between any two calls, or killed at random points, end as a straight run does.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _resuming import CHILD, REPO, comparable, step_in_children, timeless
from _scripting import call, transition, write_piece, write_script
from openai_server import OpenAIServer, error, hold, reply

from agentnb import Workspace
from agentnb.engine.context import ContextManager
from agentnb.engine.pieces import PieceError, load_piece
from agentnb.engine.prompts import text
from agentnb.models.messages import (
    AssistantMessage,
    ImagePart,
    Message,
    SystemMessage,
    ToolCallPart,
    ToolMessage,
    UserMessage,
)
from agentnb.models.openai import wire_message

MODEL = "openai:gpt-4o-mini"
WINDOW = 4_000  # prompt at 3,400 tokens, force_transition at 3,800
SUMMARY_LABEL = text("en", "compact_summary", n=0, summary="").split("(")[0]  # "[Summary of the earlier …"
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 24  # enough for ReadImage to attach it
ASK = "Summarise the conversation so far"


# -- the loopback endpoint ---------------------------------------------------------------------------------
@pytest.fixture
def server(loopback: Callable[..., OpenAIServer]) -> OpenAIServer:
    # retries 0: a scripted 500 fails the call at once
    return loopback("sk-compaction-test-0000", retries="0", timeout="30")


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


def typed(m: dict[str, Any]) -> Message:
    """A message as the endpoint received it, back as the typed message the loop held (to count it as the
    loop did); checked to give back exactly what was sent."""
    role, content = m["role"], m.get("content")
    out: Message
    if role == "tool":
        out = ToolMessage(m["tool_call_id"], content)
    elif role == "assistant":
        out = AssistantMessage(content, tuple(ToolCallPart(c["id"], c["function"]["name"], None,
                                                           c["function"]["arguments"]) for c in m.get("tool_calls") or ()))
    elif role == "system":
        out = SystemMessage(content)
    elif isinstance(content, list):
        out = UserMessage(content[0]["text"], tuple(ImagePart(p["image_url"]["url"]) for p in content[1:]))
    else:
        out = UserMessage(content)
    assert wire_message(out) == m
    return out


def check_compactions(srv: OpenAIServer, ws: Workspace, job: Any, keep: int) -> list[dict[str, Any]]:
    """Check every compaction of ``job`` (one movement run) against what the server received, and return the
    compaction events' payloads.  Each compaction is: the conversation request before it (``prev``), the
    summarisation request (``ask``), the next conversation request (``after``)."""
    sent = bodies(srv)
    asks = [i for i, b in enumerate(sent) if is_compaction(b)]
    # the k-th summarisation request is the k-th llm_request marked compaction; its compaction event (none when
    # the call failed or said nothing) has the same iteration
    ask_iterations = [e.iteration for e in of(ws, job, "llm_request") if e.payload.get("purpose") == "compaction"]
    assert len(asks) == len(ask_iterations)
    events = payloads(ws, job, "compaction")
    by_iteration = {e["iteration"]: e for e in events}
    counter = ContextManager(window=WINDOW, model=MODEL)
    responses = {(e.iteration): e.payload for e in of(ws, job, "llm_response")}
    n = 0
    for i, iteration in zip(asks, ask_iterations, strict=True):
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
        ev = by_iteration.get(iteration)
        if ev is None:
            continue
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
            counter.count_message(typed(m)) for m in added)
        # tokens_after: the new list as counted, with the tool schemas sent alongside
        schemas = counter.counter.count(json.dumps(sent[i + 1]["tools"], ensure_ascii=False))
        assert ev["tokens_after"] == schemas + sum(counter.count_message(typed(m)) for m in after)
    assert n == len(events)
    return events


def movement_names(ws: Workspace, job: Any) -> list[str]:
    return [str(m) for m in ws.frames.movements(job)["movement"]]


def check_sent_compactions(srv: OpenAIServer, ws: Workspace, job: Any, keep: int) -> list[dict[str, Any]]:
    """Each summarisation request (no tools) against the conversation request before it and the one after it:
    the request is the conversation so far plus the ask; the one after is [system, user, summary, last ``keep``
    messages (moved back to whole tool groups)]; the event's counts and token sizes match what was sent."""
    sent = [r.body for r in srv.received]
    asks = [i for i, b in enumerate(sent) if "tools" not in b]
    events = of(ws, job, "compaction")
    assert len(asks) == len(events), "every summarisation request made a compaction in these jobs"
    counter = ContextManager(window=WINDOW, model=MODEL)
    responses = {(e.movement_seq, e.iteration): e.payload for e in of(ws, job, "llm_response")}
    for n, (i, ev) in enumerate(zip(asks, events, strict=True)):
        p = ev.payload
        prev, ask, after = sent[i - 1]["messages"], sent[i]["messages"], sent[i + 1]["messages"]
        conv = ask[:-1]
        assert ask[-1]["role"] == "user" and ASK in ask[-1]["content"]
        assert conv[: len(prev)] == prev and conv[len(prev)]["role"] == "assistant"
        start = expected_start(conv, keep)
        assert after[:2] == conv[:2] and [m["role"] for m in after[:3]] == ["system", "user", "user"]
        index = sum(1 for e in events[:n] if e.movement_seq == ev.movement_seq) + 1
        assert after[2]["content"] == text("en", "compact_summary", n=index, summary=p["summary"])
        assert after[2]["content"].startswith(SUMMARY_LABEL)
        assert after[3:] == conv[start:]
        assert len(after) - 3 >= min(keep, len(conv) - 2)
        assert_pairs_whole(conv)
        assert_pairs_whole(after)
        assert (p["removed_messages"], p["kept_messages"]) == (start - 2, len(conv) - start)
        trigger = responses[(ev.movement_seq, ev.iteration - 1)]
        assert trigger.get("purpose") is None
        added = conv[len(prev) + 1:]
        assert p["tokens_before"] == sum(trigger["usage"][k] for k in ("prompt_tokens", "completion_tokens")) + sum(
            counter.count_message(typed(m)) for m in added)
        schemas = counter.counter.count(json.dumps(sent[i + 1]["tools"], ensure_ascii=False))
        assert p["tokens_after"] == schemas + sum(counter.count_message(typed(m)) for m in after)
        assert p["tokens_after"] < p["tokens_before"]
    return [e.payload for e in events]


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
        # no tools (the answer streams, as every openai: call does by default)
        assert set(b) - {"stream", "stream_options"} == {"model", "messages"} and b["model"] == "gpt-4o-mini"
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
    # the summarisation calls fire no context action (their row says compaction, docs/context.md#compaction); the
    # conversation calls after them fire warn/prompt again
    assert list(usage["actions"].fillna("")) == ["", "", "warn,prompt", "compaction", "", "warn,prompt", "compaction",
                                                 "warn", ""]
    assert list(usage["action"].astype(object).fillna("")) == ["", "", "prompt", "compaction", "", "prompt",
                                                               "compaction", "warn", ""]
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


# -- 3. a summarisation call that fails, or says nothing ---------------------------------------------------------
def _conversation(srv: OpenAIServer) -> list[dict[str, Any]]:
    """The conversation requests, their tool-call ids numbered by first appearance (the server names them by
    request number, which a summarisation request moves on)."""
    ids: dict[str, str] = {}

    def renumber(m: dict[str, Any]) -> dict[str, Any]:
        m = dict(m)
        if "tool_call_id" in m:
            m["tool_call_id"] = ids.setdefault(m["tool_call_id"], f"id{len(ids)}")
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "id": ids.setdefault(c["id"], f"id{len(ids)}")} for c in m["tool_calls"]]
        return m

    return [{**b, "messages": [renumber(m) for m in b["messages"]]} for b in timeless(bodies(srv))
            if not is_compaction(b)]


def _seed_run(tmp_path: Path, srv: OpenAIServer, actions: list[dict[str, Any]]) -> tuple[Workspace, Any]:
    """The same conversation with the seed's behaviour (no compaction key at all)."""
    srv.received.clear()
    srv.play(*actions)
    ws = Workspace(tmp_path / "seed")
    return ws, ws.run(ws.submit("List things.", piece=str(piece(tmp_path, name="seed")), model=MODEL))


FAILURES: dict[str, Any] = {
    "http-500": error(500, "the summariser is down"),
    "http-400": error(400, "context too long for a summary"),
    "empty": reply("   ", usage=(3_600, 1)),
    "none": reply(None, usage=(3_600, 0)),
}


@pytest.mark.parametrize("how", list(FAILURES))
@pytest.mark.parametrize("crossing", [3_500, 3_900])
def test_a_failed_or_empty_summary_falls_back_to_the_seed(server: OpenAIServer, tmp_path: Path, how: str,
                                                          crossing: int) -> None:
    before = [globs(1, 1_000), globs(1, 1_100), globs(2, crossing)]
    rest = [done(3_700)] if crossing < 3_800 else []  # at 97.5 % the seed forces the transition at once
    server.play(*before, FAILURES[how], *rest)
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("List things.", piece=str(compact(tmp_path)), model=MODEL))
    assert job.status == "succeeded", job.error
    (err,) = [e for e in of(ws, job, "error")]
    assert err.payload["where"] == "compaction" and err.iteration == 4
    assert err.payload["message"].startswith("compaction 1 of run 1 (work): the summarisation ")
    if how.startswith("http"):
        assert f"HTTP {how[-3:]}" in err.payload["message"]
        assert not [e for e in of(ws, job, "llm_response") if e.payload.get("purpose")]
    else:
        assert "returned no text" in err.payload["message"]
        (summary,) = [e for e in of(ws, job, "llm_response") if e.payload.get("purpose") == "compaction"]
        assert summary.iteration == 4 and summary.payload["usage"]["prompt_tokens"] == 3_600
    assert not payloads(ws, job, "compaction") and check_compactions(server, ws, job, 4) == []
    transitions = payloads(ws, job, "transition")
    # the job ends as the seed's does: the same conversation requests, the same reminder, the same transition
    sent = _conversation(server)
    seed_ws, seed = _seed_run(tmp_path, server, [*before, *rest])
    assert sent == _conversation(server)
    assert seed.status == job.status
    seed_transitions = payloads(seed_ws, seed, "transition")
    assert [(t["next_step"], t["forced"], t["reason"]) for t in transitions] == [
        (t["next_step"], t["forced"], t["reason"]) for t in seed_transitions]
    assert [r["text"] for r in payloads(ws, job, "reminder")] == [r["text"] for r in payloads(seed_ws, seed, "reminder")]
    if crossing < 3_800:
        assert [r["reason"] for r in payloads(ws, job, "reminder")] == ["context prompt"]
        assert not transitions[0]["forced"]
    else:
        assert transitions[0]["forced"] and "97.5%" in transitions[0]["reason"]


def test_a_scripted_model_that_runs_out_at_the_summary_falls_back(tmp_path: Path) -> None:
    # the script ends with the answer that crosses 96 %: the summary has no response → error, then forced,
    # exactly the transition the seed makes with the same script
    def g(n: int) -> dict[str, Any]:
        return {**call("Glob", pattern="*"), "usage": {"prompt_tokens": n, "completion_tokens": 10}}

    spec = write_script(tmp_path, "s", {"work": [g(1_000), g(1_100), g(3_840)], "next": [transition("COMPLETE")]})
    p = write_piece(tmp_path, "two", {"context": {"window_tokens": WINDOW, "on_pressure": "compact"}, "movements": [
        {"name": "work", "instruction": "Work.", "tools": ["Glob"], "rules": [{"next": "next"}],
         "default_next": "next"},
        {"name": "next", "instruction": "Finish.", "rules": [{"next": "COMPLETE"}]}]})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("List things.", piece=str(p), model=spec))
    assert job.status == "succeeded", job.error
    (err,) = of(ws, job, "error")
    assert err.payload["where"] == "compaction" and "ran out of responses" in err.payload["message"]
    first = payloads(ws, job, "transition")[0]
    assert first["forced"] and first["next_step"] == "next" and "96.0%" in first["reason"]
    seed_piece = p.read_text().replace("on_pressure: compact", "on_pressure: transition")
    seed = ws.run(ws.submit("List things.", piece=seed_piece, model=spec))
    assert [(t["next_step"], t["forced"], t["reason"]) for t in payloads(ws, seed, "transition")] == [
        (t["next_step"], t["forced"], t["reason"]) for t in payloads(ws, job, "transition")]


# -- 4. where on_pressure is set, and what is refused -----------------------------------------------------------
def g(prompt: int, tool: str = "Glob", **arguments: Any) -> dict[str, Any]:
    args = arguments or {"pattern": "*"}
    return {**call(tool, **args), "usage": {"prompt_tokens": prompt, "completion_tokens": 10}}


def summary(words: str) -> dict[str, Any]:
    return {"content": words, "usage": {"prompt_tokens": 3_600, "completion_tokens": 20}}


# both movements cross prompt at their third call; a movement that compacts takes a summary as its 4th response
_PRESSED = [g(1_000), g(1_100), g(3_500)]


def _two_movements(tmp: Path, *, piece_context: dict[str, Any] | None = None,
                   a: dict[str, Any] | None = None, b: dict[str, Any] | None = None) -> Path:
    def mv(name: str, nxt: str, ctx: dict[str, Any] | None) -> dict[str, Any]:
        m: dict[str, Any] = {"name": name, "instruction": f"Do {name}.", "tools": ["Glob"],
                             "rules": [{"next": nxt}], "default_next": nxt}
        return {**m, "context": ctx} if ctx is not None else m
    return write_piece(tmp, "pair", {"context": {"window_tokens": WINDOW, **(piece_context or {})},
                                     "movements": [mv("a", "b", a), mv("b", "COMPLETE", b)]})


def _script_for(tmp: Path, compacting: set[str], name: str = "s") -> str:
    return write_script(tmp, name, {m: [*_PRESSED, *([summary(f"summary of {m}")] if m in compacting else []),
                                        transition("b" if m == "a" else "COMPLETE")] for m in ("a", "b")})


def _compacted(ws: Workspace, job: Any) -> list[str]:
    names = {e.movement_seq: e.payload["movement"] for e in of(ws, job, "movement_start")}
    return [names[e.movement_seq] for e in of(ws, job, "compaction")]


def _wrapped(ws: Workspace, job: Any) -> list[str]:
    names = {e.movement_seq: e.payload["movement"] for e in of(ws, job, "movement_start")}
    return [names[e.movement_seq] for e in of(ws, job, "reminder") if e.payload["reason"] == "context prompt"]


@pytest.mark.parametrize(("piece_context", "a", "b", "job_context", "compacting"), [
    ({"on_pressure": "compact"}, None, None, None, {"a", "b"}),
    ({"on_pressure": "compact"}, {"on_pressure": "transition"}, None, None, {"b"}),
    (None, None, {"on_pressure": "compact"}, None, {"b"}),
    ({"on_pressure": "transition"}, {"on_pressure": "compact"}, None, None, {"a"}),
    (None, {"on_pressure": "transition"}, None, {"on_pressure": "compact"}, {"a", "b"}),
    ({"on_pressure": "compact"}, {"on_pressure": "compact"}, None, {"on_pressure": "transition"}, set()),
    ({"on_pressure": "compact", "max_compactions": 0}, {"max_compactions": 1}, None, None, {"a"}),
    ({"on_pressure": "compact"}, {"max_compactions": 1}, None, {"max_compactions": 0}, set()),
], ids=["piece", "movement-off", "movement-on", "movement-over-piece", "job-over-movement", "job-off",
        "movement-max", "job-max"])
def test_on_pressure_precedence_job_over_movement_over_piece(
        tmp_path: Path, piece_context: dict[str, Any] | None, a: dict[str, Any] | None, b: dict[str, Any] | None,
        job_context: dict[str, Any] | None, compacting: set[str]) -> None:
    ws = Workspace(tmp_path / "ws")
    p = _two_movements(tmp_path, piece_context=piece_context, a=a, b=b)
    job = ws.run(ws.submit("Go.", piece=str(p), model=_script_for(tmp_path, compacting), context=job_context))
    assert job.status == "succeeded", job.error
    assert _compacted(ws, job) == sorted(compacting)
    assert _wrapped(ws, job) == sorted({"a", "b"} - compacting)


def test_keep_last_per_movement_and_per_job(tmp_path: Path) -> None:
    p = _two_movements(tmp_path, piece_context={"on_pressure": "compact", "compact_keep_last": 4},
                       a={"compact_keep_last": 0})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("Go.", piece=str(p), model=_script_for(tmp_path, {"a", "b"})))
    assert [e["kept_messages"] for e in payloads(ws, job, "compaction")] == [0, 4]
    job = ws.run(ws.submit("Go.", piece=str(p), model=_script_for(tmp_path, {"a", "b"}),
                           context={"compact_keep_last": 2}))
    assert [e["kept_messages"] for e in payloads(ws, job, "compaction")] == [2, 2]


def test_a_fork_with_context_compacts_where_the_original_wrapped_up(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    p = _two_movements(tmp_path)
    original = ws.run(ws.submit("Go.", piece=str(p), model=_script_for(tmp_path, set())))
    assert _wrapped(ws, original) == ["a", "b"] and not _compacted(ws, original)
    fork = ws.fork(original, at=2, model=_script_for(tmp_path, {"b"}, "f"), context={"on_pressure": "compact"})
    assert fork.status == "succeeded", fork.error
    assert _compacted(ws, fork) == ["b"] and _wrapped(ws, fork) == ["a"]  # run 1 re-served as it was
    with pytest.raises(ValueError, match=r"^context.on_pressure='sometimes'; allowed: transition, compact$"):
        ws.fork(original, at=2, context={"on_pressure": "sometimes"})


def _comparable(ws: Workspace, job: Any, statuses: bool = True) -> list[tuple[Any, ...]]:
    """A job's events without what differs between two runs of the same steps (times, latency, claim owners, the
    endpoint's id for each answer, which counts its requests; with ``statuses=False`` the job_status events,
    which stepping and recovering add)."""
    out = []
    for e in ws.events(job):
        if e.kind == "job_status" and not statuses:
            continue
        payload = {k: v for k, v in e.payload.items() if k not in ("latency_s", "ttft_s", "ts", "owner", "response_id")}
        if e.kind == "job_status" and str(payload.get("reason")).startswith("claimed by "):
            payload["reason"] = "claimed by <owner>"
        out.append((e.kind, e.movement_seq, e.iteration, json.dumps(payload, sort_keys=True, default=str)))
    return timeless(out)


def test_on_pressure_transition_is_the_seed_exactly(tmp_path: Path) -> None:
    spec = _script_for(tmp_path, set())
    runs = {}
    for key, ctx in {"absent": None, "piece": {"on_pressure": "transition"}}.items():
        ws = Workspace(tmp_path / key)
        (tmp_path / f"{key}p").mkdir()
        p = _two_movements(tmp_path / f"{key}p", piece_context=ctx)
        runs[key] = _comparable(ws, ws.run(ws.submit("Go.", piece=str(p), model=spec)))
    ws = Workspace(tmp_path / "job")
    (tmp_path / "jobp").mkdir()
    p = _two_movements(tmp_path / "jobp")
    runs["job"] = _comparable(ws, ws.run(ws.submit("Go.", piece=str(p), model=spec,
                                                   context={"on_pressure": "transition"})))
    assert runs["absent"] == runs["piece"] == runs["job"]
    assert [k for k, *_ in runs["absent"]].count("reminder") == 2


_BAD_PIECES = [
    ("context:\n  on_pressure: compact\n  compact_often: 3\n", 4, "context.compact_often",
     "unknown key 'compact_often'"),
    ("context:\n  on_pressure: sometimes\n", 3, "context.on_pressure", "found 'sometimes', allowed: transition, compact"),
    ("context:\n  compact_keep_last: -1\n", 3, "context.compact_keep_last", "found -1, expected a whole number ≥ 0"),
    ("context:\n  max_compactions: two\n", 3, "context.max_compactions", "found 'two', expected a whole number ≥ 0"),
    ("movements:\n  - name: work\n    instruction: Work.\n    context:\n      window_tokens: 5000\n", 6,
     "movements[0] (work).context.window_tokens",
     "unknown key 'window_tokens'; allowed keys: on_pressure, compact_keep_last, max_compactions"),
    ("movements:\n  - name: work\n    instruction: Work.\n    context:\n      on_pressure: sometimes\n", 6,
     "movements[0] (work).context.on_pressure", "found 'sometimes', allowed: transition, compact"),
    ("movements:\n  - name: work\n    instruction: Work.\n    context:\n      compact_keep_last: -1\n", 6,
     "movements[0] (work).context.compact_keep_last", "found -1, expected a whole number ≥ 0"),
    ("movements:\n  - name: work\n    instruction: Work.\n    context:\n      max_compactions: two\n", 6,
     "movements[0] (work).context.max_compactions", "found 'two', expected a whole number ≥ 0"),
]


@pytest.mark.parametrize(("yaml_text", "line", "field", "what"), _BAD_PIECES)
def test_bad_compaction_settings_in_a_piece_name_file_line_and_field(tmp_path: Path, yaml_text: str, line: int,
                                                                     field: str, what: str) -> None:
    body = yaml_text if yaml_text.startswith("movements") else yaml_text + "movements:\n  - name: work\n    instruction: Work.\n"
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\n" + body, encoding="utf-8")
    with pytest.raises(PieceError) as info:
        load_piece(str(path))
    assert (info.value.file, info.value.line, info.value.field) == (str(path), line, field)
    assert str(info.value) .startswith(f"{path}:{line}: {field}: ") and what in str(info.value)
    assert "\n" not in str(info.value)
    ws = Workspace(tmp_path / "ws")
    with pytest.raises(PieceError):
        ws.submit("x", piece=str(path), model="demo")
    assert ws.frames.jobs().empty


@pytest.mark.parametrize(("context", "message"), [
    ({"on_pressure": "sometimes"}, "context.on_pressure='sometimes'; allowed: transition, compact"),
    ({"compact_keep_last": -1}, "context.compact_keep_last=-1; allowed: a whole number ≥ 0"),
    ({"max_compactions": "two"}, "context.max_compactions='two'; allowed: a whole number ≥ 0"),
    ({"max_compactions": True}, "context.max_compactions=True; allowed: a whole number ≥ 0"),
    ({"compact": True}, "context: unknown key(s) ['compact']; allowed: window_tokens, thresholds, min_tool_tokens, "
                        "on_pressure, compact_keep_last, max_compactions"),
])
def test_bad_context_at_submit_is_one_line_and_stores_nothing(tmp_path: Path, context: dict[str, Any],
                                                              message: str) -> None:
    ws = Workspace(tmp_path / "ws")
    with pytest.raises(ValueError) as info:
        ws.submit("x", piece="single", model="demo", context=context)
    assert str(info.value) == message
    assert ws.frames.jobs().empty and not list((tmp_path / "ws").glob("jobs/*"))


# -- 5. resumed in another process between any two calls, and killed during the summary -----------------------
def _child_env(srv: OpenAIServer) -> dict[str, str]:
    return {**os.environ, "OPENAI_BASE_URL": srv.base_url, "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")])}


def _in_child(srv: OpenAIServer, ws: Workspace, job: Any, what: str) -> str:
    done_ = subprocess.run([sys.executable, "-c", CHILD, str(ws.root), str(job.id), what], capture_output=True,
                           text=True, cwd=REPO, timeout=120, env=_child_env(srv))
    assert done_.returncode == 0, done_.stderr[-3000:]
    return done_.stdout.strip()


FAILED_THEN_SEED = [globs(1, 1_000), globs(2, 1_100), globs(1, 3_500), *error(500), globs(1, 3_600),
                    globs(1, 3_850)]
TOO_LITTLE = [globs(1, 1_000), globs(1, 1_100), globs(1, 3_500), reply("SUMMARY", usage=(3_600, 20)),
              globs(1, 3_500), done(3_600)]


IMAGES = [reply(None, [("ReadImage", {"path": "input/dot.png"}), ("Glob", {"pattern": "*"})], usage=(n, 10))
          for n in (500, 900, 3_500)] + [reply("SUMMARY-IMG", usage=(3_600, 20)), done(1_600)]


@pytest.mark.parametrize(("actions", "persona"), [(TWO_COMPACTIONS, None), (FAILED_THEN_SEED, None),
                                                  (TOO_LITTLE, " ".join(f"rule{i}" for i in range(3_300))),
                                                  (IMAGES, None)],
                         ids=["two-compactions", "failed-summary", "stays-above-prompt", "images"])
def test_stepped_one_call_per_process_equals_a_straight_run(
        server: OpenAIServer, tmp_path: Path, actions: list[dict[str, Any]], persona: str | None) -> None:
    p = piece(tmp_path, context={"on_pressure": "compact", "compact_keep_last": 3}, persona=persona,
              tools=("Glob", "ReadImage"))
    inputs = {"dot.png": PNG}
    server.play(*actions)
    straight_ws = Workspace(tmp_path / "straight")
    straight = straight_ws.run(straight_ws.submit("List things.", piece=str(p), model=MODEL, inputs=inputs))
    straight_sent = timeless(bodies(server))
    with OpenAIServer(actions=list(actions)) as other:
        ws = Workspace(tmp_path / "stepped")
        job = ws.submit("List things.", piece=str(p), model=MODEL, inputs=inputs)
        statuses = [_in_child(other, ws, job, "call") for _ in range(len(actions))]
        assert statuses[-1] == straight.status and set(statuses[:-1]) == {"queued"}
        assert timeless(bodies(other)) == straight_sent
    assert _comparable(ws, job, statuses=False) == _comparable(straight_ws, straight, statuses=False)
    assert [r for r in payloads(ws, job, "llm_request") if r.get("purpose") == "compaction"]
    assert len(straight_sent) == len(actions)


def test_killed_during_the_summarisation_call_resumes_to_the_straight_runs_events(
        server: OpenAIServer, tmp_path: Path) -> None:
    p = compact(tmp_path, compact_keep_last=3)
    server.play(*TWO_COMPACTIONS)
    straight_ws = Workspace(tmp_path / "straight")
    straight = straight_ws.run(straight_ws.submit("List things.", piece=str(p), model=MODEL))
    straight_sent = timeless(bodies(server))
    # the same answers, but the first summarisation request is held until its process is killed
    held = [*TWO_COMPACTIONS[:3], hold(), *TWO_COMPACTIONS[3:]]
    with OpenAIServer(actions=held) as other:
        ws = Workspace(tmp_path / "killed")
        job = ws.submit("List things.", piece=str(p), model=MODEL)
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(ws.root), str(job.id), "run"], cwd=REPO,
                                env=_child_env(other), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not other.holding.is_set():
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline, "the summarisation request never came"
                time.sleep(0.02)
            # the summarisation call was recorded before it was made, and has no answer yet
            last = ws.events(job)[-1]
            assert last.kind == "llm_request" and last.payload["purpose"] == "compaction" and last.iteration == 4
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
        assert ws.job(job.id).status == "running"  # the dead process's claim is still there
        assert _in_child(other, ws, job, "run") == "succeeded"
        sent = timeless(bodies(other))
    # the held request is asked again with the same messages; nothing else differs
    assert sent[3] == sent[4] and is_compaction(sent[3])
    assert sent[:4] + sent[5:] == straight_sent
    events = [tuple(e) for e in _comparable(ws, job, statuses=False)]
    reasons = [e.payload["reason"] for e in of(ws, job, "job_status")]
    assert any(r.startswith("recovered: the process that ran it") for r in reasons), reasons
    requests = [i for i, e in enumerate(events) if e[0] == "llm_request" and e[2] == 4]
    assert len(requests) == 2 and events[requests[0]] == events[requests[1]]
    without = [e for i, e in enumerate(events) if i != requests[0]]
    assert without == [tuple(e) for e in _comparable(straight_ws, straight, statuses=False)]
    assert [e["summary"] for e in payloads(ws, job, "compaction")] == [e["summary"] for e in
                                                                        payloads(straight_ws, straight, "compaction")]


# -- 6. forks, replays and the demo model ------------------------------------------------------------------------
def _to(step: str, prompt: int = 1_000) -> dict[str, Any]:
    return reply(None, [("transition", {"next_step": step, "summary": f"on to {step}"})], usage=(prompt, 10))


def _run_of(step: str, name: str) -> list[dict[str, Any]]:
    """One movement run: prompt crossed at its third answer, one summary, then its transition."""
    return [globs(2, 1_000), globs(1, 1_100), globs(2, 3_500), reply(f"SUMMARY of {name}", usage=(3_600, 20)),
            globs(1, 2_000), _to(step)]


def _three_runs(tmp: Path) -> Path:
    def mv(name: str, nxt: str) -> dict[str, Any]:
        return {"name": name, "instruction": f"Do {name}.", "tools": ["Glob"], "rules": [{"next": nxt}],
                "default_next": nxt}
    return write_piece(tmp, "three", {
        "context": {"window_tokens": WINDOW, "on_pressure": "compact", "compact_keep_last": 3},
        "movements": [mv("a", "b"), mv("b", "c"), mv("c", "COMPLETE")]})


RUNS = [_run_of("b", "a"), _run_of("c", "b"), _run_of("COMPLETE", "c")]


def _by_run(sent: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Requests grouped by movement run (each run's requests share its system and user prompts)."""
    out: list[list[dict[str, Any]]] = []
    for b in sent:
        if not out or b["messages"][:2] != out[-1][0]["messages"][:2]:
            out.append([])
        out[-1].append(b)
    return out


@pytest.mark.parametrize("at", [1, 2, 3])
def test_a_fork_re_serves_the_compactions_and_reaches_the_same_messages(
        server: OpenAIServer, tmp_path: Path, at: int) -> None:
    server.play(*[a for run in RUNS for a in run])
    ws = Workspace(tmp_path / "ws")
    original = ws.run(ws.submit("Go.", piece=str(_three_runs(tmp_path)), model=MODEL))
    assert original.status == "succeeded" and len(payloads(ws, original, "compaction")) == 3
    original_runs = [timeless(run) for run in _by_run(bodies(server))]
    server.received.clear()
    server.play(*[a for run in RUNS[at - 1:] for a in run])  # only the live runs ask the model
    fork = ws.fork(original, at=at)
    assert fork.status == "succeeded", fork.error
    assert not server.actions
    # the live runs send what the original's sent (their prompts differ only in the time, which is masked)
    assert [timeless(run) for run in _by_run(bodies(server))] == original_runs[at - 1:]
    re_served = [e for e in of(ws, fork, "llm_response") if e.movement_seq < at]
    assert len(re_served) == 6 * (at - 1) and all(e.payload["replayed_from"] == original.id for e in re_served)
    assert all(e.payload["usage"]["total_tokens"] == 0 for e in re_served)
    summaries = [e for e in re_served if e.payload.get("purpose") == "compaction"]
    assert [e.movement_seq for e in summaries] == list(range(1, at))
    # the same compactions, re-served or live, as the original's
    assert payloads(ws, fork, "compaction") == payloads(ws, original, "compaction")
    usage = ws.frames.usage(fork)
    assert list(usage["replayed"]) == [e.movement_seq < at for e in of(ws, fork, "llm_response")]


def test_a_replay_of_a_compacted_job_equals_the_original(server: OpenAIServer, tmp_path: Path) -> None:
    server.play(*[a for run in RUNS for a in run])
    ws = Workspace(tmp_path / "ws")
    original = ws.run(ws.submit("Go.", piece=str(_three_runs(tmp_path)), model=MODEL))
    n = len(server.received)
    replay = ws.replay(original)
    assert replay.status == "succeeded" and len(server.received) == n  # no model asked
    assert payloads(ws, replay, "compaction") == payloads(ws, original, "compaction")

    def conversation(job: Any) -> list[tuple[Any, ...]]:
        keep = ("llm_request", "llm_response", "tool_call", "tool_result", "compaction", "context_action",
                "reminder", "transition", "error")
        return [(k, s, i, json.loads(p).get("purpose"), json.loads(p).get("content"), json.loads(p).get("summary"))
                for k, s, i, p in _comparable(ws, job, statuses=False) if k in keep]

    assert conversation(replay) == conversation(original)


def test_a_replay_whose_calls_take_another_path_records_a_failed_compaction(tmp_path: Path) -> None:
    # the original compacted at its 4th call; replayed under transition, call 4 is a conversation call, so the
    # ReplayModel refuses it; under compact with keep 0 on a job that never compacted, the summary is refused
    def g(n: int) -> dict[str, Any]:
        return {**call("Glob", pattern="*"), "usage": {"prompt_tokens": n, "completion_tokens": 10}}

    spec = write_script(tmp_path, "s", {"work": [g(1_000), g(1_100), g(3_500), transition("COMPLETE")]})
    ws = Workspace(tmp_path / "ws")
    plain = ws.run(ws.submit("Go.", piece=str(piece(tmp_path)), model=spec))
    assert [r["reason"] for r in payloads(ws, plain, "reminder")] == ["context prompt"]
    replay = ws.replay(plain, piece=str(compact(tmp_path)))
    (err,) = of(ws, replay, "error")
    assert err.payload["where"] == "compaction" and "is a compaction call here but was a conversation call" in \
        err.payload["message"]
    assert replay.status == "succeeded"  # the fall-back is the wrap-up the original had, then its transition
    assert [r["text"] for r in payloads(ws, replay, "reminder")] == [r["text"] for r in payloads(ws, plain, "reminder")]


def test_the_demo_model_compacts_the_shipped_piece_and_completes(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("Write a hello world script in output/hello.py and check it.",
                           piece="plan-implement-verify", model="demo",
                           context={"on_pressure": "compact", "window_tokens": 3_000}))
    assert job.status == "succeeded", job.error
    compactions = of(ws, job, "compaction")
    assert compactions and all(e.payload["summary"].strip() for e in compactions)
    summaries = [e for e in of(ws, job, "llm_response") if e.payload.get("purpose") == "compaction"]
    assert [(e.movement_seq, e.iteration) for e in summaries] == [(e.movement_seq, e.iteration) for e in compactions]
    assert all(e.payload["tokens_after"] < e.payload["tokens_before"] for e in compactions)
    assert not of(ws, job, "error")
    # and a replay of it re-serves the summaries in order
    replay = ws.replay(job)
    assert replay.status == "succeeded" and payloads(ws, replay, "compaction") == payloads(ws, job, "compaction")


# -- 7. parallel tool calls with images --------------------------------------------------------------------------
def _look(prompt: int) -> dict[str, Any]:
    return reply(None, [("ReadImage", {"path": "input/dot.png"}), ("Glob", {"pattern": "*"})], usage=(prompt, 10))


@pytest.mark.parametrize("keep", [1, 2, 3, 4, 5])
def test_images_stay_with_their_tool_results(server: OpenAIServer, tmp_path: Path, keep: int) -> None:
    # each answer makes two parallel calls, one attaching an image: [assistant, tool, tool, user(image)]
    server.play(_look(500), _look(900), _look(3_500), reply("SUMMARY-IMG", usage=(3_600, 20)),
                _look(1_500), done(1_600))
    ws = Workspace(tmp_path / "ws")
    p = piece(tmp_path, context={"on_pressure": "compact", "compact_keep_last": keep}, tools=("Glob", "ReadImage"))
    job = ws.run(ws.submit("Look.", piece=str(p), model=MODEL, inputs={"dot.png": PNG}))
    assert job.status == "succeeded", job.error
    (ev,) = check_compactions(server, ws, job, keep)
    after = next(b for i, b in enumerate(bodies(server)) if i and is_compaction(bodies(server)[i - 1]))["messages"]
    tail = after[3:]
    # the whole last group is kept: its call, both results, then its image (never the image or a result alone)
    assert [m["role"] for m in tail[:4]] == ["assistant", "tool", "tool", "user"]
    assert is_attachment(tail[3]) and tail[3]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert ev["kept_messages"] == len(tail) == (4 if keep <= 4 else 8)
    assert_pairs_whole(after)
    # the images were counted in both sizes
    assert ev["tokens_after"] > 765


def test_a_fork_and_a_replay_across_a_failed_summary_take_the_same_fall_back(
        server: OpenAIServer, tmp_path: Path) -> None:
    run_a = [globs(1, 1_000), globs(1, 1_100), globs(2, 3_500), *error(500, "the summariser is down"), _to("b")]
    server.play(*run_a, *_run_of("c", "b"), *_run_of("COMPLETE", "c"))
    ws = Workspace(tmp_path / "ws")
    original = ws.run(ws.submit("Go.", piece=str(_three_runs(tmp_path)), model=MODEL))
    assert original.status == "succeeded"
    n = len(server.received)
    server.play(*_run_of("COMPLETE", "c"), *_run_of("COMPLETE", "c"))
    fork = ws.fork(original, at=3)
    replay = ws.replay(original)
    again = ws.fork(fork, at=3)  # a fork of the fork re-serves run 1 from the fork's record
    assert fork.status == replay.status == again.status == "succeeded" and len(server.received) == n + 12

    def run1(job: Any) -> list[tuple[Any, ...]]:
        return [(e.kind, e.iteration, e.payload.get("purpose"), e.payload.get("where"), e.payload.get("reason"))
                for e in ws.events(job) if e.movement_seq == 1 and e.kind in
                ("llm_request", "llm_response", "error", "reminder", "compaction", "transition")]

    assert run1(fork) == run1(replay) == run1(again) == run1(original)
    (err,) = of(ws, original, "error")
    assert err.payload["where"] == "compaction" and "HTTP 500" in err.payload["message"]
    # re-served, the failure says what happened in the original (not that the re-served run took another path)
    why = f"re-served from job {original.id}, whose summarisation call failed here too: {MODEL}: gave up after " \
          "1 tries; last error HTTP 500: the summariser is down; the movement goes on"
    for job in (fork, replay, again):
        (e,) = of(ws, job, "error")
        assert e.payload["where"] == "compaction" and why in e.payload["message"], e.payload["message"]
    assert payloads(ws, fork, "compaction") == payloads(ws, original, "compaction")


def _failed_summary_job(server: OpenAIServer, tmp_path: Path) -> tuple[Workspace, Any, int]:
    """A job whose first run's summarisation call failed (HTTP 500), and the server's request count after it."""
    run_a = [globs(1, 1_000), globs(1, 1_100), globs(2, 3_500), *error(500, "the summariser is down"), _to("b")]
    server.play(*run_a, *_run_of("c", "b"), *_run_of("COMPLETE", "c"))
    ws = Workspace(tmp_path / "ws")
    original = ws.run(ws.submit("Go.", piece=str(_three_runs(tmp_path)), model=MODEL))
    assert original.status == "succeeded"
    return ws, original, len(server.received)


CAUSE = f"{MODEL}: gave up after 1 tries; last error HTTP 500: the summariser is down"


def test_a_failed_compaction_keeps_its_cause_as_a_field_that_forks_re_serve(
        server: OpenAIServer, tmp_path: Path) -> None:
    ws, original, n = _failed_summary_job(server, tmp_path)
    (err,) = of(ws, original, "error")
    assert err.payload["detail"] == CAUSE  # the cause alone, as data (the message says it in a sentence)
    server.play(*_run_of("COMPLETE", "c"))
    fork = ws.fork(original, at=3)
    assert fork.status == "succeeded" and len(server.received) == n + 6
    (e,) = of(ws, fork, "error")
    assert e.payload["detail"] == f"re-served from job {original.id}, whose summarisation call failed here too: {CAUSE}"


def _edit_error_payloads(ws: Workspace, job: Any, edit: Any) -> None:
    """Rewrite job's stored error events as a store written by an older agentnb (or by hand) would hold them."""
    import sqlite3

    con = sqlite3.connect(ws.root / "agentnb.sqlite")
    with con:
        for id_, payload in con.execute("SELECT id, payload FROM events WHERE job_id = ? AND kind = 'error'",
                                        (job.id,)).fetchall():
            con.execute("UPDATE events SET payload = ? WHERE id = ?", (json.dumps(edit(json.loads(payload))), id_))
    con.close()


@pytest.mark.sqlite_only("rewrites stored events in the SQLite file as an older agentnb wrote them")
def test_a_failed_compaction_stored_before_the_detail_field_still_re_serves(
        server: OpenAIServer, tmp_path: Path) -> None:
    ws, original, n = _failed_summary_job(server, tmp_path)
    _edit_error_payloads(ws, original, lambda p: {k: v for k, v in p.items() if k != "detail"})
    (old,) = of(ws, original, "error")
    assert "detail" not in old.payload and CAUSE in old.payload["message"]
    server.play(*_run_of("COMPLETE", "c"))
    fork = ws.fork(original, at=3)
    assert fork.status == "succeeded" and len(server.received) == n + 6
    (e,) = of(ws, fork, "error")  # the cause read back out of the old message's words
    assert e.payload["detail"] == f"re-served from job {original.id}, whose summarisation call failed here too: {CAUSE}"


@pytest.mark.sqlite_only("rewrites a stored event's message in the SQLite file")
def test_a_re_served_failed_compaction_takes_its_cause_from_the_field_not_the_message(
        server: OpenAIServer, tmp_path: Path) -> None:
    ws, original, _n = _failed_summary_job(server, tmp_path)
    # the message reworded (as a later agentnb may word it): the cause still comes from the field
    _edit_error_payloads(ws, original, lambda p: {**p, "message": "the summary could not be made"})
    replay = ws.replay(original)
    assert replay.status == "succeeded" and not server.actions  # re-served whole: no model asked
    (e,) = of(ws, replay, "error")
    assert e.payload["detail"] == f"re-served from job {original.id}, whose summarisation call failed here too: {CAUSE}"
    assert f"the summarisation call failed: {e.payload['detail']}; the movement goes on" in e.payload["message"]


@pytest.fixture
def interrupt_once() -> Iterator[dict[str, int]]:
    """A read-only tool that is interrupted (Ctrl-C) the first time it runs: the store is left as a kill
    between a response's tool calls leaves it."""
    import agentnb

    state = {"left": 0, "runs": 0}

    @agentnb.tool(name="look_once", read_only=True)
    def look_once() -> str:
        """Look around."""
        state["runs"] += 1
        if state["left"]:
            state["left"] -= 1
            raise KeyboardInterrupt
        return "looked"

    yield state
    agentnb.tools.base.unregister("look_once")


def test_interrupted_inside_the_crossing_response_then_resumed_compacts_as_a_straight_run(
        server: OpenAIServer, tmp_path: Path, interrupt_once: dict[str, int]) -> None:
    crossing = reply(None, [("Glob", {"pattern": "*"}), ("look_once", {}), ("Glob", {"pattern": "input/*"})],
                     usage=(3_500, 10))
    actions = [globs(1, 1_000), globs(2, 1_100), crossing, reply("SUMMARY-1", usage=(3_600, 20)), globs(1, 1_500),
               done(1_600)]
    p = piece(tmp_path, context={"on_pressure": "compact", "compact_keep_last": 3}, tools=("Glob", "look_once"))
    server.play(*actions)
    straight_ws = Workspace(tmp_path / "straight")
    straight = straight_ws.run(straight_ws.submit("Look.", piece=str(p), model=MODEL))
    straight_sent = timeless(bodies(server))
    assert straight.status == "succeeded" and len(payloads(straight_ws, straight, "compaction")) == 1
    with OpenAIServer(actions=list(actions)) as other:
        os.environ["OPENAI_BASE_URL"] = other.base_url  # restored by the server fixture's monkeypatch
        ws = Workspace(tmp_path / "stopped")
        job = ws.submit("Look.", piece=str(p), model=MODEL)
        interrupt_once["left"] = 1
        with pytest.raises(KeyboardInterrupt):
            ws.run(job)
        # the crossing response and its prompt action are stored; its tools and the compaction are not done
        kinds = [e.kind for e in ws.events(job) if e.movement_seq == 1 and e.iteration == 3]
        assert kinds[:2] == ["llm_request", "llm_response"] and "context_action" in kinds
        assert len([k for k in kinds if k == "tool_result"]) < 3 and not of(ws, job, "compaction")
        job = Workspace(ws.root).run(job.id)  # nothing kept in memory: rebuilt from the events
        assert job.status == "succeeded", job.error
        assert timeless(bodies(other)) == straight_sent
    assert _comparable(ws, job, statuses=False) == _comparable(straight_ws, straight, statuses=False)


def test_max_iterations_counts_only_the_conversation_calls(tmp_path: Path) -> None:
    p = piece(tmp_path, context={"on_pressure": "compact", "compact_keep_last": 2}, max_iterations=4)
    spec = write_script(tmp_path, "s", {"work": [g(1_000), g(1_100), g(3_500), summary("SUM"), g(1_000),
                                                 g(1_000)]})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("Go.", piece=str(p), model=spec))
    assert [(e.iteration, e.payload.get("purpose")) for e in of(ws, job, "llm_request")] == [
        (1, None), (2, None), (3, None), (4, "compaction"), (5, None)]
    (t,) = payloads(ws, job, "transition")
    assert t["forced"] and t["reason"] == "max_iterations (4) reached without a transition"


def test_a_japanese_piece_labels_its_summary_in_japanese(server: OpenAIServer, tmp_path: Path) -> None:
    server.play(globs(1, 1_000), globs(1, 1_100), globs(1, 3_500), reply("要約です", usage=(3_600, 20)), done())
    p = write_piece(tmp_path, "ja", {"language": "ja", "context": {"window_tokens": WINDOW, "on_pressure": "compact"},
                                     "movements": [{"name": "work", "instruction": "作業する。", "tools": ["Glob"],
                                                    "rules": [{"next": "COMPLETE"}]}]})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("一覧を作る。", piece=str(p), model=MODEL))
    assert job.status == "succeeded", job.error
    sent = bodies(server)
    assert sent[3]["messages"][-1]["content"] == text("ja", "compact_request", pct="88%")
    assert sent[4]["messages"][2]["content"] == text("ja", "compact_summary", n=1, summary="要約です")


def test_nothing_to_remove_at_95_percent_is_the_forced_transition(server: OpenAIServer, tmp_path: Path) -> None:
    server.play(globs(3, 3_900))
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("List things.", piece=str(compact(tmp_path)), model=MODEL))
    assert job.status == "succeeded" and len(server.received) == 1
    assert not payloads(ws, job, "compaction") and not payloads(ws, job, "reminder") and not payloads(ws, job, "error")
    (t,) = payloads(ws, job, "transition")
    assert t["forced"] and "97.5%" in t["reason"]


# -- 8. compaction in movement 2 of 3, set on that movement only, overridden per job; resumed ----------------------
def tools(prompt: int, *calls: tuple[str, dict[str, Any]], content: str | None = None) -> dict[str, Any]:
    return reply(content, list(calls), usage=(prompt, 10))


def go(step: str, prompt: int = 900, summary: str = "done") -> dict[str, Any]:
    return reply(None, [("transition", {"next_step": step, "summary": summary})], usage=(prompt, 10))


def three_movements(tmp: Path, *, work_context: dict[str, Any] | None, work_tools: list[str],
                    max_iterations: int | None = None, name: str = "trio") -> Path:
    work: dict[str, Any] = {"name": "work", "instruction": "Do the work.", "tools": work_tools, "permission": "full",
                            "rules": [{"next": "verify"}], "default_next": "verify"}
    if work_context is not None:
        work["context"] = work_context
    if max_iterations is not None:
        work["max_iterations"] = max_iterations
    return write_piece(tmp, name, {"context": {"window_tokens": WINDOW}, "movements": [
        {"name": "plan", "instruction": "Plan.", "tools": ["Glob"], "rules": [{"next": "work"}]},
        work,
        {"name": "verify", "instruction": "Verify.", "tools": ["Glob", "Read"], "default_next": "COMPLETE",
         "rules": [{"next": "COMPLETE"}]},
    ]})


CHECK = {"name": "steps", "items": [{"text": "read the notes", "done": True}, {"text": "sum up", "done": False}]}
TRIO = [
    go("work", 800, "planned"),
    # work: a tool mix, then a response without tool calls that crosses prompt (87.5 %): its reminder, then the
    # summary instead of the wrap-up
    tools(1_000, ("Glob", {"pattern": "input/*"}), ("Grep", {"pattern": "alpha", "path": "input"})),
    tools(1_500, ("Read", {"path": "input/notes.txt"})),
    tools(2_000, ("Checklist", CHECK)),
    tools(3_500, content="Let me think about what is left."),
    reply("SUM-A: read the notes, ticked the checklist.", usage=(3_550, 30)),
    tools(1_200, ("Glob", {"pattern": "*"})),
    tools(3_600, ("Grep", {"pattern": "beta", "path": "input"}), ("Read", {"path": "input/notes.txt"})),
    reply("SUM-B: looked for beta.", usage=(3_650, 30)),
    # the third crossing, at 97.5 %: max_compactions (2) reached, so the seed's forced transition to verify
    tools(3_900, ("Glob", {"pattern": "output/*"})),
    # verify keeps the seed's behaviour (the piece says nothing): the wrap-up at prompt
    tools(3_500, ("Glob", {"pattern": "*"})),
    go("COMPLETE", 3_600, "verified"),
]
TRIO_INPUTS = {"notes.txt": "alpha one\nbeta two\n" * 40}


def trio_piece(tmp: Path) -> Path:
    """The three movements TRIO answers: work compacts (keeping 3), with the tools TRIO calls."""
    return three_movements(tmp, work_context={"on_pressure": "compact", "compact_keep_last": 3},
                           work_tools=["Glob", "Grep", "Read", "Checklist"])


def test_compaction_in_the_middle_movement_set_on_it_only_and_kept_per_job(server: OpenAIServer,
                                                                            tmp_path: Path) -> None:
    server.play(*TRIO)
    p = trio_piece(tmp_path)
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("Sum up the notes.", piece=str(p), model=MODEL, inputs=TRIO_INPUTS,
                           context={"compact_keep_last": 2}))  # the job's keep_last over the movement's
    assert job.status == "succeeded", job.error
    assert not server.actions and len(server.received) == len(TRIO)
    assert movement_names(ws, job) == ["plan", "work", "verify"]
    events = check_sent_compactions(server, ws, job, keep=2)
    assert [e["summary"] for e in events] == ["SUM-A: read the notes, ticked the checklist.", "SUM-B: looked for beta."]
    assert {e.movement_seq for e in of(ws, job, "compaction")} == {2}
    sent = [r.body for r in server.received]
    # the crossing had no tool call: its reminder was sent, and is one of the two messages kept verbatim
    first_after = sent[6]["messages"]
    assert [m["role"] for m in first_after] == ["system", "user", "user", "assistant", "user"]
    assert first_after[3]["content"] == "Let me think about what is left." and "tool_calls" not in first_after[3]
    (reminder,) = [r for r in payloads(ws, job, "reminder") if r["reason"] == "no tool call"]
    assert first_after[4]["content"] == reminder["text"]
    # the second kept the whole Grep+Read group (3 messages, though keep_last is 2)
    assert [(e["removed_messages"], e["kept_messages"]) for e in events] == [(7, 2), (5, 3)]
    assert sent[9]["messages"][3]["tool_calls"] and len(sent[9]["messages"][3]["tool_calls"]) == 2
    # the third crossing (97.5 %) after max_compactions: forced to work's default_next, no wrap-up first
    transitions = payloads(ws, job, "transition")
    assert [(t["movement"], t["next_step"], t["forced"]) for t in transitions] == [
        ("plan", "work", False), ("work", "verify", True), ("verify", "COMPLETE", False)]
    assert "force_transition (95%)" in transitions[1]["reason"] and "97.5%" in transitions[1]["reason"]
    # verify starts fresh (no summary) and wraps up at prompt as the seed does
    assert [m["role"] for m in sent[10]["messages"]] == ["system", "user"]
    assert [(e.movement_seq, e.payload["reason"]) for e in of(ws, job, "reminder")] == [
        (2, "no tool call"), (3, "context prompt")]
    assert sent[11]["messages"][-1]["content"] == payloads(ws, job, "reminder")[1]["text"]
    # the tools ran as they would without compaction: the checklist is there, the reads were whole
    assert (ws.root / "jobs" / str(job.id) / "logs" / "checklists" / "steps.json").is_file()
    # frames.usage: the summarisation rows, iterations numbering every call of the run
    usage = ws.frames.usage(job)
    work = usage[usage["seq"] == 2]
    assert list(work["iteration"]) == list(range(1, 10))
    assert list(work["action"].astype(object).fillna("")) == ["", "", "", "prompt", "compaction", "",
                                                              "prompt", "compaction", "force_transition"]
    comp = ws.frames.compactions(job)
    assert list(comp["tokens_after"]) == [e["tokens_after"] for e in events]


def test_the_same_job_stepped_one_call_per_process_sends_and_records_the_same(server: OpenAIServer,
                                                                               tmp_path: Path) -> None:
    server.play(*TRIO)
    p = trio_piece(tmp_path)
    straight_ws = Workspace(tmp_path / "straight")
    straight = straight_ws.run(straight_ws.submit("Sum up the notes.", piece=str(p), model=MODEL, inputs=TRIO_INPUTS,
                                                  context={"compact_keep_last": 2}))
    assert straight.status == "succeeded"
    with OpenAIServer(actions=list(TRIO)) as other:
        ws = Workspace(tmp_path / "stepped")
        job = ws.submit("Sum up the notes.", piece=str(p), model=MODEL, inputs=TRIO_INPUTS,
                        context={"compact_keep_last": 2})
        statuses = step_in_children(ws, job, env={**os.environ, "OPENAI_BASE_URL": other.base_url})
        assert statuses[-1] == "succeeded"
        assert len(statuses) >= len(TRIO)  # at least one process per call
        assert timeless([r.body for r in other.received]) == timeless([r.body for r in server.received])
    assert timeless(comparable(ws, job)) == timeless(comparable(straight_ws, straight))


def _by_last_pattern(body: dict[str, Any]) -> dict[str, Any]:
    """Answer from the conversation itself, so a request asked again after a kill gets the same answer: step
    ``i`` globs ``s<i>/*``; the step after the last one seen in the messages comes next (the crossing answer is
    always among the kept messages); a request without tools is a summarisation, answered with a summary."""
    usage = [1_000, 1_500, 3_500, 1_200, 3_600, 1_100, 3_700, 1_300]
    last = -1
    for m in body["messages"]:
        for c in m.get("tool_calls") or []:
            pattern = json.loads(c["function"]["arguments"]).get("pattern", "")
            if pattern.startswith("s"):
                last = int(pattern[1:].split("/")[0])
    if "tools" not in body:
        return reply(f"SUM after s{last}", usage=(3_600, 20))
    i = last + 1
    if i >= len(usage):
        return go("COMPLETE", 1_000)
    return reply(None, [("Glob", {"pattern": f"s{i}/*"}), ("Glob", {"pattern": f"s{i}/x/*"})], usage=(usage[i], 10))


def test_killed_at_random_points_and_resumed_each_time_equals_a_straight_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-compaction-test-0000")  # submit checks the spec in this process
    p = write_piece(tmp_path, "k", {
        "context": {"window_tokens": WINDOW, "on_pressure": "compact", "compact_keep_last": 3, "max_compactions": 3},
        "movements": [{"name": "work", "instruction": "W.", "tools": ["Glob"], "rules": [{"next": "COMPLETE"}],
                       "default_next": "COMPLETE"}]})
    env = {**os.environ, "OPENAI_API_KEY": "sk-compaction-test-0000", "AGENTNB_OPENAI_RETRIES": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    runs = {}
    for name, latency in (("straight", 0.0), ("killed", 0.3)):
        with OpenAIServer(responder=_by_last_pattern, latency=latency) as srv:
            ws = Workspace(tmp_path / name)
            job = ws.submit("t", piece=str(p), model=MODEL)
            chance = random.Random(16)
            for _ in range(60):  # SIGKILL the process that runs it anywhere after its first request, until it ends
                asked = len(srv.received)
                proc = subprocess.Popen([sys.executable, "-c", CHILD, str(ws.root), str(job.id), "run"], cwd=REPO,
                                        env={**env, "OPENAI_BASE_URL": srv.base_url}, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
                if name == "killed":
                    # the clock starts at the process's first request, not its start: under load a start takes
                    # seconds, and a kill before any request would make no progress at all
                    waited = time.monotonic() + 120
                    while len(srv.received) == asked and proc.poll() is None and time.monotonic() < waited:
                        time.sleep(0.02)
                try:
                    out, err = proc.communicate(timeout=120 if name == "straight" else chance.uniform(0.2, 1.8))
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGKILL)
                    proc.communicate()
                    continue
                assert out.strip() == "succeeded", err[-2000:]
                break
            else:
                raise AssertionError("the job did not end within 60 processes")
        runs[name] = (ws, job)
    ws, job = runs["straight"]
    assert [c["summary"] for c in payloads(ws, job, "compaction")] == ["SUM after s2", "SUM after s4", "SUM after s6"]

    def events(ws: Workspace, job: Any) -> list[tuple[Any, ...]]:
        # a request whose process was killed before its answer is asked again: keep the last of the repeats
        out: list[tuple[Any, ...]] = []
        for e in comparable(ws, job):
            if out and e[0] == "llm_request" and out[-1][:3] == e[:3]:
                out[-1] = e
            else:
                out.append(e)
        return timeless(out)

    assert events(*runs["killed"]) == events(*runs["straight"])


# -- 9. max_iterations right after a compaction; tools with effects (scripted) -------------------------------------
def test_max_iterations_reached_on_the_call_right_after_a_compaction(tmp_path: Path) -> None:
    p = three_movements(tmp_path, work_context={"on_pressure": "compact", "compact_keep_last": 2},
                        work_tools=["Glob"], max_iterations=3)
    spec = write_script(tmp_path, "s", {
        "plan": [transition("work", "planned")],
        "work": [g(1_000), g(3_500), summary("SUM"), g(1_200)],  # conversation calls 1, 2, (summary), 3
        "verify": [transition("COMPLETE", "ok")],
    })
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("Go.", piece=str(p), model=spec))
    assert job.status == "succeeded", job.error
    reqs = [(e.iteration, e.payload.get("purpose")) for e in of(ws, job, "llm_request") if e.movement_seq == 2]
    assert reqs == [(1, None), (2, None), (3, "compaction"), (4, None)]
    (c,) = payloads(ws, job, "compaction")
    assert c["iteration"] == 3 and c["summary"] == "SUM"
    work = [t for t in payloads(ws, job, "transition") if t["movement"] == "work"]
    assert work[0]["forced"] and work[0]["reason"] == "max_iterations (3) reached without a transition"
    assert work[0]["next_step"] == "verify"
    # stepped one call per process: the same events (the resumed run counts the summary as no turn)
    stepped_ws = Workspace(tmp_path / "stepped")
    stepped = stepped_ws.submit("Go.", piece=str(p), model=spec)
    assert step_in_children(stepped_ws, stepped)[-1] == "succeeded"
    assert comparable(stepped_ws, stepped) == comparable(ws, job)


def test_a_crossing_on_the_last_allowed_call_is_forced_without_a_summary(tmp_path: Path) -> None:
    # the crossing response is the max_iterations-th conversation call: a summary would serve no further call
    p = three_movements(tmp_path, work_context={"on_pressure": "compact"}, work_tools=["Glob"], max_iterations=2)
    spec = write_script(tmp_path, "s", {"plan": [transition("work")], "work": [g(1_000), g(3_500)],
                                        "verify": [transition("COMPLETE")]})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("Go.", piece=str(p), model=spec))
    assert job.status == "succeeded", job.error
    assert not payloads(ws, job, "compaction")
    assert not [r for r in payloads(ws, job, "llm_request") if r.get("purpose")]
    work = [t for t in payloads(ws, job, "transition") if t["movement"] == "work"]
    assert work[0]["forced"] and "max_iterations (2)" in work[0]["reason"]


def test_a_crossing_response_that_transitions_ends_without_a_summary_and_a_refused_one_compacts(
        tmp_path: Path) -> None:
    p = three_movements(tmp_path, work_context={"on_pressure": "compact", "compact_keep_last": 2}, work_tools=["Glob"])
    at = {"usage": {"prompt_tokens": 3_500, "completion_tokens": 10}}
    ws = Workspace(tmp_path / "ws")
    ends = ws.run(ws.submit("t", piece=str(p), model=write_script(tmp_path, "a", {
        "plan": [transition("work")], "work": [g(1_000), g(1_100), {**transition("verify", "done"), **at}],
        "verify": [transition("COMPLETE")]})))
    assert ends.status == "succeeded" and not payloads(ws, ends, "compaction")
    assert not [r for r in payloads(ws, ends, "llm_request") if r.get("purpose")]
    refused = ws.run(ws.submit("t", piece=str(p), model=write_script(tmp_path, "b", {
        "plan": [transition("work")],
        "work": [g(1_000), g(1_100), {**transition("nowhere", "bad"), **at}, summary("S"), transition("verify")],
        "verify": [transition("COMPLETE")]})))
    assert refused.status == "succeeded", refused.error
    (c,) = payloads(ws, refused, "compaction")
    # the refused transition and its error result are the kept tail
    assert (c["summary"], c["removed_messages"], c["kept_messages"]) == ("S", 4, 2)


def test_a_model_that_reports_no_usage_compacts_on_estimates_and_resumes_to_the_same(tmp_path: Path) -> None:
    # no usage in any response: the context is the tokenizer's count; each Read is cut to half of what is left,
    # so the ratio climbs 23 → 62 → 81 → 90 % (prompt), and starts again from the recount after each compaction
    p = write_piece(tmp_path, "est", {
        "context": {"window_tokens": 3_000, "on_pressure": "compact", "compact_keep_last": 2},
        "movements": [{"name": "work", "instruction": "W.", "tools": ["Read"], "rules": [{"next": "COMPLETE"}],
                       "default_next": "COMPLETE"}]})

    def read(i: int) -> dict[str, Any]:
        return call("Read", path=f"input/f{i}.txt")

    spec = write_script(tmp_path, "s", {"work": [
        read(1), read(2), read(3), read(4), {"content": "SUM-1"}, read(5), read(6), read(7), read(8),
        {"content": "SUM-2"}, *[read(i) for i in range(1, 7)], transition("COMPLETE")]})
    inputs = {f"f{i}.txt": " ".join(f"word{i}_{k}" for k in range(3_000)) for i in range(1, 9)}
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec, inputs=inputs))
    assert job.status == "succeeded", job.error
    usage = ws.frames.usage(job)
    assert set(usage["source"]) == {"tiktoken"}
    comps = payloads(ws, job, "compaction")
    assert [c["iteration"] for c in comps] == [5, 10]
    for c in comps:
        assert c["tokens_before"] / 3_000 >= 0.85 > c["tokens_after"] / 3_000 and c["kept_messages"] == 2
        # the next call's estimate is the recounted list: what the compaction said it left
        nxt = usage[usage["iteration"] == c["iteration"] + 1]
        assert int(nxt["prompt_tokens"].iloc[0]) == c["tokens_after"]
    assert [(e.iteration, e.payload["reason"]) for e in of(ws, job, "reminder")] == [(14, "context prompt")]
    (t,) = payloads(ws, job, "transition")
    assert t["forced"] and "force_transition (95%)" in t["reason"]
    stepped_ws = Workspace(tmp_path / "stepped")
    stepped = stepped_ws.submit("t", piece=str(p), model=spec, inputs=inputs)
    assert step_in_children(stepped_ws, stepped)[-1] == "succeeded"
    assert comparable(stepped_ws, stepped) == comparable(ws, job)


def test_custom_thresholds_move_where_compaction_and_the_fall_back_happen(tmp_path: Path) -> None:
    # prompt at 50 %, force_transition at 90 % of 4,000: two compactions, then the wrap-up, then forced at 92.5 %
    p = write_piece(tmp_path, "low", {
        "context": {"window_tokens": WINDOW, "on_pressure": "compact", "compact_keep_last": 2,
                    "thresholds": {"warn": 0.3, "prompt": 0.5, "force_transition": 0.9, "exhausted": 0.99}},
        "movements": [{"name": "work", "instruction": "W.", "tools": ["Glob"], "rules": [{"next": "COMPLETE"}],
                       "default_next": "COMPLETE"}]})
    spec = write_script(tmp_path, "s", {"work": [g(1_000), g(1_100), g(2_100), summary("S1"), g(1_000), g(2_200),
                                                 summary("S2"), g(2_300), g(3_700)]})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec))
    assert job.status == "succeeded", job.error
    comps = payloads(ws, job, "compaction")
    assert [(c["iteration"], c["summary"]) for c in comps] == [(4, "S1"), (7, "S2")]
    assert all(c["tokens_after"] / WINDOW < 0.5 <= c["tokens_before"] / WINDOW for c in comps)
    assert [(e.iteration, e.payload["reason"]) for e in of(ws, job, "reminder")] == [(8, "context prompt")]
    (t,) = payloads(ws, job, "transition")
    assert t["forced"] and t["reason"] == "context at 92.5% of 4,000 tokens reached force_transition (90%)"


@pytest.mark.needs("bwrap")
def test_write_edit_and_bash_in_a_compacting_movement_resumed_per_call(tmp_path: Path) -> None:
    p = three_movements(tmp_path, work_context={"on_pressure": "compact", "compact_keep_last": 1},
                        work_tools=["Write", "Edit", "Bash", "Read"])
    script = {
        "plan": [transition("work", "planned")],
        "work": [
            g(1_000, "Write", path="output/a.txt", content="one\n"),
            g(1_400, "Bash", command="echo two >> output/a.txt && wc -l < output/a.txt"),
            g(3_500, "Edit", path="output/a.txt", old="one", new="ONE"),  # crosses prompt
            summary("SUM-1: wrote a.txt, appended, edited."),
            g(1_600, "Read", path="output/a.txt"),
            g(3_550, "Bash", command="cat output/a.txt"),  # crosses again
            summary("SUM-2: read it back."),
            transition("verify", "a.txt has ONE and two", ),
        ],
        "verify": [transition("COMPLETE", "ok")],
    }
    spec = write_script(tmp_path, "s", script)
    straight_ws = Workspace(tmp_path / "straight")
    straight = straight_ws.run(straight_ws.submit("Go.", piece=str(p), model=spec))
    assert straight.status == "succeeded", straight.error
    assert (straight_ws.root / "jobs" / str(straight.id) / "output" / "a.txt").read_text() == "ONE\ntwo\n"
    comps = payloads(straight_ws, straight, "compaction")
    assert [(c["removed_messages"], c["kept_messages"]) for c in comps] == [(4, 2), (5, 2)]
    bash = [r["content"] for r in payloads(straight_ws, straight, "tool_result") if r["tool"] == "Bash"]
    assert bash[1].strip().endswith("ONE\ntwo")
    ws = Workspace(tmp_path / "stepped")
    job = ws.submit("Go.", piece=str(p), model=spec)
    assert step_in_children(ws, job)[-1] == "succeeded"
    assert (ws.root / "jobs" / str(job.id) / "output" / "a.txt").read_text() == "ONE\ntwo\n"
    assert comparable(ws, job) == comparable(straight_ws, straight)
