"""A long instruction is stored once, however many movements repeat it, and reads back exactly as it was sent.

The model is a real OpenAI-protocol server on loopback, so "as it was sent" means the
request bodies it received; the store is a real SQLite file, measured on disk.
"""

from __future__ import annotations

import random
import sqlite3
import string
from collections.abc import Callable
from pathlib import Path

import pytest
from openai_server import OpenAIServer, reply

from agentnb import Workspace
from agentnb.store.sqlite import TEXT_REF
from agentnb.workspace import MAX_INSTRUCTION_CHARS


def _text(chars: int, seed: int = 7) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(2000)]
    out = []
    size = 0
    while size < chars:
        word = rng.choice(words)
        out.append(word)
        size += len(word) + 1
    return "Summarise what follows. 日本語も少し。\n" + " ".join(out)[:chars]


def _transition(next_step: str, **extra: str) -> dict:
    return reply(tool_calls=[("transition", {"next_step": next_step, "summary": f"to {next_step}", **extra})])


def _run(folder: Path, instruction: str, loopback: Callable[..., OpenAIServer]) -> tuple[Workspace, int, list[dict]]:
    """plan asks, the user answers, then plan → implement → verify → COMPLETE: 4 movement runs, 2 activations."""
    server = loopback("test-key")
    server.play(_transition("ASK", question="Short or long?"), _transition("implement"),
                _transition("verify"), _transition("COMPLETE"))
    ws = Workspace(folder)
    job = ws.run(ws.submit(instruction, piece="plan-implement-verify", model="openai:test-model"))
    assert job.status == "waiting_human", job.error
    job = ws.run(ws.reply(job, "Short, please."))
    assert job.status == "succeeded", job.error
    sent = [r.body for r in server.received]
    return ws, job.id, sent


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("agentnb.sqlite*"))


def test_a_long_instruction_is_stored_once_and_reads_back_as_sent(tmp_path: Path, loopback: Callable[..., OpenAIServer]) -> None:
    small_ws, _, _ = _run(tmp_path / "small", "Summarise what follows.", loopback)
    small_ws.store.close()
    instruction = _text(900_000)
    ws, job_id, sent = _run(tmp_path / "large", instruction, loopback)

    # what is read back is what the model was sent, byte for byte
    starts = ws.events(job_id, kinds=["movement_start"])
    assert len(starts) == 4
    first_of_each = [body["messages"] for body in sent]  # one call per movement run
    assert [(s.system, s.user) for s in starts] == [(m[0]["content"], m[1]["content"]) for m in first_of_each]
    assert all(instruction in s.user for s in starts)
    assert "Short, please." in starts[1].user and "Short, please." not in starts[0].user
    assert all(TEXT_REF not in s.user and "_texts" not in s.payload for s in starts)
    assert ws.job(job_id).instruction == instruction
    assert [j.instruction for j in ws.jobs()] == [instruction]
    frames = ws.frames
    assert frames.jobs()["instruction"].tolist() == [instruction]
    users = frames.messages(job_id).query("role == 'user' and kind == 'movement_start'")["content"].tolist()
    assert users == [s.user for s in starts]

    # … and the file holds it about once: four prompts, the enriched instruction and the job row repeat it
    ws.store.close()
    one_copy = len(instruction.encode("utf-8"))
    assert _size(tmp_path / "large") - _size(tmp_path / "small") < 1.2 * one_copy
    raw = sqlite3.connect(tmp_path / "large" / "agentnb.sqlite")
    assert raw.execute("SELECT COUNT(*) FROM texts").fetchone()[0] == 1
    raw.close()


def test_a_long_instruction_that_holds_the_reference_marker_is_stored_as_it_is(
        tmp_path: Path, loopback: Callable[..., OpenAIServer]) -> None:
    instruction = _text(20_000) + f"\nA literal {TEXT_REF} in the task must stay itself."
    ws, job_id, sent = _run(tmp_path / "ws", instruction, loopback)
    starts = ws.events(job_id, kinds=["movement_start"])
    assert [s.user for s in starts] == [body["messages"][1]["content"] for body in sent]
    assert ws.job(job_id).instruction == instruction


def test_the_same_long_instruction_twice_is_one_text(ws: Workspace) -> None:
    instruction = _text(50_000)
    jobs = [ws.submit(instruction, piece="single", model="demo") for _ in range(2)]
    assert [ws.job(j).instruction for j in jobs] == [instruction, instruction]
    assert ws.store.query("SELECT COUNT(*) FROM texts")[0][0] == 1


def test_an_instruction_over_the_limit_is_refused_before_anything_is_stored(ws: Workspace) -> None:
    ws.submit("x" * MAX_INSTRUCTION_CHARS, piece="single", model="demo")  # the limit itself is allowed
    with pytest.raises(ValueError) as info:
        ws.submit("x" * (MAX_INSTRUCTION_CHARS + 1), piece="single", model="demo")
    message = str(info.value)
    assert "\n" not in message
    assert f"{MAX_INSTRUCTION_CHARS + 1:,} characters; at most {MAX_INSTRUCTION_CHARS:,}" in message
    assert "inputs=" in message
    assert len(ws.jobs()) == 1
