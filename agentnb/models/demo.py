"""The built-in ``demo`` model: a deterministic, offline scripted run.

It plays a fixed script on ``plan-implement-verify`` (list the inputs, read one,
write a long report, verify it by reading it back in budgeted pieces) and adapts
only to what the tools returned, so that every behaviour a user should see
without a key happens for real: several movements, lessons, a truncated Read
with its continuation, the ``warn`` and ``prompt`` context actions, COMPLETE.
Its context window is small (8,192 tokens, see ``KNOWN_WINDOWS``) for that reason.
"""

from __future__ import annotations

import re
from typing import Any

from .base import ModelRequest, ModelResponse, ToolCall, stream_response
from .messages import AssistantMessage, ToolMessage, UserMessage

__all__ = ["DemoModel"]

_ITEMS = 150
# What verify searches for once it has read the whole report, until it is told to wrap up.
_GREPS = ("status: ok", "notes:", "^## Conclusion")


def _call(name: str, **arguments: Any) -> ModelResponse:
    return ModelResponse(tool_calls=(ToolCall(id="", name=name, arguments=arguments),))


def _say(said: str, name: str, **arguments: Any) -> ModelResponse:
    return ModelResponse(content=said, tool_calls=(ToolCall(id="", name=name, arguments=arguments),))


class DemoModel:
    """The demo model.  It streams each answer (docs/models.md#streaming) when someone watches, in word-ish
    pieces of text and then each tool call, ``pace`` seconds before each piece (``demo?pace=0.02``)."""

    def __init__(self, *, pace: float = 0.0, spec: str = "demo") -> None:
        self.pace = pace
        self.spec = spec

    def complete(self, request: ModelRequest) -> ModelResponse:
        response = self._answer(request)
        stream_response(response, request, pace=self.pace)
        return response

    def _answer(self, request: ModelRequest) -> ModelResponse:
        if request.purpose == "compaction":  # docs/context.md#compaction: a summary, from what the conversation holds
            return ModelResponse(content=self._summary(request))
        if request.purpose == "judge":  # docs/design-lab.md#llm-judge
            return self._verdict(request)
        step = sum(1 for m in request.messages if isinstance(m, AssistantMessage))
        handler = {"plan": self._plan, "implement": self._implement, "verify": self._verify}.get(
            request.movement, self._generic
        )
        resp = handler(request, step)
        calls = tuple(
            ToolCall(id=f"call_{request.movement_seq}_{request.iteration}_{i}", name=c.name, arguments=c.arguments)
            for i, c in enumerate(resp.tool_calls)
        )
        return ModelResponse(content=resp.content, tool_calls=calls, usage=None)

    @staticmethod
    def _verdict(request: ModelRequest) -> ModelResponse:
        """An LLM judge's call: the best score its verdict tool allows (the first of an ``enum``, else the
        ``maximum``), whatever it was shown: an offline judge that exercises the judging, not the answer."""
        for tool in request.tools:
            fn = tool.get("function") or {}
            score = ((fn.get("parameters") or {}).get("properties") or {}).get("score") or {}
            best = score["enum"][0] if score.get("enum") else score.get("maximum", 1)
            return _call(str(fn.get("name")), score=best, reason="The demo judge gives every answer the best score.")
        return ModelResponse(content="The demo judge was offered no verdict tool.")

    # -- helpers ----------------------------------------------------------
    @staticmethod
    def _last_tool(request: ModelRequest) -> str:
        for m in reversed(request.messages):
            if isinstance(m, ToolMessage):
                return m.text
        return ""

    @staticmethod
    def _user_prompt(request: ModelRequest) -> str:
        for m in request.messages:
            if isinstance(m, UserMessage) and not m.images:
                return m.text
        return ""

    def _task(self, request: ModelRequest) -> str:
        prompt = self._user_prompt(request)
        m = re.search(r"^## (?:Task|タスク)\n(.*?)(?:\n## |\Z)", prompt, re.S | re.M)
        return m.group(1).strip() if m else "the task"

    def _inputs(self, request: ModelRequest) -> list[str]:
        prompt = self._user_prompt(request)
        block = re.search(r"^input/\n(.*?)^output/", prompt, re.S | re.M)
        return re.findall(r"^  - (\S.*?) \(", block.group(1), re.M) if block else []

    def _summary(self, request: ModelRequest) -> str:
        answers = [m for m in request.messages if isinstance(m, AssistantMessage)]
        calls = [c.name for m in answers for c in m.tool_calls]
        said = [m.text for m in answers if m.text]
        last = self._last_tool(request).splitlines()
        lines = [f"Task: {self._task(request)}",
                 f"Step: {request.movement}; {len(calls)} tool calls so far ({', '.join(dict.fromkeys(calls)) or 'none'}).",
                 *(f"- {s}" for s in said[-3:])]
        if last:
            lines.append(f"Last tool result began: {last[0][:120]}")
        return "\n".join(lines)

    # -- plan-implement-verify ----------------------------------------------------
    def _plan(self, request: ModelRequest, step: int) -> ModelResponse:
        inputs = self._inputs(request)
        if step == 0:
            return _say("Let me see which files I was given.", "Glob", pattern="input/**/*")
        if step == 1 and inputs:
            return _say(f"I will read {inputs[0]} first.", "Read", path=f"input/{inputs[0]}", limit=40)
        seen = self._last_tool(request) if inputs else ""
        lines = len(seen.splitlines())
        files = ", ".join(inputs) or "no input files"
        return _call(
            "transition", next_step="implement",
            summary=f"Planned a report on {files}: list the inputs, note their size, then write output/report.md.",
            lessons=(f"The inputs are {files}; the first one shows {lines} lines." if inputs
                     else "There are no input files; the report can only restate the task."),
        )

    def _implement(self, request: ModelRequest, step: int) -> ModelResponse:
        if step == 0:
            task = self._task(request)
            inputs = self._inputs(request) or ["(none)"]
            body = [f"# Report\n\nTask: {task}\n", "## Inputs\n"]
            body += [f"- {name}" for name in inputs]
            body.append("\n## Checks performed\n")
            # A long, line-oriented report, so that verify has to read it in pieces.
            for n in range(1, _ITEMS + 1):
                body.append(
                    f"{n:03d}. Checked item {n} of the task against the inputs; status: ok; "
                    f"notes: nothing to report for section {n % 12 + 1}."
                )
            body.append("\n## Conclusion\n\nAll checks passed.")
            return _say("Writing the report.", "Write", path="output/report.md", content="\n".join(body) + "\n")
        return _call("transition", next_step="verify", summary=f"Wrote output/report.md with {_ITEMS} checks.",
                     lessons="The report is long: read it in pieces, following the continuation offsets.")

    def _verify(self, request: ModelRequest, step: int) -> ModelResponse:
        last = self._last_tool(request)
        wrap_up = any(
            isinstance(m, UserMessage) and not m.images and ("Wrap up" in m.text or "まとめて" in m.text)
            for m in request.messages[2:]
        )
        if step == 0:
            return _say("Reading the report back.", "Read", path="output/report.md")
        if not wrap_up:
            m = re.search(r"call Read with .*? offset=(\d+)", last)
            if m:
                return _say("The report was cut; reading on from the offset the note gives.", "Read",
                            path="output/report.md", offset=int(m.group(1)))
            greps = sum(1 for m in request.messages if isinstance(m, AssistantMessage)
                        and any(c.name == "Grep" for c in m.tool_calls))
            if greps < len(_GREPS):
                return _say("Cross-checking the statuses.", "Grep", pattern=_GREPS[greps], path="output")
        return _call(
            "transition", next_step="COMPLETE",
            summary="Verified output/report.md: the checks read so far are all ok.",
            lessons="Large files come back cut to the context budget; the note says where to continue.",
        )

    # -- any other piece ----------------------------------------------------------------
    def _generic(self, request: ModelRequest, step: int) -> ModelResponse:
        prompt = self._user_prompt(request)
        targets = re.findall(r"^- `([^`]+)`", prompt, re.M)
        asked_before = "[user," in prompt
        if "ASK" in targets and not asked_before:
            return _call("transition", next_step="ASK", summary="Asked the user to clarify.",
                         question="Which format should the result have (for example: a bullet list or a table)?")
        if step == 0:
            return _say("Looking at the work directory.", "Glob", pattern="**/*")
        target = next((t for t in targets if t not in ("ASK", "ABORT", "WAIT_SUBTASKS")), "COMPLETE")
        return _call("transition", next_step=target, summary=f"Demo step {request.movement} done.",
                     lessons=f"{request.movement}: the demo model only lists the files.")
