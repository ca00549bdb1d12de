"""A batch's uncertainty (docs/design-lab.md#confidence-intervals, #paired-comparison): the summary's bootstrap
intervals and the paired comparison against a baseline, checked against numpy by hand on the same frame, for
coverage on simulated batches, and through ``ws.batch`` on scripted models."""

from __future__ import annotations

import html
import itertools
import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import pytest
from _batching import answering_model
from _scripting import call, transition, write_script

import agentnb
from agentnb import AgentnbError, BatchComparison, Workspace
from agentnb.batch_compare import compare_batch
from agentnb.views.batch_frames import batch_summary
from agentnb.views.batch_stats import Settings, cluster_interval, cluster_intervals, difference_interval, min_cases
from agentnb.views.batch_stats import paired_p_value as p_value

# -- frames built by hand ----------------------------------------------------------------------------------------


def _frame(cases: int, epochs: int | None, seed: int = 7, effect: float = 0.4) -> pd.DataFrame:
    """A batch frame of two variants: each case has a difficulty shared by its epochs and variants (so the
    epochs of a case are far from independent), ``grade`` is the difficulty plus ``effect`` in variant 1 and
    noise; tokens are skewed (lognormal per case).  ``epochs=None``: one job per case, no epoch column."""
    rng = np.random.default_rng(seed)
    level = rng.normal(0, 1.0, cases)
    size = rng.lognormal(7, 1.5, cases)
    rows, job = [], 0
    for c in range(cases):
        for v in (0, 1):
            for e in range(epochs or 1):
                job += 1
                rows.append({"case": c, **({"epoch": e} if epochs else {}), "variant": v,
                             "variant_label": f"v{v}", "piece": "single", "model": f"m{v}", "job": job,
                             "status": "succeeded", "total_tokens": int(size[c] * (1.3 if v else 1) + rng.integers(50)),
                             "cost_usd": 0.0, "seconds": 1.0 + e, "grade": level[c] + effect * v + rng.normal(0, 0.3),
                             "passed": bool(level[c] + effect * v > 0)})
    frame = pd.DataFrame(rows).astype({"grade": "Float64", "passed": "boolean", "total_tokens": "Int64",
                                       "cost_usd": "Float64", "seconds": "Float64"})
    frame.attrs.update(batch="hand", scores=["grade", "passed"])
    return frame


def _percentile_bootstrap(sums: np.ndarray, counts: np.ndarray, draws: int, seed: int,
                          level: float = 0.95) -> tuple[float, float, float]:
    """The cluster percentile bootstrap of sum/count by hand: (low, high, standard error)."""
    idx = np.random.default_rng(seed).integers(0, len(sums), (draws, len(sums)))
    stat = sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
    low, high = np.percentile(stat, [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high), float(stat.std(ddof=1))


def test_summary_intervals_are_the_cluster_percentile_bootstrap_over_cases() -> None:
    frame = _frame(cases=15, epochs=3)
    draws = 20000
    summary = batch_summary(None, frame, stats=Settings(n_resamples=draws, seed=1))
    assert summary.attrs["stats"] == "95% CI, percentile bootstrap over cases, 20,000 resamples, seed 1"
    for measure, column in (("mean_grade", "grade"), ("mean_tokens", "total_tokens"), ("mean_passed", "passed")):
        for v, row in summary.iterrows():
            rows = frame[frame["variant"] == v]
            per_case = rows.groupby("case")[column]
            sums = per_case.sum().to_numpy(dtype=float)
            counts = per_case.count().to_numpy(dtype=float)
            low, high, se = _percentile_bootstrap(sums, counts, draws, seed=99)
            width = high - low
            assert row[measure] == pytest.approx(rows[column].astype(float).mean())
            # two independent sets of 20,000 draws: their ends agree to well under 3 % of the interval's width
            assert abs(row[f"{measure}_ci_low"] - low) < 0.03 * width, (measure, v)
            assert abs(row[f"{measure}_ci_high"] - high) < 0.03 * width, (measure, v)
            assert row[f"{measure}_se"] == pytest.approx(se, rel=0.03)
            # what the check can tell apart: the basic bootstrap (2·mean − quantiles) on the skewed tokens, and
            # resampling jobs rather than cases (epochs of a case as if independent: far too narrow)
            if measure == "mean_tokens":
                basic = 2 * row[measure] - high, 2 * row[measure] - low
                assert abs(row[f"{measure}_ci_low"] - basic[0]) > 0.05 * width
            jobs = rows[column].astype(float).to_numpy()
            naive = _percentile_bootstrap(jobs, np.ones_like(jobs), draws, seed=5)
            if measure == "mean_grade":
                assert naive[1] - naive[0] < 0.75 * width
    # seconds: over the ended jobs, the same way; the same seed gives the same numbers, another seed others
    again = batch_summary(None, frame, stats=Settings(n_resamples=draws, seed=1))
    pd.testing.assert_frame_equal(summary, again)
    other = batch_summary(None, frame, stats=Settings(n_resamples=draws, seed=2))
    assert other.loc[0, "mean_grade_ci_low"] != summary.loc[0, "mean_grade_ci_low"]
    assert summary.loc[0, "mean_seconds"] == pytest.approx(2.0)


def test_one_epoch_per_case_is_the_ordinary_bootstrap_and_every_mean_has_its_interval() -> None:
    frame = _frame(cases=12, epochs=None)
    assert "epoch" not in frame.columns
    summary = batch_summary(None, frame, stats=Settings(n_resamples=20000, seed=3))
    means = ["mean_grade", "mean_passed", "mean_tokens", "mean_cost_usd", "mean_seconds"]
    for mean in means:
        at = list(summary.columns).index(mean)
        assert list(summary.columns)[at + 1:at + 4] == [f"{mean}_se", f"{mean}_ci_low", f"{mean}_ci_high"]
    grades = frame.loc[frame["variant"] == 1, "grade"].astype(float).to_numpy()
    low, high, _se = _percentile_bootstrap(grades, np.ones_like(grades), 20000, seed=4)
    assert summary.loc[1, "mean_grade_ci_low"] == pytest.approx(low, abs=0.03 * (high - low))
    assert summary.loc[1, "mean_grade_ci_high"] == pytest.approx(high, abs=0.03 * (high - low))
    # every job costs the same: the interval is that value, the standard error 0 (nothing to resample)
    assert summary.loc[0, ["mean_cost_usd", "mean_cost_usd_se", "mean_cost_usd_ci_low"]].tolist() == [0, 0, 0]
    # one case: a mean but no interval
    one = batch_summary(None, frame[frame["case"] == 0])
    assert one.loc[0, "mean_grade"] == pytest.approx(float(frame.loc[0, "grade"]))
    assert one[["mean_grade_se", "mean_grade_ci_low", "mean_grade_ci_high"]].isna().all().all()


def _by_hand_p(d: np.ndarray) -> float:
    """The two-sided sign-flip permutation p-value over all 2^n sign patterns: |mean| at least the observed."""
    observed = abs(d.mean())
    flips = np.array(list(itertools.product((1.0, -1.0), repeat=len(d))))
    stats = np.abs((flips * d).mean(axis=1))
    return float(np.mean(stats >= observed - 1e-12 * max(1.0, observed)))


def test_paired_comparison_against_numpy_by_hand_with_epochs_averaged_within_a_case() -> None:
    frame = _frame(cases=10, epochs=3, effect=0.25)
    source = SimpleNamespace(frame=frame, name="hand")
    c = compare_batch(source, baseline="v0", n_resamples=20000, seed=5)
    assert isinstance(c, BatchComparison)
    assert list(c.frame["measure"]) == ["grade", "passed", "cost_usd", "total_tokens"]
    assert list(c.frame["better"]) == ["higher", "true", "lower", "lower"]
    for _, row in c.frame.iterrows():
        m = str(row["measure"])
        means = frame.groupby(["variant", "case"])[m].mean().astype(float).unstack("case")
        d = (means.loc[1] - means.loc[0]).to_numpy()  # each case's epochs averaged first, then paired
        assert row["n"] == 10 and row["diff"] == pytest.approx(d.mean())
        assert row["baseline_mean"] == pytest.approx(means.loc[0].mean())
        # 2^10 = 1,024 sign patterns ≤ 20,000 draws: scipy enumerates them, exactly as by hand
        assert row["p_value"] == pytest.approx(_by_hand_p(d), abs=1e-12)
        assert row["test"] == "paired permutation (sign-flip)"
        sign = -1 if m in ("cost_usd", "total_tokens") else 1
        tied = np.isclose(d, 0, atol=1e-12)
        assert (row["better_cases"], row["worse_cases"], row["tied_cases"]) == (
            int(((sign * d) > 0).sum() - (tied & (sign * d > 0)).sum()), int(((sign * d) < 0).sum()), int(tied.sum()))
        if np.ptp(d) > 0:
            idx = np.random.default_rng(11).integers(0, 10, (20000, 10))
            low, high = np.percentile(d[idx].mean(axis=1), [2.5, 97.5])
            assert abs(row["ci_low"] - low) < 0.03 * (high - low) and abs(row["ci_high"] - high) < 0.03 * (high - low)
    grade = c.frame.set_index("measure").loc["grade"]
    tokens = c.frame.set_index("measure").loc["total_tokens"]
    assert grade["verdict"] == "better" and grade["ci_low"] > 0 and grade["p_value"] < 0.05
    assert tokens["verdict"] == "worse" and tokens["worse_cases"] == 10  # 30 % more tokens on every case
    assert c.frame.set_index("measure").loc["cost_usd", "tied_cases"] == 10
    # the per-case table: the regressions first (scores' before tokens'), the largest first
    cases = c.cases
    assert list(cases.columns) == ["variant", "variant_label", "case", "measure", "better", "outcome",
                                   "baseline_value", "value", "diff", "baseline_job", "job", "epochs"]
    outcomes = list(cases["outcome"])
    assert outcomes == sorted(outcomes, key=["worse", "tied", "better"].index)
    worse_grades = cases[(cases["outcome"] == "worse") & (cases["measure"] == "grade")]
    assert list(worse_grades["diff"]) == sorted(worse_grades["diff"])
    first_tokens = list(cases["measure"][cases["outcome"] == "worse"]).index("total_tokens")
    assert set(cases["measure"][cases["outcome"] == "worse"][:first_tokens]) <= {"grade", "passed"}
    # each case's links are its first epoch's jobs
    row = cases.iloc[0]
    firsts = frame[(frame["case"] == row["case"]) & (frame["epoch"] == 0)].set_index("variant")["job"]
    assert (row["baseline_job"], row["job"], row["epochs"]) == (firsts[0], firsts[1], 3)


def test_too_few_cases_for_the_test_is_said_and_the_threshold_is_where_p_can_reach_alpha() -> None:
    assert min_cases(0.05) == 6 and min_cases(0.01) == 8
    # every case better: the smallest p the test can give with n cases is 2/2^n
    s = Settings()
    assert float(p_value(np.ones(5), s)) == pytest.approx(2 / 2 ** 5)  # 0.0625: never below 0.05
    assert float(p_value(np.ones(6), s)) == pytest.approx(2 / 2 ** 6)  # 0.031
    for cases, verdict in ((5, "too few cases"), (6, "better")):
        frame = _frame(cases=cases, epochs=None, effect=0.0)
        frame.loc[frame["variant"] == 1, "grade"] = frame.loc[frame["variant"] == 0, "grade"].to_numpy() + 1.0
        c = compare_batch(SimpleNamespace(frame=frame, name="few"), baseline=0)
        assert c.frame.set_index("measure").loc["grade", "verdict"] == verdict
        page = c._repr_html_()
        assert ("Too few cases for the test to mean anything: with n = 5 paired cases the smallest p-value a paired "
                "permutation test can give is 0.0625" in html.unescape(page)) is (cases == 5)


def test_a_measure_with_no_value_on_one_side_says_no_shared_cases() -> None:
    frame = _frame(cases=8, epochs=2)
    frame.loc[frame["variant"] == 1, "cost_usd"] = pd.NA  # an unknown price
    c = compare_batch(SimpleNamespace(frame=frame, name="nocost"), baseline=0)
    cost = c.frame.set_index("measure").loc["cost_usd"]
    assert cost["verdict"] == "no shared cases" and cost["n"] == 0
    assert cost[["diff", "ci_low", "ci_high", "p_value"]].isna().all()
    assert not (c.cases["measure"] == "cost_usd").any()
    assert "data-measure='cost_usd' data-verdict='no shared cases'" in c._repr_html_()
    summary = batch_summary(None, frame)
    assert summary.loc[1, ["mean_cost_usd", "mean_cost_usd_se", "mean_cost_usd_ci_low"]].isna().all()
    assert summary.loc[0, "mean_cost_usd_ci_low"] == 0.0


# -- coverage on simulated batches ----------------------------------------------------------------------------------

def test_coverage_of_the_intervals_and_the_tests_level_on_500_simulated_batches() -> None:
    """500 batches of 25 cases × 3 epochs with a known effect: the 95 % intervals cover it 90–98 % of the time,
    and with no effect the test rejects at 5 % about 5 % of the time (vectorised: a few seconds)."""
    rng = np.random.default_rng(2026)
    s = Settings(n_resamples=999, seed=8)
    batches, cases, epochs, effect = 500, 25, 3, 0.5
    level = rng.normal(0, 1, (batches, cases, 1))  # the case's difficulty, shared by both variants
    base = level + rng.normal(0, 0.8, (batches, cases, epochs))
    other = level + effect + rng.standard_t(4, (batches, cases, epochs)) * 0.8  # heavier tails
    d = other.mean(axis=2) - base.mean(axis=2)  # epochs averaged within a case first, as compare does
    _mean, low, high = difference_interval(d, s)
    coverage = float(np.mean((low <= effect) & (effect <= high)))
    assert 0.90 <= coverage <= 0.98, coverage
    null = d - effect  # the same noise, no effect
    rejected = float(np.mean(p_value(null, s) < 0.05))
    assert 0.02 <= rejected <= 0.08, rejected
    assert float(np.mean(p_value(d, s) < 0.05)) > 0.7  # and the effect is found most of the time
    # the summary's clustered interval of a mean: cases of unequal sizes (a value missing here and there)
    truth = 0.6
    values = rng.normal(0, 1, (batches, cases, 1)) + truth + rng.normal(0, 0.5, (batches, cases, epochs))
    counts = rng.integers(1, epochs + 1, (batches, cases))
    sums = np.where(np.arange(epochs) < counts[..., None], values, 0.0).sum(axis=2)
    _mean, _se, low, high = cluster_intervals(sums, counts, s)
    coverage = float(np.mean((low <= truth) & (truth <= high)))
    assert 0.90 <= coverage <= 0.98, coverage
    # as one batch's summary computes it: the same interval
    one = cluster_interval(sums[0], counts[0], s)
    assert (one.low, one.high) == pytest.approx((float(cluster_intervals(sums[:1], counts[:1], s)[2][0]),
                                                 float(cluster_intervals(sums[:1], counts[:1], s)[3][0])), rel=0.05)


# -- through ws.batch ------------------------------------------------------------------------------------------------

def _two_models(ws: Workspace, tmp_path: Path, cases: int, name: str = "ab") -> Any:
    """Eight cases under two scripted models: m2 writes "42" (right for case 2 only, m1's "41" for case 1
    only), takes 400 more tokens a job, and its grade is one point higher on every case."""
    m1, m2 = answering_model(tmp_path, "m1", "41"), answering_model(tmp_path, "m2", "42", prompt=300)
    return ws.batch([{"instruction": f"Answer {i}", "expected": str(40 + i)} for i in range(cases)], piece="single",
                    model=[m1, m2], name=name, progress=False, scorers={
                        "ok": lambda j: (j.output / "answer.txt").read_text() == j.expected,
                        "grade": lambda j: j.case + (1.0 if "42" in (j.summary or "") else 0.0)})


def test_compare_a_real_batch_names_the_regressions_and_links_their_jobs(ws: Workspace, tmp_path: Path) -> None:
    b = _two_models(ws, tmp_path, 8)
    c = b.compare(baseline="single · scripted:m1.yaml")
    assert c.baseline == 0 and c.baseline_label == "single · scripted:m1.yaml"
    rows = c.frame.set_index("measure")
    assert rows.loc["grade", "verdict"] == "better" and rows.loc["grade", "diff"] == 1.0
    assert rows.loc["grade", "p_value"] == pytest.approx(2 / 2 ** 8)
    assert (rows.loc["grade", "ci_low"], rows.loc["grade", "ci_high"]) == (1.0, 1.0)
    assert rows.loc["total_tokens", "verdict"] == "worse" and rows.loc["total_tokens", "diff"] == 400
    ok = rows.loc["ok"]
    assert (ok["better_cases"], ok["worse_cases"], ok["tied_cases"], ok["verdict"]) == (1, 1, 6, "no clear difference")
    assert ok["p_value"] == 1.0 and ok["better"] == "true"
    # the one case whose score got worse comes first, with its two jobs
    frame = b.frame
    job = {(int(r["case"]), int(r["variant"])): int(r["job"]) for _, r in frame.iterrows()}
    first = c.cases.iloc[0]
    assert (first["case"], first["measure"], first["outcome"]) == (1, "ok", "worse")
    assert (first["baseline_job"], first["job"]) == (job[1, 0], job[1, 1])
    page = c._repr_html_()
    assert re.search(r"<tr data-variant='1' data-measure='grade' data-verdict='better' style='color:#2e8b57", page)
    assert re.search(r"<tr data-variant='1' data-measure='total_tokens' data-verdict='worse' style='color:#b00020",
                     page)
    assert "data-measure='ok' data-verdict='no clear difference'>" in page
    a, v = job[1, 0], job[1, 1]
    assert (f"<li data-case='1'>case 1, ok: true → false — <code>%agent show {a}</code> · <code>%agent show {v}"
            f"</code> · <code>%agent compare {a} {v}</code></li>") in page
    assert "scores: higher is better (a yes/no score: true), cost and tokens: lower is better" in page
    assert "Too few cases" not in page
    # the same baseline by number, by its model, or as text of its number
    for same in (0, "0", b.variants[0]["model"]):
        pd.testing.assert_frame_equal(b.compare(baseline=same).frame, c.frame)
    assert "against baseline 0 (single · scripted:m1.yaml)" in c.to_text()


def test_summary_html_shows_each_mean_plus_minus_half_its_interval_and_says_what_that_is(
        ws: Workspace, tmp_path: Path) -> None:
    b = _two_models(ws, tmp_path, 6, name="pm")
    summary, html_page = b.summary(), b._repr_html_()
    page = re.sub(r"</?span[^>]*>", "", html_page)  # the ± part is a smaller span that may wrap under the mean
    assert "<span style='white-space:nowrap;font-size:85%;color:#666'>± " in html_page
    for _, r in summary.iterrows():
        half = (r["mean_grade_ci_high"] - r["mean_grade_ci_low"]) / 2
        cell = (f"title='CI {r['mean_grade_ci_low']:.2f} to {r['mean_grade_ci_high']:.2f} · SE "
                f"{r['mean_grade_se']:.2f}'>{r['mean_grade']:.2f} ± {half:.2f}</td>")
        assert cell in page
        assert f">{r['mean_tokens']:,.0f} ± 0</td>" in page  # every job of a variant takes the same tokens
    assert ("± is half the width of the 95% CI, percentile bootstrap over cases, 9,999 resamples, seed 0 (clustered "
            "by case when cases ran several epochs)") in page
    assert b.summary(confidence=0.8, n_resamples=500, seed=3).attrs["stats"] == (
        "80% CI, percentile bootstrap over cases, 500 resamples, seed 3")
    narrower = b.summary(confidence=0.8)
    assert (narrower["mean_grade_ci_high"] - narrower["mean_grade_ci_low"] <
            summary["mean_grade_ci_high"] - summary["mean_grade_ci_low"]).all()


def test_plot_batch_draws_each_variants_interval_as_error_bars(ws: Workspace, tmp_path: Path) -> None:
    b = _two_models(ws, tmp_path, 6, name="bars")
    fig = agentnb.plot_batch(b, score="grade")
    left = fig.axes[0]
    summary = b.summary()
    assert left.get_title() == "grade against tokens · bars: 95% CI"
    bars = {c.get_label(): c for c in left.containers if c.get_label().startswith("ci:")}
    assert set(bars) == {"ci:0", "ci:1"}
    for v in (0, 1):
        _line, _caps, (xbar, ybar) = bars[f"ci:{v}"].lines
        [[(x0, y0), (x1, y1)]] = [np.asarray(p) for p in ybar.get_segments()]
        assert (y0, y1) == pytest.approx((summary.loc[v, "mean_grade_ci_low"], summary.loc[v, "mean_grade_ci_high"]))
        assert x0 == x1 == pytest.approx(summary.loc[v, "mean_tokens"])
        [[(a, _), (z, _)]] = [np.asarray(p) for p in xbar.get_segments()]
        assert (a, z) == pytest.approx((summary.loc[v, "mean_tokens_ci_low"], summary.loc[v, "mean_tokens_ci_high"]))


# -- bad input: one line, nothing created -----------------------------------------------------------------------------

def test_bad_baselines_settings_and_batches_without_shared_cases_are_one_line(ws: Workspace, tmp_path: Path) -> None:
    b = _two_models(ws, tmp_path, 3, name="bad")
    before = (len(ws.batches()), len(ws.jobs()))
    labels = "0 = 'single · scripted:m1.yaml', 1 = 'single · scripted:m2.yaml'"
    for baseline, message in (
            ("nope", f"baseline 'nope' is not a variant of batch 'bad'; allowed: a variant's number or label, or a "
                     f"piece or model only one variant has: {labels}"),
            (7, f"baseline 7 is not a variant of batch 'bad'; allowed: a variant's number or label, or a piece or "
                f"model only one variant has: {labels}"),
            ("single", f"baseline 'single' names 2 variants of batch 'bad' (0, 1); give one's number or label: {labels}"),
            (b, "baseline is batch 'bad', another batch; compare pairs the variants of one batch by case: add the "
                "variant to batch 'bad' (ws.batch(cases, piece=…, model=…, name='bad')), then compare(baseline=…)")):
        with pytest.raises(AgentnbError) as info:
            b.compare(baseline=baseline)
        assert str(info.value) == message
    for kwargs, message in (({"confidence": 95}, "confidence=95; allowed: a number between 0 and 1, such as 0.95"),
                            ({"n_resamples": 10}, "n_resamples=10; allowed: a whole number ≥ 100 (default 9999)"),
                            ({"seed": -1}, "seed=-1; allowed: a whole number ≥ 0, or None for fresh draws each time")):
        with pytest.raises(AgentnbError, match=f"^{re.escape(message)}$"):
            b.compare(baseline=0, **kwargs)
        with pytest.raises(AgentnbError, match=f"^{re.escape(message)}$"):
            b.summary(**kwargs)
    # a batch none of whose cases has ended under both the baseline and another variant: nothing to pair
    queued = ws.batch([{"instruction": "x"}, {"instruction": "y"}], piece="single", model=["demo", "scripted:" +
                      str(tmp_path / "m1.yaml")], name="queued", run=False)
    with pytest.raises(AgentnbError, match=r"^batch 'queued': no case has ended under both the baseline "
                                           r"\(single · demo\) and another variant, so there are no shared cases"):
        queued.compare(baseline="demo")
    alone = ws.batch([{"instruction": "x"}], piece="single", model="demo", name="alone", progress=False)
    with pytest.raises(AgentnbError, match=r"^batch 'alone' has one variant; compare needs another"):
        alone.compare(baseline=0)
    assert (len(ws.batches()), len(ws.jobs())) == (before[0] + 2, before[1] + 5)  # only the two made above
    assert not math.isnan(float(b.summary().loc[0, "mean_grade"]))


def test_a_batch_run_with_epochs_is_resampled_by_case_and_compared_on_each_case_s_epoch_mean(
        ws: Workspace, tmp_path: Path) -> None:
    """Through ``ws.batch(..., epochs=3)``: a case's epochs stay together in the summary's bootstrap, and the
    comparison pairs each case's mean over its epochs."""
    def varying(name: str, prompts: list[int]) -> str:
        writes = [{**call("Write", path="output/answer.txt", content="x"),
                   "usage": {"prompt_tokens": p, "completion_tokens": 5}} for p in prompts]
        done = {**transition("COMPLETE", summary="answered"), "usage": {"prompt_tokens": 10, "completion_tokens": 1}}
        return write_script(tmp_path, name, {"work": [{"by_epoch": writes}, done]})

    base, more = varying("base", [100, 200, 600]), varying("more", [150, 250, 650])
    cases = [{"instruction": f"Answer question {i}"} for i in range(7)]
    b = ws.batch(cases, piece="single", model=[base, more], epochs=3, name="ep", progress=False)
    frame = b.frame
    assert sorted(frame["epoch"].unique()) == [1, 2, 3] and len(frame) == 7 * 2 * 3
    summary = b.summary(n_resamples=20000, seed=1)
    for v, row in summary.iterrows():
        per_case = frame[frame["variant"] == v].groupby("case")["total_tokens"]
        low, high, se = _percentile_bootstrap(per_case.sum().to_numpy(dtype=float),
                                              per_case.count().to_numpy(dtype=float), 20000, seed=99)
        # every case has the same three epochs, so the case totals are equal: nothing varies between cases
        assert (low, high, se) == (pytest.approx(row["mean_tokens"]),) * 2 + (pytest.approx(0.0, abs=1e-9),)
        assert row["mean_tokens_ci_low"] == pytest.approx(low) and row["mean_tokens_ci_high"] == pytest.approx(high)
        assert row["mean_tokens_se"] == pytest.approx(0.0, abs=1e-9)
    # a job-level resampling would have given an interval as wide as the epochs' spread; by case it is a point
    assert summary.loc[0, "mean_tokens_ci_high"] - summary.loc[0, "mean_tokens_ci_low"] < 1e-6
    c = b.compare(baseline=0)
    tokens = c.frame.set_index("measure").loc["total_tokens"]
    assert tokens["diff"] == pytest.approx(50) and tokens["worse_cases"] == 7 and tokens["verdict"] == "worse"
    assert set(c.cases.loc[c.cases["measure"] == "total_tokens", "case"]) == set(range(7))
