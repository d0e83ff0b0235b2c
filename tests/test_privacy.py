"""The privacy layer against real Opacus: noise level, sensitivity, calibration, accounting."""

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

from dpivon.errors import DpivonError
from dpivon.evaluation.metrics import reliability_diagram
from dpivon.optim.dp_ivon import DPIVON
from dpivon.optim.ivon import IVON
from dpivon.privacy.accounting import epsilon_spent
from dpivon.privacy.engine import PrivacyPlan, make_private, plan_privacy
from dpivon.privacy.noise import SecureRandomness, SeededRandomness
from dpivon.privacy.validation import VALIDATION_SCORE_SENSITIVITY, private_validation_scores

DTYPE = torch.float64
N_IN, N_HIDDEN, N_OUT = 4, 6, 3


def make_model(seed=0, dtype=DTYPE):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(N_IN, N_HIDDEN), nn.Tanh(), nn.Linear(N_HIDDEN, N_OUT)).to(dtype)


def make_batch(batch_size, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, N_IN, generator=gen, dtype=DTYPE)
    y = torch.randint(0, N_OUT, (batch_size,), generator=gen)
    return x, y


def flat(tensors):
    return torch.cat([t.detach().flatten() for t in tensors])


# A valid budget: the baseline of the plans below
VALID = dict(
    target_epsilon=8.0,
    delta=1e-5,
    max_grad_norm=1.0,
    accountant="rdp",
    dataset_size=1000,
    batch_size=100,
    epochs=2,
)


def plan_for(**changes) -> PrivacyPlan:
    """`plan_privacy` for the VALID budget with ``changes``."""
    return plan_privacy(**{**VALID, **changes})


# --- 3. the noise in g_dp and its correction -----------------------------------------------


def test_noise_correction_is_unbiased_under_real_opacus_noise():
    """g_dp = (sum of clipped per-example gradients + N(0, sigma^2 C^2)) / b_expected.

    Per coordinate, E[g_dp^2] = g^2 + (sigma C / b)^2, so g_dp^2 - (sigma C / b)^2 is an
    unbiased estimate of g^2 (g = clipped sum / b) and the plain g_dp^2 is biased upwards.
    """
    plan = plan_for(
        target_epsilon=2.0, delta=1e-3, max_grad_norm=2.5, dataset_size=100, batch_size=10, epochs=1
    )
    assert plan.expected_batch_size == 10 and plan.noise_multiplier > 0.5
    sigma, clip, b = plan.noise_multiplier, plan.max_grad_norm, plan.expected_batch_size

    model = GradSampleModule(make_model())
    x, y = make_batch(8)  # the drawn batch is smaller than the expected one
    x[:4] *= 20.0  # large inputs: most of these examples get clipped
    F.cross_entropy(model(x), y).backward()
    params = list(model.parameters())
    grad_samples = [p.grad_sample.detach().clone() for p in params]

    # Clipped mean gradient, computed here independently of Opacus.
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grad_samples], 1).norm(dim=1)
    assert (norms > clip).sum() >= 2 and (norms < clip).sum() >= 2
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
    g_true = flat(torch.einsum("i,i...->...", factor, g) for g in grad_samples) / b

    dp_opt = DPOptimizer(
        torch.optim.SGD(params, lr=0.0),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        expected_batch_size=b,
    )
    repetitions = 4000
    g_dp = torch.empty(repetitions, g_true.numel(), dtype=DTYPE)
    torch.manual_seed(0)
    for r in range(repetitions):
        dp_opt.zero_grad()
        for p, g in zip(params, grad_samples, strict=True):
            p.grad_sample = g.clone()
        assert dp_opt.pre_step()
        g_dp[r] = flat(p.grad for p in params)
    torch.testing.assert_close(flat(p.summed_grad for p in params) / b, g_true)

    noise_var = plan.grad_noise_std**2
    corrected = g_dp.square() - noise_var
    standard_error = corrected.std(dim=0) / math.sqrt(repetitions)
    assert ((corrected.mean(dim=0) - g_true.square()).abs() <= 5 * standard_error).all()
    # Without the correction the bias is exactly the noise variance, far beyond the error.
    bias = g_dp.square().mean(dim=0) - g_true.square()
    assert ((bias - noise_var).abs() <= 5 * standard_error).all()
    assert (bias > 10 * standard_error).all()

    # The std of the injected noise is sigma C / b_expected (Opacus divides by the expected
    # batch size, not by the 8 examples actually drawn).
    centered = g_dp - g_dp.mean(dim=0)
    n_values = centered.numel()
    assert plan.grad_noise_std == pytest.approx(sigma * clip / b)
    assert centered.std().item() == pytest.approx(
        plan.grad_noise_std, rel=5 / math.sqrt(2 * n_values)
    )
    per_coordinate = centered.std(dim=0) / plan.grad_noise_std - 1
    assert per_coordinate.abs().max() < 5 / math.sqrt(2 * repetitions)
    assert abs(centered.std().item() / (sigma * clip / len(x)) - 1) > 0.1


# --- 4. sensitivity with Monte-Carlo samples -----------------------------------------------

CLIP = 1.0


def clipped_sum(x, y, mc_samples, optimizer_cls=DPIVON, zero_grad_each_sample=True):
    """Sum of clipped per-example gradients after one MC loop at seed 0 (no noise)."""
    model = GradSampleModule(make_model())
    kwargs = dict(lr=0.1, ess=100.0, hess_init=0.5, mc_samples=mc_samples, hess_approx="gradsq")
    if optimizer_cls is DPIVON:
        kwargs["grad_noise_std"] = 0.0
    opt = optimizer_cls(model.parameters(), **kwargs)
    dp_opt = DPOptimizer(opt, noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=len(x))
    torch.manual_seed(0)
    dp_opt.zero_grad()
    for _ in range(mc_samples):
        with opt.sampled_params(train=True):
            if zero_grad_each_sample:
                dp_opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
    grad_sample_rows = {len(g) for g in dp_opt.grad_samples}
    dp_opt.clip_and_accumulate()
    return flat(p.summed_grad for p in model.parameters()), grad_sample_rows


def neighbours():
    x, y = make_batch(8)
    outlier_x = torch.full((1, N_IN), 200.0, dtype=DTYPE)
    outlier_y = torch.tensor([(int(y[0]) + 1) % N_OUT])
    added = (torch.cat([x, outlier_x]), torch.cat([y, outlier_y]))
    replaced_x = x.clone()
    replaced_x[0] = outlier_x[0]
    replaced = (replaced_x, torch.cat([outlier_y, y[1:]]))
    return (x, y), added, replaced


@pytest.mark.parametrize("mc_samples", [1, 3])
def test_one_example_changes_the_clipped_sum_by_at_most_c(mc_samples):
    (x, y), added, replaced = neighbours()
    base, rows = clipped_sum(x, y, mc_samples)
    with_outlier, rows_with_outlier = clipped_sum(*added, mc_samples)

    # Add/remove neighbours (Opacus's adjacency under Poisson sampling): at most C. The
    # outlier's gradient is huge, so its clipped contribution is C itself: a per-MC-sample
    # clipping would show up as about S * C.
    difference = (with_outlier - base).norm().item()
    assert difference <= CLIP * (1 + 1e-9)
    assert difference > 0.99 * CLIP
    # Replace-one neighbours: old and new contributions both have norm <= C.
    swapped, _ = clipped_sum(*replaced, mc_samples)
    assert (swapped - base).norm().item() <= 2 * CLIP * (1 + 1e-9)
    # DPIVON leaves one MC-averaged gradient per example for Opacus to clip.
    assert rows == {len(x)}
    assert rows_with_outlier == {len(x) + 1}


def test_unaveraged_mc_gradients_would_break_the_bound():
    """Control for the test above: stock IVON under a DPOptimizer, without clearing between
    MC samples, hands Opacus S gradients per example; each is clipped on its own and one
    example then moves the sum by about S * C."""
    (x, y), added, _ = neighbours()
    mc_samples = 3
    base, rows = clipped_sum(x, y, mc_samples, IVON, zero_grad_each_sample=False)
    assert rows == {mc_samples * len(x)}
    with_outlier, _ = clipped_sum(*added, mc_samples, IVON, zero_grad_each_sample=False)
    assert (with_outlier - base).norm().item() > 2 * CLIP


# --- 6. calibration and accounting ---------------------------------------------------------


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
@pytest.mark.parametrize(
    ("dataset_size", "batch_size", "epochs", "target_epsilon"),
    [(1000, 50, 2, 2.0), (5000, 256, 3, 8.0), (60000, 512, 5, 1.0)],
)
def test_plan_privacy_spends_the_target_epsilon(
    accountant, dataset_size, batch_size, epochs, target_epsilon
):
    sizes = dict(dataset_size=dataset_size, batch_size=batch_size, epochs=epochs)
    plan = plan_for(target_epsilon=target_epsilon, accountant=accountant, **sizes)
    # q = b / N exactly (not Opacus's loader rate 1 / int(1 / q)); an epoch is ceil(N / b).
    assert plan.sample_rate == batch_size / dataset_size
    assert plan.steps == epochs * math.ceil(dataset_size / batch_size)
    assert plan.expected_batch_size == batch_size
    assert plan.noise_multiplier > 0
    spent = epsilon_spent(plan.noise_multiplier, plan.sample_rate, plan.steps, 1e-5, accountant)
    assert target_epsilon - 0.05 <= spent <= target_epsilon
    assert plan.grad_noise_std == pytest.approx(
        plan.noise_multiplier * plan.max_grad_norm / plan.expected_batch_size
    )


@pytest.mark.parametrize(("accountant", "mc_samples"), [("rdp", 1), ("prv", 1), ("rdp", 2)])
def test_make_private_spends_the_planned_epsilon_end_to_end(accountant, mc_samples):
    dataset_size, batch_size, epochs, target = 200, 20, 2, 4.0
    sizes = dict(dataset_size=dataset_size, batch_size=batch_size, epochs=epochs)
    plan = plan_for(target_epsilon=target, delta=1e-4, accountant=accountant, **sizes)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(dataset_size, N_IN, generator=gen)
    y = torch.randint(0, N_OUT, (dataset_size,), generator=gen)
    model = make_model(dtype=torch.float32)
    start = flat(model.parameters()).clone()
    optimizer = DPIVON(
        model.parameters(),
        lr=0.5,
        ess=float(dataset_size),
        hess_approx="gradsq",
        mc_samples=mc_samples,
        grad_noise_std=plan.grad_noise_std,
    )
    private = make_private(model, optimizer, x, y, plan, randomness=SecureRandomness())
    assert private.epsilon_spent() == 0.0
    torch.manual_seed(2)
    for _ in range(epochs):
        for xb, yb in private.loader:
            for _ in range(mc_samples):
                with optimizer.sampled_params(train=True):
                    private.optimizer.zero_grad()
                    private.criterion(private.module(xb), yb).backward()
            private.optimizer.step()
    assert private.steps_taken == plan.steps
    spent = private.epsilon_spent()
    assert target - 0.05 <= spent <= target
    # the accountant recorded exactly the planned mechanism
    planned = epsilon_spent(plan.noise_multiplier, plan.sample_rate, plan.steps, 1e-4, accountant)
    assert spent == pytest.approx(planned, rel=1e-9)
    params = flat(model.parameters())
    assert torch.isfinite(params).all() and not torch.equal(params, start)


def test_non_private_budget_means_no_noise():
    plan = plan_for(target_epsilon=math.inf, epochs=3)
    assert plan.noise_multiplier == 0.0
    assert plan.grad_noise_std == 0.0
    assert epsilon_spent(plan.noise_multiplier, plan.sample_rate, plan.steps, 1e-5) == math.inf


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_unreachable_budget_raises(accountant):
    with pytest.raises(DpivonError, match="the smallest the"):
        plan_for(target_epsilon=1e-6, accountant=accountant, epochs=50)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (dict(target_epsilon=0.0), "epsilon"),
        (dict(target_epsilon=-1.0), "epsilon"),
        (dict(delta=1.0), "delta"),
        (dict(delta=1.5), "delta"),
        (dict(delta=0.0), "delta"),
        (dict(delta=1e-3), "1/N"),  # exactly 1/N
        (dict(delta=0.01), "1/N"),
        (dict(batch_size=1001), "batch size"),
        (dict(batch_size=0), "batch size"),
        (dict(max_grad_norm=0.0), "max_grad_norm"),
        (dict(epochs=0), "epochs"),
        (dict(accountant="gdp"), "accountant"),
    ],
)
def test_invalid_budgets_raise(override, message):
    with pytest.raises(DpivonError, match=message):
        plan_for(**override)


def test_valid_reference_budget_is_accepted():
    """The baseline of the invalid cases above is itself valid."""
    assert isinstance(plan_for(), PrivacyPlan)


# --- the Gaussian mechanism on validation scores ----------------------------------------------


def test_noised_validation_scores_are_the_exact_scores_plus_calibrated_noise():
    """The release is unbiased around the exact accuracy and ECE, one record moves the
    noised sums by at most the sensitivity, and the noise has std sigma * sqrt(3) per sum."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(400, 10, generator=gen), dim=1)
    labels = torch.randint(0, 10, (400,), generator=gen)
    diagram = reliability_diagram(probs, labels, n_bins=10)
    randomness = SeededRandomness(0, torch.device("cpu"))
    almost_exact = private_validation_scores(diagram.bin_sums(), 1e-9, randomness)
    assert almost_exact == pytest.approx({"accuracy": diagram.accuracy, "ece": diagram.ece})

    one_less = reliability_diagram(probs[1:], labels[1:], n_bins=10).bin_sums()
    assert np.linalg.norm(diagram.bin_sums() - one_less) <= VALIDATION_SCORE_SENSITIVITY

    # one bin of 10,000 records, half correct: accuracy ~ 0.5 + (e_correct - e_count / 2) / N
    sums = np.array([[10_000.0], [5_000.0], [6_000.0]])
    accuracies = [private_validation_scores(sums, 1.0, randomness)["accuracy"] for _ in range(2000)]
    expected_std = 1.0 * VALIDATION_SCORE_SENSITIVITY * math.sqrt(1 + 0.5**2) / 10_000
    assert np.std(accuracies) == pytest.approx(expected_std, rel=0.1)
    assert np.mean(accuracies) == pytest.approx(0.5, abs=4 * expected_std / math.sqrt(2000))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("accountant", "sigma"), [("prv", 0.01), ("gdp", 0.01), ("gdp", 1e6)])
def test_an_accountant_that_cannot_evaluate_extreme_noise_says_so_in_one_line(accountant, sigma):
    # Opacus's PRV asks for a 1.2 TiB grid at sigma 0.01; its GDP root finding finds no sign
    # change at either end: each is refused, naming the accountant and the noise
    with pytest.raises(DpivonError) as info:
        epsilon_spent(sigma, 0.02, 1320, 1e-5, accountant)
    message = str(info.value)
    assert "\n" not in message and f"the {accountant} accountant cannot evaluate" in message
    assert epsilon_spent(5e-324, 0.02, 1320, 1e-5, "rdp") == math.inf  # its variance underflows


def test_a_plan_checks_itself_whoever_makes_it():
    plan = plan_for()
    dataclasses.replace(plan)  # the calibrated plan is valid as made
    with pytest.raises(DpivonError, match="above the budget"):
        dataclasses.replace(plan, noise_multiplier=plan.noise_multiplier / 2)
    with pytest.raises(DpivonError, match="not the expected batch"):
        dataclasses.replace(plan, sample_rate=plan.sample_rate * 3)
    with pytest.raises(DpivonError, match="not whole epochs"):
        dataclasses.replace(plan, steps=plan.steps + 1)
    with pytest.raises(DpivonError, match="clip norm"):
        dataclasses.replace(plan, max_grad_norm=0.0)
