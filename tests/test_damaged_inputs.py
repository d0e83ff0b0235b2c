"""`dpivon export` on a sweep folder whose state, table or model file is damaged: one line
naming the file, exit 2 (the readers' contract; the checkpoints' cases are in
test_train_checkpoint.py and test_benchmark.py)."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.config import TrainConfig
from dpivon.models import build_model
from dpivon.search.sweep_files import FRONT_FILE, TRIALS_FILE
from dpivon.search.trial import MODEL_FILE
from dpivon.tracking.checkpoints import save_checkpoint

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
    save_checkpoint(folder / "trials" / "t1" / MODEL_FILE, config, build_model("small-cnn"), None)
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
