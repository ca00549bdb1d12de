"""ASK: a movement asks the user, the job waits, a reply resumes it from the comments alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _scripting import call, requests, starts, transition, user_prompts, write_script
from openai_server import OpenAIServer, reply

from agentnb import Workspace
from agentnb.cli import main as cli_main
from agentnb.store.sqlite import StoreError

QUESTION = "Should the summary be in English or in French?"
ANSWER = "French, please, and keep it under 100 words."


def _ask_script(tmp_path: Path) -> str:
    return write_script(tmp_path, "ask", {
        "clarify": [
            call("Glob", pattern="input/*"),
            transition("ASK", summary="the language is unclear", question=QUESTION,
                       lessons="notes.md is a short list"),
            transition("work", summary="the user chose French"),
        ],
        "work": [
            call("Write", path="output/summary.md", content="Résumé court."),
            transition("COMPLETE", summary="wrote output/summary.md"),
        ],
    })


def _submit(ws: Workspace, tmp_path: Path):  # type: ignore[no-untyped-def]
    return ws.submit("Summarise input/notes.md", piece="ask-first", model=_ask_script(tmp_path),
                     inputs={"notes.md": "alpha\nbeta\n"})


def test_ask_waits_with_question_as_agent_comment(ws: Workspace, tmp_path: Path) -> None:
    job = ws.run(_submit(ws, tmp_path))
    assert job.status == "waiting_human"
    assert job.resume_movement == "clarify"
    assert [(c["author"], c["body"]) for c in ws.comments(job)] == [("agent", QUESTION)]
    comment_events = [e.payload for e in ws.events(job, kinds=["comment"])]
    assert comment_events == [{"author": "agent", "body": QUESTION}]
    ask = ws.events(job, kinds=["transition"])[-1]
    assert ask.payload["next_step"] == "ASK" and ask.payload["question"] == QUESTION
    statuses = [e.payload["status"] for e in ws.events(job, kinds=["job_status"])]
    assert statuses[-1] == "waiting_human"
    # running it again does nothing until someone answers
    assert ws.run(job).status == "waiting_human"
    assert len(starts(ws, job)) == 1


def _check_resumed(ws: Workspace, job_id: int) -> None:
    job = ws.job(job_id)
    assert job.status == "succeeded", job.error
    assert [e.payload["movement"] for e in starts(ws, job)] == ["clarify", "clarify", "work"]
    resumed = user_prompts(ws, job)[1]
    # the question and the answer reach the model as comments, in order
    assert f"] {QUESTION}" in resumed and f"] {ANSWER}" in resumed
    assert resumed.index(QUESTION) < resumed.index(ANSWER)
    assert "## Conversation so far (last 2 of 2 comments)" in resumed
    assert "[agent, " in resumed and "[user, " in resumed
    # the lesson of the movement that asked is carried over
    assert "## Lessons from previous steps\n- [clarify] notes.md is a short list" in resumed
    # the earlier movement's messages are not replayed: the first call after the
    # answer sends exactly the system prompt and the new user prompt
    reqs = requests(ws, job)
    first_after = next(r for r in reqs if r.movement_seq == 2)
    assert first_after.iteration == 1 and first_after.payload["messages"] == 2
    assert "Glob" not in resumed and "input/*" not in resumed
    comments = [e.payload for e in ws.events(job, kinds=["comment"])]
    assert comments == [{"author": "agent", "body": QUESTION}, {"author": "user", "body": ANSWER}]
    assert (Path(job.workdir) / "output" / "summary.md").read_text(encoding="utf-8") == "Résumé court."


def test_reply_requeues_and_resumes_at_the_asking_movement(ws: Workspace, tmp_path: Path) -> None:
    job = ws.run(_submit(ws, tmp_path))
    job = ws.reply(job, ANSWER)
    assert job.status == "queued"
    assert job.current_movement == "clarify"
    ws.run(job)
    _check_resumed(ws, job.id)


def test_reply_after_fresh_workspace_and_resume_in_another_process(tmp_path: Path) -> None:
    folder = tmp_path / "ws"
    first = Workspace(folder)
    job = first.run(_submit(first, tmp_path))
    assert job.status == "waiting_human"
    first.store.close()
    del first

    second = Workspace(folder)  # as after a kernel restart: only the SQLite file and the folder remain
    waiting = second.job(job.id)
    assert waiting.status == "waiting_human" and waiting.resume_movement == "clarify"
    assert second.reply(job.id, ANSWER).status == "queued"
    second.store.close()

    code = (
        "import sys; from agentnb import Workspace; ws = Workspace(sys.argv[1]); "
        "print(ws.run(int(sys.argv[2])).status)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(folder), str(job.id)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "succeeded"
    _check_resumed(Workspace(folder), job.id)


def test_enriched_instruction_keeps_last_five_comments_cut_to_500(ws: Workspace, tmp_path: Path) -> None:
    spec = write_script(tmp_path, "many", {
        "clarify": [
            transition("ASK", question="Q1 " + "q" * 600),
            transition("ASK", question="Q2?"),
            transition("ASK", question="Q3?"),
            transition("work"),
        ],
        "work": [transition("COMPLETE")],
    })
    job = ws.run(ws.submit("Do it", piece="ask-first", model=spec))
    for answer in ("A1 " + "a" * 700, "A2", "A3 final answer"):
        assert ws.job(job.id).status == "waiting_human"
        ws.run(ws.reply(job, answer))
    assert ws.job(job.id).status == "succeeded"
    last = user_prompts(ws, job, "clarify")[-1]
    assert "(last 5 of 6 comments)" in last
    assert "Q1 " not in last  # the oldest comment fell out
    assert "A1 " + "a" * 497 + " … [cut: 500 of 703 characters shown]" in last
    assert "a" * 498 not in last
    for body in ("Q2?", "A2", "Q3?", "A3 final answer"):
        assert f"] {body}" in last
    second = user_prompts(ws, job, "clarify")[1]
    assert "Q1 " + "q" * 497 + " … [cut: 500 of 603 characters shown]" in second


def test_reply_to_a_job_that_is_not_waiting_only_adds_a_comment(ws: Workspace, tmp_path: Path) -> None:
    job = _submit(ws, tmp_path)
    job = ws.reply(job, "a note before it starts")
    assert job.status == "queued"
    assert [c["author"] for c in ws.comments(job)] == ["user"]
    with pytest.raises(ValueError, match="reply text must be non-empty"):
        ws.reply(job, "  ")


def test_ask_needs_a_question(ws: Workspace, tmp_path: Path) -> None:
    spec = write_script(tmp_path, "noq", {
        "clarify": [transition("ASK", summary="?"), transition("ASK", question="Which format?")],
    })
    job = ws.run(ws.submit("Do it", piece="ask-first", model=spec))
    assert job.status == "waiting_human"
    results = ws.events(job, kinds=["tool_result"])
    assert results[0].payload["is_error"] and "ASK needs a question" in results[0].payload["content"]
    assert [c["body"] for c in ws.comments(job)] == ["Which format?"]


def test_cli_reply_answers_and_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "ws"
    ws = Workspace(folder)
    job = ws.run(_submit(ws, tmp_path))
    assert cli_main(["--workspace", str(folder), "show", str(job.id)]) == 0
    out = capsys.readouterr().out
    assert f"question: {QUESTION}" in out and f"agentnb reply {job.id}" in out
    assert cli_main(["--workspace", str(folder), "reply", str(job.id), "--run", *ANSWER.split(" ")]) == 0
    assert f"job {job.id}: succeeded" in capsys.readouterr().out
    _check_resumed(ws, job.id)
    assert cli_main(["--workspace", str(folder), "reply", "999", "hello"]) == 2
    assert "no job 999" in capsys.readouterr().err


def test_show_events_prints_comments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "ws"
    ws = Workspace(folder)
    job = ws.run(_submit(ws, tmp_path))
    cli_main(["--workspace", str(folder), "show", str(job.id), "--events"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {"kind": "comment", "author": "agent", "body": QUESTION}.items() <= next(
        line for line in lines if line["kind"] == "comment").items()


def test_messages_sent_over_http_after_resume_hold_no_earlier_conversation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with OpenAIServer() as server:
        server.play(
            reply(tool_calls=[("Glob", {"pattern": "input/*"})]),
            reply(tool_calls=[("transition", {"next_step": "ASK", "summary": "unclear", "question": QUESTION})]),
            reply(tool_calls=[("transition", {"next_step": "work", "summary": "clear now"})]),
            reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "done"})]),
        )
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("AGENTNB_OPENAI_RETRIES", "0")
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        folder = tmp_path / "ws"
        ws = Workspace(folder)
        job = ws.run(ws.submit("Summarise input/notes.md", piece="ask-first", model="openai:loopback-model",
                               inputs={"notes.md": "alpha\n"}))
        assert job.status == "waiting_human"
        assert len(server.received) == 2
        assert len(server.received[1].body["messages"]) == 4  # system, user, the Glob call and its result
        fresh = Workspace(folder)
        fresh.reply(job.id, ANSWER)
        assert fresh.run(job.id).status == "succeeded"
    resumed = server.received[2].body["messages"]
    assert [m["role"] for m in resumed] == ["system", "user"]
    assert QUESTION in resumed[1]["content"] and ANSWER in resumed[1]["content"]
    assert resumed[1]["content"] == user_prompts(fresh, job, "clarify")[1]
    assert not any("input/*" in json.dumps(m) for m in resumed)


def _ended(ws: Workspace, tmp_path: Path) -> dict[str, int]:
    """Three jobs that have ended: succeeded, failed (its script runs out) and aborted."""
    ended = {}
    for status, script in (("succeeded", [transition("COMPLETE", summary="done")]), ("failed", []),
                           ("aborted", [transition("ABORT", summary="cannot")])):
        spec = write_script(tmp_path, status, {"work": script})
        job = ws.run(ws.submit("Do it", piece="single", model=spec))
        assert job.status == status, job.error
        ended[status] = job.id
    return ended


def test_a_reply_to_a_job_that_has_ended_is_refused_naming_its_status(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    ws = Workspace(tmp_path / "ws")
    ended = _ended(ws, tmp_path)
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "agentnb")
    shell.run_line_magic("config", f"AgentMagic.workspace = {str(tmp_path / 'ws')!r}")
    for status, job_id in ended.items():
        events = len(ws.events(job_id))
        with pytest.raises(StoreError) as info:  # the API
            ws.reply(job_id, "Any news?")
        message = str(info.value)
        assert f"job {job_id} has ended ({status})" in message and "\n" not in message
        assert ("retry it" in message) == (status != "succeeded")
        assert cli_main(["--workspace", str(tmp_path / "ws"), "reply", str(job_id), "Any", "news?"]) == 2  # the CLI
        err = capsys.readouterr().err
        assert err == f"agentnb: error: {message}\n"
        with pytest.raises(UsageError) as magic:  # the magic
            shell.run_line_magic("agent", f'reply {job_id} "Any news?"')
        assert str(magic.value) == f"%agent reply: {message}"
        assert len(ws.events(job_id)) == events and ws.comments(job_id) == []  # nothing was added
        assert ws.job(job_id).status == status
