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
``v_hat = max(g_dp^2 - sigma_p^2 C^2 / b^2, 0)``. The update rules are the pure
functions at the top of this file; the classes only move tensors in and out of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

HESSIAN_ESTIMATORS = ("price", "gradsq")


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


def noise_corrected_squared_gradient(squared_g_dp: Tensor, noise_variance: float) -> Tensor:
    """v_hat = max(g_dp^2 - Var[noise], 0): E[g_dp^2] = g^2 + Var[noise], so subtracting the
    injected variance removes its bias; the projection keeps the curvature non-negative."""
    return (squared_g_dp - noise_variance).clamp_(min=0.0)


def momentum_update(momentum: Tensor, grad: Tensor, beta1: float) -> Tensor:
    """gbar = beta1 * gbar + (1 - beta1) * g."""
    return beta1 * momentum + (1.0 - beta1) * grad


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
    return mean - lr * direction.clamp(min=-clip_radius, max=clip_radius)


def effective_lr(lr: float, hess_init: float, weight_decay: float, rescale_lr: bool) -> float:
    """With rescale_lr the first steps move by about lr, whatever hess_init is."""
    return lr * (hess_init + weight_decay) if rescale_lr else lr


def momentum_debias(beta1: float, step: int, debias: bool) -> float:
    return 1.0 - beta1**step if debias else 1.0


# --- optimizers ---------------------------------------------------------------------------


class IVON(torch.optim.Optimizer):
    """Improved Variational Online Newton; drop-in for ``ivon.IVON`` of ivon-opt.

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
                state = self.state[p]
                hess_estimate = self._hessian_estimate(group, p)
                state["momentum"] = momentum_update(
                    state["momentum"], state["avg_grad"], group["beta1"]
                )
                state["hess"] = hessian_update(
                    state["hess"], hess_estimate, group["beta2"], group["weight_decay"]
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
        self._samples_collected = 0
        return loss

    @torch.no_grad()
    def curvature_diagnostics(self) -> dict[str, float]:
        """Summary of the posterior: where h collapses, s = 1/sqrt(ess (h + delta)) blows up."""
        hess = torch.cat([self.state[p]["hess"].flatten() for _, p in self._params()])
        std = torch.cat(
            [
                posterior_std(self.state[p]["hess"], g["ess"], g["weight_decay"]).flatten()
                for g, p in self._params()
            ]
        )
        return {
            "hess_mean": hess.mean().item(),
            "hess_median": hess.median().item(),
            "posterior_std_median": std.median().item(),
        }


class DPIVON(IVON):
    """IVON on the privatised gradient ``g_dp`` that an Opacus ``DPOptimizer`` leaves in
    ``p.grad`` (clip each example to C, sum, add N(0, sigma_p^2 C^2), divide by the
    expected batch size b).

    ``grad_noise_std`` is sigma_p * C / b, the per-coordinate std of the injected noise.
    Estimators: ``gradsq`` with ``noise_correction=True`` is DP-IVON-Gradsq;
    ``noise_correction=False`` is its uncorrected ablation; ``price`` is DP-IVON with the
    reparameterised estimator g_dp * (theta - m) / s^2 (one MC sample: there is one g_dp).

    With S > 1 MC samples, each example's per-sample gradient is averaged over the samples
    *before* clipping, so one example still contributes at most C to the sum.
    """

    def __init__(
        self,
        params,
        lr: float,
        ess: float,
        grad_noise_std: float,
        noise_correction: bool = True,
        **ivon_kwargs,
    ) -> None:
        super().__init__(params, lr, ess, **ivon_kwargs)
        if grad_noise_std < 0:
            raise ValueError(f"grad_noise_std must be >= 0, got {grad_noise_std}")
        if self.hess_approx == "price" and self.mc_samples != 1:
            raise ValueError(
                "DP-IVON with the price estimator needs mc_samples=1: the "
                "private gradient is one average over all samples"
            )
        self.grad_noise_std = grad_noise_std
        self.noise_correction = noise_correction
        self.projected_fraction = 0.0

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
        projected, total = 0, 0
        for _, p in self._params():
            state = self.state[p]
            state.pop("grad_sample_sum", None)
            g_dp = p.grad if p.grad is not None else torch.zeros_like(p)
            state["avg_grad"] = g_dp
            if self.hess_approx == "price":
                state["avg_curvature_input"] = g_dp * state["noise"]
                continue
            squared = g_dp.square()
            if self.noise_correction:
                projected = projected + (squared <= noise_variance).sum()
                total += squared.numel()
            state["avg_curvature_input"] = noise_corrected_squared_gradient(squared, noise_variance)
        self.projected_fraction = float(projected) / total if total else 0.0

    def curvature_diagnostics(self) -> dict[str, float]:
        return {**super().curvature_diagnostics(), "projected_fraction": self.projected_fraction}


__all__ = [
    "DPIVON",
    "HESSIAN_ESTIMATORS",
    "IVON",
    "effective_lr",
    "gradsq_hessian",
    "hessian_update",
    "mean_update",
    "momentum_debias",
    "momentum_update",
    "noise_corrected_squared_gradient",
    "posterior_std",
    "price_hessian",
]
