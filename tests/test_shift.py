"""Uncertainty under shift: the corrupted sets (deterministic, cached beside CIFAR-10, farther
from the clean images as severity grows), the selective-prediction and error-detection
metrics (a hand-computed case and scikit-learn), and their scoring of a model."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import CIFAR10_TARBALL
from mlflow import MlflowClient
from sklearn.metrics import roc_auc_score
from sweep_helpers import write_pipeline
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.config import TrainConfig
from dpivon.data import load_cifar10, synthetic_cifar10
from dpivon.data.corruptions import CORRUPTIONS, corrupt_images, load_corrupted
from dpivon.errors import DpivonError
from dpivon.evaluation.prediction import Predictions
from dpivon.evaluation.selective import (
    accuracy_at_coverage,
    aurc,
    error_detection_auroc,
    risk_coverage_curve,
    selective_metrics,
)
from dpivon.evaluation.shift import (
    DEFAULT_CORRUPTIONS,
    ShiftSet,
    check_shift_request,
    evaluate_shift,
    shift_images,
    uncertainty_scores,
    validation_shift_scores,
)
from dpivon.models import build_model
from dpivon.runs import load_data, train
from dpivon.search.pipeline import load_pipeline
from dpivon.search.sweep import run_sweep
from dpivon.tracking.model_file import save_model_file
from dpivon.tracking.served_model import load_scored_model

# --- the corrupted sets ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cifar_test():
    """200 CIFAR-10 test images (the first of each class's 20), with their test-set indices."""
    _, test = load_cifar10(CIFAR10_TARBALL)
    keys = np.concatenate([np.flatnonzero(test.labels == c)[:20] for c in range(10)])
    return test.take(keys), keys


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_every_corruption_is_the_same_bytes_twice_and_changes_the_images(cifar_test, corruption):
    arrays, keys = cifar_test
    first = corrupt_images(arrays.images[:20], keys[:20], corruption, 3)
    again = corrupt_images(arrays.images[:20], keys[:20], corruption, 3)
    assert first.dtype == np.uint8 and first.shape == (20, 32, 32, 3)
    assert first.tobytes() == again.tobytes()
    assert not np.array_equal(first, arrays.images[:20])


def test_an_image_is_corrupted_alike_alone_or_in_a_set_and_by_its_key(cifar_test):
    arrays, keys = cifar_test
    together = corrupt_images(arrays.images[:5], keys[:5], "gaussian_noise", 2)
    alone = corrupt_images(arrays.images[3:4], keys[3:4], "gaussian_noise", 2)
    assert np.array_equal(together[3], alone[0])
    other_key = corrupt_images(arrays.images[3:4], keys[3:4] + 1, "gaussian_noise", 2)
    assert not np.array_equal(alone, other_key)


def _distance(clean: np.ndarray, corrupted: np.ndarray) -> float:
    return float(np.abs(corrupted.astype(np.float64) - clean).mean())


@pytest.mark.parametrize("corruption", DEFAULT_CORRUPTIONS)
def test_the_default_corruptions_move_farther_from_the_clean_images_with_severity(
    cifar_test, corruption
):
    arrays, keys = cifar_test
    distances = [
        _distance(arrays.images, corrupt_images(arrays.images, keys, corruption, severity))
        for severity in range(1, 6)
    ]
    assert all(a < b for a, b in itertools.pairwise(distances)), distances


def test_over_all_19_corruptions_the_mean_distance_grows_with_severity(cifar_test):
    arrays, keys = cifar_test
    images, keys = arrays.images[:40:2], keys[:40:2]
    means = [
        np.mean([_distance(images, corrupt_images(images, keys, c, s)) for c in CORRUPTIONS])
        for s in range(1, 6)
    ]
    assert all(a < b for a, b in itertools.pairwise(means)), means


def test_cifar10c_constants_not_imagenet_c(cifar_test):
    """CIFAR-10-C's Gaussian noise at severity 1 has std 0.04 (ImageNet-C's: 0.08): before
    clipping the pixel differences have that std."""
    arrays, keys = cifar_test
    mid = arrays.images[:100]
    noisy = corrupt_images(mid, keys[:100], "gaussian_noise", 1).astype(np.float64)
    inside = (mid > 40) & (mid < 215)  # no clipping there
    std = float((noisy - mid)[inside].std() / 255)
    assert 0.035 < std < 0.045


def test_corrupted_sets_are_cached_beside_cifar10_and_read_back(cifar_test, tmp_path):
    arrays, keys = cifar_test
    made = load_corrupted(arrays, keys, "fog", 4, cache_dir=tmp_path)
    [cached] = tmp_path.glob("cifar10c-fog-s4-*.npz")
    stamp = cached.stat().st_mtime_ns
    read = load_corrupted(arrays, keys, "fog", 4, cache_dir=tmp_path)
    assert cached.stat().st_mtime_ns == stamp  # read, not made again
    assert read.images.tobytes() == made.images.tobytes()
    assert np.array_equal(read.labels, arrays.labels)
    assert read.images.tobytes() == corrupt_images(arrays.images, keys, "fog", 4).tobytes()
    # other images are another set, never the cached one
    load_corrupted(arrays.take(np.arange(10)), keys[:10], "fog", 4, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("cifar10c-fog-s4-*.npz"))) == 2


def test_training_draws_are_untouched_by_corrupting():
    np.random.seed(7)
    expected = np.random.random(3)
    np.random.seed(7)
    images, _ = synthetic_cifar10(20, 10)
    corrupt_images(images.images[:2], np.arange(2), "fog", 3)  # the library's global draws
    corrupt_images(images.images[:2], np.arange(2), "spatter", 3)
    assert np.array_equal(np.random.random(3), expected)


@pytest.mark.parametrize(
    ("corruptions", "severities", "message"),
    [
        (("fogg",), (1,), "unknown corruption 'fogg'; choose among gaussian_noise"),
        (("fog",), (0,), "severity must be an integer from 1 to 5, got 0"),
        (("fog",), (6,), "severity must be an integer from 1 to 5, got 6"),
    ],
)
def test_bad_requests_fail_in_one_line(corruptions, severities, message):
    with pytest.raises(DpivonError, match=message):
        check_shift_request(corruptions, severities)


def test_the_shift_images_are_stratified_and_fixed():
    _, test = synthetic_cifar10(100, 200)
    clean, keys = shift_images(test, 5)
    assert np.bincount(clean.labels).tolist() == [5] * 10
    assert np.array_equal(clean.images, test.images[keys])
    assert np.array_equal(shift_images(test, 5)[1], keys)
    capped, _ = shift_images(test, 1000)  # a class with fewer gives all of them
    assert len(capped) == len(test)


# --- selective prediction and error detection ------------------------------------------------


def test_hand_computed_curve_aurc_coverage_accuracy_and_auroc():
    # uncertainty ascending: right, wrong, right, wrong
    uncertainty = np.array([0.4, 0.1, 0.3, 0.2])
    correct = np.array([False, True, True, False])
    coverage, risk = risk_coverage_curve(uncertainty, correct)
    assert coverage.tolist() == [0.25, 0.5, 0.75, 1.0]
    assert risk.tolist() == pytest.approx([0, 1 / 2, 1 / 3, 2 / 4])
    assert aurc(uncertainty, correct) == pytest.approx((0 + 1 / 2 + 1 / 3 + 1 / 2) / 4)
    assert accuracy_at_coverage(uncertainty, correct, 0.5) == pytest.approx(0.5)
    assert accuracy_at_coverage(uncertainty, correct, 0.75) == pytest.approx(2 / 3)
    # pairs (wrong, right): (0.4, 0.1) (0.4, 0.3) (0.2, 0.1) are ordered, (0.2, 0.3) is not
    assert error_detection_auroc(uncertainty, correct) == pytest.approx(3 / 4)


def test_ties_count_as_a_random_order_in_expectation():
    uncertainty = np.array([0.1, 0.5, 0.5, 0.9])
    correct = np.array([True, True, False, False])
    _, risk = risk_coverage_curve(uncertainty, correct)
    # the tied pair holds one error: half an error expected at 2 accepted, one at 3
    assert risk.tolist() == pytest.approx([0, 0.5 / 2, 1 / 3, 2 / 4])
    assert error_detection_auroc(uncertainty, correct) == pytest.approx((1 + 0.5 + 1 + 1) / 4)
    order = np.array([2, 0, 3, 1])
    assert aurc(uncertainty[order], correct[order]) == pytest.approx(aurc(uncertainty, correct))


def test_auroc_agrees_with_scikit_learn_on_random_scores():
    rng = np.random.default_rng(3)
    for n in (10, 57, 500):
        correct = rng.random(n) < 0.7
        uncertainty = np.round(rng.random(n) + 0.3 * ~correct, 2)  # with ties
        expected = roc_auc_score(~correct, uncertainty)
        assert error_detection_auroc(uncertainty, correct) == pytest.approx(expected, abs=1e-12)


def test_a_perfect_ranking_and_no_errors():
    correct = np.array([True, True, False])
    assert aurc(np.array([0.0, 0.1, 0.9]), correct) == pytest.approx((0 + 0 + 1 / 3) / 3)
    assert error_detection_auroc(np.array([0.0, 0.1, 0.9]), correct) == 1.0
    assert math.isnan(error_detection_auroc(np.array([0.1, 0.2]), np.array([True, True])))
    keys = selective_metrics({"maxprob": np.array([0.0, 0.1, 0.9])}, correct)
    assert list(keys) == [
        "aurc_maxprob", "acc_at_90_maxprob", "acc_at_80_maxprob", "auroc_maxprob",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="coverage must be in"):
        accuracy_at_coverage(np.array([0.1]), np.array([True]), 0.0)


def test_scores_are_uncertainties_one_minus_top_probability_entropy_and_mi():
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4]])
    predictions = Predictions(probs, torch.tensor([0.3, 0.7]), torch.tensor([0.01, 0.2]))
    scores = uncertainty_scores(predictions)
    assert scores["maxprob"] == pytest.approx([0.1, 0.4])
    assert scores["entropy"].tolist() == pytest.approx([0.3, 0.7])
    assert scores["mi"].tolist() == pytest.approx([0.01, 0.2])
    assert "mi" not in uncertainty_scores(Predictions(probs, torch.tensor([0.3, 0.7]), None))


def test_evaluate_shift_scores_clean_and_every_corruption_and_severity(tmp_path, monkeypatch):
    monkeypatch.setenv("DPIVON_CACHE", str(tmp_path))
    _, test = synthetic_cifar10(100, 100)
    torch.manual_seed(0)
    model = build_model("small-cnn")
    shift_set = ShiftSet(("gaussian_noise", "contrast"), (1, 5), per_class=3)
    result = evaluate_shift(model, None, test, shift_set, bma_samples=0, seed=0, n_bins=15)
    assert [(r["corruption"], r["severity"]) for r in result.rows] == [
        ("none", 0), ("gaussian_noise", 1), ("gaussian_noise", 5), ("contrast", 1),
        ("contrast", 5),
    ]  # fmt: skip
    assert result.images == 30
    means = result.by_severity()
    expected = np.mean([result.rows[2]["ece"], result.rows[4]["ece"]])
    assert means["shift_s5_ece"] == pytest.approx(expected)
    assert means["shift_s0_accuracy"] == result.rows[0]["accuracy"]
    assert "shift_s1_auroc_entropy" in means and "shift_s1_auroc_mi" not in means
    assert len(list(tmp_path.glob("cifar10c-*.npz"))) == 4


# --- everywhere a run is scored: dpivon train --shift, dpivon evaluate ------------------------

runner = CliRunner()
SHIFT_ARGS = ("--corruption", "gaussian_noise", "--corruption", "contrast", "--severity", "1",
              "--severity", "5", "--per-class", "3")  # fmt: skip


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> tuple[Path, str, dict]:
    """A short synthetic dp-ivon-gradsq run, trained with --shift default: (its folder, its
    model URI, its --json summary)."""
    work = tmp_path_factory.mktemp("shift")
    out = work / "out.json"
    result = runner.invoke(app, [
        "train", "--dataset", "synthetic", "--set", "synthetic_size=300", "--model", "small-cnn",
        "--optimizer", "dp-ivon-gradsq", "--epochs", "1", "--batch-size", "64",
        "--bma-samples", "2", "--tracking-uri", f"sqlite:///{work}/mlflow.db", "--json", str(out),
        "--shift", "default",
    ], env={"DPIVON_CACHE": str(work / "cache")})  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    return work, f"runs:/{summary['mlflow_run_id']}/model", summary


def test_train_shift_writes_the_metrics_to_json_and_mlflow(logged):
    work, model_uri, summary = logged
    for severity in range(6):  # the default set: 4 corruptions x 5 severities, and clean
        for metric in ("accuracy", "ece", "nll", "aurc_maxprob", "auroc_entropy", "auroc_mi"):
            assert f"test_shift_s{severity}_{metric}" in summary
    run = MlflowClient(f"sqlite:///{work}/mlflow.db").get_run(model_uri.split("/")[1])
    assert run.data.metrics["test_shift_s3_ece"] == pytest.approx(summary["test_shift_s3_ece"])
    record = MlflowClient(f"sqlite:///{work}/mlflow.db").download_artifacts(
        run.info.run_id, "shift.json", str(work)
    )
    sets = json.loads(Path(record).read_text())["sets"]
    assert len(sets) == 1 + 4 * 5 and sets[0]["corruption"] == "none"


def evaluate_cli(work: Path, model: str, *args: str) -> dict:
    out = work / "evaluate.json"
    result = runner.invoke(
        app,
        ["evaluate", model, *args, "--json", str(out), "--tracking-uri",
         f"sqlite:///{work}/mlflow.db"],
        env={"DPIVON_CACHE": str(work / "cache")},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_evaluate_scores_a_logged_model_without_retraining(logged):
    work, model_uri, summary = logged
    scored = evaluate_cli(work, model_uri, *SHIFT_ARGS)
    assert scored["optimizer"] == "dp-ivon-gradsq" and scored["bma_samples"] == 2
    assert scored["data_source"] == "synthetic test images"
    assert scored["images"] == 30 and scored["severities"] == [1, 5]
    assert [(s["corruption"], s["severity"]) for s in scored["sets"]] == [
        ("none", 0), ("gaussian_noise", 1), ("gaussian_noise", 5), ("contrast", 1),
        ("contrast", 5),
    ]  # fmt: skip
    for key in ("shift_s0_accuracy", "shift_s5_ece", "shift_s1_aurc_mi", "shift_s5_auroc_mi"):
        assert key in scored
    # the default set, as the run's own --shift scored it: the same model, draws and images
    default = evaluate_cli(work, model_uri)
    assert default["corruptions"] == list(DEFAULT_CORRUPTIONS)
    means = {k: v for k, v in default.items() if k.startswith("shift_s")}
    assert means == {k.removeprefix("test_"): v for k, v in summary.items() if "_shift_" in k}


def test_evaluate_takes_a_model_file_as_committed_weights_are(logged):
    work, model_uri, _ = logged
    config, model, posterior = load_scored_model(model_uri, f"sqlite:///{work}/mlflow.db")
    weights = work / "model.pt"
    save_model_file(weights, config, model, posterior)
    from_file = evaluate_cli(work, str(weights), *SHIFT_ARGS)
    from_run = evaluate_cli(work, model_uri, *SHIFT_ARGS)
    assert from_file["sets"] == from_run["sets"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{work}/no-such-model"], "does not exist"),
        (["runs:/0123456789abcdef/model"], "cannot load the model runs:/0123456789abcdef/model"),
        (["{model}", "--corruption", "fogg"], "unknown corruption 'fogg'"),
        (["{model}", "--severity", "6"], "severity must be an integer from 1 to 5, got 6"),
        (["{model}", "--severity", "0"], "severity must be an integer from 1 to 5, got 0"),
        # no silent substitute data, no silent cap
        (["{model}", "--data-path", "{work}/no-such.tar.gz"], "no-such.tar.gz does not exist"),
        (["{model}", "--data-path", "{work}"], "was trained on synthetic images"),
        (["{model}", "--per-class", "1000000000000"], "is above the 6 synthetic test images"),
    ],
)
def test_evaluate_refuses_bad_input_in_one_line_with_exit_2(logged, args, message):
    work, model_uri, _ = logged
    filled = [a.format(work=work, model=model_uri) for a in args]
    result = runner.invoke(
        app, ["evaluate", *filled, "--tracking-uri", f"sqlite:///{work}/mlflow.db"]
    )
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output


# --- a sweep objective under shift ------------------------------------------------------------

SHIFT_OBJECTIVES = [{"metric": "val_shift_ece", "mode": "min"},
                    {"metric": "val_accuracy", "mode": "max"}]  # fmt: skip


def test_a_sweep_may_choose_ece_at_a_severity_as_an_objective(tmp_path):
    pipeline = load_pipeline(write_pipeline(tmp_path, objectives=SHIFT_OBJECTIVES))
    assert pipeline.validation_shift_severity == 3  # the default severity
    chosen = load_pipeline(write_pipeline(tmp_path, objectives=SHIFT_OBJECTIVES, shift_severity=5))
    assert chosen.validation_shift_severity == 5
    assert load_pipeline(write_pipeline(tmp_path)).validation_shift_severity is None
    with pytest.raises(DpivonError, match="shift_severity"):
        load_pipeline(write_pipeline(tmp_path, objectives=SHIFT_OBJECTIVES, shift_severity=6))
    with pytest.raises(DpivonError, match="objective val_shift_ece would be exact"):
        load_pipeline(write_pipeline(tmp_path, objectives=SHIFT_OBJECTIVES, validation_noise=1.0))


def test_training_reports_the_shift_objectives_every_epoch(tmp_path, monkeypatch):
    monkeypatch.setenv("DPIVON_CACHE", str(tmp_path))
    config = TrainConfig(
        optimizer="dp-ivon-gradsq", dataset="synthetic", synthetic_size=300, model="small-cnn",
        epochs=2, batch_size=64, val_bma_samples=2, epsilon=8,
    )  # fmt: skip
    data = load_data(config)
    scores = validation_shift_scores(config, data.val_images, 2)
    result = train(config, data=data, evaluate_test=False, extra_validation=scores)
    assert [sorted(k for k in epoch if "shift" in k) for epoch in result.history] == [
        ["val_shift_accuracy", "val_shift_ece", "val_shift_nll"]
    ] * 2
    # the last epoch's numbers are those of the trained model and posterior
    again = scores(result.model, result.posterior)
    assert result.history[-1]["val_shift_ece"] == again["shift_ece"]
    assert result.val["shift_accuracy"] == again["shift_accuracy"]


@pytest.mark.slow
def test_a_sweep_on_ece_under_shift_finishes_with_its_front(tmp_path, own_cache, fresh_local_ray):
    pipeline = load_pipeline(
        write_pipeline(tmp_path, objectives=SHIFT_OBJECTIVES, scheduler={"type": "none"})
    )  # no ASHA: every trial runs to its end and is scored
    trials = run_sweep(pipeline)
    assert (trials["status"] == "completed").all()
    assert trials[["val_shift_ece", "val_shift_accuracy", "val_shift_nll"]].notna().all().all()
    front = pd.read_csv(tmp_path / "runs" / pipeline.name / "pareto_front.csv")
    assert len(front) >= 1 and "val_shift_ece" in front
