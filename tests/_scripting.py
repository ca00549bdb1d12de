"""The one set of helpers for tests that drive jobs with ``scripted:`` models: pieces and scripted-model files
written to disk (docs/pieces.md, docs/models.md), the responses they hold, and what was sent, read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from agentnb import Workspace

__all__ = ["QUICK", "TWO_STEPS", "call", "requests", "say", "starts", "transition", "user_prompts", "write_piece",
           "write_script"]


def _dump(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


def write_piece(folder: Path, name: str, piece: dict[str, Any] | str) -> Path:
    """Write ``folder/<name>.yaml`` and return its path: a piece given as a dict is named ``name`` (unless it
    names itself); YAML text is written as it is (a test of what a loader makes of the text itself)."""
    path = folder / f"{name}.yaml"
    if isinstance(piece, str):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(piece, encoding="utf-8")
        return path
    return _dump(path, {"name": name, **piece})


def write_script(folder: Path, name: str, movements: dict[str, list[dict[str, Any]]] | None = None, *,
                 responses: list[dict[str, Any]] | None = None) -> str:
    """Write the scripted-model file ``folder/<name>.yaml`` and return its ``scripted:`` spec: ``movements`` maps
    a movement to its responses in order, ``responses`` is one list for the calls of every other movement."""
    data: dict[str, Any] = {}
    if responses is not None:
        data["responses"] = responses
    if movements is not None:
        data["movements"] = movements
    return f"scripted:{_dump(folder / f'{name}.yaml', data)}"


def say(content: str) -> dict[str, Any]:
    """A scripted reply with no tool call."""
    return {"content": content}


def call(tool: str, **arguments: Any) -> dict[str, Any]:
    """One scripted response that calls ``tool``."""
    return {"tool_calls": [{"name": tool, "arguments": arguments}]}


def transition(next_step: str, summary: str = "done", **extra: Any) -> dict[str, Any]:
    return call("transition", next_step=next_step, summary=summary, **extra)


def starts(ws: Workspace, job: Any) -> list[Any]:
    """The ``movement_start`` events: the system and user prompts as sent, in order."""
    return [e for e in ws.events(job, kinds=["movement_start"])]


def user_prompts(ws: Workspace, job: Any, movement: str | None = None) -> list[str]:
    return [e.payload["user"] for e in starts(ws, job) if movement is None or e.payload["movement"] == movement]


def requests(ws: Workspace, job: Any) -> list[Any]:
    return ws.events(job, kinds=["llm_request"])


# Pieces the worker, lease and scale-out tests share, as YAML text.
# two movements: first (Read, Write) goes on to second (Read), which completes
TWO_STEPS = """
name: two-steps
movements:
  - name: first
    instruction: Look around.
    tools: [Read, Write]
    permission: edit
    rules:
      - {condition: seen, next: second}
  - name: second
    instruction: Finish.
    tools: [Read]
    rules:
      - {condition: done, next: COMPLETE}
"""

# one movement, one rule: the demo model finishes a job in two quick calls
QUICK = """\
name: quick
movements:
  - name: work
    instruction: Do the task.
    tools: []
    rules:
      - {condition: done, next: COMPLETE}
"""
