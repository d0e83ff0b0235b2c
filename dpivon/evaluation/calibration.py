"""Post-hoc temperature scaling (Guo et al., 2017): the calibration baseline.

One temperature T is fitted on the validation split's predictive probabilities by
minimising their NLL, then applied to the test probabilities: p_T = softmax(log p / T).
It works on probabilities, not on a model's logits, so it applies to any optimizer's
predictive, the IVON BMA average included (log p is a logit vector of the same softmax:
softmax(log p) = p). T > 1 softens an over-confident predictor; the arg-max, hence the
accuracy, never changes. Fitted on held-out data of a private run, T is a function of
that data, so a private release must fit it on public data or privately (arXiv 2210.08248
reports DP temperature scaling cutting in-domain ECE about 3.1x).

The NLL of softmax(z / T) is convex in 1 / T (log-sum-exp of a linear function of 1 / T,
minus a linear term), hence unimodal in log T: a bounded golden-section search on log T
finds its minimum without gradients or a line search.

The data do not always determine T: on a handful of images, or where the NLL keeps falling
to a bound of the search (every validation image classified right: T -> 0 sharpens them
to certainty), the "fitted" T says nothing of the test set. `fit_temperature` then returns
None and the run has no temperature-scaled metrics.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dpivon.evaluation.metrics import NLL_EPSILON, validated_predictions

LOG_TEMPERATURE_BOUNDS = (math.log(1e-2), math.log(1e2))
# Fewer validation images leave the one-parameter fit to a few of them (Guo et al. fit on
# thousands); CIFAR-10 pipelines hold 1,000-5,000, tests' synthetic runs 30 or more.
MIN_FIT_IMAGES = 30
# A log T this close to a bound of the search is the NLL still falling there, not a minimum
_AT_BOUND = 1e-3
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def _tempered_log_probs(probs: Tensor, temperature: float) -> Tensor:
    """log softmax(log p / T), in float64; p is clamped to ``NLL_EPSILON`` before the log."""
    return torch.log_softmax(probs.double().clamp_min(NLL_EPSILON).log() / temperature, dim=1)


def is_determined(temperature: float) -> bool:
    """Whether a fitted T lies inside the search's bounds: a minimum the data determine."""
    low, high = LOG_TEMPERATURE_BOUNDS
    return low + _AT_BOUND < math.log(temperature) < high - _AT_BOUND


def fit_temperature(probs: Tensor, labels: Tensor, tolerance: float = 1e-6) -> float | None:
    """The T in [0.01, 100] that minimises the mean NLL of ``apply_temperature(probs, T)``,
    or None where the data do not determine it (fewer than `MIN_FIT_IMAGES` images, or the
    NLL's minimum at a bound of the search: `is_determined`).

    ``probs`` (N, K) are predictive probabilities of the validation split and ``labels``
    (N,) its classes. Golden-section search on log T to ``tolerance`` (in log T).
    """
    probs, labels = validated_predictions(probs, labels)
    if len(labels) < MIN_FIT_IMAGES:
        return None

    def nll(log_temperature: float) -> float:
        log_probs = _tempered_log_probs(probs, math.exp(log_temperature))
        return -log_probs.gather(1, labels.unsqueeze(1)).mean().item()

    low, high = LOG_TEMPERATURE_BOUNDS
    inner_low, inner_high = high - _GOLDEN * (high - low), low + _GOLDEN * (high - low)
    nll_low, nll_high = nll(inner_low), nll(inner_high)
    while high - low > tolerance:
        if nll_low <= nll_high:
            high, inner_high, nll_high = inner_high, inner_low, nll_low
            inner_low = high - _GOLDEN * (high - low)
            nll_low = nll(inner_low)
        else:
            low, inner_low, nll_low = inner_low, inner_high, nll_high
            inner_high = low + _GOLDEN * (high - low)
            nll_high = nll(inner_high)
    temperature = math.exp((low + high) / 2.0)
    return temperature if is_determined(temperature) else None


def apply_temperature(probs: Tensor, temperature: float) -> Tensor:
    """softmax(log p / T), in the dtype of ``probs``; T = 1 returns p (up to the clamp)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _tempered_log_probs(probs, temperature).exp().to(probs.dtype)


__all__ = [
    "LOG_TEMPERATURE_BOUNDS",
    "MIN_FIT_IMAGES",
    "apply_temperature",
    "fit_temperature",
    "is_determined",
]
