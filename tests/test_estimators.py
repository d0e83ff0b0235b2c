"""DP-IVON-Gradsq's curvature estimators, the floor on h, and the training diagnostics.

Every estimator must be post-processing of g_dp (the property that makes it free of
privacy cost): DPIVON runs fed the same g_dp sequence must make identical updates whatever
the raw per-example gradients were. The estimator functions are checked against values
computed by hand, and their mean on a coordinate of pure noise against its known value.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from scipy import integrate, stats
from torch import nn

from dpivon.config import TrainConfig, parse_config
from dpivon.errors import DpivonError
from dpivon.optim.build import build_optimizer
from dpivon.optim.curvature import (
    CLAMPED_NOISE_MEAN,
    clamped_noise_share,
    ema_noise_corrected_squared_gradient,
    gradient_snr,
    noise_corrected_squared_gradient,
    pooled_noise_corrected_squared_gradient,
    shrunk_squared_gradient,
)
from dpivon.optim.dp_ivon import DPIVON
from dpivon.optim.registry import CURVATURE_ESTIMATORS
from dpivon.optim.rules import ema_update, floored_hessian, hessian_update, lower_quantiles
from dpivon.runs import train

DTYPE = torch.float64
ESTIMATOR_SETTINGS = {
    "per-step": dict(curvature_estimator="per-step"),
    "ema-corrected": dict(curvature_estimator="ema-corrected", curvature_ema=0.9),
    "pooled-tensor": dict(curvature_estimator="pooled", curvature_pool="tensor"),
    "pooled-channel": dict(curvature_estimator="pooled", curvature_pool="channel"),
    "shrinkage-tensor": dict(curvature_estimator="shrinkage", curvature_pool="tensor"),
    "shrinkage-channel": dict(curvature_estimator="shrinkage", curvature_pool="channel"),
    "per-step-floored": dict(curvature_estimator="per-step", hess_floor=0.3),
    "ema-corrected-floored": dict(curvature_estimator="ema-corrected", hess_floor=0.3),
}


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=DTYPE)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DTYPE)


def make_dpivon(params, **changes) -> DPIVON:
    """DP-IVON-Gradsq with the settings the tests below recompute by hand: lr 0.05, ess 50,
    s = 0.05, h_0 = 0.5, weight decay 1e-3 (``changes`` override them)."""
    settings = dict(lr=0.05, ess=50.0, grad_noise_std=0.05, hess_init=0.5, weight_decay=1e-3)
    return DPIVON(params, hess_approx="gradsq", **{**settings, **changes})


# --- the estimator functions against hand-computed values ---------------------------------


def test_per_step_estimator_projects_below_the_noise_floor():
    v = noise_corrected_squared_gradient(t([0.04, 0.01, 0.25]), 0.02)
    torch.testing.assert_close(v, t([0.02, 0.0, 0.23]), rtol=0, atol=1e-15)


def test_ema_corrected_estimator_by_hand():
    # rate 0.5: a1 = 0.5 g1^2, a2 = 0.5 a1 + 0.5 g2^2; debiased by 1 - 0.5^2 = 0.75.
    first, second = t([4.0, 1.0]), t([0.0, 9.0])
    ema = ema_update(torch.zeros(2, dtype=DTYPE), first, 0.5)
    torch.testing.assert_close(ema, t([2.0, 0.5]))
    v1 = ema_noise_corrected_squared_gradient(ema, 2.0, 0.5, step=1)  # debiased a1 = g1^2
    torch.testing.assert_close(v1, t([2.0, 0.0]))
    ema = ema_update(ema, second, 0.5)
    torch.testing.assert_close(ema, t([1.0, 4.75]))
    v2 = ema_noise_corrected_squared_gradient(ema, 2.0, 0.5, step=2)
    torch.testing.assert_close(v2, t([0.0, 4.75 / 0.75 - 2.0]))


def test_pooled_estimator_by_hand():
    squared = t([[1.0, 3.0], [5.0, 7.0]])
    torch.testing.assert_close(
        pooled_noise_corrected_squared_gradient(squared, 2.0, "tensor"),
        torch.full_like(squared, 2.0),
    )  # mean 4 - 2
    torch.testing.assert_close(
        pooled_noise_corrected_squared_gradient(squared, 2.0, "channel"),
        t([[0.0, 0.0], [4.0, 4.0]]),  # row means 2 and 6, minus 2, projected
    )
    # A 1-D tensor (a bias) is one pool under either level.
    for pool in ("tensor", "channel"):
        bias = pooled_noise_corrected_squared_gradient(t([1.0, 3.0]), 1.0, pool)
        torch.testing.assert_close(bias, t([1.0, 1.0]))


def test_shrinkage_estimator_by_hand():
    squared = t([[1.0, 3.0], [5.0, 7.0]])
    # tensor pool: mean 4, B = 1 - 2/4 = 0.5, v = B (B g^2 + s^2)
    expected = 0.5 * (0.5 * squared + 2.0)
    torch.testing.assert_close(shrunk_squared_gradient(squared, 2.0, "tensor"), expected)
    # channel pools: row 0 mean 2 (B = 0), row 1 mean 6 (B = 2/3)
    b = 2.0 / 3.0
    expected = t([[0.0, 0.0], [b * (b * 5 + 2), b * (b * 7 + 2)]])
    torch.testing.assert_close(shrunk_squared_gradient(squared, 2.0, "channel"), expected)
    # The pool's total is the pooled estimator's total ...
    for pool in ("tensor", "channel"):
        torch.testing.assert_close(
            shrunk_squared_gradient(squared, 2.0, pool).sum(),
            pooled_noise_corrected_squared_gradient(squared, 2.0, pool).sum(),
        )
    # ... a pool of one coordinate is the per-step estimator, and nothing is NaN at g = 0.
    column = t([[0.5], [3.0], [0.0]])
    torch.testing.assert_close(
        shrunk_squared_gradient(column, 1.0, "channel"),
        noise_corrected_squared_gradient(column, 1.0),
    )
    zeros = torch.zeros(2, 3, dtype=DTYPE)
    assert torch.equal(shrunk_squared_gradient(zeros, 0.0, "tensor"), zeros)


def test_floor_on_h():
    torch.testing.assert_close(floored_hessian(t([0.1, 0.5]), 0.2), t([0.2, 0.5]))
    below_zero = t([-1e-5, 0.5])  # price-IVON may dip below 0: floor 0 leaves it alone
    assert torch.equal(floored_hessian(below_zero, 0.0), below_zero)


def test_diagnostic_functions_by_hand():
    share = clamped_noise_share(t([1.0, 0.01, 1e-6]), 1e-4, ess=100.0)
    torch.testing.assert_close(share, t([0.0048394, 0.48394, 1.0]), rtol=1e-4, atol=0)
    # SNR: beta1 0.5, t 2: v_e = s^2 0.5 (1 - 0.5^4) / 1.5, debias (1 - 0.5^2)^2
    momentum, s2 = t([0.3, -0.1]), 0.04
    ema_noise = s2 * 0.5 * (1 - 0.5**4) / 1.5
    expected = (0.05 - ema_noise) / 0.75**2 / s2
    assert gradient_snr(momentum, s2, 0.5, 2).item() == pytest.approx(expected, rel=1e-12)
    assert gradient_snr(t([0.01, 0.0]), s2, 0.5, 2).item() == 0.0  # below the noise: 0
    values = torch.arange(10.0)[torch.randperm(10)]
    assert lower_quantiles(values, (0.1, 0.5, 0.9)) == [0.0, values.median().item(), 8.0]


# --- mean behaviour on pure noise and on a clear signal ------------------------------------


def _noise(steps, shape, std, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [std * torch.randn(shape, generator=gen, dtype=DTYPE) for _ in range(steps)]


def _final_estimate(name, g_dp_sequence, s2):
    """v_hat after the whole sequence (the EMA needs the history; the others the last g)."""
    if name == "ema-corrected":
        ema = torch.zeros_like(g_dp_sequence[0])
        for g in g_dp_sequence:
            ema = ema_update(ema, g.square(), 0.99)
        return ema_noise_corrected_squared_gradient(ema, s2, 0.99, len(g_dp_sequence))
    squared = g_dp_sequence[-1].square()
    if name == "pooled":
        return pooled_noise_corrected_squared_gradient(squared, s2, "channel")
    if name == "shrinkage":
        return shrunk_squared_gradient(squared, s2, "channel")
    return noise_corrected_squared_gradient(squared, s2)


def test_per_step_keeps_half_the_noise_variance_where_there_is_no_signal():
    """True g = 0: the projection leaves a mean of 2 phi(1) s^2 = 0.484 s^2, not 0; the
    estimators that average (over steps or over a pool) before projecting are near 0."""
    s = 0.1
    sequence = _noise(400, (100, 200), s)  # 20,000 coordinates, channel pools of 200
    per_step = _final_estimate("per-step", sequence, s**2).mean().item() / s**2
    # std of max(Z^2 - 1, 0) is about 1.2: the mean of 20,000 is within 0.01 of 0.484
    assert per_step == pytest.approx(CLAMPED_NOISE_MEAN, abs=0.03)
    assert abs(CLAMPED_NOISE_MEAN - 0.4839) < 1e-4
    # EMA of 0.99: noise std 0.1 s^2, mean of its positive part 0.04 s^2; pools of 200: 0.04
    for name in ("ema-corrected", "pooled", "shrinkage"):
        mean = _final_estimate(name, sequence, s**2).mean().item() / s**2
        assert mean < 0.08, name


@pytest.mark.parametrize("name", ["per-step", "ema-corrected", "pooled", "shrinkage"])
def test_estimators_find_a_clear_signal(name):
    """True g = 2 s on every coordinate: each estimate's mean is about g^2 = 4 s^2 (the naive
    g_dp^2 would read 5 s^2), so no estimator just returns zeros."""
    s = 0.1
    sequence = [2 * s + g for g in _noise(400, (100, 200), s, seed=1)]
    mean = _final_estimate(name, sequence, s**2).mean().item() / s**2
    assert mean == pytest.approx(4.0, rel=0.05)


# --- the post-processing property ----------------------------------------------------------


def _run_on_given_g_dp(settings, g_dp_sequence, data_seed):
    """DPIVON steps whose backward sees data drawn with ``data_seed`` (per-example gradients
    in p.grad_sample, raw mean in p.grad) but which are then given ``g_dp_sequence`` in p.grad,
    as a DPOptimizer would leave them."""
    model = GradSampleModule(make_model())
    opt = make_dpivon(model.parameters(), beta2=0.5, **settings)
    gen = torch.Generator().manual_seed(data_seed)
    torch.manual_seed(123)  # the posterior draws
    trajectory, raw = [], []
    for g_dp in g_dp_sequence:
        x = torch.randn(8, 4, generator=gen, dtype=DTYPE)
        y = torch.randint(0, 3, (8,), generator=gen)
        with opt.sampled_params(train=True):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
        params = list(model.parameters())
        raw.append(torch.cat([p.grad_sample.flatten() for p in params]))
        for p, g in zip(params, g_dp, strict=True):
            p.grad = g.clone()
        opt.step()
        state = [
            torch.cat([opt.state[p][k].flatten() for p in params]) for k in ("hess", "momentum")
        ]
        trajectory.append(torch.cat([torch.cat([p.detach().flatten() for p in params]), *state]))
    return torch.stack(trajectory), torch.stack(raw)


def _g_dp_sequence(seed, steps=4):
    gen = torch.Generator().manual_seed(seed)
    shapes = [p.shape for p in make_model().parameters()]
    return [
        [0.05 * torch.randn(s, generator=gen, dtype=DTYPE) + 0.03 for s in shapes]
        for _ in range(steps)
    ]


@pytest.mark.parametrize("settings", ESTIMATOR_SETTINGS.values(), ids=ESTIMATOR_SETTINGS.keys())
def test_estimators_are_post_processing_of_g_dp(settings):
    g_dp = _g_dp_sequence(seed=5)
    first, raw_first = _run_on_given_g_dp(settings, g_dp, data_seed=1)
    second, raw_second = _run_on_given_g_dp(settings, g_dp, data_seed=2)
    assert (raw_first - raw_second).abs().max() > 1e-2  # the raw gradients differed
    assert torch.equal(first, second)


def test_estimators_differ_and_the_floor_holds():
    """The same g_dp gives each estimator its own h (so the post-processing test above is
    not vacuous), and another g_dp sequence other updates."""
    g_dp = _g_dp_sequence(seed=5)
    other, _ = _run_on_given_g_dp({}, _g_dp_sequence(seed=6), data_seed=1)
    assert (other[-1] - _run_on_given_g_dp({}, g_dp, data_seed=1)[0][-1]).abs().max() > 1e-3
    finals = {
        k: _run_on_given_g_dp(v, g_dp, data_seed=1)[0][-1] for k, v in ESTIMATOR_SETTINGS.items()
    }
    n_params = sum(p.numel() for p in make_model().parameters())
    hess = {k: v[n_params : 2 * n_params] for k, v in finals.items()}
    names = [k for k in hess if "floored" not in k]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert (hess[a] - hess[b]).abs().max() > 1e-6, (a, b)
    assert hess["per-step-floored"].min() >= 0.3 and hess["per-step"].min() < 0.3


# --- diagnostics ------------------------------------------------------------------------


def _dpivon_after_steps(g_dp_sequence, beta2):
    model = make_model()
    opt = make_dpivon(model.parameters(), beta2=beta2)
    torch.manual_seed(0)
    for g_dp in g_dp_sequence:
        with opt.sampled_params(train=True):
            pass
        before = [p.detach().clone() for p in model.parameters()]
        for p, g in zip(model.parameters(), g_dp, strict=True):
            p.grad = g.clone()
        opt.step()
    return opt, model, before


def test_curvature_update_share_against_its_definition():
    g_dp = _g_dp_sequence(seed=5)
    opt, _, _ = _dpivon_after_steps(g_dp, beta2=1.0)  # h never leaves hess_init
    assert opt.curvature_diagnostics()["curvature_update_share"] == 0.0

    opt, model, before = _dpivon_after_steps(g_dp, beta2=0.5)
    group = opt.param_groups[0]
    lr = group["lr"] * (group["hess_init"] + group["weight_decay"])
    debias = 1 - group["beta1"] ** len(g_dp)
    steps, differences = [], []
    for p, mean in zip(model.parameters(), before, strict=True):
        direction = opt.state[p]["momentum"] / debias + group["weight_decay"] * mean
        reference = -lr * direction / (group["hess_init"] + group["weight_decay"])
        steps.append((p.detach() - mean).flatten())
        differences.append((p.detach() - mean - reference).flatten())
    expected = torch.cat(differences).norm() / torch.cat(steps).norm()
    share = opt.curvature_diagnostics()["curvature_update_share"]
    assert share == pytest.approx(expected.item(), rel=1e-9) and share > 0.05


def test_dpivon_diagnostics_against_numpy():
    """Each diagnostic recomputed in numpy from the optimizer's state and the settings of
    `_dpivon_after_steps` (ess 50, weight decay 1e-3, s = 0.05); the clamped-noise mean
    E[max(Z^2 - 1, 0)] by numerical integration."""
    g_dp = _g_dp_sequence(seed=5)
    opt, _, _ = _dpivon_after_steps(g_dp, beta2=0.5)
    d = opt.curvature_diagnostics()
    params = opt.param_groups[0]["params"]
    hess = np.concatenate([opt.state[p]["hess"].numpy().ravel() for p in params])
    assert len(hess) % 2 == 1  # odd: numpy's median is torch's lower median
    std = 1 / np.sqrt(50.0 * (hess + 1e-3))
    for name, values in (("hess", hess), ("posterior_std", std)):
        q10, q90 = np.quantile(values, [0.1, 0.9], method="lower")
        got = [d[f"{name}_q10"], d[f"{name}_median"], d[f"{name}_q90"]]
        assert got == pytest.approx([q10, np.median(values), q90], rel=1e-12), name
    assert d["hess_mean"] == pytest.approx(hess.mean(), rel=1e-12)
    clamped_mean = 2 * integrate.quad(lambda z: (z * z - 1) * stats.norm.pdf(z), 1, np.inf)[0]
    share = np.minimum(clamped_mean * 50.0 * 0.05**2 / hess, 1.0)
    assert 0 < np.median(share) < 1
    assert d["clamped_noise_share_median"] == pytest.approx(np.median(share), rel=1e-8)
    last = np.concatenate([g.numpy().ravel() for g in g_dp[-1]])
    projected = np.mean(last**2 <= 0.05**2)  # v_hat = max(g_dp^2 - s^2, 0) is 0 there
    assert 0 < projected < 1 and d["projected_fraction"] == pytest.approx(projected, rel=1e-12)


def test_gradient_snr_sees_signal_and_pure_noise():
    """mean(g^2) / s^2 from the moving average of g_dp alone: 0 for pure noise, 9 for a
    gradient of 3 s (2,000 coordinates: the estimate is within about 0.05 of the truth)."""
    s, steps = 0.05, 40
    for signal, low, high in ((0.0, 0.0, 0.05), (3 * s, 8.7, 9.3)):
        momentum = torch.zeros(50, 40, dtype=DTYPE)
        for g in _noise(steps, (50, 40), s):
            momentum = ema_update(momentum, signal + g, 0.9)
        snr = gradient_snr(momentum, s**2, 0.9, steps).item()
        assert low <= snr <= high, (signal, snr)


# --- configuration and training ------------------------------------------------------------


def test_config_fills_and_checks_the_estimator_options():
    config = TrainConfig(optimizer="dp-ivon-gradsq", dataset="synthetic")
    assert (
        config.optimizer.curvature_estimator,
        config.optimizer.curvature_pool,
        config.optimizer.hess_floor,
    ) == (
        "per-step",
        "tensor",
        0.0,
    )
    assert "curvature_estimator" not in type(TrainConfig(optimizer="dp-sgd").optimizer).model_fields
    for bad, match in (
        ({"optimizer": "dp-sgd", "curvature_estimator": "pooled"}, "does not apply to dp-sgd"),
        ({"optimizer": "dp-ivon", "curvature_pool": "channel"}, "does not apply to dp-ivon"),
        ({"curvature_estimator": "median"}, "curvature_estimator"),
        ({"curvature_ema": 1.0}, r"curvature_ema must be in \[0, 1\)"),
        ({"hess_floor": -1.0}, "hess_floor must be in \\[0, 1e\\+06\\]"),
    ):
        with pytest.raises(DpivonError, match=match):
            parse_config(bad)
    built = build_optimizer(
        TrainConfig(
            optimizer="dp-ivon-gradsq-uncorrected",
            curvature_estimator="shrinkage",
            curvature_pool="channel",
            hess_floor=0.01,
        ).optimizer,
        make_model().parameters(),
        dataset_size=100,
        grad_noise_std=0.1,
    )
    assert (built.curvature_estimator, built.curvature_pool) == ("shrinkage", "channel")
    assert built.param_groups[0]["hess_floor"] == 0.01 and not built.noise_correction


def test_training_reports_the_diagnostics_and_respects_the_floor():
    config = parse_config(
        {
            "dataset": "synthetic",
            "synthetic_size": 300,
            "model": "small-cnn",
            "batch_size": 64,
            "epochs": 1,
            "bma_samples": 2,
            "optimizer": "dp-ivon-gradsq",
            "curvature_estimator": "ema-corrected",
            "hess_floor": 0.4,
            "beta2": 0.9,
        }
    )
    (metrics,) = train(config, evaluate_test=False).history
    # every diagnostic DPIVON defines (test_optim pins their names), logged and finite
    for key in make_dpivon(make_model().parameters()).curvature_diagnostics():
        assert math.isfinite(metrics[key]), key
    assert metrics["hess_q10"] >= 0.4
    assert 0.0 < metrics["projected_fraction"] < 1.0


def constant_curvature_rule(squared_g_dp, noise_variance, state, settings) -> torch.Tensor:
    """A toy estimator: v_hat = 4 everywhere, counting its calls in the optimizer state."""
    state["toy_calls"] = state.get("toy_calls", 0) + 1
    return torch.full_like(squared_g_dp, 4.0)


def test_a_curvature_estimator_is_one_entry_in_one_table(monkeypatch):
    unknown = {"dataset": "synthetic", "optimizer": "dp-ivon-gradsq", "epsilon": 8.0}
    with pytest.raises(DpivonError, match="unknown curvature estimator 'toy'"):
        parse_config({**unknown, "curvature_estimator": "toy"})
    monkeypatch.setitem(CURVATURE_ESTIMATORS, "toy", f"{__name__}:constant_curvature_rule")
    config = parse_config(
        {
            **unknown, "synthetic_size": 300, "epochs": 1, "batch_size": 32, "bma_samples": 2,
            "device": "cpu", "curvature_estimator": "toy", "beta2": 0.5, "hess_init": 0.1,
        }
    )  # fmt: skip
    result = train(config, evaluate_test=False)
    # v_hat = 4 whatever the gradients: h follows IVON's recursion from hess_init with
    # h_hat = 4 ess at every step, ess the training-set size (300 images less 30 validation)
    expected = torch.tensor([0.1])
    for _ in range(config.planned_steps):
        expected = hessian_update(expected, torch.tensor([4.0 * 270]), 0.5, 2e-4)
    assert config.optimizer.weight_decay == 2e-4
    assert result.history[-1]["hess_median"] == pytest.approx(expected.item(), rel=1e-5)
