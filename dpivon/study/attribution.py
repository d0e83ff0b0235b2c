"""The benchmark report's attribution: where an IVON-family method's numbers come from.

Two ingredients set the IVON family apart from a point estimate: a learned curvature h
(which shapes the step and the posterior) and the average over posterior draws. Each is
isolated by a control paired by seed:

- **learned curvature**: the method minus its frozen-curvature arm (the same pick with
  ``beta2 = 1``: h stays at hess_init; a benchmark method's ``frozen_curvature_of``);
- **weight-noise averaging**: each point-estimate model's predictive averaged over
  isotropic weight noise of the scale its validation split prefers, minus its own point
  prediction (the ``test_wna_*`` scores of `dpivon.study.benchmark`; same run, same
  weights).

Differences are means over seeds with 95 % intervals, paired t-tests and Holm-adjusted
p-values over each table's comparisons of one epsilon and metric, in the verdict's words.
Kept apart from `dpivon.study.benchmark_report`; `dpivon.study.benchmark` calls
`add_attribution_blocks` once per report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from dpivon.study.aggregate import seed_values
from dpivon.study.benchmark_report import Report
from dpivon.study.report_blocks import Heading, Paragraph, TableBlock
from dpivon.study.report_numbers import STATISTICS_RULE, difference_cells
from dpivon.study.significance import Difference, holm_adjusted, seed_difference, verdict_word

# (metric, label, scale, decimals, direction) of both tables; a weight-noise average's
# column is ``test_wna_<metric without test_>``.
ATTRIBUTED = (
    ("test_accuracy", "accuracy (points)", 100.0, 1, "max"),
    ("test_ece", "ECE", 1.0, 3, "min"),
    ("test_nll", "NLL", 1.0, 3, "min"),
    ("test_shift_s3_ece", "ECE at shift severity 3", 1.0, 3, "min"),
)
# What "leads" and "trails" mean in each table: the ingredient helps or hurts.
_WORDS = {"leads": "helps", "trails": "hurts"}

CURVATURE_NOTE = (
    "Each IVON-family method minus its frozen-curvature arm (the same configuration with "
    "beta2 = 1, so h stays at hess_init: momentum SGD with a fixed, isotropic weight noise "
    "and the same posterior average), paired by seed: what learning the curvature adds. "
    '"helps" / "hurts": the 95 % interval excludes 0 on that side.'
)
WEIGHT_NOISE_NOTE = (
    "Each point-estimate model averaged over isotropic Gaussian weight noise N(theta, s^2 I) "
    "(the posterior draws of its final test, s the one of the benchmark's weight_noise_scales "
    "of lowest validation NLL at the validation draws, 0 if none beat the point prediction) "
    "minus its own point "
    "prediction, same run: what any model gets from averaging over weight noise. Scored from "
    "the stored weights, no retraining."
)


def wna_metric(metric: str) -> str:
    """The column of ``metric`` (``test_<m>``) under weight-noise averaging."""
    return "test_wna_" + metric.removeprefix("test_")


def _rows(
    pairs: Sequence[tuple[str, float, str, Mapping[int, float], Mapping[int, float]]],
) -> list[list[str]]:
    """Rows of (label, eps, name, first, second) comparisons: first - second, Holm over the
    comparisons of one epsilon and metric."""
    families: dict[tuple[float, str], list[tuple[str, Difference]]] = {}
    for label, eps, name, first, second in pairs:
        families.setdefault((eps, label), []).append((name, seed_difference(first, second)))
    directions = {label: direction for _, label, _, _, direction in ATTRIBUTED}
    scales = {label: (scale, decimals) for _, label, scale, decimals, _ in ATTRIBUTED}
    rows = []
    for (eps, label), family in families.items():
        adjusted = holm_adjusted([d.p_value for _, d in family])
        for (name, d), holm in zip(family, adjusted, strict=True):
            word = verdict_word(d, directions[label])
            cells = difference_cells(d, *scales[label], _WORDS.get(word, word), holm)
            rows.append([f"{eps:g}", label, name, *cells])
    return rows


def _finite(values: Mapping[int, float]) -> bool:
    return bool(np.isfinite(list(values.values())).any())


def curvature_rows(
    runs: pd.DataFrame, arms: Mapping[str, str]
) -> tuple[list[str], list[list[str]]]:
    """Each method minus its frozen arm (``arms``: frozen method -> learning method), per
    epsilon and metric, paired by seed."""
    header = ["eps", "metric", "method - frozen arm", "difference", "95 % CI", "p",
              "p (Holm)", "seeds", "learned curvature"]  # fmt: skip
    pairs = []
    for eps in sorted(set(runs["epsilon"])):
        for metric, label, *_ in ATTRIBUTED:
            if metric not in runs:
                continue
            for frozen, learning in arms.items():
                first = seed_values(runs, learning, eps, metric)
                second = seed_values(runs, frozen, eps, metric)
                if _finite(first) and _finite(second):
                    pairs.append((label, eps, f"{learning} - {frozen}", first, second))
    return header, _rows(pairs)


def weight_noise_rows(
    runs: pd.DataFrame, methods: Sequence[str]
) -> tuple[list[str], list[list[str]]]:
    """Each point-estimate method's weight-noise average minus its point prediction, per
    epsilon and metric, paired by seed (the same run)."""
    header = ["eps", "metric", "method", "difference", "95 % CI", "p", "p (Holm)", "seeds",
              "weight-noise averaging"]  # fmt: skip
    pairs = []
    for eps in sorted(set(runs["epsilon"])):
        for metric, label, *_ in ATTRIBUTED:
            if wna_metric(metric) not in runs or metric not in runs:
                continue
            for method in methods:
                averaged = seed_values(runs, method, eps, wna_metric(metric))
                point = seed_values(runs, method, eps, metric)
                if _finite(averaged):
                    pairs.append((label, eps, method, averaged, point))
    return header, _rows(pairs)


def chosen_scales(runs: pd.DataFrame, methods: Sequence[str]) -> list[str]:
    """Per method and epsilon, the weight-noise scales its seeds' validation splits chose."""
    lines = []
    for method in methods:
        for eps in sorted(set(runs["epsilon"])):
            scales = seed_values(runs, method, eps, "weight_noise_scale")
            chosen = [s for s in scales.values() if not math.isnan(s)]
            if chosen:
                lines.append(f"{method} at epsilon {eps:g}: {', '.join(f'{s:g}' for s in chosen)}")
    return lines


def add_attribution_blocks(report: Report, methods: Sequence[str], arms: Mapping[str, str]) -> None:
    """The two attribution tables (where the benchmark has frozen arms or weight-noise
    scores), with their notes."""
    runs = report.runs
    curvature = curvature_rows(runs, arms) if arms else None
    has_wna = "weight_noise_scale" in runs and runs["weight_noise_scale"].notna().any()
    averaging = weight_noise_rows(runs, methods) if has_wna else None
    if not (curvature and curvature[1]) and not (averaging and averaging[1]):
        return
    report.blocks.append(Heading("Attribution: learned curvature and weight-noise averaging"))
    if curvature and curvature[1]:
        report.blocks += [
            Heading("What learning the curvature adds", level=3),
            TableBlock(*curvature),
            Paragraph(CURVATURE_NOTE),
        ]
    if averaging and averaging[1]:
        scales = "; ".join(chosen_scales(runs, methods))
        report.blocks += [
            Heading("What averaging over weight noise adds to a point estimate", level=3),
            TableBlock(*averaging),
            Paragraph(f"{WEIGHT_NOISE_NOTE} Scales chosen, by seed: {scales}."),
        ]
    report.blocks.append(Paragraph(STATISTICS_RULE))
