"""Small builders shared by the engine tests: pieces and scripted-model files on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["call", "say", "write_piece", "write_script", "transition"]


def call(name: str, **arguments: Any) -> dict[str, Any]:
    """One scripted response that calls one tool."""
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


def transition(next_step: str, summary: str = "done", **extra: Any) -> dict[str, Any]:
    return call("transition", next_step=next_step, summary=summary, **extra)


def say(content: str) -> dict[str, Any]:
    """A scripted reply with no tool call."""
    return {"content": content}


def write_piece(folder: Path, text: str, name: str = "piece.yaml") -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def write_script(folder: Path, data: dict[str, Any], name: str = "script.yaml") -> str:
    """Write a scripted-model file and return its model spec."""
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return f"scripted:{path}"
