"""What a movement may do with MCP tools (docs/pieces.md#mcp-servers): refused when the piece is checked — a YAML
file, a piece changed in Python, at submit — and, at run time, a model that reaches for a server's tool its
movement does not name gets a tool error."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path

import pytest
from _scripting import call, transition, write_piece, write_script

from agentnb import Workspace
from agentnb.engine.pieces import load_piece
from agentnb.errors import PieceError


def _time_server() -> str:
    """mcp-server-time from the package registry (the test extra), as a user runs it."""
    found = shutil.which("mcp-server-time") or str(Path(sys.executable).parent / "mcp-server-time")
    if not os.access(found, os.X_OK):
        message = "mcp-server-time is not installed: pip install -e '.[test]'"
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def test_a_piece_changed_in_python_is_checked_at_submit_and_nothing_is_stored(tmp_path: Path) -> None:
    # dataclasses.replace skips the checks replace_movement makes: the submit makes them, as a worker would
    piece = load_piece("plan-implement-verify").with_mcp_server("admin", command="mcp-server-time")
    plan = piece.movements[0]
    assert plan.permission == "readonly"
    widened = dataclasses.replace(piece, movements=(dataclasses.replace(plan, tools=(*plan.tools, "admin.*")),
                                                    *piece.movements[1:]))
    ws = Workspace(tmp_path / "ws")
    with pytest.raises(PieceError) as err:
        ws.submit("Tell the time", piece=widened, model="demo")
    message = str(err.value)
    assert "movements[0] (plan).tools" in message
    assert "MCP server 'admin' needs permission 'full'; this movement has 'readonly'" in message
    assert "\n" not in message
    assert ws.jobs() == []


@pytest.mark.needs("bwrap")
def test_a_movement_cannot_call_a_tool_of_a_server_it_does_not_name(
        tmp_path: Path) -> None:
    command = _time_server()
    piece = write_piece(tmp_path, "two-servers", {
        "mcp_servers": {
            "clock": {"command": command, "args": ["--local-timezone", "UTC"], "permission": "readonly"},
            "admin": {"command": command, "args": ["--local-timezone", "UTC"]},  # permission: full
        },
        "movements": [
            {"name": "look", "permission": "readonly", "instruction": "Look.", "tools": ["Read", "clock.*"],
             "rules": [{"next": "act"}]},
            {"name": "act", "permission": "full", "instruction": "Act.", "tools": ["admin.get_current_time"],
             "rules": [{"next": "COMPLETE"}]},
        ],
    })
    spec = write_script(tmp_path, "reach", movements={
        # the readonly movement reaches for the full server's tool by every name it could have, and for Bash
        "look": [call("admin.get_current_time", timezone="UTC"), call("admin_get_current_time", timezone="UTC"),
                 call("Bash", command="echo escaped"), call("get_current_time", timezone="Asia/Tokyo"),
                 transition("act", summary="looked")],
        "act": [call("get_current_time", timezone="Europe/Paris"), call("convert_time", source_timezone="UTC",
                                                                         time="12:00", target_timezone="Asia/Tokyo"),
                transition("COMPLETE", summary="acted")],
    })
    ws = Workspace(tmp_path / "ws")
    job = ws.run(ws.submit("Tell the time", piece=str(piece), model=spec))
    assert job.status == "succeeded", job.error
    seq = {e.movement: e.movement_seq for e in ws.events(job, kinds=["movement_start"])}
    results = ws.events(job, kinds=["tool_result"])
    look = [r for r in results if r.movement_seq == seq["look"] and r.tool != "transition"]
    act = [r for r in results if r.movement_seq == seq["act"] and r.tool != "transition"]
    # refused: the other server's tool (both spellings) and a built-in the movement lacks, each a tool error
    for refused in look[:3]:
        assert refused.is_error and "is not available in this step" in refused.content, refused.content
        assert refused.server is None
    assert not any("escaped" in r.content for r in results)
    # its own server's tool works
    assert (look[3].server, look[3].is_error) == ("clock", False) and "Asia/Tokyo" in look[3].content
    # the movement with the permission has exactly the tool it names, from its server; not the one it doesn't
    assert (act[0].server, act[0].is_error) == ("admin", False) and "Europe/Paris" in act[0].content
    assert act[1].is_error and "is not available in this step" in act[1].content
    # the model of each movement was shown only that movement's tools
    offered = {r.movement_seq: set(r.tools) for r in ws.events(job, kinds=["llm_request"])}
    assert {"Read", "get_current_time", "convert_time"} <= offered[seq["look"]]
    assert "Bash" not in offered[seq["look"]]
    assert offered[seq["act"]] - {"transition"} == {"get_current_time"}
