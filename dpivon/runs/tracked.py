"""The MLflow run of one training run, opened and closed in one place: `dpivon train` and
`dpivon audit` record through it (sweep trials and benchmark runs are recorded by their
drivers, which open one child run per trial or run on a parent)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from dpivon.config import TrainConfig
from dpivon.runs.checkpoint import RunCheckpoint
from dpivon.runs.release import released_metrics
from dpivon.tracking.client import Tracker


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
    with tracker.run(name, tags=tags, run_id=resumed) as run_id:
        if resumed is None:
            tracker.log_params(run_id, {**config.flat(), **(params or {})})
            tracker.log_text(run_id, config.to_yaml(), "config.yaml")
            for epoch in resume.training["history"] if resume is not None else []:
                metrics = released_metrics(config, epoch, train_loss=train_loss)
                tracker.log_metrics(run_id, metrics, step=int(epoch["epoch"]))
        yield run_id
