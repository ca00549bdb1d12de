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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import nbformat
from nbformat import v4

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
    ToolCallEvent,
    ToolResult,
    Transition,
)
from ..store import display_url
from .icons import COMMENT
from .render import STYLE, JobStats, fork_lines, job_stats, movement_html, timeline
from .source import JobRecord, JobSource

if TYPE_CHECKING:
    from .frames import Frames

__all__ = ["COLLAPSED", "EXPORT_MAX_CHARS", "TRANSCRIPT_TAG", "NotebookSource", "build_notebook", "export_notebook",
           "movement_text"]

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
    target = Path(path).expanduser()
    if target.is_dir():
        target = target / f"job-{job_id}.ipynb"
    if target.suffix != ".ipynb":
        raise UsageError(f"export path {str(path)!r} must end in .ipynb (or be an existing directory)")
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
    cells = [v4.new_markdown_cell(_title(ws, job, job_stats(ws, job.id), fork_lines(job, events)))]
    if plot and any(isinstance(e, LLMResponse) for e in events):
        cells += _usage_cells(ws, job.id)

    items, by_seq = timeline(events)  # the job view's own ordering, so the transcript reads the same
    for item in items:
        if isinstance(item, int):
            evs = by_seq[item]
            # JupyterLab labels a collapsed output with the first line of its HTML: make that line a caption
            markup = (f"{_caption(item, evs)}\n{STYLE}\n"
                      + movement_html(ws, job.id, item, max_chars=max_chars, max_calls=None, open=True))
            cells.append(v4.new_markdown_cell(_heading(item, evs)))
            cells.append(_transcript_cell(ws, job.id, item, markup, movement_text(evs, max_chars=max_chars)))
        elif isinstance(item, ErrorEvent):
            cells.append(v4.new_markdown_cell(f"**✖ error ({_md(item.where)}):** {_md(item.message)}"))
        else:
            cells.append(v4.new_markdown_cell(f"> **{COMMENT} {_md(item.author)}:** {_md(item.body)}"))
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


def _run_facts(seq: int, evs: Sequence[Event]) -> tuple[str, str, Transition | None]:
    """``("2. write → COMPLETE (forced)", "2 LLM calls · 18,720 tokens · …", transition)`` of a movement run.

    A run with no transition is ``"1. work ✖ failed"`` when an error ended it, else ``"(not finished)"``.
    """
    start = next((e for e in evs if isinstance(e, MovementStart)), None)
    name = start.movement if start is not None else "?"
    tr = next((e for e in reversed(evs) if isinstance(e, Transition)), None)
    calls = [e for e in evs if isinstance(e, LLMResponse)]
    tokens = sum(e.usage.total_tokens for e in calls)
    title = f"{seq}. {name}"
    if start is not None and start.replayed_from is not None:
        title += " (re-served)"
    if tr is not None:
        title += f" → {tr.next_step}" + (" (forced)" if tr.forced else "")
    elif any(isinstance(e, ErrorEvent) and e.where != "compaction" for e in evs):  # a failed compaction is no failure
        title += " ✖ failed"
    else:
        title += " (not finished)"
    actions = [e.action for e in evs if isinstance(e, ContextAction)]
    compactions = sum(isinstance(e, Compaction) for e in evs)
    line = (f"{len(calls)} LLM call{'' if len(calls) == 1 else 's'} · {tokens:,} tokens"
            + (f" · context actions: {', '.join(actions)}" if actions else "")
            + (f" · compacted {compactions}×" if compactions else ""))
    return title, line, tr


def _heading(seq: int, evs: Sequence[Event]) -> str:
    title, line, tr = _run_facts(seq, evs)
    summary = f"\n\n{_md(tr.summary)}" if tr is not None and tr.summary else ""
    return f"## {_md(title)}\n\n*{line}*{summary}"


def _caption(seq: int, evs: Sequence[Event]) -> str:
    title, line, _ = _run_facts(seq, evs)
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
    """A movement run as plain text: prompts, each call's message, tools and results, actions, transition."""
    out: list[str] = []

    def body(text: Any, indent: str = "    ") -> None:
        s = "" if text is None else str(text)
        if max_chars is not None and len(s) > max_chars:
            s = s[:max_chars] + f"\n… [{len(s):,} chars; first {max_chars:,} shown]"
        out.extend(indent + line for line in (s.splitlines() or [""]))

    compactions = 0
    for ev in evs:
        match ev:
            case MovementStart():
                out.append(f"=== movement run {ev.seq}: {ev.movement}"
                           + (f" (re-served from job {ev.replayed_from})" if ev.replayed_from is not None else "") + " ===")
                out.append("[system]")
                body(ev.system)
                out.append("[user]")
                body(ev.user)
            case LLMResponse(usage=u) if ev.purpose == "compaction":
                # a compaction's summarisation call (docs/context.md#compaction): its summary is in the compaction line below
                out.append(f"--- summarisation call {ev.iteration} (compaction, no tools): {u.prompt_tokens:,} prompt + "
                           f"{u.completion_tokens:,} completion tokens"
                           + (f", re-served from job {ev.replayed_from}" if ev.replayed_from is not None else ""))
            case Compaction():
                compactions += 1
                out.append(f"⇊ compaction {compactions}: {ev.removed_messages:,} message"
                           f"{'' if ev.removed_messages == 1 else 's'} summarised, {ev.kept_messages:,} kept, "
                           f"{ev.tokens_before:,} → {ev.tokens_after:,} tokens")
                out.append("  summary:")
                body(ev.summary)
            case ErrorEvent() if ev.where == "compaction":
                out.append(f"⚠ compaction failed — {ev.message}")
            case LLMResponse(usage=u):
                out.append(f"--- call {ev.iteration}: {u.prompt_tokens:,} prompt + {u.completion_tokens:,} completion "
                           f"tokens, context {float(u.ratio or 0):.1%} of {int(u.window or 0):,} ({u.source})"
                           + (f", re-served from job {ev.replayed_from}" if ev.replayed_from is not None else ""))
                if ev.content:
                    out.append("[assistant]")
                    body(ev.content)
            case ContextAction():
                out.append(f"!! context {ev.action}: {float(ev.ratio):.1%} ≥ {float(ev.threshold or 0):.0%} "
                           f"({int(ev.tokens):,} / {int(ev.window):,} tokens)")
            case ToolCallEvent():
                args = ev.arguments if isinstance(ev.arguments, str) else json.dumps(ev.arguments, ensure_ascii=False)
                out.append(f"> {ev.tool} {args if max_chars is None or len(args) <= 500 else args[:500] + '…'}")
            case ToolResult():
                flags = [w for w, on in (("error", ev.is_error), ("truncated", ev.truncated)) if on]
                size = f"{ev.returned_chars:,} of {ev.original_chars:,} chars" if ev.truncated else ""
                out.append(f"< {ev.tool}" + (f" [{', '.join(flags)}]" if flags else "") + (f" {size}" if size else ""))
                body(ev.content)
            case Reminder():
                out.append(f"[reminder: {ev.reason}]")
                body(ev.text)
            case Transition():
                out.append(f"==> {ev.next_step}" + (f" (forced: {ev.reason})" if ev.forced else ""))
                for key, value in (("summary", ev.summary), ("lessons", ev.lessons), ("question", ev.question),
                                   ("feedback", ev.feedback)):
                    if value:
                        out.append(f"  {key}:")
                        body(value)
                if ev.subtasks:
                    out.append("  subtasks:")
                    for t in ev.subtasks:
                        body(f"job {t.job_id}: {t.instruction}" + (f" ({t.piece})" if t.piece else ""), "    - ")
            case ErrorEvent():
                out.append(f"✖ error ({ev.where}): {ev.message}")
            case LoopDetected():
                out.append(f"⟳ loop {' → '.join(ev.cycle)} ×{ev.count} (monitor {ev.monitor}, runs "
                           f"{', '.join(map(str, ev.runs))}): then {ev.judge if ev.judge is not None else ev.next}")
            case ReplayDivergence():
                out.append(f"⚠ divergence: the re-run of {ev.tool} (call {ev.call_id}) gave another result than the original's")
                out.append("  expected:")
                body(ev.expected)
                out.append("  actual:")
                body(ev.actual)
    return "\n".join(out)


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
