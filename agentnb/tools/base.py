"""Tools: plain functions with a JSON schema from their signature and docstring.

``@agentnb.tool`` turns a function into a :class:`Tool` and registers it, so a
piece can name it in ``tools:``.  A tool's exception becomes a tool error that the
model sees; it never crashes the job.  Every path a built-in tool touches is
resolved inside the job's work directory.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from .._secrets import mask_key_shaped, redact, secret_values
from ..errors import ToolError, UsageError
from .context import ToolContext, ToolOutput
from .paths import normalise_rel, open_regular, resolve_path, unlinked_path
from .truncate import NOTE_PREFIX, cut_text

__all__ = [
    "PERMISSION_RANK",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolOutput",
    "builtin_tool",
    "get_tool",
    "normalise_rel",
    "open_regular",
    "register",
    "registered_tool_names",
    "relative_paths",
    "resolve_path",
    "tool",
    "unlinked_path",
    "unregister",
]

PERMISSION_RANK = {"readonly": 0, "edit": 1, "full": 2}


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]
    permission: str = "readonly"
    takes_context: bool = False
    builtin: bool = False
    # Safe to run again after a crash: it changes no file and runs no command.  A tool that is not
    # read-only has its call committed before it runs, and a restart never runs a started call again.
    read_only: bool = False
    server: str | None = None  # the MCP server that offers it (tools/mcp.py); None: built-in or Python
    _positional: tuple[str, ...] = field(default=(), repr=False)

    def schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def invoke(self, ctx: ToolContext, arguments: Mapping[str, Any]) -> ToolOutput:
        """Run with model-supplied arguments; every failure becomes an error output."""
        # the dict check first: isinstance against typing.Mapping walks the ABC machinery (~3 µs a call)
        if not isinstance(arguments, dict) and not isinstance(arguments, Mapping):
            return ToolOutput(f"Error: arguments for {self.name} must be a JSON object", is_error=True)
        props = self.parameters.get("properties", {})
        unknown = [k for k in arguments if k not in props]
        if unknown:
            return ToolOutput(
                f"Error: unknown argument(s) {', '.join(map(repr, unknown))} for {self.name}; "
                f"allowed: {', '.join(props) or 'none'}",
                is_error=True,
            )
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return ToolOutput(f"Error: {self.name} needs argument(s) {', '.join(map(repr, missing))}", is_error=True)
        return _safe_output(self._run(ctx, arguments), ctx, arguments)

    def _run(self, ctx: ToolContext, arguments: Mapping[str, Any]) -> ToolOutput:
        try:
            result = self.fn(ctx, **arguments) if self.takes_context else self.fn(**arguments)
        except ToolError as exc:
            return ToolOutput(f"Error: {exc}", is_error=True)
        except TypeError as exc:
            return ToolOutput(f"Error: {self.name}: {exc}", is_error=True)
        except Exception as exc:  # a user tool's exception is the model's to read
            return ToolOutput(f"Error: {self.name} raised {type(exc).__name__}: {exc}", is_error=True)
        if isinstance(result, ToolOutput):
            return result
        if result is None:
            text = "(no output)"
        elif isinstance(result, str):
            text = result
        else:
            try:
                text = json.dumps(result, ensure_ascii=False, default=str)
            except (TypeError, ValueError):
                text = repr(result)
        return cut_text(text, ctx, hint="generic")


def _safe_output(out: ToolOutput, ctx: ToolContext, arguments: Mapping[str, Any]) -> ToolOutput:
    """The last checks on every tool result, built-in or not, before it is stored or shown to the model:
    an error names no host path (only paths relative to the work directory), and no result holds a
    secret value from the environment or registered in code, nor anything shaped like a key — what the store
    would mask anyway, masked here so that the model sees the result as it is recorded (see ``_secrets``)."""
    if out.is_error:
        out.content = relative_paths(out.content, ctx)
    values = secret_values()
    content = out.content
    # a piece read from further into a file may start inside a secret whose start the last piece masked
    offset = arguments.get("offset")
    from_inside = bool(arguments.get("byte_offset")) or (type(offset) is int and offset > 1)
    note_at = -1
    if out.truncated:
        note_at = content.rfind(NOTE_PREFIX)
    if note_at >= 0:  # the body was cut where the note starts: a secret may be cut there too
        body = redact(content[:note_at], values, cut_start=from_inside, cut_end=True)
        new = body + redact(content[note_at:], values)
    else:
        new = redact(content, values, cut_start=from_inside)
    new = mask_key_shaped(new)  # the values are gone already: one pass over the result, not a second redact
    if new != content:
        shrunk = len(content) - len(new)
        out.content = new
        if out.returned_chars is not None:
            out.returned_chars = max(0, out.returned_chars - shrunk)
        if not out.truncated and out.original_chars is not None:
            out.original_chars = max(0, out.original_chars - shrunk)
    return out


# ---------------------------------------------------------------------------
# Schema from signature and docstring

_PRIMITIVES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


def _json_type(hint: Any) -> tuple[dict[str, Any], bool]:
    """JSON schema for a type hint, and whether ``None`` is allowed."""
    origin = get_origin(hint)
    if hint is Any or hint is inspect.Parameter.empty:
        return {}, False
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        optional = len(args) != len(get_args(hint))
        if len(args) == 1:
            return _json_type(args[0])[0], optional
        return {"anyOf": [_json_type(a)[0] for a in args]}, optional
    if origin is Literal:
        values = list(get_args(hint))
        return {"enum": values}, False
    if origin in (list, tuple, typing.Sequence) or hint in (list, tuple):
        items = get_args(hint)
        out: dict[str, Any] = {"type": "array"}
        if items and items[0] is not Ellipsis:
            out["items"] = _json_type(items[0])[0]
        return out, False
    if origin in (dict, typing.Mapping) or hint is dict:
        return {"type": "object"}, False
    if hint in _PRIMITIVES:
        return {"type": _PRIMITIVES[hint]}, False
    return {}, False


_ARG_LINE = re.compile(r"^\s*(?:[-*]\s*)?(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Description and per-argument text from a Google-, NumPy- or Sphinx-style docstring."""
    doc = inspect.cleandoc(doc or "")
    params: dict[str, str] = {}
    desc_lines: list[str] = []
    section: str | None = None
    current: str | None = None
    for line in doc.splitlines():
        stripped = line.strip()
        m = re.match(r":param\s+(?:\w+\s+)?(\w+):\s*(.*)", stripped)
        if m:
            current = m.group(1)
            params[current] = m.group(2)
            section = "params"
            continue
        if stripped.lower().rstrip(":") in ("args", "arguments", "parameters", "params"):
            section, current = "params", None
            continue
        if stripped.lower().rstrip(":") in ("returns", "return", "raises", "yields", "examples", "example"):
            section, current = "other", None
            continue
        if set(stripped) <= {"-"} and stripped:
            continue
        if section == "params":
            m = _ARG_LINE.match(line)
            indent = len(line) - len(line.lstrip())
            if m and (current is None or indent <= 4):
                current = m.group(1)
                params[current] = m.group(2).strip()
            elif current and stripped:
                params[current] = (params[current] + " " + stripped).strip()
        elif section is None:
            desc_lines.append(line)
    description = "\n".join(desc_lines).strip()
    return description, params


def _build_tool(
    fn: Callable[..., Any], name: str | None, description: str | None, permission: str, builtin: bool,
    read_only: bool = False,
) -> Tool:
    if permission not in PERMISSION_RANK:
        raise UsageError(f"permission={permission!r}; allowed: {', '.join(PERMISSION_RANK)}")
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    doc_desc, doc_params = _parse_docstring(fn.__doc__ or "")
    props: dict[str, Any] = {}
    required: list[str] = []
    takes_context = False
    for i, (pname, param) in enumerate(sig.parameters.items()):
        hint = hints.get(pname, param.annotation)
        if hint is ToolContext or (i == 0 and pname == "ctx"):
            takes_context = True
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        schema, optional = _json_type(hint)
        if pname in doc_params:
            schema = {**schema, "description": doc_params[pname]}
        if param.default is not inspect.Parameter.empty and param.default is not None:
            schema = {**schema, "default": param.default}
        props[pname] = schema
        if param.default is inspect.Parameter.empty and not optional:
            required.append(pname)
    parameters: dict[str, Any] = {"type": "object", "properties": props, "required": required}
    tool_name = name or fn.__name__
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", tool_name):
        raise UsageError(f"tool name {tool_name!r} must be 1–64 letters, digits, '_' or '-'")
    return Tool(
        name=tool_name,
        description=description or doc_desc or tool_name,
        parameters=parameters,
        fn=fn,
        permission=permission,
        takes_context=takes_context,
        builtin=builtin,
        read_only=bool(read_only),
    )


_REGISTRY: dict[str, Tool] = {}


def register(t: Tool) -> Tool:
    existing = _REGISTRY.get(t.name)
    if existing is not None and existing.builtin and not t.builtin:
        raise UsageError(f"{t.name!r} is a built-in tool; choose another name")
    _REGISTRY[t.name] = t
    return t


def unregister(name: str) -> None:
    t = _REGISTRY.get(name)
    if t is not None and not t.builtin:
        del _REGISTRY[name]


def get_tool(name: str) -> Tool | None:
    return _REGISTRY.get(name)


def registered_tool_names() -> list[str]:
    return list(_REGISTRY)


@typing.overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@typing.overload
def tool(
    *, name: str | None = None, description: str | None = None, permission: str = "readonly",
    read_only: bool = False,
) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    permission: str = "readonly",
    read_only: bool = False,
) -> Any:
    """Make a plain function a tool that pieces can name in ``tools:``.

    The schema comes from the signature, type hints and docstring (``Args:``
    section).  ``permission`` is what a movement needs to use it: ``readonly``,
    ``edit`` or ``full``.  ``read_only=True`` declares that the tool changes
    nothing (no file, no command, no message sent): after a crash a started call
    of it is simply run again.  Any other tool's call is committed to the store
    before it runs and is never run twice; ``permission`` does not imply it
    (``Checklist`` needs only ``readonly`` yet writes a file).  A first parameter
    named ``ctx`` (or typed :class:`ToolContext`) receives the job's context.
    Redefining a tool in a notebook cell replaces the earlier definition.
    """
    if not isinstance(read_only, bool):
        raise UsageError(f"read_only={read_only!r}; allowed: True or False")

    def wrap(f: Callable[..., Any]) -> Tool:
        return register(_build_tool(f, name, description, permission, False, read_only))

    return wrap(fn) if fn is not None else wrap


def builtin_tool(*, permission: str = "readonly", read_only: bool = False) -> Callable[[Callable[..., Any]], Tool]:
    """``@tool`` for agentnb's own tools (:mod:`.builtin`): a user's tool can never replace one of them."""

    def wrap(f: Callable[..., Any]) -> Tool:
        return register(_build_tool(f, None, None, permission, True, read_only))

    return wrap


# ---------------------------------------------------------------------------
# Host paths out of results


def relative_paths(text: str, ctx: ToolContext) -> str:
    """``text`` with the host's paths of the work directory, the job folder and the workspace written
    relative to the work directory (``input/a.md``, ``.``, ``../..``); ``<job folder>`` or ``<workspace>``
    when the work directory is elsewhere.

    The last line of defence for error messages (an OSError's text, a user tool's exception): the model
    must never learn where the job lives on the host, which would help it aim at the host's files.
    """
    if "/" not in text:
        return text
    for form, rel in _host_forms(ctx):
        if form not in text:
            continue
        text = re.sub(re.escape(form) + r"(?:(/)|(?=[\s'\"`),:;\]}>]|$))", _rewrite_as(rel), text)
    return text


def _rewrite_as(rel: str) -> Callable[[re.Match[str]], str]:
    """The replacement of a host path: ``rel`` alone, or ``rel/`` when a path goes on inside it."""
    prefix = "" if rel == "." else rel + "/"
    return lambda m: prefix if m.group(1) else rel


def _host_forms(ctx: ToolContext) -> list[tuple[str, str]]:
    """(host path, what to write instead) for the work directory, job folder and workspace, longest first."""
    workdir = os.path.realpath(ctx.workdir)
    job = ctx.logs_dir.parent
    places: list[tuple[Path, str]] = [(Path(ctx.workdir), "."), (job, "<job folder>")]
    if job.parent.name == "jobs":  # the default layout <workspace>/jobs/<id>/logs
        places.append((job.parent.parent, "<workspace>"))
    forms: dict[str, str] = {}
    for place, name in places:
        real = os.path.realpath(place)
        if real == workdir or workdir.startswith(real + os.sep):
            rel = os.path.relpath(workdir, real)
            rel = "." if rel == "." else "/".join(".." for _ in rel.split(os.sep))
        elif real.startswith(workdir + os.sep):
            rel = os.path.relpath(real, workdir)
        else:
            rel = name
        for form in {os.path.abspath(place), real}:
            if len(form) > 1:  # never rewrite "/" itself
                forms.setdefault(form, rel)
    return sorted(forms.items(), key=lambda item: len(item[0]), reverse=True)
