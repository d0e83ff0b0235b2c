"""Driver-side Ray Tune callbacks: MLflow child runs and live progress.

Both run in the driver process only, so the MLflow store sees a single writer (SQLite
does not tolerate concurrent ones). They are pickled with the Tune experiment for
`--resume`, hence the lazily created MLflow client.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ray import tune
from rich.console import Console

from dpivon.search.space import SearchSpace
from dpivon.search.trial import COMPLETE, trial_train_config
from dpivon.tracking import REDACTED, Tracker, redact_uri

# The driver's real tracking URI (with any password), for callbacks restored from storage.
TRACKING_URI_ENV = "DPIVON_TRACKING_URI"
TRIAL_TAG = "dpivon.trial_id"
STATUS_TAG = "dpivon.trial_status"
CHECKPOINT_TAG = "dpivon.checkpoint"
# Tune bookkeeping that is not worth a metric in MLflow.
_SKIPPED = {
    "done",
    "training_iteration",
    "timestamp",
    "time_this_iter_s",
    "time_total_s",
    "time_since_restore",
    "iterations_since_restore",
    "pid",
    "date",
    "hostname",
    "node_ip",
    "trial_id",
    "experiment_tag",
    "checkpoint_dir_name",
    "config",
    "should_checkpoint",
    "epoch",
}


class MlflowTrialLogger(tune.Callback):
    """One child run per trial under the sweep's parent run; reused across resumes."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        parent_run_id: str,
        base_config: dict[str, Any],
        space: SearchSpace,
        tags: dict[str, str],
    ):
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.parent_run_id = parent_run_id
        self.base_config = base_config
        self.space = space
        self.tags = tags
        self._tracker: Tracker | None = None
        self.run_ids: dict[str, str] = {}  # Tune trial id -> MLflow run id

    def __getstate__(self) -> dict:
        # Tune writes this to the sweep's storage: no password in it.
        uri = redact_uri(self.tracking_uri)
        return {**self.__dict__, "tracking_uri": uri, "_tracker": None, "run_ids": {}}

    @property
    def tracker(self) -> Tracker:
        if self._tracker is None:
            uri = self.tracking_uri
            if f":{REDACTED}@" in uri:
                uri = os.environ.get(TRACKING_URI_ENV, uri)
            self._tracker = Tracker(uri, self.experiment)
            # After a resume the trial -> run mapping comes from MLflow itself, so a trial
            # that runs again reuses its run instead of getting a duplicate.
            self.run_ids = child_runs_by_trial(self._tracker, self.parent_run_id)
        return self._tracker

    def run_id(self, trial) -> str:
        tracker = self.tracker
        run_id = self.run_ids.get(trial.trial_id)
        if run_id is None:
            config = trial_train_config(self.base_config, self.space, trial.config, trial.trial_id)
            run_id = tracker.start_run(
                f"{config.optimizer}-eps{config.epsilon:g}-{trial.trial_id}",
                parent_run_id=self.parent_run_id,
                tags={**self.tags, TRIAL_TAG: trial.trial_id, STATUS_TAG: "running"},
            )
            tracker.log_params(run_id, config.model_dump(mode="json"))
            self.run_ids[trial.trial_id] = run_id
        return run_id

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        run_id = self.run_id(trial)
        self.tracker.client.update_run(run_id, status="RUNNING")  # a resumed trial runs again

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        metrics = {
            k: v
            for k, v in result.items()
            if k not in _SKIPPED and isinstance(v, int | float) and not isinstance(v, bool)
        }
        self.tracker.log_metrics(self.run_id(trial), metrics, step=int(result.get("epoch", 0)))
        if "node_id" in result:
            self.tracker.set_tags(self.run_id(trial), {"ray.node_id": result["node_id"]})

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        complete = bool((trial.last_result or {}).get(COMPLETE))
        run_id = self.run_id(trial)
        tags = {STATUS_TAG: "completed" if complete else "early_stopped"}
        if trial.checkpoint is not None:
            tags[CHECKPOINT_TAG] = trial.checkpoint.path
        self.tracker.set_tags(run_id, tags)
        self.tracker.end_run(run_id, "FINISHED")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        run_id = self.run_id(trial)
        self.tracker.set_tags(run_id, {STATUS_TAG: "failed", "error": trial_error(trial)})
        self.tracker.end_run(run_id, "FAILED")


def trial_error(trial) -> str:
    """The last line of the trial's error file: the exception, without Ray's traceback."""
    error_file = getattr(trial, "error_file", None)
    try:
        lines = [line for line in Path(error_file).read_text().splitlines() if line.strip()]
        return lines[-1][:2000] if lines else str(error_file)
    except (OSError, TypeError):
        return "failed (see the Ray trial logs)"


def child_runs_by_trial(tracker: Tracker, parent_run_id: str) -> dict[str, str]:
    runs = tracker.client.search_runs(
        [tracker.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
        max_results=10000,
    )
    return {r.data.tags[TRIAL_TAG]: r.info.run_id for r in runs if TRIAL_TAG in r.data.tags}


class SweepProgress(tune.Callback):
    """One line per finished trial and a running tally, instead of Tune's wide tables."""

    def __init__(self, group: str, total: int, objective: str, mode: str):
        self.group, self.total = group, total
        self.objective, self.mode = objective, mode
        self.done = self.failed = self.stopped = 0
        self.best = -math.inf if mode == "max" else math.inf

    def __getstate__(self) -> dict:
        return dict(self.__dict__)

    def _line(self, trial, what: str, trials) -> None:
        running = sum(1 for t in trials if t.status == "RUNNING")
        value = (trial.last_result or {}).get(self.objective)
        shown = f"{self.objective}={value:.4f}" if isinstance(value, float) else ""
        best = f"best {self.objective}={self.best:.4f}" if math.isfinite(self.best) else ""
        Console(stderr=True).print(
            f"[bold]{self.group}[/] trial {trial.trial_id} {what} {shown} | "
            f"{self.done}/{self.total} done, {running} running, {self.failed} failed, "
            f"{self.stopped} stopped early | {best}",
            highlight=False,
        )

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        result = trial.last_result or {}
        if result.get(COMPLETE):
            self.done += 1
            value = result.get(self.objective)
            if isinstance(value, float) and math.isfinite(value):
                self.best = max(self.best, value) if self.mode == "max" else min(self.best, value)
            self._line(trial, "completed", trials)
        else:
            self.stopped += 1
            self.done += 1
            self._line(trial, "stopped early (ASHA)", trials)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self.failed += 1
        self.done += 1
        self._line(trial, f"[red]failed[/] ({trial_error(trial)})", trials)
