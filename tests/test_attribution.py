"""The benchmark's attribution (issue 44): a frozen-curvature arm paired with its IVON-family
method, and point-estimate models averaged over weight noise chosen on validation; the
tables on hand-made runs, the evaluation on a real model, one small real benchmark."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from scipy import stats
from statsmodels.stats.multitest import multipletests
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.config import parse_config
from dpivon.evaluation import (
    choose_weight_noise,
    evaluate_as_configured,
    isotropic_posterior,
    weight_noise_posterior,
)
from dpivon.runs import load_data, train
from dpivon.study.attribution import curvature_rows, weight_noise_rows
from dpivon.study.benchmark import run_benchmark
from dpivon.study.spec import load_benchmark

# accuracy of 3 seeds: the learning method, its frozen arm and a second pair
ACCURACY = {
    "ivon": [0.60, 0.62, 0.65],
    "ivon-frozen": [0.55, 0.58, 0.58],
    "mit": [0.50, 0.51, 0.49],
    "mit-frozen": [0.52, 0.50, 0.49],
}


def hand_runs() -> pd.DataFrame:
    rows = []
    for method, values in ACCURACY.items():
        for seed, accuracy in enumerate(values):
            rows.append(
                {"method": method, "epsilon": 1.0, "replicate": seed, "test_accuracy": accuracy,
                 "test_ece": 0.1, "test_nll": 1.0 + seed / 10, "test_shift_s3_ece": math.nan}
            )  # fmt: skip
    for seed, (point, averaged) in enumerate([(0.20, 0.12), (0.22, 0.15), (0.18, 0.10)]):
        rows.append(
            {"method": "sgd", "epsilon": 1.0, "replicate": seed, "test_accuracy": 0.5,
             "test_ece": point, "test_nll": 1.5, "test_shift_s3_ece": math.nan,
             "test_wna_accuracy": 0.5 + seed / 100, "test_wna_ece": averaged,
             "test_wna_nll": 1.4, "weight_noise_scale": 0.01}
        )  # fmt: skip
    return pd.DataFrame(rows)


def test_curvature_rows_pair_each_method_with_its_frozen_arm_by_seed():
    runs = hand_runs()
    _, rows = curvature_rows(runs, {"ivon-frozen": "ivon", "mit-frozen": "mit"})
    accuracy = {row[2]: row for row in rows if row[1] == "accuracy (points)"}
    assert set(accuracy) == {"ivon - ivon-frozen", "mit - mit-frozen"}
    p = {}
    for learning in ("ivon", "mit"):
        a, b = np.array(ACCURACY[learning]), np.array(ACCURACY[f"{learning}-frozen"])
        row = accuracy[f"{learning} - {learning}-frozen"]
        assert float(row[3]) == pytest.approx(100 * (a - b).mean(), abs=0.05)  # learning - frozen
        p[learning] = stats.ttest_rel(a, b).pvalue
        assert float(row[5]) == pytest.approx(p[learning], rel=0.05)
    # Holm over the two comparisons of one epsilon and metric
    holm = multipletests([p["ivon"], p["mit"]], method="holm")[1]
    assert float(accuracy["ivon - ivon-frozen"][6]) == pytest.approx(holm[0], rel=0.05)
    assert accuracy["ivon - ivon-frozen"][-1] == "helps"  # 5.3 points, [2.4, 8.3]
    assert accuracy["mit - mit-frozen"][-1] == "indistinguishable"
    # no seed ran shift scores: no shift row; and no arm, no table
    assert not any("shift" in row[1] for row in rows)
    assert curvature_rows(runs, {})[1] == []


def test_weight_noise_rows_are_the_average_minus_the_point_prediction_of_the_same_run():
    runs = hand_runs()
    _, rows = weight_noise_rows(runs, [*ACCURACY, "sgd"])
    by_metric = {row[1]: row for row in rows}
    assert [row[2] for row in rows] == ["sgd"] * 3  # IVON runs have no test_wna_* scores
    ece = by_metric["ECE"]
    assert float(ece[3]) == pytest.approx(np.mean([-0.08, -0.07, -0.08]), abs=5e-4)
    assert ece[-1] == "helps"  # lower ECE, interval below 0
    assert by_metric["NLL"][-1] == "unknown"  # the same -0.1 on every seed: no interval


def test_weight_noise_is_chosen_on_validation_and_zero_when_no_scale_helps():
    config = parse_config(
        {"dataset": "synthetic", "synthetic_size": 300, "optimizer": "dp-sgd", "epsilon": 8.0,
         "epochs": 1, "batch_size": 64, "bma_samples": 4, "device": "cpu"}
    )  # fmt: skip
    result = train(config, evaluate_test=False)
    data = load_data(config)
    model = result.model
    posterior = isotropic_posterior(model, 0.02)
    for name, p in model.named_parameters():
        assert torch.allclose(posterior.std(name), torch.full_like(p, 0.02))
    choice = choose_weight_noise(config, model, data.val, [0.05, 0.001])
    assert list(choice.validation_nll) == [0.0, 0.001, 0.05]
    point = evaluate_as_configured(config, model, data.val, None).metrics["nll"]
    assert choice.validation_nll[0.0] == point
    assert choice.scale == min(choice.validation_nll, key=choice.validation_nll.get)
    assert weight_noise_posterior(model, 0.0) is None
    # a scale so large that the average is noise cannot beat the point prediction
    huge = choose_weight_noise(config, model, data.val, [50.0])
    assert huge.validation_nll[50.0] > point and huge.scale == 0.0


def _benchmark(tmp_path, **overrides) -> str:
    data = {
        "name": "attributed",
        "data": {"dataset": "synthetic", "synthetic_size": 300},
        "model": "small-cnn",
        "epochs": 2,
        "epsilons": [8],
        "seeds": [0, 1, 2],
        "methods": [
            {"name": "dp-sgd", "optimizer": "dp-sgd", "train": {"lr": 0.5}},
            {"name": "dp-ivon", "optimizer": "dp-ivon-gradsq", "train": {"beta2": 0.5}},
            {
                "name": "dp-ivon-frozen",
                "optimizer": "dp-ivon-gradsq",
                "train": {"beta2": 1.0},
                "frozen_curvature_of": "dp-ivon",
            },
        ],
        "concurrency": 2,
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "storage_path": str(tmp_path / "runs"),
        "train": {"bma_samples": 2, "batch_size": 64},
        "weight_noise_scales": [0.01, 0.05],
    }
    data.update(overrides)
    path = tmp_path / "attributed.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ({"frozen_curvature_of": "nobody"}, "'nobody' is not another method of this benchmark"),
        (
            {"optimizer": "dp-sgd", "train": {"lr": 0.5}, "frozen_curvature_of": "dp-ivon"},
            "learns no curvature to freeze",
        ),
        (
            {"train": {"beta2": 1.0, "lr": 2.0}, "frozen_curvature_of": "dp-ivon"},
            "must repeat dp-ivon (its optimizer, from_sweep, pick and train keys)",
        ),
        ({"train": {"beta2": 0.9}, "frozen_curvature_of": "dp-ivon"}, "train: {beta2: 1.0}"),
    ],
)
def test_a_bad_frozen_arm_is_one_line_and_exit_2(tmp_path, method, message):
    arm = {"name": "dp-ivon-frozen", "optimizer": "dp-ivon-gradsq", **method}
    methods = [{"name": "dp-ivon", "optimizer": "dp-ivon-gradsq", "train": {"beta2": 0.8}}, arm]
    result = CliRunner().invoke(app, ["benchmark", _benchmark(tmp_path, methods=methods)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: invalid benchmark"), result.output
    assert message in result.output


def test_a_benchmark_attributes_curvature_and_weight_noise(tmp_path, own_cache, fresh_local_ray):
    outcome = run_benchmark(load_benchmark(_benchmark(tmp_path)))
    assert not outcome.failed and len(outcome.completed) == 9
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("dpivon-attributed")
    children = [
        r for r in client.search_runs([experiment.experiment_id])
        if "mlflow.parentRunId" in r.data.tags
    ]  # fmt: skip
    by_method: dict[str, list] = {}
    for child in children:
        by_method.setdefault(child.data.tags["dpivon.method"], []).append(child.data.metrics)
    for metrics in by_method["dp-ivon-frozen"]:  # h never left hess_init
        assert metrics["curvature_horizon_share"] == 0.0
        assert abs(metrics["curvature_learned_share_median"]) < 1e-3
    for metrics in by_method["dp-ivon"]:  # 2 epochs of ceil(270 / 64) = 5 steps: 1 - 0.5^10
        assert metrics["curvature_horizon_share"] == pytest.approx(1 - 0.5**10)
        assert metrics["curvature_learned_share_median"] > 0.5
    for metrics in by_method["dp-sgd"]:
        assert metrics["weight_noise_scale"] in (0.0, 0.01, 0.05)
        assert {"test_wna_accuracy", "test_wna_ece", "test_wna_nll"} <= metrics.keys()
        assert "curvature_horizon_share" not in metrics
    for method in ("dp-ivon", "dp-ivon-frozen"):  # IVON's own average is its predictive
        assert all("weight_noise_scale" not in m for m in by_method[method])
    markdown = outcome.report.markdown()
    assert "## Attribution: learned curvature and weight-noise averaging" in markdown
    assert "| 8 | accuracy (points) | dp-ivon - dp-ivon-frozen |" in markdown
    assert "| 8 | ECE | dp-sgd |" in markdown
    assert "horizon share of h | learned share of h |" in markdown  # the diagnostics table
    # scored once: a second report evaluates nothing again
    run_id = next(c.info.run_id for c in children if c.data.tags["dpivon.method"] == "dp-sgd")
    before = client.get_metric_history(run_id, "test_wna_ece")
    run_benchmark(load_benchmark(_benchmark(tmp_path)), report_only=True)
    assert client.get_metric_history(run_id, "test_wna_ece") == before
    # other scales: scored again, and the record says which were tried
    other = load_benchmark(_benchmark(tmp_path, weight_noise_scales=[0.02]))
    run_benchmark(other, report_only=True)
    assert len(client.get_metric_history(run_id, "test_wna_ece")) == len(before) + 1
    record = client.download_artifacts(run_id, "weight_noise.json", str(tmp_path))
    assert set(json.loads(Path(record).read_text())["validation_nll"]) == {"0", "0.02"}
