"""`dpivon sweep`: Ray Tune + Optuna over (epsilon x optimizer) groups, tracked in MLflow.

Every group keeps its own Optuna study (TPE learns per optimizer and budget), its own trial
count and, with ASHA, its own scheduler, but all groups run in ONE Tune experiment: a
searcher that multiplexes the studies (each suggested config carries its group) under the
sweep-wide ``concurrency`` limit, so the cluster stays busy across groups. Each trial
recalibrates sigma_p for its own batch size and epochs. The driver alone writes MLflow: one
parent run per sweep, one child run per trial (dpivon.search.callbacks). When every trial
has run, dpivon.search.sweep_report builds the fronts and the report from the MLflow record.

Sweep state lives in ``<storage_path>/<name>/`` (a local folder, or ``s3://`` / ``gs://``
/ ``file://`` through dpivon.orchestration.storage): ``sweep.json`` (parent run, per-trial
epsilons, each group's drawn trial count), the Tune experiment ``trials/`` (trial
checkpoints, searcher state), ``tuning_private.json``, the final tables and plots. The
state file, the Tune experiment and ``tuning_private.json`` are private, like the data.
SIGINT or SIGTERM stop the sweep cleanly (trials keep their checkpoints, the parent run
ends KILLED, exit 128 + signal); ``--resume`` finishes what was interrupted. Once every
trial has ended, their resume states (in secure mode the noise keys, as sensitive as the
data) are deleted; the final checkpoints hold only models.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import optuna
import pandas as pd
from ray import tune
from rich.console import Console

from dpivon.config import parse_config
from dpivon.data import DataSplits
from dpivon.errors import DpivonError
from dpivon.logs import logger_level
from dpivon.orchestration.folder_lock import FolderLock
from dpivon.orchestration.provenance import provenance
from dpivon.orchestration.ray_cluster import check_fits_here, connect
from dpivon.orchestration.state_file import RunState
from dpivon.orchestration.storage import ResultsStorage
from dpivon.privacy.noise import noise_tags
from dpivon.privacy.tuning import solve_trial_epsilon_within
from dpivon.process import environment_variable
from dpivon.runs import RunCheckpoint, load_data
from dpivon.search.callbacks import TRACKING_URI_ENV, tracking_wait_s
from dpivon.search.groups import SweepGroup, group_trainable, group_tuner, sweep_groups
from dpivon.search.pipeline import Pipeline
from dpivon.search.results import (
    GROUP_TAG,
    STATUS_TAG,
    SWEEP_DIR_TAG,
    group_name,
    outcome_recorded,
    recorded_outcomes,
)
from dpivon.search.stopping import StopOnSignals, StopWhenSaved, SweepInterrupted
from dpivon.search.sweep_report import report_sweep
from dpivon.search.trial import RESUME_FILE
from dpivon.tracking.client import Tracker
from dpivon.tracking.layout import ERROR_TAG, KIND_TAG, RunKind, RunOutcome

TUNE_EXPERIMENT = "trials"  # the one Tune experiment of all groups, in the sweep folder
console = Console(stderr=True)


@dataclass
class SweepState(RunState):
    """What a resumed driver needs: the parent run and the epsilon each group's trials spend."""

    file_name: ClassVar[str] = "sweep.json"
    kind: ClassVar[str] = "sweep"

    objectives: list[tuple[str, str]]
    # group -> the epsilon each of its trials spends (differs from the group's budget only
    # with total_epsilon); fixed when the sweep starts so that a resume keeps it
    trial_epsilons: dict[str, float] = field(default_factory=dict)
    # group -> its number of trials K, drawn from OS entropy when the sweep starts: private
    # (the random-trials bound holds only while K is unknown), never logged or reported
    trial_counts: dict[str, int] = field(default_factory=dict)
    # release: best: the export pick that selects the released model (None: any pick)
    release_pick: str | None = None
    # optimizer -> how many parameters its space searches (empty: an older sweep's state)
    space_dimensions: dict[str, int] = field(default_factory=dict)
    # noise_faithful's k: private trials ran at the target batch / k (None: at the target's)
    batch_divisor: int | None = None

    def __post_init__(self) -> None:
        # a TypeError here is the loader's one line naming the damaged file
        if not self.objectives or not all(len(pair) == 2 for pair in self.objectives):
            raise TypeError(f"objectives are (metric, direction) pairs, not {self.objectives!r}")
        self.objectives = [tuple(pair) for pair in self.objectives]  # JSON holds lists


def _run_trials(
    pipeline: Pipeline,
    groups: list[SweepGroup],
    data: DataSplits,
    state: SweepState,
    storage: ResultsStorage,
    tracker: Tracker,
    concurrency: int,
    stop: StopOnSignals,
) -> None:
    """Run (or finish) every group's trials in the sweep's one Tune experiment, at most
    ``concurrency`` at once. On a resume the trials MLflow records as ended are not run
    again, whatever Tune's saved state (a moment behind MLflow) says of them."""
    if not pipeline.hides_trial_count:  # else the trial counts are private
        for group in groups:
            if group.trials == 0:
                console.print(f"[bold]{group.name}[/]: K = 0 trials drawn; the group runs none")
    groups = [g for g in groups if g.trials > 0]
    if not groups:
        return
    path, filesystem = storage.experiment_path(TUNE_EXPERIMENT), storage.filesystem
    restoring = tune.Tuner.can_restore(path, storage_filesystem=filesystem)  # a resume
    recorded = recorded_outcomes(tracker, state.parent_run_id) if restoring else {}
    trainable = group_trainable(
        groups, data, pipeline.resources, recorded, pipeline.validation_shift_severity
    )
    if restoring:
        console.print("restoring the interrupted trials")
        tuner = tune.Tuner.restore(
            path,
            trainable,
            resume_unfinished=True,
            resume_errored=False,
            storage_filesystem=filesystem,
        )
    else:
        run_config = tune.RunConfig(
            name=TUNE_EXPERIMENT,
            storage_path=storage.path,
            storage_filesystem=filesystem,
            failure_config=tune.FailureConfig(max_failures=pipeline.max_failures),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
            callbacks=[StopWhenSaved()],
            verbose=0,
        )
        tuner = group_tuner(
            pipeline,
            groups,
            trainable,
            run_config,
            storage,
            concurrency=concurrency,
            tracking_uri=tracker.tracking_uri,
            experiment=state.experiment,
            parent_run_id=state.parent_run_id,
        )
    how_many = (
        f"trials drawn from {pipeline.trial_count} (mean {pipeline.trials})"
        if pipeline.hides_trial_count
        else f"{sum(g.trials for g in groups)} trials"
    )
    console.print(f"{len(groups)} groups, {how_many}, {concurrency} at a time")
    with stop.tuning():
        tuner.fit()


# Read by Tune when it runs; a value the user set stands.
TUNE_SETTINGS = {
    "RAY_AIR_NEW_OUTPUT": "0",  # with verbose=0: no Tune tables at all
    "TUNE_GLOBAL_CHECKPOINT_S": "1",  # the experiment's state saved within a second: resumable
}


@contextmanager
def _tune_settings() -> Iterator[None]:
    """What the sweep's Tune run needs of the process, for its time only: TUNE_SETTINGS,
    and Tune's and Optuna's chatter off (SweepProgress reports a failed trial in one line and
    MLflow records it; Tune's tracebacks and state messages would bury it)."""
    with ExitStack() as settings:
        settings.callback(optuna.logging.set_verbosity, optuna.logging.get_verbosity())
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        for name, value in TUNE_SETTINGS.items():
            if name not in os.environ:
                settings.enter_context(environment_variable(name, value))
        settings.enter_context(logger_level("ray.tune", logging.CRITICAL))
        yield


def _every_trial_recorded(tracker: Tracker, parent_run_id: str, groups: list[SweepGroup]) -> bool:
    """Whether MLflow records an outcome for every trial of every group (a trial's outcome
    is its last write): a finished sweep, whose resume restores nothing of Tune's."""
    runs = tracker.child_runs(parent_run_id)
    ended = Counter(run.data.tags.get(GROUP_TAG) for run in runs if outcome_recorded(run))
    return sum(ended.values()) == len(runs) and all(ended[g.name] >= g.trials for g in groups)


def _close_lost_trials(tracker: Tracker, parent_run_id: str) -> None:
    """Once every trial Tune knows has ended, a child run still open belongs to a trial
    started just before a lost driver and missing from Tune's saved state: it ends FAILED,
    one of its group's trials (GroupSearcher counted it)."""
    for run in tracker.child_runs(parent_run_id):
        if run.info.status in ("RUNNING", "KILLED"):
            error = "lost with the driver before Tune saved it; counted among the trials"
            tracker.set_tags(run.info.run_id, {STATUS_TAG: RunOutcome.FAILED, ERROR_TAG: error})
            tracker.end_run(run.info.run_id, "FAILED")


def _kill_open_trials(tracker: Tracker, parent_run_id: str) -> None:
    """The child runs an interruption left RUNNING end KILLED (a resume reopens them)."""
    for run in tracker.child_runs(parent_run_id):
        if run.info.status == "RUNNING":
            tracker.end_run(run.info.run_id, "KILLED")


# --- Ray ------------------------------------------------------------------------------------


# --- the sweep ------------------------------------------------------------------------------


def _record_new_sweep(
    pipeline: Pipeline,
    storage: ResultsStorage,
    tracker: Tracker,
    parent: str,
    trial_epsilons: dict[str, float],
    counts: dict[tuple[str, float], int],
) -> SweepState:
    """The new parent run's settings and files, and the state file that names it."""
    tracker.log_params(
        parent,
        {
            "pipeline": pipeline.name,
            "epsilons": pipeline.epsilon_list,
            "delta": pipeline.delta,
            "optimizers": list(pipeline.spaces),
            "trials": pipeline.trials,
            "trial_count": pipeline.trial_count,
            "sampler": pipeline.sampler,
            "seed": pipeline.seed,
            "scheduler": pipeline.scheduler.type,
            "release": pipeline.release,
            "total_epsilon": pipeline.total_epsilon,
            "validation_noise": pipeline.validation_noise,
            "epochs": pipeline.epochs,
            "model": pipeline.model.name,
            **provenance(),
        },
    )
    tracker.log_text(parent, pipeline.source_text, "pipeline.yaml")
    for name, space in pipeline.spaces.items():
        tracker.log_dict(parent, space.to_dict(), f"search_spaces/{name}.json")
    state = SweepState(
        pipeline.name,
        str(pipeline.path),
        tracker.display_uri,  # no password in the state file: a resume is given the URI again
        tracker.experiment_name,
        parent,
        list(pipeline.objective_pairs),
        trial_epsilons=trial_epsilons,
        trial_counts={group_name(o, e): k for (o, e), k in counts.items()},
        release_pick=pipeline.release_pick,
        space_dimensions={name: space.dimension for name, space in pipeline.spaces.items()},
        batch_divisor=pipeline.noise_faithful.batch_divisor if pipeline.noise_faithful else None,
    )
    state.save(storage)
    return state


def _trial_counts(pipeline: Pipeline, previous: SweepState | None) -> dict[tuple[str, float], int]:
    """Each group's trial count: drawn now for a new sweep, the drawn one for a resume."""
    if previous is None or not previous.trial_counts:  # new, or from before counts were kept
        return pipeline.trial_counts()
    return {(o, e): previous.trial_counts[group_name(o, e)] for o, e in pipeline.groups}


def _trial_epsilons(pipeline: Pipeline, counts: dict[tuple[str, float], int]) -> dict[str, float]:
    """Each group's per-trial epsilon: its budget, with ``noise_faithful`` what its trials'
    fixed noise spends, or with ``total_epsilon`` the largest one whose quoted tuning epsilon
    (worst case over the space) is at most the total."""
    if pipeline.total_epsilon is None:
        return {group_name(o, e): pipeline.base_train_config(o, e)["epsilon"] for o, e in counts}
    total = pipeline.total_epsilon
    solved = {}
    for optimizer, budget in pipeline.groups:
        if math.isinf(budget):  # non-private: spends nothing
            solved[group_name(optimizer, budget)] = budget
            continue
        trials = counts[(optimizer, budget)]
        console.print(f"solving the per-trial epsilon of {optimizer} for total {total:g}...")
        eps = solve_trial_epsilon_within(
            total,
            lambda e, o=optimizer: pipeline.candidate_mechanisms(o, e),
            pipeline.delta,
            pipeline.conditions,
            trials,
        )
        how_many = "each trial" if pipeline.hides_trial_count else f"each of {trials} trials"
        console.print(f"  {optimizer}: {how_many} spends epsilon {eps:.3f}")
        solved[group_name(optimizer, budget)] = eps
    return solved


def _check_resume_files(storage: ResultsStorage, groups: list[SweepGroup]) -> None:
    """Every trial checkpoint a resume would continue from reads back as a checkpoint of one
    of this sweep's groups (its settings, whatever the searched values and seed); a trial
    checks its own configuration when it resumes (and adopts it, for a file of layout 1,
    which names none)."""
    for name in storage.files_named(TUNE_EXPERIMENT, RESUME_FILE):
        where = storage.location(name)
        config = RunCheckpoint.read(storage.read_bytes(name), where).config
        if config and not any(_of_group(group, config) for group in groups):
            raise DpivonError(
                f"checkpoint {where} is of another run configuration than this sweep's "
                "trials; delete it (its trial then starts from its first epoch) or resume "
                "the sweep it belongs to"
            )


def _of_group(group: SweepGroup, config: dict[str, Any]) -> bool:
    free = {*group.space.names, "seed"}  # what differs between the trials of a group
    settings = parse_config(group.base_config, source="sweep group").flat()
    return all(config.get(k) == v for k, v in settings.items() if k not in free)


def run_sweep(
    pipeline: Pipeline,
    *,
    address: str | None = None,
    tracking_uri: str | None = None,
    resume: bool = False,
) -> pd.DataFrame:
    """Run (or resume) the whole sweep; returns the table of trials. Resuming a finished
    sweep runs no trial and changes none of its results. Raises
    :class:`SweepInterrupted` after SIGINT / SIGTERM, once the sweep is stopped cleanly."""
    storage = pipeline.storage
    check_fits_here(pipeline.resources, address, "trial")
    storage.check_writable()
    # one driver per folder, new or resumed: a second one is refused before MLflow and Ray
    with FolderLock(storage, f"sweep {pipeline.name!r}"):
        return _run_holding_folder(pipeline, storage, address, tracking_uri, resume)


def _run_holding_folder(
    pipeline: Pipeline,
    storage: ResultsStorage,
    address: str | None,
    tracking_uri: str | None,
    resume: bool,
) -> pd.DataFrame:
    """:func:`run_sweep` once its folder is this driver's."""
    tracking_wait_s()  # a bad $DPIVON_TRACKING_WAIT_S fails now, not when the trials end
    exists = SweepState.exists(storage)
    if exists and not resume:
        raise DpivonError(
            f"sweep {pipeline.name!r} already exists in {storage.uri}; pass --resume to "
            "continue it, or change the pipeline's name (or delete that folder) to start over"
        )
    previous = SweepState.load(storage) if exists else None
    if resume and previous is None:
        console.print(f"[yellow]note:[/] nothing to resume in {storage.uri}; starting the sweep")
    if not resume and (note := pipeline.random_phase_note()) is not None:
        console.print(f"[yellow]{note}[/]", highlight=False)
    if not resume:
        for line in pipeline.frozen_curvature_warnings():
            console.print(f"[bold yellow]warning:[/] {line}", highlight=False)
    counts = _trial_counts(pipeline, previous)
    trial_epsilons = previous.trial_epsilons if previous else _trial_epsilons(pipeline, counts)
    groups = sweep_groups(pipeline, trial_epsilons, counts)
    if previous is not None:  # before the store or Ray: a damaged trial checkpoint is named
        _check_resume_files(storage, groups)
    data = load_data(parse_config(groups[0].base_config))  # a missing path: before Ray, MLflow
    tracker = Tracker(tracking_uri or pipeline.tracking_uri, pipeline.experiment)
    finished = previous is not None and _every_trial_recorded(
        tracker, previous.parent_run_id, groups
    )
    # Everything that can reject the sweep runs before its parent run is opened; a finished
    # sweep needs no cluster.
    slots = 0 if finished else connect(address, pipeline.resources, "trial")
    # Without a limit Tune starts one trial at a time; the cluster's slots are the limit.
    concurrency = (pipeline.concurrency or slots) if slots else 0
    tags = {
        KIND_TAG: RunKind.SWEEP,
        SWEEP_DIR_TAG: storage.uri,
        **noise_tags(pipeline.research_mode),
    }
    # Restored Tune callbacks hold the redacted URI; they read the real one from the
    # environment, for the sweep's time only.
    real_uri = environment_variable(TRACKING_URI_ENV, tracker.tracking_uri)
    with StopOnSignals() as stop, real_uri:
        resumed = previous.parent_run_id if previous else None
        with tracker.run(pipeline.name, run_id=resumed, tags=tags) as parent:
            state = previous or _record_new_sweep(
                pipeline, storage, tracker, parent, trial_epsilons, counts
            )
            console.print(
                f"sweep {pipeline.name!r}{' (resumed)' if previous else ''}: MLflow "
                f"{tracker.display_uri}, experiment {state.experiment!r}, parent run "
                f"{parent}; results in {storage.uri}"
            )
            try:
                if finished:
                    console.print(
                        "every trial has run: none runs again; the report is "
                        "made again from the MLflow record"
                    )
                else:
                    with _tune_settings():
                        _run_trials(
                            pipeline, groups, data, state, storage, tracker, concurrency, stop
                        )
                if stop.received is not None:
                    raise SweepInterrupted(stop.received)
                _close_lost_trials(tracker, parent)
                # Every trial has ended and none resumes: their resume states (in secure
                # mode the noise keys) must not outlive them in the sweep's folder.
                storage.remove_files_named(TUNE_EXPERIMENT, RESUME_FILE)
            except SweepInterrupted:
                _kill_open_trials(tracker, parent)
                raise
            return report_sweep(pipeline, tracker, parent, trial_epsilons, counts, data, storage)
