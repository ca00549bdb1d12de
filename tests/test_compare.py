"""Compare two runs (docs/fork-compare.md#compare): ``ws.compare(a, b)`` → ``Comparison`` — its frame aligned by movement
run, ``files()`` (the difference of the two ``output/`` folders), its HTML and ``%agent compare A B``.

Real SQLite workspaces and scripted jobs on ``plan-implement-verify``; a priced job through the loopback
OpenAI-protocol server for the cost columns.
"""

from __future__ import annotations

import difflib
import html
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from _scripting import call, transition, write_script
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
from openai_server import OpenAIServer, reply

from agentnb import Comparison, Job, StoreError, Workspace
from agentnb.compare import MAX_DIFF_BYTES
from agentnb.views.compare_html import DIVERGED_BADGE, divergence_anchor

PIECE = "plan-implement-verify"
V1 = "first line\nsecond line\nthird line\n"
V2 = "first line\nsecond line, changed\nthird line\n"


def _script(tmp: Path, name: str, *, content: str = V1, extra: str = "old.md", verify: list[Any] | None = None,
            implement_again: list[Any] | None = None, say: str | None = None) -> str:
    implement = [call("Write", path="output/out.md", content=content),
                 call("Write", path=f"output/{extra}", content=f"{extra}\n"),
                 transition("verify", f"wrote {extra}")]
    if say is not None:
        implement[0] = {"content": say, **implement[0]}
    return write_script(tmp, name, {
        "plan": [call("Read", path="input/a.md"), transition("implement", "planned", lessons="keep it short")],
        "implement": implement + (implement_again or []),
        "verify": verify or [call("Read", path="output/out.md"), transition("COMPLETE", "ok")],
    })


def _job(ws: Workspace, spec: str) -> Job:
    job = ws.run(ws.submit("Do it", piece=PIECE, model=spec, inputs={"a.md": "hello"}))
    assert job.status == "succeeded", job.error
    return job


@pytest.fixture
def original(ws: Workspace, tmp_path: Path) -> Job:
    return _job(ws, _script(tmp_path, "s"))


def _edited_fork(ws: Workspace, tmp_path: Path, job: Job, **script: Any) -> Job:
    piece = ws.piece(job).replace_movement("implement", instruction="Write the second version.")
    fork = ws.fork(job, at=2, piece=piece, model=_script(tmp_path, "s2", content=V2, extra="new.md", **script))
    assert fork.status == "succeeded", fork.error
    return fork


def _col(frame: pd.DataFrame, name: str) -> list[Any]:
    return [None if pd.isna(v) else v for v in frame[name].astype(object)]


# -- identical runs -----------------------------------------------------------------------------------------

def test_a_job_and_its_replay_are_identical_everywhere(ws: Workspace, original: Job) -> None:
    replay = ws.replay(original)
    c = ws.compare(original, replay)
    assert isinstance(c, Comparison) and (c.a, c.b) == (original.id, replay.id)
    f = c.frame
    assert list(f["seq"]) == [1, 2, 3]
    assert list(f["movement_a"]) == list(f["movement_b"]) == ["plan", "implement", "verify"]
    assert list(f["next_step_a"]) == list(f["next_step_b"]) == ["implement", "verify", "COMPLETE"]
    assert list(f["summary_b"]) == ["planned", "wrote old.md", "ok"]
    assert f["identical"].all() and not f["diverged"].any() and c.first_divergence is None
    # a replay runs on replay:<job>: its calls are made (not re-served by a fork), so no run is "replayed"
    assert not f["replayed_a"].any() and not f["replayed_b"].any()
    assert list(f["llm_calls_a"]) == list(f["llm_calls_b"]) == [2, 3, 2]
    assert list(f["total_tokens_a"]) == list(f["total_tokens_b"])  # the replay re-serves the counts
    assert c.files().empty
    same = c.files(unchanged=True)
    assert list(same["path"]) == ["old.md", "out.md"] and set(same["change"]) == {"same"}
    assert same["diff"].isna().all()
    assert "identical" in repr(c) and "\n" not in repr(c)
    assert "forked" not in c._repr_html_() and f"job {replay.id} is a replay of job {original.id}" in c._repr_html_()


@pytest.mark.parametrize("at", [1, 2, 3])
def test_a_fork_with_nothing_changed_is_identical_and_re_served_before_the_fork_point(
        ws: Workspace, original: Job, at: int) -> None:
    fork = ws.fork(original, at=at)
    assert fork.status == "succeeded", fork.error
    c = ws.compare(original, fork)
    f = c.frame
    assert len(f) == 3 and f["identical"].all() and c.first_divergence is None
    assert _col(f, "replayed_b") == [seq < at for seq in (1, 2, 3)]
    assert _col(f, "replayed_a") == [False, False, False]
    # re-served runs spent nothing; the live ones spent what they spent
    for seq in range(1, at):
        assert f.loc[seq - 1, "total_tokens_b"] == 0 and f.loc[seq - 1, "total_tokens_a"] > 0
        assert f.loc[seq - 1, "cost_usd_b"] == 0
    assert (f.loc[at - 1:, "total_tokens_b"] > 0).all()
    assert list(f["llm_calls_a"]) == list(f["llm_calls_b"])
    assert c.files().empty
    # the other way round, the fork is side a
    back = ws.compare(fork, original).frame
    assert back["identical"].all() and _col(back, "replayed_a") == [seq < at for seq in (1, 2, 3)]


def test_frame_dtypes(ws: Workspace, original: Job) -> None:
    f = ws.compare(original, ws.fork(original, at=2)).frame
    assert list(f.columns) == ["seq", *[f"{n}_{s}" for s in "ab" for n in (
        "movement", "next_step", "forced", "llm_calls", "total_tokens", "cost_usd", "summary", "replayed")],
        "identical", "diverged"]
    dtypes = {name: str(dtype) for name, dtype in f.dtypes.items()}
    for side in "ab":
        assert dtypes[f"llm_calls_{side}"] == dtypes[f"total_tokens_{side}"] == "Int64"
        assert dtypes[f"forced_{side}"] == dtypes[f"replayed_{side}"] == "boolean"
        assert dtypes[f"cost_usd_{side}"] == "float64"
        assert isinstance(f[f"movement_{side}"].dtype, pd.StringDtype)
    assert dtypes["seq"] == "int64" and dtypes["identical"] == dtypes["diverged"] == "bool"


# -- diverging runs -----------------------------------------------------------------------------------------

def test_an_edited_fork_diverges_exactly_at_the_fork_point(ws: Workspace, tmp_path: Path, original: Job) -> None:
    fork = _edited_fork(ws, tmp_path, original)
    c = ws.compare(original, fork)
    f = c.frame
    assert _col(f, "identical") == [True, False, False]
    assert _col(f, "diverged") == [False, True, False]  # only the first position that differs
    assert c.first_divergence == 2
    assert _col(f, "summary_a") == ["planned", "wrote old.md", "ok"]
    assert _col(f, "summary_b") == ["planned", "wrote new.md", "ok"]
    assert _col(f, "replayed_b") == [True, False, False]
    assert "diverge at run 2" in repr(c)


def test_a_fork_that_only_edits_a_prompt_differs_there(ws: Workspace, original: Job) -> None:
    """The scripted model answers the same whatever the prompt: the edited instruction is the difference."""
    piece = ws.piece(original).replace_movement("implement", instruction="Write it in French.")
    fork = ws.fork(original, at=2, piece=piece)
    f = ws.compare(original, fork).frame
    assert _col(f, "identical") == [True, False, True] and _col(f, "diverged") == [False, True, False]
    assert _col(f, "summary_a") == _col(f, "summary_b")
    # a replay keeps its original's clock in its prompts, so it stays identical even a minute later
    assert ws.compare(original, ws.replay(original)).frame["identical"].all()


def _demo_notes(view: str) -> list[str]:
    return [html.unescape(n) for n in re.findall(r'class="[^"]*anb-demo-note[^"]*"[^>]*>note: ([^<]*)<', view)]


def test_a_demo_fork_with_an_edited_instruction_says_demo_does_not_read_it(ws: Workspace) -> None:
    """On demo an edited instruction gives the same answers, as if the edit were ignored: the fork's view and
    the compare view say once that the demo model does not read it, naming what was edited."""
    job = ws.run(ws.submit("Summarise the inputs", piece="plan-implement-verify", model="demo",
                           inputs={"notes.md": "alpha\n"}))
    piece = ws.piece(job).replace_movement("implement", instruction="Write three bullet points only.",
                                           persona="You are terse.")
    fork = ws.fork(job, at=2, piece=piece)
    assert (fork.output / "report.md").read_bytes() == (job.output / "report.md").read_bytes()  # the symptom
    c = ws.compare(job, fork)
    assert _col(c.frame, "summary_a") == _col(c.frame, "summary_b")
    (note,) = _demo_notes(c.html())
    assert note.startswith(f"job {job.id} and job {fork.id} both ran on the demo model, which does not read "
                           "instructions the way a real model does")
    assert "the edited persona and instruction of implement reached its prompt" in note
    assert "Fork onto a real model" in note
    assert _demo_notes(ws.compare(fork, job).html()) == [note.replace(f"job {job.id} and job {fork.id}",
                                                                       f"job {fork.id} and job {job.id}")]
    assert _demo_notes(fork._repr_html_()) == [note]  # the fork's own view, where it is first shown
    assert _demo_notes(job._repr_html_()) == []  # the original was edited nothing


def test_no_demo_note_where_the_model_reads_the_edit_or_nothing_was_edited(ws: Workspace, tmp_path: Path,
                                                                           original: Job) -> None:
    job = ws.run(ws.submit("Summarise the inputs", piece="plan-implement-verify", model="demo"))
    same = ws.fork(job, at=2)  # nothing edited
    plan_only = ws.fork(job, at=3, piece=ws.piece(job).replace_movement("plan", instruction="Plan more."))
    scripted = ws.fork(original, at=2, piece=ws.piece(original).replace_movement("implement", instruction="French."))
    for a, b in ((job, same), (job, plan_only), (original, scripted), (job, ws.replay(job))):
        assert _demo_notes(ws.compare(a, b).html()) == [], b.id  # plan_only: plan was re-served, never asked
        assert _demo_notes(b._repr_html_()) == [], b.id


def test_files_shows_the_changed_added_and_removed_output(ws: Workspace, tmp_path: Path, original: Job) -> None:
    fork = _edited_fork(ws, tmp_path, original)
    files = ws.compare(original, fork).files()
    assert list(files.columns) == ["path", "change", "size_a", "size_b", "diff"]
    rows = {r.path: r for r in files.itertuples()}
    assert set(rows) == {"new.md", "old.md", "out.md"}
    out = rows["out.md"]
    assert out.change == "changed" and (out.size_a, out.size_b) == (len(V1), len(V2))
    expected = "".join(difflib.unified_diff(V1.splitlines(keepends=True), V2.splitlines(keepends=True),
                                            fromfile="a/output/out.md", tofile="b/output/out.md"))
    assert out.diff == expected
    assert "-second line\n+second line, changed\n" in out.diff
    assert rows["new.md"].change == "added" and pd.isna(rows["new.md"].size_a) and rows["new.md"].size_b == 7
    assert rows["new.md"].diff == "--- /dev/null\n+++ b/output/new.md\n@@ -0,0 +1 @@\n+new.md\n"
    assert rows["old.md"].change == "removed" and rows["old.md"].size_a == 7 and pd.isna(rows["old.md"].size_b)
    assert rows["old.md"].diff == "--- a/output/old.md\n+++ /dev/null\n@@ -1 +0,0 @@\n-old.md\n"
    assert str(files["change"].dtype) == "category" and str(files["size_a"].dtype) == "Int64"
    # the diff applies: b's text is a's with it
    assert _patched(V1, out.diff) == V2


def _patched(text: str, diff: str) -> str:
    """``text`` with a one-hunk unified diff applied (enough to show the diff is right, not only alike)."""
    lines = text.splitlines(keepends=True)
    body = diff.splitlines(keepends=True)
    m = re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@", body[2])
    assert m, body[2]
    start = int(m.group(1)) - 1
    old = [ln[1:] for ln in body[3:] if ln[0] in " -"]
    new = [ln[1:] for ln in body[3:] if ln[0] in " +"]
    assert lines[start:start + len(old)] == old
    return "".join(lines[:start] + new + lines[start + len(old):])


def test_files_binary_no_newline_symlinks_and_unchanged(ws: Workspace, tmp_path: Path, original: Job) -> None:
    fork = ws.fork(original, at=3)
    a, b = original.workdir / "output", fork.workdir / "output"
    (a / "img.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x01")
    (b / "img.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x02\x03")
    (a / "end.txt").write_text("no newline")
    (b / "end.txt").write_text("no newline\n")
    big = "a line of text\n" * (MAX_DIFF_BYTES // 15 + 10)
    (a / "big.txt").write_text(big)
    (b / "big.txt").write_text(big[:-2] + "X\n")  # the same size, one byte apart at the end
    (b / "sub").mkdir()
    (b / "sub" / "deep.txt").write_text("deep\n")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET\n")
    (b / "leak.txt").symlink_to(secret)  # a link out of the work directory is never followed
    (b / "outdir").symlink_to(tmp_path)
    files = ws.compare(original, fork).files()
    rows = {r.path: r for r in files.itertuples()}
    assert set(rows) == {"img.bin", "end.txt", "big.txt", "sub/deep.txt", "leak.txt", "outdir"}
    big_row = rows["big.txt"]  # too large to diff, compared all the same
    assert big_row.change == "changed" and big_row.diff is None and big_row.size_a == big_row.size_b == len(big)
    assert rows["img.bin"].change == "changed" and rows["img.bin"].diff is None
    assert (rows["img.bin"].size_a, rows["img.bin"].size_b) == (10, 11)
    assert rows["end.txt"].diff == ("--- a/output/end.txt\n+++ b/output/end.txt\n@@ -1 +1 @@\n"
                                    "-no newline\n\\ No newline at end of file\n+no newline\n")
    assert rows["sub/deep.txt"].change == "added"
    for link in ("leak.txt", "outdir"):
        assert rows[link].change == "added" and rows[link].diff is None and pd.isna(rows[link].size_b)
    assert "TOP SECRET" not in files.to_string() and not any("TOP SECRET" in (d or "") for d in files["diff"])
    everything = ws.compare(original, fork).files(unchanged=True)
    same = everything[everything["change"] == "same"]
    assert list(same["path"]) == ["old.md", "out.md"] and same["diff"].isna().all()


def test_a_re_served_run_whose_tool_result_changed_is_not_identical(ws: Workspace, original: Job) -> None:
    # the fork copies input/ as it is now: its re-served Read of input/a.md reads something else
    (original.workdir / "input" / "a.md").write_text("changed since")
    fork = ws.fork(original, at=2)
    assert [e.kind for e in fork.events if e.kind == "replay_divergence"] == ["replay_divergence"]
    c = ws.compare(original, fork)
    assert _col(c.frame, "identical")[0] is False and c.first_divergence == 1
    assert _col(c.frame, "replayed_b")[0] is True


def test_runs_of_different_lengths_have_na_on_the_missing_side(ws: Workspace, tmp_path: Path, original: Job) -> None:
    # the fork's verify sends the work back once: 5 runs against the original's 3
    again = [call("Write", path="output/out.md", content=V1), transition("verify", "fixed")]
    verify = [transition("implement", "redo", feedback="say more"), transition("COMPLETE", "ok now")]
    longer = ws.fork(original, at=3, model=_script(tmp_path, "long", verify=verify, implement_again=again))
    assert longer.status == "succeeded", longer.error
    c = ws.compare(original, longer)
    f = c.frame
    assert list(f["seq"]) == [1, 2, 3, 4, 5]
    assert _col(f, "movement_a") == ["plan", "implement", "verify", None, None]
    assert _col(f, "movement_b") == ["plan", "implement", "verify", "implement", "verify"]
    for name in ("next_step_a", "forced_a", "llm_calls_a", "total_tokens_a", "cost_usd_a", "summary_a", "replayed_a"):
        assert f[name].iloc[3:].isna().all(), name
    assert _col(f, "identical") == [True, True, False, False, False]
    assert _col(f, "diverged") == [False, False, True, False, False]
    # the other way round, the longer job is side a and the shorter's missing runs are NA on b
    back = ws.compare(longer, original).frame
    assert back["movement_b"].iloc[3:].isna().all() and not back["identical"].iloc[3:].any()
    html_ = c._repr_html_()
    assert f"only in job {longer.id}" in html_ and f"no run 4 in job {original.id}" in html_


# -- cost ---------------------------------------------------------------------------------------------------

@pytest.fixture
def server(loopback: Callable[..., OpenAIServer]) -> OpenAIServer:
    return loopback("sk-compare-test-0000", retries="1")


def test_cost_is_priced_as_frames_usage_prices_calls(ws: Workspace, server: OpenAIServer) -> None:
    server.actions = [reply("Looking.", [("Glob", {"pattern": "*"})], usage=(12_000, 300)),
                      reply(None, [("transition", {"next_step": "COMPLETE", "summary": "done"})], usage=(15_000, 40))]
    paid = ws.run(ws.submit("look around", piece="single", model="openai:gpt-4o"))
    assert paid.status == "succeeded", paid.error
    replay = ws.replay(paid)
    f = ws.compare(paid, replay).frame
    usage = ws.frames.usage(paid)
    assert f.loc[0, "cost_usd_a"] == pytest.approx(usage["cost_usd"].sum()) and f.loc[0, "cost_usd_a"] > 0
    assert f.loc[0, "cost_usd_b"] == 0  # replay: is an offline model
    assert list(f["total_tokens_a"]) == [12_300 + 15_040] and bool(f.loc[0, "identical"])


# -- HTML ---------------------------------------------------------------------------------------------------

def test_html_shows_both_sides_the_divergence_and_escapes(ws: Workspace, tmp_path: Path, original: Job) -> None:
    fork = _edited_fork(ws, tmp_path, original, say="<script>alert('x')</script> & more")
    c = ws.compare(original, fork)
    page = c._repr_html_()
    assert f"job {original.id} vs job {fork.id}" in page
    assert f"job {fork.id} is a fork of job {original.id}, forked at run 2" in page
    # one row per position, each with both sides' run as the job view shows it
    rows = re.findall(r'<tr class="anb-cmp-row" data-seq="(\d+)"', page)
    assert rows == ["1", "2", "3"]
    for job in (original, fork):
        assert page.count(f'data-anb-key="{job.id}:') >= 3  # movement_html's sections of each job
    # the divergence: marked, anchored, linked from the header, and open on both sides
    anchor = divergence_anchor(original.id, fork.id)
    assert page.count(f'id="{anchor}"') == 1 and f'href="#{anchor}"' in page
    row2 = page[page.index(f'id="{anchor}"'):]
    row2 = row2[:row2.index("</tr>")]
    assert html.escape(DIVERGED_BADGE) in row2 and "<details class=\"anb-mv\" data-seq=\"2\" open" in row2
    assert "wrote old.md" in row2 and "wrote new.md" in row2
    # everything the model said is escaped
    assert "<script>alert" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; more" in page
    assert "<script" not in page
    # the identical run is marked so, and says the fork re-served it
    assert ">same</span>" in page and "re-served" in page


def test_html_is_bounded_like_the_job_view(ws: Workspace, tmp_path: Path, original: Job) -> None:
    fork = _edited_fork(ws, tmp_path, original, say="x" * 50_000)
    c = ws.compare(original, fork)
    page = c.html()
    assert "x" * 2_001 not in page and "x" * 1_000 in page  # bodies cut to max_chars
    small = c.html(max_bytes=2_000)
    assert small.count("details left out to keep this view small") == 4  # runs 1 and 3, both sides
    assert "x" * 1_000 in small  # the first divergence stays in detail
    assert f"%agent show {original.id} --movement 1" in small
    full = c.html(full=True)
    assert "x" * 50_000 in full
    assert "x" * 50_000 in c.html(max_chars=None)  # None lifts that one bound, as in job_html


def test_compare_refuses_an_unknown_job(ws: Workspace, original: Job) -> None:
    with pytest.raises(StoreError, match=r"^no job 99 in "):
        ws.compare(original, 99)
    with pytest.raises(StoreError, match="job must be a Job or a job id"):
        ws.compare("first", original)


# -- %agent compare -----------------------------------------------------------------------------------------

def test_magic_compare_in_a_real_shell(shell: InteractiveShell, tmp_path: Path) -> None:
    ws = Workspace(shell.run_line_magic("config", "AgentMagic.workspace"))
    job = _job(ws, _script(tmp_path, "s"))
    fork = _edited_fork(ws, tmp_path, job)
    shell.user_ns["t_fork"] = fork
    with capture_output():
        result = shell.run_cell(f"%agent compare {job.id} t_fork")
    assert result.error_in_exec is None
    c = result.result
    assert isinstance(c, Comparison) and (c.a, c.b) == (job.id, fork.id) and c.first_divergence == 2
    # the cell's value shows as the side-by-side view (what a notebook's display hook sends)
    data, _ = shell.display_formatter.format(c)
    assert f"job {job.id} vs job {fork.id}" in data["text/html"] and DIVERGED_BADGE in data["text/html"]
    assert data["text/plain"] == repr(c) and "\n" not in data["text/plain"]
    # `c = %agent compare A B` keeps the value
    shell.run_cell(f"t_c = %agent compare {{{fork.id}}} {job.id}")
    assert shell.user_ns["t_c"].a == fork.id
    with pytest.raises(UsageError) as info:
        shell.run_line_magic("agent", f"compare {job.id} 99")
    text = str(info.value)
    assert text.startswith("%agent compare: no job 99 in workspace") and "\n" not in text
    with pytest.raises(UsageError) as info:
        shell.run_line_magic("agent", f"compare {job.id}")
    assert str(info.value).startswith("%agent compare: ") and "\n" not in str(info.value)
    with pytest.raises(UsageError, match=r"^%agent compare: JOB 't_nothing' is neither a job id"):
        shell.run_line_magic("agent", f"compare t_nothing {job.id}")


def test_no_link_in_output_is_followed_even_when_output_itself_is_one(ws: Workspace, tmp_path: Path,
                                                                       original: Job) -> None:
    fork = ws.fork(original, at=3)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "x.txt").write_text("outside\n")
    out = fork.workdir / "output"
    for p in sorted(out.iterdir()):
        p.unlink()
    os.rmdir(out)
    out.symlink_to(outside)
    files = ws.compare(original, fork).files()
    assert set(files["change"]) == {"removed"} and "x.txt" not in set(files["path"])


def test_a_kernel_shows_the_demo_note_with_the_fork_and_the_comparison(tmp_path: Path) -> None:
    """As notebook 06's reader meets it: the fork displayed after ws.fork, then ws.compare and %agent compare,
    each drawn by a real ipykernel as text/html with the note once."""
    import nbformat
    from nbclient import NotebookClient

    cells = [
        "%load_ext agentnb\nws = agentnb.Workspace('ws')\n%config AgentMagic.workspace = 'ws'\n"
        "job = ws.run(ws.submit('Summarise the inputs', piece='plan-implement-verify', model='demo'))",
        "brief = ws.piece(job).replace_movement('implement', instruction='Three bullet points only.')\n"
        "fork = ws.fork(job, at=2, piece=brief)\nfork",
        "ws.compare(job, fork)",
        "%agent compare {job.id} {fork.id}",
        "job",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                         *filter(None, [os.environ.get("PYTHONPATH")])])
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute(env=env)

    def notes(i: int) -> list[str]:
        shown = [o["data"]["text/html"] for o in nb.cells[i].outputs if "text/html" in o.get("data", {})]
        assert len(shown) == 1, nb.cells[i].outputs
        return _demo_notes(shown[0])

    expected = ("job 1 and job 2 both ran on the demo model, which does not read instructions the way a real model "
                "does")
    for i in (1, 2, 3):
        (note,) = notes(i)
        assert note.startswith(expected) and "the edited instruction of implement reached its prompt" in note
    assert notes(4) == []
