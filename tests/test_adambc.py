"""DP-AdamBC against the paper's equations, against torch.optim.Adam, under a real Opacus
DPOptimizer, and end to end through `dpivon.runs.train`."""

from __future__ import annotations

import math
from copy import deepcopy

import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

from dpivon.config import PRIVATE_OPTIMIZERS, TrainConfig, parse_config
from dpivon.errors import DpivonError
from dpivon.optim.adambc import DPAdamBC
from dpivon.optim.build import build_optimizer
from dpivon.runs import load_data, train

DTYPE = torch.float64


def paper_steps(theta, grads, *, lr, beta1, beta2, noise_variance, floor, weight_decay):
    """Tang et al.'s update, one coordinate at a time in Python floats: the states
    (m_t, v_t) and parameters after every step, and whether the floor gamma' was used."""
    m = [0.0] * len(theta)
    v = [0.0] * len(theta)
    history = []
    for t, grad in enumerate(grads, start=1):
        floored = []
        for i, g in enumerate(grad):
            g = g + weight_decay * theta[i]
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            m_hat, v_hat = m[i] / (1 - beta1**t), v[i] / (1 - beta2**t)
            v_corr = max(v_hat - noise_variance, floor)
            floored.append(v_hat - noise_variance < floor)
            theta[i] = theta[i] - lr * m_hat / math.sqrt(v_corr)
        history.append((list(m), list(v), list(theta), floored))
    return history


def test_two_steps_match_the_paper_by_hand():
    theta0 = [1.0, -2.0, 0.0]
    grads = [[0.1, -0.2, 0.03], [0.3, 0.1, -0.01]]
    settings = dict(lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1)
    noise_std, floor = 0.05, 1e-4
    expected = paper_steps(
        list(theta0), grads, noise_variance=noise_std**2, floor=floor, **settings
    )
    # Both branches of max(v_hat - s^2, gamma') are exercised.
    assert expected[0][3] == [False, False, True]

    param = nn.Parameter(torch.tensor(theta0, dtype=DTYPE))
    opt = DPAdamBC(
        [param],
        lr=settings["lr"],
        grad_noise_std=noise_std,
        betas=(settings["beta1"], settings["beta2"]),
        second_moment_floor=floor,
        weight_decay=settings["weight_decay"],
    )
    for step, (grad, (m, v, theta, _)) in enumerate(zip(grads, expected, strict=True), start=1):
        param.grad = torch.tensor(grad, dtype=DTYPE)
        opt.step()
        state = opt.state[param]
        assert state["step"] == step
        torch.testing.assert_close(
            state["exp_avg"], torch.tensor(m, dtype=DTYPE), rtol=1e-12, atol=0
        )
        torch.testing.assert_close(
            state["exp_avg_sq"], torch.tensor(v, dtype=DTYPE), rtol=1e-12, atol=0
        )
        torch.testing.assert_close(
            param.detach(), torch.tensor(theta, dtype=DTYPE), rtol=1e-12, atol=1e-15
        )


def _trajectory(opt_factory, grads):
    param = nn.Parameter(torch.linspace(-1.0, 1.0, grads[0].numel(), dtype=DTYPE))
    opt = opt_factory([param])
    out = []
    for g in grads:
        param.grad = g.clone()
        opt.step()
        out.append(
            (
                param.detach().clone(),
                opt.state[param]["exp_avg"].clone(),
                opt.state[param]["exp_avg_sq"].clone(),
            )
        )
    return out


def test_without_noise_and_floor_it_is_adam_with_eps_zero():
    """s = 0, gamma' = 0: v_corr = v_hat and the update is torch.optim.Adam's with eps 0.
    With Adam's default eps the one difference is where eps sits: Adam divides by
    sqrt(v_hat) + eps (outside the root), DP-AdamBC by sqrt(max(v_hat - s^2, gamma')), so on
    the first step Adam moves by lr |g| / (|g| + eps) and DP-AdamBC by exactly lr."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, generator=gen, dtype=DTYPE) * 0.1 for _ in range(5)]
    ours = _trajectory(
        lambda p: DPAdamBC(
            p, lr=0.01, grad_noise_std=0.0, second_moment_floor=0.0, weight_decay=0.05
        ),
        grads,
    )
    adam = _trajectory(lambda p: torch.optim.Adam(p, lr=0.01, eps=0.0, weight_decay=0.05), grads)
    for (p, m, v), (p_ref, m_ref, v_ref) in zip(ours, adam, strict=True):
        torch.testing.assert_close(p, p_ref, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(m, m_ref, rtol=1e-12, atol=0)
        torch.testing.assert_close(v, v_ref, rtol=1e-12, atol=0)

    eps = 1e-8
    adam_eps = _trajectory(
        lambda p: torch.optim.Adam(p, lr=0.01, eps=eps, weight_decay=0.05), grads
    )
    start = torch.linspace(-1.0, 1.0, 7, dtype=DTYPE)
    g1 = (grads[0] + 0.05 * start).abs()
    ours_step, adam_step = (ours[0][0] - start).abs(), (adam_eps[0][0] - start).abs()
    torch.testing.assert_close(ours_step, torch.full_like(start, 0.01), rtol=1e-12, atol=0)
    torch.testing.assert_close(adam_step, 0.01 * g1 / (g1 + eps), rtol=1e-12, atol=0)
    assert (ours_step - adam_step).abs().max() > 0  # the placement does show


def test_noise_correction_uses_the_dpoptimizer_gradient_and_noise_level():
    torch.manual_seed(0)
    model = GradSampleModule(nn.Sequential(nn.Linear(4, 3)).to(DTYPE))
    noise_multiplier, clip, batch = 1.0, 0.01, 16
    noise_std = noise_multiplier * clip / batch
    lr, floor, beta1, beta2 = 1e-3, 1e-9, 0.9, 0.999
    opt = DPAdamBC(
        model.parameters(),
        lr=lr,
        grad_noise_std=noise_std,
        betas=(beta1, beta2),
        second_moment_floor=floor,
    )
    dp_opt = DPOptimizer(
        opt, noise_multiplier=noise_multiplier, max_grad_norm=clip, expected_batch_size=batch
    )
    x = torch.randn(batch, 4, dtype=DTYPE)
    y = torch.randint(0, 3, (batch,))
    start = [p.detach().clone() for p in model.parameters()]
    dp_opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    raw = [p.grad.clone() for p in model.parameters()]
    dp_opt.step()
    corrected = []
    for p, p0, g_raw in zip(model.parameters(), start, raw, strict=True):
        g_dp = p.grad  # what DPOptimizer.pre_step left there
        assert (g_dp - g_raw).norm() > 0.5 * g_raw.norm()  # noise dominates the raw gradient
        state = opt.state[p]
        torch.testing.assert_close(state["exp_avg"], (1 - beta1) * g_dp, rtol=1e-12, atol=0)
        torch.testing.assert_close(state["exp_avg_sq"], (1 - beta2) * g_dp**2, rtol=1e-12, atol=0)
        v_corr = (g_dp**2 - noise_std**2).clamp(min=floor)
        torch.testing.assert_close(
            p.detach(), p0 - lr * g_dp / v_corr.sqrt(), rtol=1e-12, atol=1e-15
        )
        corrected.append((g_dp**2 > noise_std**2).double().mean())
    assert 0 < torch.stack(corrected).mean() < 1  # the subtraction bites on some coordinates


def test_config_and_registry():
    assert "dp-adambc" in PRIVATE_OPTIMIZERS
    config = TrainConfig(optimizer="dp-adambc", dataset="synthetic", beta2=0.99)
    assert (
        config.is_private
        and config.optimizer.second_moment_floor == 1e-9
        and config.optimizer.lr == 5e-6
    )
    opt = build_optimizer(
        config.optimizer, nn.Linear(2, 2).parameters(), dataset_size=100, grad_noise_std=0.25
    )
    assert type(opt) is DPAdamBC and opt.grad_noise_std == 0.25
    group = opt.param_groups[0]
    assert group["betas"] == (0.9, 0.99) and group["second_moment_floor"] == 1e-9
    for bad, match in (
        ({"optimizer": "dp-adam", "second_moment_floor": 1e-8}, "does not apply to dp-adam"),
        (
            {"optimizer": "dp-adambc", "second_moment_floor": 0.0},
            r"second_moment_floor must be in \(0, 1e\+06\]",
        ),
        ({"optimizer": "dp-adambc", "curvature_estimator": "pooled"}, "does not apply"),
    ):
        with pytest.raises(DpivonError, match=match):
            parse_config(bad)


def test_trains_privately_end_to_end():
    """Through `train`: with the whole training set in every batch (sample rate 1) each epoch
    is one step, so the checkpoints after epochs 1 and 2 hold the second step's input and
    output. That step must be the paper's, with s = sigma C / b from the run's own plan."""
    n_train = len(load_data(parse_config({"dataset": "synthetic", "synthetic_size": 300})).train)
    lr, (beta1, beta2), floor = 1e-4, (0.9, 0.999), 1e-9
    config = parse_config(
        {
            "dataset": "synthetic",
            "synthetic_size": 300,
            "model": "small-cnn",
            "epochs": 2,
            "batch_size": n_train,
            "optimizer": "dp-adambc",
            "lr": lr,
            "epsilon": 2.0,
        }
    )
    saved = {}
    result = train(
        config,
        evaluate_test=False,
        on_epoch_end=lambda report: saved.update({report.epoch: deepcopy(report.checkpoint())}),
    )
    plan = result.privacy
    assert plan.sample_rate == 1.0 and result.steps == 2 and plan.noise_multiplier > 0
    assert 2.0 - 0.05 <= result.epsilon_spent <= 2.0
    noise_variance = (plan.noise_multiplier * plan.max_grad_norm / n_train) ** 2
    branches = []
    for i, (name, _) in enumerate(result.model.named_parameters()):
        (m1, v1), (m2, v2) = (
            [saved[e]["optimizer"]["state"][i][k].double() for k in ("exp_avg", "exp_avg_sq")]
            for e in (1, 2)
        )
        g2 = (m2 - beta1 * m1) / (1 - beta1)  # the second step's g_dp
        torch.testing.assert_close(v2, beta2 * v1 + (1 - beta2) * g2**2, rtol=1e-5, atol=0)
        v_hat = v2 / (1 - beta2**2)
        # v_hat - s^2 within 0.1% of s^2 cancels in float32: left out
        kept = (v_hat - noise_variance).abs() > 1e-3 * noise_variance
        expected = -lr * (m2 / (1 - beta1**2)) / (v_hat - noise_variance).clamp(min=floor).sqrt()
        step = saved[2]["model"][name].double() - saved[1]["model"][name].double()
        torch.testing.assert_close(step[kept], expected[kept], rtol=1e-3, atol=1e-6)
        branches.append((v_hat[kept] > noise_variance).double().mean())
    assert 0 < torch.stack(branches).mean() < 1  # both the subtraction and the floor are used
