"""Forks (docs/fork-compare.md#fork) where a user looks: the frames, the job view, the exported notebook, the panel's job list,
``%agent fork`` in a real IPython shell and ``agentnb fork`` / ``agentnb replay`` run as subprocesses."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from _scripting import call, transition, write_piece, write_script
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import agentnb
from agentnb import Job, Workspace
from agentnb.tools.base import unregister
from agentnb.views.render import job_html, movement_html

CLOCK = "TestForkClock"


@pytest.fixture
def clock() -> Iterator[str]:
    """A tool whose result changes on every run (markup and a long tail included, to check escaping and cutting):
    re-run in a fork's re-served run it differs from the original's, which records a ``replay_divergence``."""

    @agentnb.tool(name=CLOCK)
    def _clock() -> str:
        """The time now, in nanoseconds."""
        return f"<t>{time.time_ns()}</t>" + "x" * 2500

    yield CLOCK
    unregister(CLOCK)


def _piece(tmp_path: Path, extra_tools: tuple[str, ...] = ()) -> Path:
    """Three movements, plan → implement → verify; ``plan`` may use the extra tools."""
    def movement(name: str, tools: list[str], permission: str, nxt: str) -> dict[str, object]:
        return {"name": name, "persona": f"You {name}.", "instruction": f"Do the {name} step.", "tools": tools,
                "permission": permission, "rules": [{"condition": "done", "next": nxt}]}

    return write_piece(tmp_path, "three", {"initial_movement": "plan", "max_movements": 6, "movements": [
        movement("plan", ["Read", *extra_tools], "readonly", "implement"),
        movement("implement", ["Read", "Write"], "edit", "verify"),
        movement("verify", ["Read"], "readonly", "COMPLETE"),
    ]})


def _script(tmp_path: Path, name: str = "s", first: dict[str, object] | None = None, text: str = "v1") -> str:
    return write_script(tmp_path, name, {
        "plan": [first or call("Read", path="input/a.md"), transition("implement", "planned")],
        "implement": [call("Write", path="output/out.md", content=text), transition("verify", f"wrote {text}")],
        "verify": [call("Read", path="output/out.md"), transition("COMPLETE", "ok")],
    })


def _original(ws: Workspace, tmp_path: Path, *, clock: str | None = None) -> Job:
    piece = _piece(tmp_path, (clock,) if clock else ())
    model = _script(tmp_path, first=call(clock) if clock else None)
    job = ws.run(ws.submit("Write <out>", piece=str(piece), model=model, inputs={"a.md": "hello"}))
    assert job.status == "succeeded"
    return job


def _summaries(markup: str) -> list[str]:
    return re.findall(r'<details class="anb-mv"[^>]*><summary[^>]*>(.*?)</summary>', markup, flags=re.S)


# -- frames ---------------------------------------------------------------------------------------------------


def test_frames_show_where_a_fork_came_from_and_what_was_re_served(ws: Workspace, tmp_path: Path, clock: str) -> None:
    original = _original(ws, tmp_path, clock=clock)
    fork = ws.fork(original, at=3)
    other = ws.fork(original, at=1)

    jobs = ws.frames.jobs().set_index("job")
    assert jobs.loc[fork.id, "forked_from_job"] == original.id and jobs.loc[fork.id, "forked_from_seq"] == 3
    assert jobs.loc[other.id, "forked_from_seq"] == 1
    assert jobs["forked_from_job"].isna()[original.id]

    runs = ws.frames.movements(fork)
    assert runs["replayed"].tolist() == [True, True, False]
    assert not ws.frames.movements(original)["replayed"].any() and not ws.frames.movements(other)["replayed"].any()

    usage = ws.frames.usage(fork)
    served = usage[usage["replayed"]]
    assert served["seq"].tolist() == [1, 1, 2, 2]
    assert (served["total_tokens"] == 0).all() and (usage.loc[~usage["replayed"], "total_tokens"] > 0).all()
    # the context as recorded: the re-served calls keep the original's ratio
    assert served["ratio"].tolist() == ws.frames.usage(original).query("seq < 3")["ratio"].tolist()

    div = ws.frames.divergences(fork)
    assert len(div) == 1
    row = div.iloc[0]
    assert (row["job"], row["seq"], row["movement"], row["iteration"], row["tool"]) == (fork.id, 1, "plan", 1, clock)
    results = {e.job_id: e.content for j in (original, fork) for e in ws.events(j, kinds=["tool_result"])
               if e.tool == clock}
    assert row["expected"] == results[original.id] and row["actual"] == results[fork.id]
    assert row["expected"] != row["actual"]
    assert row["call_id"] == next(e.call_id for e in ws.events(fork, kinds=["replay_divergence"]))
    # every job's divergences at once; none for a job that re-served nothing
    assert ws.frames.divergences()["job"].tolist() == [fork.id]
    assert ws.frames.divergences(other).empty and ws.frames.divergences(original).empty


# -- the job view and the exported notebook -----------------------------------------------------------------------


def test_job_view_of_a_fork_names_its_origin_badges_re_served_runs_and_warns_of_a_divergence(
        ws: Workspace, tmp_path: Path, clock: str) -> None:
    original = _original(ws, tmp_path, clock=clock)
    fork = ws.fork(original, at=3)
    markup = job_html(ws, fork.id)
    head = markup[markup.index('class="anb-head"'):markup.index("<details")]
    assert f"forked from job {original.id} at run 3" in head
    assert f"runs 1–2 re-served from job {original.id}" in head

    summaries = _summaries(markup)
    assert len(summaries) == 3
    assert ["re-served" in s for s in summaries] == [True, True, False]
    assert "⚠ 1 divergence" in summaries[0] and "divergence" not in summaries[1] + summaries[2]

    # the warning block sits inside run 1, names the tool and the call, and shows both results escaped and cut
    run1 = movement_html(ws, fork.id, 1)
    block = run1[run1.index('class="anb-diverged"'):]
    div = ws.frames.divergences(fork).iloc[0]
    assert f"<b>{CLOCK}</b>" in block and html.escape(div["call_id"]) in block
    assert html.escape(div["expected"][:2000]) in block and html.escape(div["actual"][:2000]) in block
    assert "<t>" not in block and "&lt;t&gt;" in block
    assert block.count("showing the first 2,000 of 2,") == 2
    assert div["expected"][:30] not in run1.replace(html.escape(div["expected"][:30]), "")  # only escaped
    full = movement_html(ws, fork.id, 1, full=True)
    assert html.escape(div["expected"]) in full and html.escape(div["actual"]) in full

    # nothing of the kind on a job that is no fork
    plain = job_html(ws, original.id)
    assert "forked from" not in plain and "re-served" not in plain and "anb-diverged" not in plain


def test_a_fork_at_run_1_re_serves_nothing_and_says_so(ws: Workspace, tmp_path: Path) -> None:
    original = _original(ws, tmp_path)
    fork = ws.fork(original, at=1)
    markup = job_html(ws, fork.id)
    assert f"forked from job {original.id} at run 1" in markup and "no run re-served" in markup
    assert not any("re-served</span>" in s for s in _summaries(markup))


def test_fork_of_a_fork_names_its_own_origin(ws: Workspace, tmp_path: Path) -> None:
    original = _original(ws, tmp_path)
    first = ws.fork(original, at=2)
    second = ws.fork(first, at=3)
    markup = job_html(ws, second.id)
    assert f"forked from job {first.id} at run 3" in markup
    assert f"runs 1–2 re-served from job {first.id}" in markup
    assert ws.frames.jobs().set_index("job").loc[second.id, "forked_from_job"] == first.id


def test_the_view_stays_bounded_and_keeps_the_marks(ws: Workspace, tmp_path: Path, clock: str) -> None:
    original = _original(ws, tmp_path, clock=clock)
    fork = ws.fork(original, at=3)
    small = job_html(ws, fork.id, max_bytes=1)
    # the oldest runs are reduced to their summary line: the badges are in it, the warning block is not
    assert "details left out to keep this view small" in small and "anb-diverged" not in small
    summaries = _summaries(small)
    assert "re-served" in summaries[0] and "⚠ 1 divergence" in summaries[0]
    assert len(small) < len(job_html(ws, fork.id))


def test_exported_notebook_of_a_fork_has_the_origin_badges_and_divergence(ws: Workspace, tmp_path: Path,
                                                                         clock: str) -> None:
    original = _original(ws, tmp_path, clock=clock)
    fork = ws.fork(original, at=3)
    path = ws.export_notebook(fork, tmp_path / "fork.ipynb")
    nb = nbformat.read(path, as_version=4)
    title = nb.cells[0].source
    assert f"forked from job {original.id} at run 3" in title and f"runs 1–2 re-served from job {original.id}" in title
    runs = [c.outputs[0].data for c in nb.cells if c.cell_type == "code" and c.outputs
            and "anb-mv" in c.outputs[0].data.get("text/html", "")]
    assert len(runs) == 3
    htmls, texts = [d["text/html"] for d in runs], [d["text/plain"] for d in runs]
    assert ["re-served" in h for h in htmls] == [True, True, False]
    assert "anb-diverged" in htmls[0] and "⚠ divergence" in texts[0] and "re-served from job" in texts[0]
    headings = [c.source for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("## ")
                and not c.source.startswith("## Usage")]
    assert ["(re-served)" in h for h in headings] == [True, True, False]


def test_panel_lists_a_fork_with_its_origin(ws: Workspace, tmp_path: Path) -> None:
    from agentnb.notebook.panel import Panel

    original = _original(ws, tmp_path)
    fork = ws.fork(original, at=2)
    panel = Panel(ws)
    try:
        labels = dict((value, label) for label, value in panel.jobs.options)
        assert f"#{fork.id} ⎇{original.id}@2 ·" in labels[fork.id]
        assert "⎇" not in labels[original.id]
    finally:
        panel.close()


# -- %agent fork -----------------------------------------------------------------------------------------------------


def _magic_original(shell: InteractiveShell, tmp_path: Path) -> Job:
    ws = Workspace(tmp_path / "ws")
    return _original(ws, tmp_path)


def test_magic_fork_runs_the_fork_live_and_returns_it(shell: InteractiveShell, tmp_path: Path) -> None:
    original = _magic_original(shell, tmp_path)
    with capture_output() as cap:
        result = shell.run_cell(f"t_fork = %agent fork {original.id} --at 2")
    assert result.error_in_exec is None, result.error_in_exec
    fork = shell.user_ns["t_fork"]
    assert isinstance(fork, Job) and fork.status == "succeeded" and fork.forked_from == (original.id, 2)
    views = [o.data["text/html"] for o in cap.outputs if "text/html" in o.data]
    assert views and f"forked from job {original.id} at run 2" in views[-1]
    assert ["re-served" in s for s in _summaries(views[-1])] == [True, False, False]
    # the fork is the session's job now
    with capture_output():
        shown = shell.run_cell("%agent show").result.data
    assert f'data-job="{fork.id}"' in shown


def test_magic_fork_takes_a_piece_variable_a_model_and_no_run(shell: InteractiveShell, tmp_path: Path) -> None:
    original = _magic_original(shell, tmp_path)
    ws = Workspace(tmp_path / "ws")
    shell.user_ns["t_piece"] = ws.piece(original).replace_movement("implement", instruction="Write v2 instead.")
    shell.user_ns["t_model"] = _script(tmp_path, "s2", text="v2")
    shell.user_ns["t_at"] = 2
    with capture_output():
        queued = shell.run_cell(f"%agent fork {original.id} --at $t_at --piece t_piece --model {{t_model}} --no-run").result
    assert isinstance(queued, Job) and queued.status == "queued" and queued.forked_from == (original.id, 2)
    assert ws.piece(queued).movement("implement").instruction.strip() == "Write v2 instead."
    with capture_output():
        done = shell.run_cell(f"%agent run --job {queued.id}").result
    assert done.status == "succeeded"
    assert (Path(done.workdir) / "output" / "out.md").read_text() == "v2"
    assert (Path(original.workdir) / "output" / "out.md").read_text() == "v1"


@pytest.mark.parametrize(("line", "says"), [
    ("%agent fork 99 --at 1", "%agent fork: no job 99"),
    ("%agent fork {job} --at 0", "%agent fork: --at 0: "),
    ("%agent fork {job} --at 9", "%agent fork: --at 9: "),
    ("%agent fork {job} --at two", "%agent fork: --at 'two' is not a movement run number"),
    ("%agent fork {job}", "%agent fork: the following arguments are required: --at"),
    ("%agent fork {job} --at 2 --piece t_bad", "%agent fork: --piece t_bad: the variable holds a int"),
    ("%agent fork {job} --at 2 --piece no-such-piece", "%agent fork: no-such-piece: unknown piece"),
    ("%agent fork {running} --at 1", "%agent fork: job {running} is running"),
])
def test_magic_fork_refuses_bad_input_in_one_line(shell: InteractiveShell, tmp_path: Path, line: str,
                                                  says: str) -> None:
    original = _magic_original(shell, tmp_path)
    ws = Workspace(tmp_path / "ws")
    running = ws.submit("Keep going", piece=str(_piece(tmp_path)), model=_script(tmp_path, "r"))
    assert ws.store.claim(running.id, owner="another-worker") is not None
    shell.user_ns["t_bad"] = 7
    jobs_before = len(ws.jobs())
    with pytest.raises(UsageError) as err:
        shell.run_line_magic("agent", line.format(job=original.id, running=running.id)[len("%agent "):])
    message = str(err.value)
    assert message.startswith(says.format(running=running.id)), message
    assert "\n" not in message
    assert len(ws.jobs()) == jobs_before  # nothing half-made


# -- agentnb fork / agentnb replay ------------------------------------------------------------------------------------

AGENTNB = shutil.which("agentnb")
needs_cli = pytest.mark.skipif(AGENTNB is None, reason="the agentnb entry point is not installed")


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # AGENTNB_STORE stays: under AGENTNB_TEST_BACKEND=postgres the subprocess must use the test's database
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AGENTNB_", "OPENAI_")) or k == "AGENTNB_STORE"}
    return subprocess.run([str(AGENTNB), "--workspace", "ws", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


@needs_cli
def test_cli_fork_and_replay_run_the_new_job_and_print_it(tmp_path: Path) -> None:
    original = _original(Workspace(tmp_path / "ws"), tmp_path)
    out = _cli(tmp_path, "fork", str(original.id), "--at", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("job 2: succeeded  piece=three")
    assert lines[1] == f"  forked from job {original.id} at run 2"
    assert f"plan           re-served from job {original.id}:" in lines[2] and "re-served" not in lines[3]

    out = _cli(tmp_path, "fork", str(original.id), "--at", "3", "--no-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("job 3: queued") and "forked from job 1 at run 3" in out.stdout

    out = _cli(tmp_path, "replay", str(original.id))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"job 4: succeeded  piece=three model=replay:{original.id}")

    ws = Workspace(tmp_path / "ws")
    assert ws.job(2).forked_from == (1, 2) and ws.job(3).status == "queued" and ws.job(4).forked_from is None
    assert ws.frames.usage(2).query("seq == 1")["total_tokens"].sum() == 0

    out = _cli(tmp_path, "jobs")
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert " from " in header
    by_id = {int(r.split()[0]): r for r in rows}
    assert " 1@2 " in by_id[2] and " 1@3 " in by_id[3] and "@" not in by_id[1] and "@" not in by_id[4]


@needs_cli
def test_cli_strict_fork_that_diverges_fails_with_exit_1(tmp_path: Path) -> None:
    # a fork starts from the original's input/ as it is now: changed after the run, the re-run Read of run 1
    # gets another result than the original's
    ws = Workspace(tmp_path / "ws")
    original = _original(ws, tmp_path)
    (Path(original.workdir) / "input" / "a.md").write_text("changed since", encoding="utf-8")
    out = _cli(tmp_path, "fork", str(original.id), "--at", "2", "--strict")
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert out.stdout.startswith("job 2: failed") and "error:" in out.stdout
    out = _cli(tmp_path, "fork", str(original.id), "--at", "2")
    assert out.returncode == 0, (out.stdout, out.stderr)
    div = Workspace(tmp_path / "ws").frames.divergences(3)
    assert div[["seq", "tool", "expected", "actual"]].values.tolist() == [[1, "Read", "hello", "changed since"]]


@needs_cli
@pytest.mark.parametrize(("args", "says"), [
    (("fork", "99", "--at", "1"), "agentnb: error: no job 99"),
    (("fork", "{job}", "--at", "0"), "agentnb: error: --at 0: job {job} ran 3 movement run(s); allowed: a movement run from 1 to 3"),
    (("fork", "{job}", "--at", "4"), "agentnb: error: --at 4: "),
    (("fork", "{job}"), "agentnb: error: fork: the following arguments are required: --at"),
    (("fork", "{job}", "--at", "x"), "agentnb: error: fork: argument --at: invalid int value"),
    (("fork", "{running}", "--at", "1"), "agentnb: error: job {running} is running"),
    (("fork", "{job}", "--at", "1", "--piece", "no-such-piece"), "agentnb: error: no-such-piece: unknown piece"),
    (("replay", "99"), "agentnb: error: no job 99"),
    (("replay", "{running}"), "agentnb: error: job {running} is running"),
])
def test_cli_fork_and_replay_refuse_bad_input_with_exit_2(tmp_path: Path, args: tuple[str, ...], says: str) -> None:
    ws = Workspace(tmp_path / "ws")
    original = _original(ws, tmp_path)
    running = ws.submit("Keep going", piece=str(_piece(tmp_path)), model=_script(tmp_path, "r"))
    assert ws.store.claim(running.id, owner="another-worker") is not None
    out = _cli(tmp_path, *(a.format(job=original.id, running=running.id) for a in args))
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr.startswith(says.format(job=original.id, running=running.id)), out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert len(Workspace(tmp_path / "ws").jobs()) == 2  # nothing stored
