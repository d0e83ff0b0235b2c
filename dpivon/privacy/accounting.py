"""Noise calibration and epsilon reporting with one Opacus accountant.

The same accountant mechanism ("rdp" or "prv") that picks sigma_p for a target epsilon
reports the epsilon spent: mixing them is a known trap (PRV's sigma for eps 8 is reported
as eps 9.09 by RDP).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import get_args

import numpy as np
from opacus.accountants import create_accountant
from opacus.accountants.analysis.rdp import compute_rdp
from opacus.accountants.utils import MAX_SIGMA, get_noise_multiplier

from dpivon.constraints import Epsilon, check_bound
from dpivon.errors import DpivonError, first_line
from dpivon.privacy.names import AccountantName

ACCOUNTANTS: tuple[str, ...] = get_args(AccountantName)
# Bisection precision: calibrated sigma spends epsilon in [target - tol, target].
EPSILON_TOLERANCE = 0.01
# Above this a finite epsilon promises nothing (e^1000 bounds no odds), and Opacus's
# bisection, which wants the target within EPSILON_TOLERANCE, would never end (1e308).
MAX_FINITE_EPSILON = 1000.0


def calibrate_noise_multiplier(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "rdp"
) -> float:
    """Smallest sigma_p (to the tolerance) whose (epsilon, delta) after ``steps`` Poisson-
    subsampled Gaussian steps at ``sample_rate`` is at most ``target_epsilon``.
    ``target_epsilon = inf`` means no noise."""
    check_budget(target_epsilon, delta)
    if accountant not in ACCOUNTANTS:
        raise DpivonError(
            f"unknown accountant {accountant!r}; choose one of: {', '.join(ACCOUNTANTS)}"
        )
    if math.isinf(target_epsilon):
        return 0.0
    check_reachable(target_epsilon, delta, sample_rate, steps, accountant)
    try:
        with warnings.catch_warnings():  # the order at the edge: see epsilon_spent
            warnings.filterwarnings("ignore", "Optimal order is the", UserWarning)
            return get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=steps,
                accountant=accountant,
                epsilon_tolerance=EPSILON_TOLERANCE,
            )
    except ValueError as err:
        raise DpivonError(
            f"privacy budget epsilon={target_epsilon} delta={delta} cannot be met with "
            f"sample rate {sample_rate:.4g} over {steps} steps ({err}); raise epsilon, "
            "lower the number of epochs or the batch size"
        ) from err


@functools.lru_cache(maxsize=256)  # a sweep asks per group, several times
def noise_faithful_plan(
    target_epsilon: float,
    delta: float,
    dataset_size: int,
    batch_size: int,
    batch_divisor: int,
    epochs: int,
    accountant: str,
) -> tuple[float, float]:
    """(sigma_p, epsilon) of a run at batch ``batch_size / batch_divisor`` that holds the
    target run's steps (``epochs`` * ceil(N / B)) and its noise on the averaged gradient
    sigma_p / b: the "total amount of noise" scaling of Sander, Stock & Sablayrolles (TAN
    without a burn, ICML 2023), whose ranking of hyper-parameters predicts the target's at
    about 1/k of its compute. sigma_p is the target's calibrated sigma over k; the epsilon
    is what the accountant gives for what runs, far above the target's once sigma_p / k
    drops below about 2 (the scaling holds the noise, not the privacy)."""
    sample_rate, steps_per_epoch = sampling_schedule(dataset_size, batch_size)
    steps = epochs * steps_per_epoch
    small_rate = (batch_size // batch_divisor) / dataset_size  # what the trial samples at
    target_sigma = calibrate_noise_multiplier(target_epsilon, delta, sample_rate, steps, accountant)
    sigma = target_sigma / batch_divisor
    return sigma, epsilon_spent(sigma, small_rate, steps, delta, accountant)


def sampling_schedule(dataset_size: int, batch_size: int) -> tuple[float, int]:
    """(sample rate q = b / N, steps per epoch ceil(N / b)) of Poisson sampling."""
    return batch_size / dataset_size, math.ceil(dataset_size / batch_size)


@functools.lru_cache(maxsize=1024)  # a benchmark asks once per run, with a few distinct plans
def epsilon_floor(sample_rate: float, steps: int, delta: float, accountant: str) -> float:
    """The smallest epsilon the accountant reports for this plan, at Opacus's MAX_SIGMA."""
    return epsilon_spent(MAX_SIGMA, sample_rate, steps, delta, accountant)


def check_reachable(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str
) -> None:
    """A finite target that calibration can meet: at most MAX_FINITE_EPSILON, and at least
    what the accountant reports with the most noise Opacus calibrates (its MAX_SIGMA): the
    conversion from RDP (or PRV) to (epsilon, delta) has a floor that no noise goes below."""
    if math.isinf(target_epsilon):
        return
    if target_epsilon > MAX_FINITE_EPSILON:
        raise DpivonError(
            f"epsilon {target_epsilon:g} is above {MAX_FINITE_EPSILON:g}, where a guarantee "
            "means nothing and noise calibration does not end; use inf for a run without noise"
        )
    floor = epsilon_floor(sample_rate, steps, delta, accountant)
    if target_epsilon < floor:
        raise DpivonError(
            f"epsilon {target_epsilon:g} is below {floor:.3g}, the smallest the {accountant} "
            f"accountant reaches at delta {delta:g} over {steps} steps at sample rate "
            f"{sample_rate:.3g}, whatever the noise; use epsilon >= {floor:.3g}"
        )


def check_fixed_noise_fits(
    noise_multiplier: float,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str,
) -> float:
    """The epsilon a fixed ``noise_multiplier`` spends over the plan; DpivonError when that
    exceeds ``target_epsilon`` (the budget the run is held to). No calibration runs, so any
    budget is a cap: a noise-faithful trial's is its own large epsilon."""
    spent = epsilon_spent(noise_multiplier, sample_rate, steps, delta, accountant)
    if spent > target_epsilon:
        raise DpivonError(
            f"noise_multiplier {noise_multiplier:g} spends epsilon {spent:.3g} ({accountant}, "
            f"delta {delta:g}) over {steps} steps at sample rate {sample_rate:.4g}, above the "
            f"budget epsilon {target_epsilon:g}; raise noise_multiplier or epsilon"
        )
    return spent


def epsilon_spent(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp"
) -> float:
    """Epsilon of ``steps`` steps of the subsampled Gaussian mechanism; one line where the
    accountant cannot evaluate it (PRV's discretisation and GDP's root finding fail at
    extreme noise: 0.01 or 10^6)."""
    if noise_multiplier**2 == 0.0:  # none, or so little that its variance underflows
        return math.inf
    if steps == 0:
        return 0.0
    acc = create_accountant(mechanism=accountant)
    acc.history = [(noise_multiplier, sample_rate, steps)]
    # Opacus warns when the best RDP order is at the edge of its list: very little or very
    # much noise, where the epsilon is still a valid (if loose) bound
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Optimal order is the", UserWarning)
            return float(acc.get_epsilon(delta=delta))
    except (ValueError, MemoryError, OverflowError) as err:
        raise DpivonError(
            f"the {accountant} accountant cannot evaluate noise multiplier "
            f"{noise_multiplier:g} at sample rate {sample_rate:.4g} over {steps} steps "
            f"({first_line(err)}); use accountant rdp, or noise nearer 1"
        ) from err


# The RDP orders of Opacus 0.13, which published runs of 2020-2021 (Tramer & Boneh) used.
CLASSIC_RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))


def classic_rdp_epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float
) -> float:
    """Epsilon under the RDP-to-(epsilon, delta) conversion of Opacus before 1.0 (Mironov
    2017, Proposition 3: min over orders of rdp + log(1/delta) / (order - 1)), looser than
    today's (Balle et al. 2020): how papers of that time quoted their runs."""
    rdp = compute_rdp(
        q=sample_rate, noise_multiplier=noise_multiplier, steps=steps, orders=CLASSIC_RDP_ORDERS
    )
    orders = np.asarray(CLASSIC_RDP_ORDERS)
    return float(np.min(rdp + math.log(1 / delta) / (orders - 1)))


def check_budget(epsilon: float, delta: float, dataset_size: int | None = None) -> None:
    """Reject budgets that mean nothing: epsilon <= 0, delta outside (0, 1) or >= 1/N."""
    check_bound(Epsilon, "epsilon", epsilon)
    check_delta(delta, dataset_size)


def check_delta(delta: float, dataset_size: int | None = None) -> None:
    """Reject delta outside (0, 1), and with ``dataset_size`` N, delta >= 1/N: a mechanism
    that publishes one whole record with probability delta would meet it. Needs only N, so
    pipelines check it when they load."""
    if not 0 < delta < 1:
        raise DpivonError(f"delta must be in (0, 1), got {delta}")
    if dataset_size is not None and delta >= 1 / dataset_size:
        raise DpivonError(
            f"delta={delta} is >= 1/N = {1 / dataset_size:.3g} for N={dataset_size} training "
            "examples: such a delta allows leaking whole records; use delta < 1/N (e.g. 1e-5)"
        )
