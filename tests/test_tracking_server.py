"""The same commands against an MLflow tracking server backed by a real PostgreSQL."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import mlflow
import pytest
from sweep_helpers import REPO, write_pipeline
from typer.testing import CliRunner

from dpivon.cli import app

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url: str, process: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if process.poll() is not None:
            pytest.fail(f"server exited early: {process.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"{url} did not answer within {timeout_s} s")


@pytest.fixture(scope="module")
def postgres():
    """A throw-away PostgreSQL 15 cluster on a free loopback port (runs as user postgres)."""
    if not (PG_BIN / "initdb").exists():
        pytest.fail(f"PostgreSQL 15 is needed for this test ({PG_BIN}): apt-get install "
                    "postgresql-15")
    data = Path(tempfile.mkdtemp(prefix="dpivon-pg-"))
    shutil.chown(data, "postgres", "postgres")
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    port = _free_port()
    subprocess.run([*as_postgres, PG_BIN / "initdb", "-D", data / "db", "-A", "trust",
                    "-U", "postgres"], check=True, capture_output=True)
    subprocess.run([*as_postgres, PG_BIN / "pg_ctl", "-D", data / "db", "-w", "-l",
                    data / "log", "-o", f"-p {port} -k {data} -c listen_addresses=127.0.0.1",
                    "start"], check=True, capture_output=True)
    try:
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_postgres, PG_BIN / "pg_ctl", "-D", data / "db", "-m", "fast",
                        "stop"], capture_output=True)
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(scope="module")
def mlflow_server(postgres, tmp_path_factory):
    port = _free_port()
    artifacts = tmp_path_factory.mktemp("artifacts")
    server = subprocess.Popen(
        [Path(sys.executable).with_name("mlflow"), "server", "--host", "127.0.0.1",
         "--port", str(port), "--backend-store-uri", postgres,
         "--artifacts-destination", str(artifacts), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        _wait_for(f"{uri}/health", server)
        yield uri
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_train_and_sweep_against_a_tracking_server(mlflow_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, [
        "train", "--dataset", "synthetic", "--model", "small-cnn", "--optimizer",
        "dp-ivon-gradsq", "--epochs", "1", "--batch-size", "64", "--tracking-uri", mlflow_server,
    ])
    assert result.exit_code == 0, result.output
    path = write_pipeline(tmp_path, name="served", trials=2, scheduler={"type": "none"},
                          optimizers=[{"name": "dp-sgd", "space": str(
                              REPO / "search_spaces/quickstart/dp-sgd.yaml")}])
    sweep = subprocess.run(
        [sys.executable, "-m", "dpivon.cli", "sweep", str(path), "--tracking-uri",
         mlflow_server], capture_output=True, text=True, timeout=600,
    )
    assert sweep.returncode == 0, sweep.stderr[-3000:]

    client = mlflow.MlflowClient(mlflow_server)
    (train_run,) = client.search_runs([client.get_experiment_by_name("dpivon").experiment_id])
    assert train_run.info.status == "FINISHED" and "test_accuracy" in train_run.data.metrics
    runs = client.search_runs([client.get_experiment_by_name("dpivon-smoke").experiment_id])
    parents = [r for r in runs if r.data.tags.get("dpivon.kind") == "sweep"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2
    assert {"pareto.png", "pareto.html"} <= {a.path for a in
                                             client.list_artifacts(parents[0].info.run_id)}
    # Nothing went to a local SQLite store on the way.
    assert not (tmp_path / "mlflow.db").exists()


def test_no_credentials_in_output_state_or_store(postgres, tmp_path):
    """A password in the tracking URI reaches neither the console, nor the sweep's state
    and Tune files, nor the runs' params and tags (PostgreSQL trusts loopback here, so the
    password is accepted and ignored)."""
    secret = "hunter2-not-for-logs"
    port = postgres.rsplit(":", 1)[1].split("/")[0]
    # A database of its own: the server fixture's one keeps mlflow-artifacts: locations.
    subprocess.run([PG_BIN / "createdb", "-h", "127.0.0.1", "-p", port, "-U", "postgres",
                    "secrets"], check=True, capture_output=True)
    uri = postgres.replace("postgres@", f"postgres:{secret}@", 1).rsplit("/", 1)[0] + "/secrets"
    path = write_pipeline(tmp_path, name="secret", trials=1, scheduler={"type": "none"},
                          optimizers=[{"name": "dp-sgd", "space": str(
                              REPO / "search_spaces/quickstart/dp-sgd.yaml")}])
    sweep = subprocess.run(
        [sys.executable, "-m", "dpivon.cli", "sweep", str(path), "--tracking-uri", uri],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
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
