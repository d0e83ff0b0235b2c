"""Empirical privacy audit in one training run (Steinke, Nasr & Jagielski, NeurIPS 2023).

m gradient canaries are each included in the run with probability 1/2 (independent fair
coins). An included canary is one more training example: at every step it is Poisson-
sampled at the run's sample rate q, clipped like the data and added to the clipped sum
before the noise. The auditor sees every privatised gradient g_dp (white box), scores each
canary by sum_t <g_dp_t, c_j>, guesses "included" for the top k+ scores and "excluded"
for the bottom k-, and counts its correct guesses. If the run is (eps, delta)-DP, that
count is (up to a delta term) stochastically dominated by Binomial(r, e^eps / (1 + e^eps))
for r guesses, so a count too large for that binomial rejects eps: the largest eps
rejected at the chosen confidence is an empirical lower bound on the run's epsilon.

A maintained implementation exists only inside a JAX package (jax_privacy's
``auditing.CanaryScoreAuditor``), so the bound is written here with numpy; the tests check
it against an exact rational computation and the perfect-attacker numbers.

The canaries go in through the optimizer *instance*: `CanaryInjector.attach` wraps the
Opacus ``DPOptimizer``'s ``add_noise`` (canaries join ``p.summed_grad``, then Opacus adds
the noise) and ``pre_step`` (scores are read from ``p.grad`` once it is privatised). The
accountant's step hook is left alone, so this works for every private optimizer (DP-SGD,
DP-Adam and the DP-IVON family all sit under the same DPOptimizer).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from opacus.optimizers import DPOptimizer

from dpivon.config import PRIVATE_OPTIMIZERS, TrainConfig, parse_config
from dpivon.data import DataSplits
from dpivon.errors import DpivonError
from dpivon.models import build_model
from dpivon.privacy.engine import PrivacyPlan
from dpivon.training import (
    StepCallback,
    StepReport,
    build_training,
    load_data,
    resolve_device,
    seed_everything,
    train_step,
)

# --- the bound (Steinke, Nasr & Jagielski 2023, Theorem 5.2 / their Algorithm 2) ---------


def _log_binomial_pmf(r: int, p_log: float, q_log: float) -> np.ndarray:
    """log P[Binomial(r, p) = i] for i = 0..r, from log p and log(1 - p)."""
    log_factorial = np.concatenate(([0.0], np.cumsum(np.log(np.arange(1, r + 1)))))
    i = np.arange(r + 1)
    return log_factorial[r] - log_factorial[i] - log_factorial[r - i] + i * p_log + (r - i) * q_log


def p_value(m: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Probability that an (epsilon, delta)-DP run lets ``guesses`` guesses on ``m``
    canaries be right ``correct`` times or more: P[Binom(r, p) >= v] + 2 m delta alpha,
    p = e^eps / (1 + e^eps), alpha = max_{1<=i<=v} P[v - i <= Binom(r, p) < v] / i."""
    if not 0 <= correct <= guesses <= m:
        raise ValueError(f"need 0 <= correct ({correct}) <= guesses ({guesses}) <= m ({m})")
    if correct == 0:
        return 1.0
    # log p and log(1 - p) of the logistic p, stable for large epsilon
    p_log = -math.log1p(math.exp(-epsilon))
    q_log = -epsilon + p_log
    pmf = np.exp(_log_binomial_pmf(guesses, p_log, q_log))
    tail = float(pmf[correct:].sum())
    below = np.cumsum(pmf[correct - 1 :: -1])  # P[v - i <= B < v], i = 1..v
    alpha = float(np.max(below / np.arange(1, correct + 1)))
    return min(tail + 2.0 * m * delta * alpha, 1.0)


def epsilon_lower_bound(
    m: int, guesses: int, correct: int, delta: float, significance: float = 0.05
) -> float:
    """Largest epsilon whose (epsilon, delta) claim the guesses reject at ``significance``
    (p-value below it); 0 when even epsilon = 0 is not rejected."""
    if p_value(m, guesses, correct, 0.0, delta) >= significance:
        return 0.0
    low, high = 0.0, 1.0  # p_value(low) < significance <= p_value(high) once high is found
    while p_value(m, guesses, correct, high, delta) < significance:
        low, high = high, 2.0 * high
    for _ in range(40):  # bisection to about 1e-11
        middle = 0.5 * (low + high)
        if p_value(m, guesses, correct, middle, delta) < significance:
            low = middle
        else:
            high = middle
    return low


def guess_schedule(m: int) -> list[tuple[int, int]]:
    """The fixed grid of (k+, k-) guess counts tried on every audit, chosen before any
    score is seen: one-sided guesses (only "included": robust to included canaries that
    were never sampled) at 5-50% of the canaries, and balanced two-sided ones at 5-100%."""
    schedule = []
    for fraction in (0.05, 0.1, 0.2, 0.5, 1.0):
        total = max(1, round(fraction * m))
        pairs = [((total + 1) // 2, total // 2)]
        if fraction <= 0.5:
            pairs.insert(0, (total, 0))
        for pair in pairs:
            if pair not in schedule:
                schedule.append(pair)
    return schedule


@dataclass(frozen=True)
class GuessResult:
    """The best guess of the schedule and the lower bound it certifies."""

    epsilon_lower_bound: float
    k_plus: int
    k_minus: int
    guesses: int
    correct: int


def correct_guesses(scores: np.ndarray, included: np.ndarray, k_plus: int, k_minus: int) -> int:
    """Right guesses when the top ``k_plus`` scores are called included and the bottom
    ``k_minus`` excluded (ties broken by a stable sort: deterministic, blind to the coins)."""
    if k_plus + k_minus > len(scores):
        raise ValueError(f"k+ + k- = {k_plus + k_minus} exceeds the {len(scores)} canaries")
    order = np.argsort(-scores, kind="stable")
    top, bottom = order[:k_plus], order[len(order) - k_minus :]
    return int(included[top].sum() + (~included[bottom]).sum())


def audit_scores(
    scores: np.ndarray, included: np.ndarray, delta: float, confidence: float = 0.95
) -> GuessResult:
    """Epsilon lower bound at ``confidence``, maximised over `guess_schedule`.

    Picking the best of K guess counts after seeing the scores is a multiple test: each
    count is tested at significance (1 - confidence) / K (Bonferroni), so the maximum is
    still a lower bound at ``confidence``.
    """
    m = len(scores)
    schedule = guess_schedule(m)
    significance = (1.0 - confidence) / len(schedule)
    best: GuessResult | None = None
    for k_plus, k_minus in schedule:
        correct = correct_guesses(scores, included, k_plus, k_minus)
        bound = epsilon_lower_bound(m, k_plus + k_minus, correct, delta, significance)
        if best is None or bound > best.epsilon_lower_bound:
            best = GuessResult(bound, k_plus, k_minus, k_plus + k_minus, correct)
    assert best is not None
    return best


# --- the canaries -------------------------------------------------------------------------

_CANARY_STREAM = 0xCA7A_2023  # mixed into the seed: canary randomness is a stream of its own


def check_canary_count(count: int, parameters: int) -> None:
    """Each canary takes a coordinate of its own: at most one per model parameter."""
    if not 1 <= count <= parameters:
        raise DpivonError(
            f"canaries must be in [1, {parameters}] (one coordinate each of the model's "
            f"{parameters} parameters), got {count}"
        )


def check_canaries(config: TrainConfig, count: int) -> None:
    """:func:`check_canary_count` for ``config``'s model, before any run is opened."""
    check_canary_count(count, sum(p.numel() for p in build_model(config.model.name).parameters()))


class CanaryInjector:
    """Dirac gradient canaries c_j = norm_j * e_{k_j} on distinct coordinates k_j.

    Why Dirac: distinct coordinates make the canaries orthogonal, so a canary's score
    <g_dp, c_j> = norm_j * g_dp[k_j] carries no cross-talk from the other canaries (random
    directions would each add about C / sqrt(P) of every other sampled canary) and only
    the isotropic DP noise and the data's own gradient on k_j compete with the signal.
    Sampling, clipping and scoring are then m-vector operations, whatever the model size.

    ``included`` are the coins; each step every included canary is sampled with
    probability ``sample_rate`` (independent of the data's Poisson sampling), clipped with
    Opacus's factor min(1, C / (norm + 1e-6)) and added to ``p.summed_grad``.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        coordinates: torch.Tensor,
        norms: torch.Tensor,
        included: torch.Tensor,
        sample_rate: float,
        generator: torch.Generator,
    ) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        total = sum(p.numel() for p in params)
        if coordinates.unique().numel() != coordinates.numel() or not (
            int(coordinates.min()) >= 0 and int(coordinates.max()) < total
        ):
            raise ValueError(f"canary coordinates must be distinct and in [0, {total})")
        self.coordinates = coordinates  # flat indices into the concatenated ``params``
        self.norms = norms.to(torch.float64)
        self.included = included.to(torch.bool)
        self.sample_rate = sample_rate
        self.generator = generator
        self.scores = torch.zeros(len(norms), dtype=torch.float64)
        self.times_sampled = torch.zeros(len(norms), dtype=torch.long)
        self.steps = 0
        self._injected = False
        # per parameter: (parameter, its local coordinates, the canary ids living there)
        self._groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        start = 0
        for p in params:
            inside = (coordinates >= start) & (coordinates < start + p.numel())
            ids = inside.nonzero().flatten()
            if len(ids):
                local = (coordinates[ids] - start).to(p.device)
                self._groups.append((p, local, ids))
            start += p.numel()

    @classmethod
    def draw(
        cls, params: list[torch.Tensor], count: int, norm: float, sample_rate: float, seed: int
    ) -> CanaryInjector:
        """``count`` canaries of L2 norm ``norm`` on random distinct coordinates of
        ``params``, each included by a fair coin; coins, coordinates and per-step sampling
        come from a generator derived from ``seed`` and used for nothing else."""
        total = sum(p.numel() for p in params)
        check_canary_count(count, total)
        # A stream of its own: the coins must be independent of the run's randomness.
        state = np.random.SeedSequence([seed, _CANARY_STREAM]).generate_state(1, np.uint64)
        generator = torch.Generator().manual_seed(int(state[0]) & (2**63 - 1))
        coordinates = torch.randperm(total, generator=generator)[:count]
        included = torch.rand(count, generator=generator) < 0.5
        norms = torch.full((count,), float(norm))
        return cls(params, coordinates, norms, included, sample_rate, generator)

    def attach(self, optimizer: DPOptimizer) -> None:
        """Wrap this optimizer instance's ``add_noise`` and ``pre_step``; the step hook
        (the accountant) stays as it is."""
        add_noise, pre_step = optimizer.add_noise, optimizer.pre_step

        def add_noise_with_canaries() -> None:
            self._inject(optimizer.max_grad_norm)
            add_noise()

        def pre_step_then_score(*args, **kwargs) -> bool:
            self._injected = False
            stepped = pre_step(*args, **kwargs)
            if stepped and self._injected:  # p.grad now holds g_dp
                self._score()
            return stepped

        optimizer.add_noise = add_noise_with_canaries
        optimizer.pre_step = pre_step_then_score

    @torch.no_grad()
    def _inject(self, max_grad_norm: float) -> None:
        sampled = self.included & (
            torch.rand(len(self.norms), generator=self.generator, dtype=torch.float64)
            < self.sample_rate
        )
        clip_factor = (max_grad_norm / (self.norms + 1e-6)).clamp(max=1.0)
        contribution = self.norms * clip_factor * sampled
        for p, local, ids in self._groups:
            summed = p.summed_grad.view(-1)
            summed.index_add_(0, local, contribution[ids].to(summed))
        self.times_sampled += sampled
        self._injected = True

    @torch.no_grad()
    def _score(self) -> None:
        for p, local, ids in self._groups:
            self.scores[ids] += p.grad.view(-1)[local].to(torch.float64).cpu() * self.norms[ids]
        self.steps += 1


# --- the audit ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RunAudit:
    """One scored training run (the real one or the noise-off control)."""

    noise_multiplier: float
    epsilon_lower_bound: float
    guesses: int
    correct_guesses: int
    k_plus: int
    k_minus: int
    steps: int
    included: int
    mean_times_sampled: float  # per included canary; about q * steps


@dataclass(frozen=True)
class AuditResult:
    """Claimed epsilon against what one run, and its noise-off control, certify."""

    optimizer: str
    claimed_epsilon: float
    delta: float
    canaries: int
    confidence: float
    sample_rate: float
    steps: int
    noise_multiplier: float
    real: RunAudit
    control: RunAudit
    wall_time_s: float

    def summary(self) -> dict[str, float | int | str]:
        """Flat, JSON-ready record (the ``--json`` output)."""
        out: dict[str, float | int | str] = {
            k: v for k, v in asdict(self).items() if k not in ("real", "control")
        }
        out.update(
            epsilon_lower_bound=self.real.epsilon_lower_bound,
            control_epsilon_lower_bound=self.control.epsilon_lower_bound,
            guesses=self.real.guesses,
            correct_guesses=self.real.correct_guesses,
            control_guesses=self.control.guesses,
            control_correct_guesses=self.control.correct_guesses,
            k_plus=self.real.k_plus,
            k_minus=self.real.k_minus,
            included_canaries=self.real.included,
            mean_times_sampled=self.real.mean_times_sampled,
        )
        return out


# Small enough that an audit (real run + control) takes seconds on a CPU, large enough that
# at epsilon 2 and 1,000 canaries the noise-off control certifies well above 2: the data's
# own gradient on a canary's coordinate is the control's only noise, and it grows with
# the batch size relative to a canary's C / b.
AUDIT_DEFAULTS: dict[str, object] = dict(
    dataset="synthetic",
    model="small-cnn",
    synthetic_size=500,
    epochs=5,
    batch_size=50,
    epsilon=2.0,
    delta=1e-5,
)


def audit_config(**overrides: object) -> TrainConfig:
    """A training config with the audit's defaults under ``overrides``."""
    return parse_config({**AUDIT_DEFAULTS, **overrides}, source="audit options")


def run_audit(
    config: TrainConfig,
    canaries: int,
    *,
    confidence: float = 0.95,
    data: DataSplits | None = None,
    on_step: StepCallback | None = None,
) -> AuditResult:
    """Audit ``config``'s private training with ``canaries`` gradient canaries: one run as
    configured, and one control run with the noise off (everything else equal), which must
    certify more than the claimed epsilon for the audit to have shown it could see a leak.

    The runs take ``config.training.epochs`` passes with a constant learning rate (the guarantee, so
    the audit, does not depend on the schedule) and skip evaluation.
    """
    if config.optimizer.name not in PRIVATE_OPTIMIZERS:
        raise DpivonError(
            f"{config.optimizer.name} is not private: audit one of {', '.join(PRIVATE_OPTIMIZERS)}"
        )
    if not math.isfinite(config.privacy.epsilon):
        raise DpivonError("epsilon must be finite: a run without noise claims nothing")
    if canaries < 1:
        raise DpivonError(f"canaries must be >= 1, got {canaries}")
    if not 0 < confidence < 1:
        raise DpivonError(f"confidence must be in (0, 1), got {confidence}")
    started = time.perf_counter()
    data = data if data is not None else load_data(config)
    real, plan = _scored_run(config, data, canaries, confidence, noise=True, on_step=on_step)
    control, _ = _scored_run(config, data, canaries, confidence, noise=False, on_step=on_step)
    return AuditResult(
        optimizer=config.optimizer.name,
        claimed_epsilon=plan.target_epsilon,
        delta=config.privacy.delta,
        canaries=canaries,
        confidence=confidence,
        sample_rate=plan.sample_rate,
        steps=real.steps,
        noise_multiplier=plan.noise_multiplier,
        real=real,
        control=control,
        wall_time_s=time.perf_counter() - started,
    )


def _scored_run(
    config: TrainConfig,
    data: DataSplits,
    canaries: int,
    confidence: float,
    *,
    noise: bool,
    on_step: StepCallback | None,
) -> tuple[RunAudit, PrivacyPlan]:
    """Train once with the canaries in and score them from the privatised gradients."""
    seed_everything(config.runtime.seed)
    device = resolve_device(config.runtime.device)
    setup = build_training(config, data, device)
    plan = setup.private.plan
    optimizer = setup.optimizer
    if not noise:
        optimizer.noise_multiplier = 0.0
    injector = CanaryInjector.draw(
        list(optimizer.params), canaries, plan.max_grad_norm, plan.sample_rate, config.runtime.seed
    )
    injector.attach(optimizer)
    label = f"{config.optimizer.name} {'audit' if noise else 'noise-off control'}"
    done = 0
    for epoch in range(1, config.training.epochs + 1):
        setup.trained_module.train()
        for x, y in setup.loader:
            loss = train_step(setup, x.to(device), y.to(device), config.optimizer.samples_per_step)
            done += 1
            if on_step is not None:
                on_step(StepReport(label, done, plan.steps, f"epoch {epoch} loss {loss:.3f}"))
    scores = injector.scores.numpy()
    if not np.isfinite(scores).all():
        raise DpivonError(
            f"training diverged during the audit of {config.optimizer.name}: lower the learning "
            f"rate (lr={config.optimizer.lr})"
        )
    included = injector.included.numpy()
    best = audit_scores(scores, included, config.privacy.delta, confidence)
    n_included = int(included.sum())
    result = RunAudit(
        noise_multiplier=float(optimizer.noise_multiplier),
        epsilon_lower_bound=best.epsilon_lower_bound,
        guesses=best.guesses,
        correct_guesses=best.correct,
        k_plus=best.k_plus,
        k_minus=best.k_minus,
        steps=injector.steps,
        included=n_included,
        mean_times_sampled=float(injector.times_sampled.sum()) / max(n_included, 1),
    )
    return result, plan
