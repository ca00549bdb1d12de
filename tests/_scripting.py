"""Helpers for tests that drive jobs with ``scripted:`` models and read back what was sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from agentnb import Workspace

__all__ = ["call", "requests", "starts", "transition", "user_prompts", "write_piece", "write_script"]


def write_script(folder: Path, name: str, movements: dict[str, list[dict[str, Any]]]) -> str:
    """Write a per-movement script and return its ``scripted:`` spec."""
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"movements": movements}, allow_unicode=True), encoding="utf-8")
    return f"scripted:{path}"


def write_piece(folder: Path, name: str, piece: dict[str, Any]) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, **piece}, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


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
