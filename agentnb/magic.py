"""The ``%agent`` / ``%%agent`` IPython magic: a thin adapter over :class:`~agentnb.Workspace`.

One function per sub-command, each with its argument declarations (``%agent <sub> --help``
prints them).  Results are values: ``job = %agent run …`` is the :class:`~agentnb.Job`,
``%agent jobs`` / ``usage`` / ``lessons`` / ``pieces`` are DataFrames.  Mistakes by the
user (unknown sub-command, missing job, unknown piece, bad model spec, unbalanced quotes,
a ``{name}`` that names nothing) raise IPython's :class:`UsageError`, which IPython shows
as one line without a traceback; what goes wrong *inside* a job is part of the job's view.

Defaults are traitlets: ``%config AgentMagic.workspace = 'dir'`` (and ``.model``, ``.piece``).
"""

from __future__ import annotations

import string
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import HTML, display
from traitlets import Float, Unicode, observe

from .models import ModelSpecError
from .pieces import PieceError, available_pieces, load_piece
from .render import job_html, job_stats, plural
from .store import StoreError
from .workspace import DEFAULT_WORKSPACE, Job, Workspace

__all__ = ["AgentMagic", "load_ipython_extension", "expand_braces", "SUBCOMMANDS"]

SUBCOMMANDS = ("run", "step", "reply", "show", "jobs", "usage", "lessons", "panel", "pieces", "export", "retry")

_OVERVIEW = """\
%agent SUBCOMMAND [options]      (%agent SUBCOMMAND --help for its options)

  run [--piece P] [--model M] [--background] "instruction"   submit a job and run it, live
  run --job JOB [--background]  run a queued job (queued, stepped, paused or answered) to its end
  step [JOB] [--call]          run the next movement (or, with --call, the next LLM call)
  reply JOB "text" [--run]     answer a job that waits for a human
  retry JOB [--run]            queue a failed or aborted job again (it goes on from its last complete call)
  show [JOB] [--full] [--movement SEQ]   the job's view (--full: nothing cut)
  jobs                         every job, as a DataFrame
  usage [JOB] [--all]          one row per LLM call, as a DataFrame
  lessons [JOB] [--all]        the lessons the movements wrote, as a DataFrame
  panel                        the interactive panel (ipywidgets)
  pieces                       the available pieces, as a DataFrame
  export JOB PATH              the job as a notebook (.ipynb)

%%agent [--piece P] [--model M] [--background]   the cell body is the instruction
%%agent reply JOB                                 the cell body is the reply

JOB is a job id or a variable holding a Job; it defaults to the last job of this session.
{name} in an instruction is filled from the notebook's variables; write {{ and }} for braces.
Defaults: %config AgentMagic.workspace / .model / .piece
"""

_USER_ERRORS = (PieceError, ModelSpecError, StoreError, FileNotFoundError, ValueError, LookupError)


def _one_line(exc: BaseException | str) -> str:
    return " ".join(str(exc).split())


class _Namespace(Mapping[str, Any]):
    """The user namespace for :func:`expand_braces`: an unknown name is a usage error, not a KeyError."""

    def __init__(self, ns: Mapping[str, Any]) -> None:
        self.ns = ns

    def __getitem__(self, key: str) -> Any:
        if key not in self.ns:
            raise UsageError(f"{{{key}}} in the instruction names no variable of the notebook; "
                             "write {{ and }} for literal braces")
        return self.ns[key]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.ns)

    def __len__(self) -> int:
        return len(self.ns)


def expand_braces(text: str, ns: Mapping[str, Any]) -> str:
    """Fill ``{name}`` (also ``{name.attr}``, ``{name[key]}``, ``{name:fmt}``) from ``ns``; ``{{``/``}}`` stay braces."""
    try:
        return string.Formatter().vformat(text, (), _Namespace(ns))
    except UsageError:
        raise
    except (ValueError, IndexError, AttributeError, KeyError, TypeError) as exc:
        raise UsageError(f"cannot fill the braces of the instruction ({_one_line(exc)}); "
                         "write {{ and }} for literal braces") from None


@magics_class
class AgentMagic(Magics):
    """``%agent`` and ``%%agent``: run, step, reply to and inspect agentnb jobs from a notebook."""

    workspace = Unicode(DEFAULT_WORKSPACE, help="the workspace folder (agentnb.sqlite and jobs/)").tag(config=True)
    model = Unicode("demo", help="default model spec: demo | scripted:<file> | openai:<model> | replay:<id>").tag(config=True)
    piece = Unicode("plan-implement-verify", help="default piece: a name or a YAML path").tag(config=True)
    poll = Float(0.25, help="seconds between updates of a live job view").tag(config=True)

    def __init__(self, shell: Any = None, **kwargs: Any) -> None:
        super().__init__(shell=shell, **kwargs)
        self._ws: Workspace | None = None
        self.last_job: int | None = None
        self.threads: dict[int, threading.Thread] = {}

    @observe("workspace")
    def _workspace_changed(self, change: Any) -> None:
        self._ws = None
        self.last_job = None  # job ids belong to a workspace

    @property
    def ws(self) -> Workspace:
        """The :class:`Workspace` of ``AgentMagic.workspace`` (opened once, reopened when the setting changes)."""
        if self._ws is None:
            self._ws = Workspace(self.workspace)
        return self._ws

    # -- dispatch ------------------------------------------------------------
    @no_var_expand
    @line_cell_magic
    def agent(self, line: str, cell: str | None = None) -> Any:
        """Run, step and inspect agentnb jobs.  ``%agent --help`` lists the sub-commands."""
        from IPython.utils.process import arg_split

        try:
            argv = arg_split(line, posix=True)
        except ValueError as exc:
            raise UsageError(f"%agent: cannot split the line ({_one_line(exc)}); check the quotes") from None
        if cell is not None and (not argv or argv[0].startswith("-")) and not {"-h", "--help"} & set(argv):
            argv = ["run", *argv]
        if not argv or argv[0] in ("-h", "--help", "help"):
            print(_OVERVIEW)
            return None
        sub, rest = argv[0], argv[1:]
        if sub not in SUBCOMMANDS:
            raise UsageError(f"%agent: unknown sub-command {sub!r}; allowed: {', '.join(SUBCOMMANDS)}")
        if cell is not None and sub not in ("run", "reply"):
            raise UsageError(f"%%agent {sub}: only run and reply take a cell body; use the line magic %agent {sub}")
        fn = getattr(self, f"cmd_{sub}")
        if "-h" in rest or "--help" in rest:
            print(fn.parser.format_help())
            return None
        try:
            args = fn.parser.parse_args(rest)
        except UsageError as exc:
            raise UsageError(f"%agent {sub}: {_one_line(exc)}") from None
        try:
            return fn(args, cell)
        except UsageError:
            raise
        except _USER_ERRORS as exc:
            raise UsageError(f"%agent {sub}: {_one_line(exc)}") from None

    # -- helpers --------------------------------------------------------------
    def job(self, ref: Any = None) -> Job:
        """The job named by ``ref`` (an id, a Job, or a variable name holding one); the last job by default."""
        if ref is None:
            if self.last_job is None:
                raise UsageError("no job yet in this session; give a job id (see %agent jobs)")
            ref = self.last_job
        if isinstance(ref, str) and not ref.strip().lstrip("-").isdigit():
            value = (self.shell.user_ns if self.shell is not None else {}).get(ref)
            if not isinstance(value, Job):
                raise UsageError(f"JOB must be a job id or a variable holding a Job, not {ref!r}")
            ref = value.id
        try:
            job = self.ws.job(int(ref.id if isinstance(ref, Job) else ref))
        except StoreError:
            raise UsageError(f"no job {ref} in workspace {self.ws.root}; see %agent jobs") from None
        self.last_job = job.id
        return job

    def _expand(self, text: str) -> str:
        return expand_braces(text, self.shell.user_ns if self.shell is not None else {})

    def run_live(self, job: Job, *, background: bool = False) -> Job:
        """Run ``job`` in a thread while its view is shown and updated as events are written.

        In the foreground the call returns when the job stops (Ctrl-C asks it to pause after
        the current LLM call), leaving a one-line summary where the live view was; the returned
        Job then shows the full view.  In the background it returns at once.
        """
        job_id = job.id
        running = self.threads.get(job_id)
        if running is not None and running.is_alive():
            raise UsageError(f"job {job_id} is already running in the background of this session")
        handle = display(HTML(job_html(self.ws, job_id)), display_id=True)
        failure: list[BaseException] = []
        # Waited on instead of Thread.join: on Python 3.11 a Ctrl-C that interrupts join(timeout)
        # marks the still-running thread as stopped, so a later join() returns at once.
        done = threading.Event()

        def work() -> None:
            try:
                self.ws.run(job_id)
            except BaseException as exc:  # noqa: BLE001 - reported in the view, never lost silently
                failure.append(exc)
            finally:
                done.set()

        worker = threading.Thread(target=work, name=f"agentnb-job-{job_id}", daemon=True)

        def watch(final: Callable[[], Any]) -> None:
            seen = -1
            while True:
                alive = not done.is_set()
                mark = self.ws.store.last_event_id(job_id)
                if mark != seen and handle is not None:
                    seen = mark
                    handle.update(HTML(job_html(self.ws, job_id)))
                if not alive:
                    break
                done.wait(self.poll)
            if handle is not None:
                handle.update(final())

        worker.start()
        if background:
            watcher = threading.Thread(target=watch, args=(lambda: HTML(job_html(self.ws, job_id)),),
                                       name=f"agentnb-watch-{job_id}", daemon=True)
            self.threads[job_id] = watcher
            watcher.start()
            return self.ws.job(job_id)
        try:
            watch(lambda: HTML(_summary_html(self.ws, job_id)))
        except KeyboardInterrupt:
            self.ws.stop(job_id)
            done.wait()
            if handle is not None:
                handle.update(HTML(_summary_html(self.ws, job_id)))
            print(f"job {job_id} paused after its current LLM call; continue with %agent run --job {job_id} "
                  "or %agent step")
        if failure:
            raise UsageError(f"job {job_id}: {_one_line(failure[0])}")
        return self.ws.job(job_id)

    # -- sub-commands -------------------------------------------------------
    @magic_arguments(name="agent run")
    @argument("instruction", nargs="*", help="the task (or the body of a %%%%agent cell); {name} is filled from the notebook")
    @argument("--piece", "-p", help="piece name or YAML path (default: AgentMagic.piece)")
    @argument("--model", "-m", help="demo | scripted:<file.yaml> | openai:<model> | replay:<job_id> (default: AgentMagic.model)")
    @argument("--input", "-i", action="append", metavar="FILE", help="copy FILE into the job's input/ (repeatable)")
    @argument("--workdir", help="use an existing directory as the job's work directory")
    @argument("--background", "-b", action="store_true", help="return the Job at once; the view keeps updating")
    @argument("--queue", action="store_true", help="only submit the job (run it later with step or run --job)")
    @argument("--job", "-j", metavar="JOB", help="run this queued job (an id or a Job variable) instead of submitting one")
    def cmd_run(self, args: Any, cell: str | None) -> Job:
        """Submit a job and run it until it ends or waits, showing its view as it runs."""
        text = cell if cell is not None else " ".join(args.instruction)
        if args.job is not None:
            return self._run_existing(args, text)
        if args.instruction and cell is not None:
            raise UsageError("%%agent: the instruction is the cell body; put only options on the first line")
        if not text.strip():
            raise UsageError('%agent run: the instruction is missing; e.g. %agent run "Summarise input/notes.md"')
        inputs: dict[str, Any] = {}
        for item in args.input or []:
            p = Path(item).expanduser()
            if not p.is_file():
                raise UsageError(f"%agent run: --input {item}: no such file")
            inputs[p.name] = p
        job = self.ws.submit(self._expand(text).strip(), piece=args.piece or self.piece, model=args.model or self.model,
                             inputs=inputs, workdir=args.workdir)
        self.last_job = job.id
        if args.queue:
            return job
        return self.run_live(job, background=args.background)

    def _run_existing(self, args: Any, text: str) -> Job:
        # A job keeps the instruction, piece, model and files it was submitted with.
        given = [o for o, v in (("an instruction", text.strip()), ("--piece", args.piece), ("--model", args.model),
                                ("--input", args.input), ("--workdir", args.workdir), ("--queue", args.queue)) if v]
        if given:
            raise UsageError(f"%agent run --job: the job already has its instruction, piece and model; "
                             f"remove {', '.join(given)}")
        job = self.job(args.job)
        if job.status not in ("queued", "waiting_subtasks"):
            hint = ' — answer it with %agent reply' if job.status == "waiting_human" else ""
            raise UsageError(f"%agent run --job: job {job.id} is {job.status}; only a queued job (or one waiting "
                             f"for its subtasks) can be run{hint}")
        return self.run_live(job, background=args.background)

    @magic_arguments(name="agent step")
    @argument("job", nargs="?", help="job id or Job variable (default: the last job)")
    @argument("--call", action="store_true", help="run only the next LLM call (with its tool calls)")
    def cmd_step(self, args: Any, cell: str | None) -> Job:
        """Run the next movement of a job (or its next LLM call) and show it."""
        job = self.job(args.job)
        if job.status not in ("queued",):
            hint = ' — answer with %agent reply' if job.status == "waiting_human" else ""
            raise UsageError(f"%agent step: job {job.id} is {job.status}; only a queued job can be stepped{hint}")
        return self.ws.step(job, unit="call" if args.call else "movement")

    @magic_arguments(name="agent reply")
    @argument("job", help="job id or Job variable")
    @argument("text", nargs="*", help="the answer (or the body of a %%%%agent reply JOB cell)")
    @argument("--run", action="store_true", help="run the job again right away")
    def cmd_reply(self, args: Any, cell: str | None) -> Job:
        """Answer a job that waits for a human (or add a comment to any job)."""
        text = cell if cell is not None else " ".join(args.text)
        if not text.strip():
            raise UsageError('%agent reply: the text is missing; e.g. %agent reply 3 "Use the short format."')
        job = self.ws.reply(self.job(args.job), self._expand(text).strip())
        if args.run and job.status == "queued":
            return self.run_live(job)
        return job

    @magic_arguments(name="agent retry")
    @argument("job", help="job id or Job variable")
    @argument("--run", action="store_true", help="run the job right away, live")
    @argument("--retries", type=int, metavar="N", help="openai: tries after the first (429, 5xx, timeouts, malformed)")
    @argument("--max-backoff", type=float, metavar="SECONDS", help="openai: the longest wait between two tries")
    def cmd_retry(self, args: Any, cell: str | None) -> Job:
        """Queue a failed or aborted job again; it goes on from its last complete LLM call."""
        job = self.ws.retry(self.job(args.job), retries=args.retries, max_backoff=args.max_backoff)
        if args.run:
            return self.run_live(job)
        return job

    @magic_arguments(name="agent show")
    @argument("job", nargs="?", help="job id or Job variable (default: the last job)")
    @argument("--full", action="store_true", help="nothing cut: every call, every body in full")
    @argument("--movement", type=int, metavar="SEQ", help="only movement run SEQ (1 is the first)")
    def cmd_show(self, args: Any, cell: str | None) -> HTML:
        """Show a job's view (header and one collapsible section per movement run)."""
        from .render import STYLE, movement_html

        job = self.job(args.job)
        if args.movement is not None:
            return HTML(STYLE + '<div class="anb-job">'
                        + movement_html(self.ws, job.id, args.movement, full=args.full) + "</div>")
        return HTML(job_html(self.ws, job.id, full=args.full))

    @magic_arguments(name="agent jobs")
    def cmd_jobs(self, args: Any, cell: str | None) -> Any:
        """Every job of the workspace as a DataFrame (status, piece, model, tokens, …)."""
        return self.ws.frames.jobs()

    @magic_arguments(name="agent usage")
    @argument("job", nargs="?", help="job id or Job variable (default: the last job)")
    @argument("--all", action="store_true", help="every job of the workspace")
    def cmd_usage(self, args: Any, cell: str | None) -> Any:
        """One row per LLM call (tokens, context ratio, actions) as a DataFrame."""
        return self.ws.frames.usage(None if args.all else self.job(args.job))

    @magic_arguments(name="agent lessons")
    @argument("job", nargs="?", help="job id or Job variable (default: the last job)")
    @argument("--all", action="store_true", help="every job of the workspace")
    def cmd_lessons(self, args: Any, cell: str | None) -> Any:
        """The lessons written by the job's movements as a DataFrame."""
        return self.ws.frames.lessons(None if args.all else self.job(args.job))

    @magic_arguments(name="agent panel")
    def cmd_panel(self, args: Any, cell: str | None) -> Any:
        """The interactive panel: job list, run / step / reply / stop, progress and context bars."""
        from .panel import Panel

        return Panel(self.ws, magic=self)

    @magic_arguments(name="agent pieces")
    def cmd_pieces(self, args: Any, cell: str | None) -> Any:
        """The pieces found in ./pieces and in the package, as a DataFrame."""
        import pandas as pd

        rows = []
        for name, path in sorted(available_pieces().items()):
            try:
                p = load_piece(path)
                rows.append({"piece": name, "movements": " → ".join(p.names), "max_movements": p.max_movements,
                             "description": p.description, "path": str(path)})
            except PieceError as exc:
                rows.append({"piece": name, "movements": "", "max_movements": None,
                             "description": f"INVALID: {_one_line(exc)}", "path": str(path)})
        return pd.DataFrame(rows, columns=["piece", "movements", "max_movements", "description", "path"])

    @magic_arguments(name="agent export")
    @argument("job", help="job id or Job variable")
    @argument("path", help="the .ipynb file to write")
    def cmd_export(self, args: Any, cell: str | None) -> Path:
        """Write the job as a notebook that shows the run without a kernel."""
        job = self.job(args.job)
        return self.ws.export_notebook(job, Path(args.path).expanduser())


def _summary_html(ws: Workspace, job_id: int) -> str:
    """The line left where a finished foreground run was watched, with why it failed or what it asks.

    With ``job = %agent run …`` this is all the cell keeps (the Job is not displayed), so an
    error or an open question must not disappear with the live view.
    """
    import html as _html

    job = ws.job(job_id)
    st = job_stats(ws, job_id)
    out = (f"<div>Job {job.id} <b>{_html.escape(str(job.status))}</b> · {plural(st.movements, 'movement')} · "
           f"{plural(st.calls, 'LLM call')} · {st.total_tokens:,} tokens · {st.elapsed:.1f} s</div>")
    if job.error:
        out += f'<div style="color:#b00020">✖ {_html.escape(job.error)}</div>'
    if st.question:
        out += (f"<div><b>❓ waiting for you:</b> {_html.escape(st.question)} <span style=\"color:#777\">— answer "
                f'with <code>%agent reply {job.id} "…"</code></span></div>')
    return out


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%agent`` / ``%%agent`` and make ``AgentMagic`` configurable with ``%config``."""
    magic = AgentMagic(shell=ipython, config=ipython.config)
    ipython.register_magics(magic)
    if magic not in ipython.configurables:
        ipython.configurables.append(magic)

