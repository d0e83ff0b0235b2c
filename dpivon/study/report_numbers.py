"""The numbers of a benchmark report as text: means with their intervals, paired
differences with their verdicts and Holm p-values, and the results and difference tables."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from dpivon.study.aggregate import SUMMARISED, Comparison, compare, seed_values, verdict_epsilons
from dpivon.study.significance import (
    Difference,
    Interval,
    holm_adjusted,
    seed_difference,
    verdict_word,
)

STATISTICS_RULE = (
    "Intervals are 95 % t intervals over seeds (none where the seeds agree exactly: no "
    "spread measured). Two methods are compared by their per-seed "
    "differences (paired t-test over the seeds they share, else Welch's t-test): a method "
    '"leads" only where the 95 % interval of the difference excludes 0; otherwise the two '
    'are "indistinguishable" at that number of seeds (`dpivon.study.significance`). The '
    "pairs are replicate k of each method, fixed before the runs: they share the split and "
    "the test images, not their randomness, so the paired test is valid and, at a few "
    "seeds, conservative. The verdicts judge each comparison alone; p (Holm) adjusts each "
    "p-value for the other comparisons of its metric and epsilon (Holm's step-down): a "
    "verdict whose Holm p exceeds 0.05 may be one of the family's chance findings."
)
# (column, header, scale, decimals) of the results table
RESULT_COLUMNS = (
    ("test_accuracy", "accuracy %", 100.0, 1),
    ("test_nll", "NLL", 1.0, 3),
    ("test_ece", "ECE", 1.0, 3),
    ("test_brier", "Brier", 1.0, 3),
    ("test_ts_nll", "NLL (TS)", 1.0, 3),
    ("test_ts_ece", "ECE (TS)", 1.0, 3),
    ("temperature", "T", 1.0, 2),
    ("epsilon_spent", "eps spent", 1.0, 2),
    ("epsilon_end_to_end", "eps end to end", 1.0, 2),
    ("wall_time_s", "wall s", 1.0, 0),
)


def mean_with_interval(
    mean: float, low: float, high: float, scale: float = 1.0, decimals: int = 3
) -> str:
    """``mean [low, high]`` (scaled); ``inf`` and missing values spelled out, the interval
    left out when it is unknown (one seed)."""
    if math.isnan(mean):
        return "-"
    if math.isinf(mean):
        return "inf"
    text = f"{mean * scale:.{decimals}f}"
    interval = Interval(low, high)
    return f"{text} {_interval_text(interval, scale, decimals)}" if interval.known else text


# columns that describe the runs rather than score them: their mean alone
_MEAN_ONLY = ("epsilon_spent", "epsilon_end_to_end", "wall_time_s")


def results_rows(
    table: pd.DataFrame, columns: Sequence[tuple[str, str, float, int]] = RESULT_COLUMNS
) -> tuple[list[str], list[list[str]]]:
    """Header and rows of a table of ``columns`` (mean [95 % interval] over seeds; the
    mean alone for the epsilon spent and the wall time)."""
    header = ["method", "eps", "seeds", *(h for _, h, _, _ in columns)]
    rows = [
        [
            str(row["method"]),
            f"{row['epsilon']:g}",
            str(int(row["n"])),
            *(
                mean_with_interval(
                    row[f"{c}_mean"],
                    math.nan if c in _MEAN_ONLY else row[f"{c}_ci_low"],
                    math.nan if c in _MEAN_ONLY else row[f"{c}_ci_high"],
                    scale,
                    decimals,
                )
                for c, _, scale, decimals in columns
            ),
        ]
        for _, row in table.iterrows()
    ]
    return header, rows


def _interval_text(interval: Interval, scale: float, decimals: int) -> str:
    return f"[{interval.low * scale:.{decimals}f}, {interval.high * scale:.{decimals}f}]"


def difference_cells(
    d: Difference, scale: float, decimals: int, word: str, holm: float | None = None
) -> list[str]:
    """A difference's table cells: signed mean, 95 % interval, p-value, the Holm-adjusted
    p-value where the table has that column (``holm`` given), seeds, ``word``."""
    cells = [
        f"{d.mean * scale:+.{decimals}f}",
        _interval_text(d.interval, scale, decimals) if d.interval.known else "-",
        "-" if math.isnan(d.p_value) else f"{d.p_value:.2g}",
    ]
    if holm is not None:
        cells.append("-" if math.isnan(holm) else f"{holm:.2g}")
    return [*cells, str(d.seeds), word]


def difference_text(d: Difference, scale: float, decimals: int, unit: str) -> str:
    if not d.interval.known:
        why = "the same difference on every seed" if d.seeds >= 2 else "one seed on a side"
        return f"{abs(d.mean) * scale:.{decimals}f}{unit} apart, {why}: no interval"
    return (
        f"difference {d.mean * scale:.{decimals}f}{unit}, 95 % CI "
        f"{_interval_text(d.interval, scale, decimals)}, {d.test_name} p = {d.p_value:.2g}, "
        f"{d.seeds} seeds"
    )


def comparison_text(c: Comparison | None, scale: float, decimals: int, unit: str) -> str | None:
    """The best method on one metric and how it stands against the runner-up, in the words
    the difference's interval allows (see STATISTICS_RULE)."""
    if c is None:
        return None
    best = f"**{c.best}** ({c.best_mean * scale:.{decimals}f}{unit})"
    if c.second is None:
        return f"{best}, the only method"
    second = f"{c.second} ({c.second_mean * scale:.{decimals}f}{unit})"
    detail = difference_text(c.difference, scale, decimals, unit)
    if c.word == "leads":
        return f"{best} leads {second}: {detail}"
    if c.word == "unknown":
        return f"{best} ahead of {second} on the means, {detail}"
    if c.word == "trails":  # ranked over all seeds, tested on the shared ones: they disagree
        return (
            f"{best} ahead on the means over all seeds, but {c.second} leads on the "
            f"{c.difference.seeds} seeds both ran: {detail}"
        )
    n = c.difference.seeds
    return f"{best} and {second} are indistinguishable at {n} seeds: {detail}"


def verdict_lines(runs: pd.DataFrame) -> list[str]:
    """Per extreme epsilon: who has the best mean accuracy, NLL and ECE, and whether it
    leads the runner-up or is indistinguishable from it (see STATISTICS_RULE); then, where
    runs logged curvature diagnostics, which method collapses least at the last epoch.
    ``runs`` is one row per run (:func:`dpivon.study.aggregate.records_frame`)."""
    lines = []
    for eps in verdict_epsilons(runs):
        accuracy = comparison_text(compare(runs, "test_accuracy", eps), 100.0, 1, " points")
        nll = comparison_text(compare(runs, "test_nll", eps), 1.0, 3, "")
        ece = comparison_text(compare(runs, "test_ece", eps), 1.0, 3, "")
        lines.append(
            f"epsilon {eps:g}: best mean test accuracy {accuracy}; "
            f"lowest mean test NLL {nll}; lowest mean test ECE {ece}."
        )
        collapse = comparison_text(compare(runs, "last_projected_fraction", eps), 1.0, 3, "")
        if collapse is not None:
            lines.append(
                f"epsilon {eps:g}: lowest fraction of v_hat projected to zero at the last "
                f"epoch (one sign of curvature collapse; the diagnostics table has the "
                f"others) {collapse}."
            )
    return lines


# (column, header, scale, decimals) of the paired-differences table
_DIFFERENCE_METRICS = (
    ("test_accuracy", "accuracy (points)", 100.0, 1),
    ("test_nll", "NLL", 1.0, 3),
    ("test_ece", "ECE", 1.0, 3),
    ("test_ts_nll", "NLL (TS)", 1.0, 3),
    ("test_ts_ece", "ECE (TS)", 1.0, 3),
    ("test_shift_s3_accuracy", "accuracy at shift severity 3 (points)", 100.0, 1),
    ("test_shift_s3_ece", "ECE at shift severity 3", 1.0, 3),
    ("test_shift_s3_aurc_maxprob", "AURC (max-prob) at shift severity 3", 1.0, 3),
)


def difference_rows(
    runs: pd.DataFrame,
    methods: Sequence[str],
    metrics: Sequence[tuple[str, str, float, int]] = _DIFFERENCE_METRICS,
    directions: Mapping[str, str] = SUMMARISED,
) -> tuple[list[str], list[list[str]]]:
    """Every method against the best one, per epsilon and metric (column, label, scale,
    decimals; ``directions`` says which way each improves): the difference (method minus
    best), its 95 % interval, the test's p-value, that p-value adjusted by Holm's method over
    the comparisons of the same epsilon and metric, the seeds and the verdict word."""
    header = ["eps", "metric", "best", "method", "difference", "95 % CI", "p", "p (Holm)",
              "seeds", "verdict"]  # fmt: skip
    rows = []
    for eps in sorted(set(runs["epsilon"])):
        for metric, label, scale, decimals in metrics:
            comparison = compare(runs, metric, eps, directions[metric])
            if comparison is None or comparison.second is None:
                continue
            best = comparison.best
            reference = seed_values(runs, best, eps, metric)
            family = []  # (method, difference) of this epsilon and metric
            for method in methods:
                values = seed_values(runs, method, eps, metric)
                if method == best or not np.isfinite(list(values.values())).any():
                    continue
                family.append((method, seed_difference(values, reference)))
            adjusted = holm_adjusted([d.p_value for _, d in family])
            for (method, d), holm in zip(family, adjusted, strict=True):
                word = verdict_word(d, comparison.better)
                word = "trails the best" if word == "trails" else word
                cells = difference_cells(d, scale, decimals, word, holm)
                rows.append([f"{eps:g}", label, best, method, *cells])
    return header, rows
