"""Pipelines: one YAML file describes a whole sweep (data, budgets, optimizers, search, Ray);
its format, key by key, is docs/pipeline-format.md. `load_pipeline` validates everything it
can without data or Ray, each problem one line naming the file and the key; what the
pipeline implies for its trials (groups, their configs, the tuning's mechanisms) is
`dpivon.search.trial_plan`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

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
)
from dpivon.constraints import Bound, FiniteEpsilon, Float, Int, Seed
from dpivon.errors import DpivonError
from dpivon.optim.registry import OptimizerName
from dpivon.orchestration.run_file import (
    Concurrency,
    Epsilons,
    RunFile,
    StrictModel,
    check_device_fits,
    distinct,
    train_extras,
)
from dpivon.privacy.tuning import (
    TrialCount,
)
from dpivon.runs import check_plan_reachable
from dpivon.search.space import SearchSpace, load_search_space
from dpivon.search.trial_plan import TrialPlan

__all__ = [
    "METRIC_MODES",
    "Pipeline",
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


class Pipeline(TrialPlan, RunFile):
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


def drop_union_tags(message: str, tags: tuple[str, ...]) -> str:
    """Drop the tags pydantic puts into the locations of a discriminated union's errors
    (for pipeline files); ``message`` is ``format_validation_error``'s "loc: msg; ..."."""
    parts = []
    for part in message.split("; "):
        loc, sep, text = part.partition(": ")
        if sep and " " not in loc:
            kept = [x for x in loc.split(".") if x not in tags]
            part = f"{'.'.join(kept)}: {text}" if kept else text
        parts.append(part)
    return "; ".join(parts)


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
        try:
            for device in space.all_values("device") or []:
                check_device_fits(f"{space_path}: params.device", device, pipeline.resources.gpu)
        except ValueError as err:
            raise DpivonError(f"{prefix}: {err}") from None
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
