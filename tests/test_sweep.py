"""Sweeps end to end on a real local Ray (2 CPUs), real Optuna and a real MLflow store."""

from __future__ import annotations

import json

import mlflow
import pandas as pd
import pytest
import ray
import torch
import yaml
from sweep_helpers import REPO, runs_of, write_pipeline
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.search.pareto import non_dominated_mask
from dpivon.search.pipeline import load_pipeline
from dpivon.search.sweep import run_sweep, sweep_directory

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("sweep")
    pipeline = load_pipeline(write_pipeline(tmp_path))
    trials = run_sweep(pipeline)
    return tmp_path, pipeline, trials


def test_sweep_records_parent_children_and_pareto(finished_sweep):
    tmp_path, pipeline, trials = finished_sweep
    client, parents, children = runs_of(tmp_path, pipeline.experiment)
    (parent,) = parents
    assert parent.info.status == "FINISHED"
    assert len(children) == 4 == len(trials)
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    assert len({c.data.tags["dpivon.trial_id"] for c in children}) == 4
    for child in children:
        params, metrics = child.data.params, child.data.metrics
        assert params["optimizer"] in ("dp-ivon-gradsq", "dp-sgd")
        assert {"lr", "batch_size", "max_grad_norm", "epsilon", "delta"} <= params.keys()
        assert {"val_accuracy", "val_ece", "epsilon_spent", "noise_multiplier"} <= metrics.keys()
        assert metrics["epsilon_spent"] <= 8.0
        history = client.get_metric_history(child.info.run_id, "val_accuracy")
        assert [m.step for m in history] == list(range(1, len(history) + 1))
        if child.data.tags["dpivon.trial_status"] == "completed":
            assert metrics["epsilon_spent"] >= 8.0 - 0.05
            assert len(history) == pipeline.epochs
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {
        "pareto.png",
        "pareto.html",
        "pareto_front.csv",
        "trials.csv",
        "pipeline.yaml",
        "tuning_privacy.json",
    } <= artifacts
    assert any(k.startswith("hypervolume.eps8.") for k in parent.data.metrics)
    assert parent.data.metrics["tuning.eps8-dp-sgd.composition_epsilon"] > 8.0
    assert "git_commit" in parent.data.params
    # Every trial trains with its own seed (hence its own noise); the split is shared.
    assert len({c.data.params["seed"] for c in children}) == len(children)
    assert {c.data.params["data_seed"] for c in children} == {str(pipeline.seed)}
    # The parent's description states the quoted epsilons.
    assert "quoted eps" in parent.data.tags["mlflow.note.content"]


def test_asha_with_random_search_and_a_random_trial_count_quotes_the_composition(tmp_path):
    """Random K and random search, but ASHA stops trials on their metrics: adaptive."""
    pipeline = load_pipeline(
        write_pipeline(
            tmp_path,
            name="adaptive",
            sampler="random",
            trial_count="poisson",
            trials=2,
            seed=1,  # draws K = 2 (seed 0 draws K = 0)
            release="best",
            optimizers=[
                {"name": "dp-sgd", "space": str(REPO / "search_spaces/quickstart/dp-sgd.yaml")}
            ],
        )
    )
    run_sweep(pipeline)
    report = json.loads((sweep_directory(pipeline) / "tuning_privacy.json").read_text())
    (group,) = report.values()
    assert group["adaptive"] is True
    assert "random_trials_epsilon" not in group
    assert group["quoted_epsilon"] == group["composition_epsilon"]
    assert "stops trials on their metrics" in group["quote"]
    assert group["drawn_trials"] == pipeline.trial_counts()[("dp-sgd", 8.0)]


def test_front_is_non_dominated_and_only_front_sees_the_test_set(finished_sweep):
    tmp_path, pipeline, _ = finished_sweep
    directory = sweep_directory(pipeline)
    trials = pd.read_csv(directory / "trials.csv")
    front = pd.read_csv(directory / "pareto_front.csv")
    assert not front.empty
    assert (front["status"] == "completed").all()
    for (_, _), group in trials[trials.status == "completed"].groupby(["optimizer", "epsilon"]):
        mask = non_dominated_mask(group[["val_accuracy", "val_ece"]].to_numpy(), ["max", "min"])
        assert set(group[mask].trial_id) == set(front.trial_id) & set(group.trial_id)
    _, _, children = runs_of(tmp_path, pipeline.experiment)
    for child in children:
        on_front = child.data.tags["dpivon.trial_id"] in set(front.trial_id)
        assert ("test_accuracy" in child.data.metrics) == on_front
        assert (child.data.tags.get("dpivon.pareto_optimal") == "true") == on_front


def test_pareto_command_prints_the_front(finished_sweep, tmp_path):
    _, pipeline, _ = finished_sweep
    out = tmp_path / "front.png"
    result = runner.invoke(app, ["pareto", str(sweep_directory(pipeline)), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "Pareto" in result.output
    assert out.stat().st_size > 10_000 and out.with_suffix(".html").exists()


def test_export_then_train_reproduces_the_trial(finished_sweep, tmp_path):
    sweep_tmp, pipeline, _ = finished_sweep
    exported = tmp_path / "best.yaml"
    result = runner.invoke(
        app,
        [
            "export",
            str(sweep_directory(pipeline)),
            "--pick",
            "knee",
            "--optimizer",
            "dp-sgd",
            "--out",
            str(exported),
            "--no-secure-mode",  # research mode: reproducible by seed, as the trial was
        ],
    )
    assert result.exit_code == 0, result.output
    config = yaml.safe_load(exported.read_text())
    # The selection's cost travels with the config; by default exports are secure.
    tuning = config.pop("tuning")
    assert tuning["group"] == "eps8-dp-sgd" and tuning["quoted_epsilon"] > 8.0
    assert config["secure_mode"] is False
    secure = tmp_path / "secure.yaml"
    sweep_dir = str(sweep_directory(pipeline))
    runner.invoke(app, ["export", sweep_dir, "--optimizer", "dp-sgd", "--out", str(secure)])
    assert yaml.safe_load(secure.read_text())["secure_mode"] is True
    front = pd.read_csv(sweep_directory(pipeline) / "pareto_front.csv")
    trial_id = next(t for t in front.trial_id if t in exported.read_text())
    _, _, children = runs_of(sweep_tmp, pipeline.experiment)
    trial = next(c for c in children if c.data.tags["dpivon.trial_id"] == trial_id)
    assert {k: str(v) for k, v in config.items()} == {
        k: v for k, v in trial.data.params.items() if k != "tuning"
    }

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the trial: bitwise the same arithmetic
    try:
        result = runner.invoke(
            app,
            [
                "train",
                "--config",
                str(exported),
                "--tracking-uri",
                f"sqlite:///{tmp_path}/prod.db",
                "--no-log-model",
            ],
        )
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/prod.db")
    (run,) = client.search_runs([client.get_experiment_by_name("dpivon").experiment_id])
    shared = [k for k in trial.data.params if k != "tuning"]
    assert {k: run.data.params[k] for k in shared} == {k: trial.data.params[k] for k in shared}
    # The production run states what covers its release: itself composed with the tuning.
    assert run.data.metrics["tuning_epsilon"] == pytest.approx(tuning["quoted_epsilon"])
    assert run.data.metrics["epsilon_with_tuning"] > max(
        run.data.metrics["epsilon_spent"], tuning["quoted_epsilon"]
    )
    assert "epsilon_with_tuning covers the released model" in result.output
    # Same data size, batch size and epochs: the noise recalibrates to the trial's sigma.
    assert float(run.data.params["noise_multiplier"]) == trial.data.metrics["noise_multiplier"]
    # Same configuration and seed as the trial: the same model, so the same validation score.
    assert run.data.metrics["val_accuracy"] == pytest.approx(trial.data.metrics["val_accuracy"])


def test_failing_trials_are_recorded_and_the_sweep_finishes(tmp_path):
    spaces = REPO / "search_spaces" / "quickstart"
    # No ASHA here: it could stop a trial after its first report, before the failure.
    path = write_pipeline(
        tmp_path,
        name="failing",
        max_failures=0,
        scheduler={"type": "none"},
        optimizers=[
            {"name": "dp-ivon-gradsq", "space": str(spaces / "dp-ivon-gradsq.yaml")},
            {"name": "dp-sgd", "space": str(spaces / "dp-sgd.yaml"), "train": {"fail_at_epoch": 1}},
        ],
    )
    pipeline = load_pipeline(path)
    trials = run_sweep(pipeline)
    assert (trials[trials.optimizer == "dp-sgd"].status == "failed").all()
    assert (trials[trials.optimizer == "dp-ivon-gradsq"].status != "failed").all()
    _, (parent,), children = runs_of(tmp_path, pipeline.experiment)
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["trials_failed"] == 2
    for child in children:
        if child.data.params["optimizer"] == "dp-sgd":
            assert child.info.status == "FAILED"
            assert "InjectedFailure" in child.data.tags["error"]
            # The epoch before the failure was recorded, not lost.
            assert "val_accuracy" in child.data.metrics


def test_a_crashed_trial_retries_from_its_epoch_checkpoint(tmp_path):
    path = write_pipeline(
        tmp_path,
        name="retry",
        max_failures=1,
        trials=1,
        scheduler={"type": "none"},
        optimizers=[
            {
                "name": "dp-sgd",
                "space": str(REPO / "search_spaces/quickstart/dp-sgd.yaml"),
                "train": {"fail_at_epoch": 1},
            },
        ],
    )
    pipeline = load_pipeline(path)
    trials = run_sweep(pipeline)
    (status,) = trials.status
    assert status in ("completed",)
    _, _, (child,) = runs_of(tmp_path, pipeline.experiment)
    assert child.info.status == "FINISHED"
    # Resumed from the epoch-1 checkpoint: the accountant kept the first epoch's steps.
    assert 8.0 - 0.05 <= child.data.metrics["epsilon_spent"] <= 8.0
