"""A full job on the demo model, checked through its events."""

from __future__ import annotations

from agentnb import Workspace


def test_demo_job_succeeds_with_every_behaviour(ws: Workspace) -> None:
    job = ws.submit("Summarise input/notes.md", piece="plan-implement-verify", model="demo",
                    inputs={"notes.md": "alpha\nbeta\n"})
    job = ws.run(job)
    assert job.status == "succeeded", job.error
    events = ws.events(job)
    kinds = [e.kind for e in events]
    starts = [e.payload["movement"] for e in events if e.kind == "movement_start"]
    assert starts == ["plan", "implement", "verify"]
    transitions = [e.payload["next_step"] for e in events if e.kind == "transition"]
    assert transitions == ["implement", "verify", "COMPLETE"]
    actions = [e.payload["action"] for e in events if e.kind == "context_action"]
    assert actions[:2] == ["warn", "prompt"]
    assert "force_transition" not in actions
    assert any(e.kind == "tool_result" and e.payload["truncated"] for e in events)
    assert kinds.count("lesson") == 3
    lessons = (ws.root / "jobs" / str(job.id) / "logs" / "lessons.jsonl").read_text().splitlines()
    assert len(lessons) == 3
    assert (ws.root / "jobs" / str(job.id) / "output" / "report.md").is_file()
