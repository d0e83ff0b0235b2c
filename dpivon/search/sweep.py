"""`dpivon sweep`: Ray Tune + Optuna over (epsilon x optimizer) groups, tracked in MLflow.

For every epsilon and optimizer of the pipeline, one Tune experiment runs the trials of
that group (its own Optuna study: TPE learns per optimizer and budget), each trial
recalibrating sigma_p for its own batch size and epochs. The driver alone writes MLflow:
one parent run per sweep, one child run per trial. When all groups are done, the Pareto
fronts (validation metrics, completed trials only) are computed, their members evaluated
on the test set, and the comparison is logged on the parent run.

Sweep state lives in ``<storage_path>/<name>/``: ``sweep.json`` (parent run, finished
groups), one Tune experiment folder per group, and the final tables.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pandas as pd
import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch
from rich.console import Console

from dpivon.config import parse_config
from dpivon.errors import DpivonError
from dpivon.evaluation import evaluate
from dpivon.privacy.tuning import (
    SweepConditions,
    TrialMechanism,
    candidate_mechanisms,
    solve_trial_epsilon,
    tuning_privacy_report,
    worst_case_tuning_epsilon,
)
from dpivon.search.callbacks import (
    CHECKPOINT_TAG,
    STATUS_TAG,
    TRACKING_URI_ENV,
    TRIAL_TAG,
    MlflowTrialLogger,
    SweepProgress,
)
from dpivon.search.pareto import (
    hypervolume_2d,
    pareto_front,
    plot_fronts_html,
    plot_fronts_png,
    print_front_table,
)
from dpivon.search.pipeline import Pipeline
from dpivon.search.trial import COMPLETE, MODEL_FILE, run_trial
from dpivon.tracking import Tracker, load_checkpoint, log_model
from dpivon.training import load_data

STATE_FILE = "sweep.json"
TRIALS_FILE = "trials.csv"
FRONT_FILE = "pareto_front.csv"
TUNING_FILE = "tuning_privacy.json"
console = Console(stderr=True)


@dataclass
class SweepState:
    """What a resumed driver needs: the parent run and which groups are finished."""

    name: str
    pipeline_path: str
    tracking_uri: str
    experiment: str
    parent_run_id: str
    objectives: list[tuple[str, str]]
    groups_done: list[str] = field(default_factory=list)
    # group -> the epsilon each of its trials spends (differs from the group's budget only
    # with total_epsilon); fixed when the sweep starts so that a resume keeps it
    trial_epsilons: dict[str, float] = field(default_factory=dict)

    @classmethod
    def load(cls, directory: Path) -> SweepState:
        state = json.loads((directory / STATE_FILE).read_text())
        state["objectives"] = [tuple(pair) for pair in state["objectives"]]
        return cls(**state)

    def save(self, directory: Path) -> None:
        tmp = directory / f"{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(self.__dict__, indent=2))
        tmp.replace(directory / STATE_FILE)


class CompletionAwareOptunaSearch(OptunaSearch):
    """Tells Optuna that an ASHA-stopped trial was PRUNED, not COMPLETE with its last
    (partially trained) values, so early-stopped trials never steer the search as
    finished points of the front."""

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
        if result is not None and not result.get(COMPLETE):
            result = None
        super().on_trial_complete(trial_id, result=result, error=error)


def group_name(optimizer: str, epsilon: float) -> str:
    """The key of one (optimizer, epsilon) group: Tune experiment, MLflow tags, reports."""
    return f"eps{epsilon:g}-{optimizer}"


def sweep_conditions(pipeline: Pipeline) -> SweepConditions:
    return SweepConditions(
        trial_count=pipeline.trial_count,
        mean_trials=float(pipeline.trials),
        adaptive_sampler=pipeline.sampler != "random",
        adaptive_scheduler=pipeline.scheduler.type != "none",
        release=pipeline.release,
    )


def group_candidates(pipeline: Pipeline, optimizer: str, trial_epsilon: float) -> list:
    """Mechanisms covering every trial the space can produce at ``trial_epsilon``."""
    space = pipeline.spaces[optimizer]
    batch_sizes = space.all_values("batch_size")
    if batch_sizes is None:
        base = pipeline.base_train_config(optimizer, pipeline.epsilon_list[0])
        batch_sizes = [parse_config(base).batch_size]
    return candidate_mechanisms(
        batch_sizes,
        dataset_size=pipeline.data.train_size,
        epochs=pipeline.epochs,
        target_epsilon=trial_epsilon,
        delta=pipeline.delta,
        accountant=pipeline.accountant,
        validation_noise_multiplier=pipeline.validation_noise,
    )


def solve_trial_epsilons(pipeline: Pipeline, counts: dict) -> dict[str, float]:
    """Each group's per-trial epsilon: its budget, or with ``total_epsilon`` the largest one
    whose quoted tuning epsilon (worst case over the space) is at most the total."""
    if pipeline.total_epsilon is None:
        return {
            group_name(o, e): e for o in pipeline.optimizer_names for e in pipeline.epsilon_list
        }
    conditions, total = sweep_conditions(pipeline), pipeline.total_epsilon
    solved = {}
    for optimizer in pipeline.optimizer_names:
        trials = counts[(optimizer, total)]
        console.print(f"solving the per-trial epsilon of {optimizer} for total {total:g}...")
        eps = solve_trial_epsilon(
            total,
            lambda e, o=optimizer, k=trials: worst_case_tuning_epsilon(
                group_candidates(pipeline, o, e), pipeline.delta, conditions, k
            ),
        )
        console.print(f"  {optimizer}: each of {trials} trials spends epsilon {eps:.3f}")
        solved[group_name(optimizer, total)] = eps
    return solved


def sweep_directory(pipeline: Pipeline) -> Path:
    return Path(pipeline.storage_path).resolve() / pipeline.name


def _sampler(name: str, seed: int) -> optuna.samplers.BaseSampler:
    samplers = {
        "tpe": lambda: optuna.samplers.TPESampler(seed=seed),
        "nsga2": lambda: optuna.samplers.NSGAIISampler(seed=seed),
        "random": lambda: optuna.samplers.RandomSampler(seed=seed),
    }
    return samplers[name]()


def _init_ray(address: str | None) -> None:
    # Trial failures are reported by SweepProgress in one line and recorded in MLflow;
    # Tune's own tracebacks and state messages would bury them.
    logging.getLogger("ray.tune").setLevel(logging.CRITICAL)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0: no Tune tables at all
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")  # resumable within a second
    try:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise DpivonError(f"cannot connect to the Ray cluster at {address}: {err}") from None


def _provenance() -> dict[str, str]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    versions = {
        f"version.{p}": metadata.version(p)
        for p in ("torch", "opacus", "ray", "optuna", "mlflow", "pandas", "dp-accounting")
    }
    return {"git_commit": commit or "unknown", "python": platform.python_version(), **versions}


def _start_or_resume(
    pipeline: Pipeline,
    directory: Path,
    tracker: Tracker,
    resume: bool,
    trial_epsilons: dict[str, float],
) -> SweepState:
    if (directory / STATE_FILE).exists():
        if not resume:
            raise DpivonError(
                f"sweep {pipeline.name!r} already exists in {directory}; pass --resume to "
                "continue it, or change the pipeline's name (or delete that folder) to start over"
            )
        state = SweepState.load(directory)
        tracker.client.update_run(state.parent_run_id, status="RUNNING")
        console.print(f"resuming sweep {pipeline.name!r}: groups done {state.groups_done}")
        return state
    if resume:
        console.print(f"[yellow]note:[/] nothing to resume in {directory}; starting the sweep")
    directory.mkdir(parents=True, exist_ok=True)
    parent = tracker.start_run(
        pipeline.name, tags={"dpivon.kind": "sweep", "dpivon.sweep_dir": str(directory)}
    )
    tracker.log_params(
        parent,
        {
            "pipeline": pipeline.name,
            "epsilons": pipeline.epsilon_list,
            "delta": pipeline.delta,
            "optimizers": list(pipeline.spaces),
            "trials": pipeline.trials,
            "trial_count": pipeline.trial_count,
            "sampler": pipeline.sampler,
            "seed": pipeline.seed,
            "scheduler": pipeline.scheduler.type,
            "release": pipeline.release,
            "total_epsilon": pipeline.total_epsilon,
            "validation_noise": pipeline.validation_noise,
            "epochs": pipeline.epochs,
            "model": pipeline.model,
            **_provenance(),
        },
    )
    tracker.log_text(parent, pipeline.source_text, "pipeline.yaml")
    for name, space in pipeline.spaces.items():
        tracker.log_dict(parent, space.to_dict(), f"search_spaces/{name}.json")
    state = SweepState(
        pipeline.name,
        str(pipeline.path),
        tracker.display_uri,  # no password in the state file: a resume is given the URI again
        tracker.experiment_name,
        parent,
        list(pipeline.objective_pairs),
        trial_epsilons=trial_epsilons,
    )
    state.save(directory)
    return state


def _run_group(
    pipeline: Pipeline,
    optimizer: str,
    epsilon: float,
    num_trials: int,
    data,
    state: SweepState,
    directory: Path,
    resume: bool,
    tracking_uri: str,
) -> None:
    space = pipeline.spaces[optimizer]
    group = group_name(optimizer, epsilon)
    base = pipeline.base_train_config(optimizer, epsilon, state.trial_epsilons[group])
    cpu, gpu = pipeline.resources.cpu, pipeline.resources.gpu
    trainable = tune.with_resources(
        tune.with_parameters(
            run_trial, data=data, base_config=base, space=space, threads=max(1, int(cpu))
        ),
        {"cpu": cpu, "gpu": gpu},
    )
    path = directory / group
    if resume and tune.Tuner.can_restore(path):
        console.print(f"[bold]{group}[/]: restoring the interrupted Tune experiment")
        tuner = tune.Tuner.restore(
            str(path), trainable, resume_unfinished=True, resume_errored=False
        )
    else:
        (first_metric, first_mode), (second_metric, second_mode) = pipeline.objective_pairs
        searcher = CompletionAwareOptunaSearch(
            space=space.define_by_run,
            metric=[first_metric, second_metric],
            mode=[first_mode, second_mode],
            sampler=_sampler(pipeline.sampler, pipeline.seed),
        )
        scheduler = None
        if pipeline.scheduler.type == "asha":
            scheduler = ASHAScheduler(
                metric=first_metric,
                mode=first_mode,
                time_attr="training_iteration",
                max_t=pipeline.epochs,
                grace_period=pipeline.scheduler.grace_period,
                reduction_factor=pipeline.scheduler.reduction_factor,
            )
        tags = {
            "dpivon.group": group,
            "dpivon.optimizer": optimizer,
            "dpivon.epsilon": f"{epsilon:g}",
        }
        tuner = tune.Tuner(
            trainable,
            tune_config=tune.TuneConfig(
                search_alg=searcher,
                scheduler=scheduler,
                num_samples=num_trials,
                max_concurrent_trials=pipeline.concurrency,
            ),
            run_config=tune.RunConfig(
                name=group,
                storage_path=str(directory),
                failure_config=tune.FailureConfig(max_failures=pipeline.max_failures),
                checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                callbacks=[
                    MlflowTrialLogger(
                        tracking_uri, state.experiment, state.parent_run_id, base, space, tags
                    ),
                    SweepProgress(group, num_trials, first_metric, first_mode),
                ],
                verbose=0,
            ),
        )
    console.print(f"[bold]{group}[/]: {num_trials} trials, {pipeline.concurrency} at a time")
    tuner.fit()


def trials_table(tracker: Tracker, parent_run_id: str) -> pd.DataFrame:
    """One row per trial, from the MLflow child runs (the record that survives resumes)."""
    runs = tracker.client.search_runs(
        [tracker.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
        max_results=10000,
    )
    rows = []
    for run in runs:
        tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
        status = tags.get(STATUS_TAG, "failed")
        if status == "running" or run.info.status == "FAILED":
            status = "failed"
        rows.append(
            {
                "trial_id": tags.get(TRIAL_TAG),
                "run_id": run.info.run_id,
                "group": tags.get("dpivon.group"),
                "optimizer": params.get("optimizer"),
                "epsilon": float(params.get("epsilon", "nan")),
                "status": status,
                "checkpoint": tags.get(CHECKPOINT_TAG),
                **{f"param.{k}": v for k, v in params.items()},
                **metrics,
            }
        )
    return pd.DataFrame(rows)


def _evaluate_front_on_test(front: pd.DataFrame, data, tracker: Tracker) -> pd.DataFrame:
    """Test metrics of the front members (selected on validation, never on test)."""
    test_rows = []
    for _, row in front.iterrows():
        config, model, posterior = load_checkpoint(Path(row["checkpoint"]) / MODEL_FILE)
        result = evaluate(
            model,
            data.test,
            posterior=posterior,
            bma_samples=config.bma_samples,
            n_bins=config.ece_bins,
            seed=config.seed,
        )
        test = {f"test_{k}": v for k, v in result.metrics.items()}
        tracker.log_metrics(row["run_id"], test, step=config.epochs)
        tracker.set_tags(row["run_id"], {"dpivon.pareto_optimal": "true"})
        log_model(tracker, row["run_id"], config, model, posterior)
        test_rows.append({"trial_id": row["trial_id"], **test})
    return front.merge(pd.DataFrame(test_rows), on="trial_id", how="left") if test_rows else front


def _tuning_privacy(
    trials: pd.DataFrame, pipeline: Pipeline, state: SweepState, counts
) -> dict[str, Any]:
    """Per private group: what its trials cost, under which threat model, what to quote."""
    conditions = sweep_conditions(pipeline)
    reports = {}
    for (optimizer, budget), drawn in counts.items():
        group = group_name(optimizer, budget)
        trial_eps = state.trial_epsilons[group]
        if math.isinf(trial_eps) or not parse_config(
            pipeline.base_train_config(optimizer, budget, trial_eps)
        ).is_private:
            continue
        ran = trials[(trials["optimizer"] == optimizer) & (trials["epsilon"] == trial_eps)]
        if "noise_multiplier" in ran:
            ran = ran.dropna(subset=["noise_multiplier", "sample_rate", "steps"])
        else:
            ran = ran.iloc[0:0]
        releases = pipeline.epochs if pipeline.validation_noise > 0 else 0
        mechanisms = [
            TrialMechanism(
                r.noise_multiplier, r.sample_rate, int(r.steps), pipeline.validation_noise,
                releases,
            )
            for r in ran.itertuples()
        ]
        if not mechanisms and drawn > 0:
            continue  # every trial failed before training: nothing ran, nothing to report
        needs_candidates = drawn > 0 and not conditions.random_trials_obstacles()
        report = tuning_privacy_report(
            mechanisms,
            pipeline.delta,
            conditions,
            candidates=group_candidates(pipeline, optimizer, trial_eps)
            if needs_candidates
            else (),
            drawn_trials=drawn,
        )
        report["trial_epsilon"] = trial_eps
        if pipeline.total_epsilon is not None:
            report["total_epsilon"] = pipeline.total_epsilon
        reports[group] = report
    return reports


def privacy_summary_markdown(privacy: dict[str, Any]) -> str:
    """The quoted epsilons as a Markdown table, for the parent run's description."""
    lines = [
        "| group | trials | per-trial eps | composition eps | quoted eps | covers |",
        "|---|---|---|---|---|---|",
    ]
    for group, r in privacy.items():
        lines.append(
            f"| {group} | {r['num_trials']} (drawn {r['drawn_trials']}) | "
            f"{r['trial_epsilon']:.3g} | {r['composition_epsilon']:.3g} | "
            f"{r['quoted_epsilon']:.3g} | {r['release']} release; {r['records_covered']} |"
        )
    quotes = "\n".join(f"- **{group}**: {r['quote']}" for group, r in privacy.items())
    return "\n".join(lines) + "\n\n" + quotes


def _finalize(
    pipeline: Pipeline, state: SweepState, tracker: Tracker, directory: Path, data, counts
) -> pd.DataFrame:
    trials = trials_table(tracker, state.parent_run_id)
    if trials.empty:
        raise DpivonError("the sweep recorded no trial; see the Ray logs above")
    objectives = pipeline.objective_pairs
    front = pareto_front(trials, objectives, by=("optimizer", "epsilon"))
    front = _evaluate_front_on_test(front, data, tracker)
    trials = trials.assign(on_front=trials["trial_id"].isin(front["trial_id"]))
    trials.to_csv(directory / TRIALS_FILE, index=False)
    front.to_csv(directory / FRONT_FILE, index=False)

    parent = state.parent_run_id
    modes = [mode for _, mode in objectives]
    metrics: dict[str, float] = {}
    for (optimizer, epsilon), group in front.groupby(["optimizer", "epsilon"]):
        points = group[[metric for metric, _ in objectives]].to_numpy(dtype=float)
        metrics[f"hypervolume.eps{epsilon:g}.{optimizer}"] = hypervolume_2d(points, modes)
    status_counts = trials["status"].value_counts()
    for status in ("completed", "early_stopped", "failed"):
        metrics[f"trials_{status}"] = float(status_counts.get(status, 0))
    privacy = _tuning_privacy(trials, pipeline, state, counts)
    for group, report in privacy.items():
        for key, value in report.items():
            numeric = isinstance(value, float | int) and not isinstance(value, bool)
            if numeric and np.isfinite(value):
                metrics[f"tuning.{group}.{key}"] = float(value)
    tracker.log_metrics(parent, metrics)
    tracker.log_dict(parent, privacy, "tuning_privacy.json")
    (directory / TUNING_FILE).write_text(json.dumps(privacy, indent=2))
    tracker.set_tags(parent, {"mlflow.note.content": privacy_summary_markdown(privacy)})
    tracker.log_artifact(parent, directory / TRIALS_FILE)
    tracker.log_artifact(parent, directory / FRONT_FILE)
    title = f"{pipeline.name}: Pareto fronts on validation"
    plot_fronts_png(trials, objectives, directory / "pareto.png", title)
    plot_fronts_html(trials, objectives, directory / "pareto.html", title)
    tracker.log_artifact(parent, directory / "pareto.png")
    tracker.log_artifact(parent, directory / "pareto.html")
    print_front_table(front, objectives, ["test_accuracy", "test_ece", "test_nll"])
    return trials


def run_sweep(
    pipeline: Pipeline,
    *,
    address: str | None = None,
    tracking_uri: str | None = None,
    resume: bool = False,
) -> pd.DataFrame:
    """Run (or resume) the whole sweep; returns the table of trials."""
    directory = sweep_directory(pipeline)
    tracker = Tracker(tracking_uri or pipeline.tracking_uri, pipeline.experiment)
    first_optimizer = next(iter(pipeline.spaces))
    data = load_data(
        parse_config(pipeline.base_train_config(first_optimizer, pipeline.epsilon_list[0]))
    )
    counts = pipeline.trial_counts()
    trial_epsilons = (
        SweepState.load(directory).trial_epsilons
        if resume and (directory / STATE_FILE).exists()
        else solve_trial_epsilons(pipeline, counts)
    )
    state = _start_or_resume(pipeline, directory, tracker, resume, trial_epsilons)
    # Restored Tune callbacks hold the redacted URI; they read the real one from here.
    os.environ[TRACKING_URI_ENV] = tracker.tracking_uri
    console.print(
        f"sweep {pipeline.name!r}: MLflow {tracker.display_uri}, experiment "
        f"{state.experiment!r}, parent run {state.parent_run_id}; results in {directory}"
    )
    try:
        _init_ray(address)
        for epsilon in pipeline.epsilon_list:
            for optimizer in pipeline.spaces:
                group = group_name(optimizer, epsilon)
                if group in state.groups_done:
                    continue
                if counts[(optimizer, epsilon)] == 0:
                    console.print(f"[bold]{group}[/]: K = 0 trials drawn; the group runs none")
                else:
                    _run_group(
                        pipeline,
                        optimizer,
                        epsilon,
                        counts[(optimizer, epsilon)],
                        data,
                        state,
                        directory,
                        resume,
                        tracker.tracking_uri,
                    )
                state.groups_done.append(group)
                state.save(directory)
        trials = _finalize(pipeline, state, tracker, directory, data, counts)
    except KeyboardInterrupt:
        tracker.end_run(state.parent_run_id, "KILLED")
        raise
    except BaseException as err:
        tracker.set_tags(state.parent_run_id, {"error": f"{type(err).__name__}: {err}"[:5000]})
        tracker.end_run(state.parent_run_id, "FAILED")
        raise
    tracker.end_run(state.parent_run_id, "FINISHED")
    return trials
