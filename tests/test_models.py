"""Models: scripted (both formats), replay, and openai against a real OpenAI-compatible server on loopback."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, say, transition, write_piece, write_script
from openai_server import OpenAIServer, error, reply, stall

import agentnb
from agentnb import Workspace
from agentnb.engine.runner import JobRunner
from agentnb.models.base import ModelRequest, ModelResponse, ModelSpecError, ScriptedModel, ToolCall
from agentnb.models.messages import (
    AssistantMessage,
    ImagePart,
    Message,
    SystemMessage,
    TokenUsage,
    ToolCallPart,
    ToolMessage,
    UserMessage,
)
from agentnb.models.openai import wire_messages

KEY = "sk-test-DO-NOT-STORE-4f1c9a"

LOOP = """
name: loop
max_movements: 8
movements:
  - name: work
    persona: You are the worker.
    instruction: Work.
    tools: [Read, Write, crash_tool]
    permission: edit
    max_iterations: 10
    rules:
      - {condition: ready for review, next: review}
  - name: review
    persona: You are the reviewer.
    instruction: Review.
    tools: [Read]
    rules:
      - {condition: good, next: COMPLETE}
      - {condition: needs work, next: work}
"""


@pytest.fixture(autouse=True)
def crash_tool():
    @agentnb.tool
    def crash_tool(x: int) -> str:
        """Fails on purpose."""
        raise ValueError(f"cannot handle {x}")

    yield
    agentnb.tools.base.unregister("crash_tool")


@pytest.fixture
def server(loopback: Callable[..., OpenAIServer]) -> OpenAIServer:
    return loopback(KEY, timeout="5", retries="3")


def _kinds(ws: Workspace, job) -> list[str]:
    return [e.kind for e in ws.events(job)]


# -- scripted ------------------------------------------------------------------


def test_scripted_responses_list_plays_in_order_across_the_job(ws: Workspace, tmp_path: Path) -> None:
    model = write_script(tmp_path, "script", responses=[
        {"content": "Writing.", "tool_calls": [{"name": "Write", "arguments": {"path": "output/a.txt", "content": "A"}}],
         "usage": {"prompt_tokens": 1200, "completion_tokens": 40}},
        transition("review", "wrote a.txt"),
        transition("COMPLETE", "fine"),
    ])
    job = ws.run(ws.submit("task", piece=write_piece(tmp_path, "piece", LOOP), model=model))
    assert job.status == "succeeded", job.error
    assert (Path(job.workdir) / "output" / "a.txt").read_text() == "A"
    first = ws.events(job, kinds=["llm_response"])[0].payload
    assert first["content"] == "Writing."
    assert {k: first["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens", "source")} == {
        "prompt_tokens": 1200, "completion_tokens": 40, "total_tokens": 1240, "source": "usage"}
    second = ws.events(job, kinds=["llm_response"])[1].payload
    assert second["usage"]["source"] in ("tiktoken", "chars")  # no usage given: counted


def test_scripted_per_movement_lists_play_across_that_movements_runs(ws: Workspace, tmp_path: Path) -> None:
    model = write_script(tmp_path, "script", movements={
        "work": [transition("review", "first try"), call("Read", path="input"), transition("review", "second try")],
        "review": [transition("work", "redo", feedback="more"), transition("COMPLETE", "good now")],
    })
    job = ws.run(ws.submit("task", piece=write_piece(tmp_path, "piece", LOOP), model=model))
    assert job.status == "succeeded", job.error
    assert [(m["name"], m["summary"]) for m in ws.movements(job)] == [
        ("work", "first try"), ("review", "redo"), ("work", "second try"), ("review", "good now")]


@pytest.mark.parametrize("script, message", [
    ({"responses": [transition("review")]},
     "scripted model ran out of responses: {path} has 1, call 2 was asked for"),
    ({"movements": {"work": [transition("review")], "review": []}},
     "scripted model ran out of responses for movement 'review': {path} has 0, call 1 was asked for"),
])
def test_a_script_that_runs_out_fails_the_job_saying_so(ws: Workspace, tmp_path: Path, script, message) -> None:
    model = write_script(tmp_path, "script", **script)
    job = ws.run(ws.submit("task", piece=write_piece(tmp_path, "piece", LOOP), model=model))
    assert job.status == "failed"
    assert job.error == message.format(path=model.split(":", 1)[1])
    err = ws.events(job, kinds=["error"])[-1].payload
    assert err == {"message": job.error, "where": "model"}


@pytest.mark.parametrize("content, match", [
    ("responses: [1, 2]", "each response must be a mapping"),
    ("responses:\n  - {contnt: hi}", r"unknown key\(s\) \['contnt'\]; allowed: content, tool_calls, usage"),
    ("responses: [{tool_calls: [{arguments: {}}]}]", "needs a name"),
    ("hello: world", "a script needs 'responses'"),
    ("responses: [unclosed", "not valid YAML"),
    ("responses: 5", "responses must be a list"),
    ("movements: [a, b]", "movements must map each movement name to a list"),
    ("movements: {work: 3}", "movements must map each movement name to a list"),
])
def test_a_malformed_script_is_refused_at_submit(ws: Workspace, tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ModelSpecError, match=match):
        ws.submit("task", piece="single", model=f"scripted:{path}")
    assert ws.jobs() == []


@pytest.mark.parametrize("spec, match", [
    ("gpt-4", "unknown model spec 'gpt-4'; allowed: demo, scripted:<file.yaml>, openai:<model>, replay:<job_id>"),
    ("scripted:/nope.yaml", "scripted model file not found: /nope.yaml"),
    ("replay:abc", "the job id must be a number"),
    ("replay:42", "no job 42"),
    ("openai:", "unknown model spec"),
])
def test_bad_model_specs_are_refused_at_submit(ws: Workspace, spec: str, match: str) -> None:
    with pytest.raises(ModelSpecError, match=match):
        ws.submit("task", piece="single", model=spec)
    assert ws.jobs() == []


def test_replay_reproduces_a_recorded_job(ws: Workspace, tmp_path: Path) -> None:
    model = write_script(tmp_path, "script", responses=[
        call("Write", path="output/r.txt", content="replayed"), say("hmm"),
        transition("review", "wrote", lessons="l1"), transition("work", "again", feedback="fix"),
        transition("review", "fixed"), transition("COMPLETE", "ok"),
    ])
    piece = write_piece(tmp_path, "piece", LOOP)
    original = ws.run(ws.submit("task", piece=piece, model=model))
    copy = ws.run(ws.submit("task", piece=piece, model=f"replay:{original.id}"))
    assert copy.status == original.status == "succeeded"

    def shape(job) -> list[tuple[Any, ...]]:
        out = []
        for e in ws.events(job):
            if e.kind == "llm_response":
                out.append((e.kind, e.movement_seq, e.iteration, e.payload["content"],
                            [(c["name"], c["arguments"]) for c in e.payload["tool_calls"]]))
            elif e.kind in ("tool_result", "transition", "lesson", "reminder"):
                out.append((e.kind, e.movement_seq, e.payload.get("content") or e.payload.get("next_step")
                            or e.payload.get("text") or e.payload.get("lessons")))
        return out

    assert shape(copy) == shape(original)
    assert (Path(copy.workdir) / "output" / "r.txt").read_text() == "replayed"


# -- openai on loopback -----------------------------------------------------------


def test_full_job_through_an_openai_compatible_server(ws: Workspace, tmp_path: Path, server: OpenAIServer) -> None:
    server.play(
        reply("Reading.", [("Read", {"path": "input/notes.md"})], usage=(321, 12)),
        reply(None, [("transition", {"next_step": "review", "summary": "read it", "lessons": "notes are short"})],
              usage=(400, 20)),
        reply(None, [("transition", {"next_step": "COMPLETE", "summary": "approved"})], usage=(250, 5)),
    )
    job = ws.submit("Summarise", piece=write_piece(tmp_path, "piece", LOOP), model="openai:test-model",
                    inputs={"notes.md": "alpha beta\n"})
    job = ws.run(job)
    assert job.status == "succeeded", job.error
    usages = [e.payload["usage"] for e in ws.events(job, kinds=["llm_response"])]
    assert [(u["prompt_tokens"], u["completion_tokens"], u["total_tokens"], u["source"]) for u in usages] == [
        (321, 12, 333, "usage"), (400, 20, 420, "usage"), (250, 5, 255, "usage")]
    # what was sent: the model, the tools (transition always), and the conversation of the movement
    bodies = [r.body for r in server.received]
    assert all(b["model"] == "test-model" for b in bodies)
    names = [t["function"]["name"] for t in bodies[0]["tools"]]
    assert names == ["Read", "Write", "crash_tool", "transition"]
    assert [m["role"] for m in bodies[0]["messages"]] == ["system", "user"]
    assert bodies[0]["messages"][0]["content"] == "You are the worker."
    assert [m["role"] for m in bodies[1]["messages"]] == ["system", "user", "assistant", "tool"]
    assert bodies[1]["messages"][3]["content"].startswith("alpha beta")
    assert bodies[1]["messages"][2]["tool_calls"][0]["function"]["name"] == "Read"
    assert [m["role"] for m in bodies[2]["messages"]] == ["system", "user"]  # a new movement starts fresh
    assert "## Lessons from previous steps\n- [work] notes are short" in bodies[2]["messages"][1]["content"]
    assert server.received[0].headers["authorization"] == f"Bearer {KEY}"
    _assert_key_nowhere(ws)


def _assert_key_nowhere(ws: Workspace) -> None:
    for path in ws.root.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


def test_the_model_sees_tool_errors_and_reminders(ws: Workspace, tmp_path: Path, server: OpenAIServer) -> None:
    server.play(
        reply(None, [("transition", {"next_step": "nowhere", "summary": "x"})]),
        reply(None, [("crash_tool", {"x": 7})]),
        reply("I am not sure what to do."),
        reply(None, [("transition", {"next_step": "review", "summary": "done"})]),
        reply(None, [("transition", {"next_step": "COMPLETE", "summary": "ok"})]),
    )
    job = ws.run(ws.submit("task", piece=write_piece(tmp_path, "piece", LOOP), model="openai:m"))
    assert job.status == "succeeded", job.error
    fourth = server.received[3].body["messages"]
    assert [m["role"] for m in fourth] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant", "user"]
    assert fourth[3]["content"] == ("Error: next_step 'nowhere' is not allowed here; "
                                    "allowed: review, ABORT")
    assert fourth[5]["content"] == "Error: crash_tool raised ValueError: cannot handle 7"
    assert fourth[3]["tool_call_id"] == fourth[2]["tool_calls"][0]["id"]
    assert "without calling a tool" in fourth[7]["content"]


def test_retries_with_backoff_on_429_5xx_and_timeouts(ws: Workspace, tmp_path: Path, server: OpenAIServer,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # the timeout applies to every request: long enough that a loaded machine answers the others in time (a late
    # answer would be retried and shift the script), the stall longer still
    monkeypatch.setenv("AGENTNB_OPENAI_TIMEOUT", "2")
    monkeypatch.setenv("AGENTNB_OPENAI_RETRIES", "4")
    server.play(
        error(429, "slow down"), error(503, "overloaded"),
        reply(None, [("transition", {"next_step": "review", "summary": "done"})], usage=(10, 1)),
        stall(30), error(500, "oops"),
        reply(None, [("transition", {"next_step": "COMPLETE", "summary": "ok"})], usage=(20, 2)),
    )
    job = ws.run(ws.submit("task", piece=write_piece(tmp_path, "piece", LOOP), model="openai:m"))
    assert job.status == "succeeded", job.error
    assert len(server.received) == 6  # two calls, with four failed tries between them
    assert len(ws.events(job, kinds=["llm_response"])) == 2  # retries are invisible to the job
    assert not ws.events(job, kinds=["error"])


def test_after_the_last_try_the_job_fails_with_a_clear_error(ws: Workspace, tmp_path: Path, server: OpenAIServer,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTNB_OPENAI_RETRIES", "2")
    server.play(error(500, "the backend is down", times=3))
    job = ws.run(ws.submit("task", piece=write_piece(tmp_path, "piece", LOOP), model="openai:m"))
    assert job.status == "failed"
    assert job.error == "openai:m: gave up after 3 tries; last error HTTP 500: the backend is down"
    assert len(server.received) == 3
    assert ws.events(job, kinds=["error"])[-1].payload == {"message": job.error, "where": "model"}
    assert ws.movements(job)[0]["status"] == "failed"
    _assert_key_nowhere(ws)


def test_a_timeout_on_every_try_fails_the_job(ws: Workspace, tmp_path: Path, server: OpenAIServer,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTNB_OPENAI_TIMEOUT", "0.3")
    monkeypatch.setenv("AGENTNB_OPENAI_RETRIES", "1")
    server.play(stall(5), stall(5))
    job = ws.run(ws.submit("task", piece=write_piece(tmp_path, "piece", LOOP), model="openai:m"))
    assert job.status == "failed"
    assert job.error.startswith("openai:m: gave up after 2 tries; last error APITimeoutError")


def test_a_request_error_is_not_retried(ws: Workspace, tmp_path: Path, server: OpenAIServer) -> None:
    server.play(error(400, "tools are not supported by this model"))
    job = ws.run(ws.submit("task", piece=write_piece(tmp_path, "piece", LOOP), model="openai:m"))
    assert job.status == "failed"
    assert job.error == "openai:m: HTTP 400: tools are not supported by this model"
    assert len(server.received) == 1


def test_openai_without_key_or_endpoint_fails_clearly(ws: Workspace, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    # refused at submit, in one line, with nothing stored (it used to become a job that failed)
    with pytest.raises(ModelSpecError) as info:
        ws.submit("task", piece="single", model="openai:gpt-4o-mini")
    assert str(info.value).startswith("openai:gpt-4o-mini needs OPENAI_API_KEY") and "\n" not in str(info.value)
    assert ws.jobs() == []
    # a job submitted while the key was there, run after it went away, still fails with the reason
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-gone-later")
    job = ws.submit("task", piece="single", model="openai:gpt-4o-mini")
    monkeypatch.delenv("OPENAI_API_KEY")
    job = ws.run(job)
    assert job.status == "failed"
    assert "OPENAI_API_KEY" in job.error


def test_broken_json_arguments_are_a_tool_error_and_survive_a_restart(ws: Workspace, tmp_path: Path,
                                                                     server: OpenAIServer) -> None:
    server.play(
        reply(None, [("Read", '{"path": "input/notes.md"')]),  # cut-off JSON
        reply(None, [("transition", "not json at all")]),
        reply(None, [("transition", {"next_step": "review", "summary": "ok"})]),
        reply(None, [("transition", {"next_step": "COMPLETE", "summary": "ok"})]),
    )
    job = ws.submit("task", piece=write_piece(tmp_path, "piece", LOOP), model="openai:m")
    job = ws.step(job, unit="call")
    job = Workspace(ws.root).step(job.id, unit="call")  # resumed from the file, broken arguments and all
    job = Workspace(ws.root).run(job.id)
    assert job.status == "succeeded", job.error
    read, trans = [e.payload for e in ws.events(job, kinds=["tool_result"])][:2]
    assert read["is_error"] and read["content"].startswith("Error: the arguments for Read are not a JSON object")
    assert trans["is_error"] and trans["content"] == "Error: transition arguments must be a JSON object"
    third = server.received[2].body["messages"]
    # the model's own broken text is sent back verbatim, so the conversation stays what it said
    assert third[2]["tool_calls"][0]["function"]["arguments"] == '{"path": "input/notes.md"'
    assert [m["role"] for m in third] == ["system", "user", "assistant", "tool", "assistant", "tool"]


def test_a_resumed_movement_resends_the_models_own_argument_text(ws: Workspace, tmp_path: Path,
                                                                 server: OpenAIServer) -> None:
    # Real endpoints send compact JSON; some encode it twice or send an object.  Stepping call by call
    # in fresh processes must send exactly what one uninterrupted run sends.
    from openai_server import AsObject

    def play() -> None:
        server.play(
            reply("looking", [("Write", '{"path":"output/a.md","content":"A"}'), ("Read", '{"path":"input/notes.md"}')],
                  usage=None),
            reply(None, [("Read", json.dumps(json.dumps({"path": "output/a.md"})))]),
            reply(None, [("Read", AsObject(path="input/notes.md"))]),
            reply(None, [("transition", '{"next_step":"review","summary":"ok"}')]),
            reply(None, [("transition", {"next_step": "COMPLETE", "summary": "ok"})]),
        )

    piece = write_piece(tmp_path, "piece", LOOP)
    play()
    whole = ws.run(ws.submit("task", piece=piece, model="openai:m", inputs={"notes.md": "n\n"}))
    assert whole.status == "succeeded", whole.error
    sent_whole = [r.body for r in server.received]
    results = [e.payload for e in ws.events(whole, kinds=["tool_result"])]
    assert [r["is_error"] for r in results] == [False] * 6, results  # twice-encoded and object arguments work
    assert [r["content"] for r in results[1:4]] == ["n\n", "A", "n\n"]
    server.received.clear()
    play()
    job = ws.submit("task", piece=piece, model="openai:m", inputs={"notes.md": "n\n"})
    while job.status not in ("succeeded", "failed"):
        job = Workspace(ws.root).step(job.id, unit="call")  # a fresh Workspace: nothing kept in memory
    assert job.status == "succeeded", job.error
    sent_stepped = [r.body for r in server.received]
    assert len(sent_stepped) == len(sent_whole) == 5

    def same_run(body: dict[str, Any]) -> str:  # the server numbers call ids across both runs; clocks move
        text = re.sub(r"call_\d+_", "call_", json.dumps(body, ensure_ascii=False))
        return re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d \([^)]*\)", "<now>", text)

    for a, b in zip(sent_whole, sent_stepped, strict=False):
        assert same_run(a) == same_run(b)
    assert sent_stepped[3]["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"path":"output/a.md","content":"A"}'


def test_the_wait_a_server_asks_for_is_honoured(ws: Workspace, tmp_path: Path, server: OpenAIServer,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import agentnb.models.openai as oa

    waits: list[float] = []
    # record the waits instead of waiting
    monkeypatch.setattr(oa, "pause", lambda delay, cancel: waits.append(delay) or False)
    monkeypatch.setenv("AGENTNB_OPENAI_BACKOFF", "1000")  # the fallback would show as ≥ 500 s
    monkeypatch.setenv("AGENTNB_OPENAI_RETRIES", "3")
    server.play(
        error(429, "slow down", headers={"Retry-After": "7"}),
        error(429, "slower", headers={"retry-after-ms": "250", "Retry-After": "9"}),
        error(503, "busy", headers={"Retry-After": "3600"}),
        error(500, "final boom"),
    )
    job = ws.run(ws.submit("task", piece=write_piece(tmp_path, "piece", LOOP), model="openai:m"))
    assert job.status == "failed"
    assert job.error == "openai:m: gave up after 4 tries; last error HTTP 500: final boom"
    assert waits == [7.0, 0.25, 60.0]  # the server's own numbers, a long one capped; none after the last try


# -- malformed 200 answers ------------------------------------------------------------------------------------

from openai_server import raw  # noqa: E402

MALFORMED = [
    pytest.param(raw({"id": "x", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop"}]}),
                 "choices[0] has no message", id="choice-without-message"),
    pytest.param(raw({"id": "x", "object": "chat.completion", "choices": "oops"}),
                 "choices is a string, not a list", id="choices-a-string"),
    pytest.param(raw('{"id": "x", "choices": [', "application/json"),
                 "the body is not valid JSON (Expecting value at line 1, column 25): '{\"id\": \"x\", \"choices\": ['",
                 id="invalid-json"),
    pytest.param(raw("<html>\n<body><h1>502 Bad Gateway</h1></body>\n</html>", "text/html; charset=utf-8"),
                 "HTTP 200 with content-type text/html, not JSON: '<html> <body><h1>502 Bad Gateway</h1></body> </html>'",
                 id="html-page"),
    pytest.param(raw([{"choices": []}]), "the body is a list, not a JSON object", id="a-list"),
    pytest.param(raw({"error": "nope"}), "the body has no choices (its keys: error)", id="no-choices"),
]


@pytest.mark.parametrize("bad, reason", MALFORMED)
def test_a_malformed_200_is_retried_like_a_5xx(ws: Workspace, tmp_path: Path, server: OpenAIServer,
                                               bad: list[dict[str, Any]], reason: str) -> None:
    server.play(
        bad, bad,
        reply(None, [("transition", {"next_step": "review", "summary": "done"})]),
        reply(None, [("transition", {"next_step": "COMPLETE", "summary": "ok"})]),
    )
    job = ws.run(ws.submit("task", piece=write_piece(tmp_path, "piece", LOOP), model="openai:m"))
    assert job.status == "succeeded", job.error
    assert len(server.received) == 4
    assert not ws.events(job, kinds=["error"])


@pytest.mark.parametrize("bad, reason", MALFORMED)
def test_a_malformed_200_on_every_try_fails_the_job_with_one_line(ws: Workspace, tmp_path: Path,
                                                                  server: OpenAIServer, bad: list[dict[str, Any]],
                                                                  reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTNB_OPENAI_RETRIES", "2")
    server.play(bad, bad, bad)
    job = ws.run(ws.submit("task", piece=write_piece(tmp_path, "piece", LOOP), model="openai:m"))
    assert job.status == "failed"
    assert job.error == f"openai:m: gave up after 3 tries; last error malformed answer: {reason}"
    assert "\n" not in job.error
    assert ws.events(job, kinds=["error"])[-1].payload == {"message": job.error, "where": "model"}
    assert len(server.received) == 3


def test_a_tool_call_without_a_name_is_a_tool_error_the_model_reads(ws: Workspace, tmp_path: Path,
                                                                    server: OpenAIServer) -> None:
    def answer(*calls: dict[str, Any]) -> list[dict[str, Any]]:
        return raw({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": list(calls)}}]})

    server.play(
        reply(None, [(None, {"path": "input/notes.md"})]),  # "name": null
        answer({"id": "c_missing", "type": "function", "function": {"arguments": "{}"}}),  # no name at all
        answer({"type": "function", "function": None}),  # no function, no id
        reply(None, [("transition", {"next_step": "review", "summary": "done"})]),
        reply(None, [("transition", {"next_step": "COMPLETE", "summary": "ok"})]),
    )
    job = ws.run(ws.submit("task", piece=write_piece(tmp_path, "piece", LOOP), model="openai:m"))
    assert job.status == "succeeded", job.error
    results = [e.payload for e in ws.events(job, kinds=["tool_result"])][:3]
    for r in results:
        assert r["is_error"] and r["content"] == ("Error: this tool call names no tool (its function name is missing "
                                                  "or empty); available: Read, Write, crash_tool, transition")
    fourth = server.received[3].body["messages"]
    assert [m["role"] for m in fourth] == ["system", "user"] + ["assistant", "tool"] * 3
    for assistant, tool in zip(fourth[2::2], fourth[3::2], strict=False):  # every answer names the call it answers
        assert tool["tool_call_id"] == assistant["tool_calls"][0]["id"] and tool["tool_call_id"]
    assert fourth[3]["content"] == results[0]["content"]


# -- the conversation a model reads: typed messages (models/messages.py) -----------------------------------------
LISTED = """
name: listed
movements:
  - name: work
    persona: You are the worker.
    instruction: List the files.
    tools: [Glob]
    rules:
      - {condition: done, next: COMPLETE}
"""


class _Listener:
    """A Python model answering by call index, keeping each request's messages."""

    spec = "listener"

    def __init__(self) -> None:
        self.seen: dict[int, list[Message]] = {}

    def complete(self, request: ModelRequest) -> ModelResponse:
        self.seen[request.call_index] = list(request.messages)
        return [
            # compact JSON: kept verbatim, since re-encoding would add spaces
            ModelResponse(content="Looking.", tool_calls=(ToolCall("c0", "Glob", {"pattern": "*"}, '{"pattern":"*"}'),)),
            # not JSON at all: the tool error, and the model's own text sent back
            ModelResponse(tool_calls=(ToolCall("c1", "Glob", '{"pattern": ', '{"pattern": '),),
                          usage=TokenUsage(prompt_tokens=700)),
            ModelResponse(tool_calls=(ToolCall("c2", "transition", {"next_step": "COMPLETE", "summary": "listed"}),)),
        ][request.call_index]


def test_a_model_reads_typed_messages_and_a_resumed_movement_rebuilds_the_same(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    job = ws.submit("List.", piece=agentnb.parse_piece(LISTED), model="demo")
    row = ws.store.claim(job.id)
    assert row is not None
    live = _Listener()
    runner = JobRunner(ws.store, row, live, ws.root / "jobs")
    assert runner.advance("call") == runner.advance("call") == "running"
    # another process goes on from the events alone
    resumed = _Listener()
    assert JobRunner(ws.store, row, resumed, ws.root / "jobs").advance("job") == "succeeded"

    start = ws.events(job, kinds=["movement_start"])[0].payload
    results = [e.payload["content"] for e in ws.events(job, kinds=["tool_result"])]
    assert live.seen[0] == [SystemMessage(start["system"]), UserMessage(start["user"])]
    assert live.seen[1] == [*live.seen[0], AssistantMessage("Looking.", (
        ToolCallPart("c0", "Glob", {"pattern": "*"}, '{"pattern":"*"}'),)), ToolMessage("c0", results[0])]
    assert results[1].startswith("Error: the arguments for Glob are not a JSON object")
    assert resumed.seen[2] == [*live.seen[1], AssistantMessage(None, (
        ToolCallPart("c1", "Glob", '{"pattern": ', '{"pattern": '),)), ToolMessage("c1", results[1])]
    assert list(resumed.seen) == [2]
    # the reported prompt size is the one recorded, the answer counted as it was sent
    assert ws.events(job, kinds=["llm_response"])[1].payload["usage"]["prompt_tokens"] == 700
    with pytest.raises(dataclasses.FrozenInstanceError):
        resumed.seen[2][2].text = "changed"


def test_the_openai_adapter_sends_each_kind_of_message_in_the_chat_completions_shape() -> None:
    conversation: list[Message] = [
        SystemMessage("Be brief."), UserMessage("Look."),
        AssistantMessage(None, (ToolCallPart("a", "Read", {"path": "ü.md"}),
                                ToolCallPart("b", "Read", '{"path', '{"path'))),
        ToolMessage("a", "text"), ToolMessage("b", "Error: not JSON"),
        UserMessage("(image attached by ReadImage)", (ImagePart("data:image/png;base64,AAAA"),)),
        AssistantMessage(""),
    ]
    assert wire_messages(conversation) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Look."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "Read", "arguments": '{"path": "ü.md"}'}},
            {"id": "b", "type": "function", "function": {"name": "Read", "arguments": '{"path'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "text"},
        {"role": "tool", "tool_call_id": "b", "content": "Error: not JSON"},
        {"role": "user", "content": [{"type": "text", "text": "(image attached by ReadImage)"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": ""},
    ]


def test_a_scripted_usage_is_typed_and_an_unreported_completion_stays_unknown(tmp_path: Path) -> None:
    model = ScriptedModel({"responses": [{"content": "a", "usage": {"prompt_tokens": 12}},
                                         {"content": "b", "usage": {"prompt_tokens": 30, "completion_tokens": 4,
                                                                    "total_tokens": 34}}]})
    first, second = (model.complete(ModelRequest(messages=[UserMessage("x")], tools=[], call_index=i)) for i in (0, 1))
    assert (first.usage, second.usage) == (TokenUsage(12), TokenUsage(30, 4))
