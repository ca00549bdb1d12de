"""The errors a user sees, under one base.

``AgentnbError`` is what the magic, the panel and the CLI catch to show a one-line message instead of a
traceback.  Each subclass keeps the builtin base it always had (``ValueError`` for bad input,
``RuntimeError`` for a failing store or model), so code that caught those still does.
"""

from __future__ import annotations

__all__ = [
    "AgentnbError",
    "CallCancelled",
    "ModelError",
    "ModelSpecError",
    "NotFoundError",
    "PathNotFoundError",
    "PieceError",
    "StoreError",
    "ToolError",
    "UsageError",
]


class AgentnbError(Exception):
    """Base of every error agentnb raises for a user to read."""


class PieceError(AgentnbError, ValueError):
    """A piece that cannot be used; ``str()`` is one line naming file, line and field."""

    def __init__(self, message: str, *, file: str = "<piece>", line: int | None = None, field: str = "") -> None:
        self.file, self.line, self.field, self.detail = file, line, field, message
        where = file + (f":{line}" if line else "")
        super().__init__(f"{where}: {field + ': ' if field else ''}{message}")


class ModelSpecError(AgentnbError, ValueError):
    """A model spec (``demo``, ``scripted:PATH``, ``openai:NAME``, ``replay:JOB``) that cannot be used."""


class ModelError(AgentnbError, RuntimeError):
    """A model call that failed for good (after any retries)."""


class CallCancelled(AgentnbError):
    """A model call cut off mid-answer because its job was asked to stop (docs/models.md#streaming).

    Not a failure: no ``llm_response`` is made from a partial answer, the job pauses, and the call is asked
    again on resume.  ``partial_text`` and ``partial_arguments`` hold what had arrived (for a token estimate).
    """

    def __init__(self, message: str = "the call was stopped mid-answer", *, partial_text: str = "",
                 partial_arguments: str = "") -> None:
        super().__init__(message)
        self.partial_text = partial_text
        self.partial_arguments = partial_arguments


class StoreError(AgentnbError, RuntimeError):
    """The store cannot be opened, read or written, or has no such job."""


class PathNotFoundError(AgentnbError, FileNotFoundError):
    """A file or folder the user named (a job's ``workdir``) that does not exist."""


class NotFoundError(AgentnbError, LookupError):
    """Something the user named inside a job (a movement run) that the job does not have."""


class ToolError(AgentnbError):
    """A tool call that failed; its message is what the model reads as the tool result."""


class UsageError(AgentnbError, ValueError):
    """An API or command used wrongly (a bad argument or option); the message says what is allowed."""
