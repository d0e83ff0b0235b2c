"""The groups of a sweep, every one with its own study, in ONE Tune experiment.

A group is one (optimizer, epsilon) pair: its own search space, trial count, Optuna study
and, with ASHA, its own scheduler. Tune runs one experiment for all of them, so trials of
every group share the cluster (the sweep-wide ``concurrency``) instead of one group at a
time:

- :class:`GroupSearcher` multiplexes the groups' studies: each suggestion comes from one
  group and carries it in the trial's config (``GROUP_KEY``); results go back to it only.
- :class:`GroupScheduler` keeps one scheduler per group: ASHA never compares trials of
  different optimizers or epsilons.
- :class:`GroupCallbacks` hands each group's callbacks (its MLflow logger, its progress
  line) the events of its own trials, seen with their search parameters only.
- :func:`run_group_trial` is the trainable: one trial of the group its config names (on a
  resume, a trial MLflow records as ended repeats its outcome instead).
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optuna
from ray import tune
from ray.tune.callback import CallbackList
from ray.tune.experiment import Trial
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, TrialScheduler
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch

from dpivon.config import parse_config
from dpivon.data import DataSplits
from dpivon.orchestration.run_file import Resources
from dpivon.orchestration.storage import ResultsStorage
from dpivon.paths import redact_uri
from dpivon.privacy.noise import noise_tags
from dpivon.process import enter_ray_worker
from dpivon.search.callbacks import MlflowTrialLogger, RecordedTrials
from dpivon.search.pipeline import OPTUNA_SAMPLERS, Pipeline
from dpivon.search.progress import SweepProgress
from dpivon.search.results import BUDGET_TAG, GROUP_TAG, group_name
from dpivon.search.space import SearchSpace
from dpivon.search.trial import COMPLETE, DIVERGED, GROUP_KEY, RecordedOutcome, run_trial
from dpivon.tracking.layout import EPSILON_TAG, OPTIMIZER_TAG

if TYPE_CHECKING:
    from ray.tune.execution.tune_controller import TuneController


@dataclass(frozen=True)
class SweepGroup:
    """One (optimizer, epsilon) group: its own trials, settings, search space and study."""

    name: str
    optimizer: str
    epsilon: float  # the group's budget (names it)
    trials: int  # drawn for this group: private (K), never logged
    base_config: dict[str, Any]  # what each trial starts from (with the epsilon it spends)
    space: SearchSpace

    @property
    def run_name(self) -> str:
        """What its trials' MLflow runs are called, before the trial id."""
        return f"{self.optimizer}-eps{self.base_config['epsilon']:g}"

    @property
    def tags(self) -> dict[str, str]:
        """Its trials' tags: the group's budget and the epsilon each trial spends are two
        fields (they differ under ``total_epsilon`` and ``noise_faithful``); fronts,
        hypervolumes, ``pareto`` and ``export --epsilon`` go by the budget, while a trial's
        EPSILON_TAG, like every run's, says what its training spends."""
        config = parse_config(self.base_config, source="sweep group")
        return {
            GROUP_TAG: self.name,
            OPTIMIZER_TAG: self.optimizer,
            BUDGET_TAG: repr(float(self.epsilon)),
            EPSILON_TAG: repr(float(self.base_config["epsilon"])),
            **noise_tags(config.privacy.research_mode, config.is_private),
        }


def sweep_groups(
    pipeline: Pipeline, trial_epsilons: dict[str, float], counts: dict[tuple[str, float], int]
) -> list[SweepGroup]:
    """The pipeline's groups, epsilon by epsilon in the listed orders."""
    groups = []
    for optimizer, epsilon in pipeline.groups:
        name = group_name(optimizer, epsilon)
        base = pipeline.base_train_config(optimizer, epsilon, trial_epsilons[name])
        trials = counts[(optimizer, epsilon)]
        space = pipeline.spaces[optimizer]
        groups.append(SweepGroup(name, optimizer, epsilon, trials, base, space))
    return groups


def search_params(config: dict[str, Any]) -> dict[str, Any]:
    """A trial's config without its group key: what its group's search space drew."""
    return {k: v for k, v in config.items() if k != GROUP_KEY}


def run_group_trial(
    config: dict[str, Any],
    *,
    data: DataSplits,
    groups: dict[str, tuple[dict[str, Any], SearchSpace]],
    threads: int,
    recorded: dict[str, RecordedOutcome],
    shift_severity: int | None = None,
) -> None:
    """The sweep's trainable: one trial of the group its config names, or on a resume
    the outcome MLflow already records for it (``recorded``, by trial id); ``threads``: its
    CPU share."""
    enter_ray_worker(threads)
    outcome = recorded.get(tune.get_context().get_trial_id())
    if outcome is not None:
        outcome.report_again()
        return
    base_config, space = groups[config[GROUP_KEY]]
    run_trial(
        search_params(config),
        data=data,
        base_config=base_config,
        space=space,
        shift_severity=shift_severity,
    )


class CompletionAwareOptunaSearch(OptunaSearch):
    """Tells Optuna that an ASHA-stopped trial was PRUNED, not COMPLETE with its last
    (partially trained) values, so early-stopped trials never steer the search as
    finished points of the front."""

    def on_trial_complete(
        self, trial_id: str, result: dict | None = None, error: bool = False
    ) -> None:
        if result is not None and not result.get(COMPLETE):
            error = error or bool(result.get(DIVERGED))  # FAILED to Optuna, not PRUNED
            result = None
        super().on_trial_complete(trial_id, result=result, error=error)


class GroupSearcher(Searcher):
    """Every group's own study behind one Tune searcher.

    Each suggestion comes from the group with the fewest trials in flight (then the fewest
    suggested) that has trials left, and carries that group in its config; results go back
    to that group's study only. Saved and restored whole with the Tune experiment.

    Tune saves this state a moment behind MLflow, so a driver lost just after a trial
    started can leave that trial with a run in MLflow (and perhaps released metrics) but
    no place here. After a restore, such trials count among their group's before the next
    suggestion (``recorded_trials`` reads MLflow): a sweep never trains more trials than
    its privacy cost covers. The read is not part of the restore itself, where any error
    would make Tune start the experiment again from scratch; in ``suggest`` an unreachable
    MLflow stops the sweep, and ``--resume`` picks it up again.
    """

    def __init__(
        self,
        studies: dict[str, Searcher],
        trials: dict[str, int],
        recorded_trials: Callable[[], dict[str, set[str]]],
    ):
        super().__init__()
        self.studies, self.trials = studies, trials  # not `searcher`: Tune unwraps that name
        self.recorded_trials = recorded_trials
        self.suggested = dict.fromkeys(studies, 0)
        self.in_flight = dict.fromkeys(studies, 0)
        self.group_of: dict[str, str] = {}  # Tune trial id -> group
        self.counted_recorded = True  # False after a restore, until MLflow's trials count

    def set_search_properties(
        self, metric: str | None, mode: str | None, config: dict, **spec: Any
    ) -> bool:
        return True  # each study has its own metrics, modes and space

    def suggest(self, trial_id: str) -> dict | str | None:
        if not getattr(self, "counted_recorded", True):  # absent: saved by an older dpivon
            self._count_recorded_trials()
        open_groups = [g for g in self.studies if self.suggested[g] < self.trials[g]]
        if not open_groups:
            return Searcher.FINISHED
        group = min(open_groups, key=lambda g: (self.in_flight[g], self.suggested[g]))
        config = self.studies[group].suggest(trial_id)
        if config is None or config == Searcher.FINISHED:
            return None
        self.group_of[trial_id] = group
        self.suggested[group] += 1
        self.in_flight[group] += 1
        return {**config, GROUP_KEY: group}

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        self.studies[self.group_of[trial_id]].on_trial_result(trial_id, result)

    def on_trial_complete(
        self, trial_id: str, result: dict | None = None, error: bool = False
    ) -> None:
        group = self.group_of[trial_id]
        self.in_flight[group] -= 1
        self.studies[group].on_trial_complete(trial_id, result=result, error=error)

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))
        self.counted_recorded = False

    def _count_recorded_trials(self) -> None:
        """Count the trials MLflow has and this state lacks among their group's."""
        recorded = getattr(self, "recorded_trials", None)  # None: saved by an older dpivon
        for group, trial_ids in (recorded() if recorded else {}).items():
            for trial_id in trial_ids - self.group_of.keys():
                if group in self.suggested:  # counted once: a later restore knows it
                    self.group_of[trial_id] = group
                    self.suggested[group] += 1
        self.counted_recorded = True


class GroupScheduler(FIFOScheduler):
    """One scheduler per group: ASHA compares a trial only with trials of its own optimizer
    and epsilon, never across groups. Trials start in submission order."""

    def __init__(self, schedulers: dict[str, TrialScheduler]):
        super().__init__()
        self.schedulers = schedulers

    def set_search_properties(self, metric: str | None, mode: str | None, **spec: Any) -> bool:
        return True  # each group's scheduler has its own metric and mode

    def _of(self, trial) -> TrialScheduler:
        return self.schedulers[trial.config[GROUP_KEY]]

    def on_trial_add(self, tune_controller: TuneController, trial: Trial) -> None:
        self._of(trial).on_trial_add(tune_controller, trial)

    def on_trial_error(self, tune_controller: TuneController, trial: Trial) -> None:
        self._of(trial).on_trial_error(tune_controller, trial)

    def on_trial_result(self, tune_controller: TuneController, trial: Trial, result: dict) -> str:
        return self._of(trial).on_trial_result(tune_controller, trial, result)

    def on_trial_complete(
        self, tune_controller: TuneController, trial: Trial, result: dict
    ) -> None:
        self._of(trial).on_trial_complete(tune_controller, trial, result)

    def on_trial_remove(self, tune_controller: TuneController, trial: Trial) -> None:
        self._of(trial).on_trial_remove(tune_controller, trial)

    def debug_string(self) -> str:
        return "\n".join(f"{g}: {s.debug_string()}" for g, s in self.schedulers.items())


class _GroupTrial:
    """A trial as its group's callbacks see it: its config without the group key."""

    def __init__(self, trial):
        self._trial, self.config = trial, search_params(trial.config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trial, name)


class GroupCallbacks(tune.Callback):
    """Each group's callbacks (its MLflow logger, its progress line) get its trials' events
    only; experiment-wide events go to all of them."""

    IS_CALLBACK_CONTAINER = True  # Tune then checks that every hook below is forwarded

    def __init__(self, callbacks: dict[str, list[tune.Callback]]):
        self.groups = {group: CallbackList(cbs) for group, cbs in callbacks.items()}

    def _all(self, hook: str, info: dict[str, Any]) -> None:
        for callbacks in self.groups.values():
            getattr(callbacks, hook)(**info)

    def _one(self, hook: str, info: dict[str, Any]) -> None:
        trial = info["trial"]
        callbacks = self.groups[trial.config[GROUP_KEY]]
        getattr(callbacks, hook)(**{**info, "trial": _GroupTrial(trial)})

    def setup(self, **info: Any) -> None:
        self._all("setup", info)

    def on_step_begin(self, **info: Any) -> None:
        self._all("on_step_begin", info)

    def on_step_end(self, **info: Any) -> None:
        self._all("on_step_end", info)

    def on_experiment_end(self, **info: Any) -> None:
        self._all("on_experiment_end", info)

    def on_trial_start(self, **info: Any) -> None:
        self._one("on_trial_start", info)

    def on_trial_restore(self, **info: Any) -> None:
        self._one("on_trial_restore", info)

    def on_trial_save(self, **info: Any) -> None:
        self._one("on_trial_save", info)

    def on_trial_result(self, **info: Any) -> None:
        self._one("on_trial_result", info)

    def on_trial_complete(self, **info: Any) -> None:
        self._one("on_trial_complete", info)

    def on_trial_recover(self, **info: Any) -> None:
        self._one("on_trial_recover", info)

    def on_trial_error(self, **info: Any) -> None:
        self._one("on_trial_error", info)

    def on_checkpoint(self, **info: Any) -> None:
        self._one("on_checkpoint", info)

    def get_state(self) -> dict:
        return {group: callbacks.get_state() for group, callbacks in self.groups.items()}

    def set_state(self, state: dict) -> None:
        for group, group_state in state.items():
            if group_state:
                self.groups[group].set_state(group_state)


def _sampler(name: str, seed: int | None, startup: int) -> optuna.samplers.BaseSampler:
    """Optuna's sampler ``name`` with ``startup`` random trials (TPE); seed None: seeded
    from the OS entropy source."""
    options = {"n_startup_trials": startup} if name == "tpe" else {}
    return getattr(optuna.samplers, OPTUNA_SAMPLERS[name])(seed=seed, **options)


def group_search(pipeline: Pipeline, group: SweepGroup) -> CompletionAwareOptunaSearch:
    """One group's Optuna study behind Ray's searcher: both objectives, the sampler with the
    pipeline's random start, and the space's start points tried first."""
    (first_metric, first_mode), (second_metric, second_mode) = pipeline.objective_pairs
    return CompletionAwareOptunaSearch(
        space=group.space.define_by_run,
        metric=[first_metric, second_metric],
        mode=[first_mode, second_mode],
        # the random-trials bound assumes draws the adversary cannot replay
        sampler=_sampler(
            pipeline.sampler,
            None if pipeline.hides_trial_count else pipeline.seed,
            pipeline.startup_trials,
        ),
        points_to_evaluate=[dict(p) for p in group.space.start_points] or None,
    )


def group_trainable(
    groups: list[SweepGroup],
    data: DataSplits,
    resources: Resources,
    recorded: dict[str, RecordedOutcome],
    shift_severity: int | None = None,
) -> Callable[..., None]:
    """The sweep's Tune trainable: :func:`run_group_trial` with the data, each group's
    settings, the outcomes already recorded and the severity of ``val_shift_*``
    objectives in Ray's object store, and one trial's resource request."""
    return tune.with_resources(
        tune.with_parameters(
            run_group_trial,
            data=data,
            groups={g.name: (g.base_config, g.space) for g in groups},
            threads=max(1, int(resources.cpu)),
            recorded=recorded,
            shift_severity=shift_severity,
        ),
        {"cpu": resources.cpu, "gpu": resources.gpu},
    )


def group_tuner(
    pipeline: Pipeline,
    groups: list[SweepGroup],
    trainable: Callable[..., None],
    run_config: tune.RunConfig,
    storage: ResultsStorage,
    *,
    concurrency: int,
    tracking_uri: str,
    experiment: str,
    parent_run_id: str,
) -> tune.Tuner:
    """A new Tune experiment of every group's trials: their studies behind one
    :class:`GroupSearcher`, at most ``concurrency`` trials in flight sweep-wide,
    one ASHA per group, each group's MLflow logger (checkpoints tagged as locations on
    ``storage``) and progress line."""
    (first_metric, first_mode), _ = pipeline.objective_pairs
    secret_draws = pipeline.hides_trial_count
    studies = {g.name: group_search(pipeline, g) for g in groups}
    scheduler = None
    if pipeline.scheduler.type == "asha":
        scheduler = GroupScheduler(
            {
                g.name: ASHAScheduler(
                    metric=first_metric,
                    mode=first_mode,
                    time_attr="training_iteration",
                    max_t=pipeline.trial_epochs,
                    grace_period=pipeline.scheduler.grace_period,
                    reduction_factor=pipeline.scheduler.reduction_factor,
                )
                for g in groups
            }
        )
    callbacks = GroupCallbacks(
        {
            g.name: [
                MlflowTrialLogger(
                    tracking_uri, experiment, parent_run_id, g.run_name, g.tags, storage
                ),
                SweepProgress(
                    g.name,
                    None if secret_draws else g.trials,
                    None if secret_draws else sum(h.trials for h in groups),
                    first_metric,
                    first_mode,
                ),
            ]
            for g in groups
        }
    )
    return tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(
            search_alg=GroupSearcher(
                studies,
                {g.name: g.trials for g in groups},
                RecordedTrials(redact_uri(tracking_uri), experiment, parent_run_id),
            ),
            scheduler=scheduler,
            num_samples=sum(g.trials for g in groups),
            max_concurrent_trials=concurrency,  # sweep-wide: a ConcurrencyLimiter
            # A finished trial's worker runs the next one: a new worker process would import
            # torch and dpivon again while its slot stays reserved and idle.
            reuse_actors=True,
        ),
        run_config=dataclasses.replace(
            run_config, callbacks=[*(run_config.callbacks or []), callbacks]
        ),
    )
