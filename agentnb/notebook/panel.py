"""The ``%agent panel`` widget: pick, run, step, stop and answer jobs, and watch them live.

Layout (top to bottom): the job list (status as shown, piece, tokens, cost in US dollars; marks: ``⎇3@2`` a
fork of job 3 at run 2, ``⇊2`` compacted twice, ``⟳1`` a loop monitor fired once, docs/context.md) with Refresh; the
piece and model chooser with the instruction box and the Run / Step / Step call / Stop
buttons; the reply box (enabled only when the selected job waits for a human); a progress
bar of movements run against the piece's ``max_movements``; a context-usage bar of the
newest movement run with its threshold marks; the message line; and the live view of the
selected job (:func:`agentnb.render.job_html`).  Rows wrap, so nothing overflows a narrow
notebook.

Actions run in a thread so the notebook stays responsive (``liveview.LiveView``, shared with the magic).  A
watcher thread redraws the list and the view: on each event of the job the panel's action runs, when that
job is the selected one (the in-process subscription, no store read); otherwise when the store's change mark
moved, read every ``poll`` seconds while a job runs and every ``idle_poll`` seconds otherwise, whoever wrote
it.  :meth:`Panel.wait` joins the current action (for scripts and tests); :meth:`Panel.close` ends the watcher.

Selecting a job fills the Piece and Model boxes with its piece and model, as they would be typed to run
them again (a piece name from the list, the YAML path it was loaded from, else ``NAME (from job N)``: the
piece as job N keeps it in the store), with nothing secret in them (``_secrets.scrub``); Run with an
instruction then starts a new job with them and says so.  What the user types afterwards wins.

Stop acts on the job the panel's own action is running (and that job's subtasks), whichever
job is selected, and the message line says which.  Problems (a bad model spec, an unknown
piece, a job another process is running) are shown on the message line rather than raised
into the widget machinery, where they would be lost.

Where the widget cannot be drawn (a saved notebook reopened after the kernel restarted,
nbviewer, GitHub), a second output shows a saved snapshot: the job list and the selected
job's header.  A live panel hides its own snapshot.
"""

from __future__ import annotations

import html
import math
import numbers
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import ipywidgets as w

from .._secrets import scrub
from ..engine.pieces import DEFAULT_THRESHOLDS, Piece, available_pieces
from ..errors import AgentnbError, UsageError
from ..models.prices import dollars
from ..store.base import JobStatus
from ..views.icons import FORK
from ..views.render import header_html, job_html, job_stats
from ..views.status import PAUSED, display_status, last_status_reason
from ..views.streaming import StreamedCall, stream_html
from ..views.style import ACTION_COLOURS, ACTIONS, ERROR_COLOUR, OK_COLOUR
from .liveview import LiveView

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.display import DisplayHandle

    from ..views.frames import Frames
    from ..workspace import Job, Workspace

__all__ = ["NotebookSession", "Panel", "context_bar_html"]

_RUNNABLE = (JobStatus.queued, PAUSED)  # shown statuses that Step and Run continue
# {name}, $name, or the {{ and }} escapes, in the model box (e.g. scripted:{SCRIPT})
_VAR_REF = re.compile(r"\{\{|\}\}|\{(\w+)\}|\$(\w+)")
_WHOLE_VAR = re.compile(r"\{(\w+)\}|\$(\w+)")
# the piece box's name for a piece the store keeps only as YAML (no file to load it from): job N's piece
_FROM_JOB = re.compile(r"(?P<name>.+?) \(from job (?P<job>\d+)\)")
_PIECE_ALLOWED = ("allowed: a piece name from the list, a YAML path, or a notebook variable holding a Piece "
                  "or a path (PIECE, {PIECE} or $PIECE), or NAME (from job N) for the piece job N ran")
_FALLBACK_ROWS = 30  # newest jobs listed in the saved snapshot
_FALLBACK_EVERY = 2.0  # seconds between snapshot updates while a job runs


class NotebookSession(Protocol):
    """What the panel shares with the ``%agent`` magic that opened it (``AgentMagic`` is one): the default
    piece and model, the notebook's shell (its variables fill the piece and model boxes) and the last job."""

    @property
    def piece(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def shell(self) -> InteractiveShell | None: ...

    last_job: int | None

    def holding(self, ws: Workspace) -> AbstractContextManager[None]:
        """Keep ``ws`` open while the block runs, even if the session's settings replace it meanwhile."""
        ...


def context_bar_html(ratio: float | None, thresholds: dict[str, float], tokens: int | None = None,
                     window: int | None = None) -> str:
    """A horizontal bar of the context used (``ratio`` of the window) with a mark at each threshold."""
    r = max(0.0, min(1.0, ratio or 0.0))
    colour = OK_COLOUR
    for name in ACTIONS:
        if ratio is not None and ratio >= thresholds.get(name, 2.0):
            colour = ACTION_COLOURS[name]
    marks = "".join(
        f'<div title="{html.escape(name)} {value:.0%}" data-mark="{html.escape(name)}" '
        f'style="position:absolute;left:{value * 100:.1f}%;top:-3px;height:18px;border-left:2px solid '
        f'{ACTION_COLOURS.get(name, "#555")}"></div>'
        for name, value in sorted(thresholds.items(), key=lambda kv: kv[1])
    )
    label = "no LLM call yet in this movement" if ratio is None else f"context {ratio:.0%}"
    if ratio is not None and tokens is not None and window:
        label += f" ({tokens:,} / {window:,} tokens)"
    legend = " · ".join(f"{name} {value:.0%}" for name, value in sorted(thresholds.items(), key=lambda kv: kv[1]))
    return (f'<div class="anb-ctx" data-ratio="{r:.4f}" style="min-width:0">'
            f'<div style="position:relative;height:12px;background:rgba(127,127,127,.2);border-radius:2px;margin:4px 0">'
            f'<div style="width:{r * 100:.1f}%;height:100%;background:{colour};border-radius:2px"></div>{marks}</div>'
            f'<div style="font-size:11px;line-height:1.4">{html.escape(label)} <span style="color:#777">· thresholds: '
            f"{html.escape(legend)}</span></div></div>")


def _row(*children: w.Widget) -> w.HBox:
    # wrap instead of overflowing when the notebook is narrow
    return w.HBox(list(children), layout=w.Layout(flex_flow="row wrap", width="100%", align_items="center"))


class Panel(w.VBox):
    """Run, step, stop and answer jobs of a :class:`Workspace`, with a live view of the selected one.

    ``namespace`` is where the piece box looks up notebook variables (default: the notebook's,
    through ``magic`` or the running IPython).
    """

    def __init__(self, ws: Workspace, *, magic: NotebookSession | None = None, poll: float = 0.3,
                 idle_poll: float = 1.0, namespace: Mapping[str, Any] | None = None) -> None:
        self.ws = ws
        self.magic = magic
        self.poll = poll
        self.idle_poll = idle_poll
        self._namespace_arg = namespace
        self._lock = threading.RLock()
        # runs the panel's actions in a thread and wakes the watcher on each event of the job they run (liveview.py)
        self._live = LiveView(ws.execution, name="agentnb-panel")
        self._busy = False
        self._target: int | None = None  # the job the panel's current action runs
        self._stop_requested = threading.Event()
        self._closed = threading.Event()
        self._any_running = False
        self._relisting: int | None = None  # the thread that is replacing the job list's options
        # (job id, (last event id, row updated), shown status) of the job drawn in the view
        self._shown: tuple[int | None, tuple[int, float] | None, str] = (None, None, "")
        self._token = uuid.uuid4().hex[:12]
        self._fallbacks: list[DisplayHandle] = []
        self._fallback_sent = ""
        self._fallback_at = 0.0
        self._filled: int | None = None  # the job whose piece and model the boxes were last filled with
        # (the Model box's text as filled, the job's own spec): the spec it stands for, secrets masked in the box
        self._model_shown: tuple[str, str] | None = None

        self.jobs = w.Select(options=[], rows=6, description="Jobs", tooltip=_JOB_MARKS,
                             layout=w.Layout(flex="1 1 320px", width="auto", min_width="0"))
        self.refresh_button = w.Button(description="Refresh", icon="refresh",
                                       tooltip="re-read the jobs and the pieces in ./pieces")
        default_piece = magic.piece if magic is not None else "plan-implement-verify"
        self.piece = w.Combobox(value=default_piece, options=self._piece_names(), ensure_option=False,
                                description="Piece",
                                placeholder="a piece name, a YAML path or a notebook variable",
                                tooltip="a piece name from the list, a YAML path, a notebook variable "
                                        "holding a Piece or a path (PIECE, {PIECE} or $PIECE), or "
                                        "NAME (from job N): the piece job N ran; selecting a job fills it in",
                                layout=w.Layout(flex="1 1 260px", width="auto", min_width="0"))
        self.model = w.Combobox(value=magic.model if magic is not None else "demo",
                                options=["demo", "openai:gpt-4o-mini", "openai:gpt-4o"],
                                description="Model", ensure_option=False,
                                tooltip="demo | scripted:<file.yaml> | openai:<model> | replay:<job id>; "
                                        "{name} and $name are filled from the notebook; selecting a job "
                                        "fills it in",
                                layout=w.Layout(flex="1 1 260px", width="auto", min_width="0"))
        self.instruction = w.Textarea(placeholder="What should the job do?", description="Instruction",
                                      layout=w.Layout(width="auto", height="70px", min_width="0"))
        self.run_button = w.Button(description="Run", button_style="primary", icon="play",
                                   tooltip="submit the instruction as a new job on the Piece and Model shown and run it "
                                           "(or, with no instruction, continue the selected queued or "
                                           "paused job)")
        self.step_button = w.Button(description="Step", icon="step-forward", tooltip="run the next movement")
        self.step_call_button = w.Button(description="Step call", icon="forward", tooltip="run the next LLM call")
        self.stop_button = w.Button(description="Stop", button_style="warning", icon="stop",
                                    tooltip="pause the job this panel is running after its current LLM call")
        self.reply_text = w.Text(placeholder="Your answer to the job's question", description="Reply",
                                 layout=w.Layout(flex="1 1 300px", width="auto", min_width="0"))
        self.reply_button = w.Button(description="Reply", icon="reply")
        self.movements = w.IntProgress(value=0, min=0, max=1, description="Movements")
        self.movements_label = w.Label()
        self.context = w.HTML()
        self.message = w.HTML()
        self.view = w.HTML()
        # the running call's streamed text, below the view and apart from it: drawn alone, up to ten times a second,
        # without redrawing the view (docs/notebook.md#streaming); hidden when nothing streams
        self.stream = w.HTML(layout=w.Layout(display="none"))
        # A live panel hides its saved snapshot (see _ipython_display_); a dead one leaves it visible.
        self._live_style = w.HTML(f"<style>.anb-fb-{self._token}{{display:none}}</style>",
                                  layout=w.Layout(display="none"))

        self.refresh_button.on_click(lambda _: self.refresh(pieces=True))
        self.run_button.on_click(lambda _: self._act(self._run))
        self.step_button.on_click(lambda _: self._act(lambda job_id: self._step(job_id, "movement")))
        self.step_call_button.on_click(lambda _: self._act(lambda job_id: self._step(job_id, "call")))
        self.stop_button.on_click(lambda _: self._stop())
        self.reply_button.on_click(lambda _: self._act(self._reply))
        self.jobs.observe(self._on_select, names="value")

        super().__init__([
            _row(self.jobs, self.refresh_button),
            _row(self.piece, self.model),
            self.instruction,
            _row(self.run_button, self.step_button, self.step_call_button, self.stop_button),
            _row(self.reply_text, self.reply_button),
            _row(self.movements, self.movements_label),
            self.context,
            self.message,
            self.view,
            self.stream,
            self._live_style,
        ], layout=w.Layout(width="100%", min_width="0"))
        self.add_class("anb-panel")
        self.refresh()
        if self.jobs.options and magic is not None and magic.last_job is not None:
            self.select(magic.last_job)
        self._watcher = threading.Thread(target=self._watch, name="agentnb-panel-watch", daemon=True)
        self._watcher.start()

    def __repr__(self) -> str:
        # ipywidgets saves repr() as the output's text/plain: it is what a saved notebook shows where
        # the widget cannot be drawn (GitHub, nbviewer, no kernel), instead of the widget tree.
        return f"agentnb panel of workspace {self.ws.root.name!r} (interactive: run the cell in a live kernel)"

    def _ipython_display_(self, **kwargs: Any) -> None:
        """The widget, then its saved snapshot as a second output.

        JupyterLab draws a widget output with the widget renderer only: after a kernel restart
        it shows "Error displaying widget: model not found" and never falls back to the
        output's text/html.  So the snapshot is an output of its own, kept up to date while
        the panel lives and hidden by the live panel's style.
        """
        from IPython.display import display

        display(self._repr_mimebundle_(**kwargs), raw=True)
        handle = display(self.fallback_bundle(), raw=True, display_id=True)
        if handle is not None:
            self._fallbacks.append(handle)

    def close(self) -> None:
        """Close the widget and end its watcher thread."""
        self._closed.set()
        self._live.close()
        super().close()

    # -- state -------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """True while an action (Run, Step, Reply) started from this panel runs."""
        return self._busy

    @property
    def job(self) -> Job | None:
        """The selected job (read again from the store)."""
        return None if self.jobs.value is None else self.ws.job(self.jobs.value)

    def select(self, job_id: int) -> None:
        self.refresh()
        self.jobs.value = job_id

    def refresh(self, *, pieces: bool = False) -> None:
        """Re-read the job list (and, with ``pieces=True``, the piece files) and redraw the selected job."""
        with self._lock:
            if pieces:
                names = self._piece_names()
                if list(self.piece.options) != names:
                    self.piece.options = names
            frame = self.ws.frames.jobs()
            self._any_running = bool((frame["status"] == JobStatus.running).any()) if len(frame) else False
            target = self._target
            rows = frame[["job", "display_status", "piece", "total_tokens", "cost_usd", "forked_from_job",
                          "forked_from_seq"]].to_dict("records")
            marks = _event_marks(self.ws.frames)
            options = [(f"{'▶ ' if int(r['job']) == target else ''}#{r['job']}{_fork_mark(r)}{marks.get(int(r['job']), '')}"
                        f" · {r['display_status']} · "
                        f"{r['piece']} · {int(r['total_tokens']):,} tokens · {_cost(r['cost_usd'])}", int(r["job"]))
                       for r in rows]
            if options != list(self.jobs.options):
                # New options make Select pick the first job: put the selection back in the same message to
                # the browser, and skip the redraw of that first job in between.
                self._relisting = threading.get_ident()
                try:
                    with self.jobs.hold_sync():
                        selected = self.jobs.value
                        self.jobs.options = options
                        if selected in {o[1] for o in options}:
                            self.jobs.value = selected
                finally:
                    self._relisting = None
            self._show()

    def _on_select(self, change: Any) -> None:
        if self._relisting != threading.get_ident():  # a click in the browser, not refresh() relisting
            self._show()

    def _show(self) -> None:
        with self._lock:
            job = self.job
            if job is not None and job.id != self._filled:
                self._fill(job)
            if job is None:
                self._filled = None
                self._shown = (None, None, "")
                self.view.value = '<div style="color:#777">no job selected</div>'
                self.movements.value, self.movements.max = 0, 1
                self.movements_label.value = ""
                self.context.value = context_bar_html(None, dict(DEFAULT_THRESHOLDS))
            elif self._shown[:2] != (job.id, (mark := (self.ws.store.last_event_id(job.id), job.updated))):
                # redrawn only when the selected job moved on: another job's progress costs no render of this one
                st = job_stats(self.ws, job.id)
                self._shown = (job.id, mark, st.status)
                piece = self.ws.piece(job.id)
                self.movements.max = piece.max_movements
                self.movements.value = min(st.movements, piece.max_movements)
                self.movements_label.value = f"{st.movements} of {piece.max_movements} movements"
                # the thresholds the job runs with: its piece's, overridden by the context= it was submitted with
                self.context.value = context_bar_html(st.last_ratio, self.ws.frames.thresholds(job.id),
                                                      st.last_tokens, st.window)
                self.view.value = job_html(self.ws, job.id)
            self._enable(self._shown[2] or None)
            self._update_fallbacks()

    def _fill(self, job: Job) -> None:
        """Show ``job``'s piece and model in the boxes, once per selection: what the user types afterwards wins."""
        self._filled = job.id
        self.piece.value = self._piece_text(job)
        spec = str(job.model)
        # masked (a key typed as a model name must not reach the browser or the saved notebook), braces escaped
        # as the box reads them; the box unchanged stands for the job's own spec (model_choice)
        shown = scrub(spec).replace("{", "{{").replace("}", "}}")
        self._model_shown = (shown, spec)
        self.model.value = shown

    def _piece_text(self, job: Job) -> str:
        """``job``'s piece as the user would type it: a listed name, the YAML path it was loaded from, or
        ``NAME (from job N)`` for a piece the store keeps only as YAML (written in a cell, a fork's edited one)."""
        source = self.ws.piece(job.id).source  # the file it was loaded from, or <piece>, <piece text>, …
        try:
            here = Path(source).resolve()
            for name, path in available_pieces().items():
                if path.resolve() == here:
                    return name
        except (OSError, ValueError):  # not a path at all
            pass
        if Path(source).suffix in (".yaml", ".yml"):
            return source  # loaded from that file again on Run: an edit made to it since is what runs
        return f"{job.piece} (from job {job.id})"

    def _enable(self, status: str | None) -> None:
        busy = self._busy
        _set(self.run_button, not busy, "primary")
        _set(self.step_button, not busy and status in _RUNNABLE)
        _set(self.step_call_button, not busy and status in _RUNNABLE)
        _set(self.stop_button, busy, "warning")
        _set(self.reply_button, not busy and status == JobStatus.waiting_human)
        self.reply_text.disabled = busy or status != JobStatus.waiting_human

    def _say(self, text: str, error: bool = False) -> None:
        colour = ERROR_COLOUR if error else "#555"
        # the widget's line height is a row's (28px): wrapped text would be spaced out
        self.message.value = (f'<div style="color:{colour};line-height:1.4">{html.escape(text)}</div>'
                              if text else "")

    # -- the notebook's variables and the piece box -----------------------------------
    def _namespace(self) -> Mapping[str, Any]:
        if self._namespace_arg is not None:
            return self._namespace_arg
        if self.magic is not None and self.magic.shell is not None:
            return self.magic.shell.user_ns
        try:
            from IPython import get_ipython
        except ImportError:  # pragma: no cover - IPython comes with ipywidgets
            return {}
        shell = get_ipython()
        return shell.user_ns if shell is not None else {}

    @staticmethod
    def _piece_names() -> list[str]:
        return sorted(available_pieces())

    def piece_choice(self) -> str | os.PathLike[str] | Piece:
        """What the piece box names: a piece name, a YAML path, a notebook variable's Piece or path, or job N's
        stored piece (``NAME (from job N)``)."""
        text = self.piece.value.strip()
        allowed = _PIECE_ALLOWED
        if not text:
            raise UsageError(f"the Piece box is empty; {allowed}")
        if m := _FROM_JOB.fullmatch(text):
            return self._job_piece(text, m["name"], int(m["job"]))
        ns = self._namespace()
        m = _WHOLE_VAR.fullmatch(text)
        name = (m.group(1) or m.group(2)) if m else None
        if name is None and text.isidentifier() and text not in available_pieces() and text in ns:
            name = text
        if name is None:
            if text.isidentifier() and text not in available_pieces():
                raise UsageError(f"piece {text!r} is neither a piece in {', '.join(self._piece_names()) or 'none'} "
                                 f"nor a notebook variable; {allowed}")
            return text
        if name not in ns:
            raise UsageError(f"piece {text!r}: the notebook has no variable {name!r}; {allowed}")
        value = ns[name]
        if isinstance(value, (Piece, str, os.PathLike)):
            return value
        raise UsageError(f"piece {text!r}: variable {name!r} holds a {type(value).__name__}; {allowed}")

    def _job_piece(self, text: str, name: str, job_id: int) -> Piece:
        """The piece job ``job_id`` ran, as the store keeps it (``NAME (from job N)`` in the piece box)."""
        try:
            job = self.ws.job(job_id)
        except AgentnbError:
            raise UsageError(f"piece {text!r}: there is no job {job_id} in this workspace; {_PIECE_ALLOWED}") from None
        if job.piece != name:
            raise UsageError(f"piece {text!r}: job {job_id} ran piece {job.piece!r}, not {name!r}; "
                             f"{_PIECE_ALLOWED}")
        return self.ws.piece(job_id)

    def model_choice(self) -> str:
        """The model box with ``{name}`` / ``$name`` filled from the notebook (``{{``/``}}`` are braces); as a
        selected job filled it, the job's own spec (the box shows it with its secrets masked)."""
        shown = self._model_shown
        if shown is not None and self.model.value.strip() == shown[0].strip():
            return shown[1]
        ns = self._namespace()

        def fill(m: re.Match[str]) -> str:
            if m.group(0) in ("{{", "}}"):
                return m.group(0)[0]
            name = m.group(1) or m.group(2)
            if name not in ns:
                raise UsageError(f"model {self.model.value.strip()!r}: the notebook has no variable {name!r}")
            return os.fspath(ns[name]) if isinstance(ns[name], os.PathLike) else str(ns[name])

        return _VAR_REF.sub(fill, self.model.value.strip())

    # -- actions -----------------------------------------------------------------
    def _act(self, fn: Callable[[int | None], Any]) -> None:
        """Run ``fn(selected job id)`` in a thread; the watcher keeps the widgets up to date meanwhile."""
        with self._lock:
            if self._busy:
                self._say("a job is already running from this panel; Stop it or wait", error=True)
                return
            self._busy = True
            self._target = None
            self._stop_requested.clear()
            self._say("")
            selected = self.jobs.value  # read now: the user may click another job while this runs
            self._enable(None)

        def work() -> None:
            # the magic closes a workspace its settings replaced only once this action is over
            with self.magic.holding(self.ws) if self.magic is not None else nullcontext():
                act()

        def act() -> None:
            try:
                fn(selected)
            except AgentnbError as exc:  # a user's mistake: its one-line message alone
                self._say(" ".join(str(exc).split()), error=True)
            except Exception as exc:
                self._say(f"{type(exc).__name__}: {' '.join(str(exc).split())}", error=True)
            else:
                if self._stop_requested.is_set() and self._target is not None:
                    self._say(self._stopped_message(self._target))
            finally:
                with self._lock:
                    self._busy = False
                    self._target = None
                    self._stop_requested.clear()
                self.refresh()

        self._live.start(work)
        self._live.wake()  # the watcher polls at the busy pace from now on

    def _runs(self, job_id: int) -> None:
        """The panel's action is about to run job ``job_id`` here: Stop acts on it, and its events wake the view."""
        self._target = job_id
        self._live.follow(job_id)

    def _stopped_message(self, job_id: int) -> str:
        job = self.ws.job(job_id)
        status = display_status(job.status, last_status_reason(self.ws.store, job_id))
        if status == PAUSED:
            return f"job {job_id} is paused (Stop); Run or Step continues it"
        return f"job {job_id} is {status}: it ended before it could pause"

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the panel's current action and its final refresh are done."""
        self._live.join(timeout)

    def _watch(self) -> None:
        # The selected job, when this panel's action runs it here, wakes the view on each of its events (no store
        # read); anything else (another process's job, the list) is polled through the store's change mark.
        while not self._closed.is_set():
            try:
                busy = self._busy or self._any_running or self._stop_requested.is_set()
                if self._live.next_change(self.jobs.value, interval=self.poll if busy else self.idle_poll,
                                          mark=self.ws.store.change_mark) and not self._closed.is_set():
                    self.refresh()
                self._live.draw_stream(self._show_stream)
                if self._stop_requested.is_set():
                    self._enforce_stop()
            except Exception:
                pass

    def _show_stream(self, call: StreamedCall | None) -> None:
        """Draw what the running call streamed so far below the view, when the view shows its job; else hide it."""
        if call is None or call.job_id != self.jobs.value:
            if self.stream.layout.display != "none":
                self.stream.layout.display = "none"
                self.stream.value = ""
            return
        self.stream.value = stream_html(call)
        self.stream.layout.display = None

    def _enforce_stop(self) -> list[int]:
        """Ask the panel's job (and its subtasks) to pause; again on every tick, until its run has taken it."""
        target = self._target
        if target is None:
            return []
        if self.ws.job(target).status not in (JobStatus.running, JobStatus.waiting_subtasks):
            return [target]
        return self.ws.stop(target)

    def _stop(self) -> None:
        with self._lock:
            if not self._busy:
                return
            self._stop_requested.set()
            target = self._target
            selected = self.jobs.value
        if target is None:
            self._say("Stop: the new job will not be run once it is submitted")
            return
        asked = self._enforce_stop()
        children = [j for j in asked if j != target]
        which = f"job {target}" + (f" and its subtask{'s' if len(children) > 1 else ''} "
                                   f"{', '.join(map(str, children))}" if children else "")
        note = f" (not the selected job {selected})" if selected is not None and selected != target else ""
        self._say(f"Stop: {which}, run from this panel{note}, will pause after its current LLM call")

    def _run(self, job_id: int | None) -> None:
        text = self.instruction.value.strip()
        if text:
            job = self.ws.submit(text, piece=self.piece_choice(), model=self.model_choice())
            self._runs(job.id)
            self.instruction.value = ""
            if self.magic is not None:
                self.magic.last_job = job.id
            with self._lock:  # the boxes already name what the new job runs: they keep the user's text
                self.refresh()
                self._filled = job.id
                self.jobs.value = job.id
            kept = f"; job #{job_id} is left as it was" if job_id is not None else ""
            self._say(f"new job #{job.id} with {job.piece} on {scrub(job.model)}{kept}")
            if self._stop_requested.is_set():
                self._say(f"job {job.id} was submitted and not run (Stop); Run or Step starts it")
                self._stop_requested.clear()
                return
            self.ws.run(job.id)
            return
        selected = None if job_id is None else self.ws.job(job_id)
        if selected is None or selected.status not in (JobStatus.queued, JobStatus.waiting_subtasks):
            raise UsageError("write an instruction to start a new job (or select a queued or paused job to "
                             "continue it)")
        self._runs(selected.id)
        self.ws.run(selected.id)

    def _step(self, job_id: int | None, unit: str) -> None:
        if job_id is None:
            raise UsageError("select a job first")
        job = self.ws.job(job_id)
        if job.status != JobStatus.queued:
            raise UsageError(f"job {job_id} is {job.status}; only a queued or paused job can be stepped")
        self._runs(job_id)
        self.ws.step(job_id, unit=unit)

    def _reply(self, job_id: int | None) -> None:
        if job_id is None:
            raise UsageError("select a job first")
        text = self.reply_text.value.strip()
        if not text:
            raise UsageError("write your answer in the Reply box first")
        job = self.ws.reply(job_id, text)
        self.reply_text.value = ""
        if job.status == JobStatus.queued:
            self._runs(job_id)
            self.ws.run(job_id)

    # -- the saved snapshot --------------------------------------------------------
    def fallback_bundle(self) -> dict[str, str]:
        """text/html and text/plain of the panel as it is now: what a notebook shows without the widget."""
        labels = [label for label, _ in self.jobs.options]
        shown = labels[-_FALLBACK_ROWS:]
        more = len(labels) - len(shown)
        head = (f"agentnb panel of workspace {self.ws.root.name!r}: a saved snapshot; "
                "run the cell in a live kernel to use the panel")
        listing = ([f"… {more} older jobs"] if more else []) + shown
        selected = self.jobs.value
        header = header_html(self.ws, selected) if selected is not None else ""
        lines = "".join(f"<div>{html.escape(label)}</div>" for label in listing) or \
            '<div style="color:#777">no jobs yet</div>'
        # JupyterLab draws "Error displaying widget: model not found" for the dead widget just above (its
        # renderer adds .jupyter-widgets to the output only then): hide it when this snapshot follows it.
        style = ("<style>.jp-OutputArea-child:has(> .jp-OutputArea-output.jupyter-widgets)"
                 ":has(+ .jp-OutputArea-child .anb-panel-fallback){display:none}</style>")
        body = (f'{style}<div class="anb-panel-fallback anb-fb-{self._token}" style="border:1px solid '
                f'rgba(127,127,127,.35);border-radius:4px;padding:6px 8px;font-size:13px">'
                f'<div><b>agentnb panel</b> · workspace <code>{html.escape(self.ws.root.name)}</code> '
                f'<span style="color:#777">— a saved snapshot; run the cell in a live kernel to use the panel'
                f'</span></div><div style="margin:4px 0;font-family:var(--jp-code-font-family,monospace);'
                f'font-size:12px">{lines}</div>{header}</div>')
        return {"text/html": body, "text/plain": "\n".join([head, *listing])}

    def _update_fallbacks(self) -> None:
        if not self._fallbacks:
            return
        now = time.monotonic()
        # while a job runs, the snapshot follows at a slower pace than the widget
        if (self._busy or self._any_running) and now - self._fallback_at < _FALLBACK_EVERY:
            return
        bundle = self.fallback_bundle()
        if bundle["text/html"] == self._fallback_sent:
            return
        self._fallback_sent, self._fallback_at = bundle["text/html"], now
        for handle in self._fallbacks:
            handle.update(bundle, raw=True)


# what the job list's marks mean: the Select's tooltip (its options are plain text, no title of their own)
_JOB_MARKS = (f"marks: {FORK}3@2 a fork of job 3 at movement run 2 · ⇊2 compacted twice · ⟳1 a loop monitor "
              "fired once · ▶ the job this panel runs")


def _fork_mark(row: Mapping[str, Any]) -> str:
    """`` ⎇3@2`` for a fork of job 3 at movement run 2 (the jobs frame's ``forked_from_*``), else nothing."""
    origin, seq = row.get("forked_from_job"), row.get("forked_from_seq")
    # Int64 cells: a number for a fork, pandas' NA for the others
    if isinstance(origin, numbers.Integral) and isinstance(seq, numbers.Integral):
        return f" {FORK}{int(origin)}@{int(seq)}"
    return ""


def _event_marks(frames: Frames) -> dict[int, str]:
    """Job id → `` ⇊2`` (compacted twice, docs/context.md#compaction) and `` ⟳1`` (a loop monitor fired once) for the list; each
    read from one query over its kind of event (the events_kind index), so the list stays cheap to redraw."""
    marks: dict[int, str] = {}
    for frame, sign in ((frames.compactions(), "⇊"), (frames.loops(), "⟳")):
        counts = frame.groupby("job", sort=True).size()
        for job, n in zip(counts.index.tolist(), counts.tolist(), strict=True):
            marks[int(job)] = marks.get(int(job), "") + f" {sign}{int(n)}"
    return marks


def _cost(cost: float) -> str:
    """A job's cost in the list: ``$0.0123``, or ``cost unknown`` when a call has no price (NaN)."""
    return "cost unknown" if math.isnan(cost) else dollars(cost)


def _set(button: w.Button, enabled: bool, style: str = "") -> None:
    """Enable or disable a button; a disabled one loses its colour so it does not look pressable."""
    button.disabled = not enabled
    button.button_style = style if enabled else ""
