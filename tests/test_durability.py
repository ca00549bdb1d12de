"""Durability of the event log: what happened before an LLM call is committed before the call is made.

The engine batches a call's events into one transaction, never across
calls.  These tests look from a second SQLite connection — as another process,
a crashed-and-restarted worker or a notebook view would — at the moment each
model call happens.

The last test guards another optimisation of the event path: scripted-model files are
read through libyaml's node tree, and must still read exactly as ``yaml.safe_load``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import agentnb
from agentnb import Workspace
from agentnb.engine.runner import JobRunner
from agentnb.models.base import ModelRequest, ModelResponse, TokenUsage, ToolCall
from agentnb.store import open_store


@pytest.fixture(scope="module")
def durable_echo() -> Any:
    @agentnb.tool
    def durable_echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    return durable_echo


PIECE = """
name: durability
movements:
  - name: work
    instruction: Echo three times, then finish.
    tools: [durable_echo]
    max_iterations: 10
    rules: [{next: COMPLETE}]
"""


class ProbeModel:
    """Calls ``durable_echo`` ``calls - 1`` times, then ends; before answering, reads what is committed."""

    spec = "probe"

    def __init__(self, ws: Workspace, calls: int) -> None:
        # a second store on the same database (its own connection) sees only committed transactions
        self.probe = open_store(ws.store_url or ws.store.path, readonly=True)
        self.calls = calls
        self.seen: list[list[tuple[str, int | None]]] = []  # committed (kind, iteration) at each call

    def complete(self, request: ModelRequest) -> ModelResponse:
        rows = self.probe.query("SELECT kind, iteration FROM events WHERE job_id=? ORDER BY id", (request.job_id,))
        self.seen.append([(r[0], r[1]) for r in rows])
        n = len(self.seen)
        if n < self.calls:
            call = ToolCall(id=f"c{n}", name="durable_echo", arguments={"text": f"echo {n}"})
        else:
            call = ToolCall(id=f"c{n}", name="transition", arguments={"next_step": "COMPLETE", "summary": "done"})
        return ModelResponse(tool_calls=(call,))


def _run_with(ws: Workspace, model: ProbeModel) -> str:
    job = ws.submit("Echo.", piece=agentnb.parse_piece(PIECE), model="demo")
    row = ws.store.claim(job.id)
    assert row is not None
    runner = JobRunner(ws.store, row, model, ws.root / "jobs")
    return runner.advance("job")


def test_each_call_sees_its_request_and_the_previous_calls_results_committed(
    tmp_path: Path, durable_echo: Any
) -> None:
    ws = Workspace(tmp_path / "ws")
    model = ProbeModel(ws, calls=4)
    assert _run_with(ws, model) == "succeeded"
    assert len(model.seen) == 4
    for n, committed in enumerate(model.seen, start=1):
        # the request of this very call is durable before the model is asked
        assert committed.count(("llm_request", n)) == 1, committed
        assert [k for k, _ in committed].count("llm_request") == n
        # and so is everything the previous call produced: its response, tool call and tool result
        if n > 1:
            for kind in ("llm_response", "tool_call", "tool_result"):
                assert (kind, n - 1) in committed, (kind, n - 1, committed)
        # nothing of this call beyond its request exists yet
        assert ("llm_response", n) not in committed
    assert ("movement_start", 0) in model.seen[0]


def test_the_events_seen_mid_run_are_a_prefix_of_the_final_log(tmp_path: Path, durable_echo: Any) -> None:
    ws = Workspace(tmp_path / "ws")
    model = ProbeModel(ws, calls=3)
    assert _run_with(ws, model) == "succeeded"
    final = [(r[0], r[1]) for r in ws.store.query("SELECT kind, iteration FROM events WHERE job_id=1 ORDER BY id")]
    for committed in model.seen:
        assert final[: len(committed)] == committed  # committed events are never rewritten or reordered
    kinds = [k for k, _ in final]
    assert kinds.count("llm_request") == kinds.count("llm_response") == 3
    assert kinds.count("tool_result") == 3  # two echoes and the transition
    results = [i for k, i in final if k == "tool_result"]
    assert results == [1, 2, 3]


# -- the scripted model's fast YAML path reads scripts exactly as yaml.safe_load does ----------------------

SCRIPT_WITH_YAML_FEATURES = """
defaults: &usage {prompt_tokens: 1200, completion_tokens: 40}
call: &call
  name: Read
  arguments: {path: input/notes.md, limit: 0x10, offset: 1_000, ratio: .5, flag: yes, none: ~, when: 2026-11-30}
responses:
  - tool_calls: [*call]
    usage: *usage
  - <<: {content: merged text}
    tool_calls:
      - <<: *call
        arguments: {path: "007", quoted: '12', text: "a: b # not a comment"}
  - content: |
      two
      lines
    usage: {<<: *usage, completion_tokens: 7}
  - tool_calls: [{name: transition, arguments: {next_step: COMPLETE, summary: done, tags: !!set {a, b}}}]
"""


def test_a_script_file_reads_exactly_as_yaml_safe_load_gives_it(tmp_path: Path) -> None:
    import yaml

    from agentnb.models.base import ScriptedModel

    path = tmp_path / "script.yaml"
    path.write_text(SCRIPT_WITH_YAML_FEATURES, encoding="utf-8")
    from_file = ScriptedModel(path)
    reference = ScriptedModel(yaml.safe_load(SCRIPT_WITH_YAML_FEATURES))
    assert from_file.responses == reference.responses
    first, second, third, last = from_file.responses  # type: ignore[misc]
    assert first.tool_calls[0].arguments["limit"] == 16 and first.tool_calls[0].arguments["flag"] is True
    assert first.usage == TokenUsage(prompt_tokens=1200, completion_tokens=40)
    assert second.content == "merged text"  # a merge key, not a key named "<<"
    assert second.tool_calls[0].name == "Read" and second.tool_calls[0].arguments["quoted"] == "12"
    assert third.usage == TokenUsage(prompt_tokens=1200, completion_tokens=7)
    assert last.tool_calls[0].arguments["tags"] == {"a", "b"}  # !!set, as safe_load builds it


# -- a tool with effects runs only once its call is durable ------------------------------------------------


def _committed(ws: Workspace, job_id: int) -> list[tuple[str, str | None]]:
    # a second store on the same database (its own connection): what a process restarted right now would find
    probe = open_store(ws.store_url or ws.store.path, readonly=True)
    try:
        rows = probe.query("SELECT kind, payload FROM events WHERE job_id=? AND kind IN "
                           "('llm_response', 'tool_call', 'tool_result') ORDER BY id", (job_id,))
    finally:
        probe.close()
    payloads = [(r[0], r[1] if isinstance(r[1], dict) else json.loads(r[1])) for r in rows]
    return [(k, p.get("call_id") if k != "llm_response" else None) for k, p in payloads]


def test_the_response_and_a_side_effecting_call_are_committed_before_the_tool_runs(tmp_path: Path) -> None:
    seen: dict[str, list[tuple[str, str | None]]] = {}
    ws = Workspace(tmp_path / "ws")

    def probe(name: str) -> Any:
        def fn(ctx: agentnb.ToolContext) -> str:
            seen[name] = _committed(ws, ctx.job_id)
            return name
        return fn

    agentnb.tool(name="look_a", read_only=True)(probe("look_a"))
    agentnb.tool(name="look_b", read_only=True)(probe("look_b"))
    agentnb.tool(name="change")(probe("change"))  # a custom tool is taken to have effects unless it says not
    try:
        piece = agentnb.parse_piece(PIECE.replace("[durable_echo]", "[look_a, look_b, change]"))

        class Model:
            spec = "probe"

            def complete(self, request: ModelRequest) -> ModelResponse:
                if request.iteration == 1:
                    return ModelResponse(tool_calls=(ToolCall("a", "look_a", {}), ToolCall("b", "look_b", {}),
                                                     ToolCall("c", "change", {})))
                return ModelResponse(tool_calls=(ToolCall("t", "transition", {"next_step": "COMPLETE"}),))

        job = ws.submit("Probe.", piece=piece, model="demo")
        row = ws.store.claim(job.id)
        assert row is not None
        assert JobRunner(ws.store, row, Model(), ws.root / "jobs").advance("job") == "succeeded"
    finally:
        for name in ("look_a", "look_b", "change"):
            agentnb.tools.base.unregister(name)
    # before the first tool runs, the response (and that call) is durable: a restart completes it, never re-asks
    assert seen["look_a"] == [("llm_response", None), ("tool_call", "a")]
    # a second read-only tool costs no commit of its own
    assert seen["look_b"] == seen["look_a"]
    # a tool with effects: its call, and everything before it, is durable before it runs
    assert seen["change"] == [("llm_response", None), ("tool_call", "a"), ("tool_result", "a"),
                              ("tool_call", "b"), ("tool_result", "b"), ("tool_call", "c")]


def test_only_the_built_in_readers_and_declared_tools_are_read_only() -> None:
    from agentnb.tools.base import get_tool

    assert {n for n in ("Read", "Glob", "Grep", "ReadImage", "Write", "Edit", "Bash", "Checklist")
            if get_tool(n).read_only} == {"Read", "Glob", "Grep", "ReadImage"}  # type: ignore[union-attr]
    plain = agentnb.tool(name="plain_tool")(lambda: "")
    declared = agentnb.tool(name="declared_tool", read_only=True)(lambda: "")
    try:
        # permission says what a movement must allow, not whether a restart may run the tool again
        assert (plain.permission, plain.read_only, declared.read_only) == ("readonly", False, True)
        with pytest.raises(ValueError, match="read_only='yes'; allowed: True or False"):
            agentnb.tool(name="bad_tool", read_only="yes")  # type: ignore[call-overload]
    finally:
        agentnb.tools.base.unregister("plain_tool")
        agentnb.tools.base.unregister("declared_tool")


# -- a model that answers at once: its request goes in with its response --------------------------------------

SHORT = """
name: short
movements:
  - name: work
    instruction: Write the note, then finish.
    tools: [Write]
    permission: edit
    rules: [{next: COMPLETE}]
"""


def _counting(ws: Workspace) -> list[int]:
    """A spy on the workspace store's write transactions (the outermost ones): their number, as it grows."""
    opened = [0]
    transaction = ws.store.transaction

    def counted() -> Any:
        if not getattr(ws.store, "_depth", 0):
            opened[0] += 1
        return transaction()

    ws.store.transaction = counted  # type: ignore[method-assign]
    return opened


@pytest.mark.sqlite_only("counts the takes of SQLite's write lock (PostgreSQL appends in transactions of its own)")
def test_a_scripted_call_nobody_watches_is_committed_with_its_response(tmp_path: Path) -> None:
    from _scripting import call, transition, write_piece, write_script

    from agentnb import live

    piece = write_piece(tmp_path, "short", SHORT)
    script = write_script(tmp_path, "notes", responses=[call("Write", path="note.md", content="a note"),
                                                        transition("COMPLETE", "noted")])
    with Workspace(tmp_path / "ws") as ws:
        opened = _counting(ws)
        job = ws.submit("Note it.", piece=str(piece), model=script)
        submitted = opened[0]
        assert ws.run(job).status == "succeeded"
        # the claim; the movement's start (with the activation's enriched instruction); the first call's request,
        # response and tool call before the Write runs; the Write's result, the second call and the transition
        # with the job's end
        assert opened[0] - submitted == 4
        kinds = [e.kind for e in ws.events(job)]
        assert kinds.count("llm_request") == kinds.count("llm_response") == 2  # every event is still there
        assert ws.store.job(job.id).enriched  # stored with the movement's start
        assert (ws.root / "jobs" / str(job.id) / "note.md").read_text() == "a note"

        # watched live (a view of this kernel), each request is committed before its call, as for any model
        other = ws.submit("Note it again.", piece=str(piece), model=script)
        before = opened[0]
        with live.subscribe(ws.store, other.id, lambda item: None):
            assert ws.run(other).status == "succeeded"
        assert opened[0] - before == 6  # one more commit for each of its two calls
