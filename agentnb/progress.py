"""A batch's progress: the live bar while its jobs run, and the one final line it leaves when they stop.

The bar is ``tqdm.auto``'s: a widget in Jupyter, text on stderr in a terminal.  A widget does not outlive its
kernel: after a restart, on reopening, on GitHub and nbviewer, JupyterLab draws "Error displaying widget: model
not found" where it was, and the output's saved text is the bar's first state (``0%| | 0/10``).  So when the run
ends — complete, paused (Ctrl-C, the notebook's Stop, SIGTERM) or stopped by an error — the widget's output is
replaced through its display id by a static final line (text/plain and text/html, saved with the notebook) and
the widget is closed; in a terminal the text bar is cleared and the line printed in its place::

    batch exp-1 · 10/10 · 5 ok · 5 waiting · 12,340 tokens · $0.0400 · 8.2 s

The live bar is not green while jobs wait for a reply (purple, as the job view's badge) or have failed (red);
the final line's HTML draws the same colours as a stacked bar, one segment per outcome.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from .models.prices import dollars
from .store.base import WAITING_STATES, JobStatus
from .views.style import OK_COLOUR, STATUS_COLOURS

__all__ = ["BatchProgress", "Outcome", "final_html", "final_line", "live_postfix"]

# how many waiting job ids the final line's hint names before "…"
_IDS_SHOWN = 12


@dataclass(frozen=True)
class Outcome:
    """What a run of ``total`` jobs came to: each returned job's status, the skipped ones, usage and time.

    ``stopped`` is how the run ended: ``""`` (every job's run returned), ``"paused"`` (an interrupt),
    ``"error"`` (an exception, a store that failed, say) or why it paused (``cost limit reached: $1.03 of $1.00``)."""

    total: int
    statuses: Mapping[int, str]
    skipped: int = 0
    tokens: int = 0
    cost: float | None = 0.0
    seconds: float = 0.0
    stopped: str = ""

    def counts(self) -> dict[str, int]:
        """ok, failed, aborted, waiting (for a reply or for subtasks), paused (back in the queue), skipped
        (another process runs them), not started; ``done`` is those that came to a rest (ok to waiting)."""
        values = list(self.statuses.values())
        out = {
            "ok": values.count(JobStatus.succeeded), "failed": values.count(JobStatus.failed),
            "aborted": values.count(JobStatus.aborted),
            "waiting": sum(1 for s in values if s in WAITING_STATES),
            "paused": sum(1 for s in values if s in (JobStatus.queued, JobStatus.running)),
            "skipped": self.skipped,
        }
        out["not started"] = max(0, self.total - len(values) - self.skipped)
        out["done"] = out["ok"] + out["failed"] + out["aborted"] + out["waiting"]
        return out

    def waiting_ids(self) -> list[int]:
        return sorted(j for j, s in self.statuses.items() if s == JobStatus.waiting_human)

    def state(self) -> str:
        """The colour state of the whole run: the worst outcome of any job (or of the run itself)."""
        n = self.counts()
        if self.stopped == "error" or n["failed"] or n["aborted"]:
            return "failed"
        if n["waiting"]:
            return "waiting"
        if self.stopped or n["paused"] or n["not started"] or n["skipped"]:
            return "paused"
        return "ok"


# the segments of the final line's bar, in order, and the colour of each (as the job view's status badges)
_SEGMENTS = (("ok", OK_COLOUR), ("failed", STATUS_COLOURS[JobStatus.failed]),
             ("aborted", STATUS_COLOURS[JobStatus.aborted]), ("waiting", STATUS_COLOURS[JobStatus.waiting_human]),
             ("paused", STATUS_COLOURS["paused"]), ("skipped", STATUS_COLOURS[JobStatus.queued]),
             ("not started", "rgba(127,127,127,.35)"))
_STATE_COLOURS = {"ok": OK_COLOUR, "failed": STATUS_COLOURS[JobStatus.failed],
                  "waiting": STATUS_COLOURS[JobStatus.waiting_human],
                  "paused": STATUS_COLOURS["paused"]}


def _seconds(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def _money(cost: float | None) -> str:
    return "cost unknown" if cost is None else dollars(cost)


def _parts(outcome: Outcome) -> list[tuple[str, str]]:
    """The line's parts after its title, each with the outcome it counts ("" for the others)."""
    n = outcome.counts()
    # any other text: why the run stopped in its own words (a batch's cost limit reached, agentnb/budgets.py)
    parts = [("", {"paused": "paused", "error": "stopped by an error"}.get(outcome.stopped, outcome.stopped))] \
        if outcome.stopped else []
    parts.append(("", f"{n['done']}/{outcome.total}"))
    parts += [(key, f"{n[key]} {key}") for key, _ in _SEGMENTS if n[key] or key == "ok"]
    parts += [("", f"{outcome.tokens:,} tokens"), ("", _money(outcome.cost)), ("", _seconds(outcome.seconds))]
    return parts


def final_line(title: str, outcome: Outcome) -> str:
    """``batch exp-1 · 10/10 · 5 ok · 5 waiting · 12,340 tokens · $0.0400 · 8.2 s``."""
    return " · ".join([title, *(text for _, text in _parts(outcome))])


def _waiting_hint(outcome: Outcome, resume: str) -> str:
    ids = outcome.waiting_ids()
    if not ids:
        return ""
    shown = ", ".join(map(str, ids[:_IDS_SHOWN])) + (", …" if len(ids) > _IDS_SHOWN else "")
    return (f"job(s) {shown} wait for a reply: answer each (%agent reply JOB \"…\" or ws.reply(JOB, \"…\"); the "
            f"batch's view lists their questions), then resume with {resume}")


def final_html(title: str, outcome: Outcome, resume: str = "") -> str:
    """The final line as HTML: a stacked bar of the outcomes, the line, and what to do about waiting jobs."""
    n = outcome.counts()
    state = outcome.state()
    bar = "".join(f'<span data-outcome="{key}" title="{n[key]} {key}" style="flex:{n[key]} 0 0;background:{colour}">'
                  "</span>" for key, colour in _SEGMENTS if n[key])
    words = []
    for key, text in _parts(outcome):
        colour = dict(_SEGMENTS).get(key) if key not in ("", "not started", "skipped") else None
        words.append(f'<span style="color:{colour};font-weight:600">{html.escape(text)}</span>' if colour
                     else html.escape(text))
    hint = _waiting_hint(outcome, resume) if resume else ""
    more = (f'<div class="anb-batch-hint" style="color:{_STATE_COLOURS["waiting"]}">{html.escape(hint)}</div>'
            if hint else "")
    return (f'<div class="anb-batch-end" data-state="{state}" style="font-size:13px;line-height:1.5;margin:2px 0">'
            f'<div style="display:flex;height:6px;max-width:520px;border-radius:3px;overflow:hidden;'
            f'background:rgba(127,127,127,.2);margin:3px 0">{bar}</div>'
            f'<div class="anb-batch-line"><b>{html.escape(title)}</b> · {" · ".join(words)}</div>{more}</div>')


def live_postfix(statuses: Mapping[int, str], tokens: int, cost: float | None) -> str:
    """The live bar's right-hand text: ``3 ok, 0 failed, 2 waiting · 1,234 tokens · $0.0012``."""
    values = list(statuses.values())
    failed = sum(1 for s in values if s in (JobStatus.failed, JobStatus.aborted))
    waiting = sum(1 for s in values if s in WAITING_STATES)
    text = f"{values.count(JobStatus.succeeded)} ok, {failed} failed"
    if waiting:
        text += f", {waiting} waiting"
    return f"{text} · {tokens:,} tokens · {_money(cost)}"


class BatchProgress:
    """The bar of one run of jobs: :meth:`update` while they run, :meth:`write` for a line beside it, and
    :meth:`finish` once, which leaves the final line in its place."""

    def __init__(self, total: int, title: str, file: TextIO) -> None:
        self.total, self.title, self.file = total, title, file
        self._handle: Any = None
        self._colour: str | None = None
        self.bar = self._notebook_bar() or self._text_bar()

    def _notebook_bar(self) -> Any:
        """A ``tqdm.notebook`` widget shown under a display id (so that :meth:`finish` can replace it), or None
        outside a kernel or where the widget cannot be drawn (no or too old ipywidgets)."""
        try:
            from IPython.display import display
            from tqdm.auto import tqdm as auto_tqdm  # type: ignore[import-untyped]
            from tqdm.notebook import tqdm_notebook  # type: ignore[import-untyped]

            if not (isinstance(auto_tqdm, type) and issubclass(auto_tqdm, tqdm_notebook)):
                return None
            bar = auto_tqdm(total=self.total, desc=self.title, unit="job", file=self.file, dynamic_ncols=True,
                            display=False)
        except Exception:  # tqdm.notebook raises when ipywidgets is missing or too old
            return None
        bundle = dict(bar.container._repr_mimebundle_())
        # the text a notebook keeps if the kernel dies before finish() replaces the widget: not "0%| | 0/10"
        bundle["text/plain"] = f"{self.title}: {self.total} job(s) running (a live progress bar)"
        self._handle = display(bundle, raw=True, display_id=True)
        return bar

    def _text_bar(self) -> Any:
        from tqdm.std import tqdm as text_tqdm  # type: ignore[import-untyped]

        # leave=False: finish() prints the final line where the bar was
        return text_tqdm(total=self.total, desc=self.title, unit="job", file=self.file, dynamic_ncols=True,
                         leave=False)

    def update(self, ended: int, statuses: Mapping[int, str], tokens: int, cost: float | None) -> None:
        """Move the bar to ``ended`` jobs, say the counts so far, and colour it by the worst outcome so far."""
        if ended > self.bar.n:
            self.bar.update(ended - self.bar.n)
        self.bar.set_postfix_str(live_postfix(statuses, tokens, cost), refresh=True)
        if self._handle is not None:
            state = Outcome(self.total, statuses, skipped=0).state()
            # the widget's own colours until something is wrong: never tqdm's green over waiting or failed jobs
            colour = _STATE_COLOURS[state] if state in ("failed", "waiting") else None
            if colour != self._colour:
                self._colour = self.bar.colour = colour

    def write(self, text: str) -> None:
        """A line of its own on the bar's stream, even while the text bar is drawn."""
        self.bar.write(text, file=self.file)

    def finish(self, outcome: Outcome, resume: str = "") -> str:
        """Close the bar and leave the final line in its place; returns the line."""
        line = final_line(self.title, outcome)
        state = outcome.state()
        if self._handle is None:
            self.bar.close()
            print(line, file=self.file, flush=True)
            return line
        if state != "ok":
            self.bar.colour = _STATE_COLOURS[state]  # tqdm's close() paints a full bar green otherwise
        self.bar.close()
        hint = _waiting_hint(outcome, resume) if resume else ""
        text = line + (f"\n{hint}" if hint else "")
        self._handle.update({"text/plain": text, "text/html": final_html(self.title, outcome, resume)}, raw=True)
        # its models are gone from the kernel and from the widget state JupyterLab saves
        for child in self.bar.container.children:
            child.close()
        self.bar.container.close()
        return line

