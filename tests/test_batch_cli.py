"""Batches from the notebook and the terminal: ``%agent batch`` / ``%agent batches`` through a real IPython
shell, ``agentnb batch`` / ``agentnb batches`` as a subprocess on real SQLite files and the loopback
OpenAI-protocol server (docs/design-lab.md)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from _scripting import call, transition, write_piece, write_script
from conftest import store_of
from IPython.core.error import UsageError
from openai_server import OpenAIServer, reply, stall

from agentnb import BatchComparison, Workspace
from agentnb.batch import Batch
from agentnb.store import StoreError

AGENTNB = shutil.which("agentnb")


def _succeeding(folder: Path, text: str = "the answer") -> str:
    """A scripted model for piece ``single``: write output/answer.txt, then complete."""
    return write_script(folder, "ok", {"work": [
        {"tool_calls": [{"name": "Write", "arguments": {"path": "output/answer.txt", "content": text}}]},
        transition("COMPLETE", summary="answered")]})


def _llm_requests(ws: Workspace, job_id: int) -> int:
    return len(ws.store.events(job_id, kinds=["llm_request"]))


def _scores(ws: Workspace, job_id: int) -> dict[str, Any]:
    return {e.name: (e.value, e.error) for e in ws.store.events(job_id, kinds=["score"])}


# -- the magic --------------------------------------------------------------------------------------------------

CASES = [{"instruction": "Answer question one", "expected": "the answer", "topic": "a"},
         {"instruction": "Answer question two", "expected": "another answer", "topic": "b"},
         {"instruction": "Answer question three", "expected": "the answer", "topic": "a"}]


def test_magic_batch_from_a_variable_runs_every_case_and_records_each_scorer(shell: Any, tmp_path: Path) -> None:
    shell.user_ns["t_cases"] = CASES
    shell.user_ns["t_spec"] = _succeeding(tmp_path)
    shell.user_ns["t_has_output"] = lambda job: (job.output / "answer.txt").is_file()
    shell.user_ns["t_more"] = {"right": lambda job: (job.output / "answer.txt").read_text() == job.expected,
                               "broken": lambda job: 1 / 0}
    b = shell.run_line_magic("agent", "batch t_cases --piece single --model {t_spec} --concurrency 2 --name m1 "
                                      "--scorer t_has_output --scorer t_more")
    assert isinstance(b, Batch) and b.name == "m1"
    assert b.counts()["succeeded"] == 3 and b.counts()["jobs"] == 3
    ws = b.ws
    by_case = {j.case: j.id for j in b.jobs}
    assert _scores(ws, by_case[0]) == {"t_has_output": (True, None), "right": (True, None),
                                       "broken": (None, "ZeroDivisionError: division by zero")}
    assert _scores(ws, by_case[1])["right"] == (False, None)
    assert "m1" in b._repr_html_()  # what the cell shows
    frame = b.frame
    assert sorted(frame["topic"]) == ["a", "a", "b"]  # the cases' own columns are carried through


def test_magic_batch_takes_a_dataframe_and_crosses_pieces_with_models(shell: Any, tmp_path: Path) -> None:
    shell.user_ns["t_df"] = pd.DataFrame(CASES[:2])
    (tmp_path / "other").mkdir()
    ok, other = _succeeding(tmp_path), _succeeding(tmp_path / "other", "another answer")
    b = shell.run_line_magic("agent", f"batch t_df --piece single --model {ok},{other} --name m2")
    assert [(v["piece"], v["model"]) for v in b.variants] == [("single", ok), ("single", other)]
    assert b.counts()["jobs"] == 4 and b.counts()["succeeded"] == 4
    assert sorted((j.case, j.variant) for j in b.jobs) == [(0, 0), (0, 1), (1, 0), (1, 1)]



def test_magic_batch_takes_pieces_and_models_from_variables_kept_whole(shell: Any, tmp_path: Path) -> None:
    """A variable holding a list (or a Piece, or a Path) is used as it is, not as its text split at commas."""
    from agentnb import load_piece

    piece_path = tmp_path / "one, with a comma.yaml"  # a comma in the path would split a typed line
    piece_path.write_text(load_piece("single").to_yaml().replace("name: single", "name: commas"), encoding="utf-8")
    shell.user_ns.update(t_cases=CASES[:1], t_pieces=["single", piece_path], t_models=[_succeeding(tmp_path)])
    b = shell.run_line_magic("agent", "batch t_cases --piece t_pieces --model t_models --name vars")
    assert [v["piece"] for v in b.variants] == ["single", "commas"]
    assert b.counts()["succeeded"] == 2
    shell.user_ns["t_piece"] = load_piece(piece_path)
    one = shell.run_line_magic("agent", "batch t_cases --piece {t_piece} --model $t_models --name one --no-run")
    assert [v["piece"] for v in one.variants] == ["commas"]
    with pytest.raises(UsageError, match=r"^%agent batch: give either a batch to resume \('vars'\) or --name x"):
        shell.run_line_magic("agent", "batch vars --name x")

def test_magic_batch_resumes_by_name_without_running_a_finished_job_again(shell: Any, tmp_path: Path) -> None:
    shell.user_ns["t_cases"] = CASES
    shell.user_ns["t_spec"] = _succeeding(tmp_path)
    created = shell.run_line_magic("agent", "batch t_cases --piece single --model $t_spec --name m3 --no-run")
    assert created.counts()["queued"] == 3
    first = created.jobs[0]
    created.ws.run(first.id)  # one job ends before the batch is resumed
    before = _llm_requests(created.ws, first.id)
    for cache in ("bogus", "on"):  # the cache is the created jobs': a resumed batch creates none
        with pytest.raises(UsageError, match=r"^%agent batch: (--cache |cache is given)"):
            shell.run_line_magic("agent", f"batch m3 --cache {cache} --no-run")
    b = shell.run_line_magic("agent", "batch m3")
    assert b.counts()["succeeded"] == 3
    assert _llm_requests(b.ws, first.id) == before
    again = {j.id: _llm_requests(b.ws, j.id) for j in b.jobs}
    shell.user_ns["t_b"] = b
    resumed = shell.run_line_magic("agent", "batch t_b")  # a Batch variable resumes that batch too
    assert resumed.name == "m3" and {j.id: _llm_requests(b.ws, j.id) for j in resumed.jobs} == again
    # the same cases with another piece add that variant; the finished jobs stay as they were
    grown = shell.run_line_magic("agent", "batch t_cases --piece single,plan-implement-verify --model $t_spec "
                                          "--name m3 --no-run")
    assert grown.counts()["jobs"] == 6 and grown.counts()["succeeded"] == 3 and grown.counts()["queued"] == 3


def test_magic_batches_lists_each_batch_with_counts_by_status(shell: Any, tmp_path: Path) -> None:
    shell.user_ns["t_cases"] = CASES
    shell.user_ns["t_spec"] = _succeeding(tmp_path)
    empty = shell.run_line_magic("agent", "batches")
    assert isinstance(empty, pd.DataFrame) and empty.empty
    shell.run_line_magic("agent", "batch t_cases --piece single --model {t_spec} --name done")
    shell.run_line_magic("agent", "batch t_cases --piece single --model {t_spec} --name later --no-run")
    df = shell.run_line_magic("agent", "batches")
    assert list(df["name"]) == ["done", "later"]
    assert {"created", "jobs", "queued", "succeeded", "failed", "waiting_human"} <= set(df.columns)
    assert df.set_index("name").loc["done", ["jobs", "succeeded", "queued"]].tolist() == [3, 3, 0]
    assert df.set_index("name").loc["later", ["jobs", "succeeded", "queued"]].tolist() == [3, 0, 3]
    assert pd.api.types.is_datetime64_any_dtype(df["created"])
    # shown to the second, not the nanosecond: "2026-12-04 23:30:12", never "…:12.123456789"
    assert (df["created"] == df["created"].dt.floor("s")).all() and (df["updated"] == df["updated"].dt.floor("s")).all()
    assert re.search(r"\d{2}:\d{2}:\d{2}\s", df.to_string()) and not re.search(r":\d{2}\.\d", df.to_string())


@pytest.mark.parametrize(("line", "needle"), [
    ("batch t_nothing", "'t_nothing' is neither a variable of the notebook nor a batch"),
    ("batch t_cases --piece nope --model demo", "unknown piece 'nope'"),
    ("batch t_cases --piece single --model nomodel", "nomodel"),
    ("batch t_cases --piece single,,single", "--piece 'single,,single' has an empty item"),
    ("batch t_cases --concurrency 0", "--concurrency 0; allowed: a whole number ≥ 1"),
    ("batch t_cases -c0", "concurrency=0; allowed: a whole number ≥ 1"),  # (a short option: the argument's name)
    ("batch t_cases --concurrency many", "argument --concurrency/-c: invalid int value: 'many'"),
    ("batch t_cases --epochs 0", "--epochs 0; allowed: a whole number ≥ 1"),
    ("batch t_cases --scorer t_nothing", "--scorer 't_nothing' is not a variable"),
    ("batch t_cases --scorer t_cases", "--scorer t_cases: the variable holds a list"),
    ("batch t_cases --scorer t_bad", "scorer 'x' is a int, which is not callable"),
    ("batch t_notcases", "cases must be a list of dicts or a DataFrame, not int"),
    ("batch t_noinstr", "case 1 needs an 'instruction'"),
    ("batch", "the following arguments are required: cases"),
    ("batch t_cases --piece single --model demo --baseline nope", "--baseline 'nope' is not a variant of the batch; "
     "allowed: a variant's number or label, or a piece or model only one variant has: 0 = single · demo"),
])
def test_magic_batch_refuses_bad_input_in_one_line_and_creates_nothing(shell: Any, line: str, needle: str) -> None:
    shell.user_ns.update(t_cases=CASES, t_bad={"x": 3}, t_notcases=7,
                         t_noinstr=[{"instruction": "fine"}, {"expected": 1}])
    with pytest.raises(UsageError) as info:
        shell.run_line_magic("agent", line)
    text = str(info.value)
    assert text.startswith("%agent batch: ") and "\n" not in text
    assert needle in text
    assert shell.run_line_magic("agent", "batches").empty
    assert shell.run_line_magic("agent", "jobs").empty


def test_magic_batch_with_a_baseline_returns_the_comparison(shell: Any, tmp_path: Path) -> None:
    shell.user_ns["t_cases"] = CASES
    shell.user_ns["t_two"] = [_succeeding(tmp_path), _succeeding(tmp_path / "b", "another answer")]
    shell.user_ns["t_right"] = lambda job: (job.output / "answer.txt").read_text() == job.expected
    c = shell.run_line_magic("agent", "batch t_cases --piece single --model t_two --scorer t_right --name ab "
                                      "--baseline 1")
    assert isinstance(c, BatchComparison) and (c.batch, c.baseline) == ("ab", 1)
    # "the answer" is right for cases 0 and 2, "another answer" for case 1
    row = c.frame.set_index("measure").loc["t_right"]
    assert (row["variant"], row["better_cases"], row["worse_cases"], row["verdict"]) == (0, 2, 1, "too few cases")
    assert "Too few cases for the test to mean anything: with n = 3 paired cases" in c._repr_html_()
    # resuming by name with a baseline: the batch's own variants
    again = shell.run_line_magic("agent", "batch ab --baseline 0")
    assert again.frame.equals(shell.run_line_magic("agent", "batch ab --baseline 0").frame)
    with pytest.raises(UsageError, match=r"^%agent batch: --baseline 'x' is not a variant of the batch; .*"
                                         r"0 = single · scripted:[^,]+/ok\.yaml, 1 = single · scripted:b/ok\.yaml$"):
        shell.run_line_magic("agent", "batch ab --baseline x")


def test_magic_batch_name_of_a_batch_with_other_cases_is_refused(shell: Any, tmp_path: Path) -> None:
    shell.user_ns["t_cases"] = CASES
    shell.user_ns["t_other"] = CASES[:2]
    shell.run_line_magic("agent", "batch t_cases --piece single --model demo --name same --no-run")
    with pytest.raises(UsageError, match=r"^%agent batch: batch 'same' already exists with different cases"):
        shell.run_line_magic("agent", "batch t_other --piece single --model demo --name same")
    with pytest.raises(UsageError, match=r"^%agent batch: 'same' names no variable .* to add variants"):
        shell.run_line_magic("agent", "batch same --piece single")
    assert shell.run_line_magic("agent", "batches")["jobs"].tolist() == [3]


# -- the command --------------------------------------------------------------------------------------------------

needs_cli = pytest.mark.skipif(AGENTNB is None, reason="the agentnb entry point is not installed")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # AGENTNB_STORE stays: under AGENTNB_TEST_BACKEND=postgres the subprocess must use the test's database
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AGENTNB_", "OPENAI_")) or k == "AGENTNB_STORE"}
    env.update(extra or {})
    return env


def agentnb(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert AGENTNB is not None
    return subprocess.run([AGENTNB, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=_env(env))


def _batch_rows(folder: Path) -> list[tuple[Any, ...]]:
    store = store_of(folder)
    if store is None:
        return []
    try:
        return [(r[0],) for sql in ("SELECT name FROM batches ORDER BY name", "SELECT id FROM jobs ORDER BY id") for r in store.query(sql)]
    finally:
        store.close()



def _succeeded(folder: Path) -> int:
    """How many jobs have succeeded so far (0 while the store or its schema is still being made)."""
    try:
        store = store_of(folder)
        if store is None:
            return 0
        try:
            return int(store.query("SELECT COUNT(*) FROM jobs WHERE status='succeeded'")[0][0])
        finally:
            store.close()
    except (StoreError, sqlite3.Error):
        return 0  # the schema is being created

@needs_cli
def test_cli_batch_from_csv_with_an_inputs_folder_prints_the_summary_and_exits_0(tmp_path: Path) -> None:
    (tmp_path / "docs" / "one").mkdir(parents=True)
    (tmp_path / "docs" / "one" / "a.md").write_text("alpha\n")
    ok = _succeeding(tmp_path)
    aborts = write_script(tmp_path, "aborts", {"work": [transition("ABORT", summary="cannot")]})
    (tmp_path / "cases.csv").write_text("instruction,inputs,expected,topic\n"
                                        "Summarise input/a.md,docs/one,the answer,x\n"
                                        '"Say ""hello, world""",,hello,y\n', encoding="utf-8")
    out = agentnb(tmp_path, "--workspace", "ws", "batch", "cases.csv", "--piece", "single", "--model", ok,
                  "--model", aborts, "--concurrency", "3", "--name", "exp1", "--no-progress")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "<Batch 'exp1': 4/4 ended · 2 succeeded, 2 aborted>"
    header = lines[1].split()
    assert header[:3] == ["variant", "variant_label", "n"]
    short = [f"scripted:{Path(m.split(':', 1)[1]).name}" for m in (ok, aborts)]
    assert [ln.split()[:5] for ln in lines[2:4]] == [["0", "single", "·", short[0], "2"],
                                                     ["1", "single", "·", short[1], "2"]]
    assert lines[4:6] == [f"variant 0: single × {ok}", f"variant 1: single × {aborts}"]
    ws = Workspace(tmp_path / "ws", readonly=True)
    [row] = ws.batches()
    assert (row["name"], row["jobs"], row["n_succeeded"], row["n_aborted"]) == ("exp1", 4, 2, 2)
    first = next(j for j in ws.jobs() if j.case == 0 and j.variant == 0)
    assert (first.workdir / "input" / "a.md").read_text() == "alpha\n"
    assert first.expected == "the answer"
    second = next(j for j in ws.jobs() if j.case == 1 and j.variant == 0)
    assert second.instruction == 'Say "hello, world"' and not any((second.workdir / "input").iterdir())


@needs_cli
def test_cli_batch_with_a_baseline_prints_the_paired_comparison(tmp_path: Path) -> None:
    ok = _succeeding(tmp_path)
    other = write_script(tmp_path, "other", {"work": [transition("COMPLETE", summary="nothing written")]})
    (tmp_path / "c.csv").write_text("instruction\none\ntwo\n", encoding="utf-8")
    out = agentnb(tmp_path, "--workspace", "ws", "batch", "c.csv", "--piece", "single", "--model", ok, "--model",
                  other, "--baseline", "0", "--no-progress")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("against baseline 0"))
    assert lines[at] == ("against baseline 0 (single · scripted:ok.yaml): diff = variant − baseline, paired by case; "
                         "95% CI, percentile bootstrap over cases, 9,999 resamples, seed 0; p: paired permutation "
                         "(sign-flip)")
    assert lines[at + 1].split()[:4] == ["variant", "measure", "better", "n"]
    assert [ln.split()[:4] for ln in lines[at + 2:at + 4]] == [["1", "cost_usd", "lower", "2"],
                                                               ["1", "total_tokens", "lower", "2"]]
    # the summary's means printed with ± half their interval
    assert " ± " in lines[2]


@needs_cli
def test_cli_batch_from_jsonl_with_inputs_as_dict_or_folder(tmp_path: Path) -> None:
    (tmp_path / "cases" / "in").mkdir(parents=True)
    (tmp_path / "cases" / "in" / "b.txt").write_text("beta")
    ok = _succeeding(tmp_path)
    lines = [{"instruction": "one", "inputs": {"a.txt": "alpha"}, "expected": {"n": 1}},
             {"instruction": "two", "inputs": "in", "tags": ["t"]}]
    (tmp_path / "cases" / "c.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n", encoding="utf-8")
    out = agentnb(tmp_path, "batch", "cases/c.jsonl", "--piece", "single", "--model", ok, "--name", "j1",
                  "--workspace", "ws", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("<Batch 'j1': 2/2 ended · 2 succeeded>")
    ws = Workspace(tmp_path / "ws", readonly=True)
    jobs = sorted(ws.jobs(), key=lambda j: j.case)
    assert (jobs[0].workdir / "input" / "a.txt").read_text() == "alpha" and jobs[0].expected == {"n": 1}
    assert (jobs[1].workdir / "input" / "b.txt").read_text() == "beta"
    assert ws.batch("j1", run=False).cases[1]["extra"] == {"tags": ["t"]}
    listed = agentnb(tmp_path, "batches", env={"AGENTNB_WORKSPACE": str(tmp_path / "ws")})
    assert listed.returncode == 0, listed.stderr
    head, row = listed.stdout.splitlines()
    assert head.split()[:5] == ["name", "created", "(UTC)", "jobs", "queued"]
    assert row.split()[0] == "j1" and row.split()[3:6] == ["2", "0", "0"] and row.split()[6] == "2"


@needs_cli
def test_cli_batch_without_a_name_run_again_resumes_the_batch_of_the_same_cases(tmp_path: Path) -> None:
    # "interrupted and rerun to resume" holds without --name too: the same file again is the same batch
    (tmp_path / "c.csv").write_text("instruction,topic\nAnswer one,a\nAnswer two,b\n")
    argv = ["--workspace", "ws", "batch", "c.csv", "--piece", "plan-implement-verify", "--model", "demo",
            "--no-progress"]
    first = agentnb(tmp_path, *argv)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("<Batch 'batch-1': 2/2 ended")
    ws = Workspace(tmp_path / "ws", readonly=True)
    calls = sum(_llm_requests(ws, j.id) for j in ws.jobs())
    again = agentnb(tmp_path, *argv)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("<Batch 'batch-1': 2/2 ended")  # resumed, not a batch-2 run from scratch
    ws = Workspace(tmp_path / "ws", readonly=True)
    assert [b["name"] for b in ws.batches()] == ["batch-1"] and len(ws.jobs()) == 2
    assert sum(_llm_requests(ws, j.id) for j in ws.jobs()) == calls
    (tmp_path / "d.csv").write_text("instruction,topic\nAnswer three,c\n")  # other cases: a batch of their own
    other = agentnb(tmp_path, "--workspace", "ws", "batch", "d.csv", "--no-progress")
    assert other.returncode == 0 and other.stdout.startswith("<Batch 'batch-2': 1/1 ended"), other.stderr


@needs_cli
def test_cli_batch_detach_only_queues_a_worker_runs_the_jobs_and_the_same_command_scores_them(tmp_path: Path) -> None:
    (tmp_path / "c.csv").write_text("instruction,topic\nAnswer one,a\nAnswer two,b\n")
    argv = ["--workspace", "ws", "batch", "c.csv", "--piece", "plan-implement-verify", "--model", "demo",
            "--no-progress"]
    detached = agentnb(tmp_path, *argv, "--detach")
    assert detached.returncode == 0, detached.stderr
    assert detached.stdout.splitlines()[0] == "batch 'batch-1': 2 job(s), 2 queued"
    ws = Workspace(tmp_path / "ws", readonly=True)
    assert [j.status for j in ws.jobs()] == ["queued", "queued"]
    assert all(_llm_requests(ws, j.id) == 0 for j in ws.jobs())  # nothing ran
    worker = agentnb(tmp_path, "--workspace", "ws", "worker", "--concurrency", "2")
    assert worker.returncode == 0 and "ran 2 job(s)" in worker.stdout, worker.stderr
    calls = sum(_llm_requests(ws, j.id) for j in ws.jobs())
    scored = agentnb(tmp_path, *argv)
    assert scored.returncode == 0, scored.stderr
    assert scored.stdout.startswith("<Batch 'batch-1': 2/2 ended")
    assert sum(_llm_requests(ws, j.id) for j in ws.jobs()) == calls  # the worker's runs kept, not run again


@needs_cli
def test_cli_batch_with_jobs_waiting_for_a_human_exits_3_and_names_them(tmp_path: Path) -> None:
    asks = write_script(tmp_path, "asks", {"work": [transition("ASK", question="Which year?")]})
    ok = _succeeding(tmp_path)
    (tmp_path / "c.jsonl").write_text('{"instruction": "Report on the year"}\n')
    out = agentnb(tmp_path, "--workspace", "ws", "batch", "c.jsonl", "--piece", "single", "--model", ok,
                  "--model", asks, "--name", "w")
    assert out.returncode == 3, out.stderr
    assert out.stdout.startswith("<Batch 'w': 1/2 ended · 1 succeeded, 1 waiting>")
    # the bar on stderr is cleared at the end and its final line printed in its place
    last = out.stderr.replace("\r", "\n").strip().splitlines()[-1]
    assert re.fullmatch(r"batch w · 2/2 · 1 ok · 1 waiting · [\d,]+ tokens · \$0 · \d+\.\d s", last), out.stderr
    assert "job(s) 2 wait for a human" in out.stdout
    # rerunning changes nothing while the question is unanswered
    again = agentnb(tmp_path, "--workspace", "ws", "batch", "c.jsonl", "--piece", "single", "--model", ok,
                    "--model", asks, "--name", "w", "--no-progress")
    assert again.returncode == 3 and _batch_rows(tmp_path / "ws") == [("w",), (1,), (2,)]


@needs_cli
@pytest.mark.parametrize(("name", "content", "needle"), [
    ("missing.csv", None, "missing.csv: no such file"),
    ("cases.txt", "instruction\nx\n", "cases.txt: cases must be a .csv or a .jsonl file, not .txt"),
    ("noext", "instruction\nx\n", "cases must be a .csv or a .jsonl file, not a file without an extension"),
    ("h.csv", "task,expected\nx,y\n", "h.csv line 1: the header has no 'instruction' column (columns: task, expected)"),
    ("wide.csv", "instruction,expected\nok,1\nx,y,z\n", "wide.csv line 3: 2 columns expected, as in the header"),
    ("short.csv", "instruction,expected\nok,1\nonly\n", "short.csv line 3: 2 columns expected"),
    ("empty.csv", "instruction,expected\nok,1\n,2\n", "empty.csv line 3: the instruction is empty"),
    ("folder.csv", "instruction,inputs\nok,nowhere\n", "folder.csv line 2: inputs 'nowhere' is no such folder"),
    ("rows.csv", "instruction\n", "rows.csv: no cases (the file has no rows)"),
    ("bad.jsonl", '{"instruction": "ok"}\n{"instruction": "x",}\n', "bad.jsonl line 2: not valid JSON"),
    ("list.jsonl", '{"instruction": "ok"}\n\n[1, 2]\n', "list.jsonl line 3: a JSON list; each line must be an object"),
    ("noinstr.jsonl", '{"expected": 1}\n', "noinstr.jsonl line 1: 'instruction' must be non-empty text"),
    ("inp.jsonl", '{"instruction": "x", "inputs": 5}\n', "inp.jsonl line 1: inputs is a JSON int"),
    ("latin.csv", b"instruction\ncaf\xe9\n", "latin.csv: not UTF-8 text"),
])
def test_cli_batch_bad_file_is_one_error_line_exit_2_and_nothing_stored(tmp_path: Path, name: str,
                                                                     content: str | bytes | None, needle: str) -> None:
    if isinstance(content, bytes):
        (tmp_path / name).write_bytes(content)
    elif content is not None:
        (tmp_path / name).write_text(content, encoding="utf-8")
    out = agentnb(tmp_path, "--workspace", "ws", "batch", name, "--piece", "single", "--model", "demo")
    assert out.returncode == 2
    assert out.stdout == ""
    [line] = out.stderr.splitlines()
    assert line.startswith("agentnb: error: batch: ") and needle in line
    assert _batch_rows(tmp_path / "ws") == []


@needs_cli
@pytest.mark.parametrize(("args", "needle"), [
    (["--piece", "nope"], "unknown piece 'nope'"),
    (["--concurrency", "0"], "--concurrency 0; allowed: a whole number ≥ 1"),
    (["--epochs=-1"], "--epochs -1; allowed: a whole number ≥ 1"),
    (["--model", "scripted:nofile.yaml"], "nofile.yaml"),
    (["--piece", "single", "--model", "demo", "--baseline", "2"], "--baseline '2' is not a variant of the batch"),
])
def test_cli_batch_bad_options_are_one_error_line_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    (tmp_path / "c.csv").write_text("instruction\nx\n")
    out = agentnb(tmp_path, "--workspace", "ws", "batch", "c.csv", *args)
    assert out.returncode == 2, out.stdout
    [line] = out.stderr.splitlines()
    assert line.startswith("agentnb: error: ") and needle in line
    assert _batch_rows(tmp_path / "ws") == []


@needs_cli
def test_cli_batch_checks_its_retry_options_when_it_resumes_a_batch_too(tmp_path: Path) -> None:
    """The same command again makes no new job, so no job's check sees the options: the batch checks them."""
    (tmp_path / "c.csv").write_text("instruction\nx\n")
    argv = ["--workspace", "ws", "batch", "c.csv", "--model", "demo", "--name", "b"]
    assert agentnb(tmp_path, *argv).returncode == 0
    for args, message in [
        (["--retries", "-1"], "--retries -1; allowed: a whole number from 0 to 100 (the tries after the first)"),
        (["--max-backoff=-2"], "--max-backoff -2.0; allowed: a number of seconds ≥ 0 (the longest wait between two tries)"),
    ]:
        out = agentnb(tmp_path, *argv, *args)
        assert (out.returncode, out.stdout, out.stderr) == (2, "", f"agentnb: error: {message}\n")


@needs_cli
def test_cli_batch_interrupted_with_sigint_pauses_and_the_same_command_resumes(tmp_path: Path) -> None:
    """Ctrl-C in the middle: exit 130, the running job paused after its call, nothing half done; the same
    command again runs only the jobs that had not ended."""
    piece = write_piece(tmp_path, "one-call", {"max_movements": 2, "movements": [
        {"name": "work", "persona": "p", "instruction": "i", "tools": [], "permission": "readonly",
         "rules": [{"condition": "done", "next": "COMPLETE"}]}]})
    n = 6
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"instruction": f"task {i}"}) + "\n" for i in range(n)))
    # each job: an answer that takes its time (text only, so the loop asks again), then the transition
    done = reply(tool_calls=[("transition", {"next_step": "COMPLETE", "summary": "done"})])
    argv = [str(AGENTNB), "--workspace", "ws", "batch", "c.jsonl", "--piece", str(piece), "--model", "openai:m",
            "--concurrency", "1", "--name", "slow", "--no-progress"]
    with OpenAIServer() as server:
        server.play(*[a for _ in range(2 * n) for a in (stall(0.3), dict(done))])
        env = _env({"OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": "sk-test"})
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        deadline = time.monotonic() + 120
        while True:  # wait until two jobs have succeeded, then press Ctrl-C
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the batch never got going"
            if _succeeded(tmp_path / "ws") >= 2:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 130, (stdout, stderr)
        # one line says what happened and how to resume from a terminal (not with ws.batch(…), a Python call)
        [said] = [line for line in stderr.splitlines() if "interrupted" in line]
        assert re.fullmatch(r"agentnb: interrupted: \d running job\(s\) paused, \d not finished; resume with the "
                            r"same command again \(batch 'slow'\)", said), stderr
        assert "ws.batch" not in stderr
        ws = Workspace(tmp_path / "ws", readonly=True)
        first = {j.id: (str(j.status), len(ws.events(j, kinds=["llm_request"]))) for j in ws.jobs()}
        ended = {i for i, (status, _) in first.items() if status == "succeeded"}
        assert 2 <= len(ended) < n
        assert {status for status, _ in first.values()} <= {"succeeded", "queued"}  # none left running
        calls_before = len(server.received)
        out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"<Batch 'slow': {n}/{n} ended · {n} succeeded>")
    ws = Workspace(tmp_path / "ws", readonly=True)
    after = {j.id: len(ws.events(j, kinds=["llm_request"])) for j in ws.jobs()}
    assert all(after[i] == first[i][1] >= 2 for i in ended)  # a finished job was not run again
    assert all(after[i] >= 1 for i in after) and sum(after.values()) == len(server.received)  # each call once
    assert len(server.received) > calls_before


def test_magic_batch_interrupted_pauses_and_says_once_to_resume_with_the_magic(
        shell: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a real SIGINT (the notebook's stop button) while the batch's first job runs a tool
    import threading

    from IPython.utils.capture import capture_output

    import agentnb

    magic = shell.magics_manager.registry["AgentMagic"]
    ws = magic.ws
    stop_asked = threading.Event()
    real_stop = ws.stop

    def stop(job: Any) -> Any:
        stop_asked.set()
        return real_stop(job)

    monkeypatch.setattr(ws, "stop", stop)
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)

    @agentnb.tool(name="TestBatchCtrlC")
    def press_ctrl_c() -> str:
        """Interrupt the notebook."""
        os.kill(os.getpid(), signal.SIGINT)
        return "pressed" if stop_asked.wait(60) else "no stop"

    try:
        script = write_script(tmp_path, "ctrlc", {"work": [call("TestBatchCtrlC"), transition("COMPLETE")]})
        piece = write_piece(tmp_path, "press", {"max_movements": 2, "movements": [
            {"name": "work", "persona": "p", "instruction": "i", "tools": ["TestBatchCtrlC"],
             "permission": "readonly", "rules": [{"condition": "done", "next": "COMPLETE"}]}]})
        shell.user_ns["t_cases"] = CASES
        with capture_output() as cap:
            b = shell.run_line_magic("agent", f"batch t_cases --piece {piece} --model {script} --concurrency 1 "
                                              "--name stopped")
        assert isinstance(b, Batch)
        assert [str(j.status) for j in b.jobs] == ["queued"] * 3  # the first paused after its call, none other began
        said = [line for line in (cap.stdout + cap.stderr).replace("\r", "\n").splitlines()
                if "paused" in line or "interrupted" in line]
        # the bar's final line, then the one line that says how to resume
        assert len(said) == 2 and re.fullmatch(r"batch stopped · paused · 0/3 · 0 ok · 1 paused · 2 not started · "
                                               r"[\d,]+ tokens · \$0 · \d+\.\d s", said[0]), cap.stderr
        assert said[1] == "agentnb: interrupted: 1 running job(s) paused, 3 not finished; resume with %agent batch stopped"
        assert "ws.batch" not in cap.stdout + cap.stderr
    finally:
        signal.signal(signal.SIGINT, old_handler)
