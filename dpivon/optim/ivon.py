"""IVON and DP-IVON-Gradsq, top to bottom.

Posterior q(theta) = N(m, diag(s^2)) with s^2 = 1 / (ess * (h + delta)). One step:

1. draw theta = m + s * z for each of S Monte-Carlo samples, backprop there, restore m;
2. build a Hessian estimate h_hat from the gradients (``price`` or ``gradsq``);
3. momentum ``gbar``, Hessian ``h`` and mean ``m`` updates below.

`IVON` follows the reference implementation ``ivon-opt`` (Shen et al., ICML 2024): same
constructor keywords, same ``sampled_params(train=...)`` protocol, same random draws for a
given seed. It collects raw gradients when ``sampled_params`` exits.

`DPIVON` is the private variant (Jamoussi et al., 2026). It is wrapped by an Opacus
``DPOptimizer`` and builds *every* statistic in ``step()`` from ``p.grad``, which the
DPOptimizer has replaced by the clipped, noised mean gradient ``g_dp`` just before.
Its curvature is the noise-corrected squared gradient
``v_hat = max(g_dp^2 - sigma_p^2 C^2 / b^2, 0)`` (the paper's ``per-step`` estimator) or
one of the alternatives below that answer its collapse at strong privacy. The update rules
are the pure functions at the top of this file; the classes only move tensors in and out
of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import get_args

import torch
import torch.distributed as dist
from torch import Tensor

from dpivon.optim.registry import (
    CurvatureEstimator,
    CurvaturePool,
    HessianEstimator,
    check_price_samples,
)

HESSIAN_ESTIMATORS: tuple[str, ...] = get_args(HessianEstimator)
CURVATURE_ESTIMATORS: tuple[str, ...] = get_args(CurvatureEstimator)
CURVATURE_POOLS: tuple[str, ...] = get_args(CurvaturePool)
# E[max(Z^2 - 1, 0)] = 2 phi(1) for Z ~ N(0, 1): the mean of the per-step v_hat, in units of
# the noise variance, on a coordinate whose true gradient is 0.
CLAMPED_NOISE_MEAN = 2.0 * math.exp(-0.5) / math.sqrt(2.0 * math.pi)
DIAGNOSTIC_QUANTILES = (0.1, 0.9)


# --- update rules -------------------------------------------------------------------------


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


# --- curvature estimators of DP-IVON-Gradsq -----------------------------------------------
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


# --- diagnostics --------------------------------------------------------------------------


def lower_quantiles(values: Tensor, quantiles: Sequence[float]) -> list[float]:
    """Order statistics at index floor(q (n - 1)) (0.5: torch.median's lower median), with
    no size limit (torch.quantile refuses more than 2^24 values)."""
    ordered = values.flatten().sort().values
    return [ordered[int(q * (ordered.numel() - 1))].item() for q in quantiles]


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


# --- optimizers ---------------------------------------------------------------------------


class IVON(torch.optim.Optimizer):
    """Improved Variational Online Newton; drop-in for ``ivon.IVON`` of ivon-opt.

    ``hess_floor`` (not in ivon-opt; default 0 = none) keeps h >= hess_floor, see
    `floored_hessian`.

    Usage (the same as ivon-opt)::

        for x, y in loader:
            for _ in range(mc_samples):
                with optimizer.sampled_params(train=True):
                    optimizer.zero_grad()
                    loss_fn(model(x), y).backward()
            optimizer.step()
    """

    hessian_approx_methods = HESSIAN_ESTIMATORS

    def __init__(
        self,
        params,
        lr: float,
        ess: float,
        hess_init: float = 1.0,
        beta1: float = 0.9,
        beta2: float = 0.99999,
        weight_decay: float = 1e-4,
        mc_samples: int = 1,
        hess_approx: str = "price",
        clip_radius: float = float("inf"),
        sync: bool = False,
        debias: bool = True,
        rescale_lr: bool = True,
        hess_floor: float = 0.0,
    ) -> None:
        checks = {
            "lr": lr >= 0.0,
            "mc_samples": mc_samples >= 1,
            "weight_decay": weight_decay >= 0.0,
            "hess_init": hess_init > 0.0,
            "ess": ess > 0.0,
            "clip_radius": clip_radius > 0.0,
            "beta1": 0.0 <= beta1 <= 1.0,
            "beta2": 0.0 <= beta2 <= 1.0,
            "hess_approx": hess_approx in HESSIAN_ESTIMATORS,
            "hess_floor": hess_floor >= 0.0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"invalid IVON {name}: {locals()[name]!r}")
        defaults = dict(
            lr=lr,
            ess=ess,
            hess_init=hess_init,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            mc_samples=mc_samples,
            clip_radius=clip_radius,
            hess_floor=hess_floor,
        )
        super().__init__(params, defaults)
        self.mc_samples = mc_samples
        self.hess_approx = hess_approx
        self.sync = sync
        self.debias = debias
        self.rescale_lr = rescale_lr
        self.current_step = 0
        self._samples_collected = 0
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["momentum"] = torch.zeros_like(p)
                state["hess"] = torch.full_like(p, hess_init)

    def _params(self) -> Iterator[tuple[dict, Tensor]]:
        for group in self.param_groups:
            for p in group["params"]:
                yield group, p

    @torch.no_grad()
    def _sample_params(self) -> None:
        """Put theta = m + s * z into the parameters; keep m and z' = theta - m."""
        for group in self.param_groups:
            params = group["params"]
            # One draw per group, split per parameter: the same numbers as ivon-opt's
            # flat buffer for the same seed.
            z = torch.randn(
                sum(p.numel() for p in params), device=params[0].device, dtype=params[0].dtype
            )
            for p, z_p in zip(params, z.split([p.numel() for p in params]), strict=True):
                state = self.state[p]
                noise = z_p.view_as(p) * posterior_std(
                    state["hess"], group["ess"], group["weight_decay"]
                )
                state["mean"] = p.detach().clone()
                state["noise"] = noise
                p.add_(noise)

    @torch.no_grad()
    def _restore_mean(self) -> None:
        for _, p in self._params():
            p.copy_(self.state[p].pop("mean"))

    @contextmanager
    def sampled_params(self, train: bool = False) -> Iterator[None]:
        """Parameters hold a posterior sample inside the block and the mean after it.

        With ``train=True`` the gradient left in ``p.grad`` is collected for the next step.
        """
        self._sample_params()
        try:
            yield
        finally:
            self._restore_mean()
        if train:
            self._collect_sample()

    @torch.no_grad()
    def _collect_sample(self) -> None:
        """Running means over MC samples of g and of the estimator's input (g*z' or g^2)."""
        self._samples_collected += 1
        count = self._samples_collected
        for _, p in self._params():
            state = self.state[p]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            curvature_input = (
                state["noise"] * grad if self.hess_approx == "price" else grad.square()
            )
            if count == 1:
                state["avg_grad"] = grad.clone()
                state["avg_curvature_input"] = curvature_input
            else:
                state["avg_grad"].add_(grad - state["avg_grad"], alpha=1.0 / count)
                state["avg_curvature_input"].add_(
                    curvature_input - state["avg_curvature_input"], alpha=1.0 / count
                )

    def _hessian_estimate(self, group: dict, p: Tensor) -> Tensor:
        state = self.state[p]
        if self.hess_approx == "price":
            return price_hessian(
                state["avg_curvature_input"], state["hess"], group["ess"], group["weight_decay"]
            )
        return gradsq_hessian(state["avg_curvature_input"], group["ess"])

    def _sync_samples(self) -> None:
        world_size = dist.get_world_size()
        for _, p in self._params():
            for key in ("avg_grad", "avg_curvature_input"):
                dist.all_reduce(self.state[p][key])
                self.state[p][key].div_(world_size)

    def _require_sample(self) -> None:
        if self._samples_collected == 0:
            raise RuntimeError(
                "IVON.step() without a collected sample: run backward inside "
                "`with optimizer.sampled_params(train=True):` first"
            )

    def _prepare_statistics(self) -> None:
        """Hook for subclasses: fill ``avg_grad`` and ``avg_curvature_input`` per parameter."""
        self._require_sample()
        if self.sync and dist.is_initialized():
            self._sync_samples()

    def _update_parameter(self, group: dict, p: Tensor, lr: float, debias: float) -> None:
        """Momentum, Hessian and mean updates of one parameter tensor."""
        state = self.state[p]
        hess_estimate = self._hessian_estimate(group, p)
        state["momentum"] = ema_update(state["momentum"], state["avg_grad"], group["beta1"])
        state["hess"] = floored_hessian(
            hessian_update(state["hess"], hess_estimate, group["beta2"], group["weight_decay"]),
            group["hess_floor"],
        )
        p.copy_(
            mean_update(
                p,
                state["momentum"],
                state["hess"],
                lr,
                group["weight_decay"],
                group["clip_radius"],
                debias,
            )
        )
        del state["avg_grad"], state["avg_curvature_input"]

    def state_dict(self) -> dict:
        # The step count sets the momentum's debias term, so it belongs to the state: ivon-opt
        # leaves it out, and its resumed runs divide by the wrong term.
        return {**super().state_dict(), "current_step": self.current_step}

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        self.current_step = state_dict.pop("current_step")
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = sum(closure() for _ in range(self.mc_samples)) / self.mc_samples
        self._prepare_statistics()
        self.current_step += 1
        for group in self.param_groups:
            lr = effective_lr(
                group["lr"], group["hess_init"], group["weight_decay"], self.rescale_lr
            )
            debias = momentum_debias(group["beta1"], self.current_step, self.debias)
            for p in group["params"]:
                self._update_parameter(group, p, lr, debias)
        self._samples_collected = 0
        return loss

    @torch.no_grad()
    def curvature_diagnostics(self) -> dict[str, float]:
        """Summary of the posterior: where h collapses, s = 1/sqrt(ess (h + delta)) blows up.

        ``hess_mean``, ``hess_median``, ``hess_q10``, ``hess_q90`` of h and
        ``posterior_std_median``, ``posterior_std_q10``, ``posterior_std_q90`` of s, over all
        coordinates (quantiles are lower order statistics, see `lower_quantiles`); whether h
        learns: ``curvature_horizon_share`` (`curvature_horizon_share` at the step count, the
        most it can have learned) and ``curvature_learned_share_median``, ``_q10``, ``_q90``
        (`learned_curvature_share`, what it did).
        """
        hess = torch.cat([self.state[p]["hess"].flatten() for _, p in self._params()])
        decayed_init = torch.cat(
            [
                torch.full((p.numel(),), g["hess_init"] * g["beta2"] ** self.current_step)
                for g, p in self._params()
            ]
        ).to(hess)
        learned = learned_curvature_share(hess, decayed_init)
        learned_q10, learned_q90 = lower_quantiles(learned, DIAGNOSTIC_QUANTILES)
        horizon = max(
            curvature_horizon_share(g["beta2"], self.current_step) for g in self.param_groups
        )
        std = torch.cat(
            [
                posterior_std(self.state[p]["hess"], g["ess"], g["weight_decay"]).flatten()
                for g, p in self._params()
            ]
        )
        hess_q10, hess_q90 = lower_quantiles(hess, DIAGNOSTIC_QUANTILES)
        std_q10, std_q90 = lower_quantiles(std, DIAGNOSTIC_QUANTILES)
        return {
            "hess_mean": hess.mean().item(),
            "hess_median": hess.median().item(),
            "hess_q10": hess_q10,
            "hess_q90": hess_q90,
            "posterior_std_median": std.median().item(),
            "posterior_std_q10": std_q10,
            "posterior_std_q90": std_q90,
            "curvature_horizon_share": horizon,
            "curvature_learned_share_median": learned.median().item(),
            "curvature_learned_share_q10": learned_q10,
            "curvature_learned_share_q90": learned_q90,
        }


class DPIVON(IVON):
    """IVON on the privatised gradient ``g_dp`` that an Opacus ``DPOptimizer`` leaves in
    ``p.grad`` (clip each example to C, sum, add N(0, sigma_p^2 C^2), divide by the
    expected batch size b).

    ``grad_noise_std`` is sigma_p * C / b, the per-coordinate std of the injected noise.
    Estimators: ``gradsq`` with ``noise_correction=True`` is DP-IVON-Gradsq;
    ``noise_correction=False`` is its uncorrected ablation (s^2 taken as 0 in every curvature
    estimator); ``price`` is DP-IVON with the reparameterised estimator g_dp * (theta - m) /
    s^2 (one MC sample: there is one g_dp).

    ``curvature_estimator`` (gradsq only) turns g_dp^2 into v_hat, h_hat = ess * v_hat:
    ``per-step`` (the paper's, default), ``ema-corrected`` (moving-average rate
    ``curvature_ema``), ``pooled`` or ``shrinkage`` (over ``curvature_pool``: ``tensor`` or
    ``channel``); see the functions of the same names above. ``hess_floor`` (any estimator)
    keeps h >= hess_floor. All of them are post-processing of g_dp: no privacy cost.

    With S > 1 MC samples, each example's per-sample gradient is averaged over the samples
    *before* clipping, so one example still contributes at most C to the sum.

    ``curvature_diagnostics()`` keys (stable; training logs them every epoch), beyond IVON's
    h and posterior-std summaries:

    - ``projected_fraction``: share of coordinates whose v_hat is 0 (projected) in the last
      step; 0 without noise correction. Training reports its epoch mean.
    - ``curvature_update_share``: ||step - step_0|| / ||step|| for the last step, step_0 the
      same update with h = hess_init everywhere (with rescale_lr, momentum SGD at lr). 0 when
      curvature changes nothing; it exceeds 1 when a grown h shrinks the step below half of
      step_0. It costs a second mean update per tensor, so it is computed only for steps
      with ``track_update_share`` set (NaN for the others): training sets it on every tenth
      step and reports the mean of those.
    - ``clamped_noise_share_median``: median over coordinates of `clamped_noise_share`, the
      share of h that the per-step estimator's clamped noise alone would produce.
    - ``grad_snr_median``: median over parameter tensors of `gradient_snr`, mean(g^2) / s^2
      estimated from the momentum (the moving average of g_dp).
    """

    # The last step's diagnostics, and whether the next step measures
    # curvature_update_share (training sets it on every UPDATE_SHARE_EVERY-th step).
    projected_fraction: float = 0.0
    curvature_update_share: float = 0.0
    track_update_share: bool = True

    def __init__(
        self,
        params,
        lr: float,
        ess: float,
        grad_noise_std: float,
        noise_correction: bool = True,
        curvature_estimator: str = "per-step",
        curvature_ema: float = 0.99,
        curvature_pool: str = "tensor",
        **ivon_kwargs,
    ) -> None:
        super().__init__(params, lr, ess, **ivon_kwargs)
        if grad_noise_std < 0:
            raise ValueError(f"grad_noise_std must be >= 0, got {grad_noise_std}")
        check_price_samples(self.hess_approx, self.mc_samples)
        if curvature_estimator not in CURVATURE_ESTIMATORS:
            raise ValueError(
                f"curvature_estimator must be one of {CURVATURE_ESTIMATORS}, "
                f"got {curvature_estimator!r}"
            )
        if curvature_estimator != "per-step" and self.hess_approx != "gradsq":
            raise ValueError(f"curvature_estimator {curvature_estimator!r} needs gradsq")
        if not 0.0 <= curvature_ema < 1.0:
            raise ValueError(f"curvature_ema must be in [0, 1), got {curvature_ema}")
        if curvature_pool not in CURVATURE_POOLS:
            raise ValueError(f"curvature_pool must be one of {CURVATURE_POOLS}")
        self.grad_noise_std = grad_noise_std
        self.noise_correction = noise_correction
        self.curvature_estimator = curvature_estimator
        self.curvature_ema = curvature_ema
        self.curvature_pool = curvature_pool
        self._update_norms: list[Tensor] = []
        if curvature_estimator == "ema-corrected":
            for _, p in self._params():
                self.state[p]["grad_sq_ema"] = torch.zeros_like(p)

    @property
    def step_diagnostics(self) -> dict[str, float]:
        """The diagnostics of the last step alone (training averages them over an epoch);
        ``curvature_update_share`` only when that step tracked it."""
        if math.isnan(self.curvature_update_share):
            return {"projected_fraction": self.projected_fraction}
        return {
            "projected_fraction": self.projected_fraction,
            "curvature_update_share": self.curvature_update_share,
        }

    @torch.no_grad()
    def _sample_params(self) -> None:
        # Hide the running MC mean from Opacus until the next backward is done: Opacus
        # would stack it with the new per-example gradients as extra "examples" (or
        # refuse the second backward under Poisson sampling).
        for _, p in self._params():
            p.grad_sample = None
        super()._sample_params()

    @torch.no_grad()
    def _collect_sample(self) -> None:
        """Leave the MC mean of each example's gradient in ``p.grad_sample`` for clipping."""
        self._samples_collected += 1
        if self.mc_samples == 1:
            return
        for _, p in self._params():
            grad_sample = getattr(p, "grad_sample", None)
            if not isinstance(grad_sample, Tensor):
                continue
            state = self.state[p]
            if self._samples_collected == 1:
                state["grad_sample_sum"] = grad_sample  # a fresh tensor per backward: no copy
            else:
                state["grad_sample_sum"].add_(grad_sample)
            p.grad_sample = state["grad_sample_sum"] / self._samples_collected

    def _squared_gradient_estimate(
        self, state: dict, squared_g_dp: Tensor, noise_variance: float
    ) -> Tensor:
        """v_hat from g_dp^2 by the configured estimator (its state lives in ``state``)."""
        if self.curvature_estimator == "ema-corrected":
            state["grad_sq_ema"] = ema_update(
                state["grad_sq_ema"], squared_g_dp, self.curvature_ema
            )
            return ema_noise_corrected_squared_gradient(
                state["grad_sq_ema"], noise_variance, self.curvature_ema, self.current_step + 1
            )
        if self.curvature_estimator == "pooled":
            return pooled_noise_corrected_squared_gradient(
                squared_g_dp, noise_variance, self.curvature_pool
            )
        if self.curvature_estimator == "shrinkage":
            return shrunk_squared_gradient(squared_g_dp, noise_variance, self.curvature_pool)
        return noise_corrected_squared_gradient(squared_g_dp, noise_variance)

    def _prepare_statistics(self) -> None:
        """Every statistic from g_dp = p.grad, written by DPOptimizer.pre_step()."""
        self._require_sample()  # else price would reuse a stale noise draw
        noise_variance = self.grad_noise_std**2 if self.noise_correction else 0.0
        projected, total = 0, 0
        for _, p in self._params():
            state = self.state[p]
            state.pop("grad_sample_sum", None)
            g_dp = p.grad if p.grad is not None else torch.zeros_like(p)
            state["avg_grad"] = g_dp
            if self.hess_approx == "price":
                state["avg_curvature_input"] = g_dp * state["noise"]
                continue
            v_hat = self._squared_gradient_estimate(state, g_dp.square(), noise_variance)
            if self.noise_correction:
                projected = projected + (v_hat == 0).sum()
                total += v_hat.numel()
            state["avg_curvature_input"] = v_hat
        self.projected_fraction = float(projected) / total if total else 0.0

    def _update_parameter(self, group: dict, p: Tensor, lr: float, debias: float) -> None:
        """IVON's update, plus (when tracked) the squared norms of the step and of its
        difference to the step with h = hess_init (for ``curvature_update_share``)."""
        if not self.track_update_share:
            super()._update_parameter(group, p, lr, debias)
            return
        mean = p.clone()
        super()._update_parameter(group, p, lr, debias)
        reference = mean_update(
            mean,
            self.state[p]["momentum"],
            torch.full_like(p, group["hess_init"]),
            lr,
            group["weight_decay"],
            group["clip_radius"],
            debias,
        )
        self._update_norms.append(
            torch.stack([(p - mean).square().sum(), (p - reference).square().sum()])
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        self._update_norms = []
        loss = super().step(closure)
        self.curvature_update_share = math.nan
        if self.track_update_share:
            step_sq, difference_sq = torch.stack(self._update_norms).sum(dim=0).tolist()
            self.curvature_update_share = math.sqrt(difference_sq / step_sq) if step_sq else 0.0
        self._update_norms = []
        return loss

    @torch.no_grad()
    def curvature_diagnostics(self) -> dict[str, float]:
        noise_variance = self.grad_noise_std**2
        noise_share = torch.cat(
            [
                clamped_noise_share(self.state[p]["hess"], noise_variance, g["ess"]).flatten()
                for g, p in self._params()
            ]
        )
        step = self.current_step
        snr = torch.stack(
            [
                gradient_snr(self.state[p]["momentum"], noise_variance, g["beta1"], step)
                for g, p in self._params()
            ]
        )
        return {
            **super().curvature_diagnostics(),
            "projected_fraction": self.projected_fraction,
            "curvature_update_share": self.curvature_update_share,  # NaN: not tracked
            "clamped_noise_share_median": noise_share.median().item(),
            "grad_snr_median": snr.median().item(),
        }


__all__ = [
    "CLAMPED_NOISE_MEAN",
    "CURVATURE_ESTIMATORS",
    "CURVATURE_POOLS",
    "DPIVON",
    "HESSIAN_ESTIMATORS",
    "IVON",
    "beta2_for_horizon_share",
    "bias_corrected",
    "clamped_noise_share",
    "curvature_horizon_share",
    "effective_lr",
    "ema_noise_corrected_squared_gradient",
    "ema_update",
    "floored_hessian",
    "gradient_snr",
    "gradsq_hessian",
    "hessian_update",
    "learned_curvature_share",
    "lower_quantiles",
    "mean_update",
    "momentum_debias",
    "noise_corrected_squared_gradient",
    "pool_rows",
    "pooled_noise_corrected_squared_gradient",
    "posterior_std",
    "price_hessian",
    "shrunk_squared_gradient",
]
