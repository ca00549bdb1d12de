"""The engine's place in the layers, read from its source (every import counts: TYPE_CHECKING ones and
those inside functions too).

The engine (agentnb/engine/) builds typed events and asks the store for everything it keeps: it never
imports the facade, the queue worker, the views, the notebook layer or the CLI, never holds SQL or a
connection, and never hands the store a payload dict.  worker.py drives the facade without importing it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import agentnb

PACKAGE = Path(agentnb.__file__).parent
ENGINE = sorted((PACKAGE / "engine").glob("*.py"))
FORBIDDEN_FOR_ENGINE = ("agentnb.workspace", "agentnb.worker", "agentnb.views", "agentnb.notebook", "agentnb.cli",
                        "agentnb.export", "sqlite3")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(absolute module, names imported from it, line) for every import statement in ``path``."""
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names = [alias.name for alias in node.names]
            found.append((module, names, node.lineno))
            # `from . import x` imports the module agentnb.engine.x
            found += [(f"{module}.{n}", [], node.lineno) for n in names if not node.module]
    return found


@pytest.mark.parametrize("path", ENGINE, ids=lambda p: p.name)
def test_the_engine_imports_no_layer_above_it(path: Path) -> None:
    bad = [(module, line) for module, _, line in _imports(path)
           if any(module == f or module.startswith(f + ".") for f in FORBIDDEN_FOR_ENGINE)]
    assert bad == [], f"{path.name} imports {bad}"


def test_the_worker_does_not_import_the_facade_that_imports_it() -> None:
    modules = [module for module, _, _ in _imports(PACKAGE / "worker.py")]
    assert not [m for m in modules if m.startswith(("agentnb.workspace", "agentnb.notebook", "agentnb.cli"))]


@pytest.mark.parametrize("path", [*ENGINE, PACKAGE / "worker.py"], ids=lambda p: p.name)
def test_no_private_name_of_another_module_is_imported(path: Path) -> None:
    bad = [(module, name) for module, names, _ in _imports(path) for name in names
           if name.startswith("_") and not name.startswith("__")]
    assert bad == [], f"{path.name} imports private names {bad}"


@pytest.mark.parametrize("path", [*ENGINE, PACKAGE / "worker.py"], ids=lambda p: p.name)
def test_the_engine_runs_no_sql_and_writes_no_payload_dict(path: Path) -> None:
    problems = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        attr, args = node.func.attr, node.args
        if attr in ("execute", "executemany", "executescript"):
            problems.append(f"line {node.lineno}: .{attr}()")
        # the old shapes: rec.add("kind", {...}) and store.append([(job_id, seq, it, ts, "kind", {...})])
        if attr == "add" and args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
            problems.append(f"line {node.lineno}: .add({args[0].value!r}, …)")
        if attr == "append" and args and isinstance(args[0], ast.List) and any(
                isinstance(e, ast.Tuple) and any(isinstance(x, ast.Dict) for x in e.elts) for e in args[0].elts):
            problems.append(f"line {node.lineno}: .append([(…, {{…}})])")
    assert problems == [], f"{path.name}: {problems}"


def test_the_checks_above_see_the_shapes_they_refuse(tmp_path: Path) -> None:
    """The scan itself: each refused shape, written into a module, is found."""
    sample = tmp_path / "agentnb" / "engine" / "sample.py"
    sample.parent.mkdir(parents=True)
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..workspace import Workspace\n"
        "def f(rec, store, c):\n"
        "    from ..views import render\n"
        "    from .loop import _Unfinished\n"
        "    rec.add('error', {'message': 'x'})\n"
        "    store.append([(1, None, None, 0.0, 'error', {'message': 'x'})], c)\n"
        "    c.execute('SELECT 1')\n",
        encoding="utf-8",
    )
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "agentnb"
    try:
        modules = [m for m, _, _ in _imports(sample)]
        assert "agentnb.workspace" in modules and "agentnb.views" in modules
        with pytest.raises(AssertionError, match="_Unfinished"):
            test_no_private_name_of_another_module_is_imported(sample)
        with pytest.raises(AssertionError) as refused:
            test_the_engine_runs_no_sql_and_writes_no_payload_dict(sample)
        assert ".execute()" in str(refused.value) and ".add('error'" in str(refused.value)
        assert ".append([(" in str(refused.value)
    finally:
        PACKAGE = saved
