"""What a sweep concludes, from its MLflow record: fronts, test scores, privacy, plots.

When every trial has run, :func:`report_sweep` builds the Pareto front of each group
(validation metrics, completed trials only; dpivon.search.pareto), evaluates the released
models on the test set and logs them (dpivon.search.release) where their runs do not hold
their test scores and model yet, and, from the record read back, logs on the parent run: the
hypervolume of each front, the trial outcomes, the tuning-privacy report of each private
group (dpivon.privacy.tuning), the tables, the plots (dpivon.search.pareto_views), and a
Markdown description (dpivon.search.description). Finishing again (a resumed finished
sweep) therefore writes the same files and logs nothing twice. Where the random-trials bound
is quoted, nothing on the parent run reveals how many trials ran (no counts, no
composition): those facts go to ``tuning_private.json`` in the sweep's folder only, private
like its state file and checkpoints.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dpivon.data import DataSplits
from dpivon.errors import DpivonError
from dpivon.orchestration.storage import ResultsStorage
from dpivon.privacy.noise import RESEARCH_MODE_WARNING
from dpivon.privacy.tuning import TrialMechanism
from dpivon.privacy.tuning_report import composition_facts, tuning_privacy_report
from dpivon.search.description import TEST_COLUMNS, parent_description
from dpivon.search.pareto import default_reference, hypervolume_2d, pareto_front
from dpivon.search.pareto_views import plot_fronts_html, plot_fronts_png, print_front_table
from dpivon.search.pipeline import Pipeline
from dpivon.search.release import (
    record_front_on_test,
    released_models,
    tag_released_epsilons,
)
from dpivon.search.results import group_name, trials_table
from dpivon.search.sweep_files import (
    FRONT_FILE,
    HTML_FILE,
    PNG_FILE,
    PRIVATE_TUNING_FILE,
    TRIALS_FILE,
    TUNING_FILE,
)
from dpivon.tracking.client import Tracker
from dpivon.tracking.layout import RunOutcome


def tuning_privacy(
    trials: pd.DataFrame,
    pipeline: Pipeline,
    trial_epsilons: dict[str, float],
    counts: dict[tuple[str, float], int],
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Per private group: what its trials cost, under which threat model, what to quote
    (released), and the composition of the trials that ran with their number (kept
    private where the released report must not reveal the trial count)."""
    conditions = pipeline.conditions
    releases = pipeline.trial_epochs if pipeline.validation_noise > 0 else 0
    reports, private = {}, {}
    for (optimizer, budget), drawn in counts.items():
        group = group_name(optimizer, budget)
        trial_eps = trial_epsilons[group]
        if math.isinf(trial_eps):
            continue  # non-private, or no noise: nothing to account for
        ran = trials[trials["group"] == group]
        facts = ["noise_multiplier", "sample_rate", "steps"]
        ran = ran.dropna(subset=facts) if set(facts) <= set(ran.columns) else ran.iloc[0:0]
        mechanisms = [
            TrialMechanism(
                r.noise_multiplier,
                r.sample_rate,
                int(r.steps),
                pipeline.validation_noise,
                releases,
            )
            for r in ran.itertuples()
        ]
        hidden = pipeline.hides_trial_count
        if not mechanisms and drawn > 0 and not hidden:
            continue  # every trial failed before training: nothing ran, nothing to report
        report = tuning_privacy_report(
            mechanisms,
            pipeline.delta,
            conditions,
            candidates=pipeline.candidate_mechanisms(optimizer, trial_eps) if hidden else (),
            accountant=pipeline.accountant,
        )
        report["trial_epsilon"] = trial_eps
        if pipeline.noise_faithful is not None:
            report["tuned_as"] = noise_faithful_statement(pipeline, budget, trial_eps)
        if pipeline.total_epsilon is not None:
            report["total_epsilon"] = pipeline.total_epsilon
        if pipeline.selection_metric is not None:
            report["selected_by"] = pipeline.selection_metric
        if pipeline.research_mode:
            report["dp_guarantee"] = f"none: {RESEARCH_MODE_WARNING}"
            report["quote"] = f"NO DP GUARANTEE ({RESEARCH_MODE_WARNING}). {report['quote']}"
        reports[group] = report
        private[group] = composition_facts(mechanisms, pipeline.delta)
    return reports, private


def noise_faithful_statement(pipeline: Pipeline, budget: float, trial_epsilon: float) -> str:
    """What a noise-faithful group's trials ran, and on which records, in one sentence."""
    keys = pipeline.noise_faithful_settings(budget)
    steps = keys["epochs"] * keys["steps_per_epoch"]
    target = pipeline.train["batch_size"]
    return (
        f"noise-faithful tuning (TAN, Sander et al. 2023): each trial ran batch "
        f"{keys['batch_size']} = {target} / {pipeline.noise_faithful.batch_divisor} for the "
        f"target's {steps} steps at sigma {keys['fixed_noise_multiplier']:.4g} (sigma / B of "
        f"the target run at epsilon {budget:g}), on the {pipeline.data.train_size} training "
        f"images the target trains on; that spends epsilon {trial_epsilon:.4g} per trial, "
        "the accountant's for what ran, and the quote composes it"
    )


def front_hypervolumes(front: pd.DataFrame, objectives: list[tuple[str, str]]) -> dict[str, float]:
    """The hypervolume of each (optimizer, epsilon) front, as parent-run metrics."""
    metrics, modes = [m for m, _ in objectives], [mode for _, mode in objectives]
    reference = default_reference(objectives)
    return {
        f"hypervolume.eps{epsilon:g}.{optimizer}": hypervolume_2d(
            group[metrics].to_numpy(dtype=float), modes, reference
        )
        for (optimizer, epsilon), group in front.groupby(["optimizer", "epsilon"])
    }


def report_sweep(
    pipeline: Pipeline,
    tracker: Tracker,
    parent_run_id: str,
    trial_epsilons: dict[str, float],
    counts: dict[tuple[str, float], int],
    data: DataSplits,
    storage: ResultsStorage,
) -> pd.DataFrame:
    """Build and log everything the sweep concludes, its files both in the sweep's folder
    and on the parent run; returns the trials table."""
    objectives, by = pipeline.objective_pairs, ("optimizer", "epsilon")
    record = trials_table(tracker, parent_run_id, storage)
    if record.empty:
        raise DpivonError("the sweep recorded no trial; see the Ray logs above")
    front = pareto_front(record, objectives, by=by)
    record_front_on_test(released_models(front, pipeline), data, tracker, storage)
    # Everything below is computed from the record alone, read back whole, so that a first
    # finish and any resumed one write the same tables and log the same values.
    trials = trials_table(tracker, parent_run_id, storage)
    front = pareto_front(trials, objectives, by=by)
    released = released_models(front, pipeline)
    trials = trials.assign(on_front=trials["trial_id"].isin(front["trial_id"]))

    privacy, private = tuning_privacy(trials, pipeline, trial_epsilons, counts)
    tag_released_epsilons(released, privacy, tracker)
    metrics = front_hypervolumes(front, objectives)
    if not pipeline.hides_trial_count:  # the outcome counts add up to the trial count
        outcomes = trials["status"].value_counts()
        for status in RunOutcome:
            if status is not RunOutcome.RUNNING:
                metrics[f"trials_{status}"] = float(outcomes.get(status, 0))
    for group, report in privacy.items():
        for key, value in report.items():
            numeric = isinstance(value, float | int) and not isinstance(value, bool)
            if numeric and np.isfinite(value):
                metrics[f"tuning.{group}.{key}"] = float(value)
    tracker.log_changed_metrics(parent_run_id, metrics)
    description = parent_description(
        released, objectives, privacy, pipeline.research_mode, hidden_counts=private
    )
    tracker.set_tags(parent_run_id, {"mlflow.note.content": description})
    title = f"{pipeline.name}: Pareto fronts on validation"
    with tempfile.TemporaryDirectory(prefix="dpivon-report-") as tmp:
        local = Path(tmp)  # the files are made here, then stored and logged
        trials.to_csv(local / TRIALS_FILE, index=False)
        front.to_csv(local / FRONT_FILE, index=False)
        (local / TUNING_FILE).write_text(json.dumps(privacy, indent=2))
        plot_fronts_png(trials, objectives, local / PNG_FILE, title)
        plot_fronts_html(trials, objectives, local / HTML_FILE, title)
        for name in (TRIALS_FILE, FRONT_FILE, TUNING_FILE, PNG_FILE, HTML_FILE):
            storage.write_bytes(name, (local / name).read_bytes())
            tracker.log_artifact(parent_run_id, local / name)
    storage.write_text(PRIVATE_TUNING_FILE, json.dumps(private, indent=2))  # never logged
    print_front_table(front, objectives, TEST_COLUMNS)
    return trials
