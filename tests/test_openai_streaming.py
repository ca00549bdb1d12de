"""``openai:`` models stream their answers (docs/models.md#streaming): through tests/openai_server.py speaking real
server-sent ``chat.completion.chunk`` events on loopback, the stored events equal a plain call's, faults midway are
retried or refused as a plain call's are, an endpoint that does not stream is asked plainly, and a Stop cuts a
call off at once, streamed or plain, or while it waits for its headers, a retry or the rate-limit gate, and asks it
again on resume."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _scripting import write_piece
from openai_server import OpenAIServer, error, hold, midway, openai_env, raw, reply

from agentnb import Workspace
from agentnb.errors import CallCancelled, ModelError, ModelSpecError
from agentnb.events import payload_dict
from agentnb.models.base import ModelRequest
from agentnb.models.messages import Delta, UserMessage
from agentnb.models.openai import OpenAIModel, forget_refusals
from agentnb.models.openai_stream import SSEDecoder, decode_all
from agentnb.models.ratelimit import gate_for
from agentnb.store import reads
from agentnb.store.base import STOP_CUT_REASON
from agentnb.views.status import display_status

PIECE = """
name: streamed
max_movements: 4
movements:
  - name: work
    persona: You are the worker.
    instruction: Work.
    tools: [Read, Write, Glob]
    permission: edit
    max_iterations: 10
    rules:
      - {condition: done, next: COMPLETE}
"""

# text and arguments whose pieces cut inside JSON strings, \\uXXXX escapes, surrogate pairs and UTF-8 bytes
ANSWERS = [
    lambda: reply("Je lis « notes » — d'abord 😀.", [("Read", {"path": "input/notes.md"})], usage=(321, 12)),
    lambda: reply(None, [("Write", {"path": "output/é.md", "content": "ligne \"citée\" ✓ 😀\n"}),
                         ("Glob", {"pattern": "output/*"}), ("Read", {"path": "output/é.md"})], usage=(400, 40)),
    lambda: reply("Nothing left to call.", usage=None),  # no usage: counted by tiktoken, streamed or not
    lambda: reply(None, [("transition", {"next_step": "COMPLETE", "summary": "copié ✓"})], usage=(500, 9)),
]
TIMING = {"ts", "latency_s", "ttft_s"}
AGENTNB = shutil.which("agentnb")


@pytest.fixture(autouse=True)
def _pumped_when_chunked(request: pytest.FixtureRequest) -> None:
    """The ``chunked`` cases, unwatched, go through the process's stream pump (conftest's pump_from_the_first)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("chunked"):
        request.getfixturevalue("pump_from_the_first")


@pytest.fixture
def piece(tmp_path: Path) -> Path:
    return write_piece(tmp_path, "streamed", PIECE)


def _stored(ws: Workspace, job: Any) -> list[tuple[str, int | None, int | None, dict[str, Any]]]:
    """The job's events as stored, apart from timing fields (and the claimer's name and the clock in the prompt)."""
    out = []
    for e in ws.events(job):
        if e.kind == "job_status":
            continue
        data = {k: v for k, v in payload_dict(e).items()
                if k not in TIMING and not (e.kind == "movement_start" and k == "user")}
        out.append((e.kind, e.movement_seq, e.iteration, data))
    return out


def _run(ws: Workspace, piece: Path, model: str) -> Any:
    job = ws.run(ws.submit("Copy the notes", piece=piece, model=model, inputs={"notes.md": "alpha ✓\n"}))
    assert job.status == "succeeded", job.error
    return job


@pytest.mark.parametrize("cut", [{"chunk_chars": 1, "write_size": 3}, {"chunk_chars": 4, "write_size": 7}, {},
                                 {"chunk_chars": 1, "write_size": 3, "chunked": True},
                                 {"chunk_chars": 3, "write_size": 5, "chunked": True}, {"chunked": True}])
def test_a_streamed_run_stores_the_events_a_plain_run_stores(tmp_path: Path, piece: Path, cut: dict[str, Any],
                                                             loopback: Callable[..., OpenAIServer]) -> None:
    streamed_srv = loopback(**cut)
    streamed_srv.play(*(a() for a in ANSWERS))
    ws1 = Workspace(tmp_path / "streamed")
    streamed = _run(ws1, piece, "openai:m")
    assert streamed_srv.streamed == len(ANSWERS)
    assert all(r.body["stream"] is True and r.body["stream_options"] == {"include_usage": True}
               for r in streamed_srv.received)

    plain_srv = loopback()  # a fresh server: the same request numbers, so the same tool-call ids
    plain_srv.play(*(a() for a in ANSWERS))
    ws2 = Workspace(tmp_path / "plain")
    plain = _run(ws2, piece, "openai:m?stream=0")
    assert plain_srv.streamed == 0 and not any("stream" in r.body for r in plain_srv.received)

    assert _stored(ws1, streamed) == _stored(ws2, plain)
    responses = ws1.events(streamed, kinds=["llm_response"])
    assert [r.usage.source for r in responses] == ["usage", "usage", "tiktoken", "usage"]
    assert all(r.ttft_s is not None and 0 < r.ttft_s <= r.latency_s for r in responses)
    assert all(r.ttft_s is None for r in ws2.events(plain, kinds=["llm_response"]))
    # time to first token next to the latency, in frames.usage and in the job's view
    usage = ws1.frames.usage(streamed)
    assert usage["ttft_s"].notna().all() and (usage["ttft_s"] <= usage["latency_s"]).all()
    assert ws2.frames.usage(plain)["ttft_s"].isna().all()
    assert "first token" in ws1.job(streamed.id)._repr_html_()
    assert "first token" not in ws2.job(plain.id)._repr_html_()


def test_the_fragments_add_up_to_the_answer(loopback: Callable[..., OpenAIServer]) -> None:
    srv = loopback(chunk_chars=2)
    srv.play(reply("héllo 😀", [("Read", {"path": "é"}), ("Glob", {"pattern": "*.md"})]))
    deltas: list[Delta] = []
    response = OpenAIModel("m").complete(ModelRequest(messages=[UserMessage("hi")], tools=[],
                                                      on_delta=deltas.append))
    assert "".join(d.text for d in deltas) == response.content == "héllo 😀"
    for i, call in enumerate(response.tool_calls):
        mine = [d for d in deltas if d.tool_index == i]
        assert (mine[0].tool_id, mine[0].tool_name) == (call.id, call.name)  # id and name at once
        assert all(d.tool_id is None and d.tool_name is None for d in mine[1:])
        assert "".join(d.arguments for d in mine) == call.raw_arguments
    # the two calls' fragments interleaved, as parallel calls stream
    order = [d.tool_index for d in deltas if d.tool_index is not None]
    assert order[:4] == [0, 1, 0, 1]


@pytest.mark.parametrize("name_split", [0, 2])
def test_a_tool_name_that_comes_late_or_in_pieces_is_the_whole_name(loopback: Callable[..., OpenAIServer],
                                                                      name_split: int) -> None:
    # the first delta of a call holds its id and no name (or "Wr"), the next one the name (or "ite"): the call is
    # Write, as the openai SDK's accumulator makes it, and a watcher is told the name when it comes
    srv = loopback(chunk_chars=3, name_split=name_split)
    srv.play(reply(None, [("Write", {"path": "a.md", "content": "x"}), ("Read", {"path": "a.md"})]))
    deltas: list[Delta] = []
    response = OpenAIModel("m").complete(ModelRequest(messages=[UserMessage("hi")], tools=[],
                                                      on_delta=deltas.append))
    assert [c.name for c in response.tool_calls] == ["Write", "Read"]
    for i, call in enumerate(response.tool_calls):
        named = [d.tool_name for d in deltas if d.tool_index == i and d.tool_name]
        assert named[-1] == call.name and "".join(d.arguments for d in deltas if d.tool_index == i) == call.raw_arguments


def test_a_character_split_into_two_surrogate_halves_is_joined_back(loopback: Callable[..., OpenAIServer]) -> None:
    # each half a valid JSON escape on its own, as a proxy slicing UTF-16 text may send them
    chunks = ['{"choices":[{"index":0,"delta":{"role":"assistant","content":"smile \\ud83d"}}]}',
              '{"choices":[{"index":0,"delta":{"content":"\\ude00 end, lone \\udc00."}}]}',
              '{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1","type":"function",'
              '"function":{"name":"Read","arguments":"{\\"path\\": \\"\\ud83c"}}]}}]}',
              '{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\\udf89\\"}"}}]},'
              '"finish_reason":"tool_calls"}]}']
    srv = loopback()
    body = "".join(f"data: {c}\n\n" for c in chunks) + "data: [DONE]\n\n"
    srv.play(*raw(body, content_type="text/event-stream"), *raw(body, content_type="text/event-stream"))
    response = OpenAIModel("m").complete(ModelRequest(messages=[UserMessage("hi")], tools=[]))
    assert response.content == "smile 😀 end, lone \ufffd."
    assert response.tool_calls[0].arguments == {"path": "🎉"}
    # watched: the fragments a view is given are text it can send on (the first half waits for the second)
    deltas: list[Delta] = []
    watched = OpenAIModel("m").complete(ModelRequest(messages=[UserMessage("hi")], tools=[], on_delta=deltas.append))
    texts = [d.text for d in deltas if d.tool_index is None]
    assert texts == ["smile ", "😀 end, lone \ufffd."] and watched.content == response.content
    # a whole answer's lone half too: text that could not be stored
    srv.play(*raw('{"choices":[{"index":0,"message":{"role":"assistant","content":"lone \\udc00."},'
                  '"finish_reason":"stop"}]}'))
    plain = OpenAIModel("m", stream=False).complete(ModelRequest(messages=[UserMessage("hi")], tools=[]))
    assert plain.content == "lone \ufffd."


def test_a_stream_that_broke_off_tells_its_watcher_to_start_afresh(loopback: Callable[..., OpenAIServer]) -> None:
    srv = loopback(retries="2", chunk_chars=3)
    answer = reply("A whole answer, the second time.")
    srv.play(midway("reset", after=4, then=answer), answer)
    deltas: list[Delta] = []
    response = OpenAIModel("m").complete(ModelRequest(messages=[UserMessage("hi")], tools=[], on_delta=deltas.append))
    restarts = [i for i, d in enumerate(deltas) if d.restart]
    assert len(restarts) == 1 and 0 < restarts[0] < len(deltas) - 1
    assert deltas[0].text and "".join(d.text for d in deltas[restarts[0] + 1:]) == response.content


@pytest.mark.parametrize(("fault", "chunked"), [("reset", False), ("reset", True), ("error", False), ("error", True),
                                              ("framing", True)])
def test_a_reset_or_a_server_error_midway_is_retried(ws: Workspace, piece: Path, fault: str, chunked: bool,
                                                     loopback: Callable[..., OpenAIServer]) -> None:
    srv = loopback(retries="2", chunked=chunked)
    srv.play(midway(fault, after=4), *(a() for a in ANSWERS))
    job = _run(ws, piece, "openai:m")
    assert len(srv.received) == len(ANSWERS) + 1  # the first call asked twice
    assert srv.received[0].body["messages"] == srv.received[1].body["messages"]
    assert len(ws.events(job, kinds=["llm_response"])) == len(ANSWERS)
    assert not ws.events(job, kinds=["error"])


@pytest.mark.parametrize("chunked", [False, True])
def test_a_stall_between_chunks_is_retried_like_a_timeout(ws: Workspace, piece: Path, chunked: bool,
                                                          loopback: Callable[..., OpenAIServer],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTNB_OPENAI_READ_TIMEOUT", "0.4")
    srv = loopback(retries="2", chunked=chunked)
    srv.play(midway("stall", after=3, seconds=30), *(a() for a in ANSWERS))
    started = time.monotonic()
    job = _run(ws, piece, "openai:m")
    assert time.monotonic() - started < 20  # the stalled stream was given up after its read timeout
    assert len(srv.received) == len(ANSWERS) + 1
    assert not ws.events(job, kinds=["error"])


@pytest.mark.parametrize("chunked", [False, True])
def test_ttft_is_when_the_first_fragment_came_not_when_the_answer_ended(ws: Workspace, piece: Path, chunked: bool,
                                                                        loopback: Callable[..., OpenAIServer]) -> None:
    # unwatched, the events are decoded only at the answer's end: the first fragment keeps the time it arrived
    srv = loopback(chunked=chunked)
    srv.play(midway("stall", after=3, seconds=0.6), *(a() for a in ANSWERS[1:]))
    job = _run(ws, piece, "openai:m")
    first = ws.events(job, kinds=["llm_response"])[0]
    assert first.content.startswith("A long answer that streams")
    assert first.latency_s >= 0.6
    assert first.ttft_s < 0.3


def test_a_stall_on_every_try_fails_the_job_with_one_line(ws: Workspace, piece: Path,
                                                          loopback: Callable[..., OpenAIServer],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTNB_OPENAI_READ_TIMEOUT", "0.3")
    srv = loopback(retries="1")
    srv.play(midway("stall", after=2, seconds=30), midway("stall", after=2, seconds=30))
    job = ws.run(ws.submit("x", piece=piece, model="openai:m"))
    assert job.status == "failed"
    assert job.error == "openai:m: gave up after 2 tries; last error stream stalled: no chunk for 0.3 s"


@pytest.mark.parametrize("chunked", [False, True])
def test_a_malformed_chunk_is_a_model_error_in_one_line(ws: Workspace, piece: Path, chunked: bool,
                                                        loopback: Callable[..., OpenAIServer]) -> None:
    srv = loopback(chunked=chunked)
    srv.play(midway("malformed", after=3))
    job = ws.run(ws.submit("x", piece=piece, model="openai:m"))
    assert job.status == "failed"
    assert job.error.startswith("openai:m: malformed stream chunk: ") and "\n" not in job.error
    assert len(srv.received) == 1  # not retried


@pytest.mark.parametrize("how", ["400", "json"])
def test_an_endpoint_that_does_not_stream_is_asked_plainly_with_one_warning(
        tmp_path: Path, piece: Path, how: str, loopback: Callable[..., OpenAIServer],
        capfd: pytest.CaptureFixture[str]) -> None:
    srv = loopback(**({"refuses_stream": True} if how == "400" else {"streams": False}))
    srv.play(*(a() for a in ANSWERS), *(a() for a in ANSWERS))
    ws = Workspace(tmp_path / "ws")
    first, second = _run(ws, piece, "openai:m"), _run(ws, piece, "openai:m")
    warnings = [line for line in capfd.readouterr().err.splitlines() if "does not stream" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"agentnb: warning: openai:m at {srv.base_url} does not stream (")
    asked_to_stream = [bool(r.body.get("stream")) for r in srv.received]
    # once, then remembered for the process: the refused request is the only one asked to stream
    assert asked_to_stream == [True] + [False] * (len(srv.received) - 1)
    assert len(srv.received) == 2 * len(ANSWERS) + (how == "400")
    for job in (first, second):
        assert all(r.ttft_s is None for r in ws.events(job, kinds=["llm_response"]))


def test_a_server_started_where_one_refused_to_stream_is_asked_to_stream(
        loopback: Callable[..., OpenAIServer]) -> None:
    # the kernel hands a freed port out again: a server of this process on it is a new endpoint, not the one that
    # refused (remembered by URL, this once turned a later test's streamed call plain, so a Stop did not cut it)
    refusing = loopback(refuses_stream=True)
    refusing.play(reply("plain"))
    OpenAIModel("m").complete(ModelRequest(messages=[UserMessage("hi")], tools=[]))
    assert [bool(r.body.get("stream")) for r in refusing.received] == [True, False]
    refusing.__exit__(None, None, None)
    with OpenAIServer(port=int(refusing.base_url.rsplit(":", 1)[1].split("/")[0])) as again:
        assert again.base_url == refusing.base_url
        again.play(reply("streamed"))
        assert OpenAIModel("m").complete(ModelRequest(messages=[UserMessage("hi")], tools=[])).content == "streamed"
        assert again.streamed == 1


def test_a_server_started_where_one_sent_a_429_has_an_open_gate(loopback: Callable[..., OpenAIServer]) -> None:
    # the 429 gate is remembered per URL too: an earlier server's "retry after 30 s" must not hold a later one's calls
    slow = loopback()
    slow.play(*error(429, "slow down", headers={"retry-after": "30"}))
    with pytest.raises(ModelError, match="HTTP 429"):
        OpenAIModel("m", max_retries=0).complete(ModelRequest(messages=[UserMessage("hi")], tools=[]))
    closed = gate_for(slow.base_url, "m")
    slow.__exit__(None, None, None)
    with OpenAIServer(port=int(slow.base_url.rsplit(":", 1)[1].split("/")[0])) as again:
        assert gate_for(again.base_url, "m") is not closed
        again.play(reply("at once"))
        started = time.monotonic()
        assert OpenAIModel("m").complete(ModelRequest(messages=[UserMessage("hi")], tools=[])).content == "at once"
        assert time.monotonic() - started < 10


def test_forget_refusals_asks_a_refusing_endpoint_to_stream_again(loopback: Callable[..., OpenAIServer]) -> None:
    srv = loopback(refuses_stream=True)
    srv.play(reply("one"), reply("two"), reply("three"))
    for _ in range(2):
        OpenAIModel("m").complete(ModelRequest(messages=[UserMessage("hi")], tools=[]))
    forget_refusals(srv.base_url)
    OpenAIModel("m").complete(ModelRequest(messages=[UserMessage("hi")], tools=[]))
    assert [bool(r.body.get("stream")) for r in srv.received] == [True, False, False, True, False]


@pytest.mark.parametrize("switch", ["env", "workspace", "spec"])
def test_streaming_can_be_turned_off(tmp_path: Path, piece: Path, switch: str, loopback: Callable[..., OpenAIServer],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    srv = loopback()
    srv.play(*(a() for a in ANSWERS))
    if switch == "env":
        monkeypatch.setenv("AGENTNB_STREAM", "0")
    ws = Workspace(tmp_path / "ws", stream=False if switch == "workspace" else None)
    _run(ws, piece, "openai:m?stream=0" if switch == "spec" else "openai:m")
    assert srv.streamed == 0 and not any("stream" in r.body for r in srv.received)


@pytest.mark.parametrize(("variable", "value", "allowed"), [
    ("AGENTNB_STREAM", "maybe", "1 or 0"),
    ("AGENTNB_OPENAI_READ_TIMEOUT", "-5", "a number of seconds > 0"),
    ("AGENTNB_OPENAI_READ_TIMEOUT", "nan", "a number of seconds > 0"),
    ("AGENTNB_OPENAI_READ_TIMEOUT", "abc", "a number of seconds > 0"),
    ("AGENTNB_OPENAI_TIMEOUT", "0", "a number of seconds > 0"),
    ("AGENTNB_OPENAI_RETRIES", "-3", "a whole number from 0 to 100"),
    ("AGENTNB_OPENAI_RETRIES", "2.5", "a whole number from 0 to 100"),
    ("AGENTNB_OPENAI_MAX_BACKOFF", "-1", "a number of seconds ≥ 0"),
    ("AGENTNB_OPENAI_BACKOFF", "inf", "a number of seconds ≥ 0"),
])
def test_a_bad_setting_in_the_environment_is_refused_at_submit_in_one_line(
        ws: Workspace, piece: Path, loopback: Callable[..., OpenAIServer], monkeypatch: pytest.MonkeyPatch,
        variable: str, value: str, allowed: str) -> None:
    loopback()
    monkeypatch.setenv(variable, value)
    with pytest.raises(ModelSpecError) as caught:
        ws.submit("x", piece=piece, model="openai:m")
    assert str(caught.value) == f"{variable}={value!r}; allowed: {allowed}" + str(caught.value).partition(allowed)[2]
    assert "\n" not in str(caught.value) and not ws.jobs()


def test_a_spec_with_options_and_no_model_name_is_refused(ws: Workspace, piece: Path,
                                                           loopback: Callable[..., OpenAIServer]) -> None:
    loopback()
    with pytest.raises(ModelSpecError, match=r"^openai:\?stream=0: no model name before the options"):
        ws.submit("x", piece=piece, model="openai:?stream=0")
    assert not ws.jobs()


def test_a_spec_option_it_does_not_know_is_refused_in_one_line(ws: Workspace, piece: Path,
                                                               loopback: Callable[..., OpenAIServer]) -> None:
    loopback()
    with pytest.raises(ModelSpecError) as caught:
        ws.submit("x", piece=piece, model="openai:m?streem=0")
    assert str(caught.value) == "openai:m?streem=0: unknown option 'streem=0'; allowed: stream=0|1, read_timeout=SECONDS"
    with pytest.raises(ModelSpecError, match=r"^openai:m\?stream=0&stream=1: stream is given twice; give each option"):
        ws.submit("x", piece=piece, model="openai:m?stream=0&stream=1")
    assert not ws.jobs()


@pytest.mark.parametrize("chunked", [False, True])
def test_stop_mid_stream_closes_it_at_once_and_the_resume_asks_again(ws: Workspace, piece: Path, chunked: bool,
                                                                      loopback: Callable[..., OpenAIServer]) -> None:
    srv = loopback(chunked=chunked)
    srv.play(midway("hold", after=6), *(a() for a in ANSWERS))
    job = ws.submit("Copy the notes", piece=piece, model="openai:m", inputs={"notes.md": "alpha ✓\n"})
    runner = threading.Thread(target=ws.run, args=(job,))
    runner.start()
    assert srv.holding.wait(30)
    time.sleep(0.3)  # the client reads the chunks sent before the hold
    asked = time.monotonic()
    ws.stop(job)
    assert srv.disconnected.wait(5)
    assert srv.disconnects[0] - asked < 0.5  # the server saw the stream closed
    runner.join(30)
    assert not runner.is_alive()
    assert str(ws.job(job.id).status) == "queued"
    assert reads.last_status_reason(ws.store, job.id) == STOP_CUT_REASON  # not "after its current LLM call"
    assert not ws.events(job, kinds=["llm_response"])  # nothing made from the partial answer
    (cut,) = ws.events(job, kinds=["error"])
    assert cut.where == "interrupted" and "stopped mid-answer" in cut.message and "\n" not in cut.message
    assert cut.usage is not None and cut.usage.source == "estimate" and cut.usage.completion_tokens > 0
    assert "stopped mid-answer" in ws.job(job.id)._repr_html_()

    done = ws.run(job)  # resumed: the same call asked again
    assert done.status == "succeeded", done.error
    assert srv.received[1].body["messages"] == srv.received[0].body["messages"]
    assert len(ws.events(job, kinds=["llm_response"])) == len(ANSWERS)


@pytest.mark.parametrize("chunked", [False, True])
def test_ctrl_c_mid_stream_closes_it(loopback: Callable[..., OpenAIServer], chunked: bool) -> None:
    srv = loopback(chunk_chars=2, chunked=chunked)
    srv.play(midway("hold", after=8))
    seen: list[Delta] = []

    def on_delta(d: Delta) -> None:
        seen.append(d)
        if len(seen) == 3:
            raise KeyboardInterrupt  # as Ctrl-C arrives in the thread reading the stream

    with pytest.raises(KeyboardInterrupt):
        OpenAIModel("m").complete(ModelRequest(messages=[UserMessage("hi")], tools=[], on_delta=on_delta))
    assert srv.disconnected.wait(2)


@pytest.mark.parametrize(("command", "sig"), [("worker", signal.SIGTERM), ("run", signal.SIGINT)])
def test_a_one_job_worker_s_sigterm_or_run_s_ctrl_c_records_the_streamed_call_as_stopped(
        tmp_path: Path, piece: Path, command: str, sig: signal.Signals, monkeypatch: pytest.MonkeyPatch) -> None:
    # the job runs in the process's main thread, where the signal lands mid-read: the call is recorded as a
    # Stop's is (estimated tokens, the pause's reason), and the resume asks it again
    answer = reply("A long answer that streams in many small pieces, " * 4,
                   [("transition", {"next_step": "COMPLETE", "summary": "done"})])
    with OpenAIServer(chunk_chars=4) as srv:
        srv.play(midway("hold", after=6, then=answer), answer)
        env = {**os.environ, **openai_env(srv)}
        ws = [AGENTNB, "--workspace", str(tmp_path / "ws")]
        if command == "worker":
            queued = subprocess.run([*ws, "run", "--detach", "--piece", str(piece), "--model", "openai:m", "task"],
                                    env=env, capture_output=True, text=True)
            assert queued.returncode == 0, queued.stderr
            argv = [*ws, "worker"]
        else:
            argv = [*ws, "run", "--no-follow", "--piece", str(piece), "--model", "openai:m", "task"]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert srv.holding.wait(30)  # six pieces sent, then nothing
        time.sleep(0.3)  # (read by the job)
        proc.send_signal(sig)
        assert proc.wait(30) == (143 if sig == signal.SIGTERM else 130), proc.communicate()
        assert srv.disconnected.wait(5)
        with Workspace(tmp_path / "ws") as w:
            (stopped,) = w.events(1, kinds=["error"])
            assert stopped.where == "interrupted" and "stopped mid-answer after ~" in stopped.message
            assert stopped.usage is not None and stopped.usage.source == "estimate" and stopped.usage.completion_tokens > 0
            assert (w.job(1).status, w.events(1, kinds=["job_status"])[-1].reason) == ("queued", STOP_CUT_REASON)
            for name, value in openai_env(srv).items():
                monkeypatch.setenv(name, value)
            assert w.run(1).status == "succeeded" and len(srv.received) == 2  # asked again


@pytest.mark.parametrize("chunked", [False, True])  # chunked, kept alive and unwatched: read by the stream pump
def test_a_stop_set_while_streaming_raises_call_cancelled_with_the_partial_answer(
        loopback: Callable[..., OpenAIServer], chunked: bool) -> None:
    srv = loopback(chunk_chars=3, chunked=chunked)
    srv.play(midway("hold", after=5))
    cancel = threading.Event()
    threading.Thread(target=lambda: srv.holding.wait(30) and (time.sleep(0.3), cancel.set())).start()
    with pytest.raises(CallCancelled) as caught:
        OpenAIModel("m").complete(ModelRequest(messages=[UserMessage("hi")], tools=[], cancel=cancel))
    assert caught.value.partial_text and "A long answer".startswith(caught.value.partial_text)
    assert srv.disconnected.wait(2)


def _stop_and_resume(ws: Workspace, piece: Path, srv: OpenAIServer, stopping: Callable[[], bool],
                     model: str = "openai:m") -> float:
    """Run a job, Stop it once ``stopping()`` says its call is where the test wants it, and check that the run
    ended at once, the job paused with its call recorded as stopped, and the resume asked the same call again."""
    before = len(srv.received)  # requests other calls made
    job = ws.submit("Copy the notes", piece=piece, model=model, inputs={"notes.md": "alpha ✓\n"})
    runner = threading.Thread(target=ws.run, args=(job,))
    runner.start()
    deadline = time.monotonic() + 30
    while not stopping() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # well inside the wait
    asked = time.monotonic()
    ws.stop(job)
    runner.join(30)
    ended = time.monotonic() - asked
    assert not runner.is_alive()
    assert ended < 0.5, f"the run took {ended:.2f} s to end after the Stop"
    assert display_status(ws.job(job.id).status, reads.last_status_reason(ws.store, job.id)) == "paused"
    assert not ws.events(job, kinds=["llm_response"])
    assert reads.last_status_reason(ws.store, job.id) == STOP_CUT_REASON
    (cut,) = ws.events(job, kinds=["error"])
    assert cut.where == "interrupted" and "\n" not in cut.message
    assert cut.message == "call 1 of run 1 (work) was stopped before its answer began; it is asked again when the job resumes"
    view = ws.job(job.id)._repr_html_()
    assert "⏸ stopped — " in view and "stopped before its answer began" in view
    done = ws.run(job)  # resumed: the same call asked again
    assert done.status == "succeeded", done.error
    assert srv.received[-len(ANSWERS)].body["messages"] == srv.received[before].body["messages"]
    assert len(ws.events(job, kinds=["llm_response"])) == len(ANSWERS)
    return asked


@pytest.mark.parametrize("write_size", [None, 2])
def test_a_chunked_stream_keeps_its_connection_for_the_next_call(loopback: Callable[..., OpenAIServer],
                                                                write_size: int | None) -> None:
    srv = loopback(chunked=True, chunk_chars=3, write_size=write_size)
    srv.play(*(a() for a in ANSWERS))
    model = OpenAIModel("m")
    got = [model.complete(ModelRequest(messages=[UserMessage("hi")], tools=[])) for _ in ANSWERS]
    assert srv.streamed == len(ANSWERS)
    assert srv.connections == 1  # each stream read to its end: the next call went on the same connection
    assert got[0].content == "Je lis « notes » — d'abord 😀."
    assert got[1].tool_calls[0].arguments == {"path": "output/é.md", "content": "ligne \"citée\" ✓ 😀\n"}


def test_stop_while_waiting_for_the_headers_cuts_the_call_off_at_once(ws: Workspace, piece: Path,
                                                                      loopback: Callable[..., OpenAIServer]) -> None:
    srv = loopback()
    srv.play(hold(), *(a() for a in ANSWERS))  # no headers until released: the model is "thinking"
    asked = _stop_and_resume(ws, piece, srv, srv.holding.is_set)
    assert srv.disconnected.is_set() and srv.disconnects[0] - asked < 0.5  # the server saw the connection closed
    assert len(srv.received) == 1 + len(ANSWERS)


def test_a_plain_call_whose_answer_came_is_kept_though_a_stop_follows(loopback: Callable[..., OpenAIServer]) -> None:
    srv = loopback()
    srv.play(reply("whole"), reply("again"))
    cancel = threading.Event()
    model = OpenAIModel("m?stream=0")
    assert model.complete(ModelRequest(messages=[UserMessage("hi")], tools=[], cancel=cancel)).content == "whole"
    cancel.set()  # a Stop after the answer: the call is not cut, and its connection is the next call's again
    time.sleep(0.2)  # longer than the watchdog's look
    assert model.complete(ModelRequest(messages=[UserMessage("hi")], tools=[])).content == "again"


def test_stop_while_another_calls_429_holds_the_gate_ends_the_wait_at_once(
        ws: Workspace, piece: Path, loopback: Callable[..., OpenAIServer]) -> None:
    srv = loopback()
    srv.play(*error(429, "slow down", headers={"retry-after": "3"}), *(a() for a in ANSWERS))
    with pytest.raises(ModelError, match="HTTP 429"):  # another job's call: its 429 closes the gate for 3 s
        OpenAIModel("m", max_retries=0).complete(ModelRequest(messages=[UserMessage("hi")], tools=[]))
    gate = gate_for(srv.base_url, "m")
    _stop_and_resume(ws, piece, srv, lambda: gate.waiting > 0)  # this job's first call waits in the gate
    assert len(srv.received) == 1 + len(ANSWERS)  # the stopped call was never sent; the resume sent it


def test_stop_during_the_wait_before_a_retry_ends_it_at_once(ws: Workspace, piece: Path,
                                                              loopback: Callable[..., OpenAIServer]) -> None:
    srv = loopback()
    srv.play(*error(503, "busy", headers={"Retry-After": "30"}), *(a() for a in ANSWERS))  # a 30 s wait
    _stop_and_resume(ws, piece, srv, lambda: len(srv.received) == 1)
    assert len(srv.received) == 1 + len(ANSWERS)


def _events_in(chunks: list[bytes]) -> list[bytes]:
    """The data of each event in ``chunks``, fed to one decoder as they would arrive, then its end."""
    decoder = SSEDecoder()
    return [d for chunk in chunks for d in decoder.feed(chunk)] + decoder.end()


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_server_sent_events_are_read_however_the_bytes_are_cut(end: bytes) -> None:
    stream = end.join([b": a comment", b"event: message", b'data: {"a": "\xc3\xa9"}', b"", b"data:first", b"data",
                       b"data:  two spaces", b"id: 7", b"", b"event: no data", b"", b"data: [DONE]", b"", b""])
    want = [b'{"a": "\xc3\xa9"}', b"first\n\n two spaces", b"[DONE]"]
    assert list(_events_in([stream])) == want
    for cut in range(1, len(stream)):  # one cut anywhere: inside a line, a UTF-8 character or a CRLF
        assert list(_events_in([stream[:cut], stream[cut:]])) == want, cut
    assert list(_events_in([bytes([b]) for b in stream])) == want  # a byte at a time
    assert list(_events_in([stream[:-len(end) * 2] + end])) == want[:2]  # an event the stream did not end is dropped


@pytest.mark.parametrize(("data", "want"), [
    ([b'{"a": 1}', b' [2, "\xc3\xa9"] ', b"null"], [{"a": 1}, [2, "é"], None]),
    ([], []),
    ([b'{"a": 1}', b"1, 2", b"{}"], None),  # two values in one event, even if their count would match below
    ([b"1, 2", b""], None),
    ([b'{"a": 1', b"}"], None),  # one value across two events
    ([b'{"a": 1}', b"not json"], None),
    ([b"\xff"], None),
])
def test_the_events_of_an_unwatched_answer_are_decoded_in_one_parse_or_not_at_all(data: list[bytes],
                                                                                  want: list[Any] | None) -> None:
    # None sends the caller to decode them one by one, which names the malformed one as a parse per event did
    assert decode_all(data) == want
