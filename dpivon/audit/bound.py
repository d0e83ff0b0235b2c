"""The one-run audit's two analyses of the canaries' scores and coins.

- The bound of Steinke, Nasr & Jagielski (2023, Theorem 5.2 / their Algorithm 2): the
  largest epsilon that the number of correct guesses rejects at a confidence. Valid for
  any mechanism, but loose: it sees only right or wrong guesses.
- The Gaussian analysis: the included canaries' mean score shift in units of the excluded
  ones' standard deviation is a Gaussian-DP mu (Dong, Roth & Su 2022); its lower
  confidence limit, turned into epsilon at delta, is compared with the mu the central
  limit theorem gives the accounted mechanism (Bu, Dong, Long & Su 2020). Many steps of a
  subsampled Gaussian are close to Gaussian-DP, so this is tight where the binomial bound
  is not; it assumes that Gaussian shape."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.stats import norm


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


# --- the Gaussian analysis -----------------------------------------------------------------

MAX_EXP = 700.0  # exp of more overflows a float


def clt_mu(sample_rate: float, noise_multiplier: float, steps: int) -> float:
    """mu of ``steps`` Poisson-subsampled Gaussian steps by the central limit theorem of Bu,
    Dong, Long & Su (2020): q sqrt(T (e^{1/sigma^2} - 1)); infinite without noise."""
    if noise_multiplier == 0.0 or noise_multiplier**-2 > MAX_EXP:
        return math.inf
    return sample_rate * math.sqrt(steps * math.expm1(noise_multiplier**-2))


def gdp_delta(mu: float, epsilon: float) -> float:
    """delta(epsilon) of mu-Gaussian DP (Dong, Roth & Su 2022, Corollary 2.13)."""
    # e^epsilon Phi(b) as exp(epsilon + log Phi(b)): finite where e^epsilon alone overflows
    tail = math.exp(min(epsilon + float(norm.logcdf(-epsilon / mu - mu / 2)), MAX_EXP))
    return float(norm.cdf(-epsilon / mu + mu / 2) - tail)


def gdp_epsilon(mu: float, delta: float) -> float:
    """The epsilon at ``delta`` of mu-Gaussian DP; 0 when mu is 0."""
    if math.isinf(mu):
        return math.inf
    if mu <= 0.0 or gdp_delta(mu, 0.0) <= delta:
        return 0.0
    high = 1.0
    while gdp_delta(mu, high) > delta:
        high *= 2.0
    return float(brentq(lambda epsilon: gdp_delta(mu, epsilon) - delta, 0.0, high, xtol=1e-10))


@dataclass(frozen=True)
class GaussianEstimate:
    """The mean score shift of the included canaries in units of the excluded ones' std."""

    mu: float
    standard_error: float
    mu_lower_bound: float  # one-sided, at the confidence asked for


def gaussian_mu(scores: np.ndarray, included: np.ndarray, confidence: float) -> GaussianEstimate:
    """mu = (mean included - mean excluded) / std excluded, and its one-sided lower
    confidence limit by the delta method: var = s_in^2 / (n_in s^2) + (1 + mu^2 / 2) / n_out."""
    inside, outside = scores[included], scores[~included]
    if min(len(inside), len(outside)) < 2:
        raise ValueError("the Gaussian analysis needs two included and two excluded canaries")
    spread = float(outside.std(ddof=1))
    if spread == 0.0:  # nothing but the canaries moved the scores: no noise at all
        return GaussianEstimate(math.inf, 0.0, math.inf)
    mu = float(inside.mean() - outside.mean()) / spread
    variance = float(inside.var(ddof=1)) / (len(inside) * spread**2) + (1 + mu**2 / 2) / len(
        outside
    )
    error = math.sqrt(variance)
    return GaussianEstimate(mu, error, mu - float(norm.ppf(confidence)) * error)
