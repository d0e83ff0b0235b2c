"""DP-IVON (Jamoussi et al., 2026): `IVON` wrapped by an Opacus ``DPOptimizer``, building
*every* statistic in ``step()`` from ``p.grad``, which the DPOptimizer has replaced by the
clipped, noised mean gradient ``g_dp`` just before. Its curvature is the noise-corrected
squared gradient ``v_hat = max(g_dp^2 - sigma_p^2 C^2 / b^2, 0)`` (the paper's ``per-step``
estimator) or one of the alternatives in `dpivon.optim.curvature` that answer its collapse
at strong privacy.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from dpivon.optim.curvature import (
    CurvatureSettings,
    clamped_noise_share,
    curvature_rule,
    gradient_snr,
)
from dpivon.optim.ivon import IVON
from dpivon.optim.registry import CURVATURE_ESTIMATORS, CURVATURE_POOLS, check_price_samples
from dpivon.optim.rules import mean_update


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
    ``channel``); see `dpivon.optim.curvature`. ``hess_floor`` (any estimator)
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
                f"curvature_estimator must be one of {tuple(CURVATURE_ESTIMATORS)}, "
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
        self._curvature_rule = curvature_rule(curvature_estimator)
        self._update_norms: list[Tensor] = []

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

    def _prepare_statistics(self) -> None:
        """Every statistic from g_dp = p.grad, written by DPOptimizer.pre_step()."""
        self._require_sample()  # else price would reuse a stale noise draw
        noise_variance = self.grad_noise_std**2 if self.noise_correction else 0.0
        settings = CurvatureSettings(self.curvature_ema, self.curvature_pool, self.current_step + 1)
        projected, total = 0, 0
        for _, p in self._params():
            state = self.state[p]
            state.pop("grad_sample_sum", None)
            g_dp = p.grad if p.grad is not None else torch.zeros_like(p)
            state["avg_grad"] = g_dp
            if self.hess_approx == "price":
                state["avg_curvature_input"] = g_dp * state["noise"]
                continue
            v_hat = self._curvature_rule(g_dp.square(), noise_variance, state, settings)
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
