"""What every run file holds and checks the same way: a sweep pipeline
(`dpivon.search.pipeline`) and a benchmark pipeline (`dpivon.study.spec`) are each a
:class:`RunFile` with keys of their own.

The shared keys are the config sections every run of the file starts from (data, model,
epochs, accounting, noise mode, ``train:`` extras), the resources of one run, and where runs
are tracked and stored. The list checks both files make (``epsilons``, names that must not
repeat) are written here once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from dpivon.config import (
    DataConfig,
    Epochs,
    ModelConfig,
    PrivacyConfig,
    TrainingConfig,
    config_key,
    format_validation_error,
    read_yaml_mapping,
)
from dpivon.constraints import Bool, Bound, Epsilon, Float, Int, Probability
from dpivon.errors import DpivonError
from dpivon.optim.registry import OPTIMIZERS
from dpivon.orchestration.storage import ResultsStorage
from dpivon.privacy.accounting import check_delta

__all__ = [
    "Concurrency",
    "Epsilons",
    "Resources",
    "RunFile",
    "StrictModel",
    "as_list",
    "distinct",
    "group_budget",
    "train_extras",
]

_NAME = re.compile(r"[a-z0-9_-]+")
_MAX_CONCURRENCY = 4096
# Runs in flight at once over the whole file
Concurrency = Annotated[
    Int,
    Bound(
        ge=1,
        le=_MAX_CONCURRENCY,
        why="runs in flight at once, more than any Ray cluster here holds",
    ),
]
AccountantName = PrivacyConfig.model_fields["accountant"].annotation  # the config's choices


class StrictModel(BaseModel):
    """A section of a run file: unknown keys are errors, the loaded values are final."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def as_list(value: Any) -> Any:
    """A scalar as a one-item list (``epsilons: 8``)."""
    return value if isinstance(value, list) else [value]


def _shown(value: Any) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def distinct(what: str, key: Callable[[Any], Hashable] | None = None) -> AfterValidator:
    """A list field whose items (or each item's ``key``) must not repeat; ``what`` names
    them in the message (``optimizers must be distinct: dp-sgd listed more than once``)."""

    def check(items: list[Any]) -> list[Any]:
        keys = [item if key is None else key(item) for item in items]
        twice = [k for k in dict.fromkeys(keys) if keys.count(k) > 1]
        if twice:
            raise ValueError(
                f"{what} must be distinct: {', '.join(map(_shown, twice))} listed more than once"
            )
        return items

    return AfterValidator(check)


# The privacy budgets of a run file, each > 0 (inf: no noise); a scalar is a one-item list.
Epsilons = Annotated[
    list[Epsilon], BeforeValidator(as_list), Field(min_length=1), distinct("epsilons")
]


def group_budget(optimizer: str, epsilon: float) -> float:
    """The budget that labels the runs of ``optimizer`` at the listed ``epsilon``: that
    epsilon, or inf for a non-private optimizer, which spends none whatever is listed."""
    return float(epsilon) if OPTIMIZERS[optimizer].private else math.inf


def train_extras(train: Any) -> Any:
    """A ``train:`` block as flat TrainConfig keys (given flat, or as paths such as
    ``optimizer.lr``); :class:`RunFile` checks that it sets none the file owns."""
    if train is None:
        return {}
    if not isinstance(train, dict):
        return train  # the dict type check reports it
    return {config_key(str(key)): value for key, value in train.items()}


def _model_shorthand(value: Any) -> Any:
    return {"name": value} if isinstance(value, str) else value


class Resources(StrictModel):
    """What one run asks of a Ray node."""

    cpu: Float = 1.0
    gpu: Float = 0.0

    @model_validator(mode="after")
    def _check(self) -> Resources:
        if not (math.isfinite(self.cpu) and self.cpu > 0):
            raise ValueError(f"cpu must be > 0, got {self.cpu}")
        if not (math.isfinite(self.gpu) and self.gpu >= 0):
            raise ValueError(f"gpu must be >= 0, got {self.gpu}")
        if self.gpu > 1 and self.gpu != int(self.gpu):
            raise ValueError(f"gpu above 1 must be a whole number (Ray), got {self.gpu}")
        return self


def check_device_fits(where: str, device: Any, gpu: float) -> None:
    """A run on a CUDA device needs a GPU in its resources: Ray hides every GPU from a task
    that asks for none, so the run would fail on each trial (ValueError: one line)."""
    if str(device).startswith("cuda") and gpu == 0:
        raise ValueError(
            f"{where}: device {device} needs a GPU for each run; set resources: "
            "{gpu: 1} (or a fraction), or device auto"
        )


class RunFile(StrictModel):
    """What every run file (a sweep pipeline, a benchmark pipeline) holds and checks the
    same way: the config sections its runs share, and where they are tracked and stored."""

    kind: ClassVar[str]  # what its name names: a sweep, a benchmark
    noun: ClassVar[str]  # what the file is called in messages

    name: str
    data: DataConfig = DataConfig()
    model: Annotated[ModelConfig, BeforeValidator(_model_shorthand)] = ModelConfig()
    epochs: Epochs = TrainingConfig.model_fields["epochs"].default
    delta: Probability = 1e-5
    accountant: AccountantName = "rdp"
    resources: Resources = Resources()
    tracking_uri: str | None = None
    experiment: str = ""
    storage_path: str = Field("dpivon-runs", min_length=1)
    # true: every run's noise and sampling follow its seed (reproducible, no DP guarantee for
    # anything released); false: secure noise (dpivon.privacy.noise)
    research_mode: Bool = False
    train: dict[str, Any] = Field(default_factory=dict)  # more TrainConfig keys for every run

    _path: Path | None = PrivateAttr(None)
    _source_text: str = PrivateAttr("")

    @property
    def path(self) -> Path | None:
        """The file it was read from."""
        return self._path

    @property
    def source_text(self) -> str:
        """The file's text, for logging it with the runs."""
        return self._source_text

    @property
    def storage(self) -> ResultsStorage:
        """Its folder ``<storage_path>/<name>`` (state file, results), wherever stored."""
        return ResultsStorage(self.storage_path, self.name)

    @classmethod
    def read(cls, path: Path) -> Self:
        """The file at ``path``, its own keys validated (a loader adds the checks that need
        more than the file); one :class:`DpivonError` line naming the file when invalid."""
        data = read_yaml_mapping(path)
        try:
            loaded = cls.model_validate(data)
        except ValidationError as err:
            raise DpivonError(f"invalid {cls.noun} {path}: {cls.error_message(err)}") from None
        loaded._path, loaded._source_text = path, path.read_text()
        return loaded

    @classmethod
    def error_message(cls, err: ValidationError) -> str:
        """The one-line message of a file that does not validate."""
        return format_validation_error(err)

    @model_validator(mode="before")
    @classmethod
    def _default_experiment(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("experiment") is None:
            data = {**data, "experiment": f"dpivon-{data.get('name')}"}
        return data

    @field_validator("train", mode="before")
    @classmethod
    def _check_train(cls, train: Any) -> Any:
        return train_extras(train)

    @field_validator("data")
    @classmethod
    def _synthetic_size_for_synthetic(cls, data: DataConfig) -> DataConfig:
        if data.dataset != "synthetic" and "synthetic_size" in data.model_fields_set:
            raise ValueError("synthetic_size applies to dataset synthetic only; remove it")
        return data

    @property
    def owned_keys(self) -> frozenset[str]:
        """The TrainConfig keys this file's own keys set for every run: the keys of what
        builds a run's config (a subclass's), so no second list can disagree with it."""
        raise NotImplementedError

    def train_blocks(self) -> dict[str, dict[str, Any]]:
        """Every ``train:`` block of the file, by where it is."""
        return {"train": self.train}

    @model_validator(mode="after")
    def _check_runs(self) -> RunFile:
        check_delta(self.delta, self.data.train_size)
        for where, train in self.train_blocks().items():
            check_device_fits(where, train.get("device", "auto"), self.resources.gpu)
            owned = [key for key in train if key in self.owned_keys]
            if owned:
                raise ValueError(
                    f"{where}: {owned[0]} is a {self.noun} setting, not a train extra; set it "
                    f"with the {self.noun}'s own key (data:, model:, epochs:, epsilons:, ...)"
                )
        return self

    def shared_train_config(self, seed: int) -> dict[str, Any]:
        """The TrainConfig keys (flat) every run of this file starts from: its data (the
        split from ``data.data_seed``, else ``seed``), model, epochs, accounting and noise mode."""
        data = self.data.model_dump()
        data["data_seed"] = seed if self.data.data_seed is None else self.data.data_seed
        return {
            **data,
            "model": self.model.name,
            "epochs": self.epochs,
            "delta": self.delta,
            "accountant": self.accountant,
            "research_mode": self.research_mode,
        }

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"{name!r} is not a valid {cls.kind} name; use lowercase letters, digits, - and _"
            )
        return name

    @field_validator("experiment", check_fields=False)
    @classmethod
    def _check_experiment(cls, experiment: str) -> str:
        if not experiment.strip():
            raise ValueError("experiment must not be empty (omit it for dpivon-<name>)")
        return experiment
