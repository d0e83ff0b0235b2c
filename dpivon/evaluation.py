"""Predictive distributions: at the posterior mean, or Bayesian model averaging (BMA).

For the IVON family the predictive of record is BMA over ``bma_samples`` posterior draws
(default 16; the IVON authors use up to 64, 16-64 is enough); the mean prediction is
reported beside it. Other optimizers have a point estimate only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from dpivon.metrics import classification_metrics
from dpivon.optim.ivon import IVON, posterior_std

EVAL_BATCH_SIZE = 1000


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


@contextmanager
def posterior_draws(
    model: nn.Module, posterior: Posterior, generator: torch.Generator | None = None
) -> Iterator[Callable[[], None]]:
    """Inside the block, ``draw()`` puts a fresh theta = m + s * z into the parameters; after
    it they hold the mean m again. m and s are computed once for all draws."""
    with torch.no_grad():
        named = list(model.named_parameters())
        means = {name: p.detach().clone() for name, p in named}
        stds = {name: posterior.std(name).to(p.device) for name, p in named}

    @torch.no_grad()
    def draw() -> None:
        for name, p in named:
            z = torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype)
            p.copy_(means[name]).add_(z * stds[name])

    try:
        yield draw
    finally:
        with torch.no_grad():
            for name, p in named:
                p.copy_(means[name])


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[torch.device]:
    """Evaluation mode (training hooks stay idle) for the block; yields the model's device."""
    was_training = model.training
    model.eval()
    try:
        yield next(model.parameters()).device
    finally:
        model.train(was_training)


def _softmax(model: nn.Module, images: Tensor, batch_size: int) -> Tensor:
    """Softmax probabilities of ``images`` (already on the model's device), batch by batch;
    joined outside inference mode, so that the result is an ordinary tensor."""
    with torch.inference_mode():
        chunks = [torch.softmax(model(batch).float(), dim=1) for batch in images.split(batch_size)]
    return torch.cat(chunks)


def predict_probs(model: nn.Module, images: Tensor, batch_size: int = EVAL_BATCH_SIZE) -> Tensor:
    """Softmax probabilities at the current parameters, on the CPU."""
    with _eval_mode(model) as device:
        return _softmax(model, images.to(device), batch_size).cpu()


def predict_bma(
    model: nn.Module,
    posterior: Posterior,
    images: Tensor,
    samples: int,
    *,
    generator: torch.Generator | None = None,
    batch_size: int = EVAL_BATCH_SIZE,
) -> Tensor:
    """Average of the softmax over ``samples`` posterior draws, on the CPU.

    The cost is ``samples`` forward passes and nothing else that grows with the data: the
    images move to the device once, the running sum stays there, the mean and std are
    computed once. Draws and summation order are those of one draw after another, so a
    generator seed gives the same probabilities as ever.
    """
    with _eval_mode(model) as device, posterior_draws(model, posterior, generator) as draw:
        images = images.to(device)
        total = None
        for _ in range(samples):
            draw()
            probs = _softmax(model, images, batch_size)
            total = probs if total is None else total.add_(probs)
    return (total / samples).cpu()


@dataclass
class Evaluation:
    """The predictive of record and its metrics (plus mean-prediction metrics for IVON)."""

    probs: Tensor
    labels: Tensor
    metrics: dict[str, float]


def evaluate(
    model: nn.Module,
    dataset: TensorDataset,
    *,
    posterior: Posterior | None,
    bma_samples: int,
    n_bins: int,
    seed: int,
) -> Evaluation:
    """Metrics of the predictive of record: BMA when there is a posterior and
    ``bma_samples > 0``, else the point prediction. ``mean_*`` keys hold the prediction at
    the mean whenever BMA is the record."""
    images, labels = dataset.tensors
    mean_probs = predict_probs(model, images)
    mean_metrics = classification_metrics(mean_probs, labels, n_bins)
    if posterior is None or bma_samples == 0:
        return Evaluation(mean_probs, labels, mean_metrics)
    # A fixed generator: the same posterior gives the same BMA, and the training RNG stream
    # is not consumed by evaluation.
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    bma_probs = predict_bma(model, posterior, images, bma_samples, generator=generator)
    metrics = classification_metrics(bma_probs, labels, n_bins)
    metrics.update({f"mean_{k}": v for k, v in mean_metrics.items()})
    return Evaluation(bma_probs, labels, metrics)
