"""A trained model as one file: its config, mean weights and posterior (IVON family)."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import torch

from dpivon.config import TrainConfig
from dpivon.evaluation import Posterior
from dpivon.models import build_model


def save_checkpoint(
    path: Path | BinaryIO,
    config: TrainConfig,
    model: torch.nn.Module,
    posterior: Posterior | None,
) -> None:
    """Everything needed to rebuild the predictive: config, mean weights, posterior h."""
    torch.save(
        {
            "config": config.model_dump(mode="json"),
            "model_state": model.state_dict(),
            "posterior": posterior.state_dict() if posterior is not None else None,
        },
        path,
    )


def load_checkpoint(path: str | Path) -> tuple[TrainConfig, torch.nn.Module, Posterior | None]:
    """The config, model (on the CPU) and posterior that :func:`save_checkpoint` saved."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    config = TrainConfig.model_validate(state["config"])
    model = build_model(config.model.name)
    model.load_state_dict(state["model_state"])
    posterior = Posterior.from_state_dict(state["posterior"]) if state["posterior"] else None
    return config, model, posterior
