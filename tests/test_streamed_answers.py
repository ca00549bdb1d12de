"""The offline models stream their answers (docs/models.md#streaming), and the live views draw what streams
(docs/notebook.md#streaming): ``demo`` (paced with ``demo?pace=SECONDS``) and ``scripted:`` responses that say
``stream: true`` or ``chunk: N`` hand each fragment to the request's ``on_delta``; a set ``cancel`` cuts them off."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, say, write_script

from agentnb import Workspace
from agentnb.errors import CallCancelled
from agentnb.live import Notice
from agentnb.models.base import ModelRequest, ModelSpecError, ScriptedModel
from agentnb.models.factory import resolve_model
from agentnb.models.messages import Delta, UserMessage
from agentnb.notebook.liveview import STREAM_INTERVAL, LiveView, Streaming
from agentnb.views.streaming import StreamedCall, stream_html


def _joined(notices: list[Notice]) -> dict[tuple[int | None, int | None], dict[str, Any]]:
    """Each call's fragments put together: its text, and each tool call's id, name and argument text."""
    calls: dict[tuple[int | None, int | None], dict[str, Any]] = {}
    for n in notices:
        if n.what != "delta":
            continue
        d: Delta = n.detail["delta"]
        c = calls.setdefault((n.movement_seq, n.iteration), {"text": "", "tools": {}})
        if d.tool_index is None:
            c["text"] += d.text
        elif d.tool_name is not None:
            assert d.tool_index not in c["tools"], "a tool call is opened once, by its id and name"
            c["tools"][d.tool_index] = {"id": d.tool_id, "name": d.tool_name, "arguments": d.arguments}
        else:
            c["tools"][d.tool_index]["arguments"] += d.arguments
    return calls


def _comparable(ws: Workspace, job_id: int) -> list[dict[str, Any]]:
    """The job's events without what differs from run to run (ids, times, latency, the claiming process)."""
    drop = {"id", "ts", "latency_s", "job_id", "owner", "pid", "host", "worker"}
    out = []
    for e in ws.events(job_id):
        d = {k: v for k, v in dataclasses.asdict(e).items() if k not in drop}
        if e.kind == "job_status" and str(d.get("reason", "")).startswith("claimed by "):
            d["reason"] = "claimed by …"
        out.append({"kind": e.kind, **d})
    return out


def test_a_watched_demo_run_streams_each_answer_and_records_what_an_unwatched_one_does(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    plain = ws.submit("Summarise the inputs", piece="plan-implement-verify", model="demo", inputs={"a.md": "x\n"})
    ws.run(plain)
    watched = ws.submit("Summarise the inputs", piece="plan-implement-verify", model="demo", inputs={"a.md": "x\n"})
    got: list[Any] = []
    with ws.execution.subscribe(watched.id, got.append):
        ws.run(watched)
    assert ws.job(watched).status == "succeeded"
    notices = [n for n in got if isinstance(n, Notice)]
    calls = _joined(notices)
    responses = ws.events(watched, kinds=["llm_response"])
    assert len(calls) == len(responses) >= 8
    for r in responses:
        streamed = calls[(r.movement_seq, r.iteration)]
        assert streamed["text"] == (r.content or "")
        assert [(t["id"], t["name"]) for _, t in sorted(streamed["tools"].items())] == \
            [(c.id, c.name) for c in r.tool_calls]
        for i, c in enumerate(r.tool_calls):
            assert json.loads(streamed["tools"][i]["arguments"]) == c.arguments
            assert streamed["tools"][i]["arguments"] == json.dumps(c.arguments, ensure_ascii=False)
    # text in word-ish pieces: several per answer, none split inside a word
    said = [n.detail["delta"].text for n in notices if n.detail.get("delta") and n.detail["delta"].text]
    assert "Let " in said and "me " in said
    # the report's ~14,000 characters of arguments stream in a few dozen pieces, not thousands
    assert max(sum(1 for n in notices if n.what == "delta" and (n.movement_seq, n.iteration) == k)
               for k in calls) <= 60
    # deltas are never stored: the two jobs recorded the same events
    assert _comparable(ws, watched.id) == _comparable(ws, plain.id)


def _request(**kwargs: Any) -> ModelRequest:
    return ModelRequest(messages=[UserMessage("## Task\nlook\n")], tools=[], movement="look", **kwargs)


def test_a_paced_demo_spaces_its_pieces_and_returns_the_unpaced_answer() -> None:
    times: list[float] = []
    fast = resolve_model("demo").complete(_request())
    paced = resolve_model("demo?pace=0.03")
    assert paced.spec == "demo?pace=0.03"
    begun = time.perf_counter()
    answer = paced.complete(_request(on_delta=lambda d: times.append(time.perf_counter())))
    assert answer == fast  # what it says does not depend on its pace or on who watches
    assert len(times) >= 5
    gaps = [b - a for a, b in zip([begun, *times], times, strict=False)]
    assert min(gaps) >= 0.025, gaps
    # a paced demo nobody watches takes as long: a worker's run can be watched from the store
    begun = time.perf_counter()
    assert paced.complete(_request()) == fast
    assert time.perf_counter() - begun >= 0.025 * len(times)


@pytest.mark.parametrize("spec, message", [
    ("demo?pace=fast", "demo?pace=fast: pace='fast'; allowed: a number of seconds from 0 to 10 before each "
                       "streamed piece (e.g. demo?pace=0.02)"),
    ("demo?pace=-1", "pace='-1'; allowed: a number of seconds from 0 to 10"),
    ("demo?pace=inf", "pace='inf'; allowed"),
    ("demo?speed=1", "demo?speed=1: unknown option 'speed=1'; allowed: demo?pace=SECONDS"),
])
def test_a_bad_demo_pace_is_refused_at_submit_with_one_line(ws: Workspace, spec: str, message: str) -> None:
    with pytest.raises(ModelSpecError) as err:
        ws.submit("task", piece="single", model=spec)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert ws.jobs() == []


def test_a_stop_cuts_a_streaming_demo_call_off_between_pieces_and_during_a_pace() -> None:
    cancel = threading.Event()
    seen: list[Delta] = []

    def watch(d: Delta) -> None:
        seen.append(d)
        if len(seen) == 3:
            cancel.set()

    with pytest.raises(CallCancelled) as cut:
        resolve_model("demo").complete(_request(on_delta=watch, cancel=cancel))
    assert len(seen) == 3
    assert cut.value.partial_text == "".join(d.text for d in seen) and cut.value.partial_text
    # a slow pace does not delay the stop: it is waited on the cancel event
    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    begun = time.perf_counter()
    with pytest.raises(CallCancelled):
        resolve_model("demo?pace=5").complete(_request(on_delta=lambda d: None, cancel=cancel))
    assert time.perf_counter() - begun < 1.0


def _scripted(tmp_path: Path, *responses: dict[str, Any]) -> ScriptedModel:
    model = resolve_model(write_script(tmp_path, "s", responses=list(responses)))
    assert isinstance(model, ScriptedModel)
    return model


def test_scripted_responses_stream_when_they_say_so_in_chunks_of_the_size_given(tmp_path: Path) -> None:
    text = "Ünïcode — a reply in several pieces."
    model = _scripted(tmp_path,
                      {**say(text), "chunk": 4},
                      {**call("Write", path="out.md", content="é" * 30), "stream": True},
                      say("not streamed"))
    seen: list[Delta] = []
    first = model.complete(_request(on_delta=seen.append))
    assert [d.text for d in seen] == [text[i:i + 4] for i in range(0, len(text), 4)]
    assert first.content == text
    seen.clear()
    second = model.complete(_request(on_delta=seen.append, call_index=1, iteration=1))
    (opening, *pieces) = seen
    assert (opening.tool_index, opening.tool_id, opening.tool_name) == (0, second.tool_calls[0].id, "Write")
    assert len(pieces) >= 2 and all(p.tool_index == 0 and p.tool_name is None for p in pieces)
    assert json.loads("".join(p.arguments for p in pieces)) == {"path": "out.md", "content": "é" * 30}
    seen.clear()
    assert model.complete(_request(on_delta=seen.append, call_index=2)).content == "not streamed"
    assert seen == []  # a response that does not say stream answers at once, watched or not
    # the same answers as a script without the stream keys
    plain = _scripted(tmp_path / "plain", say(text), call("Write", path="out.md", content="é" * 30))
    assert plain.complete(_request()) == first
    assert plain.complete(_request(call_index=1, iteration=1)) == second


def test_a_scripted_stream_is_cut_off_by_a_stop(tmp_path: Path) -> None:
    model = _scripted(tmp_path, {**say("abcdefghij"), "chunk": 2})
    cancel = threading.Event()
    seen: list[Delta] = []

    def watch(d: Delta) -> None:
        seen.append(d)
        cancel.set()

    with pytest.raises(CallCancelled) as cut:
        model.complete(_request(on_delta=watch, cancel=cancel))
    assert [d.text for d in seen] == ["ab"] and cut.value.partial_text == "ab"


@pytest.mark.parametrize("response, message", [
    ({"content": "x", "streaming": True},
     "unknown key(s) ['streaming']; allowed: content, tool_calls, usage, stream, chunk"),
    ({"content": "x", "chunk": 0}, "responses[0].chunk: 0; allowed: a whole number ≥ 1 (characters per streamed piece)"),
    ({"content": "x", "stream": "yes"}, "responses[0].stream: 'yes'; allowed: true or false"),
])
def test_a_bad_stream_key_in_a_script_is_one_line(tmp_path: Path, response: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelSpecError) as err:
        _scripted(tmp_path, response)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_live_view_draws_streamed_text_at_most_ten_times_a_second_and_empties_it(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    job = ws.submit("Summarise the inputs", piece="plan-implement-verify", model="demo?pace=0.02",
                    inputs={"a.md": "x\n"})
    live = LiveView(ws.execution)
    redraws: list[int] = []
    draws: list[tuple[float, StreamedCall | None]] = []
    try:
        live.start(lambda: ws.run(job.id), job.id)
        live.watch(redraws.append, lambda c: draws.append((time.monotonic(), c)))
    finally:
        live.close()
    assert live.failure is None and ws.job(job).status == "succeeded"
    shown = [(t, c) for t, c in draws if c is not None]
    assert len(shown) >= 5, draws
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(draws)]
    # throttled: two draws of streamed text are STREAM_INTERVAL apart (an emptying, when the call is recorded,
    # is drawn at once)
    assert all(g >= STREAM_INTERVAL * 0.9 for g, (_, c) in zip(gaps, draws[1:], strict=True) if c is not None), gaps
    # within a call the text only grows; the view was not redrawn for streamed text (one redraw a commit at most)
    for (_, a), (_, b) in itertools.pairwise(shown):
        if (a.movement_seq, a.iteration) == (b.movement_seq, b.iteration):
            assert b.text.startswith(a.text) and b.chars >= a.chars
    assert len(redraws) <= len(ws.events(job)) + 1
    assert draws[-1][1] is None  # nothing streams once the run is over
    # the Write call's arguments grew in the view: its name at once, its argument text partial
    writes = [c for _, c in shown if c.tools and c.tools[0][0] == "Write"]
    (report,) = [r for r in ws.events(job, kinds=["llm_response"]) if r.tool_calls and r.tool_calls[0].name == "Write"]
    assert writes and len(writes[0].tools[0][1]) < len(json.dumps(report.tool_calls[0].arguments, ensure_ascii=False))


def test_a_restart_drops_what_the_broken_try_streamed_from_the_view() -> None:
    streaming = Streaming()
    streaming.begin(1, 1, 1)
    for delta in (Delta(text="The first try, "), Delta(tool_index=0, tool_id="c", tool_name="Read", arguments='{"pa')):
        streaming.add(1, 1, 1, delta)
    shown = streaming.take()
    assert shown is not None and shown.text == "The first try, " and shown.tools == (("Read", '{"pa'),)
    streaming.add(1, 1, 1, Delta(restart=True))  # the stream broke off: the call is asked again
    assert streaming.dirty and streaming.take() is None  # emptied
    streaming.add(1, 1, 1, Delta(text="The second try."))
    shown = streaming.take()
    assert shown is not None and (shown.text, shown.tools) == ("The second try.", ())


def test_an_answer_that_came_in_one_burst_is_not_drawn_however_late_it_is_recorded(tmp_path: Path) -> None:
    live = LiveView(Workspace(tmp_path / "ws").execution)
    drawn: list[StreamedCall | None] = []
    live.streaming.begin(1, 1, 1)
    for piece in ("The whole ", "answer ", "at once."):
        live.streaming.add(1, 1, 1, Delta(text=piece))
    time.sleep(STREAM_INTERVAL * 2)  # its record is slow to come (a first call's commit in a fresh kernel, say)
    live.draw_stream(drawn.append)
    assert drawn == []  # no element flashes for it
    live.streaming.add(1, 1, 1, Delta(text=" More, later."))  # it goes on streaming: now it has streamed a while
    live.draw_stream(drawn.append)
    assert [c.text for c in drawn if c is not None] == ["The whole answer at once. More, later."]


def test_the_streamed_part_is_escaped_and_shows_the_end_of_a_long_answer() -> None:
    part = stream_html(StreamedCall(3, 2, 1, text="<b>" + "x" * 5000, tools=(("Write", '{"a": "<i>"}'),)))
    assert 'data-anb-stream="3:2:1"' in part and "call 1" in part and "streaming" in part
    assert "<b>x" not in part and "&lt;i&gt;" in part and "<b>Write</b>" in part
    assert "… 3,003 chars before · " in part and "x" * 2000 in part


def test_the_streamed_part_is_masked_as_the_store_masks_and_holds_a_secret_s_beginning_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    secret, key = "Zq9SECRETvalueXYZ2024ab", "sk-" + "a1" * 12
    monkeypatch.setenv("STREAM_API_KEY", secret)
    whole = stream_html(StreamedCall(1, 1, 1, text=f"the token {secret} and {key}.",
                                     tools=(("Write", json.dumps({"content": f"x\n{key}"})),)))
    assert secret not in whole and "a1a1" not in whole and whole.count("***") == 3
    # what may still grow into a secret is not drawn yet
    growing = stream_html(StreamedCall(1, 1, 1, text=f"the token {secret[:5]}", tools=(("Write", '{"content": "x\\nsk-a1a1'),)))
    assert "Zq9" not in growing and "sk-a" not in growing
    # (what comes before is drawn; the machine's own secrets, and keys other code registered, may hold back more)
    assert "the token" in growing and '{&quot;content&quot;: &quot;x' in growing
    # a token after "Bearer " however long before its first digit, after a JSON escape too; a name that is a secret
    for args in ('{"h": "x\\nBearer eyJhbGciOi', '{"h": "Bearer ' + "a" * 5000):
        assert "eyJ" not in stream_html(StreamedCall(1, 1, 1, tools=(("Write", args),))) and "aaaa" not in stream_html(
            StreamedCall(1, 1, 1, tools=(("Write", args),)))
    named = stream_html(StreamedCall(1, 1, 1, tools=((secret, "{"), (key, "{"))))
    assert secret not in named and "a1a1" not in named and named.count("<b>***</b>") == 2


def test_a_tool_name_that_comes_late_or_in_pieces_is_drawn_whole() -> None:
    streaming = Streaming()
    streaming.begin(1, 1, 1)
    streaming.add(1, 1, 1, Delta(tool_index=0, tool_id="c"))  # the call opens with no name yet
    shown = streaming.take()
    assert shown is not None and shown.tools == (("", ""),) and "<b>?</b>" in stream_html(shown)
    for delta in (Delta(tool_index=0, tool_name="Wr"), Delta(tool_index=0, tool_name="Write", arguments="{")):
        streaming.add(1, 1, 1, delta)  # (a delta names the whole name so far)
    shown = streaming.take()
    assert shown is not None and shown.tools == (("Write", "{"),) and "<b>Write</b>" in stream_html(shown)


KERNEL_SETUP = '''
%load_ext agentnb
%config AgentMagic.workspace = "agentnb-data"
import json, time
from agentnb import live
_ws = get_ipython().magics_manager.registry["AgentMagic"].ws
chunks = []  # (when, movement_seq, iteration, characters of the call so far) of each streamed fragment
_sofar = {}

def _chunk(item):
    if isinstance(item, live.Notice) and item.what == "delta":
        d, key = item.detail["delta"], (item.movement_seq, item.iteration)
        _sofar[key] = _sofar.get(key, 0) + len(d.text) + len(d.arguments)
        chunks.append((time.time(), *key, _sofar[key]))

live.subscribe(_ws.store, None, _chunk)
'''


def _run_noting_messages(nb: Any, tmp_path: Path) -> list[tuple[float, int, dict[str, Any]]]:
    """Execute ``nb`` in a real kernel in ``tmp_path``, noting each message the kernel sends as it arrives:
    (time, cell index, message)."""
    from nbclient import NotebookClient

    received: list[tuple[float, int, dict[str, Any]]] = []

    class Client(NotebookClient):  # type: ignore[misc]
        def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
            received.append((time.time(), cell_index, msg))
            return super().process_message(msg, cell, cell_index)

    Client(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    return received


def _sent_at(message: dict[str, Any]) -> float:
    """When the kernel sent ``message`` (its header's date), in seconds since the epoch."""
    import datetime

    date = message["header"]["date"]
    return (date if isinstance(date, datetime.datetime) else datetime.datetime.fromisoformat(date)).timestamp()


def test_in_a_kernel_the_view_shows_the_text_as_it_streams_then_the_recorded_call(tmp_path: Path) -> None:
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook


    cells = [
        KERNEL_SETUP,
        'streamed = %agent run --model demo?pace=0.02 "Summarise the inputs"',
        'plain = %agent run --model demo "Summarise the inputs"',
        "from IPython.display import HTML\nfrom agentnb.views.render import KEEPER, job_html\n"
        "HTML(KEEPER + job_html(_ws, streamed.id))",
        "print(json.dumps({'chunks': chunks, 'status': [str(streamed.status), str(plain.status)]}))",
    ]
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    received = _run_noting_messages(nb, tmp_path)
    data = json.loads(nb.cells[4].outputs[0]["text"])
    assert data["status"] == ["succeeded", "succeeded"]

    # during the call: the streamed element, drawn alone (the job's view is not redrawn for it), growing
    draws = [(at, m["content"]) for at, i, m in received if i == 1
             and m["msg_type"] in ("display_data", "update_display_data")
             and "stream" in m["content"].get("transient", {}).get("agentnb", {})]
    shown = [(at, c) for at, c in draws if c["data"]]
    assert len(shown) >= 5
    assert all('class="anb-job anb-stream"' in c["data"]["text/html"] and "streaming…" in c["data"]["text/html"]
               and "data-anb-key" not in c["data"]["text/html"] for _, c in shown)
    partial = [c for _, c in shown if "<b>Write</b>" in c["data"]["text/html"]]  # the report, as it is written
    sizes = [int(m) for c in partial for m in re.findall(r"arguments \(([\d,]+) chars so far\)",
                                                          c["data"]["text/html"].replace(",", ""))]
    assert len(sizes) >= 3 and sizes == sorted(sizes) and sizes[0] < sizes[-1], sizes  # arguments growing
    # ten draws a second at most (an emptying, once the call is recorded, is sent at once), by the times the kernel
    # sent them: the client's arrival times bunch up when its machine is busy
    times = [_sent_at(m) for at, i, m in received if i == 1 and m["msg_type"] in ("display_data", "update_display_data")
             and "stream" in m["content"].get("transient", {}).get("agentnb", {}) and m["content"]["data"]]
    assert len(times) == len(shown)
    # at most six in any half second (a draw made late is followed by the next on time, so two may be close)
    assert all(sum(1 for t in times if a <= t < a + 0.5) <= 6 for a in times), times
    # chunk → view: from a fragment's publication in the kernel to the first draw showing it reaching the client
    latencies = []
    for when, seq, it, upto in data["chunks"]:
        seen = next((at for at, c in shown if c["transient"]["agentnb"]["call"] == [seq, it]
                     and c["transient"]["agentnb"]["stream"] >= upto), None)
        if seen is not None:
            latencies.append(seen - when)
    latencies.sort()
    assert len(latencies) >= 20
    median = latencies[len(latencies) // 2]
    print(f"chunk → view latency over {len(latencies)} chunks: median {median * 1000:.0f} ms, "
          f"max {latencies[-1] * 1000:.0f} ms")
    assert 0 <= median < 0.15 and latencies[-1] < 0.5, latencies

    # after: the recorded call in the view, the streamed element emptied (no data: nothing drawn, nothing saved)
    outputs = nb.cells[1].outputs
    assert [o["output_type"] for o in outputs] == ["display_data", "display_data"]
    view, emptied = outputs
    assert emptied["data"] == {}
    assert view["data"]["text/html"] == nb.cells[3].outputs[0]["data"]["text/html"]  # as a fresh rendering
    saved = nbformat.writes(nb)
    assert "anb-stream" not in saved and "streaming…" not in saved

    # the same as an unpaced run's output, apart from its ids, model spec and times
    def same(html: str) -> str:
        html = html.replace("demo?pace=0.02", "demo")
        html = re.sub(r"(?:&lt;|<|\b)\d[\d.,]* ?(?:ms|s|min|h)\b", "T", html)
        return re.sub(r"\d+", "N", html)
    assert [o for o in nb.cells[2].outputs if o["data"]] and len(nb.cells[2].outputs) == 1
    assert same(view["data"]["text/html"]) == same(nb.cells[2].outputs[0]["data"]["text/html"])
    nbformat.validate(nb)


def test_in_a_kernel_a_background_run_streams_into_its_own_cell_while_another_runs(tmp_path: Path) -> None:
    from nbformat.v4 import new_code_cell, new_notebook

    cells = [
        KERNEL_SETUP,
        'bg = %agent run --background --model demo?pace=0.02 "Summarise the inputs"',
        "while _ws.job(bg.id).status in ('queued', 'running'):\n    time.sleep(0.05)\ntime.sleep(0.5)",
        "print(json.dumps({'status': str(_ws.job(bg.id).status)}))",
    ]
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    received = _run_noting_messages(nb, tmp_path)
    assert json.loads(nb.cells[3].outputs[0]["text"]) == {"status": "succeeded"}
    stream_ids = {m["content"]["transient"]["display_id"] for _, _, m in received
                  if m["msg_type"] == "update_display_data" and m["content"]["data"]
                  and "stream" in m["content"]["transient"].get("agentnb", {})}
    assert len(stream_ids) == 1  # drawn while the next cell ran…
    # …into the element the run's cell made below its view, emptied at the end; nothing in the cell that ran then
    assert [o["output_type"] for o in nb.cells[1].outputs] == ["display_data", "display_data"]
    view, element = nb.cells[1].outputs
    assert element["data"] == {}
    assert not [o for o in nb.cells[2].outputs if o["output_type"] == "display_data"], nb.cells[2].outputs
    assert "anb-job" in view["data"]["text/html"]


def test_the_panel_shows_the_running_calls_stream_below_its_view_and_hides_it_after(tmp_path: Path) -> None:
    from agentnb.notebook.panel import Panel

    ws = Workspace(tmp_path / "ws")
    panel = Panel(ws, poll=0.05, idle_poll=0.1)
    streamed: list[tuple[float, str]] = []
    views: list[float] = []
    panel.stream.observe(lambda change: streamed.append((time.monotonic(), change["new"])), names="value")
    panel.view.observe(lambda change: views.append(time.monotonic()), names="value")
    try:
        panel.piece.value, panel.model.value = "plan-implement-verify", "demo?pace=0.02"
        panel.instruction.value = "Summarise the inputs"
        panel.run_button.click()
        panel.wait(120)
        time.sleep(0.3)  # the watcher's last turn
    finally:
        panel.close()
    job = panel.job
    assert job is not None and job.status == "succeeded"
    shown = [(t, v) for t, v in streamed if v]
    assert len(shown) >= 5 and all('class="anb-job anb-stream"' in v for _, v in shown)
    assert any("<b>Write</b>" in v for _, v in shown)
    assert all(b[0] - a[0] >= STREAM_INTERVAL * 0.9 for a, b in itertools.pairwise(shown))
    # the view is not redrawn while a call streams: between two draws of one call's stream it stays as it was
    key = re.compile(r'data-anb-stream="([^"]+)"')
    same_call = [(a[0], b[0]) for a, b in itertools.pairwise(shown)
                 if key.search(a[1]).group(1) == key.search(b[1]).group(1)]  # type: ignore[union-attr]
    assert len(same_call) >= 3
    assert not [t for t in views for begun, ended in same_call if begun < t < ended]
    assert panel.stream.value == "" and panel.stream.layout.display == "none"


def test_in_a_kernel_step_call_shows_the_call_as_it_streams_then_the_recorded_call(tmp_path: Path) -> None:
    from nbformat.v4 import new_code_cell, new_notebook


    cells = [
        KERNEL_SETUP,
        'job = %agent run --queue --model demo?pace=0.02 "Summarise the inputs"',
        "%agent step --call",  # the plan's two calls
        "%agent step --call",
        "%agent step --call",  # the implement movement's first call: the long report, written as it streams
        "print(json.dumps({'status': str(_ws.job(job.id).status),"
        " 'calls': len(_ws.events(job.id, kinds=['llm_response']))}))",
    ]
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    received = _run_noting_messages(nb, tmp_path)
    data = json.loads(nb.cells[5].outputs[0]["text"])
    assert data == {"status": "queued", "calls": 3}  # stepped three calls, paused after each
    draws = [m["content"] for _, i, m in received if i == 4
             and m["msg_type"] in ("display_data", "update_display_data")
             and "stream" in m["content"].get("transient", {}).get("agentnb", {})]
    shown = [c for c in draws if c["data"]]
    assert len(shown) >= 3, draws
    assert all('class="anb-job anb-stream"' in c["data"]["text/html"] and "<b>Write</b>" in c["data"]["text/html"]
               for c in shown)
    sizes = [c["transient"]["agentnb"]["stream"] for c in shown]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1], sizes  # the arguments grew in the view
    assert {tuple(c["transient"]["agentnb"]["call"]) for c in shown} == {(2, 1)}
    # after the step: the view shows the recorded call, the streamed element is emptied (nothing saved of it)
    outputs = nb.cells[4].outputs
    assert [o["output_type"] for o in outputs] == ["display_data", "display_data", "execute_result"]
    view, emptied, value = outputs  # the view (shrunk to a line: the Job, the cell's value, is shown in full)
    assert emptied["data"] == {} and "anb-stream" not in view["data"]["text/html"]
    assert "anb-stream" not in value["data"]["text/html"] and "Write" in value["data"]["text/html"]


def test_in_a_kernel_the_panels_stop_cuts_a_streaming_call_off_and_a_resume_asks_it_again(tmp_path: Path) -> None:
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell, new_notebook

    cells = [
        KERNEL_SETUP,
        "from agentnb.notebook.panel import Panel\n"
        "panel = Panel(_ws, magic=get_ipython().magics_manager.registry['AgentMagic'])\n"
        "panel.piece.value, panel.model.value = 'plan-implement-verify', 'demo?pace=0.05'\n"
        "panel.instruction.value = 'Summarise the inputs'\n"
        "panel.run_button.click()\n"
        # the implement movement's report (call 1 of run 2), seconds long at this pace: Stop once it has begun
        "while not [c for c in chunks if tuple(c[1:3]) == (2, 1) and c[3] > 40]:\n"
        "    time.sleep(0.005)\n"
        "stopped_at = time.time()\n"
        "panel.stop_button.click()\n"
        "panel.wait(60)\n"
        "job = panel.job\n"
        "cut = [c for c in chunks if tuple(c[1:3]) == (2, 1)]\n"
        "print(json.dumps({'stop_to_last_piece': cut[-1][0] - stopped_at, 'status': str(_ws.job(job.id).status),\n"
        "  'errors': [(e.where, e.movement_seq, e.iteration) for e in _ws.events(job.id, kinds=['error'])],\n"
        "  'responses': [(e.movement_seq, e.iteration) for e in _ws.events(job.id, kinds=['llm_response'])]}))",
        "panel.jobs.value = job.id\npanel.run_button.click()\npanel.wait(120)\n"
        "print(json.dumps({'status': str(_ws.job(job.id).status),\n"
        "  'requests': [(e.movement_seq, e.iteration) for e in _ws.events(job.id, kinds=['llm_request'])],\n"
        "  'responses': [(e.movement_seq, e.iteration) for e in _ws.events(job.id, kinds=['llm_response'])],\n"
        "  'again': len([c for c in chunks if tuple(c[1:3]) == (2, 1)])}))\n"
        "panel.close()",
    ]
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

    def printed(cell: int) -> dict[str, Any]:
        return json.loads("".join(o["text"] for o in nb.cells[cell].outputs if o["output_type"] == "stream"))

    stopped = printed(1)
    print(f"Stop → last streamed piece: {stopped['stop_to_last_piece'] * 1000:.0f} ms")
    assert stopped["stop_to_last_piece"] < 0.5  # the stream ends at once, not after the call
    assert stopped["status"] == "queued"  # paused
    assert stopped["errors"] == [["interrupted", 2, 1]]  # recorded as interrupted, no response from a partial one
    assert [2, 1] not in stopped["responses"]
    resumed = printed(2)
    assert resumed["status"] == "succeeded"
    assert resumed["requests"].count([2, 1]) == 2 and resumed["responses"].count([2, 1]) == 1  # asked again, once
    assert resumed["again"] > 5  # the call streamed again, from its start
