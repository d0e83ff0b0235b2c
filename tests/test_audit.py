"""The one-run privacy audit: the bound against independent computations, canaries that
really are clipped, Poisson-sampled training examples of every private optimizer, audits
whose real bound stays below the claim while the noise-off control exceeds it, the CLI."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from typing import get_args

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from opacus.optimizers import DPOptimizer
from typer.testing import CliRunner

from dpivon.audit import (
    CanaryInjector,
    audit_config,
    audit_scores,
    correct_guesses,
    epsilon_lower_bound,
    guess_schedule,
    p_value,
    run_audit,
)
from dpivon.cli import app
from dpivon.config import PRIVATE_OPTIMIZERS, PrivacyConfig
from dpivon.errors import DpivonError
from dpivon.training import build_training, load_data, train_step

CPU = torch.device("cpu")
ENGINES = get_args(PrivacyConfig.model_fields["engine"].annotation)
runner = CliRunner()


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread avoids the thread-pool overhead that dominates them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the bound -----------------------------------------------------------------------------


def exact_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Theorem 5.2 of Steinke, Nasr & Jagielski in exact rational arithmetic."""
    p = Fraction(math.exp(epsilon) / (1 + math.exp(epsilon)))
    pmf = [math.comb(r, i) * p**i * (1 - p) ** (r - i) for i in range(r + 1)]
    tail = sum(pmf[v:], Fraction(0))
    alpha, below = Fraction(0), Fraction(0)
    for i in range(1, v + 1):
        below += pmf[v - i]  # P[v - i <= Binom < v]
        alpha = max(alpha, below / i)
    return float(min(tail + 2 * m * Fraction(delta) * alpha, Fraction(1)))


@pytest.mark.parametrize(
    ("m", "r", "v", "epsilon", "delta"),
    [
        (100, 100, 100, 3.0, 1e-5),
        (200, 120, 90, 1.0, 1e-5),
        (1000, 150, 100, 0.5, 1e-3),
        (50, 40, 25, 0.2, 0.0),
        (300, 200, 199, 6.0, 1e-5),
    ],
)
def test_p_value_matches_exact_rational_computation(m, r, v, epsilon, delta):
    assert p_value(m, r, v, epsilon, delta) == pytest.approx(
        exact_p_value(m, r, v, epsilon, delta), rel=1e-9, abs=1e-300
    )


@pytest.mark.parametrize("r", [10, 100, 1000])
def test_perfect_guesses_without_delta_have_a_closed_form(r):
    """delta = 0, v = r: P[Binom(r, p) >= r] = p^r = 0.05 gives p = 0.05^(1/r)."""
    p = 0.05 ** (1 / r)
    assert epsilon_lower_bound(r, r, r, 0.0, 0.05) == pytest.approx(math.log(p / (1 - p)), 1e-6)


@pytest.mark.parametrize(("correct", "brief"), [(100, 3.5), (1000, 5.8), (5000, 7.3)])
def test_perfect_attacker_certifies_the_design_brief_numbers(correct, brief):
    bound = epsilon_lower_bound(correct, correct, correct, 1e-5, 0.05)
    assert round(bound, 1) == brief


def test_bound_is_the_largest_rejected_epsilon():
    m, r, v, delta = 1000, 400, 300, 1e-5
    bound = epsilon_lower_bound(m, r, v, delta, 0.05)
    assert bound > 0
    assert p_value(m, r, v, bound, delta) < 0.05 <= p_value(m, r, v, bound + 1e-6, delta)
    assert epsilon_lower_bound(m, r, r // 2, delta, 0.05) == 0.0  # chance level: no claim


def test_guesses_are_scored_from_both_ends():
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    included = np.array([True, False, True, False, False, True])
    assert correct_guesses(scores, included, 2, 0) == 1
    assert correct_guesses(scores, included, 3, 2) == 2 + 1
    assert correct_guesses(scores, included, 0, 3) == 2


def test_picking_the_best_guess_count_pays_a_bonferroni_correction():
    m = 1000
    included = np.random.default_rng(0).permutation(m) < m // 2
    perfect = included.astype(float)
    result = audit_scores(perfect, included, delta=0.0, confidence=0.95)
    p = (0.05 / len(guess_schedule(m))) ** (1 / m)  # best: all m guesses right, delta 0
    assert (result.guesses, result.correct) == (m, m)
    assert result.epsilon_lower_bound == pytest.approx(math.log(p / (1 - p)), 1e-6)


def test_audit_of_randomized_response_is_valid_and_has_power():
    """Canaries released by epsilon-randomized response (exactly epsilon-DP each): the
    lower bound may exceed epsilon in at most 5% of runs, and it is not vacuous."""
    epsilon, m, trials = 1.0, 1000, 60
    rng = np.random.default_rng(1)
    bounds = []
    for _ in range(trials):
        included = rng.random(m) < 0.5
        truthful = rng.random(m) < math.exp(epsilon) / (1 + math.exp(epsilon))
        scores = np.where(truthful, included, ~included) + 0.01 * rng.random(m)
        bounds.append(audit_scores(scores, included, delta=1e-5).epsilon_lower_bound)
    assert np.mean(np.array(bounds) > epsilon) <= 0.05
    assert 0.6 < np.median(bounds) < epsilon


# --- the canaries are training examples ----------------------------------------------------


def bare_optimizer(clip: float, batch: int, size: int = 2000) -> tuple[DPOptimizer, list]:
    """A DPOptimizer over two parameters and no model: batches are set by hand."""
    params = [torch.nn.Parameter(torch.zeros(size // 2)) for _ in range(2)]
    optimizer = DPOptimizer(
        torch.optim.SGD(params, lr=0.0),
        noise_multiplier=0.0,
        max_grad_norm=clip,
        expected_batch_size=batch,
    )
    return optimizer, params


def empty_batch_step(optimizer: DPOptimizer) -> None:
    """One step without data: g_dp is the canaries' clipped sum / b (and the noise)."""
    optimizer.zero_grad()
    for p in optimizer.params:
        p.grad_sample = torch.zeros(0, *p.shape)
    optimizer.step()


def record_base_steps(optimizer: DPOptimizer) -> list[torch.Tensor]:
    """The flat p.grad that the wrapped optimizer's step() receives, one per step."""
    seen: list[torch.Tensor] = []
    base_step = optimizer.original_optimizer.step

    def step(*args, **kwargs):
        seen.append(torch.cat([p.grad.detach().flatten() for p in optimizer.params]).clone())
        return base_step(*args, **kwargs)

    optimizer.original_optimizer.step = step
    return seen


def test_canaries_are_clipped_like_examples_before_the_noise():
    clip, batch = 1.5, 10
    optimizer, params = bare_optimizer(clip, batch)
    coordinates = torch.tensor([3, 1500, 7, 1999])
    norms = torch.tensor([3 * clip, clip / 2, clip, 3 * clip])
    included = torch.tensor([True, True, True, False])
    injector = CanaryInjector(
        params, coordinates, norms, included, 1.0, torch.Generator().manual_seed(0)
    )
    injector.attach(optimizer)
    seen = record_base_steps(optimizer)
    empty_batch_step(optimizer)
    (g_dp,) = seen
    expected = [
        n * min(1.0, clip / (n + 1e-6)) / batch if inc else 0.0  # Opacus's clip factor
        for n, inc in zip(norms.tolist(), included.tolist(), strict=True)
    ]
    assert g_dp[coordinates].tolist() == pytest.approx(expected, rel=1e-6)
    assert g_dp[3] * batch == pytest.approx(clip, rel=1e-6)  # norm 3C contributes C
    assert g_dp.abs().sum() == pytest.approx(sum(expected), rel=1e-6)  # nothing elsewhere
    assert injector.scores.tolist() == pytest.approx(
        [e * n for e, n in zip(expected, norms.tolist(), strict=True)], rel=1e-6
    )


def test_canaries_are_poisson_sampled_at_the_sample_rate_every_step():
    q, m, steps, clip, batch = 0.1, 1000, 300, 1.0, 20
    optimizer, params = bare_optimizer(clip, batch)
    accountant_calls = []
    optimizer.attach_step_hook(lambda opt: accountant_calls.append(opt.noise_multiplier))
    hook = optimizer.step_hook
    injector = CanaryInjector.draw(params, m, clip, q, seed=3)
    injector.attach(optimizer)
    seen = record_base_steps(optimizer)
    per_step = []
    for _ in range(steps):
        before = injector.times_sampled.clone()
        empty_batch_step(optimizer)
        sampled = injector.times_sampled - before
        per_step.append(sampled)
        # the optimizer received exactly the canaries sampled at this step, clipped, over b
        expected = sampled.double() * clip * (clip / (clip + 1e-6)) / batch
        assert torch.allclose(seen[-1][injector.coordinates].double(), expected, atol=1e-7)
    assert optimizer.step_hook is hook and len(accountant_calls) == steps
    draws = torch.stack(per_step)
    included = injector.included
    assert draws[:, ~included].sum() == 0  # excluded canaries never enter
    assert draws.max() <= 1  # at most once a step
    n = int(included.sum()) * steps
    rate = draws[:, included].sum().item() / n
    assert abs(rate - q) < 4 * math.sqrt(q * (1 - q) / n)  # q, not 1 and not q^2
    # a fresh draw every step: consecutive draws of a canary are uncorrelated
    centred = draws[:, included].double() - q
    assert abs((centred[1:] * centred[:-1]).mean() / (q * (1 - q))) < 4 / math.sqrt(n)


def check_canaries_reach_the_optimizer(**overrides) -> None:
    """Canaries are in what the base optimizer's step() receives, scores are read from it,
    and the accountant counts every step."""
    # epsilon 0.5 only because its noise calibrates in a fraction of a second here
    config = audit_config(
        synthetic_size=120, epochs=1, batch_size=20, epsilon=0.5, device="cpu", **overrides
    )
    setup = build_training(config, load_data(config), CPU)
    dp, plan = setup.optimizer, setup.private.plan
    assert isinstance(dp, DPOptimizer)
    hook = dp.step_hook
    injector = CanaryInjector.draw(list(dp.params), 40, plan.max_grad_norm, 1.0, seed=0)
    injector.attach(dp)
    seen = record_base_steps(dp)
    x, y = next(iter(setup.loader))
    # noise off and an empty batch: the optimizer receives the included canaries alone
    dp.noise_multiplier = 0.0
    train_step(setup, x[:0], y[:0], config.optimizer.samples_per_step)
    clip = plan.max_grad_norm
    one = clip * (clip / (clip + 1e-6)) / plan.expected_batch_size
    n_in = int(injector.included.sum())
    assert seen[-1].abs().sum() == pytest.approx(one * n_in, rel=1e-5)
    assert seen[-1][injector.coordinates][injector.included].tolist() == pytest.approx(
        [one] * n_in, rel=1e-5
    )
    # data and noise: the scores grow by <g_dp, c_j> of what the optimizer received
    dp.noise_multiplier = plan.noise_multiplier
    before = injector.scores.clone()
    train_step(setup, x, y, config.optimizer.samples_per_step)
    assert torch.allclose(
        injector.scores - before, seen[-1][injector.coordinates].double() * clip, rtol=1e-6
    )
    assert dp.step_hook is hook and setup.private.steps_taken == 2 == injector.steps


@pytest.mark.parametrize("optimizer", PRIVATE_OPTIMIZERS)
def test_every_private_optimizer_receives_and_is_scored_on_the_canaries(optimizer):
    check_canaries_reach_the_optimizer(optimizer=optimizer)


@pytest.mark.parametrize("engine", [e for e in ENGINES if e != "auto"])
def test_every_per_example_gradient_engine_takes_the_canaries(engine):
    check_canaries_reach_the_optimizer(optimizer="dp-sgd", engine=engine)


# --- the audit -----------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["dp-sgd", "dp-ivon-gradsq"])
def test_audit_bound_stays_below_the_claim_and_the_control_exceeds_it(optimizer):
    config = audit_config(optimizer=optimizer, epsilon=2.0, delta=1e-5, device="cpu")
    result = run_audit(config, 1000)
    assert result.claimed_epsilon == 2.0 and result.canaries == 1000
    assert result.real.epsilon_lower_bound < 2.0 < result.control.epsilon_lower_bound
    assert result.control.noise_multiplier == 0.0 < result.noise_multiplier
    assert result.real.steps == result.steps == result.control.steps
    # each included canary took part in about q * steps steps
    expected = result.sample_rate * result.steps
    assert result.real.mean_times_sampled == pytest.approx(expected, rel=0.1)


def test_audit_refuses_what_it_cannot_audit():
    with pytest.raises(DpivonError, match="not private"):
        run_audit(audit_config(optimizer="sgd"), 10)
    with pytest.raises(DpivonError, match="canaries"):
        run_audit(audit_config(optimizer="dp-sgd"), 0)
    with pytest.raises(DpivonError, match="finite"):
        run_audit(audit_config(optimizer="dp-sgd", epsilon=math.inf), 10)


def test_cli_writes_the_audit_json_and_logs_it_to_mlflow(tmp_path):
    out, uri = tmp_path / "audit.json", f"sqlite:///{tmp_path}/mlflow.db"
    result = runner.invoke(
        app,
        [
            "audit",
            "--dataset",
            "synthetic",
            "--optimizer",
            "dp-adam",
            "--epsilon",
            "0.5",
            "--delta",
            "1e-5",
            "--canaries",
            "100",
            "--epochs",
            "1",
            "--synthetic-size",
            "200",
            "--device",
            "cpu",
            "--json",
            str(out),
            "--tracking-uri",
            uri,
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    for key in (
        "claimed_epsilon",
        "epsilon_lower_bound",
        "control_epsilon_lower_bound",
        "canaries",
        "optimizer",
        "guesses",
        "correct_guesses",
        "confidence",
    ):
        assert key in summary
    assert (summary["optimizer"], summary["canaries"], summary["claimed_epsilon"]) == (
        "dp-adam",
        100,
        0.5,
    )
    assert summary["correct_guesses"] <= summary["guesses"] <= 100
    run = MlflowClient(uri).get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.params["canaries"] == "100"
    assert run.data.metrics["epsilon_lower_bound"] == summary["epsilon_lower_bound"]
    artifacts = [a.path for a in MlflowClient(uri).list_artifacts(run.info.run_id)]
    assert "audit.json" in artifacts


@pytest.mark.parametrize(
    "flags",
    [
        ["--epsilon", "0"],
        ["--epsilon", "-1"],
        ["--delta", "1"],
        ["--delta", "2"],
        ["--canaries", "0"],
        ["--optimizer", "sgd"],
    ],
)
def test_cli_bad_input_is_one_red_line_and_exit_2(flags, tmp_path):
    args = ["audit", "--optimizer", "dp-sgd", "--tracking-uri", f"sqlite:///{tmp_path}/m.db"]
    result = runner.invoke(app, args + flags)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert not (tmp_path / "m.db").exists()  # refused before anything ran
