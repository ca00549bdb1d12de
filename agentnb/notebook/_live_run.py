"""A job run from the notebook with its live view: the view drawn, updated at each commit and as a call streams,
and left in its final state (``%agent run``, ``step``, ``reply --run``, ``retry --run``, ``fork``)."""

from __future__ import annotations

import html as _html
import threading
from collections.abc import Callable
from typing import Any, Protocol

from IPython.core.error import UsageError
from IPython.display import HTML, display

from ..views.icons import question_badge
from ..views.render import KEEPER, duration, job_html, job_stats, plural
from ..views.streaming import StreamedCall, stream_html
from ..views.style import ERROR_COLOUR
from ..workspace import Job, Workspace
from ._retire import Retirement
from .liveview import LiveView, display_marks

__all__ = ["Runs", "one_line", "run_live", "summary_html"]


class Runs(Protocol):
    """What a run needs of the magic that starts it (:class:`~agentnb.notebook.magic.AgentMagic`)."""

    threads: dict[int, threading.Thread]  # the background runs, by job
    retirement: Retirement

    @property
    def ws(self) -> Workspace: ...

    def after_cell(self, fn: Callable[[Any], None]) -> None: ...


def run_live(magic: Runs, job: Job, *, background: bool = False, unit: str | None = None) -> Job:
    """:meth:`AgentMagic.run_live <agentnb.notebook.magic.AgentMagic.run_live>`."""
    job_id = job.id
    # the run's own workspace: a setting changed meanwhile opens another, and this one is closed when the
    # run and its view end (magic.retirement)
    ws = magic.ws
    running = magic.threads.get(job_id)
    if running is not None and running.is_alive():
        raise UsageError(f"job {job_id} is already running in the background of this session")

    def view() -> HTML:
        # KEEPER: what the user opens or closes in the view stays so while it is redrawn
        return HTML(KEEPER + job_html(ws, job_id))

    handle = display(view(), display_id=True)
    # the job runs in this kernel: each of its commits wakes the view, nothing polls the store (liveview.py)
    live = LiveView(ws.execution, name="agentnb-job")

    def redraw(event_id: int) -> None:
        if handle is not None:
            html = view()
            handle.update(html, transient=display_marks(job_id, event_id))

    # the running call's streamed text: an output of its own just below the view, made at its first fragment,
    # updated alone (the view is not redrawn for it) and emptied once the call is recorded (liveview.py).  A run in
    # the background makes it now, empty: made later, from the watching thread, it would go to whatever cell runs
    # then (a notebook saved or shown by JupyterLab drops an output sent to a cell that has ended)
    streamed: list[Any] = []
    if background:
        made = display({}, raw=True, display_id=True)
        if made is not None:
            streamed.append(made)

    def stream(call: StreamedCall | None) -> None:
        marks = display_marks(job_id, live.last_event, stream=0 if call is None else call.chars,
                              call=None if call is None else [call.movement_seq, call.iteration])
        if call is None:
            if streamed:  # no data at all: nothing of the streaming is drawn or saved in the notebook
                streamed[0].update({}, raw=True, transient=marks)
        elif streamed:
            streamed[0].update(HTML(stream_html(call)), transient=marks)
        else:
            made = display(HTML(stream_html(call)), display_id=True, transient=marks)
            if made is not None:
                streamed.append(made)

    def work() -> None:
        if unit is None:
            ws.run(job_id)
        else:
            ws.step(job_id, unit=unit)

    def watch_then_release() -> None:
        try:
            live.watch(redraw, stream)
        finally:
            live.close()
            magic.retirement.leave(ws)

    magic.retirement.enter(ws)
    if background:
        live.start(work, job_id)
        watcher = threading.Thread(target=watch_then_release, name=f"agentnb-watch-{job_id}", daemon=True)
        magic.threads[job_id] = watcher
        watcher.start()
        # A Job shown as this cell's value would be drawn once, as "running", and stay so: say instead
        # that the view above is the live one (for this cell only; later cells show the job in full).
        result = ws.job(job_id)
        result.shown_live_above(True)
        magic.after_cell(lambda value: result.shown_live_above(False))
        return result
    try:
        # started inside the try: a Ctrl-C while the thread starts must pause the job, not escape
        live.start(work, job_id)
        live.watch(redraw, stream)
    except KeyboardInterrupt:
        if not live.started:  # interrupted before the job's thread existed: nothing ran
            raise
        # asked again until the run ends: a run that was only starting clears a request made before it
        ws.stop(job_id)
        while not live.done.wait(0.25):
            ws.stop(job_id)
        if handle is not None:
            handle.update(view())
        live.streaming.end()
        live.draw_stream(stream, now=True)
        if unit is None:
            print(f"job {job_id} paused after its current LLM call; continue with %agent run --job {job_id} "
                  "or %agent step")
        else:  # a step is already the smallest unit: it was let finish
            print(f"job {job_id}: the step ran to its end; the job waits for the next %agent step")
    finally:
        live.close()
        magic.retirement.leave(ws)
    if live.failure is not None:
        raise UsageError(f"job {job_id}: {one_line(live.failure)}")
    result = ws.job(job_id)

    def shrink(value: Any) -> None:
        if value is result and handle is not None:  # the cell's value shows the job in full below
            handle.update(HTML(summary_html(ws, job_id, below=True)))

    magic.after_cell(shrink)
    return result


def summary_html(ws: Workspace, job_id: int, *, below: bool = False) -> str:
    """One line about a finished run, with why it failed or what it asks, and where to see the whole view.

    It replaces the live view when the cell's value shows the job in full just ``below``.
    """
    job = ws.job(job_id).snapshot()
    st = job_stats(ws, job_id)
    where = "its view is below" if below else f"see it with <code>%agent show {job.id}</code>"
    # st.status, not job.status: a stepped or stopped job is "paused" here as in the view below it
    out = (f"<div>Job {job.id} <b>{_html.escape(st.status)}</b> · {plural(st.movements, 'movement')} · "
           f"{plural(st.calls, 'LLM call')} · {st.total_tokens:,} tokens · running time {duration(st.running_s)} "
           f'<span style="color:#777">— {where}</span></div>')
    if job.error:
        out += f'<div style="color:{ERROR_COLOUR}">✖ {_html.escape(job.error)}</div>'
    if st.question:
        out += (f"<div>{question_badge()} <b>waiting for you:</b> {_html.escape(st.question)} "
                f'<span style="color:#777">— answer with <code>%agent reply {job.id} "…"</code></span></div>')
    return out


def one_line(exc: BaseException | str) -> str:
    """An error's text on one line."""
    return " ".join(str(exc).split())
