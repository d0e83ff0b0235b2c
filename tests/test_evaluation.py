"""Evaluation at its cost: the plan (batch size, memory format, draws per call) changes how
the predictive is computed, never its value; per-epoch validation and the final test use
their own number of draws; the phases of a run are measured."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.config import parse_config
from dpivon.evaluation import (
    PLAN_CACHE_FILE,
    EvaluationPlan,
    Posterior,
    evaluate,
    evaluation_plan,
    predict_bma,
)
from dpivon.models import build_model
from dpivon.optim.dp_ivon import DPIVON
from dpivon.process import ALLOCATOR_ENV, environment_variable, keep_freed_memory
from dpivon.runs import PHASES, load_data, train

SMALL = {
    "dataset": "synthetic",
    "synthetic_size": 300,
    "model": "small-cnn",
    "batch_size": 64,
    "optimizer": "dp-ivon-gradsq",
}


def _wide_posterior(model: torch.nn.Module) -> Posterior:
    hess = {name: torch.rand_like(p) for name, p in model.named_parameters()}
    return Posterior(hess, ess=300.0, weight_decay=1e-4)


def test_batched_draws_give_the_loops_predictive():
    """What the GPU path runs (several draws in one vmapped call) on the CPU: the same draws,
    the same sum, equal probabilities; also when the draws do not fill the last call."""
    torch.manual_seed(0)
    model = build_model("small-cnn")
    posterior, images = _wide_posterior(model), torch.randn(45, 3, 32, 32)

    def bma(**plan):
        generator = torch.Generator().manual_seed(3)
        return predict_bma(model, posterior, images, 5, generator=generator, **plan)

    loop = bma(batch_size=16, draws_per_call=1)
    for plan in ({"batch_size": 16, "draws_per_call": 2}, {"batch_size": 45, "draws_per_call": 5}):
        torch.testing.assert_close(bma(**plan), loop, rtol=1e-5, atol=1e-6)
    other_seed = predict_bma(model, posterior, images, 5, generator=torch.Generator())
    assert not torch.allclose(other_seed, loop)  # the draws matter: equality is no accident


def test_the_plan_is_measured_once_per_machine_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("DPIVON_CACHE", str(tmp_path))
    model = build_model("small-cnn")
    plan = evaluation_plan(model)
    assert plan.batch_size >= 1 and plan.draws_per_call >= 1
    stored = json.loads((tmp_path / PLAN_CACHE_FILE).read_text())
    ((key, entry),) = stored.items()
    assert "SmallCNN" in key and entry["images_per_s"] > 0
    # another process on this machine reads the file instead of measuring again
    entry["plan"] = {"batch_size": 7, "channels_last": True, "draws_per_call": 1}
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    (elsewhere / PLAN_CACHE_FILE).write_text(json.dumps({key: entry}))
    monkeypatch.setenv("DPIVON_CACHE", str(elsewhere))
    assert evaluation_plan(model) == EvaluationPlan(7, True, 1)
    # the channels-last layout changes how the predictive is computed, not its value
    posterior, images = _wide_posterior(model), torch.randn(20, 3, 32, 32)

    def bma():
        generator = torch.Generator().manual_seed(3)
        return predict_bma(model, posterior, images, 3, generator=generator)

    channels_last = bma()
    entry["plan"]["channels_last"] = False
    contiguous_dir = tmp_path / "contiguous"
    contiguous_dir.mkdir()
    (contiguous_dir / PLAN_CACHE_FILE).write_text(json.dumps({key: entry}))
    monkeypatch.setenv("DPIVON_CACHE", str(contiguous_dir))
    assert evaluation_plan(model) == EvaluationPlan(7, False, 1)
    torch.testing.assert_close(bma(), channels_last, rtol=1e-5, atol=1e-6)


def test_measuring_a_plan_draws_nothing_from_the_global_generator(tmp_path, monkeypatch):
    """A run that measures the plan (the first on a machine) trains like one that reads it
    from the cache: the measurement leaves torch's global generator where it was."""
    monkeypatch.setenv("DPIVON_CACHE", str(tmp_path))
    model = build_model("small-cnn")
    torch.manual_seed(11)
    before = torch.get_rng_state()
    evaluation_plan(model)
    assert (tmp_path / PLAN_CACHE_FILE).exists()  # it did measure
    assert torch.equal(torch.get_rng_state(), before)


def test_validation_uses_val_bma_samples_and_the_test_bma_samples():
    config = parse_config({**SMALL, "epochs": 1, "val_bma_samples": 1, "bma_samples": 3})
    data = load_data(config)
    result = train(config, data=data)

    def scores(split, draws):
        return evaluate(
            result.model,
            split,
            posterior=result.posterior,
            bma_samples=draws,
            n_bins=config.evaluation.ece_bins,
            seed=config.runtime.seed,
        ).metrics

    assert result.val == pytest.approx(scores(data.val, 1), rel=1e-6)
    assert result.test == pytest.approx(scores(data.test, 3), rel=1e-6)
    assert result.val["nll"] != pytest.approx(scores(data.val, 3)["nll"], rel=1e-6)
    assert result.history[-1]["val_ece"] == result.val["ece"]
    # curvature_update_share: the mean over the tracked steps (every tenth), a number
    assert math.isfinite(result.history[-1]["curvature_update_share"])


def test_untracked_update_share_changes_nothing_but_the_diagnostic():
    runs = []
    for track in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = DPIVON(model.parameters(), lr=0.1, ess=100.0, grad_noise_std=0.01,
                     hess_approx="gradsq", beta2=0.5)  # fmt: skip
        opt.track_update_share = track
        torch.manual_seed(1)
        for _ in range(3):
            with opt.sampled_params(train=True):
                for p in model.parameters():
                    p.grad = torch.randn_like(p)
            opt.step()
        runs.append((model, opt))
    (tracked_model, tracked), (model, untracked) = runs
    for a, b in zip(tracked_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert tracked.curvature_update_share > 0
    assert "curvature_update_share" in tracked.step_diagnostics
    assert math.isnan(untracked.curvature_update_share)
    assert "curvature_update_share" not in untracked.step_diagnostics


def test_profile_prints_every_phase_and_adds_them_to_the_json(tmp_path):
    out = tmp_path / "out.json"
    result = CliRunner().invoke(app, [
        "train", "--dataset", "synthetic", "--set", "synthetic_size=300", "--model", "small-cnn",
        "--batch-size", "64", "--epochs", "1", "--bma-samples", "2", "--val-bma-samples", "1",
        "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--no-log-model", "--profile",
        "--json", str(out),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "where the run's time went" in result.output
    summary = json.loads(out.read_text())
    seconds = {phase: summary[f"profile_{phase}_s"] for phase in PHASES}
    for phase in ("data", "setup", "train", "validation", "diagnostics", "logging", "test"):
        assert seconds[phase] > 0, phase
    assert seconds["checkpoint"] == 0  # `dpivon train` builds no resumable checkpoint
    assert sum(seconds.values()) <= summary["wall_time_s"] + seconds["data"] + seconds["logging"]


def test_the_allocator_setting_applies_on_glibc():
    assert keep_freed_memory()  # this machine's libc is glibc: mallopt accepts both settings


@pytest.mark.parametrize(
    ("setting", "on_jemalloc", "kept"),
    [(None, True, True), ("jemalloc", True, True), ("keep-freed", False, True),
     ("glibc", False, False)],
)  # fmt: skip
def test_the_allocator_asked_for_runs_and_keeps_freed_memory_or_not(setting, on_jemalloc, kept):
    # A process started as the `dpivon` command starts (restart on jemalloc, then the
    # process settings) frees 400 MB it wrote: jemalloc (the default) and glibc told to
    # keep freed memory keep it resident for the next step; glibc's defaults unmap it.
    script = (
        "import torch\n"
        "from dpivon.process import configure_process, jemalloc_loaded, preload_jemalloc\n"
        "preload_jemalloc()\n"
        "configure_process()\n"
        "def resident(): return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "before = resident()\n"
        "x = torch.ones(100_000_000)\n"
        "del x\n"
        "print(jemalloc_loaded(), (resident() - before) / 2**20)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (ALLOCATOR_ENV, "LD_PRELOAD")}
    if setting is not None:
        env[ALLOCATOR_ENV] = setting
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    loaded, grown_mb = out.stdout.split()
    assert loaded == str(on_jemalloc)
    assert (float(grown_mb) > 300) == kept, grown_mb


def test_an_unknown_allocator_is_one_line_and_exit_2():
    env = dict(os.environ, **{ALLOCATOR_ENV: "tcmalloc"})
    out = subprocess.run(
        [sys.executable, "-m", "dpivon.cli", "--help"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "error: DPIVON_ALLOCATOR must be one of jemalloc, keep-freed, glibc, got 'tcmalloc'"
    ]


@pytest.mark.parametrize("before", [None, "the caller's"])
def test_an_environment_variable_a_call_sets_is_as_it_was_after_it(monkeypatch, before):
    name = "DPIVON_TEST_VARIABLE"
    if before is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, before)
    with pytest.raises(KeyboardInterrupt), environment_variable(name, "inside"):
        assert os.environ[name] == "inside"
        raise KeyboardInterrupt  # restored however the block ends
    assert os.environ.get(name) == before
