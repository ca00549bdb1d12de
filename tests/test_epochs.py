"""Epochs (docs/design-lab.md#epochs): a batch runs every case × variant k times, each run an ordinary job tagged
with its epoch; a ``scripted:`` model answers each epoch from its own ``by_epoch`` response; resumed, grown and
read per epoch, through ``ws.batch``, ``%agent batch --epochs`` and ``agentnb batch --epochs``, on SQLite and
PostgreSQL (``AGENTNB_TEST_BACKEND=postgres``; the migration test takes both backends itself)."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _batching import llm_events, tree_totals
from _scripting import call, transition, write_script
from IPython.core.error import UsageError as MagicUsageError

import agentnb
from agentnb import ModelRequest, ModelSpecError, ScriptedModel, UsageError, Workspace

CASES = [{"instruction": "Answer question one", "expected": "x"},
         {"instruction": "Answer question two", "expected": "y"}]


def _varying(folder: Path, name: str, answers: list[str], prompts: list[int]) -> str:
    """A scripted model for piece ``single`` whose first call writes output/answer.txt: ``answers[k]`` with
    ``prompts[k]`` prompt tokens in epoch k + 1 (in turn), then completes (10 + 1 tokens)."""
    writes = [{**call("Write", path="output/answer.txt", content=a), "usage": {"prompt_tokens": p, "completion_tokens": 5}}
              for a, p in zip(answers, prompts, strict=True)]
    done = {**transition("COMPLETE", summary="answered"), "usage": {"prompt_tokens": 10, "completion_tokens": 1}}
    return write_script(folder, name, {"work": [{"by_epoch": writes}, done]})


def _right(job: Any) -> bool:
    return (job.output / "answer.txt").read_text() == job.expected


def _positions(batch: Any) -> list[tuple[int, int, int]]:
    return [(j.case, j.variant, j.epoch) for j in batch.jobs]


def _nothing_stored(ws: Workspace) -> None:
    assert ws.batches() == [] and ws.store.jobs() == []


# -- running k times ---------------------------------------------------------------------------------------------------

def test_every_case_and_variant_runs_k_times_each_epoch_answered_tagged_scored_and_priced(ws: Workspace,
                                                                                          tmp_path: Path) -> None:
    varies = _varying(tmp_path, "varies", ["x", "y", "x"], [100, 200, 300])
    steady = _varying(tmp_path, "steady", ["x"], [50])
    b = ws.batch(CASES, piece="single", model=[varies, steady], epochs=3, name="ep", scorers={"right": _right},
                 concurrency=3, progress=False)
    assert b.epochs == 3 and b.counts()["jobs"] == 12 and b.counts()["succeeded"] == 12
    assert _positions(b) == [(c, v, e) for c in range(2) for v in range(2) for e in (1, 2, 3)]
    jobs = b.jobs
    assert [ws.store.job(j.id).batch_epoch for j in jobs] == [j.epoch for j in jobs]  # the stored column
    # created epoch by epoch: a worker taking the oldest queued job runs every epoch-1 job first
    ids = {e: [j.id for j in jobs if j.epoch == e] for e in (1, 2, 3)}
    assert max(ids[1]) < min(ids[2]) and max(ids[2]) < min(ids[3])
    # each job wrote its own epoch's answer: the varying model in turn, the steady one always the same
    for j in jobs:
        assert (j.output / "answer.txt").read_text() == (["x", "y", "x"][j.epoch - 1] if j.variant == 0 else "x")

    frame = b.frame
    assert str(frame["epoch"].dtype) == "Int64" and list(frame["epoch"]) == [1, 2, 3] * 4
    cols = list(frame.columns)
    assert cols.index("variant_label") + 1 == cols.index("epoch") < cols.index("piece")
    assert list(frame["right"]) == [True, False, True, True, True, True,    # case 0 expects x
                                    False, True, False, False, False, False]  # case 1 expects y
    for _, row in frame.iterrows():  # every epoch's tokens, from its own events
        assert row["total_tokens"] == tree_totals(ws, int(row["job"]))["total_tokens"]
    assert list(frame[frame["variant"] == 0]["prompt_tokens"]) == [110, 210, 310] * 2
    assert (frame["cost_usd"] == 0).all()

    # the summary: n counts every epoch, each mean is over every epoch of every case
    summary = b.summary()
    assert list(summary["n"]) == [6, 6] and list(summary["succeeded"]) == [6, 6]
    for v in (0, 1):
        rows = frame[frame["variant"] == v]
        got = summary.set_index("variant").loc[v]
        assert got["mean_right"] == pytest.approx(rows["right"].astype(float).mean())
        assert got["mean_tokens"] == pytest.approx(rows["total_tokens"].mean())
    assert summary.set_index("variant").loc[0, "mean_right"] == pytest.approx(3 / 6)
    assert summary.set_index("variant").loc[1, "mean_right"] == pytest.approx(3 / 6)
    text = b._repr_html_()
    assert "12 of 12 ended · 3 epochs · 12 succeeded" in text
    fig = agentnb.plot_batch(b)
    assert fig.get_suptitle().startswith("batch ep: 2 variants × 2 cases × 3 epochs")
    assert fig.axes[1].get_xlabel() == "total tokens per case and epoch"


def test_a_failed_job_is_named_by_its_case_and_epoch_in_the_batch_view(ws: Workspace, tmp_path: Path) -> None:
    # epoch 2 runs out of responses (its alternative writes, and nothing completes it): that job fails alone
    spec = write_script(tmp_path, "flaky", {"work": [
        {"by_epoch": [transition("COMPLETE", summary="fine"), call("Write", path="output/a.txt", content="a")]}]})
    b = ws.batch(CASES[:1], piece="single", model=spec, epochs=2, name="flaky", progress=False)
    assert [(j.epoch, j.status) for j in b.jobs] == [(1, "succeeded"), (2, "failed")]
    assert "case 0, epoch 2, single · scripted:flaky.yaml: failed" in b._repr_html_()


def test_a_subtask_answers_for_the_epoch_of_its_batch_job(ws: Workspace, tmp_path: Path) -> None:
    child = _varying(tmp_path, "child", ["first", "second"], [10, 20])
    parent = write_script(tmp_path, "parent", {
        "split": [transition("WAIT_SUBTASKS", summary="split", lessons="one part",
                             subtasks=[{"instruction": "Do the part", "piece": "single", "model": child}])],
        "merge": [transition("COMPLETE", summary="merged")],
        "check": [transition("COMPLETE", summary="checked")],
    })
    b = ws.batch(CASES[:1], piece="fan-out", model=parent, epochs=2, name="tree", progress=False)
    assert [j.status for j in b.jobs] == ["succeeded", "succeeded"]
    for j in b.jobs:
        [kid] = ws.children(j.id)
        assert kid.batch is None and kid.epoch is None  # not a batch job itself …
        assert (kid.workdir / "output" / "answer.txt").read_text() == ["first", "second"][j.epoch - 1]  # … its epoch
        assert ws.events(kid, kinds=["llm_response"])[0].payload["usage"]["prompt_tokens"] == [10, 20][j.epoch - 1]
    for _, row in b.frame.iterrows():  # the subtask's calls count into its batch job's row
        assert row["subtasks"] == 1 and row["prompt_tokens"] == tree_totals(ws, int(row["job"]))["prompt_tokens"]


def test_a_fork_of_a_batch_job_answers_for_its_epoch(ws: Workspace, tmp_path: Path) -> None:
    spec = _varying(tmp_path, "a", ["x", "y"], [100, 200])
    b = ws.batch(CASES[:1], piece="single", model=spec, epochs=2, name="f", progress=False)
    for job in b.jobs:  # a what-if of each run, live from its first movement: the same answer as the run it forks
        fork = ws.fork(job, at=1)
        assert fork.status == "succeeded" and fork.batch is None, fork.error
        assert (fork.output / "answer.txt").read_text() == (job.output / "answer.txt").read_text() == "xy"[job.epoch - 1]


# -- resuming and growing ----------------------------------------------------------------------------------------------

def test_resume_runs_only_the_jobs_missing_in_each_epoch(ws: Workspace, tmp_path: Path) -> None:
    spec = _varying(tmp_path, "a", ["x", "y"], [100, 200])
    b = ws.batch(CASES, piece="single", model=spec, epochs=2, name="r", run=False, progress=False)
    assert b.counts()["queued"] == 4
    by_position = {(j.case, j.epoch): j.id for j in b.jobs}
    # a run takes the batch epoch by epoch: both cases of epoch 1 first
    assert b.pending() == [by_position[0, 1], by_position[1, 1], by_position[0, 2], by_position[1, 2]]
    done = [by_position[0, 2], by_position[1, 1]]  # one job of each epoch ends before the batch is resumed
    for job_id in done:
        assert ws.run(job_id).status == "succeeded"
    calls = {j: len(ws.events(j, kinds=["llm_response"])) for j in done}
    resumed = ws.batch("r", progress=False)
    assert resumed.counts()["succeeded"] == 4 and resumed.pending() == []
    assert {j: len(ws.events(j, kinds=["llm_response"])) for j in done} == calls
    assert llm_events(ws) == 4 * 2  # every job made its two calls, once
    assert ws.batch("r", epochs=2, progress=False).counts()["succeeded"] == 4  # its own epochs again: nothing new


def test_more_epochs_add_the_missing_ones_fewer_remove_none_and_new_variants_get_every_epoch(
        ws: Workspace, tmp_path: Path) -> None:
    a = _varying(tmp_path, "a", ["x", "y"], [100, 200])
    first = ws.batch(CASES, piece="single", model=a, epochs=2, name="grow", progress=False)
    kept = {j.id for j in first.jobs}
    calls = llm_events(ws)
    grown = ws.batch(CASES, piece="single", model=a, epochs=4, name="grow", progress=False)
    assert grown.epochs == 4 and _positions(grown) == [(c, 0, e) for c in range(2) for e in (1, 2, 3, 4)]
    assert kept < {j.id for j in grown.jobs} and llm_events(ws) == calls + 2 * 2 * 2  # only epochs 3 and 4 ran
    assert [(j.output / "answer.txt").read_text() for j in grown.jobs] == ["x", "y", "x", "y"] * 2  # in turn

    # fewer epochs than the batch has: nothing removed, nothing added (as pieces or models left out)
    same = ws.batch(CASES, piece="single", model=a, epochs=1, name="grow", progress=False)
    assert same.epochs == 4 and len(same.jobs) == 8 and list(same.frame["epoch"]) == [1, 2, 3, 4] * 2
    assert ws.batch("grow", epochs=3, progress=False).epochs == 4
    # by name alone, more epochs are refused (their jobs need the cases' input files), and nothing is created
    with pytest.raises(UsageError, match=r"^batch 'grow' has 4 epoch\(s\); adding epochs needs its cases again .* "
                                         r"epochs 5$"):
        ws.batch("grow", epochs=5, progress=False)
    assert len(ws.store.jobs()) == 8 and ws.batch("grow", run=False).epochs == 4

    # a new model gets every epoch the batch has; new epochs and a new model at once: both
    b = _varying(tmp_path, "b", ["y"], [50])
    wider = ws.batch(CASES, model=[a, b], name="grow", progress=False)
    assert sorted(_positions(wider)) == sorted([(c, v, e) for c in range(2) for v in range(2) for e in range(1, 5)])
    c = _varying(tmp_path, "c", ["x"], [70])
    widest = ws.batch(CASES, model=[a, b, c], epochs=5, name="grow", progress=False)
    assert sorted(_positions(widest)) == sorted([(c_, v, e) for c_ in range(2) for v in range(3) for e in range(1, 6)])
    assert widest.counts()["succeeded"] == 30 and widest.epochs == 5
    assert list(widest.summary()["n"]) == [10, 10, 10]


def test_a_batch_made_before_epochs_reads_as_one_epoch_and_grows(ws: Workspace, tmp_path: Path) -> None:
    spec = _varying(tmp_path, "a", ["x", "y"], [100, 200])
    b = ws.batch(CASES, piece="single", model=spec, name="old", progress=False)
    with ws.store.transaction() as c:  # as a store written before epochs left it
        for row in ws.store.jobs(batch="old"):
            ws.store.update_job(c, row.id, batch_epoch=None)
        ws.store.update_batch(c, "old", options=json.dumps({"context": {}}))
    assert b.epochs == 1 and [j.epoch for j in b.jobs] == [1, 1] and list(b.frame["epoch"]) == [1, 1]
    grown = ws.batch(CASES, piece="single", model=spec, name="old", epochs=2, progress=False)
    assert _positions(grown) == [(0, 0, 1), (0, 0, 2), (1, 0, 1), (1, 0, 2)]
    assert [ws.store.job(j.id).batch_epoch for j in grown.jobs] == [None, 2, None, 2]
    assert grown.counts()["succeeded"] == 4 and list(grown.frame["epoch"]) == [1, 2, 1, 2]


# -- bad input ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("epochs", [0, -1, 1.5, "2", True])
def test_bad_epochs_are_one_line_and_nothing_is_created(ws: Workspace, epochs: Any) -> None:
    with pytest.raises(UsageError) as info:
        ws.batch(CASES, piece="single", model="demo", name="bad", epochs=epochs, progress=False)
    assert str(info.value) == (f"epochs={epochs!r}; allowed: a whole number ≥ 1 (how many times each case × variant "
                               "runs)")
    _nothing_stored(ws)


# -- the scripted model ------------------------------------------------------------------------------------------------

def test_a_scripted_by_epoch_item_answers_each_epoch_in_turn_and_is_checked_whole() -> None:
    script = {"responses": [{"by_epoch": [{"content": "one"}, {"content": "two"}]}, {"content": "always"}]}

    def answers(epoch: int | None) -> list[str | None]:
        model = ScriptedModel(script, epoch=epoch)
        return [model.complete(ModelRequest(messages=[], tools=[], call_index=i)).content for i in range(2)]

    assert answers(None) == answers(1) == ["one", "always"]  # outside a batch: epoch 1
    assert answers(2) == ["two", "always"] and answers(3) == ["one", "always"] and answers(4) == ["two", "always"]
    for bad, needle in [
        ({"by_epoch": []}, "<script>: responses[0]: by_epoch must be the response's only key, with a non-empty list"),
        ({"by_epoch": {"content": "x"}}, "responses[0]: by_epoch must be the response's only key"),
        ({"by_epoch": [{"content": "x"}], "content": "y"}, "responses[0]: by_epoch must be the response's only key"),
        ({"by_epoch": [{"content": "x"}, {"contents": "typo"}]}, "responses[0].by_epoch[1]: unknown key(s) ['contents']"),
    ]:
        with pytest.raises(ModelSpecError) as info:
            ScriptedModel({"responses": [bad]}, epoch=1)  # an alternative of another epoch is checked too
        assert needle in str(info.value) and "\n" not in str(info.value)


def test_a_job_outside_a_batch_plays_the_first_epoch(ws: Workspace, tmp_path: Path) -> None:
    job = ws.submit("Answer", piece="single", model=_varying(tmp_path, "a", ["x", "y"], [100, 200]))
    assert ws.run(job).status == "succeeded" and job.epoch is None
    assert (job.output / "answer.txt").read_text() == "x"


# -- the schema: a store made before epochs is migrated ------------------------------------------------------------------

def _old_store(url: str) -> None:
    """A store at the schema before epochs (SQLite 5 migrations, PostgreSQL 2) with one batch job in it."""
    from agentnb.store.migrations import MIGRATIONS
    from agentnb.store.pg_migrations import PG_MIGRATIONS

    cases = json.dumps([{"instruction": "old", "inputs": {}, "expected": None, "extra": {}}])
    variants = json.dumps([{"piece": "single", "piece_yaml": "name: single", "piece_source": None, "model": "demo"}])
    batch = ("INSERT INTO batches (name, created, updated, fingerprint, cases, variants, options) "
             "VALUES ('old', 1, 1, 'f', ?, ?, '{\"context\": {}}')")
    job = ("INSERT INTO jobs (piece, piece_yaml, model, instruction, status, workdir, created, updated, batch, "
           "batch_case, batch_variant) VALUES ('single', 'name: single', 'demo', 'old', 'succeeded', 'jobs/1', 1, 1, "
           "'old', 0, 0)")
    if url.startswith("sqlite:"):
        conn = sqlite3.connect(url[len("sqlite://"):])
        for script in MIGRATIONS[:5]:
            conn.executescript(script)
        conn.execute(batch, (cases, variants))
        conn.execute(job)
        conn.execute("PRAGMA user_version=5")
        conn.commit()
        conn.close()
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as pg:
        for script in PG_MIGRATIONS[:2]:
            pg.execute(script)
        pg.execute("CREATE TABLE agentnb_schema (version INTEGER NOT NULL)")
        pg.execute("INSERT INTO agentnb_schema (version) VALUES (2)")
        pg.execute(batch.replace("?", "%s"), (cases, variants))
        pg.execute(job)


def _batch_index(ws: Workspace, url: str) -> str:
    """The columns of the index ``jobs_batch``, in order."""
    if url.startswith("sqlite:"):
        return ",".join(r[2] for r in ws.store.query("PRAGMA index_info(jobs_batch)"))
    [row] = ws.store.query("SELECT indexdef FROM pg_indexes WHERE indexname = 'jobs_batch'")
    return str(row["indexdef"]).split("(", 1)[1].rstrip(")").replace(" ", "")


def test_a_store_made_before_epochs_is_migrated_its_batch_jobs_read_as_epoch_1(store_url: str, tmp_path: Path) -> None:
    _old_store(store_url)
    ws = Workspace(tmp_path / "ws", store=store_url)
    [row] = ws.store.jobs(batch="old")
    assert row.batch_epoch is None and row.epoch == 1 and row.to_dict()["batch_epoch"] is None
    assert _batch_index(ws, store_url) == "batch,batch_case,batch_variant,batch_epoch"
    b = ws.batch("old", run=False)
    assert b.epochs == 1 and list(b.frame["epoch"]) == [1] and [j.epoch for j in b.jobs] == [1]
    ws.store.close()


# -- the magic and the command -------------------------------------------------------------------------------------------

def test_magic_batch_epochs_runs_grows_and_refuses_in_one_line(shell: Any, tmp_path: Path) -> None:
    shell.user_ns["t_cases"] = CASES
    shell.user_ns["t_spec"] = _varying(tmp_path, "a", ["x", "y"], [100, 200])
    b = shell.run_line_magic("agent", "batch t_cases --piece single --model {t_spec} --epochs 2 --name me")
    assert b.epochs == 2 and b.counts()["succeeded"] == 4 and list(b.frame["epoch"]) == [1, 2, 1, 2]
    grown = shell.run_line_magic("agent", "batch t_cases --piece single --model {t_spec} -e 3 --name me")
    assert grown.epochs == 3 and _positions(grown) == [(c, 0, e) for c in range(2) for e in (1, 2, 3)]
    for line, needle in [
        ("batch me --epochs 4", "batch 'me' has 3 epoch(s); adding epochs needs its cases again"),
        ("batch t_cases --piece single --model demo --epochs 0 --name bad", "--epochs 0; allowed: a whole number ≥ 1"),
        ("batch t_cases --epochs two --name bad", "argument --epochs/-e: invalid int value: 'two'"),
    ]:
        with pytest.raises(MagicUsageError) as info:
            shell.run_line_magic("agent", line)
        text = str(info.value)
        assert text.startswith("%agent batch: ") and "\n" not in text and needle in text, text
    listed = shell.run_line_magic("agent", "batches")
    assert list(listed["name"]) == ["me"] and list(listed["jobs"]) == [6]


AGENTNB = shutil.which("agentnb")


def _agentnb(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert AGENTNB is not None
    # AGENTNB_STORE stays: under AGENTNB_TEST_BACKEND=postgres the command must use the test's database
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTNB_", "OPENAI_")) or k == "AGENTNB_STORE"}
    return subprocess.run([AGENTNB, "--workspace", "ws", *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.mark.skipif(AGENTNB is None, reason="the agentnb entry point is not installed")
def test_cli_batch_epochs_runs_grows_and_refuses_in_one_line(tmp_path: Path) -> None:
    spec = _varying(tmp_path, "a", ["x", "y"], [100, 200])
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(c) for c in CASES) + "\n", encoding="utf-8")
    argv = ["batch", "c.jsonl", "--piece", "single", "--model", spec, "--name", "ce", "--no-progress"]
    out = _agentnb(tmp_path, *argv, "--epochs", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "<Batch 'ce': 4/4 ended · 4 succeeded>"
    assert lines[1].split()[:3] == ["variant", "variant_label", "n"] and lines[2].split()[4] == "4"
    for bad, needle in [("0", "--epochs 0; allowed: a whole number ≥ 1"),
                        ("two", "argument --epochs: invalid int value: 'two'")]:
        refused = _agentnb(tmp_path, *argv, "--epochs", bad)
        assert refused.returncode == 2 and refused.stdout == ""
        [line] = refused.stderr.splitlines()
        assert line.startswith("agentnb: error: ") and needle in line
    again = _agentnb(tmp_path, *argv, "--epochs", "3")  # the same command with more epochs adds epoch 3
    assert again.returncode == 0 and again.stdout.startswith("<Batch 'ce': 6/6 ended · 6 succeeded>"), again.stderr
    ws = Workspace(tmp_path / "ws", readonly=True)
    b = ws.batch("ce", run=False)
    assert b.epochs == 3 and _positions(b) == [(c, 0, e) for c in range(2) for e in (1, 2, 3)]
    assert llm_events(ws) == 6 * 2  # epochs 1 and 2 were not run again
