"""Classification and calibration metrics on predictive probabilities.

Every function takes ``probs`` (float tensor, shape (N, K), rows summing to 1) and integer
``labels`` (shape (N,)) and returns plain Python floats. Sums are accumulated in float64 so
results do not depend on the dtype of ``probs`` beyond its own rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

NLL_EPSILON = 1e-12
"""Probabilities are clamped to at least this before the log, so NLL stays finite."""


def validated_predictions(probs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Check shapes, dtypes and ranges; return detached ``probs`` and int64 ``labels``.
    Every metric (and the temperature fit of dpivon.evaluation.calibration) starts with it."""
    if not isinstance(probs, Tensor) or not isinstance(labels, Tensor):
        raise TypeError("probs and labels must be torch.Tensor")
    if probs.ndim != 2:
        raise ValueError(f"probs must be 2-D (N, K), got shape {tuple(probs.shape)}")
    if not probs.is_floating_point():
        raise ValueError(f"probs must be a floating-point tensor, got {probs.dtype}")
    if labels.ndim != 1 or labels.shape[0] != probs.shape[0]:
        raise ValueError(
            f"labels must be 1-D with one entry per row of probs ({probs.shape[0]}), "
            f"got shape {tuple(labels.shape)}"
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    n, k = probs.shape
    if n == 0 or k == 0:
        raise ValueError(f"probs must have at least one row and one column, got {(n, k)}")
    probs, labels = probs.detach(), labels.detach().long()
    if labels.min() < 0 or labels.max() >= k:
        raise ValueError(f"labels must lie in [0, {k - 1}]")
    # A loose row-sum check catches logits passed by mistake; the tolerance grows with K and
    # the dtype's epsilon so that half-precision softmax outputs still pass.
    tol = max(1e-3, k * torch.finfo(probs.dtype).eps)
    row_sums = probs.double().sum(dim=1)
    if probs.min() < 0 or (row_sums - 1).abs().max() > tol:
        raise ValueError("probs must be non-negative with rows summing to 1 (pass softmax output)")
    return probs, labels


def accuracy(probs: Tensor, labels: Tensor) -> float:
    """Fraction of examples whose arg-max class (first one on ties) equals the label."""
    probs, labels = validated_predictions(probs, labels)
    return (probs.argmax(dim=1) == labels).double().mean().item()


def negative_log_likelihood(probs: Tensor, labels: Tensor) -> float:
    """Mean ``-log p(y | x)``; p is clamped to at least ``NLL_EPSILON`` (1e-12) to avoid inf."""
    probs, labels = validated_predictions(probs, labels)
    p_true = probs.double().gather(1, labels.unsqueeze(1)).squeeze(1)
    return -p_true.clamp_min(NLL_EPSILON).log().mean().item()


def brier_score(probs: Tensor, labels: Tensor) -> float:
    """Multi-class Brier score: mean over examples of ``sum_k (p_k - onehot_k)^2``, in [0, 2]."""
    probs, labels = validated_predictions(probs, labels)
    onehot = torch.nn.functional.one_hot(labels, probs.shape[1]).double()
    return (probs.double() - onehot).square().sum(dim=1).mean().item()


@dataclass(frozen=True, eq=False)
class ReliabilityDiagram:
    """Per-bin statistics of top-label confidence; empty bins have NaN accuracy/confidence."""

    bin_edges: np.ndarray  # (n_bins + 1,), i / n_bins
    bin_accuracy: np.ndarray  # (n_bins,), fraction correct in each bin
    bin_confidence: np.ndarray  # (n_bins,), mean top-label confidence in each bin
    bin_count: np.ndarray  # (n_bins,), int64 number of examples in each bin

    @property
    def num_examples(self) -> int:
        return int(self.bin_count.sum())

    @property
    def ece(self) -> float:
        """Expected calibration error: ``sum_b |acc_b - conf_b| * n_b / N``."""
        filled = self.bin_count > 0
        gaps = np.abs(self.bin_accuracy[filled] - self.bin_confidence[filled])
        return float((gaps * self.bin_count[filled]).sum() / self.num_examples)

    @property
    def accuracy(self) -> float:
        filled = self.bin_count > 0
        return float((self.bin_accuracy[filled] * self.bin_count[filled]).sum() / self.num_examples)

    @property
    def mean_confidence(self) -> float:
        filled = self.bin_count > 0
        weighted = self.bin_confidence[filled] * self.bin_count[filled]
        return float(weighted.sum() / self.num_examples)

    def bin_sums(self) -> np.ndarray:
        """(3, n_bins) float64: per bin the number of examples, the number correct and the sum
        of confidences; what the validation scores' Gaussian mechanism noises
        (`dpivon.privacy.validation`)."""
        filled = self.bin_count > 0
        correct = np.where(filled, self.bin_accuracy * self.bin_count, 0.0)
        confidence = np.where(filled, self.bin_confidence * self.bin_count, 0.0)
        return np.stack([self.bin_count.astype(np.float64), correct, confidence])


def reliability_diagram(probs: Tensor, labels: Tensor, n_bins: int = 15) -> ReliabilityDiagram:
    """Bin examples by top-label confidence into ``n_bins`` equal-width bins on [0, 1].

    Bin i is ``(i/n, (i+1)/n]``; a confidence of exactly 0 goes to the first bin. This is the
    only binning code: ``expected_calibration_error`` is computed from its result.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    probs, labels = validated_predictions(probs, labels)
    confidence, prediction = probs.max(dim=1)
    # numpy's i / n is correctly rounded in float64, and rounding that on to a narrower float
    # equals computing i / n in that float (double rounding is harmless for division when the
    # wide format has >= 2p + 2 bits). So a float32 confidence of 0.2 equals the float32 edge
    # 2/10 and lands in the lower bin as documented. torch's tensor / scalar may multiply by
    # the reciprocal instead, which is why the edges are not built with torch.
    edges = np.arange(n_bins + 1, dtype=np.float64) / n_bins
    inner_edges = torch.from_numpy(edges[1:-1]).to(device=probs.device, dtype=probs.dtype)
    # right=False gives edges[i-1] < c <= edges[i], i.e. right-closed bins; 0 maps to bin 0.
    bins = torch.bucketize(confidence, inner_edges, right=False)

    count = torch.bincount(bins, minlength=n_bins)
    zeros = torch.zeros(n_bins, dtype=torch.float64, device=probs.device)
    sum_conf = zeros.scatter_add(0, bins, confidence.double())
    sum_correct = zeros.scatter_add(0, bins, (prediction == labels).double())
    denom = count.double()
    nan = torch.full_like(zeros, float("nan"))
    return ReliabilityDiagram(
        bin_edges=edges,
        bin_accuracy=torch.where(count > 0, sum_correct / denom, nan).cpu().numpy(),
        bin_confidence=torch.where(count > 0, sum_conf / denom, nan).cpu().numpy(),
        bin_count=count.cpu().numpy().astype(np.int64),
    )


def expected_calibration_error(probs: Tensor, labels: Tensor, n_bins: int = 15) -> float:
    """Top-label ECE of Guo et al. (2017) with equal-width bins (see ``reliability_diagram``)."""
    return reliability_diagram(probs, labels, n_bins).ece


def classification_metrics(probs: Tensor, labels: Tensor, n_bins: int = 15) -> dict[str, float]:
    """All metrics at once: keys ``accuracy``, ``nll``, ``brier``, ``ece``."""
    return {
        "accuracy": accuracy(probs, labels),
        "nll": negative_log_likelihood(probs, labels),
        "brier": brier_score(probs, labels),
        "ece": expected_calibration_error(probs, labels, n_bins),
    }


def json_number(value: object) -> object:
    """JSON has no inf/NaN: non-finite floats become null (``--json`` files, artifacts)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
