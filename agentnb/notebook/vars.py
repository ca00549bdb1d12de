"""Notebook variables in ``%agent`` arguments: ``{expr}`` and ``$name``, as IPython fills other magics.

IPython expands a magic's line with its ``DollarFormatter`` (``shell.var_expand``): ``{expr}`` is
any Python expression evaluated in the notebook's namespace (``{n // 4}``, ``{path!r}``,
``{x:>5}``), ``$name`` (or ``$name.attr``) a variable, ``{{``/``}}`` literal braces and ``$$`` a
literal ``$``.  ``%agent`` splits its line first and fills each argument on its own, with two
differences that matter for instructions written in prose:

* a ``{expr}`` that cannot be filled is a :class:`VarError` naming it (IPython would silently
  leave the whole line as typed, so a typo would reach the model unnoticed);
* the line is split into arguments before filling (a variable holding spaces stays one argument),
  but a ``{expr}`` with spaces or quotes inside is one piece of its argument (``{n * 2}``);
* a ``$word`` whose ``word`` is not a variable stays as typed (``$5``, ``$HOME`` in a shell
  instruction), where IPython would turn ``$5`` into ``5`` or, again, give up on the whole line.

:func:`expand_value` keeps the object when an argument is one field alone (``{job}``, ``$jid``),
so a JOB argument can hold a :class:`~agentnb.Job` or an int rather than its text.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Any

from ..errors import UsageError

__all__ = ["VarError", "expand", "expand_value", "split_line"]

_DOLLAR = re.compile(r"\$(\$?)([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
_BRACES_HINT = "write {{ and }} for literal braces"


class VarError(UsageError):
    """An argument names a variable the notebook does not have, or an expression that fails."""


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _eval(expr: str, ns: Mapping[str, Any], shown: str, where: str) -> Any:
    try:
        # the namespace as globals, as IPython does, so comprehensions in the expression see it too
        return eval(expr, ns if isinstance(ns, dict) else dict(ns))
    except NameError as exc:
        name = getattr(exc, "name", None) or expr
        which = "" if shown in ("{" + name + "}", "$" + name) else f" ({name!r})"
        raise VarError(f"{shown} in {where} names no variable of the notebook{which}; {_BRACES_HINT}") from None
    except SyntaxError:
        raise VarError(f"{shown} in {where} is not a Python expression; {_BRACES_HINT}") from None
    except Exception as exc:
        raise VarError(f"cannot fill {shown} in {where} ({_one_line(exc)}); {_BRACES_HINT}") from None


def _dollars(literal: str, ns: Mapping[str, Any], where: str, out: list[Any]) -> None:
    """Fill ``$name`` in a literal part; ``$$name`` is ``$name``; an unknown ``$word`` stays as typed."""
    pos = 0
    for m in _DOLLAR.finditer(literal):
        escaped, path = m.group(1), m.group(2)
        out.append(literal[pos:m.start()])
        pos = m.end()
        if escaped:
            out.append("$" + path)
        elif path.split(".", 1)[0] in ns:
            out.append(_Filled(_eval(path, ns, "$" + path, where)))
        else:
            out.append(m.group(0))
    out.append(literal[pos:])


def _parts(text: str, ns: Mapping[str, Any], where: str) -> list[Any]:
    out: list[Any] = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:  # a lone { or }
        raise VarError(f"cannot fill the braces of {where} ({exc}); {_BRACES_HINT}") from None
    for literal, field, spec, conversion in parsed:
        if literal:
            _dollars(literal, ns, where, out)
        if field is None:
            continue
        shown = "{" + field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if not field.strip():
            raise VarError(f"{{}} in {where} names nothing; {_BRACES_HINT}")
        value = _eval(field, ns, shown, where)
        if conversion or spec:
            try:
                value = string.Formatter().convert_field(value, conversion)
                value = format(value, spec or "")
            except (ValueError, TypeError) as exc:
                raise VarError(f"cannot fill {shown} in {where} ({_one_line(exc)}); {_BRACES_HINT}") from None
        out.append(_Filled(value))
    return [p for p in out if not (isinstance(p, str) and p == "")]


class _Filled:
    """A value filled in from the namespace (told apart from literal text of the argument)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def expand(text: str, ns: Mapping[str, Any], where: str = "the argument") -> str:
    """``text`` with its ``{expr}`` and ``$name`` filled from ``ns`` (see the module docstring)."""
    parts = _parts(text, ns, where)
    return "".join(format(p.value, "") if isinstance(p, _Filled) else p for p in parts)


def expand_value(text: str, ns: Mapping[str, Any], where: str = "the argument") -> Any:
    """Like :func:`expand`, but an argument that is one ``{expr}``/``$name`` alone gives the object itself."""
    parts = _parts(text, ns, where)
    if len(parts) == 1 and isinstance(parts[0], _Filled):
        return parts[0].value
    return "".join(format(p.value, "") if isinstance(p, _Filled) else p for p in parts)


def split_line(line: str) -> list[str]:
    """Split a magic's line like a shell (``shlex``), keeping each ``{expr}`` whole even with spaces or quotes."""
    from IPython.utils.process import arg_split

    fields: list[str] = []
    out: list[str] = []
    i, n = 0, len(line)
    while i < n:
        ch = line[i]
        if ch in "{}" and line[i:i + 2] in ("{{", "}}"):
            out.append(line[i:i + 2])
            i += 2
            continue
        if ch == "{":
            depth, j = 0, i
            while j < n:
                depth += {"{": 1, "}": -1}.get(line[j], 0)
                if depth == 0:
                    break
                j += 1
            if j < n and any(c.isspace() or c in "'\"" for c in line[i:j + 1]):
                fields.append(line[i:j + 1])
                out.append(f"\x00{len(fields) - 1}\x00")
                i = j + 1
                continue
        out.append(ch)
        i += 1
    parts = arg_split("".join(out), posix=True)
    return [re.sub("\x00(\\d+)\x00", lambda m: fields[int(m.group(1))], p) for p in parts]
