"""DP-AdamBC: Adam whose second moment is corrected for the DP noise.

Tang, Shpilevskiy and Lecuyer, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You
Apply Bias Correction)", AAAI 2024, arXiv 2312.14334 (code: ubc-systopia/DP-AdamBC).

Under DP the optimizer sees g_dp = g + N(0, s^2 I), s = sigma_p C / b, so Adam's second
moment estimates g^2 + s^2. Where s^2 dominates (most coordinates, as the DP-IVON-Gradsq
projected fraction shows) the denominator is about s everywhere and DP-Adam is DP-SGD with
learning rate lr / s. DP-AdamBC subtracts s^2 after Adam's bias correction and floors the
result at gamma' (``second_moment_floor``)::

    m_t = beta1 m + (1 - beta1) g_dp          m_hat = m_t / (1 - beta1^t)
    v_t = beta2 v + (1 - beta2) g_dp^2        v_hat = v_t / (1 - beta2^t)
    v_corr = max(v_hat - s^2, gamma')
    theta = theta - lr * m_hat / sqrt(v_corr)

The same correction as DP-IVON-Gradsq's, applied to an average over steps (its
``ema-corrected`` estimator) instead of to each step. There is no eps outside the square
root (the authors' code has none): gamma' plays its part, so with s = 0 and gamma' = 0 this
is torch.optim.Adam with eps = 0. Weight decay is torch.optim.Adam's (and the authors'):
delta * theta is added to g_dp before both moments; it is deterministic, so the noise
variance to subtract is unchanged. Every statistic is built from g_dp: no privacy cost.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dpivon.optim.rules import bias_corrected, ema_update


def noise_corrected_second_moment(
    second_moment: Tensor, noise_variance: float, floor: float
) -> Tensor:
    """v_corr = max(v_hat - s^2, gamma'): E[v_hat] = E[g^2] + s^2 once bias-corrected."""
    return (second_moment - noise_variance).clamp(min=floor)


def adambc_parameter_update(
    param: Tensor, first_moment: Tensor, second_moment: Tensor, lr: float
) -> Tensor:
    """theta = theta - lr * m_hat / sqrt(v_corr)."""
    return param - lr * first_moment / second_moment.sqrt()


class DPAdamBC(torch.optim.Optimizer):
    """DP-AdamBC on the privatised gradient that an Opacus ``DPOptimizer`` leaves in
    ``p.grad``; ``grad_noise_std`` is sigma_p * C / b, as for `DPIVON`.

    State per parameter, named as torch.optim.Adam's: ``step``, ``exp_avg`` (m_t),
    ``exp_avg_sq`` (v_t, uncorrected).
    """

    def __init__(
        self,
        params,
        lr: float,
        grad_noise_std: float,
        betas: tuple[float, float] = (0.9, 0.999),
        second_moment_floor: float = 1e-9,
        weight_decay: float = 0.0,
    ) -> None:
        checks = {
            "lr": lr >= 0.0,
            "grad_noise_std": grad_noise_std >= 0.0,
            "betas": all(0.0 <= beta < 1.0 for beta in betas),
            "second_moment_floor": second_moment_floor >= 0.0,
            "weight_decay": weight_decay >= 0.0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"invalid DP-AdamBC {name}: {locals()[name]!r}")
        defaults = dict(
            lr=lr, betas=betas, second_moment_floor=second_moment_floor, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        self.grad_noise_std = grad_noise_std
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].update(
                    step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                )

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        noise_variance = self.grad_noise_std**2
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                grad = p.grad + group["weight_decay"] * p
                state["step"] += 1
                state["exp_avg"] = ema_update(state["exp_avg"], grad, beta1)
                state["exp_avg_sq"] = ema_update(state["exp_avg_sq"], grad.square(), beta2)
                second_moment = noise_corrected_second_moment(
                    bias_corrected(state["exp_avg_sq"], beta2, state["step"]),
                    noise_variance,
                    group["second_moment_floor"],
                )
                p.copy_(
                    adambc_parameter_update(
                        p,
                        bias_corrected(state["exp_avg"], beta1, state["step"]),
                        second_moment,
                        group["lr"],
                    )
                )
        return loss


__all__ = [
    "DPAdamBC",
    "adambc_parameter_update",
    "noise_corrected_second_moment",
]
