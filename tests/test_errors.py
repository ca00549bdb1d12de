"""One error base: every mistake a user can make through the magic or the panel is an AgentnbError, shown in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from IPython.core.error import UsageError as IPythonUsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import agentnb
from agentnb import AgentnbError, Workspace
from agentnb.notebook.panel import Panel
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
     "UsageError: %agent retry: retries=-1; allowed: a whole number from 0 to 100 (the tries after the first)"),
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
