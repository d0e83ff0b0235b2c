"""Selective prediction and error detection: does a model's uncertainty rank its own
predictions, the right ones before the wrong ones?

A model that may abstain answers only its most certain inputs. The risk-coverage curve
(Geifman & El-Yaniv, NeurIPS 2017) gives the error rate among the k most certain of N
predictions against the coverage k / N; AURC is its mean over k = 1..N (lower is better;
a perfect ranking reaches the error rate's own floor), and the accuracy at 90 % and 80 %
coverage reads it at two points. The error-detection AUROC is the probability that a wrong
prediction is scored more uncertain than a right one (ties count one half): 0.5 is a score
that knows nothing. Each uses one uncertainty score per prediction, higher meaning less
sure: one minus the top probability, the predictive entropy, or (IVON family) the mutual
information across posterior draws (`dpivon.evaluation.prediction`).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import rankdata

# coverages at which the accuracy is reported, as percentages (key ``acc_at_<pct>_<score>``)
COVERAGES = (90, 80)


def _checked(uncertainty: np.ndarray, correct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    uncertainty = np.asarray(uncertainty, dtype=np.float64)
    correct = np.asarray(correct, dtype=bool)
    if uncertainty.ndim != 1 or uncertainty.shape != correct.shape or not len(uncertainty):
        raise ValueError(
            f"uncertainty and correct must be 1-D of one equal, non-zero length, got shapes "
            f"{uncertainty.shape} and {correct.shape}"
        )
    if not np.isfinite(uncertainty).all():
        raise ValueError("uncertainty scores must be finite")
    return uncertainty, correct


def risk_coverage_curve(
    uncertainty: np.ndarray, correct: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(coverage, risk): for k = 1..N, k / N and the error rate among the k least uncertain
    predictions. Equal scores are one group, taken in a random order in expectation (each
    member counts the group's error rate), so the curve does not depend on input order."""
    uncertainty, correct = _checked(uncertainty, correct)
    order = np.argsort(uncertainty, kind="stable")
    errors = (~correct[order]).astype(np.float64)
    _, starts, sizes = np.unique(uncertainty[order], return_index=True, return_counts=True)
    tied_error_rate = np.add.reduceat(errors, starts) / sizes
    accepted = np.arange(1, len(errors) + 1)
    risk = np.cumsum(np.repeat(tied_error_rate, sizes)) / accepted
    return accepted / len(errors), risk


def aurc(uncertainty: np.ndarray, correct: np.ndarray) -> float:
    """Area under the risk-coverage curve: the mean risk over the N coverages k / N."""
    return float(risk_coverage_curve(uncertainty, correct)[1].mean())


def accuracy_at_coverage(uncertainty: np.ndarray, correct: np.ndarray, coverage: float) -> float:
    """Accuracy of the ceil(coverage N) least uncertain predictions (ties as in the curve)."""
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    _, risk = risk_coverage_curve(uncertainty, correct)
    # the rounding keeps 0.9 x 10 at 9 accepted, not 10 from a float product above 9
    accepted = max(1, math.ceil(round(coverage * len(risk), 9)))
    return float(1.0 - risk[accepted - 1])


def error_detection_auroc(uncertainty: np.ndarray, correct: np.ndarray) -> float:
    """P(a wrong prediction's score > a right one's) + P(equal) / 2: the AUROC of telling
    wrong from right by the score (Mann-Whitney, mid-ranks); NaN without both kinds."""
    uncertainty, correct = _checked(uncertainty, correct)
    wrong = ~correct
    n_wrong, n_right = int(wrong.sum()), int(correct.sum())
    if n_wrong == 0 or n_right == 0:
        return math.nan
    ranks = rankdata(uncertainty)  # ties share their mean rank
    return float((ranks[wrong].sum() - n_wrong * (n_wrong + 1) / 2) / (n_wrong * n_right))


def selective_metrics(scores: dict[str, np.ndarray], correct: np.ndarray) -> dict[str, float]:
    """For each named uncertainty score: ``aurc_<name>``, ``acc_at_90_<name>``,
    ``acc_at_80_<name>`` and ``auroc_<name>`` (error detection)."""
    metrics = {}
    for name, uncertainty in scores.items():
        metrics[f"aurc_{name}"] = aurc(uncertainty, correct)
        for percent in COVERAGES:
            metrics[f"acc_at_{percent}_{name}"] = accuracy_at_coverage(
                uncertainty, correct, percent / 100
            )
        metrics[f"auroc_{name}"] = error_detection_auroc(uncertainty, correct)
    return metrics
