"""Words for the kinds of file that agentnb refuses to open or write (the tools, the store and the exports share
them)."""

from __future__ import annotations

import stat
from pathlib import Path

__all__ = ["file_in_the_way", "special_kind"]


def file_in_the_way(target: Path) -> Path | None:
    """The nearest existing part of ``target``'s folder when it is a file, not a folder (the folder cannot be
    made); None when there is none."""
    for parent in target.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def special_kind(mode: int) -> str:
    """What a file that is neither a regular file nor a directory is, in words."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "a special file"
