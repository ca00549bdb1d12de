"""Issue 16 reviewed as its checker would (docs/context.md): jobs the authors' tests did not run.

Compaction in the middle movement of three pieces, set on that movement only and overridden per job, with tool
mixes, a reminder at the crossing and ``max_iterations`` right after a compaction; every message sent after a
compaction read back from the loopback server.  Resuming in another process between any two calls.  Loop
monitors on two- and three-movement cycles, with and without a judge, two monitors in one piece, forced runs,
validation.  A loop monitor and compaction in one job, forked and replayed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, transition, user_prompts, write_piece, write_script
from openai_server import OpenAIServer, reply

from agentnb import Workspace
from agentnb.engine.context import ContextManager
from agentnb.engine.pieces import load_piece
from agentnb.engine.prompts import text
from agentnb.errors import PieceError
from agentnb.views.render import job_html

REPO = Path(__file__).resolve().parents[1]
MODEL = "openai:gpt-4o-mini"
WINDOW = 4_000  # warn 2,800 · prompt 3,400 · force_transition 3,800
SUMMARY_LABEL = text("en", "compact_summary", n=0, summary="").split("(")[0]
ASK = "Summarise the conversation so far"
JUDGE = "judge:review/fix"
NOW = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d \(\w+, UTC\)")  # the prompts' clock, to the minute
CHILD = ("import sys; from agentnb import Workspace; ws = Workspace(sys.argv[1]); job = int(sys.argv[2]); "
         "print(ws.step(job, unit='call').status if sys.argv[3] == 'call' else ws.run(job).status)")


# -- helpers ------------------------------------------------------------------------------------------------
@pytest.fixture
def server(loopback: Callable[..., OpenAIServer]) -> OpenAIServer:
    return loopback("sk-review-test-0000", retries="0", timeout="30")


def tools(prompt: int, *calls: tuple[str, dict[str, Any]], content: str | None = None) -> dict[str, Any]:
    return reply(content, list(calls), usage=(prompt, 10))


def go(step: str, prompt: int = 900, summary: str = "done") -> dict[str, Any]:
    return reply(None, [("transition", {"next_step": step, "summary": summary})], usage=(prompt, 10))


def of(ws: Workspace, job: Any, kind: str) -> list[Any]:
    return ws.events(job, kinds=[kind])


def payloads(ws: Workspace, job: Any, kind: str) -> list[dict[str, Any]]:
    return [e.payload for e in of(ws, job, kind)]


def names(ws: Workspace, job: Any) -> list[str]:
    return [str(m) for m in ws.frames.movements(job)["movement"]]


def is_attachment(m: dict[str, Any]) -> bool:
    return m["role"] == "user" and isinstance(m.get("content"), list)


def pairs_whole(messages: list[dict[str, Any]]) -> None:
    """Every tool result follows the assistant message that called it; every call has its result."""
    open_ids: list[str] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            assert m["tool_call_id"] in open_ids, f"message {i}: a tool result without its call"
            open_ids.remove(m["tool_call_id"])
            continue
        assert not open_ids, f"message {i}: calls {open_ids} have no result before it"
        if m["role"] == "assistant":
            open_ids = [c["id"] for c in m.get("tool_calls") or []]
    assert not open_ids


def kept_from(conv: list[dict[str, Any]], keep: int) -> int:
    k = max(2, len(conv) - keep)
    while 2 < k < len(conv) and (conv[k]["role"] == "tool" or is_attachment(conv[k])):
        k -= 1
    return k


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
        start = kept_from(conv, keep)
        assert after[:2] == conv[:2] and [m["role"] for m in after[:3]] == ["system", "user", "user"]
        index = sum(1 for e in events[:n] if e.movement_seq == ev.movement_seq) + 1
        assert after[2]["content"] == text("en", "compact_summary", n=index, summary=p["summary"])
        assert after[2]["content"].startswith(SUMMARY_LABEL)
        assert after[3:] == conv[start:]
        assert len(after) - 3 >= min(keep, len(conv) - 2)
        pairs_whole(conv)
        pairs_whole(after)
        assert (p["removed_messages"], p["kept_messages"]) == (start - 2, len(conv) - start)
        trigger = responses[(ev.movement_seq, ev.iteration - 1)]
        assert trigger.get("purpose") is None
        added = conv[len(prev) + 1:]
        assert p["tokens_before"] == sum(trigger["usage"][k] for k in ("prompt_tokens", "completion_tokens")) + sum(
            counter.count_message(m) for m in added)
        schemas = counter.counter.count(json.dumps(sent[i + 1]["tools"], ensure_ascii=False))
        assert p["tokens_after"] == schemas + sum(counter.count_message(m) for m in after)
        assert p["tokens_after"] < p["tokens_before"]
    return [e.payload for e in events]


def comparable(ws: Workspace, job: Any) -> list[tuple[Any, ...]]:
    """Events minus what differs between two runs of the same steps (times, latency, claim owners, the
    job_status events stepping adds), the prompts' clock masked."""
    out = []
    for e in ws.events(job):
        if e.kind == "job_status":
            continue
        payload = {k: v for k, v in e.payload.items() if k not in ("latency_s", "ts", "owner")}
        out.append((e.kind, e.movement_seq, e.iteration, NOW.sub("<now>", json.dumps(payload, sort_keys=True,
                                                                                    default=str))))
    return out


def timeless(value: Any) -> Any:
    """``value`` with the clock masked and the server's tool-call ids (``call_<request>_<i>``: a request asked
    again moves them on) numbered by first appearance."""
    ids: dict[str, str] = {}
    masked = NOW.sub("<now>", json.dumps(value))
    return json.loads(re.sub(r"call_\d+_\d+", lambda m: ids.setdefault(m.group(0), f"id{len(ids)}"), masked))


def step_in_children(ws: Workspace, job: Any, env: dict[str, str] | None = None, limit: int = 80) -> list[str]:
    """Step ``job`` one call per fresh Python process until it ends; the statuses each step left."""
    statuses: list[str] = []
    child_env = {**(env or os.environ), "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    while len(statuses) < limit:
        done = subprocess.run([sys.executable, "-c", CHILD, str(ws.root), str(job.id), "call"], capture_output=True,
                              text=True, cwd=REPO, timeout=120, env=child_env)
        assert done.returncode == 0, done.stderr[-3000:]
        statuses.append(done.stdout.strip())
        if statuses[-1] != "queued":
            return statuses
    raise AssertionError(f"job {job.id} did not end within {limit} steps: {statuses[-5:]}")


# -- 1. compaction in movement 2 of 3, set on that movement only, overridden per job ------------------------------
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


def test_compaction_in_the_middle_movement_set_on_it_only_and_kept_per_job(server: OpenAIServer,
                                                                            tmp_path: Path) -> None:
    server.play(*TRIO)
    p = three_movements(tmp_path, work_context={"on_pressure": "compact", "compact_keep_last": 3},
                        work_tools=["Glob", "Grep", "Read", "Checklist"])
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("Sum up the notes.", piece=str(p), model=MODEL, inputs=TRIO_INPUTS,
                           context={"compact_keep_last": 2}))  # the job's keep_last over the movement's
    assert job.status == "succeeded", job.error
    assert not server.actions and len(server.received) == len(TRIO)
    assert names(ws, job) == ["plan", "work", "verify"]
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
    p = three_movements(tmp_path, work_context={"on_pressure": "compact", "compact_keep_last": 3},
                        work_tools=["Glob", "Grep", "Read", "Checklist"])
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
    monkeypatch.setenv("OPENAI_API_KEY", "sk-review-test-0000")  # submit checks the spec in this process
    p = write_piece(tmp_path, "k", {
        "context": {"window_tokens": WINDOW, "on_pressure": "compact", "compact_keep_last": 3, "max_compactions": 3},
        "movements": [{"name": "work", "instruction": "W.", "tools": ["Glob"], "rules": [{"next": "COMPLETE"}],
                       "default_next": "COMPLETE"}]})
    env = {**os.environ, "OPENAI_API_KEY": "sk-review-test-0000", "AGENTNB_OPENAI_RETRIES": "0",
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


# -- 2. max_iterations right after a compaction; tools with effects (scripted) -------------------------------------
def g(prompt: int, tool: str = "Glob", **arguments: Any) -> dict[str, Any]:
    args = arguments or {"pattern": "*"}
    return {**call(tool, **args), "usage": {"prompt_tokens": prompt, "completion_tokens": 10}}


def summary(words: str) -> dict[str, Any]:
    return {"content": words, "usage": {"prompt_tokens": 3_600, "completion_tokens": 20}}


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


# -- 3. loop monitors -----------------------------------------------------------------------------------------
def loop_piece(tmp: Path, monitors: list[dict[str, Any]], *, name: str = "loops",
               context: dict[str, Any] | None = None, extra: dict[str, dict[str, Any]] | None = None) -> Path:
    """write → review → fix → review … ; review may also go to test, fix back to write; test → review | COMPLETE."""
    mvs: list[dict[str, Any]] = [
        {"name": "write", "instruction": "Write it.", "tools": ["Glob"], "rules": [{"next": "review"}]},
        {"name": "review", "instruction": "Review it.", "tools": ["Glob"],
         "rules": [{"condition": "issues", "next": "fix"}, {"condition": "needs tests", "next": "test"},
                   {"condition": "good", "next": "COMPLETE"}], "default_next": "fix"},
        {"name": "fix", "instruction": "Fix it.", "tools": ["Glob"],
         "rules": [{"condition": "start over", "next": "write"}, {"condition": "fixed", "next": "review"},
                   {"condition": "check", "next": "test"}], "default_next": "review"},
        {"name": "test", "instruction": "Test it.", "tools": ["Glob"],
         "rules": [{"condition": "failing", "next": "review"}, {"condition": "passing", "next": "COMPLETE"}]},
    ]
    for m in mvs:
        m.update((extra or {}).get(m["name"], {}))
    body: dict[str, Any] = {"max_movements": 60, "movements": mvs, "loop_monitors": monitors}
    if context is not None:
        body["context"] = context
    return write_piece(tmp, name, body)


def judged(threshold: int, *targets: str, cycle: tuple[str, ...] = ("review", "fix"), **more: Any) -> dict[str, Any]:
    return {"cycle": list(cycle), "threshold": threshold, **more,
            "judge": {"persona": "You judge loops.", "instruction": "Decide whether to go on.",
                      "rules": [{"condition": f"choose {t}", "next": t} for t in targets]}}


def loops_of(ws: Workspace, job: Any) -> list[dict[str, Any]]:
    return [{**e.payload, "seq": e.movement_seq} for e in of(ws, job, "loop_detected")]


def test_judge_goes_on_then_sends_to_a_movement_outside_the_cycle(tmp_path: Path) -> None:
    p = loop_piece(tmp_path, [judged(2, "review", "test", "ABORT")])
    spec = write_script(tmp_path, "s", {
        "write": [transition("review", "wrote v1")],
        "review": [transition("fix", f"review {i}: two issues") for i in (1, 2, 3, 4)],
        "fix": [transition("review", f"fix {i}") for i in (1, 2, 3, 4)],
        JUDGE: [transition("review", "fewer issues each round: go on"), transition("test", "enough: test it")],
        "test": [transition("COMPLETE", "tests pass")],
    })
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec))
    assert job.status == "succeeded", job.error
    assert names(ws, job) == ["write", "review", "fix", "review", "fix", JUDGE,
                              "review", "fix", "review", "fix", JUDGE, "test"]
    first, second = loops_of(ws, job)
    assert (first["seq"], first["cycle"], first["count"], first["runs"]) == (5, ["review", "fix"], 2, [2, 3, 4, 5])
    assert first["summaries"] == ["review 1: two issues", "fix 1", "review 2: two issues", "fix 2"]
    assert (second["seq"], second["runs"]) == (10, [7, 8, 9, 10])
    assert second["summaries"] == ["review 3: two issues", "fix 3", "review 4: two issues", "fix 4"]
    assert first["judge"] == second["judge"] == JUDGE and first["next"] is None
    prompts = user_prompts(ws, job, JUDGE)
    assert all(s in prompts[0] for s in first["summaries"]) and "Decide whether to go on." in prompts[0]
    assert all(s in prompts[1] for s in second["summaries"]) and "review 2" not in prompts[1]
    mv = ws.frames.movements(job)
    assert [bool(j) for j in mv["judge"]] == [n == JUDGE for n in names(ws, job)]
    assert list(mv["next_step"])[5] == "review" and list(mv["next_step"])[10] == "test"
    markup = job_html(ws, job.id)
    assert markup.count("⟳ loop review → fix ×2") == 2


def test_the_judge_is_sent_its_persona_the_summaries_and_only_the_transition_tool(server: OpenAIServer,
                                                                                    tmp_path: Path) -> None:
    p = loop_piece(tmp_path, [judged(2, "review", "ABORT")])
    server.play(go("review", summary="wrote"), go("fix", summary="R1: the title is wrong"),
                go("review", summary="F1: retitled"), go("fix", summary="R2: the title is still wrong"),
                go("review", summary="F2: retitled again"), go("ABORT", summary="stuck on the title"))
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=MODEL))
    assert job.status == "aborted", job.error
    judge = server.received[-1].body
    assert judge["messages"][0] == {"role": "system", "content": "You judge loops."}
    assert [t["function"]["name"] for t in judge["tools"]] == ["transition"]
    user = judge["messages"][1]["content"]
    for words in ("Decide whether to go on.", "R1: the title is wrong", "F1: retitled", "R2: the title is still wrong",
                  "F2: retitled again"):
        assert words in user
    assert user.index("R1: the title") < user.index("F1: retitled") < user.index("F2: retitled again")
    enum = judge["tools"][0]["function"]["parameters"]["properties"]["next_step"].get("enum")
    assert enum is None or set(enum) == {"review", "ABORT"}


def test_a_judged_loop_stepped_one_call_per_process_sends_the_same_messages(server: OpenAIServer,
                                                                            tmp_path: Path) -> None:
    p = loop_piece(tmp_path, [judged(2, "review", "ABORT")])
    actions = [go("review", summary="wrote"), tools(1_000, ("Glob", {"pattern": "*"})),
               go("fix", summary="R1"), go("review", summary="F1"), go("fix", summary="R2"),
               tools(1_200, ("Glob", {"pattern": "output/*"})), go("review", summary="F2"),
               tools(900, content="Comparing the rounds."), go("ABORT", summary="stuck")]
    server.play(*actions)
    straight_ws = Workspace(tmp_path / "straight")
    straight = straight_ws.run(straight_ws.submit("t", piece=str(p), model=MODEL))
    assert straight.status == "aborted", straight.error
    with OpenAIServer(actions=list(actions)) as other:
        ws = Workspace(tmp_path / "stepped")
        job = ws.submit("t", piece=str(p), model=MODEL)
        assert step_in_children(ws, job, env={**os.environ, "OPENAI_BASE_URL": other.base_url})[-1] == "aborted"
        assert timeless([r.body for r in other.received]) == timeless([r.body for r in server.received])
    assert timeless(comparable(ws, job)) == timeless(comparable(straight_ws, straight))
    assert names(ws, job) == ["write", "review", "fix", "review", "fix", JUDGE]


def test_a_monitor_without_a_judge_may_complete_the_job(tmp_path: Path) -> None:
    p = loop_piece(tmp_path, [{"cycle": ["review", "fix", "test"], "threshold": 1, "next": "COMPLETE"}])
    spec = write_script(tmp_path, "s", {"write": [transition("review")], "review": [transition("fix", "r1")],
                                        "fix": [transition("test", "f1")], "test": [transition("review", "t1")]})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec))
    assert job.status == "succeeded", job.error
    assert names(ws, job) == ["write", "review", "fix", "test"]
    (ev,) = loops_of(ws, job)
    assert (ev["cycle"], ev["count"], ev["runs"], ev["summaries"], ev["next"]) == (
        ["review", "fix", "test"], 1, [2, 3, 4], ["r1", "f1", "t1"], "COMPLETE")
    # the run's own transition is recorded as the model made it; the monitor decided where the job went
    assert payloads(ws, job, "transition")[-1]["next_step"] == "review"


def test_judge_says_complete(tmp_path: Path) -> None:
    p = loop_piece(tmp_path, [judged(3, "COMPLETE", "ABORT")])
    spec = write_script(tmp_path, "s", {
        "write": [transition("review")], "review": [transition("fix", f"r{i}") for i in range(3)],
        "fix": [transition("review", f"f{i}") for i in range(3)],
        JUDGE: [transition("COMPLETE", "good enough after three rounds")]})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec))
    assert job.status == "succeeded"
    assert names(ws, job) == ["write"] + ["review", "fix"] * 3 + [JUDGE]
    (ev,) = loops_of(ws, job)
    assert ev["count"] == 3 and ev["runs"] == [2, 3, 4, 5, 6, 7]


def test_two_monitors_in_one_piece_each_fire_on_their_own_cycle(tmp_path: Path) -> None:
    monitors = [judged(2, "review", "ABORT"),
                {"name": "tests-loop", "cycle": ["review", "test"], "threshold": 2, "next": "ABORT"}]
    p = loop_piece(tmp_path, monitors)
    ws = Workspace(tmp_path / "ws")
    # review ⇄ test twice: the second monitor aborts, the first never fires
    a = ws.run(ws.submit("t", piece=str(p), model=write_script(tmp_path, "a", {
        "write": [transition("review")], "review": [transition("test", f"r{i}") for i in range(3)],
        "test": [transition("review", f"t{i}") for i in range(3)]})))
    assert a.status == "aborted"
    assert names(ws, a) == ["write", "review", "test", "review", "test"]
    (ev,) = loops_of(ws, a)
    assert (ev["monitor"], ev["cycle"], ev["judge"], ev["next"]) == ("tests-loop", ["review", "test"], None, "ABORT")
    assert a.error == "loop monitor tests-loop: review → test repeated 2 times"
    markup = job_html(ws, a.id)
    assert markup.count("⟳ loop review → test ×2") == 1 and "loop monitor tests-loop: runs 2–5; then ABORT" in markup
    assert not ws.frames.movements(a)["judge"].any()
    # mixed: review→fix→review→test→review→fix→review→fix: the first monitor's cycle ends the history twice
    # only after the test detour, counted from the runs themselves
    b = ws.run(ws.submit("t", piece=str(p), model=write_script(tmp_path, "b", {
        "write": [transition("review")],
        "review": [transition("fix", "r1"), transition("test", "r2"), transition("fix", "r3"), transition("fix", "r4"),
                   transition("COMPLETE", "r5")],
        "fix": [transition("review", f"f{i}") for i in (1, 2, 3)],
        "test": [transition("review", "t1")],
        JUDGE: [transition("review", "go on")]})))
    assert b.status == "succeeded", b.error
    assert names(ws, b) == ["write", "review", "fix", "review", "test", "review", "fix", "review", "fix", JUDGE,
                            "review"]
    (ev,) = loops_of(ws, b)
    assert (ev["monitor"], ev["runs"]) == (JUDGE, [6, 7, 8, 9])
    mv = ws.frames.movements(b)
    assert [bool(j) for j in mv["judge"]] == [False] * 9 + [True, False]


def test_a_three_movement_cycle_left_before_the_threshold_counts_again_from_scratch(tmp_path: Path) -> None:
    judge = "judge:review/fix/test"
    p = loop_piece(tmp_path, [judged(2, "COMPLETE", "ABORT", cycle=("review", "fix", "test"))],
                   extra={"test": {"rules": [{"condition": "failing", "next": "review"},
                                             {"condition": "passing", "next": "COMPLETE"}]}})
    spec = write_script(tmp_path, "s", {
        "write": [transition("review", "w1"), transition("review", "w2")],
        "review": [transition("fix", f"r{i}") for i in range(1, 6)],
        "fix": [transition("test", "f1"), transition("write", "f2: start over"),
                transition("test", "f3"), transition("test", "f4"), transition("test", "f5")],
        "test": [transition("review", f"t{i}") for i in range(1, 5)],
        judge: [transition("ABORT", "round and round")]})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec))
    assert job.status == "aborted"
    assert names(ws, job) == ["write", "review", "fix", "test", "review", "fix", "write",
                              "review", "fix", "test", "review", "fix", "test", judge]
    (ev,) = loops_of(ws, job)
    assert ev["runs"] == [8, 9, 10, 11, 12, 13] and ev["summaries"] == ["r3", "f3", "t2", "r4", "f4", "t3"]
    assert ev["cycle"] == ["review", "fix", "test"]


def test_a_loop_of_forced_runs_is_detected_with_their_forced_summaries(tmp_path: Path) -> None:
    # fix never transitions (max_iterations 1 → default_next review); review crosses 95 % (→ default_next fix)
    p = loop_piece(tmp_path, [{"cycle": ["review", "fix"], "threshold": 2, "next": "test"}],
                   context={"window_tokens": WINDOW}, extra={"fix": {"max_iterations": 1}})
    spec = write_script(tmp_path, "s", {
        "write": [transition("review")],
        "review": [g(3_900), g(3_900)],
        "fix": [{"content": "I am thinking."}, {"content": "Still thinking."}],
        "test": [transition("COMPLETE", "passes")]})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec))
    assert job.status == "succeeded", job.error
    assert names(ws, job) == ["write", "review", "fix", "review", "fix", "test"]
    (ev,) = loops_of(ws, job)
    assert ev["next"] == "test" and ev["judge"] is None and ev["runs"] == [2, 3, 4, 5]
    assert all(s.startswith("Forced transition: ") for s in ev["summaries"])
    assert "force_transition (95%)" in ev["summaries"][0] and "max_iterations (1)" in ev["summaries"][1]
    assert [bool(f) for f in ws.frames.movements(job)["forced"]] == [False, True, True, True, True, False]


def test_a_one_movement_cycle_and_a_monitor_sending_to_a_movement(tmp_path: Path) -> None:
    # fix → fix three times is a loop of one movement; its monitor sends the job to test, with no judge
    p = loop_piece(tmp_path, [{"name": "self", "cycle": ["fix"], "threshold": 3, "next": "test"}],
                   extra={"fix": {"rules": [{"condition": "again", "next": "fix"},
                                            {"condition": "fixed", "next": "review"}]}})
    spec = write_script(tmp_path, "s", {
        "write": [transition("review")], "review": [transition("fix", "r1")],
        "fix": [transition("fix", f"f{i}") for i in range(1, 6)], "test": [transition("COMPLETE", "ok")]})
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec))
    assert job.status == "succeeded", job.error
    assert names(ws, job) == ["write", "review", "fix", "fix", "fix", "test"]
    (ev,) = loops_of(ws, job)
    assert (ev["monitor"], ev["cycle"], ev["count"], ev["runs"], ev["next"]) == ("self", ["fix"], 3, [3, 4, 5], "test")
    assert ev["summaries"] == ["f1", "f2", "f3"]
    assert "⟳ loop fix ×3" in job_html(ws, job.id)


@pytest.mark.parametrize(("yaml_text", "line", "field", "words"), [
    ("loop_monitors:\n  - cycle: [review, fix]\n    threshold: 2\n    next: ABORT\n"
     "  - cycle:\n      - review\n      - nowhere\n    threshold: 2\n    next: ABORT\n",
     15, "loop_monitors[1].cycle[1]", "unknown movement 'nowhere'"),
    ("loop_monitors:\n  - cycle: [review, fix]\n    threshold: 2\n    judge:\n      instruction: x\n"
     "      rules:\n        - {condition: a, next: review}\n        - {condition: b, next: elsewhere}\n",
     16, "loop_monitors[0].judge.rules[1].next", "unknown movement 'elsewhere'"),
    ("loop_monitors:\n  - cycle: [review, fix]\n    threshold: 2\n    next: ABORT\n    judge:\n"
     "      rules: [{next: review}]\n", 10, "loop_monitors[0].judge", "exactly one of 'judge' and 'next'"),
    ("loop_monitors:\n  - cycle: [review, fix]\n    threshold: 0\n    next: ABORT\n", 11,
     "loop_monitors[0].threshold", "whole number ≥ 1"),
    ("loop_monitors:\n  - cycle: [review, fix]\n    threshold: -3\n    next: ABORT\n", 11,
     "loop_monitors[0].threshold", "whole number ≥ 1"),
    ("loop_monitors:\n  - cycle: [review, fix]\n    threshold: true\n    next: ABORT\n", 11,
     "loop_monitors[0].threshold", "whole number"),
    ("loop_monitors:\n  - {cycle: [review, fix], threshold: 2, judge: {rules: [{next: review}]}}\n"
     "  - {cycle: [review, fix], threshold: 3, judge: {rules: [{next: ABORT}]}}\n", 11,
     "loop_monitors[1].name", "duplicate loop monitor name 'judge:review/fix'"),
    ("loop_monitors:\n  - {cycle: review, threshold: 2, next: ABORT}\n", 10, "loop_monitors[0].cycle", "list"),
    ("loop_monitors: {cycle: [review, fix]}\n", 9, "loop_monitors", "list"),
], ids=["unknown-in-second-monitor", "judge-rule-target", "judge-and-next", "threshold-0", "threshold-negative",
        "threshold-bool", "same-default-name", "cycle-not-a-list", "monitors-not-a-list"])
def test_more_validation_errors_name_file_line_and_field(tmp_path: Path, yaml_text: str, line: int, field: str,
                                                         words: str) -> None:
    base = ("name: p\nmovements:\n  - name: review\n    instruction: r\n    rules: [{next: fix}]\n"
            "  - name: fix\n    instruction: f\n    rules: [{next: review}]\n")
    path = tmp_path / "bad.yaml"
    path.write_text(base + yaml_text, encoding="utf-8")
    with pytest.raises(PieceError) as err:
        load_piece(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}:{line}: {field}: "), message
    assert words in message, message


# -- 4. a loop monitor and compaction in one job; resumed, forked, replayed ----------------------------------------
def loop_and_compaction(tmp: Path) -> tuple[Path, str]:
    """review ⇄ fix twice; fix compacts in each run (its own context), the judge compacts (the piece's context
    reaches it) then aborts."""
    p = loop_piece(tmp, [judged(2, "review", "ABORT")],
                   context={"window_tokens": WINDOW, "on_pressure": "compact", "compact_keep_last": 2},
                   extra={"review": {"context": {"on_pressure": "transition"}},
                          # one compaction per run: max_compactions counts per movement run, not per name
                          "fix": {"context": {"compact_keep_last": 1, "max_compactions": 1}}})
    spec = write_script(tmp, "s", {
        "write": [transition("review", "wrote")],
        "review": [g(1_000), transition("fix", "review 1"), g(1_000), transition("fix", "review 2")],
        "fix": [g(1_000), g(1_500), g(3_500), summary("FIX-SUM-1"), g(1_000), transition("review", "fix 1"),
                g(1_000), g(1_500), g(3_500), summary("FIX-SUM-2"), transition("review", "fix 2")],
        JUDGE: [{"content": "Round one fixed a typo.", "usage": {"prompt_tokens": 1_000, "completion_tokens": 10}},
                {"content": "Round two fixed the same typo.",
                 "usage": {"prompt_tokens": 3_500, "completion_tokens": 10}},
                summary("JUDGE-SUM"),
                transition("ABORT", "the same typo twice: stuck")],
    })
    return p, spec


def test_a_compacting_movement_inside_a_cycle_and_a_compacting_judge(tmp_path: Path) -> None:
    p, spec = loop_and_compaction(tmp_path)
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("t", piece=str(p), model=spec))
    assert job.status == "aborted", job.error
    assert names(ws, job) == ["write", "review", "fix", "review", "fix", JUDGE]
    seq_name = dict(enumerate(names(ws, job), start=1))
    comps = of(ws, job, "compaction")
    assert [(seq_name[c.movement_seq], c.payload["summary"]) for c in comps] == [
        ("fix", "FIX-SUM-1"), ("fix", "FIX-SUM-2"), (JUDGE, "JUDGE-SUM")]
    # fix keeps 1 (its own setting): the last Glob call with its result → 2 messages; the judge keeps 2 of
    # [sys, user, a, reminder, a, reminder]
    assert [(c.payload["removed_messages"], c.payload["kept_messages"]) for c in comps] == [(4, 2), (4, 2), (2, 2)]
    (ev,) = loops_of(ws, job)
    assert ev["summaries"] == ["review 1", "fix 1", "review 2", "fix 2"]
    # the judge compacted but its loop summaries are still in its user prompt (message 1, never summarised)
    (start,) = [e for e in of(ws, job, "movement_start") if e.payload["movement"] == JUDGE]
    assert all(s in start.payload["user"] for s in ev["summaries"])
    reminders = [(seq_name[e.movement_seq], e.payload["reason"]) for e in of(ws, job, "reminder")]
    assert reminders == [(JUDGE, "no tool call"), (JUDGE, "no tool call")]
    usage = ws.frames.usage(job)
    assert list(usage[usage["action"] == "compaction"]["movement"]) == ["fix", "fix", JUDGE]
    markup = job_html(ws, job.id)
    assert "⟳ loop review → fix ×2" in markup and "FIX-SUM-2" in markup and "JUDGE-SUM" in markup


def test_loop_and_compaction_stepped_one_call_per_process_equals_a_straight_run(tmp_path: Path) -> None:
    p, spec = loop_and_compaction(tmp_path)
    straight_ws = Workspace(tmp_path / "straight")
    straight = straight_ws.run(straight_ws.submit("t", piece=str(p), model=spec))
    ws = Workspace(tmp_path / "stepped")
    job = ws.submit("t", piece=str(p), model=spec)
    statuses = step_in_children(ws, job)
    assert statuses[-1] == straight.status == "aborted"
    assert comparable(ws, job) == comparable(straight_ws, straight)


def test_loop_and_compaction_forked_and_replayed(tmp_path: Path) -> None:
    p, spec = loop_and_compaction(tmp_path)
    ws = Workspace(tmp_path / "ws")
    original = ws.run(ws.submit("t", piece=str(p), model=spec))
    # a replay re-serves every call, the summaries too, and detects the same loop
    replay = ws.replay(original)
    assert replay.status == "aborted", replay.error
    assert ws.compare(original, replay).first_divergence is None
    assert [c.payload["summary"] for c in of(ws, replay, "compaction")] == ["FIX-SUM-1", "FIX-SUM-2", "JUDGE-SUM"]
    assert [(e["runs"], e["summaries"]) for e in loops_of(ws, replay)] == [
        (e["runs"], e["summaries"]) for e in loops_of(ws, original)]
    # a fork at the judge's run: runs 1-5 re-served (their compactions at 0 tokens), the judge live, compacting
    # again with its own summary and going on instead
    live = write_script(tmp_path, "live", {
        JUDGE: [{"content": "A.", "usage": {"prompt_tokens": 1_000, "completion_tokens": 10}},
                {"content": "B.", "usage": {"prompt_tokens": 3_600, "completion_tokens": 10}},
                summary("NEW-JUDGE-SUM"), transition("review", "one more round")],
        # the scripted model counts a movement's calls over the whole job: the 4 re-served review calls first
        "review": [{"content": "unused"}] * 4 + [transition("COMPLETE", "clean now")]})
    fork = ws.fork(original, at=6, model=live)
    assert fork.status == "succeeded", fork.error
    assert names(ws, fork) == ["write", "review", "fix", "review", "fix", JUDGE, "review"]
    assert [bool(r) for r in ws.frames.movements(fork)["replayed"]] == [True] * 5 + [False, False]
    comps = of(ws, fork, "compaction")
    assert [c.payload["summary"] for c in comps] == ["FIX-SUM-1", "FIX-SUM-2", "NEW-JUDGE-SUM"]
    usage = ws.frames.usage(fork)
    re_served = usage[(usage["action"] == "compaction") & (usage["seq"] < 6)]
    assert list(re_served["total_tokens"]) == [0, 0]
    (ev,) = loops_of(ws, fork)
    assert ev["runs"] == [2, 3, 4, 5] and ev["seq"] == 5
    assert "fix 2" in user_prompts(ws, fork, JUDGE)[0]
    # a fork at fix's second run: it runs live (a new summary), and the loop is detected at its end again
    live2 = write_script(tmp_path, "live2", {
        "fix": [{"content": "unused"}] * 6
        + [g(1_000), g(1_500), g(3_500), summary("OTHER-FIX-SUM"), transition("review", "fix 2 again")],
        JUDGE: [transition("ABORT", "stuck")]})
    fork2 = ws.fork(original, at=5, model=live2)
    assert fork2.status == "aborted", fork2.error
    assert [c.payload["summary"] for c in of(ws, fork2, "compaction")] == ["FIX-SUM-1", "OTHER-FIX-SUM"]
    (ev2,) = loops_of(ws, fork2)
    assert ev2["summaries"] == ["review 1", "fix 1", "review 2", "fix 2 again"]
