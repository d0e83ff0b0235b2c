"""Sweep storage on a local disk and on a real S3-compatible server (moto, on loopback):
round trips, export from a sweep stored in S3, MLflow artifacts in the bucket."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import torch
import yaml

from dpivon.config import parse_config
from dpivon.errors import DpivonError
from dpivon.orchestration.storage import ResultsStorage, local_copy
from dpivon.privacy.tuning import SweepConditions, TrialMechanism
from dpivon.privacy.tuning_report import tuning_privacy_report
from dpivon.runs import train
from dpivon.search.export import export_configs, load_results, resolve_sweep, trial_config
from dpivon.search.sweep import SweepState
from dpivon.search.sweep_files import FRONT_FILE, TRIALS_FILE, TUNING_FILE
from dpivon.search.trial import MODEL_FILE
from dpivon.tracking.model_file import save_model_file


def _root(kind: str, tmp_path, s3, monkeypatch) -> str:
    """A storage_path of each kind this module checks."""
    if kind == "local":
        return str(tmp_path / "runs")
    if kind == "file-uri":
        return (tmp_path / "runs").as_uri()
    if kind == "s3-env":  # endpoint from AWS_ENDPOINT_URL
        return f"s3://{s3.bucket}/runs"
    # endpoint in the URI itself, none in the environment
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    host = s3.endpoint.removeprefix("http://")
    return f"s3://{s3.bucket}/runs?endpoint_override={host}&scheme=http"


@pytest.mark.parametrize("kind", ["local", "file-uri", "s3-env", "s3-query"])
def test_round_trip(kind, tmp_path, s3, monkeypatch):
    storage = ResultsStorage(_root(kind, tmp_path, s3, monkeypatch), "sweep")
    assert not storage.exists() and not storage.exists(SweepState.file_name)
    assert storage.listdir() == []
    storage.write_text(SweepState.file_name, '{"name": "sweep"}')
    storage.write_text(SweepState.file_name, '{"name": "sweep", "again": true}')  # replaces it
    storage.write_bytes("tune/trial_0/checkpoint_000001/model.pt", b"\x00weights")
    storage.write_bytes("tune/trial_0/checkpoint_000001/extra/meta", b"m")
    assert json.loads(storage.read_text(SweepState.file_name)) == {"name": "sweep", "again": True}
    assert storage.listdir() == [SweepState.file_name, "tune"]  # no temporary files left
    assert storage.listdir("tune/trial_0/checkpoint_000001") == ["extra", "model.pt"]
    assert storage.is_local == (kind in ("local", "file-uri"))

    # what Tune reports (a path on the filesystem) as a location that opens again
    checkpoint = storage.uri_of(f"{storage.experiment_path('tune')}/trial_0/checkpoint_000001")
    with local_copy(checkpoint) as local:
        assert (local / "model.pt").read_bytes() == b"\x00weights"
        assert (local / "extra" / "meta").read_bytes() == b"m"
    # ... and as the name the sweep's tables record, which opens again from the folder
    assert storage.name_of(checkpoint) == "tune/trial_0/checkpoint_000001"
    assert storage.location(storage.name_of(checkpoint)) == checkpoint
    with pytest.raises(DpivonError, match="is not in"):
        storage.name_of(ResultsStorage(storage.storage_path, "other").uri)
    # the same sweep, found from its folder, and after a round trip through pickle (Tune)
    for again in (ResultsStorage.at(storage.uri), pickle.loads(pickle.dumps(storage))):
        assert (again.uri, again.name) == (storage.uri, "sweep")
        assert again.read_bytes("tune/trial_0/checkpoint_000001/model.pt") == b"\x00weights"

    if kind.startswith("s3"):
        assert storage.uri.startswith(f"s3://{s3.bucket}/runs/sweep")
        assert "runs/sweep/sweep.json" in s3.keys("runs/")  # really in the bucket


def test_storage_errors_are_one_line(tmp_path, s3):
    with pytest.raises(DpivonError, match="holds credentials") as err:
        ResultsStorage("s3://key:secret@bucket/runs", "sweep")
    assert "secret" not in str(err.value)
    missing = ResultsStorage("s3://no-such-bucket/runs", "sweep")
    with pytest.raises(DpivonError, match="cannot write s3://no-such-bucket/runs/sweep/x") as err:
        missing.write_text("x", "y")
    assert "\n" not in str(err.value)
    with pytest.raises(DpivonError, match="not found"), local_copy(f"s3://{s3.bucket}/nothing"):
        pass
    with pytest.raises(DpivonError, match="no sweep found"):
        resolve_sweep(f"s3://{s3.bucket}/runs/absent")


def _trained_checkpoint(storage: ResultsStorage, trial: str, lr: float, tmp_path):
    """A real (one-epoch, synthetic) trial's final checkpoint, uploaded as Tune leaves it."""
    config = parse_config(
        {
            "dataset": "synthetic",
            "synthetic_size": 400,
            "val_size": 40,
            "model": "small-cnn",
            "optimizer": "dp-sgd",
            "epsilon": 8.0,
            "delta": 1e-5,
            "epochs": 1,
            "batch_size": 64,
            "lr": lr,
            "bma_samples": 2,
            "seed": len(trial),
        }
    )
    result = train(config, evaluate_test=False)
    local = tmp_path / f"{trial}.pt"
    save_model_file(local, config, result.model, result.posterior)
    folder = f"tune/{trial}/checkpoint_000000"
    storage.write_bytes(f"{folder}/{MODEL_FILE}", local.read_bytes())
    local.unlink()
    return config, result, folder  # as a sweep's tables name it: inside the sweep's folder


def test_export_reads_a_sweep_stored_in_s3(tmp_path, s3):
    """`dpivon export`'s path: the state, the tables, the tuning report and the trials'
    checkpoints all come from the bucket (nothing of the sweep is on the local disk)."""
    storage = ResultsStorage(f"s3://{s3.bucket}/runs", "remote")
    objectives = [("val_accuracy", "max"), ("val_ece", "min")]
    rows, mechanisms, configs = [], [], {}
    for trial, lr in (("t0", 0.5), ("t1", 2.0)):
        config, result, checkpoint = _trained_checkpoint(storage, trial, lr, tmp_path)
        summary = result.summary()
        mechanisms.append(
            TrialMechanism(summary["noise_multiplier"], summary["sample_rate"], summary["steps"])
        )
        configs[trial] = config
        rows.append(
            {
                "trial_id": trial,
                "run_id": f"run-{trial}",
                "group": "eps8-dp-sgd",
                "optimizer": "dp-sgd",
                "epsilon": 8.0,
                "status": "completed",
                "checkpoint": checkpoint,
                "val_accuracy": 0.5 + len(rows) / 10,
                "val_ece": 0.1 + len(rows) / 10,
            }
        )  # both on the front
    conditions = SweepConditions("fixed", 2.0, adaptive_sampler=True, adaptive_scheduler=False)
    report = tuning_privacy_report(mechanisms, 1e-5, conditions)
    SweepState("remote", "", "", "", "", objectives).save(storage)
    storage.write_text(TRIALS_FILE, pd.DataFrame(rows).to_csv(index=False))
    storage.write_text(FRONT_FILE, pd.DataFrame(rows).to_csv(index=False))
    storage.write_text(TUNING_FILE, json.dumps({"eps8-dp-sgd": report}))
    assert not list(tmp_path.rglob("*.pt"))

    pipeline = tmp_path / "remote.yaml"  # a pipeline naming the same storage finds it too
    pipeline.write_text(
        yaml.safe_dump(
            {
                "name": "remote",
                "epsilons": [8],
                "trials": 2,
                "storage_path": f"s3://{s3.bucket}/runs",
                "data": {"dataset": "synthetic", "synthetic_size": 400, "val_size": 40},
                "model": "small-cnn",
                "epochs": 1,
                "train": {"bma_samples": 2},
                "optimizers": [{"name": "dp-sgd", "space": str(tmp_path / "space.yaml")}],
            }
        )
    )
    (tmp_path / "space.yaml").write_text(
        "optimizer: dp-sgd\nparams:\n  lr: {type: float, low: 0.1, high: 5.0, log: true}\n"
    )
    for reference in (storage.uri, str(pipeline)):
        found = resolve_sweep(reference)
        assert found.uri == storage.uri
        picked = export_configs(found, objectives, "pareto", full_data=False)
        assert [row["trial_id"] for row, _ in picked] == ["t0", "t1"]
        for row, exported in picked:
            trained = configs[row["trial_id"]]
            assert trial_config(found, pd.Series(row)) == trained  # read back from the bucket
            assert exported.optimizer == trained.optimizer
            assert exported.privacy.epsilon == trained.privacy.epsilon == 8.0
            assert exported.privacy.tuning.sweep == "remote"
            assert exported.privacy.tuning.quoted_epsilon == report["quoted_epsilon"]


def test_mlflow_artifacts_go_to_the_bucket(tmp_path, s3, postgres, mlflow_servers):
    """An MLflow server with its artifacts in S3 (proxied, as docker/compose.yaml runs it):
    what a client logs lands in the bucket and reads back."""
    server = mlflow_servers(postgres, f"s3://{s3.bucket}/mlflow", env=s3.env)
    client = mlflow.MlflowClient(server.uri)
    experiment = client.create_experiment("artifacts")
    run = client.create_run(experiment).info.run_id
    weights = tmp_path / "weights.pt"
    torch.save({"w": torch.arange(4.0)}, weights)
    client.log_artifact(run, str(weights), "model")
    client.log_text(run, "front table", "pareto_front.csv")
    keys = s3.keys("mlflow/")
    assert any(k.endswith(f"{run}/artifacts/model/weights.pt") for k in keys), keys
    assert any(k.endswith(f"{run}/artifacts/pareto_front.csv") for k in keys), keys
    back = client.download_artifacts(run, "model/weights.pt", str(tmp_path / "back"))
    assert torch.equal(torch.load(back)["w"], torch.arange(4.0))
    table = client.download_artifacts(run, "pareto_front.csv", str(tmp_path / "back"))
    assert Path(table).read_text() == "front table"


def test_trial_ids_of_digits_only_read_back_as_text(tmp_path):
    """Tune's trial ids can be all digits: read as numbers, "06927759" would lose its zero
    and name no trial (the exported config's provenance, `tuned_by`)."""
    storage = ResultsStorage(str(tmp_path), "digits")
    rows = pd.DataFrame(
        [
            {
                "trial_id": "06927759",
                "run_id": "0123",
                "group": "eps8-dp-sgd",
                "optimizer": "dp-sgd",
                "epsilon": 8.0,
                "checkpoint": "trials/t",
            }
        ]
    )
    for name in (TRIALS_FILE, FRONT_FILE):
        storage.write_text(name, rows.to_csv(index=False))
    for table in load_results(storage):
        assert list(table["trial_id"]) == ["06927759"] and list(table["run_id"]) == ["0123"]
