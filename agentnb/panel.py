"""The ``%agent panel`` widget: pick, run, step, stop and answer jobs, and watch them live.

Layout (top to bottom): the job list (status, piece, tokens); the piece and model
chooser with the instruction box and the Run / Step / Step call / Stop buttons; the
reply box (enabled only when the selected job waits for a human); a progress bar of
movements run against the piece's ``max_movements``; a context-usage bar of the newest
movement run with its threshold marks; and the live view of the selected job
(:func:`agentnb.render.job_html`).

Actions run in a thread so the notebook stays responsive; a second thread polls the
store and refreshes the widgets as events are written.  :meth:`Panel.wait` joins them
(for scripts and tests).  Problems (a bad model spec, an unknown piece, a job another
process is running) are shown on the panel's message line rather than raised into the
widget machinery, where they would be lost.
"""

from __future__ import annotations

import html
import threading
from typing import TYPE_CHECKING, Any, Callable

import ipywidgets as w

from .models import ModelSpecError
from .pieces import DEFAULT_THRESHOLDS, PieceError, available_pieces
from .render import job_html, job_stats
from .store import StoreError

if TYPE_CHECKING:
    from .magic import AgentMagic
    from .workspace import Job, Workspace

__all__ = ["Panel", "context_bar_html"]

_PROBLEMS = (PieceError, ModelSpecError, StoreError, FileNotFoundError, ValueError)
_MARK_COLOURS = {"warn": "#c9a200", "prompt": "#e07b00", "force_transition": "#d03a3a", "exhausted": "#8b0000"}


def context_bar_html(ratio: float | None, thresholds: dict[str, float], tokens: int | None = None,
                     window: int | None = None) -> str:
    """A horizontal bar of the context used (``ratio`` of the window) with a mark at each threshold."""
    r = max(0.0, min(1.0, ratio or 0.0))
    colour = "#2e8b57"
    for name in ("warn", "prompt", "force_transition", "exhausted"):
        if ratio is not None and ratio >= thresholds.get(name, 2.0):
            colour = _MARK_COLOURS[name]
    marks = "".join(
        f'<div title="{html.escape(name)} {value:.0%}" data-mark="{html.escape(name)}" '
        f'style="position:absolute;left:{value * 100:.1f}%;top:-3px;height:18px;border-left:2px solid '
        f'{_MARK_COLOURS.get(name, "#555")}"></div>'
        for name, value in sorted(thresholds.items(), key=lambda kv: kv[1])
    )
    label = "no LLM call yet in this movement" if ratio is None else f"context {ratio:.0%}"
    if ratio is not None and tokens is not None and window:
        label += f" ({tokens:,} / {window:,} tokens)"
    legend = " · ".join(f"{name} {value:.0%}" for name, value in sorted(thresholds.items(), key=lambda kv: kv[1]))
    return (f'<div class="anb-ctx" data-ratio="{r:.4f}" style="min-width:300px">'
            f'<div style="position:relative;height:12px;background:rgba(127,127,127,.2);border-radius:2px;margin:4px 0">'
            f'<div style="width:{r * 100:.1f}%;height:100%;background:{colour};border-radius:2px"></div>{marks}</div>'
            f'<div style="font-size:11px">{html.escape(label)} <span style="color:#777">· thresholds: '
            f"{html.escape(legend)}</span></div></div>")


class Panel(w.VBox):
    """Run, step, stop and answer jobs of a :class:`Workspace`, with a live view of the selected one."""

    def __init__(self, ws: "Workspace", *, magic: "AgentMagic | None" = None, poll: float = 0.3) -> None:
        self.ws = ws
        self.magic = magic
        self.poll = poll
        self._thread: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._lock = threading.RLock()

        self.jobs = w.Select(options=[], rows=6, description="Jobs", layout=w.Layout(width="100%"))
        self.refresh_button = w.Button(description="Refresh", icon="refresh")
        pieces = sorted(available_pieces())
        default_piece = magic.piece if magic is not None else "plan-implement-verify"
        if default_piece not in pieces:
            pieces.append(default_piece)
        self.piece = w.Dropdown(options=pieces, value=default_piece, description="Piece")
        self.model = w.Combobox(value=magic.model if magic is not None else "demo",
                                options=["demo", "openai:gpt-4o-mini", "openai:gpt-4o"],
                                description="Model", ensure_option=False)
        self.instruction = w.Textarea(placeholder="What should the job do?", description="Instruction",
                                      layout=w.Layout(width="100%", height="70px"))
        self.run_button = w.Button(description="Run", button_style="primary", icon="play")
        self.step_button = w.Button(description="Step", icon="step-forward", tooltip="run the next movement")
        self.step_call_button = w.Button(description="Step call", icon="forward", tooltip="run the next LLM call")
        self.stop_button = w.Button(description="Stop", button_style="warning", icon="stop",
                                    tooltip="pause after the current LLM call")
        self.reply_text = w.Text(placeholder="Your answer to the job's question", description="Reply",
                                 layout=w.Layout(width="70%"))
        self.reply_button = w.Button(description="Reply", icon="reply")
        self.movements = w.IntProgress(value=0, min=0, max=1, description="Movements")
        self.movements_label = w.Label()
        self.context = w.HTML()
        self.message = w.HTML()
        self.view = w.HTML()

        self.refresh_button.on_click(lambda _: self.refresh())
        self.run_button.on_click(lambda _: self._act(self._run))
        self.step_button.on_click(lambda _: self._act(lambda: self._step("movement")))
        self.step_call_button.on_click(lambda _: self._act(lambda: self._step("call")))
        self.stop_button.on_click(lambda _: self._stop())
        self.reply_button.on_click(lambda _: self._act(self._reply))
        self.jobs.observe(lambda _: self._show(), names="value")

        super().__init__([
            w.HBox([self.jobs, self.refresh_button]),
            w.HBox([self.piece, self.model]),
            self.instruction,
            w.HBox([self.run_button, self.step_button, self.step_call_button, self.stop_button]),
            w.HBox([self.reply_text, self.reply_button]),
            w.HBox([self.movements, self.movements_label]),
            self.context,
            self.message,
            self.view,
        ])
        self.refresh()
        if self.jobs.options and magic is not None and magic.last_job is not None:
            self.select(magic.last_job)

    def __repr__(self) -> str:
        # ipywidgets saves repr() as the output's text/plain: it is what a saved notebook shows where
        # the widget cannot be drawn (GitHub, nbviewer, no kernel), instead of the widget tree.
        return f"agentnb panel of workspace {self.ws.root.name!r} (interactive: run the cell in a live kernel)"

    # -- state -------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def job(self) -> "Job | None":
        """The selected job (read again from the store)."""
        return None if self.jobs.value is None else self.ws.job(self.jobs.value)

    def select(self, job_id: int) -> None:
        self.refresh()
        self.jobs.value = job_id

    def refresh(self) -> None:
        """Re-read the job list and redraw the selected job."""
        with self._lock:
            frame = self.ws.frames.jobs()
            options = [(f"#{r.job} · {r.status} · {r.piece} · {int(r.total_tokens):,} tokens", int(r.job))
                       for r in frame.itertuples()]
            selected = self.jobs.value
            if [o[1] for o in options] != [o[1] for o in self.jobs.options] or \
                    [o[0] for o in options] != [o[0] for o in self.jobs.options]:
                self.jobs.options = options
                if selected in {o[1] for o in options}:
                    self.jobs.value = selected
            self._show()

    def _show(self) -> None:
        with self._lock:
            job = self.job
            if job is None:
                self.view.value = '<div style="color:#777">no job selected</div>'
                self.movements.value, self.movements.max = 0, 1
                self.movements_label.value = ""
                self.context.value = context_bar_html(None, dict(DEFAULT_THRESHOLDS))
            else:
                st = job_stats(self.ws, job.id)
                piece = self.ws.piece(job.id)
                self.movements.max = piece.max_movements
                self.movements.value = min(st.movements, piece.max_movements)
                self.movements_label.value = f"{st.movements} of {piece.max_movements} movements"
                self.context.value = context_bar_html(st.last_ratio, dict(piece.thresholds), st.last_tokens, st.window)
                self.view.value = job_html(self.ws, job.id)
            self._enable(job)

    def _enable(self, job: "Job | None") -> None:
        busy = self.busy
        status = None if job is None else str(job.status)
        self.run_button.disabled = busy
        self.step_button.disabled = self.step_call_button.disabled = busy or status != "queued"
        self.stop_button.disabled = not busy
        self.reply_button.disabled = self.reply_text.disabled = busy or status != "waiting_human"

    def _say(self, text: str, error: bool = False) -> None:
        colour = "#b00020" if error else "#555"
        self.message.value = f'<div style="color:{colour}">{html.escape(text)}</div>' if text else ""

    # -- actions -----------------------------------------------------------------
    def _act(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` in a thread while a watcher keeps the widgets up to date."""
        if self.busy:
            self._say("a job is already running from this panel; Stop it or wait", error=True)
            return
        self._say("")

        def work() -> None:
            try:
                fn()
            except _PROBLEMS as exc:
                self._say(" ".join(str(exc).split()), error=True)
            except Exception as exc:  # noqa: BLE001 - shown, not lost in the widget's callback
                self._say(f"{type(exc).__name__}: {' '.join(str(exc).split())}", error=True)

        self._thread = threading.Thread(target=work, name="agentnb-panel", daemon=True)
        self._thread.start()
        self._watcher = threading.Thread(target=self._watch, args=(self._thread,), name="agentnb-panel-watch",
                                         daemon=True)
        self._watcher.start()
        self._enable(self.job)

    def _watch(self, thread: threading.Thread) -> None:
        seen = -1
        while thread.is_alive():
            job_id = self.jobs.value
            mark = self.ws.store.last_event_id(job_id) if job_id is not None else 0
            if mark != seen:
                seen = mark
                self._show()
            thread.join(self.poll)
        self.refresh()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the panel's current action and its final refresh are done."""
        for t in (self._thread, self._watcher):
            if t is not None:
                t.join(timeout)

    def _run(self) -> None:
        job = self.job
        text = self.instruction.value.strip()
        if text:
            job = self.ws.submit(text, piece=self.piece.value, model=self.model.value.strip())
            self.instruction.value = ""
            if self.magic is not None:
                self.magic.last_job = job.id
            self.select(job.id)
        elif job is None or str(job.status) != "queued":
            raise ValueError("write an instruction to start a new job (or select a queued job to continue it)")
        self.ws.run(job.id)

    def _step(self, unit: str) -> None:
        job = self.job
        if job is None:
            raise ValueError("select a job first")
        self.ws.step(job.id, unit=unit)

    def _stop(self) -> None:
        job = self.job
        if job is not None and self.busy:
            self.ws.stop(job.id)
            self._say(f"job {job.id} will pause after its current LLM call")

    def _reply(self) -> None:
        job = self.job
        if job is None:
            raise ValueError("select a job first")
        text = self.reply_text.value.strip()
        if not text:
            raise ValueError("write your answer in the Reply box first")
        job = self.ws.reply(job.id, text)
        self.reply_text.value = ""
        if str(job.status) == "queued":
            self.ws.run(job.id)
