"""The Recorder: the engine's typed events, checked where they are made and kept as they were made."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agentnb import Workspace
from agentnb.engine.loop import Recorder
from agentnb.events import CommentEvent, ErrorEvent, LLMResponse, RecordedToolCall, ToolResult, Usage, event_from_row


def _job(ws: Workspace, tmp_path: Path) -> int:
    script = tmp_path / "s.yaml"
    script.write_text("responses: []\n", encoding="utf-8")
    return ws.submit("x", piece="single", model=f"scripted:{script}").id


def test_events_are_stored_with_the_time_they_were_made_and_read_back_equal(ws: Workspace, tmp_path: Path) -> None:
    job_id = _job(ws, tmp_path)
    rec = Recorder(ws.store, job_id)
    made = time.time() - 60  # an event made a minute before it is written keeps its own time
    response = LLMResponse(job_id=job_id, movement_seq=None, iteration=None, ts=made, content="hi",
                           tool_calls=[RecordedToolCall(id="c1", name="Read", arguments={"path": "a"},
                                                        raw_arguments='{"path":"a"}')],
                           usage=Usage(prompt_tokens=5, completion_tokens=2, total_tokens=7, source="tiktoken",
                                       window=100, ratio=0.05, encoding="cl100k_base"), latency_s=0.5)
    failure = ErrorEvent(job_id=job_id, ts=made + 1, message="boom", where="engine")
    rec.add(response)
    rec.add(failure)
    assert ws.events(job_id, kinds=["llm_response", "error"]) == []  # nothing written before a flush
    rec.flush()
    assert rec.pending == []
    stored = ws.events(job_id, kinds=["llm_response", "error"])
    assert [type(e) for e in stored] == [LLMResponse, ErrorEvent]
    assert [e.ts for e in stored] == [made, made + 1]
    assert stored[0].usage == response.usage and stored[0].tool_calls == response.tool_calls
    assert stored[1].message == "boom" and stored[1].where == "engine"


def test_a_wrong_value_fails_where_the_event_is_made(ws: Workspace, tmp_path: Path) -> None:
    """The suite runs with AGENTNB_STRICT_EVENTS (conftest): the engine's own events are type-checked."""
    job_id = _job(ws, tmp_path)
    rec = Recorder(ws.store, job_id)
    with pytest.raises(TypeError, match=r"tool_result\.original_chars"):
        rec.add(ToolResult(job_id=job_id, tool="Read", call_id="c1", content="x", original_chars=None))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"source"):
        rec.add(LLMResponse(job_id=job_id, content=None, tool_calls=[],
                            usage=Usage(source="guess")))  # type: ignore[arg-type]
    assert rec.pending == []


def test_an_unknown_or_missing_key_fails_at_write_time_and_nothing_is_written(ws: Workspace, tmp_path: Path) -> None:
    """A misspelt or forgotten payload key is an error where the event is written, never dropped."""
    job_id = _job(ws, tmp_path)
    before = ws.events(job_id)
    rec = Recorder(ws.store, job_id)
    with pytest.raises(TypeError, match="orignal_chars"):  # misspelt: the event cannot even be made
        rec.add(ToolResult(job_id=job_id, tool="Read", call_id="c1", content="x", orignal_chars=3))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="call_id"):  # forgotten
        rec.add(ToolResult(job_id=job_id, tool="Read", content="x"))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"comment\.body"):  # given as None: the store refuses it too
        ws.store.append([CommentEvent(job_id=job_id, author="user", body="kept only with the rest"),
                         CommentEvent(job_id=job_id, author="user", body=None)])  # type: ignore[arg-type]
    rec.flush()
    assert ws.events(job_id) == before


def test_a_stored_payload_with_an_unknown_or_missing_key_is_not_read_silently() -> None:
    row = (7, 1, None, None, 0.0, "tool_result", '{"tool":"Read","call_id":"c1","content":"x","orignal_chars":3}')
    with pytest.raises(ValueError, match=r"tool_result event 7: unknown payload key\(s\) \['orignal_chars'\]"):
        event_from_row(row)
    with pytest.raises(TypeError, match="call_id"):
        event_from_row((8, 1, None, None, 0.0, "tool_result", '{"tool":"Read","content":"x"}'))
    assert event_from_row((9, 1, None, None, 0.0, "tool_result", '{"tool":"Read","call_id":"c1","content":"x"}')) \
        == ToolResult(id=9, job_id=1, tool="Read", call_id="c1", content="x")


def test_events_prepared_before_a_transaction_are_written_as_they_were_made(ws: Workspace, tmp_path: Path) -> None:
    job_id = _job(ws, tmp_path)
    rec = Recorder(ws.store, job_id)
    first = CommentEvent(job_id=job_id, ts=time.time(), author="user", body="made before")
    rec.add(first)
    rec.prepare()  # its row is built now, outside the transaction below
    built = ws.store.prepare([first])
    assert built == [(job_id, None, None, first.ts, "comment", built[0][5])] and '"made before"' in built[0][5]
    with ws.store.transaction() as c:
        rec.add(CommentEvent(job_id=job_id, ts=time.time(), author="user", body="made inside"))
        rec.flush(c)
    assert rec.pending == []
    assert [e.body for e in ws.events(job_id, kinds=["comment"])] == ["made before", "made inside"]

    # events dropped after they were prepared are not written: the rows go with them
    rec.add(CommentEvent(job_id=job_id, ts=time.time(), author="user", body="dropped"))
    rec.prepare()
    rec.pending.clear()
    rec.add(CommentEvent(job_id=job_id, ts=time.time(), author="user", body="kept"))
    rec.flush()
    assert [e.body for e in ws.events(job_id, kinds=["comment"])] == ["made before", "made inside", "kept"]
