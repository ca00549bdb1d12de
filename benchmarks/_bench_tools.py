"""The ``echo`` tool of the throughput benchmarks, in a module of its own: the worker processes of a batch run with
``processes=N`` import a batch's tools by module name (docs/design-lab.md#processes)."""

from __future__ import annotations

import agentnb
from agentnb.tools.base import get_tool

__all__ = ["echo"]

if get_tool("echo") is None:
    @agentnb.tool
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text
else:  # registered by an earlier import under another module name
    echo = get_tool("echo")
