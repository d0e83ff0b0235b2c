"""The privacy cost of hyper-parameter tuning (Papernot & Steinke, ICLR 2022).

Each trial trains with the Poisson-subsampled Gaussian mechanism, the DP event
``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)``. A sweep
releases more than one trial's epsilon:

* Releasing every trial (or choosing hyper-parameters adaptively from earlier trials'
  results, e.g. Optuna TPE / NSGA-II) costs the RDP composition of all trials; RDP
  composition holds under adaptive choice, so this bound is always valid.
* Releasing only the best of K trials, with hyper-parameters drawn independently of the
  data (random search) and K itself random (Poisson or geometric, drawn before the sweep),
  costs the Papernot & Steinke repeat-and-select bound, far less than K-fold composition.
  A fixed K gets no such discount.

Before a sweep with a total budget, :func:`solve_trial_epsilon_within` finds what each
trial may spend; after it, `dpivon.privacy.tuning_report` states what the trials cost. All
numbers come from Google's ``dp_accounting`` RDP accountant; nothing is re-derived here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp import rdp_privacy_accountant as _rdp

from dpivon.constraints import FiniteEpsilon, check_bound
from dpivon.errors import DpivonError
from dpivon.privacy.accounting import (
    EPSILON_TOLERANCE,
    calibrate_noise_multiplier,
    check_delta,
)

# Shape of the truncated negative binomial family in dp_accounting's RepeatAndSelectDpEvent:
# inf = Poisson(mean), 1 = geometric (mean = 1 / gamma).
DISTRIBUTIONS: dict[str, float] = {"poisson": math.inf, "geometric": 1.0}
TRIAL_COUNTS = ("fixed", *DISTRIBUTIONS)
TrialCount = Literal[TRIAL_COUNTS]  # how a sweep's number of trials is chosen
# One fixed RDP order grid for every computation (dp_accounting's default), so curves of
# different trials can be compared order by order.
ORDERS: tuple[float, ...] = tuple(float(a) for a in _rdp.DEFAULT_RDP_ORDERS)


@dataclass(frozen=True)
class TrialMechanism:
    """The private part of one trial: ``steps`` Poisson-subsampled Gaussian steps, and
    optionally ``validation_releases`` Gaussian-noised validation scores
    (``validation_noise_multiplier`` times their L2 sensitivity, see dpivon.privacy.validation)."""

    noise_multiplier: float
    sample_rate: float
    steps: int
    validation_noise_multiplier: float = 0.0
    validation_releases: int = 0

    def __post_init__(self) -> None:
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise DpivonError(f"noise multiplier must be >= 0; got {self.noise_multiplier}")
        if not 0 < self.sample_rate <= 1:
            raise DpivonError(f"sample rate must be in (0, 1]; got {self.sample_rate}")
        if int(self.steps) != self.steps or self.steps < 0:
            raise DpivonError(f"steps must be a non-negative integer; got {self.steps}")
        if not self.validation_noise_multiplier >= 0 or self.validation_releases < 0:
            raise DpivonError("validation noise multiplier and releases must be >= 0")

    @property
    def private(self) -> bool:
        return self.noise_multiplier > 0 or self.steps == 0

    @property
    def private_validation(self) -> bool:
        return self.validation_noise_multiplier > 0 and self.validation_releases > 0

    def event(self) -> dp_event.DpEvent:
        if self.steps == 0:
            training: dp_event.DpEvent = dp_event.NoOpDpEvent()
        elif self.noise_multiplier == 0:
            return dp_event.NonPrivateDpEvent()
        else:
            step = dp_event.PoissonSampledDpEvent(
                self.sample_rate, dp_event.GaussianDpEvent(self.noise_multiplier)
            )
            training = dp_event.SelfComposedDpEvent(step, int(self.steps))
        if not self.private_validation:
            return training
        # Composed although validation records are not training records: a record is in
        # one split only, so this is conservative (the max of the two would do).
        scores = dp_event.SelfComposedDpEvent(
            dp_event.GaussianDpEvent(self.validation_noise_multiplier), self.validation_releases
        )
        return dp_event.ComposedDpEvent([training, scores])


def _epsilon(event: dp_event.DpEvent, delta: float) -> float:
    accountant = RdpAccountant(orders=ORDERS)
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


def trial_epsilon(trial: TrialMechanism, delta: float) -> float:
    """Epsilon of one trial's training alone."""
    check_delta(delta)
    if not trial.private:
        return math.inf
    return _epsilon(trial.event(), delta)


def composition_epsilon(trials: Sequence[TrialMechanism], delta: float) -> float:
    """Epsilon of running all ``trials`` (heterogeneous allowed) and releasing everything.

    RDP composition of every trial's event; valid under adaptive choice of each trial's
    hyper-parameters from earlier results (TPE, NSGA-II). No trials cost nothing (0.0).
    """
    check_delta(delta)
    if not trials:
        return 0.0
    if not all(t.private for t in trials):
        return math.inf
    return _epsilon(dp_event.ComposedDpEvent([t.event() for t in trials]), delta)


def event_rdp(event: dp_event.DpEvent) -> np.ndarray:
    accountant = RdpAccountant(orders=ORDERS)
    accountant.compose(event)
    return np.asarray(accountant.rdp, dtype=np.float64)


def _rdp_curve(trial: TrialMechanism) -> np.ndarray:
    return event_rdp(trial.event())


def epsilon_from_rdp(rdp: Sequence[float], delta: float) -> float:
    """Epsilon at ``delta`` of an RDP curve on ``ORDERS``."""
    check_delta(delta)
    return float(_rdp.compute_epsilon(ORDERS, np.asarray(rdp, dtype=np.float64), delta)[0])


def check_tuning_cost(quoted_rdp: Sequence[float], quoted_epsilon: float, delta: float) -> None:
    """A tuning cost that a config carries (`dpivon export` writes it) is something dpivon
    computed, never something a config may claim: refuse an RDP curve of the wrong length
    or with a negative or NaN order, and a quoted epsilon below what that curve gives (a
    quote can only be the curve's epsilon or a bound above it)."""
    curve = np.asarray(quoted_rdp, dtype=np.float64)
    if curve.shape != (len(ORDERS),):
        raise DpivonError(
            f"privacy.tuning.quoted_rdp holds {curve.size} values, not one per RDP order "
            f"({len(ORDERS)}): it is not what `dpivon export` wrote; export the config again"
        )
    if np.isnan(curve).any() or (curve < 0).any():
        raise DpivonError(
            "privacy.tuning.quoted_rdp has a negative or NaN order: no mechanism has that "
            "curve; export the config again from its sweep"
        )
    floor = epsilon_from_rdp(curve, delta)
    if not quoted_epsilon >= floor - 1e-9 * max(1.0, floor):
        raise DpivonError(
            f"privacy.tuning.quoted_epsilon {quoted_epsilon:g} is below {floor:.4g}, the "
            "epsilon of its own quoted_rdp at this delta: a cost dpivon computes cannot be "
            "lowered by hand; export the config again"
        )


def compose_with_tuning(
    production: TrialMechanism, tuning_rdp: Sequence[float], delta: float
) -> float:
    """Epsilon of a production run whose hyper-parameters were tuned on the same records:
    the RDP composition of the tuning's quoted curve and the production training."""
    if not production.private:
        return math.inf
    return epsilon_from_rdp(_rdp_curve(production) + np.asarray(tuning_rdp), delta)


def max_rdp_curve(trials: Sequence[TrialMechanism]) -> np.ndarray:
    """Order-wise max of the trials' RDP curves on ``ORDERS``.

    Joint quasi-convexity of the Renyi divergence: the mechanism Q "draw hyper-parameters
    independently of the data, then train" is, at every order, at most as Renyi-divergent
    as the worst candidate mechanism, so this curve is an RDP bound for Q.
    """
    return np.max(np.stack([_rdp_curve(t) for t in set(trials)]), axis=0)


def repeat_and_select_rdp(rdp: np.ndarray, mean: float, shape: float) -> np.ndarray:
    """RDP curve on ``ORDERS`` of the best of K runs of a mechanism given by its RDP curve.

    ``RepeatAndSelectDpEvent`` takes a single DpEvent, not an RDP curve, so a mixture of
    heterogeneous trials needs dp_accounting's private helper directly. It is what
    ``RdpAccountant`` calls for that event; dp-accounting is pinned to 0.6.0 where its
    signature holds.
    """
    return _rdp._compute_rdp_repeat_and_select(ORDERS, rdp, mean, shape)


def trial_count_shape(distribution: str) -> float:
    if distribution not in DISTRIBUTIONS:
        raise DpivonError(
            f"unknown distribution of the number of trials {distribution!r}; choose one of: "
            f"{', '.join(DISTRIBUTIONS)}"
        )
    return DISTRIBUTIONS[distribution]


def random_trials_epsilon(
    trials: Sequence[TrialMechanism], delta: float, *, distribution: str, mean: float
) -> float:
    """Epsilon of releasing only the best of K trials, K ~ ``distribution`` with ``mean``.

    ``distribution`` is ``"poisson"`` (K ~ Poisson(mean)) or ``"geometric"`` (truncated
    geometric with gamma = 1 / mean). Valid only when hyper-parameters are drawn
    independently of the data (random search) and K really is drawn from that distribution
    before the sweep. ``trials`` are the candidate mechanisms: the bound uses the worst of
    them at every RDP order, so they must cover every (sigma, q, steps) the sampler can
    produce, not only those it happened to draw. Identical trials use
    ``RepeatAndSelectDpEvent`` directly; heterogeneous ones the order-wise max RDP curve.
    """
    check_delta(delta)
    shape = trial_count_shape(distribution)
    if not trials:
        raise DpivonError("random_trials_epsilon needs at least one trial mechanism")
    if not (mean >= 1 and math.isfinite(mean)):
        raise DpivonError(f"mean number of trials must be a finite number >= 1; got {mean}")
    if not all(t.private for t in trials):
        return math.inf
    distinct = set(trials)
    if len(distinct) == 1:
        event = dp_event.RepeatAndSelectDpEvent(next(iter(distinct)).event(), mean, shape)
        return _epsilon(event, delta)
    return epsilon_from_rdp(repeat_and_select_rdp(max_rdp_curve(trials), mean, shape), delta)


# Which outputs of a sweep a reader of its results sees (the threat model's "release").
RELEASES: dict[str, str] = {
    "best": "one selected model; the MLflow store, the trial metrics and the other models "
    "are kept private",
    "front": "the Pareto-front models of each group and every trial's validation metrics",
    "all": "every trial's model and validation metrics (the whole MLflow store)",
}


@dataclass(frozen=True)
class SweepConditions:
    """How a group's trials were chosen and what of them is released."""

    trial_count: TrialCount
    mean_trials: float
    adaptive_sampler: bool  # hyper-parameters chosen from earlier results (TPE, NSGA-II)
    adaptive_scheduler: bool  # trials stopped or paused on their metrics (ASHA)
    release: str = "front"
    start_points: bool = False  # given points tried before any random draw

    def __post_init__(self) -> None:
        if self.trial_count not in TRIAL_COUNTS:
            raise DpivonError(
                f"unknown trial count {self.trial_count!r}; choose one of: "
                f"{', '.join(TRIAL_COUNTS)}"
            )
        if self.release not in RELEASES:
            raise DpivonError(
                f"unknown release {self.release!r}; choose one of: {', '.join(RELEASES)}"
            )

    @property
    def adaptive(self) -> bool:
        return self.adaptive_sampler or self.adaptive_scheduler

    def random_trials_obstacles(self) -> list[str]:
        """Why the random-number-of-trials bound does not apply (empty: it does)."""
        reasons = []
        if self.trial_count == "fixed":
            reasons.append("the number of trials is fixed, not drawn at random")
        if self.adaptive_sampler:
            reasons.append("the sampler picks hyper-parameters from earlier trials' results")
        if self.adaptive_scheduler:
            reasons.append("the scheduler stops trials on their metrics (adaptive)")
        if self.start_points:
            reasons.append("start points are tried first, so the trials are not identical draws")
        if self.release != "best":
            reasons.append(f"the sweep releases {RELEASES[self.release]}, not one selected model")
        return reasons


def candidate_mechanisms(
    batch_sizes: Sequence[int],
    *,
    dataset_size: int,
    epochs: int,
    target_epsilon: float,
    delta: float,
    accountant: str,
    validation_noise_multiplier: float = 0.0,
    max_candidates: int = 16,
) -> list[TrialMechanism]:
    """Mechanisms that dominate every trial a search space can produce, at every RDP order.

    A trial with batch size b runs q = b / N for epochs * ceil(N / b) steps with the sigma
    that calibration picks for them. Batch sizes are cut into at most ``max_candidates``
    contiguous chunks; a chunk [b_lo, b_hi] is covered by (sigma_lb, q(b_hi), T(b_lo)):
    the subsampled Gaussian's RDP grows with q and T and falls with sigma, and every sigma
    calibrated in the chunk is >= the sigma that meets the target at (q(b_lo), T(b_hi)),
    which calibration to the target plus twice its tolerance undercuts. A chunk of one
    batch size is exact up to that tolerance.
    """
    values = sorted({int(b) for b in batch_sizes})
    if not values or values[0] < 1 or values[-1] > dataset_size:
        raise DpivonError(f"batch sizes must lie in [1, {dataset_size}]; got {values[:3]}...")
    if len(values) <= max_candidates:
        chunks = [[b] for b in values]
    else:  # geometric chunks: sigma and q change by similar factors in each
        edges = np.geomspace(values[0], values[-1] + 1, max_candidates + 1)
        chunks = [[b for b in values if lo <= b < hi] for lo, hi in itertools.pairwise(edges)]
        chunks = [c for c in chunks if c]
    candidates = []
    for chunk in chunks:
        low, high = chunk[0], chunk[-1]
        fewest_steps = epochs * math.ceil(dataset_size / high)
        most_steps = epochs * math.ceil(dataset_size / low)
        sigma = calibrate_noise_multiplier(
            target_epsilon + 2 * EPSILON_TOLERANCE,
            delta,
            low / dataset_size,
            fewest_steps,
            accountant,
        )
        candidates.append(
            TrialMechanism(
                sigma,
                high / dataset_size,
                most_steps,
                validation_noise_multiplier,
                epochs if validation_noise_multiplier > 0 else 0,
            )
        )
    return candidates


def worst_case_tuning_epsilon(
    candidates: Sequence[TrialMechanism],
    delta: float,
    conditions: SweepConditions,
    num_trials: int,
) -> float:
    """The quoted tuning epsilon before the sweep runs: composition of ``num_trials`` copies
    of the worst candidate at every order, or the random-trials bound where it applies."""
    check_delta(delta)
    if num_trials == 0:
        return 0.0
    if not conditions.random_trials_obstacles():
        return random_trials_epsilon(
            candidates, delta, distribution=conditions.trial_count, mean=conditions.mean_trials
        )
    curve = max_rdp_curve(candidates) * num_trials
    return float(_rdp.compute_epsilon(ORDERS, curve, delta)[0])


def solve_trial_epsilon(
    total_epsilon: float,
    quoted_for: Callable[[float], float],
    *,
    tolerance: float = 0.01,
) -> float:
    """The largest per-trial epsilon whose quoted tuning epsilon is <= ``total_epsilon``.

    ``quoted_for(eps)`` is the quoted bound of the whole sweep when every trial targets
    ``eps`` (increasing in eps). Bisection, to within ``tolerance`` below the true answer.
    """
    check_bound(FiniteEpsilon, "total_epsilon", total_epsilon)
    low, high = 0.0, total_epsilon  # a tuned release costs at least one trial's epsilon
    while high - low > tolerance:
        middle = (low + high) / 2
        try:
            fits = quoted_for(middle) <= total_epsilon
        except DpivonError:  # too small a budget to calibrate at all
            fits = False
        low, high = (middle, high) if fits else (low, middle)
    if low == 0.0:
        raise DpivonError(
            f"no per-trial epsilon fits total_epsilon {total_epsilon}: lower the number of "
            "trials, or raise the total budget"
        )
    return low


def solve_trial_epsilon_within(
    total_epsilon: float,
    candidates_at: Callable[[float], Sequence[TrialMechanism]],
    delta: float,
    conditions: SweepConditions,
    num_trials: int,
) -> float:
    """The pre-sweep accounting of a total budget: the largest epsilon each of a group's
    ``num_trials`` trials may target such that the quoted tuning epsilon, worst case over
    ``candidates_at(eps)`` (every mechanism the search space produces at eps, see
    :func:`candidate_mechanisms`), is at most ``total_epsilon``."""
    return solve_trial_epsilon(
        total_epsilon,
        lambda eps: worst_case_tuning_epsilon(candidates_at(eps), delta, conditions, num_trials),
    )


def draw_trial_count(trial_count: str, mean: int, rng: np.random.Generator | None = None) -> int:
    """How many trials one (optimizer, epsilon) group runs; >= 0.

    - ``fixed``: ``mean``.
    - ``geometric``: P(K = k) = (1 - g)^(k-1) g for k >= 1 with g = 1 / mean, so E[K] = mean.
      This is the truncated negative binomial D(eta=1, gamma=g) of Papernot & Steinke
      (ICLR 2022, Theorem 2): releasing the best of K trials then costs the bound of that
      theorem, far less than K-fold composition. Its spread is large (std ~ mean).
    - ``poisson``: K ~ Poisson(mean) (Theorem 6 there). K = 0 is kept: that group runs
      and releases nothing, and the tuning report records it (moving it to 1 would change
      the distribution the bound assumes).

    The bound holds only for a K the adversary does not know, so ``rng`` defaults to a
    generator seeded from the OS entropy source (never from a public seed); K is never
    logged or reported (the reports state its distribution only).
    """
    if mean < 1:
        raise DpivonError(f"the mean number of trials must be >= 1, got {mean}")
    if trial_count == "fixed":
        return int(mean)
    rng = np.random.default_rng() if rng is None else rng
    if trial_count == "geometric":
        return int(rng.geometric(1.0 / mean))
    if trial_count == "poisson":
        return int(rng.poisson(mean))
    raise DpivonError(f"unknown trial_count {trial_count!r}; use one of {', '.join(TRIAL_COUNTS)}")
