"""DP-IVON-Gradsq's curvature estimators: each turns g_dp^2 and the public noise variance
s^2 = (sigma_p C / b)^2 into v_hat >= 0, the input of h_hat = ess * v_hat; and the
diagnostics that say how much of h is noise.

`estimate_curvature_input` runs the estimator a config names through its rule in
`dpivon.optim.registry.CURVATURE_ESTIMATORS` (name -> ``module:function``): adding an
estimator is one entry there and its rule, a function
``(squared_g_dp, noise_variance, state, settings) -> v_hat`` that may keep its own tensors in
``state`` (the parameter's optimizer state, so checkpoints carry them)."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dpivon.optim.registry import CURVATURE_ESTIMATORS
from dpivon.optim.rules import bias_corrected, ema_update

# E[max(Z^2 - 1, 0)] = 2 phi(1) for Z ~ N(0, 1): the mean of the per-step v_hat, in units of
# the noise variance, on a coordinate whose true gradient is 0.
CLAMPED_NOISE_MEAN = 2.0 * math.exp(-0.5) / math.sqrt(2.0 * math.pi)


@dataclass(frozen=True)
class CurvatureSettings:
    """What an estimator's rule may read beside g_dp^2 and s^2."""

    ema_rate: float  # ema-corrected: the rate of g_dp^2's moving average
    pool: str  # pooled and shrinkage: ``tensor`` or ``channel``
    step: int  # the step being taken, from 1


CurvatureRule = Callable[[Tensor, float, dict, CurvatureSettings], Tensor]


# Each maps g_dp^2 (and, for ema-corrected, its running average) to v_hat >= 0, the input of
# h_hat = ess * v_hat. All are post-processing of g_dp and the public noise level s^2 =
# (sigma_p C / b)^2: none costs privacy.


def noise_corrected_squared_gradient(squared_g_dp: Tensor, noise_variance: float) -> Tensor:
    """``per-step``: v_hat = max(g_dp^2 - Var[noise], 0). E[g_dp^2] = g^2 + Var[noise], so
    subtracting the injected variance removes its bias; the projection keeps the curvature
    non-negative, but on a coordinate without signal it leaves a mean of 0.484 s^2
    (``CLAMPED_NOISE_MEAN``): clamped noise, not curvature, then feeds h."""
    return (squared_g_dp - noise_variance).clamp_(min=0.0)


def ema_noise_corrected_squared_gradient(
    squared_ema: Tensor, noise_variance: float, rate: float, step: int
) -> Tensor:
    """``ema-corrected``: v_hat = max(a_t / (1 - rate^t) - s^2, 0), a_t the moving average
    of g_dp^2 (Adam's bias correction for its zero start, as in DP-AdamBC).

    Projecting *after* averaging: the average of g_dp^2 over about (1 + rate) / (1 - rate)
    steps has a noise std of s^2 * sqrt(2 (1 - rate) / (1 + rate)) (0.1 s^2 at rate 0.99)
    instead of sqrt(2) s^2, so the projection removes far less and the noise-only mean falls
    from 0.484 s^2 to about 0.04 s^2. The price: v_hat lags the gradient by the same window.
    """
    return noise_corrected_squared_gradient(bias_corrected(squared_ema, rate, step), noise_variance)


def pool_rows(values: Tensor, pool: str) -> Tensor:
    """``values`` as a (pools, coordinates per pool) matrix.

    ``tensor``: one pool per parameter tensor. ``channel``: one per output channel (a slice
    along dim 0) of a tensor with two or more dims; 1-D tensors (biases, norm scales) stay
    one pool, because a pool of one coordinate is the per-step estimator again.
    """
    if pool == "channel" and values.ndim >= 2:
        return values.reshape(values.shape[0], -1)
    return values.reshape(1, -1)


def pooled_noise_corrected_squared_gradient(
    squared_g_dp: Tensor, noise_variance: float, pool: str
) -> Tensor:
    """``pooled``: v_hat = max(mean_pool(g_dp^2) - s^2, 0), the same for every coordinate
    of a pool.

    The pool mean of p noise terms has std sqrt(2 / p) s^2, so the relative noise falls with
    sqrt(p) and a noise-only pool's mean v_hat with it (about 0.4 s^2 sqrt(2 / p)). The price:
    one curvature per pool, a diagonal preconditioner only across pools.
    """
    rows = pool_rows(squared_g_dp, pool)
    pooled = noise_corrected_squared_gradient(rows.mean(dim=1, keepdim=True), noise_variance)
    return pooled.expand_as(rows).reshape_as(squared_g_dp)


def shrunk_squared_gradient(squared_g_dp: Tensor, noise_variance: float, pool: str) -> Tensor:
    """``shrinkage``: v_hat_i = B (B g_dp,i^2 + s^2), B = max(1 - s^2 / mean_pool(g_dp^2), 0).

    The empirical-Bayes posterior mean of g_i^2 when the true gradients of a pool are
    N(0, tau^2) and tau^2 is estimated from the pool: g_i | g_dp ~ N(B g_dp,i, B s^2), so
    E[g_i^2 | g_dp] = B^2 g_dp,i^2 + B s^2. B is the positive-part James-Stein factor with p
    in place of p - 2, so that a pool of one coordinate gives exactly the per-step estimator
    and a pool's total equals the ``pooled`` estimator's; unlike ``pooled`` it keeps the
    differences between coordinates, shrunk by how much of the pool is noise. A noise-only
    pool has B near 0 instead of a hard 0/1 projection per coordinate.
    """
    rows = pool_rows(squared_g_dp, pool)
    mean = rows.mean(dim=1, keepdim=True)
    pooled = noise_corrected_squared_gradient(mean, noise_variance)
    shrink = torch.where(pooled > 0, pooled / mean, 0.0)  # pooled > 0 implies mean > 0
    return (shrink * (shrink * rows + noise_variance)).reshape_as(squared_g_dp)


# --- the registered rules (dpivon.optim.registry.CURVATURE_ESTIMATORS) --------------------


def per_step_rule(
    squared_g_dp: Tensor, noise_variance: float, state: dict, settings: CurvatureSettings
) -> Tensor:
    return noise_corrected_squared_gradient(squared_g_dp, noise_variance)


def ema_corrected_rule(
    squared_g_dp: Tensor, noise_variance: float, state: dict, settings: CurvatureSettings
) -> Tensor:
    average = state.get("grad_sq_ema", torch.zeros_like(squared_g_dp))  # Adam's zero start
    state["grad_sq_ema"] = ema_update(average, squared_g_dp, settings.ema_rate)
    return ema_noise_corrected_squared_gradient(
        state["grad_sq_ema"], noise_variance, settings.ema_rate, settings.step
    )


def pooled_rule(
    squared_g_dp: Tensor, noise_variance: float, state: dict, settings: CurvatureSettings
) -> Tensor:
    return pooled_noise_corrected_squared_gradient(squared_g_dp, noise_variance, settings.pool)


def shrinkage_rule(
    squared_g_dp: Tensor, noise_variance: float, state: dict, settings: CurvatureSettings
) -> Tensor:
    return shrunk_squared_gradient(squared_g_dp, noise_variance, settings.pool)


def curvature_rule(name: str) -> CurvatureRule:
    """The rule that ``name`` is registered with."""
    module, function = CURVATURE_ESTIMATORS[name].split(":")
    return getattr(importlib.import_module(module), function)


# --- how much of h is noise ---------------------------------------------------------------


def clamped_noise_share(hess: Tensor, noise_variance: float, ess: float) -> Tensor:
    """min(1, 0.484 s^2 ess / h): how much of h the per-step estimator's clamped noise alone
    would produce (its h_hat on a noise-only coordinate averages 0.484 s^2 ess). Near 1, h is
    no larger than noise would make it; the same yardstick for every estimator."""
    return (CLAMPED_NOISE_MEAN * ess * noise_variance / hess).clamp(max=1.0)


def gradient_snr(momentum: Tensor, noise_variance: float, beta1: float, step: int) -> Tensor:
    """Signal-to-noise ratio of one tensor's g_dp, from the moving average of g_dp itself.

    The momentum e_t = (1 - beta1) sum_k beta1^(t-k) g_dp,k of g_dp,k = g + noise_k has
    E[e_t] = (1 - beta1^t) g and, from the independent noise, variance
    v_e = s^2 (1 - beta1) (1 - beta1^(2t)) / (1 + beta1). So
    SNR = max(mean(e_t^2) - v_e, 0) / ((1 - beta1^t)^2 s^2) estimates mean(g^2) / s^2, the
    per-step ratio that decides whether g_dp^2 - s^2 can see the signal (below 1 it mostly
    cannot). "Signal" is everything in g_dp but the injected noise, minibatch sampling noise
    included; a gradient that changes within the ~1 / (1 - beta1) steps of the average is
    underestimated. NaN before the first step, inf without noise.
    """
    debias = 1.0 - beta1**step
    ema_noise = noise_variance * (1.0 - beta1) * (1.0 - beta1 ** (2 * step)) / (1.0 + beta1)
    signal = (momentum.square().mean() - ema_noise).clamp(min=0.0) / debias**2
    return signal / noise_variance
