"""Shared set-up for the sweep tests: the smoke pipeline, re-rooted in a temporary folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow
import yaml

from dpivon.search.pipeline import Pipeline
from dpivon.search.sweep import sweep_storage

REPO = Path(__file__).resolve().parents[1]


def write_pipeline(tmp_path: Path, name: str = "smoke", **overrides: Any) -> Path:
    """pipelines/smoke.yaml with its results and MLflow store under ``tmp_path``."""
    data = yaml.safe_load((REPO / "pipelines" / "smoke.yaml").read_text())
    data["optimizers"] = [
        {**entry, "space": str((REPO / "pipelines" / entry["space"]).resolve())}
        for entry in data["optimizers"]
    ]
    data.update(name=name, storage_path=str(tmp_path / "runs"),
                tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    data.update(overrides)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def runs_of(tmp_path: Path, experiment: str) -> tuple[mlflow.MlflowClient, list, list]:
    """(client, parent runs, child runs) of an experiment in the temporary store."""
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id], max_results=1000) if found else []
    parents = [r for r in runs if r.data.tags.get("dpivon.kind") == "sweep"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


def sweep_folder(pipeline: Pipeline) -> Path:
    """The local folder of a sweep of :func:`write_pipeline`."""
    return Path(sweep_storage(pipeline).path)
