"""agentnb: a Jupyter-native toolkit for designing, running and inspecting LLM agent workflows."""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from .engine.pieces import Movement, Piece, PieceError, Rule, available_pieces, load_piece, parse_piece
from .errors import AgentnbError, StoreError, UsageError
from .events import EVENT_KINDS, Event
from .models.base import ModelError, ModelRequest, ModelResponse, ModelSpecError, ScriptedModel, ToolCall
from .tools.base import Tool, ToolContext, ToolError, ToolOutput, tool
from .workspace import Job, JobStatus, Workspace

if TYPE_CHECKING:
    from . import scorers
    from .batch_compare import BatchComparison
    from .compare import Comparison

__version__ = "0.1.0"

# imported at their first use (PEP 562): a worker process, which never compares jobs nor scores them, starts
# without them and the views they pull in (benchmarks/README.md#short-jobs-and-the-fixed-cost-per-job-issue-32)
_LAZY = {"BatchComparison": ".batch_compare", "Comparison": ".compare", "scorers": ".scorers"}

__all__ = [
    "EVENT_KINDS",
    "AgentnbError",
    "BatchComparison",
    "Comparison",
    "Event",
    "Job",
    "JobStatus",
    "ModelError",
    "ModelRequest",
    "ModelResponse",
    "ModelSpecError",
    "Movement",
    "Piece",
    "PieceError",
    "Rule",
    "ScriptedModel",
    "StoreError",
    "Tool",
    "ToolCall",
    "ToolContext",
    "ToolError",
    "ToolOutput",
    "UsageError",
    "Workspace",
    "available_pieces",
    "load_ipython_extension",
    "load_piece",
    "parse_piece",
    "plot_batch",
    "plot_usage",
    "scorers",
    "tool",
]


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(where, __name__)
    value = module if name == "scorers" else getattr(module, name)
    globals()[name] = value
    return value


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext agentnb``: register the ``%agent`` magics."""
    from .notebook.magic import load_ipython_extension as _load

    _load(ipython)
    # The README's and notebooks' snippets call agentnb.plot_usage(job) and friends after %load_ext alone.
    # A variable of the user's already named agentnb is left alone; interactive=False keeps the name out
    # of %who, as for IPython's own names.
    if "agentnb" not in ipython.user_ns:
        ipython.push({"agentnb": sys.modules[__name__]}, interactive=False)


def plot_batch(batch: Any, **kwargs: Any) -> Any:
    """A batch's variants compared (mean score against cost, tokens per case) as a matplotlib Figure."""
    from .views.batch_plots import plot_batch as _plot

    return _plot(batch, **kwargs)


def plot_usage(job_or_frame: Any, **kwargs: Any) -> Any:
    """The usage timeline of a job (or of a ``frames.usage()`` DataFrame) as a matplotlib Figure."""
    from .views.plots import plot_usage as _plot

    return _plot(job_or_frame, **kwargs)
