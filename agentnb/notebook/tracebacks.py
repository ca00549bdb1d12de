"""An ``AgentnbError`` raised by a notebook cell, shown as one line and a hint, as IPython shows its ``UsageError``.

``%load_ext agentnb`` installs :func:`one_line_error` as IPython's custom exception handler
(``InteractiveShell.set_custom_exc``) for :class:`~agentnb.errors.AgentnbError` alone: ``ws.fork(job, at=1)``
on a waiting job prints ``UsageError: …`` and the hint below, not thirty lines of frames.  ``%tb`` (and
``%debug``) still reach that error; ``%xmode Verbose`` or ``AGENTNB_TRACEBACK=1`` (read at each error, so
``%env`` works) show the full traceback every time.  Any other exception, a programming error, keeps IPython's
traceback.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Any

from ..errors import AgentnbError

__all__ = ["HANDLED", "HINT", "TRACEBACK_ENV", "full_tracebacks", "install", "one_line_error"]

TRACEBACK_ENV = "AGENTNB_TRACEBACK"
HINT = f"(full traceback: %tb; every time: %xmode Verbose or {TRACEBACK_ENV}=1)"

# The very tuple handed to IPython: ``shell.custom_exceptions is HANDLED`` tells our handler from another one.
HANDLED: tuple[type[BaseException], ...] = (AgentnbError,)


def full_tracebacks(shell: Any) -> bool:
    """Whether the user asked for full tracebacks: ``%xmode Verbose``, or ``AGENTNB_TRACEBACK`` set and not ``0``."""
    return shell.InteractiveTB.mode == "Verbose" or os.environ.get(TRACEBACK_ENV, "").strip() not in ("", "0")


def one_line_error(shell: Any, etype: type[BaseException], value: BaseException, tb: TracebackType | None,
                   tb_offset: int | None = None) -> None:
    """IPython's custom exception handler (bound to the shell by ``set_custom_exc``): the error's class and
    message on stderr, where IPython prints a ``UsageError``, and the hint; or, if asked for, the full traceback."""
    if full_tracebacks(shell):
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        return
    # What showtraceback would have kept, so that %tb and %debug find this error
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = value
    print(f"{etype.__name__}: {value}\n{HINT}", file=sys.stderr)


def install(shell: Any) -> bool:
    """Make ``shell`` show an ``AgentnbError`` as one line; False (and nothing changed) when another custom
    handler is set.

    IPython keeps one custom handler per shell.  One set by the user or another extension is left as it is,
    rather than replaced or chained: it may be set for a builtin base an AgentnbError also has (``ValueError``),
    and which of two handlers ought to win is the user's choice, not ours.  Installing twice (``%reload_ext``)
    is harmless.
    """
    if shell.custom_exceptions != () and shell.custom_exceptions is not HANDLED:
        return False
    shell.set_custom_exc(HANDLED, one_line_error)
    return True
