"""`dpivon train --checkpoint`: a long run killed mid-way resumes where it stopped, in the same
MLflow run, and ends exactly where the uninterrupted run ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from damaged_files import DAMAGED_CHECKPOINTS
from mlflow.tracking import MlflowClient

DPIVON = [sys.executable, "-m", "dpivon.cli"]
RUN = [
    "train",
    "--dataset",
    "synthetic",
    "--model",
    "small-cnn",
    "--optimizer",
    "dp-sgd",
    "--epsilon",
    "8",
    "--epochs",
    "3",
    "--batch-size",
    "64",
    "--research-mode",
    "--no-log-model",
    "--set",
    "data.synthetic_size=600",
]


def _train(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DPIVON, *RUN, *flags], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )


def _result(path) -> dict:
    result = json.loads(path.read_text())
    for key in ("wall_time_s", "mlflow_run_id"):
        result.pop(key)
    return result


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_checkpoint_and_ends_as_the_uninterrupted_one(tmp_path):
    whole = _train(tmp_path, "--json", "whole.json", "--tracking-uri", "sqlite:///whole.db")
    assert whole.returncode == 0, whole.stderr[-2000:]

    uri = "sqlite:///killed.db"
    flags = ["--checkpoint", "state.pt", "--json", "resumed.json", "--tracking-uri", uri]
    driver = subprocess.Popen(
        [*DPIVON, *RUN, *flags],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    for line in driver.stderr:  # the epoch line comes after the checkpoint is written
        if line.startswith("epoch 1/3") or time.monotonic() > deadline:
            break
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    assert (tmp_path / "state.pt").exists() and not (tmp_path / "resumed.json").exists()

    resumed = _train(tmp_path, *flags)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming run" in resumed.stderr and "after epoch 1 " in resumed.stderr
    # the same noise, batches and posterior draws as without the interruption
    assert _result(tmp_path / "resumed.json") == _result(tmp_path / "whole.json")

    client = MlflowClient(f"sqlite:///{tmp_path / 'killed.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("dpivon").experiment_id])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "val_accuracy")
    assert sorted(m.step for m in history) == [1, 2, 3]  # each epoch logged once

    # the same checkpoint into a store that lacks its run: a new run with the epochs replayed
    fresh = _train(tmp_path, *flags[:-1], "sqlite:///fresh.db")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert _result(tmp_path / "resumed.json") == _result(tmp_path / "whole.json")
    client = MlflowClient(f"sqlite:///{tmp_path / 'fresh.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("dpivon").experiment_id])
    history = client.get_metric_history(run.info.run_id, "val_accuracy")
    assert sorted(m.step for m in history) == [1, 2, 3]

    # a checkpoint of another configuration is refused, not resumed
    other = subprocess.run(
        [*DPIVON, *RUN[:-2], "--set", "data.synthetic_size=700", *flags],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert other.returncode == 2
    assert other.stderr.strip().splitlines()[-1].startswith("error: checkpoint state.pt is of")


# a checkpoint whose unpickling would run code: tests/test_input_errors.py


@pytest.mark.parametrize("case", DAMAGED_CHECKPOINTS)
def test_a_damaged_checkpoint_is_refused_in_one_line_naming_it_and_opens_no_run(tmp_path, case):
    content, reason = DAMAGED_CHECKPOINTS[case]
    (tmp_path / "ck.pt").write_bytes(content)
    ran = _train(tmp_path, "--checkpoint", "ck.pt")
    assert ran.returncode == 2, ran.stderr
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "ck.pt" in lines[0] and reason in lines[0], ran.stderr
    store = tmp_path / "mlflow.db"
    assert not store.exists() or not MlflowClient(f"sqlite:///{store}").search_runs(["0"])


@pytest.mark.slow
def test_a_sigtermed_run_ends_killed_in_one_line(tmp_path):
    """SIGTERM (a scheduler's stop, `kill`) stops `train` as Ctrl-C does: its MLflow run ends
    KILLED, not RUNNING, with one line and exit code 143."""
    at = RUN.index("--epochs")
    run = [*RUN[:at], "--epochs", "50", *RUN[at + 2 :], "--tracking-uri", "sqlite:///store.db"]
    driver = subprocess.Popen([*DPIVON, *run], cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 300
    for line in driver.stderr:  # the run is open once an epoch is logged
        if line.startswith("epoch 1/50") or time.monotonic() > deadline:
            break
    driver.send_signal(signal.SIGTERM)
    rest = driver.stderr.read()
    assert driver.wait(timeout=120) == 143, rest
    lines = [line for line in rest.splitlines() if line.strip() and not line.startswith("epoch")]
    assert lines == ["dpivon train interrupted by SIGTERM: a run in progress ended KILLED"], rest
    client = MlflowClient(f"sqlite:///{tmp_path / 'store.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("dpivon").experiment_id])
    assert run.info.status == "KILLED"
