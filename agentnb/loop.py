"""The agent loop of one movement, as a resumable step: :meth:`AgentLoop.call` makes one LLM call.

Within a movement every assistant message, tool result and reminder is appended
to ``messages`` and the whole list is re-sent on the next call.  The list is not
carried into the next movement.  Its state can always be rebuilt from the events
of the movement (:meth:`AgentLoop.resume`), so a job stopped between calls — even
across a restart — goes on from the SQLite file.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ._prompts import text
from .context import ContextManager
from .events import ContextAction, Event, LLMResponse, MovementStart, Reminder, ToolResult
from .models import Model, ModelRequest, ModelResponse
from .pieces import SPECIAL_NEXT, Movement
from .tools import PERMISSION_RANK, ToolContext, ToolOutput, get_tool

if TYPE_CHECKING:
    from .store import Store

__all__ = ["AgentLoop", "Outcome", "Recorder", "transition_schema"]


class Recorder:
    """Collects a job's events and writes them in one transaction per LLM call."""

    __slots__ = ("store", "job_id", "pending")

    def __init__(self, store: "Store", job_id: int) -> None:
        self.store = store
        self.job_id = job_id
        self.pending: list[tuple[int, int | None, int | None, float, str, dict[str, Any]]] = []

    def add(self, kind: str, payload: dict[str, Any], seq: int | None = None, iteration: int | None = None) -> None:
        self.pending.append((self.job_id, seq, iteration, time.time(), kind, payload))

    def flush(self, c: Any = None) -> None:
        if self.pending:
            rows, self.pending = self.pending, []
            self.store.append(rows, c)


@dataclass
class Outcome:
    """How a movement ended: the transition the model called, or a forced one."""

    next_step: str
    summary: str = ""
    lessons: str = ""
    forced: bool = False
    reason: str = ""
    question: str | None = None
    feedback: str | None = None
    subtasks: list[dict[str, Any]] | None = None
    resume: str | None = None


def transition_schema(movement: Movement) -> dict[str, Any]:
    steps = list(movement.next_steps)
    return {
        "type": "function",
        "function": {
            "name": "transition",
            "description": (
                "End this step and choose what happens next. Always give a short summary of what was done; "
                "lessons are notes worth passing on to later steps."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    # the same list, in the same order, as the prompt's "how to finish" block and the reminder
                    "next_step": {"type": "string", "enum": steps,
                                  "description": f"One of: {', '.join(steps)} (ABORT: the task cannot be done at all)."},
                    "summary": {"type": "string", "description": "What this step did."},
                    "lessons": {"type": "string", "description": "What later steps should know."},
                    "question": {"type": "string", "description": "With ASK: the question for the user."},
                    "feedback": {"type": "string", "description": "When verifying: what must be fixed, for the step that did the work."},
                    "subtasks": {
                        "type": "array",
                        "description": "With WAIT_SUBTASKS: the subtasks to run as child jobs.",
                        "items": {
                            "type": "object",
                            "properties": {"instruction": {"type": "string"}, "piece": {"type": "string"},
                                           "model": {"type": "string"}},
                            "required": ["instruction"],
                        },
                    },
                    "resume": {"type": "string", "description": "With WAIT_SUBTASKS: the movement to resume at when the subtasks end."},
                },
                "required": ["next_step"],
            },
        },
    }


@dataclass
class _Counters:
    call_index: int = 0  # LLM calls in the job so far
    by_movement: dict[str, int] = field(default_factory=dict)  # calls per movement name so far


class AgentLoop:
    def __init__(
        self,
        *,
        recorder: Recorder,
        movement: Movement,
        seq: int,
        model: Model,
        ctx: ContextManager,
        workdir: Path,
        logs_dir: Path,
        language: str,
        counters: _Counters,
        check_subtasks: Callable[[list[Any]], str | None] | None = None,
    ) -> None:
        self.rec = recorder
        self.movement = movement
        self.seq = seq
        self.model = model
        self.ctx = ctx
        self.workdir = workdir
        self.logs_dir = logs_dir
        self.language = language
        self.counters = counters
        self.check_subtasks = check_subtasks
        self.messages: list[dict[str, Any]] = []
        self.iteration = 0
        self.tools = [t for t in (get_tool(n) for n in movement.tools) if t is not None]
        self.schemas = [t.schema() for t in self.tools] + [transition_schema(movement)]
        self.tool_names = [t.name for t in self.tools] + ["transition"]
        self._allowed = set(movement.next_steps)
        self._prompt_due = False
        self.ctx.set_tools(self.schemas)

    # -- starting and resuming ---------------------------------------------
    def start(self, system: str, user: str) -> None:
        self._append({"role": "system", "content": system})
        self._append({"role": "user", "content": user})
        self.rec.add("movement_start", {"movement": self.movement.name, "seq": self.seq, "system": system, "user": user},
                     self.seq, 0)

    def resume(self, events: Sequence[Event]) -> None:
        """Rebuild messages, iteration and fired actions from this movement's events."""
        images: list[dict[str, Any]] = []

        def flush_images() -> None:
            for m in images:
                self._append(m)
            images.clear()

        for ev in events:
            if isinstance(ev, MovementStart):
                self._append({"role": "system", "content": ev.system})
                self._append({"role": "user", "content": ev.user})
            elif isinstance(ev, LLMResponse):
                flush_images()
                self.iteration = ev.iteration or self.iteration + 1
                assistant = _assistant_message(ev.content, ev.tool_calls)
                self.messages.append(assistant)
                self.ctx.after_response(assistant, ev.usage if ev.usage.get("source") == "usage" else None)
            elif isinstance(ev, ToolResult):
                self._append({"role": "tool", "tool_call_id": ev.call_id, "content": ev.content})
                if ev.image:
                    images.append(_image_message(ev.tool, ev.image))
            elif isinstance(ev, Reminder):
                flush_images()
                self._append({"role": "user", "content": ev.text})
        flush_images()
        self.ctx.fired = {ev.action for ev in events if isinstance(ev, ContextAction)}

    def _append(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self.ctx.add(message)

    # -- one LLM call ------------------------------------------------------------
    def call(self) -> Outcome | None:
        """Make one LLM call and run the tools it asks for; return the outcome if the movement ended."""
        mv = self.movement
        self.iteration += 1
        it = self.iteration
        seq = self.seq
        self.rec.add("llm_request", {"messages": len(self.messages), "tools": self.tool_names}, seq, it)
        self.rec.flush()  # durable before the (slow, fallible) model call
        name = mv.name
        request = ModelRequest(
            messages=self.messages, tools=self.schemas, job_id=self.rec.job_id, movement=name,
            movement_seq=seq, iteration=it, call_index=self.counters.call_index,
            movement_call_index=self.counters.by_movement.get(name, 0),
        )
        started = time.perf_counter()
        response: ModelResponse = self.model.complete(request)
        latency_s = round(time.perf_counter() - started, 6)
        self.counters.call_index += 1
        self.counters.by_movement[name] = self.counters.by_movement.get(name, 0) + 1

        calls = [c.to_message() for c in response.tool_calls]
        assistant = _assistant_message(response.content, calls)
        self.messages.append(assistant)
        decision = self.ctx.after_response(assistant, response.usage)
        self.rec.add(
            "llm_response",
            {
                "content": response.content,
                "tool_calls": [_call_record(c) for c in response.tool_calls],
                "usage": {
                    "prompt_tokens": decision.prompt_tokens,
                    "completion_tokens": decision.completion_tokens,
                    "total_tokens": decision.prompt_tokens + decision.completion_tokens,
                    "source": decision.source,
                    "window": self.ctx.window,
                    "ratio": round(decision.ratio, 6),
                    "encoding": self.ctx.counter.encoding,  # the tokenizer behind tiktoken counts and budgets
                },
                "latency_s": latency_s,
            },
            seq, it,
        )
        force_reason = ""
        for action, limit in decision.fired:
            self.rec.add(
                "context_action",
                {"action": action, "ratio": round(decision.ratio, 6), "tokens": decision.prompt_tokens,
                 "window": self.ctx.window, "iteration": it, "threshold": limit},
                seq, it,
            )
            if action == "prompt":
                self._prompt_due = True
            elif action == "force_transition":
                force_reason = (
                    f"context at {decision.ratio:.1%} of {self.ctx.window:,} tokens reached "
                    f"force_transition ({limit:.0%})"
                )

        outcome: Outcome | None = None
        images: list[dict[str, Any]] = []
        if not response.tool_calls:
            self._remind(it)
        for call in response.tool_calls:
            self.rec.add("tool_call", {"tool": call.name, "arguments": call.arguments, "call_id": call.id}, seq, it)
            if outcome is not None:
                out = ToolOutput("Skipped: the movement already ended with transition.", is_error=True)
            elif call.name == "transition":
                out, outcome = self._transition(call.arguments)
            else:
                out = self._run_tool(call.name, call.arguments)
            self.rec.add(
                "tool_result",
                {"tool": call.name, "call_id": call.id, "content": out.content, "is_error": out.is_error,
                 "truncated": out.truncated, "original_chars": out.original_chars,
                 "returned_chars": out.returned_chars, "continuation": out.continuation, "image": out.image,
                 "budget_tokens": self.ctx.tool_budget()},
                seq, it,
            )
            self._append({"role": "tool", "tool_call_id": call.id, "content": out.content})
            if out.image:
                images.append(_image_message(call.name, out.image))
        for m in images:
            self._append(m)
        # When the response that crosses force_transition itself made a valid transition, the model's own
        # choice stands (forced=False): it ended the movement as asked, and a mechanical default_next/ABORT
        # would only throw its summary away.  The crossing is still recorded as a context_action above.
        if outcome is not None:
            return outcome
        if force_reason:
            return self._forced(force_reason)
        if it >= mv.max_iterations:
            return self._forced(f"max_iterations ({mv.max_iterations}) reached without a transition")
        if self._prompt_due:
            self._prompt_due = False
            msg = text(self.language, "wrap_up", pct=f"{decision.ratio:.0%}", tokens=decision.prompt_tokens,
                       window=self.ctx.window)
            self.rec.add("reminder", {"text": msg, "reason": "context prompt"}, seq, it)
            self._append({"role": "user", "content": msg})
        return None

    def _remind(self, it: int) -> None:
        steps = ", ".join(self.movement.next_steps)
        msg = text(self.language, "reminder", steps=steps)
        self.rec.add("reminder", {"text": msg, "reason": "no tool call"}, self.seq, it)
        self._append({"role": "user", "content": msg})

    def _forced(self, reason: str) -> Outcome:
        target = self.movement.default_next or "ABORT"
        # a forced ASK still has to put a question to the user, or the reply would answer nothing
        question = f"The step {self.movement.name!r} stopped: {reason}. How should it go on?" if target == "ASK" else None
        return Outcome(next_step=target, summary=f"Forced transition: {reason}.", forced=True, reason=reason,
                       question=question)

    def _run_tool(self, name: str, arguments: Any) -> ToolOutput:
        if name in self.movement.tools and name not in self.tool_names:
            # e.g. a notebook's @agentnb.tool, and the job was resumed by another process
            return ToolOutput(f"Error: tool {name!r} is named by this step but not defined in this Python process; "
                              f"available: {', '.join(self.tool_names)}", is_error=True)
        if name not in self.tool_names:
            allowed = ", ".join(self.tool_names)
            return ToolOutput(f"Error: tool {name!r} is not available in this step; available: {allowed}", is_error=True)
        t = get_tool(name)
        if t is None:
            return ToolOutput(f"Error: tool {name!r} is not registered in this Python process", is_error=True)
        if PERMISSION_RANK[t.permission] > PERMISSION_RANK[self.movement.permission]:
            return ToolOutput(
                f"Error: {name} needs permission {t.permission!r}; this step has {self.movement.permission!r}",
                is_error=True,
            )
        if not isinstance(arguments, dict):
            return ToolOutput(f"Error: the arguments for {name} are not a JSON object: {str(arguments)[:200]}",
                              is_error=True)
        tctx = ToolContext(
            workdir=self.workdir, logs_dir=self.logs_dir, budget_tokens=self.ctx.tool_budget(),
            chars_per_token=self.ctx.chars_per_token, job_id=self.rec.job_id, movement=self.movement.name,
            count_tokens=self.ctx.counter.count,
        )
        return t.invoke(tctx, arguments)

    def _transition(self, args: Any) -> tuple[ToolOutput, Outcome | None]:
        def err(message: str) -> tuple[ToolOutput, None]:
            return ToolOutput(f"Error: {message}", is_error=True), None

        if not isinstance(args, dict):
            return err("transition arguments must be a JSON object")
        unknown = set(args) - {"next_step", "summary", "lessons", "question", "feedback", "subtasks", "resume"}
        if unknown:
            return err(f"unknown transition argument(s) {sorted(unknown)}; allowed: next_step, summary, lessons, "
                       "question, feedback, subtasks, resume")
        step = args.get("next_step")
        if not isinstance(step, str) or step not in self._allowed:
            return err(f"next_step {step!r} is not allowed here; allowed: {', '.join(self.movement.next_steps)}")
        for key in ("summary", "lessons", "question", "feedback", "resume"):
            if args.get(key) is not None and not isinstance(args[key], str):
                return err(f"{key} must be text")
        question = args.get("question")
        if step == "ASK" and not (question or "").strip():
            return err("next_step ASK needs a question for the user")
        subtasks = args.get("subtasks")
        if step == "WAIT_SUBTASKS":
            if self.check_subtasks is None:
                return err("subtasks are not available here")
            problem = self.check_subtasks(subtasks)  # type: ignore[arg-type]
            if problem:
                return err(problem)
        resume = args.get("resume")
        if resume is not None and resume not in self._allowed - set(SPECIAL_NEXT):
            return err(f"resume {resume!r} is not a movement this step can go to")
        outcome = Outcome(
            next_step=step, summary=args.get("summary") or "", lessons=args.get("lessons") or "",
            question=question, feedback=args.get("feedback"), subtasks=subtasks if step == "WAIT_SUBTASKS" else None,
            resume=resume,
        )
        return ToolOutput(f"Transition to {step} recorded."), outcome


def _call_record(c: Any) -> dict[str, Any]:
    """A tool call as kept in ``llm_response``; the model's own argument text too when re-encoding
    would change it (compact or double-encoded JSON), so a resumed movement re-sends what it said."""
    record = {"id": c.id, "name": c.name, "arguments": c.arguments}
    if c.raw_arguments and c.raw_arguments != _json_args(c.arguments):
        record["raw_arguments"] = c.raw_arguments
    return record


def _assistant_message(content: str | None, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = [
            c if "function" in c else {
                "id": c["id"], "type": "function",
                "function": {"name": c["name"], "arguments": c.get("raw_arguments") or _json_args(c.get("arguments"))},
            }
            for c in tool_calls
        ]
    return msg


def _json_args(arguments: Any) -> str:
    import json

    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _image_message(tool: str, data_url: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": f"(image attached by {tool})"},
            {"type": "image_url", "image_url": {"url": data_url}},
        ],
    }
