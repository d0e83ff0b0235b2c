"""The posterior of an IVON-family run: its Hessian estimate, and the parameter draws that
Bayesian model averaging takes (mean + std * noise, from a generator of its own)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dpivon.optim.ivon import IVON
from dpivon.optim.rules import posterior_std

Params = dict[str, Tensor]


@dataclass
class Posterior:
    """Diagonal Gaussian N(m, 1 / (ess (h + delta))): the mean lives in the model's
    parameters, ``hess`` maps parameter names to h."""

    hess: dict[str, Tensor]
    ess: float
    weight_decay: float

    def std(self, name: str) -> Tensor:
        return posterior_std(self.hess[name], self.ess, self.weight_decay)

    def state_dict(self) -> dict:
        return {"hess": self.hess, "ess": self.ess, "weight_decay": self.weight_decay}

    @classmethod
    def from_state_dict(cls, state: dict) -> Posterior:
        return cls(state["hess"], float(state["ess"]), float(state["weight_decay"]))

    @classmethod
    def from_ivon(cls, model: nn.Module, optimizer: IVON) -> Posterior:
        (group,) = optimizer.param_groups  # dpivon builds one group per model
        hess = {
            name: optimizer.state[p]["hess"].detach().clone()
            for name, p in model.named_parameters()
        }
        return cls(hess, float(group["ess"]), float(group["weight_decay"]))


# --- posterior draws ------------------------------------------------------------------------


def means_and_stds(model: nn.Module, posterior: Posterior) -> tuple[Params, Params]:
    with torch.no_grad():
        named = list(model.named_parameters())
        means = {name: p.detach().clone() for name, p in named}
        stds = {name: posterior.std(name).to(p.device) for name, p in named}
    return means, stds


def draw_parameters(means: Params, stds: Params, generator: torch.Generator | None) -> Params:
    """theta = m + s * z, one ``randn`` per tensor in parameter order: the draw sequence of a
    seeded generator is the same whichever way the draws are evaluated."""
    with torch.no_grad():
        return {
            name: mean
            + torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
            * stds[name]
            for name, mean in means.items()
        }


@contextmanager
def posterior_draws(
    model: nn.Module, posterior: Posterior, generator: torch.Generator | None = None
) -> Iterator[Callable[[], None]]:
    """Inside the block, ``draw()`` puts a fresh theta = m + s * z into the parameters; after
    it they hold the mean m again. m and s are computed once for all draws."""
    means, stds = means_and_stds(model, posterior)
    named = dict(model.named_parameters())

    @torch.no_grad()
    def draw() -> None:
        for name, theta in draw_parameters(means, stds, generator).items():
            named[name].copy_(theta)

    try:
        yield draw
    finally:
        with torch.no_grad():
            for name, p in named.items():
                p.copy_(means[name])
