"""The jail around ``Bash`` (and stdio MCP servers, :func:`jailed_server`): the command sees the work directory
read-write, the system read-only, nothing else.

Built on bubblewrap (``bwrap``), which needs no root.  Other jobs' folders, the
store, the home directory and the rest of the file system are not mounted, so a
command cannot read or write outside the job's work directory, and the network is
off unless ``AGENTNB_BASH_NETWORK=1``.  Of ``/etc`` only an allow-list of what shells
and common tools read is there (no ``shadow``, ``sudoers``, ssh host keys or TLS
private keys, which root could otherwise read), and the command runs with no
capabilities.  ``AGENTNB_BASH_SANDBOX=off`` runs commands unconfined (the user's
explicit choice; never the default).

The command's environment is an allow-list (:func:`bash_env`), jailed or not.  Jailed or
not, a command never outlives its worker or its call: it runs in its own process group,
which is killed when the command ends or times out, and which dies with the worker
(the jail's ``--die-with-parent``; unjailed, a small guard shell that the kernel signals
when the worker dies).
"""

from __future__ import annotations

import contextlib
import ctypes
import fnmatch
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._secrets import is_secret_name
from ..errors import ToolError

__all__ = [
    "BASH_ENV_SETTING",
    "ETC_ALLOWED",
    "SANDBOX_ENV",
    "Captured",
    "bash_argv",
    "bash_env",
    "jailed_server",
    "program_paths",
    "run_bounded",
    "sandbox_argv",
]

SANDBOX_ENV = "AGENTNB_BASH_SANDBOX"
BASH_ENV_SETTING = "AGENTNB_BASH_ENV"
# Read-only system folders the shell needs; a folder that is a symlink (merged /usr) stays a symlink.
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")
# What of /etc a jailed command sees: users and groups by name, the dynamic linker, name service and
# locale settings, time zone, certificates, shell start-up files, and the configuration of common tools.
# Glob patterns match names directly in /etc.
ETC_ALLOWED = (
    "passwd", "group", "nsswitch.conf", "host.conf", "hosts", "hostname", "resolv.conf", "gai.conf", "services",
    "protocols", "networks", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "ld.so.preload", "alternatives", "ssl",
    "ca-certificates", "ca-certificates.conf", "pki", "crypto-policies", "localtime", "timezone", "locale.alias",
    "locale.conf", "bash.bashrc", "profile", "profile.d", "inputrc", "shells", "python3*", "perl", "gitconfig",
    "mime.types", "magic", "magic.mime", "terminfo", "os-release", "lsb-release", "debian_version", "*-release",
    "mtab", "fonts", "matplotlibrc", "java-*", "ImageMagick-*", "R", "vim", "vimrc", "nanorc", "manpath.config",
)
# Private keys that live under an allowed folder: hidden under an empty folder.
_ETC_HIDDEN = ("ssl/private", "pki/tls/private", "pki/CA/private")
# Environment variables every command gets (LC_* too); others only when named in AGENTNB_BASH_ENV.
_ENV_ALLOWED = frozenset({"PATH", "HOME", "LANG", "LANGUAGE", "TERM", "TZ"})
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def bash_env() -> dict[str, str]:
    """The environment a command gets: PATH, HOME, LANG, LANGUAGE, LC_*, TERM, TZ, and the names listed in
    ``AGENTNB_BASH_ENV`` (comma-separated): never the rest of the notebook's (keys, database URLs, proxies)."""
    raw = os.environ.get(BASH_ENV_SETTING, "")
    extra: set[str] = set()
    for name in (n.strip() for n in raw.replace(" ", ",").split(",")):
        if not name:
            continue
        if not _ENV_NAME.fullmatch(name):
            raise ToolError(f"{BASH_ENV_SETTING} names {name!r}, which is not an environment variable name; "
                            f"allowed: names separated by commas, such as {BASH_ENV_SETTING}=PIP_INDEX_URL,GH_TOKEN")
        extra.add(name)
    return {k: v for k, v in os.environ.items()
            if k in _ENV_ALLOWED or k in extra or (k.startswith("LC_") and not is_secret_name(k))}


def bash_argv(workdir: str, command: str) -> tuple[list[str], int]:
    """The argv that runs ``command`` with bash in ``workdir``, and the signal it gets when the worker dies.

    Jailed, bwrap's ``--die-with-parent`` and its PID namespace take every process of the command down.
    Unjailed, a guard shell runs the command in the background and waits; when the worker dies the kernel
    sends the guard SIGTERM, and its trap kills the command's whole process group (a loop left running
    in the background too), which a signal to the command's shell alone would not.
    """
    jail = sandbox_argv(workdir)
    if jail:
        return [*jail, "bash", "-c", command], signal.SIGKILL
    return ["bash", "-c", _GUARD, "agentnb-bash", command], signal.SIGTERM


# "$1" is the command; its own $0 is "bash", so its error messages read as they do in the jail
_GUARD = 'trap "kill -KILL 0" TERM; bash -c "$1" bash & wait "$!"'


def sandbox_argv(workdir: str, *, cwd: str | None = None, network: bool | None = None,
                 readonly: Sequence[str] = (), who: str = "Bash runs commands") -> list[str]:
    """The argv prefix that runs a command jailed in ``workdir`` (empty when the sandbox is switched off).

    ``cwd``: the folder it starts in (default ``workdir``); ``network``: whether it has the network (default:
    ``AGENTNB_BASH_NETWORK=1``); ``readonly``: further paths it sees read-only (an MCP server's program,
    :func:`program_paths`); ``who`` names what refuses to run without bubblewrap."""
    mode = os.environ.get(SANDBOX_ENV, "auto").strip().lower()
    if mode in ("off", "0", "no", "false"):
        return []
    if mode not in ("auto", "on", "1", "yes", "true"):
        raise ToolError(f"{SANDBOX_ENV}={mode!r}; allowed: auto (default) or off")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise ToolError(
            f"{who} only inside a bubblewrap sandbox so that they stay in the work directory, and `bwrap` "
            "is not installed (Debian/Ubuntu: apt-get install bubblewrap). The user can set "
            f"{SANDBOX_ENV}=off to run them unconfined."
        )
    argv = [bwrap]
    for path in _SYSTEM:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    argv += _etc_argv()
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    # the running Python's installation, so `python3` in a command finds the same interpreter; after the
    # jail's own /tmp, which would otherwise hide a virtual environment made under /tmp
    for prefix in sorted({sys.base_prefix, sys.prefix}):
        if os.path.isdir(prefix) and not prefix.startswith(("/usr", "/opt")):
            argv += ["--ro-bind", prefix, prefix]
    for path in readonly:
        argv += ["--ro-bind", path, path]
    # the work directory last: read-write even where a read-only path above holds it
    argv += ["--bind", workdir, workdir, "--chdir", cwd or workdir, "--setenv", "HOME", workdir]
    # no capabilities: when agentnb runs as root, root in the jail must not override file permissions,
    # mount, or make device nodes
    argv += ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if os.environ.get("AGENTNB_BASH_NETWORK") == "1" if network is None else network:
        argv.append("--share-net")
    return argv


def jailed_server(command: str, args: Sequence[str], *, workdir: str, cwd: str, env: Mapping[str, str],
                  network: bool) -> list[str]:
    """The argv of a stdio MCP server in the jail Bash's commands run in (docs/tools.md#mcp-tools): the work
    directory read-write, the system and the server's program read-only, the network only when ``network``;
    ``[command, *args]`` as it is when the sandbox is off.  ``env`` is the server's environment (its PATH finds
    the program).  The caller runs it in a process group of its own that dies with the worker: bwrap's
    ``--die-with-parent`` and PID namespace take the server's own children down with it."""
    workdir, cwd = os.path.realpath(workdir), os.path.realpath(cwd)
    program = program_paths(command, env.get("PATH"), workdir, cwd)
    jail = sandbox_argv(workdir, cwd=cwd, network=network, readonly=program, who="agentnb runs stdio MCP servers")
    return [*jail, command, *args]


def program_paths(command: str, path_env: str | None, workdir: str, cwd: str) -> list[str]:
    """What a jailed program needs to see read-only beyond the system folders, the running Python and the work
    directory (docs/tools.md#mcp-tools): the program found on ``path_env`` or in ``cwd`` (its link and the file it
    leads to), the virtual environment it or its ``#!`` interpreter lives in, and that environment's Python
    installation.  Never a file its arguments name: a piece shared with you must not hand the jail your files."""
    found = shutil.which(command, path=path_env) if os.sep not in command else os.path.join(cwd, command)
    if found is None or not (os.path.isfile(found) and os.access(found, os.X_OK)):
        return []  # not found: the jail says so, and the start error shows it
    programs = [found, os.path.realpath(found)]
    interpreter = _interpreter(found)
    if interpreter is not None:
        programs += [interpreter, os.path.realpath(interpreter)]
    wanted = [_venv_of(p) or p for p in programs]
    for venv in [w for w in wanted if os.path.isfile(os.path.join(w, "pyvenv.cfg"))]:
        home = _venv_home(venv)  # the installation the environment's python links to
        if home is not None:
            wanted.append(os.path.dirname(home) if os.path.basename(home) == "bin" else home)
    seen = [p.rstrip("/") for p in (*_SYSTEM, sys.prefix, sys.base_prefix, workdir)]
    out: list[str] = []
    for w in sorted(set(wanted), key=len):  # a folder before what lies in it: one bind for both
        if os.path.exists(w) and not any(w == s or w.startswith(s + "/") for s in (*seen, *out)):
            out.append(w)
    return out


def _venv_of(program: str) -> str | None:
    """The virtual environment ``program`` is in (its ``bin/`` folder's parent holds ``pyvenv.cfg``), or None."""
    root = os.path.dirname(os.path.dirname(program))
    return root if os.path.isfile(os.path.join(root, "pyvenv.cfg")) else None


def _interpreter(program: str) -> str | None:
    """The interpreter a script's ``#!`` line names by absolute path, or None."""
    try:
        with open(program, "rb") as fh:
            first = fh.readline(512)
    except OSError:
        return None
    words = first[2:].decode("utf-8", "replace").split() if first.startswith(b"#!") else []
    return words[0] if words and os.path.isabs(words[0]) else None


def _venv_home(venv: str) -> str | None:
    with contextlib.suppress(OSError), open(os.path.join(venv, "pyvenv.cfg"), encoding="utf-8") as fh:
        for line in fh:
            key, _, value = line.partition("=")
            if key.strip() == "home" and os.path.isabs(value.strip()):
                return os.path.realpath(value.strip())
    return None


def _etc_argv() -> list[str]:
    """An /etc of only the allowed entries (read-only), so root in the jail cannot read /etc/shadow & co."""
    try:
        names = sorted(os.listdir("/etc"))
    except OSError:
        return []

    def allowed(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in ETC_ALLOWED)

    system = tuple(p + "/" for p in (*_SYSTEM, "/proc"))
    argv = ["--tmpfs", "/etc"]
    shown: set[str] = set()
    for name in filter(allowed, names):
        path = f"/etc/{name}"
        if os.path.islink(path):
            real = os.path.realpath(path)
            if real.startswith(system) or (real.startswith("/etc/") and allowed(real.split("/")[2])):
                argv += ["--symlink", os.readlink(path), path]  # into folders the jail has
            elif os.path.isfile(real) and not real.startswith("/etc/"):
                argv += ["--ro-bind", real, path]  # e.g. resolv.conf -> /run/…: that file's content only
            else:
                continue
        elif os.path.isdir(path) or os.path.isfile(path):
            argv += ["--ro-bind", path, path]
        else:
            continue
        shown.add(name)
    for hidden in _ETC_HIDDEN:
        folder = f"/etc/{hidden}"
        if hidden.split("/")[0] in shown and os.path.isdir(folder) and not os.path.islink(folder):
            argv += ["--tmpfs", folder, "--remount-ro", folder]
    return [*argv, "--remount-ro", "/etc"]


@dataclass
class Captured:
    """What a command wrote, kept up to a bound: the head of each stream and how much there was in all."""

    returncode: int | None  # None when the command timed out
    stdout: bytes
    stderr: bytes
    stdout_bytes: int
    stderr_bytes: int
    dropped_chars: int  # characters beyond the kept heads (both streams)
    dropped_lines: int
    dropped: dict[str, int]  # characters beyond the kept head, per stream ("out", "err")
    last: dict[str, bytes]  # the last byte each stream wrote ("out", "err")


def run_bounded(argv: list[str], *, cwd: str, env: dict[str, str], timeout: float, keep: int,
                death_signal: int = signal.SIGKILL) -> Captured:
    """Run ``argv`` keeping at most ``keep`` bytes of each stream; the rest is counted, never held.

    A command that prints gigabytes costs a bounded amount of memory.  It runs in a process group of its
    own, killed when the command ends or times out (nothing it started in the background lives on), and
    ``death_signal`` reaches it when the worker dies.
    """
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=_DieWithWorker(os.getpid(), death_signal))
    heads: dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}
    totals = {"out": 0, "err": 0}
    dropped = {"chars": 0, "lines": 0, "out": 0, "err": 0}
    last = {"out": b"", "err": b""}
    lock = threading.Lock()

    def drain(name: str, stream: Any) -> None:
        head = heads[name]
        while True:
            chunk = stream.read(1 << 16)
            if not chunk:
                break
            room = keep - len(head)
            if room > 0:
                head += chunk[:room]
            rest = chunk[room:] if room > 0 else chunk
            last[name] = chunk[-1:]
            with lock:
                totals[name] += len(chunk)
                if rest:
                    # characters: every byte that is not a UTF-8 continuation byte starts one
                    chars = len(rest.translate(None, _CONTINUATION))
                    dropped["chars"] += chars
                    dropped[name] += chars
                    dropped["lines"] += rest.count(b"\n")
        stream.close()

    readers = [threading.Thread(target=drain, args=("out", proc.stdout), daemon=True),
               threading.Thread(target=drain, args=("err", proc.stderr), daemon=True)]
    for t in readers:
        t.start()
    ended = threading.Event()

    def watch() -> None:
        try:  # WNOWAIT: the leader stays an unreaped zombie, so its group id cannot be reused before the kill
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
        finally:
            ended.set()

    timed_out = True
    try:
        if hasattr(os, "waitid"):
            threading.Thread(target=watch, daemon=True).start()
            timed_out = not ended.wait(timeout)
        else:  # no waitid (not Linux): reaped first, then the group, whose id is rarely reused so soon
            try:
                proc.wait(timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                pass
    finally:  # also on KeyboardInterrupt: the command never outlives the call
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    returncode: int | None = None if timed_out else proc.returncode
    for t in readers:
        # a process that left the group (setsid) may still hold the pipes: do not wait for it for ever
        t.join(_DRAIN_SECONDS)
    return Captured(returncode, bytes(heads["out"]), bytes(heads["err"]), totals["out"], totals["err"],
                    dropped["chars"], dropped["lines"], {"out": dropped["out"], "err": dropped["err"]}, last)


_CONTINUATION = bytes(range(0x80, 0xC0))
_DRAIN_SECONDS = 5.0
_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


_prctl = _load_prctl()


class _DieWithWorker:
    """Runs in the child between fork and exec: ask the kernel for ``sig`` when the worker (its parent) dies."""

    def __init__(self, parent: int, sig: int) -> None:
        self.parent, self.sig = parent, int(sig)

    def __call__(self) -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, self.sig, 0, 0, 0)
        if os.getppid() != self.parent:  # the worker died before the request was made
            os.kill(os.getpid(), self.sig)
