"""The errors a user sees, under one base.

``AgentnbError`` is what the magic, the panel and the CLI catch to show a one-line message instead of a
traceback.  Each subclass keeps the builtin base it always had (``ValueError`` for bad input,
``RuntimeError`` for a failing store or model), so code that caught those still does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

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
    "as_typed",
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
    ``interrupt``: the Ctrl-C or SIGTERM (``KeyboardInterrupt``, ``SystemExit``) that cut the call off in the thread
    reading it (a one-job worker, ``agentnb run``): the engine records the stopped call, then raises it again.
    """

    def __init__(self, message: str = "the call was stopped mid-answer", *, partial_text: str = "",
                 partial_arguments: str = "", interrupt: BaseException | None = None) -> None:
        super().__init__(message)
        self.partial_text = partial_text
        self.partial_arguments = partial_arguments
        self.interrupt = interrupt


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


# a message that opens with the Python argument it is about: `concurrency=0; allowed: …`
_PY_ARGUMENT = re.compile(r"([a-z][a-z0-9_]*)=")


def as_typed(message: str, argv: Sequence[str]) -> str:
    """``message`` with its opening Python argument (``cost_limit=-1.0; allowed: …``) said as the option the user
    typed in ``argv`` (``--cost-limit -1.0; allowed: …``): the CLI and the magic pass their options to the Python
    API, whose checks name its arguments.  Unchanged when that option was not typed so (a short form, ``-e 0``,
    keeps the argument's name)."""
    m = _PY_ARGUMENT.match(message)
    if m is None:
        return message
    flag = "--" + m[1].replace("_", "-")
    if not any(a == flag or a.startswith(flag + "=") for a in argv):
        return message
    return f"{flag} {message[m.end():]}"
