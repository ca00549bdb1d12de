"""Words for the kinds of file that agentnb refuses to open (the tools and the store share them)."""

from __future__ import annotations

import stat

__all__ = ["special_kind"]


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
