"""Each variant of a batch against a baseline, paired by case (docs/design-lab.md#paired-comparison).

``batch.compare(baseline=VARIANT)`` returns a :class:`BatchComparison`: for every other variant and every
numeric or boolean score, plus ``cost_usd`` and ``total_tokens``, the mean paired difference (variant minus
baseline, per case, epochs averaged within a case first), its bootstrap interval, the paired permutation
test's p-value, and how many cases got better, worse or stayed the same.  The numbers are
:mod:`agentnb.views.batch_stats`'s; the HTML is :mod:`agentnb.views.batch_compare_html`'s.

Comparisons are within one batch: a variant tried later is added to the batch of the same cases
(``ws.batch(cases, piece=new, name="exp-1")``), which keeps the pairing exact, so ``compare`` takes no other
batch.  "No shared cases" is then a baseline and variants with no case ended under both, refused in one line.

Like a :class:`~agentnb.batch.Batch`, it reads the store when made; pandas and scipy are imported there, so
``import agentnb`` stays light.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import UsageError
from .store.base import TERMINAL_STATES

if TYPE_CHECKING:
    import pandas as pd

    from .views.batch_stats import Settings

__all__ = ["BatchComparison", "check_baseline", "compare_batch", "resolve_baseline"]

# which way is better, per kind of column: scores up (a boolean: true), cost and tokens down
_COST_MEASURES = (("cost_usd", "lower"), ("total_tokens", "lower"))


def resolve_baseline(baseline: Any, batch: str, variants: Sequence[tuple[int, str, str, str]]) -> int:
    """The number of the variant ``baseline`` names among ``variants`` (number, label, piece, model): its
    number (an int, or text of one), its label, or a piece or model spec that only one variant has."""
    if hasattr(baseline, "frame") and hasattr(baseline, "name"):  # another Batch
        raise UsageError(f"baseline is batch {getattr(baseline, 'name', '?')!r}, another batch; compare pairs the "
                         f"variants of one batch by case: add the variant to batch {batch!r} "
                         f"(ws.batch(cases, piece=…, model=…, name={batch!r})), then compare(baseline=…)")
    numbers = {v[0] for v in variants}
    if isinstance(baseline, int) and not isinstance(baseline, bool) and baseline in numbers:
        return baseline
    if isinstance(baseline, str):
        for field in (1, 2, 3):  # the label first: it is unique; a piece or a model only when one variant has it
            found = [v[0] for v in variants if v[field] == baseline]
            if len(found) == 1:
                return found[0]
            if len(found) > 1:
                raise UsageError(f"baseline {baseline!r} names {len(found)} variants of batch {batch!r} "
                                 f"({', '.join(map(str, found))}); give one's number or label: {_allowed(variants)}")
        if baseline.strip().isdigit() and int(baseline) in numbers:
            return int(baseline)
    raise UsageError(f"baseline {baseline!r} is not a variant of batch {batch!r}; allowed: a variant's number or "
                     f"label, or a piece or model only one variant has: {_allowed(variants)}")


def _allowed(variants: Sequence[tuple[int, str, str, str]]) -> str:
    return ", ".join(f"{v[0]} = {v[1]!r}" for v in variants)


def _listed(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def check_baseline(baseline: str, store: Any, name: str | None, pieces: Any, models: Any) -> None:
    """Before a batch is created or run (``%agent batch … --baseline``, ``agentnb batch … --baseline``): refuse
    a baseline that names none of its variants, the batch's own and those the call adds.  Leniently: the
    variants are not yet numbered or labelled as the batch will, so what this lets through
    :meth:`BatchComparison`'s own check may still refuse (after the run)."""
    from .engine.pieces import load_piece
    from .store import reads
    from .views.batch_frames import variant_labels

    record = reads.batch(store, name) if name else None
    have = [(v.piece, v.model) for v in record.variants] if record else []
    pieces, models = _listed(pieces), [str(m) for m in _listed(models)]
    names = [load_piece(p).name for p in pieces]
    planned = have + [(p, m) for p in names for m in models if (p, m) not in have]
    labels = variant_labels(planned)
    known = {str(i) for i in range(len(planned))} | {x for pair in planned for x in pair} | set(labels) | set(models)
    if baseline not in known:
        listed = ", ".join(f"{i} = {label}" for i, label in enumerate(labels))
        raise UsageError(f"--baseline {baseline!r} is not a variant of the batch; allowed: a variant's number or "
                         f"label, or a piece or model only one variant has: {listed or 'none'}")


@dataclass(eq=False, repr=False)
class BatchComparison:
    """Every other variant of batch ``batch`` against ``baseline``, paired by case.

    ``frame``: one row per variant × measure: ``variant``, ``variant_label``, ``measure`` (a score,
    ``cost_usd`` or ``total_tokens``), ``better`` (``higher``; ``true`` for a boolean; ``lower`` for cost and
    tokens), ``n`` (paired cases), ``baseline_mean`` and ``mean`` over them, ``diff`` (variant − baseline),
    ``ci_low``/``ci_high``, ``p_value`` and its ``test``, ``better_cases``/``worse_cases``/``tied_cases`` and
    ``verdict`` (better, worse, no clear difference, too few cases).  ``cases``: one row per variant × case ×
    measure, the regressions first.  ``settings``: the confidence, resamples and seed used.
    """

    batch: str
    baseline: int
    baseline_label: str
    frame: pd.DataFrame
    cases: pd.DataFrame
    settings: Settings

    def __repr__(self) -> str:
        return f"<BatchComparison of batch {self.batch!r} against {self.baseline_label!r}: {len(self.frame)} rows>"

    def to_text(self) -> str:
        """The comparison as lines of text (what ``agentnb batch … --baseline`` prints)."""
        import pandas as pd

        shown = self.frame.drop(columns=["variant_label", "test"])
        with pd.option_context("display.width", 200, "display.max_columns", None):
            table = shown.to_string(index=False, float_format=lambda v: f"{v:.4g}")
        return (f"against baseline {self.baseline} ({self.baseline_label}): diff = variant − baseline, paired by "
                f"case; {self.settings.text()}; p: {self.frame['test'].iloc[0] if len(self.frame) else ''}\n{table}")

    def _repr_html_(self) -> str:
        from .views.batch_compare_html import comparison_table_html

        return comparison_table_html(self)


def compare_batch(batch: Any, baseline: Any, *, confidence: Any = 0.95, n_resamples: Any = 9999,
                  seed: Any = 0) -> BatchComparison:
    """What ``batch.compare(baseline=…)`` returns (see :class:`BatchComparison`); a one-line UsageError for a
    baseline that is not a variant, or when no case ended under both the baseline and another variant."""
    from .views.batch_frames import score_columns
    from .views.batch_stats import Measure, paired_tables, settings

    chosen = settings(confidence, n_resamples, seed)
    frame = batch.frame
    variants = frame.drop_duplicates("variant").sort_values("variant")
    listed = [(int(r["variant"]), str(r["variant_label"]), str(r["piece"]), str(r["model"]))
              for _, r in variants.iterrows()]
    base = resolve_baseline(baseline, batch.name, listed)
    labels = {v[0]: v[1] for v in listed}
    if len(listed) < 2:
        raise UsageError(f"batch {batch.name!r} has one variant; compare needs another to set against it")
    ended = frame[frame["status"].astype(str).isin(TERMINAL_STATES)]
    shared = set(ended.loc[ended["variant"] == base, "case"]) & set(ended.loc[ended["variant"] != base, "case"])
    if not shared:
        raise UsageError(f"batch {batch.name!r}: no case has ended under both the baseline ({labels[base]}) and "
                         f"another variant, so there are no shared cases to compare; run it: ws.batch({batch.name!r})")
    measures = [Measure(n, "true" if str(frame[n].dtype) == "boolean" else "higher") for n in score_columns(frame)
                if str(frame[n].dtype) in ("boolean", "Int64", "Float64")]
    measures += [Measure(n, better) for n, better in _COST_MEASURES]
    table, cases = paired_tables(ended, base, labels, measures, chosen)
    return BatchComparison(batch.name, base, labels[base], table, cases, chosen)
