"""The git excerpt a movement after a verifying one reads: status, diff stat and the start of the diff.

The work directory's repository is the model's to write, so git runs with every command-running
setting switched off from the command line, in the Bash jail when bubblewrap is there.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from .._secrets import SECRET_NAME
from ..tools.base import ToolError
from ..tools.sandbox import sandbox_argv

__all__ = ["GIT_DIFF_CHARS", "git_excerpt"]

GIT_DIFF_CHARS = 3000


def git_excerpt(workdir: Path) -> str:
    """``git status``, ``git diff --stat`` and the diff cut to :data:`GIT_DIFF_CHARS` of the repository at
    ``workdir`` (never one above it); "" when there is none or git cannot read it."""
    if not (workdir / ".git").exists():
        return ""

    # GIT_DIR and friends from the notebook's environment must not point git at another repository;
    # no optional locks, so a git command the model runs meanwhile is never blocked.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") and not SECRET_NAME.search(k)}
    # The repository's own config and .gitattributes are the model's to write (Write/Edit on .git/config),
    # and git runs commands they name — core.fsmonitor, filter drivers, hooks, textconv, external diffs —
    # on the host.  Command-line settings win over every config file, so each is switched off here, and
    # the commands run in the Bash jail when bubblewrap is there.
    safe = ["-c", "core.fsmonitor=false", "-c", f"core.hooksPath={os.devnull}", "-c", "color.ui=false",
            "-c", "core.quotepath=off"]
    try:
        jail = sandbox_argv(str(workdir))
    except ToolError:
        jail = []

    def git(*args: str) -> str | None:
        try:
            res = subprocess.run([*jail, "git", "--no-optional-locks", "--no-pager", *safe, *args],
                                 cwd=workdir, env=env, capture_output=True, text=True,
                                 errors="replace", timeout=20, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return res.stdout if res.returncode == 0 else None

    names = git("config", "--list", "--includes", "--name-only")  # reading config runs nothing
    if names is None:  # not a usable repository: say nothing rather than "clean"
        return ""
    for name in names.splitlines():
        m = re.fullmatch(r"(filter\..+)\.(clean|smudge|process|required)", name.strip(), re.IGNORECASE)
        if m:
            safe += ["-c", f"{m.group(1)}.clean=cat", "-c", f"{m.group(1)}.smudge=cat",
                     "-c", f"{m.group(1)}.process=", "-c", f"{m.group(1)}.required=false"]
    status = git("status", "--short", "--ignore-submodules=all")
    if status is None:
        return ""
    stat = git("diff", "--no-ext-diff", "--no-textconv", "--ignore-submodules=all", "--stat") or ""
    diff = git("diff", "--no-ext-diff", "--no-textconv", "--ignore-submodules=all") or ""
    if len(diff) > GIT_DIFF_CHARS:
        diff = diff[:GIT_DIFF_CHARS] + f"\n… [diff cut: {GIT_DIFF_CHARS:,} of {len(diff):,} characters shown]"
    blocks = ["$ git status --short", status.rstrip() or "(clean)"]
    if stat.strip():
        blocks += ["$ git diff --stat", stat.rstrip()]
    if diff.strip():
        blocks += ["$ git diff (excerpt)", "```diff", diff.rstrip(), "```"]
    return "\n".join(blocks)
