"""How evaluation runs: an `EvaluationPlan` (batch size, memory format, posterior draws per
call) and the forward passes that follow it, in evaluation and inference mode."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

Params = dict[str, Tensor]


@dataclass(frozen=True)
class EvaluationPlan:
    """How evaluation runs on one device: images per forward call (per draw), channels-last
    images and weights or not, and posterior draws per call (1: one after another; more: one
    ``vmap`` over the draws' stacked parameters)."""

    batch_size: int
    channels_last: bool = False
    draws_per_call: int = 1


def formatted(tensor: Tensor, channels_last: bool) -> Tensor:
    if channels_last and tensor.dim() == 4:
        return tensor.contiguous(memory_format=torch.channels_last)
    return tensor


def softmax_at(model: nn.Module, params: Params, images: Tensor, plan: EvaluationPlan) -> Tensor:
    """Softmax probabilities of ``images`` (on the model's device) at ``params``."""
    params = {name: formatted(t, plan.channels_last) for name, t in params.items()}
    images = formatted(images, plan.channels_last)
    with torch.inference_mode():
        chunks = [
            torch.softmax(functional_call(model, params, (batch,)).float(), dim=1)
            for batch in images.split(plan.batch_size)
        ]
    return torch.cat(chunks).clone()  # an ordinary tensor, usable outside inference mode


def softmax_of_draws(
    model: nn.Module, draws: list[Params], images: Tensor, plan: EvaluationPlan
) -> list[Tensor]:
    """Softmax probabilities at each of ``draws``: in one vmapped call per batch when there
    are several (contiguous layout: vmap stacks the weights)."""
    if len(draws) == 1:
        return [softmax_at(model, draws[0], images, plan)]
    stacked = {name: torch.stack([d[name] for d in draws]) for name in draws[0]}

    def probs(params: Params, batch: Tensor) -> Tensor:
        return torch.softmax(functional_call(model, params, (batch,)).float(), dim=1)

    batched = vmap(probs, in_dims=(0, None))
    with torch.inference_mode():
        chunks = [batched(stacked, batch) for batch in images.split(plan.batch_size)]
    return list(torch.cat(chunks, dim=1).clone().unbind(0))


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[torch.device]:
    """Evaluation mode (training hooks stay idle) for the block; yields the model's device."""
    was_training = model.training
    model.eval()
    try:
        yield next(model.parameters()).device
    finally:
        model.train(was_training)
