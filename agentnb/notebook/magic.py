"""The ``%agent`` / ``%%agent`` IPython magic: a thin adapter over :class:`~agentnb.Workspace`.

One function per sub-command, each with its argument declarations (``%agent <sub> --help``
prints them).  Results are values: ``job = %agent run …`` is the :class:`~agentnb.Job`,
``%agent jobs`` / ``usage`` / ``lessons`` / ``pieces`` are DataFrames.  Mistakes by the
user (unknown sub-command, missing job, unknown piece, bad model spec, unbalanced quotes,
a ``{name}`` that names nothing) raise IPython's :class:`UsageError`, which IPython shows
as one line without a traceback, always starting ``%agent SUB:``; what goes wrong *inside*
a job is part of the job's view.

The line is split first, then every argument is filled from the notebook's variables
(``{expr}``, ``$name``; see :mod:`agentnb._vars`), so a JOB may be ``3``, ``{jid}``, ``$jid``,
``jid`` or a variable holding a :class:`~agentnb.Job`.  Only a command that succeeds makes its
job the session's default one.

Defaults are traitlets: ``%config AgentMagic.workspace = 'dir'`` (and ``.model``, ``.piece``, ``.store``: a store URL, docs/stores.md).
"""

from __future__ import annotations

import contextlib
import numbers
import threading
import weakref
from collections.abc import Callable, Mapping
from os import PathLike
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import HTML, display
from traitlets import Unicode, observe

from ..batch import DEFAULT_CONCURRENCY, Batch
from ..batch_compare import BatchComparison, check_baseline
from ..compare import Comparison
from ..engine.context import context_items
from ..engine.pieces import Piece, available_pieces, load_piece
from ..errors import AgentnbError, PieceError, StoreError, as_typed
from ..store import reads
from ..store.base import JOB_STATES, JobStatus, owned_by_this_process
from ..store.records import BatchRecord
from ..views.render import KEEPER, job_html
from ..workspace import DEFAULT_WORKSPACE, Job, Workspace
from ._live_run import one_line, run_live
from ._retire import Retirement
from .tracebacks import install as install_one_line_errors
from .vars import VarError, expand, expand_value, split_line

__all__ = ["SUBCOMMANDS", "AgentMagic", "expand_braces", "load_ipython_extension"]

SUBCOMMANDS = ("run", "step", "reply", "stop", "show", "jobs", "usage", "lessons", "panel", "pieces", "tools",
               "export", "plot", "retry", "fork", "batch", "batches", "compare")

_OVERVIEW = """\
%agent SUBCOMMAND [options]      (%agent SUBCOMMAND --help for its options)

  run [--piece P] [--model M] [--input FILE] [--context KEY=VALUE] [--background] [--queue] "instruction"
                               submit a job and run it, live (--queue: only submit it)
  run --job JOB [--background]  run a queued job (queued, stepped, paused or answered) to its end
  step [JOB] [--call]          run the next movement (or, with --call, the next LLM call)
  reply JOB "text" [--run]     answer a job that waits for a human
  stop [JOB]                   pause a job running in this notebook after its current LLM call
  retry JOB [--run]            queue a failed or aborted job again (it goes on from its last complete call)
  fork JOB --at SEQ [--piece P] [--model M] [--context KEY=VALUE] [--strict] [--no-run]
                               a new job: runs 1…SEQ-1 of JOB re-served (no tokens), SEQ on live; the Job
  show [JOB] [--full] [--movement SEQ]   the job's view (--full: nothing cut)
  jobs                         every job, as a DataFrame
  usage [JOB] [--all]          one row per LLM call, as a DataFrame
  lessons [JOB] [--all]        the lessons the movements wrote, as a DataFrame
  panel                        the interactive panel (ipywidgets)
  pieces                       the available pieces, as a DataFrame
  tools [PIECE] [--workdir DIR]  each movement's tools: source (built-in, Python or MCP server), parameters
  export JOB PATH              the job as a notebook (.ipynb)
  plot [JOB]                   the usage plot: context ratio per LLM call, cumulative tokens
  batch CASES --piece a,b --model m[,m2] [--concurrency N] [--processes N] [--name NAME] [--epochs K] [--scorer VAR]... [--baseline V]
                               run every case (a list of dicts or a DataFrame variable) under every
                               piece × model, scored; the Batch (--baseline: its BatchComparison).
                               batch NAME resumes a batch
  batches                      every batch of the workspace, as a DataFrame
  compare A B                  two jobs side by side, aligned by movement run, the first divergence marked

%%agent [--piece P] [--model M] [--background]   the cell body is the instruction
%%agent reply JOB                                 the cell body is the reply

JOB is a job id (3, {jid}, $jid, or jid holding an int) or a variable holding a Job; it
defaults to the last job of this session.  {expr} and $name in any argument are filled from
the notebook's variables; write {{ and }} for braces, $$ for a $ before a variable's name.
Defaults: %config AgentMagic.workspace / .model / .piece
Store:    %config AgentMagic.store = 'postgresql://user@host:5432/db' keeps the jobs in PostgreSQL (the
          workspace folder then holds only work directories); '' (the default) means $AGENTNB_STORE,
          else the workspace folder's agentnb.sqlite
"""

# the arguments that name a job: filled by AgentMagic.job, which keeps a variable's int or Job whole
_JOB_ARGS = frozenset({"job", "a", "b"})
# the arguments that name notebook objects (cases, scorers, pieces, models): filled by AgentMagic.value,
# which keeps a variable's list, DataFrame, function or Piece whole
_VALUE_ARGS = frozenset({"cases", "scorer", "piece_list", "model_list", "fork_piece", "tools_piece"})


def expand_braces(text: str, ns: Mapping[str, Any]) -> str:
    """Fill ``{expr}`` and ``$name`` in an instruction from ``ns``; ``{{``/``}}`` stay braces (see :mod:`agentnb._vars`)."""
    try:
        return expand(text, ns, "the instruction")
    except VarError as exc:
        raise UsageError(str(exc)) from None


def _help(parser: Any) -> str:
    """A sub-command's --help without the ``::`` that IPython's parser puts first for Sphinx."""
    text = parser.format_help()
    if text.startswith("::"):
        head, _, rest = text[2:].lstrip("\n").partition("\n\n")
        text = "\n".join(line[2:] if line.startswith("  ") else line for line in head.splitlines()) + "\n\n" + rest
    return "usage: " + text


def _usage_line(parser: Any) -> str:
    """``[--piece PIECE] [--model MODEL] … [instruction ...]``: every option of a sub-command, on one line."""
    usage = _help(parser).split("\n\n", 1)[0]
    return " ".join(usage.split()[3:])  # drop "usage: %agent SUB"


@magics_class
class AgentMagic(Magics):
    """``%agent`` and ``%%agent``: run, step, reply to and inspect agentnb jobs from a notebook."""

    workspace = Unicode(DEFAULT_WORKSPACE, help="the workspace folder (agentnb.sqlite and jobs/)").tag(config=True)
    model = Unicode("demo", help="default model spec: demo | scripted:<file> | openai:<model> | replay:<id>").tag(config=True)
    piece = Unicode("plan-implement-verify", help="default piece: a name or a YAML path").tag(config=True)
    store = Unicode("", help="where the jobs are kept (docs/stores.md): postgresql://user@host:port/db or "
                    "sqlite:///ABS/PATH; '' means $AGENTNB_STORE, else the workspace folder's agentnb.sqlite; "
                    "the workspace folder then holds the jobs' work directories").tag(config=True)

    def __init__(self, shell: Any = None, **kwargs: Any) -> None:
        super().__init__(shell=shell, **kwargs)
        self._ws: Workspace | None = None
        self.last_job: int | None = None
        self._used_job: int | None = None  # the job the running command named (see agent())
        self.threads: dict[int, threading.Thread] = {}
        # the workspace a setting replaced is closed once no run started here is on it (_retire.py)
        self.retirement = Retirement()
        self._panels: weakref.WeakSet[Any] = weakref.WeakSet()

    @observe("workspace", "store")
    def _workspace_changed(self, change: Any) -> None:
        old, self._ws = self._ws, None
        self.last_job = None  # job ids belong to a workspace
        if old is not None:
            def close_panels() -> None:
                for panel in [p for p in self._panels if p.ws is old]:
                    panel.close()

            self.retirement.retire(old, close_panels)

    def holding(self, ws: Workspace) -> contextlib.AbstractContextManager[None]:
        """Keep ``ws`` open while a run started from the notebook (or its panel) is on it, even if a setting
        replaces it meanwhile."""
        return self.retirement.using(ws)

    @property
    def ws(self) -> Workspace:
        """The :class:`Workspace` of ``AgentMagic.workspace`` and ``.store`` (opened once, reopened when either
        setting changes)."""
        if self._ws is None:
            self._ws = Workspace(self.workspace, store=self.store or None)
        return self._ws

    # -- dispatch ------------------------------------------------------------
    @no_var_expand
    @line_cell_magic
    def agent(self, line: str, cell: str | None = None) -> Any:
        """Run, step and inspect agentnb jobs.  ``%agent --help`` lists the sub-commands."""
        try:
            argv = split_line(line)
        except ValueError as exc:
            raise UsageError(f"%agent: cannot split the line ({one_line(exc)}); check the quotes") from None
        if cell is not None and (not argv or argv[0].startswith("-")) and not {"-h", "--help"} & set(argv):
            argv = ["run", *argv]
        if not argv or argv[0] in ("-h", "--help", "help"):
            print(self._overview())
            return None
        sub, rest = argv[0], argv[1:]
        if sub not in SUBCOMMANDS:
            raise UsageError(f"%agent: unknown sub-command {sub!r}; allowed: {', '.join(SUBCOMMANDS)}")
        prefix = f"%{'%' if cell is not None else ''}agent {sub}: "
        if cell is not None and sub not in ("run", "reply"):
            raise UsageError(f"%%agent {sub}: only run and reply take a cell body; use the line magic %agent {sub}")
        fn = getattr(self, f"cmd_{sub}")
        if "-h" in rest or "--help" in rest:
            print(_help(fn.parser))
            return None
        try:
            # options anywhere, as a shell command takes them: `reply JOB --run "text"` as well as `reply JOB "text" --run`
            args = fn.parser.parse_intermixed_args(rest)
        except UsageError as exc:
            raise UsageError(prefix + one_line(exc)) from None
        self._used_job = None
        try:
            self._fill(args)
            result = fn(args, cell)
        except UsageError as exc:
            text = one_line(exc)
            raise UsageError(text if text.startswith(("%agent", "%%agent")) else prefix + as_typed(text, rest)) from None
        except AgentnbError as exc:  # a user's mistake (VarError too): one line, no traceback
            raise UsageError(prefix + as_typed(one_line(exc), rest)) from None
        # only a command that worked moves the session's default job (a refused `step 1` does not)
        if self._used_job is not None:
            self.last_job = self._used_job
        return result

    def _overview(self) -> str:
        """The sub-commands, then every option of each (read from their parsers, so none is missing)."""
        width = max(len(sub) for sub in SUBCOMMANDS)
        lines = [f"  %agent {sub:<{width}} {_usage_line(getattr(self, f'cmd_{sub}').parser)}".rstrip()
                 for sub in SUBCOMMANDS]
        return _OVERVIEW + "\nEvery option:\n" + "\n".join(lines)

    def _fill(self, args: Any) -> None:
        """Fill ``{expr}``/``$name`` in every string argument; JOB arguments are resolved by :meth:`job`."""
        ns = self.shell.user_ns if self.shell is not None else {}
        for name, value in vars(args).items():
            if name in _JOB_ARGS or name in _VALUE_ARGS:
                continue  # job() and value() fill them, keeping the object whole
            where = "the instruction" if name in ("instruction", "text") else f"--{name}"
            if isinstance(value, str):
                setattr(args, name, expand(value, ns, where))
            elif isinstance(value, list):
                setattr(args, name, [expand(v, ns, where) if isinstance(v, str) else v for v in value])

    # -- helpers --------------------------------------------------------------
    def job(self, ref: Any = None) -> Job:
        """The job named by ``ref``; the last job of the session by default.

        ``ref`` is a job id (``3``), a Job, or text: digits, ``{expr}``/``$name`` filled from the
        notebook, or the name of a variable holding a job id or a Job.
        """
        if ref is None:
            if self.last_job is None:
                raise UsageError("no job yet in this session; give a job id (see %agent jobs)")
            ref = self.last_job
        value = ref
        if isinstance(ref, str):
            ns = self.shell.user_ns if self.shell is not None else {}
            text = ref.strip()
            value = expand_value(text, ns, "JOB") if ("{" in text or "$" in text) else text
            if isinstance(value, str):
                value = value.strip()
                if value.isidentifier():
                    if value not in ns:
                        raise UsageError(f"JOB {ref!r} is neither a job id nor a variable of the notebook; "
                                         "give a job id (see %agent jobs) or a variable holding one or a Job")
                    value = ns[value]
                elif value.lstrip("-").isdigit():
                    value = int(value)
        if isinstance(value, Job):
            job_id = value.id
        elif (isinstance(value, numbers.Integral) and not isinstance(value, bool)) or (isinstance(value, str) and value.strip().isdigit()):
            job_id = int(value)
        else:
            raise UsageError(f"JOB must be a job id or a Job, not {ref!r} (a {type(value).__name__}); "
                             "see %agent jobs")
        try:
            job = self.ws.job(job_id)
        except StoreError:
            raise UsageError(f"no job {job_id} in workspace {self.ws.root}; see %agent jobs") from None
        self._used_job = job.id
        return job

    def _expand(self, text: str) -> str:
        return expand_braces(text, self.shell.user_ns if self.shell is not None else {})

    def run_live(self, job: Job, *, background: bool = False, unit: str | None = None) -> Job:
        """Run ``job`` in a thread while its view is shown and updated as events are written.

        ``unit`` (``"movement"`` or ``"call"``) runs one step instead of running to the end.

        The view stays where the run was, in its final state, whether or not the Job is assigned
        (``job = %agent run …``).  Only when the cell's value *is* the Job — shown in full just
        below — does the live view shrink to one line.  In the foreground the call returns when
        the job stops (Ctrl-C asks it to pause after the current LLM call); in the background it
        returns at once, and the view goes on updating until the job stops.
        """
        return run_live(self, job, background=background, unit=unit)

    def after_cell(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(value of the cell)`` once, when the running cell has finished (and shown its value)."""
        shell = self.shell
        if shell is None or not hasattr(shell, "events"):
            return

        def once(result: Any) -> None:
            with contextlib.suppress(ValueError):  # already gone
                shell.events.unregister("post_run_cell", once)
            fn(getattr(result, "result", None))

        shell.events.register("post_run_cell", once)

    # -- sub-commands -------------------------------------------------------
    @magic_arguments(name="agent run")
    @argument("instruction", nargs="*", help="the task (or the body of a %%%%agent cell); {expr} and $name are filled "
              "from the notebook")
    @argument("--piece", "-p", help="piece name or YAML path (default: AgentMagic.piece)")
    @argument("--model", "-m", help="demo | scripted:<file.yaml> | openai:<model> | replay:<job_id> (default: AgentMagic.model)")
    @argument("--input", "-i", action="append", metavar="FILE", help="copy FILE into the job's input/ (repeatable)")
    @argument("--workdir", help="use an existing directory as the job's work directory")
    @argument("--background", "-b", action="store_true", help="return the Job at once; the view keeps updating")
    @argument("--queue", action="store_true", help="only submit the job (run it later with step or run --job)")
    @argument("--job", "-j", metavar="JOB", help="run this queued job (an id or a Job variable) instead of submitting one")
    @argument("--context", "-c", action="append", metavar="KEY=VALUE",
              help="a context setting of the job (repeatable), as submit's context=: on_pressure=compact, "
                   "compact_keep_last=N, max_compactions=N, window_tokens=N, thresholds.prompt=0.8, min_tool_tokens=N")
    @argument("--cache", nargs="?", const="on", metavar="MODE", help="answer calls from the call cache (on, across-epochs)")
    def cmd_run(self, args: Any, cell: str | None) -> Job:
        """Submit a job and run it until it ends or waits, showing its view as it runs."""
        # a line's words were filled one by one in agent(); a cell body is filled here, once
        text = self._expand(cell) if cell is not None else " ".join(args.instruction)
        if args.queue and args.background:  # a queued job runs nowhere yet: there is no run to go on with
            raise UsageError("%agent run: --queue only submits the job and --background runs it behind the view; "
                             "give one")
        if args.job is not None:
            return self._run_existing(args, text)
        if args.instruction and cell is not None:
            raise UsageError("%%agent: the instruction is the cell body; put only options on the first line")
        if not text.strip():
            raise UsageError('%agent run: the instruction is missing; e.g. %agent run "Summarise input/notes.md"')
        context = context_items(args.context) if args.context else None
        inputs: dict[str, Any] = {}
        for item in args.input or []:
            p = Path(item).expanduser()
            if not p.is_file():
                raise UsageError(f"%agent run: --input {item}: no such file")
            inputs[p.name] = p
        try:
            job = self.ws.submit(text.strip(), piece=args.piece or self.piece, model=args.model or self.model,
                                 inputs=inputs, workdir=args.workdir, context=context, cache=args.cache)
        except ValueError as exc:  # context= merged with the piece's thresholds (the rest are AgentnbErrors)
            raise UsageError(one_line(exc)) from None
        self.last_job = job.id
        if args.queue:
            return job
        return self.run_live(job, background=args.background)

    def _run_existing(self, args: Any, text: str) -> Job:
        # A job keeps the instruction, piece, model and files it was submitted with.
        given = [o for o, v in (("an instruction", text.strip()), ("--piece", args.piece), ("--model", args.model),
                                ("--input", args.input), ("--workdir", args.workdir), ("--queue", args.queue),
                                ("--context", args.context)) if v]
        if given:
            raise UsageError(f"%agent run --job: the job already has its instruction, piece and model; "
                             f"remove {', '.join(given)}")
        job = self.job(args.job)
        if job.status not in (JobStatus.queued, JobStatus.waiting_subtasks):
            hint = ' — answer it with %agent reply' if job.status == JobStatus.waiting_human else ""
            raise UsageError(f"%agent run --job: job {job.id} is {job.status}; only a queued job (or one waiting "
                             f"for its subtasks) can be run{hint}")
        return self.run_live(job, background=args.background)

    @magic_arguments(name="agent step")
    @argument("job", nargs="?", help="job id or Job variable (default: the last job)")
    @argument("--call", action="store_true", help="run only the next LLM call (with its tool calls)")
    def cmd_step(self, args: Any, cell: str | None) -> Job:
        """Run the next movement of a job (or its next LLM call), showing it live as it runs."""
        job = self.job(args.job)
        if job.status != JobStatus.queued:
            hint = ' — answer with %agent reply' if job.status == JobStatus.waiting_human else ""
            raise UsageError(f"%agent step: job {job.id} is {job.status}; only a queued job can be stepped{hint}")
        return self.run_live(job, unit="call" if args.call else "movement")

    @magic_arguments(name="agent reply")
    @argument("job", help="job id or Job variable")
    @argument("text", nargs="*", help="the answer (or the body of a %%%%agent reply JOB cell)")
    @argument("--run", action="store_true", help="run the job again right away")
    def cmd_reply(self, args: Any, cell: str | None) -> Job:
        """Answer a job that waits for a human (or add a comment to any job)."""
        text = self._expand(cell) if cell is not None else " ".join(args.text)
        if not text.strip():
            raise UsageError('%agent reply: the text is missing; e.g. %agent reply 3 "Use the short format."')
        job = self.ws.reply(self.job(args.job), text.strip())
        if args.run and job.status == JobStatus.queued:
            return self.run_live(job)
        return job

    @magic_arguments(name="agent stop")
    @argument("job", nargs="?", help="job id or Job variable (default: the last job)")
    def cmd_stop(self, args: Any, cell: str | None) -> None:
        """Pause a job running in this notebook (a --background run, or one the panel started) after its current LLM call
        (a streaming call is cut off at once and asked again on resume).

        The job goes back to queued, resumable with %agent run --job JOB or %agent step JOB.
        """
        job = self.job(args.job)
        if job.status != JobStatus.running:
            raise UsageError(f"%agent stop: job {job.id} is {job.status}; only a running job can be stopped")
        owner = self.ws.store.job(job.id).claimed_by or ""
        if not owned_by_this_process(owner):
            raise UsageError(f"%agent stop: job {job.id} runs in another process ({owner or 'unknown'}); "
                             "stop it there (Ctrl-C, or the Stop button of the panel that runs it)")
        self.ws.stop(job.id)
        print(f"job {job.id} will pause after its current LLM call (one that streams is cut off now, and asked "
              f"again); go on with %agent run --job {job.id} or %agent step {job.id}")

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

    @magic_arguments(name="agent fork")
    @argument("job", help="the job to fork: a job id or Job variable (it must have stopped)")
    @argument("--at", required=True, metavar="SEQ",
              help="the movement run to run live from (1 is the first); runs before it are re-served")
    @argument("--piece", "-p", dest="fork_piece", metavar="P",
              help="the piece from SEQ on: a name, a YAML path or a variable holding a Piece (default: the job's)")
    @argument("--model", "-m", help="the model from SEQ on (default: the job's)")
    @argument("--strict", action="store_true", help="a re-run tool whose result differs fails the fork")
    @argument("--no-run", action="store_true", help="only create the fork, queued (run it with run --job or step)")
    @argument("--context", "-c", action="append", metavar="KEY=VALUE",
              help="a context setting from SEQ on, merged over the job's (repeatable), as --context of run")
    def cmd_fork(self, args: Any, cell: str | None) -> Job:
        """Fork a job at a movement run: runs 1…SEQ-1 re-served from its record (no tokens spent, tools run
        again), SEQ on run live on the given piece and model, shown as it runs like %agent run; the new Job."""
        original = self.job(args.job)
        at = args.at.strip()  # text until here, so that --at {n} and --at $n are filled like any argument
        if not at.isdigit():
            raise UsageError(f"--at {args.at!r} is not a movement run number; allowed: 1, 2, … (1 is the first run)")
        piece = None if args.fork_piece is None else self.piece_value(args.fork_piece, "--piece")
        context = context_items(args.context) if args.context else None
        job = self.ws.fork(original, at=int(at), piece=piece, model=args.model, strict=args.strict, context=context,
                           run=False)
        self._used_job = job.id  # the fork, not the original, is the session's job from now on
        if args.no_run:
            return job
        return self.run_live(job)

    @magic_arguments(name="agent show")
    @argument("job", nargs="?", help="job id or Job variable (default: the last job)")
    @argument("--full", action="store_true", help="nothing cut: every call, every body in full")
    @argument("--movement", type=int, metavar="SEQ", help="only movement run SEQ (1 is the first)")
    def cmd_show(self, args: Any, cell: str | None) -> HTML:
        """Show a job's view (header and one collapsible section per movement run)."""
        from ..views.render import STYLE, movement_html

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
        """One row per LLM call as a DataFrame (every column), shown as a compact table.

        The table: movement run, call, tokens, context ratio, action, transition, latency (and cost
        when known).  The value is the full DataFrame, as ws.frames.usage gives it.
        """
        from ..views.usage_table import UsageFrame

        return UsageFrame.of(self.ws.frames.usage(None if args.all else self.job(args.job)))

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

        panel = Panel(self.ws, magic=self)
        self._panels.add(panel)  # closed with its workspace when a setting replaces it
        return panel

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
                             "description": f"INVALID: {one_line(exc)}", "path": str(path)})
        return pd.DataFrame(rows, columns=["piece", "movements", "max_movements", "description", "path"])

    @magic_arguments(name="agent tools")
    @argument("tools_piece", nargs="?", metavar="PIECE", help="piece name, YAML path or Piece variable "
              "(default: AgentMagic.piece)")
    @argument("--workdir", help="the folder the piece's MCP servers start in, as in a job's work directory "
              "(default: an empty one with input/ and output/)")
    def cmd_tools(self, args: Any, cell: str | None) -> Any:
        """Each movement's tools with their source (built-in, Python or the MCP server's name) and parameters,
        a table per movement; the piece's MCP servers are started to ask them, and stopped after."""
        from ..engine.tool_list import list_tools
        from ..views.tool_table import ToolTable

        piece = self.piece_value(args.tools_piece, "PIECE") if args.tools_piece else self.piece
        return ToolTable(list_tools(load_piece(piece), args.workdir))

    @magic_arguments(name="agent export")
    @argument("job", help="job id or Job variable")
    @argument("path", help="the .ipynb file to write")
    def cmd_export(self, args: Any, cell: str | None) -> Path:
        """Write the job as a notebook that shows the run without a kernel."""
        job = self.job(args.job)
        return self.ws.export_notebook(job, args.path)

    @magic_arguments(name="agent plot")
    @argument("job", nargs="?", help="job id or Job variable (default: the last job)")
    def cmd_plot(self, args: Any, cell: str | None) -> Any:
        """The job's usage plot (agentnb.plot_usage): context ratio per LLM call and cumulative tokens."""
        from ..views.plots import plot_usage

        return plot_usage(self.job(args.job))


    # -- batches ---------------------------------------------------------------
    def value(self, text: str, what: str) -> tuple[bool, Any]:
        """``(True, object)`` for an argument that names a notebook object (``name``, ``$name``, ``{expr}``);
        ``(False, text)`` for plain text that names no variable."""
        ns = self.shell.user_ns if self.shell is not None else {}
        text = text.strip()
        if "{" in text or "$" in text:
            value = expand_value(text, ns, what)
            return (not isinstance(value, str) or value != text), value
        if text.isidentifier() and text in ns:
            return True, ns[text]
        return False, text

    def piece_value(self, text: str, what: str) -> Any:
        """A piece argument: a variable's Piece, name or path kept whole, or the text itself."""
        found, piece = self.value(text, what)
        if found and not isinstance(piece, (str, PathLike, Piece)):
            raise UsageError(f"{what} {text}: the variable holds a {type(piece).__name__}; allowed: "
                             "a Piece, a piece name or a YAML path")
        return piece

    def _listed(self, text: str | None, what: str) -> Any:
        """A --piece/--model argument: a variable's object (a list, a Piece, a Path) kept whole, or text split
        at commas."""
        if text is None:
            return None
        found, value = self.value(text, what)
        if isinstance(value, str):
            items = [v.strip() for v in value.split(",")]
            if not all(items):
                raise UsageError(f"{what} {text!r} has an empty item; give names separated by commas, e.g. a,b")
            return items if len(items) > 1 else items[0]
        if found and isinstance(value, (list, tuple)):
            return list(value)
        return value

    def _scorers(self, names: list[str] | None) -> dict[str, Any] | None:
        """The --scorer VARs: each a dict of name → function, or a function named after its variable."""
        if not names:
            return None
        out: dict[str, Any] = {}
        for ref in names:
            found, value = self.value(ref, "--scorer")
            if not found:
                raise UsageError(f"--scorer {ref!r} is not a variable of the notebook; give the name of a variable "
                                 "holding a function(job) or a dict of name → function")
            if isinstance(value, Mapping):
                scorers = dict(value)
            elif callable(value):
                name = ref.strip().lstrip("$").strip("{}").strip()
                scorers = {name if name.isidentifier() else getattr(value, "__name__", name): value}
            else:
                raise UsageError(f"--scorer {ref}: the variable holds a {type(value).__name__}; allowed: a "
                                 "function(job) or a dict of name → function")
            twice = sorted(set(scorers) & set(out))
            if twice:
                raise UsageError(f"--scorer {ref}: scorer {twice[0]!r} is given twice")
            out.update(scorers)
        return out

    @magic_arguments(name="agent batch")
    @argument("cases", help="a variable holding the cases (a list of dicts or a DataFrame with an 'instruction' "
              "column), or the name of a batch to resume")
    @argument("--piece", "-p", dest="piece_list", metavar="PIECES",
              help="pieces, separated by commas (names or YAML paths), or a variable holding a list of them "
                   "(default: AgentMagic.piece)")
    @argument("--model", "-m", dest="model_list", metavar="MODELS",
              help="model specs, separated by commas, or a variable holding a list (default: AgentMagic.model)")
    @argument("--concurrency", "-c", type=int, default=DEFAULT_CONCURRENCY, metavar="N",
              help=f"jobs run at once (default {DEFAULT_CONCURRENCY})")
    @argument("--name", "-n", help="the batch's name; the same name again resumes it (default: batch-N)")
    @argument("--processes", type=int, metavar="N", help="worker processes (default: one per 64 jobs at once, < cores)")
    @argument("--epochs", "-e", type=int, metavar="K", help="run every case × variant K times (default 1, or the "
              "batch's own; more adds the missing epochs)")
    @argument("--scorer", "-s", action="append", metavar="VAR",
              help="a variable holding a function(job) (scored under the variable's name) or a dict of name → "
                   "function (repeatable)")
    @argument("--no-run", action="store_true", help="only create the batch (or look it up); run it later")
    @argument("--cost-limit", type=float, metavar="USD", help="pause the whole batch once it has spent this much")
    @argument("--job-cost-limit", type=float, metavar="USD", help="abort each job (with its subtasks) at this cost")
    @argument("--job-token-limit", type=int, metavar="N", help="abort each job (with its subtasks) at this many tokens")
    @argument("--baseline", metavar="VARIANT", help="after the run, the BatchComparison of every other variant "
              "against this one (a variant's number or label, or a piece or model only it has)")
    @argument("--cache", nargs="?", const="on", metavar="MODE", help="answer calls from the call cache (on, across-epochs)")
    def cmd_batch(self, args: Any, cell: str | None) -> Batch | BatchComparison:
        """Run cases × variants (pieces × models) as jobs, N at once, score them; the Batch (its summary shows).

        Ctrl-C (the stop button) pauses every running job after its current LLM call; the same line
        again (or %agent batch NAME) resumes: finished jobs are kept, the others run.
        """
        found, cases = self.value(args.cases, "CASES")
        pieces, models = self._listed(args.piece_list, "--piece"), self._listed(args.model_list, "--model")
        scorers = self._scorers(args.scorer)
        settings = {k: getattr(args, k) for k in ("epochs", "cost_limit", "job_cost_limit", "job_token_limit", "processes")}
        if isinstance(cases, Batch):
            found, cases = False, cases.name
        if args.baseline is not None:  # refused before anything is created (a resumed batch: its own variants)
            new = (self.piece if pieces is None else pieces, self.model if models is None else models) if found else ()
            check_baseline(args.baseline, self.ws.store, args.name if found else str(cases), *(new or (None, None)))
        if not found:  # a batch name: resume it
            name = str(cases)
            if args.name is not None and args.name != name:
                raise UsageError(f"give either a batch to resume ({name!r}) or --name {args.name}, not both")
            if pieces is not None or models is not None:
                raise UsageError(f"{name!r} names no variable of the notebook, so it is read as a batch to resume, "
                                 "which keeps its pieces and models; to add variants give the cases variable too")
            if reads.batch(self.ws.store, name) is None:
                known = ", ".join(b.name for b in reads.batches(self.ws.store)) or "none yet"
                raise UsageError(f"CASES {name!r} is neither a variable of the notebook nor a batch of the workspace "
                                 f"(batches: {known}); give a variable holding a list of dicts or a DataFrame")
            batch = self.ws.batch(name, scorers=scorers, concurrency=args.concurrency, run=False, cache=args.cache,
                                  **settings)
        else:
            batch = self.ws.batch(cases, piece=self.piece if pieces is None else pieces,
                                  model=self.model if models is None else models, name=args.name,
                                  scorers=scorers, concurrency=args.concurrency, run=False, cache=args.cache,
                                  **settings)
        if args.no_run:
            return batch
        # after Ctrl-C, the executor's one line says what paused and to resume with this magic
        with contextlib.suppress(KeyboardInterrupt):
            batch.run(concurrency=args.concurrency, resume=f"%agent batch {batch.name}", processes=args.processes)
        return batch if args.baseline is None else batch.compare(baseline=args.baseline)

    @magic_arguments(name="agent batches")
    def cmd_batches(self, args: Any, cell: str | None) -> Any:
        """Every batch of the workspace as a DataFrame: name, created, jobs and how many are in each status."""
        return _batches_frame(reads.batches(self.ws.store))

    # -- comparing runs (docs/fork-compare.md) ------------------------------------------------------------------
    @magic_arguments(name="agent compare")
    @argument("a", help="the first job: a job id or Job variable")
    @argument("b", help="the second job: a job id or Job variable")
    def cmd_compare(self, args: Any, cell: str | None) -> Comparison:
        """Two jobs side by side, aligned by movement run, with the first point where they diverge marked;
        the value is the Comparison (.frame, .files())."""
        return self.ws.compare(self.job(args.a), self.job(args.b))


def _batches_frame(rows: list[BatchRecord]) -> Any:
    """``ws.batches()`` as a DataFrame: name, created, updated (UTC, as ``ws.frames.jobs``, to the second: the
    nanoseconds only widened the table), jobs, one count per job status."""
    import pandas as pd

    columns = ["name", "created", "updated", "jobs", *JOB_STATES]
    df = pd.DataFrame([{"name": r.name, "created": r.created, "updated": r.updated, "jobs": r.jobs,
                        **{s: (r.counts or {}).get(s, 0) for s in JOB_STATES}} for r in rows], columns=columns)
    for col in ("created", "updated"):
        df[col] = pd.to_datetime(pd.to_numeric(df[col]), unit="s").astype("datetime64[ns]").dt.floor("s")
    return df.astype({"jobs": "int64", **{s: "int64" for s in JOB_STATES}})


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%agent`` / ``%%agent``, make ``AgentMagic`` configurable with ``%config`` and show an
    ``AgentnbError`` raised by a cell as one line (:mod:`agentnb.notebook.tracebacks`).

    ``%load_ext agentnb`` (:func:`agentnb.load_ipython_extension`) calls this, then gives the notebook the
    name ``agentnb``.
    """
    magic = AgentMagic(shell=ipython, config=ipython.config)
    ipython.register_magics(magic)
    if magic not in ipython.configurables:
        ipython.configurables.append(magic)
    install_one_line_errors(ipython)  # an AgentnbError from the Python API in a cell: one line, as the magic's
    if getattr(ipython, "kernel", None) is not None:
        # In a notebook, install the keeper of the live views' open sections once (a page-wide script: it
        # also serves the panel's view, whose widget cannot run scripts); a terminal gets nothing.
        display(HTML(KEEPER))

