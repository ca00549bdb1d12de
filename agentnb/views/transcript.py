"""A job as a notebook transcript: ``ws.export_notebook(job, path)`` (also ``agentnb export``, ``%agent export``).

This module builds the file from a :class:`~agentnb.views.source.JobSource`; :mod:`agentnb.export` is the
public face (it re-exports these names and holds :func:`agentnb.export.transcript`, which the exported cells
run and which opens a Workspace by its path: kept out of here, so the facade can import this module).

The file is an nbformat v4 notebook that reads without a kernel:

1. a markdown title cell with the job's header (piece, model, status, movements,
   calls, tokens, times, instruction, error);
2. when the job made LLM calls, a "Usage" heading and a cell whose output is the
   :func:`agentnb.plot_usage` timeline as PNG;
3. for each movement run, a markdown heading (``## 2. implement → verify``) and a code
   cell whose outputs hold that run's prompts, messages, tool calls and results, and
   ContextManager actions — ``text/html`` from :func:`agentnb.render.movement_html`
   plus a ``text/plain`` transcript for viewers without HTML;
4. job-level comments (the user's replies, the agent's questions) and errors between
   the movement runs, in the order they happened.

Transcript cells open collapsed: ``metadata.jupyter.outputs_hidden`` (JupyterLab, Notebook 7)
and ``metadata.collapsed`` (classic Notebook).  JupyterLab then shows the cell's one line of
source and, in place of the output, its first line — a caption naming the run — which opens the
transcript with one click.  (The source is left visible on purpose: when a cell's source *and*
outputs are both hidden, JupyterLab hides the output's placeholder too, so the caption would not
show and opening the transcript would take two clicks, the first one only revealing code.)
The source, :func:`agentnb.export.transcript`, re-renders the run from the store when re-executed.

No secret reaches the file: the store holds none (store/_rows.py scrubs every text on its way in), and
every string of the notebook passes ``_secrets.scrub`` once more, which does not depend on the exporting
shell: anything shaped like a key (``sk-…``, a ``Bearer`` token) is masked, as are the keys registered in
this process and the values of its environment variables whose names are a secret's
(``_secrets.SECRET_NAME``: ``*KEY*``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ``*CREDENTIAL*``, …)
and the password of a URL in it (``DATABASE_URL``): the same secrets the tool results are cleared of.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import nbformat
from nbformat import v4

from .._fs import file_in_the_way
from .._secrets import scrub
from ..errors import UsageError
from ..events import (
    Compaction,
    ContextAction,
    ErrorEvent,
    Event,
    LLMResponse,
    LoopDetected,
    MovementStart,
    Reminder,
    ReplayDivergence,
    Transition,
)
from ..store import display_url
from ._job_stats import stats_from_timeline
from .icons import COMMENT
from .render import STYLE, JobStats, fork_lines, run_html
from .source import JobRecord, JobSource
from .timeline import MovementRun, Note, ToolUse, fold

if TYPE_CHECKING:
    from .frames import Frames

__all__ = ["COLLAPSED", "EXPORT_MAX_CHARS", "TRANSCRIPT_TAG", "NotebookSource", "build_notebook", "export_notebook",
           "movement_text", "run_text"]

# The metadata that makes a cell's output open collapsed in JupyterLab (jupyter.*) and classic Notebook
# (collapsed).  Not source_hidden: see the module docstring.
COLLAPSED: dict[str, Any] = {"collapsed": True, "jupyter": {"outputs_hidden": True}}
TRANSCRIPT_TAG = "agentnb-transcript"
# Bodies in an exported transcript are cut longer than in the live view: it is the record, but a
# single 1 MB tool result must still not make the file unopenable.
EXPORT_MAX_CHARS = 20_000


class NotebookSource(JobSource, Protocol):
    """A workspace as the export reads it: its jobs, their events, its folder and its frames (for the plot)."""

    @property
    def root(self) -> Path: ...

    @property
    def store_url(self) -> str | None:
        """The store URL the workspace was opened with (None: its folder's agentnb.sqlite)."""
        ...

    @property
    def frames(self) -> Frames: ...


def _open_args(ws: NotebookSource) -> str:
    """The arguments that open ``ws`` again in an exported cell: its folder, and its store URL without the
    password (psycopg finds that in ``PGPASSWORD`` or ``~/.pgpass``, or ``transcript`` in ``AGENTNB_STORE``)."""
    folder = repr(str(ws.root))
    return folder if ws.store_url is None else f"{folder}, store={display_url(ws.store_url)!r}"


def export_notebook(
    ws: NotebookSource, job_id: int, path: str | os.PathLike[str], *, full: bool = False, plot: bool = True
) -> Path:
    """Write job ``job_id`` as a notebook to ``path`` (a directory gets ``job-<id>.ipynb``); return the file.

    ``full=True`` keeps every body whole (by default each is cut at 20,000 characters, with its size shown);
    ``plot=False`` leaves out the usage timeline.
    """
    if not str(os.fspath(path)).strip():
        raise UsageError("the export path is empty; give a file ending in .ipynb (or an existing directory)")
    target = Path(path).expanduser()
    if target.is_dir():
        target = target / f"job-{job_id}.ipynb"
    if target.suffix != ".ipynb":
        raise UsageError(f"export path {str(path)!r} must end in .ipynb (or be an existing directory)")
    blocking = file_in_the_way(target)
    if blocking is not None:
        raise UsageError(f"export path {str(path)!r}: {blocking} is a file, not a folder")
    nb = build_notebook(ws, job_id, full=full, plot=plot)
    _mask_secrets(nb)
    nbformat.validate(nb)
    text = _relative_paths(nbformat.writes(nb, version=4), ws.root, target.resolve().parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, target)  # a reader never sees half a notebook
    return target.resolve()


def build_notebook(ws: NotebookSource, job_id: int, *, full: bool = False, plot: bool = True) -> nbformat.NotebookNode:
    """The transcript notebook of a job, in memory (see the module docstring for its cells)."""
    job = ws.job(job_id)
    events = ws.events(job.id)
    max_chars = None if full else EXPORT_MAX_CHARS
    nb = v4.new_notebook()
    nb.metadata.update({
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "agentnb": {"job": job.id, "piece": job.piece, "model": job.model, "status": str(job.status),
                    "exported": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
    })
    tl = fold(events)
    row = job.snapshot()
    cells = [v4.new_markdown_cell(_title(ws, job, stats_from_timeline(row, tl), fork_lines(job, tl)))]
    if plot and tl.totals.calls:
        cells += _usage_cells(ws, job.id)
    latest = tl.totals.latest
    for entry in tl.entries:  # the job view's own ordering, so the transcript reads the same
        if isinstance(entry, MovementRun):
            cells += _run_cells(ws, row, entry, latest[1] if latest and latest[0] == entry.seq else None, max_chars)
        elif isinstance(entry, ErrorEvent):
            cells.append(v4.new_markdown_cell(f"**✖ error ({_md(entry.where)}):** {_md(entry.message)}"))
        elif isinstance(entry, Note):
            cells.append(v4.new_markdown_cell(f"**{_md(entry.label)}:**  \n" + _md(entry.text).replace("\n", "  \n")))
        else:
            cells.append(v4.new_markdown_cell(f"> **{COMMENT} {_md(entry.author)}:** {_md(entry.body)}"))
    nb.cells = cells
    return nb


# -- cells ------------------------------------------------------------------------


def _title(ws: NotebookSource, job: JobRecord, st: JobStats, fork: Sequence[str] = ()) -> str:
    first = job.instruction.strip().splitlines()[0] if job.instruction.strip() else "(no instruction)"
    if len(first) > 100:
        first = first[:99] + "…"
    rows = [
        ("piece", f"`{job.piece}`"), ("model", f"`{job.model}`"), ("status", f"**{job.status}**"),
        ("movements run", str(st.movements)), ("LLM calls", str(st.calls)), ("tool calls", str(st.tool_calls)),
        ("tokens", f"{st.total_tokens:,} ({st.prompt_tokens:,} prompt + {st.completion_tokens:,} completion)"),
        ("created", _when(job.created)), ("ended", _when(job.ended)),
    ]
    if job.parent_id:
        rows.append(("parent job", str(job.parent_id)))
    rows.extend(("fork" if line.startswith("forked") else "re-served", _md(line)) for line in fork)
    lines = [f"# Job {job.id}: {_md(first)}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines += ["", "**Instruction**", "", *[f"> {_md(line)}" for line in job.instruction.splitlines()]]
    if job.error:
        lines += ["", f"**Error:** {_md(job.error)}"]
    lines += ["", f"*Exported by agentnb from `{_md(str(ws.root))}`. Each movement below is a collapsed "
                  "cell: expand its output to read the run.*"]
    return "\n".join(lines)


def _run_cells(ws: NotebookSource, job: JobRecord, run: MovementRun, latest: int | None,
               max_chars: int | None) -> list[nbformat.NotebookNode]:
    """A movement run's heading and its collapsed transcript cell."""
    # JupyterLab labels a collapsed output with the first line of its HTML: make that line a caption
    markup = (f"{_caption(run)}\n{STYLE}\n"
              + run_html(job, run, latest=latest, max_chars=max_chars, max_calls=None, open=True))
    return [v4.new_markdown_cell(_heading(run)),
            _transcript_cell(ws, job.id, run.seq, markup, "\n".join(run_text(run, max_chars=max_chars)))]


def _run_facts(run: MovementRun) -> tuple[str, str]:
    """``("2. write → COMPLETE (forced)", "2 LLM calls · 18,720 tokens · …")`` of a movement run.

    A run with no transition is ``"1. work ✖ failed"`` when an error ended it, else ``"(not finished)"``.
    """
    tr = run.transition
    title = f"{run.seq}. {run.name}" + (" (re-served)" if run.replayed_from is not None else "")
    if tr is not None:
        title += f" → {tr.next_step}" + (" (forced)" if tr.forced else "")
    else:  # a failed compaction is no failure
        title += " ✖ failed" if run.errors else " (not finished)"
    actions = [e.action for e in run.actions]
    n = run.llm_calls
    line = (f"{n} LLM call{'' if n == 1 else 's'} · {run.tokens:,} tokens"
            + (f" · context actions: {', '.join(actions)}" if actions else "")
            + (f" · compacted {len(run.compactions)}×" if run.compactions else ""))
    return title, line


def _heading(run: MovementRun) -> str:
    title, line = _run_facts(run)
    tr = run.transition
    summary = f"\n\n{_md(tr.summary)}" if tr is not None and tr.summary else ""
    return f"## {_md(title)}\n\n*{line}*{summary}"


def _caption(run: MovementRun) -> str:
    title, line = _run_facts(run)
    # plain text, no tags: JupyterLab shows this line verbatim on the collapsed output
    return html.escape(f"Movement run {title} · {line}")


def _transcript_cell(ws: NotebookSource, job_id: int, seq: int, markup: str, text: str) -> nbformat.NotebookNode:
    # one line: it stays in view above the collapsed output (re-running it renders the run again)
    source = f"from agentnb.export import transcript; transcript({_open_args(ws)}, job={job_id}, seq={seq})"
    cell = v4.new_code_cell(source=source)
    cell.outputs = [v4.new_output("display_data", data={"text/html": markup, "text/plain": text})]
    cell.metadata.update(json.loads(json.dumps(COLLAPSED)))
    cell.metadata["tags"] = [TRANSCRIPT_TAG]
    return cell


def _usage_cells(ws: NotebookSource, job_id: int) -> list[nbformat.NotebookNode]:
    from .plots import figure_png, plot_usage  # matplotlib, only when the job made calls

    # Twice the pixels, shown at the figure's own size (10 in at 100 px per inch, 1000 px wide): at 80 dpi
    # and no size given, the labels were 7 px high.  PNG rather than SVG: JupyterLab does not show an SVG
    # output of an untrusted notebook, and an exported transcript opens untrusted.
    png, size = figure_png(plot_usage(job_id, ws=ws), scale=2.0)
    cell = v4.new_code_cell(source=f"import agentnb\nagentnb.plot_usage(agentnb.Workspace({_open_args(ws)}).job({job_id}))")
    cell.outputs = [v4.new_output("display_data", data={
        "image/png": base64.b64encode(png).decode("ascii"), "text/plain": f"<usage timeline of job {job_id}>"},
        metadata={"image/png": size})]
    cell.metadata.update({"jupyter": {"source_hidden": True}})
    return [v4.new_markdown_cell("## Usage\n\nContext ratio per LLM call (the legend names each line and marker) "
                                 "and cumulative tokens."), cell]


# -- plain text -------------------------------------------------------------------


def movement_text(evs: Sequence[Event], *, max_chars: int | None = EXPORT_MAX_CHARS) -> str:
    """A movement run as plain text: prompts, each call's message, tools and results, actions, transition
    (``evs``: the run's events; any other events fold the same way, each run in turn)."""
    out: list[str] = []
    for entry in fold(evs).entries:
        if isinstance(entry, MovementRun):
            out.extend(run_text(entry, max_chars=max_chars))
        elif isinstance(entry, ErrorEvent):
            out.extend(_RunText(max_chars).error(entry))
        elif isinstance(entry, Note):
            out.extend(_RunText(max_chars).note(entry))
    return "\n".join(out)


def run_text(run: MovementRun, *, max_chars: int | None = EXPORT_MAX_CHARS) -> list[str]:
    """The lines of :func:`movement_text` for a folded run."""
    text = _RunText(max_chars)
    out = text.start(run.start) if run.start is not None else []
    for call in run.calls:
        for item in call.items:
            show = _TEXT.get(type(item))
            if show is not None:
                out.extend(show(text, item))
    return out


class _RunText:
    """The text of each item of a run's calls (kinds not in :data:`_TEXT` have none)."""

    def __init__(self, max_chars: int | None) -> None:
        self.max_chars = max_chars
        self.compactions = 0

    def body(self, text: Any, indent: str = "    ") -> list[str]:
        s = "" if text is None else str(text)
        if self.max_chars is not None and len(s) > self.max_chars:
            s = s[:self.max_chars] + f"\n… [{len(s):,} chars; first {self.max_chars:,} shown]"
        return [indent + line for line in (s.splitlines() or [""])]

    def start(self, ev: MovementStart) -> list[str]:
        return [f"=== movement run {ev.seq}: {ev.movement}"
                + (f" (re-served from job {ev.replayed_from})" if ev.replayed_from is not None else "") + " ===",
                "[system]", *self.body(ev.system), "[user]", *self.body(ev.user)]

    def response(self, ev: LLMResponse) -> list[str]:
        u = ev.usage
        served = f", re-served from job {ev.replayed_from}" if ev.replayed_from is not None else ""
        if ev.purpose == "compaction":
            # a compaction's summarisation call (docs/context.md#compaction): its summary is in the compaction line below
            return [f"--- summarisation call {ev.iteration} (compaction, no tools): {u.prompt_tokens:,} prompt + "
                    f"{u.completion_tokens:,} completion tokens" + served]
        out = [f"--- call {ev.iteration}: {u.prompt_tokens:,} prompt + {u.completion_tokens:,} completion "
               f"tokens, context {float(u.ratio or 0):.1%} of {int(u.window or 0):,} ({u.source})" + served]
        return out + (["[assistant]", *self.body(ev.content)] if ev.content else [])

    def compaction(self, ev: Compaction) -> list[str]:
        self.compactions += 1
        return [f"⇊ compaction {self.compactions}: {ev.removed_messages:,} message"
                f"{'' if ev.removed_messages == 1 else 's'} summarised, {ev.kept_messages:,} kept, "
                f"{ev.tokens_before:,} → {ev.tokens_after:,} tokens", "  summary:", *self.body(ev.summary)]

    def error(self, ev: ErrorEvent) -> list[str]:
        if ev.where == "compaction":
            return [f"⚠ compaction failed — {ev.message}"]
        return [f"✖ error ({ev.where}): {ev.message}"]

    def action(self, ev: ContextAction) -> list[str]:
        return [f"!! context {ev.action}: {float(ev.ratio):.1%} ≥ {float(ev.threshold or 0):.0%} "
                f"({int(ev.tokens):,} / {int(ev.window):,} tokens)"]

    def tool(self, use: ToolUse) -> list[str]:
        out: list[str] = []
        if use.call is not None:
            args = use.call.arguments
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            out.append(f"> {use.label} {args if self.max_chars is None or len(args) <= 500 else args[:500] + '…'}")
        if use.result is not None:
            ev = use.result
            flags = [w for w, on in (("error", ev.is_error), ("truncated", ev.truncated)) if on]
            size = f"{ev.returned_chars:,} of {ev.original_chars:,} chars" if ev.truncated else ""
            out.append(f"< {use.label}" + (f" [{', '.join(flags)}]" if flags else "") + (f" {size}" if size else ""))
            out.extend(self.body(ev.content))
        return out

    def reminder(self, ev: Reminder) -> list[str]:
        return [f"[reminder: {ev.reason}]", *self.body(ev.text)]

    def transition(self, ev: Transition) -> list[str]:
        out = [f"==> {ev.next_step}" + (f" (forced: {ev.reason})" if ev.forced else "")]
        for key, value in (("summary", ev.summary), ("lessons", ev.lessons), ("question", ev.question),
                           ("feedback", ev.feedback)):
            if value:
                out += [f"  {key}:", *self.body(value)]
        if ev.subtasks:
            out.append("  subtasks:")
            for t in ev.subtasks:
                out += self.body(f"job {t.job_id}: {t.instruction}" + (f" ({t.piece})" if t.piece else ""), "    - ")
        return out

    def loop(self, ev: LoopDetected) -> list[str]:
        return [f"⟳ loop {' → '.join(ev.cycle)} ×{ev.count} (monitor {ev.monitor}, runs "
                f"{', '.join(map(str, ev.runs))}): then {ev.judge if ev.judge is not None else ev.next}"]

    def note(self, item: Note) -> list[str]:
        # an event of a kind no view knows (views/timeline.py): its kind, then its payload fields
        return [f"[{item.label}]", *self.body(item.text)]

    def divergence(self, ev: ReplayDivergence) -> list[str]:
        return [f"⚠ divergence: the re-run of {ev.tool} (call {ev.call_id}) gave another result than the original's",
                "  expected:", *self.body(ev.expected), "  actual:", *self.body(ev.actual)]


_TEXT: dict[type, Callable[[_RunText, Any], list[str]]] = {
    LLMResponse: _RunText.response, Compaction: _RunText.compaction, ErrorEvent: _RunText.error,
    ContextAction: _RunText.action, ToolUse: _RunText.tool, Reminder: _RunText.reminder,
    Transition: _RunText.transition, LoopDetected: _RunText.loop, ReplayDivergence: _RunText.divergence,
    Note: _RunText.note,
}


# -- helpers -----------------------------------------------------------------------


def _when(ts: float | None) -> str:
    return "–" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _md(text: Any) -> str:
    """Text from the model or the user, safe inside markdown: no raw HTML, no table breaks."""
    s = "" if text is None else str(text)
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def _relative_paths(text: str, root: Path, notebook_dir: Path) -> str:
    """No local absolute path in the file (``text`` is the notebook's JSON).

    A path inside the workspace is written relative to it (``jobs/3/output/a.md``); the workspace itself
    and other paths near the notebook relative to the notebook's folder (``'../agentnb-data'`` in the
    code cells, which Jupyter runs from there); anything else in the home folder starts with ``~``.
    """
    def rel(path: Path) -> str | None:
        try:
            return os.path.relpath(path, notebook_dir)
        except ValueError:  # another drive (Windows): no relative path exists
            return None

    # deepest first; never a folder just below / (that would rewrite /tmp or /home in every path)
    near = [p for p in (notebook_dir, *notebook_dir.parents) if len(p.parts) > 2]
    pairs: list[tuple[str, str]] = []
    if rel(root) is not None:
        pairs += [(repr(str(root)), repr(rel(root))), (str(root) + os.sep, ""), (str(root), str(rel(root)))]
    pairs += [(str(p) + os.sep, str(rel(p)) + os.sep) for p in near if rel(p) is not None]
    home = Path.home()
    if len(home.parts) > 1:
        pairs.append((str(home) + os.sep, "~" + os.sep))
    for old, new in pairs:
        # only where a path starts: not inside a longer one (/var/tmp/x is not /tmp/x)
        pattern = r"(?<![\w.\-/~])" + re.escape(json.dumps(old)[1:-1])
        # the replacement as a template whose backslashes (JSON escapes) are meant literally
        text = re.sub(pattern, json.dumps(new)[1:-1].replace("\\", r"\\"), text)
    return text


def _mask_secrets(node: Any) -> None:
    """Every string in the notebook ``node`` scrubbed, in place (so it stays a NotebookNode): each string as it
    is, before JSON escapes it, so a key after a newline is seen as one."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in list(items):
        if isinstance(value, str):
            cleaned = scrub(value)
            if cleaned is not value:
                node[key] = cleaned
        elif isinstance(value, (dict, list)):
            _mask_secrets(value)
