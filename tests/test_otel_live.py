"""Live OpenTelemetry export (docs/otel.md#live): a workspace with ``otel=`` sends each movement run's spans to a
collector as the run ends, from a background thread; a dead, slow or refusing collector never holds a job up."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _descriptors import open_targets
from _scripting import call, transition, write_piece, write_script
from otlp_receiver import Receiver
from test_otel import CONTENT_ATTRS, SECRET, attrs, rich_job, spans_of

from agentnb import Workspace
from agentnb.errors import UsageError
from agentnb.views.otel import read_traces
from agentnb.views.render import job_html


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _key(span: Any) -> tuple[bytes, bytes, bytes, str, int, int]:
    return (span.trace_id, span.span_id, span.parent_span_id, span.name, span.start_time_unix_nano,
            span.end_time_unix_nano)


def file_spans(ws: Workspace, job: Any, tmp: Path) -> set[tuple[bytes, bytes, bytes, str, int, int]]:
    path = ws.export_otel(job, tmp / f"job{job.id}.jsonl")
    return {_key(s) for data in read_traces(path) for s in spans_of(data)}


def two_movements(tmp: Path) -> tuple[str, str]:
    spec = write_script(tmp, "two", {"plan": [call("Glob", pattern="*"), transition("work")],
                                     "work": [call("Glob", pattern="*"), transition("COMPLETE")]})
    piece = write_piece(tmp, "two-piece", {"movements": [
        {"name": "plan", "instruction": "Plan.", "tools": ["Glob"], "default_next": "work",
         "rules": [{"next": "work"}]},
        {"name": "work", "instruction": "Work.", "tools": ["Glob"], "default_next": "COMPLETE",
         "rules": [{"next": "COMPLETE"}]}]})
    return str(piece), spec


def _wait(until: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not until():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_each_run_s_spans_reach_the_collector_as_it_ends_with_the_ids_of_a_file_export(
        tmp_path: Path, receiver: Receiver) -> None:
    piece, spec = two_movements(tmp_path)
    with Workspace(tmp_path / "ws", otel=receiver.url) as ws:
        job = ws.step(ws.submit("Do it", piece=piece, model=spec), "movement")
        assert job.status == "queued"
        # the first run's spans arrive while the job is still paused after it: its run, its calls, its tool
        _wait(lambda: any(s.name == "invoke_agent plan" for s in receiver.spans()))
        names = sorted(s.name for s in receiver.spans())
        assert names == ["chat scripted", "chat scripted", "execute_tool Glob", "execute_tool transition",
                         "invoke_agent plan"]
        job = ws.run(job)
        assert job.status == "succeeded"
    assert {p for p, _, _ in receiver.got} == {"/v1/traces"}
    got = [_key(s) for s in receiver.spans()]
    assert len(got) == len(set(got)), "a span sent twice"
    # the same trace, span ids, parents, names and recorded times as a file export of the finished job
    with Workspace(tmp_path / "ws") as ws:
        assert set(got) == file_spans(ws, job, tmp_path)
        assert ws.otel_dropped == 0


def test_a_paused_and_resumed_job_with_subtasks_joins_one_trace(tmp_path: Path, receiver: Receiver) -> None:
    with Workspace(tmp_path / "ws", otel=receiver.url) as ws:
        job = rich_job(ws, tmp_path)  # waits for a human, is answered, runs on; a subtask in between
    with Workspace(tmp_path / "ws") as ws:
        expected = file_spans(ws, job, tmp_path)
        whole = file_export(ws, job, tmp_path)
    assert_one_trace_each_span_once(receiver.spans())
    # each span but the job's is sent whole and final (the job's own gains the score added after it ended)
    assert {s.span_id: s for s in receiver.spans() if s.parent_span_id} == {
        i: s for i, s in whole.items() if s.parent_span_id}
    got = {_key(s) for s in receiver.spans()}
    # rich_job scores the job after it ended: the job span of a later file export ends at that score, the rest
    # is the same
    root = next(k for k in got if k[3] == "invoke_workflow rich")
    later = next(k for k in expected if k[3] == "invoke_workflow rich")
    assert root[:5] == later[:5] and root[5] <= later[5]
    assert got - {root} == expected - {later}
    assert len(got) > 10


def file_export(ws: Workspace, job: Any, tmp: Path, *, content: bool = False) -> dict[bytes, Any]:
    """The spans of a file export of ``job``'s trace, whole (attributes, events, status), by span id."""
    path = ws.export_otel(job, tmp / f"whole{job.id}-{content}.jsonl", content=content)
    return {s.span_id: s for data in read_traces(path) for s in spans_of(data)}


def assert_one_trace_each_span_once(got: list[Any]) -> None:
    """One trace, no span id twice (a viewer such as Phoenix keeps the first copy it gets), one root, and every
    parent among the spans sent."""
    assert len({s.trace_id for s in got}) == 1
    ids = [s.span_id for s in got]
    assert len(ids) == len(set(ids)), "a span sent twice"
    assert len([s for s in got if not s.parent_span_id]) == 1
    assert {s.parent_span_id for s in got if s.parent_span_id} <= set(ids)


def asking(tmp: Path) -> tuple[str, str]:
    spec = write_script(tmp, "asking", {"work": [call("Glob", pattern="*"),
                                                 transition("ASK", summary="unclear", question="Which format?"),
                                                 transition("COMPLETE", summary="done")]})
    piece = write_piece(tmp, "asking-piece", {"movements": [
        {"name": "work", "instruction": "Work.", "tools": ["Glob"], "default_next": "COMPLETE",
         "rules": [{"next": "COMPLETE"}, {"next": "ASK"}]}]})
    return str(piece), spec


def test_a_job_waiting_for_a_human_has_its_runs_sent_and_its_own_span_once_when_it_ends(
        tmp_path: Path, receiver: Receiver) -> None:
    piece, spec = asking(tmp_path)
    with Workspace(tmp_path / "ws", otel=receiver.url) as ws:
        job = ws.run(ws.submit("Do it", piece=piece, model=spec))
        assert job.status == "waiting_human"
    # the job waits, its process gone: the run that asked is there, under the job span it will have; the job's
    # own span is not sent yet (sent now it would be the one a viewer keeps, ended at the wait, forever)
    waiting = receiver.spans()
    assert sorted(s.name for s in waiting) == ["chat scripted", "chat scripted", "execute_tool Glob",
                                               "execute_tool transition", "invoke_agent work"]
    with Workspace(tmp_path / "ws") as ws:
        whole = file_export(ws, job, tmp_path)
    (root,) = [s for s in whole.values() if not s.parent_span_id]
    assert root.name == "invoke_workflow asking-piece"
    assert [s.parent_span_id for s in waiting if s.name == "invoke_agent work"] == [root.span_id]
    # another process answers and runs it to the end
    with Workspace(tmp_path / "ws", otel=receiver.url) as ws:
        job = ws.run(ws.reply(job, "Markdown, please."))
        assert job.status == "succeeded"
    got = receiver.spans()
    assert got[:len(waiting)] == waiting
    assert_one_trace_each_span_once(got)
    assert [s.name for s in got if not s.parent_span_id] == ["invoke_workflow asking-piece"]
    assert [s.name for s in got].count("invoke_agent work") == 2
    # each span is sent once, so the copy sent is the whole final span: as a file export of the ended job has it
    with Workspace(tmp_path / "ws") as ws:
        assert {s.span_id: s for s in got} == file_export(ws, job, tmp_path)
    assert attrs(next(s for s in got if not s.parent_span_id).attributes)["agentnb.status"] == "succeeded"


def test_a_job_paused_mid_run_and_resumed_by_a_worker_is_one_trace(tmp_path: Path, receiver: Receiver) -> None:
    piece, spec = two_movements(tmp_path)
    with Workspace(tmp_path / "ws", otel=receiver.url) as ws:
        job = ws.step(ws.submit("Do it", piece=piece, model=spec), "movement")   # plan: ended, sent
        job = ws.step(job, "call")                                               # work: paused after one call
        assert job.status == "queued"
    before = receiver.spans()
    assert "invoke_agent plan" in {s.name for s in before} and "invoke_agent work" not in {s.name for s in before}
    env = {**os.environ, "AGENTNB_OTEL": receiver.url}
    out = subprocess.run([sys.executable, "-m", "agentnb.cli", "worker", "--workspace", str(tmp_path / "ws")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = receiver.spans()
    assert_one_trace_each_span_once(got)
    with Workspace(tmp_path / "ws") as ws:
        job = ws.job(job.id)
        assert job.status == "succeeded"
        assert {s.span_id: s for s in got} == file_export(ws, job, tmp_path)
    by_id = {s.span_id: s for s in got}
    (root,) = [s for s in got if not s.parent_span_id]
    for s in got:  # calls and tools under their run, runs under the job
        parent = by_id.get(s.parent_span_id)
        if s.name.startswith("invoke_agent"):
            assert parent is root
        elif s is not root:
            assert parent is not None and parent.name.startswith("invoke_agent")


def test_content_goes_live_only_when_asked_scrubbed_and_cut_as_in_a_file_export(
        tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTNB_OTEL_CONTENT", raising=False)
    monkeypatch.delenv("NOTES_PASSWORD", raising=False)
    spec = write_script(tmp_path, "reader", {"work": [call("Read", path="input/notes.md"),
                                                      transition("COMPLETE", summary="read")]})
    notes = f"the password is {SECRET}\n" + "line of notes\n" * 1_500
    with Workspace(tmp_path / "ws") as ws:  # each job reads the notes, and is paused before its next call
        jobs = [ws.step(ws.submit("Read the notes", piece="single", model=spec, inputs={"notes.md": notes}), "call")
                for _ in range(2)]
    # the secret became one after the store kept the notes as text: the export masks it all the same
    monkeypatch.setenv("NOTES_PASSWORD", SECRET)
    with Workspace(tmp_path / "ws", otel=receiver.url) as ws:
        plain = ws.run(jobs[0].id)
        assert plain.status == "succeeded"
    with Workspace(tmp_path / "ws", otel=receiver.url, otel_content=True) as ws:
        full = ws.run(jobs[1].id)
        assert full.status == "succeeded"
    bodies = b"".join(r.SerializeToString() for _, _, r in receiver.got)
    assert SECRET.encode() not in bodies
    with Workspace(tmp_path / "ws") as ws:
        plain_ids = file_export(ws, ws.job(plain.id), tmp_path)
        full_spans = file_export(ws, ws.job(full.id), tmp_path, content=True)
    sent_plain = [s for s in receiver.spans() if s.span_id in plain_ids]
    sent_full = [s for s in receiver.spans() if s.span_id in full_spans]
    assert len(sent_plain) == len(plain_ids) and len(sent_full) == len(full_spans)
    # off by default: no content attribute, no text of the notes
    assert not any(k in attrs(s.attributes) for s in sent_plain for k in CONTENT_ATTRS)
    assert b"line of notes" not in b"".join(s.SerializeToString() for s in sent_plain)
    # on: what a file export with content=True has, span by span (the same mapping, scrub and cut)
    assert {s.span_id: s for s in sent_full} == full_spans
    (read,) = [attrs(s.attributes) for s in sent_full if s.name == "execute_tool Read"]
    assert read["gen_ai.tool.call.result"].startswith("the password is ***")
    assert read["gen_ai.tool.call.result"].endswith("characters cut]")
    chats = [attrs(s.attributes) for s in sent_full if s.name.startswith("chat")]
    assert len(chats) == 2 and all("gen_ai.input.messages" in a and "gen_ai.output.messages" in a for a in chats)


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _timed_run(ws: Workspace, piece: str, spec: str) -> tuple[Any, float]:
    start = time.monotonic()
    job = ws.run(ws.submit("Do it", piece=piece, model=spec))
    return job, time.monotonic() - start


@pytest.mark.parametrize("collector", ["dead", "slow", "error 500", "refusing 400"])
def test_a_dead_slow_or_refusing_collector_never_holds_the_job_up(
        tmp_path: Path, collector: str, caplog: pytest.LogCaptureFixture) -> None:
    piece, spec = two_movements(tmp_path)
    receiver = None
    if collector == "dead":
        url = _closed_port()
    else:
        receiver = Receiver(status=int(collector.split()[-1]) if collector != "slow" else 200,
                            delay=4.0 if collector == "slow" else 0.0)
        url = receiver.url
    try:
        with Workspace(tmp_path / "plain") as ws:
            _timed_run(ws, piece, spec)  # warm up imports and caches
            _, plain = _timed_run(ws, piece, spec)
        caplog.set_level(logging.WARNING, logger="agentnb.otel")
        with Workspace(tmp_path / "ws", otel=url) as ws:
            jobs = []
            for _ in range(3):
                job, took = _timed_run(ws, piece, spec)
                assert job.status == "succeeded"
                # held up, a run would wait out the exporter's timeout (2 s) or the slow collector (4 s)
                assert took < plain + 1.5, (took, plain)
                jobs.append(job)
            expected = {job.id: len(file_spans(ws, job, tmp_path)) for job in jobs}
            if collector != "slow":
                # a refused request is known at once, but the exporter retries it after a second's back-off and the
                # export's process starts first: all that can outlast close()'s wait on a loaded machine, and then
                # what it held is counted one span a run (docs/otel.md), not exactly.  Waited for here, so that the
                # exact count is what is checked
                _wait(lambda: ws.otel_dropped >= sum(expected.values()), 60.0)
            closing = time.monotonic()
        assert time.monotonic() - closing < 4.0  # close() waits a bounded time for a hung collector
        dropped = ws.otel_dropped
        warnings = [r for r in caplog.records if r.name == "agentnb.otel" and r.levelno >= logging.WARNING]
        with Workspace(tmp_path / "ws") as ws:  # another workspace on the store: the same job view
            html = job_html(ws, jobs[0].id)
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "spans dropped" in warnings[0].getMessage()
        if collector == "slow":
            # its request may still be under way when close() stops waiting (the export process's start-up comes
            # first): then what it held counts one span a run at least (docs/otel.md)
            assert len(jobs) <= dropped <= sum(expected.values())
            shown = re.search(r"OpenTelemetry: (\d+) spans of this job not exported", html)
            assert shown is not None and 1 <= int(shown[1]) <= expected[jobs[0].id]
        else:
            assert dropped == sum(expected.values())
            assert f"OpenTelemetry: {expected[jobs[0].id]} spans of this job not exported" in html
    finally:
        if receiver is not None:
            receiver.close()


def test_without_a_dropped_span_the_job_view_has_no_otel_footer(tmp_path: Path, receiver: Receiver) -> None:
    piece, spec = two_movements(tmp_path)
    with Workspace(tmp_path / "ws", otel=receiver.url) as ws:
        job = ws.run(ws.submit("Do it", piece=piece, model=spec))
        assert "OpenTelemetry" not in job_html(ws, job.id)


def test_a_worker_with_agentnb_otel_exports_its_jobs(tmp_path: Path, receiver: Receiver) -> None:
    piece, spec = two_movements(tmp_path)
    with Workspace(tmp_path / "ws") as ws:
        jobs = [ws.submit("Do it", piece=piece, model=spec) for _ in range(2)]
    env = {**os.environ, "AGENTNB_OTEL": receiver.url}
    out = subprocess.run([sys.executable, "-m", "agentnb.cli", "worker", "--workspace", str(tmp_path / "ws")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ran 2 job(s)" in out.stdout
    with Workspace(tmp_path / "ws") as ws:
        expected = set().union(*(file_spans(ws, ws.job(j.id), tmp_path) for j in jobs))
    assert {_key(s) for s in receiver.spans()} == expected


def test_a_batch_in_threads_exports_every_job(tmp_path: Path, receiver: Receiver) -> None:
    piece, spec = two_movements(tmp_path)
    with Workspace(tmp_path / "ws", otel=receiver.url) as ws:
        batch = ws.batch([{"instruction": f"Do {i}"} for i in range(6)], piece=piece, model=spec, concurrency=3,
                         progress=False)
        jobs = batch.jobs
        assert len(jobs) == 6
    with Workspace(tmp_path / "ws") as ws:
        expected = set().union(*(file_spans(ws, j, tmp_path) for j in jobs))
    assert {_key(s) for s in receiver.spans()} == expected


def test_live_export_reads_the_signal_specific_variables_first(
        tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    piece, spec = two_movements(tmp_path)
    general = Receiver()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", general.url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-general=1")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url + "/ingest/otlp")  # used as it is
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-team-key=traces-only")
        monkeypatch.setenv("AGENTNB_OTEL", "1")
        with Workspace(tmp_path / "ws") as ws:
            assert ws.run(ws.submit("Do it", piece=piece, model=spec)).status == "succeeded"
        assert receiver.got and general.got == []
        for path, headers, _ in receiver.got:
            assert path == "/ingest/otlp" and headers["x-team-key"] == "traces-only" and "x-general" not in headers
        # a URL given is a base URL, and wins over the variables (the headers still come from them)
        monkeypatch.delenv("AGENTNB_OTEL")
        with Workspace(tmp_path / "ws", otel=general.url) as ws:
            assert ws.run(ws.submit("Do it", piece=piece, model=spec)).status == "succeeded"
        assert general.got and {p for p, _, _ in general.got} == {"/v1/traces"}
        assert all(h["x-team-key"] == "traces-only" for _, h, _ in general.got)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "localhost:4318")
        with pytest.raises(UsageError, match=r"^OTEL_EXPORTER_OTLP_TRACES_ENDPOINT 'localhost:4318' must be an "
                                             r"http:// or https:// URL"):
            Workspace(tmp_path / "ws", otel=True)
    finally:
        general.close()


def test_the_settings_and_their_precedence(tmp_path: Path, receiver: Receiver,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "AGENTNB_OTEL_CONTENT"):
        monkeypatch.delenv(name, raising=False)
    traces = receiver.url + "/v1/traces"
    monkeypatch.setenv("AGENTNB_OTEL", receiver.url)
    with Workspace(tmp_path / "ws") as ws:
        assert ws.otel is not None and ws.otel.url == traces and not ws.otel.content
    with Workspace(tmp_path / "ws", otel=False) as ws:  # the argument wins over the environment
        assert ws.otel is None
    monkeypatch.setenv("AGENTNB_OTEL", "1")
    with pytest.raises(UsageError, match="OTEL_EXPORTER_OTLP_ENDPOINT, and neither is set"):
        Workspace(tmp_path / "ws")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    with Workspace(tmp_path / "ws") as ws:
        assert ws.otel is not None and ws.otel.url == traces
    monkeypatch.setenv("AGENTNB_OTEL", "0")
    with Workspace(tmp_path / "ws") as ws:
        assert ws.otel is None
    with Workspace(tmp_path / "ws", otel=True) as ws:
        assert ws.otel is not None and ws.otel.url == traces
    # content: the argument, else AGENTNB_OTEL_CONTENT; only with a live export
    with Workspace(tmp_path / "ws", otel=True, otel_content=True) as ws:
        assert ws.otel is not None and ws.otel.content
    monkeypatch.setenv("AGENTNB_OTEL_CONTENT", "1")
    with Workspace(tmp_path / "ws", otel=True) as ws:
        assert ws.otel is not None and ws.otel.content
    with Workspace(tmp_path / "ws", otel=True, otel_content=False) as ws:
        assert ws.otel is not None and not ws.otel.content
    with Workspace(tmp_path / "ws") as ws:  # AGENTNB_OTEL=0: no live export, so no content to send either
        assert ws.otel is None
    with pytest.raises(UsageError, match=r"^otel_content=True sends content with the live export, and there is "
                                         r"none: give otel=URL"):
        Workspace(tmp_path / "ws", otel_content=True)
    monkeypatch.setenv("AGENTNB_OTEL_CONTENT", "all")
    with pytest.raises(UsageError, match=r"^AGENTNB_OTEL_CONTENT='all'; allowed: 1 .* or 0"):
        Workspace(tmp_path / "ws", otel=True)
    with pytest.raises(UsageError, match=r"^otel_content='yes': allowed: True, False or None"):
        Workspace(tmp_path / "ws", otel=True, otel_content="yes")  # type: ignore[arg-type]
    monkeypatch.delenv("AGENTNB_OTEL_CONTENT")
    monkeypatch.setenv("AGENTNB_OTEL", "localhost:4318")
    with pytest.raises(UsageError, match=r"^AGENTNB_OTEL='localhost:4318': allowed: an http:// or https://"):
        Workspace(tmp_path / "ws")
    with pytest.raises(UsageError, match=r"^otel=4318: allowed"):
        Workspace(tmp_path / "ws", otel=4318)  # type: ignore[arg-type]
    with Workspace(tmp_path / "ws", readonly=True) as ws:  # nothing runs there: nothing to export
        assert ws.otel is None


def _exporter_processes() -> list[int]:
    """The pids of this process's children that are the live export's own process (docs/otel.md#live)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"agentnb.views._otel_process" in cmdline and " Z " not in stat:
            found.append(int(entry.name))
    return found


def test_the_export_runs_in_a_process_of_its_own_and_one_that_dies_loses_no_span(
        tmp_path: Path, receiver: Receiver, caplog: pytest.LogCaptureFixture) -> None:
    piece, spec = two_movements(tmp_path)
    caplog.set_level(logging.WARNING, logger="agentnb.otel")
    with Workspace(tmp_path / "ws", otel=receiver.url) as ws:
        assert _exporter_processes() == []  # started when the first run ends
        first = ws.run(ws.submit("Do it", piece=piece, model=spec))
        assert ws.otel is not None
        _wait(lambda: ws.otel.sent == 11)  # taken by the collector, and reported (else it would go again)
        (pid,) = _exporter_processes()
        os.kill(pid, signal.SIGKILL)
        jobs = [ws.run(ws.submit("Do it", piece=piece, model=spec)) for _ in range(2)]
        assert all(j.status == "succeeded" for j in jobs)
    assert _exporter_processes() == []  # closing the workspace ends it, whichever it was
    with Workspace(tmp_path / "ws") as ws:
        expected = set().union(*(file_spans(ws, j, tmp_path) for j in [first, *jobs]))
        assert ws.otel_dropped == 0
    got = [_key(s) for s in receiver.spans()]
    assert len(got) == len(set(got)) and set(got) == expected  # every span, once
    warnings = [r.getMessage() for r in caplog.records if r.name == "agentnb.otel" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "the live OpenTelemetry export's process ended" in warnings[0], warnings


def test_a_secret_set_after_the_workspace_opened_is_masked_by_the_export_s_process(
        tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTES_PASSWORD", raising=False)
    spec = write_script(tmp_path, "reader", {"work": [call("Read", path="input/notes.md"),
                                                      transition("COMPLETE", summary="read")]})
    with Workspace(tmp_path / "ws") as ws:  # the store keeps the notes before the secret is one
        job = ws.step(ws.submit("Read the notes", piece="single", model=spec,
                                inputs={"notes.md": f"the password is {SECRET}\n"}), "call")
    # the export's process gets the environment the workspace opened with; the secret comes after
    with Workspace(tmp_path / "ws", otel=receiver.url, otel_content=True) as ws:
        monkeypatch.setenv("NOTES_PASSWORD", SECRET)
        assert ws.run(job.id).status == "succeeded"
    (read,) = [attrs(s.attributes) for s in receiver.spans() if s.name == "execute_tool Read"]
    assert read["gen_ai.tool.call.result"] == "the password is ***\n"
    assert SECRET.encode() not in b"".join(r.SerializeToString() for _, _, r in receiver.got)


def test_a_store_given_as_an_object_is_exported_by_a_thread(tmp_path: Path, receiver: Receiver) -> None:
    from agentnb.views.otel_live import LiveExport

    piece, spec = two_movements(tmp_path)
    with Workspace(tmp_path / "ws") as ws:
        export = LiveExport(ws.store, receiver.url + "/v1/traces")
        assert _exporter_processes() == []
        job = ws.run(ws.submit("Do it", piece=piece, model=spec))
        export.close()
        assert export.sent == 11 and export.process_cpu is None
        assert {_key(s) for s in receiver.spans()} == file_spans(ws, job, tmp_path)


def test_a_process_killed_before_it_reported_leaves_its_notes_to_the_workspace(
        tmp_path: Path, receiver: Receiver, caplog: pytest.LogCaptureFixture) -> None:
    piece, spec = two_movements(tmp_path)
    caplog.set_level(logging.WARNING, logger="agentnb.otel")
    with Workspace(tmp_path / "ws", otel=receiver.url) as ws:
        job = ws.run(ws.submit("Do it", piece=piece, model=spec))
        _wait(lambda: len(_exporter_processes()) == 1)
        os.kill(_exporter_processes()[0], signal.SIGKILL)  # in its start-up: it took the notes, sent nothing
    with Workspace(tmp_path / "ws") as ws:
        assert sorted(_key(s) for s in receiver.spans()) == sorted(file_spans(ws, job, tmp_path))
    warnings = [r.getMessage() for r in caplog.records if r.name == "agentnb.otel" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "process ended" in warnings[0], warnings


def test_a_workspace_whose_folder_was_renamed_still_exports_every_span_and_says_why_from_here(
        tmp_path: Path, receiver: Receiver, caplog: pytest.LogCaptureFixture) -> None:
    # the export's process opens the store by its path, where a read-only store with no file reads as empty: it
    # must say so, and the workspace's own connection, which follows the file, export instead — before its close
    piece, spec = two_movements(tmp_path)
    caplog.set_level(logging.WARNING, logger="agentnb.otel")
    ws = Workspace(tmp_path / "ws", otel=receiver.url)
    try:
        (tmp_path / "ws").rename(tmp_path / "moved")
        job = ws.run(ws.submit("Do it", piece=piece, model=spec))
        assert job.status == "succeeded" and ws.otel is not None
        _wait(lambda: ws.otel.sent == 11)
    finally:
        ws.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "agentnb.otel" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "no longer the workspace's store file (its folder moved or renamed" in warnings[0]
    with Workspace(tmp_path / "moved") as moved:  # the ids name the store's path: only they differ
        assert sorted(k[3:] for k in map(_key, receiver.spans())) == sorted(k[3:] for k in file_spans(moved, job, tmp_path))


def test_two_workspaces_on_one_store_each_export_what_they_run_once_and_a_dropped_one_stops(
        tmp_path: Path, receiver: Receiver) -> None:
    import gc

    piece, spec = two_movements(tmp_path)
    dropped = Workspace(tmp_path / "ws", otel=receiver.url)  # never closed: collected, as a notebook's re-run cell
    first = dropped.run(dropped.submit("Do it", piece=piece, model=spec)).id  # a Job would keep its workspace
    _wait(lambda: len(receiver.spans()) == 11)
    del dropped
    gc.collect()
    _wait(lambda: _exporter_processes() == [])  # its process ended with it
    with Workspace(tmp_path / "ws", otel=receiver.url) as a, Workspace(tmp_path / "ws", otel=receiver.url) as b:
        jobs = [a.run(a.submit("Do it", piece=piece, model=spec)), b.run(b.submit("Do it", piece=piece, model=spec))]
    with Workspace(tmp_path / "ws", otel=False) as ws:
        ws.run(ws.submit("Do it", piece=piece, model=spec))  # no export
        expected = sorted(k for j in [ws.job(first), *jobs] for k in file_spans(ws, j, tmp_path))
    assert sorted(_key(s) for s in receiver.spans()) == expected


def test_the_process_is_not_fooled_by_the_working_folder_or_a_fork(
        tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    piece, spec = two_movements(tmp_path)
    here = tmp_path / "here"
    here.mkdir()
    (here / "queue.py").write_text("raise SystemExit('a user module named like the standard library')\n")
    monkeypatch.chdir(here)
    # a relative store file, then the process changes folder: still the same store, and its spans
    with Workspace(tmp_path / "ws", store="rel.sqlite", otel=receiver.url) as ws:
        monkeypatch.chdir(tmp_path)
        job = ws.run(ws.submit("Do it", piece=piece, model=spec))
        assert ws.otel is not None
        _wait(lambda: ws.otel.sent == 11)
        forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(10,))
        forked.start()  # holds no end of the export's pipes
        try:
            closing = time.monotonic()
            ws.close()
            assert time.monotonic() - closing < 1.5
            assert ws.otel.process_cpu is not None  # it ended of itself, reporting, not killed
        finally:
            forked.kill()
            forked.join()
    assert (here / "rel.sqlite").exists()
    with Workspace(tmp_path / "ws", store=str(here / "rel.sqlite")) as ws:
        assert {_key(s) for s in receiver.spans()} == file_spans(ws, job, tmp_path)


@pytest.mark.parametrize("pipe", ["open", "full"])
def test_close_settles_what_a_stopped_process_held_before_it_returns(
        tmp_path: Path, receiver: Receiver, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        pipe: str) -> None:
    piece, spec = two_movements(tmp_path)
    caplog.set_level(logging.WARNING, logger="agentnb.otel")
    with Workspace(tmp_path / "ws", otel=receiver.url) as ws:
        ws.run(ws.submit("Do it", piece=piece, model=spec))
        assert ws.otel is not None
        _wait(lambda: ws.otel.sent == 11)
        (pid,) = _exporter_processes()
        os.kill(pid, signal.SIGSTOP)
        if pipe == "full":  # the next request carries this secret to it: more than its input pipe holds
            monkeypatch.setenv("HUGE_SECRET", "z" * 100_000)
        ws.run(ws.submit("Do it", piece=piece, model=spec))
        time.sleep(0.8)  # the request is under way (its write blocked, with a full pipe)
        closing = time.monotonic()
    dropped = ws.otel_dropped  # read at once: settled by close()
    assert time.monotonic() - closing < 4.0  # its wait (3 s) and the thread's count of what is left, with slack
    assert dropped >= 2 and len(receiver.spans()) == 11
    assert _exporter_processes() == []
    warnings = [r.getMessage() for r in caplog.records if r.name == "agentnb.otel" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "closed before they were exported" in warnings[0], warnings


def test_a_thread_export_dropped_while_notes_wait_sends_them_all(tmp_path: Path) -> None:
    import gc

    from agentnb.views.otel_live import LiveExport

    piece, spec = two_movements(tmp_path)
    slow = Receiver(delay=1.0)
    try:
        with Workspace(tmp_path / "ws") as ws:
            export = LiveExport(ws.store, slow.url + "/v1/traces")  # in its thread: no process
            jobs = [ws.run(ws.submit("Do it", piece=piece, model=spec))]
            _wait(lambda: len(slow.got) >= 1)  # its request under way, for a second
            jobs.append(ws.run(ws.submit("Do it", piece=piece, model=spec)))  # noted meanwhile
            del export
            gc.collect()
            _wait(lambda: len(slow.spans()) == 22, 30)
            assert sorted(_key(s) for s in slow.spans()) == sorted(k for j in jobs for k in file_spans(ws, j, tmp_path))
    finally:
        slow.close()


def _pipes() -> int:
    """The pipes this process has open."""
    return sum(target.startswith("pipe:") for target in open_targets())


def test_workspaces_dropped_right_after_their_jobs_lose_no_span_and_leave_nothing_open(
        tmp_path: Path, receiver: Receiver) -> None:
    import gc
    import threading

    piece, spec = two_movements(tmp_path)
    pipes = _pipes()
    for i in range(8):
        ws = Workspace(tmp_path / "ws", otel=receiver.url)
        ws.run(ws.submit(f"Do {i}", piece=piece, model=spec))
        del ws  # at once: its notes are still queued
        gc.collect()
    _wait(lambda: len(receiver.spans()) == 8 * 11, 20)
    _wait(lambda: not [t for t in threading.enumerate() if t.name.startswith("agentnb-otel")]
          and _exporter_processes() == [] and _pipes() <= pipes, 20)
    with Workspace(tmp_path / "ws") as ws:
        assert sorted(_key(s) for s in receiver.spans()) == sorted(
            k for j in ws.jobs() for k in file_spans(ws, j, tmp_path))


def test_a_collected_workspace_s_stopped_export_process_is_ended(tmp_path: Path, receiver: Receiver) -> None:
    import gc

    piece, spec = two_movements(tmp_path)
    ws = Workspace(tmp_path / "ws", otel=receiver.url)
    ws.run(ws.submit("Do it", piece=piece, model=spec))
    export = ws.otel
    assert export is not None
    _wait(lambda e=export: e.sent == 11)
    (pid,) = _exporter_processes()
    os.kill(pid, signal.SIGSTOP)  # it reads nothing more: closing its input does not end it
    try:
        del ws, export
        gc.collect()
        _wait(lambda: _exporter_processes() == [], 10)  # killed once it had its time, not left stopped
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def test_a_workspace_in_a_reference_cycle_is_collected_without_hanging_the_next_one(
        tmp_path: Path, receiver: Receiver) -> None:
    # the collector may run inside the next workspace's subscribing, under the subscription table's lock
    script = (
        "from agentnb import Workspace\n"
        "for i in range(60):\n"
        f"    w = Workspace({str(tmp_path / 'ws')!r}, otel={receiver.url!r})\n"
        "    w.me = w\n"
        "    del w\n"
        "print('done')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-2000:]


def test_close_without_waiting_still_counts_what_it_did_not_send(tmp_path: Path, receiver: Receiver) -> None:
    piece, spec = two_movements(tmp_path)
    ws = Workspace(tmp_path / "ws", otel=receiver.url)
    try:
        ws.run(ws.submit("Do it", piece=piece, model=spec))
        assert ws.otel is not None
        _wait(lambda: ws.otel.sent == 11)
        (pid,) = _exporter_processes()
        os.kill(pid, signal.SIGSTOP)
        ws.run(ws.submit("Do it", piece=piece, model=spec))
    finally:
        assert ws.otel is not None
        ws.otel.close(wait=0)
        assert ws.otel.dropped >= 2  # settled when close() returns
        ws.close()
    assert _exporter_processes() == []
