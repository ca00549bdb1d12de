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


def test_long_research_compacts_on_the_demo_model_and_completes(ws: Workspace) -> None:
    """The shipped long-research piece (on_pressure: compact on its reading movement) shows compaction with no
    key: demo's verify reads the long report back until the context crosses `prompt`, is summarised, reads on."""
    job = ws.run(ws.submit("Summarise input/notes.md", piece="long-research", model="demo",
                           inputs={"notes.md": "alpha\nbeta\n"}))
    assert job.status == "succeeded", job.error
    assert [e.payload["movement"] for e in ws.events(job, kinds=["movement_start"])] == ["plan", "implement", "verify"]
    compactions = ws.events(job, kinds=["compaction"])
    assert compactions and all(e.movement_seq == 3 for e in compactions)
    for c in compactions:
        assert c.payload["tokens_after"] < c.payload["tokens_before"]
        assert c.payload["summary"].startswith("Task: Summarise input/notes.md")
    summarising = [e for e in ws.events(job, kinds=["llm_request"]) if e.payload.get("purpose") == "compaction"]
    assert [e.iteration for e in summarising] == [c.iteration for c in compactions]
    assert not ws.events(job, kinds=["error"])
    transitions = ws.events(job, kinds=["transition"])
    assert [t.payload["next_step"] for t in transitions] == ["implement", "verify", "COMPLETE"]
    assert not transitions[-1].payload["forced"]
    # the seed's wrap-up request is what compaction replaces
    assert not [r for r in ws.events(job, kinds=["reminder"]) if r.payload["reason"] == "context prompt"]


def test_long_research_is_listed_and_compacts_only_its_reading_movement() -> None:
    from agentnb.engine.pieces import available_pieces, load_piece

    piece = load_piece(available_pieces()["long-research"])
    assert piece.on_pressure == "transition"  # the piece keeps the seed's behaviour …
    assert {m.name: m.on_pressure for m in piece.movements} == {"plan": None, "implement": None, "verify": "compact"}
