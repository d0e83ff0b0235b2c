"""What a finished training run logs on its MLflow run: final metrics, privacy facts, its
summary and config, the reliability diagram and the served model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpivon.plots import plot_reliability_diagram
from dpivon.tracking.client import Tracker
from dpivon.tracking.served_model import log_model

if TYPE_CHECKING:
    from dpivon.runs import TrainResult

# What the run's epsilon was accounted over (train_images: the accountant's dataset size).
RUN_PARAMS = ("noise_multiplier", "sample_rate", "steps", "target_epsilon", "train_images")


def log_training_result(
    tracker: Tracker, run_id: str, result: TrainResult, *, with_model: bool = True
) -> None:
    """Final metrics, privacy facts, the reliability diagram and the model of a TrainResult."""
    summary = result.summary()
    tracker.log_params(run_id, {k: summary[k] for k in RUN_PARAMS})
    # Per-epoch values are already logged; the rest of the summary's numbers are params.
    final = {
        k: v
        for k, v in summary.items()
        if k.startswith("test_") or k in ("wall_time_s", "tuning_epsilon", "epsilon_with_tuning")
    }
    tracker.log_metrics(run_id, final, step=result.config.training.epochs)
    tracker.log_dict(run_id, summary, "summary.json")
    tracker.log_text(run_id, result.config.to_yaml(), "config.yaml")
    if result.test_reliability is not None:
        figure = plot_reliability_diagram(
            result.test_reliability, title=f"{result.config.optimizer.name}: test reliability"
        )
        tracker.log_figure(run_id, figure, "reliability_diagram.png")
    if with_model:
        log_model(tracker, run_id, result.config, result.model, result.posterior)
