"""The deployment topology of docker/compose.yaml, without containers: PostgreSQL, an MLflow
server on it with its artifacts on an S3-compatible server, a Ray head and a worker as
`ray start` processes with token authentication, `dpivon sweep` submitted to them with its
state and checkpoints in the same S3 server, and `dpivon export` reading them back."""

from __future__ import annotations

import os
import subprocess
import sys

import mlflow
import pytest
import yaml
from sweep_helpers import REPO, write_pipeline

from dpivon.orchestration.storage import ResultsStorage

DPIVON = [sys.executable, "-m", "dpivon.cli"]
DP_SGD = str(REPO / "search_spaces/quickstart/dp-sgd.yaml")


@pytest.mark.slow
def test_sweep_on_a_cluster_with_a_tracking_server(
    tmp_path, s3, postgres, mlflow_servers, ray_cluster
):
    server = mlflow_servers(postgres, f"s3://{s3.bucket}/mlflow", env=s3.env)
    # the nodes get what the docker/ images get: the S3 endpoint and credentials
    head = ray_cluster.start_head(num_cpus=1, env=s3.env)
    worker = ray_cluster.add_worker(num_cpus=1, env=s3.env)
    storage_path = f"s3://{s3.bucket}/runs"  # no folder the nodes share: S3 only
    path = write_pipeline(
        tmp_path,
        name="topology",
        trials=2,
        concurrency=2,
        epochs=2,
        scheduler={"type": "none"},
        tracking_uri=None,
        storage_path=storage_path,
        optimizers=[{"name": "dp-sgd", "space": DP_SGD}],
    )
    env = {**os.environ, **ray_cluster.env, **s3.env}
    sweep = subprocess.run(
        [
            *DPIVON,
            "sweep",
            str(path),
            "--address",
            ray_cluster.address,
            "--tracking-uri",
            server.uri,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert sweep.returncode == 0, sweep.stderr[-3000:]

    client = mlflow.MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("dpivon-smoke")
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("dpivon.kind") == "sweep"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED"
    assert len(children) == 2
    for child in children:
        assert child.info.status == "FINISHED"
        assert child.data.tags["dpivon.trial_status"] == "completed"
        history = client.get_metric_history(child.info.run_id, "val_accuracy")
        assert [m.step for m in history] == [1, 2]
        assert {"val_ece", "epsilon_spent", "noise_multiplier"} <= set(child.data.metrics)
    # both nodes trained (one CPU each, two trials at once)
    assert {c.data.tags["ray.node_id"] for c in children} == {head.node_id, worker.node_id}
    # the parent's report and the front's models went through the server into the bucket
    keys = s3.keys("mlflow/")
    for report in ("pareto.png", "pareto.html", "trials.csv"):
        assert any(k.endswith(f"{parent.info.run_id}/artifacts/{report}") for k in keys), keys
    front = [c for c in children if c.data.tags.get("dpivon.pareto_optimal") == "true"]
    assert front
    models = client.search_logged_models(experiment_ids=[experiment.experiment_id])
    by_run = {m.source_run_id: m.model_id for m in models}
    for child in front:  # MLflow 3 keeps a run's logged model under models/<model id>/
        assert any(
            k.endswith(f"models/{by_run[child.info.run_id]}/artifacts/MLmodel") for k in keys
        ), keys
    assert not (tmp_path / "mlflow.db").exists()  # nothing went to a local store

    # the sweep's state, reports and checkpoints are in the bucket, and export reads them
    storage = ResultsStorage(storage_path, "topology")
    assert {"sweep.json", "trials.csv", "pareto_front.csv", "tuning_privacy.json"} <= set(
        storage.listdir()
    )
    for child in children:
        assert child.data.tags["dpivon.checkpoint"].startswith(f"{storage.uri}/")
    assert not (tmp_path / "runs").exists()
    export = subprocess.run(
        [*DPIVON, "export", storage.uri, "--pick", "pareto", "--out", str(tmp_path / "best.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert export.returncode == 0, export.stderr[-3000:]
    exported = yaml.safe_load((tmp_path / "best.yaml").read_text())
    exported = exported if isinstance(exported, list) else [exported]
    assert len(exported) == len(front)
    assert all(c["optimizer"]["name"] == "dp-sgd" for c in exported)
    assert all(c["privacy"]["tuning"]["sweep"] == "topology" for c in exported)
