"""The %agent magic, driven through a real IPython InteractiveShell."""

from __future__ import annotations

import html
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from _scripting import call, transition, write_piece, write_script
from IPython.core.displaypub import CapturingDisplayPublisher
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import agentnb
from agentnb import Job, Workspace
from agentnb.notebook.magic import SUBCOMMANDS
from agentnb.tools.base import unregister


def _ws(tmp_path: Path) -> Workspace:
    return Workspace(tmp_path / "ws")


def _html(outputs: list[Any]) -> list[str]:
    return [o.data["text/html"] for o in outputs if "text/html" in o.data]


def _work_piece(tmp_path: Path, tools: list[str]) -> Path:
    return write_piece(tmp_path, "work", {"max_movements": 3, "movements": [{
        "name": "work", "persona": "You work.", "instruction": "Do it.", "tools": tools, "permission": "readonly",
        "rules": [{"condition": "done", "next": "COMPLETE"}]}]})


def test_run_returns_the_job_and_shows_it_live(shell: InteractiveShell, tmp_path: Path) -> None:
    with capture_output() as cap:
        result = shell.run_cell('t_job = %agent run --piece plan-implement-verify "Summarise the inputs"')
    assert result.error_in_exec is None
    job = shell.user_ns["t_job"]
    assert isinstance(job, Job) and job.status == "succeeded"
    assert job.piece == "plan-implement-verify" and job.model == "demo"
    assert Path(job.workdir).parent.parent == (tmp_path / "ws").resolve()
    views = _html(cap.outputs)
    assert len(views) >= 2  # the live view, then its update when the job ended
    assert 'class="anb-job"' in views[0]
    # `job = %agent run …` keeps the whole view, in its final state, where the run was (it used to
    # shrink to one summary line, leaving no way to the view)
    assert views[-1].count('<details class="anb-mv"') == 3 and "anb-st-succeeded" in views[-1]
    assert "➜ next step <b>COMPLETE</b>" in views[-1]
    # the value of the cell (its Out) is the job's full view
    with capture_output():
        shown = shell.run_cell(f"%agent show {job.id}").result.data
    assert shown.count('<details class="anb-mv"') == 3 and "➜ next step <b>COMPLETE</b>" in shown
    assert shell.run_line_magic("agent", "show").data == shown  # default JOB: the last one


def test_cell_magic_body_is_the_instruction_with_variables_filled(shell: InteractiveShell, tmp_path: Path) -> None:
    shell.user_ns["t_topic"] = "the <notes>"
    with capture_output():
        job = shell.run_cell_magic("agent", "--piece single", "Summarise {t_topic}\nas JSON like {{\"k\": 1}}.")
    assert job.instruction == 'Summarise the <notes>\nas JSON like {"k": 1}.'
    assert job.piece == "single"
    with capture_output():
        job2 = shell.run_line_magic("agent", 'run --queue "about {t_topic!r} and {{braces}}"')
    assert job2.instruction == "about 'the <notes>' and {braces}" and job2.status == "queued"


def test_help_prints_usage(shell: InteractiveShell, capsys: pytest.CaptureFixture[str]) -> None:
    assert shell.run_line_magic("agent", "--help") is None
    out = capsys.readouterr().out
    for sub in ("run", "step", "reply", "show", "jobs", "usage", "lessons", "panel", "pieces", "export", "plot"):
        assert f"\n  {sub} " in out
    shell.run_line_magic("agent", "step --help")
    out = capsys.readouterr().out
    assert "%agent step [--call] [job]" in out and "the next LLM call" in out
    shell.run_cell_magic("agent", "--help", "ignored")
    assert "%%agent [--piece P]" in capsys.readouterr().out


@pytest.mark.parametrize("line, message", [
    ("frobnicate", "%agent: unknown sub-command 'frobnicate'; allowed: run, step, reply, stop, show, jobs, usage, "
                   "lessons, panel, pieces, tools, export, plot, retry"),
    # every refusal names the sub-command first, like IPython's own magics (these once lacked it)
    ("step 999", "%agent step: no job 999 in workspace "),
    ("show t_nothing", "%agent show: JOB 't_nothing' is neither a job id nor a variable of the notebook"),
    ("step", "%agent step: no job yet in this session; give a job id (see %agent jobs)"),
    ('run --piece no-such-piece "x"', "%agent run: no-such-piece: unknown piece 'no-such-piece'; available: "),
    ('run --model gpt-9 "x"', "%agent run: unknown model spec 'gpt-9'; allowed: demo, scripted:<file.yaml>, "
                             "openai:<model>, replay:<job_id>"),
    ('run "unbalanced', "%agent: cannot split the line (No closing quotation); check the quotes"),
    ('run "about {t_undefined}"', "%agent run: {t_undefined} in the instruction names no variable of the notebook; "
                                  "write {{ and }} for literal braces"),
    ("run", '%agent run: the instruction is missing; e.g. %agent run "Summarise input/notes.md"'),
    ("run --colour red x", "%agent run: unrecognized arguments: --colour"),
    ("show --movement x", "%agent show: argument --movement: invalid int value: 'x'"),
])
def test_usage_errors_are_one_line(shell: InteractiveShell, line: str, message: str) -> None:
    with pytest.raises(UsageError) as info:
        shell.run_line_magic("agent", line)
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text


def test_usage_error_shows_one_line_without_traceback(shell: InteractiveShell) -> None:
    with capture_output() as cap:
        result = shell.run_cell("%agent frobnicate")
    assert isinstance(result.error_in_exec, UsageError)
    lines = [ln for ln in (cap.stdout + cap.stderr).splitlines() if ln.strip()]
    assert lines == ["UsageError: %agent: unknown sub-command 'frobnicate'; allowed: run, step, reply, stop, show, "
                     "jobs, usage, lessons, panel, pieces, tools, export, plot, retry, fork, batch, batches, compare"]
    # a bad model spec is refused before anything is stored
    with pytest.raises(UsageError):
        shell.run_line_magic("agent", 'run --model "scripted:/no/such/file.yaml" "x"')
    assert _ws_jobs(shell) == 0


def _ws_jobs(shell: InteractiveShell) -> int:
    return len(shell.run_line_magic("agent", "jobs"))


def test_step_by_call_then_by_movement_to_the_end(shell: InteractiveShell) -> None:
    with capture_output():
        job = shell.run_line_magic("agent", 'run --queue "Summarise the inputs"')
    ws = Workspace(shell.run_line_magic("config", "AgentMagic.workspace"))
    assert job.status == "queued" and ws.events(job, kinds=["llm_response"]) == []
    job = shell.run_line_magic("agent", "step --call")
    assert job.status == "queued" and job.current_movement == "plan"
    assert len(ws.events(job, kinds=["llm_response"])) == 1 and ws.events(job, kinds=["transition"]) == []
    assert "1 LLM call ·" in job._repr_html_()
    job = shell.run_line_magic("agent", f"step {job.id}")  # the rest of the movement
    assert [e.payload["next_step"] for e in ws.events(job, kinds=["transition"])] == ["implement"]
    job = shell.run_line_magic("agent", "step --call")
    assert len(ws.events(job, kinds=["movement_start"])) == 2 and ws.job(job.id).movement_seq == 2
    assert len(ws.events(job, kinds=["transition"])) == 1
    shell.user_ns["t_j"] = job
    while job.status == "queued":
        job = shell.run_line_magic("agent", "step t_j")
    assert job.status == "succeeded"
    assert len(ws.events(job, kinds=["movement_start"])) == 3
    with pytest.raises(UsageError, match=f"job {job.id} is succeeded; only a queued job can be stepped"):
        shell.run_line_magic("agent", "step")


def test_reply_from_the_magic_resumes_an_asking_job(shell: InteractiveShell) -> None:
    with capture_output():
        job = shell.run_line_magic("agent", 'run --piece ask-first "Summarise the inputs"')
    assert job.status == "waiting_human"
    assert "waiting for you:" in job._repr_html_()
    with pytest.raises(UsageError, match="only a queued job can be stepped — answer with %agent reply"):
        shell.run_line_magic("agent", "step")
    shell.user_ns["t_style"] = "bullets"
    with capture_output():
        job = shell.run_cell_magic("agent", f"reply {job.id} --run", "Use {t_style}.")
    assert job.status == "succeeded", job.error
    ws = job.workspace
    assert [c["body"] for c in ws.comments(job) if c["author"] == "user"] == ["Use bullets."]
    assert re.search(r"✎</span> <b>user</b>: <pre[^>]*>Use bullets\.</pre>", job._repr_html_())


def test_options_go_anywhere_among_a_sub_commands_words(shell: InteractiveShell) -> None:
    """`%agent reply JOB --run "text"` as well as `reply JOB "text" --run`: options anywhere, as shells take them."""
    with capture_output():
        job = shell.run_line_magic("agent", 'run "Summarise" --piece ask-first "the inputs"')
        assert job.status == "waiting_human" and job.instruction == "Summarise the inputs"
        job = shell.run_line_magic("agent", f'reply {job.id} --run "Use bullets."')
    assert job.status == "succeeded", job.error
    assert [c["body"] for c in job.workspace.comments(job) if c["author"] == "user"] == ["Use bullets."]
    with capture_output():
        queued = shell.run_line_magic("agent", 'run --queue "Summarise"')
        stepped = shell.run_line_magic("agent", f"step --call {queued.id}")
    assert stepped.id == queued.id and stepped.status == "queued"
    assert len(stepped.workspace.events(stepped, kinds=["llm_response"])) == 1
    with pytest.raises(UsageError, match=r"^%agent fork: the following arguments are required: --at$"):
        shell.run_line_magic("agent", f"fork --strict {job.id}")  # still checked, wherever the options are


def test_error_inside_a_job_is_in_its_view_not_raised(shell: InteractiveShell, tmp_path: Path) -> None:
    script = write_script(tmp_path, "short", {"work": [call("Glob", pattern="*")]})
    piece = _work_piece(tmp_path, ["Glob"])
    with capture_output():
        job = shell.run_line_magic("agent", f'run --piece {piece} --model {script} "t"')
    assert job.status == "failed" and job.error
    html = job._repr_html_()
    assert 'class="anb-error"' in html and job.error[:30] in html


def test_an_assigned_run_keeps_the_error_and_the_question_in_the_cell(shell: InteractiveShell, tmp_path: Path) -> None:
    # With `job = %agent run …` the Job is not displayed: what stays where the live view was must
    # still say why the job failed, or what it asks.
    script = write_script(tmp_path, "short", {"work": [call("Glob", pattern="*")]})
    piece = _work_piece(tmp_path, ["Glob"])
    with capture_output() as cap:
        assert shell.run_cell(f'failed = %agent run --piece {piece} --model {script} "t"').error_in_exec is None
    job = shell.user_ns.pop("failed")
    assert job.status == "failed" and "ran out of responses" in job.error
    assert cap.outputs and "ran out of responses" in _html(cap.outputs)[-1]
    with capture_output() as cap:
        shell.run_cell('asking = %agent run --piece ask-first "Summarise the <meeting>"')
    job = shell.user_ns.pop("asking")
    question = job.workspace.events(job, kinds=["transition"])[-1].question
    last = _html(cap.outputs)[-1]
    assert job.status == "waiting_human" and question and html.escape(question) in last
    assert f"%agent reply {job.id}" in last


def test_run_job_runs_a_queued_job_to_its_end(shell: InteractiveShell) -> None:
    with capture_output():
        job = shell.run_line_magic("agent", 'run --queue "Summarise the inputs"')
        job = shell.run_line_magic("agent", f"step {job.id} --call")
        shell.user_ns["t_q"] = job
        job = shell.run_line_magic("agent", "run --job t_q")
    assert job.status == "succeeded" and job.id == shell.user_ns["t_q"].id
    assert len(job.workspace.jobs()) == 1  # no new job was submitted
    assert len(job.workspace.events(job, kinds=["movement_start"])) == 3
    with pytest.raises(UsageError, match=f"job {job.id} is succeeded; only a queued job"):
        shell.run_line_magic("agent", f"run --job {job.id}")
    with pytest.raises(UsageError, match=r"^%agent run --job: the job already has .* remove an instruction, --piece$"):
        shell.run_line_magic("agent", f'run --job {job.id} --piece single "again"')
    with capture_output():
        asking = shell.run_line_magic("agent", 'run --piece ask-first "Summarise"')
    with pytest.raises(UsageError, match=r"is waiting_human; .* answer it with %agent reply"):
        shell.run_line_magic("agent", f"run --job {asking.id}")
    with capture_output():
        shell.run_line_magic("agent", f'reply {asking.id} "Bullets."')
        asking = shell.run_line_magic("agent", f"run -j {asking.id}")
    assert asking.status == "succeeded", asking.error


def test_ctrl_c_pauses_a_foreground_run_and_run_job_resumes_it(shell: InteractiveShell, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # A real SIGINT while the magic watches the job (as the notebook's stop button sends): the job
    # must be paused, not left `running` behind a thread the magic believes has ended.
    magic = shell.magics_manager.registry["AgentMagic"]
    ws = magic.ws
    stop_asked = threading.Event()
    real_stop = ws.stop

    def stop(job: Any) -> None:
        real_stop(job)
        stop_asked.set()

    monkeypatch.setattr(ws, "stop", stop)
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)

    @agentnb.tool(name="TestCtrlC")
    def press_ctrl_c() -> str:
        """Interrupt the notebook."""
        os.kill(os.getpid(), signal.SIGINT)
        pressed = stop_asked.wait(60)  # generous: CI machines are loaded
        time.sleep(0.5)  # the call goes on a little after the stop request: the magic must wait for it
        return "pressed" if pressed else "no stop"

    try:
        script = write_script(tmp_path, "ctrlc", {"work": [call("TestCtrlC"), call("Glob", pattern="*"),
                                                            transition("COMPLETE")]})
        piece = _work_piece(tmp_path, ["TestCtrlC", "Glob"])
        with capture_output() as cap:
            job = shell.run_line_magic("agent", f'run --piece {piece} --model {script} "t"')
        assert job.status == "queued"  # paused after the call that was running
        assert [e.payload["content"] for e in ws.events(job, kinds=["tool_result"])] == ["pressed"]
        assert f"job {job.id} paused after its current LLM call; continue with %agent run --job {job.id}" in cap.stdout
        assert not [t for t in threading.enumerate() if t.name == f"agentnb-job-{job.id}"]
        with capture_output():
            job = shell.run_line_magic("agent", f"run --job {job.id}")
        assert job.status == "succeeded" and len(ws.events(job, kinds=["llm_response"])) == 3
    finally:
        signal.signal(signal.SIGINT, old_handler)
        stop_asked.set()
        unregister("TestCtrlC")


def test_frames_and_pieces_are_dataframes(shell: InteractiveShell) -> None:
    with capture_output():
        job = shell.run_line_magic("agent", 'run "Summarise the inputs"')
    jobs = shell.run_line_magic("agent", "jobs")
    assert isinstance(jobs, pd.DataFrame) and list(jobs["job"]) == [job.id]
    usage = shell.run_line_magic("agent", "usage")
    assert isinstance(usage, pd.DataFrame)
    assert len(usage) == len(job.workspace.events(job, kinds=["llm_response"]))
    assert int(usage["total_tokens"].sum()) == sum(
        e.payload["usage"]["total_tokens"] for e in job.workspace.events(job, kinds=["llm_response"]))
    lessons = shell.run_line_magic("agent", f"lessons {job.id}")
    assert list(lessons["movement"]) == ["plan", "implement", "verify"]
    pieces = shell.run_line_magic("agent", "pieces")
    assert {"single", "plan-implement-verify", "ask-first", "fan-out"} <= set(pieces["piece"])
    row = pieces.set_index("piece").loc["plan-implement-verify"]
    assert row["movements"] == "plan → implement → verify" and row["max_movements"] == 12


class _Gate:
    """A tool that holds the job until the test (or the live view) opens the gate."""

    def __init__(self, name: str) -> None:
        self.open = threading.Event()
        self.name = name

        @agentnb.tool(name=name)
        def gate() -> str:
            """Wait for the gate."""
            return "opened" if self.open.wait(60) else "timed out"  # generous: CI machines are loaded


def test_background_run_returns_at_once_and_the_job_finishes(shell: InteractiveShell, tmp_path: Path) -> None:
    gate = _Gate("TestGateBackground")
    try:
        script = write_script(tmp_path, "gate", {"work": [call(gate.name), transition("COMPLETE")]})
        piece = _work_piece(tmp_path, [gate.name])
        with capture_output():
            job = shell.run_line_magic("agent", f'run --background --piece {piece} --model {script} "t"')
            assert job.status in ("queued", "running")  # returned while the job waits at the gate
            magic = shell.magics_manager.registry["AgentMagic"]
            watcher = magic.threads[job.id]
            assert watcher.is_alive()
            gate.open.set()
            watcher.join(30)
        final = job.refresh()
        assert final.status == "succeeded"
        tool_results = final.workspace.events(final, kinds=["tool_result"])
        assert tool_results[0].payload["content"] == "opened"
    finally:
        gate.open.set()
        unregister(gate.name)


class _WatchingPublisher(CapturingDisplayPublisher):
    """Records outputs and opens a gate when a published view contains a marker."""

    def __init__(self, marker: str, gate: threading.Event) -> None:
        super().__init__()
        self.marker, self.gate = marker, gate

    def publish(self, data: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        super().publish(data, *args, **kwargs)
        if self.marker in data.get("text/html", ""):
            self.gate.set()


def test_the_view_updates_while_the_job_runs(shell: InteractiveShell, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # The job's tool waits until the live view shows the message written just before it:
    # it can only be opened by an update published while the job is still running.
    gate = _Gate("TestGateLive")
    try:
        marker = "about to wait for the view"
        script = write_script(tmp_path, "live", {"work": [
            {"content": marker, "tool_calls": [{"name": "Glob", "arguments": {"pattern": "*"}}]},
            call(gate.name),
            transition("COMPLETE"),
        ]})
        piece = _work_piece(tmp_path, ["Glob", gate.name])
        pub = _WatchingPublisher(marker, gate.open)
        monkeypatch.setattr(shell, "display_pub", pub)
        job = shell.run_line_magic("agent", f'run --piece {piece} --model {script} "t"')
        assert job.status == "succeeded"
        results = job.workspace.events(job, kinds=["tool_result"])
        assert results[1].payload["tool"] == gate.name and results[1].payload["content"] == "opened"
        assert len(pub.outputs) >= 3  # the first view, an update while running, the summary
    finally:
        gate.open.set()
        unregister(gate.name)


def test_export_writes_the_job_as_a_notebook(shell: InteractiveShell, tmp_path: Path) -> None:
    import nbformat

    with capture_output():
        job = shell.run_line_magic("agent", 'run --piece single "Summarise the inputs"')
    shell.user_ns["t_job"] = job
    path = shell.run_line_magic("agent", f"export t_job {tmp_path / 'run.ipynb'}")
    assert Path(path) == tmp_path / "run.ipynb"
    nb = nbformat.read(str(path), as_version=4)
    html = "".join(o.get("data", {}).get("text/html", "") for c in nb.cells for o in c.get("outputs", []))
    assert 'data-seq="1"' in html
    with pytest.raises(UsageError, match=r"%agent export: the following arguments are required: path"):
        shell.run_line_magic("agent", "export 1")
    with pytest.raises(UsageError, match=r"^%agent run: --queue only submits the job and --background"):
        shell.run_line_magic("agent", 'run --queue --background "x"')
    (tmp_path / "afile").write_text("keep")
    with pytest.raises(UsageError, match=r"afile is a file, not a folder$"):  # one line, no traceback
        shell.run_line_magic("agent", f"export t_job {tmp_path / 'afile' / 'x.ipynb'}")
    with pytest.raises(UsageError, match=r"the export path is empty"):
        shell.run_line_magic("agent", "export t_job ''")
    assert (tmp_path / "afile").read_text() == "keep"


def test_job_arguments_take_notebook_variables(shell: InteractiveShell) -> None:
    import numpy as np

    with capture_output():
        first = shell.run_line_magic("agent", 'run --queue "first"')
        second = shell.run_line_magic("agent", 'run --queue --piece single "second"')
    shell.user_ns.update(t_jid=first.id, t_np=np.int64(first.id), t_first=first, t_text=str(first.id))
    # the forms a notebook user writes, through IPython's own line handling (run_cell)
    for ref in ("{t_jid}", "$t_jid", "t_jid", "{t_np}", "t_np", "{t_first}", "$t_first", "t_first",
                "{t_first.id}", "$t_first.id", "{t_jid * 1}", "{t_text}", str(first.id)):
        with capture_output():
            result = shell.run_cell(f"t_shown = %agent show {ref}")
        assert result.error_in_exec is None, (ref, result.error_in_exec)
        assert f'data-job="{first.id}"' in shell.user_ns["t_shown"].data, ref
    with capture_output():
        stepped = shell.run_line_magic("agent", "step $t_jid --call")
        assert stepped.id == first.id
        shell.run_line_magic("agent", "run --job {t_first}")
    assert first.status == "succeeded"
    # a variable holding something else, or nothing, is refused in one line naming the sub-command
    shell.user_ns["t_words"] = "not a job"
    for ref, message in (("{t_missing}", "%agent step: {t_missing} in JOB names no variable of the notebook"),
                         ("t_missing", "%agent step: JOB 't_missing' is neither a job id nor a variable"),
                         ("{t_words}", "%agent step: JOB must be a job id or a Job, not '{t_words}' (a str)")):
        with pytest.raises(UsageError) as info:
            shell.run_line_magic("agent", f"step {ref}")
        assert str(info.value).startswith(message), str(info.value)
    # {{ and }} stay braces, $$ a dollar, and an unknown $word is left as typed
    with capture_output():
        job = shell.run_line_magic("agent", 'run --queue "{{t_jid}} is {t_jid}; $$t_jid is $t_jid; costs $5 in $HOME"')
    assert job.instruction == f"{{t_jid}} is {first.id}; $t_jid is {first.id}; costs $5 in $HOME"
    assert second.status == "queued"


def test_a_refused_command_leaves_the_default_job_alone(shell: InteractiveShell) -> None:
    with capture_output():
        done = shell.run_line_magic("agent", 'run "done already"')
        queued = shell.run_line_magic("agent", 'run --queue --piece single "still to do"')
    with pytest.raises(UsageError, match=rf"^%agent step: job {done.id} is succeeded; only a queued job can be stepped"):
        shell.run_line_magic("agent", f"step {done.id}")
    with pytest.raises(UsageError, match=r"^%agent show: no job 999"):
        shell.run_line_magic("agent", "show 999")
    # the default is still the queued job: the refused step did not make job `done` the current one
    with capture_output():
        stepped = shell.run_line_magic("agent", "step --call")
    assert stepped.id == queued.id
    with capture_output():
        shell.run_line_magic("agent", f"show {done.id}")  # a command that works does move it
    assert shell.magics_manager.registry["AgentMagic"].last_job == done.id


def test_help_lists_every_option_of_every_sub_command(shell: InteractiveShell,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    magic = shell.magics_manager.registry["AgentMagic"]
    shell.run_line_magic("agent", "--help")
    overview = capsys.readouterr().out
    assert "--queue" in overview and "--input" in overview
    for sub in SUBCOMMANDS:
        parser = getattr(magic, f"cmd_{sub}").parser
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert option in overview, (sub, option)
        shell.run_line_magic("agent", f"{sub} --help")
        text = capsys.readouterr().out
        assert text.startswith(f"usage: %agent {sub}"), text[:80]  # not with Sphinx's "::"
        assert "::" not in text.split("\n\n")[0]


def _wait_for(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_stop_pauses_a_background_job_and_a_kept_job_shows_fresh_status(shell: InteractiveShell, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _Gate("TestGateStop")
    magic = shell.magics_manager.registry["AgentMagic"]
    shown: list[dict[str, Any]] = []  # what the cells' values (Out) show
    monkeypatch.setattr(shell.displayhook, "write_format_data", lambda data, md=None: shown.append(data))
    try:
        script = write_script(tmp_path, "stop", {"work": [call(gate.name), call(gate.name), transition("COMPLETE")]})
        piece = _work_piece(tmp_path, [gate.name])
        with capture_output():
            result = shell.run_cell(f'bg = %agent run --background --piece {piece} --model {script} "t"\nbg')
        bg = shell.user_ns["bg"]
        # the cell's value does not freeze a "running" view under the live one: it points up to it
        assert result.result is bg and "its live view is just above" in shown[-1]["text/html"]
        _wait_for(lambda: bg.status == "running")
        with capture_output() as cap:
            shell.run_line_magic("agent", "stop")
        assert f"job {bg.id} will pause after its current LLM call" in cap.stdout
        gate.open.set()
        magic.threads[bg.id].join(30)
        # the Job kept in `bg` is not a stale snapshot: it says what the job is now
        assert bg.status == "queued" and bg.refresh().status == "queued"
        assert f"<Job {bg.id}: queued" in repr(bg)
        assert ws_reason(bg) == "paused on request after its current LLM call"
        with pytest.raises(UsageError, match=rf"^%agent stop: job {bg.id} is queued; only a running job"):
            shell.run_line_magic("agent", f"stop {bg.id}")
        snapshot = bg.snapshot()
        with capture_output():
            shell.run_line_magic("agent", f"run --job {bg.id}")
        assert bg.status == "succeeded" and snapshot.status == "queued"
        # in a later cell the Job shows its whole (fresh) view again
        with capture_output():
            shell.run_cell("bg")
        assert "anb-st-succeeded" in shown[-1]["text/html"] and '<details class="anb-mv"' in shown[-1]["text/html"]
    finally:
        gate.open.set()
        unregister(gate.name)
        shell.user_ns.pop("bg", None)


def ws_reason(job: Job) -> str:
    return job.workspace.events(job, kinds=["job_status"])[-1].payload["reason"]


def test_the_view_stays_whether_or_not_the_run_is_assigned(shell: InteractiveShell) -> None:
    # assigned: the full view stays where the run was (see test_run_returns_the_job_and_shows_it_live);
    # not assigned: the cell's value shows the full view, and the live one above shrinks to one line
    with capture_output() as cap:
        result = shell.run_cell('%agent run "Summarise the inputs"')
    job = result.result
    assert isinstance(job, Job) and job.status == "succeeded"
    views = _html(cap.outputs)
    assert views[-1].startswith(f"<div>Job {job.id} <b>succeeded</b>") and "its view is below" in views[-1]
    assert "running time" in views[-1]
    assert '<details class="anb-mv"' in job._repr_html_()  # what the cell's Out shows


def test_usage_shows_a_compact_table_and_returns_the_full_frame(shell: InteractiveShell,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    values: list[dict[str, Any]] = []  # what the cell's value (Out) shows
    monkeypatch.setattr(shell.displayhook, "write_format_data", lambda data, md=None: values.append(data))
    with capture_output():
        shell.run_line_magic("agent", 'run "Summarise the inputs"')
    with capture_output():
        result = shell.run_cell("%agent usage")
    usage = result.result
    assert isinstance(usage, pd.DataFrame) and "latency_s" in usage.columns
    assert list(usage.columns) == list(shell.run_line_magic("agent", "usage").columns)
    assert len(usage.columns) >= 17
    shown = values[-1]["text/html"]
    headers = re.findall(r'<th[^>]*class="col_heading[^"]*"[^>]*>([^<]*)</th>', shown)
    assert headers == ["movement", "call", "tokens", "context", "action", "next", "latency"]
    for noise in ("NaN", "&lt;NA&gt;", "<NA>", "0.1", "timestamp"):
        assert noise not in shown, noise
    assert re.search(r">\d+%<", shown) and "1. plan" in shown and "→ implement" in shown
    # anything derived from the value is an ordinary DataFrame, shown as pandas shows it
    assert type(usage[["call", "ratio"]]) is pd.DataFrame


def test_a_step_is_shown_live_too(shell: InteractiveShell, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As in test_the_view_updates_while_the_job_runs: the gate only opens when a view published while the
    # step runs shows the message written before it, so a step that only showed its result would time out.
    gate = _Gate("TestGateStep")
    try:
        marker = "about to wait for the view of the step"
        script = write_script(tmp_path, "step-live", {"work": [
            {"content": marker, "tool_calls": [{"name": "Glob", "arguments": {"pattern": "*"}}]},
            call(gate.name),
            transition("COMPLETE"),
        ]})
        piece = _work_piece(tmp_path, ["Glob", gate.name])
        with capture_output():
            queued = shell.run_line_magic("agent", f'run --queue --piece {piece} --model {script} "t"')
        pub = _WatchingPublisher(marker, gate.open)
        monkeypatch.setattr(shell, "display_pub", pub)
        job = shell.run_line_magic("agent", f"step {queued.id}")
        assert job.status == "succeeded"
        results = job.workspace.events(job, kinds=["tool_result"])
        assert results[1].payload["content"] == "opened"
    finally:
        gate.open.set()
        unregister(gate.name)


# -- the live view in a real kernel: each commit reaches the view within 100 ms, and nothing polls the store ------

_KERNEL_SETUP = '''
%load_ext agentnb
%config AgentMagic.workspace = "agentnb-data"
import inspect, json, threading, time
import agentnb
from agentnb import live

_magic = get_ipython().magics_manager.registry["AgentMagic"]
store = _magic.ws.store
naps, commits, reads = [], [], []

@agentnb.tool(name="Nap")
def nap() -> str:
    """Wait a moment."""
    start = time.time()
    time.sleep(NAP)
    naps.append((start, time.time()))
    return "rested"

# every store call, with its thread: the view's thread is the cell's (MainThread) in a foreground run
for name in [n for n in dir(store) if not n.startswith("_") and inspect.ismethod(getattr(store, n))]:
    def counted(*args, _name=name, _fn=getattr(store, name), **kwargs):
        reads.append((time.time(), threading.current_thread().name, _name))
        return _fn(*args, **kwargs)
    setattr(store, name, counted)
# when each event was committed: the stores publish right after the commit; this subscriber is called first
live.subscribe(store, None, lambda item: commits.append((item.id, time.time())) if item.id is not None else None)
'''


def test_in_a_kernel_the_live_view_shows_each_commit_within_100_ms_without_polling(tmp_path: Path) -> None:
    import json

    from jupyter_client.manager import start_new_kernel

    nap = 0.8
    script = write_script(tmp_path, "kernel", {"work": [
        call("Nap"), call("Glob", pattern="*"), call("Nap"), call("Nap"), call("Glob", pattern="*.md"),
        transition("COMPLETE"),
    ]})
    piece = _work_piece(tmp_path, ["Nap", "Glob"])
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))

    def execute(code: str) -> list[dict[str, Any]]:
        """Run ``code`` in the kernel; its iopub messages, in order, once it is idle again."""
        msg_id = kc.execute(code)
        messages: list[dict[str, Any]] = []
        while True:
            msg = kc.get_iopub_msg(timeout=120)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            messages.append(msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        errors = [m["content"] for m in messages if m["msg_type"] == "error"]
        assert not errors, errors
        return messages

    try:
        execute(f"NAP = {nap}\n" + _KERNEL_SETUP)
        ran = execute(f'job = %agent run --piece {piece} --model {script} "t"\njob.status')
        out = execute("print(json.dumps({'commits': commits, 'reads': reads, 'naps': naps, 'job': job.id, "
                      "'status': str(job.status)}))")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    data = json.loads("".join(m["content"]["text"] for m in out if m["msg_type"] == "stream"))
    assert data["status"] == "succeeded" and len(data["naps"]) == 3
    commits = [(int(i), float(t)) for i, t in data["commits"]]
    updates = [m["content"]["transient"]["agentnb"] for m in ran if m["msg_type"] == "update_display_data"]
    assert updates and all(u["job"] == data["job"] for u in updates)
    assert len(commits) >= 20 and [i for i, _ in commits] == sorted(i for i, _ in commits)
    # each event's latency: from its commit to the first update of the view that shows it
    latencies = []
    for event_id, committed in commits:
        shown = next(u for u in updates if u["event"] >= event_id)  # the last update shows the last event
        latencies.append(shown["at"] - committed)
    latencies.sort()
    median = latencies[len(latencies) // 2]
    assert 0 <= median < 0.1, f"median latency {median * 1000:.1f} ms over {len(latencies)} events: {latencies}"
    # no polling: the store's marks are never read, and while the job naps (no commit) the view's thread reads
    # nothing: a render follows a commit, it never looks for one
    polled = [r for r in data["reads"] if r[2] in ("last_event_id", "change_mark")]
    assert polled == []
    view_reads = [t for t, thread, _ in data["reads"] if thread == "MainThread"]
    for begun, ended in data["naps"]:
        quiet = [t for t in view_reads if begun + 0.3 < t < ended]
        assert quiet == [], f"the view read the store {len(quiet)} times while the job napped ({begun}–{ended})"
    # one render per wake-up, and a wake-up only for a commit: far fewer updates than events
    assert len(updates) <= len(commits) + 1


def test_the_line_above_a_stepped_job_says_paused_like_its_view(shell: InteractiveShell) -> None:
    # Seen in JupyterLab: `%agent step 1` left "Job 1 queued · …" above a view headed "Job 1 paused".
    with capture_output():
        queued = shell.run_line_magic("agent", 'run --queue "Summarise the inputs"')
    with capture_output() as cap:
        result = shell.run_cell(f"%agent step {queued.id}")
    job = result.result
    assert job.status == "queued"  # stored so; shown as paused everywhere
    line = _html(cap.outputs)[-1]
    assert line.startswith(f"<div>Job {job.id} <b>paused</b>") and "its view is below" in line, line
    assert re.search(r'anb-st-paused"[^>]*>paused<', job._repr_html_())


# -- a workspace the settings replace is closed (its PostgreSQL pool with it) ----------------------------------

def _connections(url: str) -> int:
    """The sessions open on ``url``'s database, this query's own left out."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND pid <> pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.needs("postgres", "psycopg")
def test_changing_the_store_closes_the_old_workspaces_pool(shell: InteractiveShell, pg_url: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTNB_STORE", raising=False)
    magic = shell.magics_manager.registry["AgentMagic"]
    shell.run_line_magic("config", f"AgentMagic.store = {pg_url!r}")
    try:
        with capture_output():
            job = shell.run_line_magic("agent", "run --piece single hello")
            panel = shell.run_line_magic("agent", "panel")
        assert job.status == "waiting_human"
        old = magic.ws
        assert _connections(pg_url) >= 1  # the workspace's pool
    finally:
        shell.run_line_magic("config", "AgentMagic.store = ''")
    _wait_for(lambda: _connections(pg_url) == 0)  # a server session ends just after its client hangs up
    assert panel._closed.is_set()  # the panel of that workspace stopped watching it
    with pytest.raises(Exception, match="closed"):
        old.jobs()
    assert magic.ws is not old and magic.ws.store_url is None


@pytest.mark.needs("postgres", "psycopg")
def test_a_store_changed_under_a_background_job_is_closed_when_the_job_ends(
        shell: InteractiveShell, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTNB_STORE", raising=False)
    gate = _Gate("TestGateRetire")
    magic = shell.magics_manager.registry["AgentMagic"]
    try:
        script = write_script(tmp_path, "gate", {"work": [call(gate.name), transition("COMPLETE")]})
        piece = _work_piece(tmp_path, [gate.name])
        shell.run_line_magic("config", f"AgentMagic.store = {pg_url!r}")
        with capture_output():
            job = shell.run_line_magic("agent", f'run --background --piece {piece} --model {script} "t"')
            watcher = magic.threads[job.id]
            shell.run_line_magic("config", "AgentMagic.store = ''")  # while the job waits at its gate
            assert magic.ws.store_url is None and magic.ws.jobs() == []  # the notebook is on the other store now
            assert watcher.is_alive() and _connections(pg_url) >= 1  # the job's workspace stays open under it
            gate.open.set()
            watcher.join(30)
        assert not watcher.is_alive()
        with psycopg_connection(pg_url) as conn:
            assert conn.execute("SELECT status FROM jobs WHERE id = %s", (job.id,)).fetchone() == ("succeeded",)
        _wait_for(lambda: _connections(pg_url) == 0)  # closed once the run and its view ended
    finally:
        gate.open.set()
        unregister(gate.name)
        shell.run_line_magic("config", "AgentMagic.store = ''")


def psycopg_connection(url: str) -> Any:
    import psycopg

    return psycopg.connect(url, autocommit=True)
