"""The quickstart and design-lab notebooks in a real JupyterLab, driven by Playwright in Debian's Chromium.

This is what a new user does: open ``notebooks/01-quickstart.ipynb``, run every cell, open a
movement's collapsible section, and press a button of the ``%agent panel`` widget; then, in a
notebook of their own, answer a job's question in the panel's Reply box, save, and reopen the
notebook to find the run still shown.  Screenshots are kept in ``tests/artifacts/`` (a CI
artifact, gitignored).

Playwright's own browser download is not possible on these machines, so the test launches the
system's ``chromium``.  Without it (or without the ``playwright`` package) the test is skipped
on a developer machine, but fails when ``CI`` is set: CI must never pass by skipping it.
"""

from __future__ import annotations

import contextlib
import http.cookies
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
NOTEBOOK = "notebooks/01-quickstart.ipynb"
DESIGN_LAB = "notebooks/05-design-lab.ipynb"
# every test here drives chromium (conftest: skipped without it off CI; .ci/run's pass on a machine without it
# selects `-m needs`)
pytestmark = pytest.mark.needs("chromium")

# Flags seen working here as root with no network: no sandbox (root), no GPU (no screen), and no
# background traffic to Google's hosts, which this machine's closed network would refuse.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]

LAB_START_TIMEOUT = 90.0  # seconds; about 10 s on 2 cores, more on a loaded CI machine
RUN_ALL_TIMEOUT_MS = 180_000


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"browser test cannot run in CI: {reason}")
    pytest.skip(reason)


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        _unavailable("no chromium on PATH (apt-get install -y chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _unavailable("the playwright package is not installed (pip install -e '.[browser]')")
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_lab(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + LAB_START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"jupyter lab did not answer {url} within {LAB_START_TIMEOUT:.0f} s:\n"
                       f"{log.read_text()[-3000:]}")


@dataclass
class Lab:
    url: str
    log: Path
    root: Path  # the server's root folder (a copy of notebooks/ and pieces/)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """A JupyterLab server on loopback over a copy of the notebooks and pieces."""
    _chromium()
    root = tmp_path_factory.mktemp("lab")
    shutil.copytree(REPO / "notebooks", root / "notebooks",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "agentnb-data", "*.html"))
    shutil.copytree(REPO / "pieces", root / "pieces")
    home = root / "home"  # a clean Jupyter settings/runtime folder, so no user state leaks in
    home.mkdir()
    # no "get notified about Jupyter news?" toast over the notebook, and no update check
    notify = home / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notify.parent.mkdir(parents=True)
    notify.write_text('{"fetchNews": "false", "checkForUpdates": false}')
    # start the notebook's kernel without the "Select Kernel" dialog, and render every cell (the
    # default windowing leaves cells outside the viewport out of the DOM)
    tracker = home / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text('{"autoStartDefaultKernel": true, "windowingMode": "none"}')
    port = _free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(home / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(home / "ws"),
               AGENTNB_WORKSPACE=str(root / "agentnb-data"))
    log = root / "lab.log"
    cmd = [
        sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
        "--ip", "127.0.0.1", "--port", str(port),
        "--ServerApp.token=", "--ServerApp.password=",
        f"--ServerApp.root_dir={root}",  # laid out like the repository (and like Binder)
        # no requests to the internet: no news feed, no update check, no PyPI extension manager
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_for_lab(f"{base}/lab", proc, log)
        yield Lab(base, log, root)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _api(lab: Lab, method: str, path: str, body: dict[str, object] | None = None) -> object:
    """A call of the lab's REST API (the server's XSRF check wants its cookie echoed in a header)."""
    with urllib.request.urlopen(f"{lab.url}/lab", timeout=30) as resp:
        jar: http.cookies.SimpleCookie = http.cookies.SimpleCookie()
        for cookie in resp.headers.get_all("Set-Cookie") or []:
            jar.load(cookie)
    xsrf = jar["_xsrf"].value if "_xsrf" in jar else ""
    req = urllib.request.Request(f"{lab.url}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-XSRFToken": xsrf,
                                          "Cookie": f"_xsrf={xsrf}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"null")


def _session_kernel(lab: Lab, path: str) -> dict[str, object] | None:
    """The kernel (id, execution_state, connections) of the lab's session of notebook ``path``, if any."""
    sessions = _api(lab, "GET", "/api/sessions")
    assert isinstance(sessions, list)
    return next((s["kernel"] for s in sessions if s["path"] == path), None)


def _open(page, lab: Lab, path: str, reset: bool = True) -> str:  # type: ignore[no-untyped-def]
    """Open notebook ``path`` (relative to the lab's root) on a kernel the lab's REST API started for it before
    the page loads, and return the kernel's id.

    Left to the page, JupyterLab could start the notebook's kernel twice on a loaded machine: it shut the first
    one down while it was still importing, and Run All Cells then went nowhere (the cells' prompts cleared, no
    cell ran).  A session that exists when the notebook opens is joined instead: one kernel, no race."""
    session = _api(lab, "POST", "/api/sessions", {"path": path, "type": "notebook", "name": Path(path).name,
                                                  "kernel": {"name": "python3"}})
    assert isinstance(session, dict)
    page.goto(f"{lab.url}/lab/tree/{path}" + ("?reset" if reset else ""))
    return str(session["kernel"]["id"])


@dataclass
class Shot:
    """The screenshot a test leaves in ARTIFACTS when it ends, passed or failed (none when ``name`` is None).  A test
    renames it as it gets further (``shot.name = "x-done.png"``), so that a failure's picture says where it stopped."""
    name: str | None
    full_page: bool = False


@contextlib.contextmanager
def _lab_page(lab: Lab, shot: str | None, full_page: bool = False,
              env: dict[str, str] | None = None) -> Iterator[tuple[Any, Shot]]:
    """A 1400×1000 page of a headless Chromium (launched with ``env``, else this process's), and the Shot taken
    of it at the end; an error inside is raised again with the tail of the lab's log."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    end = Shot(shot, full_page)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium(), headless=True, args=CHROMIUM_ARGS, env=env)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            yield page, end
        except Exception as exc:
            raise AssertionError(f"{exc}\n--- jupyter lab log (tail) ---\n{lab.log_tail()}") from exc
        finally:
            if end.name is not None:
                page.screenshot(path=str(ARTIFACTS / end.name), full_page=end.full_page)
            browser.close()


def _run_all_cells(page, lab: Lab, path: str, kernel: str) -> None:  # type: ignore[no-untyped-def]
    """Run > Run All Cells, then wait until the kernel has run every code cell."""
    _start_all_cells(page, lab, path, kernel)
    # every code cell's prompt shows a number once it ran ("[*]:" while queued or running)
    page.wait_for_function(
        """() => {
            const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];
            return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
        }""",
        timeout=RUN_ALL_TIMEOUT_MS,
    )


def _start_all_cells(page, lab: Lab, path: str, kernel: str) -> None:  # type: ignore[no-untyped-def]
    """Run > Run All Cells, and return once the kernel (``kernel``, started by ``_open``) has started on them."""
    page.locator(".jp-Notebook").first.wait_for(timeout=60_000)
    # the page has joined the notebook's session: its kernel is still the one started for it, connected
    deadline = time.monotonic() + LAB_START_TIMEOUT
    while True:
        now = _session_kernel(lab, path)
        assert now is not None and now["id"] == kernel, f"the notebook's kernel changed: {now}\n{lab.log_tail()}"
        if int(now["connections"]) >= 1:  # type: ignore[call-overload]
            break
        assert time.monotonic() < deadline, f"the page never connected to the notebook's kernel:\n{lab.log_tail()}"
        time.sleep(0.25)
    # and it shows the kernel connected and idle, or Run All does nothing
    page.wait_for_function(
        """() => {
            const el = document.querySelector('.jp-Notebook-ExecutionIndicator');
            return el && el.getAttribute('data-status') === 'idle';
        }""",
        timeout=90_000,
    )
    prompts_js = "[...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.textContent.trim())"
    before = page.evaluate(prompts_js)
    # started: a cell is queued/running or got a new number (saved outputs keep old numbers)
    started = f"""() => {{
        const now = {prompts_js};
        const before = {before!r};
        return now.some((t, i) => t.includes('*') || (/\\[\\d+\\]/.test(t) && t !== before[i]));
    }}"""
    page.locator(".jp-Notebook .jp-Cell").first.click()  # make the notebook the current widget
    for attempt in range(4):
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        try:
            page.wait_for_function(started, timeout=15_000)
            break
        except Exception:  # a Run All the kernel missed only clears the prompts: ask again
            if attempt == 3:
                raise


def _notebook(lab: Lab, name: str, cells: list[str], shots: str) -> Path:
    """Write ``cells`` as notebook ``name`` in the lab's folder and clear the test's old ``shots-*.png``."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(cells=[new_code_cell(src) for src in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = lab.root / name
    nbformat.write(nb, path)
    ARTIFACTS.mkdir(exist_ok=True)
    for old in ARTIFACTS.glob(f"{shots}-*.png"):
        old.unlink()
    return path


def _assert_no_cell_raised(page) -> None:  # type: ignore[no-untyped-def]
    stderr = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    raised = [t for t in stderr.all_inner_texts() if "Traceback" in t or "Error" in t]
    assert not raised, f"a cell raised in JupyterLab:\n{raised[0][:3000]}"


def test_quickstart_runs_in_jupyterlab(lab: Lab) -> None:
    from playwright.sync_api import expect

    ARTIFACTS.mkdir(exist_ok=True)
    for old in ARTIFACTS.glob("quickstart-*.png"):
        old.unlink()
    with _lab_page(lab, "quickstart-panel.png") as (page, _):
        kernel = _open(page, lab, NOTEBOOK, reset=False)
        _run_all_cells(page, lab, NOTEBOOK, kernel)
        _assert_no_cell_raised(page)

        # the finished demo job renders one collapsible section per movement run
        view = page.locator(".jp-OutputArea-output .anb-job").filter(has=page.locator("details.anb-mv")).first
        sections = view.locator("details.anb-mv[data-seq]")
        expect(sections).to_have_count(3)
        for seq, name in ((1, "plan"), (2, "implement"), (3, "verify")):
            expect(view.locator(f"details.anb-mv[data-seq='{seq}'] > summary")).to_contain_text(name)

        # a closed section opens on a click on its title and shows what happened inside
        seq = view.locator("details.anb-mv:not([open])").first.get_attribute("data-seq")
        assert seq is not None, "every movement section is already open; none to expand"
        closed = view.locator(f"details.anb-mv[data-seq='{seq}']")
        body = closed.locator(":scope > .anb-body")
        expect(body).to_be_hidden()
        closed.locator(":scope > summary").click()
        expect(closed).to_have_attribute("open", "")
        expect(body).to_be_visible()
        expect(body).to_contain_text("assistant")
        expect(body.locator(".anb-tool").first).to_be_visible()
        closed.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "quickstart-movements.png"))

        # the panel opened on the queued job; Step runs its first movement, live in the panel
        # (an ipywidgets button's accessible name includes its icon glyph, so match its text)
        panel_step = page.locator("button.widget-button").filter(has_text=re.compile(r"^\s*Step\s*$"))
        expect(panel_step).to_have_count(1)
        expect(panel_step).to_be_enabled()
        panel = page.locator(".widget-vbox").filter(has=panel_step).last
        expect(panel.locator("div.widget-label", has_text="of 12 movements")).to_contain_text("0 of 12 movements")
        panel_step.click()
        expect(panel.locator("div.widget-label", has_text="of 12 movements")).to_contain_text(
            "1 of 12 movements", timeout=60_000)
        stepped = panel.locator("details.anb-mv[data-seq='1'] > summary")
        expect(stepped).to_contain_text("plan")
        # stepped part-way, the job is paused (stored as queued), in the list as in the view
        expect(panel.locator("select option", has_text="paused · plan-implement-verify")).to_be_attached()
        expect(panel.locator(".anb-job .anb-st-paused").first).to_have_text("paused")
        panel_step.scroll_into_view_if_needed()
        page.mouse.wheel(0, 300)
    shots = sorted(ARTIFACTS.glob("quickstart-*.png"))
    assert len(shots) == 2 and all(p.stat().st_size > 10_000 for p in shots), "a screenshot is missing or empty"



def test_design_lab_runs_in_jupyterlab(lab: Lab) -> None:
    """Notebook 05 as a new user runs it, fresh: every cell runs, and the batch, its summary table, the
    plot and the worst job's view are drawn."""
    from playwright.sync_api import expect

    with _lab_page(lab, "design-lab.png") as (page, _):
        # ?reset: only this notebook open (the lab is shared with the other tests)
        kernel = _open(page, lab, DESIGN_LAB)
        _run_all_cells(page, lab, DESIGN_LAB, kernel)
        _assert_no_cell_raised(page)
        outputs = page.locator(".jp-OutputArea-output")
        expect(outputs.filter(has_text="<Batch 'review-or-not': 16/16 ended · 16 succeeded>")).to_have_count(1)
        expect(outputs.filter(has_text="the review adds 0.38 coverage")).to_have_count(1)
        expect(outputs.locator("table").filter(has_text="release-notes-reviewed").first).to_be_visible()
        expect(outputs.locator("img").first).to_be_visible()  # plot_batch's figure
        worst = outputs.locator(".anb-job").filter(has=page.locator("details.anb-mv")).first
        expect(worst.locator("details.anb-mv[data-seq]")).to_have_count(4)  # draft, review, draft, review
        worst.scroll_into_view_if_needed()



@pytest.mark.parametrize("notebook", ["notebooks/06-fork-compare.ipynb", "notebooks/07-compaction-loops.ipynb"])
def test_fork_compare_and_compaction_notebooks_run_in_jupyterlab(lab: Lab, notebook: str) -> None:
    """Notebooks 06 and 07 as a new user runs them, fresh: every cell runs, every figure is drawn whole
    inside its output (the what-if plot's labels themselves are checked on the Agg canvas in
    test_what_if.py), and the fork, comparison and compaction views show.  Each figure is kept as an
    artifact of its own, to look at."""
    from playwright.sync_api import expect

    stem = Path(notebook).stem
    with _lab_page(lab, f"{stem}.png", full_page=True) as (page, _):
        kernel = _open(page, lab, notebook)
        _run_all_cells(page, lab, notebook, kernel)
        _assert_no_cell_raised(page)
        outputs = page.locator(".jp-OutputArea-output")
        images = outputs.locator("img")
        expect(images.first).to_be_visible()
        sizes = images.evaluate_all(
            "els => els.map(e => [e.naturalWidth, e.getBoundingClientRect().width,"
            " e.closest('.jp-OutputArea-output').getBoundingClientRect().width])")
        # each figure decoded, and shown no wider than its output (a figure wider than the output is cut)
        assert sizes and all(natural > 0 and 0 < shown <= area + 1 for natural, shown, area in sizes), sizes
        for i in range(len(sizes)):
            images.nth(i).scroll_into_view_if_needed()
            images.nth(i).screenshot(path=str(ARTIFACTS / f"{stem}-figure-{i + 1}.png"))
        expect(outputs.locator(".anb-job").first).to_be_visible()
        if stem.startswith("06"):
            # the comparison of the fork with its original, side by side and within the output
            table = outputs.locator("table.anb-cmp").first
            expect(table).to_be_visible()
            assert table.evaluate("el => el.scrollWidth <= el.closest('.jp-OutputArea-output').clientWidth + 1")
        assert _overflow(page, ".anb-job") == [], _overflow(page, ".anb-job")


# A notebook as a new user would write it: run a piece that asks, open the panel, show the job.
ASK_CELLS = [
    '%load_ext agentnb\n%config AgentMagic.workspace = "agentnb-data"',
    'asker = %agent run --piece ask-first --model demo "Summarise the meeting for the team"',
    "%agent panel",
    "%agent show asker",
]
ANSWER = "A bullet list, at most five points."


def _run_cell(page, index: int) -> None:  # type: ignore[no-untyped-def]
    """Run one code cell with Ctrl+Enter and wait until its prompt shows a new number."""
    prompt = f"document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')[{index}].textContent.trim()"
    before = page.evaluate(prompt)
    page.locator(".jp-Notebook .jp-CodeCell").nth(index).locator(".jp-InputArea-editor").click()
    page.keyboard.press("Control+Enter")
    page.wait_for_function(f"() => {{ const t = {prompt}; return /\\[\\d+\\]/.test(t) && t !== {before!r}; }}",
                           timeout=RUN_ALL_TIMEOUT_MS)


def _saved_outputs(path: Path, index: int) -> str:
    import nbformat

    try:
        nb = nbformat.read(path, as_version=4)
    except Exception:
        return ""
    return "".join(str(o.get("data", {}).get("text/html", "")) for o in nb.cells[index].get("outputs", []))


def test_reply_to_an_ask_from_the_panel_then_reopen_the_saved_notebook(lab: Lab) -> None:
    import nbformat
    from playwright.sync_api import expect

    name = "ask-from-the-panel.ipynb"
    path = _notebook(lab, name, ASK_CELLS, "panel-reply")
    with _lab_page(lab, "panel-reply-reopened.png") as (page, _):
        # ?reset: a clean JupyterLab layout, without the tabs an earlier test left open (the
        # helpers look for cells in the whole page)
        kernel = _open(page, lab, name)
        expect(page.locator(".jp-Notebook")).to_have_count(1, timeout=60_000)
        _run_all_cells(page, lab, name, kernel)
        _assert_no_cell_raised(page)

        # the panel opened on the asking job: its question is in the view and Reply is enabled
        reply = page.locator("button.widget-button").filter(has_text=re.compile(r"^\s*Reply\s*$"))
        expect(reply).to_have_count(1)
        panel = page.locator(".widget-vbox").filter(has=reply).last
        expect(panel.locator("select option", has_text="waiting_human · ask-first")).to_be_attached()
        expect(panel.locator(".anb-job")).to_contain_text("waiting for you")
        expect(reply).to_be_enabled()
        box = panel.locator("input[placeholder=\"Your answer to the job's question\"]")
        box.fill(ANSWER)
        reply.click()
        # the answer resumes the job, which runs to its end live in the panel
        expect(panel.locator("select option", has_text="succeeded · ask-first")).to_be_attached(timeout=120_000)
        expect(panel.locator("div.widget-label", has_text="of 6 movements")).to_contain_text(
            "3 of 6 movements", timeout=60_000)
        expect(panel.locator(".anb-comment", has_text=ANSWER)).to_have_count(1)
        expect(reply).to_be_disabled()
        expect(box).to_have_value("")
        panel.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "panel-reply-answered.png"))

        # show the finished job in the notebook, save, and find the views in the saved file
        _run_cell(page, 3)
        page.keyboard.press("Control+s")
        deadline = time.monotonic() + 60
        while ANSWER not in _saved_outputs(path, 3) and time.monotonic() < deadline:
            time.sleep(0.25)
        shown = _saved_outputs(path, 3)
        assert ANSWER in shown and shown.count('<details class="anb-mv"') == 3, "the saved view lacks the run"
        assert "waiting for you" in _saved_outputs(path, 1), "the saved run cell lost the job's question"
        saved = nbformat.read(path, as_version=4)
        panel_out = saved.cells[2].outputs[0]["data"]["text/plain"]
        assert panel_out.startswith("agentnb panel of workspace"), panel_out

        # reopen: the saved static HTML shows the run before anything is run again
        page.reload()
        page.locator(".jp-Notebook").first.wait_for(timeout=60_000)
        view = page.locator(".jp-Notebook .jp-CodeCell").nth(3).locator(".anb-job")
        expect(view.locator("details.anb-mv")).to_have_count(3, timeout=60_000)
        expect(view.locator(".anb-comment", has_text=ANSWER)).to_have_count(1)
        view.locator("details.anb-mv[data-seq='3'] > summary").scroll_into_view_if_needed()


# A new user's panel session: a quick job, then a slow one written in the notebook (a piece file and
# a tool defined in cells, as notebooks 03 and 04 do), run from the panel's piece box by variable name.
SLOW_CELLS = [
    # a workspace of its own: the job ids below do not depend on the other tests
    '%load_ext agentnb\n%config AgentMagic.workspace = "panel-session-data"',
    '''import time
from pathlib import Path
import agentnb

@agentnb.tool
def slow_step() -> str:
    """Take a second."""
    time.sleep(1.0)
    return "done"

PIECE = Path("slow.yaml")
PIECE.write_text("""
name: slow
movements:
  - name: work
    persona: You work slowly.
    instruction: Work.
    tools: [slow_step]
    rules:
      - {condition: done, next: COMPLETE}
""")
SCRIPT = Path("slow-script.yaml").resolve()
SCRIPT.write_text("responses:\\n" + "  - tool_calls: [{name: slow_step, arguments: {}}]\\n" * 15
                  + "  - tool_calls: [{name: transition, arguments: {next_step: COMPLETE, summary: done}}]\\n")''',
    'first = %agent run --model demo "A quick job first"',
    "%agent panel",
]


def _overflow(page, selector: str) -> list[str]:  # type: ignore[no-untyped-def]
    """The descendants of ``selector`` that stick out to the right of it (none when it lays out well)."""
    return page.evaluate(
        """(sel) => {
            const root = document.querySelector(sel);
            const right = root.getBoundingClientRect().right + 1;
            return [...root.querySelectorAll('*')]
                .filter(el => el.getClientRects().length && el.getBoundingClientRect().right > right)
                .map(el => el.className || el.tagName);
        }""",
        selector,
    )


def test_panel_stop_narrow_layout_and_restart(lab: Lab) -> None:
    from playwright.sync_api import expect

    name = "panel-session.ipynb"
    _notebook(lab, name, SLOW_CELLS, "panel-session")
    with _lab_page(lab, "panel-session-failed.png") as (page, shot):
        kernel = _open(page, lab, name)
        expect(page.locator(".jp-Notebook")).to_have_count(1, timeout=60_000)
        _run_all_cells(page, lab, name, kernel)
        _assert_no_cell_raised(page)

        panel = page.locator(".anb-panel")
        expect(panel).to_have_count(1)
        # the saved snapshot is in the page, hidden while the live panel is there
        expect(page.locator(".anb-panel-fallback")).to_have_count(1)
        expect(page.locator(".anb-panel-fallback")).to_be_hidden()
        stop = panel.locator("button.widget-button").filter(has_text=re.compile(r"^\s*Stop\s*$"))
        run = panel.locator("button.widget-button").filter(has_text=re.compile(r"^\s*Run\s*$"))
        # a disabled Stop is grey, not the orange of a button that can be pressed
        expect(stop).to_be_disabled()
        expect(stop).not_to_have_class(re.compile(r"mod-warning"))

        # the slow piece by its notebook variable, the model with {SCRIPT} filled in
        piece_box, model_box = panel.locator("input[list]").all()
        piece_box.fill("PIECE")
        model_box.fill("scripted:{SCRIPT}")
        panel.locator("textarea").fill("A slow job")
        run.click()
        jobs = panel.locator("select")
        expect(jobs.locator("option", has_text="▶ #2 · running · slow")).to_be_attached(timeout=60_000)
        expect(stop).to_be_enabled()
        expect(stop).to_have_class(re.compile(r"mod-warning"))
        # the user looks at the first job, then presses Stop: it acts on the running job 2
        jobs.select_option(index=0)
        expect(panel.locator(".anb-job[data-job='1']")).to_be_visible()
        stop.click()
        expect(panel).to_contain_text(
            "Stop: job 2, run from this panel (not the selected job 1), will pause after its current LLM call")
        page.screenshot(path=str(ARTIFACTS / "panel-session-stop.png"))
        expect(panel).to_contain_text("job 2 is paused (Stop); Run or Step continues it", timeout=60_000)
        expect(panel).not_to_contain_text("will pause")
        expect(jobs.locator("option", has_text="#2 · paused · slow")).to_be_attached()
        expect(jobs.locator("option", has_text="running")).to_have_count(0)
        jobs.select_option(index=1)
        expect(panel.locator(".anb-job[data-job='2'] .anb-st-paused")).to_have_text("paused")
        panel.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "panel-session-paused.png"))

        # narrow: rows wrap and nothing sticks out of the panel
        page.set_viewport_size({"width": 620, "height": 1000})
        page.wait_for_timeout(500)
        panel.locator("textarea").scroll_into_view_if_needed()
        assert _overflow(page, ".anb-panel") == [], _overflow(page, ".anb-panel")
        page.screenshot(path=str(ARTIFACTS / "panel-session-narrow.png"))
        page.set_viewport_size({"width": 1400, "height": 1000})

        # save, restart the kernel and reload: the snapshot shows where the widget cannot be drawn
        page.keyboard.press("Control+s")
        page.wait_for_timeout(1000)
        page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").first.click()
        page.get_by_role("menuitem", name=re.compile(r"^Restart Kernel…")).first.click()
        page.locator(".jp-Dialog button", has_text="Restart").click()
        page.wait_for_function(
            """() => {
                const el = document.querySelector('.jp-Notebook-ExecutionIndicator');
                return el && el.getAttribute('data-status') === 'idle';
            }""",
            timeout=90_000,
        )
        page.reload()
        page.locator(".jp-Notebook").first.wait_for(timeout=60_000)
        # the widget renderer has given up on the dead panel ("model not found"): hidden, the snapshot shown
        dead = page.locator(".jp-OutputArea-output.jupyter-widgets")
        expect(dead).to_have_count(1, timeout=60_000)
        expect(dead).to_contain_text("model not found")
        expect(dead).to_be_hidden()
        snapshot = page.locator(".anb-panel-fallback")
        expect(snapshot).to_be_visible(timeout=60_000)
        expect(snapshot).to_contain_text("a saved snapshot; run the cell in a live kernel to use the panel")
        expect(snapshot).to_contain_text("#2 · paused · slow")
        expect(snapshot).to_contain_text("#1 · succeeded · plan-implement-verify")
        expect(snapshot.locator(".anb-st-paused")).to_have_text("paused")  # the header of the selected job 2
        snapshot.scroll_into_view_if_needed()
        shot.name = "panel-session-restarted.png"


# A job slow enough to read while it runs: each call of its tool takes a moment.
LIVE_CELLS = [
    '%load_ext agentnb\n%config AgentMagic.workspace = "agentnb-data"',
    '''import time
from pathlib import Path

import yaml

import agentnb


@agentnb.tool(name="Slow")
def slow(step: int) -> str:
    """Take a moment, then report.

    Args:
        step: which step this is
    """
    time.sleep(1.0)
    return f"step {step} done\\n" + "".join(f"detail {i} of step {step}\\n" for i in range(30))


def calls(name, n, then):
    steps = [{"tool_calls": [{"name": "Slow", "arguments": {"step": i}}]} for i in range(1, n + 1)]
    return steps + [{"tool_calls": [{"name": "transition", "arguments": {"next_step": then, "summary": name + " done"}}]}]


movements = [{"name": name, "persona": "You work slowly and carefully.\\n" * 12,
              "instruction": "Take one step at a time.\\n" * 12, "tools": ["Slow"], "permission": "readonly",
              "max_iterations": 30, "rules": [{"condition": "done", "next": then}]}
             for name, then in (("first", "second"), ("second", "COMPLETE"))]
Path("slow.yaml").write_text(yaml.safe_dump({"name": "slow", "max_movements": 3, "movements": movements}))
Path("slow-script.yaml").write_text(yaml.safe_dump(
    {"movements": {"first": calls("first", 9, "second"), "second": calls("second", 5, "COMPLETE")}}))''',
    # a first call stepped: the same job shown in two cells, as in a stepping session
    'slowjob = %agent run --queue --piece slow.yaml --model scripted:slow-script.yaml "Go slowly"\n'
    "%agent step slowjob --call",
    "slowjob = %agent run --job slowjob",
    "%agent usage",
]


def test_sections_opened_during_a_live_run_stay_open(lab: Lab) -> None:
    """The live view is redrawn at every event; what the user opened or closed stays so."""
    from playwright.sync_api import expect

    name = "live-view.ipynb"
    _notebook(lab, name, LIVE_CELLS, "live-view")
    with _lab_page(lab, "live-view-end.png") as (page, _):
        kernel = _open(page, lab, name)
        expect(page.locator(".jp-Notebook")).to_have_count(1, timeout=60_000)
        # run everything without waiting: the user reads the slow job's view along while it goes on
        _start_all_cells(page, lab, name, kernel)
        view = page.locator(".jp-Notebook .jp-CodeCell").nth(3).locator(".anb-job")
        calls = view.locator(".anb-call")
        expect(calls).to_have_count(2, timeout=120_000)

        def section(key: str):  # type: ignore[no-untyped-def]
            return view.locator(f"summary[data-anb-key='{key}']")

        def is_open(key: str) -> bool:
            return bool(section(key).evaluate("s => s.parentElement.open"))

        job = view.get_attribute("data-job")
        result_key = f"{job}:1:1:call_1_1_0:result"
        # open the user prompt and the first tool result; close nothing yet
        section(f"{job}:1:user").click()
        section(result_key).click()
        assert is_open(f"{job}:1:user") and is_open(result_key)
        seen = calls.count()
        # more events arrive (each one redraws the view) ...
        page.wait_for_function(
            f"() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')][3]"
            f".querySelectorAll('.anb-job .anb-call').length >= {seen + 2}", timeout=60_000)
        # ... and what the user opened is still open, scrolled to where they read
        assert is_open(f"{job}:1:user"), "the user prompt the user opened closed again"
        assert is_open(result_key), "the tool result the user opened closed again"
        section(result_key).scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "live-view-opened.png"))

        # the newest movement run is open by default; a user who closes it keeps it closed
        section(f"{job}:1").click()
        assert not is_open(f"{job}:1")
        seen = calls.count()
        page.wait_for_function(
            f"() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')][3]"
            f".querySelectorAll('.anb-job .anb-call').length >= {seen + 2}", timeout=60_000)
        assert not is_open(f"{job}:1"), "the movement the user closed opened again"
        section(f"{job}:1").click()  # and opened again, the parts inside are as they were left
        assert is_open(f"{job}:1") and is_open(result_key)

        # the next movement run opens by itself (the user never touched it); the first stays as left
        expect(section(f"{job}:2")).to_be_attached(timeout=120_000)
        page.wait_for_function(
            f"() => {{ const s = document.querySelector(\"summary[data-anb-key='{job}:2']\");"
            " return s && s.parentElement.open; }", timeout=60_000)
        assert is_open(f"{job}:1") and is_open(result_key)

        # the header's link leads to the newest call
        link = view.locator("a.anb-latest")
        expect(link).to_contain_text("latest call")
        # the cell above shows the same job (its first call, stepped), with an anchor of the same name:
        # JupyterLab's own handling of the click went there after the link's scroll
        page.mouse.wheel(0, -5000)
        link.click()
        latest = view.locator(f"#anb-latest-{job}")
        expect(latest).to_be_in_viewport()
        # the newest call (it moves on as calls arrive) is where the user looks, not just a sliver of it
        page.wait_for_timeout(300)
        page.wait_for_function(
            f"""() => {{
                const views = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')][3].querySelectorAll('.anb-job');
                const call = views[views.length - 1].querySelector('#anb-latest-{job}');
                if (!call) return false;
                const r = call.getBoundingClientRect();
                return r.top >= 0 && r.top < window.innerHeight - 60;
            }}""", timeout=2_000)
        page.screenshot(path=str(ARTIFACTS / "live-view-latest.png"))

        # the run ends: `slowjob = %agent run …` keeps the whole view, and the user's choices in it
        page.wait_for_function(
            "() => /\\[\\d+\\]/.test([...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')][3].textContent)",
            timeout=RUN_ALL_TIMEOUT_MS)
        expect(view.locator("details.anb-mv")).to_have_count(2)
        expect(view.locator(".anb-head")).to_contain_text("succeeded")
        assert is_open(f"{job}:1") and is_open(result_key)
        expect(view.locator(".anb-call").first).to_contain_text("◷")

        page.wait_for_function(
            "() => /\\[\\d+\\]/.test([...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')][4].textContent)",
            timeout=RUN_ALL_TIMEOUT_MS)
        _assert_no_cell_raised(page)
        table = page.locator(".jp-Notebook .jp-CodeCell").nth(4).locator("table")
        expect(table.locator("th.col_heading")).to_have_count(7)
        expect(table).to_contain_text("1. first")
        table.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "live-view-usage.png"))


# The batch progress bar after a kernel restart: each batch's final line, never "Error displaying widget".
BATCH_BAR_CELLS = [
    '%load_ext agentnb\n%config AgentMagic.workspace = "batch-bar-data"',
    'cases = [{"instruction": "Summarise input/notes.md", "inputs": {"notes.md": "Ship on Friday. QA is open."}},\n'
    '         {"instruction": "List the open questions in input/notes.md", "inputs": {"notes.md": "Who owns QA?"}}]\n'
    "%agent batch cases --piece plan-implement-verify,review-loop --model demo --name exp-1",
    "%agent batch cases --piece ask-first --model demo --name asks",
]


def test_batch_bars_leave_their_final_lines_across_a_kernel_restart(lab: Lab) -> None:
    import nbformat
    from playwright.sync_api import expect

    name = "batch-bar.ipynb"
    path = _notebook(lab, name, BATCH_BAR_CELLS, "batch-bar")
    with _lab_page(lab, "batch-bar-failed.png") as (page, shot):
        kernel = _open(page, lab, name)
        expect(page.locator(".jp-Notebook")).to_have_count(1, timeout=60_000)
        _run_all_cells(page, lab, name, kernel)
        _assert_no_cell_raised(page)

        def check_lines() -> None:
            done = page.locator(".anb-batch-end[data-state='ok']")
            waiting = page.locator(".anb-batch-end[data-state='waiting']")
            expect(done).to_have_count(1, timeout=60_000)
            expect(done).to_be_visible()
            expect(done.locator(".anb-batch-line")).to_have_text(
                re.compile(r"^batch exp-1 · 4/4 · 4 ok · [\d,]+ tokens · \$0 · \d+\.\d s$"))
            expect(waiting).to_be_visible()
            expect(waiting.locator(".anb-batch-line")).to_have_text(
                re.compile(r"^batch asks · 2/2 · 0 ok · 2 waiting · [\d,]+ tokens · \$0 · \d+\.\d s$"))
            expect(waiting.locator(".anb-batch-hint")).to_contain_text(
                "job(s) 5, 6 wait for a reply", use_inner_text=True)
            # the waiting batch is not green: its bar is the waiting purple, the other one's all green
            colours = waiting.locator("[data-outcome]").evaluate_all(
                "els => els.map(e => [e.dataset.outcome, getComputedStyle(e).backgroundColor, e.offsetWidth])")
            assert [(o, c) for o, c, _ in colours] == [("waiting", "rgb(142, 68, 173)")], colours
            assert colours[0][2] > 100, colours  # drawn, not a sliver
            ok = done.locator("[data-outcome]").evaluate_all(
                "els => els.map(e => [e.dataset.outcome, getComputedStyle(e).backgroundColor])")
            assert ok == [["ok", "rgb(46, 139, 87)"]], ok
            assert _overflow(page, ".anb-batch-end") == [], _overflow(page, ".anb-batch-end")
            # no progress widget left anywhere, live or dead
            expect(page.locator(".jp-OutputArea-output .widget-progress")).to_have_count(0)
            expect(page.get_by_text("Error displaying widget")).to_have_count(0)
            expect(page.get_by_text("model not found")).to_have_count(0)

        check_lines()
        page.locator(".anb-batch-end[data-state='waiting']").scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "batch-bar-live.png"))

        # save, restart the kernel and reload: what a reopened notebook shows
        page.keyboard.press("Control+s")
        deadline = time.monotonic() + 60
        while "anb-batch-end" not in _saved_outputs(path, 2) and time.monotonic() < deadline:
            time.sleep(0.25)
        saved = nbformat.read(path, as_version=4)
        outputs = [o for cell in saved.cells for o in cell.get("outputs", [])]
        assert not [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
        lines = [str(o["data"]["text/plain"]) for o in outputs if "anb-batch-end" in str(o.get("data", {}))]
        assert [line.splitlines()[0].split(" · ")[:4] for line in lines] == [
            ["batch exp-1", "4/4", "4 ok", lines[0].split(" · ")[3]], ["batch asks", "2/2", "0 ok", "2 waiting"]]
        page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").first.click()
        page.get_by_role("menuitem", name=re.compile(r"^Restart Kernel…")).first.click()
        page.locator(".jp-Dialog button", has_text="Restart").click()
        page.wait_for_function(
            """() => {
                const el = document.querySelector('.jp-Notebook-ExecutionIndicator');
                return el && el.getAttribute('data-status') === 'idle';
            }""",
            timeout=90_000,
        )
        page.reload()
        page.locator(".jp-Notebook").first.wait_for(timeout=60_000)
        check_lines()
        page.locator(".anb-batch-end[data-state='ok']").scroll_into_view_if_needed()
        shot.name = "batch-bar-restarted.png"


# The panel's Piece and Model boxes follow the job selected in its list, and Run from
# there starts a new job with them.
FOLLOW_CELLS = [
    '%load_ext agentnb\n%config AgentMagic.workspace = "panel-follow-data"',
    'from pathlib import Path\nPath("follow-script.yaml").write_text("movements:\\n  work:\\n    - tool_calls: '
    '[{name: transition, arguments: {next_step: COMPLETE, summary: done}}]\\n")\n'
    'first = %agent run --queue --piece plan-implement-verify --model demo "The first job"\n'
    'second = %agent run --queue --piece single --model scripted:follow-script.yaml "The second job"',
    "%agent panel",
]


def test_panel_boxes_follow_the_selected_job(lab: Lab) -> None:
    from playwright.sync_api import expect

    name = "panel-follow.ipynb"
    _notebook(lab, name, FOLLOW_CELLS, "panel-follow")
    spec = f"scripted:{(lab.root / 'follow-script.yaml').resolve()}"
    with _lab_page(lab, "panel-follow-failed.png") as (page, shot):
        kernel = _open(page, lab, name)
        expect(page.locator(".jp-Notebook")).to_have_count(1, timeout=60_000)
        _run_all_cells(page, lab, name, kernel)
        _assert_no_cell_raised(page)
        panel = page.locator(".anb-panel")
        expect(panel).to_have_count(1)
        piece_box, model_box = panel.locator("input[list]").all()
        jobs = panel.locator("select")
        # the panel opens on the session's last job, the second: its piece and model
        expect(piece_box).to_have_value("single")
        expect(model_box).to_have_value(spec)
        for index, piece, model in ((0, "plan-implement-verify", "demo"), (1, "single", spec)):
            jobs.select_option(index=index)
            expect(panel.locator(f".anb-job[data-job='{index + 1}']")).to_be_visible()
            expect(piece_box).to_have_value(piece)
            expect(model_box).to_have_value(model)
        # the piece's name is in view whole (the model's path is as long as the lab's temporary folder makes
        # it), and nothing sticks out of the panel
        assert piece_box.evaluate("el => el.scrollWidth <= el.clientWidth")
        assert _overflow(page, ".anb-panel") == [], _overflow(page, ".anb-panel")
        panel.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "panel-follow-selected.png"))
        # Run from the selected job: a new job #3 with its piece and model; job 2 stays queued
        panel.locator("textarea").fill("A third job")
        panel.locator("button.widget-button").filter(has_text=re.compile(r"^\s*Run\s*$")).click()
        expect(jobs.locator("option", has_text="#3 · succeeded · single")).to_be_attached(timeout=60_000)
        expect(jobs.locator("option", has_text="#2 · queued · single")).to_be_attached()
        expect(panel).to_contain_text(f"new job #3 with single on {spec}; job #2 is left as it was")
        expect(piece_box).to_have_value("single")
        expect(model_box).to_have_value(spec)
        shot.name = "panel-follow-run.png"


# Batch tables and plots of 2 and 8 variants on long scripted: paths: narrow summaries, short labels, scores in view.
BATCH_LABEL_CELLS = [
    "import sys\nfrom pathlib import Path\n"
    f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
    "import agentnb\nfrom _batching import answering_model, draft_review\n"
    "deep = Path('batch-labels/clients/acme-corporation/experiments/2026-q4/release-notes-evaluation').resolve()\n"
    "(deep / 'other').mkdir(parents=True, exist_ok=True)\n"
    "ws = agentnb.Workspace('batch-labels/ws')\n"
    "cases = [{'instruction': f'Answer question {i}', 'expected': str(40 + i)} for i in range(3)]\n"
    "scorers = {'has_answer': lambda j: (j.output / 'answer.txt').is_file(),\n"
    "           'right_answer': lambda j: (j.output / 'answer.txt').read_text() == j.expected,\n"
    "           'answer_length': lambda j: len((j.output / 'answer.txt').read_text()),\n"
    "           'mentions_plugins': lambda j: j.case == 1}\n"
    "models = [answering_model(deep, f'summary-script-{k}', '41' if k else '99', prompt=100 + 60 * k)\n"
    "          for k in range(3)]\n"
    "models.append(answering_model(deep / 'other', 'summary-script-0', '42', prompt=500))\n"
    # a long piece name with hyphens, which the old table broke as "release-/notes"
    "(deep / 'release-notes-reviewed.yaml').write_text(draft_review(deep).read_text().replace("
    "'name: draft-review', 'name: release-notes-reviewed'))\n"
    "pieces = [deep / 'release-notes-reviewed.yaml', 'single']\n"
    "b2 = ws.batch(cases, piece=pieces, model=models[0], name='two', scorers=scorers, progress=False)\n"
    "b8 = ws.batch(cases, piece=pieces, model=models, name='eight', scorers=scorers, progress=False)",
    "b2",
    "agentnb.plot_batch(b2)",
    "b8",
    "agentnb.plot_batch(b8)",
]


def test_batch_summaries_and_plots_of_2_and_8_variants_fit_the_output(lab: Lab) -> None:
    from playwright.sync_api import expect

    name = "batch-labels.ipynb"
    _notebook(lab, name, BATCH_LABEL_CELLS, "batch-labels")
    with _lab_page(lab, None) as (page, _):
        kernel = _open(page, lab, name)
        _run_all_cells(page, lab, name, kernel)
        _assert_no_cell_raised(page)
        tables = page.locator(".jp-OutputArea-output table.agentnb-batch-summary")
        expect(tables).to_have_count(2)
        for i, n in ((0, 2), (1, 8)):
            table = tables.nth(i)
            table.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / f"batch-labels-summary-{n}.png"))
            seen = table.evaluate("""t => {
                const out = t.closest('.jp-OutputArea-output').getBoundingClientRect();
                const heads = [...t.querySelectorAll('th')].map(h => [h.textContent, h.getBoundingClientRect()]);
                const spans = [...t.querySelectorAll('td:first-child span')];
                return {width: t.getBoundingClientRect().width, outRight: out.right,
                        heads: heads.map(([text, r]) => [text, r.right]), rows: t.querySelectorAll('tbody tr').length,
                        text: t.innerText, wrapped: spans.filter(s => s.getClientRects().length > 1).map(s => s.textContent),
                        titles: [...t.querySelectorAll('td[title]')].map(td => td.title)};
            }""")
            assert seen["rows"] == n
            assert seen["width"] <= 1000, f"the summary of {n} variants is {seen['width']:.0f} px wide"
            for text, right in seen["heads"]:  # every column, the scores too, within the output area
                assert right <= seen["outRight"] + 1, f"column {text!r} is off-screen ({right} > {seen['outRight']})"
            assert [h for h, _ in seen["heads"]] == [
                "variant", "n", "succeeded", "has_answer", "right_answer", "answer_length", "mentions_plugins",
                "tokens/job", "cost/job", "s/job", "p95s"]
            assert not seen["wrapped"], f"a name wraps inside itself: {seen['wrapped']}"
            assert "acme-corporation" not in seen["text"]  # the path only in the tooltips
            assert any("acme-corporation" in t for t in seen["titles"])
            assert "release-notes-reviewed" in seen["text"] and "scripted:summary-script-" in seen["text"]
        images = page.locator(".jp-OutputArea-output img")
        expect(images).to_have_count(2)
        for i, n in ((0, 2), (1, 8)):
            image = images.nth(i)
            image.scroll_into_view_if_needed()
            box = image.bounding_box()
            assert box is not None and box["width"] >= 600, box
            image.screenshot(path=str(ARTIFACTS / f"batch-labels-plot-{n}.png"))
    shots = sorted(ARTIFACTS.glob("batch-labels-*.png"))
    assert len(shots) == 4 and all(p.stat().st_size > 10_000 for p in shots), "a screenshot is missing or empty"
# The views' symbols in a Chromium without an emoji font, against the same views with the default fonts (🔧, ⏱, ❓
# and ⑂ were once empty boxes there, "#12 □1@2").
def _icon_cells(data: str) -> list[str]:
    """A notebook showing every symbol: tool calls and latency, compaction and force_transition badges, a waiting
    question, a reply (a comment), and a fork and a compacted job in the panel's list."""
    return [
        f'%load_ext agentnb\n%config AgentMagic.workspace = "{data}"',
        f'''from pathlib import Path
import yaml
import agentnb

ws = agentnb.Workspace("{data}")


def glob(prompt):
    return {{"tool_calls": [{{"name": "Glob", "arguments": {{"pattern": "*"}}}}],
            "usage": {{"prompt_tokens": prompt, "completion_tokens": 10}}}}


def done(next_step="COMPLETE", **extra):
    return {{"tool_calls": [{{"name": "transition", "arguments": {{"next_step": next_step, "summary": "done", **extra}}}}]}}


Path("icons-long.yaml").write_text(yaml.safe_dump({{
    "name": "long", "context": {{"window_tokens": 1000, "on_pressure": "compact", "compact_keep_last": 2}},
    "movements": [{{"name": "work", "instruction": "Work.", "tools": ["Glob"], "rules": [{{"next": "COMPLETE"}}],
                   "default_next": "COMPLETE"}}]}}))
Path("icons-long-script.yaml").write_text(yaml.safe_dump({{"movements": {{"work": [
    glob(500), glob(900), {{"content": "summary one", "usage": {{"prompt_tokens": 950, "completion_tokens": 20}}}},
    glob(300), glob(880), {{"content": "summary two"}}, glob(400), glob(960), done()]}}}}))
Path("icons-ask-script.yaml").write_text(yaml.safe_dump({{"movements": {{"work": [done("ASK", question="Which language?")]}}}}))
demo = ws.run(ws.submit("Summarise the files", piece="plan-implement-verify", model="demo"))
fork = ws.fork(demo, at=2)''',
        'compacted = %agent run --piece icons-long.yaml --model scripted:icons-long-script.yaml "Work long"',
        'asker = %agent run --piece single --model scripted:icons-ask-script.yaml "Ask me"\nasker',
        'ws.reply(ws.run(ws.submit("Ask me too", piece="single", model="scripted:icons-ask-script.yaml")), "Python.")',
        "%agent panel",
    ]


# Every non-ASCII character in the notebook's outputs (the panel's <option>s included), drawn on a canvas in its
# element's font: one drawn exactly as an unassigned code point (U+0378, which no font has) is an empty box.
_GLYPHS_JS = """() => {
    const draw = (font, text) => {
        const c = document.createElement('canvas'); c.width = 48; c.height = 48;
        const x = c.getContext('2d'); x.font = font; x.textBaseline = 'top'; x.fillText(text, 4, 4);
        return Array.from(x.getImageData(0, 0, 48, 48).data).join(',');
    };
    const seen = new Map();
    for (const area of document.querySelectorAll('.jp-Notebook .jp-OutputArea')) {
        const walker = document.createTreeWalker(area, NodeFilter.SHOW_TEXT);
        for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            const cs = getComputedStyle(node.parentElement);
            const font = `${cs.fontStyle} ${cs.fontWeight} ${cs.fontSize} ${cs.fontFamily}`;
            for (const ch of node.data) if (ch.codePointAt(0) > 127 && !/\\s/.test(ch)) seen.set(ch + '\\u0000' + font, [ch, font]);
        }
    }
    const boxes = [...seen.values()].filter(([ch, font]) => draw(font, ch) === draw(font, '\\u0378'));
    // (the panel's saved snapshot is in the page too, hidden while the live panel is there)
    const icons = [...document.querySelectorAll('.jp-Notebook .jp-OutputArea .anb-icon')].filter(el => el.checkVisibility()).map(el => {
        const r = el.getBoundingClientRect();
        return [el.textContent, el.getAttribute('aria-label'), Math.round(r.width * 10) / 10,
                Math.round(r.height * 10) / 10];
    });
    const probe = document.createElement('span'); probe.textContent = '\\u{1F527}'; document.body.appendChild(probe);
    const pf = getComputedStyle(document.querySelector('.jp-Notebook'));
    const font = `${pf.fontStyle} ${pf.fontWeight} ${pf.fontSize} ${pf.fontFamily}`;
    const emoji = draw(font, '\\u{1F527}') !== draw(font, '\\u0378');
    probe.remove();
    // the panel's buttons draw their icons from JupyterLab's own Font Awesome, whatever the system's fonts
    const buttons = [...document.querySelectorAll('.anb-panel button i.fa')].map(i => i.getBoundingClientRect().width);
    return {checked: seen.size, boxes: boxes.map(([ch, font]) => `${ch} U+${ch.codePointAt(0).toString(16)} in ${font}`),
            icons, emoji, buttons};
}"""

_NO_EMOJI_FONTCONFIG = """<?xml version="1.0"?>
<!DOCTYPE fontconfig SYSTEM "fonts.dtd">
<fontconfig>
  <include ignore_missing="yes">/etc/fonts/fonts.conf</include>
  <selectfont><rejectfont>
    <pattern><patelt name="family"><string>Noto Color Emoji</string></patelt></pattern>
  </rejectfont></selectfont>
</fontconfig>
"""


def _icons_in(lab: Lab, mode: str, env: dict[str, str] | None) -> dict[str, object]:
    """Run the icon notebook in a Chromium launched with ``env``; screenshot its views; measure its glyphs."""
    from playwright.sync_api import expect

    name = f"icons-{mode}.ipynb"
    _notebook(lab, name, _icon_cells(f"icons-{mode}-data"), f"icons-{mode}")
    with _lab_page(lab, f"icons-{mode}-failed.png", env=env) as (page, shot):
        kernel = _open(page, lab, name)
        expect(page.locator(".jp-Notebook")).to_have_count(1, timeout=60_000)
        _run_all_cells(page, lab, name, kernel)
        _assert_no_cell_raised(page)
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        view = cells.nth(2).locator(".anb-job").last
        expect(view.locator(".anb-compaction").first).to_be_visible()
        expect(cells.nth(3).locator(".anb-ask").first).to_be_visible()
        options = page.locator(".anb-panel select option")
        expect(cells.nth(4).locator(".anb-comment .anb-icon")).to_have_attribute("aria-label", "comment")
        expect(options.filter(has_text="⎇1@2")).to_have_count(1)
        expect(options.filter(has_text="⇊2")).to_have_count(1)
        view.locator(".anb-tool").first.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / f"icons-{mode}-job.png"))
        cells.nth(3).locator(".anb-ask").first.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / f"icons-{mode}-question.png"))
        page.locator(".anb-panel").scroll_into_view_if_needed()
        shot.name = f"icons-{mode}-panel.png"
        return page.evaluate(_GLYPHS_JS)


def test_views_draw_their_symbols_without_an_emoji_font(lab: Lab, tmp_path: Path) -> None:
    fonts = tmp_path / "fonts.conf"
    fonts.write_text(_NO_EMOJI_FONTCONFIG)
    bare = _icons_in(lab, "no-emoji", dict(os.environ, FONTCONFIG_FILE=str(fonts)))
    default = _icons_in(lab, "default", None)
    # the bare browser really has no emoji font: an emoji is a box there (else this test proves nothing)
    assert bare["emoji"] is False, "the emoji font was not rejected: the no-emoji run is not one"
    # no character of any output is a box, with or without the emoji font
    assert bare["checked"] and bare["boxes"] == [], bare["boxes"]
    assert default["boxes"] == [], default["boxes"]
    # each symbol is there, named for screen readers, drawn at a size, and the same with or without emoji fonts
    icons = {tuple(i) for i in bare["icons"]}  # type: ignore[attr-defined]
    assert {(text, label) for text, label, _, _ in icons} >= {
        ("⚒", "tool call"), ("◷", "how long the model took to answer"), ("?", "question"), ("✎", "comment")}
    assert all(w > 4 and h > 4 for _, _, w, h in icons), icons
    assert icons == {tuple(i) for i in default["icons"]}  # type: ignore[attr-defined]
    assert len(bare["buttons"]) >= 6 and all(w > 4 for w in bare["buttons"]), bare["buttons"]  # type: ignore[arg-type]
    assert len(list(ARTIFACTS.glob("icons-no-emoji-*.png"))) == 3 == len(list(ARTIFACTS.glob("icons-default-*.png")))


# Streaming (docs/notebook.md#streaming): a paced demo call's text grows in its own element below the job's
# view while it streams, the view itself is left alone, and once the run is over nothing of the stream is left.
STREAM_CELLS = [
    '%load_ext agentnb\n%config AgentMagic.workspace = "stream-data"',
    # paced so that the report's Write call streams for about 4 s: time to read it twice on a slow machine
    'job = %agent run --model demo?pace=0.1 "Summarise the inputs"',
]


def test_streamed_text_grows_during_a_paced_demo_call_and_leaves_no_trace(lab: Lab) -> None:
    from playwright.sync_api import expect

    name = "stream-view.ipynb"
    path = _notebook(lab, name, STREAM_CELLS, "stream-view")
    with _lab_page(lab, "stream-view-failed.png") as (page, shot):
        kernel = _open(page, lab, name)
        expect(page.locator(".jp-Notebook")).to_have_count(1, timeout=60_000)
        _start_all_cells(page, lab, name, kernel)
        cell = page.locator(".jp-Notebook .jp-CodeCell").nth(1)
        stream = cell.locator(".anb-stream")
        # the report being written: the Write call's name at once, its arguments growing
        args = cell.locator(".anb-stream .anb-tool:has(b:text-is('Write')) .anb-stream-args")
        expect(args).to_have_count(1, timeout=120_000)
        # mark the job's view: streamed text must not redraw it (the sections the user opened stay so)
        cell.locator(".anb-job:not(.anb-stream)").first.evaluate("v => { v.__anbKept = true; }")
        grown = ("([n]) => { const a = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')][1]"
                 ".querySelector('.anb-stream .anb-stream-args'); return a && a.textContent.length > n; }")
        page.wait_for_function(grown, arg=[0], timeout=10_000)
        first = len(args.inner_text())
        page.wait_for_function(grown, arg=[first], timeout=10_000)  # the next draw: a piece is ~400 characters
        second = len(args.inner_text())
        assert second > first > 0, (first, second)
        # read at one moment (the streamed element is replaced at each draw): the view kept, the streamed
        # element right below it in the same cell, as wide as the cell at most, saying it streams
        seen = page.evaluate(
            """() => {
                const cell = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')][1];
                const view = cell.querySelector('.anb-job:not(.anb-stream)');
                const stream = cell.querySelector('.anb-stream');
                if (!stream) return null;
                stream.scrollIntoView({block: 'center'});
                const v = view.getBoundingClientRect(), s = stream.getBoundingClientRect();
                return {kept: view.__anbKept === true, below: s.top >= v.bottom - 1,
                        fits: s.width <= cell.getBoundingClientRect().width, text: stream.innerText};
            }""")
        assert seen is not None, "the call ended before it could be read"
        assert seen["kept"], "the job's view was redrawn for streamed text"
        assert seen["below"] and seen["fits"] and "streaming…" in seen["text"], seen
        page.screenshot(path=str(ARTIFACTS / "stream-view-during.png"))

        # after the run: the recorded calls in the view, and no streamed element, visible or not
        page.wait_for_function(
            "() => /\\[\\d+\\]/.test([...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')][1].textContent)",
            timeout=RUN_ALL_TIMEOUT_MS)
        _assert_no_cell_raised(page)
        expect(stream).to_have_count(0)
        view = cell.locator(".anb-job").last
        expect(view.locator(".anb-head")).to_contain_text("succeeded")
        expect(view).to_contain_text("Writing the report.")
        # the emptied output draws nothing: the cell's outputs are as tall as the view alone
        heights = cell.locator(".jp-OutputArea-child").evaluate_all(
            "cs => cs.map(c => c.getBoundingClientRect().height)")
        assert sum(h for h in heights if h > 0) <= view.bounding_box()["height"] + 30, heights  # type: ignore[index]
        view.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "stream-view-after.png"))
        shot.name = "stream-view-end.png"
        # saved: no trace of the stream in the file
        page.keyboard.press("Control+s")
        page.wait_for_timeout(1500)
        saved = path.read_text()
        assert "Writing the report." in saved and "anb-stream" not in saved and "streaming…" not in saved
