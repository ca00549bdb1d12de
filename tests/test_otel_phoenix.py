"""OpenTelemetry export read in a real viewer (docs/otel.md#proven-in-a-real-viewer): Arize Phoenix started as a
local server on loopback, sent a fork of a three-movement job with a subtask, tool errors and a compaction, and
read back through Phoenix's own client; its spans are compared with the job's events.  The file export, posted
line by line to a second Phoenix, gives the same spans.  A job that waits for a human, exported live, is shown
whole once it ends, and a span id Phoenix already has is not taken again (docs/otel.md#a-job-that-waits).

Phoenix is large and pins its own packages, so it lives in a venv of its own: ``AGENTNB_TEST_PHOENIX`` names that
venv's python (``pip install -c tests/phoenix-constraints.txt arize-phoenix``; .ci/run makes it).  Without it the
test is skipped with one line (failed under CI).  The test runs that python as the server and as Phoenix's client.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, transition, write_script
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from test_otel import rich_job, spans_of
from test_otel_live import asking, two_movements

from agentnb import Workspace
from agentnb.cli import main
from agentnb.events import LLMRequest, LLMResponse, MovementStart, ToolCallEvent, ToolResult
from agentnb.views.otel import read_traces

pytestmark = pytest.mark.needs("phoenix")

READY_S = 180.0  # Phoenix's first start migrates its database: ~25 s on an idle 2-core machine
INGEST_S = 60.0
# Phoenix's own client, in Phoenix's venv: every span of a project as JSON (Phoenix's REST v1 shape)
READER = """
import json, sys
from phoenix.client import Client
spans = Client(base_url=sys.argv[1]).spans.get_spans(project_identifier=sys.argv[2], limit=10_000)
print(json.dumps(spans, default=str))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Phoenix:
    """A Phoenix server on loopback: its own working folder (its SQLite database), free ports, no telemetry and
    nothing fetched from outside."""

    def __init__(self, python: str, folder: Path) -> None:
        self.python = python
        folder.mkdir(parents=True)
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PHOENIX_", "OTEL_"))}
        env.update(PHOENIX_HOST="127.0.0.1", PHOENIX_PORT=str(port), PHOENIX_GRPC_PORT=str(_free_port()),
                   PHOENIX_WORKING_DIR=str(folder), PHOENIX_TELEMETRY_ENABLED="false",
                   PHOENIX_ALLOW_EXTERNAL_RESOURCES="false", PHOENIX_AGENTS_DISABLE_WEB_ACCESS="true")
        self.log = folder / "server.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen([python, "-m", "phoenix.server.main", "serve"], env=env, cwd=folder,
                                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"Phoenix exited ({self.process.returncode}):\n{self._tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise AssertionError(f"Phoenix did not answer /healthz in {READY_S:.0f} s:\n{self._tail()}")

    def spans(self, project: str = "default") -> list[dict[str, Any]]:
        """Every span of ``project``, read through Phoenix's own client."""
        done = subprocess.run([self.python, "-c", READER, self.url, project], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        found: list[dict[str, Any]] = json.loads(done.stdout)
        return found

    def spans_once_in(self, count: int) -> list[dict[str, Any]]:
        """The project's spans once Phoenix has stored ``count`` of them (it takes spans in and writes them to
        its database in the background)."""
        deadline = time.monotonic() + INGEST_S
        while True:
            got = self.spans()
            if len(got) >= count or time.monotonic() > deadline:
                return got
            time.sleep(0.5)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)

    def _tail(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-3000:]


@pytest.fixture
def phoenixes(tmp_path: Path) -> Iterator[tuple[Phoenix, Phoenix]]:
    """Two Phoenix servers, started together (each takes ~25 s): one sent to, one loaded from the file."""
    python = os.environ["AGENTNB_TEST_PHOENIX"]
    started: list[Phoenix] = []
    try:
        started = [Phoenix(python, tmp_path / "phoenix-sent"), Phoenix(python, tmp_path / "phoenix-file")]
        yield started[0], started[1]
    finally:
        for server in started:
            server.stop()


def forked_job(ws: Workspace, tmp: Path) -> Any:
    """A fork at run 3 of tests/test_otel.py's rich job: runs 1-2 re-served (a subtask, a failing Read, a
    compaction, a question and its reply), run 3 live with a failing Read of its own."""
    job = rich_job(ws, tmp)
    # the scripted model counts a movement's calls over the job: the re-served run's five come first
    live = write_script(tmp, "fork-script", {"work": [{"content": "re-served"}] * 5 + [
        call("Read", path="absent.md"), transition("COMPLETE", summary="done again")]})
    fork = ws.fork(job, at=3, model=live)
    assert fork.status == "succeeded", fork.error
    return fork


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).astimezone(timezone.utc).timestamp()


def _same_time(iso: str, ts: float) -> bool:
    # Phoenix keeps times to the microsecond
    return abs(_ts(iso) - ts) <= 1.5e-6


def compare_with_events(ws: Workspace, fork: Any, spans: list[dict[str, Any]]) -> None:
    """Phoenix's spans against the events of the fork and its subtask: names, parents, times, tokens, errors."""
    by_id = {s["context"]["span_id"]: s for s in spans}
    assert len(by_id) == len(spans), "a span twice"
    assert len({s["context"]["trace_id"] for s in spans}) == 1, "one trace for the job and its subtask"
    jobs = [fork, *ws.children(fork)]
    assert len(jobs) == 2 and jobs[1].model.startswith("replay:")

    def parent(span: dict[str, Any]) -> dict[str, Any] | None:
        return by_id.get(span["parent_id"]) if span["parent_id"] else None

    roots = [s for s in spans if parent(s) is None]
    assert [r["name"] for r in roots] == ["invoke_workflow rich"] and roots[0]["parent_id"] is None
    root = roots[0]
    root_events = ws.events(fork)
    assert _same_time(root["start_time"], root_events[0].ts) and _same_time(root["end_time"], root_events[-1].ts)
    assert root["status_code"] == "UNSET"
    checked = {root["context"]["span_id"]}
    for job in jobs:
        events = ws.events(job)
        (workflow,) = [s for s in spans if s["name"].startswith("invoke_workflow")
                       and s["attributes"]["agentnb.job_id"] == job.id]
        runs = sorted((s for s in spans if parent(s) is workflow), key=lambda s: _ts(s["start_time"]))
        starts = [e for e in events if isinstance(e, MovementStart)]
        assert [r["name"] for r in runs] == [f"invoke_agent {e.movement}" for e in starts]
        assert all(_same_time(r["start_time"], e.ts) for r, e in zip(runs, starts, strict=True))
        run_of = {e.seq: r for e, r in zip(starts, runs, strict=True)}
        checked |= {workflow["context"]["span_id"], *(r["context"]["span_id"] for r in runs)}

        chats = sorted((s for s in spans if s["name"].startswith("chat ")
                        and s["attributes"]["gen_ai.conversation.id"] == str(job.id)), key=lambda s: _ts(s["start_time"]))
        requests = [e for e in events if isinstance(e, LLMRequest)]
        responses = [e for e in events if isinstance(e, LLMResponse)]
        assert len(chats) == len(requests) == len(responses) > 0
        for span, req, resp in zip(chats, requests, responses, strict=True):
            a = span["attributes"]
            assert _same_time(span["start_time"], req.ts) and _same_time(span["end_time"], resp.ts), span["name"]
            assert parent(span) is run_of[resp.movement_seq]
            assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
                resp.usage.prompt_tokens, resp.usage.completion_tokens)
            # Phoenix reads the GenAI conventions into its own (OpenInference) names: an LLM span with its tokens
            assert span["span_kind"] == "LLM"
            assert (a["llm.token_count.prompt"], a["llm.token_count.completion"]) == (
                resp.usage.prompt_tokens, resp.usage.completion_tokens)
            assert span["status_code"] == "UNSET"
            assert a.get("agentnb.purpose") == req.purpose
        checked |= {s["context"]["span_id"] for s in chats}

        calls = [e for e in events if isinstance(e, ToolCallEvent)]
        results = {e.call_id: e for e in events if isinstance(e, ToolResult)}
        tools = {s["attributes"]["gen_ai.tool.call.id"]: s for s in spans if s["name"].startswith("execute_tool ")
                 and parent(s) in runs}
        assert set(tools) == {c.call_id for c in calls}
        for c in calls:
            span, result = tools[c.call_id], results[c.call_id]
            assert span["name"] == f"execute_tool {c.tool}" and span["span_kind"] == "TOOL"
            assert parent(span) is run_of[c.movement_seq]
            assert _same_time(span["start_time"], c.ts) and _same_time(span["end_time"], result.ts)
            assert span["status_code"] == ("ERROR" if result.is_error else "UNSET"), (c.tool, result.is_error)
            assert (span["attributes"].get("error.type") == "tool_error") == result.is_error
        checked |= {s["context"]["span_id"] for s in tools.values()}
    assert checked == set(by_id), "spans the events do not account for"

    # what this fork has: the subtask under the run that asked for it, two failing Reads (the re-served run's and
    # the live run's), a summarising call, and the compaction as an event of its run
    (child,) = [s for s in spans if s["name"] == "invoke_workflow single"]
    assert parent(child) is not None and parent(child)["name"] == "invoke_agent split"
    assert [s["name"] for s in spans if s["status_code"] == "ERROR"] == ["execute_tool Read"] * 2
    assert sum(s["attributes"].get("agentnb.purpose") == "compaction" for s in spans) == 1
    assert [s["name"] for s in spans for e in s["events"] if e["name"] == "agentnb.compaction"] == ["invoke_agent work"]
    assert {s["name"] for s in spans if s["name"].startswith("invoke_agent")} == {
        "invoke_agent split", "invoke_agent work"}


def _view(span: dict[str, Any]) -> dict[str, Any]:
    """A span as Phoenix shows it, less Phoenix's own row id."""
    return {k: v for k, v in span.items() if k != "id"}


def test_phoenix_shows_a_forked_job_as_its_events_say(ws: Workspace, tmp_path: Path,
                                                      phoenixes: tuple[Phoenix, Phoenix],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    sent_to, loaded = phoenixes
    fork = forked_job(ws, tmp_path)  # while the servers start
    path = ws.export_otel(fork, tmp_path / "fork.jsonl")
    (data,) = read_traces(path)
    exported = spans_of(data)
    sent_to.wait_ready()
    loaded.wait_ready()

    # sent as a user does: `agentnb otel send`
    assert main(["otel", "send", str(fork.id), "--endpoint", sent_to.url, "--workspace", str(ws.root)]) == 0
    assert capsys.readouterr().out.strip() == f"{len(exported)} spans sent"
    spans = sent_to.spans_once_in(len(exported))
    assert len(spans) == len(exported)
    compare_with_events(ws, fork, spans)
    # and every span of the export, its id, parent, name and status, is one Phoenix shows
    shown = {(s["context"]["span_id"], s["parent_id"], s["name"], s["status_code"]) for s in spans}
    status = {0: "UNSET", 1: "OK", 2: "ERROR"}
    assert shown == {(s.span_id.hex(), s.parent_span_id.hex() or None, s.name, status[s.status.code])
                     for s in exported}
    assert {s["context"]["trace_id"] for s in spans} == {exported[0].trace_id.hex()}

    # Phoenix has no import of OTLP JSON files: each line's TracesData, as protobuf, is posted to /v1/traces
    for line in read_traces(path):
        body = ExportTraceServiceRequest(resource_spans=line.resource_spans).SerializeToString()
        request = urllib.request.Request(f"{loaded.url}/v1/traces", data=body, method="POST",
                                         headers={"Content-Type": "application/x-protobuf"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 200
    from_file = loaded.spans_once_in(len(exported))
    key = lambda s: s["context"]["span_id"]  # noqa: E731
    assert sorted(map(_view, from_file), key=key) == sorted(map(_view, spans), key=key)



@pytest.fixture
def phoenix(tmp_path: Path) -> Iterator[Phoenix]:
    server = Phoenix(os.environ["AGENTNB_TEST_PHOENIX"], tmp_path / "phoenix")
    try:
        yield server
    finally:
        server.stop()


def test_phoenix_shows_a_job_that_waited_for_a_human_once_it_ends_and_keeps_a_span_s_first_copy(
        tmp_path: Path, phoenix: Phoenix, capsys: pytest.CaptureFixture[str]) -> None:
    piece, spec = asking(tmp_path)
    two = two_movements(tmp_path)
    phoenix.wait_ready()
    with Workspace(tmp_path / "ws", otel=phoenix.url) as ws:  # live export, straight to Phoenix
        job = ws.run(ws.submit("Do it", piece=piece, model=spec))
        assert job.status == "waiting_human"
    waiting = phoenix.spans_once_in(5)
    # while the job waits: the run that asked, with its calls and tools, under the job span Phoenix has not got
    (run,) = [s for s in waiting if s["name"] == "invoke_agent work"]
    assert len(waiting) == 5 and run["parent_id"] is not None
    assert run["parent_id"] not in {s["context"]["span_id"] for s in waiting}
    with Workspace(tmp_path / "ws", otel=phoenix.url) as ws:  # answered, and run on by another workspace
        job = ws.run(ws.reply(job, "Markdown, please."))
        assert job.status == "succeeded"
        events = ws.events(job)
        whole = spans_of(read_traces(ws.export_otel(job, tmp_path / "job.jsonl"))[0])
    spans = phoenix.spans_once_in(len(whole))
    assert len(spans) == len(whole) == 9
    by_id = {s["context"]["span_id"]: s for s in spans}
    (root,) = [s for s in spans if s["parent_id"] is None]
    assert root["context"]["span_id"] == run["parent_id"] and root["name"] == "invoke_workflow asking-piece"
    assert root["attributes"]["agentnb.status"] == "succeeded" and root["status_code"] == "UNSET"
    assert _same_time(root["start_time"], events[0].ts) and _same_time(root["end_time"], events[-1].ts)
    assert all(s["parent_id"] in by_id for s in spans if s is not root)
    assert {(s["context"]["span_id"], s["parent_id"], s["name"]) for s in spans} == {
        (s.span_id.hex(), s.parent_span_id.hex() or None, s.name) for s in whole}

    # a span id Phoenix has is not taken again: the job scored afterwards and sent again keeps the job span it had
    # (sent after it, another job's spans show when Phoenix has taken both requests in)
    with Workspace(tmp_path / "ws") as ws:
        ws.score(job.id, {"done": lambda j: True})
        other = ws.run(ws.submit("Do it", piece=two[0], model=two[1]))
        assert other.status == "succeeded"
        rescored = spans_of(read_traces(ws.export_otel(job.id, tmp_path / "rescored.jsonl"))[0])
        assert main(["otel", "send", str(job.id), str(other.id), "--endpoint", phoenix.url,
                     "--workspace", str(ws.root)]) == 0
    sent = int(capsys.readouterr().out.split()[0])
    assert any(e.name == "gen_ai.evaluation.result" for e in rescored[0].events)
    again = phoenix.spans_once_in(len(spans) + sent - 9)
    assert len(again) == len(spans) + sent - 9
    key = lambda s: s["context"]["span_id"]  # noqa: E731
    assert sorted((_view(s) for s in again if key(s) in by_id), key=key) == sorted(map(_view, spans), key=key)
    (kept,) = [s for s in again if s["context"]["span_id"] == root["context"]["span_id"]]
    assert not any(e["name"] == "gen_ai.evaluation.result" for e in kept["events"])
    # the way to replace it there: delete the trace in Phoenix, and send the job again
    trace_id = root["context"]["trace_id"]
    request = urllib.request.Request(f"{phoenix.url}/v1/traces/{trace_id}", method="DELETE")
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 204
    assert main(["otel", "send", str(job.id), "--endpoint", phoenix.url, "--workspace", str(tmp_path / "ws")]) == 0
    deadline = time.monotonic() + INGEST_S
    while not any(e["name"] == "gen_ai.evaluation.result" for s in phoenix.spans() if s["parent_id"] is None
                  and s["context"]["trace_id"] == trace_id for e in s["events"]):
        assert time.monotonic() < deadline, "the job span sent after the trace was deleted is not shown"
        time.sleep(0.5)
