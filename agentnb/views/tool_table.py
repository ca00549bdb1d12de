"""A piece's tools, a table per movement (docs/tools.md#listing-tools): HTML in a notebook (``%agent tools``),
text in a terminal (``agentnb tools``), a DataFrame for code.  The listing itself is ``engine/tool_list.py``'s."""

from __future__ import annotations

import html
import shutil
import textwrap
from typing import Any

from ..engine.tool_list import ListedTool, ToolListing
from .style import ERROR_COLOUR

__all__ = ["ToolTable"]

_COLUMNS = ("tool", "source", "parameters", "description")
_DESCRIPTION_CHARS = 120  # a tool's description is its first sentence, cut: the table is for scanning


def _short(text: str, limit: int = _DESCRIPTION_CHARS) -> str:
    """A description's first sentence, cut to ``limit`` characters."""
    first = text.split(". ", 1)[0]
    first = first if first == text or first.endswith(".") else first + "."
    return first if len(first) <= limit else first[: limit - 1].rstrip() + "…"


def _wrap(text: str, width: int, keep: str = "") -> list[str]:
    """``text`` wrapped to ``width``, never breaking at ``keep`` (a parameter's ``name: type``)."""
    glued = text.replace(keep, keep.replace(" ", "\u00a0")) if keep else text  # textwrap breaks at ASCII spaces only
    return [line.replace("\u00a0", " ") for line in textwrap.wrap(glued, width)] or [""]


def _row(t: ListedTool) -> tuple[str, str, str, str]:
    return t.name, t.source, t.parameters_text, _short(t.description)


class ToolTable:
    """The value of ``%agent tools``: shown as a table per movement; :meth:`frame` gives one row per tool."""

    def __init__(self, listing: ToolListing) -> None:
        self.listing = listing

    def frame(self) -> Any:
        """One row per (movement, tool): movement, tool, source, parameters (text), permission, read_only,
        description."""
        import pandas as pd

        rows = [{"movement": m.movement, "tool": t.name, "source": t.source, "parameters": t.parameters_text,
                 "permission": t.permission, "read_only": t.read_only, "description": t.description}
                for m in self.listing.movements for t in m.tools]
        return pd.DataFrame(rows, columns=["movement", "tool", "source", "parameters", "permission", "read_only",
                                           "description"])

    def text(self, width: int | None = None, *, failures: bool = True) -> str:
        """Plain text: the failures first (unless ``failures`` is False: ``agentnb tools`` puts them on stderr),
        then each movement's heading and its table, parameters and description wrapped to ``width``."""
        width = width or shutil.get_terminal_size((120, 24)).columns
        out = [f"! {line}" for line in self.listing.failures] if failures else []
        for m in self.listing.movements:
            rows = [_row(t) for t in m.tools]
            fixed = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_COLUMNS[:2])]
            room = max(40, width - 2 - sum(fixed) - 6)  # what the two wrapped columns share
            params = min(max(len(_COLUMNS[2]), *(len(r[2]) for r in rows)), max(20, room // 2))
            widths = [*fixed, params, max(20, room - params)]
            if out:
                out.append("")
            out.append(f"{m.movement} (permission {m.permission})")
            for cells in [_COLUMNS, *rows]:
                wrapped = [[c] for c in cells[:2]] + [_wrap(cells[2], widths[2], keep=": "), _wrap(cells[3], widths[3])]
                for n in range(max(len(w) for w in wrapped)):
                    out.append("  " + "  ".join((w[n] if n < len(w) else "").ljust(widths[i])
                                                for i, w in enumerate(wrapped)))
        return "\n".join(line.rstrip() for line in out)

    def __repr__(self) -> str:
        return self.text(width=120)

    def _repr_html_(self) -> str:
        e = html.escape
        parts = ['<div class="anb-tools" style="font-size:12px">']
        for line in self.listing.failures:
            parts.append(f'<div style="color:{ERROR_COLOUR}">{e(line)}</div>')
        th = "text-align:left;padding:2px 8px;white-space:nowrap"
        td = "text-align:left;padding:2px 8px;vertical-align:top"
        for m in self.listing.movements:
            parts.append(f'<div style="margin-top:6px"><b>{e(m.movement)}</b> '
                         f'<span style="color:#777">(permission {e(m.permission)})</span></div>')
            parts.append('<table style="border-collapse:collapse"><tr>'
                         + "".join(f'<th style="{th}">{c}</th>' for c in _COLUMNS) + "</tr>")
            for t in m.tools:
                name, source, params, desc = (e(c) for c in _row(t))
                parts.append(f'<tr><td style="{td};white-space:nowrap"><code>{name}</code></td>'
                             f'<td style="{td};white-space:nowrap">{source}</td>'
                             f'<td style="{td}"><code>{params}</code></td><td style="{td}">{desc}</td></tr>')
            parts.append("</table>")
        parts.append("</div>")
        return "".join(parts)
