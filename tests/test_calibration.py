"""Post-hoc temperature scaling on predictors whose calibration is known by construction."""

from __future__ import annotations

import pytest
import torch

from dpivon.evaluation.calibration import (
    MIN_FIT_IMAGES,
    apply_temperature,
    fit_temperature,
    is_determined,
)
from dpivon.evaluation.metrics import accuracy, expected_calibration_error, negative_log_likelihood


def calibrated_predictor(n=4000, k=10, seed=0):
    """Labels drawn from softmax(z): softmax(z) is calibrated, softmax(3 z) over-confident."""
    gen = torch.Generator().manual_seed(seed)
    logits = 1.5 * torch.randn(n, k, generator=gen, dtype=torch.float64)
    probs = torch.softmax(logits, dim=1)
    labels = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    return logits, probs, labels


def test_over_confident_predictor_gets_t_above_one_and_lower_ece():
    logits, _, labels = calibrated_predictor()
    sharp = torch.softmax(3.0 * logits, dim=1)
    temperature = fit_temperature(sharp, labels)
    assert temperature == pytest.approx(3.0, rel=0.1)  # undoes the sharpening
    fixed = apply_temperature(sharp, temperature)
    assert expected_calibration_error(fixed, labels) < 0.5 * expected_calibration_error(
        sharp, labels
    )
    assert negative_log_likelihood(fixed, labels) < negative_log_likelihood(sharp, labels)
    assert accuracy(fixed, labels) == accuracy(sharp, labels)  # the arg-max is unchanged


def test_calibrated_predictor_keeps_t_near_one():
    _, probs, labels = calibrated_predictor(seed=1)
    assert fit_temperature(probs, labels) == pytest.approx(1.0, abs=0.06)


def test_fit_on_validation_apply_on_test():
    """Fit on one split, apply to another: the held-out NLL improves too."""
    logits, _, labels = calibrated_predictor(n=6000, seed=2)
    sharp = torch.softmax(2.0 * logits, dim=1)
    temperature = fit_temperature(sharp[:3000], labels[:3000])
    test_probs, test_labels = sharp[3000:], labels[3000:]
    tempered = apply_temperature(test_probs, temperature)
    assert negative_log_likelihood(tempered, test_labels) < negative_log_likelihood(
        test_probs, test_labels
    )
    torch.testing.assert_close(tempered.sum(dim=1), torch.ones(3000, dtype=torch.float64))


def test_under_confident_predictor_and_input_checks():
    logits, _, labels = calibrated_predictor(seed=3)
    flat = torch.softmax(0.5 * logits, dim=1).float()
    temperature = fit_temperature(flat, labels)
    assert temperature == pytest.approx(0.5, rel=0.1)
    assert apply_temperature(flat, temperature).dtype == torch.float32
    torch.testing.assert_close(apply_temperature(flat, 1.0), flat)
    with pytest.raises(ValueError, match="rows summing to 1"):
        fit_temperature(logits, labels)  # logits, not probabilities
    with pytest.raises(ValueError, match="temperature must be > 0"):
        apply_temperature(flat, 0.0)


def test_no_temperature_where_the_validation_split_does_not_determine_one():
    logits, _, labels = calibrated_predictor(n=200, seed=4)
    sharp = torch.softmax(3.0 * logits, dim=1)
    assert fit_temperature(sharp[:MIN_FIT_IMAGES], labels[:MIN_FIT_IMAGES]) is not None
    assert fit_temperature(sharp[: MIN_FIT_IMAGES - 1], labels[: MIN_FIT_IMAGES - 1]) is None
    # every image classified right: the NLL falls as T -> 0, down to the search's bound (the
    # one validation image of the Tramer & Boneh reproduction gave T = 0.01 and an NLL of 11)
    right = sharp.argmax(dim=1)
    assert fit_temperature(sharp, right) is None
    assert not is_determined(0.01) and not is_determined(100.0) and is_determined(3.0)
