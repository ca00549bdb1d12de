"""WAIT_SUBTASKS: child jobs, the waiting parent, and its resumption with the children's results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from _scripting import call, transition, user_prompts, write_piece, write_script
from openai_server import OpenAIServer, reply

from agentnb import Workspace
from agentnb.engine.pieces import available_pieces
from agentnb.worker import Worker


def _child(tmp_path: Path, name: str, summary: str) -> str:
    return write_script(tmp_path, name, {"work": [
        call("Write", path="output/part.md", content=f"{name} result"),
        transition("COMPLETE", summary=summary),
    ]})


def _parent(tmp_path: Path, subtasks: list[dict[str, str]], **extra: object) -> str:
    return write_script(tmp_path, "parent", {
        "split": [transition("WAIT_SUBTASKS", summary="split in parts", subtasks=subtasks,
                             lessons="parts are independent", **extra)],
        "merge": [call("Glob", pattern="**"), transition("COMPLETE", summary="merged")],
        "check": [transition("COMPLETE", summary="checked")],
    })


def _three(tmp_path: Path) -> list[dict[str, str]]:
    broken = write_script(tmp_path, "broken", {"work": [call("Glob", pattern="*")]})  # runs out: fails
    return [
        {"instruction": "Do part one", "piece": "single", "model": _child(tmp_path, "one", "part one written")},
        {"instruction": "Do part two", "piece": "single", "model": broken},
        {"instruction": "Do part three", "piece": "single", "model": _child(tmp_path, "three", "part three written")},
    ]


def test_parent_with_three_children_one_failing(ws: Workspace, tmp_path: Path) -> None:
    parent = ws.submit("Do three parts", piece="fan-out", model=_parent(tmp_path, _three(tmp_path)))
    # stop before the children run, to look at the waiting state
    waiting = ws.run(parent, subtasks=False)
    assert waiting.status == "waiting_subtasks"
    assert waiting.resume_movement == "merge"
    children = ws.children(parent)
    assert [c.parent_id for c in children] == [parent.id] * 3
    assert [c.status.value for c in children] == ["queued"] * 3
    assert [c.piece for c in children] == ["single"] * 3
    assert [c.instruction for c in children] == ["Do part one", "Do part two", "Do part three"]
    workdirs = {Path(c.workdir) for c in children}
    assert len(workdirs) == 3 and Path(parent.workdir) not in workdirs
    for c in children:
        assert Path(c.workdir) == ws.root / "jobs" / str(c.id)
        assert (Path(c.workdir) / "input").is_dir() and (Path(c.workdir) / "output").is_dir()
    tr = ws.events(parent, kinds=["transition"])[-1].payload
    assert tr["next_step"] == "WAIT_SUBTASKS"
    assert [s["job_id"] for s in tr["subtasks"]] == [c.id for c in children]
    assert [s["instruction"] for s in tr["subtasks"]] == ["Do part one", "Do part two", "Do part three"]

    done = ws.run(parent)
    assert done.status == "succeeded", done.error
    children = ws.children(parent)
    assert [c.status.value for c in children] == ["succeeded", "failed", "succeeded"]
    for c in (children[0], children[2]):
        assert (Path(c.workdir) / "output" / "part.md").is_file()
    assert not (Path(parent.workdir) / "output" / "part.md").exists()
    statuses = [e.payload for e in ws.events(parent, kinds=["job_status"])]
    assert {"status": "queued", "reason": "every subtask has ended"} in statuses
    prompts = user_prompts(ws, parent)
    assert [e.payload["movement"] for e in ws.events(parent, kinds=["movement_start"])] == ["split", "merge"]
    merge = prompts[1]
    assert "## Results of subtasks" in merge
    one, two, three = (c.id for c in children)
    assert f"- job {one} (succeeded): Do part one\n  summary: part one written" in merge
    assert f"- job {three} (succeeded): Do part three\n  summary: part three written" in merge
    assert (f"- job {two} (failed): Do part two\n  summary: -\n"
            "  error: scripted model ran out of responses for movement 'work'") in merge
    assert "## Lessons from previous steps\n- [split] parts are independent" in merge
    # results are shown once, to the movement that resumes, not to later ones
    assert "## Results of subtasks" not in prompts[0]


def test_children_run_by_a_worker_of_another_workspace_object(ws: Workspace, tmp_path: Path) -> None:
    parent = ws.run(ws.submit("Do three parts", piece="fan-out", model=_parent(tmp_path, _three(tmp_path))),
                    subtasks=False)
    assert parent.status == "waiting_subtasks"
    other = Workspace(ws.root)
    ran = Worker(other).run()
    assert ran == 4  # three children, then the parent they put back in the queue
    assert ws.job(parent.id).status == "succeeded"
    assert [c.status.value for c in ws.children(parent)] == ["succeeded", "failed", "succeeded"]
    assert "## Results of subtasks" in user_prompts(ws, parent, "merge")[0]


def test_children_claimed_by_a_worker_process(ws: Workspace, tmp_path: Path) -> None:
    parent = ws.run(ws.submit("Do three parts", piece="fan-out", model=_parent(tmp_path, _three(tmp_path))),
                    subtasks=False)
    proc = subprocess.run(
        [sys.executable, "-m", "agentnb.cli", "--workspace", str(ws.root), "worker", "--max-jobs", "3"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ran 3 job(s)" in proc.stdout
    assert [c.status.value for c in ws.children(parent)] == ["succeeded", "failed", "succeeded"]
    for c in ws.children(parent):
        claims = [e.payload["reason"] for e in ws.events(c, kinds=["job_status"]) if e.payload["status"] == "running"]
        assert len(claims) == 1 and claims[0].startswith("claimed by ")
    assert ws.job(parent.id).status == "queued"  # the last child to end queued it
    done = ws.run(parent)
    assert done.status == "succeeded"
    assert f"job {ws.children(parent)[1].id} (failed)" in user_prompts(ws, parent, "merge")[0]


def test_children_use_the_parents_piece_unless_named_and_resume_can_be_chosen(ws: Workspace, tmp_path: Path) -> None:
    child = write_script(tmp_path, "child", {
        "split": [transition("merge", summary="too small to split")],
        "merge": [transition("COMPLETE", summary="child merged")],
    })
    spec = _parent(tmp_path, [{"instruction": "Small part", "model": child}], resume="check")
    piece = write_piece(tmp_path, "fan-check", {"movements": [
        {"name": "split", "instruction": "Split.", "default_next": "merge",
         "rules": [{"next": "WAIT_SUBTASKS"}, {"next": "merge"}, {"next": "check"}]},
        {"name": "merge", "instruction": "Merge.", "rules": [{"next": "COMPLETE"}]},
        {"name": "check", "instruction": "Check.", "rules": [{"next": "COMPLETE"}]},
    ]})
    parent = ws.run(ws.submit("Do it", piece=str(piece), model=spec))
    assert parent.status == "succeeded", parent.error
    (kid,) = ws.children(parent)
    assert kid.piece == "fan-check" and kid.status == "succeeded"
    assert [e.payload["movement"] for e in ws.events(kid, kinds=["movement_start"])] == ["split", "merge"]
    assert [e.payload["movement"] for e in ws.events(parent, kinds=["movement_start"])] == ["split", "check"]
    assert f"- job {kid.id} (succeeded): Small part\n  summary: child merged" in user_prompts(ws, parent, "check")[0]


def test_aborted_child_is_reported(ws: Workspace, tmp_path: Path) -> None:
    quitter = write_script(tmp_path, "quit", {"work": [transition("ABORT", summary="the input is missing")]})
    spec = _parent(tmp_path, [{"instruction": "Impossible part", "piece": "single", "model": quitter}])
    parent = ws.run(ws.submit("Do it", piece="fan-out", model=spec))
    assert parent.status == "succeeded"
    (kid,) = ws.children(parent)
    assert kid.status == "aborted"
    merge = user_prompts(ws, parent, "merge")[0]
    assert f"- job {kid.id} (aborted): Impossible part\n  summary: the input is missing" in merge


def test_child_waiting_for_a_human_keeps_the_parent_waiting(ws: Workspace, tmp_path: Path) -> None:
    asker = write_script(tmp_path, "asker", {"work": [
        transition("ASK", question="Which year?"),
        transition("COMPLETE", summary="used 2024"),
    ]})
    spec = _parent(tmp_path, [
        {"instruction": "Ask first", "piece": "single", "model": asker},
        {"instruction": "Plain part", "piece": "single", "model": _child(tmp_path, "plain", "plain done")},
    ])
    parent = ws.run(ws.submit("Do it", piece="fan-out", model=spec))
    assert parent.status == "waiting_subtasks"  # run returns instead of blocking on the human
    asking, plain = ws.children(parent)
    assert asking.status == "waiting_human" and plain.status == "succeeded"
    assert ws.run(parent).status == "waiting_subtasks"  # still nothing to do
    ws.reply(asking, "2024")
    done = ws.run(parent)  # runs the answered child, then the parent
    assert done.status == "succeeded"
    assert ws.job(asking.id).status == "succeeded"
    assert f"- job {asking.id} (succeeded): Ask first\n  summary: used 2024" in user_prompts(ws, parent, "merge")[0]


def test_subtasks_are_checked_before_anything_is_created(ws: Workspace, tmp_path: Path) -> None:
    spec = write_script(tmp_path, "bad", {
        "split": [
            transition("WAIT_SUBTASKS", subtasks=[]),
            transition("WAIT_SUBTASKS", subtasks=[{"instruction": "x", "colour": "red"}]),
            transition("WAIT_SUBTASKS", subtasks=[{"instruction": "x", "piece": "no-such-piece"}]),
            transition("merge", summary="gave up splitting"),
        ],
        "merge": [transition("COMPLETE")],
    })
    job = ws.run(ws.submit("Do it", piece="fan-out", model=spec))
    assert job.status == "succeeded"
    assert ws.children(job) == []
    errors = [e.payload["content"] for e in ws.events(job, kinds=["tool_result"]) if e.payload["is_error"]]
    assert "non-empty list of {instruction, piece?}" in errors[0]
    assert "unknown key(s) ['colour']" in errors[1]
    assert errors[2].startswith("Error: subtasks[0].piece:") and "no-such-piece" in errors[2]


def test_child_failing_after_a_step_or_at_setup_is_reported_with_its_error(
    ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a subtask names a piece of the project's pieces/ folder (never a path)
    (tmp_path / "pieces").mkdir()
    monkeypatch.chdir(tmp_path)
    write_piece(tmp_path / "pieces", "two-steps", {"movements": [
        {"name": "first", "instruction": "First.", "rules": [{"next": "second"}]},
        {"name": "second", "instruction": "Second.", "rules": [{"next": "COMPLETE"}]},
    ]})
    halfway = write_script(tmp_path, "halfway", {"first": [transition("second", summary="first half done")]})
    vanishing = tmp_path / "vanishing.yaml"
    vanishing.write_text("movements: {work: []}\n", encoding="utf-8")
    spec = _parent(tmp_path, [
        {"instruction": "Half", "piece": "two-steps", "model": halfway},
        {"instruction": "Vanish", "piece": "single", "model": f"scripted:{vanishing}"},
    ])
    parent = ws.run(ws.submit("Do it", piece="fan-out", model=spec), subtasks=False)
    vanishing.unlink()  # the child's model cannot be built when it is claimed
    assert ws.run(parent).status == "succeeded"
    half, gone = ws.children(parent)
    assert half.status == "failed" and gone.status == "failed"
    merge = user_prompts(ws, parent, "merge")[0]
    assert (f"- job {half.id} (failed): Half\n  summary: first half done\n"
            "  error: scripted model has no responses for movement 'second'") in merge
    assert f"- job {gone.id} (failed): Vanish\n  summary: -\n  error: scripted model file not found" in merge


def test_grandchild_answered_later_is_run_through_the_parent(ws: Workspace, tmp_path: Path) -> None:
    asker = write_script(tmp_path, "grand", {"work": [
        transition("ASK", question="Which unit?"),
        transition("COMPLETE", summary="metres"),
    ]})
    middle = write_script(tmp_path, "middle", {
        "split": [transition("WAIT_SUBTASKS", subtasks=[{"instruction": "Ask", "piece": "single", "model": asker}])],
        "merge": [transition("COMPLETE", summary="middle merged")],
    })
    parent = ws.run(ws.submit("Nested", piece="fan-out", model=_parent(tmp_path, [
        {"instruction": "Middle", "model": middle}])))
    assert parent.status == "waiting_subtasks"
    (child,) = ws.children(parent)
    (grand,) = ws.children(child)
    assert child.status == "waiting_subtasks" and grand.status == "waiting_human"
    ws.reply(grand, "metres")
    assert ws.run(parent).status == "succeeded"
    assert [ws.job(j.id).status.value for j in (child, grand)] == ["succeeded", "succeeded"]
    assert f"- job {grand.id} (succeeded): Ask\n  summary: metres" in user_prompts(ws, child, "merge")[0]
    assert f"- job {child.id} (succeeded): Middle\n  summary: middle merged" in user_prompts(ws, parent, "merge")[0]


def test_forced_wait_subtasks_without_subtasks_fails_clearly(ws: Workspace, tmp_path: Path) -> None:
    piece = write_piece(tmp_path, "forced-split", {"movements": [
        {"name": "split", "instruction": "Split.", "tools": ["Glob"], "max_iterations": 1,
         "rules": [{"next": "WAIT_SUBTASKS"}], "default_next": "WAIT_SUBTASKS"},
    ]})
    spec = write_script(tmp_path, "forced", {"split": [call("Glob", pattern="*")]})
    job = ws.run(ws.submit("Split", piece=str(piece), model=spec))
    assert job.status == "failed"
    assert job.error.startswith("split ended with WAIT_SUBTASKS but named no subtasks (max_iterations (1) reached")
    assert ws.children(job) == []


def test_relative_scripted_path_of_a_subtask_is_kept_absolute(
    ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _child(tmp_path, "relative", "relative done")
    monkeypatch.chdir(tmp_path)
    parent = ws.run(ws.submit("Do it", piece="fan-out", model=_parent(tmp_path, [
        {"instruction": "Part", "piece": "single", "model": "scripted:relative.yaml"}])), subtasks=False)
    (kid,) = ws.children(parent)
    assert kid.model == f"scripted:{tmp_path / 'relative.yaml'}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert ws.run(parent).status == "succeeded"
    assert ws.job(kid.id).status == "succeeded"


def test_subtasks_that_hand_out_subtasks_again_stop_at_the_nesting_limit(ws: Workspace, tmp_path: Path) -> None:
    from agentnb.engine.subtasks import MAX_SUBTASK_DEPTH

    # every job of this piece splits into two more of itself: without a limit the tree never ends
    spec = write_script(tmp_path, "again", {
        "split": [transition("WAIT_SUBTASKS", summary="split", subtasks=[{"instruction": "half"}, {"instruction": "half"}]),
                  transition("merge", summary="too deep to split: did it here")],
        "merge": [transition("COMPLETE", summary="merged")],
    })
    root = ws.run(ws.submit("Do it", piece="fan-out", model=spec))
    assert root.status == "succeeded", root.error
    jobs = ws.jobs()
    assert len(jobs) == 2 ** (MAX_SUBTASK_DEPTH + 1) - 1  # a full binary tree MAX_SUBTASK_DEPTH levels below the root
    assert all(j.status == "succeeded" for j in jobs)
    deepest = [j for j in jobs if not ws.children(j)]
    refused = next(e.payload["content"] for e in ws.events(deepest[0], kinds=["tool_result"]))
    assert refused == (f"Error: this job is already a subtask {MAX_SUBTASK_DEPTH} levels deep; subtasks may nest at "
                       f"most {MAX_SUBTASK_DEPTH} levels: do this work here instead of handing it out")


def test_too_many_subtasks_in_one_transition_are_a_tool_error(ws: Workspace, tmp_path: Path) -> None:
    from agentnb.engine.subtasks import MAX_SUBTASKS_PER_CALL

    spec = write_script(tmp_path, "many", {
        "split": [transition("WAIT_SUBTASKS", subtasks=[{"instruction": f"part {i}"} for i in range(MAX_SUBTASKS_PER_CALL + 1)]),
                  transition("merge")],
        "merge": [transition("COMPLETE")],
    })
    job = ws.run(ws.submit("Do it", piece="fan-out", model=spec))
    assert job.status == "succeeded" and ws.children(job) == []
    first = ws.events(job, kinds=["tool_result"])[0].payload
    assert first["is_error"] and f"at most {MAX_SUBTASKS_PER_CALL} per transition" in first["content"]


def test_a_subtask_instruction_over_the_size_limit_is_a_tool_error(ws: Workspace, tmp_path: Path) -> None:
    from agentnb.store.sqlite import MAX_INSTRUCTION_CHARS

    spec = write_script(tmp_path, "huge", {
        "split": [transition("WAIT_SUBTASKS", subtasks=[{"instruction": "x" * (MAX_INSTRUCTION_CHARS + 1)}]),
                  transition("merge")],
        "merge": [transition("COMPLETE")],
    })
    job = ws.run(ws.submit("Do it", piece="fan-out", model=spec))
    assert job.status == "succeeded" and ws.children(job) == []
    first = ws.events(job, kinds=["tool_result"])[0].payload
    assert first["is_error"] and f"at most {MAX_INSTRUCTION_CHARS:,} are allowed" in first["content"]

# -- what a subtask may run: a listed piece, within the rights of the movement that creates it --------------

SECRET = "host-secret-7f3a: the root password is hunter2"


def _store_text(ws: Workspace) -> str:
    """Everything the store holds about jobs and their events, as one text to search."""
    rows = ws.store.query("SELECT payload FROM events")
    jobs = ws.store.query("SELECT piece, piece_yaml, piece_path, model, instruction, options FROM jobs")
    return "\n".join(str(v) for r in [*rows, *jobs] for v in r)


def _writer_piece(folder: Path) -> Path:
    """A piece whose only step can Write (and hand out subtasks): nothing else, and no Bash."""
    return write_piece(folder, "writer", {"movements": [
        {"name": "write", "instruction": "Write.", "tools": ["Write"], "permission": "edit",
         "rules": [{"next": "WAIT_SUBTASKS"}, {"next": "COMPLETE"}]},
    ]})


@pytest.mark.parametrize("form", ["relative", "absolute"])
def test_a_piece_written_by_the_job_and_named_by_path_is_refused_and_nothing_runs(
    ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    host_file = tmp_path / "host-secret.txt"
    host_file.write_text(SECRET, encoding="utf-8")
    evil = yaml.safe_dump({"name": "evil", "movements": [
        {"name": "pwn", "instruction_file": str(host_file), "tools": ["Bash"], "permission": "full",
         "rules": [{"next": "COMPLETE"}]}]})
    monkeypatch.chdir(tmp_path)  # the attack named the piece relative to the worker's directory
    # the job about to be submitted is the workspace's first: job 1
    ref = (f"{ws.root.name}/jobs/1/output/evil.yaml" if form == "relative"
           else str(ws.root / "jobs" / "1" / "output" / "evil.yaml"))
    spec = write_script(tmp_path, "attack", {"write": [
        call("Write", path="output/evil.yaml", content=evil),
        transition("WAIT_SUBTASKS", subtasks=[{"instruction": "Run it", "piece": ref}]),
        transition("COMPLETE", summary="gave up"),
    ]})
    job = ws.run(ws.submit("Do it", piece=str(_writer_piece(tmp_path)), model=spec))
    assert job.id == 1
    assert (tmp_path / ref).is_file()  # the Write itself was allowed
    assert job.status == "succeeded", job.error
    assert ws.children(job) == []
    refused = [e.payload["content"] for e in ws.events(job, kinds=["tool_result"]) if e.payload["is_error"]]
    assert refused == [f"Error: subtasks[0].piece: {ref!r} is a path; a subtask's piece is a name that "
                       f"`agentnb pieces` lists: {', '.join(sorted(available_pieces()))}"]
    assert SECRET not in _store_text(ws)
    assert len(ws.jobs()) == 1


@pytest.mark.sqlite_only("submit(workdir=) is refused on PostgreSQL (files live in the store)")
def test_a_listed_piece_inside_the_work_directory_is_refused(
    ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a job whose work directory holds the project's pieces/ could write a piece there and name it
    project = tmp_path / "project"
    (project / "pieces").mkdir(parents=True)
    monkeypatch.chdir(project)
    evil = yaml.safe_dump({"name": "evil", "movements": [
        {"name": "work", "instruction": "Go.", "tools": ["Write"], "permission": "edit",
         "rules": [{"next": "COMPLETE"}]}]})
    spec = write_script(tmp_path, "plant", {"write": [
        call("Write", path="pieces/evil.yaml", content=evil),
        transition("WAIT_SUBTASKS", subtasks=[{"instruction": "Run it", "piece": "evil"}]),
        transition("COMPLETE", summary="gave up"),
    ]})
    job = ws.run(ws.submit("Do it", piece=str(_writer_piece(tmp_path)), model=spec, workdir=project))
    assert job.status == "succeeded", job.error
    assert ws.children(job) == []
    (refused,) = [e.payload["content"] for e in ws.events(job, kinds=["tool_result"]) if e.payload["is_error"]]
    assert refused == ("Error: subtasks[0].piece: piece 'evil' (evil.yaml) lies inside this job's work directory, "
                       "where a job could have written it; keep pieces outside work directories")


def test_a_broken_listed_piece_is_refused_without_its_host_path(
    ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pieces").mkdir()
    (tmp_path / "pieces" / "broken.yaml").write_text("name: broken\nmovements: []\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    spec = write_script(tmp_path, "broken-split", {"write": [
        transition("WAIT_SUBTASKS", subtasks=[{"instruction": "x", "piece": "broken"}]), transition("COMPLETE")]})
    job = ws.run(ws.submit("Do it", piece=str(_writer_piece(tmp_path)), model=spec))
    assert job.status == "succeeded" and ws.children(job) == []
    (refused,) = [e.payload["content"] for e in ws.events(job, kinds=["tool_result"]) if e.payload["is_error"]]
    assert refused == ("Error: subtasks[0].piece: piece 'broken' is not valid: line 2: movements: "
                       "found an empty list, expected at least one movement")


def _splitter(folder: Path, tools: list[str], permission: str, **more: Any) -> Path:
    return write_piece(folder, "splitter", {"movements": [
        {"name": "split", "instruction": "Split.", "tools": tools, "permission": permission,
         "rules": [{"next": "WAIT_SUBTASKS"}, {"next": "COMPLETE"}], **more},
    ]})


def test_a_subtask_piece_with_more_tools_than_its_creator_is_refused(ws: Workspace, tmp_path: Path) -> None:
    spec = write_script(tmp_path, "more-tools", {"split": [
        transition("WAIT_SUBTASKS", subtasks=[{"instruction": "Write it", "piece": "single"}]),
        transition("COMPLETE", summary="did it here"),
    ]})
    job = ws.run(ws.submit("Do it", piece=str(_splitter(tmp_path, ["Read", "Glob"], "edit")), model=spec))
    assert job.status == "succeeded" and ws.children(job) == []
    (refused,) = [e.payload["content"] for e in ws.events(job, kinds=["tool_result"]) if e.payload["is_error"]]
    assert refused == (
        "Error: subtasks[0].piece: piece 'single': movement 'work' uses Grep, Write, Edit, Checklist, beyond this "
        "step's tools (step 'split' has tools: Read, Glob and permission 'edit'); a subtask never gets more tools "
        "or permission than the step that creates it: name a piece that fits, or do the work here")


def test_a_subtask_piece_with_more_permission_than_its_creator_is_refused(ws: Workspace, tmp_path: Path) -> None:
    # the same tools as single, but readonly: single's edit permission would be an escalation
    tools = ["Read", "Glob", "Grep", "Write", "Edit", "Checklist"]
    spec = write_script(tmp_path, "more-permission", {"split": [
        transition("WAIT_SUBTASKS", subtasks=[{"instruction": "Write it", "piece": "single"}]),
        transition("COMPLETE", summary="did it here"),
    ]})
    job = ws.run(ws.submit("Do it", piece=str(_splitter(tmp_path, tools, "readonly")), model=spec))
    assert job.status == "succeeded" and ws.children(job) == []
    (refused,) = [e.payload["content"] for e in ws.events(job, kinds=["tool_result"]) if e.payload["is_error"]]
    assert refused.startswith("Error: subtasks[0].piece: piece 'single': movement 'work' has permission 'edit', "
                              "above this step's (step 'split' has tools: Read, Glob, Grep, Write, Edit, Checklist "
                              "and permission 'readonly')")


def test_without_a_piece_every_movement_of_the_parents_own_piece_must_fit(ws: Workspace, tmp_path: Path) -> None:
    piece = write_piece(tmp_path, "lopsided", {"movements": [
        {"name": "split", "instruction": "Split.", "tools": ["Read"], "permission": "readonly",
         "rules": [{"next": "WAIT_SUBTASKS"}, {"next": "finish"}]},
        {"name": "finish", "instruction": "Finish.", "tools": ["Read", "Write"], "permission": "edit",
         "rules": [{"next": "COMPLETE"}]},
    ]})
    spec = write_script(tmp_path, "own", {
        "split": [transition("WAIT_SUBTASKS", subtasks=[{"instruction": "Again"}]), transition("finish")],
        "finish": [transition("COMPLETE")],
    })
    job = ws.run(ws.submit("Do it", piece=str(piece), model=spec))
    assert job.status == "succeeded" and ws.children(job) == []
    (refused,) = [e.payload["content"] for e in ws.events(job, kinds=["tool_result"]) if e.payload["is_error"]]
    assert refused.startswith("Error: subtasks[0].piece: piece 'lopsided': movement 'finish' uses Write, beyond")


def test_fan_out_hands_out_single_within_its_rights_and_the_children_keep_the_cap(
    ws: Workspace, tmp_path: Path
) -> None:
    parent = ws.run(ws.submit("Do two parts", piece="fan-out", model=_parent(tmp_path, [
        {"instruction": "Part one", "piece": "single", "model": _child(tmp_path, "one", "one written")},
        {"instruction": "Part two", "piece": "single", "model": _child(tmp_path, "two", "two written")},
    ])))
    assert parent.status == "succeeded", parent.error
    kids = ws.children(parent)
    assert [k.status.value for k in kids] == ["succeeded", "succeeded"]
    for kid in kids:
        assert (Path(kid.workdir) / "output" / "part.md").is_file()  # Write ran in the child
        assert ws.store.job(kid.id).options.subtask_cap == {"tools": ["Read", "Glob", "Grep", "Write", "Edit", "Checklist"],
                                          "permission": "edit"}


@pytest.mark.sqlite_only("seeds a child's work directory on disk; on PostgreSQL a claim materialises it from the store")
def test_the_childs_loop_refuses_tools_beyond_the_cap_even_if_its_row_names_a_bigger_piece(
    ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pieces").mkdir()
    monkeypatch.chdir(tmp_path)
    write_piece(tmp_path / "pieces", "reader", {"movements": [
        {"name": "work", "instruction": "Read.", "tools": ["Read"], "permission": "readonly",
         "rules": [{"next": "COMPLETE"}]}]})
    child = write_script(tmp_path, "child", {"work": [
        call("Write", path="output/escaped.txt", content="out"),
        call("Edit", path="output/seed.txt", old="a", new="b"),
        transition("COMPLETE", summary="tried"),
    ]})
    spec = write_script(tmp_path, "parent", {"split": [
        transition("WAIT_SUBTASKS", subtasks=[{"instruction": "Read it", "piece": "reader", "model": child}])]})
    parent = ws.run(ws.submit("Do it", piece=str(_splitter(tmp_path, ["Read", "Edit"], "readonly")), model=spec),
                    subtasks=False)
    (kid,) = ws.children(parent)
    # the row is changed behind the engine's back: Write and Edit, with edit permission
    bigger = yaml.safe_dump({"name": "reader", "movements": [
        {"name": "work", "instruction": "Read.", "tools": ["Read", "Write", "Edit"], "permission": "edit",
         "rules": [{"next": "COMPLETE"}]}]})
    with ws.store.transaction() as c:
        ws.store.update_job(c, kid.id, piece_yaml=bigger)
    (Path(kid.workdir) / "output" / "seed.txt").write_text("a", encoding="utf-8")
    done = ws.run(kid.id)
    assert done.status == "succeeded", done.error
    assert not (Path(kid.workdir) / "output" / "escaped.txt").exists()
    assert (Path(kid.workdir) / "output" / "seed.txt").read_text(encoding="utf-8") == "a"
    results = [e.payload for e in ws.events(kid, kinds=["tool_result"])]
    assert results[0]["is_error"] and results[0]["content"].startswith("Error: tool 'Write' is not available")
    # Edit is within the creator's tools, but not its permission
    assert results[1]["content"] == "Error: Edit needs permission 'edit'; this step has 'readonly'"
    tools_offered = ws.events(kid, kinds=["llm_request"])[0].payload["tools"]
    assert tools_offered == ["Read", "Edit", "transition"]


def test_a_subtask_of_a_real_model_may_not_name_a_script_or_another_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = write_script(tmp_path, "planted", {"work": [transition("COMPLETE")]})
    with OpenAIServer() as server:
        server.play(
            reply(tool_calls=[("transition", {"next_step": "WAIT_SUBTASKS", "subtasks": [
                {"instruction": "x", "piece": "single", "model": script}]})]),
            reply(tool_calls=[("transition", {"next_step": "WAIT_SUBTASKS", "subtasks": [
                {"instruction": "x", "piece": "single", "model": "replay:1"}]})]),
            reply(tool_calls=[("transition", {"next_step": "WAIT_SUBTASKS", "subtasks": [
                {"instruction": "own model", "piece": "single", "model": "openai:loopback-model"},
                {"instruction": "plain spec", "piece": "single", "model": "demo"},
                {"instruction": "inherited", "piece": "single"}]})]),
        )
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("AGENTNB_OPENAI_RETRIES", "0")
        ws = Workspace(tmp_path / "ws")
        job = ws.run(ws.submit("Split", piece="fan-out", model="openai:loopback-model"), subtasks=False)
    assert job.status == "waiting_subtasks", job.error
    refused = [e.payload["content"] for e in ws.events(job, kinds=["tool_result"]) if e.payload["is_error"]]
    allowed = "allowed: this job's own model (openai:loopback-model), demo or openai:<model>"
    assert refused == [f"Error: subtasks[0].model: {script!r} names a file or another job; {allowed}",
                       f"Error: subtasks[0].model: 'replay:1' names a file or another job; {allowed}"]
    assert [k.model for k in ws.children(job)] == ["openai:loopback-model", "demo", "openai:loopback-model"]
