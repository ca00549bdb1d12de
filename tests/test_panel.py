"""The panel widget, driven by setting widget values and clicking its buttons."""

from __future__ import annotations

import re
import threading
from pathlib import Path

from IPython.core.interactiveshell import InteractiveShell

import agentnb
from _scripting import call, transition, write_piece, write_script
from agentnb import Workspace
from agentnb.panel import Panel
from agentnb.tools import unregister


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
    assert panel.jobs.options == ((f"#{job.id} · succeeded · plan-implement-verify · {tokens:,} tokens", job.id),)
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
    assert re.search(r"💬 <b>user</b>: <pre[^>]*>Use &lt;bullets&gt;\.</pre>", panel.view.value)
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


def test_stop_pauses_a_running_job_after_its_current_call(ws: Workspace, tmp_path: Path) -> None:
    gate = threading.Event()
    entered = threading.Event()

    @agentnb.tool(name="TestPanelGate")
    def panel_gate() -> str:
        """Wait for the test."""
        entered.set()
        return "opened" if gate.wait(20) else "timed out"

    try:
        script = write_script(tmp_path, "gate", {"work": [call("TestPanelGate"), call("TestPanelGate"),
                                                          transition("COMPLETE")]})
        piece = write_piece(tmp_path, "gated", {"movements": [{
            "name": "work", "persona": "p", "instruction": "i", "tools": ["TestPanelGate"],
            "rules": [{"condition": "done", "next": "COMPLETE"}]}]})
        panel = Panel(ws)
        panel.piece.options = [*panel.piece.options, str(piece)]
        panel.piece.value, panel.model.value, panel.instruction.value = str(piece), script, "t"
        panel.run_button.click()  # returns at once: the job runs in the panel's thread
        assert entered.wait(20)
        assert panel.busy and not panel.stop_button.disabled and panel.run_button.disabled
        panel.stop_button.click()
        assert "will pause after its current LLM call" in panel.message.value
        gate.set()
        panel.wait(60)
        job = panel.job
        assert job.status == "queued"  # paused, resumable
        assert len(ws.events(job, kinds=["llm_response"])) == 1
        assert not panel.step_button.disabled and panel.stop_button.disabled
    finally:
        gate.set()
        unregister("TestPanelGate")


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
