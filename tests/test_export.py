"""Notebook transcripts: valid nbformat v4, one collapsed section per movement run, nothing secret."""

from __future__ import annotations

import ast
import base64
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import nbformat
import pytest
from _scripting import call, transition, write_piece, write_script
from _usage_jobs import demo_job, usage_job

from agentnb import Workspace
from agentnb.cli import main as cli
from agentnb.export import TRANSCRIPT_TAG


def _read(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    return nb


def _sections(nb: nbformat.NotebookNode) -> list[tuple[str, nbformat.NotebookNode]]:
    """(heading source, transcript cell) per movement run."""
    out = []
    for i, cell in enumerate(nb.cells):
        if TRANSCRIPT_TAG in cell.metadata.get("tags", []):
            assert nb.cells[i - 1].cell_type == "markdown"
            out.append((nb.cells[i - 1].source, cell))
    return out


def test_export_writes_a_valid_notebook_with_one_collapsed_section_per_movement(ws: Workspace, tmp_path: Path) -> None:
    job = usage_job(ws, tmp_path / "scripts", instruction="Report on input/notes.md <b>now</b> | fast")
    path = ws.export_notebook(job, tmp_path / "out" / "run.ipynb")
    assert path == (tmp_path / "out" / "run.ipynb").resolve()
    nb = _read(path)
    assert nb.nbformat == 4 and nb.metadata["agentnb"]["job"] == job.id

    title = nb.cells[0]
    assert title.cell_type == "markdown"
    assert title.source.startswith(f"# Job {job.id}: Report on input/notes.md &lt;b&gt;now&lt;/b&gt; \\| fast")
    for fact in ("`usage-probe`", "**succeeded**", "| movements run | 2 |", "| LLM calls | 5 |", "24,370"):
        assert fact in title.source

    sections = _sections(nb)
    runs = ws.frames.movements(job)
    assert len(sections) == len(runs) == 2
    assert [h.splitlines()[0] for h, _ in sections] == ["## 1. gather → write", "## 2. write → COMPLETE (forced)"]
    for (heading, cell), seq in zip(sections, runs["seq"], strict=False):
        assert cell.cell_type == "code"
        assert cell.metadata["collapsed"] is True
        # outputs hidden, source shown: JupyterLab hides the output's caption while the source is hidden too
        assert cell.metadata["jupyter"] == {"outputs_hidden": True}
        assert len(cell.source.splitlines()) == 1 and f"job={job.id}, seq={seq})" in cell.source
        (output,) = cell.outputs
        assert output.output_type == "display_data"
        assert f'data-seq="{seq}"' in output.data["text/html"]
        # JupyterLab labels a collapsed output with its first line: a readable caption, not markup
        assert output.data["text/html"].splitlines()[0].startswith(f"Movement run {heading[3:].splitlines()[0]} · ")
        assert output.data["text/plain"].startswith(f"=== movement run {seq}:")

    gather_html, gather_text = (sections[0][1].outputs[0].data[k] for k in ("text/html", "text/plain"))
    for text in (gather_html, gather_text):
        assert "You gather facts." in text and "Looking around." in text  # prompt and assistant message
        assert "input/notes.md" in text and "alpha" in text  # tool call and its result
        assert "notes.md holds two lines" in text  # the transition's lessons
    write_html, write_text = (sections[1][1].outputs[0].data[k] for k in ("text/html", "text/plain"))
    for text in (write_html, write_text):
        assert "warn" in text and "prompt" in text and "force_transition" in text  # context actions
        assert "no such file" in text  # the failing tool's error
    assert "!! context warn: 88.0% ≥ 70%" in write_text and "< Read [error]" in write_text
    assert "Writing &amp; checking." in write_html  # model text is escaped in HTML
    assert "*5 LLM calls" not in nb.cells[0].source and "| LLM calls | 5 |" in nb.cells[0].source

    # the usage timeline is embedded as a PNG
    pngs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.data]
    assert len(pngs) == 1 and base64.b64decode(pngs[0].data["image/png"])[:4] == b"\x89PNG"


def test_exported_usage_plot_is_large_enough_to_read(ws: Workspace, tmp_path: Path) -> None:
    """At 80 dpi with no size given, the plot's labels were 7 px high.  Now: twice the pixels, shown 1,000 px
    wide (10 in at 100 px per inch), so a 7 pt label is 10 px high and sharp on a high-density screen."""
    import struct

    job = usage_job(ws, tmp_path / "scripts")
    nb = _read(ws.export_notebook(job, tmp_path / "t.ipynb"))
    (out,) = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.data]
    png = base64.b64decode(out.data["image/png"])
    width, height = struct.unpack(">II", png[16:24])
    shown = out.metadata["image/png"]
    assert shown["width"] >= 1000 and shown["height"] >= 600
    assert (width, height) == (2 * shown["width"], 2 * shown["height"])
    # PNG, not SVG: JupyterLab shows no SVG output in an untrusted notebook, and a transcript opens untrusted
    assert "image/svg+xml" not in out.data


def test_transcript_cell_source_re_renders_the_run(ws: Workspace, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    job = usage_job(ws, tmp_path / "scripts")
    nb = _read(ws.export_notebook(job, tmp_path / "t.ipynb"))
    _, cell = _sections(nb)[1]
    # the source names the workspace from the notebook's folder (no local absolute path), where Jupyter runs it
    assert str(tmp_path) not in cell.source
    monkeypatch.chdir(tmp_path)
    tree = ast.parse(cell.source)
    scope: dict[str, object] = {}
    exec(compile(ast.Module(body=tree.body[:-1], type_ignores=[]), "cell", "exec"), scope)
    shown = eval(compile(ast.Expression(body=tree.body[-1].value), "cell", "eval"), scope)  # type: ignore[attr-defined]
    assert 'data-seq="2"' in shown.data and "force_transition" in shown.data


def test_export_of_the_demo_job_through_the_cli(ws: Workspace, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = demo_job(ws)
    assert cli(["export", "--workspace", str(ws.root), str(job.id), str(tmp_path)]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == (tmp_path / f"job-{job.id}.ipynb").resolve()
    nb = _read(path)
    sections = _sections(nb)
    assert [h.split("\n")[0] for h, _ in sections] == [
        "## 1. plan → implement", "## 2. implement → verify", "## 3. verify → COMPLETE"]
    verify_text = sections[2][1].outputs[0].data["text/plain"]
    assert "[truncated]" in verify_text  # the demo's budgeted Read
    assert verify_text.count("!! context") == 2


def test_comments_between_movements_and_waiting_jobs(ws: Workspace, tmp_path: Path) -> None:
    script = write_script(tmp_path, "ask", responses=[
        {"tool_calls": [{"name": "transition", "arguments": {"next_step": "ASK", "summary": "unclear",
                                                             "question": "Which format?"}}]},
        {"tool_calls": [{"name": "transition", "arguments": {"next_step": "COMPLETE", "summary": "done"}}]},
    ])
    job = ws.run(ws.submit("Write it", piece="single", model=script))
    assert job.status == "waiting_human"
    nb = _read(ws.export_notebook(job, tmp_path / "waiting.ipynb"))
    assert "**waiting_human**" in nb.cells[0].source
    ws.reply(job, "Markdown <please>")
    job = ws.run(job)
    nb = _read(ws.export_notebook(job, tmp_path / "done.ipynb"))
    sources = [c.source for c in nb.cells if c.cell_type == "markdown"]
    ask = next(i for i, s in enumerate(sources) if s.startswith("## 1. work → ASK"))
    question = next(i for i, s in enumerate(sources) if "Which format?" in s)
    reply = next(i for i, s in enumerate(sources) if "Markdown &lt;please&gt;" in s)
    complete = next(i for i, s in enumerate(sources) if s.startswith("## 2. work → COMPLETE"))
    assert ask < question < reply < complete


def test_export_never_writes_a_key_and_refuses_bad_paths(ws: Workspace, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "sk-test-0123456789abcdefXYZ"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    job = ws.run(ws.submit(f"Summarise input/notes.md (key {secret})", piece="plan-implement-verify",
                           model="demo", inputs={"notes.md": f"alpha\nkey={secret}\n"}))
    path = ws.export_notebook(job, tmp_path / "k.ipynb")
    text = path.read_text(encoding="utf-8")
    assert secret not in text and "***" in text
    _read(path)
    with pytest.raises(ValueError, match=r"must end in \.ipynb"):
        ws.export_notebook(job, tmp_path / "k.html")


def test_export_masks_what_tool_results_are_cleared_of(ws: Workspace, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # a URL's password is a secret whatever its variable is called (export had a list of its own)
    password = "s3cr3t-pw-0123456789"
    monkeypatch.setenv("DATABASE_URL", f"postgresql://app:{password}@db/prod")
    job = ws.submit(f"Check the schema behind postgresql://app:{password}@db/prod", piece="single", model="demo")
    text = ws.export_notebook(job, tmp_path / "u.ipynb").read_text(encoding="utf-8")
    assert password not in text and "***" in text


def test_export_masks_every_name_the_bash_filter_treats_as_secret(ws: Workspace, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # one pattern (agentnb._secrets) for Bash, the git excerpt and export: a *CREDENTIAL* is a secret in all
    credential = "cred-0123456789-abcdef"
    region = "region-0123456789-north"
    monkeypatch.setenv("SERVICE_CREDENTIAL", credential)
    monkeypatch.setenv("SERVICE_REGION", region)
    job = ws.submit(f"Deploy with {credential} to {region}", piece="single", model="demo")
    text = ws.export_notebook(job, tmp_path / "c.ipynb").read_text(encoding="utf-8")
    assert credential not in text and f"Deploy with *** to {region}" in text


def test_export_of_a_job_that_never_ran(ws: Workspace, tmp_path: Path) -> None:
    job = ws.submit("later", piece="single", model="demo")
    nb = _read(ws.export_notebook(job, tmp_path / "q.ipynb"))
    assert len(nb.cells) == 1 and "**queued**" in nb.cells[0].source


def test_headings_name_failed_and_unfinished_runs_and_subtasks_are_listed(ws: Workspace, tmp_path: Path) -> None:
    # a run that ends in failure, and one call (singular) per run
    failing = write_script(tmp_path, "fails", {"work": [call("Glob", pattern="*")]})
    job = ws.run(ws.submit("fail", piece="single", model=failing))
    assert job.status == "failed"
    (heading, cell), = _sections(_read(ws.export_notebook(job, tmp_path / "failed.ipynb")))
    assert heading.startswith("## 1. work ✖ failed\n\n*1 LLM call · ")
    assert "ran out of responses" in cell.outputs[0].data["text/plain"]

    # a run paused between two calls
    two = write_script(tmp_path, "two", {"work": [call("Glob", pattern="*"), transition("COMPLETE")]})
    paused = ws.step(ws.submit("pause", piece="single", model=two), unit="call")
    (heading, _), = _sections(_read(ws.export_notebook(paused, tmp_path / "paused.ipynb")))
    assert heading.startswith("## 1. work (not finished)")

    # a parent's transcript names its child jobs
    child = write_script(tmp_path, "child", {"work": [transition("COMPLETE", summary="子の結果")]})
    parent = ws.run(ws.submit("fan out", piece="fan-out", model=write_script(tmp_path, "parent", {
        "split": [transition("WAIT_SUBTASKS", summary="split", subtasks=[
            {"instruction": "子タスク一", "piece": "single", "model": child},
            {"instruction": "子タスク二", "model": child}])],
        "merge": [transition("COMPLETE", summary="merged")]})))
    assert parent.status == "succeeded", parent.error
    kids = [c.id for c in ws.children(parent)]
    split_text = _sections(_read(ws.export_notebook(parent, tmp_path / "parent.ipynb")))[0][1].outputs[0].data["text/plain"]
    assert f"  subtasks:\n    - job {kids[0]}: 子タスク一 (single)\n    - job {kids[1]}: 子タスク二" in split_text


@pytest.fixture()
def lab_over(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A JupyterLab server on loopback over ``tmp_path / "lab"`` (yields its URL), as in test_browser."""
    import os
    import subprocess
    import sys

    from test_browser import _chromium, _free_port, _wait_for_lab

    _chromium()  # skips off CI when there is no browser
    root, home = tmp_path / "lab", tmp_path / "home"
    root.mkdir()
    tracker = home / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text('{"windowingMode": "none"}')  # every cell in the DOM, not only those in view
    notify = home / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notify.parent.mkdir(parents=True)
    notify.write_text('{"fetchNews": "false", "checkForUpdates": false}')
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(home / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(home / "ws"))
    port = _free_port()
    log = tmp_path / "lab.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip", "127.0.0.1",
             "--port", str(port), "--ServerApp.token=", "--ServerApp.password=", f"--ServerApp.root_dir={root}",
             "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
             "--LabApp.extension_manager=readonly"],
            cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for_lab(f"http://127.0.0.1:{port}/lab", proc, log)
        yield f"http://127.0.0.1:{port}", root
    finally:
        proc.terminate()  # our own server, by its process
        proc.wait(timeout=30)


@pytest.mark.needs("chromium")
def test_transcript_opens_collapsed_in_jupyterlab_and_expands_with_one_click(ws: Workspace, tmp_path: Path,
                                                                              lab_over) -> None:  # type: ignore[no-untyped-def]
    """What a user sees: one caption per movement run, no transcript shown; a click on a caption opens that run."""
    from playwright.sync_api import expect, sync_playwright
    from test_browser import ARTIFACTS, CHROMIUM_ARGS, _chromium

    url, root = lab_over
    job = usage_job(ws, tmp_path / "scripts", instruction="報告を書く: input/notes.md")
    ws.export_notebook(job, root / "transcript.ipynb")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium(), headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        try:
            page.goto(f"{url}/lab/tree/transcript.ipynb")
            page.locator(".jp-Notebook").first.wait_for(timeout=60_000)
            captions = page.locator(".jp-OutputPlaceholder")
            expect(captions).to_have_count(2, timeout=30_000)
            for i, text in enumerate(["Movement run 1. gather → write · 3 LLM calls",
                                      "Movement run 2. write → COMPLETE (forced) · 2 LLM calls"]):
                expect(captions.nth(i)).to_be_visible()
                expect(captions.nth(i)).to_contain_text(text)
            expect(page.locator("details.anb-mv")).to_have_count(0)  # every transcript collapsed
            # the usage plot: 2,000 px drawn, shown 1,000 px wide, or as wide as the output area when narrower
            plot = page.locator(".jp-RenderedImage img").first
            expect(plot).to_be_visible(timeout=30_000)
            assert plot.evaluate("img => [img.naturalWidth, img.getAttribute('width')]") == [2000, "1000"]
            box, area = plot.bounding_box(), page.locator(".jp-RenderedImage").first.bounding_box()
            assert box is not None and area is not None and box["width"] >= min(990, area["width"] - 30), (box, area)
            plot.screenshot(path=str(ARTIFACTS / "export-usage-plot.png"))
            captions.nth(1).scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "export-collapsed.png"))

            captions.nth(1).click()
            # (an untrusted notebook's HTML is sanitized: data-* attributes go, classes and <details> stay)
            run = page.locator("details.anb-mv")
            expect(run).to_have_count(1)  # the other run stays closed
            expect(run).to_be_visible()
            expect(run.locator(":scope > summary")).to_contain_text("write")
            expect(run).to_contain_text("force_transition")
            expect(run).to_contain_text("no such file")
            run.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "export-expanded.png"))
        finally:
            browser.close()


def test_the_transcript_has_no_local_absolute_path(ws: Workspace, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import agentnb
    from agentnb.tools.base import unregister

    @agentnb.tool(name="TestWhere")
    def where(ctx: agentnb.ToolContext) -> str:
        """Say where the report goes."""
        return f"the report goes to {ctx.workdir / 'output' / 'report.md'}"

    try:
        piece = write_piece(tmp_path, "where", {"movements": [{
            "name": "work", "persona": "p", "instruction": "i", "tools": ["TestWhere"], "permission": "readonly",
            "rules": [{"condition": "done", "next": "COMPLETE"}]}]})
        script = write_script(tmp_path, "where-script", {"work": [call("TestWhere"), transition("COMPLETE")]})
        job = ws.run(ws.submit("where?", piece=piece, model=script))
        assert job.status == "succeeded", job.error
        assert str(ws.root) in ws.events(job, kinds=["tool_result"])[0].payload["content"]
        path = ws.export_notebook(job, tmp_path / "out" / "run.ipynb")
        text = path.read_text(encoding="utf-8")
        assert str(tmp_path) not in text and str(ws.root) not in text
        # a path inside the workspace reads relative to it; code names the workspace from the notebook's folder
        assert f"the report goes to jobs/{job.id}/output/report.md" in text
        assert "from `../ws`" in text and "transcript('../ws', job=" in text
        monkeypatch.chdir(path.parent)  # where Jupyter runs the notebook's cells
        from agentnb.export import transcript

        assert 'data-seq="1"' in transcript("../ws", job=job.id, seq=1).data
    finally:
        unregister("TestWhere")
