"""IVON (Shen et al., ICML 2024), following the reference implementation ``ivon-opt``:
same constructor keywords, same ``sampled_params(train=...)`` protocol, same random draws for
a given seed. It collects raw gradients when ``sampled_params`` exits.

Posterior q(theta) = N(m, diag(s^2)) with s^2 = 1 / (ess * (h + delta)). One step:

1. draw theta = m + s * z for each of S Monte-Carlo samples, backprop there, restore m;
2. build a Hessian estimate h_hat from the gradients (``price`` or ``gradsq``);
3. momentum ``gbar``, Hessian ``h`` and mean ``m`` updates (`dpivon.optim.rules`).

The private variant is `dpivon.optim.dp_ivon.DPIVON`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

from dpivon.optim.registry import HESSIAN_ESTIMATORS
from dpivon.optim.rules import (
    DIAGNOSTIC_QUANTILES,
    curvature_horizon_share,
    effective_lr,
    ema_update,
    floored_hessian,
    gradsq_hessian,
    hessian_update,
    learned_curvature_share,
    lower_quantiles,
    mean_update,
    momentum_debias,
    posterior_std,
    price_hessian,
)


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
