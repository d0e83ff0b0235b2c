"""Weight-noise averaging: a point-estimate model's predictive averaged over an isotropic
Gaussian perturbation of its weights, N(theta, scale^2 I), with the scale chosen on the
validation split. It is the control for the IVON family's posterior average: what any
model gets from averaging over weight noise, with no curvature learned. An evaluation of
stored weights (no training), as BMA over `Posterior` draws with the same machinery."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpivon.config import TrainConfig
from dpivon.evaluation.posterior import Posterior
from dpivon.evaluation.predictive import evaluate_as_configured


def isotropic_posterior(model: nn.Module, scale: float) -> Posterior:
    """N(theta, scale^2 I) around the model's weights, as a `Posterior` (h = 1 / scale^2,
    ess 1, no weight decay: s = 1 / sqrt(ess (h + delta)) = scale everywhere)."""
    if not scale > 0:
        raise ValueError(f"a weight-noise scale is > 0, got {scale!r}")
    hess = {
        name: torch.full_like(p.detach(), 1.0 / scale**2) for name, p in model.named_parameters()
    }
    return Posterior(hess, ess=1.0, weight_decay=0.0)


@dataclass(frozen=True)
class WeightNoiseChoice:
    """The scale of lowest validation NLL (0.0: the point estimate itself, which no scale
    beat) and every scale's validation NLL."""

    scale: float
    validation_nll: dict[float, float]


def weight_noise_posterior(model: nn.Module, scale: float) -> Posterior | None:
    """The posterior a chosen scale evaluates with: None for 0 (the point estimate)."""
    return isotropic_posterior(model, scale) if scale > 0 else None


def choose_weight_noise(
    config: TrainConfig, model: nn.Module, validation: TensorDataset, scales: Sequence[float]
) -> WeightNoiseChoice:
    """The scale among 0 and ``scales`` whose averaged predictive has the lowest NLL on
    ``validation``, with the draws a run validates with (``val_bma_samples``, the config's
    seed): a proper score, so the scale is chosen for calibration and accuracy together;
    ties go to the smaller scale."""
    draws = config.evaluation.val_bma_samples
    nll = {0.0: evaluate_as_configured(config, model, validation, None).metrics["nll"]}
    for scale in sorted(scales):
        posterior = isotropic_posterior(model, scale)
        scores = evaluate_as_configured(config, model, validation, posterior, bma_samples=draws)
        nll[scale] = scores.metrics["nll"]
    return WeightNoiseChoice(min(nll, key=nll.__getitem__), nll)
