"""IVON / DPIVON against the reference ivon-opt and against real Opacus DPOptimizers.

Equivalence checks run in float64 so that tolerances can be tight: two implementations of
the same update then agree to ~1e-12, and any real difference (a wrong estimator, the raw
instead of the private gradient, a missing debias) is many orders of magnitude larger.
"""

import math

import ivon
import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

from dpivon.config import OPTIMIZER_NAMES, TrainConfig
from dpivon.optim.adambc import DPAdamBC
from dpivon.optim.build import build_optimizer
from dpivon.optim.dp_ivon import DPIVON
from dpivon.optim.ivon import IVON
from dpivon.optim.rules import gradsq_hessian, mean_update

DTYPE = torch.float64
N_IN, N_HIDDEN, N_OUT = 4, 6, 3


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(N_IN, N_HIDDEN), nn.Tanh(), nn.Linear(N_HIDDEN, N_OUT)).to(DTYPE)


def noise_std(noise_multiplier, max_grad_norm, expected_batch_size):
    """Per-coordinate std of the noise Opacus adds to the mean gradient: sigma_p C / b."""
    return noise_multiplier * max_grad_norm / expected_batch_size


def make_batches(n_batches, batch_size=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch_size, N_IN, generator=gen, dtype=DTYPE),
            torch.randint(0, N_OUT, (batch_size,), generator=gen),
        )
        for _ in range(n_batches)
    ]


def flat(tensors):
    return torch.cat([t.detach().flatten() for t in tensors])


def ours_state(opt, key):
    return flat(opt.state[p][key] for p in opt.param_groups[0]["params"])


def ivon_step(opt, model, x, y, mc_samples, zero_grad=None):
    """One IVON step with the ivon-opt protocol; ``zero_grad`` lets a DPOptimizer clear."""
    zero_grad = zero_grad or opt.zero_grad
    for _ in range(mc_samples):
        with opt.sampled_params(train=True):
            zero_grad()
            F.cross_entropy(model(x), y).backward()


def run_reference(kwargs, batches, seed):
    """ivon-opt: parameters, flat Hessian and flat momentum after every step."""
    model = make_model()
    opt = ivon.IVON(model.parameters(), **kwargs)
    torch.manual_seed(seed)
    trajectory = []
    for x, y in batches:
        ivon_step(opt, model, x, y, kwargs.get("mc_samples", 1))
        opt.step()
        group = opt.param_groups[0]
        trajectory.append(
            (flat(model.parameters()), group["hess"].clone(), group["momentum"].clone())
        )
    return trajectory


def run_ours(kwargs, batches, seed, optimizer_class=IVON):
    """``optimizer_class`` (dpivon's IVON, or a variant) over ``batches``: the trajectory of
    (parameters, h, momentum) after each step, and the optimizer."""
    model = make_model()
    opt = optimizer_class(model.parameters(), **kwargs)
    torch.manual_seed(seed)
    trajectory = []
    for x, y in batches:
        ivon_step(opt, model, x, y, kwargs.get("mc_samples", 1))
        opt.step()
        trajectory.append(
            (flat(model.parameters()), ours_state(opt, "hess"), ours_state(opt, "momentum"))
        )
    return trajectory, opt


def assert_trajectories_match(ours, reference, atol=1e-6):
    assert len(ours) == len(reference)
    for step, ((p, h, m), (p_ref, h_ref, m_ref)) in enumerate(zip(ours, reference, strict=True)):
        torch.testing.assert_close(p, p_ref, atol=atol, rtol=0, msg=f"params, step {step}")
        torch.testing.assert_close(h, h_ref, atol=atol, rtol=1e-6, msg=f"hess, step {step}")
        torch.testing.assert_close(m, m_ref, atol=atol, rtol=0, msg=f"momentum, step {step}")


# --- 1. IVON follows ivon-opt -------------------------------------------------------------


@pytest.mark.parametrize("hess_approx", ["price", "gradsq"])
@pytest.mark.parametrize("mc_samples", [1, 2])
def test_ivon_matches_ivon_opt_step_for_step(hess_approx, mc_samples):
    kwargs = dict(
        lr=0.1,
        ess=32.0,
        hess_init=0.5,
        beta2=0.9,
        weight_decay=1e-3,
        mc_samples=mc_samples,
        hess_approx=hess_approx,
    )
    batches = make_batches(6)
    reference = run_reference(kwargs, batches, seed=7)
    ours, _ = run_ours(kwargs, batches, seed=7)
    assert_trajectories_match(ours, reference)
    # The comparison is not vacuous: the Hessian moved away from hess_init, and the
    # trajectory depends on the posterior draws (another seed gives other parameters).
    assert (reference[-1][1] - 0.5).abs().max() > 1e-2
    other_seed = run_reference(kwargs, batches, seed=8)
    assert (other_seed[-1][0] - reference[-1][0]).abs().max() > 1e-4


def test_ivon_constructor_keywords_compatible_with_ivon_opt():
    kwargs = dict(
        lr=0.05,
        ess=32.0,
        hess_init=0.3,
        beta1=0.8,
        beta2=0.95,
        weight_decay=1e-3,
        mc_samples=2,
        hess_approx="price",
        clip_radius=1e-3,
        sync=False,
        debias=False,
        rescale_lr=False,
    )
    reference_opt = ivon.IVON(make_model().parameters(), **kwargs)
    ours_opt = IVON(make_model().parameters(), **kwargs)
    for attr in ("mc_samples", "hess_approx", "sync", "debias", "rescale_lr"):
        assert getattr(ours_opt, attr) == getattr(reference_opt, attr) == kwargs[attr]
    for key in ("lr", "ess", "hess_init", "beta1", "beta2", "weight_decay", "clip_radius"):
        assert ours_opt.param_groups[0][key] == reference_opt.param_groups[0][key]

    batches = make_batches(4)
    reference = run_reference(kwargs, batches, seed=3)
    ours, _ = run_ours(kwargs, batches, seed=3)
    assert_trajectories_match(ours, reference)
    # The keywords took effect: with rescale_lr=False and a tiny clip_radius, every step
    # moves the parameters by at most lr * clip_radius, and some coordinate by exactly that.
    start = flat(make_model().parameters())
    previous = start
    for params, _, _ in ours:
        step = (params - previous).abs().max().item()
        assert step == pytest.approx(kwargs["lr"] * kwargs["clip_radius"], rel=1e-9)
        previous = params


def test_sampled_params_draws_from_the_posterior():
    model = make_model()
    ess, weight_decay = 64.0, 1e-3
    opt = IVON(
        model.parameters(),
        lr=0.1,
        ess=ess,
        hess_init=0.5,
        beta2=0.5,
        weight_decay=weight_decay,
        hess_approx="gradsq",
    )
    torch.manual_seed(0)
    for x, y in make_batches(3):
        ivon_step(opt, model, x, y, 1)
        opt.step()
    hess = ours_state(opt, "hess")
    assert hess.std() / hess.mean() > 0.1  # per-coordinate std really varies
    expected_std = 1.0 / torch.sqrt(ess * (hess + weight_decay))
    mean = flat(model.parameters()).clone()

    n_draws = 4000
    draws = torch.empty(n_draws, mean.numel(), dtype=DTYPE)
    torch.manual_seed(1)
    for i in range(n_draws):
        with opt.sampled_params(train=False):
            draws[i] = flat(model.parameters())
        assert torch.equal(flat(model.parameters()), mean)
    # Std estimate of a Gaussian: relative standard error 1/sqrt(2n); allow 5 of them.
    rel_err = (draws.std(dim=0) / expected_std - 1).abs()
    assert rel_err.max() < 5 / math.sqrt(2 * n_draws)
    mean_err = (draws.mean(dim=0) - mean).abs() / (expected_std / math.sqrt(n_draws))
    assert mean_err.max() < 5


def test_sampled_params_eval_restores_mean_and_collects_nothing():
    model = make_model()
    opt = IVON(model.parameters(), lr=0.1, ess=16.0)
    mean = flat(model.parameters()).clone()
    x, y = make_batches(1)[0]
    torch.manual_seed(0)
    with opt.sampled_params(train=False):
        assert not torch.equal(flat(model.parameters()), mean)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
    assert torch.equal(flat(model.parameters()), mean)
    with pytest.raises(RuntimeError, match="sampled_params"):
        opt.step()
    assert torch.equal(flat(model.parameters()), mean)
    # The mean also comes back when the block raises.
    with pytest.raises(ValueError, match="boom"), opt.sampled_params(train=True):
        raise ValueError("boom")
    assert torch.equal(flat(model.parameters()), mean)


def test_eval_sample_between_training_samples_is_not_collected():
    """A sampled_params(train=False) block (e.g. a BMA prediction) between the training
    samples of a step leaves the step unchanged, whatever gradient it leaves behind."""
    x, y = make_batches(1)[0]
    results = []
    for with_eval_block in (False, True):
        model = make_model()
        opt = IVON(model.parameters(), lr=0.1, ess=16.0, hess_approx="price")
        torch.manual_seed(0)
        with opt.sampled_params(train=True):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
        if with_eval_block:
            with opt.sampled_params(train=False):
                opt.zero_grad()
                (100.0 * model(x).square().sum()).backward()
        opt.step()
        results.append(flat(model.parameters()))
    assert torch.equal(results[0], results[1])


def test_dpivon_step_without_collected_sample_raises():
    """Like IVON, DPIVON must refuse to step when no backward ran inside
    ``sampled_params(train=True)``: otherwise it silently trains at the mean (gradsq) or
    reuses the posterior noise of an earlier step in the price estimator."""
    x, y = make_batches(1)[0]
    for hess_approx in ("gradsq", "price"):
        model = GradSampleModule(make_model())
        opt = DPIVON(
            model.parameters(), lr=0.1, ess=16.0, grad_noise_std=0.0, hess_approx=hess_approx
        )
        dp_opt = DPOptimizer(
            opt, noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=len(x)
        )
        torch.manual_seed(0)
        ivon_step(opt, model, x, y, 1, zero_grad=dp_opt.zero_grad)
        dp_opt.step()  # a proper step first, so that stale state exists
        start = flat(model.parameters()).clone()
        dp_opt.zero_grad()
        F.cross_entropy(model(x), y).backward()  # at the mean, not at a posterior sample
        with pytest.raises(RuntimeError, match="sampled_params"):
            dp_opt.step()
        assert torch.equal(flat(model.parameters()), start)


# --- 2. DPIVON without noise or clipping is IVON-gradsq -----------------------------------


def run_dpivon_fixed_batch(kwargs, batches, seed, noise_multiplier=0.0, max_grad_norm=1e6):
    """DPIVON under a real DPOptimizer on fixed batches (no Poisson sampling)."""
    model = GradSampleModule(make_model())
    opt = DPIVON(model.parameters(), **kwargs)
    dp_opt = DPOptimizer(
        opt,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=len(batches[0][0]),
    )
    torch.manual_seed(seed)
    trajectory = []
    for x, y in batches:
        ivon_step(opt, model, x, y, kwargs.get("mc_samples", 1), zero_grad=dp_opt.zero_grad)
        dp_opt.step()
        trajectory.append(
            (flat(model.parameters()), ours_state(opt, "hess"), ours_state(opt, "momentum"))
        )
    return trajectory, opt


@pytest.mark.parametrize("beta2", [0.99999, 0.9])
def test_dpivon_without_noise_matches_ivon_gradsq(beta2):
    kwargs = dict(lr=0.1, ess=16.0, hess_init=0.5, beta2=beta2, hess_approx="gradsq")
    batches = make_batches(5)
    reference = run_reference(kwargs, batches, seed=11)
    ours_ivon, _ = run_ours(kwargs, batches, seed=11)
    private, opt = run_dpivon_fixed_batch(
        {**kwargs, "grad_noise_std": 0.0, "noise_correction": True}, batches, seed=11
    )
    assert opt.noise_correction and opt.hess_approx == "gradsq"
    assert_trajectories_match(private, reference, atol=1e-5)
    assert_trajectories_match(private, ours_ivon, atol=1e-10)


class MCMeanGradsqIVON(IVON):
    """Non-private IVON whose gradsq estimator squares the MC-mean gradient.

    Under DP there is one privatised gradient per step (each example's gradient is averaged
    over the MC samples *before* clipping), so DP-IVON-Gradsq's v_hat is the square of the
    MC mean, while ivon-opt's gradsq uses the MC mean of squares. For one MC sample the two
    are the same.
    """

    def _hessian_estimate(self, group, p):
        return gradsq_hessian(self.state[p]["avg_grad"].square(), group["ess"])


def test_dpivon_without_noise_mc2_matches_ivon_on_the_mc_mean_gradient():
    kwargs = dict(lr=0.1, ess=16.0, hess_init=0.5, beta2=0.9, hess_approx="gradsq", mc_samples=2)
    batches = make_batches(5)
    private, _ = run_dpivon_fixed_batch(
        {**kwargs, "grad_noise_std": 0.0, "noise_correction": True}, batches, seed=13
    )
    mc_mean, _ = run_ours(kwargs, batches, seed=13, optimizer_class=MCMeanGradsqIVON)
    assert_trajectories_match(private, mc_mean, atol=1e-10)
    # Against ivon-opt's gradsq (MC mean of squares): the gradient path is identical, so the
    # first momentum matches; the Hessian differs by ess * Var_s(g) only.
    reference = run_reference(kwargs, batches, seed=13)
    torch.testing.assert_close(private[0][2], reference[0][2], atol=1e-10, rtol=0)
    assert (private[0][1] - reference[0][1]).abs().max() > 1e-4


# --- 5. the optimizer consumes the privatised gradient -----------------------------------


def one_private_step(opt, model, x, y, noise_multiplier, max_grad_norm):
    """One DPOptimizer step; returns (raw mean gradient at the sample, g_dp) per param."""
    dp_opt = DPOptimizer(
        opt,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=len(x),
    )
    with opt.sampled_params(train=True):
        dp_opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
    raw = flat(p.grad for p in model.parameters()).clone()
    dp_opt.step()
    g_dp = flat(p.grad for p in model.parameters()).clone()
    return raw, g_dp


def test_dpivon_momentum_is_built_from_the_private_gradient():
    beta1, lr, hess_init, weight_decay = 0.9, 0.05, 0.5, 1e-4
    model = GradSampleModule(make_model())
    start = flat(model.parameters()).clone()
    opt = DPIVON(
        model.parameters(),
        lr=lr,
        ess=16.0,
        hess_init=hess_init,
        beta1=beta1,
        weight_decay=weight_decay,
        grad_noise_std=noise_std(1.0, 0.01, 16),
        hess_approx="gradsq",
    )
    x, y = make_batches(1)[0]
    torch.manual_seed(0)
    raw, g_dp = one_private_step(opt, model, x, y, noise_multiplier=1.0, max_grad_norm=0.01)
    momentum = ours_state(opt, "momentum")
    torch.testing.assert_close(momentum, (1 - beta1) * g_dp, atol=1e-12, rtol=0)
    assert (momentum - (1 - beta1) * raw).norm() > 0.5 * ((1 - beta1) * raw).norm()
    # The mean moved along g_dp too (first step: debiased momentum is g_dp itself).
    hess = ours_state(opt, "hess")
    expected = start - lr * (hess_init + weight_decay) * (g_dp + weight_decay * start) / (
        hess + weight_decay
    )
    torch.testing.assert_close(flat(model.parameters()), expected, atol=1e-12, rtol=0)


def test_stock_ivon_opt_under_dpoptimizer_trains_on_the_raw_gradient():
    """The trap of the design brief: ivon-opt collects p.grad when sampled_params exits,
    before DPOptimizer privatises it, and never reads p.grad again."""
    beta1 = 0.9
    model = GradSampleModule(make_model())
    opt = ivon.IVON(model.parameters(), lr=0.05, ess=16.0, beta1=beta1, hess_approx="gradsq")
    x, y = make_batches(1)[0]
    torch.manual_seed(0)
    raw, g_dp = one_private_step(opt, model, x, y, noise_multiplier=1.0, max_grad_norm=0.01)
    momentum = opt.param_groups[0]["momentum"]
    torch.testing.assert_close(momentum, (1 - beta1) * raw, atol=1e-12, rtol=0)
    assert (momentum - (1 - beta1) * g_dp).norm() > 0.5 * ((1 - beta1) * g_dp).norm()


# --- 8. DPIVON's noise correction and diagnostics -----------------------------------------


@pytest.mark.parametrize("noise_correction", [True, False])
def test_dpivon_hessian_and_projected_fraction_from_g_dp(noise_correction):
    ess, hess_init, beta2, weight_decay = 16.0, 0.5, 0.5, 1e-4
    noise_multiplier, max_grad_norm, batch = 0.3, 1.0, 16
    std = noise_std(noise_multiplier, max_grad_norm, batch)
    model = GradSampleModule(make_model())
    opt = DPIVON(
        model.parameters(),
        lr=0.05,
        ess=ess,
        hess_init=hess_init,
        beta2=beta2,
        weight_decay=weight_decay,
        grad_noise_std=std,
        hess_approx="gradsq",
        noise_correction=noise_correction,
    )
    x, y = make_batches(1, batch_size=batch)[0]
    torch.manual_seed(0)
    _, g_dp = one_private_step(opt, model, x, y, noise_multiplier, max_grad_norm)

    below_noise = g_dp.square() <= std**2
    if noise_correction:
        assert 0.05 < below_noise.double().mean() < 0.95  # both regimes present
        assert opt.projected_fraction == pytest.approx(below_noise.double().mean().item())
        v_hat = (g_dp.square() - std**2).clamp(min=0)
    else:
        assert opt.projected_fraction == 0.0
        v_hat = g_dp.square()
    h_hat = ess * v_hat
    expected_hess = (
        beta2 * hess_init
        + (1 - beta2) * h_hat
        + 0.5 * (1 - beta2) ** 2 * (hess_init - h_hat).square() / (hess_init + weight_decay)
    )
    hess = ours_state(opt, "hess")
    torch.testing.assert_close(hess, expected_hess, atol=1e-12, rtol=1e-12)

    diagnostics = opt.curvature_diagnostics()
    assert set(diagnostics) == {
        "hess_mean",
        "hess_median",
        "hess_q10",
        "hess_q90",
        "posterior_std_median",
        "posterior_std_q10",
        "posterior_std_q90",
        "projected_fraction",
        "curvature_update_share",
        "clamped_noise_share_median",
        "grad_snr_median",
        "curvature_horizon_share",
        "curvature_learned_share_median",
        "curvature_learned_share_q10",
        "curvature_learned_share_q90",
    }
    assert all(math.isfinite(v) for v in diagnostics.values())
    # one step: 1 - beta2 of h could be learned; the learned share, by its definition
    assert diagnostics["curvature_horizon_share"] == pytest.approx(1 - beta2)
    learned = 1 - hess_init * beta2 / hess
    assert diagnostics["curvature_learned_share_median"] == pytest.approx(
        learned.median().item(), rel=1e-6
    )
    assert diagnostics["projected_fraction"] == opt.projected_fraction
    assert diagnostics["hess_mean"] == pytest.approx(hess.mean().item(), rel=1e-12)
    assert diagnostics["hess_median"] == pytest.approx(hess.median().item(), rel=1e-12)
    assert hess.min() <= diagnostics["hess_median"] <= hess.max()
    expected_std = 1 / torch.sqrt(ess * (hess + weight_decay))
    assert diagnostics["posterior_std_median"] == pytest.approx(
        expected_std.median().item(), rel=1e-12
    )


def test_projected_fraction_tracks_the_noise_level():
    """No noise: nothing is projected. Noise far above the signal: g_dp is almost pure
    noise of std grad_noise_std, so the fraction is P(|Z| <= 1) = 0.683 per coordinate."""
    x, y = make_batches(1)[0]
    fractions = []
    for noise_multiplier in (0.0, 1e3):
        model = GradSampleModule(make_model())
        opt = DPIVON(
            model.parameters(),
            lr=0.05,
            ess=16.0,
            hess_approx="gradsq",
            grad_noise_std=noise_std(noise_multiplier, 1.0, len(x)),
        )
        torch.manual_seed(0)
        one_private_step(opt, model, x, y, noise_multiplier, max_grad_norm=1.0)
        fractions.append(opt.curvature_diagnostics()["projected_fraction"])
    assert fractions[0] == 0.0
    # 51 coordinates: standard error sqrt(0.683 * 0.317 / 51) = 0.065; allow 3 of them.
    assert abs(fractions[1] - 0.683) < 0.2


# --- 7. registry ---------------------------------------------------------------------------

EXPECTED_OPTIMIZERS = {
    # name: (class, hess_approx, noise_correction)
    "sgd": (torch.optim.SGD, None, None),
    "dp-sgd": (torch.optim.SGD, None, None),
    "adam": (torch.optim.Adam, None, None),
    "dp-adam": (torch.optim.Adam, None, None),
    "dp-adambc": (DPAdamBC, None, None),
    "ivon": (IVON, "price", None),
    "dp-ivon-gradsq": (DPIVON, "gradsq", True),
    "dp-ivon-gradsq-uncorrected": (DPIVON, "gradsq", False),
    "dp-ivon": (DPIVON, "price", True),
}


def test_registry_covers_every_optimizer_name():
    assert set(EXPECTED_OPTIMIZERS) == set(OPTIMIZER_NAMES)


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_build_optimizer_returns_the_named_optimizer(name):
    expected_class, hess_approx, noise_correction = EXPECTED_OPTIMIZERS[name]
    config = TrainConfig(optimizer=name, dataset="synthetic")
    model = make_model()
    opt = build_optimizer(
        config.optimizer, model.parameters(), dataset_size=123, grad_noise_std=0.25
    )
    assert type(opt) is expected_class
    group = opt.param_groups[0]
    assert group["lr"] == config.optimizer.lr
    assert group["weight_decay"] == config.optimizer.weight_decay
    assert len(group["params"]) == len(list(model.parameters()))
    if expected_class is torch.optim.SGD:
        assert group["momentum"] == config.optimizer.momentum
    if expected_class is torch.optim.Adam:
        assert group["betas"] == (config.optimizer.beta1, config.optimizer.beta2)
    if hess_approx is not None:
        assert opt.hess_approx == hess_approx == config.optimizer.hess_approx
        assert group["ess"] == 123.0  # ess defaults to the training-set size
        assert group["hess_init"] == config.optimizer.hess_init
        assert group["beta2"] == config.optimizer.beta2
    if expected_class is DPIVON:
        assert opt.noise_correction is noise_correction
        assert opt.grad_noise_std == 0.25


def test_build_optimizer_passes_ivon_options():
    config = TrainConfig(
        optimizer="ivon",
        dataset="synthetic",
        hess_approx="gradsq",
        ess=1000.0,
        mc_samples=3,
        clip_radius=0.5,
        debias=False,
        rescale_lr=False,
    )
    opt = build_optimizer(config.optimizer, make_model().parameters(), dataset_size=50)
    assert type(opt) is IVON
    assert opt.hess_approx == "gradsq"
    assert opt.mc_samples == 3
    assert opt.debias is False and opt.rescale_lr is False
    group = opt.param_groups[0]
    assert group["ess"] == 1000.0
    assert group["clip_radius"] == 0.5


def test_an_sgd_option_reaches_torch_from_every_entry_point():
    """nesterov is declared once, on SGDOptions: config, --set paths and flat keys take it."""
    flat = TrainConfig(optimizer="dp-sgd", nesterov=True)
    by_path = TrainConfig.model_validate({"optimizer": "dp-sgd", "optimizer.nesterov": True})
    assert flat == by_path and flat.flat()["nesterov"] is True
    opt = build_optimizer(flat.optimizer, make_model().parameters(), dataset_size=50)
    assert opt.param_groups[0]["nesterov"] is True
    with pytest.raises(ValueError, match="nesterov needs momentum > 0"):
        TrainConfig(optimizer="sgd", nesterov=True, momentum=0.0)
    with pytest.raises(ValueError, match="nesterov does not apply to adam"):
        TrainConfig(optimizer="adam", nesterov=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_clip_radius_beyond_the_dtype_clips_nothing(dtype):
    # A radius no value of the dtype reaches (3.5e38 in float32 or bfloat16) is no
    # clipping; torch's clamp refuses it ("cannot be converted ... without overflow"),
    # found by tests/memory_probe.py with a config's clip_radius beyond float32.
    mean = torch.tensor([1.0, -2.0], dtype=dtype)
    momentum = torch.tensor([1e3, -5.0], dtype=dtype)
    hess = torch.ones(2, dtype=dtype)
    clipped = mean_update(mean, momentum, hess, 0.1, 0.0, 3.5e38, 1.0)
    assert torch.equal(clipped, mean_update(mean, momentum, hess, 0.1, 0.0, math.inf, 1.0))
    assert torch.equal(clipped, mean - 0.1 * momentum)
