"""Empirical privacy audit in one training run (Steinke, Nasr & Jagielski, NeurIPS 2023).

m gradient canaries are each included in the run with probability 1/2 (independent fair
coins). An included canary is one more training example, and it takes the data's path:

- it is a row of the Poisson sampler's population, so the sampler that draws the batches
  draws it, at the rate it really uses (not the accounted one);
- when drawn, its gradient (norm 10 C, above the clip norm) joins the batch's per-example
  gradients *before* the engine clips them, so it reaches the sum with norm C only if the
  engine clips;
- the noise and the division by the expected batch size follow, as for the data.

The auditor sees every privatised gradient g_dp (white box), scores each canary by the
likelihood ratio of its coordinate's values over the steps (`CanaryExamples.scores`),
guesses "included" for the top k+ scores and "excluded" for the bottom k-, and counts its
correct guesses. If the run is (eps, delta)-DP, that count is (up to a delta term)
stochastically dominated by Binomial(r, e^eps / (1 + e^eps)) for r guesses, so a count too
large for that binomial rejects eps: the largest eps rejected at the chosen
confidence is an empirical lower bound on the run's epsilon.

What it can see is what its canaries pass through: the sampler's rate, the engine's clip,
the noise's scale, the accountant's epsilon for that mechanism. It cannot see a leak on a
path they skip: the model's forward pass (canary gradients are injected, not computed),
evaluation, logging or anything released outside the training loop.

A maintained implementation of the bound exists only inside a JAX package (jax_privacy's
``auditing.CanaryScoreAuditor``), so it is written here with numpy; the tests check it
against an exact rational computation and the perfect-attacker numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
import torch
from torch import Tensor

from dpivon.config import PRIVATE_OPTIMIZERS, TrainConfig, parse_config
from dpivon.data import DataSplits
from dpivon.errors import DpivonError
from dpivon.models import build_model
from dpivon.privacy.accounting import epsilon_spent
from dpivon.privacy.engine import PER_SAMPLE_ENGINES, PrivacyPlan, PrivateTraining
from dpivon.privacy.sampling import PoissonBatches
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
# A canary's gradient norm in clip norms: clipped it adds C to the sum, unclipped 10 C.
CANARY_NORM_IN_CLIPS = 10.0


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


@dataclass(frozen=True)
class Canaries:
    """Dirac gradient canaries c_j = norm_j * e_{k_j} on distinct coordinates k_j of the
    model's trainable parameters (flat indices into them, concatenated in order), each in
    the run by its fair coin ``included[j]``.

    Why Dirac: distinct coordinates make the canaries orthogonal, so the coordinate g_dp[k_j]
    a canary is scored on carries no cross-talk from the other canaries (random directions
    would each add about C / sqrt(P) of every other sampled canary) and only the isotropic
    DP noise and the data's own gradient on k_j compete with the signal. Clipping keeps the
    direction: a clipped canary adds exactly C e_{k_j}, an unclipped one norm_j e_{k_j}.
    """

    coordinates: Tensor  # (m,) long
    norms: Tensor  # (m,) float64
    included: Tensor  # (m,) bool

    @classmethod
    def draw(cls, parameters: int, count: int, norm: float, seed: int) -> Canaries:
        """``count`` canaries of L2 norm ``norm`` on random distinct coordinates of
        ``parameters`` ones, each included by a fair coin; coins and coordinates come from
        a generator derived from ``seed`` and used for nothing else."""
        check_canary_count(count, parameters)
        # A stream of its own: the coins must be independent of the run's randomness.
        state = np.random.SeedSequence([seed, _CANARY_STREAM]).generate_state(1, np.uint64)
        generator = torch.Generator().manual_seed(int(state[0]) & (2**63 - 1))
        coordinates = torch.randperm(parameters, generator=generator)[:count]
        included = torch.rand(count, generator=generator) < 0.5
        return cls(coordinates, torch.full((count,), float(norm), dtype=torch.float64), included)


def subsampled_gaussian_log_ratio(x: Tensor, sample_rate: float, noise_multiplier: float) -> Tensor:
    """log [(1 - q) N(x; 0, sigma^2) + q N(x; 1, sigma^2)] / N(x; 0, sigma^2): how much more
    likely one step's coordinate x (in clip norms, x = b g_dp[k] / C) is if a canary of
    clipped norm 1 is in the population, Poisson-sampled at rate q, with noise sigma.

    The Neyman-Pearson statistic of one step, summed over steps: a plain sum of x would
    weigh the steps a canary missed as much as the one it was drawn in.
    """
    shift = (x - 0.5) / noise_multiplier**2
    return torch.logaddexp(
        torch.full_like(x, math.log1p(-sample_rate)), math.log(sample_rate) + shift
    )


def dirac_sum(like: Tensor, rows: Tensor, local: Tensor, norms: Tensor, clip: Tensor) -> Tensor:
    """sum_i clip[rows_i] norms_i e_{local_i}, shaped like ``like``: the clipped sum of
    Dirac per-example gradients (rows: their places among the clip factors)."""
    total = torch.zeros_like(like).view(-1)
    total.index_add_(0, local, (clip[rows].to(norms) * norms).to(total))
    return total.view_as(like)


class CanaryExamples:
    """One run's included canaries as training examples (module docstring): enrolled in
    the Poisson sampler's population, their gradients clipped by the engine with the
    batch's, scored on the privatised gradient.

    Built on a run's private training, it enrolls in its sampler and hooks its engine; then
    for every batch the sampler yields, `take` the canary rows out before the training step
    (the data rows go on as usual).
    """

    def __init__(self, canaries: Canaries, private: PrivateTraining) -> None:
        self.canaries = canaries
        self.params = [p for p in private.optimizer.params if p.requires_grad]
        total = sum(p.numel() for p in self.params)
        coordinates = canaries.coordinates
        if coordinates.unique().numel() != coordinates.numel() or not (
            int(coordinates.min()) >= 0 and int(coordinates.max()) < total
        ):
            raise ValueError(f"canary coordinates must be distinct and in [0, {total})")
        device = self.params[0].device
        ends = torch.tensor([p.numel() for p in self.params]).cumsum(0)
        self._owner = torch.bucketize(coordinates, ends, right=True)  # parameter of canary j
        starts = ends - torch.tensor([p.numel() for p in self.params])
        self._local = (coordinates - starts[self._owner]).to(device)  # index inside it
        # per parameter holding canaries: (its index, the ids of its canaries)
        self._groups = [
            (index, ids)
            for index in range(len(self.params))
            if len(ids := (self._owner == index).nonzero().flatten())
        ]
        self._norms = canaries.norms.to(device)
        m = len(coordinates)
        self.plan = private.plan
        self._clips_per_unit = self.plan.expected_batch_size / self.plan.max_grad_norm
        self.transcript: list[Tensor] = []  # per step, x of every canary (`_score_if`)
        self.times_sampled = torch.zeros(m, dtype=torch.long)
        self._drawn = torch.zeros(0, dtype=torch.long)  # the canaries of the current batch
        self._stage = self._wire(private)
        self._enroll(private.loader)

    # sampling
    def _enroll(self, loader: PoissonBatches) -> None:
        """Each included canary j becomes row N + i of the sampler's population: a blank
        input labelled -1 - j (data labels are >= 0)."""
        ids = self.canaries.included.nonzero().flatten()
        blanks = loader.features.new_zeros((len(ids), *loader.features.shape[1:]))
        loader.features = torch.cat([loader.features, blanks])
        loader.labels = torch.cat([loader.labels, (-1 - ids).to(loader.labels)])

    def take(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """The data rows of a sampled batch; its canary rows are staged for the engine."""
        is_canary = y < 0
        self._drawn = (-1 - y[is_canary]).cpu()
        self.times_sampled[self._drawn] += 1
        self._stage()
        return x[~is_canary], y[~is_canary]

    # clipping: the drawn canaries' per-example gradients, as each engine takes them
    def _wire(self, private: PrivateTraining) -> Callable[[], None]:
        """Hook the engine; returns what `take` calls to stage the drawn canaries."""
        optimizer = private.optimizer
        pre_step = optimizer.pre_step
        if private.engine == "bk":
            clipper = optimizer.clipper

            def stage() -> None:
                clipper.add_examples(self._drawn_squared_norms(), self._drawn_sums())

            def step(*args, **kwargs) -> bool:
                return self._score_if(pre_step(*args, **kwargs))

        elif private.engine in PER_SAMPLE_ENGINES:

            def stage() -> None:
                pass

            def step(*args, **kwargs) -> bool:
                self._append_grad_samples()
                return self._score_if(pre_step(*args, **kwargs))

        else:
            raise DpivonError(
                f"the audit cannot put canaries into engine {private.engine}'s clipping "
                f"(it computes norms inside Opacus's two-pass loss); audit engine bk or one "
                f"of {', '.join(PER_SAMPLE_ENGINES)}"
            )
        optimizer.pre_step = step
        return stage

    def _drawn_of(self, index: int) -> tuple[Tensor, Tensor]:
        """(rows among the drawn, canary ids) of the drawn canaries on parameter ``index``."""
        rows = (self._owner[self._drawn] == index).nonzero().flatten()
        return rows, self._drawn[rows]

    def _drawn_squared_norms(self) -> Tensor:
        dtype = self.params[0].dtype
        return self._norms[self._drawn.to(self._norms.device)].square().to(dtype)

    def _drawn_sums(self) -> dict[torch.nn.Parameter, Callable[[Tensor], Tensor]]:
        """Per parameter: clip factors of the drawn canaries -> their clipped sum there."""
        sums = {}
        for index, p in enumerate(self.params):
            rows, ids = self._drawn_of(index)
            if len(ids):
                sums[p] = partial(
                    dirac_sum, p, rows.to(p.device), self._local[ids], self._norms[ids]
                )
        return sums

    @torch.no_grad()
    def _append_grad_samples(self) -> None:
        """The drawn canaries as rows after the batch's in every ``p.grad_sample``."""
        for index, p in enumerate(self.params):
            rows, ids = self._drawn_of(index)
            canary_rows = p.grad_sample.new_zeros((len(self._drawn), p.numel()))
            canary_rows[rows.to(p.device), self._local[ids]] = self._norms[ids].to(p.dtype)
            p.grad_sample = torch.cat([p.grad_sample, canary_rows.view(-1, *p.shape)])

    # scoring
    @torch.no_grad()
    def _score_if(self, stepped: bool) -> bool:
        """After pre_step p.grad holds g_dp: record x_j = b g_dp[k_j] / C, the step's
        coordinate of canary j in clip norms (C / b: what a clipped canary adds)."""
        if stepped:
            step = torch.empty(len(self.canaries.norms), dtype=torch.float64)
            for index, ids in self._groups:
                values = self.params[index].grad.view(-1)[self._local[ids]]
                step[ids] = values.to(torch.float64).cpu() * self._clips_per_unit
            self.transcript.append(step)
        return stepped

    @property
    def steps(self) -> int:
        return len(self.transcript)

    def noise_estimate(self) -> float:
        """sigma read off the transcript: 1.4826 x the median absolute deviation of every
        recorded x (robust to the few steps a canary was drawn in), floored at 1e-3 (a
        noise-off control may have nothing but the data's gradient there)."""
        x = torch.stack(self.transcript)
        deviation = (x - x.median()).abs().median()
        return max(1.4826 * float(deviation), 1e-3)

    def scores(self) -> Tensor:
        """score_j = sum_t `subsampled_gaussian_log_ratio`(x_tj; q, sigma_hat): the
        accounted q, and the noise the transcript shows (a function of the released
        gradients alone, so the bound stays valid; a run with less noise than accounted
        is scored with the noise it had)."""
        x = torch.stack(self.transcript)
        ratios = subsampled_gaussian_log_ratio(x, self.plan.sample_rate, self.noise_estimate())
        return ratios.sum(0)


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
    measured_noise_multiplier: float  # `CanaryExamples.noise_estimate`


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
    epsilon_at_measured_noise: float  # the accountant's, at the real run's measured noise
    wall_time_s: float

    @property
    def noise_ratio(self) -> float:
        """The noise the real run's gradients show over the noise accounted."""
        return self.real.measured_noise_multiplier / self.noise_multiplier

    @property
    def noise_ratio_floor(self) -> float:
        """`noise_ratio` below this is a violation: `NOISE_TOLERANCE` less four standard
        errors of the estimate (1.166 / sqrt(values) for a median absolute deviation)."""
        return NOISE_TOLERANCE - 4 * 1.166 / math.sqrt(self.steps * self.canaries)

    def violations(self) -> list[str]:
        """What this audit refutes, one line each: an epsilon lower bound above the claim,
        or less noise in the released gradients than the accountant was told."""
        found = []
        if self.real.epsilon_lower_bound > self.claimed_epsilon:
            found.append(
                f"epsilon >= {self.real.epsilon_lower_bound:.3g} at {self.confidence:.0%} "
                f"confidence, above the claimed {self.claimed_epsilon:g}"
            )
        if self.noise_ratio < self.noise_ratio_floor:
            found.append(
                f"the gradients carry noise multiplier {self.real.measured_noise_multiplier:.3g}"
                f", {self.noise_ratio:.0%} of the {self.noise_multiplier:.3g} accounted "
                f"(epsilon {self.epsilon_at_measured_noise:.3g} at that noise)"
            )
        return found

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
            measured_noise_multiplier=self.real.measured_noise_multiplier,
            noise_ratio=self.noise_ratio,
        )
        return out


# Measured noise below this share of the accounted (less the estimate's error, see
# `AuditResult.noise_ratio_floor`) is a violation; the data's gradients on the canaries'
# coordinates only add to the measured noise.
NOISE_TOLERANCE = 0.9

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
    real, plan = scored_run(config, data, canaries, confidence, on_step=on_step)
    control, _ = scored_run(config, data, canaries, confidence, noise=False, on_step=on_step)
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
        epsilon_at_measured_noise=epsilon_spent(
            real.measured_noise_multiplier,
            plan.sample_rate,
            real.steps,
            plan.delta,
            plan.accountant,
        ),
        wall_time_s=time.perf_counter() - started,
    )


def scored_run(
    config: TrainConfig,
    data: DataSplits,
    canaries: int,
    confidence: float = 0.95,
    *,
    noise: bool = True,
    on_step: StepCallback | None = None,
) -> tuple[RunAudit, PrivacyPlan]:
    """Train ``config`` once with ``canaries`` canaries in (noise off for the control) and
    score them from the privatised gradients."""
    seed_everything(config.runtime.seed)
    device = resolve_device(config.runtime.device)
    setup = build_training(config, data, device)
    private = setup.private
    plan = private.plan
    if not noise:
        private.optimizer.noise_multiplier = 0.0
    parameters = sum(p.numel() for p in private.optimizer.params if p.requires_grad)
    norm = CANARY_NORM_IN_CLIPS * plan.max_grad_norm
    drawn = Canaries.draw(parameters, canaries, norm, config.runtime.seed)
    examples = CanaryExamples(drawn, private)
    label = f"{config.optimizer.name} {'audit' if noise else 'noise-off control'}"
    done = 0
    for epoch in range(1, config.training.epochs + 1):
        setup.trained_module.train()
        for x, y in setup.loader:
            x, y = examples.take(x, y)
            loss = train_step(setup, x, y, config.optimizer.samples_per_step)
            done += 1
            if on_step is not None:
                on_step(StepReport(label, done, plan.steps, f"epoch {epoch} loss {loss:.3f}"))
    scores = examples.scores().numpy()
    if not np.isfinite(scores).all():
        raise DpivonError(
            f"training diverged during the audit of {config.optimizer.name}: lower the learning "
            f"rate (lr={config.optimizer.lr})"
        )
    included = drawn.included.numpy()
    best = audit_scores(scores, included, config.privacy.delta, confidence)
    n_included = int(included.sum())
    result = RunAudit(
        noise_multiplier=float(private.optimizer.noise_multiplier),
        epsilon_lower_bound=best.epsilon_lower_bound,
        guesses=best.guesses,
        correct_guesses=best.correct,
        k_plus=best.k_plus,
        k_minus=best.k_minus,
        steps=examples.steps,
        included=n_included,
        mean_times_sampled=float(examples.times_sampled.sum()) / max(n_included, 1),
        measured_noise_multiplier=examples.noise_estimate() * float(noise),
    )
    return result, plan
