"""Predictive distributions and their scores: at the posterior mean, or BMA over posterior
draws, following the machine's evaluation plan."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from dpivon.config import TrainConfig
from dpivon.evaluation.forward import (
    EvaluationPlan,
    eval_mode,
    formatted,
    softmax_at,
    softmax_of_draws,
)
from dpivon.evaluation.metrics import classification_metrics
from dpivon.evaluation.plans import evaluation_plan
from dpivon.evaluation.posterior import Posterior, draw_parameters, means_and_stds


def _plan(model: nn.Module, batch_size: int | None, draws_per_call: int | None) -> EvaluationPlan:
    plan = evaluation_plan(model)
    return EvaluationPlan(
        batch_size or plan.batch_size,
        plan.channels_last,
        draws_per_call or plan.draws_per_call,
    )


def predict_probs(model: nn.Module, images: Tensor, batch_size: int | None = None) -> Tensor:
    """Softmax probabilities at the current parameters, on the CPU."""
    plan = _plan(model, batch_size, 1)
    params = {name: p.detach() for name, p in model.named_parameters()}
    with eval_mode(model) as device:
        return softmax_at(model, params, images.to(device), plan).cpu()


def predict_bma(
    model: nn.Module,
    posterior: Posterior,
    images: Tensor,
    samples: int,
    *,
    generator: torch.Generator | None = None,
    batch_size: int | None = None,
    draws_per_call: int | None = None,
) -> Tensor:
    """Average of the softmax over ``samples`` posterior draws, on the CPU.

    The cost is ``samples`` forward passes (``draws_per_call`` of them per call) and nothing
    else that grows with the data: the images move to the device once, the running sum stays
    there, the mean and std are computed once. Draws and summation order are those of one
    draw after another, so a generator seed gives the same draws whatever the plan.
    """
    plan = _plan(model, batch_size, draws_per_call)
    means, stds = means_and_stds(model, posterior)
    with eval_mode(model) as device:
        images = formatted(images.to(device), plan.channels_last)  # once for all draws
        total = None
        for first in range(0, samples, plan.draws_per_call):
            group = min(plan.draws_per_call, samples - first)
            draws = [draw_parameters(means, stds, generator) for _ in range(group)]
            for probs in softmax_of_draws(model, draws, images, plan):
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


def evaluate_as_configured(
    config: TrainConfig,
    model: nn.Module,
    dataset: TensorDataset,
    posterior: Posterior | None,
    *,
    bma_samples: int | None = None,
) -> Evaluation:
    """`evaluate` as ``config`` says: its ECE bins and seed, and ``bma_samples`` posterior
    draws (default: the final test's ``evaluation.bma_samples``)."""
    return evaluate(
        model,
        dataset,
        posterior=posterior,
        bma_samples=config.evaluation.bma_samples if bma_samples is None else bma_samples,
        n_bins=config.evaluation.ece_bins,
        seed=config.runtime.seed,
    )
