"""One facade over Opacus: plan the budget, then wrap model, optimizer and data loader.

Opacus does the work (per-example gradients, clipping, noise, Poisson sampling, the
accountant's step hook); this module only decides sigma_p before the optimizer exists,
because DP-IVON needs the noise level to correct its squared gradient.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dpivon.errors import DpivonError
from dpivon.privacy.accounting import calibrate_noise_multiplier, check_budget, epsilon_spent


@dataclass(frozen=True)
class PrivacyPlan:
    """Everything a private run's guarantee depends on, fixed before training starts."""

    target_epsilon: float
    delta: float
    max_grad_norm: float
    accountant: str
    sample_rate: float
    expected_batch_size: int
    steps: int
    noise_multiplier: float

    @property
    def grad_noise_std(self) -> float:
        """Per-coordinate std of the noise in g_dp: sigma_p * C / b."""
        return self.noise_multiplier * self.max_grad_norm / self.expected_batch_size

    def planned_epsilon(self) -> float:
        return epsilon_spent(
            self.noise_multiplier, self.sample_rate, self.steps, self.delta, self.accountant
        )

    def as_params(self) -> dict[str, float | int | str]:
        return asdict(self)


def plan_privacy(
    *,
    target_epsilon: float,
    delta: float,
    max_grad_norm: float,
    accountant: str,
    dataset_size: int,
    batch_size: int,
    epochs: int,
) -> PrivacyPlan:
    """Calibrate sigma_p so that ``epochs`` epochs spend exactly ``target_epsilon``.

    The sample rate and expected batch size are the ones Opacus derives from a loader of
    ``batch_size``: q = 1 / ceil(N / b) and b_expected = floor(N q); steps = epochs / q.
    """
    check_budget(target_epsilon, delta, dataset_size)
    if not 0 < batch_size <= dataset_size:
        raise DpivonError(
            f"batch size {batch_size} must be in [1, {dataset_size}] (the training set size)"
        )
    if not max_grad_norm > 0:
        raise DpivonError(f"max_grad_norm (clip norm C) must be > 0, got {max_grad_norm}")
    if epochs < 1:
        raise DpivonError(f"epochs must be >= 1, got {epochs}")
    batches_per_epoch = math.ceil(dataset_size / batch_size)
    sample_rate = 1.0 / batches_per_epoch
    steps = epochs * batches_per_epoch
    sigma = calibrate_noise_multiplier(target_epsilon, delta, sample_rate, steps, accountant)
    return PrivacyPlan(
        target_epsilon=target_epsilon,
        delta=delta,
        max_grad_norm=max_grad_norm,
        accountant=accountant,
        sample_rate=sample_rate,
        expected_batch_size=int(dataset_size * sample_rate),
        steps=steps,
        noise_multiplier=sigma,
    )


@dataclass
class PrivateTraining:
    """The Opacus-wrapped training objects and the accountant that tracks them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    data_loader: DataLoader
    engine: PrivacyEngine
    plan: PrivacyPlan

    def epsilon_spent(self) -> float:
        """Epsilon of the steps actually taken, from the accountant that calibrated sigma."""
        if self.plan.noise_multiplier == 0.0:
            return math.inf
        if not self.engine.accountant.history:
            return 0.0
        return float(self.engine.accountant.get_epsilon(delta=self.plan.delta))

    @property
    def steps_taken(self) -> int:
        return sum(steps for _, _, steps in self.engine.accountant.history)


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: Dataset,
    plan: PrivacyPlan,
    *,
    batch_size: int,
    generator: torch.Generator | None = None,
) -> PrivateTraining:
    """Wrap for DP-SGD-style training with Poisson sampling at ``plan.sample_rate``."""
    engine = PrivacyEngine(accountant=plan.accountant)
    loader = DataLoader(dataset, batch_size=batch_size, generator=generator)
    private_model, private_optimizer, private_loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=plan.noise_multiplier,
        max_grad_norm=plan.max_grad_norm,
        poisson_sampling=True,
        noise_generator=generator,
    )
    # The noise correction of DP-IVON relies on these matching what Opacus does.
    assert abs(private_optimizer.expected_batch_size - plan.expected_batch_size) < 1e-9
    assert abs(private_loader.sample_rate - plan.sample_rate) < 1e-12
    return PrivateTraining(private_model, private_optimizer, private_loader, engine, plan)
