"""The typed configuration of one training run: validated, saved with the run, YAML in/out.

A ``TrainConfig`` is a tree of small sections (data, model, optimizer, training, privacy,
evaluation, runtime), each declaring its fields' constraints. The optimizer section is the
options model of the named optimizer (dpivon.optim.registry). Every flat key (``lr``,
``epsilon``) names one field of the tree, so the CLI, search spaces, ``--json``, MLflow
params and older flat config files address options by their flat names.

Every optimizer-specific default is filled in at validation time, so a saved or exported
config is complete: re-running it never depends on a default that might change.
"""

from __future__ import annotations

import difflib
import math
import re
import reprlib
import typing
import unicodedata
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from dpivon.constraints import (
    Bool,
    Bound,
    Count,
    Epsilon,
    Float,
    Int,
    NoiseMultiplier,
    NonNegativeFloat,
    PositiveScale,
    Probability,
    Seed,
    size_text,
)
from dpivon.errors import DpivonError
from dpivon.optim.registry import (
    OPTIMIZER_NAMES,
    OPTIMIZERS,
    OPTION_NAMES,
    PRIVATE_OPTIMIZERS,
    OptimizerOptions,
    UnknownOptionError,
    optimizer_options,
)
from dpivon.paths import read_input_text
from dpivon.privacy.names import (
    AccountantName,
    EngineName,
    check_engine_samples,
)

__all__ = [  # the optimizer names are the registry's, re-exported for config users
    "FLAT_KEYS",
    "OPTIMIZER_NAMES",
    "PRIVATE_OPTIMIZERS",
    "SECTIONS",
    "BmaSamples",
    "DatasetName",
    "Epochs",
    "TrainConfig",
    "TuningCost",
    "config_key",
    "field_info",
    "format_validation_error",
    "load_configs",
    "parse_assignments",
    "parse_config",
    "read_yaml_mapping",
]

CIFAR10_TRAIN_IMAGES = 50_000
NUM_CLASSES = 10
# Upper bounds of the counts a run's memory or time grows with, each stated with its cost.
# A synthetic image is held as uint8 (3,072 bytes) and as a float32 tensor (12,288 bytes).
SYNTHETIC_IMAGE_BYTES = 3 * 32 * 32 * (1 + 4)
MAX_SYNTHETIC_IMAGES = 1_000_000  # 15 GB: twenty CIFAR-10 training sets
# A reliability diagram holds about ten float64 arrays of n_bins (counts, sums, means, edges)
_BIN_BYTES = 80
MAX_ECE_BINS = 10_000
# Posterior draws of a BMA prediction: each one a pass over the predicted images
MAX_BMA_SAMPLES = 1_000
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?|mps")

# The choice lists a config names; the code that implements each choice takes its list from
# here (typing.get_args), so a choice is added in one place besides its implementation.
DatasetName = Literal["cifar10", "synthetic"]  # dpivon.data


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class DataConfig(Section):
    """Which images a run trains and validates on."""

    dataset: DatasetName = "cifar10"
    data_path: str | None = None  # CIFAR-10 tarball or folder; None: $DPIVON_DATA, the cache
    val_size: Count  # default: 5000 for cifar10, a tenth of synthetic_size
    per_class: Count | None = None  # a class-balanced subset of the training images
    synthetic_size: Annotated[
        Int,
        Bound(
            ge=NUM_CLASSES,
            le=MAX_SYNTHETIC_IMAGES,
            cost=lambda n: f"need {size_text(n * SYNTHETIC_IMAGE_BYTES)} of images in memory",
            why=size_text(MAX_SYNTHETIC_IMAGES * SYNTHETIC_IMAGE_BYTES),
        ),
    ] = 2000
    data_seed: Seed | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_val_size(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("val_size") is None:
            size = data.get("synthetic_size", cls.model_fields["synthetic_size"].default)
            synthetic = data.get("dataset") == "synthetic" and isinstance(size, int)
            data = {**data, "val_size": size // 10 if synthetic else 5000}
        return data

    @model_validator(mode="after")
    def _fits(self) -> DataConfig:
        total = self.total_train_images
        if not self.val_size < total:
            raise ValueError(
                f"val_size ({self.val_size}) must be below the {total} training "
                f"images of {self.dataset}"
            )
        if self.per_class is not None:
            available = (total - self.val_size) // NUM_CLASSES
            if self.per_class > available:
                raise ValueError(
                    f"per_class {self.per_class} exceeds the about {available} images per "
                    f"class left after the validation split; pass per_class <= {available}"
                )
        return self

    @property
    def total_train_images(self) -> int:
        """Images of the training part before the validation split."""
        return self.synthetic_size if self.dataset == "synthetic" else CIFAR10_TRAIN_IMAGES

    @property
    def train_size(self) -> int:
        """Images a run trains on (what the sampling rate q = batch_size / N refers to)."""
        if self.per_class is not None:
            return self.per_class * NUM_CLASSES
        return self.total_train_images - self.val_size


class ModelConfig(Section):
    name: str = "tanh-cnn"

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        from dpivon.models import MODEL_NAMES  # imports torch: only when a model is named

        if name not in MODEL_NAMES:
            raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")
        return name


# bounded: the noise calibration searches over epochs * steps per epoch
Epochs = Annotated[Int, Bound(ge=1, le=100_000)]


class TrainingConfig(Section):
    epochs: Epochs = 10
    batch_size: Count = 256  # expected batch size b of Poisson sampling (private runs)
    # Poisson batches per epoch of a private run; None: ceil(N / b), one pass in expectation.
    # Set it to hold a published run's step count (Tramer & Boneh: 48 = floor(50,000 / 1,024))
    steps_per_epoch: Annotated[Int, Bound(ge=1, le=1_000_000)] | None = None
    lr_schedule: Literal["constant", "cosine"] = "constant"


class TuningCost(Section):
    """What choosing this config cost: the tuning sweep's quoted bound over the same records.

    Written by ``dpivon export``; a production run composes its own training with
    ``quoted_rdp`` (RDP on dpivon.privacy.tuning.ORDERS) to state what covers its release.
    """

    sweep: str
    group: str
    quoted_epsilon: Float
    quote: str
    release: str
    records_covered: str
    quoted_rdp: list[Float]


class PrivacyConfig(Section):
    """The training's (epsilon, delta) budget and how it is spent. Private optimizers only."""

    epsilon: Epsilon = 8.0  # inf: no noise
    delta: Probability = 1e-5
    max_grad_norm: PositiveScale = 1.0  # the per-example clip norm C
    accountant: AccountantName = "rdp"
    # auto = bk (book-keeping) where it is exact for the model and one MC sample, else hooks
    engine: EngineName = "auto"
    # Off (the default): noise and Poisson sampling from a CSPRNG keyed by the OS, never
    # stored outside resume checkpoints (dpivon.privacy.noise). On: they follow the seed,
    # reproducible by anyone who knows it: no DP guarantee for anything the run releases.
    research_mode: Bool = False
    # A fixed sigma_p instead of the one calibrated to `epsilon` (a published run's noise);
    # `epsilon` stays the budget: a run whose fixed noise would spend more is refused.
    fixed_noise_multiplier: NoiseMultiplier | None = None
    tuning: TuningCost | None = None  # set by `dpivon export`: the cost of the selection

    @model_validator(mode="before")
    @classmethod
    def _drop_secure_mode(cls, data: Any) -> Any:
        # Files written before secure noise became the default hold `secure_mode`: noise is
        # secure unless research_mode is set, so either value now means the default.
        if isinstance(data, Mapping) and isinstance(data.get("secure_mode"), bool):
            data = {k: v for k, v in data.items() if k != "secure_mode"}
        return data

    @model_validator(mode="after")
    def _fixed_noise_has_budget(self) -> PrivacyConfig:
        if self.fixed_noise_multiplier is not None and math.isinf(self.epsilon):
            raise ValueError(
                f"fixed_noise_multiplier {self.fixed_noise_multiplier:g} needs a finite epsilon, "
                "the budget its noise must fit (epsilon inf means no noise)"
            )
        return self


def _draws(what: str, when: str = "") -> AfterValidator:
    return Bound(
        ge=0,
        le=MAX_BMA_SAMPLES,
        cost=lambda n: f"predict {what} {n:,} times{when}",
        why="the BMA's estimate settles within a few dozen draws",
    )


# Posterior draws of a BMA prediction (0: the posterior mean); `predict` and `evaluate`
# check their --bma-samples against it too.
BmaSamples = Annotated[Int, _draws("every image")]
EceBins = Annotated[
    Int,
    Bound(
        ge=1,
        le=MAX_ECE_BINS,
        cost=lambda n: f"need {size_text(n * _BIN_BYTES)} per reliability diagram",
        why="more bins than the validation images leave most of them empty",
    ),
]


class EvaluationConfig(Section):
    # posterior draws of IVON's BMA: the final test and the logged model
    bma_samples: Annotated[Int, _draws("the test set")] = 16
    # the per-epoch validation (what the sweep's objectives and ASHA read); few draws: the
    # validation ECE stayed within 0.01 of 16 draws (benchmarks/RESULTS.md)
    val_bma_samples: Annotated[Int, _draws("the validation set", " every epoch")] = 4
    ece_bins: EceBins = 15
    # > 0: release only Gaussian-noised validation accuracy and ECE (DP for the validation
    # records that steer selection); 0: exact scores, validation records unprotected.
    val_noise_multiplier: NonNegativeFloat = 0.0
    # the test set's accuracy after every epoch as well (`epoch_test_accuracy`), as published
    # DP-SGD scripts log it; the test set steers nothing, so it spends no budget
    test_every_epoch: Bool = False


class RuntimeConfig(Section):
    # initialisation and posterior draws; in research mode also the DP noise and sampling
    seed: Seed = 0
    device: str = "auto"

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if _DEVICE.fullmatch(device) is None:
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
        return device


SECTIONS: dict[str, type[BaseModel]] = {
    "data": DataConfig,
    "model": ModelConfig,
    "optimizer": OptimizerOptions,
    "training": TrainingConfig,
    "privacy": PrivacyConfig,
    "evaluation": EvaluationConfig,
    "runtime": RuntimeConfig,
}
# The flat key of every option: the field's own name (unique over the tree), or for a
# section's `name` the section's name (`optimizer: dp-sgd`, `model: wrn-16-4`).
FLAT_KEYS: dict[str, tuple[str, str]] = {
    **{
        (section if name == "name" else name): (section, name)
        for section, model in SECTIONS.items()
        if section != "optimizer"
        for name in model.model_fields
    },
    "optimizer": ("optimizer", "name"),
    **{name: ("optimizer", name) for name in OPTION_NAMES},
}
# Keys that older flat configs hold with a value that now means "not set": a test hook
# (fail_at_epoch), secure_mode, and options of other optimizer families, which those files
# listed for every optimizer at their old global defaults.
_RETIRED_FLAT_VALUES = {
    "fail_at_epoch": (None,),
    "secure_mode": (True, False),  # secure noise is the default: research_mode opts out
    "beta1": (None, 0.9),
    "mc_samples": (None, 1),
    "clip_radius": (None, math.inf),
    "rescale_lr": (None, True),
    "debias": (None, True),
}


def _retired(key: Any, value: Any) -> bool:
    """Whether an older flat file's ``key: value`` means "not set" (same type and value:
    `mc_samples: yes` is no retired 1)."""
    return any(
        value is old or (type(value) is type(old) and value == old)
        for old in _RETIRED_FLAT_VALUES.get(key, (None,) if key in OPTION_NAMES else ())
    )


def _no_budget_without_noise(optimizer: str, privacy: Any) -> None:
    """A non-private optimizer's epsilon is inf (what it spends); a finite one would be
    logged and quoted as a budget that no noise backs, so it is an error."""
    if not isinstance(privacy, dict):
        return  # validation says it is no mapping
    epsilon = privacy.setdefault("epsilon", math.inf)
    number = isinstance(epsilon, int | float) and not isinstance(epsilon, bool)
    if number and math.isfinite(epsilon):
        raise ValueError(
            f"{optimizer} is not private (it adds no noise), so epsilon {epsilon:g} would be "
            "a claim nothing backs; omit epsilon (it is inf) or use a private optimizer (dp-...)"
        )


def config_key(name: str) -> str:
    """The flat key that ``name`` (a flat key such as ``lr`` or a path such as
    ``optimizer.lr``) denotes; ValueError naming the closest keys when there is none."""
    if name in FLAT_KEYS:
        return name
    section, _, field_name = name.partition(".")
    if section in SECTIONS:
        for flat, location in FLAT_KEYS.items():
            if location == (section, field_name):
                return flat
    raise ValueError(f"{name!r} is not a TrainConfig field{_unknown_key_hint(name)}")


# Other libraries' names for our keys (PyTorch, Opacus, Hugging Face)
_KNOWN_AS = {
    "learning_rate": "lr",
    "num_epochs": "epochs",
    "target_epsilon": "epsilon",
    "target_delta": "delta",
    "noise_multiplier": "fixed_noise_multiplier",
    "clipping_norm": "max_grad_norm",
}
# What an unknown key is matched against -> the key suggested: every key, flat and as a
# path, and the names above, so that learnig_rate gets "did you mean lr?"
_SUGGESTED = {
    **{key: key for key in FLAT_KEYS},
    **{f"{s}.{f}": f"{s}.{f}" for s, f in FLAT_KEYS.values()},
    **_KNOWN_AS,
    **{
        f"{FLAT_KEYS[key][0]}.{alias}": ".".join(FLAT_KEYS[key]) for alias, key in _KNOWN_AS.items()
    },
}


def _unknown_key_hint(name: str, suggest: bool = True) -> str:
    """What an unknown key may have meant: the closest TrainConfig keys (``suggest``) and
    any character that only looks like an ASCII one (a Cyrillic e, U+0435, in "epsilon").
    The one rule for every unknown key: ``--set``'s, a config file's, an optimizer's."""
    notes = []
    if suggest and (close := difflib.get_close_matches(name, _SUGGESTED, n=3)):
        notes.append(f"did you mean {', '.join(dict.fromkeys(_SUGGESTED[c] for c in close))}?")
    foreign = dict.fromkeys(c for c in name if not c.isascii())
    if foreign:
        shown = ", ".join(
            f"{c!r} is U+{ord(c):04X} {unicodedata.name(c, 'unnamed')}" for c in foreign
        )
        notes.append(f"{shown}, not an ASCII letter")
    return f" ({'; '.join(notes)})" if notes else ""


def field_info(key: str) -> tuple[str, FieldInfo]:
    """The dotted path and the declaration of the field a flat key or path names."""
    section, name = FLAT_KEYS[config_key(key)]
    if section != "optimizer":
        return f"{section}.{name}", SECTIONS[section].model_fields[name]
    owner = next(s.options for s in OPTIMIZERS.values() if name in s.options.model_fields)
    return f"optimizer.{name}", owner.model_fields[name]


def parse_assignments(assignments: list[str]) -> dict[str, Any]:
    """``["optimizer.lr=0.5", "hess_floor=1e-3"]`` as flat keys with YAML-typed values."""
    values: dict[str, Any] = {}
    for assignment in assignments:
        key, equals, text = assignment.partition("=")
        if not equals or not key.strip():
            raise DpivonError(f"--set takes PATH=VALUE (e.g. optimizer.lr=0.5), got {assignment!r}")
        try:
            flat = config_key(key.strip())
            value = yaml.load(text, Loader=_YamlLoader)
        except ValueError as err:
            raise DpivonError(f"--set {assignment}: {err}") from None
        except (yaml.YAMLError, RecursionError):  # a value nested deeper than Python recurses
            shown = text if len(text) <= 40 else f"{text[:40]}..."
            raise DpivonError(f"--set {key.strip()}: {shown!r} is not a YAML value") from None
        if value is None and not _takes_null(flat):
            raise DpivonError(
                f"--set {assignment}: {field_info(flat)[0]} has no null value; give a value, "
                "or leave it out for the default"
            )
        if flat in values:  # as a key given twice in a file: the last would win silently
            raise DpivonError(
                f"--set {key.strip()} given twice ({values[flat]!r}, then {value!r}); give it once"
            )
        values[flat] = value
    return values


def _takes_null(key: str) -> bool:
    """Whether null is a value of the field (``data_path: null``: the default location)."""
    annotation = field_info(key)[1].annotation
    return annotation is None or type(None) in typing.get_args(annotation)


class TrainConfig(BaseModel):
    """One training run: a tree of sections. Built from the tree (what ``to_yaml`` writes)
    or from flat keys (``lr``, ``optimizer``: what the CLI, search spaces, ``--json`` and
    MLflow params use); an unset optimizer option takes that optimizer's default.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    optimizer: SerializeAsAny[OptimizerOptions]
    training: TrainingConfig = TrainingConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    @model_validator(mode="before")
    @classmethod
    def _as_tree(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        tree: dict[str, Any] = {}

        def section(name: str) -> dict | None:
            current = tree.setdefault(name, {})
            return current if isinstance(current, dict) else None  # a non-mapping: an error

        for key, value in data.items():
            if key in SECTIONS and isinstance(value, Mapping | BaseModel):
                given = value.model_dump() if isinstance(value, BaseModel) else value
                if (target := section(key)) is not None:
                    target.update(given)
            elif key in SECTIONS and key not in FLAT_KEYS:
                tree[key] = value  # validation says it is no mapping
            elif isinstance(key, str) and (key in FLAT_KEYS or "." in key):
                try:
                    section_name, field_name = FLAT_KEYS[config_key(key)]
                except ValueError:
                    tree[key] = value  # extra="forbid" names it
                    continue
                if (target := section(section_name)) is not None:
                    target[field_name] = value
            elif not _retired(key, value):
                tree[key] = value
        # options of another family that an older flat file holds at the old defaults
        options = tree.setdefault("optimizer", {})  # {}: the default optimizer
        if isinstance(options, dict):
            name = options.get("name", "dp-ivon-gradsq")
            spec = OPTIMIZERS.get(name) if isinstance(name, str) else None
            fields = spec.options.model_fields if spec is not None else {}
            tree["optimizer"] = {
                k: v for k, v in options.items() if k in fields or not _retired(k, v)
            }
            if spec is not None and not spec.private:
                _no_budget_without_noise(name, tree.setdefault("privacy", {}))
        return tree

    @field_validator("optimizer", mode="before")
    @classmethod
    def _optimizer_options(cls, value: Any) -> Any:
        if isinstance(value, OptimizerOptions):
            value = value.model_dump()
        return optimizer_options(value) if isinstance(value, Mapping) else value

    @model_validator(mode="after")
    def _check_across_sections(self) -> TrainConfig:
        if self.is_private:
            check_engine_samples(self.privacy.engine, self.optimizer.samples_per_step)
        elif self.training.steps_per_epoch is not None:
            raise ValueError(
                f"steps_per_epoch applies to private runs (Poisson batches); "
                f"{self.optimizer.name} passes over the shuffled data once an epoch: omit it"
            )
        return self

    @property
    def is_private(self) -> bool:
        return OPTIMIZERS[self.optimizer.name].private

    @property
    def planned_steps(self) -> int:
        """The optimizer steps the run takes (`steps_at` its batch size)."""
        return self.steps_at(self.training.batch_size)

    def steps_at(self, batch_size: int) -> int:
        """The optimizer steps the run would take at ``batch_size``: its epochs of
        ``steps_per_epoch`` (private runs may set it) or of one pass over the training
        images, ceil(N / batch)."""
        one_pass = math.ceil(self.data.train_size / batch_size)
        return self.training.epochs * (self.training.steps_per_epoch or one_pass)

    @property
    def split_seed(self) -> int:
        """The train/validation split's seed: data_seed, else the run's seed."""
        return self.runtime.seed if self.data.data_seed is None else self.data.data_seed

    def flat(self) -> dict[str, Any]:
        """The config as flat keys (JSON values): MLflow params, ``--json``, trial configs."""
        tree = self.model_dump(mode="json")
        return {
            flat: tree[section][name]
            for flat, (section, name) in FLAT_KEYS.items()
            if name in tree[section]
        }

    def replace(self, **changes: Any) -> TrainConfig:
        """A validated copy with flat-key ``changes`` (a new optimizer drops the options of
        the old one)."""
        flat = self.flat()
        if changes.get("optimizer", self.optimizer.name) != self.optimizer.name:
            flat = {k: v for k, v in flat.items() if FLAT_KEYS[k][0] != "optimizer"}
        return TrainConfig.model_validate({**flat, **changes})

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


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e-6``, ``1E+3`` and ``inf`` as floats.

    YAML 1.1 (what PyYAML implements) wants a dot in a float's mantissa, so ``1e-6`` would
    be the string "1e-6", and writes infinity ``.inf``; users write both as numbers.
    """


class DuplicateKeyError(ValueError):
    """A mapping names a key twice; YAML would silently keep the last value."""


def _mapping_without_duplicates(loader: _YamlLoader, node: yaml.MappingNode) -> dict:
    seen: set[Any] = set()  # the keys written here; a merged (<<) one may be overridden
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        # True == 1 in Python, not in a file; a list key (allowed by YAML) by its text
        hashable = (type(key) is bool, key if isinstance(key, Hashable) else repr(key))
        if hashable in seen:
            line = key_node.start_mark.line + 1
            raise DuplicateKeyError(
                f"key {_shown_value(key)} given twice (line {line}); YAML would silently keep "
                "the last value: give it once"
            )
        seen.add(hashable)
    return loader.construct_mapping(node, deep=True)


_YamlLoader.add_constructor("tag:yaml.org,2002:map", _mapping_without_duplicates)
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?
        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?\.?(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789.iI"),
)


def _read_yaml(path: str | Path) -> Any:
    path = Path(path)
    text = read_input_text(path)
    try:
        return yaml.load(text, Loader=_YamlLoader)
    except DuplicateKeyError as err:
        raise DpivonError(f"{path} is not valid YAML: {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())
        raise DpivonError(f"{path} is not valid YAML{where}: {problem}") from None
    except (ValueError, RecursionError) as err:  # PyYAML's constructors, its composer
        problem = " ".join(str(err).split())[:200] or type(err).__name__
        raise DpivonError(f"{path} is not valid YAML: {problem}") from None


def format_validation_error(err: ValidationError) -> str:
    """The errors of one validation as one line: ``where: what`` for each."""
    parts = []
    for e in err.errors():
        # sections and union members are noise in a location: `optimizer.lr`, not
        # `optimizer.function-after[...].lr`
        loc = [str(x) for x in e["loc"] if not str(x).startswith(("function-", "tagged-union"))]
        message = _our_wording(e)
        if e["type"] == "extra_forbidden" and loc:  # TrainConfig's keys are known here
            message += _unknown_key_hint(".".join(loc), suggest=err.title == "TrainConfig")
        unknown = (e.get("ctx") or {}).get("error")
        if isinstance(unknown, UnknownOptionError) and isinstance(unknown.key, str):
            message += _unknown_key_hint(f"optimizer.{unknown.key}")
        if isinstance(e.get("input"), bool) and e["type"] in ("float_type", "int_type"):
            name = loc[-1] if loc else "the value"
            if name.isdigit() and len(loc) > 1:  # a list's item: "epsilons.0", not "0"
                name, loc = ".".join(loc[-2:]), loc[:-2]
            message = (
                f"{name} takes no boolean, got {e['input']!r} (YAML "
                "reads yes/no/on/off as booleans; write the value itself)"
            )
        if loc and message.startswith(f"{loc[-1]}="):  # "ece_bins=10 would ...": its path
            message, loc = ".".join([*loc[:-1], message]), []
        if loc and message.startswith(f"{loc[-1]} "):
            loc = []  # the message names the field itself ("lr must be > 0, got 0")
        where = ".".join(loc)
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def _our_wording(error: Any) -> str:
    """One pydantic error in our words (what the value must be, what it was), without
    pydantic's phrasing ("Input should be ...") or its documentation links."""
    kind, ctx = error["type"], error.get("ctx") or {}
    got = f", got {_shown_value(error.get('input'))}" if "input" in error else ""
    shown = {
        "extra_forbidden": lambda: "unknown key",
        "missing": lambda: "required",
        "invalid_key": lambda: f"keys must be text{got}",
        "int_type": lambda: f"must be a whole number{got}",
        "int_from_float": lambda: f"must be a whole number{got}",
        "int_parsing": lambda: f"must be a whole number{got}",
        "float_type": lambda: f"must be a number{got}",
        "float_parsing": lambda: f"must be a number{got}",
        "finite_number": lambda: f"must be a finite number{got}",
        "bool_type": lambda: f"must be true or false{got}",
        "string_type": lambda: f"must be text{got}",
        "string_too_short": lambda: "must not be empty",
        "literal_error": lambda: f"must be one of {ctx.get('expected')}{got}",
        "dict_type": lambda: f"must be a mapping of keys to values{got}",
        "model_type": lambda: f"must be a mapping of keys to values{got}",
        "model_attributes_type": lambda: f"must be a mapping of keys to values{got}",
        "list_type": lambda: f"must be a list{got}",
        "too_short": lambda: f"needs at least {ctx.get('min_length')} item(s){got}",
        "too_long": lambda: f"takes at most {ctx.get('max_length')} item(s)",
        "greater_than": lambda: f"must be > {ctx.get('gt')}{got}",
        "greater_than_equal": lambda: f"must be >= {ctx.get('ge')}{got}",
        "less_than": lambda: f"must be < {ctx.get('lt')}{got}",
        "less_than_equal": lambda: f"must be <= {ctx.get('le')}{got}",
        "union_tag_invalid": lambda: f"type must be one of {ctx.get('expected_tags')}{got}",
        "union_tag_not_found": lambda: f"needs a {ctx.get('discriminator')} key",
    }.get(kind)
    return shown() if shown else error["msg"].removeprefix("Value error, ")


# A value's repr cut short while it is made: a YAML alias bomb is a few lines that expand to
# millions of items, whose whole repr takes seconds before the first 80 characters are kept.
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring, _SHORT_REPR.maxother = 4, 80, 80
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxdict = 10


def _shown_value(value: Any) -> str:
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
