"""The ``agentnb`` command: the Workspace operations for terminals and scripts.

Exit codes of ``run`` (and of ``fork`` and ``replay``, which run the new job the same way): 0 when the job
succeeded or waits for a human, 1 when it failed or was aborted, 2 on a usage, piece, model-spec or store error (one line on
stderr, no traceback), 130 after Ctrl-C and 143 after SIGTERM (the running job is
queued again).  ``batch``: 0 when every job ended (succeeded, failed or aborted),
3 when some wait for a human (answer them with ``reply``, then rerun the command),
2 and 130 as ``run`` (after Ctrl-C the running jobs are paused after their current
LLM call; the same command again resumes).  ``jobs``, ``show``, ``export`` and
``batches`` open the store read-only.  ``store copy SRC DST``: 0 when every row and file was copied and
counted again in DST (one line per table on stdout), 2 when it was refused or failed (one line; DST as it was).
``tools PIECE``: 0 when every MCP server of the piece answered, 1 when one could not (its line on stderr; the
other tools still listed), 2 on a bad piece.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cache_cli import add_cache_commands, add_cache_option
from .engine.context import context_items
from .engine.pieces import PieceError, available_pieces
from .errors import AgentnbError, UsageError, as_typed
from .events import payload_dict
from .executor import GRACE, check_poll, check_slots
from .interrupts import Terminated, sigterm_interrupts
from .store import BACKEND_ERRORS, describe_error, reads
from .store.base import JobStatus
from .store.reads import total_tokens
from .store.records import MovementRecord
from .views.timeline import MovementRun, fold

if TYPE_CHECKING:
    from .workspace import Job, Workspace

__all__ = ["main"]

# errors met using a store (a damaged, locked or read-only file, a full disk, a path that is a file)
_STORE_FAILURES: tuple[type[Exception], ...] = (*BACKEND_ERRORS, OSError)


class _Usage(UsageError):
    """A command used wrongly: the message follows ``agentnb: error:``."""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, any_order: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # a sub-command takes its options anywhere (`reply 1 yes --run please`), as shells' commands do;
        # argparse alone ends a positional list at the first option and then refuses what follows it
        self._any_order = any_order
        self._mixing = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        # the subparsers action calls this on the sub-command's parser; parse_known_intermixed_args calls it
        # back twice itself (options first, then positionals), which must parse as argparse does
        if not self._any_order or self._mixing:
            return super().parse_known_args(args, namespace)
        self._mixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._mixing = False

    def error(self, message: str) -> None:  # type: ignore[override]
        # main() prefixes "agentnb: error:"; a sub-command adds its own name
        sub = self.prog.split(" ", 1)[1] if " " in self.prog else ""
        raise _Usage(f"{sub}: {message}" if sub else message)


# the positional arguments, named as the help names them; a list of them is one text, joined by spaces
_POSITIONAL = frozenset({"instruction", "text", "cases", "src", "dst", "path"})


def _check_utf8(args: argparse.Namespace) -> None:
    """Refuse, before anything is opened, an argument that is not UTF-8: Python hands its bytes over as lone
    surrogates (PEP 383), which no store can keep (the instruction, a reply, a name, a folder that is stored)."""
    for dest, value in vars(args).items():
        if isinstance(value, list) and dest in _POSITIONAL:
            value = " ".join(map(str, value))
        for text in value if isinstance(value, list) else [value]:
            if not isinstance(text, str) or text.isascii():
                continue
            name = dest if dest in _POSITIONAL else "--" + dest.replace("_", "-")
            try:
                text.encode("utf-8")
                continue
            except UnicodeEncodeError as exc:
                what = f"character U+{ord(text[exc.start]):04X} at position {exc.start}"
            try:  # the bytes as they were given, to name the first one that is not UTF-8 where it is
                text.encode("utf-8", "surrogateescape").decode("utf-8")
            except UnicodeEncodeError:
                pass
            except UnicodeDecodeError as exc:
                what = f"byte 0x{exc.object[exc.start]:02x} at position {exc.start}"
            raise UsageError(f"{name}: not valid UTF-8 ({what}); pass UTF-8 text")


def _folder(args: argparse.Namespace) -> Path:
    return Path(getattr(args, "workspace", None) or os.environ.get("AGENTNB_WORKSPACE") or "agentnb-data")


def _workspace(args: argparse.Namespace, *, readonly: bool = False) -> Workspace:
    from .workspace import Workspace

    # --store, else $AGENTNB_STORE (read by Workspace), else the folder's own agentnb.sqlite (docs/stores.md)
    ws = Workspace(_folder(args), readonly=readonly, store=getattr(args, "store", None),
                   lease=getattr(args, "lease", None))
    _OPENED.append(ws)
    return ws


# the workspaces a command opened, closed when it returns (a PostgreSQL pool must not be left to the collector)
_OPENED: list[Workspace] = []


def _close_opened() -> None:
    while _OPENED:
        with contextlib.suppress(Exception):  # closing must not hide the command's own outcome
            _OPENED.pop().close()


def _question(ws: Workspace, job: Job) -> str | None:
    """The agent's latest question to the user (the ASK), if it asked one."""
    asked = [c.body for c in reads.comments(ws.store, job.id) if c.author == "agent"]
    return asked[-1] if asked else None


def _run_line(mv: MovementRecord, run: MovementRun | None, served_from: int | None) -> str:
    """A movement run as ``agentnb show`` lists it."""
    n = len(run.compactions) if run is not None else 0
    forced = (" (forced)" if mv.forced else "") + (f" ({n} compaction{'s' if n > 1 else ''})" if n else "") \
        + (" (loop detected)" if run is not None and run.loops else "")
    served = f"re-served from job {served_from}: " if served_from is not None else ""
    return (f"  {mv.seq:>2}. {mv.name:<14} {served}{mv.iterations:>3} {'call ' if mv.iterations == 1 else 'calls'} → {mv.next_step or '…'}{forced}"
            + (f"  {mv.summary}" if mv.summary else ""))


def _print_job(ws: Workspace, job: Job) -> None:
    print(f"job {job.id}: {job.status}  piece={job.piece} model={job.model}")
    if job.forked_from is not None:
        print(f"  forked from job {job.forked_from[0]} at run {job.forked_from[1]}")
    # a fork's runs re-served from the original's record (no tokens spent): their movement_start names it
    # and how many times each run compacted its context, and the runs that closed a loop (docs/context.md)
    tl = fold(ws.events(job, kinds=["movement_start", "compaction", "loop_detected"]))
    reserved = tl.reserved_runs() if job.forked_from else {}
    for mv in reads.movements(ws.store, job.id):
        print(_run_line(mv, tl.run(mv.seq), reserved.get(mv.seq)))
    print(f"  tokens: {total_tokens(ws.store, job.id):,}")
    if job.error:
        print(f"  error: {job.error}")
    if job.status == JobStatus.waiting_human:
        question = _question(ws, job)
        if question:
            print(f"  question: {question}")
        print(f"  answer with: agentnb reply {job.id} \"…\"")
    if job.status == JobStatus.waiting_subtasks:
        # the parent only goes on when every child has ended: say which ones are still open and why
        for child in ws.children(job):
            print(f"  subtask job {child.id}: {child.status}  {child.instruction.splitlines()[0][:60] if child.instruction else ''}")
            if child.status == JobStatus.waiting_human:
                asked = _question(ws, child)
                if asked:
                    print(f"    question: {asked}")
                print(f"    answer with: agentnb reply {child.id} \"…\" --run")
            elif child.status == JobStatus.waiting_subtasks:
                print(f"    waits for its own subtasks: agentnb show {child.id}")
    print(f"  work directory: {job.workdir}")


def _following(args: argparse.Namespace, ws: Workspace, job: Job) -> contextlib.AbstractContextManager[object]:
    """What the run prints as it goes (docs/cli.md#following-a-run): with ``--follow``, or by default when stdout
    is a terminal (a person watches it; a pipe or a file gets only the job's lines, as a script expects)."""
    follow = getattr(args, "follow", None)
    tty = sys.stdout.isatty()
    if not (tty if follow is None else follow):
        return contextlib.nullcontext()
    from .follow import Follower

    style = tty and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"
    return Follower(ws.execution, sys.stdout, job_id=job.id, style=style)


def cmd_run(args: argparse.Namespace) -> int:
    if args.detach and args.follow:  # a queued job is run by a worker elsewhere: there is nothing here to follow
        raise _Usage("run: --detach queues the job for a worker and --follow prints its run here; give one")
    context = context_items(args.context) if args.context else None  # refused before the store is opened
    ws = _workspace(args)
    inputs = {}
    for item in args.input or []:
        p = Path(item)
        if not p.is_file():
            raise _Usage(f"--input {item}: no such file")
        inputs[p.name] = p.read_bytes()
    instruction = " ".join(args.instruction).strip()
    if not instruction:
        raise _Usage("run: the instruction is missing")
    job = ws.submit(instruction, piece=args.piece, model=args.model, inputs=inputs, workdir=args.workdir,
                    context=context, retries=args.retries, max_backoff=args.max_backoff, cache=args.cache,
                    cost_limit=args.cost_limit, token_limit=args.token_limit)
    if args.detach:
        print(job.id)
        return 0
    with _following(args, ws, job):
        job = ws.run(job)
    _print_job(ws, job)
    return 0 if job.status in (JobStatus.succeeded, JobStatus.waiting_human, JobStatus.waiting_subtasks) else 1


def _ran(ws: Workspace, job: Job) -> int:
    """Print a job that was run and give ``run``'s exit code for it."""
    _print_job(ws, job)
    return 0 if job.status in (JobStatus.succeeded, JobStatus.waiting_human, JobStatus.waiting_subtasks) else 1


def cmd_fork(args: argparse.Namespace) -> int:
    context = context_items(args.context) if args.context else None
    ws = _workspace(args)
    job = ws.fork(args.job, at=args.at, piece=args.piece, model=args.model, strict=args.strict, context=context,
                  run=False)
    if args.no_run:
        _print_job(ws, job)
        print(f"  run it with: agentnb worker (or %agent run --job {job.id} in a notebook)")
        return 0
    with _following(args, ws, job):
        job = ws.run(job)
    return _ran(ws, job)


def cmd_replay(args: argparse.Namespace) -> int:
    ws = _workspace(args)
    job = ws.replay(args.job, piece=args.piece, run=False)
    with _following(args, ws, job):
        job = ws.run(job)
    return _ran(ws, job)


def cmd_worker(args: argparse.Namespace) -> int:
    # refused before the store is opened, as one line
    check_slots(args.concurrency)
    check_poll(args.poll)
    if not args.grace >= 0:
        raise UsageError(f"--grace {args.grace}; allowed: a number of seconds ≥ 0")
    if args.max_jobs is not None and args.max_jobs < 1:
        raise UsageError(f"--max-jobs {args.max_jobs}; allowed: a whole number ≥ 1 (the jobs to claim before stopping)")
    worker = _workspace(args).worker()
    try:
        worker.run(forever=args.forever, poll=args.poll, max_jobs=args.max_jobs, concurrency=args.concurrency,
                   grace=args.grace)
    finally:
        # the jobs this process ran, said even when a SIGTERM ends it: what the logs of many workers add up to
        ids = f": {' '.join(map(str, worker.ran))}" if args.list and worker.ran else ""
        print(f"ran {len(worker.ran)} job(s){ids}", flush=True)
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    ws = _workspace(args, readonly=True)
    jobs = ws.jobs()
    if args.json:
        print(json.dumps([{k: getattr(j, k) for k in ("id", "parent_id", "piece", "model", "status", "error")}
                          for j in jobs], default=str))
        return 0
    if not jobs:
        print("no jobs")
        return 0
    # a fork's origin as JOB@RUN (forked from job JOB at movement run RUN); the column only when a fork exists
    forks = {j.id: f"{j.forked_from[0]}@{j.forked_from[1]}" for j in jobs if j.forked_from is not None}
    width = max((len(v) for v in forks.values()), default=0)
    origin = (lambda j: f"{forks.get(j.id, ''):<{max(width, 4)}} ") if forks else (lambda j: "")
    print(f"{'id':>4}  {'status':<16} {'piece':<24} {'model':<24} " + (f"{'from':<{max(width, 4)}} " if forks else "")
          + "instruction")
    for j in jobs:
        instr = j.instruction.replace("\n", " ")
        print(f"{j.id:>4}  {j.status.value:<16} {j.piece:<24} {j.model:<24} {origin(j)}{instr[:50]}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    ws = _workspace(args, readonly=True)
    job = ws.job(args.job)
    if args.events:
        for ev in ws.events(job):
            print(json.dumps({"id": ev.id, "kind": ev.kind, "seq": ev.movement_seq, "iteration": ev.iteration,
                              **payload_dict(ev)}, ensure_ascii=False, default=str))
        return 0
    _print_job(ws, job)
    return 0


def cmd_reply(args: argparse.Namespace) -> int:
    ws = _workspace(args)
    job = ws.reply(args.job, " ".join(args.text))
    if args.run and job.status == JobStatus.queued:
        job = _run_up(args, ws, job)
    _print_job(ws, job)
    return 0


def _run_up(args: argparse.Namespace, ws: Workspace, job: Job) -> Job:
    """Run ``job``; when it was a subtask whose parent it was the last one to wait for, go on with the
    parent (and so on up).  Returns the last job run."""
    with _following(args, ws, job):
        job = ws.run(job)
    while job.parent_id is not None:
        parent = ws.job(job.parent_id)
        if parent.status != JobStatus.queued:
            break
        _print_job(ws, job)
        with _following(args, ws, parent):
            job = ws.run(parent)
    return job


def cmd_retry(args: argparse.Namespace) -> int:
    ws = _workspace(args)
    job = ws.retry(args.job, retries=args.retries, max_backoff=args.max_backoff)
    if not args.run:
        _print_job(ws, job)
        print(f"  run it with: agentnb retry {job.id} --run (or let a worker take it: agentnb worker)")
        return 0
    job = _run_up(args, ws, job)
    _print_job(ws, job)
    return 0 if job.status in (JobStatus.succeeded, JobStatus.waiting_human, JobStatus.waiting_subtasks) else 1


def cmd_export(args: argparse.Namespace) -> int:
    ws = _workspace(args, readonly=True)
    path = ws.export_notebook(args.job, args.path)
    print(path)
    return 0


def _otel_jobs(ws: Workspace, args: argparse.Namespace) -> list[Any]:
    jobs: list[Any] = list(args.job)
    if args.batch:
        if reads.batch(ws.store, args.batch) is None:
            known = ", ".join(b.name for b in reads.batches(ws.store)) or "none yet"
            raise _Usage(f"otel {args.otel_command}: no batch {args.batch!r} (batches: {known})")
        jobs += [r.id for r in ws.store.jobs(batch=args.batch)]
    if not jobs:
        raise _Usage(f"otel {args.otel_command}: name jobs (JOB …) or a batch (--batch NAME)")
    return jobs


def cmd_otel_export(args: argparse.Namespace) -> int:
    ws = _workspace(args, readonly=True)
    print(ws.export_otel([ws.job(j) for j in _otel_jobs(ws, args)], args.out, content=args.content, max_chars=args.max_chars))
    return 0


def cmd_otel_send(args: argparse.Namespace) -> int:
    from .views.otel import DEFAULT_MAX_CHARS, send_otel

    ws = _workspace(args, readonly=True)
    ids = [ws.job(j).id for j in _otel_jobs(ws, args)]
    sent = send_otel(ws.store, ids, args.endpoint, content=args.content,
                     max_chars=DEFAULT_MAX_CHARS if args.max_chars is None else args.max_chars)
    print(f"{sent} spans sent")
    return 0


def cmd_store_copy(args: argparse.Namespace) -> int:
    from .store import copy_store, summary_lines

    counts = copy_store(args.src, args.dst, running=args.running)
    for line in summary_lines(counts):
        print(line)
    return 0


def cmd_pieces(args: argparse.Namespace) -> int:
    from .engine.pieces import load_piece

    for name, path in sorted(available_pieces().items()):
        try:
            p = load_piece(path)
            print(f"{name:<24} {' → '.join(p.names):<40} {p.description}")
        except PieceError as exc:
            print(f"{name:<24} INVALID: {exc}")
    return 0


def cmd_tools(args: argparse.Namespace) -> int:
    """Each movement's tools, a table each; 1 when an MCP server could not be asked (its line on stderr)."""
    from .engine.pieces import load_piece
    from .engine.tool_list import list_tools
    from .views.tool_table import ToolTable

    listing = list_tools(load_piece(args.piece), args.workdir)
    for line in listing.failures:
        print(f"agentnb: error: {line}", file=sys.stderr)
    print(ToolTable(listing).text(failures=False))
    return 1 if listing.failures else 0


# `agentnb batch`: some jobs wait for a human (or for subtasks that do), so the batch has not ended
EXIT_WAITING = 3


def _cell(value: str | None) -> str | None:
    """A CSV cell: an empty one is a missing value."""
    return None if value is None or value == "" else value


def _case_inputs(value: object, base: Path, where: str) -> object:
    """A case's ``inputs`` from a file: a folder path (relative to the cases file's folder), or a dict."""
    if isinstance(value, str):
        folder = (base / Path(value).expanduser())
        if not folder.is_dir():
            what = "a file, not a folder" if folder.exists() else "no such folder"
            raise _Usage(f"batch: {where}: inputs {value!r} is {what} (a relative path is read from {base})")
        return folder
    return value


def read_cases(path: Path) -> list[dict[str, object]]:
    """The cases of a ``.csv`` (a header row, then one case a row) or ``.jsonl`` file (one JSON object a line).

    Columns / keys map to case fields: ``instruction`` (required), ``inputs`` (in a CSV a folder path; in
    JSONL a dict of file name → text, or a folder path), ``expected``, any other column carried through.
    A missing file, another extension or a malformed row is a usage error naming the line.
    """
    import csv

    suffix = path.suffix.lower()
    if suffix not in (".csv", ".jsonl"):
        raise _Usage(f"batch: {path}: cases must be a .csv or a .jsonl file, not {suffix or 'a file without an extension'}")
    if not path.is_file():
        raise _Usage(f"batch: {path}: no such file")
    base = path.resolve().parent
    cases: list[dict[str, object]] = []
    try:
        with path.open(encoding="utf-8", newline="") as f:
            if suffix == ".csv":
                reader = csv.DictReader(f, strict=True)
                fields = reader.fieldnames or []
                if "instruction" not in fields:
                    raise _Usage(f"batch: {path} line 1: the header has no 'instruction' column "
                                 f"(columns: {', '.join(fields) or 'none'})")
                for row in reader:
                    where = f"{path} line {reader.line_num}"
                    if None in row or any(v is None for v in row.values()):
                        raise _Usage(f"batch: {where}: {len(fields)} columns expected, as in the header")
                    case: dict[str, object] = {k: _cell(v) for k, v in row.items()}
                    if not case.get("instruction"):
                        raise _Usage(f"batch: {where}: the instruction is empty")
                    if case.get("inputs") is not None:
                        case["inputs"] = _case_inputs(case["inputs"], base, where)
                    cases.append(case)
            else:
                for n, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    where = f"{path} line {n}"
                    try:
                        data = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise _Usage(f"batch: {where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
                    if not isinstance(data, dict):
                        raise _Usage(f"batch: {where}: a JSON {type(data).__name__}; each line must be an object "
                                     'such as {"instruction": "..."}')
                    if not isinstance(data.get("instruction"), str) or not data["instruction"].strip():
                        raise _Usage(f"batch: {where}: 'instruction' must be non-empty text")
                    inputs = data.get("inputs")
                    if inputs is not None and not isinstance(inputs, (str, dict)):
                        raise _Usage(f"batch: {where}: inputs is a JSON {type(inputs).__name__}; allowed: an object "
                                     "of file name → text, or a folder path")
                    if inputs is not None:
                        data["inputs"] = _case_inputs(inputs, base, where)
                    cases.append(data)
    except UnicodeDecodeError as exc:
        raise _Usage(f"batch: {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except csv.Error as exc:
        raise _Usage(f"batch: {path}: not a valid CSV file ({exc})") from None
    if not cases:
        raise _Usage(f"batch: {path}: no cases (the file has no rows)")
    return cases


def _print_batch(batch: object) -> None:
    import pandas as pd

    from .views.batch_stats import plus_minus

    summary = batch.summary()  # type: ignore[attr-defined]
    print(repr(batch))
    with pd.option_context("display.width", 200, "display.max_columns", None, "display.max_colwidth", 60):
        # each variant by its short label; the full piece and model spec once each, below the table
        print(plus_minus(summary.drop(columns=["piece", "model"])).to_string(index=False))  # ± : half the 95 % CI
    for _, row in summary.iterrows():
        print(f"variant {row['variant']}: {row['piece']} × {row['model']}")


def cmd_batch(args: argparse.Namespace) -> int:
    from .batch import batch_of_cases
    from .batch_compare import check_baseline
    from .processes import check_processes

    check_processes(args.processes)  # a bad number: one line, before anything is created
    cases = read_cases(Path(args.cases).expanduser())
    ws = _workspace(args)
    # without --name, the same command again resumes the batch it made (the one of these very cases)
    name = args.name if args.name is not None else batch_of_cases(ws.store, cases)
    if args.baseline is not None:  # refused before anything is created
        check_baseline(args.baseline, ws.store, name, args.piece or ["plan-implement-verify"], args.model or ["demo"])
    batch = ws.batch(cases, piece=args.piece or ["plan-implement-verify"], model=args.model or ["demo"],
                     name=name, concurrency=args.concurrency, retries=args.retries, max_backoff=args.max_backoff,
                     cost_limit=args.cost_limit, job_cost_limit=args.job_cost_limit,
                     job_token_limit=args.job_token_limit, run=False, epochs=args.epochs, cache=args.cache,
                     processes=args.processes)
    if args.detach:  # workers (on this or other machines) run the queued jobs; the same command later scores
        queued = [j.id for j in batch.jobs if j.status == JobStatus.queued]
        print(f"batch {batch.name!r}: {len(batch.jobs)} job(s), {len(queued)} queued")
        print("  run them with: agentnb worker (on any machine sharing the store), then run the same command "
              "again without --detach to score and summarise them")
        return 0
    try:
        # the one line after Ctrl-C (from the executor) says how to resume here: not ws.batch(…) but the command
        batch.run(concurrency=args.concurrency, progress=not args.no_progress, processes=args.processes,
                  resume=f"the same command again (batch {batch.name!r})")
    except KeyboardInterrupt:
        return 130
    _print_batch(batch)
    if args.baseline is not None:
        print(batch.compare(baseline=args.baseline).to_text())
    waiting = [j.id for j in batch.jobs if j.status in (JobStatus.waiting_human, JobStatus.waiting_subtasks)]
    if waiting:
        print(f"job(s) {', '.join(map(str, waiting))} wait for a human: see agentnb show JOB, answer with "
              "agentnb reply JOB \"…\", then run the same command again")
        return EXIT_WAITING
    return 0


def cmd_batches(args: argparse.Namespace) -> int:
    from .store import reads
    from .store.base import JOB_STATES

    ws = _workspace(args, readonly=True)
    rows = reads.batches(ws.store)
    if not rows:
        print("no batches")
        return 0
    import datetime as dt

    short: dict[str, str] = {JobStatus.waiting_human: "wait_human", JobStatus.waiting_subtasks: "wait_sub"}
    heads = [short.get(s, s) for s in JOB_STATES]
    width = max(12, *(len(r.name) for r in rows))
    print(f"{'name':<{width}}  {'created (UTC)':<19}  {'jobs':>5}  " + "  ".join(f"{h:>{max(len(h), 5)}}" for h in heads))
    for r in rows:
        created = dt.datetime.fromtimestamp(r.created, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        counts = r.counts or {}
        print(f"{r.name:<{width}}  {created:<19}  {r.jobs:>5}  "
              + "  ".join(f"{counts.get(s, 0):>{max(len(h), 5)}}" for s, h in zip(JOB_STATES, heads, strict=True)))
    return 0


def _retry_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--retries", type=int, metavar="N",
                   help="openai: tries after the first on 429, 5xx, timeouts and malformed answers "
                        "(default: $AGENTNB_OPENAI_RETRIES, else 4)")
    p.add_argument("--max-backoff", type=float, metavar="SECONDS",
                   help="openai: the longest wait between two tries (default: $AGENTNB_OPENAI_MAX_BACKOFF, else 60)")


def _limit_options(p: argparse.ArgumentParser, prefix: str) -> None:
    for unit, kind in (("cost", float), ("token", int)):  # docs/design-lab.md#budgets
        p.add_argument(f"--{prefix}{unit}-limit", type=kind, metavar="USD" if kind is float else "N",
                       help=f"abort {'each' if prefix else 'the'} job once it and its subtasks have spent this many {'US dollars' if kind is float else 'tokens'}")


def _follow_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--follow", action=argparse.BooleanOptionalAction, default=None,
                   help="print each movement run's streamed text, tool calls and results as they come "
                        "(default: on when stdout is a terminal)")


def _context_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--context", action="append", metavar="KEY=VALUE",
                   help=f"{what} (repeatable), as submit's context=: on_pressure=compact, "
                        "compact_keep_last=N, max_compactions=N, window_tokens=N, thresholds.prompt=0.8, "
                        "min_tool_tokens=N")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="agentnb", description="Run and inspect agentnb jobs.")
    parser.add_argument("--workspace", help="workspace folder (default: $AGENTNB_WORKSPACE, else ./agentnb-data)")
    parser.add_argument("--store", help="where jobs are kept: postgresql://user@host:port/db or sqlite:///ABS/PATH "
                        "(default: $AGENTNB_STORE, else the workspace folder's agentnb.sqlite); the workspace "
                        "folder then holds only the work directories")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, any_order=True)
        p.add_argument("--workspace", default=argparse.SUPPRESS, help="workspace folder")
        p.add_argument("--store", default=argparse.SUPPRESS, help="store URL (postgresql://… or sqlite:///…)")
        p.set_defaults(fn=fn)
        return p

    p = add("run", cmd_run, "submit a job and run it")
    p.add_argument("--piece", default="plan-implement-verify", help="piece name or YAML path")
    p.add_argument("--model", default="demo", help="demo | scripted:<file.yaml> | openai:<model> | replay:<job_id>")
    p.add_argument("--input", action="append", metavar="FILE", help="copy FILE into the job's input/ (repeatable)")
    p.add_argument("--workdir", help="use an existing directory as the work directory")
    p.add_argument("--detach", action="store_true", help="only queue the job (a worker runs it); print its id")
    _follow_option(p)
    _context_option(p, "a context setting of the job")
    _retry_options(p)
    add_cache_option(p)
    _limit_options(p, "")
    p.add_argument("instruction", nargs="*", help="the task")

    p = add("worker", cmd_worker, "run queued jobs (until none is left, or --forever)")
    p.add_argument("--concurrency", type=int, default=1, metavar="N",
                   help="jobs run at once, each in a thread of its own (default 1)")
    p.add_argument("--forever", action="store_true",
                   help="keep waiting for new jobs (PostgreSQL: woken by LISTEN/NOTIFY; SQLite: polling)")
    p.add_argument("--poll", type=float, default=None, metavar="SECONDS",
                   help="the longest idle wait between two claims (default 1 on SQLite; 5 on PostgreSQL, "
                        "where a NOTIFY wakes the worker sooner)")
    p.add_argument("--grace", type=float, default=GRACE, metavar="SECONDS",
                   help=f"on SIGTERM, how long running jobs get to pause after their current LLM call before "
                        f"they are given back to the queue as they stand (default {GRACE:g})")
    p.add_argument("--max-jobs", type=int, default=None, metavar="N", help="stop after claiming N jobs")
    p.add_argument("--list", action="store_true", help="print the ids of the jobs it ran")
    # checked by Workspace (one line naming what is allowed), as AGENTNB_LEASE is
    p.add_argument("--lease", metavar="SECONDS", default=None,
                   help="seconds a claimed job stays this worker's without renewal (default: $AGENTNB_LEASE, else 30)")

    p = add("jobs", cmd_jobs, "list jobs")
    p.add_argument("--json", action="store_true")

    p = add("show", cmd_show, "show a job")
    p.add_argument("job", type=int)
    p.add_argument("--events", action="store_true", help="print every event as a JSON line")

    p = add("reply", cmd_reply, "answer a job that waits for a human")
    p.add_argument("job", type=int)
    p.add_argument("text", nargs="+")
    p.add_argument("--run", action="store_true",
                   help="run the job again right away (and its parent, when it was the last subtask it waited for)")
    _follow_option(p)

    p = add("retry", cmd_retry, "queue a failed or aborted job again; it goes on from its last complete call")
    p.add_argument("job", type=int)
    p.add_argument("--run", action="store_true", help="run it right away (and its parent, when it waits for it)")
    _follow_option(p)
    _retry_options(p)

    p = add("fork", cmd_fork, "a new job: runs 1…SEQ-1 of JOB re-served from its record (no tokens), SEQ on run live")
    p.add_argument("job", type=int, help="the job to fork (it must have stopped)")
    p.add_argument("--at", type=int, required=True, metavar="SEQ",
                   help="the movement run to run live from (1 is the first); the runs before it are re-served")
    p.add_argument("--piece", help="piece name or YAML path from SEQ on (default: the job's)")
    p.add_argument("--model", help="model spec from SEQ on (default: the job's)")
    p.add_argument("--strict", action="store_true", help="a re-run tool whose result differs fails the fork")
    p.add_argument("--no-run", action="store_true", help="only create the fork, queued (a worker runs it)")
    _follow_option(p)
    _context_option(p, "a context setting from SEQ on, merged over the job's")

    p = add("replay", cmd_replay, "a new job on replay:JOB: every response re-served, every tool run again")
    p.add_argument("job", type=int, help="the job to replay (it must have stopped)")
    p.add_argument("--piece", help="piece name or YAML path (default: the job's)")
    _follow_option(p)

    p = add("export", cmd_export, "export a job as a notebook")
    p.add_argument("job", type=int)
    p.add_argument("path")

    add("pieces", cmd_pieces, "list the available pieces")

    p = add("tools", cmd_tools, "list each movement's tools with their source (built-in, Python or an MCP server) "
            "and parameters; starts the piece's MCP servers to ask them")
    p.add_argument("piece", metavar="PIECE", help="piece name or YAML path")
    p.add_argument("--workdir", help="the folder the MCP servers start in, as in a job's work directory "
                   "(default: an empty one with input/ and output/)")

    p = add("batch", cmd_batch, "run every case of a .csv/.jsonl file under every piece × model; print the summary")
    p.add_argument("cases", metavar="CASES", help="a .csv (a header with 'instruction', optional 'inputs' (a folder), "
                   "'expected', other columns) or .jsonl file (one object a line)")
    p.add_argument("--piece", action="append", metavar="PIECE",
                   help="piece name or YAML path (repeatable: one variant each; default plan-implement-verify)")
    p.add_argument("--model", action="append", metavar="MODEL",
                   help="model spec (repeatable: crossed with every piece; default demo)")
    p.add_argument("--concurrency", type=int, default=4, metavar="N", help="jobs run at once (default 4)")
    p.add_argument("--processes", type=int, metavar="N", help="worker processes that run the jobs (default: one per "
                   "64 jobs at once, at most one per core but one)")
    p.add_argument("--epochs", type=int, metavar="K", help="run every case × variant K times (default 1, or the "
                   "batch's own; more adds the missing epochs)")
    p.add_argument("--name", help="the batch's name: the same command again resumes it (default: the batch of the same cases, "
                   "or a new batch-N)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--baseline", metavar="VARIANT", help="also print every other variant against this one, paired by case")
    p.add_argument("--detach", action="store_true",
                   help="only create the batch and queue its jobs (workers run them); print its name")
    _retry_options(p)
    add_cache_option(p)
    _limit_options(p, "job-")
    p.add_argument("--cost-limit", type=float, metavar="USD", help="pause the whole batch once it has spent this much")

    add("batches", cmd_batches, "list the batches: name, created, jobs and how many are in each status")
    add_cache_commands(sub, _workspace, _Parser)

    p = sub.add_parser("otel", help="jobs as OpenTelemetry GenAI traces (otel export … --out FILE, otel send …)")
    otel_sub = p.add_subparsers(dest="otel_command", parser_class=_Parser, required=True)
    for name, fn, help_ in (("export", cmd_otel_export, "write OTLP JSON Lines, one trace per root job"),
                            ("send", cmd_otel_send, "post OTLP/HTTP (protobuf) to a collector's /v1/traces")):
        p = otel_sub.add_parser(name, any_order=True, help=help_)
        p.add_argument("--workspace", default=argparse.SUPPRESS, help="workspace folder")
        p.add_argument("--store", default=argparse.SUPPRESS, help="store URL (postgresql://… or sqlite:///…)")
        p.add_argument("job", type=int, nargs="*", metavar="JOB", help="a job (a subtask exports its root's trace)")
        p.add_argument("--batch", metavar="NAME", help="every job of batch NAME")
        p.add_argument("--content", action="store_true", help="add messages, tool arguments and results "
                       "(scrubbed of secrets, cut to --max-chars per attribute)")
        p.add_argument("--max-chars", type=int, default=None, metavar="N", help="the longest content attribute")
        if name == "export":
            p.add_argument("--out", required=True, metavar="FILE", help="the .jsonl file to write")
        else:
            p.add_argument("--endpoint", metavar="URL", help="the collector's base URL, e.g. http://127.0.0.1:4318 "
                           "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as it is, else $OTEL_EXPORTER_OTLP_ENDPOINT); "
                           "headers from $OTEL_EXPORTER_OTLP_TRACES_HEADERS, else $OTEL_EXPORTER_OTLP_HEADERS")
        p.set_defaults(fn=fn)

    p = sub.add_parser("store", help="move a workspace between stores (store copy SRC DST)")
    store_sub = p.add_subparsers(dest="store_command", parser_class=_Parser, required=True)
    p = store_sub.add_parser("copy", any_order=True, help="copy a whole workspace (jobs, events, files) into an empty store; "
                             "prints the rows copied per table")
    p.add_argument("src", metavar="SRC", help="a workspace folder or store file, sqlite:///ABS/PATH or postgresql://…")
    p.add_argument("dst", metavar="DST", help="an empty store: a folder (its agentnb.sqlite; made when missing), "
                   "a file ending in .sqlite, sqlite:///ABS/PATH or postgresql://… (an existing database)")
    p.add_argument("--running", choices=("refuse", "queue"), default="refuse",
                   help="a job running in SRC: refuse the copy (default), or copy it as queued so that a worker "
                   "on DST resumes it from its events")
    p.set_defaults(fn=cmd_store_copy)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = argparse.Namespace()
    try:
        args = parser.parse_args(argv)
        if getattr(args, "fn", None) is None:
            parser.print_help()
            return 2
        if not hasattr(args, "workspace"):
            args.workspace = None
        _check_utf8(args)
        with sigterm_interrupts():
            try:
                rc = int(args.fn(args))
                # here, where a reader gone away is caught below: left to the interpreter's exit, a buffered
                # stdout (not a terminal, no PYTHONUNBUFFERED) fails there with "Exception ignored … BrokenPipeError"
                sys.stdout.flush()
                return rc
            finally:
                _close_opened()
    except (AgentnbError, ValueError) as exc:
        return _error(as_typed(" ".join(str(exc).split()), sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        return 130
    except Terminated as exc:
        print("agentnb: stopped by SIGTERM; any job it was running is queued again", file=sys.stderr)
        return int(exc.code or 143)
    except BrokenPipeError:
        # `agentnb jobs | head`: the reader went away; no traceback, and none at exit either
        # (the way the Python docs advise: point stdout at devnull before the interpreter flushes it)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except _STORE_FAILURES as exc:
        # a damaged, locked or read-only store, a full disk, a path that is a file: one line, not a traceback
        return _error(describe_error(exc, Path(os.path.abspath(_folder(args))) / "agentnb.sqlite"))


def _error(message: str) -> int:
    print(f"agentnb: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
