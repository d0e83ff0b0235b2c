"""One Ray Tune trial: the same `train` as `dpivon train`, reporting each epoch to Tune.

Runs inside Ray workers and never touches MLflow (the driver is the only writer). Each
epoch's report carries a checkpoint to resume from; the last one carries the trained model
(mean + posterior) that the driver evaluates on the test set if the trial is on the front.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import ray
import torch
from ray import tune

from dpivon.config import parse_config
from dpivon.data import DataSplits
from dpivon.search.space import SearchSpace
from dpivon.tracking import save_checkpoint
from dpivon.training import EpochReport, train

RESUME_FILE = "resume.pt"
MODEL_FILE = "model.pt"
COMPLETE = "training_complete"


def _privacy_facts(summary: dict[str, Any]) -> dict[str, Any]:
    keys = ("noise_multiplier", "sample_rate", "steps", "epsilon_spent", "target_epsilon")
    return {k: summary.get(k) for k in keys}


def run_trial(
    params: dict[str, Any],
    *,
    data: DataSplits,
    base_config: dict[str, Any],
    space: SearchSpace,
    threads: int,
) -> None:
    """Ray Tune function trainable: ``params`` is what OptunaSearch drew."""
    torch.set_num_threads(max(1, threads))
    config = parse_config({**base_config, **space.trial_config(params)}, source="trial config")
    node = {"node_id": ray.get_runtime_context().get_node_id()}
    resume_state = None
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            resume_state = torch.load(Path(directory) / RESUME_FILE, weights_only=False)

    def report_epoch(report: EpochReport) -> None:
        if report.epoch == config.epochs:
            return  # the final report below carries the model instead
        with tempfile.TemporaryDirectory() as directory:
            torch.save(report.checkpoint(), Path(directory) / RESUME_FILE)
            tune.report(
                {**report.metrics, COMPLETE: 0, **node},
                checkpoint=tune.Checkpoint.from_directory(directory),
            )

    result = train(
        config, data=data, on_epoch_end=report_epoch, resume_state=resume_state, evaluate_test=False
    )
    final_metrics = {
        **result.history[-1],
        **_privacy_facts(result.summary()),
        COMPLETE: 1,
        "wall_time_s": result.wall_time_s,
        **node,
    }
    with tempfile.TemporaryDirectory() as directory:
        save_checkpoint(Path(directory) / MODEL_FILE, config, result.model, result.posterior)
        tune.report(final_metrics, checkpoint=tune.Checkpoint.from_directory(directory))
