"""The models a sweep releases: which front rows they are (``release: best`` or all the
front), and their test scores and logged models (chosen on validation, never on test)."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
from rich.console import Console

from dpivon.data import DataSplits
from dpivon.evaluation import evaluate_as_configured
from dpivon.orchestration.storage import ResultsStorage, local_copy
from dpivon.search.pareto import pick
from dpivon.search.pipeline import Pipeline
from dpivon.search.results import BUDGET_TAG
from dpivon.search.trial import MODEL_FILE
from dpivon.tracking.client import Tracker
from dpivon.tracking.layout import END_TO_END_EPSILON_TAG, EPSILON_TAG
from dpivon.tracking.model_file import load_model_file
from dpivon.tracking.served_model import log_model

console = Console(stderr=True)


def released_models(front: pd.DataFrame, pipeline: Pipeline) -> pd.DataFrame:
    """The front rows whose models the sweep releases: every member, or with ``release:
    best`` exactly one per group, the best by the pipeline's metric."""
    if pipeline.release_pick is None or front.empty:
        return front
    return pick(front, pipeline.objective_pairs, pipeline.release_pick, by=("optimizer", "epsilon"))


def record_front_on_test(
    front: pd.DataFrame, data: DataSplits, tracker: Tracker, storage: ResultsStorage
) -> None:
    """Test metrics and model of each front member (selected on validation, never on test),
    logged on its run unless its run records them already: finishing again (a resumed
    finished sweep) evaluates and logs nothing twice."""
    for number, row in enumerate(front.itertuples(), start=1):
        scored = pd.notna(getattr(row, "test_accuracy", math.nan))  # one batch of metrics
        modelled = tracker.has_logged_model(row.run_id)
        if not (scored and modelled):
            # a test pass and a model upload each: for a whole front, minutes to account for
            work = [
                what for what, done in (("test scores", scored), ("model", modelled)) if not done
            ]
            console.print(
                f"released model {number}/{len(front)} ({row.group}, trial {row.trial_id}): "
                f"logging its {' and '.join(work)}",
                highlight=False,
            )
            # downloaded if stored remotely
            with local_copy(storage.location(row.checkpoint)) as checkpoint:
                config, model, posterior = load_model_file(checkpoint / MODEL_FILE)
            if not scored:
                result = evaluate_as_configured(config, model, data.test, posterior)
                test = {f"test_{k}": v for k, v in result.metrics.items()}
                tracker.log_metrics(row.run_id, test, step=config.training.epochs)
            if not modelled:
                log_model(tracker, row.run_id, config, model, posterior)
        tracker.set_tags(row.run_id, {"dpivon.pareto_optimal": "true"})  # a tag is replaced


def tag_released_epsilons(
    released: pd.DataFrame, privacy: dict[str, dict[str, Any]], tracker: Tracker
) -> None:
    """Each released model's two epsilons on its run, as every run kind tags them: what its
    training spent (a noise-faithful trial spends far more than the budget its group stands
    for, which BUDGET_TAG keeps) and what its release costs end to end, its group's quoted
    tuning epsilon (the trials composed, this one among them). Tagged again on every
    finish, so a store written before these tags gets them on a resumed finished sweep."""
    for row in released.itertuples():
        spent = repr(float(row.trial_epsilon))
        report = privacy.get(row.group)  # none for a non-private group: nothing to compose
        tags = {
            BUDGET_TAG: repr(float(row.epsilon)),
            EPSILON_TAG: spent,
            END_TO_END_EPSILON_TAG: spent if report is None else f"{report['quoted_epsilon']:.6g}",
        }
        tracker.set_tags(row.run_id, tags)
