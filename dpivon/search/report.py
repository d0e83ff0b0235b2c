"""What a sweep concludes, from its MLflow record: fronts, test scores, privacy, plots.

When every trial has run, :func:`report_sweep` builds the Pareto front of each group
(validation metrics, completed trials only; dpivon.search.pareto), evaluates its members on
the test set, and logs on the parent run: the hypervolume of each front, the trial
outcomes, the tuning-privacy report of each private group (dpivon.privacy.tuning), the
tables, the plots, and a Markdown description (the fronts and the epsilons to quote). The
same accounting, run before the sweep, solves the per-trial epsilon of a ``total_epsilon``
budget (:func:`solve_trial_epsilons`).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console

from dpivon.config import parse_config
from dpivon.data import DataSplits
from dpivon.errors import DpivonError
from dpivon.evaluation import evaluate
from dpivon.privacy.noise import RESEARCH_MODE_WARNING
from dpivon.privacy.tuning import (
    SweepConditions,
    TrialMechanism,
    candidate_mechanisms,
    solve_trial_epsilon,
    tuning_privacy_report,
    worst_case_tuning_epsilon,
)
from dpivon.search.pareto import (
    default_reference,
    hypervolume_2d,
    pareto_front,
    plot_fronts_html,
    plot_fronts_png,
    print_front_table,
)
from dpivon.search.pipeline import Pipeline
from dpivon.search.results import TrialStatus, group_name, trials_table
from dpivon.search.storage import SweepStorage, local_copy
from dpivon.search.trial import MODEL_FILE
from dpivon.tracking import Tracker, load_checkpoint, log_model

TRIALS_FILE = "trials.csv"
FRONT_FILE = "pareto_front.csv"
TUNING_FILE = "tuning_privacy.json"
PNG_FILE = "pareto.png"
HTML_FILE = "pareto.html"
TEST_COLUMNS = ("test_accuracy", "test_ece", "test_nll")
NOTE_LIMIT = 8000  # the longest tag value MLflow stores (the description is a tag)
console = Console(stderr=True)


# --- tuning privacy -------------------------------------------------------------------------


def sweep_conditions(pipeline: Pipeline) -> SweepConditions:
    return SweepConditions(
        trial_count=pipeline.trial_count,
        mean_trials=float(pipeline.trials),
        adaptive_sampler=pipeline.sampler != "random",
        adaptive_scheduler=pipeline.scheduler.type != "none",
        release=pipeline.release,
    )


def group_candidates(
    pipeline: Pipeline, optimizer: str, trial_epsilon: float
) -> list[TrialMechanism]:
    """Mechanisms covering every trial the space can produce at ``trial_epsilon``."""
    batch_sizes = pipeline.spaces[optimizer].all_values("batch_size")
    if batch_sizes is None:
        base = pipeline.base_train_config(optimizer, pipeline.epsilon_list[0])
        batch_sizes = [parse_config(base).training.batch_size]
    return candidate_mechanisms(
        batch_sizes,
        dataset_size=pipeline.data.train_size,
        epochs=pipeline.epochs,
        target_epsilon=trial_epsilon,
        delta=pipeline.delta,
        accountant=pipeline.accountant,
        validation_noise_multiplier=pipeline.validation_noise,
    )


def solve_trial_epsilons(
    pipeline: Pipeline, counts: dict[tuple[str, float], int]
) -> dict[str, float]:
    """Each group's per-trial epsilon: its budget, or with ``total_epsilon`` the largest one
    whose quoted tuning epsilon (worst case over the space) is at most the total."""
    if pipeline.total_epsilon is None:
        return {group_name(o, e): e for o, e in counts}
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


def tuning_privacy(
    trials: pd.DataFrame,
    pipeline: Pipeline,
    trial_epsilons: dict[str, float],
    counts: dict[tuple[str, float], int],
) -> dict[str, dict[str, Any]]:
    """Per private group: what its trials cost, under which threat model, what to quote."""
    conditions = sweep_conditions(pipeline)
    releases = pipeline.epochs if pipeline.validation_noise > 0 else 0
    reports = {}
    for (optimizer, budget), drawn in counts.items():
        group = group_name(optimizer, budget)
        trial_eps = trial_epsilons[group]
        if math.isinf(trial_eps) or not parse_config(
            pipeline.base_train_config(optimizer, budget, trial_eps)
        ).is_private:
            continue
        ran = trials[trials["group"] == group]
        facts = ["noise_multiplier", "sample_rate", "steps"]
        ran = ran.dropna(subset=facts) if set(facts) <= set(ran.columns) else ran.iloc[0:0]
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
            candidates=group_candidates(pipeline, optimizer, trial_eps) if needs_candidates else (),
            drawn_trials=drawn,
        )
        report["trial_epsilon"] = trial_eps
        if pipeline.total_epsilon is not None:
            report["total_epsilon"] = pipeline.total_epsilon
        if pipeline.research_mode:
            report["dp_guarantee"] = f"none: {RESEARCH_MODE_WARNING}"
            report["quote"] = f"NO DP GUARANTEE ({RESEARCH_MODE_WARNING}). {report['quote']}"
        reports[group] = report
    return reports


# --- fronts ---------------------------------------------------------------------------------


def evaluate_front_on_test(front: pd.DataFrame, data: DataSplits, tracker: Tracker) -> pd.DataFrame:
    """Test metrics of the front members (selected on validation, never on test), logged
    with their models on their runs."""
    test_rows = []
    for row in front.itertuples():
        with local_copy(row.checkpoint) as checkpoint:  # downloaded if stored remotely
            config, model, posterior = load_checkpoint(checkpoint / MODEL_FILE)
        result = evaluate(
            model,
            data.test,
            posterior=posterior,
            bma_samples=config.evaluation.bma_samples,
            n_bins=config.evaluation.ece_bins,
            seed=config.runtime.seed,
        )
        test = {f"test_{k}": v for k, v in result.metrics.items()}
        tracker.log_metrics(row.run_id, test, step=config.training.epochs)
        tracker.set_tags(row.run_id, {"dpivon.pareto_optimal": "true"})
        log_model(tracker, row.run_id, config, model, posterior)
        test_rows.append({"trial_id": row.trial_id, **test})
    return front.merge(pd.DataFrame(test_rows), on="trial_id", how="left") if test_rows else front


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


def parent_description(
    front: pd.DataFrame,
    objectives: list[tuple[str, str]],
    privacy: dict[str, dict[str, Any]],
    research_mode: bool = False,
) -> str:
    """The parent run's Markdown description: the fronts and the epsilons to quote, within
    MLflow's tag length (front rows that do not fit are left to the front's CSV). In
    research mode it opens by saying that no DP guarantee holds."""
    columns = [
        "optimizer",
        "epsilon",
        "trial_id",
        *(metric for metric, _ in objectives),
        *(c for c in TEST_COLUMNS if c in front),
    ]
    warning = [f"**No DP guarantee**: {RESEARCH_MODE_WARNING}.", ""] if research_mode else []
    header = [
        *warning,
        "### Pareto fronts (validation; test scores of the members)",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    rows = [
        "| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row) + " |"
        for row in front[columns].itertuples(index=False)
    ]
    quoted = [
        "",
        "### Privacy of the tuning",
        "",
        "| group | trials | per-trial eps | composition eps | quoted eps | covers |",
        "|---|---|---|---|---|---|",
        *(
            f"| {group} | {r['num_trials']} (drawn {r['drawn_trials']}) | "
            f"{r['trial_epsilon']:.3g} | {r['composition_epsilon']:.3g} | "
            f"{r['quoted_epsilon']:.3g} | {r['release']} release; {r['records_covered']} |"
            for group, r in privacy.items()
        ),
        "",
        *(f"- **{group}**: {r['quote']}" for group, r in privacy.items()),
    ]

    def text(shown: int) -> str:
        more = [] if shown == len(rows) else ["", f"_{len(rows) - shown} more in {FRONT_FILE}_"]
        return "\n".join([*header, *rows[:shown], *more, *quoted])

    shown = len(rows)
    while shown > 0 and len(text(shown)) > NOTE_LIMIT:
        shown -= 1
    return text(shown)[:NOTE_LIMIT]


# --- the report -----------------------------------------------------------------------------


def report_sweep(
    pipeline: Pipeline,
    tracker: Tracker,
    parent_run_id: str,
    trial_epsilons: dict[str, float],
    counts: dict[tuple[str, float], int],
    data: DataSplits,
    storage: SweepStorage,
) -> pd.DataFrame:
    """Build and log everything the sweep concludes, its files both in the sweep's folder
    and on the parent run; returns the trials table."""
    trials = trials_table(tracker, parent_run_id)
    if trials.empty:
        raise DpivonError("the sweep recorded no trial; see the Ray logs above")
    objectives = pipeline.objective_pairs
    front = pareto_front(trials, objectives, by=("optimizer", "epsilon"))
    front = evaluate_front_on_test(front, data, tracker)
    trials = trials.assign(on_front=trials["trial_id"].isin(front["trial_id"]))

    privacy = tuning_privacy(trials, pipeline, trial_epsilons, counts)
    metrics = front_hypervolumes(front, objectives)
    outcomes = trials["status"].value_counts()
    for status in TrialStatus:
        if status is not TrialStatus.RUNNING:
            metrics[f"trials_{status}"] = float(outcomes.get(status, 0))
    for group, report in privacy.items():
        for key, value in report.items():
            numeric = isinstance(value, float | int) and not isinstance(value, bool)
            if numeric and np.isfinite(value):
                metrics[f"tuning.{group}.{key}"] = float(value)
    tracker.log_metrics(parent_run_id, metrics)
    description = parent_description(front, objectives, privacy, pipeline.research_mode)
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
    print_front_table(front, objectives, TEST_COLUMNS)
    return trials
