"""IVON's update rules as pure functions, one per quantity (ivon-opt's style): the posterior
std, the Hessian estimates and their recursion, the curvature's horizon, the mean update,
and the order statistics its diagnostics report. `dpivon.optim.ivon` only moves tensors in
and out of them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

DIAGNOSTIC_QUANTILES = (0.1, 0.9)


def posterior_std(hess: Tensor, ess: float, weight_decay: float) -> Tensor:
    """s = 1 / sqrt(ess * (h + delta))."""
    return torch.rsqrt(ess * (hess + weight_decay))


def price_hessian(
    mean_noise_times_grad: Tensor, hess: Tensor, ess: float, weight_decay: float
) -> Tensor:
    """Reparameterisation estimate ess * (h + delta) * E[z' * g] = E[g * (theta - m) / s^2]."""
    return ess * (hess + weight_decay) * mean_noise_times_grad


def gradsq_hessian(mean_squared_grad: Tensor, ess: float) -> Tensor:
    """Squared-gradient (Gauss-Newton-like) estimate ess * E[g^2]."""
    return ess * mean_squared_grad


def ema_update(average: Tensor, value: Tensor, rate: float) -> Tensor:
    """a = rate * a + (1 - rate) * x: IVON's momentum (rate beta1) and the moving average
    of g_dp^2 behind the ``ema-corrected`` curvature."""
    return rate * average + (1.0 - rate) * value


def bias_corrected(average: Tensor, rate: float, step: int) -> Tensor:
    """Adam's correction of a moving average started at 0: a_t / (1 - rate^t)."""
    return average / (1.0 - rate**step)


def hessian_update(
    hess: Tensor, hess_estimate: Tensor, beta2: float, weight_decay: float
) -> Tensor:
    """IVON's Riemannian-gradient correction keeps h positive:
    h = beta2 h + (1 - beta2) h_hat + (1 - beta2)^2 / 2 * (h - h_hat)^2 / (h + delta)."""
    return (
        beta2 * hess
        + (1.0 - beta2) * hess_estimate
        + 0.5 * (1.0 - beta2) ** 2 * (hess - hess_estimate).square() / (hess + weight_decay)
    )


def curvature_horizon_share(beta2: float, steps: int) -> float:
    """1 - beta2^T: the most of h that T steps of estimates can have made; the rest is
    hess_init decayed (IVON's default 0.99999 over 1,320 steps: 0.013, a frozen h)."""
    return 1.0 - beta2**steps


def beta2_for_horizon_share(share: float, steps: int) -> float:
    """The beta2 whose `curvature_horizon_share` over ``steps`` is ``share``."""
    return (1.0 - share) ** (1.0 / steps)


def learned_curvature_share(hess: Tensor, decayed_init: Tensor) -> Tensor:
    """1 - hess_init beta2^t / h per coordinate: the share of h beyond what the decay of its
    start explains (0 for a frozen h; near 0 where the estimates are 0, the collapse)."""
    return 1.0 - decayed_init / hess


def floored_hessian(hess: Tensor, floor: float) -> Tensor:
    """h = max(h, floor); a floor of 0 leaves h as it is.

    An unbiased curvature estimate drives h towards 0 where g_dp carries no signal, and the
    posterior std towards 1 / sqrt(ess * delta) (0.33 for ess 45,000, delta 2e-4: wide
    enough to wreck BMA predictions). The floor bounds the std by
    1 / sqrt(ess * (floor + delta)) and the step by lr * |direction| / (floor + delta). A
    floor of 0 is no floor at all, not a clamp at 0: the price estimator lets h dip below 0
    (never below -delta), as in ivon-opt.
    """
    return hess.clamp(min=floor) if floor > 0 else hess


def mean_update(
    mean: Tensor,
    momentum: Tensor,
    hess: Tensor,
    lr: float,
    weight_decay: float,
    clip_radius: float,
    momentum_debias: float,
) -> Tensor:
    """m = m - lr * clip((gbar / debias + delta * m) / (h + delta), -r, r)."""
    direction = (momentum / momentum_debias + weight_decay * mean) / (hess + weight_decay)
    if clip_radius >= torch.finfo(direction.dtype).max:
        return mean - lr * direction  # no value of this dtype lies beyond it (and clamp refuses it)
    return mean - lr * direction.clamp(min=-clip_radius, max=clip_radius)


def effective_lr(lr: float, hess_init: float, weight_decay: float, rescale_lr: bool) -> float:
    """With rescale_lr the first steps move by about lr, whatever hess_init is."""
    return lr * (hess_init + weight_decay) if rescale_lr else lr


def momentum_debias(beta1: float, step: int, debias: bool) -> float:
    return 1.0 - beta1**step if debias else 1.0


def lower_quantiles(values: Tensor, quantiles: Sequence[float]) -> list[float]:
    """Order statistics at index floor(q (n - 1)) (0.5: torch.median's lower median), with
    no size limit (torch.quantile refuses more than 2^24 values)."""
    ordered = values.flatten().sort().values
    return [ordered[int(q * (ordered.numel() - 1))].item() for q in quantiles]
