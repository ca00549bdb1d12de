"""The Checklist tool: items created and ticked, stored per job, shown to the following movements."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _scripting import call, transition, user_prompts, write_piece, write_script

from agentnb import Workspace


def _piece(tmp_path: Path, language: str = "en") -> Path:
    return write_piece(tmp_path, f"checked-{language}", {"language": language, "movements": [
        {"name": "plan", "instruction": "Plan.", "tools": ["Checklist"], "rules": [{"next": "work"}]},
        {"name": "work", "instruction": "Work.", "tools": ["Checklist"], "permission": "edit",
         "rules": [{"next": "review"}]},
        {"name": "review", "instruction": "Review.", "rules": [{"next": "COMPLETE"}]},
    ]})


def _script(tmp_path: Path) -> str:
    return write_script(tmp_path, "checklists", {
        "plan": [
            call("Checklist", name="steps", items=[{"text": "read the notes", "done": False},
                                                   {"text": "write the summary", "done": False}]),
            call("Checklist", name="steps", items=[{"text": "read the notes", "done": True}]),
            call("Checklist", name="risks", items=[{"text": "notes may be empty"}]),
            transition("work", summary="planned"),
        ],
        "work": [
            call("Checklist", name="steps", items=[{"text": "write the summary", "done": True},
                                                   {"text": "check spelling", "done": False}]),
            transition("review", summary="worked"),
        ],
        "review": [transition("COMPLETE", summary="reviewed")],
    })


def test_checklist_state_reaches_the_next_movements(ws: Workspace, tmp_path: Path) -> None:
    job = ws.run(ws.submit("Summarise", piece=str(_piece(tmp_path)), model=_script(tmp_path)))
    assert job.status == "succeeded", job.error
    plan, work, review = user_prompts(ws, job)
    assert "## Checklists" not in plan
    assert (
        "## Checklists\n"
        "### risks (0/1 done)\n- [ ] notes may be empty\n"
        "### steps (1/2 done)\n- [x] read the notes\n- [ ] write the summary"
    ) in work
    assert (
        "### steps (2/3 done)\n- [x] read the notes\n- [x] write the summary\n- [ ] check spelling"
    ) in review
    folder = ws.root / "jobs" / str(job.id) / "logs" / "checklists"
    assert sorted(p.name for p in folder.iterdir()) == ["risks.json", "steps.json"]
    stored = json.loads((folder / "steps.json").read_text(encoding="utf-8"))
    assert stored == {"name": "steps", "items": [
        {"text": "read the notes", "done": True},
        {"text": "write the summary", "done": True},
        {"text": "check spelling", "done": False},
    ]}
    results = [e.payload for e in ws.events(job, kinds=["tool_result"]) if e.payload["tool"] == "Checklist"]
    assert results[1]["content"] == "Checklist steps: 1/2 done\n- [x] read the notes\n- [ ] write the summary"
    assert not any(r["is_error"] for r in results)


@pytest.mark.sqlite_only("submit(workdir=) is refused on PostgreSQL (files live in the store)")
def test_checklists_live_in_the_jobs_logs_even_with_an_existing_workdir(ws: Workspace, tmp_path: Path) -> None:
    workdir = tmp_path / "project"
    workdir.mkdir()
    job = ws.run(ws.submit("Summarise", piece=str(_piece(tmp_path)), model=_script(tmp_path), workdir=workdir))
    assert job.status == "succeeded"
    assert (ws.root / "jobs" / str(job.id) / "logs" / "checklists" / "steps.json").is_file()
    assert not (workdir / "logs").exists()


def test_bad_checklist_calls_are_tool_errors_and_change_nothing(ws: Workspace, tmp_path: Path) -> None:
    spec = write_script(tmp_path, "bad", {
        "plan": [
            call("Checklist", name="ok", items=[{"text": "first", "done": False}]),
            call("Checklist", name="../escape", items=[{"text": "x"}]),
            call("Checklist", name="ok", items=[{"text": "second"}, {"text": "first", "done": "yes"}]),
            call("Checklist", name="ok", items=[{"text": "first", "colour": "red"}]),
            call("Checklist", name="ok", items="first"),
            call("Checklist", name="ok", items=[{"text": "  "}]),
            transition("work"),
        ],
        "work": [transition("review")],
        "review": [transition("COMPLETE")],
    })
    job = ws.run(ws.submit("Do it", piece=str(_piece(tmp_path)), model=spec))
    assert job.status == "succeeded"
    results = [e.payload for e in ws.events(job, kinds=["tool_result"]) if e.payload["tool"] == "Checklist"]
    assert [r["is_error"] for r in results] == [False, True, True, True, True, True]
    assert "must be 1–64 letters, digits, '-' or '_'" in results[1]["content"]
    assert "items[1].done is 'yes'; allowed: true or false" in results[2]["content"]
    assert "items[0]: unknown key(s) ['colour']; allowed: text, done" in results[3]["content"]
    assert "items must be a list" in results[4]["content"]
    assert "items[0] must be an object with a non-empty 'text'" in results[5]["content"]
    logs = ws.root / "jobs" / str(job.id) / "logs"
    assert sorted(p.name for p in (logs / "checklists").iterdir()) == ["ok.json"]
    assert not list(logs.parent.parent.rglob("escape*"))
    assert "### ok (0/1 done)\n- [ ] first\n" in user_prompts(ws, job, "work")[0] + "\n"


def test_japanese_piece_uses_japanese_heading(ws: Workspace, tmp_path: Path) -> None:
    job = ws.run(ws.submit("要約して", piece=str(_piece(tmp_path, "ja")), model=_script(tmp_path)))
    assert job.status == "succeeded"
    work = user_prompts(ws, job, "work")[0]
    assert "## チェックリスト\n### risks (1 件中 0 件完了)\n- [ ] notes may be empty\n### steps (2 件中 1 件完了)" in work
    assert "## Checklists" not in work


def test_checklist_files_written_by_hand_do_not_break_the_next_prompt(ws: Workspace, tmp_path: Path) -> None:
    # in the default work directory logs/ is reachable by Write, so the files may be anything
    spec = write_script(tmp_path, "hand", {
        "plan": [
            call("Write", path="logs/checklists/list.json", content="[1, 2]"),
            call("Write", path="logs/checklists/broken.json", content="{not json"),
            call("Write", path="logs/checklists/odd.json", content='{"items": [{"text": "kept", "done": true}, 3]}'),
            transition("work"),
        ],
        "work": [transition("review")],
        "review": [transition("COMPLETE")],
    })
    piece = write_piece(tmp_path, "hand-piece", {"movements": [
        {"name": "plan", "instruction": "Plan.", "tools": ["Write"], "permission": "edit", "rules": [{"next": "work"}]},
        {"name": "work", "instruction": "Work.", "rules": [{"next": "review"}]},
        {"name": "review", "instruction": "Review.", "rules": [{"next": "COMPLETE"}]},
    ]})
    job = ws.run(ws.submit("Do it", piece=str(piece), model=spec))
    assert job.status == "succeeded", job.error
    work = user_prompts(ws, job, "work")[0]
    assert "### list (0/0 done)" in work and "### odd (1/1 done)\n- [x] kept" in work
    assert "broken" not in work


def test_japanese_checklist_names_work_and_hand_written_files_are_tool_errors_not_crashes(
    ws: Workspace, tmp_path: Path
) -> None:
    spec = write_script(tmp_path, "ja-names", {
        "plan": [
            call("Checklist", name="買い物", items=[{"text": "牛乳", "done": False}, {"text": "卵", "done": True}]),
            call("Checklist", name="買い物 リスト", items=[{"text": "x"}]),     # a space: refused
            call("Write", path="logs/checklists/broken.json", content="{not json"),
            call("Checklist", name="broken", items=[{"text": "a"}]),
            call("Write", path="logs/checklists/odd.json", content='{"items": [{"done": true}, 3, {"text": "kept"}]}'),
            call("Checklist", name="odd", items=[{"text": "new", "done": True}]),
            transition("work"),
        ],
        "work": [transition("review")],
        "review": [transition("COMPLETE")],
    })
    piece = write_piece(tmp_path, "ja-lists", {"language": "ja", "movements": [
        {"name": "plan", "instruction": "計画", "tools": ["Checklist", "Write"], "permission": "edit",
         "rules": [{"next": "work"}]},
        {"name": "work", "instruction": "作業", "rules": [{"next": "review"}]},
        {"name": "review", "instruction": "確認", "rules": [{"next": "COMPLETE"}]},
    ]})
    job = ws.run(ws.submit("買い物", piece=str(piece), model=spec))
    assert job.status == "succeeded", job.error
    results = [e.payload for e in ws.events(job, kinds=["tool_result"]) if e.payload["tool"] == "Checklist"]
    assert not results[0]["is_error"], results[0]["content"]
    assert results[1]["is_error"] and "no spaces, dots or slashes" in results[1]["content"]
    assert results[2]["is_error"] and "logs/checklists/broken.json cannot be read as a checklist" in results[2]["content"]
    assert "raised" not in results[2]["content"] + results[3]["content"]
    assert not results[3]["is_error"] and "- [ ] kept\n- [x] new" in results[3]["content"]
    stored = json.loads((ws.root / "jobs" / str(job.id) / "logs" / "checklists" / "買い物.json").read_text("utf-8"))
    assert stored["items"] == [{"text": "牛乳", "done": False}, {"text": "卵", "done": True}]
    work = user_prompts(ws, job, "work")[0]
    assert "### 買い物 (2 件中 1 件完了)\n- [ ] 牛乳\n- [x] 卵" in work


@pytest.mark.sqlite_only("on PostgreSQL logs/ is kept in the store with the job's other files (test_files_store.py)")
def test_a_worker_with_a_folder_of_its_own_keeps_the_checklists_and_lessons_with_the_job(tmp_path: Path) -> None:
    # a worker on the same SQLite file (--store sqlite:///…) with another --workspace: the job works in the
    # submitter's jobs/<id>, and its logs/ must be there too, or the submitter reads no lessons and a movement run
    # by another worker sees no checklists
    laptop = Workspace(tmp_path / "laptop")
    job = laptop.submit("Summarise", piece=str(_piece(tmp_path)), model=_script(tmp_path))
    worker = Workspace(tmp_path / "worker", store=f"sqlite:///{laptop.store.path}")
    assert worker.worker().run() == 1
    assert laptop.job(job).status == "succeeded"
    _, work, review = user_prompts(laptop, job)
    assert "### steps (1/2 done)\n- [x] read the notes\n- [ ] write the summary" in work
    assert "### steps (2/3 done)" in review
    logs = laptop.root / "jobs" / str(job.id) / "logs"
    assert sorted(p.name for p in (logs / "checklists").iterdir()) == ["risks.json", "steps.json"]
    assert laptop.frames.lessons(job)["summary"].tolist() == ["reviewed"]
    assert worker.frames.lessons(job)["summary"].tolist() == ["reviewed"]  # the same file, read from either folder
    assert not (worker.root / "jobs").exists()  # nothing of the job in the worker's own folder
    worker.close()
    laptop.close()
