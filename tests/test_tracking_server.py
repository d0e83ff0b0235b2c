"""Training against an MLflow tracking server backed by a real PostgreSQL, and no password of
a tracking URI anywhere."""

from __future__ import annotations

import subprocess
import sys

import mlflow
from sweep_helpers import REPO, write_pipeline
from typer.testing import CliRunner

from dpivon.cli import app


def test_train_against_a_tracking_server(postgres, mlflow_servers, tmp_path, monkeypatch):
    """`dpivon train` logs to the server (sweeps against one: tests/test_topology.py)."""
    mlflow_server = mlflow_servers(postgres, str(tmp_path / "artifacts")).uri
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--dataset",
            "synthetic",
            "--model",
            "small-cnn",
            "--optimizer",
            "dp-ivon-gradsq",
            "--epochs",
            "1",
            "--batch-size",
            "64",
            "--tracking-uri",
            mlflow_server,
        ],
    )
    assert result.exit_code == 0, result.output
    client = mlflow.MlflowClient(mlflow_server)
    (train_run,) = client.search_runs([client.get_experiment_by_name("dpivon").experiment_id])
    assert train_run.info.status == "FINISHED" and "test_accuracy" in train_run.data.metrics
    assert "config.yaml" in {a.path for a in client.list_artifacts(train_run.info.run_id)}
    # Nothing went to a local SQLite store on the way.
    assert not (tmp_path / "mlflow.db").exists()


def test_no_credentials_in_output_state_or_store(postgres, tmp_path):
    """A password in the tracking URI reaches neither the console, nor the sweep's state
    and Tune files, nor the runs' params and tags (PostgreSQL trusts loopback here, so the
    password is accepted and ignored)."""
    secret = "hunter2-not-for-logs"
    uri = postgres.replace("postgres@", f"postgres:{secret}@", 1)
    path = write_pipeline(
        tmp_path,
        name="secret",
        trials=1,
        scheduler={"type": "none"},
        optimizers=[
            {"name": "dp-sgd", "space": str(REPO / "search_spaces/quickstart/dp-sgd.yaml")}
        ],
    )
    sweep = subprocess.run(
        [sys.executable, "-m", "dpivon.cli", "sweep", str(path), "--tracking-uri", uri],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert secret not in sweep.stdout + sweep.stderr
    assert "postgres:***@" in sweep.stderr  # the URI is shown, redacted
    for file in (tmp_path / "runs").rglob("*"):
        if file.is_file():
            assert secret.encode() not in file.read_bytes(), file
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("dpivon-smoke").experiment_id])
    assert len(runs) == 2
    for run in runs:
        assert secret not in repr((run.data.params, run.data.tags, run.data.metrics))
