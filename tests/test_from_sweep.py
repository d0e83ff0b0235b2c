"""A benchmark whose method comes from a real sweep (`from_sweep`), scaled down: the sweep runs,
then the benchmark trains, for every seed, the configuration the sweep's pick chose, and its
report carries the sweep's front and tuning budget."""

from __future__ import annotations

import json
import shutil

import mlflow
import pytest
import ray
import yaml
from sweep_helpers import write_pipeline

from dpivon.search.export import export_configs, resolve_sweep
from dpivon.search.pipeline import load_pipeline
from dpivon.search.sweep import SweepState, run_sweep
from dpivon.study.benchmark import run_benchmark
from dpivon.study.spec import load_benchmark


@pytest.mark.slow
def test_a_benchmark_trains_the_pick_of_a_real_sweep_for_every_seed(tmp_path):
    smoke = yaml.safe_load(write_pipeline(tmp_path, name="tune").read_text())
    dp_sgd = [entry for entry in smoke["optimizers"] if entry["name"] == "dp-sgd"]
    path = write_pipeline(
        tmp_path, name="tune", epochs=1, trials=3, optimizers=dp_sgd, scheduler={"type": "none"}
    )
    spec = {
        "name": "from-tune",
        "data": {"dataset": "synthetic", "synthetic_size": 300},
        "model": "small-cnn",
        "epochs": 1,
        "epsilons": [8],
        "seeds": [0, 1, 2],
        "methods": [
            # the sweep's folder, moved after the sweep (as one committed or downloaded):
            # its tables name the checkpoints inside it
            {
                "name": "dp-sgd-tuned",
                "optimizer": "dp-sgd",
                "from_sweep": str(tmp_path / "moved" / "tune"),
                "pick": "max-accuracy",
            },
            {"name": "dp-sgd-fixed", "optimizer": "dp-sgd", "train": {"lr": 0.5}},
        ],
        "concurrency": 2,
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "storage_path": str(tmp_path / "runs"),
        "train": {"batch_size": 64},
    }
    spec_path = tmp_path / "from-tune.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        sweep = load_pipeline(path)
        run_sweep(sweep)
        (tmp_path / "moved").mkdir()
        shutil.move(resolve_sweep(str(path)).path, tmp_path / "moved" / "tune")
        folder = resolve_sweep(str(tmp_path / "moved" / "tune"))
        ((row, picked),) = export_configs(
            folder,
            SweepState.load(folder).objectives,
            "max-accuracy",
            optimizer="dp-sgd",
            epsilon=8.0,
            full_data=False,
            research_mode=False,
        )
        benchmark = load_benchmark(spec_path)
        outcome = run_benchmark(benchmark)
    finally:
        ray.shutdown()

    assert not outcome.failed and len(outcome.completed) == 6
    # every run of the tuned method trains the sweep's pick, and says so
    assert {r.tuned_by for r in benchmark.runs if r.method == "dp-sgd-tuned"} == {
        f"{folder.name}/eps8-dp-sgd/{row['trial_id']}"
    }
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name(benchmark.experiment)
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    tuned = [r for r in runs if r.data.params.get("method") == "dp-sgd-tuned"]
    assert len(tuned) == 3
    for run in tuned:  # the sweep's pick, on the benchmark's data and epochs, a seed each
        params = run.data.params
        assert float(params["lr"]) == picked.optimizer.lr
        assert float(params["max_grad_norm"]) == picked.privacy.max_grad_norm
        assert params["synthetic_size"] == "300" and params["epochs"] == "1"
        assert run.data.metrics["epsilon_spent"] <= 8.0 + 1e-6
    assert len({r.data.params["seed"] for r in tuned}) == 3
    # the pick is a trial of the best validation accuracy, read from the sweep's own runs
    sweep_runs = client.search_runs(
        [client.get_experiment_by_name(sweep.experiment).experiment_id], max_results=100
    )
    trials = [r for r in sweep_runs if "mlflow.parentRunId" in r.data.tags]
    best = max(r.data.metrics["val_accuracy"] for r in trials)
    assert len(trials) == 3 and row["val_accuracy"] == best
    assert picked.optimizer.lr in {
        float(r.data.params["lr"]) for r in trials if r.data.metrics["val_accuracy"] == best
    }
    parent = next(r for r in runs if r.data.tags.get("dpivon.kind") == "benchmark")
    report = benchmark.storage.read_text("report/report.md")
    assert "Pareto fronts of the tuning sweeps" in report
    # the pick's tuning score and its space's dimension travel to the report
    assert {r.tuning_score for r in benchmark.runs if r.method == "dp-sgd-tuned"} == {
        ("val_accuracy", row["val_accuracy"])
    }
    dimension = sweep.spaces["dp-sgd"].dimension
    assert f"eps8-dp-sgd/{row['trial_id']} | {dimension} |" in report
    assert "| dp-sgd-fixed | dp-sgd |" in report and "fixed hyper-parameters | - |" in report
    assert "1 tuned pick(s): too few to say whether the tuning predicted" in report
    assert parent.info.status == "FINISHED"

    # Both epsilons wherever the tuned model appears: the training's and, composed with the
    # tuning that chose its settings on the same images, the end-to-end one.
    tuning = next(r.config.privacy.tuning for r in benchmark.runs if r.method == "dp-sgd-tuned")
    end_to_end = tuned[0].data.metrics["epsilon_with_tuning"]
    assert end_to_end > tuning.quoted_epsilon > 8.0
    for run in runs:  # the same two tags as a train run's and a released sweep model's
        if "dpivon.benchmark_key" not in run.data.tags:
            continue
        tags, metrics = run.data.tags, run.data.metrics
        assert tags["dpivon.epsilon"] == "8"
        chosen = "epsilon_with_tuning" if run in tuned else "epsilon_spent"
        assert float(tags["dpivon.epsilon_end_to_end"]) == pytest.approx(metrics[chosen], rel=1e-5)
    images = f"same {benchmark.data.train_size:,} training images, chosen by its scores on the "
    spent = tuned[0].data.metrics["epsilon_spent"]  # the same plan on every seed
    line = (
        f"**dp-sgd-tuned** (epsilon 8): training {spent:,.2f}, end to end {end_to_end:,.2f}; "
        "tuned by sweep tune (front release) on the "
    )
    note = parent.data.tags["mlflow.note.content"]
    for text in (report, note):
        assert line in text and images in text and "validation scores are exact" in text
        assert "**Epsilon 8 is what each run's training spent.**" in text
        assert "**dp-sgd-fixed** (epsilon 8): training " in text
        assert "; fixed hyper-parameters, not chosen on these images." in text
    table = outcome.report.results_markdown()  # what a README pastes
    assert (
        "| eps spent | eps end to end |" in table and f"| {spent:.2f} | {end_to_end:.2f} |" in table
    )
    # the sweep's released models carry what they spent and what their release costs
    released = [r for r in sweep_runs if r.data.tags.get("dpivon.pareto_optimal") == "true"]
    quoted = json.loads(folder.read_text("tuning_privacy.json"))["eps8-dp-sgd"]["quoted_epsilon"]
    assert released and quoted == pytest.approx(tuning.quoted_epsilon)
    for run in released:
        assert (
            float(run.data.tags["dpivon.epsilon"]) == 8.0 == float(run.data.tags["dpivon.budget"])
        )
        assert float(run.data.tags["dpivon.epsilon_end_to_end"]) == pytest.approx(quoted, rel=1e-5)
