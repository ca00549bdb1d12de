"""Jobs with known token usage, for the frames, plots and export tests.

``usage_job`` runs a two-movement piece on a scripted model that reports usage, in
a 10,000-token window, so the numbers are exact and known:

======  =========  ======  ==========  ===========================================
call    movement   prompt  completion  what happens
======  =========  ======  ==========  ===========================================
1       gather     1000    50          Glob
2       gather     2000    60          Read input/notes.md
3       gather     2500    40          transition → write (with lessons)
4       write      8800    300         Write; warn *and* prompt fire at this call
5       write      9600    20          Read of a missing file (error); force_transition
                                       fires and the movement is forced to COMPLETE
======  =========  ======  ==========  ===========================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _scripting import write_piece, write_script

from agentnb import Job, Workspace

__all__ = ["COMPLETIONS", "PROMPTS", "demo_job", "raw_usage", "tiktoken_job", "usage_job"]

PROMPTS = [1000, 2000, 2500, 8800, 9600]
COMPLETIONS = [50, 60, 40, 300, 20]

_PIECE = {
    "name": "usage-probe",
    "max_movements": 4,
    "context": {"window_tokens": 10000},
    "movements": [
        {"name": "gather", "persona": "You gather facts.", "instruction": "Read the notes.",
         "tools": ["Read", "Glob"], "permission": "readonly", "max_iterations": 5,
         "rules": [{"condition": "the facts are known", "next": "write"}], "default_next": "write"},
        {"name": "write", "persona": "You write reports.", "instruction": "Write output/report.md.",
         "tools": ["Read", "Write"], "permission": "edit", "max_iterations": 5,
         "rules": [{"condition": "the report is written", "next": "COMPLETE"}], "default_next": "COMPLETE"},
    ],
}


def _resp(tool: str, prompt: int, completion: int, said: str | None = None, **arguments: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"tool_calls": [{"name": tool, "arguments": arguments}],
                           "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}
    if said is not None:
        out["content"] = said
    return out


def usage_job(ws: Workspace, folder: Path, instruction: str = "Report on input/notes.md") -> Job:
    piece = write_piece(folder, "usage-probe", _PIECE)
    script = {
        "gather": [
            _resp("Glob", PROMPTS[0], COMPLETIONS[0], "Looking around.", pattern="input/*"),
            _resp("Read", PROMPTS[1], COMPLETIONS[1], path="input/notes.md"),
            _resp("transition", PROMPTS[2], COMPLETIONS[2], next_step="write", summary="gathered <facts>",
                  lessons="notes.md holds two lines"),
        ],
        "write": [
            _resp("Write", PROMPTS[3], COMPLETIONS[3], "Writing & checking.", path="output/report.md",
                  content="# Report\nalpha\n"),
            _resp("Read", PROMPTS[4], COMPLETIONS[4], path="input/missing.md"),
        ],
    }
    model = write_script(folder, "usage-script", script)
    job = ws.submit(instruction, piece=piece, model=model, inputs={"notes.md": "alpha\nbeta\n"})
    job = ws.run(job)
    assert job.status == "succeeded", job.error
    return job


def tiktoken_job(ws: Workspace, folder: Path) -> Job:
    """The ``single`` piece on a script without usage: counts come from the tokenizer."""
    model = write_script(folder, "tiktoken-script", responses=[
        {"content": "Listing.", "tool_calls": [{"name": "Glob", "arguments": {"pattern": "**/*"}}]},
        {"tool_calls": [{"name": "transition", "arguments": {"next_step": "COMPLETE", "summary": "listed",
                                                             "lessons": "nothing to read"}}]},
    ])
    job = ws.run(ws.submit("List the files", piece="single", model=model))
    assert job.status == "succeeded", job.error
    return job


def demo_job(ws: Workspace) -> Job:
    job = ws.run(ws.submit("Summarise input/notes.md", piece="plan-implement-verify", model="demo",
                           inputs={"notes.md": "alpha\nbeta\n"}))
    assert job.status == "succeeded", job.error
    return job


def raw_usage(ws: Workspace, job: Job) -> list[dict[str, Any]]:
    """The ``usage`` payloads of a job's ``llm_response`` events, read through the event API."""
    return [e.payload["usage"] for e in ws.events(job, kinds=["llm_response"])]
