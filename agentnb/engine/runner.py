"""The piece runner: a resumable state machine that drives one job through its movements.

:meth:`JobRunner.advance` runs one LLM call, one movement or the whole job.  It
starts movements (building their prompts from the enriched instruction and what
earlier movements carried over), follows transitions, records lessons, and
moves the job to its next state.  Everything it decides is an event.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._secrets import SECRET_NAME as _SECRET_ENV
from ..events import Lesson, Subtask, Transition
from ..models.base import Model, ModelError
from ..store.sqlite import MAX_INSTRUCTION_CHARS, TERMINAL_STATES
from ..tools.base import PERMISSION_RANK, ToolError, open_regular, unlinked_path
from ..tools.sandbox import sandbox_argv
from .context import ContextManager, job_thresholds, window_for_model
from .loop import AgentLoop, Outcome, Recorder, _Counters
from .pieces import SPECIAL_NEXT, Movement, Piece, PieceError, available_pieces, load_piece, parse_piece
from .prompts import text

if TYPE_CHECKING:
    from ..store.sqlite import Store

__all__ = ["MAX_LESSON_CHARS", "MAX_SUBTASKS_PER_CALL", "MAX_SUBTASK_DEPTH", "JobRunner", "notify_parent"]

MAX_LESSON_CHARS = 2000
# A model can hand out subtasks whose piece hands out subtasks again: without a bound that is a job
# tree without end (and ws.run recursing into it until Python gives up).
MAX_SUBTASK_DEPTH = 4
MAX_SUBTASKS_PER_CALL = 50
GIT_DIFF_CHARS = 3000
# The key of a subtask's options that holds the tools and permission of the movement that created it.
CAP_OPTION = "subtask_cap"


class JobRunner:
    """Drives one job; one instance per job per process, rebuilt from the store when needed."""

    def __init__(self, store: Store, job: dict[str, Any], model: Model, jobs_root: Path) -> None:
        self.store = store
        self.job_id = int(job["id"])
        self.model = model
        self.piece: Piece = _parse_stored(job)
        self.options: dict[str, Any] = json.loads(job.get("options") or "{}")
        self.model_spec = str(job["model"])
        self.workdir = Path(job["workdir"])
        self.logs_dir = jobs_root / str(self.job_id) / "logs"
        self.rec = Recorder(store, self.job_id)
        self.loop: AgentLoop | None = None
        self.counters = _Counters()
        self._load_counters()
        open_mv = store.open_movement(self.job_id)
        if open_mv is not None:
            self.loop = self._make_loop(self.piece.movement(open_mv["name"]), int(open_mv["seq"]))
            self.loop.resume(store.events(self.job_id, movement_seq=int(open_mv["seq"])))

    # -- state ------------------------------------------------------------
    def _load_counters(self) -> None:
        rows = self.store.query(
            "SELECT m.name, COUNT(*) FROM events e JOIN movements m ON m.job_id=e.job_id AND m.seq=e.movement_seq "
            "WHERE e.job_id=? AND e.kind='llm_response' GROUP BY m.name",
            (self.job_id,),
        )
        self.counters.by_movement = {r[0]: int(r[1]) for r in rows}
        self.counters.call_index = sum(self.counters.by_movement.values())

    def job(self) -> dict[str, Any]:
        return self.store.job(self.job_id)

    def _context_manager(self) -> ContextManager:
        opts = self.options.get("context", {})
        window = opts.get("window_tokens") or self.piece.window_tokens or window_for_model(self.model.spec)
        thresholds = job_thresholds(self.piece.thresholds, self.options)
        return ContextManager(
            window=window, thresholds=thresholds, model=self.model.spec,
            min_tool_tokens=opts.get("min_tool_tokens") or self.piece.min_tool_tokens,
        )

    def _make_loop(self, movement: Movement, seq: int) -> AgentLoop:
        # A subtask runs within the rights of the movement that created it, whatever its stored piece says:
        # the check at transition time is the first line, this is the second (a row written any other way).
        movement = _capped(movement, self.options.get(CAP_OPTION))
        return AgentLoop(
            recorder=self.rec, movement=movement, seq=seq, model=self.model, ctx=self._context_manager(),
            workdir=self.workdir, logs_dir=self.logs_dir, language=self.piece.language, counters=self.counters,
            check_subtasks=lambda subtasks: self._check_subtasks(subtasks, movement),
        )

    # -- driving ---------------------------------------------------------------
    def advance(self, unit: str = "job", stop: threading.Event | None = None) -> str:
        """Run one ``call``, one ``movement`` or the whole ``job`` (until it ends or waits).

        The job must be claimed (``running``).  Returns the job's status afterwards;
        a job with more to do is left ``running`` for the caller to release.
        """
        try:
            while True:
                if self.loop is None:
                    if not self._start_movement():
                        return self.job()["status"]
                assert self.loop is not None
                outcome = self.loop.call()
                if outcome is not None:
                    status = self._finish_movement(outcome)
                    if unit != "job" or status != "running":
                        return status
                elif unit == "call":
                    self.rec.flush()
                    return "running"
                if stop is not None and stop.is_set():
                    self.rec.flush()
                    return "running"
        except ModelError as exc:
            return self._fail(str(exc), where="model")
        except Exception as exc:  # an engine bug must not lose the events or leave the job running
            return self._fail(f"{type(exc).__name__}: {exc}", where="engine")

    def _fail(self, message: str, where: str) -> str:
        with self.store.transaction() as c:
            self.rec.add("error", {"message": message, "where": where},
                         self.loop.seq if self.loop else None, self.loop.iteration if self.loop else None)
            self.rec.flush(c)
            if self.loop is not None:
                c.execute("UPDATE movements SET status='failed', ended=?, iterations=? WHERE job_id=? AND seq=?",
                          (time.time(), self.loop.iteration, self.job_id, self.loop.seq))
            self.store.set_status(c, self.job_id, "failed", reason=message, error=message)
            notify_parent(self.store, c, self.job_id)
        self.loop = None
        return "failed"

    def _start_movement(self) -> bool:
        job = self.job()
        name = job["current_movement"] or self.piece.initial_movement
        seq = int(job["movement_seq"]) + 1
        if seq > self.piece.max_movements:
            message = (
                f"max_movements ({self.piece.max_movements}) exceeded: the piece ran {seq - 1} movements "
                f"and wanted to start {name!r}"
            )
            self._fail(message, where="runner")
            return False
        movement = self.piece.movement(name)
        system = movement.persona
        user = self._user_prompt(job, movement)
        loop = self._make_loop(movement, seq)
        loop.start(system, user)
        with self.store.transaction() as c:
            c.execute(
                "INSERT INTO movements (job_id, seq, name, status, started) VALUES (?,?,?,?,?)",
                (self.job_id, seq, name, "running", time.time()),
            )
            self.store.update_job(c, self.job_id, current_movement=name, movement_seq=seq)
            self.rec.flush(c)
        self.loop = loop
        return True

    def _finish_movement(self, out: Outcome) -> str:
        loop = self.loop
        assert loop is not None
        mv = loop.movement
        seq, it = loop.seq, loop.iteration
        # The seed turns the summary of a COMPLETE without lessons into the lesson, whatever ended the movement:
        # a forced COMPLETE (default_next: COMPLETE under context pressure or max_iterations) too.  A forced move
        # to another step carries none, as it is no claim about the work (its lessons are always empty).
        lesson_text = out.lessons or (out.summary if out.next_step == "COMPLETE" else "")
        children: list[dict[str, Any]] = []
        with self.store.transaction() as c:
            if out.next_step == "WAIT_SUBTASKS" and out.subtasks:
                children = self._create_children(c, out.subtasks, mv)
            self.rec.add(
                "transition",
                {"movement": mv.name, "next_step": out.next_step, "summary": out.summary, "lessons": out.lessons,
                 "forced": out.forced, "reason": out.reason, "question": out.question, "feedback": out.feedback,
                 "subtasks": children or None},
                seq, it,
            )
            if lesson_text:
                self.rec.add("lesson", {"lessons": lesson_text, "summary": out.summary, "movement": mv.name}, seq, it)
            self.rec.flush(c)
            c.execute(
                "UPDATE movements SET status='done', ended=?, iterations=?, next_step=?, forced=?, summary=? "
                "WHERE job_id=? AND seq=?",
                (time.time(), it, out.next_step, int(out.forced), out.summary, self.job_id, seq),
            )
            status = self._apply_next(c, mv, out)
        if lesson_text:
            try:
                self._append_lesson_file(mv.name, seq, lesson_text, out.summary)
            except (ToolError, OSError) as exc:  # the lesson is in the events; say why the file lacks it
                self.rec.add("error", {"message": f"lesson not written to logs/lessons.jsonl: {exc}",
                                       "where": "lessons"}, seq, it)
                self.rec.flush()
        self.loop = None
        return status

    def _apply_next(self, c: Any, mv: Movement, out: Outcome) -> str:
        step = out.next_step
        why = f"{mv.name} → {step}" + (" (forced)" if out.forced else "")
        if step == "COMPLETE":
            self.store.set_status(c, self.job_id, "succeeded", reason=why)
            notify_parent(self.store, c, self.job_id)
            return "succeeded"
        if step == "ABORT":
            reason = out.reason or out.summary or "aborted by the model"
            self.store.set_status(c, self.job_id, "aborted", reason=why, error=reason)
            notify_parent(self.store, c, self.job_id)
            return "aborted"
        if step == "ASK":
            self.store.add_comment(c, self.job_id, "agent", out.question or "")
            self.store.set_status(c, self.job_id, "waiting_human", reason=why, resume_movement=mv.name, enriched=None)
            return "waiting_human"
        if step == "WAIT_SUBTASKS" and not out.subtasks:
            # only a forced transition gets here (the transition tool insists on subtasks):
            # with no child to wait for, the job would wait forever
            message = f"{mv.name} ended with WAIT_SUBTASKS but named no subtasks ({out.reason or 'no reason given'})"
            self.store.set_status(c, self.job_id, "failed", reason=why, error=message)
            notify_parent(self.store, c, self.job_id)
            return "failed"
        if step == "WAIT_SUBTASKS":
            resume = out.resume or mv.default_next
            if resume is None or resume in SPECIAL_NEXT:
                resume = mv.name
            self.store.set_status(c, self.job_id, "waiting_subtasks", reason=why, resume_movement=resume, enriched=None)
            return "waiting_subtasks"
        self.store.update_job(c, self.job_id, current_movement=step)
        return "running"

    # -- lessons --------------------------------------------------------------
    def _append_lesson_file(self, movement: str, seq: int, lessons: str, summary: str) -> None:
        path = unlinked_path(self.logs_dir.parent, self.logs_dir.name, "lessons.jsonl")
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        record = {"job": self.job_id, "movement": movement, "seq": seq, "lessons": lessons, "summary": summary,
                  "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        # a link made after the check above is refused too, and a FIFO planted here (Bash can) never blocks
        fd = open_regular(path, "logs/lessons.jsonl", append=True)
        with open(fd, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")

    # -- subtasks ----------------------------------------------------------------
    def _check_subtasks(self, subtasks: Any, creator: Movement) -> str | None:
        """Why these subtasks cannot be created by movement ``creator`` (a tool error the model reads), or None."""
        if not isinstance(subtasks, list) or not subtasks:
            return "next_step WAIT_SUBTASKS needs subtasks: a non-empty list of {instruction, piece?}"
        if len(subtasks) > MAX_SUBTASKS_PER_CALL:
            return (f"{len(subtasks)} subtasks given; at most {MAX_SUBTASKS_PER_CALL} per transition "
                    "(group the work into fewer subtasks)")
        depth = self._depth()
        if depth >= MAX_SUBTASK_DEPTH:
            return (f"this job is already a subtask {depth} levels deep; subtasks may nest at most "
                    f"{MAX_SUBTASK_DEPTH} levels: do this work here instead of handing it out")
        for i, sub in enumerate(subtasks):
            if not isinstance(sub, dict) or not isinstance(sub.get("instruction"), str) or not sub["instruction"].strip():
                return f"subtasks[{i}] needs a non-empty instruction"
            if len(sub["instruction"]) > MAX_INSTRUCTION_CHARS:
                return (f"subtasks[{i}].instruction has {len(sub['instruction']):,} characters; at most "
                        f"{MAX_INSTRUCTION_CHARS:,} are allowed: write long material to a file and name it instead")
            extra = set(sub) - {"instruction", "piece", "model"}
            if extra:
                return f"subtasks[{i}]: unknown key(s) {sorted(extra)}; allowed: instruction, piece, model"
            try:
                self._subtask_piece(sub, creator)
                self._subtask_model(sub)
            except _Refused as exc:
                return f"subtasks[{i}].{exc.field}: {exc}"
        return None

    def _subtask_piece(self, sub: dict[str, Any], creator: Movement) -> Piece:
        """The piece a subtask runs, checked: a name ``agentnb pieces`` lists (never a path), whose every
        movement fits within ``creator``'s tools and permission.  No piece named: this job's own piece."""
        ref = sub.get("piece")
        if ref is None:
            piece = self.piece
        else:
            piece = self._named_piece(ref)
        has = (f"step {creator.name!r} has tools: {', '.join(creator.tools) or 'none'} "
               f"and permission {creator.permission!r}")
        for mv in piece.movements:
            more = [t for t in mv.tools if t not in creator.tools]
            if more:
                raise _Refused("piece", f"piece {piece.name!r}: movement {mv.name!r} uses {', '.join(more)}, beyond "
                                        f"this step's tools ({has}); a subtask never gets more tools or permission "
                                        "than the step that creates it: name a piece that fits, or do the work here")
            if PERMISSION_RANK[mv.permission] > PERMISSION_RANK[creator.permission]:
                raise _Refused("piece", f"piece {piece.name!r}: movement {mv.name!r} has permission "
                                        f"{mv.permission!r}, above this step's ({has}); a subtask never gets more "
                                        "tools or permission than the step that creates it: name a piece that "
                                        "fits, or do the work here")
        return piece

    def _named_piece(self, ref: Any) -> Piece:
        available = available_pieces()
        listing = ", ".join(sorted(available)) or "none"
        if not isinstance(ref, str) or not ref.strip():
            raise _Refused("piece", f"found {ref!r}; allowed: the name of a piece: {listing}")
        # A path would let the job run a piece it wrote itself (any tools, any instruction_file on the host).
        if (any(sep in ref for sep in ("/", "\\", os.sep)) or ref.lower().endswith((".yaml", ".yml"))
                or ref.startswith(".")):
            raise _Refused("piece", f"{ref!r} is a path; a subtask's piece is a name that `agentnb pieces` lists: "
                                    f"{listing}")
        if ref not in available:
            raise _Refused("piece", f"unknown piece {ref!r}; available: {listing}")
        path = available[ref].resolve()
        for root, what in ((self.workdir.resolve(), "this job's work directory"),
                           (self.logs_dir.parents[1].resolve(), "the workspace's job folders")):
            if path == root or root in path.parents:
                raise _Refused("piece", f"piece {ref!r} ({path.name}) lies inside {what}, where a job could have "
                                        "written it; keep pieces outside work directories")
        try:
            return load_piece(path)
        except PieceError as exc:  # worded without the file's host path, which the model has no need of
            where = f"line {exc.line}: " if exc.line else ""
            raise _Refused("piece", f"piece {ref!r} is not valid: {where}{exc.field + ': ' if exc.field else ''}"
                                    f"{exc.detail}") from None
        except OSError as exc:
            raise _Refused("piece", f"piece {ref!r} cannot be read: {exc.strerror or exc}") from None

    def _subtask_model(self, sub: dict[str, Any]) -> str:
        """The model a subtask runs on: this job's own, or a plain spec.  ``scripted:`` names a file and
        ``replay:`` another job, so an LLM may not choose them; a job that itself runs on a ``scripted:``
        model may, since then the user's script, not a model, names them."""
        from ..models.base import ModelSpecError, check_model_spec
        from ..workspace import _normalise_spec

        spec = sub.get("model")
        if spec is None or spec == self.model_spec:
            return self.model_spec
        if not isinstance(spec, str) or not spec.strip():
            raise _Refused("model", f"found {spec!r}; allowed: a model spec such as demo or openai:<model>")
        kind = spec.partition(":")[0]
        if kind in ("scripted", "replay") and not self.model_spec.startswith("scripted:"):
            raise _Refused("model", f"{spec!r} names a file or another job; allowed: this job's own model "
                                    f"({self.model_spec}), demo or openai:<model>")
        try:
            check_model_spec(spec)
        except ModelSpecError as exc:
            raise _Refused("model", str(exc)) from None
        # a relative scripted: path means the same file for a worker started elsewhere
        return _normalise_spec(spec)

    def _depth(self) -> int:
        """How many ancestors this job has (0 for a job submitted by a user)."""
        rows = self.store.query(
            "WITH RECURSIVE up(id, parent_id, n) AS (SELECT id, parent_id, 0 FROM jobs WHERE id=? "
            "UNION ALL SELECT j.id, j.parent_id, up.n + 1 FROM jobs j JOIN up ON j.id = up.parent_id "
            "WHERE up.n < 1000) SELECT MAX(n) FROM up", (self.job_id,),
        )
        return int(rows[0][0] or 0)

    def _create_children(self, c: Any, subtasks: list[dict[str, Any]], creator: Movement) -> list[dict[str, Any]]:
        from ..workspace import prepare_workdir

        parent = self.store.job(self.job_id)
        options = json.loads(parent["options"] or "{}")
        # what the child may never exceed, kept with it and enforced again by its loop (see _make_loop)
        options[CAP_OPTION] = {"tools": list(creator.tools), "permission": creator.permission}
        created = []
        for sub in subtasks:
            try:  # checked when the transition was made; checked again, as the piece file may have changed since
                piece = self._subtask_piece(sub, creator)
                model = self._subtask_model(sub)
            except _Refused as exc:
                raise RuntimeError(f"subtask refused when created: {exc.field}: {exc}") from None
            if sub.get("piece") is not None:
                piece_name, piece_yaml, piece_path = piece.name, piece.to_yaml(), piece.source
            else:
                piece_name, piece_yaml, piece_path = parent["piece"], parent["piece_yaml"], parent["piece_path"]
            now = time.time()
            cur = c.execute(
                "INSERT INTO jobs (parent_id, piece, piece_yaml, piece_path, model, instruction, status, workdir, "
                "options, created, updated) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (self.job_id, piece_name, piece_yaml, piece_path, model, sub["instruction"], "queued", "",
                 json.dumps(options), now, now),
            )
            child_id = int(cur.lastrowid)
            # logs_dir is <workspace>/jobs/<id>/logs; prepare_workdir wants <workspace>
            workdir = prepare_workdir(self.logs_dir.parents[2], child_id, None)
            c.execute("UPDATE jobs SET workdir=? WHERE id=?", (str(workdir), child_id))
            self.store.append([(child_id, None, None, now, "job_status",
                                {"status": "queued", "reason": f"subtask of job {self.job_id}"})], c)
            created.append({"instruction": sub["instruction"], "piece": piece_name, "model": model, "job_id": child_id})
        return created

    # -- prompts -------------------------------------------------------------------
    def _user_prompt(self, job: dict[str, Any], movement: Movement) -> str:
        lang = self.piece.language
        parts = [job["enriched"] or ""]
        lessons = self._lessons_block()
        if lessons:
            parts.append(f"{text(lang, 'lessons')}\n{lessons}")
        checklists = self._checklists_block()
        if checklists:
            parts.append(f"{text(lang, 'checklists')}\n{checklists}")
        feedback = self._feedback_block(movement)
        if feedback:
            parts.append(f"{text(lang, 'feedback')}\n\n{feedback}")
        transitions = self.store.events(self.job_id, kinds=["transition"])
        last = transitions[-1] if transitions else None
        if isinstance(last, Transition) and last.next_step == "WAIT_SUBTASKS" and last.subtasks:
            parts.append(f"{text(lang, 'subtasks')}\n{self._subtasks_block(last.subtasks)}")
        if isinstance(last, Transition) and last.movement and self._is_verify(last.movement):
            git = self._git_block()
            if git:
                parts.append(f"{text(lang, 'git')}\n{git}")
        parts.append(f"{text(lang, 'step', name=movement.name)}\n{movement.instruction.strip()}")
        parts.append(_finish_block(movement, lang))
        return "\n\n".join(p for p in parts if p)

    def _lessons_block(self) -> str:
        items = [f"- [{ev.movement}] {ev.lessons.strip()}" for ev in self.store.events(self.job_id, kinds=["lesson"])
                 if isinstance(ev, Lesson)]
        # keep the newest, dropping the oldest, within the cap
        kept: list[str] = []
        size = 0
        for item in reversed(items):
            if size + len(item) + 1 > MAX_LESSON_CHARS:
                if not kept:
                    kept.append(item[: MAX_LESSON_CHARS - 1] + "…")
                break
            kept.append(item)
            size += len(item) + 1
        return "\n".join(reversed(kept))

    def _checklists_block(self) -> str:
        try:
            folder = unlinked_path(self.logs_dir.parent, self.logs_dir.name, "checklists")
        except ToolError:
            return ""  # a link planted in logs/ must not bring outside files into the prompt
        if not folder.is_dir():
            return ""
        out = []
        for path in sorted(folder.glob("*.json")):
            if path.is_symlink():
                continue
            try:
                # a FIFO named x.json (Bash can make one) would block the worker on every prompt
                with open(open_regular(path, f"logs/checklists/{path.name}"), encoding="utf-8") as fh:
                    data = json.loads(fh.read())
            except (OSError, ValueError, ToolError):
                continue
            # the default work directory holds logs/, so the model may have written these files itself
            raw = data.get("items") if isinstance(data, dict) else None
            items = [i for i in raw if isinstance(i, dict)] if isinstance(raw, list) else []
            done = sum(1 for i in items if i.get("done"))
            out.append(text(self.piece.language, "checklist_head", name=path.stem, done=done, total=len(items)))
            out += [f"- [{'x' if i.get('done') else ' '}] {i.get('text', '')}" for i in items]
        return "\n".join(out)

    def _feedback_block(self, movement: Movement) -> str:
        items = []
        for ev in self.store.events(self.job_id, kinds=["transition"]):
            if not isinstance(ev, Transition) or ev.next_step != movement.name or not ev.feedback:
                continue
            if not self._is_verify(ev.movement, target=movement.name):
                continue
            items.append(ev)
        lang = self.piece.language
        return "\n\n".join(
            f"{text(lang, 'feedback_item', n=n, source=ev.movement)}\n{ev.feedback.strip()}"  # type: ignore[union-attr]
            for n, ev in enumerate(items, start=1)
        )

    def _is_verify(self, name: str, target: str | None = None) -> bool:
        try:
            mv = self.piece.movement(name)
        except KeyError:
            return False
        return mv.verify is not None and (target is None or mv.verify == target)

    def _subtasks_block(self, subtasks: list[Subtask]) -> str:
        """One entry per child: its status, its last summary and, when it failed or was aborted, why."""
        lang = self.piece.language
        lines = []
        for sub in subtasks:
            child_id = sub.job_id
            child = self.store.job(int(child_id))
            summary = ""
            for ev in reversed(self.store.events(int(child_id), kinds=["transition"])):
                if isinstance(ev, Transition):
                    summary = ev.summary
                    break
            lines.append(text(lang, "subtask_line", id=child_id, status=child["status"],
                              instruction=sub.instruction, summary=summary or "-"))
            # an abort's reason is usually its summary; a failure's message never is
            if child["error"] and child["error"] != summary:
                lines.append(text(lang, "subtask_error", error=child["error"]))
        return "\n".join(lines)

    def _git_block(self) -> str:
        if not (self.workdir / ".git").exists():
            return ""

        # GIT_DIR and friends from the notebook's environment must not point git at another repository;
        # no optional locks, so a git command the model runs meanwhile is never blocked.
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") and not _SECRET_ENV.search(k)}
        # The repository's own config and .gitattributes are the model's to write (Write/Edit on .git/config),
        # and git runs commands they name — core.fsmonitor, filter drivers, hooks, textconv, external diffs —
        # on the host.  Command-line settings win over every config file, so each is switched off here, and
        # the commands run in the Bash jail when bubblewrap is there.
        safe = ["-c", "core.fsmonitor=false", "-c", f"core.hooksPath={os.devnull}", "-c", "color.ui=false",
                "-c", "core.quotepath=off"]
        try:
            jail = sandbox_argv(str(self.workdir))
        except ToolError:
            jail = []

        def git(*args: str) -> str | None:
            try:
                res = subprocess.run([*jail, "git", "--no-optional-locks", "--no-pager", *safe, *args],
                                     cwd=self.workdir, env=env, capture_output=True, text=True,
                                     errors="replace", timeout=20, stdin=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired):
                return None
            return res.stdout if res.returncode == 0 else None

        names = git("config", "--list", "--includes", "--name-only")  # reading config runs nothing
        if names is None:  # not a usable repository: say nothing rather than "clean"
            return ""
        for name in names.splitlines():
            m = re.fullmatch(r"(filter\..+)\.(clean|smudge|process|required)", name.strip(), re.IGNORECASE)
            if m:
                safe += ["-c", f"{m.group(1)}.clean=cat", "-c", f"{m.group(1)}.smudge=cat",
                         "-c", f"{m.group(1)}.process=", "-c", f"{m.group(1)}.required=false"]
        status = git("status", "--short", "--ignore-submodules=all")
        if status is None:
            return ""
        stat = git("diff", "--no-ext-diff", "--no-textconv", "--ignore-submodules=all", "--stat") or ""
        diff = git("diff", "--no-ext-diff", "--no-textconv", "--ignore-submodules=all") or ""
        if len(diff) > GIT_DIFF_CHARS:
            diff = diff[:GIT_DIFF_CHARS] + f"\n… [diff cut: {GIT_DIFF_CHARS:,} of {len(diff):,} characters shown]"
        blocks = ["$ git status --short", status.rstrip() or "(clean)"]
        if stat.strip():
            blocks += ["$ git diff --stat", stat.rstrip()]
        if diff.strip():
            blocks += ["$ git diff (excerpt)", "```diff", diff.rstrip(), "```"]
        return "\n".join(blocks)


class _Refused(ValueError):
    """A subtask that may not be created; ``field`` is the subtask key at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _capped(movement: Movement, cap: Any) -> Movement:
    """``movement`` with no tool and no permission beyond ``cap`` (``{tools, permission}``; None: as it is)."""
    if not isinstance(cap, dict):
        return movement
    allowed = cap.get("tools") or []
    tools = tuple(t for t in movement.tools if t in allowed)
    permission = movement.permission
    ceiling = cap.get("permission")
    if ceiling not in PERMISSION_RANK or PERMISSION_RANK[permission] > PERMISSION_RANK[ceiling]:
        permission = ceiling if ceiling in PERMISSION_RANK else "readonly"
    if tools == movement.tools and permission == movement.permission:
        return movement
    return replace(movement, tools=tools, permission=permission)


def _finish_block(movement: Movement, language: str) -> str:
    """The prompt's "how to finish" block: one line per value of ``movement.next_steps``, no more, no less."""
    lines = [text(language, "finish"), text(language, "finish_intro")]
    for rule in movement.rules:
        lines.append(f"- `{rule.next}`" + (f": {rule.condition}" if rule.condition else ""))
    if "ABORT" not in {r.next for r in movement.rules}:
        lines.append(text(language, "finish_abort"))
    lines.append(text(language, "finish_notes"))
    return "\n".join(lines)


def notify_parent(store: Store, c: Any, job_id: int) -> None:
    """Job ``job_id`` has ended (in transaction ``c``): when it was the last open child of a
    parent waiting for subtasks, queue the parent again at the movement it named.

    Every way a job ends (COMPLETE, ABORT, a failure) must call this, or the parent waits forever.
    """
    row = c.execute("SELECT parent_id FROM jobs WHERE id=?", (job_id,)).fetchone()
    if row is None or row[0] is None:
        return
    parent_id = int(row[0])
    parent = c.execute("SELECT status, resume_movement, current_movement FROM jobs WHERE id=?",
                       (parent_id,)).fetchone()
    if parent is None or parent[0] != "waiting_subtasks":
        return
    open_children = c.execute(
        f"SELECT COUNT(*) FROM jobs WHERE parent_id=? AND status NOT IN ({','.join('?' * len(TERMINAL_STATES))})",
        (parent_id, *sorted(TERMINAL_STATES)),
    ).fetchone()[0]
    if open_children == 0:
        store.set_status(c, parent_id, "queued", reason="every subtask has ended",
                         current_movement=parent[1] or parent[2], resume_movement=None)


def _parse_stored(job: dict[str, Any]) -> Piece:
    """The piece a job was submitted with (its YAML is kept in the store, files inlined)."""
    from ..tools.base import registered_tool_names

    # Tools named by the piece were checked at submit; a later process may lack a
    # notebook's custom tool, which the loop then reports to the model.
    piece = parse_piece(job["piece_yaml"], source=job.get("piece_path") or job["piece"],
                        known_tools=_all_names(job["piece_yaml"]) + registered_tool_names())
    return piece


def _all_names(piece_yaml: str) -> list[str]:
    import yaml

    data = yaml.load(piece_yaml, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}  # libyaml: ~10x faster
    names: list[str] = []
    for m in data.get("movements") or []:
        if isinstance(m, dict):
            names += [t for t in m.get("tools") or [] if isinstance(t, str)]
    return names
