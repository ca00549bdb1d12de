"""The import rules of the layers, and who uses whose private attributes, read from the sources with ``ast``
(nothing is imported).

Every import counts: at the top, inside functions, and under ``if TYPE_CHECKING:``, since a type
checker follows those too and a later refactoring turns them into runtime imports.  The layers:
cli and notebook → workspace → views, engine → models, tools, store → events, errors.  The last test runs the
fold and the views on an event kind made in the test: what a new kind needs besides ``events.py``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

PACKAGE = Path(__file__).resolve().parent.parent / "agentnb"


@dataclass(frozen=True)
class Import:
    """One name an agentnb module imports: the module it comes from (and the name, for ``from M import name``)."""

    importer: str
    line: int
    module: str  # the imported module, resolved to its full dotted name
    name: str | None  # for ``from M import name`` where ``name`` is not itself a module

    def where(self) -> str:
        return f"{_path(self.importer)}:{self.line}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _sources()


def _path(module: str) -> str:
    return str(MODULES[module].relative_to(PACKAGE.parent))


def _resolve(importer: str, level: int, target: str | None) -> str:
    """The absolute module of ``from <level dots><target> import …`` written in ``importer``."""
    if level == 0:
        return target or ""
    is_package = MODULES[importer].name == "__init__.py"
    base = importer.split(".")
    # in a package's __init__, one dot is the package itself; in a module, its parent
    base = base[: len(base) - level + (1 if is_package else 0)]
    return ".".join(base + ([target] if target else []))


def imports(module: str, source: str | None = None) -> Iterator[Import]:
    """Every import statement of ``module`` (its file, or ``source``), anywhere in it."""
    text = MODULES[module].read_text(encoding="utf-8") if source is None else source
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, node.lineno, alias.name, None)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node.level, node.module)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in MODULES:  # `from . import render`: the submodule itself
                    yield Import(module, node.lineno, sub, None)
                else:
                    yield Import(module, node.lineno, source, alias.name)


def _edges() -> dict[str, dict[str, list[Import]]]:
    """importer → imported agentnb module → the import statements."""
    graph: dict[str, dict[str, list[Import]]] = {m: {} for m in MODULES}
    for module in MODULES:
        for imp in imports(module):
            if imp.module in MODULES and imp.module != module:
                graph[module].setdefault(imp.module, []).append(imp)
    return graph


def _cycles(graph: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(graph: dict[str, dict[str, list[Import]]], component: list[str]) -> str:
    members = set(component)
    lines = [f"cycle of {len(component)} modules: {', '.join(component)}"]
    for a in component:
        for b, imps in sorted(graph[a].items()):
            if b in members:
                lines.append(f"  {a} → {b} ({', '.join(dict.fromkeys(i.where() for i in imps))})")
    return "\n".join(lines)


def test_no_import_cycles_between_agentnb_modules() -> None:
    graph = _edges()
    cycles = _cycles(graph)
    assert not cycles, "import cycles (counting TYPE_CHECKING and function-level imports):\n" + "\n".join(
        _describe(graph, c) for c in cycles)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_imports_another_modules_private_names() -> None:
    found = [
        f"{imp.where()}: {imp.importer} imports {imp.name} from {imp.module}"
        for module in MODULES
        for imp in imports(module)
        if imp.name is not None and _is_private(imp.name) and imp.module in MODULES and imp.module != module
    ]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


# Private attributes, not only private imports: ``x._name`` (or ``getattr``/``setattr``/``object.__setattr__`` of
# ``x, "_name"``) where ``x`` is not ``self``/``cls`` and ``_name`` is not a member this module defines itself (a
# Protocol's members do not count: a Protocol describes another module's object).  The IPython display protocol's
# ``_repr_html_``-style names are public by that protocol.  Each allowance names why; a temporary one names who
# removes it.
ALLOWED_PRIVATE_ACCESS: dict[tuple[str, str], str] = {
    ("agentnb._secrets", "_data"): "os.environ's own dict, compared to tell a changed environment in ~0.4 µs a call",
    ("agentnb.tools._grepscan", "_exit"): "os._exit, the documented way for a forked child to end without cleanup",
    ("agentnb.models.openai_stream", "_pool"): "httpx's HTTPTransport has no public hook for its connection pool's "
                                               "network backend: the only way to find the socket of a call waiting "
                                               "for its headers, so a Stop can cut it off (guarded: False if absent)",
    # chunked_body: a streamed answer's body read below httpx (benchmarks/README.md, "Streamed answers"); h11 is
    # then driven through its public API only; guarded: None (read through httpx) where the layout differs
    ("agentnb.models.openai_stream", "_httpcore_stream"): "httpx's response stream to httpcore's: no public path",
    ("agentnb.models.openai_stream", "_connection"): "httpcore's body stream to its HTTP/1.1 connection: no public "
                                                     "path",
    ("agentnb.models.openai_stream", "_h11_state"): "that connection's h11.Connection, told the body's end so the "
                                                    "connection is kept: httpcore gives it no public name",
    ("agentnb.views._otel_encode", "_client"): "OTLPSpanExporter's HTTP client, to post a request built without SDK "
                                               "spans (its export() takes only those); guarded: the SDK's spans to "
                                               "export() where absent",
}

_ATTRIBUTE_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr", "__setattr__", "__getattribute__", "__delattr__"}


@dataclass(frozen=True)
class Access:
    """One use of a private attribute on an object other than ``self``/``cls``."""

    module: str
    line: int
    name: str
    text: str

    def where(self) -> str:
        return f"{_path(self.module)}:{self.line}"


def _is_protocol(node: ast.ClassDef) -> bool:
    return any((isinstance(b, ast.Name) and b.id == "Protocol") or (isinstance(b, ast.Subscript) and isinstance(
        b.value, ast.Name) and b.value.id == "Protocol") for b in node.bases)


def _own_members(tree: ast.Module) -> set[str]:
    """The names a module defines as members of its own objects: its classes' bodies (Protocols excepted), the
    attributes it assigns (``self._x = …``, ``obj._x = …``) and its own top-level names."""
    own: set[str] = set()
    protocols = {id(n) for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and _is_protocol(n)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and id(node) not in protocols:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    own.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    own.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    own.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
    for item in tree.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(item.name)
        elif isinstance(item, ast.Assign):
            own.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            own.add(item.target.id)
    return own


def _on_itself(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _is_private_attribute(name: str) -> bool:
    # ``_repr_html_``, ``_ipython_display_``: IPython's display protocol, public by that protocol
    return _is_private(name) and not (name.endswith("_") and not name.startswith("__"))


def private_accesses(module: str, source: str | None = None) -> Iterator[Access]:
    """Every private attribute of another module's object that ``module`` (its file, or ``source``) uses."""
    text = MODULES[module].read_text(encoding="utf-8") if source is None else source
    tree = ast.parse(text)
    own = _own_members(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            target, name = node.value, node.attr
        elif (isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)
              and ((isinstance(node.func, ast.Name) and node.func.id in _ATTRIBUTE_FUNCTIONS)
                   or (isinstance(node.func, ast.Attribute) and node.func.attr in _ATTRIBUTE_FUNCTIONS))):
            target, name = node.args[0], node.args[1].value
        else:
            continue
        if _is_private_attribute(name) and not _on_itself(target) and name not in own:
            yield Access(module, node.lineno, name, ast.unparse(node))


def test_no_module_uses_another_modules_private_attributes() -> None:
    found = [f"{a.where()}: {a.text}" for module in MODULES for a in private_accesses(module)
             if (a.module, a.name) not in ALLOWED_PRIVATE_ACCESS]
    assert not found, "private attributes of another module's objects used (make them public, or move the code " \
                      "that needs them next to them):\n" + "\n".join(found)
    used = {(a.module, a.name) for module in MODULES for a in private_accesses(module)}
    stale = sorted(set(ALLOWED_PRIVATE_ACCESS) - used)
    assert not stale, f"allowances no longer needed (remove them): {stale}"


def test_the_attribute_check_sees_what_it_must() -> None:
    # the reader itself, on a made-up module: a facade's private method and a setattr of another module's field
    # are found, as is a name only a Protocol declares; self's, a class's own field on another instance and the
    # display protocol are not
    source = """
from typing import Protocol
class Host(Protocol):
    def _run_claimed(self, row: dict) -> None: ...
class Job:
    _row: dict
    def __eq__(self, other):
        return self._row == other._row
def run(ws, job, bar):
    ws._run_claimed({})
    object.__setattr__(job, "_shown_live", True)
    getattr(job, "_secret", None)
    bar._repr_mimebundle_()
    setattr(job, "public", 1)
"""
    found = {(a.name, a.line) for a in private_accesses("agentnb.tools.base", source)}
    assert found == {("_run_claimed", 10), ("_shown_live", 11), ("_secret", 12)}


# Modules stay under about 800 lines (ARCHITECTURE.md): past that, coherent machinery goes into a ``_``-prefixed
# module named after it.  The check allows some slack over the mark, so that a small change near it does not fail.
MAX_MODULE_LINES = 850


def test_no_module_is_far_past_the_800_line_mark() -> None:
    lengths = {module: len(path.read_text(encoding="utf-8").splitlines()) for module, path in MODULES.items()}
    long = [f"{_path(m)}: {n} lines" for m, n in sorted(lengths.items()) if n > MAX_MODULE_LINES]
    assert not long, (f"modules past {MAX_MODULE_LINES} lines (split their machinery into a _-prefixed module "
                      "named after it):\n" + "\n".join(long))
    assert max(lengths.values()) > 100  # the sources were read


def test_only_the_store_imports_sqlite3() -> None:
    found = [
        f"{imp.where()}: {imp.importer} imports {imp.module}"
        for module in MODULES
        if not module.startswith("agentnb.store.")
        for imp in imports(module)
        if imp.module == "sqlite3" or imp.module.startswith("sqlite3.")
    ]
    assert not found, "sqlite3 outside agentnb/store/:\n" + "\n".join(found)


def test_outside_the_store_only_its_interface_is_imported() -> None:
    # the engine, the views, the notebook and the CLI are typed against store.base (the interface), read its
    # records and the reads written once for every backend: a second backend then goes in beside
    # store/sqlite.py without touching them; only the package's open_store picks one
    interface = {"agentnb.store.base", "agentnb.store.reads", "agentnb.store.records"}
    found = [
        f"{imp.where()}: {imp.importer} imports {imp.module}"
        for module in MODULES
        if not module.startswith("agentnb.store")
        for imp in imports(module)
        if imp.module.startswith("agentnb.store.") and imp.module not in interface
    ]
    assert not found, "a store backend imported outside agentnb/store/:\n" + "\n".join(found)


def _in(module: str, *layers: str) -> bool:
    return any(module == layer or module.startswith(layer + ".") for layer in layers)


ABOVE_THE_ENGINE = ("agentnb.workspace", "agentnb.worker", "agentnb.cli", "agentnb.views", "agentnb.notebook")
ABOVE_THE_VIEWS = ("agentnb.workspace", "agentnb.notebook", "agentnb.cli")


def _upward(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    return list(dict.fromkeys(
        f"{imp.where()}: {imp.importer} imports {imp.module}"
        for module in MODULES
        if _in(module, layer)
        for imp in imports(module)
        if _in(imp.module, *forbidden)
    ))


def test_the_engine_never_imports_the_facade_the_worker_the_cli_the_views_or_the_notebook() -> None:
    found = _upward("agentnb.engine", ABOVE_THE_ENGINE)
    assert not found, "the engine imports a layer above it:\n" + "\n".join(found)


def test_the_execution_never_imports_the_facade_the_worker_the_executor_or_the_batches() -> None:
    # agentnb/execution.py runs a job's life for all of them, so it sits below them all
    found = _upward("agentnb.execution", (*ABOVE_THE_ENGINE, "agentnb.executor", "agentnb.batch"))
    assert not found, "the execution imports a layer above it:\n" + "\n".join(found)


def test_the_views_never_import_the_facade_the_notebook_or_the_cli() -> None:
    found = _upward("agentnb.views", ABOVE_THE_VIEWS)
    assert not found, "the views import a layer above them:\n" + "\n".join(found)


def test_the_live_subscription_sits_below_the_store_and_the_engine() -> None:
    # both stores publish to agentnb.live after each commit and the engine its notices, so it imports nothing of
    # agentnb but the events: any other import would pull a layer above them in, or make a cycle
    found = sorted({imp.module for imp in imports("agentnb.live") if imp.module.startswith("agentnb")})
    assert found == ["agentnb.events"], found
    users = {m for m in MODULES for imp in imports(m) if imp.module == "agentnb.live"}
    assert {"agentnb.store._rows", "agentnb.engine.loop", "agentnb.execution", "agentnb.notebook.liveview"} <= users


def test_the_checks_see_the_imports_they_must() -> None:
    # the reader itself, on a made-up tools/base.py: imports under TYPE_CHECKING and inside functions are
    # found, relative ones resolved to modules (a submodule imported by name too), private names kept
    source = """
from typing import TYPE_CHECKING
import sqlite3
from ..errors import ToolError
from . import builtin
if TYPE_CHECKING:
    from ..workspace import Workspace
def f():
    from .truncate import _utf8_cut
"""
    found = {(i.module, i.name) for i in imports("agentnb.tools.base", source)}
    assert found == {("typing", "TYPE_CHECKING"), ("sqlite3", None), ("agentnb.errors", "ToolError"),
                     ("agentnb.tools.builtin", None), ("agentnb.workspace", "Workspace"),
                     ("agentnb.tools.truncate", "_utf8_cut")}
    assert _resolve("agentnb.tools", 1, "base") == "agentnb.tools.base"  # in a package's __init__
    assert _cycles({"a": {"b": []}, "b": {"a": []}, "c": {"a": []}}) == [["a", "b"]]
    assert "agentnb.notebook.magic" in _edges()["agentnb"]  # agentnb/__init__.py imports it inside a function


def test_a_new_event_kind_shows_in_the_views_without_teaching_them(tmp_path: Path) -> None:
    # an event kind none of agentnb's modules knows, made here: the fold hands it to the views as a Note, in its
    # call (or between the runs when it has none), so a kind added to events.py alone shows in the job view,
    # the transcript and, through the job view, the comparison's columns
    from agentnb import Workspace
    from agentnb.events import EventBase
    from agentnb.views.render import timeline_html
    from agentnb.views.timeline import Note, fold
    from agentnb.views.transcript import movement_text

    @dataclass(frozen=True, kw_only=True, slots=True)
    class Checkpoint(EventBase):
        kind: ClassVar[str] = "check_point"  # type: ignore[misc]
        label: str
        files: list[str]

    with Workspace(tmp_path / "ws") as ws:
        job = ws.run(ws.submit("Summarise input/notes.md", piece="plan-implement-verify", model="demo",
                               inputs={"notes.md": "alpha\n"}))
        events = ws.events(job)
        assert not any(isinstance(i, Note) for run in fold(events).runs.values() for c in run.calls for i in c.items)
        first = next(i for i, ev in enumerate(events) if ev.movement_seq == 1 and ev.iteration == 1)
        mid = Checkpoint(job_id=job.id, movement_seq=1, iteration=1, label="<half> way", files=["a.md"])
        late = Checkpoint(job_id=job.id, label="after all", files=[])
        events = [*events[:first + 1], mid, *events[first + 1:], late]
        tl = fold(events)
        call = tl.runs[1].calls[0]
        assert [i for i in call.items if isinstance(i, Note)] == [Note(mid, "check point", 'label: <half> way\nfiles: ["a.md"]')]
        assert tl.entries[-1] == Note(late, "check point", "label: after all\nfiles: []")
        html = timeline_html(ws, job.snapshot(), tl)
        assert html.count("check point") == 2 and "label: &lt;half&gt; way" in html and "<half>" not in html
        assert html.index("label: &lt;half&gt; way") < html.index('data-seq="2"') < html.index("label: after all")
        text = movement_text(events)
        assert "[check point]\n    label: <half> way\n    files: [\"a.md\"]" in text
        assert text.rstrip().endswith("[check point]\n    label: after all\n    files: []")
