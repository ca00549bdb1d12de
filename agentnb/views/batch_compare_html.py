"""The HTML of a :class:`~agentnb.batch_compare.BatchComparison` (docs/design-lab.md#paired-comparison).

One table row per variant × measure (improvements green, regressions red, the rest plain), what the numbers
are in words above it, a note when a row has too few cases for the test to mean anything, then per variant
the cases that got worse and better, each with the commands that open the two jobs' views and set them side
by side (``%agent show`` and ``%agent compare``, as the batch's own view names its jobs).  Everything escaped.
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Any, Final, Protocol

from .batch_stats import BOOTSTRAP, Settings, min_cases
from .style import ERROR_COLOUR, OK_COLOUR

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["CASES_SHOWN", "ComparisonSource", "comparison_table_html"]


class ComparisonSource(Protocol):
    """What the HTML reads of a comparison (a :class:`agentnb.batch_compare.BatchComparison`)."""

    batch: str
    baseline: int
    baseline_label: str
    frame: pd.DataFrame
    cases: pd.DataFrame
    settings: Settings

# per variant, how many worse (and how many better) cases the view lists; .cases has them all
CASES_SHOWN: Final = 8
_CELL: Final = "padding:2px 6px;text-align:right;vertical-align:top;white-space:nowrap"
_HEAD: Final = "padding:2px 6px;text-align:right;vertical-align:bottom;font-weight:bold"
_COLOURS: Final = {"better": OK_COLOUR, "worse": ERROR_COLOUR}
_BETTER: Final = {"higher": "↑ higher is better", "lower": "↓ lower is better", "true": "true is better"}


def _na(value: Any) -> bool:
    import pandas as pd

    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def _num(value: Any, measure: str, signed: bool = False) -> str:
    """A value of ``measure`` (dollars for cost); ``signed``: a difference, with its + or −."""
    if _na(value):
        return "NA"
    v = float(value)
    body = f"${abs(v):,.4f}" if measure == "cost_usd" else (f"{abs(v):,.0f}" if abs(v) >= 100 else f"{abs(v):.2f}")
    return ("−" if v < 0 else ("+" if signed and v > 0 else "")) + body


def _yes_no(value: Any) -> str:
    """A boolean score of a case: true or false, or the share true over its epochs."""
    return "NA" if _na(value) else {0.0: "false", 1.0: "true"}.get(float(value), f"{float(value):.0%} true")


def _p(value: Any) -> str:
    if _na(value):
        return "NA"
    return "<0.001" if float(value) < 0.001 else f"{float(value):.3f}"


def comparison_table_html(c: ComparisonSource) -> str:
    e = html.escape
    s = c.settings
    level = s.level
    parts = [f"<div class='agentnb-batch-compare'><p><b>{e(f'batch {c.batch}: each variant against the baseline')}"
             f" {e(c.baseline_label)} (variant {c.baseline}), paired by case</b><br><span style='font-size:11px;"
             f"color:#777'>diff = variant − baseline, case by case (a case's epochs averaged first); {e(level)} CI: "
             f"{e(BOOTSTRAP)} ({s.n_resamples:,} resamples); p: {e(c.frame['test'].iloc[0]) if len(c.frame) else ''}"
             f", two-sided; <span style='color:{OK_COLOUR}'>green: better</span>, <span style='color:{ERROR_COLOUR}'>"
             f"red: worse</span> (p &lt; {s.alpha:.2g} and the interval excludes 0); scores: higher is better (a yes/no "
             "score: true), cost and tokens: lower is better</span></p>"]
    few = c.frame[c.frame["verdict"] == "too few cases"]
    if len(few):
        n = int(few["n"].min())
        need = min_cases(s.alpha)
        text = (f"Too few cases for the test to mean anything: with n = {n} paired cases the smallest p-value a "
                f"paired permutation test can give is {2 / 2 ** n:.3g}, not below {s.alpha:.2g} whatever the data; "
                f"it needs {need} or more cases (epochs do not add cases), and so few cases make too narrow intervals.")
        parts.append(f"<p class='agentnb-too-few' style='color:{ERROR_COLOUR}'>{e(text)}</p>")
    heads = ["variant", "measure", "better", "n", "baseline mean", "mean", "diff", f"{level} CI", "p", "better / worse"
             " / tied", "verdict"]
    parts.append("<table class='agentnb-batch-comparison' style='width:auto;max-width:100%'><thead><tr>"
                 + "".join(f"<th style='{_HEAD}{';text-align:left' if i < 3 else ''}'>{e(h)}</th>"
                           for i, h in enumerate(heads)) + "</tr></thead><tbody>")
    for _, r in c.frame.iterrows():
        m = str(r["measure"])
        colour = _COLOURS.get(str(r["verdict"]))
        style = f" style='color:{colour};font-weight:600'" if colour else ""
        cells = [str(r["variant_label"]), m, _BETTER[str(r["better"])]]
        parts.append(f"<tr data-variant='{int(r['variant'])}' data-measure='{e(m, quote=True)}'"
                     f" data-verdict='{e(str(r['verdict']), quote=True)}'{style}>"
                     + "".join(f"<td style='{_CELL};text-align:left'>{e(x)}</td>" for x in cells)
                     + f"<td style='{_CELL}'>{int(r['n'])}</td><td style='{_CELL}'>{_num(r['baseline_mean'], m)}</td>"
                     f"<td style='{_CELL}'>{_num(r['mean'], m)}</td><td style='{_CELL}'>{_num(r['diff'], m, True)}</td>"
                     f"<td style='{_CELL}'>{_num(r['ci_low'], m, True)} to {_num(r['ci_high'], m, True)}</td>"
                     f"<td style='{_CELL}'>{_p(r['p_value'])}</td><td style='{_CELL}'>{int(r['better_cases'])} / "
                     f"{int(r['worse_cases'])} / {int(r['tied_cases'])}</td>"
                     f"<td style='{_CELL};text-align:left'>{e(str(r['verdict']))}</td></tr>")
    parts.append("</tbody></table>")
    for variant in c.frame["variant"].drop_duplicates():
        parts.append(_case_lists(c.cases[c.cases["variant"] == variant], c))
    parts.append("</div>")
    return "".join(parts)


def _case_lists(cases: pd.DataFrame, c: ComparisonSource) -> str:
    """The worse and the better cases of one variant, each with the commands that open the two jobs."""
    e = html.escape
    out = []
    for outcome in ("worse", "better"):
        rows = cases[cases["outcome"] == outcome]
        if not len(rows):
            continue
        head = f"{outcome} than the baseline, case by case: {rows['variant_label'].iloc[0]} (variant " \
               f"{int(rows['variant'].iloc[0])})"
        out.append(f"<p>{e(head)}</p><ul class='agentnb-cases-{outcome}' style='color:{_COLOURS[outcome]}'>")
        for _, r in rows.head(CASES_SHOWN).iterrows():
            m, a, b = str(r["measure"]), int(r["baseline_job"]), int(r["job"])
            was, now = (_yes_no(r[k]) if r["better"] == "true" else _num(r[k], m) for k in ("baseline_value", "value"))
            what = f"case {int(r['case'])}, {m}: {was} → {now}"
            epochs = f" (mean of {int(r['epochs'])} epochs; first epoch's jobs)" if int(r["epochs"]) > 1 else ""
            out.append(f"<li data-case='{int(r['case'])}'>{e(what + epochs)} — <code>%agent show {a}</code> · "
                       f"<code>%agent show {b}</code> · <code>%agent compare {a} {b}</code></li>")
        more = len(rows) - CASES_SHOWN
        if more > 0:
            out.append(f"<li>… and {more} more: see the comparison's <code>.cases</code></li>")
        out.append("</ul>")
    return "".join(out)
