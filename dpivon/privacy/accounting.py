"""Noise calibration and epsilon reporting with one Opacus accountant.

The same accountant mechanism ("rdp" or "prv") that picks sigma_p for a target epsilon
reports the epsilon spent: mixing them is a known trap (PRV's sigma for eps 8 is reported
as eps 9.09 by RDP).
"""

from __future__ import annotations

import math

from opacus.accountants import create_accountant
from opacus.accountants.utils import get_noise_multiplier

from dpivon.errors import DpivonError

ACCOUNTANTS = ("rdp", "prv")
# Bisection precision: calibrated sigma spends epsilon in [target - tol, target].
EPSILON_TOLERANCE = 0.01


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
    try:
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


def epsilon_spent(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp"
) -> float:
    """Epsilon of ``steps`` steps of the subsampled Gaussian mechanism."""
    if noise_multiplier == 0.0:
        return math.inf
    if steps == 0:
        return 0.0
    acc = create_accountant(mechanism=accountant)
    acc.history = [(noise_multiplier, sample_rate, steps)]
    return float(acc.get_epsilon(delta=delta))


def check_budget(epsilon: float, delta: float, dataset_size: int | None = None) -> None:
    """Reject budgets that mean nothing: epsilon <= 0, delta outside (0, 1) or >= 1/N."""
    if not epsilon > 0:
        raise DpivonError(f"epsilon must be > 0 (or inf for non-private), got {epsilon}")
    if not 0 < delta < 1:
        raise DpivonError(f"delta must be in (0, 1), got {delta}")
    if dataset_size is not None:
        check_delta(delta, dataset_size)


def check_delta(delta: float, dataset_size: int) -> None:
    """Reject delta >= 1/N: a mechanism that publishes one whole record with probability
    delta would meet it. Needs only N, so pipelines check it when they load."""
    if delta >= 1 / dataset_size:
        raise DpivonError(
            f"delta={delta} is >= 1/N = {1 / dataset_size:.3g} for N={dataset_size} training "
            "examples: such a delta allows leaking whole records; use delta < 1/N (e.g. 1e-5)"
        )
