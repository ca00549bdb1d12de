"""ContextManager in real jobs: token sources, thresholds, forced transitions, windows and tool budgets."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from _scripting import write_piece, write_script

from agentnb import Workspace
from agentnb.engine.context import (
    DEFAULT_WINDOW,
    MAX_TOOL_TOKENS,
    ContextManager,
    check_context_options,
    window_for_model,
)
from agentnb.engine.tokens import TokenCounter, counter_for_model
from agentnb.models.base import ModelSpecError
from agentnb.models.messages import AssistantMessage, TokenUsage, ToolMessage

NOTES = "".join(f"note line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(3000))


def _piece(tmp_path: Path, *, context: dict[str, Any] | None = None, default_next: str | None = "wrap",
           name: str = "ctx") -> Path:
    work: dict[str, Any] = {
        "name": "work", "persona": "You work.", "instruction": "Work on the notes.", "tools": ["Read"],
        "permission": "readonly", "max_iterations": 30,
        "rules": [{"condition": "done", "next": "COMPLETE"}, {"condition": "wrap up", "next": "wrap"}],
    }
    if default_next:
        work["default_next"] = default_next
    wrap = {"name": "wrap", "persona": "You wrap up.", "instruction": "Wrap up.", "tools": [],
            "rules": [{"condition": "done", "next": "COMPLETE"}]}
    doc: dict[str, Any] = {"movements": [work, wrap]}
    if context:
        doc["context"] = context
    return write_piece(tmp_path, name, doc)


def _read(usage: int | None = None, completion: int = 20, **args: Any) -> dict[str, Any]:
    item: dict[str, Any] = {"tool_calls": [{"name": "Read", "arguments": {"path": "input/notes.md", "limit": 3,
                                                                          **args}}]}
    if usage is not None:
        item["usage"] = {"prompt_tokens": usage, "completion_tokens": completion}
    return item


def _transition(step: str, usage: int | None = None) -> dict[str, Any]:
    item: dict[str, Any] = {"tool_calls": [{"name": "transition", "arguments": {"next_step": step,
                                                                                "summary": "done", "lessons": "l"}}]}
    if usage is not None:
        item["usage"] = {"prompt_tokens": usage, "completion_tokens": 20}
    return item


def _script(tmp_path: Path, work: list[dict[str, Any]], wrap: list[dict[str, Any]] | None = None) -> str:
    return write_script(tmp_path, "script", {"work": work, "wrap": wrap or [_transition("COMPLETE")]})


def _run(ws: Workspace, piece: Path, model: str, **kw: Any) -> tuple[Any, list[Any]]:
    job = ws.submit("Work on input/notes.md", piece=str(piece), model=model, inputs={"notes.md": NOTES}, **kw)
    job = ws.run(job)
    return job, ws.events(job)


def _of(events: list[Any], kind: str) -> list[Any]:
    return [e for e in events if e.kind == kind]


# -- thresholds ---------------------------------------------------------------------


def test_each_threshold_fires_once_and_in_order_then_force_goes_to_default_next(ws: Workspace, tmp_path: Path) -> None:
    piece = _piece(tmp_path, context={"window_tokens": 10_000})
    usages = [1_000, 7_000, 7_500, 8_500, 8_600, 9_500, 9_600]
    model = _script(tmp_path, [_read(u) for u in usages])
    job, events = _run(ws, piece, model)
    assert job.status == "succeeded", job.error

    actions = _of(events, "context_action")
    assert [(a.payload["action"], a.payload["iteration"]) for a in actions] == [
        ("warn", 2), ("prompt", 4), ("force_transition", 6)]
    for a, tokens, limit in zip(actions, (7_000, 8_500, 9_500), (0.70, 0.85, 0.95), strict=False):
        assert a.payload["tokens"] == tokens
        assert a.payload["window"] == 10_000
        assert a.payload["ratio"] == pytest.approx(tokens / 10_000)
        assert a.payload["threshold"] == limit
        assert a.iteration == a.payload["iteration"]

    work_responses = [e for e in _of(events, "llm_response") if e.movement_seq == 1]
    assert len(work_responses) == 6  # the 7th scripted response is never asked for: the movement was forced
    assert [r.payload["usage"]["prompt_tokens"] for r in work_responses] == usages[:6]
    assert {r.payload["usage"]["source"] for r in work_responses} == {"usage"}
    assert [r.payload["usage"]["ratio"] for r in work_responses] == [u / 10_000 for u in usages[:6]]

    reminders = [e for e in _of(events, "reminder") if e.payload["reason"] == "context prompt"]
    assert len(reminders) == 1 and reminders[0].iteration == 4
    assert "transition" in reminders[0].payload["text"]
    # the wrap-up message is what the model sees next
    request_5 = next(e for e in _of(events, "llm_request") if e.movement_seq == 1 and e.iteration == 5)
    request_4 = next(e for e in _of(events, "llm_request") if e.movement_seq == 1 and e.iteration == 4)
    assert request_5.payload["messages"] == request_4.payload["messages"] + 3  # assistant, tool result, reminder

    forced = _of(events, "transition")[0]
    assert forced.payload["forced"] is True
    assert forced.payload["next_step"] == "wrap"
    assert forced.payload["summary"].startswith("Forced transition")
    # a forced transition is not a claim that the work is done: no lessons are passed on
    assert not [e for e in _of(events, "lesson") if e.payload["movement"] == "work"]
    assert [e.payload["movement"] for e in _of(events, "movement_start")] == ["work", "wrap"]
    # the next movement starts with a fresh context: nothing fires again there
    assert all(a.movement_seq == 1 for a in actions)


def test_force_transition_without_default_next_aborts(ws: Workspace, tmp_path: Path) -> None:
    piece = _piece(tmp_path, context={"window_tokens": 10_000}, default_next=None)
    job, events = _run(ws, piece, _script(tmp_path, [_read(1_000), _read(9_600), _read(9_700)]))
    assert job.status == "aborted"
    (t,) = _of(events, "transition")
    assert t.payload["forced"] is True
    assert t.payload["next_step"] == "ABORT"
    assert "force_transition" in t.payload["reason"]
    assert [a.payload["action"] for a in _of(events, "context_action")] == ["warn", "prompt", "force_transition"]
    # forced at once: no wrap-up reminder is added for a movement that is over
    assert not [e for e in _of(events, "reminder") if e.payload["reason"] == "context prompt"]


def test_forced_into_complete_succeeds_but_stays_marked_forced(ws: Workspace, tmp_path: Path) -> None:
    piece = _piece(tmp_path, context={"window_tokens": 10_000}, default_next="COMPLETE")
    job, events = _run(ws, piece, _script(tmp_path, [_read(9_900)]))
    assert job.status == "succeeded"
    (t,) = _of(events, "transition")
    assert (t.payload["next_step"], t.payload["forced"]) == ("COMPLETE", True)
    # as for any COMPLETE without lessons, its summary is the lesson (the seed's rule, whatever the cause)
    (lesson,) = _of(events, "lesson")
    assert lesson.payload["lessons"] == t.payload["summary"] and lesson.payload["movement"] == "work"


def test_a_jump_past_every_threshold_fires_all_four_in_order(ws: Workspace, tmp_path: Path) -> None:
    piece = _piece(tmp_path, context={"window_tokens": 10_000})
    _job, events = _run(ws, piece, _script(tmp_path, [_read(500), _read(9_950)]))
    actions = _of(events, "context_action")
    assert [a.payload["action"] for a in actions] == ["warn", "prompt", "force_transition", "exhausted"]
    assert {a.payload["iteration"] for a in actions} == {2}
    assert [a.payload["threshold"] for a in actions] == [0.70, 0.85, 0.95, 0.99]
    assert _of(events, "transition")[0].payload["forced"] is True


def test_the_models_own_transition_in_the_crossing_response_is_kept(ws: Workspace, tmp_path: Path) -> None:
    # The response that crosses 95 % already ends the movement by the model's own choice; that choice
    # stands (it is not forced), and the crossing is still on record as a context_action.
    piece = _piece(tmp_path, context={"window_tokens": 10_000})
    job, events = _run(ws, piece, _script(tmp_path, [_read(1_000), _transition("COMPLETE", usage=9_700)]))
    assert job.status == "succeeded"
    (t,) = _of(events, "transition")
    assert (t.payload["next_step"], t.payload["forced"]) == ("COMPLETE", False)
    assert "force_transition" in [a.payload["action"] for a in _of(events, "context_action")]


def test_an_invalid_transition_in_the_crossing_response_is_forced(ws: Workspace, tmp_path: Path) -> None:
    piece = _piece(tmp_path, context={"window_tokens": 10_000})
    _job, events = _run(ws, piece, _script(tmp_path, [_transition("nowhere", usage=9_700)]))
    transitions = _of(events, "transition")
    assert (transitions[0].payload["next_step"], transitions[0].payload["forced"]) == ("wrap", True)
    results = [e for e in _of(events, "tool_result") if e.payload["tool"] == "transition"]
    assert results[0].payload["is_error"] is True


def test_thresholds_come_from_the_piece(ws: Workspace, tmp_path: Path) -> None:
    th = {"warn": 0.2, "prompt": 0.3, "force_transition": 0.5, "exhausted": 0.6}
    piece = _piece(tmp_path, context={"window_tokens": 10_000, "thresholds": th})
    _job, events = _run(ws, piece, _script(tmp_path, [_read(1_000), _read(2_100), _read(3_100), _read(5_000)]))
    actions = _of(events, "context_action")
    assert [(a.payload["action"], a.payload["iteration"], a.payload["threshold"]) for a in actions] == [
        ("warn", 2, 0.2), ("prompt", 3, 0.3), ("force_transition", 4, 0.5)]


def test_job_options_override_the_piece(ws: Workspace, tmp_path: Path) -> None:
    piece = _piece(tmp_path, context={"window_tokens": 10_000, "thresholds": {"warn": 0.5}})
    model = _script(tmp_path, [_read(1_000), _read(6_500), _transition("COMPLETE", 6_600)])
    job, events = _run(ws, piece, model, context={"window_tokens": 20_000, "thresholds": {"warn": 0.3}})
    assert job.status == "succeeded"
    assert {e.payload["usage"]["window"] for e in _of(events, "llm_response")} == {20_000}
    actions = _of(events, "context_action")
    assert [(a.payload["action"], a.payload["iteration"], a.payload["window"]) for a in actions] == [
        ("warn", 2, 20_000)]
    assert actions[0].payload["threshold"] == 0.3


def test_window_comes_from_piece_then_model_table_then_default(ws: Workspace, tmp_path: Path) -> None:
    model = _script(tmp_path, [_transition("COMPLETE")])
    _, with_piece = _run(ws, _piece(tmp_path, context={"window_tokens": 50_000}, name="a"), model)
    _, without = _run(ws, _piece(tmp_path, name="b"), model)
    assert _of(with_piece, "llm_response")[0].payload["usage"]["window"] == 50_000
    assert _of(without, "llm_response")[0].payload["usage"]["window"] == DEFAULT_WINDOW  # scripted: no table row
    demo = ws.run(ws.submit("Summarise input/notes.md", model="demo", inputs={"notes.md": "a\n"}))
    assert {e.payload["usage"]["window"] for e in _of(ws.events(demo), "llm_response")} == {window_for_model("demo")}
    assert window_for_model("openai:gpt-4o-mini") == 128_000
    assert window_for_model("openai:gpt-4.1-mini") == 1_047_576
    assert window_for_model("gpt-3.5-turbo") == 16_385
    assert window_for_model("openai:some-unknown-model") == DEFAULT_WINDOW


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ({"window": 1}, "unknown key"),
        ({"window_tokens": "big"}, "window_tokens='big'"),
        ({"window_tokens": 10}, "≥ 256"),
        ({"min_tool_tokens": 0}, "min_tool_tokens=0"),
        ({"thresholds": {"panic": 0.5}}, "unknown action"),
        ({"thresholds": {"warn": 1.5}}, "between 0 (excluded) and 1"),
        ({"thresholds": {"warn": 0.9, "prompt": 0.8, "force_transition": 0.95, "exhausted": 0.99}}, "above prompt"),
    ],
)
def test_bad_job_context_options_are_refused_at_submit(ws: Workspace, tmp_path: Path, context: dict[str, Any],
                                                       message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ws.submit("x", piece=str(_piece(tmp_path)), model="demo", context=context)
    assert ws.jobs() == []
    assert check_context_options({"window_tokens": 1000}) == {"window_tokens": 1000}


@pytest.mark.parametrize(
    ("usage", "message"),
    [
        ({"prompt_tokens": "abc"}, "usage.prompt_tokens: 'abc'; allowed: a whole number ≥ 0"),
        ({"prompt_tokens": None}, "usage.prompt_tokens: None; allowed: a whole number ≥ 0"),
        ({"prompt_tokens": -5}, "usage.prompt_tokens: -5; allowed"),
        ({"prompt_tokens": 1.5}, "usage.prompt_tokens: 1.5; allowed"),
        ({"prompt_tokens": True}, "usage.prompt_tokens: True; allowed"),
        ({"prompt_tokens": 10, "completion_token": 5}, "unknown key(s) ['completion_token']; allowed: prompt_tokens"),
    ],
)
def test_bad_usage_in_a_script_is_a_one_line_error(ws: Workspace, tmp_path: Path, usage: dict[str, Any],
                                                   message: str) -> None:
    spec = write_script(tmp_path, "bad", responses=[{**_transition("COMPLETE"), "usage": usage}])
    script = spec.removeprefix("scripted:")
    with pytest.raises(ModelSpecError) as info:
        ws.run(ws.submit("x", piece=str(_piece(tmp_path)), model=spec))
    assert message in str(info.value) and f"{script}: responses[0]" in str(info.value)
    assert "\n" not in str(info.value)


def test_job_thresholds_that_would_not_rise_over_the_pieces_are_refused_at_submit(ws: Workspace,
                                                                                  tmp_path: Path) -> None:
    custom = _piece(tmp_path, context={"thresholds": {"warn": 0.5, "prompt": 0.6, "force_transition": 0.8,
                                                      "exhausted": 0.9}})
    with pytest.raises(ValueError, match=r"prompt \(0.85\) is above force_transition \(0.8\).*over the piece's"):
        ws.submit("x", piece=str(custom), model="demo", context={"thresholds": {"prompt": 0.85}})
    with pytest.raises(ValueError, match=r"prompt \(0.97\) is above force_transition \(0.95\)"):
        ws.submit("x", piece=str(_piece(tmp_path)), model="demo", context={"thresholds": {"prompt": 0.97}})
    assert ws.jobs() == []
    ok = ws.submit("x", piece=str(custom), model="demo", context={"thresholds": {"prompt": 0.7}})
    assert ok.status == "queued"


# -- token sources ------------------------------------------------------------------------


def _message_tokens(count: Any, text: str) -> int:
    return 4 + count(text)


@pytest.mark.parametrize("source", ["tiktoken", "chars"])
def test_counted_sources_measure_the_messages_added_between_calls(ws: Workspace, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  source: str) -> None:
    if source == "chars":
        monkeypatch.setenv("AGENTNB_TOKENIZER", "chars")
    piece = _piece(tmp_path)
    model = _script(tmp_path, [_read(), _read(offset=10), _transition("COMPLETE")])
    _job, events = _run(ws, piece, model)
    responses = [e for e in _of(events, "llm_response") if e.movement_seq == 1]
    assert [r.payload["usage"]["source"] for r in responses] == [source] * 3
    counter = counter_for_model(model)
    assert responses[0].payload["usage"]["encoding"] == counter.encoding
    # what was added between call 1 and call 2: the assistant message and the tool result
    first = responses[0].payload
    args = json.dumps(first["tool_calls"][0]["arguments"], ensure_ascii=False)
    assistant_text = "\n".join(["Read", args])
    result = next(e for e in _of(events, "tool_result") if e.iteration == 1 and e.movement_seq == 1)
    added = _message_tokens(counter.count, assistant_text) + _message_tokens(counter.count, result.payload["content"])
    p1, p2 = (r.payload["usage"]["prompt_tokens"] for r in responses[:2])
    assert p2 - p1 == added
    assert first["usage"]["completion_tokens"] == _message_tokens(counter.count, assistant_text)
    assert first["usage"]["total_tokens"] == p1 + first["usage"]["completion_tokens"]
    assert p1 > 0


def test_usage_and_counted_sources_mix_per_call(ws: Workspace, tmp_path: Path) -> None:
    model = _script(tmp_path, [_read(1_234), _read(), _transition("COMPLETE", 2_000)])
    _job, events = _run(ws, _piece(tmp_path), model)
    responses = [e for e in _of(events, "llm_response") if e.movement_seq == 1]
    assert [r.payload["usage"]["source"] for r in responses] == ["usage", "tiktoken", "usage"]
    assert responses[0].payload["usage"]["prompt_tokens"] == 1_234
    assert responses[2].payload["usage"]["prompt_tokens"] == 2_000


def test_a_call_without_usage_counts_on_from_the_last_reported_size(ws: Workspace, tmp_path: Path) -> None:
    # 94 % reported, then a response without usage: the context did not shrink to a bare count of the
    # messages, so force_transition fires at that call (source tiktoken), not never
    model = _script(tmp_path, [_read(9_400), _read(), _read(), _transition("COMPLETE")])
    _job, events = _run(ws, _piece(tmp_path, context={"window_tokens": 10_000}), model)
    responses = [e for e in _of(events, "llm_response") if e.movement_seq == 1]
    assert [r.payload["usage"]["source"] for r in responses] == ["usage", "tiktoken"]
    count = counter_for_model(model).count
    tool = next(e for e in _of(events, "tool_result") if e.movement_seq == 1).payload["content"]
    reminder = next(e for e in _of(events, "reminder") if e.movement_seq == 1).payload["text"]
    second = responses[1].payload["usage"]
    assert second["prompt_tokens"] == 9_400 + 20 + _message_tokens(count, tool) + _message_tokens(count, reminder)
    actions = [(e.payload["action"], e.iteration) for e in _of(events, "context_action") if e.movement_seq == 1]
    assert actions == [("warn", 1), ("prompt", 1), ("force_transition", 2)]
    assert next(e.payload["forced"] for e in _of(events, "transition")) is True


# -- incremental counting ------------------------------------------------------------------


def test_each_message_is_tokenized_once() -> None:
    seen: list[int] = []

    def count(text: str) -> int:
        seen.append(len(text))
        return len(text) // 4 + 1

    cm = ContextManager(window=10_000_000, counter=TokenCounter("tiktoken", "test", count))
    total = 0
    for i in range(200):
        tool = ToolMessage(f"c{i}", "r" * (i + 1))
        cm.add(tool)
        assistant = AssistantMessage("a" * (i + 2))
        cm.after_response(assistant, None)
        total += (i + 1) + (i + 2)
    assert sum(seen) == total  # linear in the text, not in calls × history
    assert len(seen) == 400


# -- tool budgets --------------------------------------------------------------------------


def test_tool_budget_is_half_the_available_capped_and_floored() -> None:
    big = ContextManager(window=1_000_000, model="gpt-4o")
    assert big.tool_budget() == MAX_TOOL_TOKENS
    cm = ContextManager(window=10_000, model="gpt-4o", min_tool_tokens=300)
    cm.after_response(AssistantMessage("x"), TokenUsage(prompt_tokens=4_000, completion_tokens=0))
    assert cm.tool_budget() == 3_000
    cm.add(ToolMessage("c1", "y" * 40_000))
    assert cm.tool_budget() == 300  # nothing much left: the floor
    assert ContextManager(window=4_096, model="gpt-4o").min_tool_tokens == 4_096 // 16  # a floor fitting a small window


def test_tool_results_record_their_budget_and_fit_it(ws: Workspace, tmp_path: Path) -> None:
    piece = _piece(tmp_path, context={"window_tokens": 20_000})
    model = _script(tmp_path, [_read(2_000, completion=30, limit=None), _read(9_000, completion=30, limit=None),
                               _transition("COMPLETE", 9_500)])
    _job, events = _run(ws, piece, model)
    results = [e for e in _of(events, "tool_result") if e.payload["tool"] == "Read"]
    assert [r.payload["budget_tokens"] for r in results] == [(20_000 - 2_030) // 2, (20_000 - 9_030) // 2]
    counter = counter_for_model(model)
    for r in results:
        assert r.payload["truncated"] is True
        assert counter.count(r.payload["content"]) <= r.payload["budget_tokens"]
        assert r.payload["original_chars"] == len(NOTES)
        assert r.payload["returned_chars"] < r.payload["original_chars"]


@pytest.mark.parametrize("where", ["piece", "job"])
def test_the_budget_floor_is_configurable(ws: Workspace, tmp_path: Path, where: str) -> None:
    context: dict[str, Any] = {"window_tokens": 10_000}
    kw: dict[str, Any] = {}
    if where == "piece":
        context["min_tool_tokens"] = 2_000
    else:
        kw["context"] = {"min_tool_tokens": 2_000}
    model = _script(tmp_path, [_read(9_000, limit=None), _transition("COMPLETE", 9_100)])
    _job, events = _run(ws, _piece(tmp_path, context=context), model, **kw)
    (r,) = [e for e in _of(events, "tool_result") if e.payload["tool"] == "Read"]
    assert r.payload["budget_tokens"] == 2_000  # half of what is left would be ~490
    assert r.payload["truncated"] is True
    assert counter_for_model(model).count(r.payload["content"]) <= 2_000
    assert math.isclose(counter_for_model(model).count(r.payload["content"]), 2_000, rel_tol=0.25)


def test_accounting_survives_a_restart_between_calls(tmp_path: Path) -> None:
    # the same job run straight through, and one call at a time with a fresh Workspace (a new process's
    # view of the file) before each call: the same counts, and each action still fires once
    piece = _piece(tmp_path, context={"window_tokens": 10_000})
    script = [_read(), _read(7_200), _read(offset=7), _read(8_700), _read(), _transition("COMPLETE", 9_000)]
    model = _script(tmp_path, script)
    straight_ws = Workspace(tmp_path / "straight")
    _, straight = _run(straight_ws, piece, model)
    root = tmp_path / "stepped"
    job = Workspace(root).submit("Work on input/notes.md", piece=str(piece), model=model, inputs={"notes.md": NOTES})
    for _ in range(40):
        job = Workspace(root).step(job, unit="call")
        if job.status != "running" and job.status != "queued":
            break
    assert job.status == "succeeded", job.error
    stepped = Workspace(root).events(job)

    def usage(events: list[Any]) -> list[tuple[Any, ...]]:
        return [(e.movement_seq, e.iteration, e.payload["usage"]["prompt_tokens"], e.payload["usage"]["source"])
                for e in _of(events, "llm_response")]

    assert usage(stepped) == usage(straight)
    actions = [(a.payload["action"], a.iteration) for a in _of(stepped, "context_action")]
    assert actions == [(a.payload["action"], a.iteration) for a in _of(straight, "context_action")]
    assert actions == [("warn", 2), ("prompt", 4)]
