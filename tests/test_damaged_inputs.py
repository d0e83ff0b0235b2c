"""`dpivon export` on a sweep folder whose state, table or model file is damaged, and `dpivon
sweep --resume` on one whose trial checkpoint is: one line naming the file, exit 2, no run
(the readers' contract; `train --checkpoint`'s and the benchmark's cases are in
test_train_checkpoint.py and test_benchmark.py)."""

from __future__ import annotations

import json
import os
import pickle

import pytest
from damaged_files import DAMAGED_CHECKPOINTS, SHAPED_TRAINING_STATE, torch_bytes
from sweep_helpers import write_pipeline
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.config import TrainConfig, parse_config
from dpivon.errors import DpivonError
from dpivon.models import build_model
from dpivon.orchestration.storage import ResultsStorage
from dpivon.runs import RunCheckpoint
from dpivon.search.groups import sweep_groups
from dpivon.search.pipeline import load_pipeline
from dpivon.search.results import group_name
from dpivon.search.sweep import TUNE_EXPERIMENT, SweepState, _check_resume_files
from dpivon.search.sweep_files import FRONT_FILE, TRIALS_FILE
from dpivon.search.trial import MODEL_FILE, RESUME_FILE
from dpivon.tracking.model_file import save_model_file

COLUMNS = "trial_id,group,optimizer,epsilon,checkpoint,val_accuracy,val_ece"


def sweep_folder(tmp_path):
    """A finished sweep's folder as export reads it: state, tables, one trial's model."""
    folder = tmp_path / "sweep"
    (folder / "trials" / "t1").mkdir(parents=True)
    state = {
        "name": "s", "pipeline_path": "s.yaml", "tracking_uri": "sqlite:///m.db",
        "experiment": "s", "parent_run_id": "p",
        "objectives": [["val_accuracy", "max"], ["val_ece", "min"]],
    }  # fmt: skip
    (folder / "sweep.json").write_text(json.dumps(state))
    row = "t1,dp-sgd|8,dp-sgd,8.0,trials/t1,0.5,0.05"
    for table in (TRIALS_FILE, FRONT_FILE):
        (folder / table).write_text(f"{COLUMNS}\n{row}\n")
    config = TrainConfig(optimizer="dp-sgd", dataset="synthetic", model="small-cnn")
    save_model_file(folder / "trials" / "t1" / MODEL_FILE, config, build_model("small-cnn"), None)
    return folder


DAMAGES = {
    "state without objectives": ("sweep.json", lambda f: f.write_text(json.dumps(
        {**json.loads(f.read_text()), "objectives": []}))),
    "state not JSON": ("sweep.json", lambda f: f.write_bytes(os.urandom(64))),
    "table of random bytes": (TRIALS_FILE, lambda f: f.write_bytes(os.urandom(256))),
    "front without its checkpoint column": (FRONT_FILE, lambda f: f.write_text(
        f.read_text().replace(",checkpoint", "").replace(",trials/t1", ""))),
    "front without an objective": (FRONT_FILE, lambda f: f.write_text(
        f.read_text().replace(",val_ece", "").replace(",0.05", ""))),
    "model file of random bytes": (f"trials/t1/{MODEL_FILE}", lambda f: f.write_bytes(
        os.urandom(4096))),
}  # fmt: skip


@pytest.mark.parametrize("case", DAMAGES)
def test_export_names_the_damaged_file_of_a_sweep_folder(tmp_path, case):
    folder = sweep_folder(tmp_path)
    damaged, damage = DAMAGES[case]
    damage(folder / damaged)
    out = tmp_path / "best.yaml"
    result = CliRunner().invoke(app, ["export", str(folder), "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and os.path.basename(damaged) in lines[0], result.output
    assert "Traceback" not in result.output and not out.exists()


def interrupted_sweep(tmp_path):
    """A sweep whose driver was lost: its state, and where a trial's checkpoint lies."""
    pipeline = load_pipeline(write_pipeline(tmp_path))
    state = SweepState(
        name=pipeline.name, pipeline_path=str(pipeline.path), tracking_uri="sqlite:///x.db",
        experiment=pipeline.experiment, parent_run_id="p",
        objectives=[["val_accuracy", "max"], ["val_ece", "min"]],
        trial_epsilons={group_name(o, e): e for o, e in pipeline.groups},
    )  # fmt: skip
    state.save(pipeline.storage)
    return pipeline, f"{TUNE_EXPERIMENT}/trial_1/checkpoint_000000/{RESUME_FILE}"


@pytest.mark.parametrize("case", DAMAGED_CHECKPOINTS)
def test_sweep_resume_names_a_damaged_trial_checkpoint_before_mlflow_or_ray(tmp_path, case):
    content, reason = DAMAGED_CHECKPOINTS[case]
    pipeline, name = interrupted_sweep(tmp_path)
    pipeline.storage.write_bytes(name, content)
    result = CliRunner().invoke(app, ["sweep", str(pipeline.path), "--resume"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and reason in lines[0], result.output
    assert pipeline.storage.location(name) in lines[0]
    assert not (tmp_path / "mlflow.db").exists()  # no store opened, let alone a run


def test_a_trial_checkpoint_of_the_sweep_passes_the_resume_check(tmp_path):
    """Any searched values and seed of a group's trials: the check refuses only what is of
    no group (the trial itself checks its exact configuration when it resumes)."""
    pipeline, name = interrupted_sweep(tmp_path)
    counts = pipeline.trial_counts()
    groups = sweep_groups(pipeline, SweepState.load(pipeline.storage).trial_epsilons, counts)
    group = groups[-1]
    assert "lr" in group.space.names
    config = parse_config({**group.base_config, "seed": 12345, "lr": 0.0123})
    training = SHAPED_TRAINING_STATE
    pipeline.storage.write_bytes(name, RunCheckpoint(config.flat(), training).to_bytes())
    _check_resume_files(pipeline.storage, groups)
    changed = config.replace(epochs=config.training.epochs + 1)
    pipeline.storage.write_bytes(name, RunCheckpoint(changed.flat(), training).to_bytes())
    with pytest.raises(DpivonError, match="another run configuration than this sweep"):
        _check_resume_files(pipeline.storage, groups)
    # a trial's file of layout 1 (its bare releasable state) names no config: the trial
    # adopts its own when it resumes
    pipeline.storage.write_bytes(name, torch_bytes(training))
    _check_resume_files(pipeline.storage, groups)
    read = RunCheckpoint.read(pipeline.storage.read_bytes(name), name)
    assert read.check_config(config, name).config == config.flat() and read.epoch == 1


def test_a_sweep_started_before_the_rename_unpickles_its_storage(tmp_path):
    """Tune's saved state pickled the storage by its old class name, SweepStorage."""
    old = pickle.dumps(ResultsStorage(str(tmp_path), "s"), protocol=0).replace(
        b"\nResultsStorage\n", b"\nSweepStorage\n"
    )
    assert b"SweepStorage" in old
    assert pickle.loads(old).uri == ResultsStorage(str(tmp_path), "s").uri
