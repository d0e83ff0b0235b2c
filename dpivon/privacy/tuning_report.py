"""What a sweep group's tuning cost: the threat model, the bound that applies (the RDP
composition of the trials that ran, or the random-trials bound over the whole space) and
the number to quote, as the sweep report states them. The mathematics is `tuning`'s."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from dp_accounting import dp_event

from dpivon.errors import DpivonError
from dpivon.privacy.accounting import check_delta
from dpivon.privacy.tuning import (
    ORDERS,
    RELEASES,
    SweepConditions,
    TrialMechanism,
    composition_epsilon,
    epsilon_from_rdp,
    event_rdp,
    max_rdp_curve,
    repeat_and_select_rdp,
    trial_count_shape,
    trial_epsilon,
)


def composition_facts(trials: Sequence[TrialMechanism], delta: float) -> dict[str, Any]:
    """The RDP composition of the trials that ran, with their number: valid whatever was
    released, but it reveals how many trials ran, so where the random-trials bound is
    quoted these stay in the sweep's private state (a pick other than the declared one
    falls back on them)."""
    curve = (
        event_rdp(dp_event.ComposedDpEvent([t.event() for t in trials]))
        if trials
        else np.zeros(len(ORDERS))
    )
    return {
        "num_trials": len(trials),
        "composition_epsilon": composition_epsilon(trials, delta),
        "composition_rdp": [float(v) for v in curve],
    }


def _accountant_note(accountant: str) -> str:
    if accountant == "rdp":
        return ""
    return (
        f" The trials were calibrated with {accountant.upper()}; these bounds compose RDP "
        "curves (dp_accounting) because the random-trials bound and the composition with a "
        f"production run need RDP, which {accountant.upper()} does not give: RDP is the "
        "conservative side (a trial's RDP epsilon is at least its epsilon_spent)."
    )


@dataclass(frozen=True)
class _QuotedBound:
    """One bound of a tuning report: its entries, its RDP curve, its name and why it holds."""

    entries: dict[str, Any]
    curve: Sequence[float]
    name: str  # the entry that holds the quoted epsilon
    why: str


def _threat_model(conditions: SweepConditions, covered: Sequence[TrialMechanism]) -> dict[str, Any]:
    """How the group's trials were chosen, what is released, which records are covered."""
    noised = bool(covered) and all(t.private_validation for t in covered)
    return {
        "trial_count": conditions.trial_count,
        "mean_trials": conditions.mean_trials,
        "adaptive": conditions.adaptive,
        "release": conditions.release,
        "accountant": "rdp",
        "records_covered": (
            "training and validation records (validation scores are noised)"
            if noised
            else "training records only: validation scores are exact, so the validation "
            "records that steer selection have no DP protection"
        ),
        "outputs_covered": RELEASES[conditions.release],
    }


def _composition_bound(
    trials: Sequence[TrialMechanism],
    delta: float,
    conditions: SweepConditions,
    obstacles: list[str],
) -> _QuotedBound:
    """The RDP composition of the trials that ran: valid under adaptivity, whatever ran."""
    n = len(trials)
    if n == 0 and conditions.trial_count == "fixed":
        raise DpivonError("no trial to account for: the sweep ran no trial")
    facts = composition_facts(trials, delta)
    entries = {
        "per_trial_epsilon_max": max((trial_epsilon(t, delta) for t in set(trials)), default=0.0),
        "num_trials": n,
        "composition_epsilon": facts["composition_epsilon"],
    }
    why = (
        "no trial ran for this group (K = 0 drawn): it released nothing"
        if n == 0
        else f"the random-number-of-trials bound does not apply ({'; '.join(obstacles)}), "
        f"so the bound is the RDP composition of all {n} trials, valid under adaptivity"
    )
    return _QuotedBound(entries, facts["composition_rdp"], "composition_epsilon", why)


# What the random-trials quote assumes, said beside it: the same words whatever K was.
HIDDEN_K_CONDITION = (
    "this bound holds only while the number of trials K stays hidden from whoever is "
    "protected against: the released model and this report show K's distribution alone, but "
    "the sweep's MLflow store (its child runs, trials.csv, the front plots) and its console "
    "output count the trials; against anyone who reads them, the composition over the trials "
    "that ran holds (given in the parent run's description, inside that store, and in "
    "tuning_private.json in the sweep's folder)"
)


def _random_trials_bound(
    candidates: Sequence[TrialMechanism], delta: float, conditions: SweepConditions
) -> _QuotedBound:
    """The Papernot & Steinke bound over every candidate mechanism of the search space."""
    if not candidates:
        raise DpivonError(
            "the random-trials bound needs the candidate mechanisms of the whole space"
        )
    shape = trial_count_shape(conditions.trial_count)
    curve = repeat_and_select_rdp(max_rdp_curve(candidates), conditions.mean_trials, shape)
    entries = {
        "per_trial_epsilon_max": max(trial_epsilon(t, delta) for t in set(candidates)),
        "random_trials_epsilon": epsilon_from_rdp(curve, delta),
        "candidates": len(candidates),
    }
    why = (
        f"hyper-parameters were drawn independently of the data from the OS entropy "
        f"source, K from a {conditions.trial_count} distribution with mean "
        f"{conditions.mean_trials:g} (drawn from the OS entropy source and kept private: "
        f"this report states only its distribution), no trial was stopped on its "
        f"metrics, and only one selected model is released: the Papernot & Steinke bound "
        f"over all {len(candidates)} candidate mechanisms of the search space applies"
    )
    entries["holds_while"] = HIDDEN_K_CONDITION
    return _QuotedBound(entries, curve, "random_trials_epsilon", why)


def tuning_privacy_report(
    trials: Sequence[TrialMechanism],
    delta: float,
    conditions: SweepConditions,
    *,
    candidates: Sequence[TrialMechanism] = (),
    accountant: str = "rdp",
) -> dict[str, Any]:
    """Privacy of one group of a sweep, the threat model, and which number to quote.

    ``trials`` are the mechanisms that ran (their RDP composition is always valid, adaptive
    choices included); ``candidates`` cover every mechanism the search space can produce
    (see :func:`candidate_mechanisms`), needed by the random-trials bound, which is quoted
    only where :meth:`SweepConditions.random_trials_obstacles` finds none. That bound holds
    only while the number of trials K stays unknown, so its report states K's distribution
    and nothing that reveals K (no trial count, no composition: see
    :func:`composition_facts`). ``accountant`` is the one that calibrated the trials.
    """
    check_delta(delta)
    obstacles = conditions.random_trials_obstacles()
    # what the quoted bound is over: the trials that ran, or every candidate of the space
    report = _threat_model(conditions, trials if obstacles else candidates)
    bound = (
        _composition_bound(trials, delta, conditions, obstacles)
        if obstacles
        else _random_trials_bound(candidates, delta, conditions)
    )
    report.update(bound.entries)
    report["quoted_epsilon"] = report[bound.name]
    report["quote"] = f"{bound.name}: {bound.why}.{_accountant_note(accountant)}"
    # The quoted bound as an RDP curve on ORDERS: a production run tuned by this sweep
    # composes with it (see compose_with_tuning).
    report["quoted_rdp"] = [float(v) for v in bound.curve]
    return report
