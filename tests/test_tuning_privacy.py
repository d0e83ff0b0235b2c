"""Tests for the privacy cost of hyper-parameter tuning against the design brief's numbers."""

from __future__ import annotations

import itertools
import math

import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant

from dpivon.errors import DpivonError
from dpivon.privacy.tuning import (
    ORDERS,
    TrialMechanism,
    _max_rdp_curve,
    _repeat_and_select_epsilon_from_curve,
    composition_epsilon,
    random_trials_epsilon,
    trial_epsilon,
    tuning_privacy_report,
)

DELTA = 1e-5
# The brief's checked setting: q 0.01, sigma 0.548, 300 steps, delta 1e-5.
BRIEF = TrialMechanism(noise_multiplier=0.548, sample_rate=0.01, steps=300)
TOL = 0.02


def test_brief_single_run():
    assert trial_epsilon(BRIEF, DELTA) == pytest.approx(7.95, abs=TOL)
    assert composition_epsilon([BRIEF], DELTA) == pytest.approx(7.95, abs=TOL)


def test_brief_geometric_best_of_mean_8():
    eps = random_trials_epsilon([BRIEF] * 3, DELTA, distribution="geometric", mean=8)
    assert eps == pytest.approx(12.05, abs=TOL)


def test_brief_eight_fixed_trials_composed():
    assert composition_epsilon([BRIEF] * 8, DELTA) == pytest.approx(16.42, abs=TOL)


def test_trial_event_matches_brief_event():
    event = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(0.548)), 300
    )
    assert BRIEF.event() == event


@pytest.mark.parametrize("distribution, shape", [("poisson", math.inf), ("geometric", 1.0)])
@pytest.mark.parametrize("mean", [1.0, 3.0, 8.0, 50.0])
def test_max_curve_path_equals_repeat_and_select_event(distribution, shape, mean):
    direct = RdpAccountant(orders=ORDERS)
    direct.compose(dp_event.RepeatAndSelectDpEvent(BRIEF.event(), mean, shape))
    via_curve = _repeat_and_select_epsilon_from_curve(
        _max_rdp_curve([BRIEF, BRIEF]), mean, shape, DELTA
    )
    assert via_curve == pytest.approx(direct.get_epsilon(DELTA), rel=1e-12)
    assert random_trials_epsilon(
        [BRIEF], DELTA, distribution=distribution, mean=mean
    ) == pytest.approx(direct.get_epsilon(DELTA), rel=1e-12)


HETERO = [
    BRIEF,
    TrialMechanism(noise_multiplier=0.8, sample_rate=0.02, steps=500),
    TrialMechanism(noise_multiplier=1.2, sample_rate=0.05, steps=200),
    TrialMechanism(noise_multiplier=0.6, sample_rate=0.005, steps=1000),
]


def test_heterogeneous_composition_at_least_each_trial():
    total = composition_epsilon(HETERO, DELTA)
    for trial in HETERO:
        assert total >= trial_epsilon(trial, DELTA)


@pytest.mark.parametrize("distribution", ["poisson", "geometric"])
def test_heterogeneous_random_trials_at_least_each_trial(distribution):
    eps = random_trials_epsilon(HETERO, DELTA, distribution=distribution, mean=5)
    for trial in HETERO:
        alone = trial_epsilon(trial, DELTA)
        assert eps >= alone
        # and at least the repeat-and-select bound of that mechanism alone
        assert eps >= random_trials_epsilon([trial], DELTA, distribution=distribution, mean=5)
    # the order of the candidates does not matter
    assert eps == random_trials_epsilon(HETERO[::-1], DELTA, distribution=distribution, mean=5)


def test_composition_grows_with_number_of_trials():
    epsilons = [composition_epsilon([BRIEF] * k, DELTA) for k in (1, 2, 4, 8, 16)]
    assert all(a < b for a, b in itertools.pairwise(epsilons))
    mixed = [composition_epsilon(HETERO[:k], DELTA) for k in range(1, len(HETERO) + 1)]
    assert all(a < b for a, b in itertools.pairwise(mixed))


@pytest.mark.parametrize("distribution", ["poisson", "geometric"])
def test_larger_mean_costs_more(distribution):
    epsilons = [
        random_trials_epsilon([BRIEF], DELTA, distribution=distribution, mean=m)
        for m in (1.5, 4, 8, 32, 128)
    ]
    assert all(a < b for a, b in itertools.pairwise(epsilons))


def test_random_trials_far_cheaper_than_composition_for_many_trials():
    composed = composition_epsilon([BRIEF] * 32, DELTA)
    poisson = random_trials_epsilon([BRIEF], DELTA, distribution="poisson", mean=32)
    assert trial_epsilon(BRIEF, DELTA) < poisson < composed


def test_non_private_and_empty():
    free = TrialMechanism(noise_multiplier=0.0, sample_rate=0.01, steps=10)
    assert math.isinf(trial_epsilon(free, DELTA))
    assert math.isinf(composition_epsilon([BRIEF, free], DELTA))
    assert math.isinf(random_trials_epsilon([BRIEF, free], DELTA, distribution="poisson", mean=4))
    assert composition_epsilon([], DELTA) == 0.0
    assert trial_epsilon(TrialMechanism(1.0, 0.01, 0), DELTA) == 0.0


@pytest.mark.parametrize(
    "call",
    [
        lambda: random_trials_epsilon([BRIEF], DELTA, distribution="binomial", mean=4),
        lambda: random_trials_epsilon([BRIEF], DELTA, distribution="poisson", mean=0.5),
        lambda: random_trials_epsilon([], DELTA, distribution="poisson", mean=4),
        lambda: composition_epsilon([BRIEF], 0.0),
        lambda: TrialMechanism(noise_multiplier=-1.0, sample_rate=0.01, steps=10),
        lambda: TrialMechanism(noise_multiplier=1.0, sample_rate=1.5, steps=10),
        lambda: tuning_privacy_report([BRIEF], DELTA, trial_count="uniform", mean_trials=4),
        lambda: tuning_privacy_report([], DELTA, trial_count="fixed"),
        lambda: tuning_privacy_report([BRIEF], DELTA, trial_count="poisson", adaptive=False),
    ],
)
def test_user_errors(call):
    with pytest.raises(DpivonError):
        call()


def test_report_fixed_quotes_composition():
    report = tuning_privacy_report([BRIEF] * 8, DELTA, trial_count="fixed", mean_trials=8)
    assert report["trial_count"] == "fixed"
    assert report["num_trials"] == 8
    assert report["per_trial_epsilon_max"] == pytest.approx(7.95, abs=TOL)
    assert report["composition_epsilon"] == pytest.approx(16.42, abs=TOL)
    assert "random_trials_epsilon" not in report
    assert report["quote"].startswith("composition_epsilon")
    assert report["quoted_epsilon"] == report["composition_epsilon"]


def test_report_adaptive_sampler_quotes_composition_even_with_random_count():
    report = tuning_privacy_report(
        [BRIEF] * 8, DELTA, trial_count="geometric", mean_trials=8, adaptive=True
    )
    assert report["quote"].startswith("composition_epsilon")
    assert "adaptive" in report["quote"]
    assert "random_trials_epsilon" not in report


@pytest.mark.parametrize("distribution", ["poisson", "geometric"])
def test_report_random_search_quotes_random_trials(distribution):
    report = tuning_privacy_report(
        [BRIEF] * 8, DELTA, trial_count=distribution, mean_trials=8, adaptive=False
    )
    expected = random_trials_epsilon([BRIEF], DELTA, distribution=distribution, mean=8)
    assert report["random_trials_epsilon"] == pytest.approx(expected)
    assert report["quote"].startswith("random_trials_epsilon")
    assert report["quoted_epsilon"] == report["random_trials_epsilon"]
    if distribution == "geometric":
        assert report["random_trials_epsilon"] == pytest.approx(12.05, abs=TOL)
    assert set(report) == {
        "per_trial_epsilon_max",
        "composition_epsilon",
        "random_trials_epsilon",
        "trial_count",
        "num_trials",
        "quote",
        "quoted_epsilon",
    }


def test_report_per_trial_max_over_heterogeneous_trials():
    report = tuning_privacy_report(HETERO, DELTA, trial_count="fixed")
    assert report["per_trial_epsilon_max"] == pytest.approx(
        max(trial_epsilon(t, DELTA) for t in HETERO)
    )
