"""The jail around ``Bash``: the command sees the work directory read-write, the system read-only, nothing else.

Built on bubblewrap (``bwrap``), which needs no root.  Other jobs' folders, the
store, the home directory and the rest of the file system are not mounted, so a
command cannot read or write outside the job's work directory, and the network is
off unless ``AGENTNB_BASH_NETWORK=1``.  ``AGENTNB_BASH_SANDBOX=off`` runs commands
unconfined (the user's explicit choice; never the default).
"""

from __future__ import annotations

import os
import shutil
import sys

from .tools import ToolError

__all__ = ["sandbox_argv", "SANDBOX_ENV"]

SANDBOX_ENV = "AGENTNB_BASH_SANDBOX"
# Read-only system folders the shell needs; a folder that is a symlink (merged /usr) stays a symlink.
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")


def sandbox_argv(workdir: str) -> list[str]:
    """The argv prefix that runs a command jailed in ``workdir`` (empty when the sandbox is switched off)."""
    mode = os.environ.get(SANDBOX_ENV, "auto").strip().lower()
    if mode in ("off", "0", "no", "false"):
        return []
    if mode not in ("auto", "on", "1", "yes", "true"):
        raise ToolError(f"{SANDBOX_ENV}={mode!r}; allowed: auto (default) or off")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise ToolError(
            "Bash runs only inside a bubblewrap sandbox so that commands stay in the work directory, and `bwrap` "
            "is not installed (Debian/Ubuntu: apt-get install bubblewrap). The user can set "
            f"{SANDBOX_ENV}=off to run commands unconfined."
        )
    argv = [bwrap]
    for path in _SYSTEM:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    # the running Python's installation, so `python3` in a command finds the same interpreter
    for prefix in {sys.base_prefix, sys.prefix}:
        if os.path.isdir(prefix) and not prefix.startswith(("/usr", "/opt")):
            argv += ["--ro-bind", prefix, prefix]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    argv += ["--bind", workdir, workdir, "--chdir", workdir, "--setenv", "HOME", workdir]
    argv += ["--unshare-all", "--die-with-parent", "--new-session"]
    if os.environ.get("AGENTNB_BASH_NETWORK") == "1":
        argv.append("--share-net")
    return argv
