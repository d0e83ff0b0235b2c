"""Tests for classification and calibration metrics against hand-computed values."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from dpivon.evaluation.metrics import (
    NLL_EPSILON,
    accuracy,
    brier_score,
    classification_metrics,
    expected_calibration_error,
    negative_log_likelihood,
    reliability_diagram,
)
from dpivon.plots import plot_reliability_diagram

# Five examples, three classes. With n_bins=5 the edges are 0, .2, .4, .6, .8, 1 and bins are
# right-closed, so the confidences .6 and .4 sit on edges and belong to the lower bin.
#   probs              label  conf  pred  correct  bin
#   [.9, .05, .05]     0      .9    0     1        4 (.8, 1]
#   [.7, .2,  .1 ]     1      .7    0     0        3 (.6, .8]
#   [.5, .3,  .2 ]     0      .5    0     1        2 (.4, .6]
#   [.2, .6,  .2 ]     1      .6    1     1        2 (.4, .6]  on the edge .6
#   [.4, .4,  .2 ]     2      .4    0     0        1 (.2, .4]  on the edge .4; tie -> class 0
PROBS = torch.tensor(
    [
        [0.9, 0.05, 0.05],
        [0.7, 0.2, 0.1],
        [0.5, 0.3, 0.2],
        [0.2, 0.6, 0.2],
        [0.4, 0.4, 0.2],
    ],
    dtype=torch.float64,
)
LABELS = torch.tensor([0, 1, 0, 1, 2])


def _calibrated_sample(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random predictive distributions and labels drawn from them: perfectly calibrated."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(2.0 * torch.randn(n, k, generator=gen), dim=1)
    labels = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    return probs, labels


def numpy_reliability(
    probs: torch.Tensor, labels: torch.Tensor, n_bins: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Per-bin (count, accuracy, confidence) and ECE, binned in numpy independently of
    dpivon: confidence c lands in bin ceil(n_bins c) - 1 (right-closed, 0 in bin 0)."""
    p = probs.double().numpy()
    confidence, correct = p.max(axis=1), p.argmax(axis=1) == labels.numpy()
    bins = np.clip(np.ceil(confidence * n_bins).astype(int) - 1, 0, n_bins - 1)
    count = np.bincount(bins, minlength=n_bins)
    with np.errstate(invalid="ignore"):  # empty bins: NaN, as in the diagram
        acc = np.bincount(bins, weights=correct, minlength=n_bins) / count
        conf = np.bincount(bins, weights=confidence, minlength=n_bins) / count
    filled = count > 0
    ece = np.sum(np.abs(acc - conf)[filled] * count[filled]) / len(p)
    return count, acc, conf, float(ece)


def test_accuracy_by_hand() -> None:
    # correct = 1, 0, 1, 1, 0
    assert accuracy(PROBS, LABELS) == pytest.approx(3 / 5)


def test_nll_by_hand() -> None:
    # p(true label) = .9, .2, .5, .6, .2
    expected = -(math.log(0.9) + math.log(0.2) + math.log(0.5) + math.log(0.6) + math.log(0.2))
    assert negative_log_likelihood(PROBS, LABELS) == pytest.approx(expected / 5)


def test_nll_clamps_zero_probability() -> None:
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    labels = torch.tensor([1, 0])
    expected = (-math.log(NLL_EPSILON) - math.log(0.5)) / 2
    assert negative_log_likelihood(probs, labels) == pytest.approx(expected)


def test_brier_by_hand() -> None:
    # sum_k (p_k - onehot_k)^2 per example:
    #   .1^2 + .05^2 + .05^2 = .015
    #   .7^2 + .8^2  + .1^2  = 1.14
    #   .5^2 + .3^2  + .2^2  = .38
    #   .2^2 + .4^2  + .2^2  = .24
    #   .4^2 + .4^2  + .8^2  = .96
    # mean = 2.735 / 5 = .547
    assert brier_score(PROBS, LABELS) == pytest.approx(0.547)


def test_brier_extremes() -> None:
    labels = torch.tensor([0, 1])
    assert brier_score(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), labels) == 0.0
    assert brier_score(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), labels) == pytest.approx(2.0)


def test_ece_and_diagram_by_hand() -> None:
    # bin 1: {5}      acc 0, conf .4,  gap .4,  n 1
    # bin 2: {3, 4}   acc 1, conf .55, gap .45, n 2
    # bin 3: {2}      acc 0, conf .7,  gap .7,  n 1
    # bin 4: {1}      acc 1, conf .9,  gap .1,  n 1
    # ECE = (.4 * 1 + .45 * 2 + .7 * 1 + .1 * 1) / 5 = 2.1 / 5 = .42
    diagram = reliability_diagram(PROBS, LABELS, n_bins=5)
    np.testing.assert_allclose(diagram.bin_edges, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    np.testing.assert_array_equal(diagram.bin_count, [0, 1, 2, 1, 1])
    np.testing.assert_allclose(diagram.bin_accuracy, [np.nan, 0.0, 1.0, 0.0, 1.0])
    np.testing.assert_allclose(diagram.bin_confidence, [np.nan, 0.4, 0.55, 0.7, 0.9])
    assert diagram.num_examples == 5
    assert diagram.accuracy == pytest.approx(0.6)
    assert diagram.mean_confidence == pytest.approx((0.9 + 0.7 + 0.5 + 0.6 + 0.4) / 5)
    assert expected_calibration_error(PROBS, LABELS, n_bins=5) == pytest.approx(0.42)


def test_ece_single_bin_is_accuracy_confidence_gap() -> None:
    # One bin: |mean accuracy - mean confidence| = |.6 - .62| = .02
    assert expected_calibration_error(PROBS, LABELS, n_bins=1) == pytest.approx(0.02)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_bin_edges_are_right_closed(dtype: torch.dtype) -> None:
    # Two classes, n_bins=10; top-label confidence c goes to bin ceil(10 c) - 1.
    above_six = torch.nextafter(torch.tensor(0.6, dtype=dtype), torch.tensor(1.0, dtype=dtype))
    conf = torch.stack(
        [
            torch.tensor(0.5, dtype=dtype),  # on the edge .5 -> bin 4 (.4, .5]
            torch.tensor(0.6, dtype=dtype),  # on the edge .6 -> bin 5 (.5, .6]
            above_six,  # just above .6 -> bin 6
            torch.tensor(1.0, dtype=dtype),  # on the top edge -> last bin 9
        ]
    )
    probs = torch.stack([conf, 1 - conf], dim=1)
    diagram = reliability_diagram(probs, torch.zeros(4, dtype=torch.long), n_bins=10)
    expected_count = np.zeros(10, dtype=np.int64)
    expected_count[[4, 5, 6, 9]] = 1
    np.testing.assert_array_equal(diagram.bin_count, expected_count)


def test_confidence_at_lowest_edge_goes_to_first_bin() -> None:
    # Five equal classes: confidence exactly .2 is the upper edge of bin 0 for n_bins=5.
    probs = torch.full((2, 5), 0.2)
    diagram = reliability_diagram(probs, torch.tensor([0, 1]), n_bins=5)
    np.testing.assert_array_equal(diagram.bin_count, [2, 0, 0, 0, 0])
    # Arg-max breaks the tie towards class 0, so one of the two is correct.
    assert diagram.bin_accuracy[0] == pytest.approx(0.5)


def test_ece_and_diagram_match_numpy_binning() -> None:
    probs, labels = _calibrated_sample(2_000, 4, seed=1)
    probs = torch.softmax(3.0 * probs.log(), dim=1)  # sharpen: overconfident, ECE clearly > 0
    count, acc, conf, ece = numpy_reliability(probs, labels, n_bins=15)
    d = reliability_diagram(probs, labels, n_bins=15)
    np.testing.assert_array_equal(d.bin_count, count)
    np.testing.assert_allclose(d.bin_accuracy, acc, rtol=1e-12, err_msg="bin accuracy")
    np.testing.assert_allclose(d.bin_confidence, conf, rtol=1e-12, err_msg="bin confidence")
    assert ece > 0.05
    assert expected_calibration_error(probs, labels, n_bins=15) == pytest.approx(ece, rel=1e-12)


def test_perfectly_calibrated_predictions_have_small_ece() -> None:
    probs, labels = _calibrated_sample(100_000, 10, seed=0)
    # Sampling noise alone gives about 0.4 * sqrt(n_bins / N) ~ 0.005.
    assert expected_calibration_error(probs, labels) < 0.01
    overconfident = torch.softmax(3.0 * probs.log(), dim=1)
    assert expected_calibration_error(overconfident, labels) > 0.05


def test_classification_metrics_keys_and_values() -> None:
    metrics = classification_metrics(PROBS, LABELS, n_bins=5)
    assert metrics == {
        "accuracy": pytest.approx(0.6),
        "nll": pytest.approx(negative_log_likelihood(PROBS, LABELS)),
        "brier": pytest.approx(0.547),
        "ece": pytest.approx(0.42),
    }
    assert all(type(v) is float for v in metrics.values())


def test_float32_matches_float64() -> None:
    probs, labels = _calibrated_sample(1_000, 10, seed=2)
    m64 = classification_metrics(probs.double(), labels)
    m32 = classification_metrics(probs.float(), labels)
    for key in m64:
        assert m32[key] == pytest.approx(m64[key], abs=1e-5)


@pytest.mark.parametrize(
    ("probs", "labels", "match"),
    [
        (torch.tensor([0.5, 0.5]), torch.tensor([0]), "2-D"),
        (PROBS, LABELS[:4], "one entry per row"),
        (PROBS, LABELS.unsqueeze(1), "one entry per row"),
        (PROBS, LABELS.double(), "integer"),
        (PROBS, torch.tensor([0, 1, 0, 1, 3]), r"\[0, 2\]"),
        (PROBS.log(), LABELS, "summing to 1"),
        (torch.ones(5, 3).long(), LABELS, "floating-point"),
        (torch.empty(0, 3), torch.empty(0, dtype=torch.long), "at least one row"),
    ],
)
def test_invalid_inputs(probs: torch.Tensor, labels: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        classification_metrics(probs, labels)


def test_invalid_n_bins() -> None:
    with pytest.raises(ValueError, match="n_bins"):
        expected_calibration_error(PROBS, LABELS, n_bins=0)


def test_plot_reliability_diagram(tmp_path: Path) -> None:
    probs, labels = _calibrated_sample(5_000, 10, seed=3)
    probs = torch.softmax(2.0 * probs.log(), dim=1)
    count, acc, conf, ece = numpy_reliability(probs, labels, n_bins=15)
    fig = plot_reliability_diagram(reliability_diagram(probs, labels), title="Overconfident")
    assert isinstance(fig, Figure)
    ax_rel, ax_hist = fig.axes
    accuracy_bars, gap_bars = ax_rel.containers
    filled = count > 0
    # accuracy bars: each bin's accuracy (0 where empty); the gap spans accuracy to confidence
    bar_heights = [bar.get_height() for bar in accuracy_bars]
    np.testing.assert_allclose(bar_heights, np.where(filled, acc, 0.0), err_msg="accuracy bars")
    gap_spans = [(bar.get_y(), bar.get_y() + bar.get_height()) for bar in gap_bars]
    expected_spans = np.stack([np.minimum(acc, conf), np.maximum(acc, conf)], axis=1)[filled]
    np.testing.assert_allclose(gap_spans, expected_spans, err_msg="gap bars")
    (hist_bars,) = ax_hist.containers
    np.testing.assert_allclose([bar.get_height() for bar in hist_bars], count / count.sum())
    # the vertical lines: overall accuracy and mean confidence
    overall = [np.sum(v[filled] * count[filled]) / count.sum() for v in (acc, conf)]
    np.testing.assert_allclose([line.get_xdata()[0] for line in ax_hist.lines], overall)
    assert f"{100 * ece:.2f}%" in ax_rel.get_legend_handles_labels()[1][-1]
    path = tmp_path / "reliability.png"
    fig.savefig(path, dpi=100)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
