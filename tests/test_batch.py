"""Batches (docs/design-lab.md): cases × variants as ordinary jobs, resumed by name, refused whole on bad input,
and their results (``batch.frame``, ``summary()``, the HTML view, ``plot_batch``) checked against the events."""

from __future__ import annotations

import dataclasses
import hashlib
import html
import itertools
import json
import math
import re
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from _batching import answering_model, asking_model, draft_review, llm_events, tree, tree_totals
from _scripting import call, transition, write_script
from openai_server import OpenAIServer, reply

import agentnb
from agentnb import AgentnbError, Workspace
from agentnb.batch import Batch
from agentnb.engine.pieces import parse_piece
from agentnb.events import JobStatusEvent
from agentnb.models.prices import UnknownPriceWarning, call_cost
from agentnb.store import reads
from agentnb.store.base import JOB_STATES
from agentnb.store.records import BatchCase, BatchRecord, BatchVariant


def _cases(n: int = 3) -> list[dict[str, Any]]:
    return [{"instruction": f"Answer question {i}", "expected": str(40 + i), "topic": f"t{i}", "weight": i * 0.5}
            for i in range(n)]


def _answer_ok(job: Any) -> bool:
    path = job.output / "answer.txt"
    return path.is_file() and path.read_text() == job.expected


# -- cases and variants ----------------------------------------------------------------------------------------------

def test_list_of_dicts_times_pieces_times_models_each_job_tagged(ws: Workspace, tmp_path: Path) -> None:
    m1, m2 = answering_model(tmp_path, "m1", "41"), answering_model(tmp_path, "m2", "42", prompt=300)
    b = ws.batch(_cases(), piece=["single", draft_review(tmp_path)], model=[m1, m2], name="exp-1",
                 concurrency=3, progress=False)
    assert isinstance(b, Batch) and b.name == "exp-1"
    assert [(v["piece"], v["model"]) for v in b.variants] == [
        ("single", m1), ("single", m2), ("draft-review", m1), ("draft-review", m2)]
    jobs = b.jobs
    assert len(jobs) == 12 and len(set(j.id for j in jobs)) == 12
    assert [(j.case, j.variant) for j in jobs] == [(c, v) for c in range(3) for v in range(4)]
    for j in jobs:
        assert j.batch == "exp-1"
        assert j.status == "succeeded", j.error
        assert j.instruction == f"Answer question {j.case}"
        assert (j.piece, j.model) == (b.variants[j.variant]["piece"], b.variants[j.variant]["model"])
        # an ordinary job: viewable by id like any other
        assert ws.job(j.id).batch == "exp-1" and ws.job(j.id).case == j.case
    assert b.counts()["succeeded"] == 12 and b.counts()["jobs"] == 12
    frame = b.frame
    assert len(frame) == 12
    assert list(frame["case"]) == [c for c in range(3) for _ in range(4)]
    assert list(frame["piece"]) == ["single", "single", "draft-review", "draft-review"] * 3
    assert list(frame["model"]) == [m1, m2, m1, m2] * 3
    assert list(frame["job"]) == [j.id for j in jobs]
    # the case's own columns and expected are carried through
    assert list(frame["topic"]) == [f"t{c}" for c in range(3) for _ in range(4)]
    assert list(frame["weight"]) == [c * 0.5 for c in range(3) for _ in range(4)]
    assert list(frame["expected"]) == [str(40 + c) for c in range(3) for _ in range(4)]
    assert list(frame["instruction"]) == [f"Answer question {c}" for c in range(3) for _ in range(4)]
    # the batch is listed with its counts
    listed = ws.batches()
    assert [r["name"] for r in listed] == ["exp-1"]
    assert listed[0]["jobs"] == 12 and listed[0]["n_succeeded"] == 12


def test_dataframe_cases_with_inputs_as_text_bytes_and_a_folder(ws: Workspace, tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.md").write_text("alpha")
    (folder / "sub" / "b.bin").write_bytes(b"\x00\x01")
    cases = pd.DataFrame([
        {"instruction": "Summarise", "inputs": {"notes.md": "# notes", "raw.bin": b"\xff\xfe"}, "expected": 1},
        {"instruction": "Summarise the folder", "inputs": str(folder), "expected": np.nan},
        {"instruction": "Nothing to read", "inputs": None, "expected": 3},
    ])
    b = ws.batch(cases, piece="single", model=answering_model(tmp_path, "m", "x"), name="df", progress=False)
    one, two, three = b.jobs
    assert (one.workdir / "input" / "notes.md").read_text() == "# notes"
    assert (one.workdir / "input" / "raw.bin").read_bytes() == b"\xff\xfe"
    assert (two.workdir / "input" / "a.md").read_text() == "alpha"
    assert (two.workdir / "input" / "sub" / "b.bin").read_bytes() == b"\x00\x01"
    assert list((three.workdir / "input").iterdir()) == []
    # a DataFrame's NaN is a missing value (None), numbers stay numbers
    assert [one.expected, two.expected, three.expected] == [1, None, 3]
    assert list(b.frame["expected"]) == [1, None, 3]
    assert b.cases[0]["inputs"]["raw.bin"]["bytes"] == 2


# -- the batch record (docs/python-api.md#records) ------------------------------------------------------------------

def test_a_stored_batch_reads_back_as_a_frozen_record_with_typed_cases_and_variants(ws: Workspace) -> None:
    cases = [{"instruction": "Answer ä", "inputs": {"a.txt": "hello"}, "expected": {"n": [1, 2]}, "topic": "t0"},
             {"instruction": "Answer b", "topic": "t1"}]
    b = ws.batch(cases, piece="single", model="demo", name="rec", run=False, progress=False)
    rec = reads.batch(ws.store, "rec")
    assert isinstance(rec, BatchRecord) and rec.name == "rec" and isinstance(rec.created, float)
    digest = {"bytes": 5, "sha256": hashlib.sha256(b"hello").hexdigest()}
    assert rec.cases == (BatchCase(instruction="Answer ä", inputs={"a.txt": digest}, expected={"n": [1, 2]},
                                   extra={"topic": "t0"}),
                         BatchCase(instruction="Answer b", inputs={}, expected=None, extra={"topic": "t1"}))
    [variant] = rec.variants
    assert isinstance(variant, BatchVariant) and (variant.piece, variant.model) == ("single", "demo")
    assert parse_piece(variant.piece_yaml).name == "single"
    assert rec.jobs is None and rec.counts is None  # counted only in a listing
    # frozen, with slots: neither the record nor a case can be changed or given a new attribute
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.name = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.cases[0].instruction = "other"  # type: ignore[misc]
    assert not hasattr(rec, "__dict__") and not hasattr(rec.cases[0], "__dict__")
    # to_dict() is the row as the store gave it before records (SELECT *: JSON columns as text)
    columns, rows = ws.store.rows("SELECT * FROM batches WHERE name = ?", ("rec",))
    old = dict(zip(columns, rows[0], strict=True))
    assert rec.to_dict() == old and list(rec.to_dict()) == list(old)
    # the typed cases and variants are what the columns hold, and what Batch.cases/.variants give users
    assert [c.to_dict() for c in rec.cases] == json.loads(old["cases"]) == b.cases
    assert [v.to_dict() for v in rec.variants] == json.loads(old["variants"]) == b.variants
    # a case's dict is a copy: changing it changes neither the record nor the store
    mine = rec.cases[0].to_dict()
    mine["expected"]["n"].append(3)
    mine["extra"]["topic"] = "changed"
    assert rec.cases[0].expected == {"n": [1, 2]} and rec.cases[0].extra == {"topic": "t0"}
    assert reads.batch(ws.store, "rec") == rec and reads.batch(ws.store, "nothing") is None


def test_listed_batches_carry_their_job_counts_and_give_the_old_rows(ws: Workspace, tmp_path: Path) -> None:
    model = answering_model(tmp_path, "m", "40")
    ws.batch(_cases(2), piece="single", model=model, name="waits", run=False, progress=False)
    ws.batch(_cases(1), piece="single", model=[model, "demo"], name="ran", progress=False)
    listed = reads.batches(ws.store)
    assert [r.name for r in listed] == ["waits", "ran"]  # oldest first
    assert listed[0].jobs == 2 and listed[0].counts == {**dict.fromkeys(JOB_STATES, 0), "queued": 2}
    assert listed[1].jobs == 2 and listed[1].counts is not None and listed[1].counts["queued"] == 0
    assert sum(listed[1].counts.values()) == 2
    for r in listed:
        # the old listing row: the batch's columns, then jobs and n_<status> for every status
        columns, rows = ws.store.rows("SELECT * FROM batches WHERE name = ?", (r.name,))
        jobs = ws.store.jobs(batch=r.name)
        old = {**dict(zip(columns, rows[0], strict=True)), "jobs": len(jobs),
               **{f"n_{s}": sum(j.status == s for j in jobs) for s in JOB_STATES}}
        assert r.to_dict() == old and list(r.to_dict()) == list(old)
        # the same record as read by name, apart from the counts
        assert dataclasses.replace(r, jobs=None, counts=None) == reads.batch(ws.store, r.name)
    # what users get from ws.batches() keeps its shape: plain dicts without the JSON columns and fingerprint
    assert ws.batches() == [{k: v for k, v in r.to_dict().items()
                             if k not in ("cases", "variants", "options", "fingerprint")} for r in listed]
    assert all(type(row) is dict for row in ws.batches())


# -- resuming ----------------------------------------------------------------------------------------------------------

def test_resume_by_name_and_by_the_same_call_runs_nothing_twice(ws: Workspace, tmp_path: Path) -> None:
    model = answering_model(tmp_path, "m", "40")
    b = ws.batch(_cases(), piece="single", model=model, name="r", run=False, progress=False)
    assert b.counts()["queued"] == 3 and llm_events(ws) == 0
    first = b.jobs[0]
    ws.run(first)  # one job ran before (as after an interrupted run)
    done_calls = len(ws.events(first, kinds=["llm_response"]))
    assert done_calls == 2 and b.pending() == [j.id for j in b.jobs[1:]]

    resumed = ws.batch("r", progress=False)
    assert resumed.counts()["succeeded"] == 3
    assert len(ws.events(first, kinds=["llm_response"])) == done_calls  # the finished job was kept
    assert llm_events(ws) == 3 * done_calls
    assert ws.batch(name="r", progress=False).counts()["succeeded"] == 3
    ws.batch(_cases(), piece="single", model=model, name="r", progress=False)  # the same call again
    assert llm_events(ws) == 3 * done_calls
    assert len(ws.store.jobs()) == 3 and [r["name"] for r in ws.batches()] == ["r"]


def test_a_new_variant_is_added_to_an_existing_batch(ws: Workspace, tmp_path: Path) -> None:
    model = answering_model(tmp_path, "m", "40")
    b = ws.batch(_cases(2), piece="single", model=model, name="grow", progress=False)
    before = {j.id: len(j.events) for j in b.jobs}
    grown = ws.batch(_cases(2), piece=["single", draft_review(tmp_path)], model=model, name="grow", progress=False)
    assert [v["piece"] for v in grown.variants] == ["single", "draft-review"]
    jobs = grown.jobs
    assert len(jobs) == 4 and all(j.status == "succeeded" for j in jobs)
    assert [(j.case, j.variant) for j in jobs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {j.id: len(j.events) for j in jobs if j.id in before} == before  # the old jobs did not run again
    assert list(grown.frame["piece"]) == ["single", "draft-review"] * 2


def test_jobs_waiting_for_a_human_stay_waiting_and_do_not_block(ws: Workspace, tmp_path: Path) -> None:
    b = ws.batch(_cases(3), piece="single", model=[asking_model(tmp_path), answering_model(tmp_path, "m", "41")],
                 name="ask", concurrency=1, progress=False)
    frame = b.frame
    assert list(frame["status"]) == ["waiting_human", "succeeded"] * 3
    counts = b.counts()
    assert counts["waiting_human"] == 3 and counts["succeeded"] == 3
    summary = b.summary()
    assert list(summary["waiting"]) == [3, 0] and list(summary["succeeded"]) == [0, 3]
    assert b.pending() == []  # a resume leaves them waiting
    calls = llm_events(ws)
    assert ws.batch("ask", progress=False).counts()["waiting_human"] == 3
    assert llm_events(ws) == calls
    assert "3 waiting" in repr(b) and "3 waiting" in b._repr_html_()
    # each waiting job with its question, the reply that answers it and the command that resumes the batch
    page = b._repr_html_()
    assert "jobs waiting for your reply: reply to each, then <code>%agent batch ask</code>" in page
    asking = [j.id for j in b.jobs if j.status == "waiting_human"]
    for job_id in asking:
        assert f"<code>%agent reply {job_id} YOUR ANSWER</code>" in page
    assert page.count("asks: Which language?") == 3
    # waiting is not running: the time stops when the job waits
    again = b.frame
    waiting = frame["status"] == "waiting_human"
    assert list(again.loc[waiting, "seconds"]) == list(frame.loc[waiting, "seconds"])


# -- bad input: one line, nothing stored --------------------------------------------------------------------------

def _nothing_stored(ws: Workspace) -> None:
    assert ws.batches() == []
    assert ws.store.jobs() == []
    jobs = ws.root / "jobs"
    assert not jobs.exists() or list(jobs.iterdir()) == []


@pytest.mark.parametrize(("change", "message"), [
    (lambda c, t: {"cases": [*c, {"expected": "1"}]}, r"case 3 needs an 'instruction'"),
    (lambda c, t: {"cases": [*c, {"instruction": "x", "inputs": str(t / "missing")}]},
     r"case 3 inputs: .*missing' is not an existing folder"),
    (lambda c, t: {"cases": [*c, {"instruction": "x", "inputs": str(_a_file(t))}]},
     r"case 3 inputs: .*a\.txt' is a file, not a folder; allowed: a dict of file name"),
    (lambda c, t: {"cases": [*c, {"instruction": "x", "expected": np.array([object()])}]},
     r"case 3 expected\[0\] is a object; allowed: JSON values"),
    (lambda c, t: {"cases": [*c, {"instruction": "x", "inputs": {"a.md": 5}}]},
     r"case 3 inputs\['a.md'\] is a int; allowed: text, bytes or a pathlib.Path"),
    (lambda c, t: {"cases": [*c, {"instruction": "x", "inputs": {"../a.md": "x"}}]},
     r"case 3: input name '../a.md' must be a relative path inside input/"),
    (lambda c, t: {"piece": ["single", "no-such-piece"]}, r"no-such-piece"),
    (lambda c, t: {"model": ["demo", "bogus:thing"]}, r"bogus"),
    (lambda c, t: {"concurrency": 0}, r"concurrency=0; allowed: a whole number ≥ 1"),
    (lambda c, t: {"epochs": 0}, r"^epochs=0; allowed: a whole number ≥ 1"),
    (lambda c, t: {"cases": [*c, {"instruction": "x", "epoch": 2}]}, r"case 3 has column\(s\) 'epoch'"),
    (lambda c, t: {"scorers": {"ok": "yes"}}, r"scorer 'ok' is a str, which is not callable"),
    (lambda c, t: {"cases": [*c, {"instruction": "x", "expected": object()}]},
     r"case 3 expected is a object; allowed: JSON values"),
    (lambda c, t: {"cases": [*c, {"instruction": "x", "when": {1, 2}}]}, r"case 3 column 'when' is a set"),
    (lambda c, t: {"cases": [*c, {"instruction": "x", "job": 3}]}, r"case 3 has column\(s\) 'job'"),
    (lambda c, t: {"scorers": {"status": bool}}, r"scorer name 'status' is a column"),
    (lambda c, t: {"scorers": {"topic": bool}}, r"scorer name\(s\) 'topic' clash with the cases' own columns"),
    (lambda c, t: {"cases": []}, r"cases is empty"),
    (lambda c, t: {"cases": "Answer"}, r"no batch 'Answer'"),
])
def test_bad_input_is_one_line_and_leaves_nothing(ws: Workspace, tmp_path: Path, change: Any, message: str) -> None:
    args: dict[str, Any] = {"cases": _cases(), "piece": "single", "model": "demo", "name": "bad", "progress": False}
    args.update(change(args["cases"], tmp_path))
    cases = args.pop("cases")
    if isinstance(cases, str):
        args.pop("name")
    with pytest.raises(AgentnbError) as info:
        ws.batch(cases, **args)
    text = str(info.value)
    assert "\n" not in text and re.search(message, text), text
    _nothing_stored(ws)


def test_a_batch_of_dicts_resumes_from_the_same_cases_as_a_dataframe(ws: Workspace, tmp_path: Path) -> None:
    # pd.DataFrame(cases) fills a column a case lacks with NaN: the same cases, resumed, nothing run again
    cases = [{"instruction": "Answer question 0", "topic": "x", "n": 1}, {"instruction": "Answer question 1"}]
    b = ws.batch(cases, piece="single", model=answering_model(tmp_path, "m", "41"), name="gaps", progress=False)
    assert b.counts()["succeeded"] == 2
    calls = llm_events(ws)
    again = ws.batch(pd.DataFrame(cases), name="gaps", progress=False)
    assert llm_events(ws) == calls and len(ws.store.jobs()) == 2 and again.counts()["succeeded"] == 2
    other = pd.DataFrame(cases).assign(topic=["x", "y"])
    with pytest.raises(AgentnbError, match=r"^batch 'gaps' already exists with different cases \(case 1 differs in "
                                           r"column 'topic'\); give another batch name, or its own cases"):
        ws.batch(other, name="gaps", progress=False)


def test_resuming_by_name_refuses_new_pieces_or_models_and_no_name_no_cases_says_what_is_needed(
        ws: Workspace, tmp_path: Path) -> None:
    model = answering_model(tmp_path, "m", "41")
    with pytest.raises(AgentnbError, match=r"^ws\.batch needs cases \(a list of dicts or a DataFrame\) or the name "
                                           r"of a batch to resume \(batches: none yet\)$"):
        ws.batch(progress=False)
    _nothing_stored(ws)
    ws.batch(_cases(2), piece="single", model=model, name="kept", progress=False)
    jobs = ws.store.jobs()
    # ws.batch(name) has no cases to make new variants' jobs from: said, not silently ignored
    with pytest.raises(AgentnbError, match=r"^ws\.batch\('kept'\) resumes the batch as it is, without piece=; to "
                                           r"add pieces or models, give its cases again: ws\.batch\(cases, "):
        ws.batch("kept", piece="plan-implement-verify", progress=False)
    with pytest.raises(AgentnbError, match=r"without piece= and model="):
        ws.batch(name="kept", piece="ask-first", model="demo", progress=False)
    assert ws.store.jobs() == jobs and len(Batch(ws, "kept").variants) == 1
    grown = ws.batch(_cases(2), piece="plan-implement-verify", model=model, name="kept", progress=False)
    assert len(grown.variants) == 2 and len(grown.jobs) == 4


def _a_file(folder: Path) -> Path:
    path = folder / "a.txt"
    path.write_text("a file, not a folder")
    return path


def test_numpy_arrays_in_the_cases_are_kept_as_lists(ws: Workspace, tmp_path: Path) -> None:
    # a list column read from parquet (or built with numpy) holds arrays: they are JSON lists, not an error
    cases = pd.DataFrame({"instruction": ["Answer question 0", "Answer question 1"],
                          "expected": [np.array(["41", "42"]), np.array([], dtype=object)],
                          "weights": [np.array([0.5, 1.0]), np.array([2])]})
    b = ws.batch(cases, piece="single", model=answering_model(tmp_path, "m", "41"), name="arrays",
                 scorers={"hit": lambda job: (job.output / "answer.txt").read_text() in job.expected},
                 progress=False)
    frame = b.frame
    assert list(frame["expected"]) == [["41", "42"], []]
    assert list(frame["weights"]) == [[0.5, 1.0], [2]]
    assert list(frame["hit"]) == [True, False]
    assert [j.expected for j in b.jobs] == [["41", "42"], []]
    assert ws.batch(cases, name="arrays", progress=False).counts()["succeeded"] == 2  # the same cases: resumed


def test_same_name_with_other_cases_is_refused_and_changes_nothing(ws: Workspace, tmp_path: Path) -> None:
    ws.batch(_cases(2), piece="single", model="demo", name="same", run=False, progress=False)
    jobs, folders = ws.store.jobs(), sorted((ws.root / "jobs").iterdir())
    other = _cases(2)
    other[1]["expected"] = "different"
    with pytest.raises(AgentnbError, match=r"^batch 'same' already exists with different cases \(case 1 differs "
                                           r"in expected\); give another batch name, or its own cases"):
        ws.batch(other, piece=["single", "ask-first"], model="demo", name="same", progress=False)
    with pytest.raises(AgentnbError, match=r"it has 2 cases, these are 3"):
        ws.batch(_cases(3), piece="single", model="demo", name="same", progress=False)
    assert ws.store.jobs() == jobs and sorted((ws.root / "jobs").iterdir()) == folders
    assert len(Batch(ws, "same").variants) == 1


# -- results: the frame against the events ----------------------------------------------------------------------------

def _running_seconds(ws: Workspace, job_id: int) -> float:
    """Running time from the job_status events, the plain way (the job has ended: no open interval)."""
    statuses = [e for e in ws.events(job_id, kinds=["job_status"]) if isinstance(e, JobStatusEvent)]
    return sum(b.ts - a.ts for a, b in itertools.pairwise(statuses) if a.status == "running")


def test_frame_totals_equal_the_sums_over_the_events(ws: Workspace, tmp_path: Path) -> None:
    b = ws.batch(_cases(), piece=["single", draft_review(tmp_path)],
                 model=[answering_model(tmp_path, "m1", "41"), answering_model(tmp_path, "m2", "42", 250, 30)],
                 name="sums", progress=False)
    frame = b.frame
    assert frame.dtypes.to_dict() == {
        "case": "Int64", "instruction": "string", "topic": "string", "weight": "Float64", "expected": object,
        "variant": "Int64", "variant_label": "string", "epoch": "Int64", "piece": "string", "model": "string", "job": "Int64",
        "status": "string", "subtasks": "Int64", "movements": "Int64", "llm_calls": "Int64", "prompt_tokens": "Int64",
        "completion_tokens": "Int64", "total_tokens": "Int64", "cost_usd": "Float64", "judge_cost_usd": "Float64",
        "seconds": "Float64"}
    for _, row in frame.iterrows():
        expected = tree_totals(ws, int(row["job"]))
        assert {k: int(row[k]) for k in expected} == expected
        assert row["subtasks"] == 0
        assert row["cost_usd"] == 0.0  # scripted models are free
        assert row["seconds"] == pytest.approx(_running_seconds(ws, int(row["job"])))
        assert row["seconds"] > 0
    assert set(frame.loc[frame["piece"] == "draft-review", "movements"]) == {2}
    assert set(frame.loc[frame["piece"] == "single", "llm_calls"]) == {2}


def test_a_jobs_subtasks_count_into_its_row(ws: Workspace, tmp_path: Path) -> None:
    kid = answering_model(tmp_path, "kid", "part", prompt=500, completion=50)
    parent = write_script(tmp_path, "parent", {
        "split": [transition("WAIT_SUBTASKS", summary="split", subtasks=[
            {"instruction": "part one", "piece": "single", "model": kid},
            {"instruction": "part two", "piece": "single", "model": kid}])],
        "merge": [call("Glob", pattern="**"), transition("COMPLETE", summary="merged")],
    })
    b = ws.batch(_cases(2), piece="fan-out", model=parent, name="fan", progress=False)
    frame = b.frame
    assert list(frame["status"]) == ["succeeded", "succeeded"]
    assert list(frame["subtasks"]) == [2, 2]
    for _, row in frame.iterrows():
        ids = tree(ws, int(row["job"]))
        assert len(ids) == 3
        expected = tree_totals(ws, int(row["job"]))
        assert {k: int(row[k]) for k in expected} == expected
        own = len(ws.events(int(row["job"]), kinds=["llm_response"]))
        assert row["llm_calls"] == own + 4  # the children's two calls each are counted
        assert row["seconds"] == pytest.approx(sum(_running_seconds(ws, j) for j in ids))


@pytest.fixture
def priced_server(loopback: Callable[..., OpenAIServer]) -> OpenAIServer:
    return loopback("sk-test-batch", retries="2")


def _complete(prompt: int, completion: int) -> dict[str, Any]:
    return reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "done"})], usage=(prompt, completion))


def test_cost_of_priced_and_unpriced_models_over_the_loopback_endpoint(ws: Workspace, priced_server: Any) -> None:
    unknown = "openai:agentnb-test-unpriced-model-7"
    priced_server.play(*[_complete(1000 + 10 * i, 200) for i in range(4)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = ws.batch(_cases(2), piece="single", model=["openai:gpt-4o-mini", unknown], name="paid",
                     concurrency=1, progress=False)
        frame = b.frame  # the warning comes with the first pricing of the unknown model, wherever that is
    assert list(frame["status"]) == ["succeeded"] * 4
    assert any(issubclass(w.category, UnknownPriceWarning) and "agentnb-test-unpriced-model-7" in str(w.message)
               for w in caught)
    priced = frame[frame["model"] == "openai:gpt-4o-mini"]
    for _, row in priced.iterrows():
        want = sum(call_cost("openai:gpt-4o-mini", e.payload["usage"]["prompt_tokens"],
                             e.payload["usage"]["completion_tokens"], e.ts)
                   for e in ws.events(int(row["job"]), kinds=["llm_response"]))
        assert row["cost_usd"] == pytest.approx(want) and want > 0
    assert frame.loc[frame["model"] == unknown, "cost_usd"].isna().all()
    summary = b.summary()
    assert summary.loc[0, "cost_usd"] == pytest.approx(priced["cost_usd"].sum())
    assert summary.loc[0, "mean_cost_usd"] == pytest.approx(priced["cost_usd"].mean())
    assert summary["cost_usd"].isna().tolist() == [False, True]
    fig = agentnb.plot_batch(b)  # the points stand on the cost axis only when every cost is known
    assert "tokens" in fig.axes[0].get_xlabel()


# -- the summary's arithmetic ---------------------------------------------------------------------------------------

def test_summary_arithmetic(ws: Workspace, tmp_path: Path) -> None:
    broken = write_script(tmp_path, "broken", {"work": [call("Glob", pattern="*")]})  # runs out of responses: fails
    b = ws.batch(_cases(4), piece="single",
                 model=[answering_model(tmp_path, "m1", "41"), answering_model(tmp_path, "m2", "42", 90, 7), broken],
                 name="sum", progress=False, scorers={"ok": _answer_ok, "length": lambda j: len(j.summary or "")})
    frame, summary = b.frame, b.summary()
    ci = ("_se", "_ci_low", "_ci_high")  # each mean's interval (tests/test_batch_stats.py checks them)
    assert list(summary.columns) == [
        "variant", "variant_label", "n", "succeeded", "failed", "aborted", "waiting", "unfinished",
        *[f"{m}{s}" for m in ("mean_ok", "mean_length", "mean_tokens") for s in ("", *ci)], "median_tokens",
        "cost_usd", *[f"mean_cost_usd{s}" for s in ("", *ci)], "judge_cost_usd",
        *[f"mean_seconds{s}" for s in ("", *ci)], "p50_seconds", "p95_seconds", "piece", "model"]
    assert summary["n"].dtype == "Int64" and summary["mean_tokens"].dtype == "Float64"
    assert list(summary["failed"]) == [0, 0, 4] and list(summary["succeeded"]) == [4, 4, 0]
    for v, row in summary.iterrows():
        rows = frame[frame["variant"] == v]
        tokens = rows["total_tokens"].astype(float).to_numpy()
        seconds = rows["seconds"].astype(float).to_numpy()  # every job ended
        assert row["n"] == 4 and row["piece"] == "single" and row["model"] == b.variants[v]["model"]
        assert row["mean_tokens"] == pytest.approx(tokens.mean())
        assert row["median_tokens"] == pytest.approx(np.median(tokens))
        assert row["cost_usd"] == 0.0 and row["mean_cost_usd"] == 0.0 and row["judge_cost_usd"] == 0.0
        assert row["mean_seconds"] == pytest.approx(seconds.mean())
        assert row["p50_seconds"] == pytest.approx(np.percentile(seconds, 50))
        assert row["p95_seconds"] == pytest.approx(np.percentile(seconds, 95))
        oks = [bool(x) for x in rows["ok"]]
        assert row["mean_ok"] == pytest.approx(sum(oks) / len(oks))
        assert row["mean_length"] == pytest.approx(rows["length"].astype(float).mean())
    # case i expects "4i": only case 1 of m1 (41) and case 2 of m2 (42) are right; the failed jobs are scored False
    assert list(summary["mean_ok"]) == [0.25, 0.25, 0.0]


# -- the HTML view -------------------------------------------------------------------------------------------------

def test_html_progress_summary_and_failed_jobs_escaped(ws: Workspace, tmp_path: Path) -> None:
    broken = write_script(tmp_path, "broken", {"work": [call("Glob", pattern="*")]})
    b = ws.batch(_cases(2), piece="single", model=[answering_model(tmp_path, "m", "41"), broken],
                 name="<exp> & co", progress=False)
    page = b._repr_html_()
    assert "batch &lt;exp&gt; &amp; co: 4 of 4 ended · 2 succeeded, 2 failed · " in page
    tokens = int(b.frame["total_tokens"].sum())
    assert f"{tokens:,} tokens · $0.0000" in page
    assert "<exp>" not in page
    failed = [j.id for j in b.jobs if j.status == "failed"]
    # as the waiting jobs are: each with why it stopped, then the commands that go on from there
    assert (f"failed or aborted jobs: {failed[0]}, {failed[1]} — <code>%agent retry JOB</code> queues one again "
            "from its last complete call, then <code>%agent batch &lt;exp&gt; &amp; co</code> resumes the batch") in page
    for job_id in failed:
        error = " ".join(str(ws.job(job_id).error).split())
        assert error and f"<code>%agent show {job_id}</code> — " in page
        assert html.escape(f": failed: {error[:160]}", quote=True) in page
    assert page.count("%agent show") == 2
    assert "<table class='agentnb-batch-summary'" in page and "tokens<br>/job" in page
    # the failed jobs are named by their variant's short label, not the script's full path
    assert f"single · scripted:{Path(broken.split(':', 1)[1]).name}: failed" in page
    # what the line says works: retried, the failed jobs run again when the batch is resumed
    for job_id in failed:
        ws.retry(job_id)
    again = ws.batch("<exp> & co", progress=False)
    assert sorted(again.last_run.statuses) == failed


def _table(page: str) -> tuple[list[str], list[list[tuple[str, str | None]]]]:
    """The summary table of a batch's HTML: its header texts, and each row's cells as (text, title)."""
    from html.parser import HTMLParser

    class Table(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.heads: list[str] = []
            self.rows: list[list[tuple[str, str | None]]] = []
            self.cell: list[str] | None = None
            self.title: str | None = None
            self.inside = False

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            if tag == "table" and ("class", "agentnb-batch-summary") in attrs:
                self.inside = True
            elif self.inside and tag == "tr":
                self.rows.append([])
            elif self.inside and tag in ("th", "td"):
                self.cell, self.title = [], dict(attrs).get("title")

        def handle_endtag(self, tag: str) -> None:
            if tag == "table":
                self.inside = False
            elif self.inside and tag in ("th", "td") and self.cell is not None:
                text = "".join(self.cell)
                if tag == "th":
                    self.heads.append(text)
                else:
                    self.rows[-1].append((text, self.title))
                self.cell = None

        def handle_data(self, data: str) -> None:
            if self.cell is not None:
                self.cell.append(data)

    parser = Table()
    parser.feed(page)
    return parser.heads, [r for r in parser.rows if r]


def test_variants_are_named_by_short_unique_labels_and_the_full_spec_is_kept(ws: Workspace, tmp_path: Path) -> None:
    deep = tmp_path / "clients" / "acme-corporation" / "experiments" / "release-notes-evaluation"
    (deep / "other").mkdir(parents=True)
    m1, m2 = answering_model(deep, "draft-script", "41"), answering_model(deep, "summary", "42", prompt=300)
    twin = answering_model(deep / "other", "draft-script", "40")  # the same file name as m1, another folder
    b = ws.batch(_cases(2), piece=["single", draft_review(tmp_path)], model=[m1, m2, twin], name="labels",
                 progress=False, scorers={"ok": _answer_ok, "grade": lambda j: 0.5 + j.case, "has_answer":
                                          lambda j: (j.output / "answer.txt").is_file(), "long_name_score": lambda j: len(j.summary or "")})
    want = ["single · scripted:release-notes-evaluation/draft-script.yaml", "single · scripted:summary.yaml",
            "single · scripted:other/draft-script.yaml",
            "draft-review · scripted:release-notes-evaluation/draft-script.yaml",
            "draft-review · scripted:summary.yaml", "draft-review · scripted:other/draft-script.yaml"]
    frame, summary = b.frame, b.summary()
    assert list(frame["variant_label"]) == want * 2
    assert list(summary["variant_label"]) == want
    assert list(frame["model"]) == [m1, m2, twin] * 4 and list(summary["model"]) == [m1, m2, twin] * 2  # full
    heads, rows = _table(b._repr_html_())
    # the variant, n, the outcome counts, each score, tokens, cost, time: what a reader scans, left to right
    # (no job failed, aborted or waits: those counts are left out)
    assert heads == ["variant", "n", "succeeded", "ok", "grade", "has_answer", "long_name_score", "tokens/job",
                     "cost/job", "s/job", "p95s"]
    assert [r[0][0] for r in rows] == want
    assert [r[0][1] for r in rows] == [f"variant {i}: {p} × {m}" for i, (p, m) in
                                       enumerate(itertools.product(["single", "draft-review"], [m1, m2, twin]))]
    assert all(str(deep) not in text for r in rows for text, _ in r)  # the path only in the tooltip
    # each mean ± half its interval's width (2 cases: every job of a variant takes the same tokens)
    assert [r[3][0].split(" ± ")[0] for r in rows] == [f"{v:.2f}" for v in summary["mean_ok"]]
    assert [r[7][0] for r in rows] == [f"{v:,.0f} ± 0" for v in summary["mean_tokens"]]
    assert [r[7][1] for r in rows] == [f"median {v:,.0f} · CI {v:,.0f} to {v:,.0f} · SE 0"
                                       for v in summary["median_tokens"]]
    # a label breaks only between the piece and the model, never inside a name such as "release-/notes"
    assert "<span style='white-space:nowrap'>draft-review</span> · <span style='white-space:nowrap'>" \
           "scripted:summary.yaml</span>" in b._repr_html_()


def test_variant_labels_lengthen_only_what_clashes() -> None:
    from agentnb.views.batch_frames import variant_labels

    assert variant_labels([("a", "scripted:/w/x/p/s.yaml"), ("a", "scripted:/w/y/p/s.yaml"),
                           ("a", "scripted:/w/z/t.yaml"), ("b", "openai:gpt-4o-mini"), ("b", "demo")]) == [
        "a · scripted:x/p/s.yaml", "a · scripted:y/p/s.yaml", "a · scripted:t.yaml", "b · openai:gpt-4o-mini",
        "b · demo"]
    # a relative path shows no more than it has; the same piece name and model twice are numbered
    assert variant_labels([("a", "scripted:s.yaml"), ("a", "scripted:/q/s.yaml")]) == [
        "a · scripted:s.yaml", "a · scripted:/q/s.yaml"]
    assert variant_labels([("a", "demo"), ("a", "demo"), ("b", "demo")]) == ["a · demo #0", "a · demo #1", "b · demo"]


# -- the plot --------------------------------------------------------------------------------------------------------

def test_plot_batch_points_per_variant_and_tokens_per_case(ws: Workspace, tmp_path: Path) -> None:
    b = ws.batch(_cases(3), piece=["single", draft_review(tmp_path)], model=answering_model(tmp_path, "m", "41"),
                 name="plot", progress=False, scorers={"ok": _answer_ok, "grade": lambda j: 0.5 + j.case})
    fig = agentnb.plot_batch(b)
    scatter, boxes = fig.axes
    points = {a.get_gid(): a.get_offsets()[0] for a in scatter.collections if str(a.get_gid()).startswith("variant:")}
    summary = b.summary()
    assert set(points) == {"variant:0", "variant:1"}
    for v in (0, 1):
        x, y = points[f"variant:{v}"]
        assert x == pytest.approx(summary.loc[v, "mean_tokens"])  # scripted: nothing is priced
        assert y == pytest.approx(summary.loc[v, "mean_ok"])
    assert "tokens" in scatter.get_xlabel() and "no cost" in scatter.get_xlabel()
    assert scatter.get_ylabel() == "share of ok true"
    # each variant named once, by its short label, as a row of the tokens panel (first variant on top)
    labels = {t.get_gid(): t.get_text() for t in boxes.get_yticklabels()}
    assert labels == {"label:0": "● single · scripted:m.yaml", "label:1": "■ draft-review · scripted:m.yaml"}
    assert not scatter.texts  # no label beside a point, where two could overprint
    other = agentnb.plot_batch(b.frame, score="grade")
    assert other.axes[0].get_ylabel() == "mean grade"
    assert other.axes[0].collections[0].get_offsets()[0][1] == pytest.approx(1.5)
    png, size = fig._repr_png_()
    assert png.startswith(b"\x89PNG") and size["width"] > 0
    with pytest.raises(AgentnbError, match=r"score='nope' is not a score of this batch; allowed: ok, grade"):
        agentnb.plot_batch(b, score="nope")
    with pytest.raises(AgentnbError, match=r"plot_batch takes a Batch"):
        agentnb.plot_batch(42)


def test_plot_batch_without_scores_says_so(ws: Workspace, tmp_path: Path) -> None:
    b = ws.batch(_cases(2), piece="single", model=answering_model(tmp_path, "m", "41"), name="plain",
                 progress=False)
    fig = agentnb.plot_batch(b)
    assert any(t.get_gid() == "no-score" for t in fig.axes[0].texts)
    assert not math.isnan(float(b.summary().loc[0, "mean_tokens"]))
    assert json.loads(json.dumps(b.cases))[0]["instruction"] == "Answer question 0"


def _lab_frame(n: int, cases: int = 8) -> pd.DataFrame:
    """A batch frame as notebook 05's, with ``n`` variants on scripts deep in a folder: ``has_notes`` is true
    for every job, ``coverage`` differs between the variants."""
    deep = "scripted:/home/someone/projects/acme-corporation/experiments/2026-q4/notebooks/design-lab"
    rows = [{"case": c, "variant": v, "piece": ["release-notes", "release-notes-reviewed"][v % 2],
             "model": f"{deep}/{['draft', 'reviewed'][v % 2]}-script-{v // 2}.yaml", "status": "succeeded",
             "total_tokens": 2500 + 900 * v + 37 * c, "cost_usd": 0.0, "seconds": 1.5, "has_notes": True,
             "coverage": min(1.0, (v % 4 + c % 2) / 4)} for c in range(cases) for v in range(n)]
    frame = pd.DataFrame(rows).astype({"has_notes": "boolean", "coverage": "Float64", "total_tokens": "Int64"})
    frame.attrs.update(batch="review-or-not", scores=["has_notes", "coverage"])
    return frame


@pytest.mark.parametrize("n", [2, 3, 5, 8, 12])
def test_plot_batch_layout_holds_from_2_to_12_variants(n: int) -> None:
    """Notebook 05's plot was unreadable: the full script paths as labels overprinted each other, the left
    panel was squeezed to ~100 px with its ticks run together, and titles and axis labels were clipped."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    fig = agentnb.plot_batch(_lab_frame(n))
    canvas = FigureCanvasAgg(fig)  # laid out and drawn as the PNG shown in a notebook is
    canvas.draw()
    renderer = canvas.get_renderer()
    page = fig.bbox
    ticks, shown = set(), []
    for ax in fig.axes:  # a tick label outside the axis' limits is kept but not drawn
        for labels, where, (lo, hi) in ((ax.get_xticklabels(), ax.get_xticks(), sorted(ax.get_xlim())),
                                        (ax.get_yticklabels(), ax.get_yticks(), sorted(ax.get_ylim()))):
            ticks.update(labels)
            shown.extend(t for t, at in zip(labels, where, strict=True) if lo <= at <= hi)
    texts = [t for t in [*fig.findobj(Text), *shown] if t not in ticks or t in shown]
    texts = [t for t in dict.fromkeys(texts) if t.get_visible() and t.get_text().strip()]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    for text, box in boxes:  # nothing clipped: every text lies inside the figure
        assert page.x0 - 0.5 <= box.x0 and box.x1 <= page.x1 + 0.5 and page.y0 - 0.5 <= box.y0 \
            and box.y1 <= page.y1 + 0.5, f"{text!r} runs out of the figure: {box} not in {page}"
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):  # and no two texts overprint
        assert not box_a.overlaps(box_b), f"{a!r} overlaps {b!r}"
    # no squeezed panel: each keeps a third of the figure's width, and a row of at least 20 px per variant
    scatter, tokens = fig.axes
    for ax in (scatter, tokens):
        assert ax.get_window_extent(renderer).width >= page.width / 3, ax.get_title()
    assert tokens.get_window_extent(renderer).height >= 20 * n
    labels = [t.get_text() for t in tokens.get_yticklabels()]
    assert len(labels) == n and all("/home/someone" not in t for t in labels)
    assert "release-notes-reviewed" in labels[1] and "scripted:reviewed-script-0.yaml" in labels[1]


def test_plot_batch_plots_the_score_that_varies_and_says_which(ws: Workspace) -> None:
    frame = _lab_frame(2)
    fig = agentnb.plot_batch(frame)  # has_notes is 1.0 for every variant: coverage is what tells them apart
    scatter = fig.axes[0]
    assert scatter.get_ylabel() == "mean coverage" and scatter.get_title() == "coverage against tokens · bars: 95% CI"
    assert fig.get_suptitle() == ("batch review-or-not: 2 variants × 8 cases\n"
                                  "score plotted: coverage · others: has_notes (choose with score=)")
    means = frame.groupby("variant")["coverage"].mean()
    assert [c.get_offsets()[0][1] for c in scatter.collections
            if str(c.get_gid()).startswith("variant:")] == pytest.approx(list(means))
    chosen = agentnb.plot_batch(frame, score="has_notes")
    assert chosen.axes[0].get_ylabel() == "share of has_notes true"
    assert "score plotted: has_notes · others: coverage" in chosen.get_suptitle()
    with pytest.raises(AgentnbError, match=r"^score='covrage' is not a score of this batch; "
                                           r"allowed: has_notes, coverage$"):
        agentnb.plot_batch(frame, score="covrage")


def test_repeating_a_call_without_piece_or_model_adds_no_variant(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    cases = [{"instruction": "one"}, {"instruction": "two"}]
    b = ws.batch(cases, piece="single", model="demo", name="e", progress=False)
    assert len(b.variants) == 1 and b.counts()["jobs"] == 2
    again = ws.batch(cases, name="e", progress=False)  # no piece=/model=: the batch's own
    assert len(again.variants) == 1 and again.counts()["jobs"] == 2
    more = ws.batch(cases, piece=["single", "plan-implement-verify"], name="e", progress=False)
    # model omitted: the new piece runs on the batch's own model
    assert [(v["piece"], v["model"]) for v in more.variants] == [("single", "demo"), ("plan-implement-verify", "demo")]
    assert more.counts()["jobs"] == 4


def test_whole_floats_from_a_dataframe_are_the_same_cases_as_ints(tmp_path: Path) -> None:
    import pandas as pd

    ws = Workspace(tmp_path / "ws")
    cases = [{"instruction": "one", "n": 1, "expected": 2}, {"instruction": "two", "n": None, "expected": 3}]
    ws.batch(cases, piece="single", name="e", run=False)
    b = ws.batch(pd.DataFrame(cases), name="e", run=False)  # n becomes 1.0/NaN, expected stays int
    assert b.counts()["jobs"] == 2


# -- processes creating and extending the same batch at once ---------------------------------------------------

@pytest.mark.parametrize("backend", [pytest.param("postgres", marks=pytest.mark.needs("postgres", "psycopg")),
                                     "sqlite"])
def test_processes_creating_the_same_batch_at_once_make_one_batch(tmp_path: Path, backend: str,
                                                                  request: pytest.FixtureRequest) -> None:
    """Four processes call ws.batch on the same name at the same instant: two with the same variant, one with
    another piece, one with the first variant in two epochs.  The first to write creates the batch; the others,
    finding it created under them, add only what it lacks: one batch, both variants, both epochs, every case once
    per variant and epoch, and no process fails."""
    import os
    import subprocess
    import sys
    import textwrap
    import time

    store = request.getfixturevalue("pg_url") if backend == "postgres" else f"sqlite:///{tmp_path / 'ws'}"
    code = textwrap.dedent("""
        import sys, time
        from agentnb import Workspace
        ws = Workspace(sys.argv[1], store=sys.argv[2])
        cases = [{"instruction": f"case {n}"} for n in range(6)]
        time.sleep(max(0.0, float(sys.argv[4]) - time.time()))
        b = ws.batch(cases, name="exp", piece=sys.argv[3], model="demo", run=False, epochs=int(sys.argv[5]) or None)
        print(len(b.jobs))
        ws.store.close()
    """)
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTNB_STORE")}
    env["PYTHONPATH"] = f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    start = str(time.time() + 2.0)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / f"p{k}"), store, piece, start, epochs],
                              env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for k, (piece, epochs) in enumerate([("single", "0"), ("single", "0"), ("plan-implement-verify", "0"),
                                                  ("single", "2")])]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
    ws = Workspace(tmp_path / "reader", store=store)
    try:
        assert [b.name for b in reads.batches(ws.store)] == ["exp"]
        jobs = ws.store.jobs(batch="exp")
        assert len(jobs) == 24
        assert sorted(Counter((j.batch_case, j.piece, j.epoch) for j in jobs).values()) == [1] * 24
        assert reads.batch(ws.store, "exp").epochs == 2
        assert {j.piece for j in jobs} == {"single", "plan-implement-verify"}
    finally:
        ws.store.close()
