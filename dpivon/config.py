"""The typed configuration of one training run: validated, saved with the run, YAML in/out.

Every optimizer-specific default is filled in at validation time, so a saved or exported
config is complete: re-running it never depends on a default that might change.
"""

from __future__ import annotations

import math
import re
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
    "dp-adambc",
)
NONPRIVATE_OPTIMIZERS = ("ivon", "sgd", "adam")
OPTIMIZER_NAMES = PRIVATE_OPTIMIZERS + NONPRIVATE_OPTIMIZERS
IVON_FAMILY = ("ivon", "dp-ivon-gradsq", "dp-ivon-gradsq-uncorrected", "dp-ivon")

# IVON's CIFAR recipe (Shen et al.) for the non-private optimizers; the private IVON family
# needs a far larger lr: its step is about lr * g_dp while h stays near hess_init.
_IVON_DEFAULTS = dict(hess_init=0.5, beta2=0.99999, weight_decay=2e-4, hess_floor=0.0)
# The paper's per-step v_hat; the other estimators answer its collapse (dpivon.optim.ivon).
_GRADSQ_DEFAULTS = dict(
    hess_approx="gradsq",
    curvature_estimator="per-step",
    curvature_ema=0.99,
    curvature_pool="tensor",
)
OPTIMIZER_DEFAULTS: dict[str, dict[str, float | str]] = {
    "sgd": dict(lr=0.1, momentum=0.9, weight_decay=5e-4),
    "adam": dict(lr=2e-3, beta2=0.999, weight_decay=0.0),
    "ivon": dict(lr=0.2, hess_approx="price", **_IVON_DEFAULTS),
    "dp-sgd": dict(lr=0.5, momentum=0.9, weight_decay=0.0),
    "dp-adam": dict(lr=2e-3, beta2=0.999, weight_decay=0.0),
    # The authors' CIFAR-10 CNN setting (lr 5e-6, gamma' 1e-9, with C 3 and batch 1024):
    # gamma' bounds 1 / sqrt(v_corr), so the lr sits far below DP-Adam's.
    "dp-adambc": dict(lr=5e-6, beta2=0.999, weight_decay=0.0, second_moment_floor=1e-9),
    "dp-ivon-gradsq": dict(lr=3.0, **_GRADSQ_DEFAULTS, **_IVON_DEFAULTS),
    "dp-ivon-gradsq-uncorrected": dict(lr=3.0, **_GRADSQ_DEFAULTS, **_IVON_DEFAULTS),
    "dp-ivon": dict(lr=3.0, hess_approx="price", **_IVON_DEFAULTS),
}
# The private IVON variants are defined by their estimator; only plain IVON may choose.
_FIXED_ESTIMATOR = {"dp-ivon-gradsq", "dp-ivon-gradsq-uncorrected", "dp-ivon"}
# Options of some optimizers only: setting one for another optimizer is an error, not a no-op.
_OPTIMIZER_SPECIFIC = (
    "curvature_estimator",
    "curvature_ema",
    "curvature_pool",
    "hess_floor",
    "second_moment_floor",
)


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?|mps")


class TuningCost(BaseModel):
    """What choosing this config cost: the tuning sweep's quoted bound over the same records.

    Written by ``dpivon export``; a production run composes its own training with
    ``quoted_rdp`` (RDP on dpivon.privacy.tuning.ORDERS) to state what covers its release.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    sweep: str
    group: str
    quoted_epsilon: float
    quote: str
    release: str
    records_covered: str
    quoted_rdp: list[float]


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
    # DP-IVON-Gradsq: how v_hat is estimated from g_dp (see dpivon.optim.ivon); all are
    # post-processing of g_dp, none costs privacy
    curvature_estimator: Literal["per-step", "ema-corrected", "pooled", "shrinkage"] | None = None
    curvature_ema: float | None = None  # ema-corrected: moving-average rate of g_dp^2
    curvature_pool: Literal["tensor", "channel"] | None = None  # pooled and shrinkage
    hess_floor: float | None = None  # IVON family: keeps h >= hess_floor (0: no floor)
    second_moment_floor: float | None = None  # dp-adambc: gamma' in max(v_hat - s^2, gamma')
    # training
    epochs: int = 10
    batch_size: int = 256
    # privacy
    epsilon: float = 8.0
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    accountant: Literal["rdp", "prv"] = "rdp"
    # How clipped per-example gradients are computed (dpivon.privacy.engine): auto = bk
    # (book-keeping) where it is exact for the model and mc_samples == 1, else Opacus hooks.
    engine: Literal["auto", "bk", "hooks", "functorch", "ew", "ghost"] = "auto"
    # Noise and Poisson sampling from OS entropy (never stored) with Opacus's floating-point
    # attack defence; off, they follow `seed` and are reproducible by anyone who knows it.
    secure_mode: bool = False
    tuning: TuningCost | None = None  # set by `dpivon export`: the cost of the selection
    # evaluation
    bma_samples: int = 16
    ece_bins: int = 15
    # > 0: release only Gaussian-noised validation accuracy and ECE (DP for the validation
    # records that steer selection); 0: exact scores, validation records unprotected.
    val_noise_multiplier: float = 0.0
    # reproducibility and testing
    seed: int = 0  # training: initialisation, posterior draws, batches and (unless secure) noise
    data_seed: int | None = None  # the train/validation split; None = seed
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
        foreign = [
            k
            for k in _OPTIMIZER_SPECIFIC
            if filled.get(k) is not None and k not in OPTIMIZER_DEFAULTS[name]
        ]
        if foreign:
            owners = [o for o in OPTIMIZER_NAMES if foreign[0] in OPTIMIZER_DEFAULTS[o]]
            raise ValueError(
                f"{foreign[0]} does not apply to {name}; it is an option of {', '.join(owners)}"
            )
        for key, value in OPTIMIZER_DEFAULTS[name].items():
            if filled.get(key) is None:
                filled[key] = value
        return filled

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        """YAML reads `yes` as true, which pydantic would take as the number 1."""
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key)
                wants_bool = field is not None and field.annotation in (bool, bool | None)
                if isinstance(value, bool) and field is not None and not wants_bool:
                    raise ValueError(
                        f"{key} takes no boolean, got {value!r} (YAML reads yes/no/on/off "
                        "as booleans; write the value itself)"
                    )
        return data

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
            (self.val_noise_multiplier >= 0, "val_noise_multiplier must be >= 0"),
            (0 <= self.seed < 2**32, f"seed must be in [0, 2**32), got {self.seed}"),
            (self.val_size >= 1, f"val_size must be >= 1, got {self.val_size}"),
            (self.hess_init is None or self.hess_init > 0, "hess_init must be > 0"),
            (self.beta2 is None or 0 <= self.beta2 < 1, "beta2 must be in [0, 1)"),
            (self.ess is None or self.ess > 0, "ess must be > 0"),
            (
                self.weight_decay is None or self.weight_decay >= 0,
                f"weight_decay must be >= 0, got {self.weight_decay}",
            ),
            (
                self.momentum is None or 0 <= self.momentum < 1,
                f"momentum must be in [0, 1), got {self.momentum}",
            ),
            (
                _DEVICE.fullmatch(self.device) is not None,
                f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}",
            ),
            (
                self.curvature_ema is None or 0 <= self.curvature_ema < 1,
                "curvature_ema must be in [0, 1)",
            ),
            (self.hess_floor is None or self.hess_floor >= 0, "hess_floor must be >= 0"),
            (
                self.second_moment_floor is None or self.second_moment_floor > 0,
                "second_moment_floor must be > 0 (gamma' keeps 1 / sqrt(v_corr) finite)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.optimizer == "dp-ivon" and self.mc_samples != 1:
            raise ValueError("dp-ivon (price estimator) supports mc_samples=1 only")
        if self.is_private and self.engine in ("bk", "ghost") and self.mc_samples > 1:
            raise ValueError(
                f"engine {self.engine} clips one backward pass; mc_samples > 1 averages each "
                "example's gradient over posterior samples first: use engine hooks or auto"
            )
        return self

    @property
    def is_private(self) -> bool:
        return self.optimizer in PRIVATE_OPTIMIZERS

    @property
    def split_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed

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
