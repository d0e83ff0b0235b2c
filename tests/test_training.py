"""The training function and the `dpivon train` CLI, end to end on synthetic data."""

from __future__ import annotations

import json
import random

import mlflow
import numpy as np
import pytest
import torch
import yaml
from fault_injection import InjectedFailure, fail_after
from typer.testing import CliRunner

from dpivon import runs
from dpivon.cli import app
from dpivon.config import OPTIMIZER_NAMES, parse_config
from dpivon.data import CIFAR10_CLASSES
from dpivon.errors import DpivonError
from dpivon.models import build_model
from dpivon.optim.registry import OPTIMIZERS
from dpivon.runs import TrainingDiverged, load_data, train

SMALL = {
    "dataset": "synthetic",
    "synthetic_size": 600,
    "model": "small-cnn",
    "batch_size": 64,
    "bma_samples": 4,
}
REQUIRED_KEYS = {
    "optimizer",
    "target_epsilon",
    "epsilon_spent",
    "delta",
    "accountant",
    "noise_multiplier",
    "sample_rate",
    "steps",
    "max_grad_norm",
    "batch_size",
    "val_accuracy",
    "val_ece",
    "test_accuracy",
    "test_nll",
    "test_ece",
    "test_brier",
    "mlflow_run_id",
}
runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=True)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One MLflow store for the module's runs that can share one: its migrations cost more
    than a tiny run."""
    return f"sqlite:///{tmp_path_factory.mktemp('store')}/mlflow.db"


def small_flags(
    tmp_path, size: int = SMALL["synthetic_size"], store: str | None = None
) -> list[str]:
    """`dpivon train`'s flags for SMALL's data and model, logging into ``store`` (default: a
    new one in ``tmp_path``)."""
    return [
        "--dataset",
        "synthetic",
        "--set",
        f"synthetic_size={size}",
        "--model",
        "small-cnn",
        "--batch-size",
        "64",
        "--bma-samples",
        "4",
        "--tracking-uri",
        store or f"sqlite:///{tmp_path}/mlflow.db",
    ]


@pytest.mark.parametrize("optimizer", OPTIMIZER_NAMES)
def test_cli_trains_every_optimizer(tmp_path, store, optimizer):
    out = tmp_path / "out.json"
    budget = ["--epsilon", "8"] if OPTIMIZERS[optimizer].private else []  # else inf
    result = cli(
        "train",
        *small_flags(tmp_path, store=store),
        "--optimizer",
        optimizer,
        *budget,
        "--delta",
        "1e-5",
        "--epochs",
        "1",
        "--json",
        str(out),
        "--no-log-model",
        "--checkpoint",
        str(tmp_path / "run.ckpt"),
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert summary.keys() >= REQUIRED_KEYS
    assert summary["optimizer"] == optimizer
    # Every weight tensor left its initialisation (the seed-0 model the run started from).
    runs.seed_everything(0)
    initial = build_model("small-cnn").state_dict()
    trained = torch.load(tmp_path / "run.ckpt", weights_only=False)["training"]["model"]
    unmoved = [name for name, p in initial.items() if torch.equal(trained[name], p)]
    assert trained.keys() == initial.keys() and not unmoved, f"weights that did not move: {unmoved}"
    client = mlflow.MlflowClient(store)
    run = client.get_run(summary["mlflow_run_id"])
    # Values, not ranges: accuracy is a count over the synthetic test images, and what
    # MLflow holds is what the run printed.
    n_test = len(load_data(parse_config(SMALL)).test)
    correct = summary["test_accuracy"] * n_test
    assert correct == pytest.approx(round(correct), abs=1e-6)
    for key in ("test_accuracy", "test_ece", "test_nll", "test_brier"):
        assert run.data.metrics[key] == pytest.approx(summary[key], rel=1e-12)
    assert run.info.status == "FINISHED"
    assert run.data.params["optimizer"] == optimizer
    assert "val_accuracy" in run.data.metrics
    if optimizer.startswith("dp-"):
        assert 8.0 - 0.05 <= summary["epsilon_spent"] <= 8.0
        assert summary["noise_multiplier"] > 0
        assert float(run.data.params["noise_multiplier"]) == summary["noise_multiplier"]
        assert len(client.get_metric_history(run.info.run_id, "epsilon_spent")) == 1
    else:
        assert summary["epsilon_spent"] is None and summary["noise_multiplier"] == 0.0
        assert run.data.params["epsilon"] == "inf"  # no claim that nothing backs


def test_logged_model_reproduces_bma_predictions(tmp_path):
    out = tmp_path / "out.json"
    result = cli(
        "train",
        *small_flags(tmp_path),
        "--optimizer",
        "dp-ivon-gradsq",
        "--epochs",
        "2",
        "--json",
        str(out),
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    model = mlflow.pyfunc.load_model(f"runs:/{summary['mlflow_run_id']}/model")
    data = load_data(parse_config(SMALL))
    images, labels = data.test.tensors
    # the training tensors are CIFAR-normalised already (raw images: tests/test_serving.py)
    rows = model.predict(images.numpy(), params={"cifar_normalised": True})
    accuracy = float((rows["class"].to_numpy() == labels.numpy()).mean())
    assert accuracy == pytest.approx(summary["test_accuracy"], abs=1e-9)
    # BMA differs from the mean prediction: the posterior really is in the model.
    mean = model.predict(images.numpy(), params={"bma_samples": 0, "cifar_normalised": True})
    probs = [f"prob_{name}" for name in CIFAR10_CLASSES]
    assert not np.allclose(rows[probs].to_numpy(), mean[probs].to_numpy())


def test_training_is_reproducible_and_resumable():
    # research mode: the noise follows the seed, so two runs agree
    config = parse_config(
        {**SMALL, "optimizer": "dp-ivon-gradsq", "epochs": 2, "research_mode": True}
    )
    data = load_data(config)
    full = train(config, data=data, evaluate_test=False)
    again = train(config, data=data, evaluate_test=False)
    assert full.val == again.val

    saved = {}

    def keep(report):
        saved[report.epoch] = report.checkpoint()

    with pytest.raises(InjectedFailure):
        train(config, data=data, on_epoch_end=fail_after(1, keep), evaluate_test=False)
    resumed = train(config, data=data, resume_state=saved[1], evaluate_test=False)
    assert resumed.steps == full.steps
    assert resumed.epsilon_spent == pytest.approx(full.epsilon_spent)
    for name, p in full.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], p)
    assert resumed.val == pytest.approx(full.val)


def _global_generator_states() -> tuple:
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()


def test_a_run_leaves_its_callers_global_generators_as_they_were():
    config = parse_config(
        {**SMALL, "optimizer": "dp-ivon-gradsq", "research_mode": True, "epochs": 1}
    )
    data = load_data(config)
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    before = _global_generator_states()
    first = train(config, data=data, evaluate_test=False)
    after = _global_generator_states()
    assert after[:2] == before[:2] and torch.equal(after[2], before[2])
    # ... however it ends, and what the caller drew before does not change the run
    torch.rand(5), np.random.rand(5), random.random()
    before = _global_generator_states()
    with pytest.raises(InjectedFailure):
        train(config, data=data, on_epoch_end=fail_after(1))
    after = _global_generator_states()
    assert after[:2] == before[:2] and torch.equal(after[2], before[2])
    assert train(config, data=data, evaluate_test=False).val == first.val


def test_a_train_checkpoint_of_layout_1_reads_back_releasable_and_resumes(tmp_path):
    """`dpivon train --checkpoint` wrote the whole state before every driver shared one
    format, the noise key and the raw training loss with it: such a file reads back as
    today's checkpoint without either, and the run continues from it."""
    config = parse_config({**SMALL, "optimizer": "dp-sgd", "epochs": 2})
    data = load_data(config)
    saved = {}

    def keep(report):
        saved[report.epoch] = report.checkpoint()

    with pytest.raises(InjectedFailure):
        train(config, data=data, on_epoch_end=fail_after(1, keep), evaluate_test=False)
    state = saved[1]
    assert "key" in state["rng"]["randomness"] and "train_loss" in state["history"][0]
    path = tmp_path / "old.ckpt"
    torch.save({"config": config.flat(), "mlflow_run_id": "abc", "training": state}, path)
    checkpoint = runs.RunCheckpoint.load(path, config)
    assert checkpoint.epoch == 1 and checkpoint.mlflow_run_id == "abc"
    assert "key" not in checkpoint.training["rng"]["randomness"]
    assert "train_loss" not in checkpoint.training["history"][0]
    resumed = train(config, data=data, resume_state=checkpoint.training, evaluate_test=False)
    assert [m["epoch"] for m in resumed.history] == [1, 2]
    with pytest.raises(DpivonError, match="another run configuration"):
        runs.RunCheckpoint.load(path, config.replace(lr=config.optimizer.lr * 2))


def test_failed_run_is_marked_failed(tmp_path, monkeypatch):
    config = tmp_path / "fail.yaml"
    config.write_text(yaml.safe_dump({**SMALL, "optimizer": "dp-sgd", "epochs": 2}))
    real_train = runs.train

    def failing_train(*args, on_epoch_end=None, **kwargs):
        return real_train(*args, on_epoch_end=fail_after(1, on_epoch_end), **kwargs)

    monkeypatch.setattr(runs, "train", failing_train)
    result = cli(
        "train", "--config", str(config), "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"
    )
    assert result.exit_code != 0
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs(client.get_experiment_by_name("dpivon").experiment_id)
    assert run.info.status == "FAILED"
    assert "InjectedFailure" in run.data.tags["error"]
    assert len(client.get_metric_history(run.info.run_id, "val_accuracy")) == 1


def _bad_layout(tmp_path):
    (tmp_path / "notcifar" / "train").mkdir(parents=True)
    return str(tmp_path / "notcifar")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--epsilon", "0"], "epsilon must be > 0"),
        (["--epsilon", "-1"], "epsilon must be > 0"),
        (["--delta", "1.5"], "delta must be in (0, 1)"),
        (["--delta", "0.01"], "1/N"),
        (["--batch-size", "0"], "batch_size must be >= 1"),
        (["--batch-size", "100000"], "larger than the training set"),
        (["--optimizer", "dp-lion"], "unknown optimizer 'dp-lion'"),
        (["--model", "resnet-9000"], "unknown model 'resnet-9000'"),
        (["--epsilon", "1e-9", "--epochs", "50"], "smallest the rdp accountant reaches"),
        (["--device", "tpu"], "device must be auto, cpu, cuda"),
        (["--seed", "-1"], "seed must be in [0, 2**32)"),
        (["--weight-decay", "-0.1"], "weight_decay must be in [0, 1e+06]"),
        (["--experiment", " "], "--experiment must not be empty"),
        (["--json", "/proc/dpivon.json"], "--json /proc/dpivon.json cannot be written"),
    ],
)
def test_bad_input_gives_one_clear_line(tmp_path, args, message):
    result = cli("train", *small_flags(tmp_path), "--optimizer", "dp-sgd", "--epochs", "1", *args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert message in result.output
    assert result.output.strip().startswith("error:") or "error:" in result.output


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"optimizer": "dp-sgd", "learning_rate": 0.1}, "learning_rate: unknown key"),
        ({"optimizer": "dp-sgd", "lr": "fast"}, "lr: must be a number"),
        ({"optimizer": "dp-sgd", "epochs": [1, 2]}, "epochs"),
        ({"optimizer": "dp-sgd", "epsilon": True}, "epsilon takes no boolean"),
    ],
)
def test_bad_yaml_config(tmp_path, config, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    result = cli("train", "--config", str(path))
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_malformed_yaml_and_missing_paths(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("optimizer: [dp-sgd\n")
    result = cli("train", "--config", str(path))
    assert result.exit_code == 2 and "not valid YAML" in result.output
    result = cli("train", "--config", str(tmp_path / "absent.yaml"))
    assert result.exit_code == 2 and "file not found" in result.output
    result = cli("train", "--dataset", "cifar10", "--data-path", str(tmp_path / "nowhere.tgz"))
    assert result.exit_code == 2 and "nowhere.tgz" in result.output
    result = cli("train", "--dataset", "cifar10", "--data-path", _bad_layout(tmp_path))
    assert result.exit_code == 2 and "notcifar" in result.output


def test_unreachable_tracking_server(tmp_path):
    result = cli(
        "train",
        "--dataset",
        "synthetic",
        "--model",
        "small-cnn",
        "--tracking-uri",
        "http://127.0.0.1:9",
    )
    assert result.exit_code == 2
    assert "cannot reach the MLflow tracking server" in result.output


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--optimizer", "sgd", "--epsilon", "8"], "sgd is not private"),
        (["--max-grad-norm", "inf"], "max_grad_norm must be a finite number in (0, 1e+06]"),
        (["--lr", "inf"], "lr must be a finite number in (0, 1e+06]"),
    ],
)
def test_what_cannot_be_private_is_refused_before_anything_starts(tmp_path, flags, expected):
    """No clipping (unbounded sensitivity), an infinite step, or a budget without noise:
    one line, exit 2, and no MLflow store is even created."""
    result = cli("train", *small_flags(tmp_path), *flags)
    assert result.exit_code == 2, result.output
    assert expected in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "mlflow.db").exists()


def _train(tmp_path, store: str, *flags: str):
    """`dpivon train` on tiny data into ``store``; its exit code and its logged run."""
    out = tmp_path / "out.json"
    # one epoch on 180 synthetic images: seconds
    result = cli("train", *small_flags(tmp_path, size=200, store=store), "--epochs", "1", *flags,
                 "--no-log-model", "--json", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    run_id = json.loads(out.read_text())["mlflow_run_id"]
    return result, mlflow.MlflowClient(store).get_run(run_id)


def test_a_non_private_run_is_logged_at_epsilon_inf(tmp_path, store):
    _, run = _train(tmp_path, store, "--optimizer", "sgd")
    assert run.data.params["epsilon"] == "inf" and run.info.run_name == "sgd-epsinf"


@pytest.mark.parametrize("asked", [False, True])
def test_a_private_run_logs_its_raw_training_loss_only_when_asked(tmp_path, store, asked):
    flags = ["--log-train-loss"] if asked else []
    result, run = _train(tmp_path, store, "--optimizer", "dp-sgd", *flags)
    assert ("train_loss" in run.data.metrics) == asked
    assert ("dpivon.not_covered" in run.data.tags) == asked
    assert ("train_loss=" in result.output) == asked
    assert ("does not cover it" in result.output) == asked


def test_divergence_is_seen_in_the_parameters_not_the_raw_loss():
    config = parse_config(
        {
            "dataset": "synthetic",
            "synthetic_size": 200,
            "model": "small-cnn",
            "optimizer": "dp-sgd",
            "lr": 1e6,
            "max_grad_norm": 1e6,
            "batch_size": 32,
            "epochs": 1,
            "bma_samples": 0,
        }
    )  # fmt: skip  (steps of lr times noise of std about 3e4: the activations overflow)
    with pytest.raises(TrainingDiverged, match="parameters are no longer finite") as info:
        train(config)
    assert set(info.value.privacy) == {"noise_multiplier", "sample_rate", "steps"}


def test_config_rejects_contradicting_estimator():
    with pytest.raises(DpivonError, match="gradsq estimator"):
        parse_config({"optimizer": "dp-ivon-gradsq", "hess_approx": "price"})
