"""`dpivon benchmark`: aggregation and report on hand-made records, pipeline validation,
and one small real run on a local Ray with a real MLflow SQLite store (parent/child
layout, report on the parent, resume)."""

from __future__ import annotations

import io
import json
import math
import queue
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import ray
import torch
import yaml
from damaged_files import DAMAGED_CHECKPOINTS, torch_bytes
from scipy import stats
from sweep_helpers import store_snapshot
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.config import TrainConfig
from dpivon.errors import DpivonError
from dpivon.evaluation import evaluate_as_configured
from dpivon.evaluation.metrics import reliability_diagram
from dpivon.evaluation.shift import SHIFT_SETS, ShiftSet, evaluate_shift_as_configured
from dpivon.models import build_model
from dpivon.orchestration.storage import ResultsStorage
from dpivon.process import enter_ray_worker
from dpivon.runs import (
    NOT_COVERED_METRICS,
    TrainResult,
    load_data,
    released_metrics,
    train,
)
from dpivon.saved_files import FORMAT_KEY
from dpivon.study.aggregate import RunRecord, aggregate, compare, load_records, records_frame
from dpivon.study.benchmark import RESUMED_TAG, duration_text, run_benchmark, time_left_s
from dpivon.study.benchmark_report import build_report, write_report
from dpivon.study.benchmark_run import CheckpointPlace, run_one, score_on_test
from dpivon.study.layout import KEY_TAG, STATUS_TAG, weights_file
from dpivon.study.report_numbers import verdict_lines
from dpivon.study.shift_report import add_shift_blocks, cross_reference_rows
from dpivon.study.spec import RunSpec, load_benchmark
from dpivon.tracking.client import Tracker
from dpivon.tracking.model_file import load_model_file, save_model_file

runner = CliRunner()

# test accuracy / ECE of 3 seeds per (method, epsilon), chosen so means and stds are easy
HAND = {
    ("alpha", 1.0): ([0.30, 0.33, 0.34], [0.10, 0.12, 0.14]),
    ("alpha", 8.0): ([0.50, 0.50, 0.56], [0.05, 0.05, 0.05]),
    ("beta", 1.0): ([0.20, 0.22, 0.24], [0.02, 0.03, 0.04]),
    ("beta", 8.0): ([0.52, 0.54, 0.56], [0.06, 0.08, 0.10]),
}


def hand_records() -> list[RunRecord]:
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(200, 10, generator=gen), dim=1)
    labels = torch.randint(0, 10, (200,), generator=gen)
    records = []
    for (method, eps), (accs, eces) in HAND.items():
        for seed, (acc, ece) in enumerate(zip(accs, eces, strict=True)):
            history = {}
            if method == "alpha":  # an IVON-like method with diagnostics; beta has none
                history = {
                    "projected_fraction": [0.68, 0.67],
                    "hess_median": [0.5, 0.4 + 0.01 * seed],
                    "hess_q10": [0.4, 0.3],
                    "hess_q90": [0.6, 0.7],
                    "posterior_std_median": [0.01, 0.012],
                }
            records.append(
                RunRecord(
                    method=method,
                    optimizer="dp-ivon-gradsq" if method == "alpha" else "dp-sgd",
                    epsilon=eps,
                    replicate=seed,
                    metrics={
                        "test_accuracy": acc,
                        "test_ece": ece,
                        "test_nll": 2.0 - acc,
                        "test_brier": 0.9,
                        "test_ts_nll": 1.9 - acc,
                        "test_ts_ece": ece / 2,
                        "temperature": 1.5,
                        "epsilon_spent": eps - 0.01,
                        "wall_time_s": 10.0 + seed,
                    },
                    history=history,
                    reliability=reliability_diagram(probs, labels, 15),
                )
            )
    return records


def test_aggregation_matches_hand_computed_means_and_stds():
    table = aggregate(hand_records(), ["alpha", "beta"])
    assert list(zip(table["method"], table["epsilon"], strict=True)) == [
        ("alpha", 1.0),
        ("alpha", 8.0),
        ("beta", 1.0),
        ("beta", 8.0),
    ]
    assert (table["n"] == 3).all()
    row = table.iloc[1]  # alpha at 8: accuracy 0.50, 0.50, 0.56
    assert row["test_accuracy_mean"] == pytest.approx(0.52)
    # sample std (ddof 1): deviations -0.02, -0.02, 0.04 -> sqrt(0.0024 / 2)
    assert row["test_accuracy_std"] == pytest.approx(math.sqrt(0.0024 / 2))
    assert row["test_ece_std"] == pytest.approx(0.0, abs=1e-12)
    assert row["wall_time_s_mean"] == pytest.approx(11.0)
    assert row["wall_time_s_std"] == pytest.approx(1.0)
    assert table.iloc[0]["test_ece_std"] == pytest.approx(0.02)

    # the 95 % t interval of alpha's mean at 8 (n 3): mean ± t(0.975, 2) * std / sqrt(3)
    half = 4.302652729911275 * math.sqrt(0.0024 / 2) / math.sqrt(3)
    assert (row["test_accuracy_ci_low"], row["test_accuracy_ci_high"]) == pytest.approx(
        (0.52 - half, 0.52 + half)
    )

    runs = records_frame(hand_records())
    # eps 1: alpha ahead of beta by 0.10, 0.11, 0.10: the paired interval is
    # 0.1033 ± t(0.975, 2) * 0.00577 / sqrt(3)
    acc = compare(runs, "test_accuracy", 1.0)
    assert (acc.best, acc.second) == ("alpha", "beta")
    assert acc.gap == pytest.approx(0.31 / 3) and acc.word == "leads"
    assert acc.difference.paired and acc.difference.seeds == 3
    half = 4.302652729911275 * math.sqrt(0.0001 / 3) / math.sqrt(3)
    assert acc.difference.interval.low == pytest.approx(0.31 / 3 - half)
    # eps 8: beta leads by 0.02 on the means; per seed 0.02, 0.04, 0.00: the interval
    # 0.02 ± 4.30 * 0.02 / sqrt(3) straddles 0
    acc8 = compare(runs, "test_accuracy", 8.0)
    assert acc8.best == "beta" and acc8.word == "indistinguishable"
    assert acc8.difference.interval.low < 0 < acc8.difference.interval.high
    assert compare(runs, "test_ece", 1.0).best == "beta"  # lower is better
    # the last epoch's diagnostics: alpha's h ends at 0.40, 0.41, 0.42; beta logs none
    assert row["last_hess_median_mean"] == pytest.approx(0.41)
    assert row["last_hess_median_std"] == pytest.approx(0.01)
    assert row["last_projected_fraction_mean"] == pytest.approx(0.67)
    assert table.iloc[3][["last_projected_fraction_mean", "last_hess_median_std"]].isna().all()
    lines = verdict_lines(runs)
    assert len(lines) == 4  # per epsilon: the metrics, then the collapse
    assert lines[0].startswith("epsilon 1:") and "**alpha** (32.3 points) leads beta" in lines[0]
    assert "difference 10.3 points, 95 % CI [8.9, 11.8], paired t-test" in lines[0]
    # NLL = 2 - accuracy: alpha's is lower at eps 1
    assert "lowest mean test NLL **alpha** (1.677) leads beta (1.780)" in lines[0]
    assert lines[1].startswith("epsilon 1: lowest fraction of v_hat projected to zero")
    assert "**alpha**" in lines[1]
    assert lines[2].startswith("epsilon 8:")
    assert (
        "**beta** (54.0 points) and alpha (52.0 points) are indistinguishable at 3 seeds"
        in (lines[2])
    )
    # one seed per method (a benchmark under way): no interval to judge the gap with
    one_seed = records_frame([r for r in hand_records() if r.replicate == 0])
    assert compare(one_seed, "test_accuracy", 1.0).word == "unknown"
    assert "one seed on a side: no interval" in verdict_lines(one_seed)[0]


def test_report_has_the_table_and_a_self_contained_html(tmp_path):
    records = hand_records()
    report = build_report(
        "Benchmark hand",
        records,
        method_order=["alpha", "beta"],
        settings=["hand-made records"],
        method_configs={"alpha": {"optimizer": "dp-ivon-gradsq", "lr": 3.0, "tuned_by": None}},
    )
    markdown, page = report.markdown(), report.html()
    assert "| method | eps | seeds | accuracy % | NLL | ECE |" in markdown
    # mean [95 % t interval]: 52.0 ± 4.30 * 3.46 / sqrt(3)
    assert "| alpha | 8 | 3 | 52.0 [43.4, 60.6] |" in markdown
    assert "validation" in markdown  # the temperature-scaling note names its records
    assert "## Verdict" in markdown and report.verdict[0] in markdown
    assert set(report.figures) == {
        "metrics_vs_epsilon.png",
        "diagnostics.png",
        "reliability_alpha_eps1.png",
        "reliability_beta_eps1.png",
        "reliability_alpha_eps8.png",
        "reliability_beta_eps8.png",
    }
    assert page.count('src="data:image/png;base64,') == len(report.figures)
    assert not re.search(r'(src|href)="(?!data:)', page)  # no external asset
    assert "<td>52.0 [43.4, 60.6]</td>" in page and "<strong>alpha</strong>" in page
    assert "(beta) are not drawn" in markdown  # beta logged no diagnostics
    # ... and has no row in the last epoch's diagnostics table
    assert "| method | eps | seeds | projected fraction | clamped-noise share of h |" in markdown
    assert (
        "| alpha | 8 | 3 | 0.670 | - | 0.410 [0.385, 0.435] | 0.0120 |"  # constant: no interval
    ) in markdown
    assert "| beta | 8 | 3 | - |" not in markdown
    note = report.note()
    assert report.verdict[2] in note and "| beta | 1 | 3 | 22.0 [17.0, 27.0] |" in note
    # every method against the best, paired by seed: beta trails alpha by 10 points at eps 1
    assert "| 1 | accuracy (points) | alpha | beta | -10.3 | [-11.8, -8.9] |" in markdown
    assert "| 3 | trails the best |" in markdown
    assert "| 8 | accuracy (points) | beta | alpha | -2.0 |" in markdown

    files = write_report(report, tmp_path)
    assert (tmp_path / "report.md").read_text() == markdown
    assert (tmp_path / "figures" / "diagnostics.png").read_bytes()[:4] == b"\x89PNG"
    assert len(pd.read_csv(tmp_path / "results.csv")) == 4
    assert len(files) == 4 + len(report.figures)


def test_scoring_on_test_gives_trains_own_test_metrics_and_a_temperature():
    config = TrainConfig(
        optimizer="dp-ivon-gradsq",
        dataset="synthetic",
        synthetic_size=300,
        model="small-cnn",
        epochs=1,
        batch_size=64,
        bma_samples=2,
        epsilon=8,
        research_mode=True,  # both trainings draw the seed's noise: the same model
    )
    data = load_data(config)
    reference = train(config, data=data, evaluate_test=True)
    scored = score_on_test(train(config, data=data, evaluate_test=False), data)
    assert scored.test == reference.test  # the same evaluation, evaluated once
    assert np.array_equal(scored.test_reliability.bin_count, reference.test_reliability.bin_count)
    assert 0.01 <= scored.extra["temperature"] <= 100.0
    assert {"test_ts_nll", "test_ts_ece", "test_ts_brier"} <= scored.summary().keys()


def test_scoring_on_test_adds_the_shift_metrics_of_the_pipelines_shift_set(tmp_path, monkeypatch):
    monkeypatch.setenv("DPIVON_CACHE", str(tmp_path))
    config = checkpoint_config(epochs=1)
    data = load_data(config)
    trained = train(config, data=data, evaluate_test=False)
    shift_set = ShiftSet(("contrast",), (2,), per_class=4)
    scored = score_on_test(trained, data, shift_set)
    direct = evaluate_shift_as_configured(
        config, trained.model, trained.posterior, data.test_images, shift_set
    ).by_severity()
    assert direct and all(scored.test[k] == v for k, v in direct.items())
    assert scored.summary()["test_shift_s2_ece"] == direct["shift_s2_ece"]
    assert "shift_s0_ece" not in score_on_test(trained, data).test  # no set: not scored
    assert load_benchmark(write_benchmark(tmp_path, shift="default")).shift == "default"


def shifted_records() -> list[RunRecord]:
    """hand_records with shift metrics: ECE at severity k is 0.01 k (alpha) or 0.02 k
    (beta) plus 0.001 x seed; alpha logs mutual information, beta does not."""
    records = hand_records()
    for record in records:
        slope = 0.01 if record.method == "alpha" else 0.02
        for k in range(6):
            record.metrics[f"test_shift_s{k}_ece"] = slope * k + 0.001 * record.replicate
            record.metrics[f"test_shift_s{k}_accuracy"] = 0.5 - 0.05 * k
            record.metrics[f"test_shift_s{k}_aurc_maxprob"] = 0.3 + 0.01 * k
            if record.method == "alpha":
                record.metrics[f"test_shift_s{k}_auroc_mi"] = 0.6
    return records


def test_report_says_what_privacy_costs_under_shift_against_each_methods_reference():
    """alpha's reference ref-a has ECE 0.005 k + 0.002 x seed at severity k, beta's ref-b
    0.01 k: alpha's ECE cost is 0.005 k - 0.001 x seed, beta's 0.01 k + 0.001 x seed. Paired by
    replicate, beta's cost at severity 3 exceeds alpha's by 0.015 + 0.002 x seed (mean 0.017,
    std 0.002, 3 seeds), an interval that excludes 0: alpha leads."""
    records = shifted_records()
    for name, optimizer, slope, per_seed in (("ref-a", "ivon", 0.005, 0.002),
                                             ("ref-b", "adam", 0.01, 0.0)):  # fmt: skip
        for seed in range(3):
            metrics = {}
            for k in range(6):
                metrics[f"test_shift_s{k}_ece"] = slope * k + per_seed * seed
                metrics[f"test_shift_s{k}_accuracy"] = 0.6 - 0.05 * k
                metrics[f"test_shift_s{k}_nll"] = 1.0
            records.append(RunRecord(name, optimizer, math.inf, seed, metrics))
    methods = ["alpha", "beta", "ref-a", "ref-b"]
    references = {"alpha": "ref-a", "beta": "ref-b"}
    report = build_report("Benchmark hand", records, method_order=methods)
    add_shift_blocks(report, records, methods, references)
    markdown = report.markdown()
    assert "### What privacy costs under shift" in markdown
    assert report.figures["privacy_cost.png"][:4] == b"\x89PNG"
    # alpha vs ref-a at severity 1: 0.005 - 0.001 x seed, mean 0.004, std 0.001
    assert "| alpha vs ref-a | 1 | 3 | -0.001 [-0.003, 0.001] | 0.004 [0.002, 0.006] |" in (
        markdown
    )
    assert "| beta vs ref-b | 8 | 3 | 0.001 [-0.001, 0.003] | 0.011 [0.009, 0.013] |" in markdown
    # accuracy lost: 0.6 - 0.5 at every severity, in points (the same on every seed: no
    # interval)
    assert "| alpha vs ref-a | 1 | 3 | 10.0 | 10.0 |" in markdown
    # the costs compared: beta's ECE cost at severity 3 is 0.017 above alpha's; the 95 %
    # interval is 0.017 +- t(0.975, 2) x 0.002 / sqrt(3) = 0.017 +- 0.005
    row = "| 1 | ECE added at severity 3 | alpha | beta | +0.017 | [0.012, 0.022] |"
    assert row in markdown and "3 | trails the best |" in markdown
    verdict = [line for line in report.verdict if "least ECE added by privacy" in line]
    assert len(verdict) == 2 and verdict[0].startswith("epsilon 1, under shift (severity 3)")
    assert (
        "**alpha** (0.014) leads beta (0.031): difference -0.017, 95 % CI [-0.022, -0.012]"
        in (verdict[0])
    )
    assert verdict[0] in markdown and "<strong>alpha</strong> (0.014) leads" in report.html()
    # across references: alpha's cost against ref-a minus beta's against ref-b, one pair
    # per epsilon (its Holm p is its p)
    assert "| 1 | alpha vs ref-a | beta vs ref-b | -0.017 | [-0.022, -0.012] |" in markdown

    # without its reference's runs a method has no cost; with none at all, the report says so
    unmatched = [r for r in records if r.method != "ref-b"]
    alone = build_report("Benchmark hand", unmatched, method_order=methods)
    add_shift_blocks(alone, unmatched, methods, references)
    assert "beta vs ref-b" not in alone.markdown() and "alpha vs ref-a" in alone.markdown()
    nothing = build_report("Benchmark hand", shifted_records(), method_order=methods)
    add_shift_blocks(nothing, shifted_records(), methods, references)
    assert "No private method has a finished run beside a finished run of its" in (
        nothing.markdown()
    )
    assert "privacy_cost.png" not in nothing.figures


def test_report_shift_blocks_plot_and_table_ece_and_selective_prediction_by_severity():
    records = shifted_records()
    report = build_report("Benchmark hand", records, method_order=["alpha", "beta"])
    add_shift_blocks(report, records, ["alpha", "beta"], shift_set=SHIFT_SETS["default"])
    markdown = report.markdown()
    assert "## Uncertainty under dataset shift" in markdown
    # the subset's images are said, and that their sampling error is not in the intervals
    assert "50 images per class, under `gaussian_noise`, `defocus_blur`, `fog`" in markdown
    assert "not in the intervals" in markdown
    assert report.figures["shift.png"][:4] == b"\x89PNG"
    assert "![shift.png](figures/shift.png)" in markdown
    # ECE by severity: alpha at eps 1, seeds 0-2 -> 0.01 k + 0.001, std 0.001: the 95 % t
    # interval is 0.001 x t(0.975, 2) / sqrt(3) = 0.0025 either side
    assert "| alpha | 1 | 3 | 0.001 [-0.001, 0.003] | 0.011 [0.009, 0.013] |" in markdown
    assert "| beta | 8 | 3 | 0.001 [-0.001, 0.003] | 0.021 [0.019, 0.023] |" in markdown
    # selective prediction: clean and severity 3; beta has no mutual information
    assert "| method | eps | seeds | shift | accuracy % | AURC | AUROC MI |" in markdown
    clean = "| 50.0 | 0.300 | 0.600 |"  # the same on every seed: no interval
    assert f"| alpha | 1 | 3 | clean {clean}" in markdown
    assert "| beta | 1 | 3 | severity 3 | 35.0 | 0.330 | - |" in (markdown)
    # paired by seed like the clean metrics: beta's ECE at severity 3 is 0.03 above alpha's
    # on every seed, a difference without spread: no interval, no verdict (a zero-width
    # interval would call it certain); so are the equal accuracies
    row = "| 1 | ECE at shift severity 3 | alpha | beta | +0.030 | - | - | - | 3 | unknown |"
    assert row in markdown
    assert "| 1 | accuracy at shift severity 3 (points) | alpha | beta | +0.0 |" in markdown
    plain = build_report("Benchmark hand", hand_records(), method_order=["alpha", "beta"])
    add_shift_blocks(plain, hand_records(), ["alpha", "beta"])
    assert "shift severity 3" not in plain.markdown()  # no scores, no rows
    assert "shift: default" in plain.markdown() and "shift.png" not in plain.figures


# --- runs continued from their checkpoints ------------------------------------------------


def checkpoint_config(**overrides) -> TrainConfig:
    fields = {
        "optimizer": "dp-ivon-gradsq",
        "dataset": "synthetic",
        "synthetic_size": 300,
        "model": "small-cnn",
        "epochs": 3,
        "batch_size": 64,
        "bma_samples": 2,
        "val_bma_samples": 1,
        "epsilon": 8,
    }
    return TrainConfig(**(fields | overrides))


def interrupted_after_first_epoch(monkeypatch, config, data, checkpoint) -> None:
    """run_one stopped by Ctrl-C once its first epoch is checkpointed (as a driver's
    interrupt or a session's end stops it)."""
    real_train = train

    def train_until_interrupted(*args, on_epoch_end, **kwargs):
        def save_then_stop(report):
            on_epoch_end(report)
            raise KeyboardInterrupt

        return real_train(*args, on_epoch_end=save_then_stop, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr("dpivon.study.benchmark_run.train", train_until_interrupted)
        with pytest.raises(KeyboardInterrupt):
            run_one(config, data, checkpoint)
    assert checkpoint.load().epoch == 1


def resumed(config, data, checkpoint) -> tuple[TrainResult, list[int]]:
    """run_one continued from ``checkpoint``, and the epochs it reported as done."""
    done = queue.SimpleQueue()
    result = run_one(config, data, checkpoint, checkpoint.load(), done)
    reported = []
    while not done.empty():
        name, epoch = done.get()
        assert name == checkpoint.name
        reported.append(epoch)
    return result, reported


def parameters(result) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in result.model.parameters()])


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_threads_are_set_by_the_ray_worker_entry_never_by_the_run(tmp_path, two_threads):
    """A run called in the caller's process keeps the caller's thread count; the worker
    entry sets the run's CPU share."""
    config = checkpoint_config(research_mode=True, epochs=1)
    spec = RunSpec("dp-sgd", 8.0, 0, config)
    run_one(config, load_data(config), CheckpointPlace.of(ResultsStorage(str(tmp_path), "a"), spec))
    assert torch.get_num_threads() == 2
    enter_ray_worker(1)
    assert torch.get_num_threads() == 1


def test_an_interrupted_run_continues_after_its_last_epoch_as_if_never_stopped(
    tmp_path, monkeypatch, one_thread
):
    """Research mode (the noise follows the seed): the continued run trains epochs 2 and 3
    only and ends where the uninterrupted run ends, history and parameters."""
    config = checkpoint_config(research_mode=True)
    data = load_data(config)
    spec = RunSpec("dp-ivon-gradsq", 8.0, 0, config)
    whole = run_one(config, data, CheckpointPlace.of(ResultsStorage(str(tmp_path), "a"), spec))
    checkpoint = CheckpointPlace.of(ResultsStorage(str(tmp_path), "b"), spec)
    interrupted_after_first_epoch(monkeypatch, config, data, checkpoint)
    started = time.perf_counter()
    continued, epochs = resumed(config, data, checkpoint)
    # the run's wall time counts the interrupted attempt too
    assert continued.wall_time_s > time.perf_counter() - started
    assert epochs == [2, 3]
    assert [released_metrics(config, m) for m in continued.history] == [
        released_metrics(config, m) for m in whole.history
    ]
    assert torch.equal(parameters(continued), parameters(whole))
    assert continued.test == whole.test


def test_a_stored_checkpoint_holds_no_noise_key_and_a_resume_draws_a_fresh_one(
    tmp_path, monkeypatch, one_thread
):
    """The checkpoint is kept with the results, so it must not let a reader replay the
    noise: the key the run drew is nowhere in the file, nor is the raw training loss, and
    two resumes from the one file add different noise (with the key kept, they would be
    equal, as in research mode above)."""
    config = checkpoint_config(epochs=2)
    data = load_data(config)
    spec = RunSpec("dp-ivon-gradsq", 8.0, 0, config)
    checkpoint = CheckpointPlace.of(ResultsStorage(str(tmp_path), "bench"), spec)
    known_key = bytes(range(7, 39))
    with monkeypatch.context() as patch:
        patch.setattr("dpivon.privacy.noise.os_key", lambda: known_key)
        interrupted_after_first_epoch(monkeypatch, config, data, checkpoint)
    stored = checkpoint.folder.read_bytes(checkpoint.name)
    assert known_key not in stored
    saved = checkpoint.load()
    assert "key" not in saved.training["rng"]["randomness"]
    assert all(name not in m for m in saved.training["history"] for name in NOT_COVERED_METRICS)

    first, _ = resumed(config, data, checkpoint)
    checkpoint.save(saved)  # the same file again, as a second reader of it would resume
    second, _ = resumed(config, data, checkpoint)
    assert not torch.equal(parameters(first), parameters(second))
    assert first.epsilon_spent == pytest.approx(second.epsilon_spent)


def test_a_checkpoint_of_another_configuration_is_refused(tmp_path, monkeypatch):
    config = checkpoint_config(epochs=2)
    data = load_data(config)
    storage = ResultsStorage(str(tmp_path), "bench")
    checkpoint = CheckpointPlace.of(storage, RunSpec("m", 8.0, 0, config))
    interrupted_after_first_epoch(monkeypatch, config, data, checkpoint)
    changed = checkpoint_config(epochs=2, lr=0.5)
    other = CheckpointPlace.of(storage, RunSpec("m", 8.0, 0, changed))
    assert other.name == checkpoint.name
    with pytest.raises(DpivonError, match="another run configuration; delete it"):
        other.load()


# --- pipelines ---------------------------------------------------------------------------


def write_benchmark(tmp_path, **overrides) -> str:
    data = {
        "name": "tiny",
        "data": {"dataset": "synthetic", "synthetic_size": 300},
        "model": "small-cnn",
        "epochs": 1,
        "epsilons": [8, float("inf")],
        "seeds": [0, 1, 2],
        "methods": [
            {"name": "dp-sgd", "optimizer": "dp-sgd", "train": {"lr": 0.5}},
            {
                "name": "dp-ivon-ema",
                "optimizer": "dp-ivon-gradsq",
                "train": {"curvature_estimator": "ema-corrected", "beta2": 0.99},
            },
        ],
        "concurrency": 2,
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "storage_path": str(tmp_path / "runs"),
        "train": {"bma_samples": 2, "batch_size": 64},
    }
    data.update(overrides)
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"seeds": [0, 1]}, "at least 3 seeds"),
        ({"epsilons": [8, 8]}, "epsilons must be distinct"),
        ({"methods": [{"name": "x", "optimizer": "dp-nope"}]}, "unknown optimizer 'dp-nope'"),
        (
            {"methods": [{"name": "x", "optimizer": "dp-sgd", "train": {"epochs": 3}}]},
            "epochs is a benchmark setting",
        ),
        (
            {"methods": [{"name": "x", "optimizer": "dp-sgd", "train": {"lr": -1}}]},
            "lr must be in (0, 1e+06]",
        ),
        (
            {"methods": [{"name": "x", "optimizer": "dp-sgd", "from_sweep": "nowhere"}]},
            "no sweep found for 'nowhere'",
        ),
        ({"colour": "red"}, "colour: unknown key"),
        ({"shift": "most"}, "shift"),
        (
            {
                "methods": [
                    {"name": "x", "optimizer": "dp-sgd", "reference": "adam"},
                    {"name": "sgd", "optimizer": "sgd"},
                ]
            },
            ": methods.0.reference: 'adam' is not a method of this benchmark; name one of its "
            "non-private methods: sgd",
        ),
        (
            {
                "methods": [
                    {"name": "a", "optimizer": "adam", "reference": "b"},
                    {"name": "b", "optimizer": "adam"},
                ]
            },
            ": methods.0.reference: 'a' (adam) is not private",
        ),
        (
            {
                "methods": [
                    {"name": "a", "optimizer": "dp-adam", "reference": "b"},
                    {"name": "b", "optimizer": "dp-sgd"},
                ]
            },
            ": methods.0.reference: 'b' (dp-sgd) is private; the reference is a non-private",
        ),
        (
            {
                "methods": [
                    {"name": "a", "optimizer": "dp-adam", "reference": "b"},
                    {"name": "b", "optimizer": "adam"},
                ]
            },
            ": methods.0.reference: a reference measures what privacy costs under shift; set "
            "shift: default",
        ),
    ],
)
def test_bad_benchmark_yaml_is_one_line_and_exit_2(tmp_path, overrides, message):
    result = runner.invoke(app, ["benchmark", write_benchmark(tmp_path, **overrides)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: invalid benchmark")
    assert message in result.output and "methods: methods" not in result.output


@pytest.mark.parametrize("case", DAMAGED_CHECKPOINTS)
def test_resume_names_a_damaged_run_checkpoint_before_mlflow_or_ray(tmp_path, case):
    content, reason = DAMAGED_CHECKPOINTS[case]
    pipeline = load_benchmark(write_benchmark(tmp_path, epsilons=[8]))
    checkpoint = CheckpointPlace.of(pipeline.storage, pipeline.runs[-1])
    checkpoint.folder.write_bytes(checkpoint.name, content)
    result = runner.invoke(app, ["benchmark", str(pipeline.path), "--resume"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and reason in lines[0], result.output
    assert checkpoint.folder.location(checkpoint.name) in lines[0]
    assert not (tmp_path / "mlflow.db").exists()  # no store opened, let alone a run


def test_a_non_private_method_runs_at_eps_inf_only(tmp_path):
    """sgd spends no budget: its runs are labelled inf, never epsilon 8."""
    methods = [{"name": "sgd", "optimizer": "sgd"}, {"name": "dp-sgd", "optimizer": "dp-sgd"}]
    pipeline = load_benchmark(write_benchmark(tmp_path, methods=methods, epsilons=[8]))
    sgd = [r for r in pipeline.runs if r.method == "sgd"]
    assert len(sgd) == 3 and {r.epsilon for r in sgd} == {math.inf}
    assert {r.config.privacy.epsilon for r in sgd} == {math.inf}
    assert {r.epsilon for r in pipeline.runs if r.method == "dp-sgd"} == {8.0}


def fake_sweep(tmp_path, name: str, trials_per_group: int, lr: float):
    """A finished sweep on disk as `dpivon export` reads it: one front trial per group."""
    directory = tmp_path / name
    directory.mkdir()
    rows = []
    for eps in (8.0, math.inf):
        group = f"eps{eps:g}-dp-sgd"
        checkpoint = directory / group / "trial0"
        checkpoint.mkdir(parents=True)
        config = TrainConfig(
            optimizer="dp-sgd",
            epsilon=eps,
            lr=lr,
            batch_size=32,
            max_grad_norm=0.7,
            dataset="synthetic",
            model="small-cnn",
        )
        save_model_file(checkpoint / "model.pt", config, build_model("small-cnn"), None)
        for i in range(trials_per_group):
            rows.append(
                {
                    "trial_id": f"{group}-{i}",
                    "group": group,
                    "optimizer": "dp-sgd",
                    "epsilon": eps,
                    "status": "completed",
                    "val_accuracy": 0.5 - 0.1 * i,
                    "val_ece": 0.1 + 0.1 * i,
                    "checkpoint": f"{group}/trial0",  # inside the sweep's folder
                }
            )
    trials = pd.DataFrame(rows)
    trials.to_csv(directory / "trials.csv", index=False)
    trials.groupby("group").head(1).to_csv(directory / "pareto_front.csv", index=False)
    (directory / "tuning_privacy.json").write_text("{}")
    (directory / "sweep.json").write_text(
        json.dumps(
            {
                "name": name,
                "pipeline_path": "",
                "tracking_uri": "",
                "experiment": "",
                "parent_run_id": "",
                "objectives": [["val_accuracy", "max"], ["val_ece", "min"]],
            }
        )
    )
    return directory


def test_from_sweep_takes_the_exported_pick_and_checks_the_trial_budget(tmp_path):
    sweep = fake_sweep(tmp_path, "s1", trials_per_group=2, lr=0.123)
    methods = [
        {"name": "tuned", "optimizer": "dp-sgd", "from_sweep": str(sweep)},
        {"name": "fixed", "optimizer": "dp-sgd", "train": {"lr": 1.0}},
    ]
    pipeline = load_benchmark(write_benchmark(tmp_path, methods=methods))
    tuned = [r for r in pipeline.runs if r.method == "tuned"]
    assert len(tuned) == 6 and {r.config.optimizer.lr for r in tuned} == {0.123}
    # the sweep's hyper-parameters, the benchmark's setting (data, epochs, seeds)
    assert {r.config.privacy.max_grad_norm for r in tuned} == {0.7}
    assert {r.config.training.batch_size for r in tuned} == {64}  # the benchmark's train: wins
    assert {r.config.data.synthetic_size for r in tuned} == {300}
    assert tuned[0].tuned_by == "s1/eps8-dp-sgd/eps8-dp-sgd-0"
    assert [s.uri for s in pipeline.sweep_directories] == [str(sweep.resolve())]
    report = build_report("with a sweep", hand_records(), sweeps=pipeline.sweep_directories)
    assert report.figures["pareto_s1.png"][:4] == b"\x89PNG"
    assert "Pareto fronts of the tuning sweeps" in report.markdown()
    # seeds differ per run, the split is shared
    assert len({r.config.runtime.seed for r in pipeline.runs}) == len(pipeline.runs)
    assert {r.config.data.data_seed for r in pipeline.runs} == {0}

    # a second tuned method: from a sweep of as many trials per group, it compares
    same = fake_sweep(tmp_path, "s2", trials_per_group=2, lr=0.2)
    methods.append({"name": "tuned-same", "optimizer": "dp-sgd", "from_sweep": str(same)})
    assert {r.method for r in load_benchmark(write_benchmark(tmp_path, methods=methods)).runs} == {
        "tuned",
        "fixed",
        "tuned-same",
    }
    # an epsilon no run can meet is refused as such before the sweep is read (which has no
    # group there: that error would hide the real one)
    for epsilons, words in (([1e308], "above 1000"), ([1e-12], "the smallest")):
        with pytest.raises(DpivonError, match=words):
            load_benchmark(write_benchmark(tmp_path, methods=methods, epsilons=epsilons))
    # from a sweep of more trials per group, it would win by budget, not by merit
    other = fake_sweep(tmp_path, "s3", trials_per_group=3, lr=0.2)
    methods[-1] = {"name": "tuned-more", "optimizer": "dp-sgd", "from_sweep": str(other)}
    with pytest.raises(DpivonError, match="different trial budgets"):
        load_benchmark(write_benchmark(tmp_path, methods=methods))


def test_the_time_left_is_the_median_measured_epoch_times_the_epochs_left_per_run_at_once():
    # a slow first epoch (the start-up of a run) does not move the median
    assert time_left_s(60, [100.0, 120.0, 500.0], 2) == pytest.approx(60 * 120.0 / 2)
    assert time_left_s(60, [], 2) is None  # nothing measured yet: no guess
    assert [duration_text(s) for s in (20.0, 2400.0, 5399.0, 34_200.0)] == [
        "1 min",
        "40 min",
        "90 min",
        "9.5 h",
    ]


# --- a real run --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_benchmark(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("benchmark")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        pipeline = load_benchmark(write_benchmark(tmp_path))
        outcome = run_benchmark(pipeline)
        yield tmp_path, pipeline, outcome
    finally:
        ray.shutdown()


def runs_of(tmp_path, experiment: str):
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("dpivon.kind") == "benchmark"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


def test_one_parent_one_child_per_method_epsilon_seed(finished_benchmark):
    tmp_path, pipeline, outcome = finished_benchmark
    assert not outcome.failed and len(outcome.completed) == 12
    client, parents, children = runs_of(tmp_path, pipeline.experiment)
    (parent,) = parents
    assert parent.info.status == "FINISHED" and parent.info.run_id == outcome.parent_run_id
    assert len(children) == 12
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    assert {c.data.tags[KEY_TAG] for c in children} == {r.key for r in pipeline.runs}
    assert any("temperature" in child.data.metrics for child in children)
    for child in children:
        params, metrics = child.data.params, child.data.metrics
        assert child.info.status == "FINISHED" and child.data.tags[STATUS_TAG] == "completed"
        assert {"method", "replicate", "optimizer", "lr", "batch_size", "seed"} <= params.keys()
        # the records the run trained on (and, private, its epsilon was accounted over)
        assert int(params["train_images"]) == pipeline.data.train_size
        assert {
            "test_accuracy",
            "test_nll",
            "test_ece",
            "test_brier",
            "wall_time_s",
            "val_accuracy",
        } <= metrics.keys()
        # temperature scaling where the 30 validation images determine a T (not at chance:
        # there the NLL falls all the way to T = 100, the uniform predictive)
        assert (
            ("temperature" in metrics) == ("test_ts_ece" in metrics) == ("test_ts_nll" in metrics)
        )
        private = child.data.tags["dpivon.epsilon"] == "8"
        if private:
            assert metrics["epsilon_spent"] == pytest.approx(8.0, abs=0.05)
            assert "train_loss" not in metrics  # not DP: never stored for a private run
        if params["optimizer"] == "dp-ivon-gradsq":
            history = client.get_metric_history(child.info.run_id, "projected_fraction")
            assert [m.step for m in history] == [1]
        artifacts = {a.path for a in client.list_artifacts(child.info.run_id)}
        assert {"reliability.json", "summary.json", "config.yaml"} <= artifacts
    report = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/report.md", "report/report.html", "report/results.csv"} <= report
    note = parent.data.tags["mlflow.note.content"]
    assert "| method | eps | seeds |" in note and "epsilon 8:" in note
    assert "test_accuracy.eps8.dp-sgd" in parent.data.metrics
    page = pipeline.storage.read_text("report/report.html")
    assert "data:image/png;base64," in page
    results = pd.read_csv(io.StringIO(pipeline.storage.read_text("report/results.csv")))
    assert len(results) == 4 and (results["train_images"] == pipeline.data.train_size).all()
    assert pipeline.storage.listdir("checkpoints") == []  # each removed once its run was logged
    # each run's released weights lie in the folder, as a model file and nothing more
    assert sorted(pipeline.storage.listdir("weights")) == sorted(
        weights_file(r.key).removeprefix("weights/") for r in pipeline.runs
    )
    for child in children:
        key = child.data.tags[KEY_TAG]
        path = tmp_path / "runs" / pipeline.name / weights_file(key)
        stored = torch.load(path, map_location="cpu", weights_only=True)
        assert set(stored) == {FORMAT_KEY, "config", "model_state", "posterior"}  # no noise key
        config, model, posterior = load_model_file(path)
        assert config.flat()["seed"] == int(child.data.params["seed"])
        assert (posterior is not None) == (config.optimizer.name == "dp-ivon-gradsq")
        if posterior is None:  # the mean's predictive: the logged test accuracy again
            test = evaluate_as_configured(config, model, load_data(config).test, None)
            assert test.metrics["accuracy"] == pytest.approx(child.data.metrics["test_accuracy"])


def test_resume_skips_finished_runs_and_reruns_the_rest(finished_benchmark, one_thread):
    tmp_path, pipeline, _ = finished_benchmark
    client, _, children = runs_of(tmp_path, pipeline.experiment)
    interrupted = next(c for c in children if c.data.tags[KEY_TAG] == "dp-sgd|eps8|seed1")
    # as if the driver had died while this run was in flight
    client.set_tag(interrupted.info.run_id, STATUS_TAG, "running")
    client.update_run(interrupted.info.run_id, status="RUNNING")
    ended = {c.info.run_id: c.info.end_time for c in children}
    # ... after the run had checkpointed its (only) epoch
    spec = next(r for r in pipeline.runs if r.key == "dp-sgd|eps8|seed1")
    checkpoint = CheckpointPlace.of(pipeline.storage, spec)
    run_one(spec.config, load_data(spec.config), checkpoint)
    assert checkpoint.load().epoch == 1

    with pytest.raises(DpivonError, match="pass --resume"):
        run_benchmark(pipeline)
    outcome = run_benchmark(pipeline, resume=True)
    assert outcome.skipped == 11 and outcome.completed == ["dp-sgd|eps8|seed1"]
    assert client.get_run(interrupted.info.run_id).data.tags[RESUMED_TAG] == "1"
    assert checkpoint.load() is None
    _, parents, after = runs_of(tmp_path, pipeline.experiment)
    assert len(parents) == 1 and len(after) == 12  # the same child run was reused
    for child in after:
        if child.info.run_id == interrupted.info.run_id:
            assert child.data.tags[STATUS_TAG] == "completed"
            assert child.info.status == "FINISHED"
        else:
            assert child.info.end_time == ended[child.info.run_id]  # untouched
    history = client.get_metric_history(interrupted.info.run_id, "val_accuracy")
    assert len(history) >= 1 and np.isfinite([m.value for m in history]).all()


def test_resuming_a_finished_benchmark_twice_changes_nothing(finished_benchmark):
    """The report is built from the MLflow record alone: resumed twice, a finished benchmark
    trains nothing and leaves its files (plots aside), runs, metric histories and artifacts
    as they were."""
    tmp_path, pipeline, _ = finished_benchmark
    before = store_snapshot(tmp_path, pipeline.experiment, Path(pipeline.storage.path))
    for _ in range(2):
        result = runner.invoke(app, ["benchmark", str(pipeline.path), "--resume"])
        assert result.exit_code == 0, result.output
        assert "0 of 12 runs to do (12 finished before)" in " ".join(result.output.split())
        assert store_snapshot(tmp_path, pipeline.experiment, Path(pipeline.storage.path)) == before
    assert {"report/report.md", "report/results.csv", "report/runs.csv"} <= set(before["results"])


def test_report_only_reports_the_completed_runs_of_an_interrupted_benchmark(finished_benchmark):
    """--report-only trains nothing: the report of an interrupted benchmark covers its
    completed runs, and the interrupted run is left for --resume."""
    tmp_path, pipeline, _ = finished_benchmark
    client, _, children = runs_of(tmp_path, pipeline.experiment)
    interrupted = next(c for c in children if c.data.tags[KEY_TAG] == "dp-sgd|eps8|seed2")
    client.set_tag(interrupted.info.run_id, STATUS_TAG, "running")
    client.update_run(interrupted.info.run_id, status="KILLED")
    try:
        result = runner.invoke(app, ["benchmark", str(pipeline.path), "--report-only"])
        assert result.exit_code == 0, result.output
        assert "the report of 11 of 12 runs" in " ".join(result.output.split())
        assert "11 of 12 runs completed" in pipeline.storage.read_text("report/report.md")
        runs = pd.read_csv(io.StringIO(pipeline.storage.read_text("report/runs.csv")))
        assert len(runs) == 11
        after = client.get_run(interrupted.info.run_id)
        assert after.info.status == "KILLED" and after.data.tags[STATUS_TAG] == "running"
    finally:
        client.set_tag(interrupted.info.run_id, STATUS_TAG, "completed")
        client.update_run(interrupted.info.run_id, status="FINISHED")
        runner.invoke(app, ["benchmark", str(pipeline.path), "--report-only"])


def test_a_temperature_the_validation_split_did_not_determine_is_not_reported(
    finished_benchmark,
):
    """A run stored with T at a bound of the search (fitted before `fit_temperature` refused
    such fits: one validation image, all right, gave T = 0.01 and an NLL of 11) has no
    temperature-scaled metrics in the report; the others keep theirs."""
    tmp_path, pipeline, outcome = finished_benchmark
    client, _, children = runs_of(tmp_path, pipeline.experiment)
    child = next(c for c in children if "temperature" in c.data.metrics)
    kept = child.data.metrics["temperature"]
    client.log_metric(child.info.run_id, "temperature", 0.01, step=10_000)
    try:
        tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", pipeline.experiment)
        records = {r.run_id: r for r in load_records(tracker, outcome.parent_run_id)}
        undetermined = records.pop(child.info.run_id).metrics
        assert not {"temperature", "test_ts_nll", "test_ts_ece"} & undetermined.keys()
        assert "test_nll" in undetermined
        fitted = [c.info.run_id for c in children if "temperature" in c.data.metrics]
        assert all("test_ts_nll" in records[i].metrics for i in fitted if i != child.info.run_id)
    finally:
        client.log_metric(child.info.run_id, "temperature", kept, step=10_001)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--report-only", "--resume"], "pass one of them"),
        (["--report-only"], "has not started in"),
    ],
)
def test_report_only_errors_are_one_line(tmp_path, extra, message):
    result = runner.invoke(app, ["benchmark", write_benchmark(tmp_path, name="never"), *extra])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not (tmp_path / "runs" / "never").exists()


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_resume_continues_the_run_from_its_last_epoch(tmp_path):
    """SIGTERM (a container stop, `kill`) stops the driver as Ctrl-C does: exit 143, the
    parent and the run in flight KILLED, the run's checkpoint kept; --resume continues
    that run after its checkpointed epoch (not from the start) and removes the file."""
    path = write_benchmark(
        tmp_path,
        name="stopped",
        data={"dataset": "synthetic", "synthetic_size": 1500},
        epochs=6,
        epsilons=[8],
        methods=[{"name": "dp-sgd", "optimizer": "dp-sgd", "train": {"lr": 0.5}}],
        concurrency=1,
    )
    pipeline = load_benchmark(path)
    command = [sys.executable, "-m", "dpivon.cli", "benchmark", path]
    folder = Path(pipeline.storage.path) / "checkpoints"
    driver = subprocess.Popen(command, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 400
    while not any(folder.glob("*.pt")):  # the first run has finished an epoch
        assert driver.poll() is None and time.time() < deadline, driver.stderr.read()[-3000:]
        time.sleep(0.2)
    driver.send_signal(signal.SIGTERM)
    _, stderr = driver.communicate(timeout=120)
    assert driver.returncode == 143, stderr.decode()[-3000:]
    assert "interrupted by SIGTERM" in stderr.decode() and "--resume" in stderr.decode()
    client, (parent,), children = runs_of(tmp_path, pipeline.experiment)
    assert parent.info.status == "KILLED"
    (stopped,) = [c for c in children if c.info.status != "FINISHED"]
    assert stopped.info.status == "KILLED"
    said = " ".join(stderr.decode().split())
    assert f"{stopped.data.tags[KEY_TAG]} interrupted" in said  # stopped, not failed
    assert f"{stopped.data.tags[KEY_TAG]} failed" not in said and ", 1 failed" not in said
    checkpoint = CheckpointPlace.of(
        pipeline.storage, next(r for r in pipeline.runs if r.key == stopped.data.tags[KEY_TAG])
    )
    kept = checkpoint.load().epoch
    assert 1 <= kept < 6

    resumed = subprocess.run([*command, "--resume"], capture_output=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr.decode()[-3000:]
    assert f"continues after epoch {kept}" in " ".join(resumed.stderr.decode().split())
    after = client.get_run(stopped.info.run_id)
    assert after.info.status == "FINISHED" and after.data.tags[RESUMED_TAG] == str(kept)
    history = client.get_metric_history(stopped.info.run_id, "val_accuracy")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6]  # each epoch logged once
    assert not any(folder.glob("*.pt"))


@pytest.mark.slow
def test_a_resume_that_adds_a_method_says_so_on_the_parent(tmp_path):
    """A resume may add a method (the anchor control was added so): the parent then names
    every method and run it holds, and keeps the pipeline it ran last."""
    dp_sgd = {"name": "dp-sgd", "optimizer": "dp-sgd", "train": {"lr": 0.5}}
    sgd = {"name": "sgd", "optimizer": "sgd", "train": {"lr": 0.1}}
    plan = {"epsilons": [8], "data": {"dataset": "synthetic", "synthetic_size": 200}}
    path = write_benchmark(tmp_path, methods=[dp_sgd], **plan)
    first = runner.invoke(app, ["benchmark", path])
    assert first.exit_code == 0, first.output
    path = write_benchmark(tmp_path, methods=[dp_sgd, sgd], **plan)
    resumed = runner.invoke(app, ["benchmark", path, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert "3 of 6 runs to do (3 finished before)" in " ".join(resumed.output.split())
    client, (parent,), children = runs_of(tmp_path, load_benchmark(path).experiment)
    assert len(children) == 6
    tags = parent.data.tags
    assert (tags["methods"], tags["epsilons"], tags["seeds"], tags["runs"]) == (
        "dp-sgd,sgd",
        "8",
        "0,1,2",
        "6",
    )
    logged = client.download_artifacts(parent.info.run_id, "pipeline.yaml", str(tmp_path))
    assert Path(logged).read_text() == Path(path).read_text()


@pytest.mark.slow
def test_a_benchmark_with_shift_logs_the_shift_metrics_and_reports_them(
    tmp_path, own_cache, fresh_local_ray
):
    methods = [
        {"name": "dp-sgd", "optimizer": "dp-sgd", "train": {"lr": 0.5}, "reference": "sgd"},
        {"name": "sgd", "optimizer": "sgd", "train": {"lr": 0.5}},
    ]
    path = write_benchmark(tmp_path, name="shifted", methods=methods, epsilons=[8],
                           shift="default")  # fmt: skip
    outcome = run_benchmark(load_benchmark(path))
    assert not outcome.failed and len(outcome.completed) == 6
    client, _, children = runs_of(tmp_path, "dpivon-shifted")
    for child in children:
        assert {f"test_shift_s{k}_ece" for k in range(6)} <= child.data.metrics.keys()
        # every set's row and what scoring cost, as `dpivon train --shift` logs them
        record = json.loads(
            Path(
                client.download_artifacts(
                    child.info.run_id, "shift.json", str(tmp_path / child.info.run_id)
                )
            ).read_text()
        )
        assert len(record["sets"]) == 1 + 4 * 5 and record["predict_cpu_s"] > 0
        assert record["shift_s3_ece"] == pytest.approx(child.data.metrics["test_shift_s3_ece"])
    markdown = outcome.report.markdown()
    assert "![shift.png](figures/shift.png)" in markdown
    assert "| dp-sgd | 8 | 3 | clean |" in markdown
    # the file's reference reaches the report: dp-sgd's cost against sgd, seed by seed
    assert "![privacy_cost.png](figures/privacy_cost.png)" in markdown
    assert "| dp-sgd vs sgd | 8 | 3 |" in markdown


@pytest.mark.slow
def test_report_only_scores_the_stored_weights_of_runs_finished_before_shift_was_asked(
    tmp_path, own_cache, fresh_local_ray
):
    """A study finished without shift scores gets them from its stored weights when its
    pipeline asks for them: an evaluation logged on each run, no retraining; the report then
    has the shift blocks. A run whose weights are gone is named."""
    methods = [{"name": "dp-sgd", "optimizer": "dp-sgd", "train": {"lr": 0.5}}]
    plain = dict(name="later", methods=methods, epsilons=[8])
    outcome = run_benchmark(load_benchmark(write_benchmark(tmp_path, **plain)))
    assert not outcome.failed and "shift.png" not in outcome.report.figures
    client, _, children = runs_of(tmp_path, "dpivon-later")
    trained = {c.info.run_id: c.data.metrics["test_accuracy"] for c in children}
    weights = sorted((tmp_path / "runs" / "later" / "weights").iterdir())
    weights[1].unlink()  # one run's weights lost: that run cannot be scored

    shifted = load_benchmark(write_benchmark(tmp_path, **plain, shift="default"))
    outcome = run_benchmark(shifted, report_only=True)
    _, _, children = runs_of(tmp_path, "dpivon-later")
    scored = [c for c in children if "test_shift_s3_ece" in c.data.metrics]
    assert len(scored) == 2 and len(children) == 3
    for child in children:  # the training's own numbers are untouched
        assert child.data.metrics["test_accuracy"] == trained[child.info.run_id]
        assert len(client.get_metric_history(child.info.run_id, "test_accuracy")) == 1
    assert "![shift.png](figures/shift.png)" in outcome.report.markdown()
    # scored once: a second report finds the scores logged and evaluates nothing
    before = client.get_metric_history(scored[0].info.run_id, "test_shift_s3_ece")
    run_benchmark(shifted, report_only=True)
    assert client.get_metric_history(scored[0].info.run_id, "test_shift_s3_ece") == before


def test_a_run_checkpoint_of_layout_1_continues_for_its_own_configuration_only(
    tmp_path, monkeypatch, one_thread
):
    """The benchmark's checkpoint before every driver shared one format (its configuration
    named by a hash; the Tramer & Boneh anchor's runs in flight were committed so) reads back
    as today's and the run continues from it; under another configuration it is refused."""
    config = checkpoint_config(epochs=2)
    data = load_data(config)
    place = CheckpointPlace.of(ResultsStorage(str(tmp_path), "bench"), RunSpec("m", 8.0, 0, config))
    interrupted_after_first_epoch(monkeypatch, config, data, place)
    today = place.load()
    old = {"config_hash": place.config_hash, "training": today.training, "seconds": 5.0}
    place.folder.write_bytes(place.name, torch_bytes(old))  # no layout key: layout 1
    read = place.load()
    assert read.config == config.flat() and read.epoch == 1 and read.seconds == 5.0
    continued, epochs = resumed(config, data, place)
    assert epochs == [2] and continued.wall_time_s > 5.0
    place.folder.write_bytes(place.name, torch_bytes(old))
    with pytest.raises(DpivonError, match="another run configuration"):
        replace(place, config_hash="0" * 16).load()


def test_a_conclusion_now_undefined_is_recorded_as_such_not_left_at_its_old_value(tmp_path):
    """A rebuilt report whose temperature-scaled ECE is no longer defined (NaN) records NaN
    over the value an earlier report logged; an unchanged or still undefined one adds no
    history, and one never recorded is not logged as NaN."""
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "report")
    run_id = tracker.client.create_run(tracker.experiment_id).info.run_id
    tracker.log_changed_metrics(run_id, {"test_ts_ece.eps3.a": 0.4, "test_ece.eps3.a": 0.2})
    for _ in range(2):
        tracker.log_changed_metrics(
            run_id, {"test_ts_ece.eps3.a": math.nan, "test_ece.eps3.a": 0.2, "new": math.nan}
        )
    metrics = tracker.client.get_run(run_id).data.metrics
    assert math.isnan(metrics["test_ts_ece.eps3.a"]) and "new" not in metrics
    assert [len(tracker.metric_history(run_id, k)) for k in sorted(metrics)] == [1, 2]


def test_costs_are_compared_across_references_only_and_holm_adjusted_per_epsilon():
    """Three methods: a1 and a2 against reference A, b against B. Only the pairs whose
    references differ are compared, A's method first: (a1, b) and (a2, b); a1's cost is
    0.02 below b's on every seed but one, a2's the same as b's."""
    rows = []
    for seed, (a1, a2, b) in enumerate([(0.10, 0.13, 0.12), (0.11, 0.15, 0.14),
                                        (0.13, 0.14, 0.15)]):  # fmt: skip
        for method, cost in (("a1", a1), ("a2", a2), ("b", b)):
            rows.append({"method": method, "epsilon": 3.0, "replicate": seed,
                         "ece_cost_s3": cost})  # fmt: skip
    costs = pd.DataFrame(rows)
    references = {"a1": "A", "a2": "A", "b": "B"}
    header, table = cross_reference_rows(costs, ["a1", "a2", "b"], references)
    assert header[5:7] == ["p", "p (Holm)"]
    assert [(r[1], r[2]) for r in table] == [("a1 vs A", "b vs B"), ("a2 vs A", "b vs B")]
    p = {r[1]: float(r[5]) for r in table}
    holm = {r[1]: float(r[6]) for r in table}
    expected = stats.ttest_rel([0.10, 0.11, 0.13], [0.12, 0.14, 0.15]).pvalue
    assert p["a1 vs A"] == pytest.approx(expected, rel=0.05)
    assert holm["a1 vs A"] == pytest.approx(min(1.0, 2 * p["a1 vs A"]), rel=0.05)
    assert table[0][3] == "-0.023" and table[0][-1] == "leads"
    assert table[1][-1] == "indistinguishable"


@pytest.mark.parametrize("flag", ["--report-only", "--resume"])
def test_a_started_benchmark_needs_the_store_that_holds_its_parent(
    finished_benchmark, tmp_path, flag
):
    """A store that does not exist is not created, and one without the parent run is
    refused, in one line, before Ray or any report."""
    _, pipeline, _ = finished_benchmark
    missing = tmp_path / "elsewhere.db"
    args = ["benchmark", str(pipeline.path), flag, "--tracking-uri"]
    result = runner.invoke(app, [*args, f"sqlite:///{missing}"])
    assert result.exit_code == 2 and "elsewhere.db does not exist" in result.output, result.output
    assert not missing.exists()
    other = f"sqlite:///{tmp_path}/other.db"
    Tracker(other, "other-runs").start_run("unrelated")
    result = runner.invoke(app, [*args, other])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "has no run" in lines[0], result.output
