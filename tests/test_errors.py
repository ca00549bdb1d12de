"""One error base: every mistake a user can make through the magic or the panel is an AgentnbError, shown in one line."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from IPython.core.error import UsageError as IPythonUsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import agentnb
from agentnb import AgentnbError, Workspace
from agentnb.notebook.panel import Panel
from agentnb.notebook.tracebacks import HINT, TRACEBACK_ENV, install
from agentnb.store.sqlite import MAX_INSTRUCTION_CHARS


def _shown(shell: InteractiveShell, cell: str) -> list[str]:
    """What the user reads when the cell fails: the non-blank lines of its output."""
    with capture_output() as cap:
        result = shell.run_cell(cell)
    assert isinstance(result.error_in_exec, IPythonUsageError), result.error_in_exec
    return [ln for ln in (cap.stdout + cap.stderr).splitlines() if ln.strip()]


@pytest.mark.parametrize("cell, line", [
    # raised by the workspace, the export and the views, caught by the magic as AgentnbError
    ('%agent run --workdir /no/such/folder "x"',
     "UsageError: %agent run: workdir '/no/such/folder' is not an existing directory"),
    ("%agent show 1 --movement 9", "UsageError: %agent show: job 1 has no movement run 9; it has run 3"),
    ("%agent export 1 transcript.txt",
     "UsageError: %agent export: export path 'transcript.txt' must end in .ipynb (or be an existing directory)"),
    ("%agent retry 1 --retries -1",
     "UsageError: %agent retry: --retries -1; allowed: a whole number from 0 to 100 (the tries after the first)"),
    ('%agent run "about {t_missing}"', "UsageError: %agent run: {t_missing} in the instruction names no variable "
                                       "of the notebook; write {{ and }} for literal braces"),
])
def test_a_users_mistake_in_the_magic_is_one_line_without_traceback(
        shell: InteractiveShell, tmp_path: Path, cell: str, line: str) -> None:
    with capture_output():
        job = shell.run_line_magic("agent", 'run "Summarise the inputs"')
    assert job.id == 1 and job.status == "succeeded"
    assert _shown(shell, cell) == [line]


def test_the_errors_a_user_sees_share_one_base_and_keep_their_builtin_ones() -> None:
    # code that caught the builtin errors before the base existed still catches them
    builtin = {
        "PieceError": ValueError, "ModelSpecError": ValueError, "UsageError": ValueError,
        "ModelError": RuntimeError, "StoreError": RuntimeError,
        "PathNotFoundError": FileNotFoundError, "NotFoundError": LookupError,
    }
    for name, base in builtin.items():
        cls = getattr(agentnb.errors, name)
        assert issubclass(cls, AgentnbError) and issubclass(cls, base), name
    assert issubclass(agentnb.ToolError, AgentnbError)
    from agentnb.notebook.vars import VarError

    assert issubclass(VarError, agentnb.UsageError)


def test_workspace_refusals_are_agentnb_errors(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    with pytest.raises(agentnb.UsageError, match=r"^instruction must be non-empty text$"):
        ws.submit("  ")
    with pytest.raises(agentnb.errors.PathNotFoundError, match=r"^workdir '/no/such' is not an existing directory$"):
        ws.submit("x", workdir="/no/such")
    job = ws.submit("x", piece="single")
    with pytest.raises(agentnb.UsageError, match=r"^unit='leap'; allowed: 'movement', 'call'$"):
        ws.step(job.id, unit="leap")
    with pytest.raises(agentnb.UsageError, match=r"^reply text must be non-empty$"):
        ws.reply(job.id, " ")


def test_the_panel_shows_a_workspace_refusal_as_its_message_alone(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    panel = Panel(ws, namespace={})
    panel.piece.value = "single"
    panel.model.value = "demo"
    panel.instruction.value = "x" * (MAX_INSTRUCTION_CHARS + 1)
    panel.run_button.click()
    panel.wait(60)
    # the message alone, not "UsageError: …" as for an unexpected error
    assert f">the instruction has {MAX_INSTRUCTION_CHARS + 1:,} characters; at most" in panel.message.value
    assert "Error" not in panel.message.value
    assert ws.jobs() == []


# -- an AgentnbError raised by the Python API in a cell: one line and a hint, as the magic's ------------------------

_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def _cell(shell: InteractiveShell, cell: str) -> tuple[BaseException | None, str, str]:
    """The cell's error, and its stdout and stderr without colours."""
    with capture_output() as cap:
        result = shell.run_cell(cell)
    return result.error_in_exec, _COLOUR.sub("", cap.stdout), _COLOUR.sub("", cap.stderr)


@pytest.fixture
def waiting(shell: InteractiveShell, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``t_ws`` and ``t_job``, a job waiting for a human's reply (which a fork refuses), in the shell; the message
    of that refusal.  No AGENTNB_TRACEBACK, and the shell's exception mode (Context) put back after."""
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    error, _, _ = _cell(shell, f"t_ws = agentnb.Workspace({str(tmp_path / 'api')!r})\n"
                               "t_job = t_ws.run(t_ws.submit('x', piece='ask-first'))")
    assert error is None and shell.user_ns["t_job"].status == "waiting_human"
    mode = shell.InteractiveTB.mode
    yield ("UsageError: job 1 is waiting_human (it waits for a human's reply); a fork needs a job that has stopped: "
           "reply or let its subtasks end first")
    shell.InteractiveTB.set_mode(mode=mode)


def test_an_agentnb_error_from_the_python_api_is_one_line_and_a_hint(shell: InteractiveShell, waiting: str) -> None:
    error, out, err = _cell(shell, "t_ws.fork(t_job, at=1)")
    assert isinstance(error, agentnb.UsageError)  # still an error: "Run all" stops there
    assert out == "" and err.splitlines() == [waiting, HINT]
    error, out, err = _cell(shell, "t_ws.job(999)")
    assert isinstance(error, agentnb.errors.StoreError)
    assert out == "" and err.splitlines() == [f"StoreError: no job 999 in {shell.user_ns['t_ws'].store.path}", HINT]
    # %tb, as the hint says, shows the traceback of that last error, down to where it was raised
    error, out, err = _cell(shell, "%tb")
    assert error is None and "Traceback (most recent call last)" in out and "def job(" in out
    assert "StoreError" in out.splitlines()[-1]


@pytest.mark.parametrize("switch", ["%xmode Verbose", f"%env {TRACEBACK_ENV}=1"])
def test_xmode_verbose_or_the_environment_variable_give_the_full_traceback_back(
        shell: InteractiveShell, waiting: str, switch: str) -> None:
    assert _cell(shell, switch)[0] is None
    error, out, err = _cell(shell, "t_ws.fork(t_job, at=1)")
    assert isinstance(error, agentnb.UsageError)
    assert "Traceback (most recent call last)" in out and "plan_fork(" in out and HINT not in out + err
    assert waiting.split(": ", 1)[1] in out.splitlines()[-1]


def test_agentnb_traceback_0_keeps_the_one_line(shell: InteractiveShell, waiting: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRACEBACK_ENV, "0")
    assert _cell(shell, "t_ws.fork(t_job, at=1)")[1:] == ("", f"{waiting}\n{HINT}\n")


def test_a_programming_error_keeps_its_traceback(shell: InteractiveShell, waiting: str) -> None:
    error, out, err = _cell(shell, "def t_f():\n    return 1 / 0\nt_f()")
    assert isinstance(error, ZeroDivisionError)
    assert "Traceback (most recent call last)" in out and "return 1 / 0" in out and HINT not in out + err


def test_a_custom_exception_handler_of_the_users_is_left_alone(shell: InteractiveShell, waiting: str) -> None:
    ours = shell.custom_exceptions, shell.CustomTB
    seen: list[BaseException] = []

    def theirs(self: InteractiveShell, etype: type, value: BaseException, tb: object, tb_offset: int | None = None) -> None:
        seen.append(value)

    try:
        shell.set_custom_exc((ValueError,), theirs)
        assert install(shell) is False  # what %load_ext agentnb does once more
        error, out, err = _cell(shell, "t_ws.fork(t_job, at=1)")
        assert seen == [error] and isinstance(error, agentnb.UsageError) and out == err == ""
    finally:
        shell.custom_exceptions, shell.CustomTB = ours
    assert install(shell) is True  # ours again (loading twice is harmless)
    assert _cell(shell, "t_ws.fork(t_job, at=1)")[2] == f"{waiting}\n{HINT}\n"


def test_a_kernel_shows_an_agentnb_error_as_one_line_and_a_programming_error_in_full(tmp_path: Path) -> None:
    """What JupyterLab draws: a stderr stream of two lines (as for the magic's UsageError), not an error output
    with its frames; a ZeroDivisionError stays an error output."""
    import os

    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in (
        "%load_ext agentnb", "ws = agentnb.Workspace('ws')", "ws.job(999)", "1/0")])
    env = {k: v for k, v in os.environ.items() if k != TRACEBACK_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                         *filter(None, [os.environ.get("PYTHONPATH")])])
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute(env=env)
    store = Path(tmp_path / "ws" / "agentnb.sqlite").resolve()
    assert [(o.output_type, o.get("name"), o.get("text")) for o in nb.cells[2].outputs] == [
        ("stream", "stderr", f"StoreError: no job 999 in {store}\n{HINT}\n")]
    [error] = nb.cells[3].outputs
    assert error.output_type == "error" and error.ename == "ZeroDivisionError" and len(error.traceback) > 1
