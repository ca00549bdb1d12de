"""The piece parser's machinery: a checker that reads YAML nodes and fails with file, line and field, and
the placing of errors the YAML parser reports (engine/pieces.py is the parser itself)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ..errors import PieceError

__all__ = ["TOP", "Checker", "FastLoader", "Keys", "keys_found", "short", "yaml_error", "yaml_field"]

# libyaml (when PyYAML has it) composes ~10x faster; a job's runner parses its stored piece on every
# (re)start, so the pure-Python parser was most of a short run's fixed cost.  Errors are still worded by
# the pure-Python parser (see parse_piece), so messages do not depend on which one is installed.
FastLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# a mapping's keys, each with its key node and value node (for the lines errors name)
Keys = dict[str, tuple[Node, Node]]
_T = TypeVar("_T")
_D = TypeVar("_D")
TOP = "(top level)"
# scalars whose text a text field takes as written (a name like `2024` or `yes`); null is "empty"
_TEXTLIKE_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "timestamp"))


def keys_found(keys: dict[str, Any]) -> str:
    return ", ".join(keys) or "none"


_KEY_LINE = re.compile(r"^( *)(- +)?([A-Za-z_][\w-]*) *:")


def yaml_field(text: str, line: int) -> str:
    """The key path around a (1-based) line, read from indentation, for errors the YAML parser can't place."""
    lines = [ln.replace("\t", " ") for ln in text.splitlines()]
    if not lines:
        return TOP
    parts: list[str] = []
    limit: int | None = None  # the column of the innermost node found so far; parents sit left of it
    for i in range(min(max(line - 1, 0), len(lines) - 1), -1, -1):
        m = _KEY_LINE.match(lines[i])
        if not m:
            continue
        dash = len(m.group(1))
        column = dash + len(m.group(2) or "")
        if limit is None or column < limit:
            parts.insert(0, m.group(3))
            limit = column
        if m.group(2) and column <= limit:  # a list item that holds what we have: which item is it?
            parts.insert(0, f"[{_item_index(lines, i, dash)}]")
            limit = dash
        if limit == 0:
            break
    return _join_field(parts)


def _item_index(lines: list[str], i: int, dash: int) -> int:
    """Which item of its list the item starting on line ``i`` (its dash at column ``dash``) is, from 0."""
    n = 0
    for j in range(i - 1, -1, -1):
        stripped = lines[j].lstrip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(lines[j]) - len(stripped)
        if indent < dash:
            break
        if indent == dash and stripped.startswith("-"):
            n += 1
    return n


def _join_field(parts: list[str]) -> str:
    """``movements[1].rules[0].next`` from its parts (keys and ``[i]`` indexes)."""
    out = ""
    for part in parts:
        out += part if part.startswith("[") or not out else "." + part
    return out or TOP


def yaml_error(exc: yaml.YAMLError, text: str, source: str) -> PieceError:
    lines = text.splitlines()
    mark = getattr(exc, "problem_mark", None)
    context = getattr(exc, "context_mark", None)
    blank = mark is None or mark.line >= len(lines) or not lines[mark.line].strip()
    if blank and context is not None:  # e.g. the end of the file: where the unclosed thing began says more
        mark = context
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if blank and getattr(exc, "context", None):
        problem = f"{problem} {exc.context}"  # type: ignore[attr-defined]
    line = mark.line + 1 if mark is not None else None
    found = lines[line - 1].strip() if line and 0 < line <= len(lines) else ""
    if "\t" in found or "'\\t'" in problem:
        problem += " (indent with spaces, not tabs)"
    return PieceError(
        f"not valid YAML: {problem}; found {short(found)}, expected YAML text (a mapping of name, movements, …)",
        file=source, line=line, field=yaml_field(text, line or 1),
    )


def short(value: str, limit: int = 80) -> str:
    """``value`` quoted for an error line, cut: a file that is not a piece (a host file named by mistake)
    must not be echoed whole into one line of error output."""
    return repr(value if len(value) <= limit else value[:limit] + "…")


class Checker:
    def __init__(self, file: str, base: Path | None) -> None:
        self.file, self.base = file, base

    def fail(self, node: Node | None, fld: str, message: str) -> PieceError:
        line = node.start_mark.line + 1 if node is not None else None
        return PieceError(message, file=self.file, line=line, field=fld)

    @staticmethod
    def _describe(node: Node) -> str:
        if isinstance(node, MappingNode):
            return "a mapping"
        if isinstance(node, SequenceNode):
            return "a list"
        value = node.value
        return short(value) if value != "" else "an empty value"

    def mapping(self, node: Node, fld: str, allowed: Iterable[str]) -> Keys:
        if not isinstance(node, MappingNode):
            raise self.fail(node, fld, f"found {self._describe(node)}, expected a mapping")
        allowed = tuple(allowed)
        out: dict[str, tuple[Node, Node]] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, ScalarNode) else None
            sub = f"{fld}.{key}" if fld and fld != TOP else str(key)
            if key not in allowed:
                raise self.fail(key_node, sub, f"unknown key {key!r}; allowed keys: {', '.join(allowed)}")
            if key in out:
                raise self.fail(key_node, sub, f"key {key!r} appears twice")
            out[key] = (key_node, value_node)
        return out

    def string(self, node: Node, fld: str, *, choices: Iterable[str] | None = None, nonempty: bool = True) -> str:
        if not isinstance(node, ScalarNode) or node.tag not in ("tag:yaml.org,2002:str",):
            if isinstance(node, ScalarNode) and node.tag not in _TEXTLIKE_TAGS:
                # an explicit tag (!!python/object:…, !!binary, !custom) is never what a piece means
                raise self.fail(node, fld, f"found a value tagged {node.tag.replace('tag:yaml.org,2002:', '!!')!r}, "
                                           "expected plain text")
            if isinstance(node, ScalarNode) and node.tag != "tag:yaml.org,2002:null":
                # numbers and booleans written where text is expected: accept their text
                value = node.value
            else:
                raise self.fail(node, fld, f"found {self._describe(node)}, expected text")
        else:
            value = node.value
        if nonempty and not value.strip():
            raise self.fail(node, fld, "found an empty value, expected text")
        if choices is not None:
            choices = tuple(choices)
            if value not in choices:
                raise self.fail(node, fld, f"found {value!r}, allowed: {', '.join(choices)}")
        return value

    def integer(self, node: Node, fld: str, *, minimum: int = 1) -> int:
        if not isinstance(node, ScalarNode) or node.tag != "tag:yaml.org,2002:int":
            raise self.fail(node, fld, f"found {self._describe(node)}, expected a whole number ≥ {minimum}")
        value = int(yaml.load(node.value, Loader=FastLoader))
        if value < minimum:
            raise self.fail(node, fld, f"found {value}, expected a whole number ≥ {minimum}")
        return value

    def ratio(self, node: Node, fld: str) -> float:
        if not isinstance(node, ScalarNode) or node.tag not in ("tag:yaml.org,2002:float", "tag:yaml.org,2002:int"):
            raise self.fail(node, fld, f"found {self._describe(node)}, expected a number between 0 and 1")
        value = float(yaml.load(node.value, Loader=FastLoader))
        if not 0 < value <= 1:
            raise self.fail(node, fld, f"found {value}, expected a number between 0 (excluded) and 1")
        return value

    def optional(self, keys: Keys, key: str, default: _D, read: Callable[[Node, str], _T]) -> _T | _D:
        """``read(value node, key)`` when ``key`` is given, else ``default``."""
        return read(keys[key][1], key) if key in keys else default

    def one_of(self, node: Node, fld: str, value: str, allowed: tuple[str, ...]) -> None:
        """A name that must be one of ``allowed`` (movement names, or special next steps too)."""
        if value not in allowed:
            raise self.fail(node, fld, f"unknown movement {value!r}; allowed: {', '.join(allowed) or 'none'}")

    def sequence(self, node: Node, fld: str) -> list[Node]:
        if not isinstance(node, SequenceNode):
            raise self.fail(node, fld, f"found {self._describe(node)}, expected a list")
        return list(node.value)

    def inside(self, node: Node, fld: str, rel: str) -> Path:
        """``rel`` resolved inside the piece's folder (the current folder for YAML text): a shared piece must
        not send a host file to the model, by an absolute path, a ``..`` or a link leading out."""
        base = (self.base or Path.cwd()).resolve()
        where = ("the current folder" if self.base is None else "the piece's folder") + f" ({str(base)!r})"
        if os.path.isabs(rel):
            raise self.fail(node, fld, f"found {short(rel)}, an absolute path; allowed: a path relative to {where}")
        try:
            path = (base / rel).resolve()
        except (OSError, RuntimeError) as exc:  # a link loop (RuntimeError before Python 3.13)
            raise self.fail(node, fld, f"cannot read {short(rel)}: {exc}") from None
        if path != base and base not in path.parents:
            how = "a '..' that leads" if Path(os.path.normpath(rel)).parts[:1] == ("..",) else "a link that leads"
            raise self.fail(node, fld, f"found {short(rel)}, {how} out of {where}; allowed: a file inside it")
        return path

    def text_or_file(self, keys: Keys, fld: str, name: str, *, required: bool, owner: Node) -> str:
        file_key = f"{name}_file"
        if name in keys and file_key in keys:
            raise self.fail(keys[file_key][0], f"{fld}.{file_key}", f"give either {name} or {file_key}, not both")
        if name in keys:
            return self.string(keys[name][1], f"{fld}.{name}", nonempty=required)
        if file_key in keys:
            node = keys[file_key][1]
            path = self.inside(node, f"{fld}.{file_key}", self.string(node, f"{fld}.{file_key}"))
            try:
                return path.read_text(encoding="utf-8")
            except OSError as exc:
                raise self.fail(node, f"{fld}.{file_key}", f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
            except UnicodeDecodeError as exc:
                raise self.fail(node, f"{fld}.{file_key}", f"found {str(path)!r}, which is not UTF-8 text "
                                f"(byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); allowed: a UTF-8 file") from None
        if required:
            raise self.fail(owner, f"{fld}.{name}", f"missing required key {name!r} (or {file_key!r}); "
                            f"found keys: {keys_found(keys)}")
        return ""
