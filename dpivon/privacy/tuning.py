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

All numbers come from Google's ``dp_accounting`` RDP accountant; nothing is re-derived here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from absl import logging as absl_logging
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp import rdp_privacy_accountant as _rdp

from dpivon.errors import DpivonError

# dp_accounting logs a warning for every fractional Renyi order whose series does not
# converge at large sampling rates; it drops those orders, which only loosens the bound.
absl_logging.set_verbosity(absl_logging.ERROR)

# Shape of the truncated negative binomial family in dp_accounting's RepeatAndSelectDpEvent:
# inf = Poisson(mean), 1 = geometric (mean = 1 / gamma).
DISTRIBUTIONS: dict[str, float] = {"poisson": math.inf, "geometric": 1.0}
TRIAL_COUNTS = ("fixed", *DISTRIBUTIONS)
# One fixed RDP order grid for every computation (dp_accounting's default), so curves of
# different trials can be compared order by order.
ORDERS: tuple[float, ...] = tuple(float(a) for a in _rdp.DEFAULT_RDP_ORDERS)


@dataclass(frozen=True)
class TrialMechanism:
    """The private training of one trial: ``steps`` Poisson-subsampled Gaussian steps."""

    noise_multiplier: float
    sample_rate: float
    steps: int

    def __post_init__(self) -> None:
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise DpivonError(f"noise multiplier must be >= 0; got {self.noise_multiplier}")
        if not 0 < self.sample_rate <= 1:
            raise DpivonError(f"sample rate must be in (0, 1]; got {self.sample_rate}")
        if int(self.steps) != self.steps or self.steps < 0:
            raise DpivonError(f"steps must be a non-negative integer; got {self.steps}")

    @property
    def private(self) -> bool:
        return self.noise_multiplier > 0 or self.steps == 0

    def event(self) -> dp_event.DpEvent:
        if self.steps == 0:
            return dp_event.NoOpDpEvent()
        if self.noise_multiplier == 0:
            return dp_event.NonPrivateDpEvent()
        step = dp_event.PoissonSampledDpEvent(
            self.sample_rate, dp_event.GaussianDpEvent(self.noise_multiplier)
        )
        return dp_event.SelfComposedDpEvent(step, int(self.steps))


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise DpivonError(f"delta must be in (0, 1); got {delta}")


def _epsilon(event: dp_event.DpEvent, delta: float) -> float:
    accountant = RdpAccountant(orders=ORDERS)
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


def trial_epsilon(trial: TrialMechanism, delta: float) -> float:
    """Epsilon of one trial's training alone."""
    _check_delta(delta)
    if not trial.private:
        return math.inf
    return _epsilon(trial.event(), delta)


def composition_epsilon(trials: Sequence[TrialMechanism], delta: float) -> float:
    """Epsilon of running all ``trials`` (heterogeneous allowed) and releasing everything.

    RDP composition of every trial's event; valid under adaptive choice of each trial's
    hyper-parameters from earlier results (TPE, NSGA-II). No trials cost nothing (0.0).
    """
    _check_delta(delta)
    if not trials:
        return 0.0
    if not all(t.private for t in trials):
        return math.inf
    return _epsilon(dp_event.ComposedDpEvent([t.event() for t in trials]), delta)


def _rdp_curve(trial: TrialMechanism) -> np.ndarray:
    accountant = RdpAccountant(orders=ORDERS)
    accountant.compose(trial.event())
    return accountant.rdp


def _max_rdp_curve(trials: Sequence[TrialMechanism]) -> np.ndarray:
    """Order-wise max of the trials' RDP curves on ``ORDERS``.

    Joint quasi-convexity of the Renyi divergence: the mechanism Q "draw hyper-parameters
    independently of the data, then train" is, at every order, at most as Renyi-divergent
    as the worst candidate mechanism, so this curve is an RDP bound for Q.
    """
    return np.max(np.stack([_rdp_curve(t) for t in set(trials)]), axis=0)


def _repeat_and_select_epsilon_from_curve(
    rdp: np.ndarray, mean: float, shape: float, delta: float
) -> float:
    """Epsilon of the best of K runs of a mechanism given by its RDP curve on ``ORDERS``.

    ``RepeatAndSelectDpEvent`` takes a single DpEvent, not an RDP curve, so a mixture of
    heterogeneous trials needs dp_accounting's private helpers directly. They are what
    ``RdpAccountant`` calls for that event (``_compute_rdp_repeat_and_select`` then
    ``compute_epsilon``); dp-accounting is pinned to 0.6.0 where these signatures hold.
    """
    curve = _rdp._compute_rdp_repeat_and_select(ORDERS, rdp, mean, shape)
    return float(_rdp.compute_epsilon(ORDERS, curve, delta)[0])


def _shape(distribution: str) -> float:
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
    _check_delta(delta)
    shape = _shape(distribution)
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
    return _repeat_and_select_epsilon_from_curve(_max_rdp_curve(trials), mean, shape, delta)


def tuning_privacy_report(
    trials: Sequence[TrialMechanism],
    delta: float,
    *,
    trial_count: str,
    mean_trials: float | None = None,
    adaptive: bool = True,
) -> dict[str, float | str]:
    """Privacy of a whole sweep, and which number to quote.

    ``trial_count`` is ``"fixed"`` or the distribution K was drawn from (``"poisson"``,
    ``"geometric"``, with ``mean_trials``). ``adaptive`` says whether the sampler picks
    hyper-parameters from earlier results (TPE, NSGA-II: True) or independently of the data
    (random search: False). ``random_trials_epsilon`` is reported only when it is valid
    (random K and a non-adaptive sampler); ``quoted_epsilon`` is the value of the key named
    in ``quote``.
    """
    _check_delta(delta)
    if trial_count not in TRIAL_COUNTS:
        raise DpivonError(
            f"unknown trial count {trial_count!r}; choose one of: {', '.join(TRIAL_COUNTS)}"
        )
    if not trials:
        raise DpivonError("no trial to account for: the sweep ran no trial")
    n = len(trials)
    report: dict[str, float | str] = {
        "per_trial_epsilon_max": max(trial_epsilon(t, delta) for t in set(trials)),
        "composition_epsilon": composition_epsilon(trials, delta),
        "trial_count": trial_count,
        "num_trials": n,
    }
    if trial_count == "fixed":
        quoted = "composition_epsilon"
        why = (
            f"a fixed number of trials gets no tuning discount, so the bound is the RDP "
            f"composition of all {n} trials"
        )
    elif adaptive:
        quoted = "composition_epsilon"
        why = (
            f"an adaptive sampler chooses hyper-parameters from earlier trials' results, so "
            f"the random-number-of-trials bound does not apply and only the RDP composition "
            f"of all {n} trials (valid under adaptivity) does"
        )
    else:
        if mean_trials is None:
            raise DpivonError(f"trial_count {trial_count!r} needs mean_trials")
        report["random_trials_epsilon"] = random_trials_epsilon(
            trials, delta, distribution=trial_count, mean=mean_trials
        )
        quoted = "random_trials_epsilon"
        why = (
            f"hyper-parameters were drawn independently of the data and the number of "
            f"trials from a {trial_count} distribution with mean {mean_trials:g}, so releasing "
            f"only the best trial costs the Papernot & Steinke repeat-and-select bound"
        )
    report["quoted_epsilon"] = report[quoted]
    report["quote"] = f"{quoted}: {why}."
    return report
