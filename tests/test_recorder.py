"""The Recorder: the engine's typed events, checked where they are made and kept as they were made."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agentnb import Workspace
from agentnb.engine.loop import Recorder
from agentnb.events import ErrorEvent, LLMResponse, RecordedToolCall, ToolResult, Usage


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
