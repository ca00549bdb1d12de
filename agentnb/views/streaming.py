"""The running call of a job as its model streams it (docs/notebook.md#streaming): its text so far, and each tool
call as it forms (its name at once, its arguments growing).

Drawn by the live views (``notebook/liveview.py``) in an element of its own, just below the job's view, while the
call streams, and emptied when the call's ``llm_response`` is recorded: the job's view then shows the call as a
call that did not stream, so nothing of the streaming is left in a saved notebook.  Built from what arrived
(``agentnb.models.messages.Delta``), never from the store: nothing streamed is stored, so it is masked here as the
store masks what it keeps, and the end that could still grow into a secret is held back until it is settled
(``_secrets.shown_so_far``, the terminal's rule too).
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from .._secrets import scrub, shown_so_far
from .icons import TOOL, icon

__all__ = ["STREAM_CLASS", "StreamedCall", "stream_html"]

STREAM_CLASS = "anb-stream"
# only the end of a long answer is drawn: the view is redrawn up to ten times a second, and the whole of it shows
# in the job's view once the call is recorded
_TAIL = 2_000
_PRE = ("white-space:pre-wrap;word-break:break-word;margin:2px 0;padding:4px 6px;"
        "background:rgba(127,127,127,.08);border-radius:3px;font-size:12px")


@dataclass(frozen=True, slots=True)
class StreamedCall:
    """What call ``iteration`` of movement run ``movement_seq`` of job ``job_id`` has streamed so far."""

    job_id: int
    movement_seq: int | None
    iteration: int | None
    text: str = ""
    tools: tuple[tuple[str, str], ...] = ()  # (name, argument text so far) of each tool call, in order

    @property
    def chars(self) -> int:
        """The characters streamed so far (text and arguments)."""
        return len(self.text) + sum(len(args) for _, args in self.tools)


def _tail(text: str) -> str:
    if len(text) <= _TAIL:
        return html.escape(text)
    return f"… {len(text) - _TAIL:,} chars before · " + html.escape(text[-_TAIL:])


def stream_html(call: StreamedCall) -> str:
    """The streamed part of ``call``, styled inline (an untrusted notebook keeps it readable) like a call of the
    job's view, so that it reads as the running call at the end of the job's newest movement run."""
    key = f"{call.job_id}:{call.movement_seq}:{call.iteration}"
    which = f"call {call.iteration}" if call.iteration else "call"
    parts = [f'<div class="anb-job {STREAM_CLASS}" data-anb-stream="{html.escape(key)}" '
             'style="font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:13px;line-height:1.4">'
             '<div class="anb-mv" style="border-left:3px solid #7a9cc6;padding-left:8px;margin:3px 0">'
             '<div class="anb-call" style="border-top:1px dotted rgba(127,127,127,.4);padding:3px 0">'
             f'<div>{which} <span class="anb-dim" style="color:#777">· streaming…</span></div>']
    if call.text:
        parts.append(f'<div class="anb-msg"><b>assistant</b><pre class="anb-stream-text" style="{_PRE}">'
                     f"{_tail(shown_so_far(call.text, json_text=False))}</pre></div>")
    for name, arguments in call.tools:
        parts.append(f'<div class="anb-tool">{icon(TOOL, "tool call")} <b>{html.escape(scrub(name) or "?")}</b>'
                     f'<div class="anb-dim" style="color:#777">arguments ({len(arguments):,} chars so far)</div>'
                     f'<pre class="anb-stream-args" style="{_PRE}">{_tail(shown_so_far(arguments, json_text=True))}</pre></div>')
    parts.append("</div></div></div>")
    return "".join(parts)
