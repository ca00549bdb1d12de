"""The example notebooks and the Binder files, as files: what a reader or repo2docker reads.

nbval runs the notebooks themselves (see pyproject's addopts); these tests keep the saved files
clean — no stray outputs or widget state, no paths of a developer's machine, no key — and keep
``binder/`` in line with repo2docker's conventions and with the package's dependencies.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]-*.ipynb"))
BINDER = REPO / "binder"
CHECK = "NBVAL_CHECK_OUTPUT"


def test_the_eight_notebooks_exist() -> None:
    assert [p.name for p in NOTEBOOKS] == [
        "01-quickstart.ipynb", "02-stepping.ipynb", "03-token-usage.ipynb", "04-piece-design.ipynb",
        "05-design-lab.ipynb", "06-fork-compare.ipynb", "07-compaction-loops.ipynb", "08-mcp-tools.ipynb"]


def test_the_design_lab_runs_on_scripted_models_kept_in_the_repository() -> None:
    """Notebook 05 reads its pieces and scripts from notebooks/design-lab/, not from a temporary folder,
    so a reader can open them; they must be there and be valid."""
    from agentnb import load_piece
    from agentnb.models.factory import resolve_model

    lab = REPO / "notebooks" / "design-lab"
    text = (REPO / "notebooks" / "05-design-lab.ipynb").read_text(encoding="utf-8")
    for name in ("release-notes.yaml", "release-notes-reviewed.yaml"):
        assert name in text
        load_piece(lab / name)
    for name in ("draft-script.yaml", "reviewed-script.yaml"):
        assert name in text
        resolve_model(f"scripted:{lab / name}")


def test_the_fork_notebook_runs_on_scripted_models_kept_in_the_repository() -> None:
    """Notebook 06 reads its piece, incident report and scripts from notebooks/fork-compare/, so a reader can
    open them; they must be there and be valid."""
    from agentnb import load_piece
    from agentnb.models.factory import resolve_model

    lab = REPO / "notebooks" / "fork-compare"
    text = (REPO / "notebooks" / "06-fork-compare.ipynb").read_text(encoding="utf-8")
    assert "incident.md" in text and (lab / "incident.md").is_file()
    assert "incident-summary.yaml" in text
    assert load_piece(lab / "incident-summary.yaml").window_tokens == 8000  # the what-if cells reckon with it
    for name in ("summary-script.yaml", "bullets-script.yaml", "ticket-script.yaml"):
        assert name in text
        resolve_model(f"scripted:{lab / name}")


def test_the_compaction_notebook_runs_on_files_kept_in_the_repository() -> None:
    """Notebook 07 reads its piece, sources and scripts from notebooks/compaction-loops/, so a reader can open
    them; they must be there and be valid, and its piece must compact its movement as the notebook says."""
    from agentnb import load_piece
    from agentnb.models.factory import resolve_model

    lab = REPO / "notebooks" / "compaction-loops"
    nb = nbformat.read(REPO / "notebooks" / "07-compaction-loops.ipynb", as_version=4)
    text = "\n".join(c.source for c in nb.cells)
    assert "research.yaml" in text and 'piece="review-loop"' in text
    movement = load_piece(lab / "research.yaml").movement("research")
    assert (movement.on_pressure, movement.compact_keep_last, movement.max_compactions) == ("compact", 2, 2)
    assert len(list((lab / "sources").glob("*.md"))) == 5
    for name in ("research-script.yaml", "review-loop-script.yaml"):
        assert name in text
        resolve_model(f"scripted:{lab / name}")


def test_the_mcp_notebook_runs_the_shipped_git_review_piece_on_a_script_kept_in_the_repository() -> None:
    """Notebook 08 runs pieces/git-review.yaml (mcp-server-git) on notebooks/mcp-tools/review-script.yaml, whose
    calls must be tools the piece's movement is shown."""
    from agentnb import load_piece
    from agentnb.models.factory import resolve_model

    nb = nbformat.read(REPO / "notebooks" / "08-mcp-tools.ipynb", as_version=4)
    text = "\n".join(c.source for c in nb.cells)
    assert 'piece="git-review"' in text and "review-script.yaml" in text and "%agent tools git-review" in text
    review = load_piece(REPO / "pieces" / "git-review.yaml")
    git = review.mcp_servers["git"]
    assert (git.command, git.args) == ("python", ("-m", "mcp_server_git", "--repository", "input/repo"))
    resolve_model(f"scripted:{REPO / 'notebooks' / 'mcp-tools' / 'review-script.yaml'}")
    script = yaml.safe_load((REPO / "notebooks" / "mcp-tools" / "review-script.yaml").read_text(encoding="utf-8"))
    called = {c["name"] for r in script["responses"] for c in r.get("tool_calls", [])}
    assert called == {"git_status", "git_log", "git_diff_unstaged", "Write", "transition"}
    assert called - {"Write", "transition"} <= set(git.tools or ())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_saved_clean(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert "widgets" not in nb.metadata, "saved widget state: clear it before saving"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    checked = 0
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if CHECK in cell.source:
            checked += 1
            assert cell.outputs, f"cell {i} is marked {CHECK} but has no saved output to compare"
        else:
            assert not cell.outputs, f"cell {i} has saved outputs but is not marked {CHECK}"
    assert checked >= 1, f"{path.name}: no cell is compared by nbval"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_holds_no_machine_paths_and_no_key(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    paths = re.findall(r"(?<![\w.])/(?:tmp|root|home|work|Users|var/folders)/[^\s\"'\\]+", text)
    assert not paths, f"absolute paths of a machine: {paths[:3]}"
    assert not re.search(r"\bsk-[A-Za-z0-9_-]{16,}", text), "something that looks like an API key"
    assert not re.search(r"OPENAI_API_KEY\s*=\s*['\"]?(?!\.\.\.)[A-Za-z0-9_-]{8,}", text), "an API key value"
    key = os.environ.get("OPENAI_API_KEY")
    if key:
        assert key not in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_says_how_to_use_a_real_endpoint(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    text = "\n".join(c.source for c in nb.cells)
    for needle in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "openai:gpt-4o-mini"):
        assert needle in text, f"{path.name} does not mention {needle}"
    # the live examples run offline: every model named outside comments is demo or scripted
    for cell in nb.cells:
        if cell.cell_type == "code":
            live = "\n".join(line.split("#", 1)[0] for line in cell.source.splitlines())
            assert "openai:" not in live, f"{path.name} calls a real endpoint outside a comment"


def test_binder_follows_repo2docker_conventions() -> None:
    post = BINDER / "postBuild"
    start = BINDER / "start"
    assert os.access(post, os.X_OK) and os.access(start, os.X_OK), "postBuild and start must be executable"
    post_lines = [ln.strip() for ln in post.read_text().splitlines() if ln.strip()]
    assert post_lines[0].startswith("#!/bin/bash")
    first_command = next(ln for ln in post_lines[1:] if not ln.startswith("#"))
    assert first_command.startswith("set -e"), "postBuild must stop on the first error (set -e)"
    assert any("pip install" in ln and "-e ." in ln for ln in post_lines), "postBuild must install the package"
    start_lines = [ln.strip() for ln in start.read_text().splitlines() if ln.strip()]
    assert start_lines[0].startswith("#!/bin/bash") and start_lines[-1] == 'exec "$@"'
    assert re.fullmatch(r"python-3\.\d+\s*", (BINDER / "runtime.txt").read_text())


def test_binder_requirements_are_pinned_and_cover_the_package() -> None:
    pins: dict[str, str] = {}
    for line in (BINDER / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        assert len(spec) == 1 and spec[0].operator == "==", f"not pinned with ==: {line}"
        pins[canonicalize_name(req.name)] = spec[0].version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed = [Requirement(r) for r in project["dependencies"]] + [Requirement("jupyterlab"), Requirement("ipykernel")]
    for req in needed:
        name = canonicalize_name(req.name)
        assert name in pins, f"binder/requirements.txt does not pin {req.name}"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"binder pins {req.name}=={pins[name]}, outside pyproject's {req.specifier}"


_CHART = re.compile(r"plot_usage\(|plot_batch\(|\.plot\b|%agent plot\b")


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if _CHART.search(p.read_text(encoding="utf-8"))],
                         ids=lambda p: p.name)
def test_every_chart_of_the_notebook_is_drawn_in_a_fresh_kernel(path: Path, tmp_path: Path) -> None:
    """Notebook 03's last bar chart showed nothing: plot_usage, the kernel's first plot, had turned the inline
    backend's interactive mode off.  Run as a new user does (a fresh kernel, top to bottom), every cell that
    draws a chart has an image."""
    import shutil

    from nbclient import NotebookClient

    work = tmp_path / path.name
    shutil.copy(path, work)  # the notebook writes next to itself (an exported transcript)
    for folder in path.parent.iterdir():  # and reads what sits next to it (05's pieces and scripts)
        if folder.is_dir() and not folder.name.startswith((".", "agentnb-")):
            shutil.copytree(folder, tmp_path / folder.name)
    nb = nbformat.read(work, as_version=4)
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # the kernel picks its inline backend
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute(env=env)
    charts = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              and _CHART.search("\n".join(ln.split("#", 1)[0] for ln in c.source.splitlines()))]
    assert charts
    for i, cell in charts:
        assert any("image/png" in o.get("data", {}) for o in cell.outputs), f"cell {i} drew nothing:\n{cell.source}"
