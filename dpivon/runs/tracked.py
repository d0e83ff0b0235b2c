"""A training run in MLflow: its run opened and closed in one place (`tracked_run`: `dpivon
train` and `dpivon audit`; sweep trials and benchmark runs are recorded by their drivers,
one child run per trial or run on a parent) and what a finished run logs
(`log_training_result`: train's and the benchmark's)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from dpivon.config import TrainConfig
from dpivon.evaluation.shift import SHIFT_FILE
from dpivon.plots import plot_reliability_diagram
from dpivon.privacy.noise import noise_tags
from dpivon.runs.checkpoint import RunCheckpoint
from dpivon.runs.release import released_metrics
from dpivon.runs.result import TrainResult
from dpivon.tracking.client import Tracker
from dpivon.tracking.layout import END_TO_END_EPSILON_TAG, EPSILON_TAG
from dpivon.tracking.served_model import log_model


@contextmanager
def tracked_run(
    tracker: Tracker,
    config: TrainConfig,
    name: str,
    *,
    tags: Mapping[str, str] = (),
    params: Mapping[str, Any] | None = None,
    resume: RunCheckpoint | None = None,
    train_loss: bool = False,
) -> Iterator[str]:
    """The run's id for the block, which ends it FINISHED, FAILED or KILLED (never RUNNING).

    A new run records ``config`` (params and config.yaml) and ``params``. With ``resume``
    the run it reports to continues, or, in a store without that run (moved, or a fresh
    one), a new run replays the checkpoint's epochs (``train_loss``: the raw training loss
    too, where the checkpoint holds it)."""
    reported_to = resume.mlflow_run_id if resume is not None else ""
    resumed = reported_to if reported_to and tracker.has_run(reported_to) else None
    tags = {**tags, **noise_tags(config.privacy.research_mode, config.is_private)}
    with tracker.run(name, tags=tags, run_id=resumed) as run_id:
        if resumed is None:
            tracker.log_params(run_id, {**config.flat(), **(params or {})})
            tracker.log_text(run_id, config.to_yaml(), "config.yaml")
            for epoch in resume.training["history"] if resume is not None else []:
                metrics = released_metrics(config, epoch, train_loss=train_loss)
                tracker.log_metrics(run_id, metrics, step=int(epoch["epoch"]))
        yield run_id


def end_to_end_epsilon(values: Mapping[str, Any]) -> float:
    """A run's end-to-end epsilon from its summary or logged metrics: its training composed
    with the tuning that chose its settings on the same records (``epsilon_with_tuning``)
    where a sweep chose them, else its training's own (settings fixed without those
    records); inf for a run that spent no budget (no noise)."""
    for key in ("epsilon_with_tuning", "epsilon_spent"):
        if key in values:  # None: a summary's inf (JSON has none)
            return math.inf if values[key] is None else float(values[key])
    return math.inf


def epsilon_tags(config: TrainConfig, values: Mapping[str, Any]) -> dict[str, str]:
    """The run's two epsilons as tags (`dpivon.tracking.layout`): the budget its training was
    calibrated to, which it spends at most, and the end-to-end epsilon of ``values`` (its
    summary or logged metrics)."""
    training = config.privacy.epsilon if config.is_private else math.inf
    return {
        EPSILON_TAG: f"{training:g}",
        END_TO_END_EPSILON_TAG: f"{end_to_end_epsilon(values):.6g}",
    }


# What the run's epsilon was accounted over (train_images: the accountant's dataset size).
RUN_PARAMS = ("noise_multiplier", "sample_rate", "steps", "target_epsilon", "train_images")


def log_training_result(
    tracker: Tracker, run_id: str, result: TrainResult, *, with_model: bool = True
) -> None:
    """Final metrics, privacy facts, the scores under shift (where it was scored), the
    reliability diagram and the model of a TrainResult."""
    summary = result.summary()
    tracker.log_params(run_id, {k: summary[k] for k in RUN_PARAMS})
    # Per-epoch values are already logged; the rest of the summary's numbers are params.
    final = {
        k: v
        for k, v in summary.items()
        if k.startswith("test_") or k in ("wall_time_s", "tuning_epsilon", "epsilon_with_tuning")
    }
    tracker.log_metrics(run_id, final, step=result.config.training.epochs)
    tracker.set_tags(run_id, epsilon_tags(result.config, summary))
    tracker.log_dict(run_id, summary, "summary.json")
    tracker.log_text(run_id, result.config.to_yaml(), "config.yaml")
    if result.shift_record is not None:
        tracker.log_dict(run_id, result.shift_record, SHIFT_FILE)
    if result.test_reliability is not None:
        figure = plot_reliability_diagram(
            result.test_reliability, title=f"{result.config.optimizer.name}: test reliability"
        )
        tracker.log_figure(run_id, figure, "reliability_diagram.png")
    if with_model:
        log_model(tracker, run_id, result.config, result.model, result.posterior)
