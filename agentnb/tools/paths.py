"""Paths a tool touches: confined to the job's work directory, and opened only when they are regular files."""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from .._fs import special_kind
from ..errors import ToolError

__all__ = ["normalise_rel", "open_regular", "resolve_path", "unlinked_path"]




def resolve_path(workdir: str | os.PathLike[str], rel: str) -> Path:
    """Resolve ``rel`` inside ``workdir``; refuse absolute paths and anything that leaves it.

    Symlinks are followed before the check, so a link pointing outside is refused too;
    backslashes count as separators (see :func:`normalise_rel`).
    """
    if not isinstance(rel, str) or not rel.strip():
        raise ToolError("path must be a non-empty path relative to the work directory")
    given = rel
    rel = normalise_rel(rel, what="path")
    root = os.path.realpath(workdir)
    real = os.path.realpath(os.path.join(root, rel))
    if real != root and not real.startswith(root + os.sep):
        raise ToolError(f"path {given!r} leaves the work directory; only paths inside it are allowed")
    if os.path.islink(real):  # realpath stops at a link it cannot resolve: a loop
        raise ToolError(f"path {given!r} is a symbolic link that loops (it never reaches a file)")
    return Path(real)


_DRIVE = re.compile(r"^[A-Za-z]:(/|$)")


def normalise_rel(rel: str, *, what: str = "path") -> str:
    """A model's relative path in POSIX form; absolute ones (POSIX, ``~``, Windows) are refused.

    Backslashes are taken as separators: a model writing ``output\\a.md`` or ``..\\x`` means
    folders, and a file literally named with backslashes would only surprise the user.
    """
    if "\x00" in rel:
        raise ToolError(f"{what} contains a NUL byte")
    posix = rel.replace("\\", "/")
    if os.path.isabs(posix) or posix.startswith("~") or _DRIVE.match(posix):
        raise ToolError(f"{what} {rel!r} is absolute; give a path relative to the work directory")
    return posix


def unlinked_path(base: str | os.PathLike[str], *parts: str) -> Path:
    """``base/parts…`` for a file the engine itself writes or reads on the host (logs, checklists).

    In the default layout ``logs/`` sits inside the work directory, where a ``Bash`` command (jailed,
    but its files stay) can leave symbolic links; following one would let the engine write or read
    outside the job.  So no existing component below ``base`` may be a link.
    """
    path = Path(base)
    for part in parts:
        path = path / part
        if path.is_symlink():
            rel = "/".join(path.relative_to(base).parts)
            raise ToolError(f"{rel} is a symbolic link; agentnb does not follow links in its log folder")
    return path


def open_regular(path: Path, rel: str, *, write: bool = False, append: bool = False) -> int:
    """A file descriptor for the regular file ``path`` (resolved already); anything else is a tool error.

    A FIFO, socket or device would block the worker or never end (a FIFO without a writer, /dev/zero).
    A check before opening is not enough, as the file can be swapped between the check and the open,
    so the open itself never blocks (``O_NONBLOCK``), never follows a link swapped in (``O_NOFOLLOW``,
    the path is resolved already), and ``fstat`` of what was opened decides.  ``write`` opens for
    writing, creating or emptying the file; ``append`` opens it for appending, creating it.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not (write or append):
            raise ToolError(f"no such file: {rel!r}") from None
        st = None
    except OSError as exc:
        raise ToolError(f"cannot open {rel!r}: {exc.strerror or type(exc).__name__}") from None
    if st is not None:
        _check_regular(st.st_mode, rel)  # a device is never opened: opening one can act (a tape, a watchdog)
    flags = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
    if append:
        flags |= os.O_WRONLY | os.O_CREAT | os.O_APPEND
    else:
        flags |= (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EWOULDBLOCK):
            raise ToolError(f"{rel!r} changed while it was being opened (it is no longer a regular file); "
                            "tools read and write regular files only") from None
        raise ToolError(f"cannot open {rel!r}: {exc.strerror or type(exc).__name__}") from None
    try:
        _check_regular(os.fstat(fd).st_mode, rel)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_regular(mode: int, rel: str) -> None:
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise ToolError(f"{rel!r} is a directory; use Glob to list it")
    raise ToolError(f"{rel!r} is {special_kind(mode)}, not a regular file; tools read and write regular files "
                    "only (a FIFO or device could block or never end)")
