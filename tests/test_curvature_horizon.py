"""The curvature's horizon (issue 44): how much of h an IVON-family run can learn (known
before it runs), how much it did (logged per epoch), the warning for a run that cannot, and
the shipped spaces that search it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from mlflow import MlflowClient
from sweep_helpers import shipped_run_files, write_pipeline
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.config import parse_config
from dpivon.optim.registry import OPTIMIZERS, IVONOptions
from dpivon.optim.rules import (
    beta2_for_horizon_share,
    curvature_horizon_share,
    learned_curvature_share,
)
from dpivon.runs import frozen_curvature_warning, planned_curvature_share, train
from dpivon.search.export import target_config
from dpivon.search.pipeline import load_pipeline
from dpivon.search.space import load_search_space
from dpivon.study.aggregate import curvature_shares_of_earlier_run

ROOT = Path(__file__).resolve().parents[1]
IVON_FAMILY = {n for n, s in OPTIMIZERS.items() if issubclass(s.options, IVONOptions)}
IVON_SPACES = [
    p for p in sorted((ROOT / "search_spaces").rglob("*.yaml"))
    if load_search_space(p).optimizer in IVON_FAMILY
]  # fmt: skip
PIPELINES = shipped_run_files(benchmarks=False)


def _tiny(optimizer: str = "dp-ivon-gradsq", **changes) -> dict:
    keys = {
        "dataset": "synthetic", "synthetic_size": 300, "optimizer": optimizer, "epochs": 2,
        "batch_size": 32, "bma_samples": 2, "device": "cpu",
    }  # fmt: skip
    if OPTIMIZERS[optimizer].private:
        keys["epsilon"] = 8.0
    return {**keys, **changes}


def test_the_horizon_by_hand():
    # the first epsilon-3 study's runs: IVON's default over 1,320 steps keeps 98.7 % of h
    assert curvature_horizon_share(0.99999, 1320) == pytest.approx(0.0131, abs=1e-4)
    assert curvature_horizon_share(1.0, 1320) == 0.0
    assert curvature_horizon_share(0.5, 3) == 0.875
    for share, steps in ((0.9, 1320), (0.5, 18), (0.99, 7)):
        beta2 = beta2_for_horizon_share(share, steps)
        assert curvature_horizon_share(beta2, steps) == pytest.approx(share, rel=1e-12)
    import torch

    hess = torch.tensor([2.0, 1.0, 0.5])
    # hess_init 1 decayed to 0.5: h = 2 is three-quarters learned, h = 0.5 not at all
    assert learned_curvature_share(hess, torch.full((3,), 0.5)).tolist() == [0.75, 0.5, 0.0]


def test_a_run_logs_the_share_it_could_learn_and_the_share_it_learned():
    frozen = train(parse_config(_tiny(beta2=1.0)), evaluate_test=False)
    learning = train(parse_config(_tiny(beta2=0.8)), evaluate_test=False)
    steps = parse_config(_tiny()).planned_steps
    assert steps == 2 * math.ceil(270 / 32)  # 300 synthetic images less the 30 validation
    for metrics in frozen.history:
        assert metrics["curvature_horizon_share"] == 0.0
        for key in ("median", "q10", "q90"):
            assert abs(metrics[f"curvature_learned_share_{key}"]) < 1e-3
    for epoch, metrics in enumerate(learning.history, start=1):
        horizon = curvature_horizon_share(0.8, epoch * steps // 2)
        assert metrics["curvature_horizon_share"] == pytest.approx(horizon)
    last = learning.history[-1]
    assert last["curvature_learned_share_median"] > 0.5
    assert last["curvature_learned_share_q10"] <= last["curvature_learned_share_median"]
    assert last["curvature_learned_share_median"] <= last["curvature_learned_share_q90"]
    summary = learning.summary()
    assert summary["curvature_horizon_share"] == pytest.approx(curvature_horizon_share(0.8, 18))
    assert summary["curvature_learned_share_median"] == last["curvature_learned_share_median"]
    # a point-estimate run has no curvature to speak of
    sgd = train(parse_config(_tiny("dp-sgd", epochs=1)), evaluate_test=False)
    assert not any(k.startswith("curvature_") for k in sgd.summary())


def test_a_curvature_that_cannot_learn_is_warned_of_and_the_run_goes_on(tmp_path):
    config = parse_config(_tiny())  # IVON's default beta2 0.99999 over 18 steps
    line = frozen_curvature_warning(config)
    assert line is not None and "\n" not in line
    suggested = beta2_for_horizon_share(0.9, 18)
    assert f"beta2={suggested:.5f}" in line and "0.018 %" in line
    assert frozen_curvature_warning(parse_config(_tiny(beta2=suggested))) is None
    # just below and above the line of 0.5
    assert frozen_curvature_warning(parse_config(_tiny(beta2=0.97))) is not None  # 0.42
    assert frozen_curvature_warning(parse_config(_tiny(beta2=0.95))) is None  # 0.60
    assert frozen_curvature_warning(parse_config(_tiny("dp-sgd"))) is None
    assert planned_curvature_share(parse_config(_tiny("dp-sgd"))) is None
    args = ["train", "--dataset", "synthetic", "--optimizer", "dp-ivon-gradsq", "--epsilon", "8",
            "--epochs", "1", "--batch-size", "32", "--set", "synthetic_size=200",
            "--set", "bma_samples=2", "--tracking-uri", f"sqlite:///{tmp_path}/m.db"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    before_run = result.output.split("tracking to")[0]
    assert "warning:" in before_run and "curvature can learn at most" in before_run
    assert "curvature_learned_share" in result.output  # the summary's row
    client = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    (run,) = client.search_runs([client.get_experiment_by_name("dpivon").experiment_id])
    for key in ("curvature_horizon_share", "curvature_learned_share_median"):
        assert key in run.data.metrics
    learning = CliRunner().invoke(app, [*args, "--set", "beta2=0.5"])
    assert learning.exit_code == 0 and "warning:" not in learning.output


@pytest.mark.parametrize("path", IVON_SPACES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_ivon_family_space_searches_the_horizon_and_starts_where_h_learns(path):
    space = load_search_space(path)
    assert "beta2" in space.distributions, f"{path} does not search beta2"
    assert space.start_points, f"{path} has no start point"
    for pipeline_path in PIPELINES:
        pipeline = load_pipeline(pipeline_path)
        if path.resolve() not in {s.path.resolve() for s in pipeline.spaces.values()}:
            continue
        starts = [c for c in pipeline.start_configs() if c.optimizer.name == space.optimizer]
        assert starts
        for config in starts:
            share = planned_curvature_share(config)
            assert share >= 0.9, (pipeline_path.name, config.planned_steps, share)


def test_a_noise_faithful_trial_learns_the_share_its_final_run_learns():
    pipeline = load_pipeline(ROOT / "pipelines/compare-eps1-tan-tuning-horizon.yaml")
    (trial,) = pipeline.start_configs()
    assert trial.training.batch_size == 64  # 1,024 / 16
    # what a benchmark's from_sweep trains: the target's batch, budget and epochs
    final = target_config(trial, pipeline.noise_faithful.batch_divisor, 1.0).replace(
        epochs=pipeline.epochs
    )
    assert final.training.batch_size == 1024
    assert trial.planned_steps == final.planned_steps == 1320
    assert planned_curvature_share(trial) == planned_curvature_share(final)
    assert planned_curvature_share(trial) == pytest.approx(1 - 0.998**1320)


@pytest.mark.parametrize("optimizer", ["dp-ivon-gradsq", "ivon"])
def test_an_earlier_runs_shares_follow_from_its_h_quantiles(optimizer):
    """Runs logged before the shares (the first epsilon-3 study) get them from their h
    quantiles and settings: the same numbers as the optimizer's own, epoch by epoch."""
    result = train(parse_config(_tiny(optimizer, beta2=0.9, hess_init=0.7)), evaluate_test=False)
    keys = ("hess_median", "hess_q10", "hess_q90")
    history = {k: [m[k] for m in result.history] for k in keys}
    params = {"beta2": "0.9", "hess_init": "0.7", "train_images": "270", "batch_size": "32"}
    steps = [m["steps"] for m in result.history] if optimizer != "ivon" else []
    derived = curvature_shares_of_earlier_run(history, params, steps)
    for key, values in derived.items():
        logged = [m[key] for m in result.history]
        assert values == pytest.approx(logged, rel=1e-5, abs=1e-6), key


def test_a_sweep_is_warned_of_a_group_whose_curvature_cannot_learn(tmp_path):
    frozen_space = tmp_path / "frozen.yaml"
    frozen_space.write_text(
        "# a space that leaves beta2 at IVON's default\noptimizer: dp-ivon-gradsq\n"
        "params:\n  lr: {type: float, low: 1.0, high: 4.0, log: true}\n"
    )
    frozen = load_pipeline(
        write_pipeline(
            tmp_path, optimizers=[{"name": "dp-ivon-gradsq", "space": str(frozen_space)}]
        )
    )
    (line,) = frozen.frozen_curvature_warnings()  # 2 epochs of 540 / 256: 6 steps at 0.99999
    assert "in its 6 steps" in line and "beta2=" in line
    assert load_pipeline(write_pipeline(tmp_path)).frozen_curvature_warnings() == []
