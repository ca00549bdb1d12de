"""The "scores" section of a job's view (docs/design-lab.md#llm-judge): the latest score of each name, and every call
an LLM judge made on the job (``purpose: "judge"``, outside any movement run) with its model, tokens, latency, cost
and verdict.  ``render.py`` appends it after the movement runs; it reads the folded timeline only.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Mapping

from .._secrets import scrub
from ..events import LLMResponse, ScoreEvent
from ..models.prices import call_costs, dollars

__all__ = ["judge_verdict", "scores_html"]


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def judge_verdict(ev: LLMResponse) -> str:
    """A judge's answer in words: ``score 4 — reason``, or what it said instead of a verdict."""
    for call in ev.tool_calls:
        if call.name == "verdict":
            args = call.arguments
            if isinstance(args, Mapping):
                reason = str(args.get("reason") or "").strip()
                return f"score {json.dumps(args.get('score'), ensure_ascii=False)}" + (f" — {reason}" if reason else "")
            return f"verdict with arguments {str(args)[:200]}"
    said = " ".join((ev.content or "").split())
    return f"no verdict: {said[:200]}" if said else "no verdict (an empty answer)"


def _score_line(ev: ScoreEvent) -> str:
    if ev.error is not None:
        return f'<li><b>{_e(ev.name)}</b>: <span class="anb-error">✖ {_e(ev.error)}</span></li>'
    value = f"{ev.value:.4g}" if isinstance(ev.value, float) else json.dumps(ev.value, ensure_ascii=False)
    return f"<li><b>{_e(ev.name)}</b> = {_e(value)}</li>"


def _judge_line(ev: LLMResponse, job_model: str) -> str:
    spec = ev.model or job_model
    cost = call_costs(spec, [ev.usage.prompt_tokens], [ev.usage.completion_tokens], [ev.ts])[0]
    price = "cost unknown" if cost is None else dollars(cost)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ev.ts))
    latency = f" · {ev.latency_s:.2f} s" if ev.latency_s is not None else ""
    head = (f"{when} UTC · <code>{_e(scrub(spec))}</code> · {ev.usage.total_tokens:,} tokens "
            f'<span class="anb-dim">({ev.usage.prompt_tokens:,} + {ev.usage.completion_tokens:,})</span>'
            f"{latency} · {_e(price)}")
    return f'<li>{head}<div>{_e(judge_verdict(ev))}</div></li>'


def scores_html(scores: Mapping[str, ScoreEvent], judge_calls: tuple[LLMResponse, ...], job_model: str) -> str:
    """The section (a closed ``<details>``), or nothing for a job never scored nor judged."""
    if not scores and not judge_calls:
        return ""
    parts = [f'<details class="anb-scores"><summary><b>scores</b> <span class="anb-dim">({len(scores)} latest'
             + (f", {len(judge_calls)} judge call{'s' if len(judge_calls) != 1 else ''}" if judge_calls else "")
             + ")</span></summary>"]
    if scores:
        parts.append("<ul>" + "".join(_score_line(ev) for ev in scores.values()) + "</ul>")
    if judge_calls:
        total = [call_costs(ev.model or job_model, [ev.usage.prompt_tokens], [ev.usage.completion_tokens],
                            [ev.ts])[0] for ev in judge_calls]
        spent = "cost unknown" if None in total else dollars(sum(c for c in total if c is not None))
        parts.append(f'<div>LLM judge calls <span class="anb-dim">(purpose judge; {_e(spent)} in all, apart from '
                     "the job's own cost)</span></div><ol>"
                     + "".join(_judge_line(ev, job_model) for ev in judge_calls) + "</ol>")
    parts.append("</details>")
    return "".join(parts)
