"""Files that are not what dpivon wrote, made from a payload of the right layout, with the
words of the refusal each must get: the readers' contract tests feed them to every command
that reads a dpivon torch file."""

from __future__ import annotations

import io
import os
from typing import Any

import torch

from dpivon.runs.checkpoint import CHECKPOINT_LAYOUT


def torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def damaged_torch_files(valid: dict[str, Any]) -> dict[str, tuple[bytes, str]]:
    """Case name -> (file content, words of its refusal); ``valid`` is a payload of the
    reader's layout (its values may be of another configuration)."""
    return {
        "truncated": (torch_bytes(valid)[:300], "cut short"),
        "random bytes": (os.urandom(4096), "not a file dpivon wrote"),
        "a list": (torch_bytes([1, 2, 3]), "holds a list"),
        "a state dict": (torch_bytes({"weight": torch.zeros(2)}), "lacks"),
        "an older layout": (torch_bytes({**valid, "format": 0}), "layout version 0"),
        "a layout that is no number": (torch_bytes({**valid, "format": [2]}), "layout version"),
    }


# A training state of the shape a checkpoint is checked for, of no real run
SHAPED_TRAINING_STATE = {
    "epoch": 1, "model": {}, "optimizer": {}, "scheduler": {}, "accountant": None,
    "rng": {"randomness": {}}, "history": [],
}  # fmt: skip
# A run checkpoint of the current layout, of another configuration than any test runs.
OTHER_RUN_CHECKPOINT = {
    "format": CHECKPOINT_LAYOUT, "config": {"optimizer": "adam"},
    "training": SHAPED_TRAINING_STATE,
    "mlflow_run_id": "x", "seconds": 1.0,
}  # fmt: skip
# What every reader of run checkpoints (train --checkpoint, benchmark and sweep --resume) refuses
DAMAGED_CHECKPOINTS = {
    **damaged_torch_files(OTHER_RUN_CHECKPOINT),
    "a training state of another shape": (
        torch_bytes({**OTHER_RUN_CHECKPOINT, "training": {**SHAPED_TRAINING_STATE, "epoch": None}}),
        "training state's epoch",
    ),
    "another configuration": (torch_bytes(OTHER_RUN_CHECKPOINT), "another run configuration"),
}
