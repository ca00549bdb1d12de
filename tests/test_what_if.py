"""What-if for the ContextManager (docs/fork-compare.md#what-if): ``ws.frames.what_if`` and ``plot_usage(what_if=…)``.

The job below reports its own usage, in a 10,000-token window, over four movement runs (a movement run
twice, so the once-per-run re-arming is seen), so every ratio is known and the expected actions are written
out by hand:

====  ===  ======  ======  ==================================================
call  run  move    prompt  recorded (warn .70, prompt .85, force .95, exh .99)
====  ===  ======  ======  ==================================================
1     1    draft   1000
2     1    draft   3000
3     1    draft   5000    → check
4     2    check   2000
5     2    check   4000    → draft
6     3    draft   3000
7     3    draft   6000
8     3    draft   7200    warn; → check
9     4    check   6500
10    4    check   8600    warn, prompt; → COMPLETE
====  ===  ======  ======  ==================================================
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display in tests; must precede any pyplot import

import numpy as np
import pandas as pd
import pytest
from _scripting import write_piece, write_script

import agentnb
from agentnb import Job, Workspace
from agentnb.engine.context import ContextManager
from agentnb.engine.tokens import counter_for_model
from agentnb.errors import AgentnbError, UsageError
from agentnb.events import ACTIONS
from agentnb.models.messages import AssistantMessage, TokenUsage
from agentnb.views.frames import COLUMNS
from agentnb.views.what_if import WHAT_IF_COLUMNS, simulate

PROMPTS = [1000, 3000, 5000, 2000, 4000, 3000, 6000, 7200, 6500, 8600]
RUNS = [1, 1, 1, 2, 2, 3, 3, 3, 4, 4]

_PIECE = {
    "name": "what-if-probe",
    "max_movements": 6,
    "context": {"window_tokens": 10000},
    "movements": [
        {"name": "draft", "persona": "You draft.", "instruction": "Draft it.", "tools": ["Glob"],
         "permission": "readonly", "max_iterations": 6,
         "rules": [{"condition": "drafted", "next": "check"}], "default_next": "check"},
        {"name": "check", "persona": "You check.", "instruction": "Check it.", "tools": ["Glob"],
         "permission": "readonly", "max_iterations": 6,
         "rules": [{"condition": "needs work", "next": "draft"}, {"condition": "good", "next": "COMPLETE"}],
         "default_next": "COMPLETE"},
    ],
}


def _glob(prompt: int) -> dict[str, Any]:
    return {"tool_calls": [{"name": "Glob", "arguments": {"pattern": "*"}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 10}}


def _to(next_step: str, prompt: int) -> dict[str, Any]:
    return {"tool_calls": [{"name": "transition", "arguments": {"next_step": next_step, "summary": "ok"}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 10}}


def _run(ws: Workspace, folder: Path, draft: list[dict[str, Any]], check: list[dict[str, Any]],
         name: str = "script", window: int = 10000) -> Job:
    piece = write_piece(folder, f"piece-{name}", {**_PIECE, "context": {"window_tokens": window}})
    model = write_script(folder, name, {"draft": draft, "check": check})
    job = ws.run(ws.submit("Probe the context", piece=piece, model=model))
    assert job.status == "succeeded", job.error
    return job


def probe_job(ws: Workspace, folder: Path) -> Job:
    p = PROMPTS
    return _run(ws, folder,
                draft=[_glob(p[0]), _glob(p[1]), _to("check", p[2]), _glob(p[5]), _glob(p[6]), _to("check", p[7])],
                check=[_glob(p[3]), _to("draft", p[4]), _glob(p[8]), _to("COMPLETE", p[9])])


@pytest.fixture
def job(ws: Workspace, tmp_path: Path) -> Job:
    return probe_job(ws, tmp_path / "scripts")


def _listed(df: pd.DataFrame, column: str) -> list[str | None]:
    return [None if pd.isna(v) else str(v) for v in df[column]]


def test_the_record_is_what_the_table_says(ws: Workspace, job: Job) -> None:
    u = ws.frames.usage(job)
    assert u["prompt_tokens"].tolist() == PROMPTS and u["seq"].tolist() == RUNS
    assert u["movement"].tolist() == ["draft"] * 3 + ["check"] * 2 + ["draft"] * 3 + ["check"] * 2
    assert _listed(u, "actions") == [None] * 7 + ["warn", None, "warn,prompt"]


def test_no_settings_reproduce_the_record(ws: Workspace, job: Job) -> None:
    w = ws.frames.what_if(job)
    usage = ws.frames.usage(job)
    assert sorted(w.columns) == sorted(COLUMNS["usage"] + WHAT_IF_COLUMNS)
    pd.testing.assert_frame_equal(w[list(COLUMNS["usage"])], usage)  # the usage frame whole, as it is
    assert _listed(w, "action_recorded") == _listed(usage, "action")
    assert _listed(w, "action_what_if") == _listed(usage, "action")
    assert _listed(w, "actions_what_if") == _listed(usage, "actions")
    assert w["ratio_what_if"].tolist() == usage["ratio"].tolist()
    assert not w["forced_what_if"].any() and not w["first_forced"].any()
    assert w.attrs["what_if"] == {"window": 10000,
                                  "thresholds": {"warn": 0.7, "prompt": 0.85, "force_transition": 0.95,
                                                 "exhausted": 0.99}}
    assert w.attrs["job"] == job.id and w.attrs["thresholds"] == ws.frames.thresholds(job)
    # dtypes: actions as usage's ordered categorical, flags as plain bools
    assert w["action_what_if"].dtype == usage["action"].dtype == w["action_recorded"].dtype
    assert w["actions_what_if"].dtype == "string" and w["ratio_what_if"].dtype == "float64"
    assert w["forced_what_if"].dtype == bool and w["first_forced"].dtype == bool


def test_each_what_if_column_sits_after_its_recorded_twin(ws: Workspace, job: Job) -> None:
    w = ws.frames.what_if(job, window=8000, thresholds={"prompt": 0.8})
    columns = list(w.columns)
    # the usage columns keep their order; each simulated one follows the recorded column it is compared with
    assert [c for c in columns if c not in WHAT_IF_COLUMNS] == list(COLUMNS["usage"])
    for twin, after in {"ratio": ["ratio_what_if"], "action": ["action_recorded", "action_what_if"],
                        "actions": ["actions_what_if"], "forced": ["forced_what_if", "first_forced"]}.items():
        at = columns.index(twin)
        assert columns[at:at + 1 + len(after)] == [twin, *after], columns
    # a frame displayed with pandas' default 20 columns hides the middle: the README's pairs are all there
    assert columns[columns.index("ratio") + 1] == "ratio_what_if"
    # the what-if columns have their twins' dtypes
    for twin, simulated in (("ratio", "ratio_what_if"), ("action", "action_what_if"),
                            ("action", "action_recorded"), ("actions", "actions_what_if")):
        assert w[simulated].dtype == w[twin].dtype, simulated


def test_ratio_what_if_is_rounded_as_the_record_is(ws: Workspace, job: Job, tmp_path: Path) -> None:
    # the same calls really run in a 7,000-token window: their recorded ratio is what the what-if must show
    p = PROMPTS
    real = _run(ws, tmp_path / "seven", name="seven", window=7000,
                draft=[_glob(p[0]), _glob(p[1]), _to("check", p[2]), _glob(p[5]), _glob(p[6]), _to("check", p[7])],
                check=[_glob(p[3]), _to("draft", p[4]), _glob(p[8]), _to("COMPLETE", p[9])])
    recorded = ws.frames.usage(real)["ratio"]
    assert recorded.tolist()[0] == 0.142857  # 1000 / 7000, to 6 places
    simulated = ws.frames.what_if(job, window=7000)["ratio_what_if"]
    assert simulated.tolist() == recorded.tolist()
    # and displayed alike: pandas formats both columns the same way
    assert simulated.to_string(index=False) == recorded.to_string(index=False)


def test_a_smaller_window_by_hand(ws: Workspace, job: Job) -> None:
    w = ws.frames.what_if(job, window=5000)
    all4 = "warn,prompt,force_transition,exhausted"
    # run 1: 0.2, 0.6, 1.0 → all four at call 3; run 2: 0.4, 0.8 → warn again (a new run re-arms);
    # run 3: 0.6, 1.2, 1.44 → all four at call 7 and nothing more at call 8 (each fires once per run);
    # run 4: 1.3, 1.72 → all four at call 9
    assert _listed(w, "actions_what_if") == [None, None, all4, None, "warn", None, all4, None, all4, None]
    assert _listed(w, "action_what_if") == [None, None, "exhausted", None, "warn", None, "exhausted", None,
                                            "exhausted", None]
    assert w["ratio_what_if"].tolist() == pytest.approx([p / 5000 for p in PROMPTS])
    assert w["forced_what_if"].tolist() == [False, False, True, False, False, False, True, False, True, False]
    assert w["first_forced"].tolist() == [False, False, True] + [False] * 7
    # the record is kept beside it
    assert _listed(w, "action_recorded") == [None] * 7 + ["warn", None, "prompt"]
    assert w.attrs["what_if"]["window"] == 5000


def test_other_thresholds_by_hand(ws: Workspace, job: Job) -> None:
    w = ws.frames.what_if(job, thresholds={"warn": 0.3, "prompt": 0.5, "force_transition": 0.65})
    # window 10,000 as recorded; exhausted stays the job's 0.99.  A ratio equal to a threshold fires it.
    # run 1: 0.1, 0.3 (warn), 0.5 (prompt); run 2: 0.2, 0.4 (warn); run 3: 0.3 (warn), 0.6 (prompt),
    # 0.72 (force_transition); run 4: 0.65 (warn, prompt, force_transition), 0.86 (nothing left below 0.99)
    assert _listed(w, "actions_what_if") == [None, "warn", "prompt", None, "warn", "warn", "prompt",
                                             "force_transition", "warn,prompt,force_transition", None]
    assert _listed(w, "action_what_if") == [None, "warn", "prompt", None, "warn", "warn", "prompt",
                                            "force_transition", "force_transition", None]
    assert w["forced_what_if"].tolist() == [False] * 7 + [True, True, False]
    assert w["first_forced"].tolist() == [False] * 7 + [True, False, False]
    assert w.attrs["what_if"] == {"window": 10000, "thresholds": {"warn": 0.3, "prompt": 0.5,
                                                                  "force_transition": 0.65, "exhausted": 0.99}}


def test_window_and_thresholds_together_by_hand(ws: Workspace, job: Job) -> None:
    # a larger window and lower thresholds: ratios are prompt / 20,000
    w = ws.frames.what_if(job, window=20000, thresholds={"warn": 0.1, "prompt": 0.2, "force_transition": 0.3,
                                                         "exhausted": 0.4})
    # run 1: .05, .15 (warn), .25 (prompt); run 2: .10 (warn), .20 (prompt); run 3: .15 (warn), .30
    # (prompt, force_transition), .36; run 4: .325 (warn, prompt, force_transition), .43 (exhausted)
    assert _listed(w, "actions_what_if") == [None, "warn", "prompt", "warn", "prompt", "warn",
                                             "prompt,force_transition", None, "warn,prompt,force_transition",
                                             "exhausted"]
    assert w["forced_what_if"].tolist() == [False] * 6 + [True, False, True, False]
    assert w["first_forced"].tolist() == [False] * 6 + [True, False, False, False]


def _reference(prompts: list[int], runs: list[int], window: int, thresholds: dict[str, float]) -> list[str | None]:
    """What a real ContextManager with those settings fires, fed the same counts (a new one per run)."""
    counter = counter_for_model("gpt-4o")
    out: list[str | None] = []
    cm: ContextManager | None = None
    last = None
    for prompt, run in zip(prompts, runs, strict=True):
        if run != last:
            cm, last = ContextManager(window=window, thresholds=thresholds, counter=counter), run
        assert cm is not None
        decision = cm.after_response(AssistantMessage(""),
                                     TokenUsage(prompt_tokens=prompt, completion_tokens=1))
        out.append(",".join(a for a, _ in decision.fired) or None)
    return out


def _random_thresholds(rng: random.Random) -> dict[str, float]:
    values = sorted(round(rng.uniform(0.05, 1.0), rng.choice([1, 2, 3])) for _ in ACTIONS)
    return dict(zip(ACTIONS, values, strict=True))


def test_equivalent_to_a_real_context_manager_over_random_counts() -> None:
    rng = random.Random(15)
    for _ in range(300):
        runs: list[int] = []
        for seq in range(1, rng.randint(1, 6) + 1):
            runs += [seq] * rng.randint(1, 8)
        prompts = [rng.choice([rng.randint(0, 3000), rng.randint(0, 60_000), 1000 * rng.randint(0, 20)])
                   for _ in runs]
        recorded_window = rng.choice([8192, 10_000, 128_000])
        usage = pd.DataFrame({
            "job": 1, "seq": runs, "prompt_tokens": prompts, "window": recorded_window,
            "ratio": [p / recorded_window for p in prompts],
            "action": pd.Categorical([None] * len(runs), categories=list(ACTIONS), ordered=True)})
        usage.attrs["thresholds"] = _random_thresholds(rng)
        window = rng.choice([None, 256, 1000, 4096, 5000, 9999, 32_768])
        partial = {k: v for k, v in _random_thresholds(rng).items() if rng.random() < 0.5}
        merged = {**usage.attrs["thresholds"], **partial}
        if any(a > b for a, b in zip(list(merged.values()), list(merged.values())[1:], strict=False)):
            continue  # not rising: refused (tested below)
        w = simulate(usage, window=window, thresholds=partial)
        expected = _reference(prompts, runs, window or recorded_window, merged)
        assert _listed(w, "actions_what_if") == expected, (prompts, runs, window, merged)
        assert w["forced_what_if"].tolist() == ["force_transition" in (e or "") for e in expected]


def test_random_jobs_match_a_real_context_manager(ws: Workspace, tmp_path: Path) -> None:
    rng = random.Random(7)
    for n in range(3):
        draft_runs = [rng.randint(1, 4) for _ in range(2)]
        check_runs = [rng.randint(1, 3) for _ in range(2)]
        draws = {"draft": [[rng.randint(100, 9000) for _ in range(k)] for k in draft_runs],
                 "check": [[rng.randint(100, 9000) for _ in range(k)] for k in check_runs]}
        nexts = {"draft": ["check", "check"], "check": ["draft", "COMPLETE"]}
        script = {m: [r for i, run in enumerate(draws[m]) for r in
                      [*(_glob(p) for p in run[:-1]), _to(nexts[m][i], run[-1])]] for m in draws}
        # high recorded thresholds, so the record itself never forces a transition and the runs go as scripted
        piece = write_piece(tmp_path / f"r{n}", "piece", {**_PIECE, "context": {
            "window_tokens": 10000, "thresholds": {"warn": 0.97, "prompt": 0.98, "force_transition": 0.99,
                                                   "exhausted": 1.0}}})
        model = write_script(tmp_path / f"r{n}", "script", script)
        job = ws.run(ws.submit("Probe", piece=piece, model=model))
        assert job.status == "succeeded", job.error
        order = [draws["draft"][0], draws["check"][0], draws["draft"][1], draws["check"][1]]
        prompts = [p for run in order for p in run]
        runs = [i + 1 for i, run in enumerate(order) for _ in run]
        window = rng.choice([2000, 4000, 7000])
        partial = {"warn": 0.3, "prompt": 0.6}
        w = ws.frames.what_if(job, window=window, thresholds=partial)
        assert w["prompt_tokens"].tolist() == prompts and w["seq"].tolist() == runs
        merged = {"warn": 0.3, "prompt": 0.6, "force_transition": 0.99, "exhausted": 1.0}
        assert _listed(w, "actions_what_if") == _reference(prompts, runs, window, merged)


def test_a_forks_re_served_calls_use_ratio_times_window(ws: Workspace, job: Job) -> None:
    fork = ws.fork(job, at=3)
    assert fork.status == "succeeded", fork.error
    usage = ws.frames.usage(fork)
    # runs 1–2 re-served: nothing spent, the context kept in ratio and window
    assert usage["prompt_tokens"].tolist() == [0] * 5 + PROMPTS[5:]
    assert usage["ratio"].tolist() == pytest.approx([p / 10000 for p in PROMPTS])
    for settings in ({"window": 5000}, {"thresholds": {"warn": 0.3, "prompt": 0.5, "force_transition": 0.65}},
                     {}):
        w, original = ws.frames.what_if(fork, **settings), ws.frames.what_if(job, **settings)
        # the fork's simulation is the original's: its re-served calls count with the prompts they had
        for column in ("actions_what_if", "action_what_if", "action_recorded"):
            assert _listed(w, column) == _listed(original, column), (settings, column)
        assert w["ratio_what_if"].tolist() == pytest.approx(original["ratio_what_if"].tolist())
        assert w["forced_what_if"].tolist() == original["forced_what_if"].tolist()
        assert w["first_forced"].tolist() == original["first_forced"].tolist()
    assert ws.frames.what_if(fork, window=5000)["first_forced"].tolist() == [False, False, True] + [False] * 7


def test_a_re_served_prompt_is_rounded_from_ratio_times_the_recorded_window() -> None:
    # 1234 / 8192 recorded to 6 places is 0.150635; × 8192 = 1234.0 after rounding
    usage = pd.DataFrame({"job": 1, "seq": [1, 1], "prompt_tokens": [0, 0], "window": 8192,
                          "ratio": [round(1234 / 8192, 6), round(5000 / 8192, 6)],
                          "action": pd.Categorical([None, None], categories=list(ACTIONS), ordered=True)})
    w = simulate(usage, window=2000, replayed=[True, True])
    assert w["ratio_what_if"].tolist() == [1234 / 2000, 5000 / 2000]
    # not re-served: a 0-token call stays 0
    assert simulate(usage, window=2000, replayed=[False, False])["ratio_what_if"].tolist() == [0.0, 0.0]
    # without the marks, a call with 0 tokens at a ratio above 0 can only be a re-served one
    assert simulate(usage, window=2000)["ratio_what_if"].tolist() == [1234 / 2000, 5000 / 2000]


@pytest.mark.parametrize("window", [0, 255, -8000, 1.5, 8000.0, "8000", True])
def test_a_bad_window_is_one_line(ws: Workspace, job: Job, window: Any) -> None:
    with pytest.raises(UsageError) as err:
        ws.frames.what_if(job, window=window)
    message = str(err.value)
    assert "\n" not in message and f"window={window!r}" in message and "whole number of tokens ≥ 256" in message


@pytest.mark.parametrize(("thresholds", "said"), [
    ({"warm": 0.5}, "unknown action(s) ['warm']; allowed: warn, prompt, force_transition, exhausted"),
    ({"warn": 0}, "context.thresholds.warn=0; allowed: a number between 0 (excluded) and 1"),
    ({"prompt": 1.5}, "context.thresholds.prompt=1.5; allowed: a number between 0 (excluded) and 1"),
    ({"warn": "high"}, "context.thresholds.warn='high'"),
    ([0.5], "allowed: a mapping of warn, prompt, force_transition, exhausted to ratios"),
    # merged over the job's thresholds (prompt 0.85), warn 0.9 would not rise
    ({"warn": 0.9}, "warn (0.9) is above prompt (0.85); allowed: warn ≤ prompt ≤ force_transition ≤ exhausted"),
])
def test_bad_thresholds_are_refused_as_context_is(ws: Workspace, job: Job, thresholds: Any, said: str) -> None:
    with pytest.raises(UsageError) as err:
        ws.frames.what_if(job, thresholds=thresholds)
    assert said in str(err.value) and "\n" not in str(err.value)
    # the same words as context= at submit
    with pytest.raises(ValueError) as submitted:
        ws.submit("x", piece="single", model="demo", context={"thresholds": thresholds})
    assert str(submitted.value).split(" (the ")[0] == str(err.value).split(" (the ")[0]


def test_what_if_needs_a_job_and_writes_nothing(ws: Workspace, job: Job) -> None:
    before = (ws.frames.jobs().to_dict("records"), len(ws.events(job)))
    with pytest.raises(AgentnbError, match="no job 999"):
        ws.frames.what_if(999)
    with pytest.raises(UsageError, match="allowed: a Job or a job id"):
        ws.frames.what_if(None)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        ws.frames.what_if(job, window=10)
    ws.frames.what_if(job, window=5000)
    after = (ws.frames.jobs().to_dict("records"), len(ws.events(job)))
    assert after[1] == before[1] and len(after[0]) == len(before[0])


def test_a_job_without_calls_gives_an_empty_frame(ws: Workspace, job: Job) -> None:
    queued = ws.submit("not yet", piece="single", model="demo")
    w = ws.frames.what_if(queued, window=4000)
    assert w.empty and list(w.columns) == list(ws.frames.what_if(job).columns)  # in the same order
    assert w.attrs["what_if"]["window"] == 4000
    fig = agentnb.plot_usage(queued, what_if={"window": 4000})
    assert not fig.axes  # the no-calls text, as without what_if


# -- the plot --------------------------------------------------------------------------------------------------

def _by_gid(ax: Any) -> dict[str, Any]:
    return {line.get_gid(): line for line in ax.lines if line.get_gid()}


def _what_if_offsets(ax: Any, job_id: int) -> list[tuple[float, float]]:
    found = [c for c in ax.collections if c.get_gid() == f"what_if:action:{job_id}"]
    return sorted((float(x), float(y)) for c in found for x, y in c.get_offsets())


def test_plot_usage_overlays_the_what_if(ws: Workspace, job: Job) -> None:
    fig = agentnb.plot_usage(job, what_if={"window": 5000, "thresholds": {"warn": 0.5}})
    ax = fig.axes[0]
    lines = _by_gid(ax)
    # the recorded figure is all there
    assert lines["threshold:warn"].get_ydata()[0] == pytest.approx(0.7)
    assert {"movement:1", "movement:2", "movement:3", "movement:4"} <= set(lines)
    # the simulated ratio, dashed
    ratio = lines[f"what_if:ratio:{job.id}"]
    assert ratio.get_linestyle() == "--"
    assert np.allclose(ratio.get_xdata(), range(1, 11)) and np.allclose(ratio.get_ydata(), [p / 5000 for p in PROMPTS])
    # the what-if thresholds: warn moved to 50 %, the others the job's
    for name, value in {"warn": 0.5, "prompt": 0.85, "force_transition": 0.95, "exhausted": 0.99}.items():
        line = lines[f"what_if:threshold:{name}"]
        assert line.get_ydata()[0] == pytest.approx(value)
        assert line.get_linestyle() == "--"  # dashed (a longer dash than the recorded lines')
    # hollow markers where the actions would fire: run 1 calls 2 (warn at 0.6) and 3 (the rest at 1.0),
    # run 2 call 5 (warn at 0.8), run 3 calls 6 (warn at 0.6) and 7 (the rest at 1.2), run 4 call 9 (all at 1.3)
    expected = [(2, 0.6), (3, 1.0), (5, 0.8), (6, 0.6), (7, 1.2), (9, 1.3)]
    # as arrays: pytest.approx compares no nested sequences (pytest 9.2 refuses a list of tuples)
    assert np.array(sorted(set(_what_if_offsets(ax, job.id)))) == pytest.approx(np.array(expected))
    for c in ax.collections:
        if c.get_gid() == f"what_if:action:{job.id}":
            assert np.all(c.get_facecolors()[:, 3] == 0)  # hollow
    labels = sorted(t.get_text() for t in ax.texts if t.get_gid() == "label:what_if")
    assert labels == sorted(["warn", "prompt,force_transition,exhausted", "warn", "warn",
                             "prompt,force_transition,exhausted", "warn,prompt,force_transition,exhausted"])
    assert lines["what_if:first_forced"].get_xdata()[0] == 3
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "what-if (window 5000)" in legend and "what-if warn 50%" in legend
    assert "exhausted would fire (what-if)" in legend and "what-if: first forced transition" in legend
    # the y axis reaches the highest simulated ratio
    assert ax.get_ylim()[1] >= 8600 / 5000


def test_plot_usage_without_what_if_has_none_of_it(ws: Workspace, job: Job) -> None:
    fig = agentnb.plot_usage(job)
    ax = fig.axes[0]
    assert not [g for g in _by_gid(ax) if g.startswith("what_if")]
    assert not [c for c in ax.collections if (c.get_gid() or "").startswith("what_if")]
    assert not [t for t in ax.texts if t.get_gid() == "label:what_if"]
    assert not [t.get_text() for t in ax.get_legend().get_texts() if "what-if" in t.get_text()]


def test_plot_usage_takes_a_what_if_frame(ws: Workspace, job: Job) -> None:
    settings = {"window": 8000, "thresholds": {"warn": 0.3, "prompt": 0.5, "force_transition": 0.65}}
    frame = ws.frames.what_if(job, **settings)
    expected = [(float(r.call), float(r.ratio_what_if)) for r in frame.itertuples() if pd.notna(r.action_what_if)]
    from_settings = agentnb.plot_usage(job, what_if=settings)
    for fig in (agentnb.plot_usage(frame), agentnb.plot_usage(job, what_if=frame),
                agentnb.plot_usage(ws.frames.usage(job), what_if=settings), from_settings):
        ax = fig.axes[0]
        assert np.allclose(_by_gid(ax)[f"what_if:ratio:{job.id}"].get_ydata(), frame["ratio_what_if"])
        assert np.array(sorted(set(_what_if_offsets(ax, job.id)))) == pytest.approx(np.array(sorted(expected)))
        assert _by_gid(ax)["what_if:threshold:warn"].get_ydata()[0] == pytest.approx(0.3)
        assert "what-if (window 8000)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_plot_of_a_fork_what_if(ws: Workspace, job: Job) -> None:
    fork = ws.fork(job, at=3)
    fig = agentnb.plot_usage(fork, what_if={"window": 5000})
    ratio = _by_gid(fig.axes[0])[f"what_if:ratio:{fork.id}"]
    # re-served calls (0 tokens recorded) are drawn at the context they had
    assert np.allclose(ratio.get_ydata(), [p / 5000 for p in PROMPTS])


@pytest.mark.parametrize(("what_if", "said"), [
    ({"windw": 4000}, "unknown key(s) ['windw']; allowed: window, thresholds"),
    (4000, "what_if=4000; allowed: a dict with window= and/or thresholds="),
    ({"window": 10}, "window=10; allowed: a whole number of tokens ≥ 256"),
    ({"thresholds": {"warn": 2}}, "context.thresholds.warn=2"),
])
def test_plot_usage_refuses_a_bad_what_if(ws: Workspace, job: Job, what_if: Any, said: str) -> None:
    with pytest.raises(UsageError) as err:
        agentnb.plot_usage(job, what_if=what_if)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_plot_usage_refuses_a_what_if_frame_of_other_calls(ws: Workspace, job: Job, tmp_path: Path) -> None:
    other = _run(ws, tmp_path / "other", draft=[_to("check", 100)], check=[_to("COMPLETE", 200)], name="other")
    with pytest.raises(UsageError, match="not of the calls plotted"):
        agentnb.plot_usage(job, what_if=ws.frames.what_if(other))
    with pytest.raises(UsageError, match="lacks"):
        agentnb.plot_usage(job, what_if=ws.frames.usage(job))


def test_plot_what_if_thresholds_start_from_the_ones_drawn(ws: Workspace, job: Job) -> None:
    # plot_usage's thresholds= stands for the job's; the what-if is merged over it, as for a frame
    fig = agentnb.plot_usage(job, thresholds={"warn": 0.5}, what_if={"window": 5000, "thresholds": {"prompt": 0.6}})
    lines = _by_gid(fig.axes[0])
    assert lines["threshold:warn"].get_ydata()[0] == pytest.approx(0.5)
    assert lines["what_if:threshold:warn"].get_ydata()[0] == pytest.approx(0.5)
    assert lines["what_if:threshold:prompt"].get_ydata()[0] == pytest.approx(0.6)
    # run 1 at window 5000: 0.2, 0.6 (warn and prompt), 1.0 (force_transition, exhausted)
    texts = [t.get_text() for t in fig.axes[0].texts if t.get_gid() == "label:what_if"]
    assert "warn,prompt" in texts and "force_transition,exhausted" in texts


def _label_boxes(fig: Any) -> list[tuple[Any, Any]]:
    """Each visible call label of the ratio panel with the extent of its text (without its leader line)."""
    from matplotlib.text import Text

    return [(t, Text.get_window_extent(t)) for t in fig.axes[0].texts if t.get_text() and t.get_visible()]


@pytest.mark.parametrize(("what_if", "figsize"), [
    # call 10: the record's warn,prompt and the what-if's warn at the very same marker
    ({"thresholds": {"prompt": 0.9}}, (10.0, 6.5)),
    ({"thresholds": {"prompt": 0.9}}, (8.0, 5.0)),
    ({"window": 9000}, (10.0, 6.5)),
    # a legend taller than the ratio panel: constrained layout moved the axes at every later draw
    ({"window": 8000, "thresholds": {"warn": 0.3, "prompt": 0.5, "force_transition": 0.65}}, (8.0, 5.0)),
    ({"window": 8000, "thresholds": {"warn": 0.3, "prompt": 0.5, "force_transition": 0.65}}, (7.0, 4.5)),
])
def test_what_if_labels_never_overlap_and_stay_inside(ws: Workspace, job: Job, tmp_path: Path,
                                                      what_if: dict[str, Any], figsize: tuple[float, float]) -> None:
    """Labels of the same or nearby calls (the record's and the what-if's) never overlap, however often and at
    whatever density the figure is drawn (a notebook draws it again on every display), and stay inside the
    ratio panel and the figure."""
    fig = agentnb.plot_usage(job, what_if=what_if, figsize=figsize)
    for _ in range(2):  # shown twice (the PNG at twice the density), then saved as a notebook export does
        fig._repr_png_()
    fig.savefig(tmp_path / "what-if.png", dpi=100)
    inside, whole = fig.axes[0].get_window_extent(), fig.bbox
    boxes = _label_boxes(fig)
    assert len(boxes) >= 4
    for t, box in boxes:
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, t.get_text()
        assert whole.contains(box.x0, box.y0) and whole.contains(box.x1, box.y1), t.get_text()
    for (a, ba), (b, bb) in itertools.combinations(boxes, 2):
        assert not ba.overlaps(bb), f"{a.get_text()!r} at call {a.xy[0]} overlaps {b.get_text()!r} at call {b.xy[0]}"


def test_labels_at_one_marker_are_stacked_in_one_column(ws: Workspace, tmp_path: Path) -> None:
    """The README's what-if on the demo job: at call 8 the record fired warn and the what-if would fire
    warn,prompt, at markers a pixel apart.  Both labels are shown one above the other on the same side, the
    what-if's (the higher marker) outermost, apart by more than their boxes' pads, not one on each side of
    the markers where they ran together."""
    job = ws.run(ws.submit("Summarise the inputs", piece="plan-implement-verify", model="demo"))
    fig = agentnb.plot_usage(job, what_if={"window": 8000, "thresholds": {"prompt": 0.8}})
    fig._repr_png_()
    fig.savefig(tmp_path / "readme-what-if.png", dpi=100)
    at_8 = {t.get_gid(): (t, box) for t, box in _label_boxes(fig) if t.xy[0] == 8}
    (record, rb), (simulated, sb) = at_8["label:action"], at_8["label:what_if"]
    assert (record.get_text(), simulated.get_text()) == ("warn", "warn,prompt")
    assert record.get_horizontalalignment() == simulated.get_horizontalalignment()
    edge = "x0" if record.get_horizontalalignment() == "left" else "x1"
    assert getattr(rb, edge) == pytest.approx(getattr(sb, edge), abs=1)  # one column
    up = record.get_verticalalignment() == "bottom"
    gap = sb.y0 - rb.y1 if up else rb.y0 - sb.y1
    assert gap >= 6 * fig.dpi / 72 - 1


def test_labels_of_any_number_of_jobs_at_one_call_are_stacked(ws: Workspace, tmp_path: Path) -> None:
    """Four jobs with the same record: at each call where an action fired, four labels at one marker."""
    for n in range(4):
        probe_job(ws, tmp_path / f"scripts-{n}")
    fig = agentnb.plot_usage(ws.frames.usage(), what_if={"thresholds": {"prompt": 0.9}})
    fig.savefig(tmp_path / "four.png", dpi=100)
    boxes = _label_boxes(fig)
    at_10 = [b for t, b in boxes if t.xy[0] == 10 and t.get_gid() in ("label:action", "label:what_if")]
    assert len(at_10) == 8  # four jobs, each its record's label and its what-if's
    for (a, ba), (b, bb) in itertools.combinations(boxes, 2):
        assert not ba.overlaps(bb), f"{a.get_text()!r} overlaps {b.get_text()!r}"
