"""Pipelines: one YAML file describes a whole sweep (data, budgets, optimizers, search, Ray).

Format (every key but ``name``, ``epsilons`` (or ``total_epsilon``), ``optimizers`` and
``trials`` has the default
shown or described)::

    name: quickstart                 # sweep name, [a-z0-9_-]+; also the key to --resume it
    data:                            # default {dataset: cifar10}
      dataset: cifar10               # cifar10 | synthetic
      per_class: 100                 # subsample the training part (after the validation split)
      val_size: 1000                 # default: 5000 (cifar10), synthetic_size // 10 (synthetic)
      data_path: null                # null: $DPIVON_DATA, then the cache (see dpivon.data)
      # synthetic_size: 600          # synthetic only (default 2000)
    model: small-cnn                 # default tanh-cnn; one of dpivon.models.MODEL_NAMES
    epochs: 3                        # default 10
    epsilons: [8]                    # a number or a list, each > 0 (.inf = non-private)
    # total_epsilon: 8               # instead of epsilons: the budget of each group's tuned
    #                                # release; dpivon solves the per-trial epsilon
    release: front                   # what is published: best | front | all (threat model)
    validation_noise: 0.0            # > 0: Gaussian-noised val_accuracy / val_ece only
    delta: 1.0e-5                    # in (0, 1)
    accountant: rdp                  # rdp | prv
    optimizers:                      # each optimizer once, with its search-space file
      - {name: dp-ivon-gradsq, space: ../search_spaces/quickstart/dp-ivon-gradsq.yaml}
      - {name: dp-sgd, space: ../search_spaces/quickstart/dp-sgd.yaml}
    trials: 4                        # per optimizer and epsilon (the mean if drawn), 1-10000
    trial_count: fixed               # fixed | poisson | geometric: drawn from OS entropy,
                                     # kept private (see trial_counts)
    # best_by: val_accuracy          # release: best only: the one metric (an objective)
    #                                # that picks the released model; default the first
    concurrency: 2                   # in flight sweep-wide, 1-4096; null: all resources allow
    resources: {cpu: 1, gpu: 0}      # per trial; gpu may be fractional (0.25)
    scheduler: {type: asha, grace_period: 1, reduction_factor: 2}   # default {type: none}
    objectives:                      # exactly two, distinct
      - {metric: val_accuracy, mode: max}
      - {metric: val_ece, mode: min}
    sampler: tpe                     # tpe | nsga2 | random (TPE draws a third of the
                                     # trials at random, then models; a space's start:
                                     # points run first)
    seed: 0                          # data split, training and Optuna seed; in [0, 2**32)
                                     # (not the random sampler's where the random-trials
                                     # bound holds)
    research_mode: false             # true: noise reproducible from the seeds, no DP guarantee
    tracking_uri: null               # null: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    experiment: dpivon-quickstart    # MLflow experiment; default "dpivon-" + name
    storage_path: dpivon-runs        # a path (relative to the current directory) or a URI:
                                     # s3://bucket/prefix, gs://..., file://
                                     # (dpivon.orchestration.storage)
    max_failures: 1                  # per-trial retries from the last epoch checkpoint, 0-100
    # noise_faithful: {batch_divisor: 16, trial_epochs: 5}   # TAN: each private trial runs
    #                                # batch B / k for the target run's steps at its sigma / B
    #                                # (B: train's batch_size; trial_epochs, which divides
    #                                # epochs: the trials' epochs, each validated); its own
    #                                # epsilon is computed, and export gives back the target
    train: {bma_samples: 8}          # more fixed TrainConfig keys for every trial
    # an optimizer entry may add its own: {name: dp-sgd, space: ..., train: {mc_samples: 1}}
    #   (neither train: may set a key the optimizer's space sets: the space would win)
    # shift_severity: 3              # severity of the val_shift_* objectives, 1-5

A space path is looked up relative to the pipeline file's directory, then relative to the
current directory. ASHA (``asha``) stops trials on the FIRST objective, reported each epoch;
it needs ``epochs`` >= 2 and ``grace_period`` < ``epochs``. Objectives are metrics among
``val_accuracy`` (max), ``val_ece``, ``val_nll``, ``val_brier`` (min), and under dataset
shift ``val_shift_accuracy`` (max), ``val_shift_ece``, ``val_shift_nll`` (min): every epoch,
the means over `dpivon.evaluation.shift`'s default corruptions at ``shift_severity``
(default 3, 1-5) of the validation images (at most 50 per class).

A non-private optimizer spends no budget, so its trials form one group labelled
``eps=inf`` (epsilon inf in its configs and runs) whatever ``epsilons`` lists.

Loading validates everything it can without data or Ray (a key given twice in the file is
an error, not the last one winning; files above 1 MiB are refused unread): each problem is
one :class:`~dpivon.errors.DpivonError` line naming the file and the key. That includes
``delta < 1/N`` for the N training images, that the largest batch size of every space fits
the training set, that neither ``train`` nor a space sets a key the pipeline owns (the keys
:meth:`Pipeline.owned_settings` builds for every trial: data, model, epochs, optimizer,
epsilon, delta, accountant, validation noise, seed, research mode) and ``train`` repeats none
a space samples, that every epsilon is reachable (at least the accountant's floor with the
most noise, at most 1000), and that every trial the spaces can produce (bounds and choices)
is a valid TrainConfig with this pipeline's settings.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import (
    BeforeValidator,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from dpivon.config import (
    Epochs,
    TrainConfig,
    TrainingConfig,
    format_validation_error,
    parse_config,
)
from dpivon.constraints import Bound, FiniteEpsilon, Float, Int, Seed
from dpivon.errors import DpivonError
from dpivon.optim.registry import OptimizerName
from dpivon.orchestration.run_file import (
    Concurrency,
    Epsilons,
    RunFile,
    StrictModel,
    distinct,
    group_budget,
    train_extras,
)
from dpivon.privacy.accounting import noise_faithful_plan, sampling_schedule
from dpivon.privacy.tuning import (
    TRIAL_COUNTS,
    SweepConditions,
    TrialCount,
    TrialMechanism,
    candidate_mechanisms,
)
from dpivon.runs import check_plan_reachable, frozen_curvature_warning
from dpivon.search.space import SearchSpace, drop_union_tags, load_search_space

__all__ = [
    "METRIC_MODES",
    "Pipeline",
    "draw_trial_count",
    "load_pipeline",
]

# the direction in which each selectable metric improves
METRIC_MODES: dict[str, str] = {
    "val_accuracy": "max",
    "val_ece": "min",
    "val_nll": "min",
    "val_brier": "min",
    # under shift (`dpivon.evaluation.shift`): the default corruptions at `shift_severity` of the
    # validation images, scored every epoch (costlier than the clean validation)
    "val_shift_accuracy": "max",
    "val_shift_ece": "min",
    "val_shift_nll": "min",
}
# Optuna's sampler class of each ``sampler:`` choice (imported by the sweep, not here)
OPTUNA_SAMPLERS: dict[str, str] = {
    "tpe": "TPESampler",
    "nsga2": "NSGAIISampler",
    "random": "RandomSampler",
}
# NSGA-II's first generation is drawn at random (Optuna's default population)
NSGA2_POPULATION = 50
# Upper bounds of the counts, each with what it protects
MAX_TRIALS = 10_000
_TRIALS_WHY = "per group, each trial a whole training run; split a larger search into sweeps"
MAX_RETRIES = 100
_RETRIES_WHY = "retries of one trial; one that failed 100 times will fail again"


class OptimizerEntry(StrictModel):
    name: OptimizerName
    space: str = Field(min_length=1)
    # fixed keys for this optimizer only
    train: Annotated[dict[str, Any], BeforeValidator(train_extras)] = Field(default_factory=dict)


class AshaScheduler(StrictModel):
    type: Literal["asha"]
    grace_period: Annotated[Int, Bound(ge=1)] = 1
    # finite: .inf would keep no trial past the first rung
    reduction_factor: Float = Field(2.0, gt=1, allow_inf_nan=False)


class NoScheduler(StrictModel):
    type: Literal["none"]


def _scheduler_shorthand(value: Any) -> Any:
    return {"type": value} if isinstance(value, str) else value


Scheduler = Annotated[
    AshaScheduler | NoScheduler,
    Field(discriminator="type"),
    BeforeValidator(_scheduler_shorthand),
]


class NoiseFaithful(StrictModel):
    """Tune at a k-times smaller batch with the target run's steps and noise per averaged
    gradient (:func:`dpivon.privacy.accounting.noise_faithful_plan`)."""

    batch_divisor: Annotated[Int, Bound(ge=2, le=1024)]
    # the trials' epochs, each validated (None: the target's): the target's steps in fewer,
    # longer epochs, so that validation does not cost what the smaller batch saved
    trial_epochs: Epochs | None = None


class Objective(StrictModel):
    metric: Literal[tuple(METRIC_MODES)]
    mode: Literal["max", "min"]

    @model_validator(mode="after")
    def _direction(self) -> Objective:
        best = METRIC_MODES[self.metric]
        if self.mode != best:
            raise ValueError(f"{self.metric} improves by mode {best}, not {self.mode}")
        return self


class Pipeline(RunFile):
    """A validated sweep pipeline; build it with :func:`load_pipeline`."""

    kind: ClassVar[str] = "sweep"
    noun: ClassVar[str] = "pipeline"

    epsilons: Epsilons | None = None
    # The budget of each group's release instead of each trial's: dpivon solves the per-trial
    # epsilon so that the quoted tuning epsilon is at most this (omit `epsilons` then).
    total_epsilon: FiniteEpsilon | None = None
    release: Literal["best", "front", "all"] = "front"  # what of the sweep is published
    # release: best: the metric (one of the objectives) that selects the one released model
    best_by: str | None = None
    # the corruption severity of the val_shift_* objectives
    shift_severity: Annotated[Int, Bound(ge=1, le=5)] = 3
    validation_noise: Annotated[Float, Bound(ge=0)] = (
        0.0  # > 0: DP validation scores (val_noise_multiplier)
    )
    optimizers: Annotated[
        list[OptimizerEntry], Field(min_length=1), distinct("optimizers", lambda e: e.name)
    ]
    trials: Annotated[Int, Bound(ge=1, le=MAX_TRIALS, why=_TRIALS_WHY)]
    trial_count: TrialCount = "fixed"
    # trials in flight at once over the whole sweep (all groups); None: as many as fit
    concurrency: Concurrency | None = 1
    scheduler: Scheduler = NoScheduler(type="none")
    objectives: list[Objective] = Field(
        default_factory=lambda: [
            Objective(metric="val_accuracy", mode="max"),
            Objective(metric="val_ece", mode="min"),
        ]
    )
    sampler: Literal[tuple(OPTUNA_SAMPLERS)] = "tpe"
    seed: Seed = 0
    # private trials at batch B / k with the target's steps and sigma / B (TAN)
    noise_faithful: NoiseFaithful | None = None
    max_failures: Annotated[Int, Bound(ge=0, le=MAX_RETRIES, why=_RETRIES_WHY)] = 1

    _spaces: dict[str, SearchSpace] = PrivateAttr(default_factory=dict)

    # -- validation ----------------------------------------------------------------------------

    @model_validator(mode="after")
    def _check_best_by(self) -> Pipeline:
        if self.best_by is not None and self.release != "best":
            raise ValueError(f"best_by applies to release: best only, not {self.release}")
        metrics = [o.metric for o in self.objectives]
        if self.best_by is not None and self.best_by not in metrics:
            raise ValueError(
                f"best_by must be one of the objectives ({', '.join(metrics)}), got "
                f"{self.best_by!r}"
            )
        return self

    @model_validator(mode="after")
    def _check_noise_faithful(self) -> Pipeline:
        if self.noise_faithful is None:
            return self
        if self.total_epsilon is not None:
            raise ValueError(
                "noise_faithful runs each trial at its own epsilon, computed from what it "
                "runs; total_epsilon would solve that epsilon instead: use epsilons"
            )
        divisor = self.noise_faithful.batch_divisor
        batch = self.train.get("batch_size")
        if not isinstance(batch, int) or isinstance(batch, bool):
            raise ValueError(
                "noise_faithful holds the target run's batch size: set train.batch_size (the "
                "final run's B; trials run at B / batch_divisor)"
            )
        if batch % divisor:
            raise ValueError(
                f"noise_faithful.batch_divisor {divisor} must divide train.batch_size {batch} "
                "(trials run at batch_size / batch_divisor)"
            )
        if self.epochs % self.trial_epochs:  # the target's epochs, in whole trial epochs
            raise ValueError(
                f"noise_faithful.trial_epochs {self.trial_epochs} must divide epochs "
                f"{self.epochs} (each trial epoch runs a whole number of the target's)"
            )
        return self

    @property
    def trial_epochs(self) -> int:
        """The epochs (validation points) of each trial: ``noise_faithful.trial_epochs``,
        else ``epochs``."""
        if self.noise_faithful is None or self.noise_faithful.trial_epochs is None:
            return self.epochs
        return self.noise_faithful.trial_epochs

    @model_validator(mode="after")
    def _check_budget_kind(self) -> Pipeline:
        if (self.epsilons is None) == (self.total_epsilon is None):
            raise ValueError(
                "give either epsilons (each trial's budget) or total_epsilon (the budget of "
                "each group's tuned release), not both and not neither"
            )
        if self.validation_noise > 0:
            noisy = {"val_accuracy", "val_ece"}
            other = [o.metric for o in self.objectives if o.metric not in noisy]
            if other:
                raise ValueError(
                    f"validation_noise releases only noised val_accuracy and val_ece; the "
                    f"objective {other[0]} would be exact: use val_accuracy and val_ece"
                )
        return self

    @field_validator("objectives")
    @classmethod
    def _check_objectives(cls, objectives: list[Objective]) -> list[Objective]:
        if len(objectives) != 2:
            raise ValueError(
                f"give exactly two objectives (a Pareto front of two metrics), got "
                f"{len(objectives)}"
            )
        if objectives[0].metric == objectives[1].metric:
            raise ValueError(f"the two objectives must differ, both are {objectives[0].metric}")
        return objectives

    @model_validator(mode="after")
    def _check_scheduler(self) -> Pipeline:
        if isinstance(self.scheduler, AshaScheduler):
            epochs = self.trial_epochs
            if epochs < 2:
                raise ValueError(
                    f"scheduler asha needs trials of epochs >= 2 (it stops trials between "
                    f"epochs), got {epochs}; use scheduler {{type: none}}"
                )
            if self.scheduler.grace_period >= epochs:
                raise ValueError(
                    f"scheduler.grace_period ({self.scheduler.grace_period}) must be below "
                    f"the trials' epochs ({epochs}), else asha never stops a trial"
                )
        return self

    @classmethod
    def error_message(cls, err: ValidationError) -> str:
        # the scheduler's union tags (asha, none) are no keys of the file
        return drop_union_tags(format_validation_error(err), ("asha", "none"))

    # -- the API -------------------------------------------------------------------------------

    @property
    def spaces(self) -> dict[str, SearchSpace]:
        """The loaded search spaces, keyed by optimizer name, in the listed order."""
        return dict(self._spaces)

    @property
    def optimizer_names(self) -> list[str]:
        return [e.name for e in self.optimizers]

    @property
    def selection_metric(self) -> str | None:
        """``release: best``: the metric that picks the one released model (``best_by``,
        else the first objective); None for the other releases."""
        if self.release != "best":
            return None
        return self.best_by or self.objectives[0].metric

    @property
    def release_pick(self) -> str | None:
        """``release: best``: the export pick (dpivon.search.pareto.PICKS) that selects the
        released model: best in the first objective (``max-accuracy``) or the second."""
        metric = self.selection_metric
        if metric is None:
            return None
        return "max-accuracy" if metric == self.objectives[0].metric else "min-ece"

    @property
    def conditions(self) -> SweepConditions:
        """How its trials are chosen and what is released: what the tuning bounds assume."""
        return SweepConditions(
            trial_count=self.trial_count,
            mean_trials=float(self.trials),
            adaptive_sampler=self.sampler != "random",
            adaptive_scheduler=self.scheduler.type != "none",
            release=self.release,
            start_points=any(space.start_points for space in self._spaces.values()),
        )

    @property
    def startup_trials(self) -> int:
        """Trials a group's sampler draws at random before it models the results: for TPE
        at most a third of the group's (mean) trials, at least one (Optuna's default of 10
        would leave a small budget to random search); NSGA-II's first generation; all of
        them for the random sampler."""
        if self.sampler == "tpe":
            return max(1, self.trials // 3)
        return NSGA2_POPULATION if self.sampler == "nsga2" else self.trials

    def random_phase_note(self) -> str | None:
        """One line when some group's budget leaves an adaptive sampler in its random phase
        (every trial a random draw or a start point), said before the sweep starts."""
        if self.sampler == "random":
            return None
        for name, space in self.spaces.items():
            modelled = self.trials - max(self.startup_trials, len(space.start_points))
            if modelled <= 0:
                return (
                    f"note: sampler {self.sampler} draws its first {self.startup_trials} "
                    f"trials at random and {name} has {len(space.start_points)} start "
                    f"point(s): with trials {self.trials} no trial of {name} is chosen by the "
                    f"sampler's model (random search); raise trials above "
                    f"{max(self.startup_trials, len(space.start_points))}"
                )
        return None

    def frozen_curvature_warnings(self) -> list[str]:
        """`dpivon.runs.frozen_curvature_warning` of each distinct start config whose
        curvature cannot learn: said before the sweep starts, which it does not stop."""
        lines = (frozen_curvature_warning(config) for config in self.start_configs())
        return list(dict.fromkeys(line for line in lines if line))

    def start_configs(self) -> list[TrainConfig]:
        """Every group's start points as configs (its fixed keys alone where it has none
        and samples no ``beta2``): the runs a sweep is warned of before it starts."""
        configs = []
        for optimizer, budget in self.groups:
            space = self.spaces[optimizer]
            base = self.base_train_config(optimizer, budget)
            if space.start_points:
                points = [space.trial_config(point) for point in space.start_points]
            else:
                points = [] if "beta2" in space.distributions else [space.fixed]
            configs += [parse_config({**base, **point}) for point in points]
        return configs

    @property
    def hides_trial_count(self) -> bool:
        """Whether the random-trials bound is quoted: it holds only while K and the random
        sampler's draws stay unknown, so both come from the OS entropy source and K is
        neither logged nor reported."""
        return not self.conditions.random_trials_obstacles()

    @property
    def groups(self) -> list[tuple[str, float]]:
        """Every (optimizer, budget) group, epsilon by epsilon in the listed orders; a
        non-private optimizer has one group, at budget inf (see :func:`group_budget`)."""
        keys = [
            (name, group_budget(name, eps))
            for eps in self.epsilon_list
            for name in self.optimizer_names
        ]
        return list(dict.fromkeys(keys))

    @property
    def owned_keys(self) -> frozenset[str]:
        return frozenset(self.owned_settings(self.optimizers[0].name, math.inf))

    def train_blocks(self) -> dict[str, dict[str, Any]]:
        entries = {f"optimizers.{i}.train": e.train for i, e in enumerate(self.optimizers)}
        return {"train": self.train, **entries}

    @property
    def validation_shift_severity(self) -> int | None:
        """The severity each trial scores its validation images at, every epoch, when an
        objective is a ``val_shift_*`` metric; else None (no trial pays for it)."""
        shifted = any(o.metric.startswith("val_shift_") for o in self.objectives)
        return self.shift_severity if shifted else None

    @property
    def objective_pairs(self) -> list[tuple[str, str]]:
        """The two objectives as (metric, mode) pairs; the first one drives ASHA."""
        return [(o.metric, o.mode) for o in self.objectives]

    @property
    def epsilon_list(self) -> list[float]:
        """The groups' budgets, in the listed order (``inf`` = non-private): each trial's,
        or with ``total_epsilon`` the one budget of each group's release."""
        if self.epsilons is None:
            return [float(self.total_epsilon)]
        return [float(e) for e in self.epsilons]

    def trial_counts(self) -> dict[tuple[str, float], int]:
        """The number of trials of each (optimizer, budget) group, in listed order.

        ``fixed``: ``trials``. Otherwise drawn once per group by :func:`draw_trial_count`
        from the OS entropy source: a sweep calls this once when it starts and keeps the
        counts in its state file (private, like the checkpoints), so a resume keeps them.
        """
        return {group: draw_trial_count(self.trial_count, self.trials) for group in self.groups}

    def candidate_mechanisms(self, optimizer: str, trial_epsilon: float) -> list[TrialMechanism]:
        """Mechanisms covering every trial ``optimizer``'s space can produce when each
        targets ``trial_epsilon`` (what the tuning bounds are over before trials run)."""
        if self.noise_faithful is not None:  # one plan, exact: no calibration to cover
            plans = [self.noise_faithful_settings(b) for b in self.epsilon_list]
            keys = next((p for p in plans if p["epsilon"] == trial_epsilon), None)
            if keys is None:
                raise DpivonError(
                    f"pipeline {self.path}: no noise-faithful group's trials spend epsilon "
                    f"{trial_epsilon:g}"
                )
            return [
                TrialMechanism(
                    keys["fixed_noise_multiplier"],
                    keys["batch_size"] / self.data.train_size,
                    keys["epochs"] * keys["steps_per_epoch"],
                    self.validation_noise,
                    keys["epochs"] if self.validation_noise > 0 else 0,
                )
            ]
        batch_sizes = self.spaces[optimizer].all_values("batch_size")
        if batch_sizes is None:
            base = self.base_train_config(optimizer, self.epsilon_list[0])
            batch_sizes = [parse_config(base).training.batch_size]
        return candidate_mechanisms(
            batch_sizes,
            dataset_size=self.data.train_size,
            epochs=self.epochs,
            target_epsilon=trial_epsilon,
            delta=self.delta,
            accountant=self.accountant,
            validation_noise_multiplier=self.validation_noise,
        )

    def owned_settings(self, optimizer: str, epsilon: float) -> dict[str, Any]:
        """The TrainConfig keys the pipeline's own keys set for every trial of a group that
        spends ``epsilon``: :attr:`owned_keys`, which no search space or ``train:`` may
        set, are this mapping's keys."""
        return {
            **self.shared_train_config(self.seed),
            "optimizer": optimizer,
            "epsilon": float(epsilon),
            "val_noise_multiplier": self.validation_noise,
            # Each trial's training seed (and in research mode its noise) is derived from
            # the pipeline seed and the trial id: see dpivon.search.trial.
            "seed": self.seed,
        }

    def base_train_config(
        self, optimizer: str, epsilon: float, trial_epsilon: float | None = None
    ) -> dict[str, Any]:
        """The TrainConfig keys every trial of (optimizer, epsilon) starts from.

        The pipeline's :meth:`owned_settings` and the ``train`` extras; a trial's config is
        this updated with ``spaces[optimizer].trial_config(...)``. With ``total_epsilon``,
        ``epsilon`` names the group and ``trial_epsilon`` is what its trials spend. A
        non-private optimizer's group is at inf, whatever ``epsilon`` is given.
        """
        if optimizer not in self._spaces:
            raise DpivonError(
                f"pipeline {self.path}: no optimizer {optimizer!r}; it has "
                f"{', '.join(self.optimizer_names)}"
            )
        budget = group_budget(optimizer, epsilon)
        if (optimizer, budget) not in self.groups:
            raise DpivonError(
                f"pipeline {self.path}: no epsilon {epsilon}; it has "
                f"{', '.join(map(str, self.epsilon_list))}"
            )
        spent = budget if trial_epsilon is None or math.isinf(budget) else trial_epsilon
        config = self.owned_settings(optimizer, spent)
        config.update(self.train)
        config.update(next(e.train for e in self.optimizers if e.name == optimizer))
        if self.noise_faithful is not None and math.isfinite(budget):
            config.update(self.noise_faithful_settings(budget))
        return config

    def noise_faithful_settings(self, budget: float) -> dict[str, Any]:
        """A private noise-faithful trial's keys at a group's ``budget``: batch B / k, the
        target's steps per epoch, the target's sigma over k and the epsilon that spends
        (the trial's own; the target run spends ``budget``)."""
        divisor, batch = self.noise_faithful.batch_divisor, self.train["batch_size"]
        sigma, epsilon = noise_faithful_plan(
            float(budget),
            self.delta,
            self.data.train_size,
            batch,
            divisor,
            self.epochs,
            self.accountant,
        )
        target_epochs_per_epoch = self.epochs // self.trial_epochs
        return {
            "batch_size": batch // divisor,
            "epochs": self.trial_epochs,
            "steps_per_epoch": target_epochs_per_epoch
            * sampling_schedule(self.data.train_size, batch)[1],
            "fixed_noise_multiplier": sigma,
            "epsilon": epsilon,
        }


def draw_trial_count(trial_count: str, mean: int, rng: np.random.Generator | None = None) -> int:
    """How many trials one (optimizer, epsilon) group runs; >= 0.

    - ``fixed``: ``mean``.
    - ``geometric``: P(K = k) = (1 - g)^(k-1) g for k >= 1 with g = 1 / mean, so E[K] = mean.
      This is the truncated negative binomial D(eta=1, gamma=g) of Papernot & Steinke
      (ICLR 2022, Theorem 2): releasing the best of K trials then costs the bound of that
      theorem, far less than K-fold composition. Its spread is large (std ~ mean).
    - ``poisson``: K ~ Poisson(mean) (Theorem 6 there). K = 0 is kept: that group runs
      and releases nothing, and the tuning report records it (moving it to 1 would change
      the distribution the bound assumes).

    The bound holds only for a K the adversary does not know, so ``rng`` defaults to a
    generator seeded from the OS entropy source (never from a public seed); K is never
    logged or reported (the reports state its distribution only).
    """
    if mean < 1:
        raise DpivonError(f"the mean number of trials must be >= 1, got {mean}")
    if trial_count == "fixed":
        return int(mean)
    rng = np.random.default_rng() if rng is None else rng
    if trial_count == "geometric":
        return int(rng.geometric(1.0 / mean))
    if trial_count == "poisson":
        return int(rng.poisson(mean))
    raise DpivonError(f"unknown trial_count {trial_count!r}; use one of {', '.join(TRIAL_COUNTS)}")


def load_pipeline(path: str | Path) -> Pipeline:
    """Read and validate a pipeline YAML file and the search spaces it names."""
    path = Path(path)
    pipeline = Pipeline.read(path)
    where = f"pipeline {path}"

    spaces: dict[str, SearchSpace] = {}
    for i, entry in enumerate(pipeline.optimizers):
        prefix = f"invalid {where}: optimizers.{i}.space"
        space_path = _resolve_space(path, entry.space, prefix)
        try:
            space = load_search_space(space_path)
        except DpivonError as err:
            raise DpivonError(f"{prefix}: {err}") from None
        if space.optimizer != entry.name:
            raise DpivonError(
                f"{prefix}: {space_path} is a space for {space.optimizer}, not for "
                f"{entry.name}; point {entry.name} at its own space file"
            )
        owned = [name for name, key in space.keys.items() if key in pipeline.owned_keys]
        if owned:
            raise DpivonError(
                f"{prefix}: {space_path}: params.{owned[0]}: {space.keys[owned[0]]} is set by "
                "the pipeline for every trial (its privacy budget, data, seed, ...), not by a "
                "search space; remove it here"
            )
        spaces[entry.name] = space
    pipeline._spaces = spaces
    _check_trials(pipeline, where)
    return pipeline


def _resolve_space(pipeline_path: Path, space: str, prefix: str) -> Path:
    given = Path(space).expanduser()
    if given.is_absolute():
        candidates = [given]
    else:
        candidates = [Path(os.path.normpath(pipeline_path.parent / given)), given]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = " or ".join(str(c) for c in candidates)
    raise DpivonError(
        f"{prefix}: file not found: {space} (looked for {looked}); a space path is relative "
        "to the pipeline file's directory, then to the current directory"
    )


def _check_trials(pipeline: Pipeline, where: str) -> None:
    """Cross-checks of the pipeline with its spaces: overlaps, batch sizes, TrainConfigs."""
    n_train = pipeline.data.train_size
    default_batch = pipeline.train.get(
        "batch_size", TrainingConfig.model_fields["batch_size"].default
    )
    for i, (entry, (name, space)) in enumerate(
        zip(pipeline.optimizers, pipeline.spaces.items(), strict=True)
    ):
        prefix = f"invalid {where}: optimizers.{i} ({name}, {space.path})"
        for block, train in (("train:", pipeline.train), (f"optimizers.{i}.train:", entry.train)):
            both = [k for k in train if k in space.names]
            if both:
                raise DpivonError(
                    f"{prefix}: {', '.join(both)} set both under {block} and by the search "
                    "space, which would override it; keep one"
                )
        batch = space.max_value("batch_size")
        batch = default_batch if batch is None else batch
        if isinstance(batch, int | float) and batch > n_train:
            raise DpivonError(
                f"{prefix}: batch_size reaches {batch} but trials train on {n_train} images "
                "(after the validation split and per_class); lower the space's batch_size "
                "bounds (search_spaces/quickstart/ has spaces for small data)"
            )
        for optimizer, eps in pipeline.groups:
            if optimizer != name:
                continue
            try:  # a noise-faithful group calibrates its trials' noise here
                base = pipeline.base_train_config(name, eps)
            except DpivonError as err:
                raise DpivonError(f"{prefix}: epsilons: {err}") from None
            try:
                config = TrainConfig.model_validate(base)
            except ValidationError as err:
                raise DpivonError(
                    f"invalid {where}: the trial settings of {name} at epsilon {eps} are not "
                    f"a valid TrainConfig: {format_validation_error(err)}"
                ) from None
            if config.is_private and pipeline.epsilons is not None:
                try:
                    check_plan_reachable(config, space.max_value("batch_size"))
                except DpivonError as err:
                    raise DpivonError(f"{prefix}: epsilons: {err}") from None
            for description, values in space.bound_configs():
                try:
                    TrainConfig.model_validate({**base, **values})
                except ValidationError as err:
                    raise DpivonError(
                        f"{prefix}: {description} with this pipeline's settings at epsilon "
                        f"{eps} is not a valid TrainConfig: {format_validation_error(err)}"
                    ) from None
