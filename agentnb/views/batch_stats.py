"""The statistics of a batch (docs/design-lab.md#confidence-intervals, docs/design-lab.md#paired-comparison).

Choices, made here once for the summary, the comparison and the plot:

- **The resampling unit is the case.**  Jobs of the same case share its difficulty (and, with epochs, its
  jobs are repeats of one another), so resampling jobs as if independent would make intervals too narrow.
  A variant's mean is the mean over its jobs that have a value, i.e. ``sum / count`` over cases; the
  bootstrap draws cases with replacement and recomputes that ratio (a *cluster* bootstrap: all the epochs
  of a drawn case come with it).  With one job per case it is the ordinary bootstrap of the mean.
- **Percentile bootstrap** (``scipy.stats.bootstrap(method="percentile")``): the interval is the
  ``(1 ± confidence) / 2`` quantiles of the resampled means; the standard error is their standard deviation
  (ddof=1).  Not BCa: scores are often booleans, whose resampled means are few distinct values with ties at
  the observed one, where BCa's bias correction is unstable (and it is undefined when every value is the
  same); the percentile interval is what the tests check by hand.  Fewer than 2 cases: no interval (NA);
  every value equal: the interval is that value and the standard error 0.
- **The paired comparison** pairs each case's mean over its epochs in a variant with the baseline's on the
  same case (cases where either has no value are left out); the difference's interval is the percentile
  bootstrap of the mean per-case difference over cases, and its p-value the two-sided **paired permutation
  test** (sign-flip: under "no difference", each case's difference is as likely negative as positive;
  ``scipy.stats.permutation_test(permutation_type="samples")`` on the differences, the mean as the
  statistic; exact over all 2^n sign patterns when 2^n ≤ ``n_resamples``, otherwise randomised).
- **Too few cases**: with n paired cases the smallest two-sided p-value the test can give is 2/2^n, so
  below :func:`min_cases` (6 at 95 %) no data could show a difference; such a row says "too few cases".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import pandas as pd

from ..errors import UsageError

__all__ = ["BOOTSTRAP", "CASE_COLUMNS", "COMPARISON_COLUMNS", "OUTCOMES", "TEST", "Interval", "Measure", "Settings",
           "cluster_interval", "cluster_intervals", "difference_interval", "interval_columns", "min_cases", "paired_p_value", "paired_tables",
           "plus_minus", "settings", "summary_intervals"]

BOOTSTRAP: Final = "percentile bootstrap over cases"
TEST: Final = "paired permutation (sign-flip)"
# the resamples scipy draws by default: enough for a 95 % interval's ends to move by well under a tenth of its
# width from one seed to another
_RESAMPLES: Final = 9999


@dataclass(frozen=True)
class Settings:
    """How intervals and tests are computed: ``confidence`` (of the intervals; the test's level is
    ``1 - confidence``), ``n_resamples`` (bootstrap and permutation draws) and ``seed`` (None: fresh draws
    each time; the default 0 gives the same numbers every time the same batch is shown)."""

    confidence: float = 0.95
    n_resamples: int = _RESAMPLES
    seed: int | None = 0

    @property
    def alpha(self) -> float:
        return 1.0 - self.confidence

    @property
    def level(self) -> str:
        """The confidence as a percentage: ``95%``, ``97.5%``."""
        return f"{self.confidence * 100:.4g}%"

    def text(self) -> str:
        """The settings in words, for the HTML and the docs' promise that each view says what ± is."""
        seed = "fresh draws" if self.seed is None else f"seed {self.seed}"
        return f"{self.level} CI, {BOOTSTRAP}, {self.n_resamples:,} resamples, {seed}"


def settings(confidence: Any = 0.95, n_resamples: Any = _RESAMPLES, seed: Any = 0) -> Settings:
    """Checked :class:`Settings`; a one-line UsageError naming what is allowed."""
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise UsageError(f"confidence={confidence!r}; allowed: a number between 0 and 1, such as 0.95")
    if isinstance(n_resamples, bool) or not isinstance(n_resamples, int) or n_resamples < 100:
        raise UsageError(f"n_resamples={n_resamples!r}; allowed: a whole number ≥ 100 (default {_RESAMPLES})")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise UsageError(f"seed={seed!r}; allowed: a whole number ≥ 0, or None for fresh draws each time")
    return Settings(float(confidence), n_resamples, seed)


def min_cases(alpha: float) -> int:
    """The fewest paired cases with which the sign-flip test can reach ``p < alpha``: its smallest two-sided
    p-value with n cases is 2/2^n (every difference on the same side), 0.0625 with 5 and 0.031 with 6."""
    return math.floor(1 - math.log2(alpha)) + 1


@dataclass(frozen=True)
class Interval:
    """A mean, its bootstrap standard error and confidence interval (NA where they cannot be had)."""

    mean: float
    se: float
    low: float
    high: float


_NA = Interval(math.nan, math.nan, math.nan, math.nan)


def _rng(s: Settings) -> np.random.Generator:
    return np.random.default_rng(s.seed)


def cluster_interval(sums: Any, counts: Any, s: Settings) -> Interval:
    """The mean ``sum(sums) / sum(counts)`` over cases (one sum and one count of values per case; a case
    with no value is left out) and its cluster bootstrap interval: cases are drawn with replacement, each
    bringing all its values."""
    sums, counts = np.asarray(sums, dtype=float), np.asarray(counts, dtype=float)
    keep = counts > 0
    sums, counts = sums[keep], counts[keep]
    if len(sums) == 0:
        return _NA
    if len(sums) < 2:
        return Interval(float(sums.sum() / counts.sum()), math.nan, math.nan, math.nan)
    mean, se, low, high = cluster_intervals(sums, counts, s)
    return Interval(float(mean), float(se), float(low), float(high))


def cluster_intervals(sums: Any, counts: Any, s: Settings) -> tuple[np.ndarray, ...]:
    """:func:`cluster_interval` over the last axis of ``sums`` and ``counts`` (many simulated batches at
    once; every case with at least one value, at least 2 cases): ``(mean, se, low, high)`` arrays."""
    from scipy import stats

    sums, counts = np.asarray(sums, dtype=float), np.asarray(counts, dtype=float)
    mean = sums.sum(axis=-1) / counts.sum(axis=-1)
    # every case the same: nothing to resample (the interval is the value, the standard error 0)
    flat = np.all(np.isclose(sums / counts, mean[..., None], rtol=0, atol=1e-12), axis=-1)
    if np.all(flat):
        return mean, np.zeros_like(mean), mean.copy(), mean.copy()

    def ratio(x: np.ndarray, n: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.sum(x, axis=axis) / np.sum(n, axis=axis)

    res = stats.bootstrap((sums, counts), ratio, paired=True, vectorized=True, axis=-1, n_resamples=s.n_resamples,
                          confidence_level=s.confidence, method="percentile", rng=_rng(s))
    ci = res.confidence_interval
    return (mean, np.where(flat, 0.0, res.standard_error), np.where(flat, mean, ci.low), np.where(flat, mean, ci.high))


def difference_interval(diffs: Any, s: Settings) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The percentile bootstrap interval of the mean of per-case differences, over the last axis of
    ``diffs`` (so many simulated batches can go at once): ``(mean, low, high)`` arrays."""
    from scipy import stats

    d = np.asarray(diffs, dtype=float)
    mean = d.mean(axis=-1)
    if d.shape[-1] < 2:
        nan = np.full_like(mean, math.nan)
        return mean, nan, nan
    flat = np.ptp(d, axis=-1) == 0
    if np.all(flat):
        return mean, mean.copy(), mean.copy()
    res = stats.bootstrap((d,), np.mean, vectorized=True, axis=-1, n_resamples=s.n_resamples,
                          confidence_level=s.confidence, method="percentile", rng=_rng(s))
    low = np.where(flat, mean, res.confidence_interval.low)
    high = np.where(flat, mean, res.confidence_interval.high)
    return mean, np.asarray(low, dtype=float), np.asarray(high, dtype=float)


def paired_p_value(diffs: Any, s: Settings) -> np.ndarray:
    """The two-sided p-value of the sign-flip permutation test of "no difference", over the last axis."""
    from scipy import stats

    d = np.asarray(diffs, dtype=float)
    if d.shape[-1] < 1:
        return np.full(d.shape[:-1], math.nan)
    res = stats.permutation_test((d,), np.mean, permutation_type="samples", vectorized=True, axis=-1,
                                 n_resamples=s.n_resamples, alternative="two-sided", rng=_rng(s))
    return np.asarray(res.pvalue, dtype=float)


def interval_columns(mean: str) -> list[str]:
    """The summary columns that go with the mean column ``mean``: its standard error and interval ends."""
    return [f"{mean}_se", f"{mean}_ci_low", f"{mean}_ci_high"]


def summary_intervals(frame: pd.DataFrame, measures: Sequence[tuple[str, str, pd.Series | None]],
                      s: Settings) -> dict[str, dict[Any, Interval]]:
    """Per summary column, per variant, the :class:`Interval` of the mean of a frame column.

    ``measures``: ``(summary column, frame column, rows)``: ``rows`` a boolean Series saying which rows
    count (the ended jobs, for seconds), or None for all.  A mean that the summary leaves NA (a cost with an
    unknown price) gets no interval."""
    out: dict[str, dict[Any, Interval]] = {}
    for name, column, rows in measures:
        part = frame if rows is None else frame[rows]
        per_variant: dict[Any, Interval] = {}
        for variant, group in part.groupby("variant", sort=True):
            values = group[column]
            if name.endswith("cost_usd") and values.isna().any():
                per_variant[variant] = _NA  # one unknown price: the mean itself is unknown
                continue
            numbers = values.astype("Float64").astype(float)
            by_case = pd.DataFrame({"case": group["case"], "x": numbers}).dropna().groupby("case")["x"]
            per_variant[variant] = cluster_interval(by_case.sum().to_numpy(), by_case.count().to_numpy(), s)
        out[name] = per_variant
    return out


# -- the paired comparison -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Measure:
    """A column compared between variants, and which way is better: ``higher`` (a number), ``true`` (a
    boolean: a higher share true) or ``lower`` (cost and tokens)."""

    name: str
    better: str

    @property
    def sign(self) -> int:
        return -1 if self.better == "lower" else 1


COMPARISON_COLUMNS: Final = ("variant", "variant_label", "measure", "better", "n", "baseline_mean", "mean", "diff",
                             "ci_low", "ci_high", "p_value", "test", "better_cases", "worse_cases", "tied_cases",
                             "verdict")
CASE_COLUMNS: Final = ("variant", "variant_label", "case", "measure", "better", "outcome", "baseline_value", "value",
                       "diff", "baseline_job", "job", "epochs")
# a case's outcome, in the order .cases lists them: regressions first
OUTCOMES: Final = ("worse", "tied", "better")


def _per_case(rows: pd.DataFrame, column: str) -> pd.DataFrame:
    """Per case: the mean of ``column`` over its epochs that have a value, how many, and the first epoch's job."""
    order = ["case", "epoch"] if "epoch" in rows.columns else ["case"]
    part = rows.sort_values(order, kind="stable")
    values = part[column].astype("Float64").astype(float)
    has = pd.DataFrame({"case": part["case"].astype(int), "x": values, "job": part["job"].astype(int)}).dropna()
    grouped = has.groupby("case", sort=True)
    return pd.DataFrame({"value": grouped["x"].mean(), "epochs": grouped["x"].count(), "job": grouped["job"].first()})


def _verdict(n: int, gain: float, low: float, high: float, p: float, s: Settings) -> str:
    if n < min_cases(s.alpha):
        return "too few cases"
    # both the test and the interval must say so: where they disagree the difference is borderline
    if p < s.alpha and (low > 0 or high < 0):
        return "better" if gain > 0 else "worse"
    return "no clear difference"


def paired_tables(frame: pd.DataFrame, baseline: int, labels: dict[int, str], measures: Sequence[Measure],
                  s: Settings) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every other variant against ``baseline`` on each measure, over the ended rows of ``frame`` (one row
    per case × variant [× epoch]): the comparison (one row per variant × measure, ``COMPARISON_COLUMNS``)
    and the per-case table (``CASE_COLUMNS``, regressions first)."""
    rows_out: list[dict[str, Any]] = []
    cases_out: list[pd.DataFrame] = []
    base_rows = frame[frame["variant"] == baseline]
    for variant in sorted(int(v) for v in frame["variant"].unique() if int(v) != baseline):
        other = frame[frame["variant"] == variant]
        for m in measures:
            a, b = _per_case(base_rows, m.name), _per_case(other, m.name)
            both = a.add_suffix("_base").join(b, how="inner")
            d = (both["value"] - both["value_base"]).to_numpy(dtype=float)
            tied = np.isclose(both["value"].to_numpy(dtype=float), both["value_base"].to_numpy(dtype=float),
                              rtol=1e-9, atol=1e-12)
            gain = np.where(tied, 0.0, d * m.sign)
            n = len(d)
            mean, low, high = (float(x) for x in difference_interval(d, s)) if n else (math.nan,) * 3
            p = float(paired_p_value(d, s)) if n else math.nan
            rows_out.append({
                "variant": variant, "variant_label": labels[variant], "measure": m.name, "better": m.better, "n": n,
                "baseline_mean": float(both["value_base"].mean()) if n else math.nan,
                "mean": float(both["value"].mean()) if n else math.nan, "diff": mean, "ci_low": low, "ci_high": high,
                "p_value": p, "test": TEST, "better_cases": int((gain > 0).sum()), "worse_cases": int((gain < 0).sum()),
                "tied_cases": int(tied.sum()),
                "verdict": _verdict(n, mean * m.sign, low, high, p, s) if n else "no shared cases"})
            outcome = np.where(gain < 0, "worse", np.where(gain > 0, "better", "tied"))
            cases_out.append(pd.DataFrame({
                "variant": variant, "variant_label": labels[variant], "case": both.index.to_numpy(dtype=int),
                "measure": m.name, "better": m.better, "outcome": outcome, "baseline_value": both["value_base"],
                "value": both["value"], "diff": d, "baseline_job": both["job_base"], "job": both["job"],
                "epochs": both["epochs"], "_rank": [OUTCOMES.index(o) for o in outcome],
                "_measure": measures.index(m), "_gain": gain}).reset_index(drop=True))
    table = pd.DataFrame.from_records(rows_out, columns=list(COMPARISON_COLUMNS)).astype({
        "variant": "Int64", "variant_label": "string", "measure": "string", "better": "string", "n": "Int64",
        "test": "string", "verdict": "string", "better_cases": "Int64", "worse_cases": "Int64", "tied_cases": "Int64",
        **dict.fromkeys(("baseline_mean", "mean", "diff", "ci_low", "ci_high", "p_value"), "Float64")})
    cases = pd.concat(cases_out, ignore_index=True) if cases_out else pd.DataFrame(
        columns=[*CASE_COLUMNS, "_rank", "_measure", "_gain"])
    # the regressions first, the scores' before cost's and tokens', the largest first; then ties, improvements
    cases = cases.sort_values(["_rank", "_measure", "_gain", "variant", "case"], kind="stable")
    cases = cases.drop(columns=["_rank", "_measure", "_gain"]).reset_index(drop=True)
    cases = cases.astype({"variant": "Int64", "variant_label": "string", "case": "Int64", "measure": "string",
                          "better": "string", "outcome": "string", "baseline_value": "Float64", "value": "Float64",
                          "diff": "Float64", "baseline_job": "Int64", "job": "Int64", "epochs": "Int64"})
    return table, cases


def plus_minus(summary: pd.DataFrame) -> pd.DataFrame:
    """A ``batch_summary`` for printing: each mean that has an interval as text ``mean ± half its width``
    (4 significant digits; NA without an interval), the interval columns left out."""
    out = summary.copy()
    for mean in [c for c in summary.columns if f"{c}_ci_low" in summary.columns]:
        low, high = summary[f"{mean}_ci_low"], summary[f"{mean}_ci_high"]
        out[mean] = [("NA" if pd.isna(m) else f"{m:.4g}") + ("" if pd.isna(lo) else f" ± {(hi - lo) / 2:.2g}")
                     for m, lo, hi in zip(summary[mean], low, high, strict=True)]
        out = out.drop(columns=interval_columns(mean))
    return out
