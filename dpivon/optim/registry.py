"""The optimizer registry: each name's options (a config sub-model), defaults and whether it
is private, the way Opacus registers its accountants; each options family's class is in
`dpivon.optim.build`.

DP-SGD and DP-Adam are plain SGD and Adam under an Opacus DPOptimizer; the DP-IVON family
is `DPIVON` and DP-AdamBC is `DPAdamBC`, which read the privatised gradient that the
DPOptimizer leaves in p.grad. Opacus wraps the private ones after `build_optimizer`.

An option is declared once, with its constraint, on the options model of the family it
belongs to; a family's optimizers differ only in their defaults and in what they fix
(the DP-IVON variants are defined by their estimator). This module imports no torch: the
config tree (dpivon.config) is built from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator

from dpivon.constraints import (
    Bool,
    Bound,
    CurvatureRate,
    Float,
    Int,
    NonNegativeScale,
    PositiveFloat,
    PositiveScale,
    Rate,
)

# The choices of IVON's Hessian estimate (dpivon.optim.ivon) and of DP-IVON-Gradsq's
# curvature pools (dpivon.optim.curvature).
HessianEstimator = Literal["price", "gradsq"]
CurvaturePool = Literal["tensor", "channel"]
HESSIAN_ESTIMATORS: tuple[str, ...] = get_args(HessianEstimator)
CURVATURE_POOLS: tuple[str, ...] = get_args(CurvaturePool)
# DP-IVON-Gradsq's curvature estimators, name -> its rule as ``module:function`` (see
# dpivon.optim.curvature for the rule's signature): adding an estimator is one entry here.
# Rules load when an optimizer is built, so a config names one without importing torch.
CURVATURE_ESTIMATORS: dict[str, str] = {
    "per-step": "dpivon.optim.curvature:per_step_rule",
    "ema-corrected": "dpivon.optim.curvature:ema_corrected_rule",
    "pooled": "dpivon.optim.curvature:pooled_rule",
    "shrinkage": "dpivon.optim.curvature:shrinkage_rule",
}


def check_curvature_estimator(name: str) -> str:
    if name not in CURVATURE_ESTIMATORS:
        raise ValueError(
            f"unknown curvature estimator {name!r}; choose one of: "
            f"{', '.join(CURVATURE_ESTIMATORS)}"
        )
    return name


CurvatureEstimator = Annotated[str, AfterValidator(check_curvature_estimator)]
# Posterior samples per training step: each is a forward and backward pass of the batch
MAX_MC_SAMPLES = 64


def check_price_samples(hess_approx: str, mc_samples: int) -> None:
    """The price estimator multiplies g_dp by one posterior draw's noise: with one private
    gradient per step (the average over all samples) it needs mc_samples == 1. The rule's one
    home: the options model validates it, `DPIVON` for callers without a config."""
    if hess_approx == "price" and mc_samples != 1:
        raise ValueError(
            f"DP-IVON with the price estimator needs mc_samples=1, got {mc_samples}: the "
            "private gradient is one average over all samples"
        )


class OptimizerOptions(BaseModel):
    """What every optimizer takes. ``lr`` and ``weight_decay`` default per optimizer.

    Every field but ``name`` is a constructor keyword of the optimizer class under the same
    name, so an option is added by declaring it on its family's model (and taking it in the
    class); ``optimizer_kwargs`` overrides only compute a keyword from fields.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    # The noise-aware optimizers take the per-coordinate noise std sigma_p * C / b.
    takes_grad_noise_std: ClassVar[bool] = False

    name: str
    lr: PositiveScale
    weight_decay: NonNegativeScale

    @property
    def samples_per_step(self) -> int:
        """Forward-backward passes per step (posterior samples for IVON)."""
        return 1

    def optimizer_kwargs(self, *, dataset_size: int, grad_noise_std: float) -> dict[str, Any]:
        """The constructor keywords of the optimizer class, besides the parameters: every
        option, and ``grad_noise_std`` (sigma * C / b) where the class takes it."""
        kwargs = self.model_dump(exclude={"name"})
        if self.takes_grad_noise_std:
            kwargs["grad_noise_std"] = grad_noise_std
        return kwargs


class SGDOptions(OptimizerOptions):
    momentum: Rate
    nesterov: Bool = False  # Nesterov's look-ahead momentum; needs momentum > 0
    # the share of each new gradient the momentum buffer drops: (1 - dampening) g
    dampening: Rate = 0.0

    @model_validator(mode="after")
    def _nesterov_needs_undampened_momentum(self) -> SGDOptions:
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov needs momentum > 0")
        if self.nesterov and self.dampening != 0:
            raise ValueError("nesterov needs dampening 0")
        return self


class AdamOptions(OptimizerOptions):
    beta1: Rate = 0.9
    beta2: Rate

    def optimizer_kwargs(self, *, dataset_size: int, grad_noise_std: float) -> dict[str, Any]:
        kwargs = super().optimizer_kwargs(dataset_size=dataset_size, grad_noise_std=grad_noise_std)
        kwargs["betas"] = (kwargs.pop("beta1"), kwargs.pop("beta2"))  # torch's one argument
        return kwargs


class AdamBCOptions(AdamOptions):
    takes_grad_noise_std = True

    # gamma' in max(v_hat - s^2, gamma'): keeps 1 / sqrt(v_corr) finite
    second_moment_floor: PositiveScale


class IVONOptions(OptimizerOptions):
    beta1: Rate = 0.9
    beta2: CurvatureRate
    hess_approx: HessianEstimator
    hess_init: PositiveScale
    ess: PositiveFloat | None = None  # None: the training-set size
    mc_samples: Annotated[
        Int,
        Bound(
            ge=1,
            le=MAX_MC_SAMPLES,
            cost=lambda n: f"run {n:,} forward and backward passes per step",
            why="a step that many times as long as one sample's; IVON uses 1 to 10",
        ),
    ] = 1
    clip_radius: Annotated[Float, Bound(gt=0, infinite=True, shown="> 0 (.inf: no clipping)")] = (
        math.inf
    )
    rescale_lr: Bool = True
    debias: Bool = True
    hess_floor: NonNegativeScale  # keeps h >= hess_floor (0: no floor)

    @property
    def samples_per_step(self) -> int:
        return self.mc_samples

    def optimizer_kwargs(self, *, dataset_size: int, grad_noise_std: float) -> dict[str, Any]:
        kwargs = super().optimizer_kwargs(dataset_size=dataset_size, grad_noise_std=grad_noise_std)
        if kwargs["ess"] is None:
            kwargs["ess"] = float(dataset_size)
        return kwargs


class DPIVONOptions(IVONOptions):
    takes_grad_noise_std = True

    @model_validator(mode="after")
    def _one_sample_for_price(self) -> DPIVONOptions:
        check_price_samples(self.hess_approx, self.mc_samples)
        return self


class GradsqIVONOptions(DPIVONOptions):
    """DP-IVON-Gradsq: how v_hat is estimated from g_dp (see dpivon.optim.curvature). Every
    estimator is post-processing of g_dp: none costs privacy."""

    noise_correction: Bool = True
    curvature_estimator: CurvatureEstimator = "per-step"
    curvature_ema: Rate = 0.99  # ema-corrected: the rate of g_dp^2's average
    curvature_pool: CurvaturePool = "tensor"  # pooled and shrinkage


@dataclass(frozen=True)
class OptimizerSpec:
    """One registered optimizer."""

    options: type[OptimizerOptions]  # its family, which decides its class
    private: bool
    defaults: Mapping[str, Any] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)  # what the name itself decides


# IVON's CIFAR recipe (Shen et al.) for the non-private optimizers; the private IVON family
# needs a far larger lr: its step is about lr * g_dp while h stays near hess_init.
_IVON_DEFAULTS = {"hess_init": 0.5, "beta2": 0.99999, "weight_decay": 2e-4, "hess_floor": 0.0}

OPTIMIZERS: dict[str, OptimizerSpec] = {
    "dp-ivon-gradsq": OptimizerSpec(
        GradsqIVONOptions, private=True,
        defaults={"lr": 3.0, **_IVON_DEFAULTS},
        fixed={"hess_approx": "gradsq", "noise_correction": True},
    ),
    "dp-ivon-gradsq-uncorrected": OptimizerSpec(
        GradsqIVONOptions, private=True,
        defaults={"lr": 3.0, **_IVON_DEFAULTS},
        fixed={"hess_approx": "gradsq", "noise_correction": False},
    ),
    "dp-ivon": OptimizerSpec(
        DPIVONOptions, private=True,
        defaults={"lr": 3.0, **_IVON_DEFAULTS}, fixed={"hess_approx": "price"},
    ),
    "dp-sgd": OptimizerSpec(
        SGDOptions, private=True,
        defaults={"lr": 0.5, "momentum": 0.9, "weight_decay": 0.0},
    ),
    "dp-adam": OptimizerSpec(
        AdamOptions, private=True,
        defaults={"lr": 2e-3, "beta2": 0.999, "weight_decay": 0.0},
    ),
    # The authors' CIFAR-10 CNN setting (lr 5e-6, gamma' 1e-9, with C 3 and batch 1024):
    # gamma' bounds 1 / sqrt(v_corr), so the lr sits far below DP-Adam's.
    "dp-adambc": OptimizerSpec(
        AdamBCOptions, private=True,
        defaults={"lr": 5e-6, "beta2": 0.999, "weight_decay": 0.0, "second_moment_floor": 1e-9},
    ),
    "ivon": OptimizerSpec(
        IVONOptions, private=False,
        defaults={"lr": 0.2, "hess_approx": "price", **_IVON_DEFAULTS},
    ),
    "sgd": OptimizerSpec(
        SGDOptions, private=False,
        defaults={"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4},
    ),
    "adam": OptimizerSpec(
        AdamOptions, private=False,
        defaults={"lr": 2e-3, "beta2": 0.999, "weight_decay": 0.0},
    ),
}  # fmt: skip
OPTIMIZER_NAMES = tuple(OPTIMIZERS)
PRIVATE_OPTIMIZERS = tuple(n for n, s in OPTIMIZERS.items() if s.private)
OPTION_NAMES = tuple(
    dict.fromkeys(k for s in OPTIMIZERS.values() for k in s.options.model_fields if k != "name")
)


class UnknownOptionError(ValueError):
    """A key that is no optimizer's option; `dpivon.config` says what it may have meant."""

    def __init__(self, key: Any) -> None:
        super().__init__(f"{key!r} is not an optimizer option")
        self.key = key


def optimizer_spec(name: Any) -> OptimizerSpec:
    if not isinstance(name, str) or name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZER_NAMES)}")
    return OPTIMIZERS[name]


def known_optimizer(name: Any) -> str:
    """``name`` when an optimizer is registered under it (else the ValueError naming the
    choices): the check of every file that names an optimizer."""
    optimizer_spec(name)
    return name


OptimizerName = Annotated[str, AfterValidator(known_optimizer)]


def optimizer_options(values: Mapping[str, Any]) -> OptimizerOptions:
    """Validate one optimizer's options: ``None`` takes the optimizer's default, an option
    of another family is an error (not a silent no-op), and so is contradicting what the
    name fixes."""
    name = values.get("name", "dp-ivon-gradsq")
    spec = optimizer_spec(name)
    given = {k: v for k, v in values.items() if v is not None and k != "name"}
    foreign = [k for k in given if k not in spec.options.model_fields]
    if foreign:
        owners = [n for n, s in OPTIMIZERS.items() if foreign[0] in s.options.model_fields]
        if not owners:
            raise UnknownOptionError(foreign[0])
        raise ValueError(f"{foreign[0]} does not apply to {name}; it is an option of "
                         f"{', '.join(owners)}")  # fmt: skip
    for key, value in spec.fixed.items():
        if key in given and given[key] != value:
            estimator = key == "hess_approx"
            fixed = f"the {value} estimator" if estimator else f"{key}={value!r}"
            raise ValueError(
                f"{name} uses {fixed}; {key}={given[key]!r} contradicts it (use "
                f"{'optimizer ivon' if estimator else 'another optimizer'} to choose freely)"
            )
    return spec.options.model_validate({"name": name, **spec.defaults, **given, **spec.fixed})
