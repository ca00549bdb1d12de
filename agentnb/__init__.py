"""agentnb: a Jupyter-native toolkit for designing, running and inspecting LLM agent workflows."""

from __future__ import annotations

from typing import Any

from .events import EVENT_KINDS, Event
from .models.base import ModelError, ModelRequest, ModelResponse, ModelSpecError, ScriptedModel, ToolCall
from .engine.pieces import Movement, Piece, PieceError, Rule, available_pieces, load_piece, parse_piece
from .tools.base import Tool, ToolContext, ToolError, ToolOutput, tool
from .workspace import Job, JobStatus, Workspace

__version__ = "0.1.0"

__all__ = [
    "Workspace",
    "Job",
    "JobStatus",
    "Piece",
    "Movement",
    "Rule",
    "PieceError",
    "load_piece",
    "parse_piece",
    "available_pieces",
    "tool",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolOutput",
    "Event",
    "EVENT_KINDS",
    "ModelError",
    "ModelSpecError",
    "ModelRequest",
    "ModelResponse",
    "ScriptedModel",
    "ToolCall",
    "load_ipython_extension",
    "plot_usage",
]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext agentnb``: register the ``%agent`` magics."""
    from .notebook.magic import load_ipython_extension as _load

    _load(ipython)


def plot_usage(job_or_frame: Any, **kwargs: Any) -> Any:
    """The usage timeline of a job (or of a ``frames.usage()`` DataFrame) as a matplotlib Figure."""
    from .views.plots import plot_usage as _plot

    return _plot(job_or_frame, **kwargs)
