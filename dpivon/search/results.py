"""A sweep's record in MLflow, read back: its groups, its trials' outcomes, the trials table.

The driver writes one child run per trial under the sweep's parent run
(dpivon.search.callbacks), tagged with its group, trial id and outcome. That record survives
resumes, so the final report and the trials table are built from it, not from Tune's files.
"""

from __future__ import annotations

import pandas as pd
from mlflow.entities import Run

from dpivon.orchestration.storage import ResultsStorage
from dpivon.search.trial import DIVERGED_ERROR, RecordedOutcome
from dpivon.tracking.client import Tracker
from dpivon.tracking.layout import EPSILON_TAG, ERROR_TAG, OPTIMIZER_TAG, RunOutcome

TRIAL_TAG = "dpivon.trial_id"
STATUS_TAG = "dpivon.trial_status"
CHECKPOINT_TAG = "dpivon.checkpoint"
GROUP_TAG = "dpivon.group"
SWEEP_DIR_TAG = "dpivon.sweep_dir"  # on the parent: the sweep's folder when it started
BUDGET_TAG = "dpivon.budget"  # a trial's group budget; its EPSILON_TAG is what it spends
# What a trial spent, in stores written before EPSILON_TAG said so (it held the budget then)
TRIAL_EPSILON_TAG = "dpivon.trial_epsilon"
# The outcome's earlier name: a sweep's saved Tune state (its queued MLflow writes) may hold
# members pickled under it, which a resume reads back as RunOutcome members.
TrialStatus = RunOutcome


def group_name(optimizer: str, epsilon: float) -> str:
    """The key of one (optimizer, epsilon) group: its study, MLflow tag, report entries."""
    return f"eps{epsilon:g}-{optimizer}"


def trial_status(run: Run) -> RunOutcome:
    """A run's outcome for the report: untagged, still running once the sweep is over, or
    ended FAILED without a diagnosis (an errored trial, a lost driver) counts as failed."""
    try:
        status = RunOutcome(run.data.tags.get(STATUS_TAG, ""))
    except ValueError:
        return RunOutcome.FAILED
    if status is RunOutcome.RUNNING or (
        run.info.status == "FAILED" and status is not RunOutcome.DIVERGED
    ):
        return RunOutcome.FAILED
    return status


def outcome_recorded(run: Run) -> bool:
    """Whether the run holds its trial's outcome: it ended FINISHED or FAILED with the
    outcome tagged (the trial's last write), not merely closed by a stopped driver."""
    return (
        run.info.status in ("FINISHED", "FAILED")
        and run.data.tags.get(STATUS_TAG) != RunOutcome.RUNNING
    )


def recorded_outcomes(tracker: Tracker, parent_run_id: str) -> dict[str, RecordedOutcome]:
    """The outcomes MLflow holds, by trial id: what a resume repeats to Tune for trials
    that its saved state, written a moment behind MLflow, still has as unfinished."""
    outcomes = {}
    for run in tracker.child_runs(parent_run_id):
        tags = run.data.tags
        if TRIAL_TAG not in tags or not outcome_recorded(run):
            continue
        status = trial_status(run)
        result: dict[str, float | str] = dict(run.data.metrics)
        if status is RunOutcome.DIVERGED:
            result[DIVERGED_ERROR] = tags.get(ERROR_TAG, "")  # the progress line shows it
        outcomes[tags[TRIAL_TAG]] = RecordedOutcome(
            result=result, failed=status is RunOutcome.FAILED
        )
    return outcomes


def trials_table(tracker: Tracker, parent_run_id: str, storage: ResultsStorage) -> pd.DataFrame:
    """One row per trial: ids, group, outcome, checkpoint, ``param.*`` and last metrics.

    ``checkpoint`` names the trial's final checkpoint inside the sweep's folder
    (``storage.location`` opens it), so the tables hold wherever the folder is moved.

    ``epsilon`` is the group's budget (every front, hypervolume, plot and ``--epsilon``
    filter goes by it), ``trial_epsilon`` what the trial spent: the same number unless the
    sweep has a ``total_epsilon`` or ``noise_faithful``."""
    rows = []
    recorded_at = tracker.run_tags(parent_run_id).get(SWEEP_DIR_TAG)  # before any copy
    for run in tracker.child_runs(parent_run_id):
        tags, params = run.data.tags, run.data.params
        checkpoint = tags.get(CHECKPOINT_TAG)
        # a store written before BUDGET_TAG holds the budget in EPSILON_TAG
        budget = tags.get(BUDGET_TAG, tags.get(EPSILON_TAG, params.get("epsilon", "nan")))
        spent = tags.get(TRIAL_EPSILON_TAG, tags.get(EPSILON_TAG, params.get("epsilon", "nan")))
        rows.append(
            {
                "trial_id": tags.get(TRIAL_TAG),
                "run_id": run.info.run_id,
                "group": tags.get(GROUP_TAG),
                "optimizer": tags.get(OPTIMIZER_TAG, params.get("optimizer")),
                "epsilon": float(budget),
                "trial_epsilon": float(spent),
                "status": trial_status(run).value,
                "checkpoint": checkpoint and storage.name_of(checkpoint, recorded_at),
                **{f"param.{k}": v for k, v in params.items()},
                **run.data.metrics,
            }
        )
    return pd.DataFrame(rows)
