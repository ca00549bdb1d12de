"""Which next_step a movement may take: its rules' targets, and ABORT.

The prompt's "how to finish" block, the reminder, the transition tool's schema (as sent to an
OpenAI-protocol endpoint) and the values the tool accepts must all say the same thing.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from _scripting import write_piece
from openai_server import OpenAIServer, reply

from agentnb import Workspace
from agentnb.engine.pieces import SPECIAL_NEXT, available_pieces

CUSTOM = {  # Japanese headings, ABORT named by a rule, a target named twice, no special step but ABORT
    "name": "custom", "language": "ja",
    "movements": [
        {"name": "draft", "instruction": "書く。", "rules": [
            {"condition": "書けた", "next": "review"}, {"condition": "書き直す", "next": "draft"},
            {"condition": "材料がない", "next": "ABORT"}, {"condition": "もう一度", "next": "review"}]},
        {"name": "review", "instruction": "確認する。", "rules": [{"next": "draft"}, {"next": "COMPLETE"}]},
    ],
}


def _movements() -> list[Any]:
    docs = [yaml.safe_load(available_pieces()[name].read_text(encoding="utf-8"))
            for name in ("plan-implement-verify", "fan-out", "ask-first", "single")]
    return [pytest.param(doc["name"], doc, m["name"], id=f"{doc['name']}:{m['name']}")
            for doc in [*docs, CUSTOM] for m in doc["movements"]]


def _ordered(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _transition(step: str) -> dict[str, Any]:
    args: dict[str, Any] = {"next_step": step, "summary": "s", "question": "Which one?"}
    if step == "WAIT_SUBTASKS":
        args["subtasks"] = [{"instruction": "part"}]
    return reply(tool_calls=[("transition", args)])


@pytest.mark.parametrize(("piece", "doc", "movement"), _movements())
def test_prompt_reminder_schema_and_validation_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: str, doc: dict[str, Any], movement: str
) -> None:
    path = write_piece(tmp_path, f"{piece}-{movement}", {**doc, "initial_movement": movement})
    names = [m["name"] for m in doc["movements"]]
    candidates = [*names, *SPECIAL_NEXT, "nowhere"]
    ws = Workspace(tmp_path / "ws")
    monkeypatch.setenv("AGENTNB_OPENAI_RETRIES", "0")
    accepted: set[str] = set()
    refused: set[str] = set()
    prompt_list = reminder_list = schema_list = None
    with OpenAIServer() as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        remaining = candidates
        while remaining:
            # an accepted transition ends the movement: each job tries the candidates left, in order
            server.play(reply("I think I am done."), *[_transition(c) for c in remaining])
            start = len(server.received)
            job = ws.run(ws.submit("Do it", piece=str(path), model="openai:loopback"), subtasks=False)
            results = [e.payload for e in ws.events(job, kinds=["tool_result"])
                       if e.payload["tool"] == "transition" and e.movement_seq == 1]
            tried = remaining[: len(results)]
            refused |= {c for c, r in zip(tried, results, strict=False) if r["is_error"]}
            accepted |= {c for c, r in zip(tried, results, strict=False) if not r["is_error"]}
            remaining = remaining[len(results):]
            server.actions.clear()
            if prompt_list is None:
                user = ws.events(job, kinds=["movement_start"])[0].payload["user"]
                finish = re.split(r"^## (?:How to finish this step|このステップの終え方)$", user, flags=re.M)[1]
                prompt_list = _ordered(re.findall(r"^- `([^`]+)`", finish, re.M))
                reminder = ws.events(job, kinds=["reminder"])[0].payload["text"]
                reminder_list = re.search(r"(?:one of: |next_step: )([^.)]+)", reminder).group(1).split(", ")
                tools = server.received[start].body["tools"]
                schema = next(t for t in tools if t["function"]["name"] == "transition")
                schema_list = schema["function"]["parameters"]["properties"]["next_step"]["enum"]
    assert accepted | refused == set(candidates)
    assert prompt_list == reminder_list == schema_list
    assert set(prompt_list) == accepted
    assert "ABORT" in accepted and "nowhere" in refused
    rules = [r["next"] for m in doc["movements"] if m["name"] == movement for r in m.get("rules", [])]
    assert prompt_list == _ordered([*rules, "ABORT"])
