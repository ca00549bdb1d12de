"""Helpers for the batch tests: scripted models and pieces, and totals summed over a job tree's events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _scripting import call, transition, write_piece, write_script

from agentnb import Workspace

__all__ = ["DRAFT_REVIEW", "answering_model", "asking_model", "llm_events", "tree", "tree_totals"]

# a two-movement piece: draft writes the answer, review completes (the "with a review movement" variant)
DRAFT_REVIEW: dict[str, Any] = {
    "description": "Draft, then review.",
    "max_movements": 4,
    "movements": [
        {"name": "draft", "persona": "You draft.", "instruction": "Write output/answer.txt.",
         "tools": ["Read", "Glob", "Write"], "permission": "edit",
         "rules": [{"condition": "the draft is written", "next": "review"}]},
        {"name": "review", "persona": "You review.", "instruction": "Check output/answer.txt.",
         "tools": ["Read", "Glob"], "permission": "readonly",
         "rules": [{"condition": "it is right", "next": "COMPLETE"}]},
    ],
}


def _with_usage(response: dict[str, Any], prompt: int, completion: int) -> dict[str, Any]:
    return {**response, "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


def answering_model(folder: Path, name: str, answer: str, prompt: int = 100, completion: int = 10) -> str:
    """A scripted model that writes ``answer`` to output/answer.txt, for the single and draft-review pieces."""
    write = _with_usage(call("Write", path="output/answer.txt", content=answer), prompt, completion)
    return write_script(folder, name, {
        "work": [write, _with_usage(transition("COMPLETE", summary=f"answered {answer}"), prompt + 7, completion)],
        "draft": [write, _with_usage(transition("review", summary=f"drafted {answer}"), prompt + 3, completion)],
        "review": [_with_usage(transition("COMPLETE", summary=f"reviewed {answer}"), 2 * prompt, completion + 1)],
    })


def asking_model(folder: Path, name: str = "asker") -> str:
    """A scripted model whose single-piece job asks the user and waits."""
    return write_script(folder, name, {"work": [
        _with_usage(transition("ASK", summary="unclear", question="Which language?"), 80, 5)]})


def draft_review(folder: Path) -> Path:
    return write_piece(folder, "draft-review", DRAFT_REVIEW)


def tree(ws: Workspace, job_id: int) -> list[int]:
    """The job and every job below it."""
    out = [job_id]
    for child in ws.children(job_id):
        out.extend(tree(ws, child.id))
    return out


def llm_events(ws: Workspace) -> int:
    """How many LLM calls the whole workspace has recorded (nothing re-run when it stays the same)."""
    return sum(len(ws.events(j, kinds=["llm_response"])) for j in ws.store.job_ids())


def tree_totals(ws: Workspace, job_id: int) -> dict[str, int]:
    """Calls, movement runs and tokens of a job tree, summed straight from ``ws.events``."""
    totals = dict.fromkeys(("movements", "llm_calls", "prompt_tokens", "completion_tokens", "total_tokens"), 0)
    for j in tree(ws, job_id):
        totals["movements"] += len(ws.events(j, kinds=["movement_start"]))
        for ev in ws.events(j, kinds=["llm_response"]):
            usage = ev.payload["usage"]
            totals["llm_calls"] += 1
            for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
                totals[key] += usage[key]
    return totals
