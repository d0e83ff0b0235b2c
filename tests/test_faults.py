"""Faults during a sweep, each on real processes: a Ray worker node killed, the MLflow server
down for a while or until the end of the trials, a trial whose loss turns NaN."""

from __future__ import annotations

import sys
from pathlib import Path

import mlflow
import pytest
from conftest import wait_until
from mlflow.entities import Run
from sweep_helpers import REPO, runs_of, write_pipeline

DPIVON = [sys.executable, "-m", "dpivon.cli"]
DP_SGD = {"name": "dp-sgd", "space": str(REPO / "search_spaces/quickstart/dp-sgd.yaml")}
DP_ADAM = {"name": "dp-adam", "space": str(REPO / "search_spaces/quickstart/dp-adam.yaml")}
EXPERIMENT = "dpivon-smoke"


def _children(client: mlflow.MlflowClient) -> list[Run]:
    """The trials' runs recorded so far (none before the driver created the experiment)."""
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return []
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    return [r for r in runs if "mlflow.parentRunId" in r.data.tags]


def _epochs(client: mlflow.MlflowClient, run: Run) -> list[int]:
    """The epochs whose validation accuracy the run holds, one entry per record."""
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy"))


def _exited(driver) -> bool:
    return driver.poll() is not None


def _tail(log: Path) -> str:
    return log.read_text()[-3000:]


def _assert_every_trial_recorded_once(client, trials: int, epochs: int) -> list[Run]:
    children = _children(client)
    trial_ids = [c.data.tags["dpivon.trial_id"] for c in children]
    assert len(trial_ids) == len(set(trial_ids)) == trials
    for child in children:
        assert child.info.status == "FINISHED"
        assert child.data.tags["dpivon.trial_status"] == "completed"
        assert _epochs(client, child) == list(range(1, epochs + 1))  # none lost, none twice
    return children


@pytest.mark.slow
def test_trials_of_a_killed_worker_node_resume_on_the_other(tmp_path, ray_cluster, spawn):
    head = ray_cluster.start_head(num_cpus=1)
    worker = ray_cluster.add_worker(num_cpus=1)
    path = write_pipeline(
        tmp_path,
        name="node-loss",
        trials=2,
        concurrency=2,
        epochs=3,
        scheduler={"type": "none"},
        max_failures=2,
        optimizers=[DP_SGD],
    )
    driver, log = spawn(
        [*DPIVON, "sweep", path, "--address", ray_cluster.address], "driver", ray_cluster.env
    )
    client, _, _ = runs_of(tmp_path, EXPERIMENT)
    on_worker: list[Run] = []

    def checkpointed_on_worker() -> bool:
        # its first epoch reported (with a checkpoint) and training the second
        on_worker[:] = [
            c
            for c in _children(client)
            if c.data.tags.get("ray.node_id") == worker.node_id and "val_accuracy" in c.data.metrics
        ]
        return bool(on_worker)

    wait_until(checkpointed_on_worker, 400, "a trial's first epoch on the worker", driver)
    ray_cluster.kill(worker)
    wait_until(lambda: _exited(driver), 600, "the sweep after the node loss")
    assert driver.returncode == 0, _tail(log)
    children = _assert_every_trial_recorded_once(client, trials=2, epochs=3)
    (moved,) = [c for c in children if c.info.run_id == on_worker[0].info.run_id]
    assert moved.data.tags["ray.node_id"] == head.node_id  # finished on the remaining node


# Epochs of the outage sweeps' one trial: the server is stopped after the first is in MLflow,
# and the rest must still be running then (with 2, a loaded machine let the trial end first).
OUTAGE_EPOCHS = 4


def _outage_sweep(
    tmp_path, postgres, mlflow_servers, spawn, name: str, env: dict[str, str] | None = None
):
    """A one-trial sweep against an MLflow server, and the server once the trial's first
    epoch is in it (its later epochs and its end are still to be written)."""
    server = mlflow_servers(postgres, str(tmp_path / "artifacts"))
    path = write_pipeline(
        tmp_path,
        name=name,
        trials=1,
        concurrency=1,
        epochs=OUTAGE_EPOCHS,
        scheduler={"type": "none"},
        tracking_uri=None,
        optimizers=[DP_SGD],
    )
    command = [*DPIVON, "sweep", path, "--tracking-uri", server.uri]
    driver, log = spawn(command, "driver", env)
    client = mlflow.MlflowClient(server.uri)
    wait_until(
        lambda: any(_epochs(client, c) for c in _children(client)),
        400,
        "a first epoch in MLflow",
        driver,
    )
    return server, client, command, driver, log


@pytest.mark.slow
def test_results_wait_for_an_mlflow_server_that_comes_back(
    tmp_path, postgres, mlflow_servers, spawn
):
    server, client, _, driver, log = _outage_sweep(
        tmp_path, postgres, mlflow_servers, spawn, "outage"
    )
    server.stop()
    wait_until(
        lambda: "MLflow is unreachable" in log.read_text(),
        300,
        "the driver keeping results while MLflow is down",
        driver,
    )
    server.start()
    wait_until(lambda: _exited(driver), 600, "the sweep after the outage")
    assert driver.returncode == 0, _tail(log)
    assert "answers again" in log.read_text()
    _assert_every_trial_recorded_once(client, trials=1, epochs=OUTAGE_EPOCHS)


@pytest.mark.slow
def test_mlflow_down_to_the_end_stops_in_one_line_and_resume_writes_the_rest(
    tmp_path, postgres, mlflow_servers, spawn
):
    server, client, command, driver, log = _outage_sweep(
        tmp_path, postgres, mlflow_servers, spawn, "blackout", env={"DPIVON_TRACKING_WAIT_S": "5"}
    )
    server.stop()
    wait_until(lambda: _exited(driver), 600, "the sweep without MLflow")
    output = log.read_text()
    assert driver.returncode == 2, _tail(log)
    assert "Traceback" not in output
    last = output.strip().splitlines()[-1]
    assert "stayed unreachable" in last and "--resume" in last, last

    server.start()
    resumed, resumed_log = spawn([*command, "--resume"], "resumed")
    wait_until(lambda: _exited(resumed), 600, "the resumed sweep")
    assert resumed.returncode == 0, _tail(resumed_log)
    _assert_every_trial_recorded_once(client, trials=1, epochs=OUTAGE_EPOCHS)


@pytest.mark.slow
def test_a_diverging_trial_is_recorded_and_the_sweep_goes_on(tmp_path, spawn):
    # lr and clip norm at their bounds (1e6): steps of lr times noise of std about 1e4 make the
    # activations overflow within the first steps
    diverging = tmp_path / "diverging.yaml"
    diverging.write_text(
        "optimizer: dp-sgd\nparams:\n  lr: 1.0e6\n  max_grad_norm: 1.0e6\n  batch_size: 64\n"
    )
    path = write_pipeline(
        tmp_path,
        name="diverge",
        trials=1,
        concurrency=2,
        epochs=1,
        scheduler={"type": "none"},
        optimizers=[{"name": "dp-sgd", "space": str(diverging)}, DP_ADAM],
    )
    driver, log = spawn([*DPIVON, "sweep", path], "driver")
    wait_until(lambda: _exited(driver), 600, "the sweep")
    assert driver.returncode == 0, _tail(log)
    client, (parent,), children = runs_of(tmp_path, EXPERIMENT)
    assert parent.info.status == "FINISHED"
    trial_ids = [c.data.tags["dpivon.trial_id"] for c in children]
    assert len(trial_ids) == len(set(trial_ids)) == 2
    by_group: dict[str, list[Run]] = {}
    for child in children:
        by_group.setdefault(child.data.tags["dpivon.group"], []).append(child)
    (diverged,), (completed,) = by_group["eps8-dp-sgd"], by_group["eps8-dp-adam"]
    assert diverged.info.status == "FAILED"
    assert diverged.data.tags["dpivon.trial_status"] == "diverged"
    assert "diverged" in diverged.data.tags["error"] and "lr=1e+06" in diverged.data.tags["error"]
    assert diverged.data.metrics["diverged"] == 1
    assert "val_accuracy" not in diverged.data.metrics  # NaN is never recorded
    # ended, not retried from a checkpoint (max_failures 1): one record of it
    assert len(client.get_metric_history(diverged.info.run_id, "diverged")) == 1
    assert completed.info.status == "FINISHED"
    assert completed.data.tags["dpivon.trial_status"] == "completed"
    assert _epochs(client, completed) == [1]
    assert "diverged" in log.read_text()  # the progress line says so
