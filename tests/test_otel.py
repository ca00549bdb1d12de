"""OpenTelemetry GenAI export (docs/otel.md): real jobs run with scripted models, exported as OTLP JSON Lines or
posted as OTLP/HTTP to a loopback receiver, and read back with opentelemetry-proto."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _batching import answering_model
from _scripting import call, say, transition, write_piece, write_script
from google.protobuf import json_format
from openai_server import OpenAIServer, midway, reply
from opentelemetry.proto.trace.v1.trace_pb2 import Span, TracesData
from otlp_receiver import Receiver

from agentnb import Workspace
from agentnb.cli import main
from agentnb.errors import UsageError
from agentnb.events import LLMRequest, LLMResponse, ToolCallEvent, ToolResult
from agentnb.models.prices import call_cost
from agentnb.store import StoreError
from agentnb.views.otel import read_traces, sdk_spans, traces, traces_data

DOCS = Path(__file__).resolve().parent.parent / "docs" / "otel.md"
WINDOW = 4_000
SECRET = "hunter2-very-secret-value-9876"


# -- the docs' table ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    what: str
    is_span: bool
    name: re.Pattern[str]
    kind: str
    under: tuple[str, ...]
    always: frozenset[str]
    known: frozenset[str]
    content: frozenset[str]


def _codes(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def mapping_table() -> list[Row]:
    """The rows of docs/otel.md's mapping table."""
    text = DOCS.read_text(encoding="utf-8").split("## Mapping", 1)[1]
    rows = []
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith("| agentnb") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 8, line
        what, as_, name, kind, under, always, known, content = cells
        (name_code,) = _codes(name)
        pattern = re.compile(re.sub(r"\\\{[a-z]+\\\}", ".+", re.escape(name_code)) + "$")
        rows.append(Row(what, as_ == "span", pattern, kind, tuple(c.split()[0] for c in _codes(under)),
                        frozenset(_codes(always)), frozenset(_codes(known)), frozenset(_codes(content))))
    assert len(rows) > 10
    return rows


def _row(rows: list[Row], name: str, span: bool) -> Row:
    found = [r for r in rows if r.is_span == span and r.name.match(name)]
    assert found, f"{name!r} has no row in docs/otel.md's mapping table"
    return found[0]


# -- reading an export back ----------------------------------------------------------------------------------------
def spans_of(data: TracesData) -> list[Span]:
    return [s for rs in data.resource_spans for ss in rs.scope_spans for s in ss.spans]


def attrs(items: Any) -> dict[str, Any]:
    out = {}
    for kv in items:
        value = getattr(kv.value, kv.value.WhichOneof("value"))
        out[kv.key] = list(v.string_value for v in value.values) if kv.value.HasField("array_value") else value
    return out


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


# -- the jobs ------------------------------------------------------------------------------------------------------
def _pressed(prompt: int) -> dict[str, Any]:
    return {**call("Glob", pattern="*"), "usage": {"prompt_tokens": prompt, "completion_tokens": 10}}


def rich_job(ws: Workspace, tmp: Path) -> Any:
    """Three movement runs: tools (one failing) and a subtask; then calls that cross the window and compact,
    a question answered by the user; then the same movement again to the end.  Scored afterwards."""
    child = write_script(tmp, "child", {"work": [call("Write", path="output/part.md", content="part"),
                                                 transition("COMPLETE", summary="part written")]})
    spec = write_script(tmp, "rich-script", {
        "split": [call("Glob", pattern="*"), call("Read", path="missing.txt"),
                  transition("WAIT_SUBTASKS", summary="split", subtasks=[
                      {"instruction": "Write a part", "piece": "single", "model": child}])],
        "work": [_pressed(1_000), _pressed(1_100), _pressed(3_500),
                 {"content": "summary of the work so far", "usage": {"prompt_tokens": 3_600, "completion_tokens": 20}},
                 transition("ASK", summary="unclear", question="Which format?"),
                 transition("COMPLETE", summary="done", lessons="ask for the format first")],
    })
    piece = write_piece(tmp, "rich", {"context": {"window_tokens": WINDOW, "on_pressure": "compact"}, "movements": [
        # a subtask gets no more tools or permission than the run that creates it: single's
        {"name": "split", "instruction": "Split.", "tools": ["Read", "Glob", "Grep", "Write", "Edit", "Checklist"],
         "permission": "edit", "default_next": "work",
         "rules": [{"next": "WAIT_SUBTASKS"}, {"next": "work"}]},
        {"name": "work", "instruction": "Work.", "tools": ["Glob"], "default_next": "COMPLETE",
         "rules": [{"next": "COMPLETE"}, {"next": "ASK"}]},
    ]})
    job = ws.run(ws.submit("Do it in parts", piece=str(piece), model=spec))
    assert job.status == "waiting_human", job.error
    job = ws.run(ws.reply(job, "Markdown, please."))
    assert job.status == "succeeded", job.error
    ws.score(job, {"done": lambda j: True})
    return job


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Workspace]:
    with Workspace(tmp_path / "ws") as w:
        yield w


# -- the mapping -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [False, True], ids=["plain", "with-content"])
def test_every_span_and_span_event_is_as_the_docs_table_says(ws: Workspace, tmp_path: Path, content: bool) -> None:
    job = rich_job(ws, tmp_path)
    (data,) = read_traces(ws.export_otel(job, tmp_path / "t.jsonl", content=content))
    rows = mapping_table()
    spans = spans_of(data)
    by_id = {s.span_id: s for s in spans}
    problems: list[str] = []
    names_seen: set[str] = set()
    for s in spans:
        row = _row(rows, s.name, span=True)
        names_seen.add(row.what)
        kind = {"INTERNAL": Span.SPAN_KIND_INTERNAL, "CLIENT": Span.SPAN_KIND_CLIENT}[row.kind]
        if s.kind != kind:
            problems.append(f"{s.name}: kind {s.kind}, docs say {row.kind}")
        a = set(attrs(s.attributes))
        problems += [f"{s.name}: no {k}" for k in row.always - a]
        problems += [f"{s.name}: {k} is not in the docs' row" for k in a - row.always - row.known
                     - (row.content if content else set())]
        parent = by_id.get(s.parent_span_id)
        if s.parent_span_id and (parent is None or parent.name.split()[0] not in row.under):
            problems.append(f"{s.name}: under {parent.name if parent else '?'}, docs say {row.under}")
        for e in s.events:
            erow = _row(rows, e.name, span=False)
            names_seen.add(erow.what)
            ea = set(attrs(e.attributes))
            problems += [f"{e.name}: no {k}" for k in erow.always - ea]
            problems += [f"{e.name}: {k} is not in the docs' row" for k in ea - erow.always - erow.known
                         - (erow.content if content else set())]
            if s.name.split()[0] not in erow.under:
                problems.append(f"{e.name}: on {s.name}, docs say {erow.under}")
    assert not problems, "\n".join(problems)
    # the job's parts each showed: every span row, and the events this job has
    assert {r.what for r in rows if r.is_span} <= names_seen
    assert {"`compaction`", "`transition`", "`score`", "`comment` by the user (a human reply)",
            "`context_action`"} <= names_seen, names_seen
    transitions = [attrs(e.attributes) for s in spans for e in s.events if e.name == "agentnb.transition"]
    if content:  # the summaries, and the lessons the last run passed on (its `lesson` event's text)
        assert sorted(t["agentnb.summary"] for t in transitions) == ["done", "part written", "split", "unclear"]
        assert [t["agentnb.lessons"] for t in transitions if "agentnb.lessons" in t] == ["ask for the format first"]
    else:
        assert not any("agentnb.summary" in t or "agentnb.lessons" in t for t in transitions)


def test_spans_have_the_events_times_tokens_parents_and_errors(ws: Workspace, tmp_path: Path) -> None:
    job = rich_job(ws, tmp_path)
    (kid,) = ws.children(job)
    (data,) = read_traces(ws.export_otel(kid, tmp_path / "t.jsonl"))  # a subtask: its root's trace
    spans = spans_of(data)
    by_id = {s.span_id: s for s in spans}
    assert len({s.trace_id for s in spans}) == 1
    roots = [s for s in spans if not s.parent_span_id]
    assert [r.name for r in roots] == ["invoke_workflow rich"]
    runs = [s for s in spans if s.name.startswith("invoke_agent") and by_id[s.parent_span_id] is roots[0]]
    assert [r.name for r in runs] == ["invoke_agent split", "invoke_agent work", "invoke_agent work"]
    (child_root,) = [s for s in spans if s.name == "invoke_workflow single"]
    assert by_id[child_root.parent_span_id] is runs[0]  # under the run that asked for it
    assert attrs(child_root.attributes)["agentnb.job_id"] == kid.id

    events = ws.events(job)
    ns = lambda t: round(t * 1e9)  # noqa: E731
    chats = [s for s in spans if s.name.startswith("chat") and attrs(s.attributes)["gen_ai.conversation.id"] == str(job.id)]
    requests = [e for e in events if isinstance(e, LLMRequest)]
    responses = [e for e in events if isinstance(e, LLMResponse)]
    assert len(chats) == len(requests) == len(responses) == 9
    for span, req, resp in zip(chats, requests, responses, strict=True):
        a = attrs(span.attributes)
        assert (span.start_time_unix_nano, span.end_time_unix_nano) == (ns(req.ts), ns(resp.ts))
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
            resp.usage.prompt_tokens, resp.usage.completion_tokens)
        assert a["gen_ai.provider.name"] == "agentnb.scripted" and span.name == "chat scripted"
        assert a["gen_ai.response.finish_reasons"] == (["tool_call"] if resp.tool_calls else ["stop"])
        assert by_id[span.parent_span_id].name == f"invoke_agent {ws.events(job, kinds=['movement_start'])[resp.movement_seq - 1].payload['movement']}"
    summarising = [attrs(s.attributes) for s in chats if attrs(s.attributes).get("agentnb.purpose") == "compaction"]
    assert len(summarising) == 1 and summarising[0]["gen_ai.usage.input_tokens"] == 3_600
    compacted = [attrs(s.attributes).get("gen_ai.conversation.compacted", False) for s in chats]
    assert compacted == [False] * 7 + [True, False]  # the calls after the compaction, in its run only
    assert not any(s.status.code == s.status.STATUS_CODE_ERROR for s in chats)

    tools = [s for s in spans if s.name.startswith("execute_tool") and by_id[s.parent_span_id] in runs]
    calls = [e for e in events if isinstance(e, ToolCallEvent)]
    results = {e.call_id: e for e in events if isinstance(e, ToolResult)}
    assert [s.name for s in tools] == [f"execute_tool {c.tool}" for c in calls]
    for span, c in zip(tools, calls, strict=True):
        a = attrs(span.attributes)
        assert (span.start_time_unix_nano, span.end_time_unix_nano) == (ns(c.ts), ns(results[c.call_id].ts))
        assert a["gen_ai.tool.call.id"] == c.call_id and a["gen_ai.tool.type"] == "function"
        failed = results[c.call_id].is_error
        assert (span.status.code == span.status.STATUS_CODE_ERROR) == failed
        assert (a.get("error.type") == "tool_error") == failed
    assert [s.name for s in tools if s.status.code == s.status.STATUS_CODE_ERROR] == ["execute_tool Read"]
    root = roots[0]
    assert (root.start_time_unix_nano, root.end_time_unix_nano) == (ns(events[0].ts), ns(events[-1].ts))
    assert root.status.code == root.status.STATUS_CODE_UNSET
    assert attrs(data.resource_spans[0].resource.attributes) == {"service.name": "agentnb"}


def test_every_span_event_is_inside_its_span_and_every_span_inside_its_parent(ws: Workspace, tmp_path: Path) -> None:
    job = rich_job(ws, tmp_path)
    # an answer with no tool call: a reminder, after the answer
    talker = write_script(tmp_path, "talker", {"work": [say("Thinking aloud."), transition("COMPLETE")]})
    other = ws.run(ws.submit("Go", piece="single", model=talker))
    assert other.status == "succeeded", other.error
    data, more = read_traces(ws.export_otel([job, other], tmp_path / "t.jsonl"))
    spans = spans_of(data) + spans_of(more)
    by_id = {s.span_id: s for s in spans}
    placed = {e.name for s in spans for e in s.events}
    assert {"agentnb.context_action", "agentnb.reminder", "agentnb.comment", "agentnb.human_reply",
            "agentnb.compaction", "agentnb.transition"} <= placed
    for s in spans:
        for e in s.events:
            assert s.start_time_unix_nano <= e.time_unix_nano <= s.end_time_unix_nano, (s.name, e.name)
        parent = by_id.get(s.parent_span_id)
        if parent is None:
            continue
        assert parent.start_time_unix_nano <= s.start_time_unix_nano, (s.name, parent.name)
        if not (s.name.startswith("invoke_workflow") and parent.name.startswith("invoke_agent")):
            # (a subtask's job outlives the run that asked for it: docs/otel.md#mapping)
            assert s.end_time_unix_nano <= parent.end_time_unix_nano, (s.name, parent.name)
    (subtask,) = [s for s in spans if s.name.startswith("invoke_workflow") and s.parent_span_id]
    assert subtask.end_time_unix_nano > by_id[subtask.parent_span_id].end_time_unix_nano
    # the reminder came after its call's answer: on the run's span
    (reminded,) = [s for s in spans if any(e.name == "agentnb.reminder" for e in s.events)]
    assert reminded.name == "invoke_agent work"


def test_a_model_spec_s_options_name_no_model(ws: Workspace, tmp_path: Path) -> None:
    job = ws.run(ws.submit("Summarise the inputs", piece="single", model="demo?pace=0"))
    (data,) = read_traces(ws.export_otel(job, tmp_path / "t.jsonl"))
    chats = [s for s in spans_of(data) if s.name.startswith("chat")]
    assert chats and {s.name for s in chats} == {"chat demo"}
    assert {(attrs(s.attributes)["gen_ai.provider.name"], attrs(s.attributes)["gen_ai.request.model"])
            for s in chats} == {("agentnb.demo", "demo")}


def test_a_call_stopped_and_asked_again_is_two_chat_spans_the_first_ended_at_its_stop(
        ws: Workspace, tmp_path: Path, loopback: Callable[..., OpenAIServer]) -> None:
    srv = loopback("sk-otel-test-key-0000", timeout="5", retries="0")
    srv.play(midway("hold", after=6), reply(None, [("transition", {"next_step": "COMPLETE", "summary": "done"})],
                                            usage=(1_500, 20)))
    job = ws.submit("look around", piece="single", model="openai:gpt-4o-mini?stream=1")
    runner = threading.Thread(target=ws.run, args=(job,))
    runner.start()
    assert srv.holding.wait(30)
    time.sleep(0.2)
    ws.stop(job)
    runner.join(30)
    done = ws.run(job)
    assert done.status == "succeeded", done.error
    (data,) = read_traces(ws.export_otel(done, tmp_path / "t.jsonl"))
    chats = sorted((s for s in spans_of(data) if s.name.startswith("chat")), key=lambda s: s.start_time_unix_nano)
    asked = ws.events(job, kinds=["llm_request"])
    (cut,) = ws.events(job, kinds=["error"])
    (answer,) = ws.events(job, kinds=["llm_response"])
    ns = lambda t: round(t * 1e9)  # noqa: E731
    assert [s.name for s in chats] == ["chat gpt-4o-mini"] * 2 == ["chat gpt-4o-mini"] * len(asked)
    stopped, again = chats
    assert (stopped.start_time_unix_nano, stopped.end_time_unix_nano) == (ns(asked[0].ts), ns(cut.ts))
    assert stopped.status.code == stopped.status.STATUS_CODE_UNSET  # a Stop is no failure
    assert [(e.name, attrs(e.attributes)["error.type"]) for e in stopped.events] == [("agentnb.error", "interrupted")]
    assert "gen_ai.usage.input_tokens" not in attrs(stopped.attributes)
    assert (again.start_time_unix_nano, again.end_time_unix_nano) == (ns(asked[1].ts), ns(answer.ts))
    assert attrs(again.attributes)["gen_ai.usage.input_tokens"] == 1_500
    assert stopped.span_id != again.span_id and stopped.parent_span_id == again.parent_span_id


def test_a_failed_job_and_its_failed_call_have_the_error_status(ws: Workspace, tmp_path: Path) -> None:
    spec = write_script(tmp_path, "short", {"work": [call("Glob", pattern="*")]})  # runs out of responses
    job = ws.run(ws.submit("Go", piece="single", model=spec))
    assert job.status == "failed"
    (data,) = read_traces(ws.export_otel(job, tmp_path / "t.jsonl"))
    errors = {s.name: attrs(s.attributes)["error.type"] for s in spans_of(data)
              if s.status.code == s.status.STATUS_CODE_ERROR}
    assert errors == {"invoke_workflow single": "failed", "invoke_agent work": "model", "chat scripted": "model"}


def test_a_run_a_retry_took_on_to_its_transition_is_no_longer_failed(ws: Workspace, tmp_path: Path) -> None:
    piece = write_piece(tmp_path, "p", {"movements": [{"name": "work", "instruction": "i", "tools": ["Glob"],
                                                       "rules": [{"next": "COMPLETE"}]}]})
    job = ws.run(ws.submit("Go", piece=piece, model=write_script(tmp_path, "s", {"work": [call("Glob", pattern="*")]})))
    assert job.status == "failed"
    write_script(tmp_path, "s", {"work": [call("Glob", pattern="*"), transition("COMPLETE")]})
    job = ws.run(ws.retry(job))
    assert job.status == "succeeded"
    (data,) = read_traces(ws.export_otel(job, tmp_path / "t.jsonl"))
    errors = [(s.name, attrs(s.attributes)["error.type"]) for s in spans_of(data)
              if s.status.code == s.status.STATUS_CODE_ERROR]
    assert errors == [("chat scripted", "model")]  # the call that failed, not its run nor the job


# -- ids, content, files -------------------------------------------------------------------------------------------
def test_exporting_twice_gives_the_same_ids(ws: Workspace, tmp_path: Path) -> None:
    job = rich_job(ws, tmp_path)
    first = ws.export_otel(job, tmp_path / "a.jsonl")
    again = ws.export_otel([job.id], tmp_path / "b.jsonl")
    assert first.read_bytes() == again.read_bytes()
    with_content = read_traces(ws.export_otel(job, tmp_path / "c.jsonl", content=True))
    ids = lambda data: [(s.trace_id, s.span_id, s.parent_span_id) for s in spans_of(data)]  # noqa: E731
    assert ids(with_content[0]) == ids(read_traces(first)[0])
    assert len({s.span_id for s in spans_of(with_content[0])}) == len(spans_of(with_content[0]))
    # another job of the same store: another trace
    other = ws.run(ws.submit("Go", piece="single", model=answering_model(tmp_path, "m", "x")))
    assert spans_of(read_traces(ws.export_otel(other, tmp_path / "d.jsonl"))[0])[0].trace_id != spans_of(
        with_content[0])[0].trace_id


def test_the_same_store_named_another_way_gives_the_same_ids(ws: Workspace, tmp_path: Path) -> None:
    # a worker given sqlite:////… or a symlinked folder exports live what `otel send` from the folder sends again:
    # one job must stay one trace in the viewer
    job = ws.run(ws.submit("Go", piece="single", model=answering_model(tmp_path, "m", "x")))
    ids = lambda data: [(s.trace_id, s.span_id, s.parent_span_id) for s in spans_of(data)]  # noqa: E731
    expected = ids(read_traces(ws.export_otel(job, tmp_path / "a.jsonl"))[0])
    (tmp_path / "link").symlink_to(tmp_path / "ws")
    for n, store in enumerate([f"sqlite:///{tmp_path}/ws/agentnb.sqlite", f"sqlite:////{tmp_path}/ws/agentnb.sqlite",
                               f"sqlite:///{tmp_path}/link/agentnb.sqlite"]):
        with Workspace(tmp_path / f"other{n}", store=store, readonly=True) as other:
            assert ids(read_traces(other.export_otel(job.id, tmp_path / f"b{n}.jsonl"))[0]) == expected, store
    with Workspace(tmp_path / "link", readonly=True) as other:
        assert ids(read_traces(other.export_otel(job.id, tmp_path / "c.jsonl"))[0]) == expected


def test_the_file_and_the_requests_hold_what_the_sdk_s_own_encoder_makes_of_the_spans(
        ws: Workspace, tmp_path: Path) -> None:
    # the export builds OTLP's messages directly (protobuf for OTLP/HTTP, proto-json for the file): they must be
    # the ones the exporter package's encode_spans makes of the same spans as the SDK's ReadableSpans
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    job = rich_job(ws, tmp_path)  # errors, span events, subtasks, arrays, floats, bools, a resource
    path = ws.export_otel(job, tmp_path / "t.jsonl", content=True)
    (trace,) = traces(ws.store, [job.id], content=True)
    expected = TracesData(resource_spans=encode_spans(sdk_spans(trace)).resource_spans)
    assert len(spans_of(expected)) > 10 and any(s.status.code == 2 for s in spans_of(expected))
    assert any(s.events for s in spans_of(expected))
    assert traces_data(trace) == expected
    assert read_traces(path) == [expected]


CONTENT_ATTRS = ("gen_ai.system_instructions", "gen_ai.input.messages", "gen_ai.output.messages",
                 "gen_ai.tool.definitions", "gen_ai.tool.call.arguments", "gen_ai.tool.call.result")


def test_content_is_off_by_default_and_scrubbed_and_cut_when_on(
        ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    long_text = "line of notes\n" * 400
    spec = write_script(tmp_path, "reader", {"work": [call("Read", path="input/notes.md"),
                                                      transition("COMPLETE", summary="read")]})
    job = ws.run(ws.submit("Read the notes", piece="single", model=spec,
                           inputs={"notes.md": f"the password is {SECRET}\n{long_text}"}))
    assert job.status == "succeeded", job.error
    # the secret became one after the run (the store kept it as text): the export masks it all the same
    monkeypatch.setenv("NOTES_PASSWORD", SECRET)
    plain = ws.export_otel(job, tmp_path / "plain.jsonl")
    assert not any(k in plain.read_text() for k in CONTENT_ATTRS) and "line of notes" not in plain.read_text()

    full = ws.export_otel(job, tmp_path / "full.jsonl", content=True, max_chars=2_000)
    text = full.read_text()
    assert SECRET not in text and "the password is ***" in text
    spans = spans_of(read_traces(full)[0])
    (read,) = [attrs(s.attributes) for s in spans if s.name == "execute_tool Read"]
    assert json.loads(read["gen_ai.tool.call.arguments"]) == {"path": "input/notes.md"}
    assert read["gen_ai.tool.call.result"].endswith("characters cut]") and len(read["gen_ai.tool.call.result"]) == 2_000
    chats = [attrs(s.attributes) for s in spans if s.name.startswith("chat")]
    assert len(chats) == 2
    for a in chats:
        for key in ("gen_ai.system_instructions", "gen_ai.input.messages", "gen_ai.output.messages",
                    "gen_ai.tool.definitions"):
            assert len(a[key]) <= 2_000, key
            json.loads(a[key])  # cut, and still JSON
    first_in = json.loads(chats[0]["gen_ai.input.messages"])
    assert first_in[0]["role"] == "user" and first_in[0]["parts"][0]["type"] == "text"
    second_in = json.loads(chats[1]["gen_ai.input.messages"])
    assert second_in[-1]["role"] == "tool" and second_in[-1]["parts"][0]["type"] == "tool_call_response"
    out = json.loads(chats[0]["gen_ai.output.messages"])
    assert out == [{"role": "assistant", "finish_reason": "tool_call", "parts": [
        {"type": "tool_call", "id": out[0]["parts"][0]["id"], "name": "Read", "arguments": {"path": "input/notes.md"}}]}]
    assert {"type": "function", "name": "Read"} in json.loads(chats[0]["gen_ai.tool.definitions"])
    for bad in (0, 99, 1.5, True, "10", float("nan")):
        with pytest.raises(UsageError, match=r"^max_chars=.*; allowed: a whole number of characters ≥ 100"):
            ws.export_otel(job, tmp_path / "new" / "x.jsonl", content=True, max_chars=bad)
    with pytest.raises(UsageError, match=r"^content='no'; allowed: True .* or False"):
        ws.export_otel(job, tmp_path / "new" / "x.jsonl", content="no")  # a string is no switch
    assert not (tmp_path / "new").exists()  # refused before anything was made


def test_one_huge_answer_is_cut_to_max_chars_too_and_its_messages_stay_json(ws: Workspace, tmp_path: Path) -> None:
    big = "é" * 20_000
    spec = write_script(tmp_path, "writer", {"work": [call("Write", path="output/big.md", content=big),
                                                      transition("COMPLETE", summary="written")]})
    job = ws.run(ws.submit("Write it", piece="single", model=spec))
    assert job.status == "succeeded", job.error
    for limit in (100, 300, 1_000, 16_000):
        spans = spans_of(read_traces(ws.export_otel(job, tmp_path / f"{limit}.jsonl", content=True,
                                                    max_chars=limit))[0])
        values = [(k, v) for s in spans for k, v in attrs(s.attributes).items() if k in CONTENT_ATTRS]
        assert values and all(len(v) <= limit for _, v in values), limit
        for key, value in values:
            if key.endswith("messages"):
                json.loads(value)
        (first, _) = [attrs(s.attributes) for s in spans if s.name.startswith("chat")]
        (part,) = json.loads(first["gen_ai.output.messages"])[0]["parts"]
        if limit == 100:  # too short even for the call's id and name: the message says how long it was
            assert part["type"] == "text" and re.fullmatch(r"\[\d+ characters cut\]", part["content"])
            continue
        # arguments too long to show whole are their JSON text, cut
        assert part["type"] == "tool_call" and isinstance(part["arguments"], str)
        assert part["arguments"].startswith('{"path": "output/big.md", "content": "éé')
        assert part["arguments"].endswith("characters cut]")
        (write,) = [attrs(s.attributes) for s in spans if s.name == "execute_tool Write"]
        assert len(write["gen_ai.tool.call.arguments"]) == limit


def test_an_export_never_replaces_the_store_a_database_a_folder_or_a_device(ws: Workspace, tmp_path: Path) -> None:
    import os

    job = ws.run(ws.submit("Go", piece="single", model=answering_model(tmp_path, "m", "x")))
    store = Path(str(ws.store.path))
    other_db = tmp_path / "other.db"
    import sqlite3

    sqlite3.connect(other_db).execute("CREATE TABLE t (x)").connection.commit()
    (tmp_path / "a-file").write_text("keep me")
    os.mkfifo(tmp_path / "fifo")
    cases = {str(store): "is the store itself", f"{store}-wal": "is the store itself",
             str(other_db): "is an SQLite database", str(tmp_path): "is a folder",
             f"{tmp_path / 'a-file'}/": "ends with a slash but is no folder",
             str(tmp_path / "fifo"): "is not a regular file", " ": "the file to write is empty"}
    for target, why in cases.items():
        with pytest.raises(UsageError, match=why):
            ws.export_otel(job, target)
        assert main(["otel", "export", str(job.id), "--out", target, "--workspace", str(ws.root)]) == 2
    assert ws.job(job.id).status == "succeeded" and (tmp_path / "a-file").read_text() == "keep me"
    assert sqlite3.connect(other_db).execute("SELECT count(*) FROM t").fetchone() == (0,)
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "a-file")
    ws.export_otel(job, link)  # a link: the file it points to is written, the link kept
    assert link.is_symlink() and read_traces(tmp_path / "a-file")


def test_a_malformed_collector_url_or_headers_variable_is_one_line(
        ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    job = ws.run(ws.submit("Go", piece="single", model=answering_model(tmp_path, "m", "x")))
    folder = ["--workspace", str(ws.root)]
    for url in ("http://", "http://:4318", "http://127.0.0.1 :4318", "http://127.0.0.1:99999", "http://[::1"):
        assert main(["otel", "send", str(job.id), "--endpoint", url, *folder]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "must be an http:// or https:// URL with a host" in err, err
        with pytest.raises(UsageError, match="must be an http:// or https:// URL with a host"):
            Workspace(tmp_path / "live", otel=url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "garbage")
    assert main(["otel", "send", str(job.id), "--endpoint", "http://127.0.0.1:9", *folder]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "OTEL_EXPORTER_OTLP_HEADERS: 'garbage' is not a header; allowed: key=value" in err
    with pytest.raises(UsageError, match="OTEL_EXPORTER_OTLP_HEADERS: 'garbage' is not a header"):
        Workspace(tmp_path / "live", otel="http://127.0.0.1:9")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_HEADERS")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    with Workspace(tmp_path / "one", otel=1) as on, Workspace(tmp_path / "zero", otel=0) as off:  # as 1/True, 0/False
        assert on.otel is not None and on.otel.url == "http://127.0.0.1:9/v1/traces" and off.otel is None
    monkeypatch.setenv("AGENTNB_OTEL_CONTENT", "garbage")  # checked with no live export asked for, too
    with pytest.raises(UsageError, match="AGENTNB_OTEL_CONTENT='garbage'; allowed"):
        Workspace(tmp_path / "content")
    with pytest.raises(StoreError, match="job must be a Job or a job id, not True"):
        ws.export_otel(True, tmp_path / "t.jsonl")


def test_a_100_job_batch_is_one_file_of_valid_otlp_json(ws: Workspace, tmp_path: Path) -> None:
    cases = [{"instruction": f"Answer {i}"} for i in range(100)]
    batch = ws.batch(cases, piece="single", model=answering_model(tmp_path, "m", "x"), name="hundred",
                     concurrency=4, progress=False)
    path = ws.export_otel("hundred", tmp_path / "batch.jsonl")
    assert path.read_bytes() == ws.export_otel(batch, tmp_path / "again.jsonl").read_bytes()
    text = lines(path)
    assert len(text) == 100
    seen_cases = set()
    for line in text:
        data = json_format.Parse(line, TracesData())  # opentelemetry-proto's own JSON format takes every line
        raw = json.loads(line)
        span = raw["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        assert re.fullmatch(r"[0-9a-f]{32}", span["traceId"]) and re.fullmatch(r"[0-9a-f]{16}", span["spanId"])
        assert isinstance(span["kind"], int)
        resource = attrs(data.resource_spans[0].resource.attributes)
        assert resource["agentnb.batch"] == "hundred" and resource["agentnb.variant"] == 0
        assert resource["agentnb.epoch"] == 1
        seen_cases.add(resource["agentnb.case"])
        assert [s.name for s in spans_of(data)][:2] == ["invoke_workflow single", "invoke_agent work"]
    assert seen_cases == set(range(100))
    traces = read_traces(path)
    assert spans_of(traces[0])[0].trace_id.hex() == json.loads(text[0])["resourceSpans"][0]["scopeSpans"][0][
        "spans"][0]["traceId"]


# -- the command, and sending --------------------------------------------------------------------------------------
@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def test_otel_export_and_send_commands(ws: Workspace, tmp_path: Path, receiver: Receiver,
                                       monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    job = rich_job(ws, tmp_path)
    other = ws.run(ws.submit("Go", piece="single", model=answering_model(tmp_path, "m", "x")))
    folder = ["--workspace", str(ws.root)]
    out = tmp_path / "cli.jsonl"
    assert main(["otel", "export", str(job.id), str(other.id), "--out", str(out), *folder]) == 0
    assert capsys.readouterr().out.strip() == str(out.resolve())
    exported = read_traces(out)
    assert len(exported) == 2

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-team-key=abc123")
    assert main(["otel", "send", str(job.id), str(other.id), *folder]) == 0
    spans = sum(len(spans_of(d)) for d in exported)
    assert capsys.readouterr().out.strip() == f"{spans} spans sent"
    assert receiver.got is not None and len(receiver.got) == 2
    for (path, headers, request), data in zip(receiver.got, exported, strict=True):
        assert path == "/v1/traces" and headers["x-team-key"] == "abc123"
        assert headers["content-type"] == "application/x-protobuf"
        assert list(request.resource_spans) == list(data.resource_spans)  # the same spans as the file, ids and all

    receiver.status = 400  # a collector that refuses them: one line, exit 2
    assert main(["otel", "send", str(job.id), "--endpoint", receiver.url, *folder]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did not take the spans" in err

    assert main(["otel", "export", "--out", str(out), *folder]) == 2
    assert "name jobs (JOB …) or a batch (--batch NAME)" in capsys.readouterr().err
    assert main(["otel", "export", "--batch", "nope", "--out", str(out), *folder]) == 2
    assert "no batch 'nope'" in capsys.readouterr().err
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    assert main(["otel", "send", str(job.id), *folder]) == 2
    assert "give --endpoint URL" in capsys.readouterr().err


def test_otel_send_reads_the_signal_specific_variables_first(
        ws: Workspace, tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    job = ws.run(ws.submit("Go", piece="single", model=answering_model(tmp_path, "m", "x")))
    folder = ["--workspace", str(ws.root)]
    general = Receiver()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", general.url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-general=1")
        # the traces URL is used as it is, no /v1/traces added (the OTLP exporter specification)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url + "/ingest/otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-team-key=traces-only")
        assert main(["otel", "send", str(job.id), *folder]) == 0
        assert capsys.readouterr().out.endswith(" spans sent\n")
        ((path, headers, _),) = receiver.got
        assert path == "/ingest/otlp" and headers["x-team-key"] == "traces-only" and "x-general" not in headers
        # --endpoint is a base URL and wins over both
        assert main(["otel", "send", str(job.id), "--endpoint", receiver.url, *folder]) == 0
        assert [p for p, _, _ in receiver.got] == ["/ingest/otlp", "/v1/traces"]
        assert general.got == []
        # without the traces variables, the general ones: the endpoint as a base, its headers
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS")
        assert main(["otel", "send", str(job.id), *folder]) == 0
        ((path, headers, _),) = general.got
        assert path == "/v1/traces" and headers["x-general"] == "1"
        capsys.readouterr()
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "127.0.0.1:4318/v1/traces")
        assert main(["otel", "send", str(job.id), *folder]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT '127.0.0.1:4318/v1/traces' must be an http:// or https://" in err
    finally:
        general.close()


def test_without_the_extra_the_export_says_what_to_install(tmp_path: Path) -> None:
    # a Python where the opentelemetry packages cannot be imported (as without the extra)
    code = ("import sys; sys.modules['opentelemetry'] = None\n"
            "from agentnb.cli import main\n"
            f"sys.exit(main(['--workspace', {str(tmp_path / 'ws')!r}, 'otel', 'export', '1', '--out', 'x.jsonl']))")
    with Workspace(tmp_path / "ws") as w:
        w.run(w.submit("Go", piece="single", model=answering_model(tmp_path, "m", "x")))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    assert done.stderr == "agentnb: error: OpenTelemetry export needs the otel extra: pip install 'agentnb[otel]'\n"


@pytest.mark.needs("bwrap")  # the MCP server runs in the jail
def test_a_fork_and_an_mcp_tool(ws: Workspace, tmp_path: Path) -> None:
    # a fork's resource names its origin, its re-served run and calls say so; an MCP server's tool is `mcp`
    time_server = shutil.which("mcp-server-time") or str(Path(sys.executable).parent / "mcp-server-time")
    piece = write_piece(tmp_path, "clock", {
        "mcp_servers": {"time": {"command": time_server, "args": ["--local-timezone", "UTC"],
                                 "permission": "readonly", "trust_annotations": True}},
        "movements": [
            {"name": "ask", "instruction": "What time is it in Tokyo?", "tools": ["time.*"], "rules": [{"next": "tell"}]},
            {"name": "tell", "instruction": "Tell it.", "rules": [{"next": "COMPLETE"}]}],
    })
    spec = write_script(tmp_path, "clock-script", {
        "ask": [call("get_current_time", timezone="Asia/Tokyo"), transition("tell", summary="asked")],
        "tell": [transition("COMPLETE", summary="told")]})
    job = ws.run(ws.submit("Time?", piece=str(piece), model=spec))
    assert job.status == "succeeded", job.error
    fork = ws.fork(job, at=2)
    assert fork.status == "succeeded", fork.error
    (data,) = read_traces(ws.export_otel(fork, tmp_path / "fork.jsonl"))
    assert attrs(data.resource_spans[0].resource.attributes) == {
        "service.name": "agentnb", "agentnb.forked_from": job.id, "agentnb.forked_at": 2}
    spans = {s.name: attrs(s.attributes) for s in spans_of(data)}
    tool = spans["execute_tool get_current_time"]
    assert (tool["gen_ai.tool.type"], tool["agentnb.mcp.server"]) == ("mcp", "time")
    assert spans["invoke_agent ask"]["agentnb.replayed_from"] == job.id
    assert "agentnb.replayed_from" not in spans["invoke_agent tell"]
    (original,) = read_traces(ws.export_otel(job, tmp_path / "job.jsonl"))
    assert spans_of(original)[0].trace_id != spans_of(data)[0].trace_id


def test_an_openai_call_has_its_provider_model_cost_latency_and_time_to_first_chunk(
        ws: Workspace, tmp_path: Path, loopback: Callable[..., OpenAIServer]) -> None:
    server = loopback("sk-otel-test-key-0000", timeout="5", retries="0")
    server.actions = [reply("Looking.", [("Glob", {"pattern": "*"})], usage=(1_200, 30), cached=1_024),
                      reply(None, [("transition", {"next_step": "COMPLETE", "summary": "done"})], usage=(1_500, 20))]
    job = ws.run(ws.submit("look around", piece="single", model="openai:gpt-4o-mini"))
    assert job.status == "succeeded", job.error
    (data,) = read_traces(ws.export_otel(job, tmp_path / "t.jsonl"))
    chats = [(s.name, attrs(s.attributes)) for s in spans_of(data) if s.name.startswith("chat")]
    responses = ws.events(job, kinds=["llm_response"])
    assert [name for name, _ in chats] == ["chat gpt-4o-mini"] * 2
    for (_, a), resp in zip(chats, responses, strict=True):
        assert isinstance(resp, LLMResponse) and resp.ttft_s is not None  # streamed
        assert (a["gen_ai.provider.name"], a["gen_ai.request.model"]) == ("openai", "gpt-4o-mini")
        assert a["agentnb.cost_usd"] == call_cost(job.model, resp.usage.prompt_tokens, resp.usage.completion_tokens,
                                                  resp.ts) > 0
        assert (a["agentnb.latency_s"], a["gen_ai.response.time_to_first_chunk"]) == (resp.latency_s, resp.ttft_s)
        # what the endpoint said of its answer, recorded on the llm_response
        assert (a["gen_ai.response.model"], a["gen_ai.response.finish_reasons"]) == ("gpt-4o-mini", ["tool_call"])
        assert a["gen_ai.response.id"] == resp.response_id and resp.response_id.startswith("chatcmpl-")
    assert [a.get("gen_ai.usage.cache_read.input_tokens") for _, a in chats] == [1_024, None]
    assert [r.cached_tokens for r in responses] == [1_024, None]


def test_an_llm_judge_s_calls_are_chat_spans_under_the_job_named_by_the_judge_s_model(
        ws: Workspace, tmp_path: Path) -> None:
    from agentnb.scorers import llm_judge

    verdict = {"tool_calls": [{"name": "verdict", "arguments": {"score": 4, "reason": "close"}}],
               "usage": {"prompt_tokens": 300, "completion_tokens": 25}}
    judge = llm_judge("Is the answer 41?", model=write_script(tmp_path, "judge", responses=[verdict]))
    job = ws.run(ws.submit("Answer", piece="single", model=answering_model(tmp_path, "m", "41")))
    ws.score(job, {"quality": judge})
    (data,) = read_traces(ws.export_otel(job, tmp_path / "t.jsonl", content=True))
    spans = spans_of(data)
    root = next(s for s in spans if s.name.startswith("invoke_workflow"))
    judged = [s for s in spans if attrs(s.attributes).get("agentnb.purpose") == "judge"]
    assert len(judged) == 1
    (span,) = judged
    a = attrs(span.attributes)
    assert span.name == "chat scripted" and span.parent_span_id == root.span_id and span.kind == Span.SPAN_KIND_CLIENT
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"], a["agentnb.cost_usd"]) == (300, 25, 0.0)
    assert "close" in a["gen_ai.output.messages"] and "gen_ai.input.messages" not in a  # its prompt is not stored
    (response,) = [e for e in ws.events(job, kinds=["llm_response"]) if e.purpose == "judge"]
    assert span.end_time_unix_nano == round(response.ts * 1e9)
    # the job's own calls stay under their run, and the score is an event of the job's span
    assert all(s.parent_span_id != root.span_id for s in spans if s.name.startswith("chat") and s is not span)
    assert "gen_ai.evaluation.result" in [e.name for e in root.events]
