"""Secrets never reach the store, its views or an export (``agentnb/_secrets.py``, ``store/_rows.py``).

An endpoint (or a proxy in front of it) may repeat the API key in its error ("Incorrect API key provided:
sk-…"); the job's ``error``, its ``error`` event and its ``job_status`` reason are stored from that text, and
printed by ``agentnb run``, ``agentnb show --events``, the frames and an export.  Every text goes through one
scrub on its way into the store, on SQLite as on PostgreSQL (a database a team shares); a key given in code
(not in the environment) is registered by the model that uses it, and key-shaped text is masked whatever its
origin.  The tool results' masking is tested in test_security.py.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from openai_server import ECHO_KEY, OpenAIServer, error, raw, reply

import agentnb
from agentnb import Workspace
from agentnb._secrets import KEY_SHAPED, MASK, register_secret, scrub, scrub_data
from agentnb.cli import main as cli_main
from agentnb.engine.runner import JobRunner
from agentnb.events import CommentEvent, ErrorEvent, ToolCallEvent
from agentnb.models.openai import OpenAIModel
from agentnb.store import reads

ROOT = Path(agentnb.__file__).resolve().parents[1]

# key-shaped (the pattern's net would catch it even were it in no variable)
SHAPED_KEY = "sk-proj-" + "Tq4vW9" * 7
# shaped like no key: only the value itself (from the environment, or registered by the model) can mask it
ENV_KEY = "envkey-" + "Hp3Lm8" * 6
CODE_KEY = "codekey-" + "Rz2Nx5" * 6


def _stored_text(store_url: str) -> str:
    """Everything the store holds as text: the SQLite file and its side files byte for byte, or every row of
    every PostgreSQL table."""
    if store_url.startswith("sqlite:///"):
        db = Path(store_url.removeprefix("sqlite://"))
        files = [f for f in db.parent.glob(db.name + "*") if f.is_file()]
        assert db in files
        return "\n".join(f.read_bytes().decode("latin-1") for f in files)
    import psycopg

    with psycopg.connect(store_url) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema='public'")]
        assert {"jobs", "events", "comments", "movements", "texts"} <= set(tables)
        return "\n".join(str(r[0]) for t in tables
                         for r in conn.execute(f'SELECT row_to_json(t)::text FROM "{t}" t'))


def _frames_text(ws: Workspace) -> str:
    frames = ws.frames
    return "\n".join(getattr(frames, name)().to_csv() for name in (
        "jobs", "movements", "messages", "tool_calls", "usage", "context_actions", "divergences", "compactions",
        "loops", "scores"))


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli_main(list(args))
    out = capsys.readouterr()
    return code, out.out + out.err


# (what the endpoint answers, where the key comes from, the key): a 401 repeating the key (as the report had it),
# a 5xx retried until the model gives up, a 200 that is no chat completion (an HTML page naming the key)
CASES = {
    "401": (error(401, f"Incorrect API key provided: {ECHO_KEY}. You can find your API key at "
                       "https://platform.openai.com/account/api-keys."), "env", SHAPED_KEY),
    "500": (error(500, f"upstream refused key {ECHO_KEY} (try again)", times=2), "code", CODE_KEY),
    "malformed-200": (raw(f"<html><body>proxy: the key {ECHO_KEY} is not allowed here</body></html>",
                          content_type="text/html", times=2), "env", ENV_KEY),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_endpoint_repeating_the_key_leaves_it_nowhere(
    case: str, store_url: str, tmp_path: Path, loopback: Callable[..., OpenAIServer],
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    answers, source, key = CASES[case]
    srv = loopback(key if source == "env" else "sk-test", retries="1")
    srv.play(*answers)
    folder = str(tmp_path / "ws")
    if source == "env":
        code, run_out = _cli(capsys, "run", "--workspace", folder, "--store", store_url, "--piece", "single",
                             "--model", "openai:gpt-test", "Say hello.")
        assert code == 1, run_out
        job_id = 1
    else:  # the key is given in code: no environment variable holds it
        monkeypatch.delenv("OPENAI_API_KEY")
        run_out = ""
        with Workspace(folder, store=store_url) as ws:
            job_id = ws.submit("Say hello.", piece="single", model="openai:gpt-test").id
            row = ws.store.claim(job_id)
            assert row is not None
            model = OpenAIModel("gpt-test", base_url=srv.base_url, api_key=key, max_retries=1, backoff=0.01)
            assert JobRunner(ws.store, row, model, ws.root / "jobs").advance("job") == "failed"
    # the endpoint was asked with the key and did repeat it
    assert srv.received and srv.received[-1].headers["authorization"] == f"Bearer {key}"

    code, show_out = _cli(capsys, "show", "--workspace", folder, "--store", store_url, str(job_id), "--events")
    assert code == 0
    with Workspace(folder, store=store_url) as ws:
        job = ws.job(job_id)
        status, job_error = job.status, job.error or ""
        reasons = [e.payload.get("reason", "") for e in ws.events(job, kinds=["job_status"])]
        errors = [e.payload["message"] for e in ws.events(job, kinds=["error"])]
        frames = _frames_text(ws)
    # the export runs in a shell whose environment holds no key at all
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY" and not k.startswith("AGENTNB_STORE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    notebook = tmp_path / "job.ipynb"
    done = subprocess.run([sys.executable, "-m", "agentnb.cli", "--workspace", folder, "--store", store_url,
                           "export", str(job_id), str(notebook)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    exported = notebook.read_text(encoding="utf-8")

    places = {"store": _stored_text(store_url), "run": run_out, "show --events": show_out, "frames": frames,
              "export": exported}
    for where, text in places.items():
        for piece in (key, key[:16], key[-16:]):
            assert piece not in text, (where, piece)
    # what the endpoint said stays readable, with the key masked where it stood
    assert status == "failed" and MASK in job_error
    assert "HTTP 401: Incorrect API key provided: ***." in job_error if case == "401" else True
    assert any(MASK in r for r in reasons) and errors and all(MASK in m for m in errors), (reasons, errors)
    assert MASK in show_out and MASK in exported and (source != "env" or MASK in run_out)


def test_every_text_the_store_keeps_is_scrubbed(store_url: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # a job's texts, a status reason, an event of any kind, a comment, a movement's summary, a subtask's row
    monkeypatch.setenv("SERVICE_TOKEN", ENV_KEY)
    register_secret(CODE_KEY)
    said = f"keys {SHAPED_KEY} / {ENV_KEY} / {CODE_KEY} / Bearer {'Ab9' * 8}"
    with Workspace(tmp_path / "ws", store=store_url) as ws:
        s = ws.store
        job_id = ws.submit("Use " + said + " " + "x" * 3000, piece="single", model="demo",
                           context={"window_tokens": 9000}).id
        with s.transaction() as c:
            s.update_job(c, job_id, error=said, enriched="Enriched: " + said, options=json.dumps({"note": said}))
            s.set_status(c, job_id, "failed", reason=said)
            s.add_comment(c, job_id, "user", said)
            s.start_movement(c, job_id, 1, "work")
            s.finish_movement(c, job_id, 1, iterations=1, next_step="COMPLETE", forced=False, summary=said)
            child = s.create_child_job(c, job_id, piece="single", piece_yaml="movements: []", piece_path=None,
                                       model="demo", instruction=said, options=json.dumps({"why": said}))
        s.append([ErrorEvent(job_id=job_id, movement_seq=1, iteration=1, ts=1.0, message=said, where="model",
                             detail=said),
                  ToolCallEvent(job_id=job_id, movement_seq=1, iteration=1, ts=1.0, tool="Bash", call_id="c1",
                                arguments={"command": said, "more": [said, {"nested": said}]}),
                  CommentEvent(job_id=job_id, ts=1.0, author="agent", body="line one\n" + said)])
        job = s.job(job_id)
        assert job.error == f"keys {MASK} / {MASK} / {MASK} / Bearer {MASK}"
        assert job.instruction.startswith(f"Use keys {MASK} / ")
        assert json.loads(job.options_text) == {"note": job.error}
        assert s.job(child).instruction == job.error
        assert [c.body for c in reads.comments(s, job_id)] == [job.error]
        events = s.events(job_id)
        assert [e.detail for e in events if e.kind == "error"] == [job.error]
        assert [e.arguments for e in events if e.kind == "tool_call"] == [
            {"command": job.error, "more": [job.error, {"nested": job.error}]}]
        assert [e.body for e in events if e.kind == "comment"] == [job.error, "line one\n" + job.error]
        assert [e.reason for e in events if e.kind == "job_status"][-1] == job.error
    stored = _stored_text(store_url)
    for secret in (SHAPED_KEY, ENV_KEY, CODE_KEY, "Ab9" * 8):
        assert secret not in stored, secret


def test_a_batchs_cases_and_options_are_kept_without_secrets(store_url: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # a case's instruction, its other columns and the batch's context options are the batch row's texts too
    monkeypatch.setenv("SERVICE_TOKEN", ENV_KEY)
    said = f"keys {SHAPED_KEY} / {ENV_KEY}"
    cases = [{"instruction": "Summarise: " + said, "note": said, "expected": {"answer": said}}]
    with Workspace(tmp_path / "ws", store=store_url) as ws:
        first = ws.batch(cases, piece="single", model="demo", name="exp", context={"on_pressure": "compact"},
                         progress=False)
        assert len(first.frame) == 1
        assert first.frame["note"].tolist() == [f"keys {MASK} / {MASK}"]
        # the same cases again are the same batch (its fingerprint is of the cases as given): nothing new runs
        again = ws.batch(cases, piece="single", model="demo", name="exp", progress=False)
        assert again.frame["job"].tolist() == first.frame["job"].tolist()
    stored = _stored_text(store_url)
    for secret in (SHAPED_KEY, ENV_KEY):
        assert secret not in stored, secret


@pytest.mark.parametrize("stream", [True, False])
def test_a_secret_the_model_wrote_escaped_in_its_argument_text_is_not_kept(
        store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        loopback: Callable[..., OpenAIServer], stream: bool) -> None:
    # the model's own argument text is kept when re-encoding would change it (compact JSON); JSON may write a
    # secret there otherwise than as itself (\" and \\, \u0051, \/), which no masking of text sees
    secret = 'Q7zXw9/pLm2Rt"\\Vb'
    monkeypatch.setenv("TOOL_API_KEY", secret)
    escaped = json.dumps(secret)[1:-1]
    texts = ['{"path":"a.md","content":"key ' + v + '"}'
             for v in (escaped, "\\u0051" + escaped[1:], escaped.replace("/", "\\/"))]
    srv = loopback()
    srv.play(reply(None, [("Write", t) for t in texts]), reply(None, [("transition", {"next_step": "COMPLETE",
                                                                                      "summary": "done"})]))
    piece = {"name": "w", "movements": [{"name": "work", "persona": "p", "instruction": "i", "tools": ["Write"],
                                         "permission": "edit", "rules": [{"condition": "done", "next": "COMPLETE"}]}]}
    (tmp_path / "w.yaml").write_text(json.dumps(piece))
    with Workspace(tmp_path / "ws", store=store_url) as ws:
        job = ws.run(ws.submit("write", piece=str(tmp_path / "w.yaml"), model="openai:m" + ("" if stream else "?stream=0")))
        assert job.status == "succeeded", job.error
        (response,) = [e for e in ws.events(job, kinds=["llm_response"]) if e.tool_calls][:1]
        assert [c.arguments["content"] for c in response.tool_calls] == [f"key {MASK}"] * 3
    stored = _stored_text(store_url)
    for form in (secret, escaped, escaped[1:], escaped.replace("/", "\\/")):
        assert form[:8] not in stored and form[-8:] not in stored, form


@pytest.mark.parametrize("text", [
    "task-list-for-the-2024-release-candidate", "risk-0123456789abcdefghij", "desk-lamp sk-learn sk-2",
    "the bearer of bad news, Bearer short1", "sk-abcdefghijklmnopqrstuvwxyz (no digit)", "BEARER TOKEN",
    "an ordinary line\nwith words, numbers 12345678901234567890 and paths /tmp/sk-dir/x",
    "", "***",
])
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert scrub(text) is text
    data = {"a": [text, {"b": text}], "n": 3}
    assert scrub_data(data) is data


@pytest.mark.parametrize(("text", "masked"), [
    ("Incorrect API key provided: sk-proj-AbC123def456GHI789jkl0. See docs.", f"Incorrect API key provided: {MASK}. See docs."),
    ("key=sk-ant-api03-Zx9Yw8Vu7Ts6Rq5Po4", f"key={MASK}"),
    ("line\nsk-0123456789abcdefghijkl", f"line\n{MASK}"),
    ("proxy-sk-0123456789abcdefghijkl", f"proxy-{MASK}"),
    ("Authorization: Bearer eyJhbGciOi.J9eyJzdWIiOiIx.MjM0NTY3ODkw=", f"Authorization: Bearer {MASK}"),
    ('{"error": "bad token Bearer abcDEF123456ghiJKL"}', f'{{"error": "bad token Bearer {MASK}"}}'),
    # after an escape written out (a pattern's "\n", a JSON text's): no word boundary before the key there
    ("No lines match '\\nsk-proj-AbC1dEf2GhI3jKl4MnO5'.", f"No lines match '\\n{MASK}'."),
    ('{"h": "x\\nBearer eyJhbGciOi1JIUzI1NiJ9xyzWq"}', f'{{"h": "x\\nBearer {MASK}"}}'),
])
def test_key_shaped_text_is_masked(text: str, masked: str) -> None:
    assert scrub(text) == masked
    assert KEY_SHAPED.search(masked) is None


def test_a_secret_of_letters_alone_is_masked_where_it_is_a_word_and_nowhere_inside_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a weak password ("postgres") masked as any text would garble every "postgresql" the process keeps
    monkeypatch.setenv("APP_DB_PASSWORD", "postgres")
    monkeypatch.setenv("APP_DB_URL", "postgresql://app:postgres@db:5432/prod")
    text = ("connect to postgresql://app:postgres@db:5432/prod, or postgresql://other:postgres@h/x as user "
            "postgres; postgresql, postgres_exporter and apostgres stay")
    masked = (f"connect to {MASK}, or postgresql://other:{MASK}@h/x as user {MASK}; postgresql, postgres_exporter "
              "and apostgres stay")
    assert scrub(text) == masked
    with Workspace(tmp_path / "ws") as ws:
        job = ws.submit(text, piece="single", model="demo")
        assert ws.job(job.id).instruction == masked
    # a key with digits or marks is masked wherever it is, inside a longer word too
    monkeypatch.setenv("APP_DB_PASSWORD", "s3cret-pw")
    assert scrub("xs3cret-pwx") == f"x{MASK}x"
    # streamed: a whole word at the end is held back until the next character says whether it is one
    from agentnb._secrets import shown_so_far

    monkeypatch.setenv("APP_DB_PASSWORD", "postgres")
    assert shown_so_far("user postgres", json_text=False) == "user "
    assert shown_so_far("user postgres;", json_text=False) == f"user {MASK};"
    assert shown_so_far("use postgresql.", json_text=False) == "use postgresql."


def test_two_keys_masked_alike_in_a_mapping_are_one() -> None:
    keys = {"sk-" + "a1" * 12: 1, "sk-" + "b2" * 12: 2}
    assert scrub_data(keys) == {MASK: 2}


def test_a_key_given_in_code_is_masked_once_the_model_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    key = "in-code-" + os.urandom(8).hex()
    assert scrub(f"said {key}") == f"said {key}"  # nothing knows it yet
    OpenAIModel("m", base_url="http://127.0.0.1:9/v1", api_key=key)
    assert scrub(f"said {key}") == f"said {MASK}"
    assert key not in repr(OpenAIModel("m", api_key=key))


@pytest.mark.sqlite_only("writes a row into the SQLite file as a store made before the scrub could hold it")
def test_export_masks_keys_an_older_store_holds_without_the_key_in_its_environment(tmp_path: Path) -> None:
    folder = tmp_path / "ws"
    with Workspace(folder) as ws:
        job = ws.run(ws.submit("Say hello.", piece="single", model="demo"))
    # a row as a store written before the scrub may hold it, the key in the text the endpoint sent
    payload = json.dumps({"message": f"openai:m: HTTP 401: Incorrect API key provided: {SHAPED_KEY}", "where": "model"})
    with sqlite3.connect(folder / "agentnb.sqlite") as conn:
        conn.execute("UPDATE jobs SET error=? WHERE id=?", (f"HTTP 401: {SHAPED_KEY}", job.id))
        conn.execute("INSERT INTO events (job_id, movement_seq, iteration, ts, kind, payload) "
                     "VALUES (?, 1, 1, 2e9, 'error', ?)", (job.id, payload))
    conn.close()
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY" and not k.startswith("AGENTNB_STORE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    out = tmp_path / "old.ipynb"
    done = subprocess.run([sys.executable, "-m", "agentnb.cli", "--workspace", str(folder), "export", str(job.id),
                           str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = out.read_text(encoding="utf-8")
    assert SHAPED_KEY not in text and SHAPED_KEY[:16] not in text
    assert f"Incorrect API key provided: {MASK}" in text
