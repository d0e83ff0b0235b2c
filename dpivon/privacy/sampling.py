"""Batches drawn from tensors that already live on the training device.

`PoissonBatches` is the sampling the accountant assumes: at every step each example is
included independently with probability q, a Bernoulli mask from the run's randomness
(`dpivon.privacy.noise`: cryptographic unless in research mode). The
accountant is told this very q, so the plan and what runs cannot drift apart (Opacus 1.6's
loader derives q = 1 / int(1 / q) from its length, which for some batch counts is the
rate of k - 1 batches). No DataLoader, no workers, no per-example Python.

`ShuffledBatches` is the non-private counterpart: fixed-size batches of a fresh
permutation each epoch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

from dpivon.privacy.noise import Randomness


class PoissonBatches:
    """``steps`` Poisson-sampled batches per pass, each example in with probability q."""

    def __init__(
        self,
        features: Tensor,
        labels: Tensor,
        *,
        sample_rate: float,
        steps: int,
        randomness: Randomness,
    ) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if len(features) != len(labels):
            raise ValueError(f"{len(features)} features but {len(labels)} labels")
        self.features, self.labels = features, labels
        self.sample_rate, self.steps, self.randomness = sample_rate, steps, randomness

    def __len__(self) -> int:
        return self.steps

    def sample_mask(self) -> Tensor:
        """One step's inclusion mask; float64 uniforms keep P(in) = q to 2^-53."""
        return self.randomness.uniform(len(self.labels), self.labels.device) < self.sample_rate

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for _ in range(self.steps):
            index = self.sample_mask().nonzero().squeeze(1)
            yield self.features.index_select(0, index), self.labels.index_select(0, index)


class ShuffledBatches:
    """Batches of ``batch_size`` (the last one smaller) of a new permutation per pass."""

    def __init__(
        self, features: Tensor, labels: Tensor, *, batch_size: int, generator: torch.Generator
    ) -> None:
        self.features, self.labels = features, labels
        self.batch_size, self.generator = batch_size, generator

    def __len__(self) -> int:
        return math.ceil(len(self.labels) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        order = torch.randperm(
            len(self.labels), generator=self.generator, device=self.labels.device
        )
        for index in order.split(self.batch_size):
            yield self.features.index_select(0, index), self.labels.index_select(0, index)
