"""The typed configuration of one training run: validated, saved with the run, YAML in/out.

Every optimizer-specific default is filled in at validation time, so a saved or exported
config is complete: re-running it never depends on a default that might change.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from dpivon.errors import DpivonError

PRIVATE_OPTIMIZERS = (
    "dp-ivon-gradsq",
    "dp-ivon-gradsq-uncorrected",
    "dp-ivon",
    "dp-sgd",
    "dp-adam",
)
NONPRIVATE_OPTIMIZERS = ("ivon", "sgd", "adam")
OPTIMIZER_NAMES = PRIVATE_OPTIMIZERS + NONPRIVATE_OPTIMIZERS
IVON_FAMILY = ("ivon", "dp-ivon-gradsq", "dp-ivon-gradsq-uncorrected", "dp-ivon")

# IVON's CIFAR recipe (Shen et al.) for the non-private optimizers; the private IVON family
# needs a far larger lr: its step is about lr * g_dp while h stays near hess_init.
_IVON_DEFAULTS = dict(hess_init=0.5, beta2=0.99999, weight_decay=2e-4)
OPTIMIZER_DEFAULTS: dict[str, dict[str, float | str]] = {
    "sgd": dict(lr=0.1, momentum=0.9, weight_decay=5e-4),
    "adam": dict(lr=2e-3, beta2=0.999, weight_decay=0.0),
    "ivon": dict(lr=0.2, hess_approx="price", **_IVON_DEFAULTS),
    "dp-sgd": dict(lr=0.5, momentum=0.9, weight_decay=0.0),
    "dp-adam": dict(lr=2e-3, beta2=0.999, weight_decay=0.0),
    "dp-ivon-gradsq": dict(lr=3.0, hess_approx="gradsq", **_IVON_DEFAULTS),
    "dp-ivon-gradsq-uncorrected": dict(lr=3.0, hess_approx="gradsq", **_IVON_DEFAULTS),
    "dp-ivon": dict(lr=3.0, hess_approx="price", **_IVON_DEFAULTS),
}
# The private IVON variants are defined by their estimator; only plain IVON may choose.
_FIXED_ESTIMATOR = {"dp-ivon-gradsq", "dp-ivon-gradsq-uncorrected", "dp-ivon"}


class TrainConfig(BaseModel):
    """One training run. ``None`` hyper-parameters take the optimizer's default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # data
    dataset: Literal["cifar10", "synthetic"] = "cifar10"
    data_path: str | None = None
    val_size: int | None = None  # default: 5000 for cifar10, a tenth of synthetic_size
    per_class: int | None = None
    synthetic_size: int = 2000
    # model
    model: str = "tanh-cnn"
    # optimizer
    optimizer: str = "dp-ivon-gradsq"
    lr: float | None = None
    lr_schedule: Literal["constant", "cosine"] = "constant"
    weight_decay: float | None = None
    momentum: float | None = None
    beta1: float = 0.9
    beta2: float | None = None
    hess_approx: Literal["price", "gradsq"] | None = None
    hess_init: float | None = None
    ess: float | None = None
    mc_samples: int = 1
    clip_radius: float = math.inf
    rescale_lr: bool = True
    debias: bool = True
    # training
    epochs: int = 10
    batch_size: int = 256
    # privacy
    epsilon: float = 8.0
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    accountant: Literal["rdp", "prv"] = "rdp"
    # evaluation
    bma_samples: int = 16
    ece_bins: int = 15
    # reproducibility and testing
    seed: int = 0
    device: str = "auto"
    fail_at_epoch: int | None = None  # raises after that epoch: exercises failure handling

    @model_validator(mode="before")
    @classmethod
    def _fill_optimizer_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        name = data.get("optimizer", cls.model_fields["optimizer"].default)
        if name not in OPTIMIZER_DEFAULTS:
            raise ValueError(
                f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZER_NAMES)}"
            )
        filled = dict(data)
        if filled.get("val_size") is None:
            synthetic = filled.get("dataset") == "synthetic"
            filled["val_size"] = (
                int(filled.get("synthetic_size", 2000)) // 10 if synthetic else 5000
            )
        fixed = OPTIMIZER_DEFAULTS[name].get("hess_approx")
        given = filled.get("hess_approx")
        if name in _FIXED_ESTIMATOR and given is not None and given != fixed:
            raise ValueError(
                f"{name} uses the {fixed} estimator; hess_approx={given!r} "
                "contradicts it (use optimizer ivon to choose freely)"
            )
        for key, value in OPTIMIZER_DEFAULTS[name].items():
            if filled.get(key) is None:
                filled[key] = value
        return filled

    @model_validator(mode="after")
    def _check_ranges(self) -> TrainConfig:
        checks = [
            (self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
            (self.epsilon > 0, f"epsilon must be > 0 (inf = non-private), got {self.epsilon}"),
            (0 < self.delta < 1, f"delta must be in (0, 1), got {self.delta}"),
            (self.max_grad_norm > 0, f"max_grad_norm must be > 0, got {self.max_grad_norm}"),
            (self.lr is not None and self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.mc_samples >= 1, f"mc_samples must be >= 1, got {self.mc_samples}"),
            (self.bma_samples >= 0, f"bma_samples must be >= 0, got {self.bma_samples}"),
            (self.ece_bins >= 1, f"ece_bins must be >= 1, got {self.ece_bins}"),
            (self.val_size >= 1, f"val_size must be >= 1, got {self.val_size}"),
            (self.hess_init is None or self.hess_init > 0, "hess_init must be > 0"),
            (self.beta2 is None or 0 <= self.beta2 < 1, "beta2 must be in [0, 1)"),
            (self.ess is None or self.ess > 0, "ess must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.optimizer == "dp-ivon" and self.mc_samples != 1:
            raise ValueError("dp-ivon (price estimator) supports mc_samples=1 only")
        return self

    @property
    def is_private(self) -> bool:
        return self.optimizer in PRIVATE_OPTIMIZERS

    @property
    def is_ivon(self) -> bool:
        return self.optimizer in IVON_FAMILY

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())


def parse_config(data: dict[str, Any], source: str = "config") -> TrainConfig:
    """Validate a mapping into a TrainConfig; errors become one readable line."""
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as err:
        raise DpivonError(f"invalid {source}: {format_validation_error(err)}") from None


def load_configs(path: str | Path, overrides: dict[str, Any] | None = None) -> list[TrainConfig]:
    """Read a YAML training config, or a list of them (as ``dpivon export`` writes),
    applying ``overrides`` to each."""
    data = _read_yaml(path)
    documents = data if isinstance(data, list) else [data]
    if not documents or not all(isinstance(d, dict) for d in documents):
        raise DpivonError(f"{path} must hold a mapping of config keys, or a list of them")
    return [parse_config({**d, **(overrides or {})}, source=f"config {path}") for d in documents]


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    data = _read_yaml(path)
    if not isinstance(data, dict):
        raise DpivonError(f"{path} must hold a YAML mapping of keys to values")
    return data


def _read_yaml(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise DpivonError(f"file not found: {path}")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(err, "problem", err)
        raise DpivonError(f"{path} is not valid YAML{where}: {problem}") from None


def format_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"])
        message = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            message = "unknown key"
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)
