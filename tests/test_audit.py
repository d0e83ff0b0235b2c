"""The one-run privacy audit: the binomial bound against independent computations, the
Gaussian analysis against closed forms and an exactly Gaussian release; canaries that are
training examples (drawn by the data's sampler, normed and clipped by the engine) for every
private optimizer and engine; a correct run that certifies at least half its claim while
its noise-off control has power; a missing clip, q = 1, half the noise, per-example norms
read 10x too small and a sampler at 3 q, each flagged; the CLI."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from opacus.optimizers import DPOptimizer
from scipy.stats import norm
from typer.testing import CliRunner

from dpivon.audit import (
    Canaries,
    CanaryExamples,
    audit_config,
    audit_scores,
    correct_guesses,
    epsilon_lower_bound,
    gaussian_mu,
    gdp_delta,
    gdp_epsilon,
    guess_schedule,
    last_linear,
    p_value,
    run_audit,
)
from dpivon.cli import app
from dpivon.config import PRIVATE_OPTIMIZERS
from dpivon.errors import DpivonError
from dpivon.privacy import bookkeeping, noise, sampling
from dpivon.privacy.engine import PER_SAMPLE_ENGINES
from dpivon.runs import TrainingSetup, build_training, load_data, train_step

CPU = torch.device("cpu")
runner = CliRunner()


@pytest.fixture(autouse=True)
def every_test_on_one_thread(one_thread):
    """Every audit here trains a tiny model: see the ``one_thread`` fixture."""


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


def test_gdp_epsilon_inverts_the_closed_form_delta():
    """Dong, Roth & Su's delta(epsilon) at epsilon 0 is 2 Phi(mu / 2) - 1 (the total
    variation of N(0, 1) and N(mu, 1)); gdp_epsilon is its inverse in epsilon."""
    assert gdp_delta(1.0, 0.0) == pytest.approx(2 * norm.cdf(0.5) - 1, rel=1e-12)
    for mu, delta in [(0.5, 1e-5), (1.0, 1e-5), (2.0, 1e-6)]:
        epsilon = gdp_epsilon(mu, delta)
        assert gdp_delta(mu, epsilon) == pytest.approx(delta, rel=1e-6)
    # mu = 0.5 at delta 1e-5 is epsilon 2.0 (to two digits): the audit's default claim
    assert round(gdp_epsilon(0.5, 1e-5), 1) == 2.0
    assert gdp_epsilon(0.0, 1e-5) == 0.0


def test_gaussian_analysis_of_a_gaussian_mechanism_is_valid_and_tight():
    """Scores of an exactly mu-GDP release (N(mu, 1) included, N(0, 1) excluded): the lower
    limit exceeds mu in about 5% of runs at 95% confidence, and sits near mu."""
    mu, m, trials = 0.5, 2000, 300
    rng = np.random.default_rng(2)
    lower = []
    for _ in range(trials):
        included = rng.random(m) < 0.5
        scores = rng.normal(0.0, 1.0, m) + mu * included
        lower.append(gaussian_mu(scores, included, 0.95).mu_lower_bound)
    assert np.mean(np.array(lower) > mu) < 0.09
    assert mu - 0.15 < np.median(lower) < mu


# --- the canaries are training examples ----------------------------------------------------


def small_private_run(**overrides) -> tuple[TrainingSetup, CanaryExamples]:
    """A tiny private run (noise off) with 40 canaries attached, half of them of gradient
    norm 10 C and half of norm C / 2, all included."""
    # epsilon 0.5 only because its noise calibrates in a fraction of a second here
    config = audit_config(
        synthetic_size=120, epochs=1, batch_size=20, epsilon=0.5, device="cpu", **overrides
    )
    setup = build_training(config, load_data(config), CPU)
    setup.optimizer.noise_multiplier = 0.0
    clip = setup.private.plan.max_grad_norm
    drawn = Canaries.draw(last_linear(setup.model), 40, 10 * clip, seed=0)
    norms = drawn.norms.clone()
    norms[20:] = clip / 2
    canaries = Canaries(drawn.outputs, drawn.directions, norms, torch.ones(40, dtype=torch.bool))
    return setup, CanaryExamples(canaries, setup, seed=0)


def canary_rows(ids: list[int], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of canary rows only, as the sampler yields them (blank inputs, label -1 - j)."""
    return like.new_zeros((len(ids), *like.shape[1:])), torch.tensor([-1 - j for j in ids])


def check_canaries_are_clipped_by_the_engine(**overrides) -> None:
    """A batch of canaries alone: each canary's gradient is clipped to C (norm 10 C) or kept
    (norm C / 2) by the engine, and the transcript records the projections of their signed
    sum on every canary's direction, in clipped canaries and signed back; nothing reaches
    the layers before the last."""
    setup, examples = small_private_run(**overrides)
    clip = setup.private.plan.max_grad_norm
    drawn = [0, 1, 2, 25, 26]
    x, y = examples.take(*canary_rows(drawn, setup.loader.features))
    train_step(setup, x, y, 1)
    canaries = examples.canaries
    kept = torch.zeros(40, dtype=torch.float64)  # each drawn canary in clip norms, clipped
    kept[drawn] = (canaries.norms[drawn] / clip).clamp(max=1.0)
    same_output = canaries.outputs[:, None] == canaries.outputs[None, :]
    overlap = (canaries.directions @ canaries.directions.T) * same_output
    signs = examples.signs  # each canary's gradient flipped by its sign, its projection too
    expected = signs * (overlap @ (signs * kept))
    assert examples.transcript[-1].tolist() == pytest.approx(expected.tolist(), abs=1e-4)
    assert set(signs.tolist()) == {-1.0, 1.0}
    head = last_linear(setup.model)
    for p in setup.optimizer.params:
        if p is not head.weight and p is not head.bias:
            assert p.grad.abs().max() == 0  # the crafted input is detached
    # with data: the data's examples are clipped as before, the canaries on top
    x, y = next(iter(setup.loader))
    train_step(setup, *examples.take(x, y), 1)
    assert setup.private.steps_taken == 2 and examples.steps == 2


@pytest.mark.parametrize("optimizer", PRIVATE_OPTIMIZERS)
def test_every_private_optimizer_has_its_canaries_clipped_by_the_engine(optimizer):
    check_canaries_are_clipped_by_the_engine(optimizer=optimizer)


@pytest.mark.parametrize("engine", ["bk", *PER_SAMPLE_ENGINES])
def test_every_per_example_engine_clips_the_canaries(engine):
    check_canaries_are_clipped_by_the_engine(optimizer="dp-sgd", engine=engine)


def test_an_engine_the_canaries_cannot_enter_is_refused():
    with pytest.raises(DpivonError, match="engine ghost"):
        small_private_run(optimizer="dp-sgd", engine="ghost")


def test_canaries_are_drawn_by_the_data_sampler_at_its_rate():
    setup, examples = small_private_run(optimizer="dp-sgd")
    loader, q = setup.loader, setup.private.plan.sample_rate
    assert len(loader.labels) == setup.private.plan.dataset_size + 40
    epochs = 60
    for _ in range(epochs):
        for x, y in loader:
            assert examples.take(x, y)[1] is y  # the canaries stay in the batch
    n = 40 * epochs * len(loader)
    rate = examples.times_sampled.sum().item() / n
    assert abs(rate - q) < 4 * math.sqrt(q * (1 - q) / n)  # q, not 1 and not q^2


# --- the audit: correct runs pass, broken privacy paths are flagged -------------------------


def unclipped_bookkeeping(monkeypatch) -> None:
    monkeypatch.setattr(bookkeeping, "clip_factors", lambda squared, clip: torch.ones_like(squared))


def sampler_takes_everything(monkeypatch) -> None:
    """Every example in every batch (q = 1) while the accountant is told b / N."""
    monkeypatch.setattr(
        sampling.PoissonBatches,
        "sample_mask",
        lambda self: torch.ones_like(self.labels, dtype=torch.bool),
    )


def sampler_at_three_times_the_rate(monkeypatch) -> None:
    """The Poisson mask drawn at 3 q while the accountant is told q."""

    def mask(self):
        uniforms = self.randomness.uniform(len(self.labels), self.labels.device)
        return uniforms < 3 * self.sample_rate

    monkeypatch.setattr(sampling.PoissonBatches, "sample_mask", mask)


def norms_read_ten_times_too_small(monkeypatch) -> None:
    """Every book-keeping layer rule gives squared norms / 100: bk clips at 10 C."""
    for layer, rule in list(bookkeeping._RULES.items()):

        def small(*args, rule=rule):
            squared, sums = rule(*args)
            return squared / 100, sums

        monkeypatch.setitem(bookkeeping._RULES, layer, small)


def half_the_noise(monkeypatch) -> None:
    """The DP optimizers (every engine's) draw noise of half the std they are asked for."""
    generate = noise.gaussian_noise

    def half(randomness, std, count, device, dtype=torch.float32):
        return generate(randomness, std / 2, count, device, dtype)

    monkeypatch.setattr(noise, "gaussian_noise", half)


MUTATIONS = {
    "no-clip": unclipped_bookkeeping,
    "q=1": sampler_takes_everything,
    "half-noise": half_the_noise,
    "norms-10x-small": norms_read_ten_times_too_small,
    "3q": sampler_at_three_times_the_rate,
}
# `dpivon audit`'s synthetic audit (450 examples, b 50, 5 epochs: 45 steps) with 2,000
# canaries: the correct run certifies about 1.0 against the claim of 2 (1.57 in Gaussian-DP
# terms), its control about 9; each mutation certifies well above the claim.
MUTATION_AUDIT = dict(epochs=5, epsilon=2.0, delta=1e-5, device="cpu")
AUDIT_CANARIES = 2000


@pytest.mark.slow
def test_audit_of_a_correct_run_certifies_half_its_claim_and_its_control_has_power():
    result = run_audit(audit_config(optimizer="dp-sgd", **MUTATION_AUDIT), AUDIT_CANARIES)
    print(result.summary())
    assert result.claimed_epsilon == 2.0 and result.canaries == AUDIT_CANARIES
    assert 0.5 * 2.0 <= result.real.epsilon_certified <= 2.0
    assert result.real.mu_lower_bound <= result.claimed_mu < result.control.mu_lower_bound
    assert result.violations() == []
    assert result.control.noise_multiplier == 0.0 < result.noise_multiplier
    assert result.real.steps == result.steps == result.control.steps == 45
    assert 0.95 < result.noise_ratio < 1.1
    # each included canary took part in about q * steps steps
    expected = result.sample_rate * result.steps
    assert result.real.mean_times_sampled == pytest.approx(expected, rel=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_audit_flags_a_broken_privacy_path(mutation, monkeypatch):
    MUTATIONS[mutation](monkeypatch)
    result = run_audit(audit_config(optimizer="dp-sgd", **MUTATION_AUDIT), AUDIT_CANARIES)
    violations = result.violations()
    print(mutation, result.summary())
    assert result.real.mu_lower_bound > result.claimed_mu
    assert any("above the claimed mu" in v for v in violations), violations
    if mutation == "half-noise":
        assert any("noise multiplier" in v for v in violations), violations
    if mutation == "q=1":
        assert result.real.mean_times_sampled == result.steps


QUICK_AUDIT = {**MUTATION_AUDIT, "epochs": 2}  # the unit tier's: 18 steps, 1,000 canaries


def test_quick_audit_passes_a_correct_dp_ivon_run():
    result = run_audit(audit_config(optimizer="dp-ivon-gradsq", **QUICK_AUDIT), 1000)
    assert result.violations() == []
    assert result.control.mu_lower_bound > result.claimed_mu


def test_quick_audit_flags_norms_read_ten_times_too_small(monkeypatch):
    norms_read_ten_times_too_small(monkeypatch)
    result = run_audit(audit_config(optimizer="dp-sgd", **QUICK_AUDIT), 1000)
    assert any("above the claimed mu" in v for v in result.violations())


def test_audit_flags_a_missing_clip_in_opacus_hooks(monkeypatch):
    def sum_unclipped(self: DPOptimizer) -> None:
        for p in self.params:
            p.summed_grad = p.grad_sample.sum(0)

    monkeypatch.setattr(DPOptimizer, "clip_and_accumulate", sum_unclipped)
    config = audit_config(optimizer="dp-sgd", engine="hooks", **QUICK_AUDIT)
    assert any("above the claimed mu" in v for v in run_audit(config, 1000).violations())


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
        "epsilon_certified",
        "mu_lower_bound",
        "claimed_mu",
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


def test_cli_exits_1_on_a_violation_and_still_writes_the_audit(tmp_path, monkeypatch):
    unclipped_bookkeeping(monkeypatch)
    out, uri = tmp_path / "audit.json", f"sqlite:///{tmp_path}/mlflow.db"
    args = ["audit", "--optimizer", "dp-sgd", "--epsilon", "2", "--epochs", "2"]
    args += ["--canaries", "1000", "--device", "cpu", "--json", str(out), "--tracking-uri", uri]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    violation = [line for line in result.output.splitlines() if "privacy violation" in line]
    assert len(violation) == 1 and "above the claimed mu" in violation[0], result.output
    summary = json.loads(out.read_text())
    assert summary["mu_lower_bound"] > summary["claimed_mu"] and summary["claimed_epsilon"] == 2


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
