"""Benchmark pipelines: methods x epsilons x seeds, each trained once and tested once; the
file's format, key by key, is docs/benchmark-format.md. Loading validates the file and the
sweeps its tuned methods come from, and expands it into one `RunSpec` per run.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from dpivon.config import (
    TrainConfig,
    parse_config,
)
from dpivon.constraints import Bound, Float, Int, Seed
from dpivon.errors import DpivonError
from dpivon.optim.registry import OPTIMIZERS, IVONOptions, OptimizerName
from dpivon.orchestration.run_file import (
    Concurrency,
    Epsilons,
    RunFile,
    StrictModel,
    as_list,
    distinct,
    group_budget,
    train_extras,
)
from dpivon.orchestration.storage import ResultsStorage
from dpivon.runs import check_plan_reachable
from dpivon.search.pareto import PICKS
from dpivon.search.trial import trial_seed

MIN_SEEDS = 3
_METHOD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


TrainExtras = Annotated[dict[str, Any], BeforeValidator(train_extras)]


def _method_name(name: str) -> str:
    if _METHOD_NAME.fullmatch(name) is None:
        raise ValueError(
            f"method name {name!r} must start with a letter or digit and hold only "
            "letters, digits and _ . + - (it names files, runs and table rows)"
        )
    return name


class Method(StrictModel):
    """One compared method: an optimizer with fixed settings, or a sweep's pick."""

    name: Annotated[str, AfterValidator(_method_name)]
    optimizer: OptimizerName
    from_sweep: str | None = None
    pick: Literal[tuple(p for p in PICKS if p != "pareto")] = "knee"  # one config each
    train: TrainExtras = Field(default_factory=dict)
    reference: str | None = None  # the non-private method this one is the private version of
    # the IVON-family method this one repeats with h frozen (beta2 1): the ablation of its
    # learned curvature, paired with it by seed in the report
    frozen_curvature_of: str | None = None


@dataclass(frozen=True)
class RunSpec:
    """One training run of the benchmark; ``key`` identifies it across resumes."""

    method: str
    epsilon: float
    replicate: int
    config: TrainConfig
    tuned_by: str | None = None  # "<sweep>/<group>/<trial id>" for from_sweep methods
    # the pick's score in its sweep: (metric, value) of the sweep's first objective
    tuning_score: tuple[str, float] | None = None
    space_dimension: int | None = None  # parameters its sweep searched (None: not recorded)

    @property
    def key(self) -> str:
        return run_key(self.method, self.epsilon, self.replicate)

    @property
    def config_json(self) -> str:
        return json.dumps(self.config.model_dump(mode="json"), sort_keys=True)


def run_key(method: str, epsilon: float, replicate: int) -> str:
    return f"{method}|eps{epsilon:g}|seed{replicate}"


class BenchmarkPipeline(RunFile):
    """A validated benchmark pipeline; build it with :func:`load_benchmark`."""

    kind: ClassVar[str] = "benchmark"
    noun: ClassVar[str] = "benchmark"

    epsilons: Epsilons
    seeds: Annotated[list[Annotated[Int, Bound(ge=0)]], BeforeValidator(as_list), distinct("seeds")]
    split_seed: Seed = 0
    methods: Annotated[
        list[Method], Field(min_length=1), distinct("method names", lambda m: m.name)
    ]
    concurrency: Concurrency = 2
    run_timeout_s: Annotated[Float, Bound(gt=0, infinite=True, shown="> 0 (.inf: no limit)")] = (
        6 * 3600.0
    )
    # not a TrainConfig key: scoring under shift changes no run's training (or config hash)
    shift: Literal["none", "default", "full"] = "none"
    # Point-estimate models also scored averaged over isotropic weight noise of the one of
    # these scales that the validation split prefers (`dpivon.evaluation.weight_noise`);
    # empty: not scored. Like shift, an evaluation of the stored weights.
    weight_noise_scales: Annotated[
        list[Annotated[Float, Bound(gt=0, lt=1e3)]],
        BeforeValidator(as_list),
        distinct("weight_noise_scales"),
    ] = Field(default_factory=list)

    _runs: list[RunSpec] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _check_references(self) -> BenchmarkPipeline:
        """Each ``reference`` names a non-private method of the file, from a private one,
        in a benchmark scored under shift (the only place the reference is used)."""
        optimizers = {m.name: m.optimizer for m in self.methods}
        non_private = [name for name, o in optimizers.items() if not OPTIMIZERS[o].private]
        for i, method in enumerate(self.methods):
            reference, where = method.reference, f"methods.{i}.reference"
            if reference is None:
                continue
            if reference not in optimizers:
                raise ValueError(
                    f"{where}: {reference!r} is not a method of this benchmark; name one of "
                    f"its non-private methods: {', '.join(non_private) or 'none (add one)'}"
                )
            if not OPTIMIZERS[method.optimizer].private:
                raise ValueError(
                    f"{where}: {method.name!r} ({method.optimizer}) is not private, so privacy "
                    "costs it nothing to measure; give references to private methods only"
                )
            if OPTIMIZERS[optimizers[reference]].private:
                raise ValueError(
                    f"{where}: {reference!r} ({optimizers[reference]}) is private; the "
                    "reference is a non-private method (e.g. adam for dp-adam)"
                )
            if self.shift == "none":
                raise ValueError(
                    f"{where}: a reference measures what privacy costs under shift; set "
                    "shift: default (or full) to score the runs under shift"
                )
        return self

    @model_validator(mode="after")
    def _check_frozen_curvature_arms(self) -> BenchmarkPipeline:
        """Each ``frozen_curvature_of`` names an IVON-family method of the file that this one
        repeats (optimizer, sweep, pick, train keys) with beta2 1 alone changed: h frozen at
        hess_init, so that the pair differs in the learned curvature only."""
        by_name = {m.name: m for m in self.methods}

        def without_beta2(method: Method) -> tuple:
            train = {k: v for k, v in method.train.items() if k != "beta2"}
            return method.optimizer, method.from_sweep, method.pick, train

        for i, method in enumerate(self.methods):
            name, where = method.frozen_curvature_of, f"methods.{i}.frozen_curvature_of"
            if name is None:
                continue
            learning = by_name.get(name)
            if learning is None or learning is method:
                others = [m.name for m in self.methods if m is not method]
                raise ValueError(
                    f"{where}: {name!r} is not another method of this benchmark; name the "
                    f"method whose curvature {method.name} freezes: {', '.join(others)}"
                )
            if not issubclass(OPTIMIZERS[method.optimizer].options, IVONOptions):
                raise ValueError(
                    f"{where}: {method.name} ({method.optimizer}) learns no curvature to "
                    "freeze; frozen arms are of IVON-family methods"
                )
            if without_beta2(method) != without_beta2(learning):
                raise ValueError(
                    f"{where}: {method.name} must repeat {name} (its optimizer, from_sweep, "
                    "pick and train keys) with beta2 alone changed"
                )
            if method.train.get("beta2") != 1.0:
                raise ValueError(f"{where}: give {method.name} train: {{beta2: 1.0}} (h frozen)")
        return self

    @field_validator("seeds")
    @classmethod
    def _check_seeds(cls, seeds: list[int]) -> list[int]:
        if len(seeds) < MIN_SEEDS:
            raise ValueError(
                f"give at least {MIN_SEEDS} seeds (the report states the spread over seeds), "
                f"got {len(seeds)}"
            )
        return seeds

    # -- the API -------------------------------------------------------------------------------

    @property
    def runs(self) -> list[RunSpec]:
        """Every run in submission order: seed-major, then epsilon, then method, so that an
        interrupted benchmark holds complete comparisons of its first seeds."""
        return list(self._runs)

    @property
    def method_names(self) -> list[str]:
        return [m.name for m in self.methods]

    @property
    def frozen_curvature_arms(self) -> dict[str, str]:
        """Each frozen-curvature method -> the method whose curvature it freezes."""
        return {m.name: m.frozen_curvature_of for m in self.methods if m.frozen_curvature_of}

    @property
    def references(self) -> dict[str, str]:
        """Each private method with a ``reference``: method name -> its reference's name."""
        return {m.name: m.reference for m in self.methods if m.reference is not None}

    @property
    def epsilon_list(self) -> list[float]:
        return [float(e) for e in self.epsilons]

    def method_epsilons(self, method: Method) -> list[float]:
        """The epsilons ``method`` runs at: the listed ones, or inf alone for a non-private
        optimizer (it spends no budget, so a finite label would claim one)."""
        return list(dict.fromkeys(group_budget(method.optimizer, e) for e in self.epsilon_list))

    @property
    def owned_keys(self) -> frozenset[str]:
        return frozenset(self.base_config(self.methods[0], math.inf, 0))

    def train_blocks(self) -> dict[str, dict[str, Any]]:
        methods = {f"methods.{i}.train": m.train for i, m in enumerate(self.methods)}
        return {"train": self.train, **methods}

    @property
    def sweep_directories(self) -> list[ResultsStorage]:
        """The distinct sweeps the tuned methods come from (for the Pareto fronts)."""
        from dpivon.search.export import resolve_sweep

        found = [resolve_sweep(m.from_sweep) for m in self.methods if m.from_sweep]
        return list({s.uri: s for s in found}.values())

    def base_config(self, method: Method, epsilon: float, replicate: int) -> dict[str, Any]:
        """The TrainConfig keys the benchmark sets for one run (before a sweep's pick)."""
        config = {
            **self.shared_train_config(self.split_seed),
            "optimizer": method.optimizer,
            "epsilon": float(epsilon),
            "seed": trial_seed(replicate, f"{method.name}@{epsilon!r}"),
        }
        return config


@dataclass(frozen=True)
class TunedPick:
    """A sweep's pick for one epsilon: its config as a mapping, where it came from
    ("<sweep>/<group>/<trial id>") and its score on the sweep's first objective."""

    config: dict[str, Any]
    tuned_by: str
    score: tuple[str, float]
    space_dimension: int | None


def _tuned_configs(
    method: Method, epsilons: list[float], where: str
) -> tuple[dict[float, TunedPick], dict[float, int]]:
    """Per epsilon: the sweep's pick and the number of trials its group ran."""
    from dpivon.search.export import export_configs, load_results, resolve_sweep
    from dpivon.search.results import group_name
    from dpivon.search.sweep import SweepState

    prefix = f"invalid {where}: method {method.name} (from_sweep {method.from_sweep})"
    try:
        directory = resolve_sweep(method.from_sweep)
        state = SweepState.load(directory)
        objectives = state.objectives
        trials, _ = load_results(directory)
    except DpivonError as err:
        raise DpivonError(f"{prefix}: {err}") from None
    picked, budgets = {}, {}
    for eps in epsilons:
        group = group_name(method.optimizer, eps)
        try:
            ((row, config),) = export_configs(
                directory,
                objectives,
                method.pick,
                optimizer=method.optimizer,
                epsilon=eps,
                full_data=False,
            )
        except DpivonError as err:
            raise DpivonError(f"{prefix}: group {group}: {err}") from None
        metric = objectives[0][0]
        picked[eps] = TunedPick(
            config.flat(),
            f"{directory.name}/{group}/{row['trial_id']}",
            (metric, float(row[metric])),
            state.space_dimensions.get(method.optimizer),
        )
        budgets[eps] = int(
            ((trials["optimizer"] == method.optimizer) & (trials["epsilon"] == eps)).sum()
        )
    return picked, budgets


def _check_equal_budgets(budgets: dict[tuple[str, float], int], where: str) -> None:
    for eps in {e for _, e in budgets}:
        at = {m: n for (m, e), n in budgets.items() if e == eps}
        if len(set(at.values())) > 1:
            shown = ", ".join(f"{m} {n}" for m, n in at.items())
            raise DpivonError(
                f"invalid {where}: at epsilon {eps:g} the tuned methods come from sweeps with "
                f"different trial budgets ({shown} trials); tune every method with the same "
                "trials and trial_count: fixed"
            )


def _check_budgets_before_sweeps(pipeline: BenchmarkPipeline, where: str) -> None:
    """A tuned method's epsilons are checked before its sweep is read, where the benchmark
    fixes the batch size (all that reachability needs): a budget no run can meet is
    refused as such, not as a group that the sweep never tuned."""
    for method in pipeline.methods:
        fixed = {**pipeline.train, **method.train}
        if method.from_sweep is None or "batch_size" not in fixed:
            continue
        for eps in pipeline.method_epsilons(method):
            source = f"{where}: method {method.name} at epsilon {eps:g}"
            keys = {**pipeline.base_config(method, eps, pipeline.seeds[0]), **fixed}
            _checked_config(keys, source)


def _checked_config(keys: dict[str, Any], source: str) -> TrainConfig:
    """The run configuration of ``keys``; a private one whose budget no run can meet is
    refused, named by ``source``."""
    config = parse_config(keys, source=source)
    if config.is_private:
        try:
            check_plan_reachable(config)
        except DpivonError as err:
            raise DpivonError(f"invalid {source}: {err}") from None
    return config


def load_benchmark(path: str | Path) -> BenchmarkPipeline:
    """Read and validate a benchmark YAML file, resolving every run's TrainConfig."""
    path = Path(path)
    pipeline = BenchmarkPipeline.read(path)
    where = f"benchmark {path}"

    _check_budgets_before_sweeps(pipeline, where)
    runs: list[RunSpec] = []
    budgets: dict[tuple[str, float], int] = {}
    for method in pipeline.methods:
        tuned: dict[float, TunedPick] = {}
        if method.from_sweep is not None:
            tuned, counts = _tuned_configs(method, pipeline.method_epsilons(method), where)
            budgets.update({(method.name, eps): n for eps, n in counts.items()})
        for eps in pipeline.method_epsilons(method):
            pick = tuned.get(eps)
            for replicate in pipeline.seeds:
                keys = {
                    **(pick.config if pick else {}),
                    **pipeline.base_config(method, eps, replicate),
                    **pipeline.train,
                    **method.train,
                }
                source = f"{where}: method {method.name} at epsilon {eps:g}"
                config = _checked_config(keys, source)
                if config.training.batch_size > pipeline.data.train_size:
                    raise DpivonError(
                        f"invalid {source}: batch_size {config.training.batch_size} exceeds the "
                        f"{pipeline.data.train_size} training images; lower it"
                    )
                runs.append(
                    RunSpec(
                        method.name,
                        eps,
                        replicate,
                        config,
                        pick.tuned_by if pick else None,
                        pick.score if pick else None,
                        pick.space_dimension if pick else None,
                    )
                )
    _check_equal_budgets(budgets, where)
    methods, seeds = pipeline.method_names, pipeline.seeds
    epsilons = list(dict.fromkeys([*pipeline.epsilon_list, math.inf]))
    pipeline._runs = sorted(
        runs,
        key=lambda r: (
            seeds.index(r.replicate),
            epsilons.index(r.epsilon),
            methods.index(r.method),
        ),
    )
    return pipeline
