"""One facade over Opacus: plan the budget, then wire per-sample gradients, the private
optimizer, the accountant and Poisson sampling.

Opacus does the work: its grad-sample modules compute per-example gradients, its
``DPOptimizer`` clips them, adds N(0, sigma^2 C^2) to the sum and divides by the expected
batch size, and its accountant records every step through the optimizer's step hook. This
module decides sigma_p before the optimizer exists (DP-IVON needs the noise level to correct
its squared gradient) and owns the sampling, so that the sample rate the accountant is told
is exactly the one the sampler uses: q = b / N, expected batch size b.

Engines (how the clipped sum of per-example gradients is computed; scaling and accounting
are Opacus's in every one, the noise comes from the run's `dpivon.privacy.noise.Randomness`
in every one, and every one reads the clipped sum from ``p.summed_grad`` in ``add_noise``):

- ``bk``: book-keeping, one backward pass without per-sample gradients of the whole model
  (`dpivon.privacy.bookkeeping`); the fastest, for Conv2d, Linear and GroupNorm models.
- ``hooks``, ``functorch``, ``ew``: Opacus's per-sample gradients, clipped in pre_step.
- ``ghost``: Opacus's fast gradient clipping (two backward passes).
- ``auto`` (the default): ``bk`` where it is exact for the model and the step (one
  backward per step, i.e. mc_samples == 1), else ``hooks``.
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from opacus.accountants import IAccountant, create_accountant
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.grad_sample.utils import prepare_module
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from opacus.validators import ModuleValidator
from torch import Tensor, nn

from dpivon.errors import DpivonError
from dpivon.privacy.accounting import (
    calibrate_noise_multiplier,
    check_budget,
    check_fixed_noise_fits,
    sampling_schedule,
)
from dpivon.privacy.bookkeeping import (
    BookKeeping,
    BookKeepingDPOptimizer,
    BookKeepingLoss,
    trainable_layers,
    unsupported_layers,
)
from dpivon.privacy.names import (
    AUTO_ENGINE,
    ENGINES,
    check_engine_samples,
    per_sample_engines,
)
from dpivon.privacy.noise import NoiseFromRandomness, Randomness
from dpivon.privacy.sampling import PoissonBatches

# Opacus grad-sample modes that plug into the standard DPOptimizer (clip in pre_step).
PER_SAMPLE_ENGINES: tuple[str, ...] = per_sample_engines()
# Layer types torch's ExpandedWeights (engine ew) has per-sample rules for.
_EW_LAYERS = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.Embedding,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)


class NoisedDPOptimizer(NoiseFromRandomness, DPOptimizer):
    """Opacus's DPOptimizer (clip in pre_step) with its noise from a `Randomness`."""


class NoisedFastGradientClippingOptimizer(NoiseFromRandomness, DPOptimizerFastGradientClipping):
    """Opacus's ghost-clipping optimizer with its noise from a `Randomness`."""


@dataclass(frozen=True)
class PrivacyPlan:
    """Everything a private run's guarantee depends on, fixed before training starts; a plan
    checks itself when made (its noise spends at most its budget, whoever made it).

    ``sample_rate`` is exactly ``expected_batch_size / dataset_size``: the sampler draws with
    it, the accountant records it and the optimizer divides by ``expected_batch_size``.
    """

    target_epsilon: float
    delta: float
    max_grad_norm: float
    accountant: str
    dataset_size: int
    expected_batch_size: int
    sample_rate: float
    steps_per_epoch: int
    steps: int
    noise_multiplier: float

    def __post_init__(self) -> None:
        check_plan_inputs(
            self.target_epsilon,
            self.delta,
            self.max_grad_norm,
            self.dataset_size,
            self.expected_batch_size,
        )
        if self.sample_rate != self.expected_batch_size / self.dataset_size:
            raise DpivonError(
                f"sample rate {self.sample_rate} is not the expected batch over the data, "
                f"{self.expected_batch_size} / {self.dataset_size}"
            )
        if self.steps_per_epoch < 1 or self.steps < 1 or self.steps % self.steps_per_epoch:
            raise DpivonError(
                f"{self.steps} steps are not whole epochs of {self.steps_per_epoch} steps"
            )
        check_fixed_noise_fits(
            self.noise_multiplier,
            self.target_epsilon,
            self.delta,
            self.sample_rate,
            self.steps,
            self.accountant,
        )

    @property
    def grad_noise_std(self) -> float:
        """Per-coordinate std of the noise in g_dp: sigma_p * C / b."""
        return self.noise_multiplier * self.max_grad_norm / self.expected_batch_size


def check_plan_inputs(
    target_epsilon: float, delta: float, max_grad_norm: float, dataset_size: int, batch_size: int
) -> None:
    """What a plan needs before its noise can be calibrated: a budget that means something,
    a batch within the data and a clip norm above 0."""
    check_budget(target_epsilon, delta, dataset_size)
    if not 0 < batch_size <= dataset_size:
        raise DpivonError(
            f"batch size {batch_size} must be in [1, {dataset_size}] (the training set size)"
        )
    if not max_grad_norm > 0:
        raise DpivonError(f"max_grad_norm (clip norm C) must be > 0, got {max_grad_norm}")


def plan_privacy(
    *,
    target_epsilon: float,
    delta: float,
    max_grad_norm: float,
    accountant: str,
    dataset_size: int,
    batch_size: int,
    epochs: int,
    steps_per_epoch: int | None = None,
    noise_multiplier: float | None = None,
) -> PrivacyPlan:
    """Calibrate sigma_p so that ``epochs`` epochs spend at most ``target_epsilon``, or
    check that a fixed ``noise_multiplier`` does.

    q = b / N exactly; an epoch is ``steps_per_epoch`` steps, by default ceil(N / b) (at
    least one pass in expectation). Raises DpivonError for a budget or a batch that means
    nothing, or fixed noise above the budget.
    """
    check_plan_inputs(target_epsilon, delta, max_grad_norm, dataset_size, batch_size)
    if epochs < 1:
        raise DpivonError(f"epochs must be >= 1, got {epochs}")
    sample_rate, one_pass = sampling_schedule(dataset_size, batch_size)
    steps_per_epoch = one_pass if steps_per_epoch is None else steps_per_epoch
    steps = epochs * steps_per_epoch
    if noise_multiplier is None:
        sigma = calibrate_noise_multiplier(target_epsilon, delta, sample_rate, steps, accountant)
    else:
        sigma = noise_multiplier  # the plan checks that it fits the budget
    return PrivacyPlan(
        target_epsilon=target_epsilon,
        delta=delta,
        max_grad_norm=max_grad_norm,
        accountant=accountant,
        dataset_size=dataset_size,
        expected_batch_size=batch_size,
        sample_rate=sample_rate,
        steps_per_epoch=steps_per_epoch,
        steps=steps,
        noise_multiplier=sigma,
    )


@dataclass
class PrivateTraining:
    """The Opacus-wired training objects and the accountant that tracks them.

    ``module`` runs the forward, ``criterion`` gives the loss to call ``backward()`` on
    (for ``bk`` and ``ghost`` that backward clips), ``engine`` is the resolved engine.
    """

    module: nn.Module
    optimizer: DPOptimizer
    criterion: nn.Module
    loader: PoissonBatches
    accountant: IAccountant
    plan: PrivacyPlan
    engine: str

    def epsilon_spent(self) -> float:
        """Epsilon of the steps actually taken, from the accountant that calibrated sigma."""
        if self.plan.noise_multiplier == 0.0:
            return math.inf
        if not self.accountant.history:
            return 0.0
        with warnings.catch_warnings():  # the best order at the edge: see epsilon_spent
            warnings.filterwarnings("ignore", "Optimal order is the", UserWarning)
            return float(self.accountant.get_epsilon(delta=self.plan.delta))

    @property
    def steps_taken(self) -> int:
        return sum(steps for _, _, steps in self.accountant.history)


def resolve_engine(engine: str, model: nn.Module, mc_samples: int = 1) -> str:
    """The engine a run uses, after refusing what it cannot do exactly.

    ``auto`` is the fastest exact engine: ``bk`` when it has a rule for every trainable
    layer and a step is one backward pass (mc_samples == 1), else Opacus ``hooks``. Errors
    name the offending layers.
    """
    if engine != AUTO_ENGINE and engine not in ENGINES:
        raise DpivonError(
            f"unknown engine {engine!r}; choose one of: {', '.join([AUTO_ENGINE, *ENGINES])}"
        )
    refused = _opacus_refusals(model)
    if refused:
        raise DpivonError("the model has layers private training cannot use: " + "; ".join(refused))
    bk_problems = unsupported_layers(model)
    if engine == AUTO_ENGINE:
        return "bk" if not bk_problems and mc_samples == 1 else "hooks"
    check_engine_samples(engine, mc_samples)
    if engine == "bk" and bk_problems:
        raise DpivonError(
            "engine bk cannot clip these layers exactly: "
            + "; ".join(bk_problems)
            + " (use engine hooks, or auto, which picks it)"
        )
    if engine == "ew":
        foreign = [
            f"{name} ({type(m).__name__})"
            for name, m in trainable_layers(model)
            if not isinstance(m, _EW_LAYERS)
        ]
        if foreign:
            raise DpivonError(
                "engine ew (torch ExpandedWeights) has no per-sample rule for: "
                + ", ".join(foreign)
                + " (use engine hooks)"
            )
    return engine


def _opacus_refusals(model: nn.Module) -> list[str]:
    """Opacus's module validators (BatchNorm and the like), each with the layer's name."""
    return [
        f"{name} ({type(module).__name__}: {str(error).split('. ')[0]})"
        for name, module in trainable_layers(model)
        for error in ModuleValidator.VALIDATORS.get(type(module), lambda m: [])(module)
    ]


class EmptyBatchBypass(nn.Module):
    """Runs Opacus's functorch or ew module, except on a batch of no examples.

    Poisson sampling draws empty batches (probability (1 - q)^N per step), and these two
    engines fail on them. Such a batch runs through the plain network with the per-sample
    machinery off and leaves zero-row per-sample gradients: the clipped sum is zero and the
    step still adds the noise and is accounted, as under hooks.
    """

    def __init__(self, grad_sample_module: nn.Module) -> None:
        super().__init__()
        self.grad_sample_module = grad_sample_module

    def forward(self, x: Tensor) -> Tensor:
        gsm = self.grad_sample_module
        if hasattr(gsm, "hooks_enabled"):  # functorch: Opacus hooks; ew has none
            gsm.hooks_enabled = len(x) > 0  # also read by the backward hooks after this
        if len(x) > 0:
            return gsm(x)
        for p in gsm.parameters():
            if p.requires_grad:
                p.grad_sample = p.new_zeros((0, *p.shape))
        return gsm._module(x)


# --- the wirings (dpivon.privacy.names.ENGINES) ---------------------------------------------
# Each gives (module to run, private optimizer, criterion); ``noise`` holds the DPOptimizer
# arguments, the same for every engine.


def wire_book_keeping(
    engine: str, model: nn.Module, optimizer: torch.optim.Optimizer, noise: dict[str, Any]
) -> tuple[nn.Module, DPOptimizer, nn.Module]:
    clipper = BookKeeping(model, noise["max_grad_norm"])
    private = BookKeepingDPOptimizer(optimizer, clipper=clipper, **noise)
    return model, private, BookKeepingLoss(nn.CrossEntropyLoss(), clipper)


def wire_ghost_clipping(
    engine: str, model: nn.Module, optimizer: torch.optim.Optimizer, noise: dict[str, Any]
) -> tuple[nn.Module, DPOptimizer, nn.Module]:
    module = GradSampleModuleFastGradientClipping(
        model,
        batch_first=True,
        loss_reduction="mean",
        max_grad_norm=noise["max_grad_norm"],
        use_ghost_clipping=True,
    )
    private = NoisedFastGradientClippingOptimizer(optimizer, **noise)
    criterion = DPLossFastGradientClipping(module, private, nn.CrossEntropyLoss(), "mean")
    return module, private, criterion


def wire_grad_sample_mode(
    engine: str, model: nn.Module, optimizer: torch.optim.Optimizer, noise: dict[str, Any]
) -> tuple[nn.Module, DPOptimizer, nn.Module]:
    """Opacus's grad-sample module in mode ``engine`` (hooks, functorch or ew)."""
    module = prepare_module(model, engine, batch_first=True, loss_reduction="mean")
    module.forbid_grad_accumulation()  # Poisson sampling: one backward per step
    if engine in ("functorch", "ew"):
        module = EmptyBatchBypass(module)
    return module, NoisedDPOptimizer(optimizer, **noise), nn.CrossEntropyLoss()


def engine_wiring(engine: str) -> Callable[..., tuple[nn.Module, DPOptimizer, nn.Module]]:
    """The wiring that ``engine`` is registered with."""
    module, function = ENGINES[engine].wiring.split(":")
    return getattr(importlib.import_module(module), function)


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    features: Tensor,
    labels: Tensor,
    plan: PrivacyPlan,
    *,
    engine: str = "auto",
    randomness: Randomness,
) -> PrivateTraining:
    """Wire ``model`` and ``optimizer`` for private training on (features, labels).

    ``engine`` is one of ``ENGINES``; ``auto`` resolves here (``PrivateTraining.engine``
    says to what). An IVON-family optimizer's ``mc_samples`` takes part in that choice.
    Train with ``PrivateTraining.criterion``: ``bk`` and ``ghost`` clip in its backward.

    ``randomness`` draws the Poisson masks and the noise (`dpivon.privacy.noise`: a
    `SecureRandomness` for anything released, with the floating-point attack defence).
    """
    if len(labels) != plan.dataset_size:
        raise ValueError(f"plan is for {plan.dataset_size} examples, data has {len(labels)}")
    engine = resolve_engine(engine, model, getattr(optimizer, "mc_samples", 1))
    noise = dict(
        noise_multiplier=plan.noise_multiplier,
        max_grad_norm=plan.max_grad_norm,
        expected_batch_size=plan.expected_batch_size,
        loss_reduction="mean",
        randomness=randomness,
    )
    wire = engine_wiring(engine)
    module, private_optimizer, criterion = wire(engine, model, optimizer, noise)
    accountant = create_accountant(mechanism=plan.accountant)
    # The accountant's hook is the optimizer's only step hook (a second would replace it).
    private_optimizer.attach_step_hook(
        accountant.get_optimizer_hook_fn(sample_rate=plan.sample_rate)
    )
    loader = PoissonBatches(
        features,
        labels,
        sample_rate=plan.sample_rate,
        steps=plan.steps_per_epoch,
        randomness=randomness,
    )
    return PrivateTraining(
        module=module,
        optimizer=private_optimizer,
        criterion=criterion,
        loader=loader,
        accountant=accountant,
        plan=plan,
        engine=engine,
    )
