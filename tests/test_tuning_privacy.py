"""Tests for the privacy cost of hyper-parameter tuning against the design brief's numbers."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pandas as pd
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant

from dpivon.errors import DpivonError
from dpivon.privacy.tuning import (
    ORDERS,
    SweepConditions,
    TrialMechanism,
    candidate_mechanisms,
    check_tuning_cost,
    composition_epsilon,
    epsilon_from_rdp,
    max_rdp_curve,
    random_trials_epsilon,
    repeat_and_select_rdp,
    solve_trial_epsilon,
    trial_epsilon,
    worst_case_tuning_epsilon,
)
from dpivon.privacy.tuning_report import composition_facts, tuning_privacy_report
from dpivon.search.description import parent_description

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
    via_curve = epsilon_from_rdp(
        repeat_and_select_rdp(max_rdp_curve([BRIEF, BRIEF]), mean, shape), DELTA
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
        lambda: conditions("uniform"),
        lambda: conditions("fixed", release="everything"),
        lambda: tuning_privacy_report([], DELTA, conditions("fixed")),
        # the random-trials bound applies here but needs the space's candidates
        lambda: tuning_privacy_report([BRIEF], DELTA, conditions("poisson", release="best")),
    ],
)
def test_user_errors(call):
    with pytest.raises(DpivonError):
        call()


def conditions(trial_count, *, sampler=False, scheduler=False, release="front", mean=8):
    return SweepConditions(trial_count, mean, sampler, scheduler, release)


def test_report_fixed_quotes_composition():
    report = tuning_privacy_report([BRIEF] * 8, DELTA, conditions("fixed", release="best"))
    assert report["trial_count"] == "fixed"
    assert report["num_trials"] == 8
    assert report["per_trial_epsilon_max"] == pytest.approx(7.95, abs=TOL)
    assert report["composition_epsilon"] == pytest.approx(16.42, abs=TOL)
    assert "random_trials_epsilon" not in report
    assert report["quote"].startswith("composition_epsilon")
    assert report["quoted_epsilon"] == report["composition_epsilon"]


def test_report_adaptive_sampler_quotes_composition_even_with_random_count():
    report = tuning_privacy_report(
        [BRIEF] * 8, DELTA, conditions("geometric", sampler=True, release="best")
    )
    assert report["quote"].startswith("composition_epsilon")
    assert "earlier trials' results" in report["quote"]
    assert "random_trials_epsilon" not in report


@pytest.mark.parametrize("distribution", ["poisson", "geometric"])
def test_report_random_search_quotes_random_trials(distribution):
    report = tuning_privacy_report(
        [BRIEF] * 8, DELTA, conditions(distribution, release="best"), candidates=[BRIEF]
    )
    expected = random_trials_epsilon([BRIEF], DELTA, distribution=distribution, mean=8)
    assert report["random_trials_epsilon"] == pytest.approx(expected)
    assert report["quote"].startswith("random_trials_epsilon")
    assert report["quoted_epsilon"] == report["random_trials_epsilon"]
    if distribution == "geometric":
        assert report["random_trials_epsilon"] == pytest.approx(12.05, abs=TOL)
    assert epsilon_from_rdp(report["quoted_rdp"], DELTA) == pytest.approx(report["quoted_epsilon"])
    assert report["candidates"] == 1


@pytest.mark.parametrize(
    ("obstacle", "words"),
    [
        (dict(scheduler=True), "stops trials on their metrics"),
        (dict(sampler=True), "earlier trials' results"),
        (dict(release="front"), "Pareto-front models"),
        (dict(release="all"), "whole MLflow store"),
    ],
)
def test_any_adaptivity_or_wider_release_quotes_the_composition(obstacle, words):
    """ASHA, TPE, or publishing more than one model: the random-trials bound is invalid."""
    setting = {"release": "best", **obstacle}
    report = tuning_privacy_report([BRIEF] * 8, DELTA, conditions("poisson", **setting))
    assert "random_trials_epsilon" not in report
    assert report["quoted_epsilon"] == report["composition_epsilon"]
    assert words in report["quote"]
    assert report["adaptive"] == bool(obstacle.get("sampler") or obstacle.get("scheduler"))


def test_candidates_not_draws_set_the_random_trials_bound():
    """The bound holds the worst mechanism the space can produce, drawn or not."""
    drawn = TrialMechanism(0.9, 0.01, 300)
    undrawn_worse = TrialMechanism(0.6, 0.02, 300)
    best = conditions("poisson", release="best")
    only_drawn = tuning_privacy_report([drawn] * 4, DELTA, best, candidates=[drawn])
    whole_space = tuning_privacy_report([drawn] * 4, DELTA, best, candidates=[drawn, undrawn_worse])
    assert whole_space["quoted_epsilon"] > only_drawn["quoted_epsilon"] + 0.5


def test_candidate_chunks_dominate_every_batch_size_of_the_space():
    """Each chunk's mechanism is at least as costly, at every order, as every exact one."""
    sizes = range(40, 101)
    setting = dict(dataset_size=4000, epochs=2, target_epsilon=4.0, delta=DELTA, accountant="rdp")
    chunked = candidate_mechanisms(sizes, max_candidates=3, **setting)
    assert len(chunked) == 3
    exact = candidate_mechanisms(sizes[::10], max_candidates=100, **setting)
    worst = max_rdp_curve(chunked)
    for mechanism in exact:
        assert (max_rdp_curve([mechanism]) <= worst + 1e-12).all()
    assert epsilon_from_rdp(worst, DELTA) > 4.0  # a bound, hence above each trial's epsilon


def test_zero_trials_drawn_is_recorded_and_costs_nothing():
    """K = 0 under an adaptive search: nothing ran, nothing released, composition 0."""
    report = tuning_privacy_report([], DELTA, conditions("poisson", sampler=True, release="best"))
    assert report["num_trials"] == 0 and "drawn_trials" not in report
    assert report["quoted_epsilon"] == 0.0
    assert "K = 0" in report["quote"]


@pytest.mark.parametrize("ran", [0, 3, 9])
def test_a_hidden_trial_count_leaves_no_trace_in_the_report(ran):
    """Where the random-trials bound is quoted, the report is the same whatever K was: it
    states K's distribution and nothing that counts the trials (K = 0 included)."""
    best = conditions("poisson", release="best")
    report = tuning_privacy_report([BRIEF] * ran, DELTA, best, candidates=[BRIEF])
    assert {"num_trials", "drawn_trials", "composition_epsilon"}.isdisjoint(report)
    assert report["trial_count"] == "poisson" and report["mean_trials"] == 8
    assert report == tuning_privacy_report([BRIEF] * 5, DELTA, best, candidates=[BRIEF])
    assert "kept private" in report["quote"] and "OS entropy" in report["quote"]
    # the condition the quote rests on is said beside it, and what breaks it
    assert "only while the number of trials K stays hidden" in report["holds_while"]
    assert "MLflow store" in report["holds_while"] and "console" in report["holds_while"]
    # what it leaves out is still there for the private state: the composition of what ran
    facts = composition_facts([BRIEF] * ran, DELTA)
    assert facts["num_trials"] == ran
    assert facts["composition_epsilon"] == pytest.approx(composition_epsilon([BRIEF] * ran, DELTA))
    # the parent's description, inside the store that counts the trials anyway, gives it
    front = pd.DataFrame(
        {"optimizer": ["dp-sgd"], "epsilon": [8.0], "trial_id": ["a"], "val_accuracy": [0.5]}
    )
    report = {**report, "trial_epsilon": 1.0}  # as the sweep's report adds it
    text = parent_description(
        front, [("val_accuracy", "max")], {"g": report}, hidden_counts={"g": facts}
    )
    assert report["holds_while"] in text
    shared = f"the {ran} trials that ran holds, epsilon {facts['composition_epsilon']:.3g}"
    assert shared in text
    assert "if this store is shared" not in parent_description(
        front, [("val_accuracy", "max")], {"g": report}
    )  # without the facts, no figure is made up


def test_the_report_says_why_it_composes_rdp_for_prv_calibrated_trials():
    report = tuning_privacy_report([BRIEF] * 2, DELTA, conditions("fixed"), accountant="prv")
    assert report["accountant"] == "rdp"
    assert "calibrated with PRV" in report["quote"] and "conservative" in report["quote"]
    assert "PRV" not in tuning_privacy_report([BRIEF] * 2, DELTA, conditions("fixed"))["quote"]


def test_validation_noise_is_composed_into_the_trial_cost():
    plain = TrialMechanism(0.9, 0.01, 300)
    scored = TrialMechanism(0.9, 0.01, 300, validation_noise_multiplier=5.0, validation_releases=3)
    report = tuning_privacy_report([scored], DELTA, conditions("fixed"))
    assert trial_epsilon(scored, DELTA) > trial_epsilon(plain, DELTA)
    assert "validation records" in report["records_covered"]
    exact = tuning_privacy_report([plain], DELTA, conditions("fixed"))
    assert "no DP protection" in exact["records_covered"]


def test_sweep_budget_solves_the_per_trial_epsilon():
    setting = dict(dataset_size=4000, epochs=2, delta=DELTA, accountant="rdp")
    fixed = conditions("fixed", mean=4)

    def quoted(eps):
        cands = candidate_mechanisms([100], target_epsilon=eps, **setting)
        return worst_case_tuning_epsilon(cands, DELTA, fixed, 4)

    per_trial = solve_trial_epsilon(6.0, quoted, tolerance=0.05)
    assert quoted(per_trial) <= 6.0 < quoted(per_trial + 0.1)
    assert 1.0 < per_trial < 6.0  # four composed trials: each gets much less than the total


def test_report_per_trial_max_over_heterogeneous_trials():
    report = tuning_privacy_report(HETERO, DELTA, conditions("fixed"))
    assert report["per_trial_epsilon_max"] == pytest.approx(
        max(trial_epsilon(t, DELTA) for t in HETERO)
    )


# A tuning cost in a config is dpivon's computation (`dpivon export`), never a claim.
_QUOTE = Path(__file__).resolve().parents[1] / (
    "results/compare-eps3/compare-eps3-tuning/tuning_privacy.json"
)


@pytest.mark.parametrize(
    ("forge", "message"),
    [
        (lambda t: {**t, "quoted_rdp": [-100.0] * len(t["quoted_rdp"])}, "negative or NaN"),
        (lambda t: {**t, "quoted_rdp": [math.nan] * len(t["quoted_rdp"])}, "negative or NaN"),
        (lambda t: {**t, "quoted_rdp": t["quoted_rdp"][:10]}, "holds 10 values"),
        (lambda t: {**t, "quoted_epsilon": -5.0}, "quoted_epsilon -5 is below"),
        (lambda t: {**t, "quoted_epsilon": 0.1}, "quoted_epsilon 0.1 is below"),
    ],
)
def test_a_forged_tuning_cost_is_refused_before_any_run(tmp_path, forge, message):
    import json

    import yaml
    from typer.testing import CliRunner

    from dpivon.cli import app

    quote = json.loads(_QUOTE.read_text())["eps3-dp-sgd"]
    tuning = {
        "sweep": "compare-eps3-tuning",
        "group": "eps3-dp-sgd",
        "quoted_epsilon": quote["quoted_epsilon"],
        "quote": quote["quote"],
        "release": quote["release"],
        "records_covered": quote["records_covered"],
        "quoted_rdp": [float(v) for v in quote["quoted_rdp"]],
    }
    config = {
        "optimizer": "dp-sgd",
        "dataset": "synthetic",
        "synthetic_size": 400,
        "model": "small-cnn",
        "epochs": 1,
        "batch_size": 64,
        "epsilon": 8.0,
    }
    path = tmp_path / "forged.yaml"
    path.write_text(yaml.safe_dump({**config, "privacy": {"tuning": forge(tuning)}}))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    ran = CliRunner().invoke(app, ["train", "--config", str(path), "--tracking-uri", uri])
    assert ran.exit_code == 2, ran.output
    assert message in " ".join(ran.output.split()) and "Traceback" not in ran.output
    assert not (tmp_path / "mlflow.db").exists()  # refused before a store or run was opened
    # the genuine cost passes the same check
    check_tuning_cost(tuning["quoted_rdp"], tuning["quoted_epsilon"], 1e-5)
