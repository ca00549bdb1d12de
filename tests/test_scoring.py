"""Scorers (docs/design-lab.md): what a scorer gets, what is recorded as ``score`` events, re-scoring without running,
and the latest score per name in ``batch.frame``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _batching import answering_model, asking_model, llm_events
from _scripting import call, write_script

from agentnb import AgentnbError, Job, Workspace
from agentnb.batch import score_value
from agentnb.events import ScoreEvent


def _cases(n: int = 2) -> list[dict[str, Any]]:
    return [{"instruction": f"Answer {i}", "expected": {"answer": "41", "case": i}, "level": i} for i in range(n)]


def _scores(ws: Workspace, job: Any) -> list[tuple[str, Any, str | None]]:
    return [(e.name, e.value, e.error) for e in ws.events(job, kinds=["score"]) if isinstance(e, ScoreEvent)]


def test_a_scorer_gets_the_finished_job_with_output_summary_events_and_expected(ws: Workspace, tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    def look(job: Job) -> bool:
        seen.append({"job": job.id, "status": str(job.status), "output": job.output,
                     "answer": (job.output / "answer.txt").read_text(), "summary": job.summary,
                     "kinds": [e.kind for e in job.events], "expected": job.expected, "case": job.case})
        return True

    b = ws.batch(_cases(), piece="single", model=answering_model(tmp_path, "m", "41"), name="look",
                 scorers={"look": look}, progress=False)
    assert sorted(s["job"] for s in seen) == [j.id for j in b.jobs]
    for s in sorted(seen, key=lambda s: s["job"]):
        job = ws.job(s["job"])
        assert s["status"] == "succeeded"
        assert s["output"] == job.workdir / "output"
        assert s["answer"] == "41"
        assert s["summary"] == "answered 41"
        assert s["kinds"][-1] == "job_status" and "llm_response" in s["kinds"] and "transition" in s["kinds"]
        assert s["expected"] == {"answer": "41", "case": s["case"]}
    assert all(_scores(ws, j) == [("look", True, None)] for j in b.jobs)


def test_bool_int_float_and_str_are_recorded_with_their_types(ws: Workspace, tmp_path: Path) -> None:
    scorers = {"ok": lambda j: j.expected["answer"] == (j.output / "answer.txt").read_text(),
               "files": lambda j: len(list(j.output.iterdir())), "ratio": lambda j: j.case / 4,
               "grade": lambda j: "AB"[j.case], "np": lambda j: np.int64(7), "npb": lambda j: np.bool_(j.case == 1)}
    b = ws.batch(_cases(), piece="single", model=answering_model(tmp_path, "m", "41"), name="types",
                 scorers=scorers, progress=False)
    first, second = b.jobs
    assert _scores(ws, first) == [("ok", True, None), ("files", 1, None), ("ratio", 0.0, None), ("grade", "A", None),
                                  ("np", 7, None), ("npb", False, None)]
    values = {name: value for name, value, _ in _scores(ws, second)}
    assert [type(values[n]) for n in scorers] == [bool, int, float, str, int, bool]
    frame = b.frame
    assert {n: str(frame[n].dtype) for n in scorers} == {
        "ok": "boolean", "files": "Int64", "ratio": "Float64", "grade": "string", "np": "Int64", "npb": "boolean"}
    assert list(frame["grade"]) == ["A", "B"] and list(frame["ratio"]) == [0.0, 0.25]
    assert frame["ok_error"].isna().all() and str(frame["ok_error"].dtype) == "string"
    assert frame.attrs["scores"] == list(scorers)


def test_a_raising_scorer_records_its_error_and_the_batch_goes_on(ws: Workspace, tmp_path: Path) -> None:
    def boom(job: Job) -> bool:
        if job.case == 0:
            raise ValueError("no answer\nfile  found")
        return True

    b = ws.batch(_cases(3), piece="single", model=answering_model(tmp_path, "m", "41"), name="boom",
                 scorers={"boom": boom, "wrong": lambda j: [1], "nan": lambda j: math.nan, "fine": lambda j: 1},
                 concurrency=1, progress=False)
    assert b.counts()["succeeded"] == 3  # every job ran and was scored
    first = b.jobs[0]
    assert _scores(ws, first) == [
        ("boom", None, "ValueError: no answer file found"),
        ("wrong", None, "returned list [1]; allowed: bool, int, float or str"),
        ("nan", None, "returned NaN; allowed: bool, int, float or str"),
        ("fine", 1, None)]
    frame = b.frame
    assert frame["boom"].isna().tolist() == [True, False, False]
    assert frame["boom_error"].tolist()[0] == "ValueError: no answer file found"
    assert frame["boom_error"].isna().tolist() == [False, True, True]
    assert frame["wrong"].isna().all() and frame["nan"].isna().all()
    assert list(frame["fine"]) == [1, 1, 1]
    # the summary's mean is over the jobs that have a value
    assert b.summary().loc[0, "mean_boom"] == 1.0


def test_a_score_value_unit() -> None:
    assert score_value(lambda j: np.float32(0.5), None) == (0.5, None)
    assert score_value(lambda j: None, None) == (None, "returned NoneType None; allowed: bool, int, float or str")
    assert score_value(lambda j: 1 / 0, None) == (None, "ZeroDivisionError: division by zero")
    assert score_value(lambda j: (_ for _ in ()).throw(KeyError()), None) == (None, "KeyError")
    with pytest.raises(KeyboardInterrupt):  # an interrupt is not a scorer's error: it stops the batch
        score_value(lambda j: (_ for _ in ()).throw(KeyboardInterrupt()), None)


def test_not_callable_and_clashing_scorers_are_refused(ws: Workspace, tmp_path: Path) -> None:
    model = answering_model(tmp_path, "m", "41")
    for scorers, message in [({"ok": True}, r"^scorer 'ok' is a bool, which is not callable; allowed: a function"),
                             ({"": bool}, r"scorer name '' must be non-empty text"),
                             (["ok"], r"scorers must be a dict of name → function\(job\), not list"),
                             ({"level": bool}, r"scorer name\(s\) 'level' clash with the cases' own columns"),
                             ({"seconds": bool}, r"scorer name 'seconds' is a column of the batch's frame"),
                             ({"ok": bool, "ok_error": bool}, r"'ok_error' is the error column of scorer 'ok'")]:
        with pytest.raises(AgentnbError, match=message):
            ws.batch(_cases(), piece="single", model=model, name="x", scorers=scorers, progress=False)
        assert ws.batches() == [] and ws.store.jobs() == []
    b = ws.batch(_cases(), piece="single", model=model, name="x", progress=False)
    calls = llm_events(ws)
    for bad in ({"ok": 3}, {}, {"level": bool}):
        with pytest.raises(AgentnbError):
            ws.score(b, bad)
        with pytest.raises(AgentnbError):
            b.score(bad)
    assert all(_scores(ws, j) == [] for j in b.jobs) and llm_events(ws) == calls
    with pytest.raises(AgentnbError, match=r"^no batch 'nope' in .*\(batches: x\)$"):
        ws.score("nope", {"ok": bool})


def test_rescoring_runs_nothing_and_the_latest_score_wins(ws: Workspace, tmp_path: Path) -> None:
    b = ws.batch(_cases(3), piece="single", model=answering_model(tmp_path, "m", "41"), name="again",
                 scorers={"grade": lambda j: 1}, progress=False)
    calls = llm_events(ws)
    assert list(b.frame["grade"]) == [1, 1, 1]

    scored = ws.score("again", {"grade": lambda j: 10 + j.case})  # by name
    assert [j.id for j in scored] == [j.id for j in b.jobs]
    assert list(b.frame["grade"]) == [10, 11, 12]
    ws.score(b, {"grade": lambda j: 1 / 0})  # the Batch: the latest event is an error → NA, with its error
    frame = b.frame
    assert frame["grade"].isna().all() and set(frame["grade_error"]) == {"ZeroDivisionError: division by zero"}
    ws.score(b.jobs[:2], {"grade": lambda j: 20.5})  # jobs: only those
    frame = b.frame
    assert frame["grade"].tolist()[:2] == [20.5, 20.5] and frame["grade"].isna().tolist()[2]
    ws.score(b.jobs[2].id, {"grade": lambda j: 30, "new": lambda j: "yes"})  # one job id; a new name
    frame = b.frame
    assert frame["grade"].tolist() == [20.5, 20.5, 30.0] and str(frame["grade"].dtype) == "Float64"
    assert frame["new"].isna().tolist() == [True, True, False]
    assert b.score({"grade": lambda j: 2}) is b
    assert list(b.frame["grade"]) == [2, 2, 2]
    assert llm_events(ws) == calls  # nothing ran again
    assert [n for n, _, _ in _scores(ws, b.jobs[2])] == ["grade", "grade", "grade", "grade", "new", "grade"]


def test_waiting_jobs_are_not_scored_failed_ones_are(ws: Workspace, tmp_path: Path) -> None:
    broken = write_script(tmp_path, "broken", {"work": [call("Glob", pattern="*")]})
    b = ws.batch(_cases(2), piece="single", model=[asking_model(tmp_path), broken], name="mixed",
                 scorers={"has_output": lambda j: any(j.output.iterdir())}, progress=False)
    frame = b.frame
    assert list(frame["status"]) == ["waiting_human", "failed"] * 2
    assert frame["has_output"].isna().tolist() == [True, False] * 2
    assert frame.loc[frame["status"] == "failed", "has_output"].tolist() == [False, False]
    waiting = [j for j in b.jobs if j.status == "waiting_human"]
    assert all(_scores(ws, j) == [] for j in waiting)
    rescored = ws.score(b, {"has_output": lambda j: True})
    assert {j.id for j in rescored} == {j.id for j in b.jobs if j.status == "failed"}
    assert all(_scores(ws, j) == [] for j in waiting)


def test_a_resumed_batch_scores_the_jobs_that_ended_unscored(ws: Workspace, tmp_path: Path) -> None:
    model = answering_model(tmp_path, "m", "41")
    b = ws.batch(_cases(2), piece="single", model=model, name="later", progress=False)  # no scorers
    assert all(_scores(ws, j) == [] for j in b.jobs)
    calls = llm_events(ws)
    ws.batch("later", scorers={"ok": lambda j: True}, progress=False)
    assert all(_scores(ws, j) == [("ok", True, None)] for j in b.jobs)
    ws.batch("later", scorers={"ok": lambda j: False}, progress=False)  # scored once: a resume does not re-score
    assert all(_scores(ws, j) == [("ok", True, None)] for j in b.jobs)
    assert llm_events(ws) == calls
