"""Driver-side Ray Tune callbacks: MLflow child runs and live progress.

Both run in the driver process only, so the MLflow store sees a single writer (SQLite
does not tolerate concurrent ones), and a store that is down for a while holds nothing
up: the logger keeps the trials' results and writes them when it answers. They are
pickled with the Tune experiment for `--resume`, hence the lazily created MLflow client.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from mlflow.exceptions import MlflowException
from ray import tune
from ray.tune.experiment import Trial
from ray.tune.result import SHOULD_CHECKPOINT
from rich.console import Console

from dpivon.constraints import NonNegativeFloat, check_bound
from dpivon.errors import DpivonError, first_line
from dpivon.orchestration.storage import ResultsStorage
from dpivon.paths import REDACTED, redact_uri

# SweepProgress lived here and a saved Tune state names it here: importable for resumes
from dpivon.search.progress import SweepProgress, trial_error  # noqa: F401
from dpivon.search.results import CHECKPOINT_TAG, GROUP_TAG, STATUS_TAG, TRIAL_TAG, outcome_recorded
from dpivon.search.trial import (
    COMPLETE,
    DIVERGED,
    DIVERGED_ERROR,
    REPLAYED,
    TRIAL_CONFIG,
)
from dpivon.tracking.client import Tracker, check_tracking_server
from dpivon.tracking.layout import ERROR_TAG, RunOutcome

# The driver's real tracking URI (with any password), for callbacks restored from storage.
TRACKING_URI_ENV = "DPIVON_TRACKING_URI"
# How long the end of a group waits for an unreachable MLflow store, and the retry period.
WAIT_ENV = "DPIVON_TRACKING_WAIT_S"
DEFAULT_WAIT_S = 300.0
RETRY_S = 5.0


def tracking_wait_s() -> float:
    """``$DPIVON_TRACKING_WAIT_S`` in seconds (default 300), or one line naming it; read
    when a sweep starts too, so that a bad value fails then, not after the trials."""
    text = os.environ.get(WAIT_ENV, "").strip()
    if not text:
        return DEFAULT_WAIT_S
    try:
        seconds = float(text)
    except ValueError:
        raise DpivonError(f"{WAIT_ENV} must be a number of seconds, got {text!r}") from None
    check_bound(NonNegativeFloat, WAIT_ENV, seconds)
    return seconds


console = Console(stderr=True)
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
    SHOULD_CHECKPOINT,
    "epoch",
    DIVERGED_ERROR,
    TRIAL_CONFIG,
}


def real_tracking_uri(saved_uri: str) -> str:
    """The URI to reach MLflow from an object restored from the sweep's storage, which
    holds it without its password (:data:`TRACKING_URI_ENV` has the real one)."""
    if f":{REDACTED}@" in saved_uri:
        return os.environ.get(TRACKING_URI_ENV, saved_uri)
    return saved_uri


@dataclass(frozen=True)
class RecordedTrials:
    """Reads the sweep's trial ids in MLflow, by group, for a restored driver. Pickled with
    the Tune experiment: the URI is kept without its password."""

    tracking_uri: str
    experiment: str
    parent_run_id: str

    def __call__(self) -> dict[str, set[str]]:
        try:
            tracker = Tracker(real_tracking_uri(self.tracking_uri), self.experiment)
            runs = tracker.child_runs_by_tag(self.parent_run_id, TRIAL_TAG)
        except (DpivonError, MlflowException, OSError) as err:
            raise TrackingUnavailable(
                f"MLflow at {self.tracking_uri} did not answer when the resumed sweep "
                f"counted its trials ({first_line(err)}); once it answers, run "
                "`dpivon sweep PIPELINE --resume` again"
            ) from err
        by_group: dict[str, set[str]] = {}
        for trial, run in runs.items():
            by_group.setdefault(run.data.tags.get(GROUP_TAG, ""), set()).add(trial)
        return by_group


class TrackingUnavailable(DpivonError):
    """The MLflow store stayed unreachable past the wait; the unwritten trial results are
    kept in the Tune experiment's state, and ``dpivon sweep --resume`` writes them."""


class MlflowTrialLogger(tune.Callback):
    """One child run per trial under the sweep's parent run; reused across resumes.

    Every write is queued first and the queue is written in order, so an MLflow store that
    is down for a while loses nothing: the results wait here (and in Tune's saved callback
    state, see :meth:`get_state`) and go out when it answers again. At the end of the
    group the logger waits up to ``$DPIVON_TRACKING_WAIT_S`` seconds (default 300) for
    the store, then stops the sweep with :class:`TrackingUnavailable`.
    """

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        parent_run_id: str,
        run_name: str,
        tags: dict[str, str],
        storage: ResultsStorage,
    ):
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.parent_run_id = parent_run_id
        self.run_name = run_name  # its trials' runs are <run_name>-<trial id>
        self.tags = tags
        self.storage = storage  # where Tune keeps the checkpoints: tagged as its URIs
        self._tracker: Tracker | None = None
        self.run_ids: dict[str, str] = {}  # Tune trial id -> MLflow run id
        self.recorded: set[str] = set()  # trials whose outcome MLflow held at the resume
        self.started: set[str] = set()  # trials whose "start" this driver has queued
        self.configured: set[str] = set()  # trials whose config (params) it has queued
        self.pending: list[dict[str, Any]] = []  # writes not yet accepted by MLflow, in order
        self.unsaved: dict[str, list[dict[str, Any]]] = {}  # metrics awaiting their checkpoint
        self._retry_at = 0.0
        self._down_since: float | None = None

    def __getstate__(self) -> dict:
        # Tune writes this to the sweep's storage: no password in it. The queue travels in
        # get_state() instead (saved at every experiment checkpoint, not only at the start).
        uri = redact_uri(self.tracking_uri)
        return {
            **self.__dict__,
            "tracking_uri": uri,
            "_tracker": None,
            "run_ids": {},
            "recorded": set(),
            "started": set(),
            "configured": set(),
            "pending": [],
            "unsaved": {},
            "_retry_at": 0.0,
            "_down_since": None,
        }

    def get_state(self) -> dict:
        # Always a non-empty dict: Tune skips saving when every callback returns a falsy
        # state, which would leave an older, longer queue on disk to be replayed.
        return {"pending": list(self.pending)}

    def set_state(self, state: dict) -> None:
        self.pending = list(state.get("pending", []))

    def _real_uri(self) -> str:
        return real_tracking_uri(self.tracking_uri)

    @property
    def tracker(self) -> Tracker:
        if self._tracker is None:
            self._tracker = Tracker(self._real_uri(), self.experiment)
            # After a resume the trial -> run mapping comes from MLflow itself, so a trial
            # that runs again reuses its run instead of getting a duplicate.
            runs = self._tracker.child_runs_by_tag(self.parent_run_id, TRIAL_TAG)
            self.run_ids = {trial: run.info.run_id for trial, run in runs.items()}
            # A trial that had ended only repeats its outcome (RecordedOutcome): its run
            # is final and none of its events is written again.
            self.recorded = {trial for trial, run in runs.items() if outcome_recorded(run)}
        return self._tracker

    # --- the queue ----------------------------------------------------------------------

    def _queue(self, trial, op: str, **payload: Any) -> None:
        self.pending.append({"trial": trial.trial_id, "op": op, **payload})
        self._flush()

    def _apply(self, write: dict[str, Any]) -> None:
        tracker, trial_id = self.tracker, write["trial"]
        if trial_id in self.recorded:
            return
        if write["op"] == "start":
            run_id = self.run_ids.get(trial_id)
            if run_id is None:
                run_id = tracker.start_run(
                    write["name"], parent_run_id=self.parent_run_id, tags=write["tags"]
                )
                self.run_ids[trial_id] = run_id
            else:
                tracker.set_run_status(run_id, "RUNNING")  # a resumed trial
            return
        run_id = self.run_ids[trial_id]  # its "start" write went out before this one
        if write["op"] == "params":
            tracker.log_params(run_id, write["params"])
        elif write["op"] == "metrics":
            tracker.log_metrics(run_id, write["metrics"], step=write["step"])
        elif write["op"] == "tags":
            tracker.set_tags(run_id, write["tags"])
        elif write["op"] == "end":
            tracker.set_tags(run_id, write["tags"])
            tracker.end_run(run_id, write["status"])

    def _write_pending(self) -> None:
        # A cheap /health probe first: against a server that is down, MLflow's own
        # retries would block the Tune loop for minutes on every write.
        check_tracking_server(self._real_uri(), timeout_s=2.0)
        while self.pending:
            self._apply(self.pending[0])
            self.pending.pop(0)

    def _flush(self, wait_s: float = 0.0) -> None:
        """Write the queue; on a store that is down retry every few seconds, for at most
        ``wait_s`` now (0: one attempt, the next event or Tune step tries again)."""
        deadline = time.monotonic() + wait_s
        while self.pending:
            now = time.monotonic()
            if now >= self._retry_at:
                try:
                    self._write_pending()
                except (DpivonError, MlflowException, OSError) as err:
                    if isinstance(err, MlflowException) and not _transient(err):
                        raise
                    self._retry_at = now + RETRY_S
                    if self._down_since is None:
                        self._down_since = now
                        console.print(
                            "[yellow]MLflow is unreachable: trial results are kept and "
                            f"written when it answers (retrying every {RETRY_S:g} s)[/]: "
                            f"{first_line(err)}",
                            highlight=False,
                        )
                    continue
                if self._down_since is not None:
                    console.print(
                        f"MLflow answers again after {now - self._down_since:.0f} s; "
                        "the kept trial results are written",
                        highlight=False,
                    )
                    self._down_since = None
                return
            if now >= deadline:
                return
            time.sleep(min(self._retry_at, deadline) - now)

    # --- Tune's events ------------------------------------------------------------------

    def on_trial_start(
        self, iteration: int, trials: list[Trial], trial: Trial, **info: Any
    ) -> None:
        self.started.add(trial.trial_id)
        self._queue(
            trial,
            "start",
            name=f"{self.run_name}-{trial.trial_id}",
            tags={**self.tags, TRIAL_TAG: trial.trial_id, STATUS_TAG: RunOutcome.RUNNING},
        )

    def on_trial_result(
        self, iteration: int, trials: list[Trial], trial: Trial, result: dict, **info: Any
    ) -> None:
        if result.get(REPLAYED):
            return  # logged with its checkpoint before the trial was restored from it
        if trial.trial_id not in self.configured and TRIAL_CONFIG in result:
            # the config the trial trains with, as its worker built it
            self.configured.add(trial.trial_id)
            self._queue(trial, "params", params=json.loads(result[TRIAL_CONFIG]))
        metrics = {
            k: v
            for k, v in result.items()
            if k not in _SKIPPED and isinstance(v, int | float) and not isinstance(v, bool)
        }
        step = int(result.get("epoch", 0))
        if result.get(SHOULD_CHECKPOINT):
            # Tune registers the checkpoint one step later, and a trial whose node dies
            # before that retries this epoch from the previous checkpoint: its metrics go
            # out with the checkpoint (on_checkpoint), so each epoch is logged once.
            self.unsaved.setdefault(trial.trial_id, []).append({"metrics": metrics, "step": step})
        else:
            self._queue(trial, "metrics", metrics=metrics, step=step)
        if "node_id" in result:
            self._queue(trial, "tags", tags={"ray.node_id": result["node_id"]})

    def _log_saved(self, trial) -> None:
        # queued only (the next step writes them): an error raised here would keep Tune
        # from registering the checkpoint
        for write in self.unsaved.pop(trial.trial_id, []):
            self.pending.append({"trial": trial.trial_id, "op": "metrics", **write})

    def on_checkpoint(
        self,
        iteration: int,
        trials: list[Trial],
        trial: Trial,
        checkpoint: tune.Checkpoint,
        **info: Any,
    ) -> None:
        self._log_saved(trial)

    def on_trial_recover(
        self, iteration: int, trials: list[Trial], trial: Trial, **info: Any
    ) -> None:
        # it retries from its last registered checkpoint: the epochs after it run again
        self.unsaved.pop(trial.trial_id, None)

    def on_trial_complete(
        self, iteration: int, trials: list[Trial], trial: Trial, **info: Any
    ) -> None:
        self._log_saved(trial)  # nothing runs it again: what it reported is its record
        result = trial.last_result or {}
        if result.get(DIVERGED):
            tags = {STATUS_TAG: RunOutcome.DIVERGED, ERROR_TAG: str(result.get(DIVERGED_ERROR))}
            self._queue(trial, "end", tags=tags, status="FAILED")
            return
        done = RunOutcome.COMPLETED if result.get(COMPLETE) else RunOutcome.EARLY_STOPPED
        tags = {STATUS_TAG: done}
        if trial.checkpoint is not None:
            tags[CHECKPOINT_TAG] = self.storage.uri_of(trial.checkpoint.path)
        self._queue(trial, "end", tags=tags, status="FINISHED")

    def on_trial_error(
        self, iteration: int, trials: list[Trial], trial: Trial, **info: Any
    ) -> None:
        if trial.trial_id not in self.started:
            # Its actor died before it started (out of memory, a lost node): Tune reports
            # the error without a start, so the run is opened here, to be closed FAILED.
            self.on_trial_start(iteration, trials, trial)
        self._log_saved(trial)
        tags = {STATUS_TAG: RunOutcome.FAILED, ERROR_TAG: trial_error(trial)}
        self._queue(trial, "end", tags=tags, status="FAILED")

    def on_step_end(self, iteration: int, trials: list[Trial], **info: Any) -> None:
        self._flush()  # drains the queue once the store is back, between events too

    def on_experiment_end(self, trials: list[Trial], **info: Any) -> None:
        self._flush(wait_s=tracking_wait_s())
        if self.pending:
            raise TrackingUnavailable(
                f"MLflow at {redact_uri(self._real_uri())} stayed unreachable; "
                f"{len(self.pending)} trial results are kept in the sweep's Tune state: "
                "start the server, then run `dpivon sweep PIPELINE --resume` to write them"
            )


def _transient(err: MlflowException) -> bool:
    """A store that is down or overloaded (connection refused, 5xx), not a bad request."""
    return err.get_http_status_code() >= 500
