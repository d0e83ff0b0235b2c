"""Shared set-up for the sweep tests: the smoke pipeline, re-rooted in a temporary folder."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import mlflow
import yaml

from dpivon.search.pipeline import Pipeline

REPO = Path(__file__).resolve().parents[1]


def shipped_run_files(benchmarks: bool) -> list[Path]:
    """The shipped ``pipelines/*.yaml``: benchmark files (they list ``methods``) or sweep
    pipelines."""
    files = sorted((REPO / "pipelines").glob("*.yaml"))
    return [p for p in files if ("methods" in yaml.safe_load(p.read_text())) == benchmarks]


def write_pipeline(tmp_path: Path, name: str = "smoke", **overrides: Any) -> Path:
    """pipelines/smoke.yaml with its results and MLflow store under ``tmp_path``."""
    data = yaml.safe_load((REPO / "pipelines" / "smoke.yaml").read_text())
    data["optimizers"] = [
        {**entry, "space": str((REPO / "pipelines" / entry["space"]).resolve())}
        for entry in data["optimizers"]
    ]
    data.update(
        name=name,
        storage_path=str(tmp_path / "runs"),
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
    )
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
    return Path(pipeline.storage.path)


PLOTS = (".png", ".html")  # rendered again by a resume; not compared byte for byte


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` but the plots, by relative path."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.suffix not in PLOTS
    }


def store_snapshot(tmp_path: Path, experiment: str, results: Path) -> dict[str, Any]:
    """Everything a sweep or benchmark left under ``tmp_path``: the result folder's files,
    and in MLflow every run's status, tags, params and whole metric histories (so a value
    logged twice shows), the artifact files, the logged models."""
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    found = client.get_experiment_by_name(experiment)
    runs = {}
    for run in client.search_runs([found.experiment_id], max_results=1000):
        histories = {
            key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
            for key in run.data.metrics
        }
        runs[run.info.run_id] = (run.info.status, run.data.tags, run.data.params, histories)
    models = sorted(
        (m.model_id, m.source_run_id, m.name, str(m.status))
        for m in client.search_logged_models([found.experiment_id])
    )
    return {
        "results": file_hashes(results),
        "artifacts": file_hashes(tmp_path / "mlartifacts"),
        "runs": runs,
        "models": models,
    }
