"""The panel widget, driven by setting widget values and clicking its buttons."""

from __future__ import annotations

import html
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _scripting import call, transition, write_piece, write_script
from IPython.core.interactiveshell import InteractiveShell

import agentnb
from agentnb import Workspace
from agentnb.models.prices import UnknownPriceWarning
from agentnb.notebook.panel import Panel
from agentnb.tools.base import unregister

Panels = Callable[..., Panel]


def _new(panel: Panel, instruction: str, piece: str = "plan-implement-verify", model: str = "demo") -> None:
    panel.piece.value = piece
    panel.model.value = model
    panel.instruction.value = instruction
    panel.run_button.click()
    panel.wait(60)


def test_run_from_the_panel_shows_job_progress_and_context(ws: Workspace) -> None:
    panel = Panel(ws)
    assert panel.jobs.options == () and "no job selected" in panel.view.value
    _new(panel, "Summarise the <inputs>")
    job = panel.job
    assert job is not None and job.status == "succeeded" and job.instruction == "Summarise the <inputs>"
    assert panel.instruction.value == ""
    tokens = sum(e.payload["usage"]["total_tokens"] for e in ws.events(job, kinds=["llm_response"]))
    assert panel.jobs.options == ((f"#{job.id} · succeeded · plan-implement-verify · {tokens:,} tokens · $0", job.id),)
    assert (panel.movements.value, panel.movements.max) == (3, 12)
    assert panel.movements_label.value == "3 of 12 movements"
    # the context bar shows the newest movement's last ratio and the piece's threshold marks
    last = ws.events(job, kinds=["llm_response"])[-1].payload["usage"]
    assert f'data-ratio="{last["ratio"]:.4f}"' in panel.context.value
    assert re.findall(r'data-mark="(\w+)" style="position:absolute;left:([\d.]+)%', panel.context.value) == [
        ("warn", "70.0"), ("prompt", "85.0"), ("force_transition", "95.0"), ("exhausted", "99.0")]
    assert f"{last['prompt_tokens']:,} / {last['window']:,} tokens" in panel.context.value
    # the live view is the job's HTML view, escaped
    assert panel.view.value == job._repr_html_()
    assert "Summarise the &lt;inputs&gt;" in panel.view.value
    # a finished job cannot be stepped or answered; a new one can be run
    assert panel.step_button.disabled and panel.step_call_button.disabled and panel.reply_button.disabled
    assert not panel.run_button.disabled and panel.stop_button.disabled


def test_step_call_and_step_movement_buttons(ws: Workspace) -> None:
    job = ws.submit("Summarise the inputs", piece="plan-implement-verify", model="demo")
    panel = Panel(ws)
    panel.select(job.id)
    assert not panel.step_call_button.disabled
    panel.step_call_button.click()
    panel.wait(60)
    assert len(ws.events(job, kinds=["llm_response"])) == 1 and ws.events(job, kinds=["transition"]) == []
    assert "1 LLM call ·" in panel.view.value
    panel.step_button.click()
    panel.wait(60)
    assert [e.payload["next_step"] for e in ws.events(job, kinds=["transition"])] == ["implement"]
    assert panel.movements.value == 1 and panel.job.status == "queued"
    # Run with an empty instruction continues the selected queued job to its end
    panel.run_button.click()
    panel.wait(60)
    assert panel.job.status == "succeeded" and panel.movements.value == 3
    assert len(ws.jobs()) == 1


def test_reply_is_enabled_only_while_the_job_waits_and_resumes_it(ws: Workspace) -> None:
    panel = Panel(ws)
    assert panel.reply_button.disabled
    _new(panel, "Summarise the inputs", piece="ask-first")
    job = panel.job
    assert job.status == "waiting_human"
    assert not panel.reply_button.disabled and not panel.reply_text.disabled
    assert panel.step_button.disabled
    assert "waiting for you:" in panel.view.value
    panel.reply_text.value = "Use <bullets>."
    panel.reply_button.click()
    panel.wait(60)
    assert panel.job.status == "succeeded", panel.message.value
    assert [c["body"] for c in ws.comments(job) if c["author"] == "user"] == ["Use <bullets>."]
    assert re.search(r"✎</span> <b>user</b>: <pre[^>]*>Use &lt;bullets&gt;\.</pre>", panel.view.value)
    assert panel.reply_button.disabled and panel.reply_text.value == ""


def test_bad_input_is_shown_on_the_message_line(ws: Workspace) -> None:
    panel = Panel(ws)
    _new(panel, "x", model="gpt-9")
    assert "unknown model spec &#x27;gpt-9&#x27;; allowed: demo" in panel.message.value
    assert ws.jobs() == []
    panel.model.value = "demo"
    panel.instruction.value = ""
    panel.run_button.click()
    panel.wait(60)
    assert "write an instruction to start a new job" in panel.message.value


class Gate:
    """A tool that blocks a job inside an LLM call until the test opens it: a slow job, on demand."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.open = threading.Event()
        self.calls = 0
        self.entered = threading.Semaphore(0)
        self.passes = threading.Semaphore(0)

        @agentnb.tool(name="TestPanelGate")
        def panel_gate() -> str:
            """Wait for the test."""
            self.calls += 1
            self.entered.release()
            deadline = time.monotonic() + 120  # only a guard against a test that never opens it
            while not self.open.is_set() and time.monotonic() < deadline:
                if self.passes.acquire(timeout=0.02):
                    return "let through"
            return "opened" if self.open.is_set() else "timed out"

        self.piece = write_piece(tmp_path, "gated", {"movements": [{
            "name": "work", "persona": "p", "instruction": "i", "tools": ["TestPanelGate"],
            "rules": [{"condition": "done", "next": "COMPLETE"}]}]})

    def list_piece(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """List the gated piece in ./pieces as ``gated``: subtasks may only name listed pieces."""
        monkeypatch.chdir(self.tmp_path)
        (self.tmp_path / "pieces").mkdir(exist_ok=True)
        (self.tmp_path / "pieces" / "gated.yaml").write_text(self.piece.read_text(encoding="utf-8"), encoding="utf-8")

    def script(self, name: str = "gate", calls: int = 2) -> str:
        return write_script(self.tmp_path, name, {"work": [call("TestPanelGate")] * calls + [transition("COMPLETE")]})

    def let_one(self) -> None:
        """Let the call waiting at the gate go on; the gate stays closed for the next one."""
        self.passes.release()

    def wait_entered(self) -> None:
        assert self.entered.acquire(timeout=60), "the job never reached the gate"


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[Gate]:
    g = Gate(tmp_path)
    try:
        yield g
    finally:
        g.open.set()
        unregister("TestPanelGate")


@pytest.fixture
def panels() -> Iterator[Panels]:
    """Panels that poll fast, closed (their watcher threads ended) after the test."""
    made: list[Panel] = []

    def make(ws: Workspace, **kwargs: Any) -> Panel:
        panel = Panel(ws, poll=0.05, idle_poll=0.1, **kwargs)
        made.append(panel)
        return panel

    yield make
    for panel in made:
        panel.close()


def _until(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _said(panel: Panel) -> str:
    """The message line's text."""
    return html.unescape(re.sub(r"<[^>]+>", "", panel.message.value))


def _label(panel: Panel, job_id: int) -> str:
    return next(label for label, value in panel.jobs.options if value == job_id)


def _tokens(ws: Workspace, job_id: int) -> int:
    return sum(e.payload["usage"]["total_tokens"] for e in ws.events(job_id, kinds=["llm_response"]))


def test_stop_pauses_a_running_job_after_its_current_call(ws: Workspace, gate: Gate, panels: Panels) -> None:
    panel = panels(ws)
    panel.piece.value, panel.model.value, panel.instruction.value = str(gate.piece), gate.script(), "t"
    assert panel.stop_button.disabled and panel.stop_button.button_style == ""
    panel.run_button.click()  # returns at once: the job runs in the panel's thread
    gate.wait_entered()
    assert panel.busy and not panel.stop_button.disabled and panel.run_button.disabled
    # an enabled Stop is orange; a disabled button loses its colour so it does not look pressable
    assert panel.stop_button.button_style == "warning" and panel.run_button.button_style == ""
    panel.stop_button.click()
    assert "will pause after its current LLM call" in panel.message.value
    gate.open.set()
    panel.wait(60)
    job = panel.job
    assert job.status == "queued"  # stored as queued: resumable
    assert len(ws.events(job, kinds=["llm_response"])) == 1
    assert not panel.step_button.disabled and panel.stop_button.disabled
    assert panel.stop_button.button_style == "" and panel.run_button.button_style == "primary"


def test_stop_pauses_the_job_the_panel_runs_not_the_selected_one(ws: Workspace, gate: Gate, panels: Panels) -> None:
    done = ws.run(ws.submit("an earlier job", piece="plan-implement-verify", model="demo"))
    assert done.status == "succeeded"
    panel = panels(ws)
    panel.piece.value, panel.model.value, panel.instruction.value = str(gate.piece), gate.script(calls=3), "slow"
    panel.run_button.click()
    gate.wait_entered()
    slow = panel.jobs.value
    assert slow != done.id
    panel.jobs.value = done.id  # the user looks at the finished job meanwhile
    assert panel.job.id == done.id
    panel.stop_button.click()
    message = panel.message.value
    assert f"Stop: job {slow}, run from this panel (not the selected job {done.id})" in message, message
    assert "will pause after its current LLM call" in message
    gate.open.set()
    panel.wait(60)
    # the running job paused after the call it was in; the finished one is as it was
    assert len(ws.events(slow, kinds=["llm_response"])) == 1
    assert ws.job(slow).status == "queued"
    assert ws.events(slow, kinds=["job_status"])[-1].payload["reason"] == "paused on request after its current LLM call"
    assert ws.job(done.id).status == "succeeded"
    # the stale "will pause" note is replaced by what happened
    assert re.fullmatch(f'<div style="[^"]*">job {slow} is paused \\(Stop\\); Run or Step continues it</div>',
                        panel.message.value), panel.message.value
    assert _label(panel, slow) == f"#{slow} · paused · gated · {_tokens(ws, slow):,} tokens · $0"
    # Run on the paused job continues it to its end
    panel.jobs.value = slow
    panel.run_button.click()
    panel.wait(60)
    assert ws.job(slow).status == "succeeded" and panel.message.value == ""


def test_stop_reaches_the_subtasks_the_panel_runs(ws: Workspace, gate: Gate, panels: Panels, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # a subtask may only run a listed piece (./pieces) within the rights of the movement that hands it out
    gate.list_piece(monkeypatch)
    fan = write_piece(tmp_path, "gated-fan", {"movements": [
        {"name": "split", "persona": "p", "instruction": "i", "tools": ["TestPanelGate"],
         "rules": [{"next": "WAIT_SUBTASKS"}], "default_next": "merge"},
        {"name": "merge", "persona": "p", "instruction": "i", "rules": [{"next": "COMPLETE"}]}]})
    child = gate.script("child")
    parent = write_script(tmp_path, "parent", {
        "split": [transition("WAIT_SUBTASKS", summary="split", subtasks=[
            {"instruction": "part one", "piece": "gated", "model": child},
            {"instruction": "part two", "piece": "gated", "model": child}])],
        "merge": [transition("COMPLETE", summary="merged")],
    })
    panel = panels(ws)
    panel.piece.value, panel.model.value, panel.instruction.value = str(fan), parent, "two parts"
    panel.run_button.click()
    gate.wait_entered()  # the first subtask is inside its first call
    root = panel._target
    assert root is not None
    first, second = (c.id for c in ws.children(root))
    panel.stop_button.click()
    assert f"Stop: job {root} and its subtask {first}, run from this panel" in panel.message.value
    gate.open.set()
    panel.wait(60)
    # the running subtask paused after its call, the next one never started, the parent waits for them
    assert len(ws.events(first, kinds=["llm_response"])) == 1 and ws.job(first).status == "queued"
    assert ws.events(second, kinds=["llm_response"]) == [] and ws.job(second).status == "queued"
    assert ws.job(root).status == "waiting_subtasks"
    assert gate.calls == 1


def test_stop_pauses_a_movement_step_after_its_current_call(ws: Workspace, gate: Gate, panels: Panels) -> None:
    job = ws.submit("t", piece=str(gate.piece), model=gate.script(calls=3))
    panel = panels(ws)
    panel.select(job.id)
    panel.step_button.click()  # the whole movement: four calls
    gate.wait_entered()
    panel.stop_button.click()
    assert f"Stop: job {job.id}, run from this panel, will pause" in panel.message.value
    gate.open.set()
    panel.wait(60)
    assert len(ws.events(job, kinds=["llm_response"])) == 1 and ws.events(job, kinds=["transition"]) == []
    assert f"job {job.id} is paused (Stop)" in panel.message.value
    # a later step is not cut short by that Stop
    panel.step_button.click()
    panel.wait(60)
    assert [e.payload["next_step"] for e in ws.events(job, kinds=["transition"])] == ["COMPLETE"]


def test_a_stop_during_the_call_that_hands_out_subtasks_starts_none(ws: Workspace, gate: Gate, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # ws.stop, as the panel and %agent stop use it: the parent's last call ends in WAIT_SUBTASKS
    gate.list_piece(monkeypatch)
    child = write_script(tmp_path, "child", {"work": [transition("COMPLETE")]})
    parent = write_script(tmp_path, "parent", {
        "split": [{"tool_calls": [{"name": "TestPanelGate", "arguments": {}},
                                  {"name": "transition", "arguments": {
                                      "next_step": "WAIT_SUBTASKS", "summary": "split", "subtasks": [
                                          {"instruction": "part one", "piece": "gated", "model": child}]}}]}],
        "merge": [transition("COMPLETE", summary="merged")],
    })
    fan_out = write_piece(tmp_path, "fan", {"movements": [
        {"name": "split", "persona": "p", "instruction": "i", "tools": ["TestPanelGate"],
         "rules": [{"condition": "split", "next": "WAIT_SUBTASKS"}], "default_next": "merge"},
        {"name": "merge", "persona": "p", "instruction": "i", "tools": [],
         "rules": [{"condition": "done", "next": "COMPLETE"}]}]})
    job = ws.submit("t", piece=str(fan_out), model=parent)
    runner = threading.Thread(target=ws.run, args=(job.id,))
    runner.start()
    gate.wait_entered()
    assert ws.stop(job) == [job.id]
    gate.open.set()
    runner.join(60)
    assert ws.job(job).status == "waiting_subtasks"
    (part,) = ws.children(job)
    assert part.status == "queued" and ws.events(part, kinds=["llm_response"]) == []
    assert ws.run(job).status == "succeeded"  # Run again: the subtask runs, then the parent merges


def test_list_and_view_follow_a_running_job_live(ws: Workspace, gate: Gate, panels: Panels) -> None:
    panel = panels(ws)
    panel.piece.value, panel.model.value, panel.instruction.value = str(gate.piece), gate.script(calls=3), "t"
    panel.run_button.click()
    gate.wait_entered()
    job_id = panel.jobs.value
    gate.let_one()
    gate.wait_entered()  # the second call
    gate.let_one()
    gate.wait_entered()  # the third call: blocked there until the gate opens
    # the list says what the view says: running, with the tokens of the calls recorded so far (the third
    # call's response is committed before its tool runs)
    _until(lambda: "3 LLM calls" in panel.view.value, "the view to show the calls so far")
    _until(lambda: _label(panel, job_id) == f"▶ #{job_id} · running · gated · {_tokens(ws, job_id):,} tokens · $0",
           "the list to follow the job")
    assert _tokens(ws, job_id) > 0
    assert "running</span>" in panel.view.value
    gate.open.set()
    panel.wait(60)
    assert _label(panel, job_id) == f"#{job_id} · succeeded · gated · {_tokens(ws, job_id):,} tokens · $0"


def test_the_panel_polls_no_store_while_it_runs_the_selected_job(ws: Workspace, gate: Gate, panels: Panels,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # The job the panel's action runs wakes the view on each of its commits (agentnb.live): while it is selected,
    # the watcher never reads the store's change mark; it polls it again once the run is over.
    panel = panels(ws)
    reads: list[float] = []
    mark = ws.store.change_mark
    monkeypatch.setattr(ws.store, "change_mark", lambda: (reads.append(time.monotonic()), mark())[1])
    panel.piece.value, panel.model.value, panel.instruction.value = str(gate.piece), gate.script(calls=2), "t"
    panel.run_button.click()
    gate.wait_entered()  # the first call waits at the gate: nothing commits meanwhile
    job_id = panel.jobs.value
    _until(lambda: "1 LLM call" in panel.view.value, "the view to show the first call")
    before = len(reads)
    time.sleep(0.5)  # ten polls' worth (poll=0.05)
    assert len(reads) == before
    gate.let_one()
    gate.wait_entered()  # the second call's events woke the view, with no store mark read
    _until(lambda: "2 LLM calls" in panel.view.value, "the view to show the second call")
    _until(lambda: _label(panel, job_id).startswith(f"▶ #{job_id} · running"), "the list to follow")
    assert len(reads) == before
    gate.open.set()
    panel.wait(60)
    _until(lambda: len(reads) > before, "the watcher to poll the store again")
    _until(lambda: _label(panel, job_id).startswith(f"#{job_id} · succeeded"), "the list to show the end")


def test_list_shows_jobs_run_outside_the_panel(ws: Workspace, panels: Panels) -> None:
    panel = panels(ws)
    assert panel.jobs.options == ()
    job = ws.run(ws.submit("from a notebook cell", piece="plan-implement-verify", model="demo"))
    _until(lambda: len(panel.jobs.options) == 1, "the list to show the new job")
    _until(lambda: panel.jobs.options[0][0].startswith(f"#{job.id} · succeeded · plan-implement-verify"),
           "its final status")
    ws.step(ws.submit("stepped", piece="plan-implement-verify", model="demo"))
    _until(lambda: len(panel.jobs.options) == 2 and " · paused · " in panel.jobs.options[1][0],
           "a stepped job to show as paused")


def test_a_paused_job_shows_as_paused_in_view_list_and_frames(ws: Workspace, panels: Panels) -> None:
    job = ws.step(ws.submit("one movement at a time", piece="plan-implement-verify", model="demo"))
    fresh = ws.submit("not started", piece="single", model="demo")
    assert job.status == "queued"  # what the store keeps: the job can be claimed and resumed
    panel = panels(ws)
    panel.select(job.id)
    assert _label(panel, job.id).startswith(f"#{job.id} · paused · ")
    assert _label(panel, fresh.id).startswith(f"#{fresh.id} · queued · ")
    assert re.search(r'class="anb-badge anb-st-paused"[^>]*>paused</span>', panel.view.value)
    assert not panel.step_button.disabled  # a paused job can be stepped on
    frame = ws.frames.jobs().set_index("job")
    assert frame.loc[job.id, "display_status"] == "paused" and frame.loc[job.id, "status"] == "queued"
    assert frame.loc[fresh.id, "display_status"] == "queued"
    ws.run(job)
    assert ws.frames.jobs().set_index("job").loc[job.id, "display_status"] == "succeeded"


def test_a_waiting_job_shows_its_question_once(ws: Workspace, panels: Panels) -> None:
    panel = panels(ws)
    _new(panel, "Summarise the inputs", piece="ask-first")
    job = panel.job
    question = ws.events(job, kinds=["transition"])[-1].payload["question"]
    assert panel.view.value.count(question) == 1
    assert "waiting for you:" in panel.view.value
    assert "↑ above, waiting for your answer" in panel.view.value  # the movement's transition points to it
    assert _said(panel) == f"new job #{job.id} with ask-first on demo"  # and no error


def test_refresh_picks_up_new_piece_files(ws: Workspace, panels: Panels, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # ./pieces is looked up from the notebook's folder
    (tmp_path / "pieces").mkdir()
    panel = panels(ws)
    assert "brand-new" not in panel.piece.options
    write_piece(tmp_path / "pieces", "brand-new", {"movements": [{
        "name": "only", "persona": "p", "instruction": "i", "tools": [],
        "rules": [{"condition": "done", "next": "COMPLETE"}]}]})
    panel.refresh_button.click()
    assert "brand-new" in panel.piece.options
    script = write_script(tmp_path, "s", {"only": [transition("COMPLETE")]})
    _new(panel, "t", piece="brand-new", model=script)
    assert panel.job.piece == "brand-new" and panel.job.status == "succeeded", panel.message.value


def test_piece_box_takes_a_yaml_path_and_notebook_variables(ws: Workspace, panels: Panels, tmp_path: Path) -> None:
    path = write_piece(tmp_path, "from-a-file", {"movements": [{
        "name": "only", "persona": "p", "instruction": "i", "tools": [],
        "rules": [{"condition": "done", "next": "COMPLETE"}]}]})
    written = agentnb.parse_piece(path.read_text().replace("from-a-file", "written-here"))
    script = write_script(tmp_path, "s", {"only": [transition("COMPLETE")]})
    ns: dict[str, Any] = {"piece": written, "PIECE": path, "SCRIPT": script.split(":", 1)[1], "n": 3}
    panel = panels(ws, namespace=ns)
    for ref, name in ((str(path), "from-a-file"), ("piece", "written-here"), ("{PIECE}", "from-a-file"),
                      ("$piece", "written-here")):
        _new(panel, f"run {ref}", piece=ref, model="scripted:{SCRIPT}")
        assert _said(panel).startswith(f"new job #{panel.job.id} with {name} on scripted:{script.split(':', 1)[1]}"), \
            (ref, panel.message.value)
        assert (panel.job.instruction, panel.job.piece, panel.job.status) == (f"run {ref}", name, "succeeded")
    jobs = len(ws.jobs())
    allowed = "allowed: a piece name from the list, a YAML path, or a notebook variable holding a Piece or a path"
    for ref, error in (("{nothing}", "piece &#x27;{nothing}&#x27;: the notebook has no variable &#x27;nothing&#x27;"),
                       ("n", "piece &#x27;n&#x27;: variable &#x27;n&#x27; holds a int"),
                       ("nonesuch", "piece &#x27;nonesuch&#x27; is neither a piece in ")):
        _new(panel, "x", piece=ref, model="demo")
        assert error in panel.message.value and allowed in panel.message.value, panel.message.value
    assert len(ws.jobs()) == jobs  # nothing was submitted


NOTEBOOK_PIECE = """
import agentnb
piece = agentnb.parse_piece('''
name: release-notes
movements:
  - name: draft
    persona: You write release notes.
    instruction: Write them.
    rules:
      - {condition: done, next: COMPLETE}
''')
"""


def test_the_panel_runs_a_piece_written_in_the_notebook(tmp_path: Path) -> None:
    # as in notebook 04: a Piece parsed from text in a cell, a scripted model written next to it
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "agentnb")
    sh.run_line_magic("config", f"AgentMagic.workspace = {str(tmp_path / 'ws')!r}")
    script = write_script(tmp_path, "s", {"draft": [transition("COMPLETE")]})
    assert sh.run_cell(NOTEBOOK_PIECE + f"SCRIPT = {script.split(':', 1)[1]!r}\n").success
    panel = sh.run_line_magic("agent", "panel")
    try:
        _new(panel, "Write the release notes", piece="piece", model="scripted:$SCRIPT")
        assert _said(panel) == f"new job #{panel.job.id} with release-notes on {script}"
        assert (panel.job.piece, panel.job.status) == ("release-notes", "succeeded")
    finally:
        panel.close()


def test_panel_magic_returns_the_panel_on_the_session_workspace(tmp_path: Path) -> None:
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "agentnb")
    sh.run_line_magic("config", f"AgentMagic.workspace = {str(tmp_path / 'ws')!r}")
    job = sh.run_line_magic("agent", 'run --queue "Summarise the inputs"')
    panel = sh.run_line_magic("agent", "panel")
    assert isinstance(panel, Panel)
    assert panel.ws.root == (tmp_path / "ws").resolve()
    assert panel.jobs.value == job.id  # the session's last job is selected


def test_a_saved_panel_reads_as_one_line_where_the_widget_cannot_be_drawn(ws: Workspace) -> None:
    # ipywidgets stores repr() as the output's text/plain (GitHub, nbviewer, a notebook without a kernel)
    panel = Panel(ws)
    _new(panel, "Summarise the <inputs>")
    bundle = panel._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    text = bundle["text/plain"]
    assert text == f"agentnb panel of workspace {ws.root.name!r} (interactive: run the cell in a live kernel)"
    assert "<inputs>" not in text and "children" not in text


def test_a_kernel_saves_a_snapshot_of_the_panel_beside_the_widget(tmp_path: Path) -> None:
    # JupyterLab draws a widget output with the widget renderer only, so after a kernel restart it
    # shows "model not found" there: the snapshot must be an output of its own, updated as the panel is
    import nbformat
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell, new_notebook

    cells = [
        '%load_ext agentnb\n%config AgentMagic.workspace = "agentnb-data"',
        'first = %agent run --model demo "Write the <report>"',
        # a watcher that sleeps: the snapshot below changes only when the next cell refreshes the panel
        "from agentnb.notebook.panel import Panel\npanel = Panel(_agent_magic.ws, magic=_agent_magic, idle_poll=3600)\npanel",
        'second = %agent run --queue --model demo "Another one"\npanel.refresh()',
    ]
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    setup = "_agent_magic = get_ipython().magics_manager.registry['AgentMagic']"
    nb.cells[0].source += "\n" + setup
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    widget, snapshot = nb.cells[2].outputs
    assert set(widget["data"]) == {"text/plain", "application/vnd.jupyter.widget-view+json"}
    assert widget["data"]["text/plain"] == ("agentnb panel of workspace 'agentnb-data' "
                                            "(interactive: run the cell in a live kernel)")
    page = snapshot["data"]["text/html"]
    assert 'class="anb-panel-fallback anb-fb-' in page and "run the cell in a live kernel" in page
    # the snapshot followed the panel: both jobs, and the selected one's header
    assert "#1 · succeeded · plan-implement-verify" in page and "#2 · queued · plan-implement-verify" in page
    assert "<b>Job 1</b>" in page and "Write the &lt;report&gt;" in page
    text = snapshot["data"]["text/plain"]
    assert text.splitlines()[0].startswith("agentnb panel of workspace 'agentnb-data': a saved snapshot")
    assert "#2 · queued · plan-implement-verify · 0 tokens" in text
    nbformat.validate(nb)


def test_context_bar_marks_the_thresholds_the_job_runs_with(ws: Workspace, panels: Panels) -> None:
    # a job's context= overrides its piece's thresholds: the bar marks what the run acts on, as the plots do
    job = ws.submit("Summarise the inputs", piece="plan-implement-verify", model="demo",
                    context={"thresholds": {"warn": 0.3, "prompt": 0.5}})
    panel = panels(ws)
    panel.select(job.id)
    marks = re.findall(r'data-mark="(\w+)" style="position:absolute;left:([\d.]+)%', panel.context.value)
    assert marks == [("warn", "30.0"), ("prompt", "50.0"), ("force_transition", "95.0"), ("exhausted", "99.0")]
    assert "thresholds: warn 30% · prompt 50% · force_transition 95% · exhausted 99%" in panel.context.value
    assert ws.frames.thresholds(job) == {"warn": 0.3, "prompt": 0.5, "force_transition": 0.95, "exhausted": 0.99}
    # another job of the same piece, submitted without context=, keeps the piece's marks
    plain = ws.submit("Summarise the inputs", piece="plan-implement-verify", model="demo")
    panel.select(plain.id)
    marks = re.findall(r'data-mark="(\w+)" style="position:absolute;left:([\d.]+)%', panel.context.value)
    assert marks == [("warn", "70.0"), ("prompt", "85.0"), ("force_transition", "95.0"), ("exhausted", "99.0")]


def _widget_state(panel: Panel) -> str:
    """Everything the panel's widgets send to the browser (and a saved notebook keeps), as text."""
    import json

    import ipywidgets as w

    states: list[Any] = []

    def walk(widget: w.Widget) -> None:
        states.append(widget.get_state())
        for child in getattr(widget, "children", ()):
            walk(child)

    walk(panel)
    return json.dumps(states, default=str)


def test_selecting_a_job_shows_its_piece_and_model(ws: Workspace, panels: Panels, tmp_path: Path) -> None:
    only = {"movements": [{"name": "only", "persona": "p", "instruction": "i", "tools": [],
                           "rules": [{"condition": "done", "next": "COMPLETE"}]}]}
    path = write_piece(tmp_path, "from-a-file", only)
    script = write_script(tmp_path, "s", {"only": [transition("COMPLETE")]})
    written = agentnb.parse_piece(path.read_text().replace("from-a-file", "written-here"))
    jobs = [ws.submit("one", piece="plan-implement-verify", model="demo"),
            ws.submit("two", piece="single", model=script),
            ws.submit("three", piece=str(path), model=script),
            ws.submit("four", piece=written, model=script)]
    panel = panels(ws)
    assert (panel.piece.value, panel.model.value) == ("plan-implement-verify", "demo")  # nothing selected yet
    # as typed to run them again: a listed name, the YAML path, the store's own copy of a piece written in code
    expected = {jobs[0].id: ("plan-implement-verify", "demo"), jobs[1].id: ("single", script),
                jobs[2].id: (str(path), script), jobs[3].id: (f"written-here (from job {jobs[3].id})", script)}
    for job_id in (2, 1, 4, 3, 2):  # a click in the list sets the Select's value
        panel.jobs.value = job_id
        assert (panel.piece.value, panel.model.value) == expected[job_id], job_id
    # what the user types after selecting wins, also over the watcher's redraws
    panel.jobs.value = jobs[0].id
    panel.piece.value = "single"
    ws.run(jobs[0])  # the list and the view move on
    _until(lambda: " · succeeded · " in _label(panel, jobs[0].id), "the list to follow the job")
    panel.refresh()
    assert (panel.piece.value, panel.model.value) == ("single", "demo")
    # another job selected: its own piece and model again
    panel.select(jobs[2].id)
    assert (panel.piece.value, panel.model.value) == expected[jobs[2].id]


def test_run_from_a_selected_job_starts_a_new_job_with_its_piece_and_model(ws: Workspace, panels: Panels,
                                                                         tmp_path: Path) -> None:
    script = write_script(tmp_path, "s", {"only": [transition("COMPLETE")]})
    written = agentnb.parse_piece("""
name: written-here
movements:
  - name: only
    persona: p
    instruction: i
    rules:
      - {condition: done, next: COMPLETE}
""")
    queued = ws.submit("a queued job", piece=written, model=script)
    asked = ws.run(ws.submit("an earlier job", piece="ask-first", model="demo"))
    panel = panels(ws)
    # a queued job selected, an instruction written: a new job on its piece and model; the queued one stays as it was
    panel.select(queued.id)
    panel.instruction.value = "run it again"
    panel.run_button.click()
    panel.wait(60)
    new = panel.job
    assert new.id not in (queued.id, asked.id) and len(ws.jobs()) == 3
    assert (new.instruction, new.piece, new.model, new.status) == ("run it again", "written-here", script, "succeeded")
    assert ws.piece(new).to_yaml() == ws.piece(queued).to_yaml()  # the store's copy: it has no file
    assert ws.job(queued).status == "queued" and [e.kind for e in ws.events(queued)] == ["job_status"]
    assert _said(panel) == f"new job #{new.id} with written-here on {script}; job #{queued.id} is left as it was"
    # the boxes still name what the new job ran
    assert panel.piece.value == f"written-here (from job {queued.id})" and panel.model.value == script
    # from a job waiting for a reply: a new job, the waiting one is not answered
    panel.select(asked.id)
    panel.instruction.value = "ask me again"
    panel.run_button.click()
    panel.wait(60)
    again = panel.job
    assert (again.piece, again.model, again.instruction) == ("ask-first", "demo", "ask me again")
    assert ws.job(asked).status == "waiting_human" and [c for c in ws.comments(asked) if c["author"] == "user"] == []
    assert _said(panel) == f"new job #{again.id} with ask-first on demo; job #{asked.id} is left as it was"
    # an edited box wins over the selected job's
    panel.select(queued.id)
    panel.model.value = "demo"
    panel.piece.value = "single"
    panel.instruction.value = "edited"
    panel.run_button.click()
    panel.wait(60)
    assert (panel.job.piece, panel.job.model) == ("single", "demo")


def test_the_piece_box_names_a_piece_the_store_keeps(ws: Workspace, panels: Panels) -> None:
    written = agentnb.parse_piece(Path(agentnb.__file__).parent.joinpath("pieces", "single.yaml").read_text()
                                  .replace("name: single", "name: my-single"))
    kept = ws.submit("t", piece=written, model="demo")
    panel = panels(ws)
    panel.piece.value = f"my-single (from job {kept.id})"  # as typed, without selecting the job
    assert panel.piece_choice().to_yaml() == ws.piece(kept).to_yaml()
    for text, error in ((f"nonesuch (from job {kept.id})", f"job {kept.id} ran piece 'my-single', not 'nonesuch'"),
                        ("my-single (from job 99)", "there is no job 99 in this workspace")):
        _new(panel, "x", piece=text, model="demo")
        assert f"piece {text!r}: {error}; allowed: " in _said(panel), _said(panel)
    assert len(ws.jobs()) == 1


def test_a_key_in_a_jobs_model_spec_never_reaches_the_panel(ws: Workspace, panels: Panels, loopback: Any) -> None:
    from openai_server import reply

    key = "sk-proj-AbCdEf0123456789ghIJkl"
    srv = loopback(key, actions=[reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "ok"})])])
    # a user pasted the key where the model name goes
    job = ws.submit("t", piece="single", model=f"openai:{key}")
    panel = panels(ws)
    panel._ipython_display_()  # the saved snapshot too
    panel.select(job.id)
    assert (panel.piece.value, panel.model.value) == ("single", "openai:***")
    assert key not in _widget_state(panel) and key not in panel.fallback_bundle()["text/html"]
    assert "model <code>openai:***</code>" in panel.view.value
    # Run from there: the job's own spec, not the masked text; the message line shows it masked
    panel.instruction.value = "again"
    with pytest.warns(UnknownPriceWarning) as warned:  # the panel's list prices the new job's call
        panel.run_button.click()
        panel.wait(60)
    assert [str(w.message) for w in warned if key in str(w.message)] == []
    new = panel.job
    assert new.id != job.id and new.model == f"openai:{key}" and new.status == "succeeded", _said(panel)
    assert srv.received[0].body["model"] == key
    assert _said(panel) == f"new job #{new.id} with single on openai:***; job #{job.id} is left as it was"
    assert key not in _widget_state(panel)


def test_in_a_kernel_the_boxes_follow_the_selected_job_and_run_a_new_one(tmp_path: Path) -> None:
    # a regression: with job 2 (single) selected, the boxes once still showed plan-implement-verify
    import nbformat
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell, new_notebook

    cells = [
        '%load_ext agentnb\n%config AgentMagic.workspace = "agentnb-data"\n'
        "_agent_magic = get_ipython().magics_manager.registry['AgentMagic']",
        'from pathlib import Path\nPath("s.yaml").write_text("movements:\\n  work:\\n    - tool_calls: [{name: transition, '
        'arguments: {next_step: COMPLETE, summary: done}}]\\n")\n'
        'first = %agent run --queue --piece plan-implement-verify --model demo "The first job"\n'
        'second = %agent run --queue --piece single --model scripted:s.yaml "The second job"',
        "from agentnb.notebook.panel import Panel\npanel = Panel(_agent_magic.ws, magic=_agent_magic)\npanel",
        # a click in the list sets the Select's value
        "for job in (first, second, first):\n    panel.jobs.value = job.id\n"
        "    print(job.id, panel.piece.value, panel.model.value, sep=' | ')",
        "panel.jobs.value = second.id\npanel.instruction.value = 'A new job'\npanel.run_button.click()\npanel.wait(60)\n"
        "new = panel.job\nprint(new.id, new.piece, new.model, new.status, new.instruction, sep=' | ')\n"
        "print(second.status, len(_agent_magic.ws.events(second)), sep=' | ')\nprint(panel.message.value)",
    ]
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    spec = f"scripted:{(tmp_path / 's.yaml').resolve()}"
    def printed(cell: int) -> list[str]:
        return "".join(o["text"] for o in nb.cells[cell].outputs if o["output_type"] == "stream").splitlines()

    assert printed(3) == [
        "1 | plan-implement-verify | demo", f"2 | single | {spec}", "1 | plan-implement-verify | demo"]
    new, second, message = printed(4)
    assert new == f"3 | single | {spec} | succeeded | A new job"
    assert second == "queued | 1"  # the selected job was neither run nor changed: its one event is its submit
    assert "new job #3 with single on scripted:" in message and "job #2 is left as it was" in message
    # what the browser was sent, as the saved notebook keeps it: the boxes show job 3's piece and model
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    boxes = {m["state"]["description"]: m["state"]["value"] for m in state.values()
             if m["model_name"] == "ComboboxModel"}
    assert boxes == {"Piece": "single", "Model": spec}
    nbformat.validate(nb)
