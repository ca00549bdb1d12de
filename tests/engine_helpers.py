"""Small builders shared by the engine tests: pieces and scripted-model files on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from _scripting import call, transition  # the response builders are shared with the ASK/subtask tests

__all__ = ["call", "say", "transition", "write_piece", "write_script"]


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
