"""A trained model as one file: its config, mean weights and posterior (IVON family)."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import torch

from dpivon.config import TrainConfig
from dpivon.errors import DpivonError, first_line
from dpivon.evaluation import Posterior
from dpivon.models import build_model
from dpivon.saved_files import FORMAT_VERSION, read_saved, versioned


def save_model_file(
    path: Path | BinaryIO,
    config: TrainConfig,
    model: torch.nn.Module,
    posterior: Posterior | None,
) -> None:
    """Everything needed to rebuild the predictive: config, mean weights, posterior h."""
    torch.save(
        versioned({
            "config": config.model_dump(mode="json"),
            "model_state": model.state_dict(),
            "posterior": posterior.state_dict() if posterior is not None else None,
        }),
        path,
    )  # fmt: skip


def load_model_file(path: str | Path) -> tuple[TrainConfig, torch.nn.Module, Posterior | None]:
    """The config, model (on the CPU) and posterior that :func:`save_model_file` saved;
    a file that is not one gets one line naming it."""
    path = Path(path)
    fields = {"config": dict, "model_state": dict, "posterior": (dict, type(None))}
    state = read_saved(path, "model file", {FORMAT_VERSION: [fields]})
    try:
        config = TrainConfig.model_validate(state["config"])
        model = build_model(config.model.name)
        model.load_state_dict(state["model_state"])
        posterior = Posterior.from_state_dict(state["posterior"]) if state["posterior"] else None
    except (ValueError, KeyError, RuntimeError) as err:  # edited by hand, or another model's
        raise DpivonError(
            f"model file {path} does not hold a model dpivon saved: {first_line(err)}"
        ) from None
    return config, model, posterior
