"""What a sweep concludes, from its MLflow record: fronts, test scores, privacy, plots.

When every trial has run, :func:`report_sweep` builds the Pareto front of each group
(validation metrics, completed trials only; dpivon.search.pareto), evaluates the released
models on the test set and logs them (the front's members; with ``release: best`` only the
one best by the pipeline's metric) where their runs do not hold their test scores and model
yet, and, from the record read back, logs on the parent run: the hypervolume of each front,
the trial outcomes, the tuning-privacy report of each private group
(dpivon.privacy.tuning), the tables, the plots, and a Markdown description (the fronts and
the epsilons to quote). Finishing again (a resumed finished sweep) therefore writes the same
files and logs nothing twice. Where the random-trials bound is quoted, nothing on the parent
run reveals how many trials ran (no counts, no composition): those facts go to
``tuning_private.json`` in the sweep's folder only, private like its state file and
checkpoints. The same accounting, run before the sweep, solves the per-trial epsilon of a
``total_epsilon`` budget (:func:`solve_trial_epsilons`).
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
from dpivon.orchestration.storage import SweepStorage, local_copy
from dpivon.privacy.noise import RESEARCH_MODE_WARNING
from dpivon.privacy.tuning import (
    TrialMechanism,
    candidate_mechanisms,
    composition_facts,
    solve_trial_epsilon,
    tuning_privacy_report,
    worst_case_tuning_epsilon,
)
from dpivon.search.pareto import (
    default_reference,
    hypervolume_2d,
    pareto_front,
    pick,
    plot_fronts_html,
    plot_fronts_png,
    print_front_table,
)
from dpivon.search.pipeline import Pipeline
from dpivon.search.results import TrialStatus, group_name, trials_table
from dpivon.search.trial import MODEL_FILE
from dpivon.tracking.checkpoints import load_checkpoint
from dpivon.tracking.client import Tracker
from dpivon.tracking.served_model import log_model

TRIALS_FILE = "trials.csv"
FRONT_FILE = "pareto_front.csv"
TUNING_FILE = "tuning_privacy.json"
# The trial counts and compositions a hidden-K report leaves out: the sweep's folder only
PRIVATE_TUNING_FILE = "tuning_private.json"
PNG_FILE = "pareto.png"
HTML_FILE = "pareto.html"
TEST_COLUMNS = ("test_accuracy", "test_ece", "test_nll")
NOTE_LIMIT = 8000  # the longest tag value MLflow stores (the description is a tag)
console = Console(stderr=True)


# --- tuning privacy -------------------------------------------------------------------------


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
    conditions, total = pipeline.conditions, pipeline.total_epsilon
    solved = {}
    for optimizer, budget in pipeline.groups:
        if math.isinf(budget):  # non-private: spends nothing
            solved[group_name(optimizer, budget)] = budget
            continue
        trials = counts[(optimizer, budget)]
        console.print(f"solving the per-trial epsilon of {optimizer} for total {total:g}...")
        eps = solve_trial_epsilon(
            total,
            lambda e, o=optimizer, k=trials: worst_case_tuning_epsilon(
                group_candidates(pipeline, o, e), pipeline.delta, conditions, k
            ),
        )
        how_many = "each trial" if pipeline.hides_trial_count else f"each of {trials} trials"
        console.print(f"  {optimizer}: {how_many} spends epsilon {eps:.3f}")
        solved[group_name(optimizer, budget)] = eps
    return solved


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
    releases = pipeline.epochs if pipeline.validation_noise > 0 else 0
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
                r.noise_multiplier, r.sample_rate, int(r.steps), pipeline.validation_noise,
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
            candidates=group_candidates(pipeline, optimizer, trial_eps) if hidden else (),
            accountant=pipeline.accountant,
        )
        report["trial_epsilon"] = trial_eps
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


# --- fronts ---------------------------------------------------------------------------------


def released_models(front: pd.DataFrame, pipeline: Pipeline) -> pd.DataFrame:
    """The front rows whose models the sweep releases: every member, or with ``release:
    best`` exactly one per group, the best by the pipeline's metric."""
    if pipeline.release_pick is None or front.empty:
        return front
    return pick(front, pipeline.objective_pairs, pipeline.release_pick, by=("optimizer", "epsilon"))


def record_front_on_test(front: pd.DataFrame, data: DataSplits, tracker: Tracker) -> None:
    """Test metrics and model of each front member (selected on validation, never on test),
    logged on its run unless its run records them already: finishing again (a resumed
    finished sweep) evaluates and logs nothing twice."""
    for row in front.itertuples():
        scored = pd.notna(getattr(row, "test_accuracy", math.nan))  # one batch of metrics
        modelled = tracker.has_logged_model(row.run_id)
        if not (scored and modelled):
            with local_copy(row.checkpoint) as checkpoint:  # downloaded if stored remotely
                config, model, posterior = load_checkpoint(checkpoint / MODEL_FILE)
            if not scored:
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
            if not modelled:
                log_model(tracker, row.run_id, config, model, posterior)
        tracker.set_tags(row.run_id, {"dpivon.pareto_optimal": "true"})  # a tag is replaced


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


def _trials_cell(report: dict[str, Any]) -> str:
    if "num_trials" in report:
        return str(report["num_trials"])
    return f"{report['trial_count']}, mean {report['mean_trials']:g} (count private)"


def parent_description(
    front: pd.DataFrame,
    objectives: list[tuple[str, str]],
    privacy: dict[str, dict[str, Any]],
    research_mode: bool = False,
) -> str:
    """The parent run's Markdown description: the released front rows and the epsilons to
    quote, within MLflow's tag length (rows that do not fit are left to the front's CSV).
    A group whose trial count is private shows its distribution, not the count. In research
    mode it opens by saying that no DP guarantee holds."""
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
            f"| {group} | {_trials_cell(r)} | {r['trial_epsilon']:.3g} | "
            f"{format(r['composition_epsilon'], '.3g') if 'composition_epsilon' in r else '-'} "
            f"| {r['quoted_epsilon']:.3g} | {r['release']} release; {r['records_covered']} |"
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
    objectives, by = pipeline.objective_pairs, ("optimizer", "epsilon")
    record = trials_table(tracker, parent_run_id)
    if record.empty:
        raise DpivonError("the sweep recorded no trial; see the Ray logs above")
    front = pareto_front(record, objectives, by=by)
    record_front_on_test(released_models(front, pipeline), data, tracker)
    # Everything below is computed from the record alone, read back whole, so that a first
    # finish and any resumed one write the same tables and log the same values.
    trials = trials_table(tracker, parent_run_id)
    front = pareto_front(trials, objectives, by=by)
    released = released_models(front, pipeline)
    trials = trials.assign(on_front=trials["trial_id"].isin(front["trial_id"]))

    privacy, private = tuning_privacy(trials, pipeline, trial_epsilons, counts)
    metrics = front_hypervolumes(front, objectives)
    if not pipeline.hides_trial_count:  # the outcome counts add up to the trial count
        outcomes = trials["status"].value_counts()
        for status in TrialStatus:
            if status is not TrialStatus.RUNNING:
                metrics[f"trials_{status}"] = float(outcomes.get(status, 0))
    for group, report in privacy.items():
        for key, value in report.items():
            numeric = isinstance(value, float | int) and not isinstance(value, bool)
            if numeric and np.isfinite(value):
                metrics[f"tuning.{group}.{key}"] = float(value)
    tracker.log_changed_metrics(parent_run_id, metrics)
    description = parent_description(released, objectives, privacy, pipeline.research_mode)
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
