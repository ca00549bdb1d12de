"""The HTML of a :class:`~agentnb.compare.Comparison`: two jobs' movement runs side by side.

One table row per movement-run position: the position with a badge (the same run, the first point where the
runs diverge — marked, tinted and given an anchor the header links to — a later difference, or a run one job
has not made), then each side's run as the job view shows it (:func:`render.movement_html`, so it expands
the same way and escapes everything the same way), each job's header above its column.

Bounded like the job view: every body cut to ``max_chars``, calls per run to ``max_calls``, and when the
whole view would exceed ``max_bytes`` the rows are reduced to one line each — the identical ones first, oldest
first — keeping the first divergence in detail; ``full=True`` lifts the bounds.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ._fork_lines import demo_note
from .render import DEFAULT_MAX_BYTES, DEFAULT_MAX_CALLS, DEFAULT_MAX_CHARS, STYLE, header_html, movement_html, plural
from .style import ERROR_COLOUR, OK_COLOUR

if TYPE_CHECKING:
    import pandas as pd

    from .source import JobSource

__all__ = ["DIVERGED_BADGE", "ForkNote", "comparison_html", "divergence_anchor"]

DIVERGED_BADGE: Final = "⚑ diverges here"
_GREY: Final = "#888"
_BADGE: Final = ("display:inline-block;padding:0 6px;margin:1px 2px;border-radius:8px;font-size:11px;"
                 "font-weight:600;color:#fff;background:{}")
_CELL: Final = "vertical-align:top;padding:4px 6px;border-top:1px solid rgba(127,127,127,.3);text-align:left"
_DIM: Final = "color:#777"


@dataclass(frozen=True)
class ForkNote:
    """How two compared jobs are related: ``child`` was made from ``parent``, a fork at run ``at`` (None: a
    replay of the whole job)."""

    child: int
    parent: int
    at: int | None

    def text(self) -> str:
        if self.at is None:
            return f"job {self.child} is a replay of job {self.parent}"
        served = "" if self.at == 1 else ("; run 1 re-served" if self.at == 2 else f"; runs 1–{self.at - 1} re-served")
        return f"job {self.child} is a fork of job {self.parent}, forked at run {self.at}{served}"


def divergence_anchor(a: int, b: int) -> str:
    """The id of the row where jobs ``a`` and ``b`` first diverge (the header links to it)."""
    return f"anb-diverged-{a}-{b}"


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _badge(text: str, colour: str) -> str:
    return f'<span class="anb-badge" style="{_BADGE.format(colour)}">{_e(text)}</span>'


def _value(row: pd.Series, name: str) -> Any:
    value = row[name]
    import pandas as pd

    return None if value is pd.NA or (isinstance(value, float) and pd.isna(value)) else value


def _mark(row: pd.Series, a_id: int, b_id: int) -> str:
    """The position's badge: same, diverges here, differs, or a run only one job made."""
    a, b = _value(row, "movement_a"), _value(row, "movement_b")
    if bool(row["diverged"]):
        return _badge(DIVERGED_BADGE, ERROR_COLOUR)
    if bool(row["identical"]):
        return _badge("same", OK_COLOUR)
    if a is None or b is None:
        return _badge(f"only in job {b_id if a is None else a_id}", _GREY)
    return _badge("differs", _GREY)


def _compact(job_id: int, row: pd.Series, side: str) -> str:
    """A run in one line, where the view is kept small."""
    seq = int(row["seq"])
    step = _value(row, f"next_step_{side}")
    calls = _value(row, f"llm_calls_{side}") or 0
    tokens = _value(row, f"total_tokens_{side}") or 0
    return (f'<div class="anb-more" style="font-size:11px;color:#777"><b>{seq}. {_e(row[f"movement_{side}"])}</b>'
            + (f" ➜ {_e(step)}" if step else "") + f" · {plural(int(calls), 'call')} · {int(tokens):,} tokens"
            f" — details left out to keep this view small; see them with "
            f"<code>%agent show {job_id} --movement {seq}</code></div>")


def _side(source: JobSource, job_id: int, row: pd.Series, side: str, *, open_: bool, compact: bool,
          max_chars: int | None, max_calls: int | None) -> str:
    if _value(row, f"movement_{side}") is None:
        return f'<div style="{_DIM}">— no run {int(row["seq"])} in job {job_id}</div>'
    served = (f'<div style="{_DIM};font-size:11px">↺ re-served from the original\'s record (no tokens spent)</div>'
              if _value(row, f"replayed_{side}") else "")
    if compact:
        return served + _compact(job_id, row, side)
    return served + movement_html(source, job_id, int(row["seq"]), max_chars=max_chars, max_calls=max_calls,
                                  open=open_)


def comparison_html(
    source: JobSource,
    a: int,
    b: int,
    frame: pd.DataFrame,
    *,
    note: ForkNote | None = None,
    max_chars: int | None = DEFAULT_MAX_CHARS,
    max_calls: int | None = DEFAULT_MAX_CALLS,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    full: bool = False,
) -> str:
    """Jobs ``a`` and ``b`` side by side, one row per movement-run position of ``frame`` (a Comparison's frame)."""
    if full:
        max_chars = max_calls = max_bytes = None
    rows = [row for _, row in frame.iterrows()]
    first = next((int(r["seq"]) for r in rows if bool(r["diverged"])), None)
    anchor = divergence_anchor(a, b)

    def cells(row: pd.Series, compact: bool) -> tuple[str, str]:
        open_ = int(row["seq"]) == first
        return (_side(source, a, row, "a", open_=open_, compact=compact, max_chars=max_chars, max_calls=max_calls),
                _side(source, b, row, "b", open_=open_, compact=compact, max_chars=max_chars, max_calls=max_calls))

    shown = {int(r["seq"]): cells(r, False) for r in rows}
    if max_bytes is not None:
        total = sum(len(x) + len(y) for x, y in shown.values())
        # the same runs say least, then the oldest; the first divergence stays in detail
        order = sorted(rows, key=lambda r: (not bool(r["identical"]), int(r["seq"])))
        for row in order:
            if total <= max_bytes:
                break
            seq = int(row["seq"])
            if seq == first:
                continue
            small = cells(row, True)
            total += len(small[0]) + len(small[1]) - len(shown[seq][0]) - len(shown[seq][1])
            shown[seq] = small
    body: list[str] = []
    for row in rows:
        seq = int(row["seq"])
        left, right = shown[seq]
        here = seq == first
        mark = f' id="{_e(anchor)}"' if here else ""
        tint = f"background:{ERROR_COLOUR}14;" if here else ""
        edge = f"border-left:3px solid {ERROR_COLOUR};" if here else ""
        body.append(f'<tr class="anb-cmp-row" data-seq="{seq}"{mark} style="{tint}">'
                    f'<td style="{_CELL};{edge}white-space:nowrap"><b>{seq}</b><br>{_mark(row, a, b)}</td>'
                    f'<td style="{_CELL}">{left}</td><td style="{_CELL}">{right}</td></tr>')
    same = int(frame["identical"].sum()) if len(frame) else 0
    head = [f'<b>job {a} vs job {b}</b>']
    if note is not None:
        head.append(f' · <span style="{_DIM}">{_e(note.text())}</span>')
    head.append(f" · {plural(len(rows), 'run position')}, {same:,} identical")
    if first is not None:
        head.append(f' · <a href="#{_e(anchor)}">{_badge(DIVERGED_BADGE, ERROR_COLOUR)} at run {first}</a>')
    elif rows:
        head.append(" · " + _badge("identical in every run", OK_COLOUR))
    demo = demo_note(source, a, b)
    if demo is not None:  # the same answers on both sides would otherwise look like an edit ignored
        head.append(f'<div class="anb-demo-note" style="{_DIM};padding-top:2px">note: {_e(demo)}</div>')
    if not rows:
        body.append(f'<tr><td colspan="3" style="{_CELL};{_DIM}">neither job has run a movement yet</td></tr>')
    table = (
        '<table class="anb-cmp" style="width:100%;border-collapse:collapse;table-layout:fixed">'
        '<colgroup><col style="width:8.5em"><col><col></colgroup>'
        f'<thead><tr><th style="{_CELL}">run</th>'
        f'<th style="{_CELL};font-weight:normal">A: {header_html(source, a)}</th>'
        f'<th style="{_CELL};font-weight:normal">B: {header_html(source, b)}</th></tr></thead>'
        f'<tbody>{"".join(body)}</tbody></table>'
    )
    return (STYLE + f'<div class="anb-job anb-compare" data-jobs="{a},{b}" '
            'style="font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:13px;line-height:1.4">'
            f'<div class="anb-head" style="padding:4px 0 6px">{"".join(head)}</div>{table}</div>')
