"""The Gaussian mechanism on validation scores: accuracy and ECE released with noise, so
that the validation records that steer a sweep's selection are covered by DP too.

It noises the per-bin sums of a reliability diagram (``ReliabilityDiagram.bin_sums`` of
dpivon.evaluation.metrics) and derives both scores from the noised sums; the noise comes from the
run's `Randomness`, like the gradient noise.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dpivon.privacy.noise import Randomness, gaussian_noise

# Adding or removing one validation record changes one bin's count, correct count and
# confidence sum by at most 1 each.
VALIDATION_SCORE_SENSITIVITY = math.sqrt(3.0)


def private_validation_scores(
    bin_sums: np.ndarray, noise_multiplier: float, randomness: Randomness
) -> dict[str, float]:
    """Accuracy and ECE from Gaussian-noised bin statistics (the Gaussian mechanism).

    ``bin_sums`` (3, n_bins) holds per bin of top-label confidence the number of records,
    the number correct and the confidence sum; each gets
    N(0, (noise_multiplier * sqrt(3))^2): one release is (alpha, alpha / (2 sigma^2))-RDP in
    the validation records, accounted as ``GaussianDpEvent(noise_multiplier)``. Both scores
    are post-processing of the noised statistics.
    """
    if not noise_multiplier > 0:
        raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
    exact = torch.from_numpy(np.asarray(bin_sums, dtype=np.float64))
    std = noise_multiplier * VALIDATION_SCORE_SENSITIVITY
    noise = gaussian_noise(randomness, std, exact.numel(), torch.device("cpu"), torch.float64)
    count, correct, confidence = (exact + noise.view_as(exact)).numpy()
    total = max(float(count.sum()), 1.0)
    return {
        "accuracy": float(np.clip(correct.sum() / total, 0.0, 1.0)),
        "ece": float(np.clip(np.abs(correct - confidence).sum() / total, 0.0, 1.0)),
    }
