"""How sure a comparison over seeds is: 95 % t intervals of means and of differences.

A benchmark runs each (method, epsilon) on a few seeds that every method shares (the seeds
name replicates: same split, each run's own initialisation, batches and noise). Two methods
are compared by their per-seed differences (a paired t-test, ``scipy.stats.ttest_rel``) when
they share at least two seeds, else by Welch's t-test (``ttest_ind(equal_var=False)``). The
pairs are fixed before the runs (replicate k of each), which keeps the test valid; since the
runs of a replicate share no randomness, pairing removes no variance and costs degrees of
freedom (n - 1): at a few seeds the paired interval is the conservative one. Values or
differences with no spread at all (accuracies are multiples of 1 / test images, so two seeds
can score, or differ by, exactly the same) get no interval: a t interval of zero width
would call such a mean or gap certain.
The words a report may use follow from the interval of the difference: a method *leads*
only where that interval excludes 0; otherwise the two are *indistinguishable* at that
number of seeds. With 2 seeds the t quantile is 12.7, so only a gap many times the seeds'
spread is a lead: that is what 2 seeds can say.
A report makes several such comparisons at once (every method against the best, per metric);
:func:`holm_adjusted` gives their p-values corrected for that number (Holm's step-down,
which bounds the chance of any false lead in the family at 5 %).

Whether a tuning sweep predicted the final runs is a rank correlation (Spearman's rho,
Kendall's tau) between each pick's tuning score and its final score (:func:`rank_agreement`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats
from statsmodels.stats.multitest import multipletests

CONFIDENCE = 0.95
# Spearman's permutation test: exact (every pairing) up to 8 items, else this many draws
SPEARMAN_RESAMPLES = 40_320
# Below this width (relative to the value) an interval is rounding, not spread.
NO_SPREAD = 1e-9


@dataclass(frozen=True)
class Interval:
    """A two-sided 95 % interval; NaN bounds when it is unknown (fewer than two values)."""

    low: float
    high: float

    @property
    def known(self) -> bool:
        return not (math.isnan(self.low) or math.isnan(self.high))

    @property
    def excludes_zero(self) -> bool:
        return self.known and (self.low > 0 or self.high < 0)


UNKNOWN = Interval(math.nan, math.nan)


def _finite(values: Sequence[float]) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    return array[np.isfinite(array)]


def _spread_interval(low: float, high: float, center: float) -> Interval:
    """``[low, high]``, or UNKNOWN where it has no width: values that agree exactly (or to
    rounding) measured no spread, and a point interval would claim certainty they do not
    give."""
    if not high - low > NO_SPREAD * max(1.0, abs(center)):  # NaN too: scipy's zero variance
        return UNKNOWN
    return Interval(low, high)


def mean_interval(values: Sequence[float]) -> Interval:
    """The t interval of the mean of ``values`` (the finite ones); UNKNOWN with fewer than
    two or where they agree exactly (`_spread_interval`)."""
    finite = _finite(values)
    if len(finite) < 2:
        return UNKNOWN
    with warnings.catch_warnings():  # identical values: scipy warns (no interval then)
        warnings.simplefilter("ignore", RuntimeWarning)
        interval = stats.ttest_1samp(finite, 0.0).confidence_interval(CONFIDENCE)
    return _spread_interval(float(interval.low), float(interval.high), float(np.mean(finite)))


@dataclass(frozen=True)
class Difference:
    """``first - second`` over seeds: its mean, 95 % interval, p-value and how it was tested."""

    mean: float
    interval: Interval
    p_value: float
    seeds: int  # the shared seeds (paired), else the smaller of the two counts
    paired: bool

    @property
    def test_name(self) -> str:
        return "paired t-test" if self.paired else "Welch t-test"


def seed_difference(first: Mapping[int, float], second: Mapping[int, float]) -> Difference:
    """``first - second``, each a mapping of seed -> value: paired over the shared seeds
    when there are two or more, else Welch's test over all finite values of each."""
    shared = sorted(s for s in set(first) & set(second) if np.isfinite([first[s], second[s]]).all())
    with warnings.catch_warnings():  # a constant difference: scipy warns (no interval then)
        warnings.simplefilter("ignore", RuntimeWarning)
        if len(shared) >= 2:
            a = np.array([first[s] for s in shared])
            b = np.array([second[s] for s in shared])
            result = stats.ttest_rel(a, b)
            return _difference(float(np.mean(a - b)), result, len(shared), paired=True)
        a, b = _finite(list(first.values())), _finite(list(second.values()))
        if len(a) < 2 or len(b) < 2:
            mean = float(np.mean(a) - np.mean(b)) if len(a) and len(b) else math.nan
            return Difference(mean, UNKNOWN, math.nan, min(len(a), len(b)), paired=False)
        result = stats.ttest_ind(a, b, equal_var=False)
        return _difference(float(np.mean(a) - np.mean(b)), result, min(len(a), len(b)), False)


def _difference(mean: float, result, seeds: int, paired: bool) -> Difference:
    bounds = result.confidence_interval(CONFIDENCE)
    interval = _spread_interval(float(bounds.low), float(bounds.high), mean)
    p_value = float(result.pvalue) if interval.known else math.nan
    return Difference(mean, interval, p_value, seeds, paired)


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    """``p_values`` of one family of comparisons, adjusted by Holm's step-down method
    (statsmodels' ``multipletests``); NaN ones (no interval) stay NaN and do not count."""
    adjusted = [math.nan] * len(p_values)
    known = [i for i, p in enumerate(p_values) if not math.isnan(p)]
    if known:
        corrected = multipletests([p_values[i] for i in known], method="holm")[1]
        for i, p in zip(known, corrected, strict=True):
            adjusted[i] = float(p)
    return adjusted


def verdict_word(difference: Difference, better: str) -> str:
    """``leads`` where the interval excludes 0 on the better side (``better`` is "max" or
    "min" for the metric), ``trails`` where it excludes 0 on the other side, else
    ``indistinguishable``; ``unknown`` without an interval."""
    if not difference.interval.known:
        return "unknown"
    if not difference.interval.excludes_zero:
        return "indistinguishable"
    ahead = difference.mean > 0 if better == "max" else difference.mean < 0
    return "leads" if ahead else "trails"


@dataclass(frozen=True)
class RankAgreement:
    """How well one ranking (tuning scores) predicts another (final scores) over the same
    items: Spearman's rho and Kendall's tau with their two-sided p-values."""

    items: int
    spearman: float
    spearman_p: float
    kendall: float
    kendall_p: float

    @property
    def word(self) -> str:
        """``predicted`` (tau > 0 at p < 0.05), ``did not predict`` (tau <= 0), else
        ``agreed, not significantly``; ``unknown`` below 3 items."""
        if self.items < 3 or math.isnan(self.kendall):
            return "unknown"
        if self.kendall <= 0:
            return "did not predict"
        return "predicted" if self.kendall_p < 1 - CONFIDENCE else "agreed, not significantly"


def rank_agreement(tuning: Mapping[str, float], final: Mapping[str, float]) -> RankAgreement:
    """Rank correlation of ``tuning`` and ``final`` over their shared keys (both oriented so
    that larger is better, or both so that smaller is)."""
    keys = sorted(k for k in set(tuning) & set(final) if np.isfinite([tuning[k], final[k]]).all())
    if len(keys) < 3:
        return RankAgreement(len(keys), math.nan, math.nan, math.nan, math.nan)
    a, b = [tuning[k] for k in keys], [final[k] for k in keys]
    with warnings.catch_warnings():  # constant input: scipy warns and returns NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        spearman = stats.spearmanr(a, b).statistic
        kendall = stats.kendalltau(a, b)  # its p-value is exact at these sizes (no ties)
        spearman_p = math.nan
        if np.isfinite(spearman):
            # spearmanr's p is a t approximation, poor at a handful of picks (5 picks, rho 0.9:
            # 0.037 against the exact 0.083); every pairing is enumerated up to 8! of them
            spearman_p = stats.permutation_test(
                (a,),
                lambda x: stats.spearmanr(x, b).statistic,
                permutation_type="pairings",
                n_resamples=SPEARMAN_RESAMPLES,
                random_state=0,
            ).pvalue
    return RankAgreement(
        len(keys), float(spearman), float(spearman_p), float(kendall.statistic),
        float(kendall.pvalue),
    )  # fmt: skip
