"""A job as a notebook transcript: ``ws.export_notebook(job, path)`` (also ``agentnb export``, ``%agent export``).

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
The source, :func:`transcript`, re-renders the run from the store when re-executed.

No secret reaches the file: the store holds none, and the value of any environment
variable whose name is a secret's (``_secrets.SECRET_NAME``: ``*KEY*``, ``*TOKEN*``,
``*SECRET*``, ``*PASSWORD*``, ``*CREDENTIAL*``, …) is masked wherever it appears (an
instruction could quote one), as is the password of a URL in the environment (``DATABASE_URL``):
the same secrets (``_secrets.secret_values``) the tool results are cleared of.
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
from typing import TYPE_CHECKING, Any

import nbformat
from nbformat import v4

from ._secrets import redact, secret_values
from .errors import UsageError
from .events import Event, payload_dict

if TYPE_CHECKING:
    from .workspace import Workspace

__all__ = ["COLLAPSED", "TRANSCRIPT_TAG", "build_notebook", "export_notebook", "movement_text", "transcript"]

# The metadata that makes a cell's output open collapsed in JupyterLab (jupyter.*) and classic Notebook
# (collapsed).  Not source_hidden: see the module docstring.
COLLAPSED: dict[str, Any] = {"collapsed": True, "jupyter": {"outputs_hidden": True}}
TRANSCRIPT_TAG = "agentnb-transcript"
# Bodies in an exported transcript are cut longer than in the live view: it is the record, but a
# single 1 MB tool result must still not make the file unopenable.
EXPORT_MAX_CHARS = 20_000


def export_notebook(
    ws: Workspace, job_id: int, path: str | os.PathLike[str], *, full: bool = False, plot: bool = True
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
    nbformat.validate(nb)
    text = _relative_paths(_mask_secrets(nbformat.writes(nb, version=4)), ws.root, target.resolve().parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, target)  # a reader never sees half a notebook
    return target.resolve()


def build_notebook(ws: Workspace, job_id: int, *, full: bool = False, plot: bool = True) -> nbformat.NotebookNode:
    """The transcript notebook of a job, in memory (see the module docstring for its cells)."""
    from .views.render import STYLE, job_stats, movement_html

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
    cells = [v4.new_markdown_cell(_title(ws, job, job_stats(ws, job.id)))]
    if plot and any(e.kind == "llm_response" for e in events):
        cells += _usage_cells(ws, job.id)

    for kind, item in _timeline(events):
        if kind == "comment":
            who = "🧑 user" if item.author == "user" else f"🤖 {item.author}"
            cells.append(v4.new_markdown_cell(f"> **{who}:** {_md(item.body)}"))
        elif kind == "error":
            cells.append(v4.new_markdown_cell(f"**✖ error ({_md(item.where)}):** {_md(item.message)}"))
        else:
            seq, evs = item
            # JupyterLab labels a collapsed output with the first line of its HTML: make that line a caption
            markup = (f"{_caption(seq, evs)}\n{STYLE}\n"
                    + movement_html(ws, job.id, seq, max_chars=max_chars, max_calls=None, open=True))
            cells.append(v4.new_markdown_cell(_heading(seq, evs)))
            cells.append(_transcript_cell(ws, job.id, seq, markup, movement_text(evs, max_chars=max_chars)))
    nb.cells = cells
    return nb


# -- cells ------------------------------------------------------------------------


def _timeline(events: Sequence[Event]) -> list[tuple[str, Any]]:
    """Movement runs (``("movement", (seq, events))``) and job-level comments/errors, in order."""
    from .views.render import _layout  # the job view's own ordering, so the transcript reads the same

    items, by_seq = _layout(events)
    return [("movement", (item, by_seq[item])) if kind == "mv" else (kind, item) for kind, item in items]


def _title(ws: Workspace, job: Any, st: Any) -> str:
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
    lines = [f"# Job {job.id}: {_md(first)}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines += ["", "**Instruction**", "", *[f"> {_md(line)}" for line in job.instruction.splitlines()]]
    if job.error:
        lines += ["", f"**Error:** {_md(job.error)}"]
    lines += ["", f"*Exported by agentnb from `{_md(str(ws.root))}`. Each movement below is a collapsed "
                  "cell: expand its output to read the run.*"]
    return "\n".join(lines)


def _run_facts(seq: int, evs: Sequence[Event]) -> tuple[str, str, Any]:
    """``("2. write → COMPLETE (forced)", "2 LLM calls · 18,720 tokens · …", transition)`` of a movement run.

    A run with no transition is ``"1. work ✖ failed"`` when an error ended it, else ``"(not finished)"``.
    """
    start = next((e for e in evs if e.kind == "movement_start"), None)
    name = start.movement if start is not None else "?"  # type: ignore[union-attr]
    tr = next((e for e in reversed(evs) if e.kind == "transition"), None)
    calls = [e for e in evs if e.kind == "llm_response"]
    tokens = sum(e.usage.total_tokens for e in calls)  # type: ignore[union-attr]
    title = f"{seq}. {name}"
    if tr is not None:
        title += f" → {tr.next_step}" + (" (forced)" if tr.forced else "")  # type: ignore[union-attr]
    elif any(e.kind == "error" for e in evs):
        title += " ✖ failed"
    else:
        title += " (not finished)"
    actions = [e.action for e in evs if e.kind == "context_action"]  # type: ignore[union-attr]
    line = f"{len(calls)} LLM call{'' if len(calls) == 1 else 's'} · {tokens:,} tokens" + (f" · context actions: {', '.join(actions)}" if actions else "")
    return title, line, tr


def _heading(seq: int, evs: Sequence[Event]) -> str:
    title, line, tr = _run_facts(seq, evs)
    summary = f"\n\n{_md(tr.summary)}" if tr is not None and tr.summary else ""
    return f"## {_md(title)}\n\n*{line}*{summary}"


def _caption(seq: int, evs: Sequence[Event]) -> str:
    title, line, _ = _run_facts(seq, evs)
    # plain text, no tags: JupyterLab shows this line verbatim on the collapsed output
    return html.escape(f"Movement run {title} · {line}")


def _transcript_cell(ws: Workspace, job_id: int, seq: int, markup: str, text: str) -> nbformat.NotebookNode:
    # one line: it stays in view above the collapsed output (re-running it renders the run again)
    source = f"from agentnb.export import transcript; transcript({str(ws.root)!r}, job={job_id}, seq={seq})"
    cell = v4.new_code_cell(source=source)
    cell.outputs = [v4.new_output("display_data", data={"text/html": markup, "text/plain": text})]
    cell.metadata.update(json.loads(json.dumps(COLLAPSED)))
    cell.metadata["tags"] = [TRANSCRIPT_TAG]
    return cell


def transcript(workspace: str | os.PathLike[str] | Workspace, job: int, seq: int) -> Any:
    """Movement run ``seq`` of job ``job`` as HTML for a notebook (what an exported transcript cell runs)."""
    from IPython.display import HTML

    from .views.render import STYLE, movement_html
    from .workspace import Workspace

    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    return HTML(STYLE + movement_html(ws, job, seq, max_calls=None))


def _usage_cells(ws: Workspace, job_id: int) -> list[nbformat.NotebookNode]:
    from .views.plots import figure_png, plot_usage

    # Twice the pixels, shown at the figure's own size (10 in at 100 px per inch, 1000 px wide): at 80 dpi
    # and no size given, the labels were 7 px high.  PNG rather than SVG: JupyterLab does not show an SVG
    # output of an untrusted notebook, and an exported transcript opens untrusted.
    png, size = figure_png(plot_usage(ws.job(job_id)), scale=2.0)
    cell = v4.new_code_cell(source=f"import agentnb\nagentnb.plot_usage(agentnb.Workspace({str(ws.root)!r}).job({job_id}))")
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

    for ev in evs:
        p = payload_dict(ev)
        k = ev.kind
        if k == "movement_start":
            out.append(f"=== movement run {p['seq']}: {p['movement']} ===")
            out.append("[system]")
            body(p["system"])
            out.append("[user]")
            body(p["user"])
        elif k == "llm_response":
            u = p.get("usage") or {}
            out.append(f"--- call {ev.iteration}: {u.get('prompt_tokens', 0):,} prompt + "
                       f"{u.get('completion_tokens', 0):,} completion tokens, context "
                       f"{float(u.get('ratio') or 0):.1%} of {int(u.get('window') or 0):,} ({u.get('source', '?')})")
            if p.get("content"):
                out.append("[assistant]")
                body(p["content"])
        elif k == "context_action":
            out.append(f"!! context {p['action']}: {float(p['ratio']):.1%} ≥ {float(p.get('threshold') or 0):.0%} "
                       f"({int(p['tokens']):,} / {int(p['window']):,} tokens)")
        elif k == "tool_call":
            args = p["arguments"] if isinstance(p["arguments"], str) else json.dumps(p["arguments"], ensure_ascii=False)
            out.append(f"> {p['tool']} {args if max_chars is None or len(args) <= 500 else args[:500] + '…'}")
        elif k == "tool_result":
            flags = [w for w, on in (("error", p.get("is_error")), ("truncated", p.get("truncated"))) if on]
            size = f"{p.get('returned_chars', 0):,} of {p.get('original_chars', 0):,} chars" if p.get("truncated") else ""
            out.append(f"< {p['tool']}" + (f" [{', '.join(flags)}]" if flags else "") + (f" {size}" if size else ""))
            body(p.get("content"))
        elif k == "reminder":
            out.append(f"[reminder: {p.get('reason', '')}]")
            body(p.get("text"))
        elif k == "transition":
            out.append(f"==> {p['next_step']}" + (f" (forced: {p.get('reason')})" if p.get("forced") else ""))
            for key in ("summary", "lessons", "question", "feedback"):
                if p.get(key):
                    out.append(f"  {key}:")
                    body(p[key])
            if p.get("subtasks"):
                out.append("  subtasks:")
                for t in p["subtasks"]:
                    t = t if isinstance(t, dict) else {"instruction": t}
                    who = f"job {t['job_id']}: " if t.get("job_id") is not None else ""
                    body(who + str(t.get("instruction", "")) + (f" ({t['piece']})" if t.get("piece") else ""), "    - ")
        elif k == "error":
            out.append(f"✖ error ({p.get('where')}): {p.get('message')}")
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
        text = re.sub(pattern, lambda m: json.dumps(new)[1:-1], text)
    return text


def _mask_secrets(text: str) -> str:
    values = secret_values()  # the same secrets the tool results are cleared of before they are stored
    text = redact(text, values)
    return redact(text, tuple(json.dumps(v)[1:-1] for v in values))  # as escaped inside the JSON
