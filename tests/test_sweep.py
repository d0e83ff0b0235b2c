"""Sweeps end to end on a real local Ray (2 CPUs), real Optuna and a real MLflow store."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import Counter
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import ray
import torch
import yaml
from fault_injection import (
    KILLED,
    NOISE_KEY,
    RESUMED_STATES,
    injected_faults,
    trial_faults_runtime_env,
)
from optuna.trial import TrialState
from pareto_reference import brute_force_front
from ray.tune.experiment import Trial
from ray.tune.schedulers import ASHAScheduler, TrialScheduler
from sweep_helpers import REPO, runs_of, store_snapshot, sweep_folder, write_pipeline
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.config import load_configs
from dpivon.data import DataSplits
from dpivon.privacy.noise import RESEARCH_MODE_WARNING
from dpivon.runs import load_data, train
from dpivon.saved_files import FORMAT_KEY
from dpivon.search.callbacks import TRACKING_URI_ENV
from dpivon.search.groups import GROUP_KEY, GroupScheduler, GroupSearcher
from dpivon.search.pipeline import load_pipeline
from dpivon.search.sweep import TUNE_EXPERIMENT, TUNE_SETTINGS, SweepState, run_sweep
from dpivon.search.trial import RESUME_FILE
from dpivon.tracking.layout import RunOutcome
from dpivon.tracking.model_file import load_model_file

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def local_ray(tmp_path_factory):
    """A local Ray whose trial workers can be told to fail (yields the faults file)."""
    faults = tmp_path_factory.mktemp("faults") / "faults.json"
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=trial_faults_runtime_env(faults),
    )
    yield faults
    ray.shutdown()


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("sweep")
    pipeline = load_pipeline(write_pipeline(tmp_path))
    trials = run_sweep(pipeline)
    return tmp_path, pipeline, trials


def test_a_sweep_leaves_the_process_environment_as_it_found_it(finished_sweep):
    # the real tracking URI (a password in it), Tune's switches and its quiet loggers are the
    # sweep's own
    assert TRACKING_URI_ENV not in os.environ
    assert not {"TUNE_DISABLE_SIGINT_HANDLER", *TUNE_SETTINGS} & os.environ.keys()
    assert logging.getLogger("ray.tune").level != logging.CRITICAL


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
        if child.data.tags["dpivon.trial_status"] == RunOutcome.COMPLETED:
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
            trial_count="geometric",  # K >= 1
            trials=2,
            release="best",
            optimizers=[
                {"name": "dp-sgd", "space": str(REPO / "search_spaces/quickstart/dp-sgd.yaml")}
            ],
        )
    )
    run_sweep(pipeline)
    report = json.loads((sweep_folder(pipeline) / "tuning_privacy.json").read_text())
    (group,) = report.values()
    assert group["adaptive"] is True
    assert "random_trials_epsilon" not in group
    assert group["quoted_epsilon"] == group["composition_epsilon"]
    assert "stops trials on their metrics" in group["quote"]
    # the composition holds for a known K: it is stated, as the trials that ran
    state = SweepState.load(pipeline.storage)
    assert "drawn_trials" not in group and group["num_trials"] == state.trial_counts["eps8-dp-sgd"]


def test_front_is_non_dominated_and_only_front_sees_the_test_set(finished_sweep):
    tmp_path, pipeline, _ = finished_sweep
    directory = sweep_folder(pipeline)
    trials = pd.read_csv(directory / "trials.csv")
    front = pd.read_csv(directory / "pareto_front.csv")
    assert not front.empty
    assert (front["status"] == RunOutcome.COMPLETED).all()
    completed = trials[trials.status == RunOutcome.COMPLETED]
    for (_, _), group in completed.groupby(["optimizer", "epsilon"]):
        on_front = brute_force_front(group[["val_accuracy", "val_ece"]].to_numpy(), ["max", "min"])
        assert set(group[on_front].trial_id) == set(front.trial_id) & set(group.trial_id)
    _, _, children = runs_of(tmp_path, pipeline.experiment)
    for child in children:
        on_front = child.data.tags["dpivon.trial_id"] in set(front.trial_id)
        assert ("test_accuracy" in child.data.metrics) == on_front
        assert (child.data.tags.get("dpivon.pareto_optimal") == "true") == on_front


def test_pareto_command_prints_the_front(finished_sweep, tmp_path):
    _, pipeline, _ = finished_sweep
    out = tmp_path / "front.png"
    result = runner.invoke(app, ["pareto", str(sweep_folder(pipeline)), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "Pareto" in result.output
    assert out.stat().st_size > 10_000 and out.with_suffix(".html").exists()


def test_resuming_a_finished_sweep_twice_changes_nothing(finished_sweep):
    """Finishing is idempotent: every file and record of the sweep, plots aside, is the same
    after two resumes; nothing is evaluated, logged or trained again."""
    tmp_path, pipeline, _ = finished_sweep
    folder = sweep_folder(pipeline)
    before = store_snapshot(tmp_path, pipeline.experiment, folder)
    for _ in range(2):
        result = runner.invoke(app, ["sweep", str(pipeline.path), "--resume"])
        assert result.exit_code == 0, result.output
        assert "every trial has run: none runs again" in " ".join(result.output.split())
        assert "test_accuracy" in result.output  # the front is printed again, test scores too
        assert store_snapshot(tmp_path, pipeline.experiment, folder) == before
    front = pd.read_csv(folder / "pareto_front.csv")
    assert {"test_accuracy", "test_ece", "test_nll"} <= set(front.columns)
    assert not [c for c in front.columns if c.endswith(("_x", "_y"))]
    assert {r[1] for r in before["models"]} == set(front.run_id)  # one model per member
    parent = next(run for run in before["runs"].values() if run[1].get("dpivon.kind") == "sweep")
    assert "test_accuracy" in parent[1]["mlflow.note.content"]


def test_a_finished_sweep_copied_elsewhere_resumes_there_and_keeps_its_record(
    finished_sweep, tmp_path
):
    """Its folder and store copied (or committed and cloned) elsewhere, a resume there makes
    the report from the copy: the trials' checkpoints, recorded under the first folder, are
    found in the copy, and the recorded parent stays FINISHED (it turned FAILED)."""
    source, pipeline, _ = finished_sweep
    copy = tmp_path / "runs" / pipeline.name
    shutil.copytree(sweep_folder(pipeline), copy)
    shutil.copy(source / "mlflow.db", tmp_path / "mlflow.db")
    moved = write_pipeline(tmp_path)  # the same sweep, its folder and store under tmp_path
    result = runner.invoke(app, ["sweep", str(moved), "--resume"])
    assert result.exit_code == 0, result.output
    _, parents, _ = runs_of(tmp_path, pipeline.experiment)
    assert [parent.info.status for parent in parents] == ["FINISHED"]
    checkpoints = pd.read_csv(copy / "trials.csv")["checkpoint"].dropna()
    assert len(checkpoints) and all((copy / name).is_dir() for name in checkpoints)


def test_export_then_train_runs_the_trial_config(finished_sweep, tmp_path):
    sweep_tmp, pipeline, _ = finished_sweep
    exported = tmp_path / "best.yaml"
    sweep_dir = str(sweep_folder(pipeline))
    result = runner.invoke(
        app,
        ["export", sweep_dir, "--pick", "knee", "--optimizer", "dp-sgd", "--out", str(exported)],
    )
    assert result.exit_code == 0, result.output
    (config,) = load_configs(exported)
    # The selection's cost travels with the config; by default exports are secure.
    tuning = config.privacy.tuning
    assert tuning.group == "eps8-dp-sgd" and tuning.quoted_epsilon > 8.0
    assert config.privacy.research_mode is False
    research = tmp_path / "research.yaml"
    runner.invoke(
        app,
        ["export", sweep_dir, "--optimizer", "dp-sgd", "--out", str(research), "--research-mode"],
    )
    assert load_configs(research)[0].privacy.research_mode is True
    front = pd.read_csv(sweep_folder(pipeline) / "pareto_front.csv")
    trial_id = next(t for t in front.trial_id if t in exported.read_text())
    _, _, children = runs_of(sweep_tmp, pipeline.experiment)
    trial = next(c for c in children if c.data.tags["dpivon.trial_id"] == trial_id)
    assert {k: str(v) for k, v in config.flat().items() if k != "tuning"} == {
        k: v for k, v in trial.data.params.items() if k != "tuning"
    }

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
    assert result.exit_code == 0, result.output
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/prod.db")
    (run,) = client.search_runs([client.get_experiment_by_name("dpivon").experiment_id])
    shared = [k for k in trial.data.params if k != "tuning"]
    assert {k: run.data.params[k] for k in shared} == {k: trial.data.params[k] for k in shared}
    # The production run states what covers its release: itself composed with the tuning.
    assert run.data.metrics["tuning_epsilon"] == pytest.approx(tuning.quoted_epsilon)
    assert run.data.metrics["epsilon_with_tuning"] > max(
        run.data.metrics["epsilon_spent"], tuning.quoted_epsilon
    )
    assert "epsilon_with_tuning covers the released model" in result.output
    # Both epsilons: in the exported file, in what train says, in the run's tags.
    assert "epsilon 8 this training; epsilon " in exported.read_text()
    assert "end to end" in exported.read_text()
    assert "training images, chosen by its scores on the" in " ".join(result.output.split())
    assert run.data.tags["dpivon.epsilon"] == "8"
    assert float(run.data.tags["dpivon.epsilon_end_to_end"]) == pytest.approx(
        run.data.metrics["epsilon_with_tuning"], rel=1e-5
    )
    # Same data size, batch size and epochs: the noise recalibrates to the trial's sigma.
    assert float(run.data.params["noise_multiplier"]) == trial.data.metrics["noise_multiplier"]
    # The trial's noise was secure: no re-run reproduces it (tests/test_secure_noise.py).


def _released_text(client, parent, folder) -> str:
    """Everything a release: best sweep publishes beside its model: the parent run's params,
    tags (description included), metric names, its logged files."""
    parts = [
        json.dumps(parent.data.params),
        json.dumps(parent.data.tags),
        json.dumps(sorted(parent.data.metrics)),
    ]
    for name in ("tuning_privacy.json", "trials.csv", "pareto_front.csv"):
        parts.append((folder / name).read_text())
        assert name in {a.path for a in client.list_artifacts(parent.info.run_id)}
    return "\n".join(parts)


def test_a_total_epsilon_best_release_sweep_end_to_end(tmp_path):
    """total_epsilon, random search, a geometric K, release: best. The group's budget and
    each trial's epsilon are two fields that fronts, hypervolumes, `pareto`, `export
    --epsilon` and `train --config` agree on; K is in no released artefact; one model is
    released; a knee pick quotes the composition, in one line."""
    space = tmp_path / "dp-sgd.yaml"  # one batch size: one candidate mechanism, a fast solve
    space.write_text(
        "optimizer: dp-sgd\nparams:\n  lr: {type: float, low: 0.5, high: 4.0}\n  batch_size: 64\n"
    )
    pipeline = load_pipeline(write_pipeline(
        tmp_path, name="budget", epsilons=None, total_epsilon=8, sampler="random",
        trial_count="geometric", trials=2, release="best", best_by="val_accuracy", epochs=1,
        scheduler={"type": "none"}, optimizers=[{"name": "dp-sgd", "space": str(space)}],
    ))  # fmt: skip
    run_sweep(pipeline)
    folder, state = sweep_folder(pipeline), SweepState.load(pipeline.storage)
    (trial_eps,) = state.trial_epsilons.values()
    assert 1.0 < trial_eps < 8.0
    client, (parent,), children = runs_of(tmp_path, pipeline.experiment)
    assert len(children) == state.trial_counts["eps8-dp-sgd"] >= 1
    # Two named fields: the group's budget and what each trial spent.
    for child in children:
        assert child.data.tags["dpivon.budget"] == "8.0"
        assert float(child.data.tags["dpivon.epsilon"]) == trial_eps
        assert float(child.data.params["epsilon"]) == trial_eps
    trials = pd.read_csv(folder / "trials.csv")
    assert set(trials["epsilon"]) == {8.0} and set(trials["trial_epsilon"]) == {trial_eps}
    assert "hypervolume.eps8.dp-sgd" in parent.data.metrics
    (report,) = json.loads((folder / "tuning_privacy.json").read_text()).values()
    assert report["quoted_epsilon"] == report["random_trials_epsilon"] <= 8.0 + 0.01
    # K is nowhere in what is released: no count, no composition, no outcome tally.
    released = _released_text(client, parent, folder)
    assert "drawn_trials" not in released and "num_trials" not in released
    assert "composition_epsilon" not in json.dumps(report)
    assert not any(k.startswith("trials_") for k in parent.data.metrics)
    private = json.loads((folder / "tuning_private.json").read_text())["eps8-dp-sgd"]
    assert private["num_trials"] == len(children)
    # Exactly one model released: the best validation accuracy of the group.
    logged = [c for c in children if "test_accuracy" in c.data.metrics]
    (best,) = logged
    assert best.data.metrics["val_accuracy"] == max(
        c.data.metrics.get("val_accuracy", -1) for c in children
    )
    result = runner.invoke(app, ["pareto", str(folder), "--out", str(tmp_path / "f.png")])
    assert result.exit_code == 0, result.output
    assert "trial_epsilon" in result.output  # the budget, and what the trials spent
    # export --epsilon takes the budget; the default pick is the release's own.
    exported = tmp_path / "best.yaml"
    result = runner.invoke(app, ["export", str(folder), "--epsilon", "8", "--out", str(exported)])
    assert result.exit_code == 0 and "note:" not in result.output, result.output
    (config,) = load_configs(exported)
    assert config.privacy.epsilon == trial_eps
    assert config.privacy.tuning.quoted_epsilon == report["random_trials_epsilon"]
    assert best.data.tags["dpivon.trial_id"] in exported.read_text()
    knee = tmp_path / "knee.yaml"
    result = runner.invoke(
        app, ["export", str(folder), "--epsilon", "8", "--pick", "knee", "--out", str(knee)]
    )
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if "note:" in line]
    assert len(notes) == 1 and "--pick knee is not the model the sweep releases" in notes[0]
    tuning = load_configs(knee)[0].privacy.tuning
    assert tuning.quoted_epsilon == private["composition_epsilon"]
    assert tuning.quote.startswith("composition_epsilon")
    result = runner.invoke(
        app,
        [
            "train",
            "--config",
            str(exported),
            "--no-log-model",
            "--tracking-uri",
            f"sqlite:///{tmp_path}/prod.db",
        ],
    )
    assert result.exit_code == 0, result.output
    prod = mlflow.MlflowClient(f"sqlite:///{tmp_path}/prod.db")
    (run,) = prod.search_runs([prod.get_experiment_by_name("dpivon").experiment_id])
    assert float(run.data.params["epsilon"]) == trial_eps
    assert run.data.metrics["tuning_epsilon"] == pytest.approx(report["quoted_epsilon"])
    assert run.data.metrics["epsilon_with_tuning"] > report["quoted_epsilon"]


def test_failing_trials_are_recorded_and_the_sweep_finishes(tmp_path, local_ray):
    spaces = REPO / "search_spaces" / "quickstart"
    # No ASHA here: it could stop a trial after its first report, before the failure.
    path = write_pipeline(
        tmp_path,
        name="failing",
        max_failures=0,
        scheduler={"type": "none"},
        optimizers=[
            {"name": "dp-ivon-gradsq", "space": str(spaces / "dp-ivon-gradsq.yaml")},
            {"name": "dp-sgd", "space": str(spaces / "dp-sgd.yaml")},
        ],
    )
    pipeline = load_pipeline(path)
    with injected_faults(local_ray, {"dp-sgd": 1}):
        trials = run_sweep(pipeline)
    assert (trials[trials.optimizer == "dp-sgd"].status == RunOutcome.FAILED).all()
    assert (trials[trials.optimizer == "dp-ivon-gradsq"].status != RunOutcome.FAILED).all()
    _, (parent,), children = runs_of(tmp_path, pipeline.experiment)
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["trials_failed"] == 2
    for child in children:
        if child.data.params["optimizer"] == "dp-sgd":
            assert child.info.status == "FAILED"
            assert "InjectedFailure" in child.data.tags["error"]
            # The epoch before the failure was recorded, not lost.
            assert "val_accuracy" in child.data.metrics
    # ... with the privacy facts of every epoch: the tuning cost composes both failed trials
    private = json.loads((sweep_folder(pipeline) / "tuning_private.json").read_text())
    assert private["eps8-dp-sgd"]["num_trials"] == 2


def test_a_trial_killed_before_it_starts_is_recorded_failed_and_the_sweep_finishes(
    tmp_path, local_ray
):
    """Its worker dies while the trial's actor is created (as when the kernel kills it for
    memory): Tune reports an error for a trial that never started, and never ran."""
    spaces = REPO / "search_spaces" / "quickstart"
    path = write_pipeline(
        tmp_path, name="killed", max_failures=0, trials=1, epochs=1, scheduler={"type": "none"},
        optimizers=[{"name": "dp-sgd", "space": str(spaces / "dp-sgd.yaml")},
                    {"name": "dp-adam", "space": str(spaces / "dp-adam.yaml")}],
    )  # fmt: skip
    pipeline = load_pipeline(path)
    with injected_faults(local_ray, {"dp-sgd": KILLED}):
        trials = run_sweep(pipeline)
    by_optimizer = dict(zip(trials.optimizer, trials.status, strict=True))
    assert by_optimizer == {"dp-sgd": RunOutcome.FAILED, "dp-adam": RunOutcome.COMPLETED}
    _, (parent,), children = runs_of(tmp_path, pipeline.experiment)
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["trials_failed"] == 1
    (killed,) = [c for c in children if c.data.tags["dpivon.optimizer"] == "dp-sgd"]
    assert killed.info.status == "FAILED"
    assert killed.data.tags["dpivon.trial_status"] == RunOutcome.FAILED
    # it never reported: no metrics, and no params (its worker never built its config)
    assert not killed.data.metrics and not killed.data.params


def test_a_crashed_trial_retries_from_its_epoch_checkpoint(tmp_path, local_ray):
    path = write_pipeline(
        tmp_path,
        name="retry",
        storage_path=(tmp_path / "runs").as_uri(),  # a file:// URI, through pyarrow
        max_failures=1,
        trials=1,
        scheduler={"type": "none"},
        optimizers=[
            {"name": "dp-sgd", "space": str(REPO / "search_spaces/quickstart/dp-sgd.yaml")},
        ],
    )
    pipeline = load_pipeline(path)
    with injected_faults(local_ray, {"dp-sgd": 1}):  # the first attempt fails after epoch 1
        trials = run_sweep(pipeline)
    (status,) = trials.status
    assert status == RunOutcome.COMPLETED
    _, _, (child,) = runs_of(tmp_path, pipeline.experiment)
    assert child.info.status == "FINISHED"
    # Resumed from the epoch-1 checkpoint: the accountant kept the first epoch's steps.
    assert 8.0 - 0.05 <= child.data.metrics["epsilon_spent"] <= 8.0
    assert (sweep_folder(pipeline) / "trials.csv").exists()


def test_a_resumed_trial_finds_no_noise_key_on_disk_and_draws_a_fresh_one(tmp_path, local_ray):
    """A secure trial fails after epoch 1 and resumes from that epoch's checkpoint: the
    resume state held the stream position but no key (the retry keyed its stream afresh),
    and no file under the sweep's folders, its MLflow store or Ray's session folder holds
    the key that the trials' OS entropy source returned."""
    key = os.urandom(32)
    resumed = tmp_path / "resumed.jsonl"
    path = write_pipeline(
        tmp_path,
        name="no-key",
        max_failures=1,
        trials=1,
        scheduler={"type": "none"},
        optimizers=[
            {"name": "dp-sgd", "space": str(REPO / "search_spaces/quickstart/dp-sgd.yaml")},
        ],
    )
    pipeline = load_pipeline(path)
    faults = {"dp-sgd": 1, NOISE_KEY: key.hex(), RESUMED_STATES: str(resumed)}
    with injected_faults(local_ray, faults):
        trials = run_sweep(pipeline)
    assert list(trials.status) == [RunOutcome.COMPLETED]
    assert [json.loads(line) for line in resumed.read_text().splitlines()] == [["draws"]]
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    forms = (key, key.hex().encode(), str(list(key)).encode())
    for folder in (tmp_path, session):
        for file in (f for f in folder.rglob("*") if f.is_file()):
            blob = file.read_bytes()
            assert not any(form in blob for form in forms), file


def test_all_groups_are_in_flight_together_each_with_its_own_study(tmp_path):
    """3 groups with their own trial counts (geometric, mean 2), 3 trials at once."""
    dp_sgd = {"name": "dp-sgd", "space": str(REPO / "search_spaces/quickstart/dp-sgd.yaml")}
    pipeline = load_pipeline(
        write_pipeline(
            tmp_path,
            name="groups",
            epsilons=[2, 4, 8],
            optimizers=[dp_sgd],
            trials=2,
            epochs=1,
            trial_count="geometric",
            concurrency=3,
            resources={"cpu": 0.5},
            scheduler={"type": "none"},
        )
    )
    run_sweep(pipeline)
    # drawn from OS entropy when the sweep started, kept in its (private) state file
    expected = SweepState.load(pipeline.storage).trial_counts
    assert set(expected) == {"eps2-dp-sgd", "eps4-dp-sgd", "eps8-dp-sgd"}
    _, (parent,), children = runs_of(tmp_path, pipeline.experiment)
    assert parent.info.status == "FINISHED"
    assert Counter(c.data.tags["dpivon.group"] for c in children) == expected
    spans = [(c.data.tags["dpivon.group"], c.info.start_time, c.info.end_time) for c in children]
    assert any(g1 != g2 and s1 < e2 and s2 < e1 for g1, s1, e1 in spans for g2, s2, e2 in spans), (
        f"no two groups overlapped: {spans}"
    )
    # Every group's Optuna study saw its own trials, and only those.
    searcher = GroupSearcher({}, {}, dict)  # restore_from_dir brings its own reader
    searcher.restore_from_dir(str(sweep_folder(pipeline) / TUNE_EXPERIMENT))
    assert searcher.group_of == {
        c.data.tags["dpivon.trial_id"]: c.data.tags["dpivon.group"] for c in children
    }
    for group, study in searcher.studies.items():
        states = [t.state for t in study._ot_study.trials]
        assert states == [TrialState.COMPLETE] * expected[group], group


def test_asha_compares_a_trial_with_its_own_group_only():
    def asha():
        return ASHAScheduler(
            metric="val_accuracy",
            mode="max",
            time_attr="training_iteration",
            max_t=4,
            grace_period=1,
            reduction_factor=2,
        )

    scheduler = GroupScheduler({"a": asha(), "b": asha()})
    trials = {
        name: Trial("t", config={GROUP_KEY: name[0]}, stub=True, trial_id=name)
        for name in ("a1", "b1", "b2")
    }
    for trial in trials.values():
        scheduler.on_trial_add(None, trial)

    def report(name: str, accuracy: float) -> str:
        result = {"training_iteration": 1, "val_accuracy": accuracy}
        return scheduler.on_trial_result(None, trials[name], result)

    assert report("a1", 0.9) == TrialScheduler.CONTINUE
    # One ASHA for both groups would stop b1 here: it is below a1 at the first rung.
    assert report("b1", 0.1) == TrialScheduler.CONTINUE
    assert report("b2", 0.05) == TrialScheduler.STOP  # below b1, of its own group


@pytest.mark.parametrize(("address", "resources", "message"), [
    # a local Ray: this machine, checked before Ray starts
    (None, {"cpu": 1, "gpu": 64}, "more than this machine has"),
    # a cluster (here this module's Ray of 2 CPUs): its nodes, once joined
    ("auto", {"cpu": 3, "gpu": 0}, "more than any node of the Ray cluster has (nodes: 2 CPU"),
])  # fmt: skip
def test_a_trial_no_node_can_host_is_one_line_before_any_run(tmp_path, address, resources, message):
    path = write_pipeline(tmp_path, name="big", resources=resources)
    address_option = ["--address", address] if address else []
    result = runner.invoke(app, ["sweep", str(path), *address_option])
    assert result.exit_code == 2, result.output
    assert f"{resources['cpu']:g} CPU and {resources['gpu']:g} GPU" in result.output
    assert message in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output
    _, parents, children = runs_of(tmp_path, load_pipeline(path).experiment)
    assert parents == [] and children == []


# --- what a released model's noise reveals -------------------------------------------------


def yaml_optimizers() -> list[dict]:
    """The smoke pipeline's optimizer entries, spaces as absolute paths."""
    data = yaml.safe_load((REPO / "pipelines" / "smoke.yaml").read_text())
    return [
        {**entry, "space": str((REPO / "pipelines" / entry["space"]).resolve())}
        for entry in data["optimizers"]
    ]


def released_models(tmp_path, pipeline) -> list[tuple[str, dict, Path]]:
    """(run id, checkpoint contents, checkpoint file) of every model the sweep logged."""
    client, _, children = runs_of(tmp_path, pipeline.experiment)
    mlflow.set_tracking_uri(client.tracking_uri)  # a logged model resolves through it
    released = []
    for child in children:
        if child.data.tags.get("dpivon.pareto_optimal") != "true":
            continue
        folder = mlflow.artifacts.download_artifacts(
            artifact_uri=f"runs:/{child.info.run_id}/model",
            dst_path=str(tmp_path / "released" / child.info.run_id),
        )
        (checkpoint,) = Path(folder).rglob("checkpoint.pt")
        released.append((child.info.run_id, torch.load(checkpoint, weights_only=True), checkpoint))
    return released


def relative_distances_of_retrains(checkpoint: Path) -> tuple[float, float]:
    """What the review did: retrain the released model from the config stored inside it
    (one thread, as its trial ran), with and without one training record (the target);
    the relative distance of each retrain to the released weights."""
    config, model, _ = load_model_file(checkpoint)
    data = load_data(config)
    x, y = data.train.tensors
    without = DataSplits(TensorDataset(x[1:], y[1:]), data.val, data.test, data.classes)
    released = torch.cat([p.flatten() for p in model.state_dict().values()])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        distances = []
        for splits in (data, without):
            retrained = train(config, data=splits, evaluate_test=False).model
            weights = torch.cat([p.flatten() for p in retrained.state_dict().values()])
            distances.append(((weights - released).norm() / released.norm()).item())
    finally:
        torch.set_num_threads(threads)
    return distances[0], distances[1]


def test_a_default_sweep_releases_models_no_retrain_reproduces(finished_sweep, tmp_path):
    """Membership inference as the review ran it finds no match on a default sweep's
    released models; the control, a research-mode sweep, matches bit for bit with the
    target and not without it, so the test can fail."""
    sweep_tmp, pipeline, _ = finished_sweep
    client, (parent,), children = runs_of(sweep_tmp, pipeline.experiment)
    assert {c.data.params["research_mode"] for c in children} == {"False"}
    assert "No DP guarantee" not in parent.data.tags["mlflow.note.content"]
    released = released_models(sweep_tmp, pipeline)
    assert released
    for run_id, state, _ in released:  # no randomness state in a released model
        assert state.keys() == {FORMAT_KEY, "config", "model_state", "posterior"}
        assert state["config"]["privacy"]["research_mode"] is False
        assert client.get_run(run_id).data.tags["dpivon.noise"].startswith("secure")
    # No resume state (in secure mode it holds the key) outlives the sweep in its folder.
    assert not list(sweep_folder(pipeline).rglob(RESUME_FILE))
    checkpoint = next(c for _, s, c in released if s["config"]["optimizer"]["name"] == "dp-sgd")
    with_target, without_target = relative_distances_of_retrains(checkpoint)
    print(f"secure: relative distance {with_target:.3g} with, {without_target:.3g} without")
    assert with_target > 1e-3 and without_target > 1e-3

    research = load_pipeline(
        write_pipeline(
            tmp_path,
            name="smoke-research",
            research_mode=True,
            optimizers=[e for e in yaml_optimizers() if e["name"] == "dp-sgd"],
            trials=1,
        )
    )
    run_sweep(research)
    research_client, (research_parent,), _ = runs_of(tmp_path, research.experiment)
    assert research_parent.data.tags["mlflow.note.content"].startswith("**No DP guarantee**")
    tuning = json.loads((sweep_folder(research) / "tuning_privacy.json").read_text())
    assert tuning["eps8-dp-sgd"]["dp_guarantee"].startswith("none: research mode")
    ((research_run, _, research_checkpoint),) = released_models(tmp_path, research)
    tags = research_client.get_run(research_run).data.tags
    assert tags["dpivon.noise"] == RESEARCH_MODE_WARNING
    # every run says which noise ran, whether or not it logged a model
    _, research_parents, research_children = runs_of(tmp_path, research.experiment)
    for run in research_parents + research_children:
        assert run.data.tags["dpivon.noise"] == RESEARCH_MODE_WARNING, run.info.run_name
    for run in [parent, *children]:
        assert run.data.tags["dpivon.noise"].startswith("secure"), run.info.run_name
    logged = mlflow.pyfunc.load_model(f"runs:/{research_run}/model")
    assert logged.metadata.metadata["dpivon.noise"] == RESEARCH_MODE_WARNING
    with_target, without_target = relative_distances_of_retrains(research_checkpoint)
    print(f"research: relative distance {with_target:.3g} with, {without_target:.3g} without")
    assert with_target == 0.0 and without_target > 1e-3


@pytest.mark.slow
def test_a_noise_faithful_sweep_quotes_what_its_trials_ran_and_exports_the_target(tmp_path):
    from dpivon.search.export import export_configs, resolve_sweep

    space = tmp_path / "dp-sgd.yaml"
    space.write_text("optimizer: dp-sgd\nparams:\n  lr: {type: float, low: 0.1, high: 2.0}\n")
    path = write_pipeline(
        tmp_path,
        name="tan",
        epochs=2,
        trials=2,
        scheduler={"type": "none"},
        optimizers=[{"name": "dp-sgd", "space": str(space)}],
        train={"batch_size": 64, "bma_samples": 2},
        noise_faithful={"batch_divisor": 2},
    )
    pipeline = load_pipeline(path)
    run_sweep(pipeline)
    expected = pipeline.noise_faithful_settings(8.0)
    n = pipeline.data.train_size
    steps = 2 * -(-n // 64)  # the target's: 2 epochs of ceil(N / 64) batches of 64
    _, (parent,), children = runs_of(tmp_path, pipeline.experiment)
    assert len(children) == 2
    for child in children:  # each trial ran batch 32 for the target's steps at sigma_T / 2
        metrics = child.data.metrics
        assert metrics["noise_multiplier"] == pytest.approx(expected["fixed_noise_multiplier"])
        assert metrics["sample_rate"] == pytest.approx(32 / n)
        assert metrics["steps"] == steps
        assert metrics["epsilon_spent"] == pytest.approx(expected["epsilon"], rel=1e-9)
    folder = sweep_folder(pipeline)
    tuning = json.loads((folder / "tuning_privacy.json").read_text())["eps8-dp-sgd"]
    assert tuning["trial_epsilon"] == pytest.approx(expected["epsilon"])
    assert expected["epsilon"] > 8.0
    assert tuning["num_trials"] == 2 and tuning["quoted_epsilon"] > expected["epsilon"]
    assert "batch 32 = 64 / 2" in tuning["tuned_as"] and f"{steps} steps" in tuning["tuned_as"]
    assert "noise-faithful tuning" in parent.data.tags["mlflow.note.content"]
    # A released model's tags say what it spent, never the budget its group stands for.
    released = [c for c in children if c.data.tags.get("dpivon.pareto_optimal") == "true"]
    assert released
    for child in released:
        tags = child.data.tags
        assert float(tags["dpivon.budget"]) == 8.0
        assert float(tags["dpivon.epsilon"]) == pytest.approx(expected["epsilon"])
        assert float(tags["dpivon.epsilon_end_to_end"]) == pytest.approx(
            tuning["quoted_epsilon"], rel=1e-5
        )
    trials = pd.read_csv(folder / "trials.csv")  # the tables still go by the budget
    assert set(trials["epsilon"]) == {8.0}
    assert trials["trial_epsilon"].to_numpy() == pytest.approx(expected["epsilon"])
    # the export is the run the trials stood for: batch 64, the budget's calibrated sigma
    storage = resolve_sweep(str(path))
    ((_, config),) = export_configs(
        storage, pipeline.objective_pairs, "max-accuracy", full_data=False
    )
    assert config.training.batch_size == 64 and config.privacy.epsilon == 8.0
    assert config.privacy.fixed_noise_multiplier is None
    assert config.training.steps_per_epoch is None
