"""Build the base optimizer for a config; Opacus wraps the private ones afterwards.

DP-SGD and DP-Adam are plain SGD and Adam under an Opacus DPOptimizer; the DP-IVON family
is `DPIVON` and DP-AdamBC is `DPAdamBC`, which read the privatised gradient that the
DPOptimizer leaves in p.grad.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dpivon.config import TrainConfig
from dpivon.optim.adambc import DPAdamBC
from dpivon.optim.ivon import DPIVON, IVON

# DPIVON options that only the gradsq optimizers' configs set (None elsewhere).
_CURVATURE_OPTIONS = ("curvature_estimator", "curvature_ema", "curvature_pool")


def build_optimizer(
    config: TrainConfig,
    params: Iterable[torch.nn.Parameter],
    *,
    dataset_size: int,
    grad_noise_std: float = 0.0,
) -> torch.optim.Optimizer:
    """The optimizer named by ``config.optimizer``, before any privacy wrapping.

    ``grad_noise_std`` is sigma_p * C / b, needed by the noise-corrected estimators.
    """
    name = config.optimizer
    if name in ("sgd", "dp-sgd"):
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    if name in ("adam", "dp-adam"):
        return torch.optim.Adam(
            params,
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            weight_decay=config.weight_decay,
        )
    if name == "dp-adambc":
        return DPAdamBC(
            params,
            lr=config.lr,
            grad_noise_std=grad_noise_std,
            betas=(config.beta1, config.beta2),
            second_moment_floor=config.second_moment_floor,
            weight_decay=config.weight_decay,
        )
    ivon_kwargs = dict(
        lr=config.lr,
        ess=config.ess if config.ess is not None else float(dataset_size),
        hess_init=config.hess_init,
        beta1=config.beta1,
        beta2=config.beta2,
        weight_decay=config.weight_decay,
        mc_samples=config.mc_samples,
        clip_radius=config.clip_radius,
        debias=config.debias,
        rescale_lr=config.rescale_lr,
        hess_floor=config.hess_floor,
    )
    if name == "ivon":
        return IVON(params, hess_approx=config.hess_approx, **ivon_kwargs)
    curvature = {
        k: getattr(config, k) for k in _CURVATURE_OPTIONS if getattr(config, k) is not None
    }
    return DPIVON(
        params,
        grad_noise_std=grad_noise_std,
        noise_correction=name != "dp-ivon-gradsq-uncorrected",
        hess_approx=config.hess_approx,
        **curvature,
        **ivon_kwargs,
    )
