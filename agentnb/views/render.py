"""Static HTML views of a job, derived only from its events.

``job_html`` is what ``Job._repr_html_`` shows and what the live views (magic,
panel) and the notebook export reuse, so a saved notebook shows the run in
nbviewer or on GitHub without a kernel.  Its shape: a header (piece, model,
status, movements run, LLM calls, tokens, cost in US dollars, elapsed, scores) followed by one collapsible
``<details>`` section per movement run, with job-level comments and errors
placed between them in the order they happened.

Everything that comes from the model, the tools or the user is passed through
:func:`html.escape`; only this module's own markup is emitted unescaped.

Size bounds (a job of thousands of LLM calls must stay usable and must not
grow a saved notebook by its whole transcript):

* every text body (prompt, message, arguments, result) is cut to ``max_chars``
  with its full size shown and how to see all of it (``%agent show JOB --full``
  or ``ws.events(JOB)``);
* a movement with more than ``max_calls`` LLM calls shows its first and last
  calls in detail and one line for the calls in between;
* when the whole view would exceed ``max_bytes``, the oldest movements are
  reduced to their summary line and transition, newest kept in detail.

A compaction (docs/context.md#compaction) shows in its movement run: a ``⇊ compacted`` badge on the run, and in the call
list, at the summarisation call (shown as such, not as a turn of the conversation), a block "Compaction k:
N messages summarised, M kept · before → after tokens" with the summary in a ``<details>``.  A summarisation
call that failed (an ``error`` event with ``where`` compaction) is a warning, "compaction failed — …": the
movement went on, and it does not mark the run failed (the job's status says how the job ended).

``full=True`` lifts all three bounds.  The signatures of :func:`job_html`,
:func:`movement_html`, :func:`header_html` and :func:`job_stats` are stable:
other modules (the export, the panel) build on them.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from string import Template
from typing import Any

from .._secrets import scrub
from ..errors import NotFoundError
from ..events import (
    CommentEvent,
    Compaction,
    ContextAction,
    ErrorEvent,
    LLMRequest,
    LLMResponse,
    Reminder,
    ReplayDivergence,
    ScoreEvent,
    ToolCallEvent,
    ToolResult,
    Transition,
)
from ..models.prices import dollars, is_free, priced_name
from ..store.base import JobStatus
from ..store.reads import latest_request
from ._fork_lines import demo_note, fork_lines, reserved_runs
from ._fork_lines import runs_text as _runs_text
from ._job_stats import JobStats, job_stats, stats_from_timeline
from ._scores_html import scores_html
from .icons import COMMENT, LATENCY, REMINDER, STOP, TOOL, icon, question_badge
from .otel_live import dropped_spans
from .source import JobRecord, JobSource
from .style import (
    ACTION_COLOURS,
    ACTIONS,
    COMPACTION_COLOUR,
    DIVERGENCE_COLOUR,
    ERROR_COLOUR,
    LOOP_COLOUR,
    OK_COLOUR,
    RESERVED_COLOUR,
)
from .timeline import Call, MovementRun, Note, Timeline, ToolUse, fold, is_compaction_error, is_interruption

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_CALLS",
    "DEFAULT_MAX_CHARS",
    "KEEPER",
    "STYLE",
    "JobStats",
    "cost_text",
    "fork_lines",
    "header_html",
    "job_html",
    "job_stats",
    "movement_html",
    "plural",
    "reserved_runs",
    "run_html",
    "timeline_html",
]

DEFAULT_MAX_CHARS = 2_000
DEFAULT_MAX_CALLS = 40
DEFAULT_MAX_BYTES = 400_000
# Bodies longer than this are folded into a closed <details> so a movement reads at a glance.
_FOLD_CHARS = 300

# $warn, $prompt, …: the shared palette (views/style.py), which the panel's marks and the plots use too
STYLE = Template("""<style>
.anb-job{font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:13px;line-height:1.4}
.anb-job pre{white-space:pre-wrap;word-break:break-word;margin:2px 0;padding:4px 6px;background:rgba(127,127,127,.08);border-radius:3px;font-size:12px}
.anb-head{padding:4px 0 6px}
.anb-job details{margin:3px 0}
.anb-mv{border-left:3px solid #7a9cc6;padding-left:8px}
.anb-call{border-top:1px dotted rgba(127,127,127,.4);padding:3px 0}
.anb-dim{color:#777}
.anb-badge{display:inline-block;padding:0 6px;margin:1px 2px;border-radius:8px;font-size:11px;font-weight:600;color:#fff;background:#888}
.anb-warn{background:$warn}.anb-prompt{background:$prompt}.anb-force_transition{background:$force_transition}.anb-exhausted{background:$exhausted}
.anb-st-succeeded{background:$ok}.anb-st-failed,.anb-st-aborted{background:#c0392b}.anb-st-running,.anb-st-queued{background:#2f6fb0}
.anb-st-waiting_human,.anb-st-waiting_subtasks{background:#8e44ad}.anb-st-paused{background:#b7791f}
.anb-error{color:$error}
.anb-tr{background:rgba(46,139,87,.08);padding:3px 6px;border-radius:3px}
.anb-more{font-size:11px;color:#777}
</style>""").substitute(ACTION_COLOURS, ok=OK_COLOUR, error=ERROR_COLOUR)

# Live views (the magic's, the panel's) are re-drawn as events arrive.  This script, installed once per
# page, remembers which sections the user opened or closed (by the ``data-anb-key`` of their <summary>,
# the same on every render) and gives that state back to every newly drawn copy, before the browser
# paints it: what the user opened stays open while the job goes on, and what they closed stays closed.
# Sections the user never touched keep the view's own defaults (the newest movement run open).
# ``__anbLatest`` serves the header's "latest call" link: it opens the sections around the newest call
# of the same view and scrolls to it.  Without scripts (an untrusted notebook, GitHub) the view is the
# same static HTML and the link is a plain anchor.
KEEPER = """<script>
(function () {
  if (window.__anbKeeper) return;
  var chosen = new Map();
  window.__anbKeeper = chosen;
  var SEL = 'summary[data-anb-key]';
  document.addEventListener('click', function (e) {
    var s = e.target && e.target.closest ? e.target.closest(SEL) : null;
    if (!s || !s.parentElement || s.parentElement.tagName !== 'DETAILS') return;
    var d = s.parentElement, key = s.getAttribute('data-anb-key');
    chosen.set(key, !d.open);  // the click toggles it right after this handler
    setTimeout(function () { if (d.isConnected) chosen.set(key, d.open); }, 0);
  }, true);
  function restore(node) {
    var found = node.matches && node.matches(SEL) ? [node] : [];
    if (node.querySelectorAll) found = found.concat(Array.prototype.slice.call(node.querySelectorAll(SEL)));
    found.forEach(function (s) {
      var want = chosen.get(s.getAttribute('data-anb-key')), d = s.parentElement;
      if (want !== undefined && d && d.tagName === 'DETAILS' && d.open !== want) d.open = want;
    });
  }
  new MutationObserver(function (records) {
    records.forEach(function (r) { r.addedNodes.forEach(function (n) { if (n.nodeType === 1) restore(n); }); });
  }).observe(document.body, {childList: true, subtree: true});
  window.__anbLatest = function (link) {
    var view = link.closest('.anb-job'), id = (link.getAttribute('href') || '').slice(1);
    var target = view && id ? view.querySelector('[id="' + id + '"]') : null;
    if (!target) return true;
    for (var d = target.closest('details'); d; d = d.parentElement.closest('details')) {
      var s = d.querySelector(':scope > ' + SEL);
      if (s) chosen.set(s.getAttribute('data-anb-key'), true);
      d.open = true;
    }
    target.scrollIntoView({block: 'center'});
    // JupyterLab handles the same click after this: it focuses the cell holding the link and scrolls
    // that back into view, undoing the scroll above in a tall live view.  Scroll again once it has.
    setTimeout(function () { if (target.isConnected) target.scrollIntoView({block: 'center'}); }, 0);
    return false;
  };
})();
</script>"""

# The same look as inline styles: an untrusted notebook (JupyterLab, nbviewer, GitHub) drops <style>
# blocks but keeps style attributes, so a saved view stays readable there.
_INLINE = {
    "anb-job": "font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:13px;line-height:1.4",
    "anb-head": "padding:4px 0 6px",
    "anb-mv": "border-left:3px solid #7a9cc6;padding-left:8px;margin:3px 0",
    "anb-call": "border-top:1px dotted rgba(127,127,127,.4);padding:3px 0",
    "anb-dim": "color:#777",
    "anb-badge": "display:inline-block;padding:0 6px;margin:1px 2px;border-radius:8px;font-size:11px;"
                 "font-weight:600;color:#fff;background:#888",
    **{f"anb-{action}": f"background:{ACTION_COLOURS[action]}" for action in ACTIONS},
    "anb-st-succeeded": f"background:{OK_COLOUR}", "anb-st-failed": "background:#c0392b",
    "anb-st-aborted": "background:#c0392b", "anb-st-running": "background:#2f6fb0",
    "anb-st-queued": "background:#2f6fb0", "anb-st-waiting_human": "background:#8e44ad",
    "anb-st-waiting_subtasks": "background:#8e44ad", "anb-st-paused": "background:#b7791f",
    "anb-error": f"color:{ERROR_COLOUR}",
    "anb-tr": "background:rgba(46,139,87,.08);padding:3px 6px;border-radius:3px",
    "anb-more": "font-size:11px;color:#777",
    # the fork marks are styled inline only (every tag of the view carries its style attribute)
    "anb-reserved": f"background:{RESERVED_COLOUR}", "anb-divergence": f"background:{DIVERGENCE_COLOUR}",
    "anb-loop": f"background:{LOOP_COLOUR}",  # inline only too: views of pieces without monitors are unchanged
    # a compaction (docs/context.md#compaction), inline only as well: views of jobs that never compacted are unchanged
    "anb-compaction": f"background:{COMPACTION_COLOUR}",
    "anb-compacted": f"border-left:3px solid {COMPACTION_COLOUR};background:rgba(31,138,138,.07);padding:3px 6px;"
                     "margin:2px 0;border-radius:3px",
    "anb-compaction-failed": f"border-left:3px solid {ACTION_COLOURS['prompt']};background:rgba(224,123,0,.08);"
                             "padding:3px 6px;margin:2px 0;border-radius:3px",
    "anb-diverged": f"border-left:3px solid {DIVERGENCE_COLOUR};background:rgba(179,89,0,.07);padding:3px 6px;"
                    "margin:2px 0;border-radius:3px",
}
_PRE_STYLE = ("white-space:pre-wrap;word-break:break-word;margin:2px 0;padding:4px 6px;"
              "background:rgba(127,127,127,.08);border-radius:3px;font-size:12px")
_CLASSED_TAG = re.compile(r'(<\w+ class="([^"]*)"[^<>]*?)(/?>)')


def _inline(markup: str) -> str:
    """Give each of our tags a style attribute from its classes (text is escaped, so only our tags match)."""
    def style(m: re.Match[str]) -> str:
        css = ";".join(_INLINE[c] for c in m.group(2).split() if c in _INLINE)
        return f'{m.group(1)} style="{css}"{m.group(3)}' if css else m.group(0)

    return _CLASSED_TAG.sub(style, markup).replace("<pre>", f'<pre style="{_PRE_STYLE}">')


_ACTION_ICON = {"warn": "⚠", "prompt": "⚠", "force_transition": STOP, "exhausted": STOP}


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _n(value: float | int) -> str:
    return f"{int(value):,}"


def plural(n: int, word: str) -> str:
    """``1 call``, ``2 calls``."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _pct(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio * 100:.0f}%"


def _latency(s: float) -> str:
    """A measured time as HTML text."""
    if s < 0.0005:
        return "&lt;1 ms"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f} s"


def _latest_id(job_id: int) -> str:
    return f"anb-latest-{job_id}"


def duration(s: float) -> str:
    """``12.5 s``, ``3 min 4 s``, ``2 h 5 min``: a running or wall time as the views show it."""
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"


# ---------------------------------------------------------------------------
# Building blocks


@dataclass(frozen=True)
class _Opts:
    job_id: int
    max_chars: int | None
    max_calls: int | None
    open_question: str | None = None  # shown once, in the header, while the job waits for its answer

    def hint(self, seq: int | None = None) -> str:
        where = f" --movement {seq}" if seq is not None else ""
        return f"%agent show {self.job_id}{where} --full"


def _key(o: _Opts, *parts: Any) -> str:
    """The stable name of a collapsible part of the view: the same part gets the same key on every render,
    so the live views' keeper (:data:`KEEPER`) can give back the open/closed state the user chose."""
    return ":".join(str(p) for p in (o.job_id, *parts))


def _body(text: Any, o: _Opts, seq: int | None, *, label: str = "", fold: bool = True, key: str = "") -> str:
    """A text body in <pre>, cut to ``max_chars`` and folded (as the part ``key``) when long."""
    s = "" if text is None else str(text)
    size = len(s)
    cut = o.max_chars is not None and size > o.max_chars
    shown = s[: o.max_chars] if cut else s
    out = f"<pre>{_e(shown)}</pre>"
    if cut:
        out += (f'<div class="anb-more">… showing the first {_n(len(shown))} of {_n(size)} chars; '
                f"all of it: <code>{_e(o.hint(seq))}</code> or <code>ws.events({o.job_id})</code></div>")
    if fold and (size > _FOLD_CHARS or s.count("\n") > 8):
        summary = f"{_e(label)} <span class=\"anb-dim\">({_n(size)} chars)</span>" if label else f"{_n(size)} chars"
        named = f' data-anb-key="{_e(key)}"' if key else ""
        return f"<details><summary{named}>{summary}</summary>{out}</details>"
    return (f"<div>{_e(label)}</div>" if label else "") + out


def _json(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, indent=1, default=str)
    except (TypeError, ValueError):
        return repr(value)


def _badge(text: str, cls: str, title: str | None = None) -> str:
    hover = f' title="{_e(title)}"' if title else ""
    return f'<span class="anb-badge {_e(cls)}"{hover}>{_e(text)}</span>'


def _context_badge(ev: ContextAction) -> str:
    icon = _ACTION_ICON.get(ev.action, "•")
    text = f"{icon} context {ev.action} · {_pct(ev.ratio)}"
    if ev.threshold:
        text += f" ≥ {_pct(ev.threshold)}"
    if ev.window:
        text += f" · {_n(ev.tokens)} / {_n(ev.window)} tokens"
    return _badge(text, f"anb-{ev.action}")


def _tool_html(call: ToolCallEvent | None, result: ToolResult | None, o: _Opts, seq: int | None) -> str:
    ev = call if call is not None else result
    assert ev is not None, "a tool is shown from its call, its result or both"
    name, key = ev.tool, _key(o, seq, ev.iteration, ev.call_id)
    parts = [f'<div class="anb-tool">{icon(TOOL, "tool call")} <b>{_e(name)}</b>{_server_html(ev.server)}']
    if call is not None:
        parts.append(_body(_json(call.arguments), o, seq, label="arguments", key=key + ":arguments"))
    if result is None:
        parts.append('<div class="anb-dim">(no result yet)</div>')
    else:
        label = "error" if result.is_error else "result"
        note = ""
        if result.truncated:
            note = (f"cut for the model: {_n(result.returned_chars)} of {_n(result.original_chars)} chars returned")
            cont = result.continuation or {}
            if cont:
                note += "; continue with " + ", ".join(f"{_e(k)}={_e(v)}" for k, v in cont.items())
        title = label + (f" · {note}" if note else "")
        body = _body(result.content, o, seq, label=title, key=key + ":result")
        if result.is_error:
            body = f'<div class="anb-error">{body}</div>'
        parts.append(body)
        if result.image:
            parts.append('<div class="anb-dim">(an image was returned to the model)</div>')
    parts.append("</div>")
    return "".join(parts)


def _server_html(server: str | None) -> str:
    """`` · git`` after an MCP tool's name: the server that offers it (docs/tools.md#mcp-tools)."""
    if not server:
        return ""
    return f' <span class="anb-dim anb-server" title="MCP server {_e(server)}">· {_e(server)}</span>'


def _transition_html(ev: Transition, o: _Opts, seq: int | None) -> str:
    forced = f" {_badge('forced', 'anb-force_transition')} <span class=\"anb-dim\">{_e(ev.reason)}</span>" if ev.forced else ""
    rows = [f'<div class="anb-tr">➜ next step <b>{_e(ev.next_step)}</b>{forced}']
    for label, value in (("summary", ev.summary), ("lessons", ev.lessons), ("question", ev.question),
                         ("feedback", ev.feedback)):
        if value and label == "question" and value == o.open_question:
            rows.append('<div><i>question:</i> <span class="anb-dim">↑ above, waiting for your answer</span></div>')
        elif value:
            rows.append(f"<div><i>{label}:</i> {_body(value, o, seq, fold=False)}</div>")
    if ev.subtasks:
        items = "".join(f"<li>{_e(t.instruction)}"
                        + (f" <span class=\"anb-dim\">({_e(t.piece)})</span>" if t.piece else "")
                        + "</li>" for t in ev.subtasks)
        rows.append(f"<div><i>subtasks:</i><ol>{items}</ol></div>")
    rows.append("</div>")
    return "".join(rows)


def _call_head(call: Call) -> str:
    """The line above a call: which call, the messages sent, its tokens, context, latency."""
    it = call.iteration
    head = (f"summarisation call {it} <span class=\"anb-dim\">(compaction, no tools)</span>" if call.summarising
            else f"call {it}" if it else "call")
    for ev in call.items:
        if isinstance(ev, LLMRequest):
            head += f' <span class="anb-dim">· {ev.messages} messages</span>'
        elif isinstance(ev, LLMResponse):
            head += _response_head(ev)
    return head


def _response_head(ev: LLMResponse) -> str:
    u = ev.usage
    head = f' <span class="anb-dim">· {_n(u.prompt_tokens)} prompt + {_n(u.completion_tokens)} completion tokens'
    if u.ratio is not None:
        head += f' · context {_pct(u.ratio)} of {_n(u.window or 0)} ({_e(u.source)})'
    if ev.latency_s is not None:
        head += f' · {icon(LATENCY, "how long the model took to answer")} {_latency(ev.latency_s)}'
        if ev.ttft_s is not None:  # a streamed answer: how long its first token took
            head += f' <span title="time to first token">(first token {_latency(ev.ttft_s)})</span>'
    if ev.replayed_from is not None:
        head += f" · re-served from job {ev.replayed_from}, no tokens spent"
    if ev.cached:  # docs/design-lab.md#call-cache
        head += ' · <span class="anb-cached">cached</span>: answered from the call cache, no tokens spent'
    return head + "</span>"


def _response_html(ev: LLMResponse, run: MovementRun, o: _Opts) -> str:
    if ev.purpose == "compaction":  # its summary is shown in the compaction block
        return "" if (ev.content or "").strip() else '<div class="anb-dim">summary: (empty)</div>'
    if ev.content:
        return (f'<div class="anb-msg"><b>assistant</b>'
                f'{_body(ev.content, o, run.seq, key=_key(o, run.seq, ev.iteration, "assistant"))}</div>')
    return "" if ev.tool_calls else '<div class="anb-dim">assistant: (empty message)</div>'


def _tool_use_html(use: ToolUse, run: MovementRun, o: _Opts) -> str:
    if use.tool == "transition" and (use.result is None or not use.result.is_error):
        return ""  # the transition box says it better
    return _tool_html(use.call, use.result, o, run.seq)


def _reminder_html(ev: Reminder, run: MovementRun, o: _Opts) -> str:
    return f'<div class="anb-dim">{icon(REMINDER, "reminder")} reminder ({_e(ev.reason)}): {_e(ev.text)}</div>'


def _note_html(item: Note, o: _Opts, seq: int | None) -> str:
    """An event of a kind no view knows (views/timeline.py): its kind and its payload fields."""
    return f'<div class="anb-note"><span class="anb-dim">{_e(item.label)}</span>{_body(item.text, o, seq)}</div>'


# how each item of a call shows in its call (a kind not named here shows nothing there)
_ITEM_HTML: dict[type, Callable[[Any, MovementRun, _Opts], str]] = {
    LLMResponse: _response_html,
    ContextAction: lambda ev, run, o: f"<div>{_context_badge(ev)}</div>",
    ToolUse: _tool_use_html,
    Reminder: _reminder_html,
    Transition: lambda ev, run, o: _transition_html(ev, o, run.seq),
    ErrorEvent: lambda ev, run, o: _error_html(ev, o, run.seq),
    CommentEvent: lambda ev, run, o: _comment_html(ev, o),
    ReplayDivergence: lambda ev, run, o: _divergence_html(ev, o, run.seq),
    Compaction: lambda ev, run, o: _compaction_html(ev, run.compaction_number(ev.iteration), o, run.seq),
    Note: lambda item, run, o: _note_html(item, o, run.seq),
}


def _call_html(call: Call, run: MovementRun, o: _Opts, *, latest: bool = False) -> str:
    """One LLM call: the assistant message, context badges, each tool call with its result, reminders.

    ``latest`` marks the job's newest call, the target of the header's "latest call" link.  A compaction's
    summarisation call is headed as such, its summary shown in the compaction block rather than as an
    assistant message.
    """
    out = [_ITEM_HTML[type(item)](item, run, o) for item in call.items if type(item) in _ITEM_HTML]
    anchor = f' id="{_e(_latest_id(o.job_id))}"' if latest else ""
    return f'<div class="anb-call"{anchor}><div>{_call_head(call)}</div>{"".join(out)}</div>'


def _comment_html(ev: CommentEvent, o: _Opts) -> str:
    return f'<div class="anb-comment">{icon(COMMENT, "comment")} <b>{_e(ev.author)}</b>: {_body(ev.body, o, None, fold=False)}</div>'


def _divergence_html(ev: ReplayDivergence, o: _Opts, seq: int | None) -> str:
    """A tool re-run in a re-served run whose result differed from the original's: a warning block with both."""
    key = _key(o, seq, ev.iteration, ev.call_id, "divergence")
    return (f'<div class="anb-diverged">{_badge("⚠ divergence", "anb-divergence")} the re-run of tool '
            f"<b>{_e(ev.tool)}</b> <span class=\"anb-dim\">(call {_e(ev.call_id)})</span> gave another result than "
            "the original's"
            + _body(ev.expected, o, seq, label="expected (the original's result)", key=key + ":expected")
            + _body(ev.actual, o, seq, label="actual (this run's result)", key=key + ":actual")
            + "</div>")


def _error_html(ev: ErrorEvent, o: _Opts, seq: int | None) -> str:
    if is_compaction_error(ev):
        return f'<div class="anb-compaction-failed">⚠ compaction failed — {_body(ev.message, o, seq, fold=False)}</div>'
    if is_interruption(ev):  # a Stop cut a call off (its message says when): not a failure
        return f'<div class="anb-dim">⏸ stopped — {_body(ev.message, o, seq, fold=False)}</div>'
    return f'<div class="anb-error">✖ error ({_e(ev.where)}): {_body(ev.message, o, seq, fold=False)}</div>'


def _compaction_html(ev: Compaction, number: int, o: _Opts, seq: int | None) -> str:
    """A compaction: how many messages were summarised and kept, the sizes, and the summary folded."""
    key = _key(o, seq, ev.iteration, "compaction")
    return (f'<div class="anb-compacted">{_badge(f"⇊ compaction {number}", "anb-compaction")} '
            f"<b>Compaction {number}:</b> {plural(ev.removed_messages, 'message')} summarised, "
            f"{_n(ev.kept_messages)} kept · {_n(ev.tokens_before)} → {_n(ev.tokens_after)} tokens"
            f'<details><summary data-anb-key="{_e(key)}">summary <span class="anb-dim">'
            f"({_n(len(ev.summary))} chars)</span></summary>{_body(ev.summary, o, seq, fold=False)}</details></div>")


def _run_status(job: JobRecord, run: MovementRun) -> str:
    if run.transition is not None:
        return "done"
    if run.errors:
        return "failed"
    return "running" if job.status == JobStatus.running and run.seq == job.movement_seq else "open"


def _run_summary(job: JobRecord, run: MovementRun) -> str:
    """The one line of a movement run: name, status, calls, tokens, context, its badges, where it went."""
    summ = [f"<b>{run.seq}. {_e(run.name)}</b>"]
    if run.replayed_from is not None:
        summ.append(_badge("re-served", "anb-reserved",
                           title=f"responses re-served from job {run.replayed_from}: no tokens spent"))
    summ.append(f'<span class="anb-dim">{_run_status(job, run)} · {plural(run.llm_calls, "call")}'
                + (f" ({run.summarisations} summarisation)" if run.summarisations else "")
                + f' · {_n(run.tokens)} tokens'
                + (f" · context up to {_pct(run.max_ratio)}" if run.max_ratio is not None else "") + "</span>")
    if run.divergences:
        summ.append(_badge(f"⚠ {plural(len(run.divergences), 'divergence')}", "anb-divergence"))
    summ.extend(_badge(f"{_ACTION_ICON.get(a.action, '')} {a.action} {_pct(a.ratio)}", f"anb-{a.action}")
                for a in run.actions)
    summ.extend(_transition_summary(run.transition))
    summ.extend(_run_marks(run))
    return " ".join(summ)


def _transition_summary(tr: Transition | None) -> list[str]:
    if tr is None:
        return []
    out = [f"➜ <b>{_e(tr.next_step)}</b>"]
    if tr.forced:
        out.append(_badge("forced", "anb-force_transition"))
    if tr.summary:
        short = tr.summary if len(tr.summary) <= 120 else tr.summary[:119] + "…"
        out.append(f'<span class="anb-dim">{_e(short)}</span>')
    return out


def _run_marks(run: MovementRun) -> list[str]:
    """The badges of a run's compactions, failed compactions, loops and failure."""
    out: list[str] = []
    if run.compactions:
        n = len(run.compactions)
        out.append(_badge("⇊ compacted" + (f" ×{n}" if n > 1 else ""), "anb-compaction",
                          title="; ".join(f"compaction {k}: {_n(e.tokens_before)} → {_n(e.tokens_after)} tokens"
                                          for k, e in enumerate(run.compactions, start=1))))
    if run.compaction_errors:
        out.append(_badge("⚠ compaction failed", "anb-prompt"))
    for lp in run.loops:
        then = lp.judge if lp.judge is not None else lp.next
        out.append(_badge(f"⟳ loop {' → '.join(lp.cycle)} ×{lp.count}", "anb-loop",
                          title=f"loop monitor {lp.monitor}: {_runs_text(lp.runs)}; then {then}"))
    if run.errors:
        out.append(_badge("error", "anb-st-failed"))
    return out


def _run_body(run: MovementRun, o: _Opts, *, compact: bool, latest: int | None) -> list[str]:
    seq = run.seq
    if compact:
        body = [f'<div class="anb-more">details left out to keep this view small; '
                f"see them with <code>{_e(o.hint(seq))}</code></div>"]
        return body + ([_transition_html(run.transition, o, seq)] if run.transition is not None else [])
    body = []
    if run.start is not None:
        body.append(_body(run.start.system, o, seq, label="system prompt", key=_key(o, seq, "system")))
        body.append(_body(run.start.user, o, seq, label="user prompt", key=_key(o, seq, "user")))
    calls: Sequence[Call | None] = run.calls
    hidden: Sequence[Call] = ()
    if o.max_calls is not None and len(run.calls) > o.max_calls:
        head_n = max(1, o.max_calls // 4)
        tail_n = max(1, o.max_calls - head_n)
        hidden = run.calls[head_n:-tail_n]
        calls = [*run.calls[:head_n], None, *run.calls[-tail_n:]]
    for call in calls:
        body.append(_hidden_line(hidden, o, seq) if call is None
                    else _call_html(call, run, o, latest=latest is not None and call.iteration == latest))
    return body


def _movement_section(job: JobRecord, run: MovementRun, o: _Opts, *, open_: bool, compact: bool = False,
                      latest: int | None = None) -> str:
    """Movement run ``run`` as a ``<details>``; ``latest`` is the iteration of the job's newest call when it is in this run."""
    flag = " open" if open_ else ""
    return (f'<details class="anb-mv" data-seq="{run.seq}"{flag}><summary data-anb-key="{_e(_key(o, run.seq))}">'
            f'{_run_summary(job, run)}</summary>'
            f'<div class="anb-body">{"".join(_run_body(run, o, compact=compact, latest=latest))}</div></details>')


def _hidden_line(hidden: Sequence[Call], o: _Opts, seq: int | None) -> str:
    n_calls = sum(c.answered for c in hidden)
    tokens = sum(c.tokens for c in hidden)
    tools: dict[str, int] = {}
    for c in hidden:
        for name in c.tools:
            tools[name] = tools.get(name, 0) + 1
    first, last = hidden[0].iteration, hidden[-1].iteration
    used = ", ".join(f"{_e(k)}×{v}" for k, v in sorted(tools.items(), key=lambda kv: -kv[1])[:8])
    return (f'<div class="anb-call anb-more">… calls {first}–{last} not shown ({n_calls} calls, {_n(tokens)} tokens'
            + (f"; tools {used}" if used else "") + f"); all of them: <code>{_e(o.hint(seq))}</code></div>")


def cost_text(model: str, cost: float | None) -> str:
    """A job's cost as its header shows it: ``$0.0123``, ``$0 (offline model)``, ``cost unknown (…)``."""
    if cost is None:
        return f"cost unknown (model {priced_name(model) or model} has no price)"
    if is_free(model):
        return "$0 (offline model)"
    return dollars(cost)


def _cost(model: str, cost: float | None) -> str:
    text = _e(scrub(cost_text(model, cost)))  # it may name the model
    return f'<span class="anb-dim">{text}</span>' if cost is None else text


def _score(ev: ScoreEvent) -> str:
    """A score as a badge (green for true, red for false), or the scorer's error in red."""
    if ev.error is not None:
        return f'<span class="anb-error">✖ {_e(ev.name)}: {_e(ev.error)}</span>'
    cls = {True: "anb-st-succeeded", False: "anb-st-failed"}.get(ev.value, "") if isinstance(ev.value, bool) else ""
    value = f"{ev.value:.4g}" if isinstance(ev.value, float) else str(ev.value)
    return _badge(f"{ev.name} = {value}", cls)


def _header(job: JobRecord, st: JobStats, piece_max: int | None, *, latest_link: bool = False,
            fork: Sequence[str] = (), note: str | None = None) -> str:
    status = st.status or str(job.status)
    mv = f"{st.movements}" + (f" / {piece_max}" if piece_max else "")
    parts = [
        f'<div class="anb-head"><b>Job {job.id}</b> {_badge(status, "anb-st-" + status)}',
        f" · piece <b>{_e(job.piece)}</b> · model <code>{_e(scrub(job.model))}</code>",  # a key typed as a model
        f" · movements {mv} · {plural(st.calls, 'LLM call')} · {_n(st.total_tokens)} tokens"
        f' <span class="anb-dim">({_n(st.prompt_tokens)} prompt + {_n(st.completion_tokens)} completion)</span>',
        f" · {_cost(job.model, st.cost_usd)}",
        f" · running time {duration(st.running_s)}",
        f' <span class="anb-dim">· wall {duration(st.wall_s)} '
        f'{"from submit to end" if job.ended else "since submit"}</span>',
    ]
    if st.latest is not None and latest_link:
        seq, it = st.latest
        parts.append(f' · <a href="#{_e(_latest_id(job.id))}" class="anb-latest" '
                     'onclick="return window.__anbLatest ? window.__anbLatest(this) : true">'
                     f"↓ {'latest' if job.status == JobStatus.running else 'last'} call ({seq}.{it})</a>")
    if job.parent_id:
        parts.append(f' · <span class="anb-dim">subtask of job {job.parent_id}</span>')
    if fork:
        parts.append(f'<div class="anb-fork">{_badge("fork", "anb-reserved") if job.forked_from else ""} '
                     + " · ".join(_e(line) for line in fork) + "</div>")
    if note:
        parts.append(f'<div class="anb-dim anb-demo-note">note: {_e(note)}</div>')
    parts.append(f'<div class="anb-dim">instruction: {_e(job.instruction if len(job.instruction) <= 300 else job.instruction[:299] + "…")}</div>')
    if job.error:
        parts.append(f'<div class="anb-error">✖ {_e(job.error)}</div>')
    if st.scores:
        parts.append(f'<div>scores: {" ".join(_score(ev) for ev in st.scores.values())}</div>')
    if st.question:
        parts.append(f'<div>{question_badge()} <b>waiting for you:</b> {_e(st.question)} '
                     f'<span class="anb-dim">— answer with <code>%agent reply {job.id} "…"</code></span></div>')
    parts.append("</div>")
    return "".join(parts)


def _piece_max(ws: JobSource, job_id: int) -> int | None:
    try:
        return ws.piece(job_id).max_movements
    except Exception:  # a stored piece that no longer parses must not break the view
        return None


def header_html(ws: JobSource, job_id: int) -> str:
    """The header line of a job: piece, model, status, movements run, calls, tokens, cost, elapsed, the latest
    score of each name (no <style>)."""
    job = ws.job(job_id).snapshot()
    tl = fold(ws.events(job_id), runs=False)  # the numbers and the re-served runs only
    return _inline(_header(job, stats_from_timeline(job, tl), _piece_max(ws, job_id), fork=fork_lines(job, tl)))


def _sections(job: JobRecord, tl: Timeline, o: _Opts, latest: tuple[int, int] | None, *, open_last: bool,
              max_bytes: int | None) -> dict[int, str]:
    """Each movement run's section; when they exceed ``max_bytes``, the oldest reduced to their summary."""
    last_seq = max(tl.runs) if tl.runs else None
    newest = dict([latest]) if latest is not None else {}
    sections = {seq: _movement_section(job, run, o, open_=open_last and seq == last_seq, latest=newest.get(seq))
                for seq, run in tl.runs.items()}
    if max_bytes is not None:
        total = sum(len(s) for s in sections.values())
        for seq in sorted(tl.runs):  # oldest first; the newest run stays in detail
            if total <= max_bytes or seq == last_seq:
                break
            compact = _movement_section(job, tl.runs[seq], o, open_=False, compact=True)
            total += len(compact) - len(sections[seq])
            sections[seq] = compact
    return sections


def _entry_html(entry: MovementRun | CommentEvent | ErrorEvent | Note, sections: dict[int, str],
                asked: frozenset[str], o: _Opts) -> str:
    if isinstance(entry, MovementRun):
        return sections[entry.seq]
    if isinstance(entry, ErrorEvent):
        return _error_html(entry, o, None)
    if isinstance(entry, Note):
        return _note_html(entry, o, None)
    # the agent's ASK is also stored as its comment: the transition box already shows that question
    return "" if entry.author == "agent" and entry.body in asked else _comment_html(entry, o)


def job_html(
    ws: JobSource,
    job_id: int,
    *,
    max_chars: int | None = DEFAULT_MAX_CHARS,
    max_calls: int | None = DEFAULT_MAX_CALLS,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    full: bool = False,
    open_last: bool = True,
    style: bool = True,
) -> str:
    """The whole view of job ``job_id`` as one HTML string (header, then one ``<details>`` per movement run).

    ``max_chars`` cuts each text body, ``max_calls`` bounds the calls shown in detail per movement run,
    ``max_bytes`` bounds the whole view by reducing the oldest movement runs to their summary;
    ``full=True`` lifts all bounds.  ``open_last`` opens the newest movement section.  ``style=False``
    leaves out the ``<style>`` block (for callers that emit it once themselves, see :data:`STYLE`).
    """
    # one consistent reading: the row first, so no event the status speaks of is missing
    job = ws.job(job_id).snapshot()
    return timeline_html(ws, job, fold(ws.events(job_id)), max_chars=max_chars, max_calls=max_calls,
                         max_bytes=max_bytes, full=full, open_last=open_last, style=style)


def timeline_html(
    ws: JobSource,
    job: JobRecord,
    tl: Timeline,
    *,
    max_chars: int | None = DEFAULT_MAX_CHARS,
    max_calls: int | None = DEFAULT_MAX_CALLS,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    full: bool = False,
    open_last: bool = True,
    style: bool = True,
) -> str:
    """:func:`job_html` of a job row and its folded events (a live view keeps a :class:`~.timeline.Fold` and
    adds the events after its ``last_id``, read after the row): the same HTML."""
    if full:
        max_chars = max_calls = max_bytes = None
    st = stats_from_timeline(job, tl)
    o = _Opts(job.id, max_chars, max_calls, st.question)
    sections = _sections(job, tl, o, st.latest, open_last=open_last, max_bytes=max_bytes)
    body = [_entry_html(entry, sections, tl.asked, o) for entry in tl.entries]
    if not tl.runs and job.status == JobStatus.queued:
        body.append('<div class="anb-dim">not started yet</div>')
    body.append(scores_html(tl.totals.scores, tl.totals.judge_calls, job.model))  # docs/design-lab.md#llm-judge
    return (STYLE if style else "") + _inline(
        f'<div class="anb-job" data-job="{job.id}">'
        + _header(job, st, _piece_max(ws, job.id), latest_link=True, fork=fork_lines(job, tl),
                  # said once where the fork is shown; header_html (the compare view's columns) leaves it to that view
                  note=demo_note(ws, job.forked_from[0], job.id) if job.forked_from else None)
        + "".join(body) + _footer(ws, job) + "</div>"
    )


def _footer(ws: JobSource, job: JobRecord) -> str:
    """The job's footer: what this process could not do for it (live OpenTelemetry spans dropped)."""
    dropped = dropped_spans(ws.store, job.id)
    if not dropped:
        return ""
    return (f'<div class="anb-dim anb-foot">OpenTelemetry: {plural(dropped, "span")} of this job not exported '
            "(the collector was unreachable, too slow or refused them; docs/otel.md#live)</div>")


def movement_html(
    ws: JobSource,
    job_id: int,
    seq: int,
    *,
    max_chars: int | None = DEFAULT_MAX_CHARS,
    max_calls: int | None = DEFAULT_MAX_CALLS,
    full: bool = False,
    open: bool = True,
) -> str:
    """One movement run (``seq`` is 1 for the job's first run) as a ``<details>`` section, without ``<style>``.

    Raises ``NotFoundError`` (a ``LookupError``) when the job has no movement run ``seq``.
    """
    job = ws.job(job_id).snapshot()
    run = fold(ws.store.events(job.id, movement_seq=seq)).run(seq)
    if run is None:
        raise NotFoundError(f"job {job.id} has no movement run {seq}; it has run {job.movement_seq}")
    # the same markup as in job_html: the job's newest call is marked wherever its run is shown
    newest = latest_request(ws.store, job.id)
    latest = newest[1] if newest and newest[0] == seq else None
    return run_html(job, run, latest=latest, max_chars=max_chars, max_calls=max_calls, full=full, open=open)


def run_html(job: JobRecord, run: MovementRun, *, latest: int | None = None,
             max_chars: int | None = DEFAULT_MAX_CHARS, max_calls: int | None = DEFAULT_MAX_CALLS,
             full: bool = False, open: bool = True) -> str:
    """:func:`movement_html` of a folded run; ``latest``: the iteration of the job's newest call when in it."""
    if full:
        max_chars = max_calls = None
    return _inline(_movement_section(job, run, _Opts(job.id, max_chars, max_calls), open_=open, latest=latest))
