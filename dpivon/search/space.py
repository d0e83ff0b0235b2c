"""Search spaces: which TrainConfig hyper-parameters a sweep samples, and from where.

One YAML file per optimizer::

    optimizer: dp-ivon-gradsq        # must be one of dpivon.config.OPTIMIZER_NAMES
    params:                          # sampled and suggested in this order
      lr:            {type: float, low: 0.5, high: 50.0, log: true}
      hess_init:     {type: float, low: 0.01, high: 2.0, log: true}
      max_grad_norm: {type: float, low: 0.1, high: 10.0, step: 0.1}
      batch_size:    {type: int, low: 128, high: 1024, log: true}   # or step: 128
      beta2:         {type: categorical, choices: [0.99, 0.999, 0.9999, 0.99999]}
      mc_samples: 1                  # a bare value (scalar, list, string, null) is fixed
      use_wd:        {type: categorical, choices: [true, false]}    # a switch, see below
      weight_decay:  {type: float, low: 1.0e-6, high: 1.0e-2, log: true, when: {use_wd: true}}

Parameter kinds (the same meaning as Optuna's ``suggest_*``):

- ``float``: ``low`` < ``high``, ``log`` (default false; needs ``low`` > 0), optional
  ``step`` (a grid low, low + step, ...; ``step`` and ``log`` exclude each other).
- ``int``: integer ``low`` < ``high``, ``log`` (default false; needs ``low`` >= 1),
  ``step`` (default 1; ``log`` needs ``step`` 1).
- ``categorical``: ``choices``, a non-empty list of distinct scalars (numbers, strings,
  booleans, null).
- a fixed value: anything that is not a mapping; every trial gets it as is.

``when: {name: value}`` (or ``{name: [value, ...]}``) makes a sampled parameter
conditional: it is suggested only when the EARLIER parameter ``name`` of the same space
(declaration order) took that value (one of those values); several names must all match,
and a parameter whose condition names an inactive parameter is inactive too. A condition
may name a categorical or int parameter, and its values must be among that parameter's
possible values. An inactive parameter is absent from the trial and keeps TrainConfig's
default (for the optimizer's defaults: ``dpivon.config.OPTIMIZER_DEFAULTS``).

Every parameter name must be a TrainConfig field, except *switches*: categorical helper
parameters that some ``when`` names (``use_wd`` above). Switches steer conditions and are
dropped from the trial's config. The pipeline owns the fields ``optimizer``, ``epsilon``,
``delta``, ``accountant``, ``dataset``, ``data_path``, ``val_size``, ``per_class``,
``synthetic_size``, ``model``, ``epochs``, ``seed``, ``device``, ``fail_at_epoch``; a space
may not set them (a pipeline sets ``device``/``fail_at_epoch`` through its ``train`` block).

YAML note: PyYAML reads ``1e-6`` (no dot) as a string; numeric strings in bounds, steps,
choices, conditions and fixed values are converted to numbers (``inf`` too).

Loading checks the whole file (unknown keys and types, bounds, conditions, names) and
that every bound and choice is a valid TrainConfig value for the optimizer; each problem
is a one-line :class:`~dpivon.errors.DpivonError` naming the file and the parameter.
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from dpivon.config import (
    OPTIMIZER_NAMES,
    TrainConfig,
    format_validation_error,
    read_yaml_mapping,
)
from dpivon.errors import DpivonError

if TYPE_CHECKING:
    import optuna

__all__ = [
    "PIPELINE_OWNED_FIELDS",
    "CategoricalParam",
    "FloatParam",
    "IntParam",
    "SearchSpace",
    "drop_union_tags",
    "load_search_space",
    "numeric",
]

# TrainConfig fields a pipeline sets for every trial; search spaces may not sample or fix them.
PIPELINE_OWNED_FIELDS: tuple[str, ...] = (
    "optimizer",
    "epsilon",
    "delta",
    "accountant",
    "dataset",
    "data_path",
    "model",
    "epochs",
    "seed",
    "data_seed",
    "secure_mode",
    "device",
    "fail_at_epoch",
    "val_size",
    "per_class",
    "synthetic_size",
)

_INT = re.compile(r"[-+]?\d+")
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_INF = re.compile(r"[-+]?\.?inf(inity)?", re.IGNORECASE)


def numeric(value: Any) -> Any:
    """A numeric string (``"1e-6"``, ``"128"``, ``"inf"``) as a number; anything else as is.

    Lists are converted element-wise. PyYAML reads ``1e-6`` as a string (YAML 1.1 needs a
    dot), so every number a user writes in a space or pipeline file passes through here.
    """
    if isinstance(value, list):
        return [numeric(v) for v in value]
    if isinstance(value, str):
        text = value.strip()
        if _INT.fullmatch(text):
            return int(text)
        if _FLOAT.fullmatch(text):
            return float(text)
        if _INF.fullmatch(text):
            return float(text.replace(".", ""))
    return value


Float = Annotated[StrictFloat, BeforeValidator(numeric)]
Int = Annotated[StrictInt, BeforeValidator(numeric)]


def _scalar(value: Any) -> Any:
    value = numeric(value)
    if value is not None and not isinstance(value, bool | int | float | str):
        raise ValueError(f"must be a number, string, boolean or null, got {value!r}")
    return value


Scalar = Annotated[Any, BeforeValidator(_scalar)]
ConditionValues = Annotated[
    list[Scalar], BeforeValidator(lambda v: v if isinstance(v, list) else [v])
]


class _Param(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    when: dict[str, ConditionValues] | None = None

    def spec(self) -> dict[str, Any]:
        """The parameter as plain data, ``when`` last (as it is usually written)."""
        data = self.model_dump(exclude_none=True)
        when = data.pop("when", None)
        return data if when is None else {**data, "when": when}


def _check_bounds(low: float, high: float, log: bool, step: float | None) -> None:
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"low and high must be finite, got {low} and {high}")
    if not low < high:
        raise ValueError(
            f"low must be below high, got low={low}, high={high} "
            "(for a single value write the value itself instead of a range)"
        )
    if log and low <= 0:
        raise ValueError(f"log: true needs low > 0, got low={low}")
    if step is not None:
        if step <= 0:
            raise ValueError(f"step must be > 0, got {step}")
        if log:
            raise ValueError("step and log: true exclude each other; drop one")
        n = (high - low) / step
        if abs(n - round(n)) > 1e-9 * max(1.0, abs(n)):
            raise ValueError(
                f"high - low ({high - low:g}) must be a multiple of step ({step:g}); adjust high"
            )


class FloatParam(_Param):
    type: Literal["float"]
    low: Float
    high: Float
    log: bool = False
    step: Float | None = None

    @model_validator(mode="after")
    def _check(self) -> FloatParam:
        _check_bounds(self.low, self.high, self.log, self.step)
        return self

    def suggest(self, trial: Any, name: str) -> float:
        return trial.suggest_float(name, self.low, self.high, step=self.step, log=self.log)

    def extremes(self) -> list[Any]:
        return [self.low, self.high]

    def contains(self, value: Any) -> bool:
        return (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and self.low <= value <= self.high
        )


class IntParam(_Param):
    type: Literal["int"]
    low: Int
    high: Int
    log: bool = False
    step: Int = 1

    @model_validator(mode="after")
    def _check(self) -> IntParam:
        if self.log and self.step != 1:
            raise ValueError(f"log: true needs step 1 (as in Optuna), got step {self.step}")
        _check_bounds(self.low, self.high, self.log, None if self.log else self.step)
        return self

    def suggest(self, trial: Any, name: str) -> int:
        return trial.suggest_int(name, self.low, self.high, step=self.step, log=self.log)

    def extremes(self) -> list[Any]:
        return [self.low, self.high]

    def values(self) -> list[Any]:
        return list(range(self.low, self.high + 1, self.step))

    def contains(self, value: Any) -> bool:
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and self.low <= value <= self.high
            and (value - self.low) % self.step == 0
        )


class CategoricalParam(_Param):
    type: Literal["categorical"]
    choices: list[Scalar] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> CategoricalParam:
        keys = [_choice_key(c) for c in self.choices]
        if len(set(keys)) != len(keys):
            raise ValueError(f"choices must be distinct, got {self.choices}")
        return self

    def suggest(self, trial: Any, name: str) -> Any:
        return trial.suggest_categorical(name, list(self.choices))

    def extremes(self) -> list[Any]:
        return list(self.choices)

    def values(self) -> list[Any]:
        return list(self.choices)

    def contains(self, value: Any) -> bool:
        return _choice_key(value) in {_choice_key(c) for c in self.choices}


def _choice_key(value: Any) -> tuple[str, Any]:
    """Distinguishes True from 1 and 1 from 1.0 only where YAML does (bool vs number)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (type(value).__name__, value)
    return ("number", float(value))


SampledParam = FloatParam | IntParam | CategoricalParam
_PARAM = TypeAdapter(Annotated[SampledParam, Field(discriminator="type")])
_PARAM_TYPES = ("float", "int", "categorical")


class _SpaceFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    optimizer: str
    params: dict[str, Any] = Field(min_length=1)


class SearchSpace:
    """A validated search space for one optimizer; build it with :func:`load_search_space`."""

    def __init__(
        self,
        optimizer: str,
        fixed: dict[str, Any],
        sampled: dict[str, SampledParam],
        order: list[str],
        path: Path | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.path = path
        self._fixed = dict(fixed)
        self._sampled = dict(sampled)
        self._order = list(order)
        referenced = {n for p in self._sampled.values() for n in (p.when or {})}
        fields = set(TrainConfig.model_fields)
        self.switches: frozenset[str] = frozenset(
            n for n in self._sampled if n not in fields and n in referenced
        )

    # -- inspection --------------------------------------------------------------------------

    @property
    def fixed(self) -> dict[str, Any]:
        """The fixed (not sampled) values, in declaration order."""
        return dict(self._fixed)

    @property
    def sampled(self) -> dict[str, SampledParam]:
        """The sampled parameters (switches included), in declaration order."""
        return dict(self._sampled)

    @property
    def names(self) -> list[str]:
        """All parameter names, fixed and sampled, in declaration order."""
        return list(self._order)

    def max_value(self, name: str) -> Any:
        """The largest value ``name`` can take in a trial (``None`` if the space lacks it)."""
        if name in self._fixed:
            return self._fixed[name]
        if name in self._sampled:
            values = [v for v in self._sampled[name].extremes() if isinstance(v, int | float)]
            return max(values) if values else None
        return None

    def all_values(self, name: str) -> list[Any] | None:
        """Every value a discrete ``name`` can take in a trial (``None`` if the space lacks it).

        The tuning-privacy bound needs the whole set (not the values drawn): each batch size
        is its own candidate mechanism. A continuous parameter has no such list: TypeError.
        """
        if name in self._fixed:
            return [self._fixed[name]]
        if name not in self._sampled:
            return None
        param = self._sampled[name]
        if not hasattr(param, "values"):
            raise TypeError(f"{name} is a continuous parameter; it has no finite set of values")
        return param.values()

    def to_dict(self) -> dict[str, Any]:
        """The space as plain data (JSON/YAML-safe), for logging it with the sweep."""
        params: dict[str, Any] = {}
        for name in self._order:
            params[name] = self._fixed[name] if name in self._fixed else self._sampled[name].spec()
        return {
            "optimizer": self.optimizer,
            "path": None if self.path is None else str(self.path),
            "params": params,
        }

    # -- sampling ----------------------------------------------------------------------------

    def _active(self, name: str, values: dict[str, Any]) -> bool:
        when = self._sampled[name].when
        if not when:
            return True
        for ref, allowed in when.items():
            if ref not in values:  # the referenced parameter is itself inactive
                return False
            key = _choice_key(values[ref])
            if key not in {_choice_key(a) for a in allowed}:
                return False
        return True

    def define_by_run(self, trial: optuna.trial.Trial) -> dict[str, Any]:
        """Suggest every active sampled parameter on ``trial``; return the fixed values.

        The define-by-run function for Ray's ``OptunaSearch(space=...)`` (which passes a
        wrapper with the same ``suggest_*`` methods) or for a plain ``study.ask()`` trial.
        Ray merges the returned constants with the suggested values into the trial config.
        """
        values: dict[str, Any] = {}
        for name in self._order:
            if name in self._fixed:
                values[name] = self._fixed[name]
            elif self._active(name, values):
                values[name] = self._sampled[name].suggest(trial, name)
        return dict(self._fixed)

    def trial_config(self, sampled: dict[str, Any]) -> dict[str, Any]:
        """The TrainConfig keys of one trial: ``optimizer`` + fixed + active sampled values.

        ``sampled`` is what was drawn (Optuna's ``trial.params``, or Ray's trial config,
        which also holds the fixed values). Switches are dropped; values of inactive
        conditional parameters are ignored. Keys that are not parameters of this space and
        missing active parameters are errors.
        """
        unknown = [k for k in sampled if k not in self._fixed and k not in self._sampled]
        if unknown:
            raise DpivonError(
                f"trial values {', '.join(map(repr, unknown))} are not parameters of the "
                f"{self.optimizer} search space {self.path}; sample trials from this space"
            )
        values: dict[str, Any] = {}
        for name in self._order:
            if name in self._fixed:
                values[name] = self._fixed[name]
            elif self._active(name, values):
                if name not in sampled:
                    raise DpivonError(
                        f"trial values lack {name!r} of the {self.optimizer} search space "
                        f"{self.path}; sample trials from this space"
                    )
                values[name] = sampled[name]
        config = {k: v for k, v in values.items() if k not in self.switches}
        return {"optimizer": self.optimizer, **config}

    # -- validation ----------------------------------------------------------------------------

    def bound_configs(self) -> list[tuple[str, dict[str, Any]]]:
        """(description, TrainConfig keys) pairs covering every bound and choice.

        Each parameter's every extreme value alone, then all parameters at their first
        extreme (low / first choice) and at their last (high / last choice) together;
        conditions are ignored (every parameter counted as active), switches dropped.
        """
        names = [n for n in self._order if n not in self.switches]
        extremes = {
            n: [self._fixed[n]] if n in self._fixed else self._sampled[n].extremes() for n in names
        }
        configs = [
            (f"params.{n} = {v!r}", {"optimizer": self.optimizer, n: v})
            for n in names
            for v in extremes[n]
        ]
        for label, index in (("low", 0), ("high", -1)):
            combo = {n: extremes[n][index] for n in names}
            configs.append(
                (
                    f"all parameters at their {label} values {combo}",
                    {"optimizer": self.optimizer, **combo},
                )
            )
        return configs


def drop_union_tags(message: str, tags: tuple[str, ...]) -> str:
    """Drop the tags pydantic puts into the locations of a discriminated union's errors.

    ``message`` is :func:`~dpivon.config.format_validation_error`'s "loc: msg; loc: msg".
    """
    parts = []
    for part in message.split("; "):
        loc, sep, text = part.partition(": ")
        if sep and " " not in loc:
            kept = [x for x in loc.split(".") if x not in tags]
            part = f"{'.'.join(kept)}: {text}" if kept else text
        parts.append(part)
    return "; ".join(parts)


def load_search_space(path: str | Path) -> SearchSpace:
    """Read and validate a search-space YAML file (format: see the module docstring)."""
    path = Path(path)
    data = read_yaml_mapping(path)
    where = f"search space {path}"
    try:
        raw = _SpaceFile.model_validate(data)
    except ValidationError as err:
        raise DpivonError(f"invalid {where}: {format_validation_error(err)}") from None
    if raw.optimizer not in OPTIMIZER_NAMES:
        raise DpivonError(
            f"invalid {where}: optimizer {raw.optimizer!r} is unknown; "
            f"choose one of: {', '.join(OPTIMIZER_NAMES)}"
        )

    fixed: dict[str, Any] = {}
    sampled: dict[str, SampledParam] = {}
    order: list[str] = []
    for name, value in raw.params.items():
        name = str(name)
        if isinstance(value, dict):
            if "type" not in value:
                raise DpivonError(
                    f"invalid {where}: params.{name}: a mapping needs a type "
                    f"({', '.join(_PARAM_TYPES)}); a fixed value must not be a mapping"
                )
            try:
                param = _PARAM.validate_python(value)
            except ValidationError as err:
                message = drop_union_tags(format_validation_error(err), _PARAM_TYPES)
                raise DpivonError(f"invalid {where}: params.{name}: {message}") from None
            _check_condition(where, name, param, sampled, fixed, list(raw.params))
            sampled[name] = param
        else:
            fixed[name] = numeric(value)
        order.append(name)

    _check_names(where, fixed, sampled)
    space = SearchSpace(raw.optimizer, fixed, sampled, order, path=path)
    for description, config in space.bound_configs():
        try:
            TrainConfig.model_validate(config)
        except ValidationError as err:
            raise DpivonError(
                f"invalid {where}: {description} is not a valid {raw.optimizer} setting: "
                f"{format_validation_error(err)}; change that bound or choice"
            ) from None
    return space


def _check_condition(
    where: str,
    name: str,
    param: SampledParam,
    sampled: dict[str, SampledParam],
    fixed: dict[str, Any],
    all_names: list[str],
) -> None:
    for ref, allowed in (param.when or {}).items():
        prefix = f"invalid {where}: params.{name}.when.{ref}"
        if ref == name:
            raise DpivonError(f"{prefix}: a parameter cannot depend on itself")
        if ref in fixed:
            raise DpivonError(
                f"{prefix}: {ref!r} is a fixed value, so the condition is constant; "
                "drop the when or make it categorical"
            )
        if ref not in sampled:
            known = ref in all_names
            raise DpivonError(
                f"{prefix}: {ref!r} is "
                + ("declared later" if known else "not a parameter of this space")
                + f"; a when may only name a parameter declared above {name!r}"
            )
        target = sampled[ref]
        if isinstance(target, FloatParam):
            raise DpivonError(
                f"{prefix}: {ref!r} is a float range, which never equals a given value; "
                "condition on a categorical or int parameter"
            )
        if not allowed:
            raise DpivonError(f"{prefix}: give at least one value")
        never = [a for a in allowed if not target.contains(a)]
        if never:
            raise DpivonError(
                f"{prefix}: {ref!r} never takes {', '.join(map(repr, never))}; use values "
                f"it can take"
            )


def _check_names(where: str, fixed: dict[str, Any], sampled: dict[str, SampledParam]) -> None:
    fields = set(TrainConfig.model_fields)
    referenced = {n for p in sampled.values() for n in (p.when or {})}
    for name in [*fixed, *sampled]:
        prefix = f"invalid {where}: params.{name}"
        if name in PIPELINE_OWNED_FIELDS:
            raise DpivonError(
                f"{prefix}: {name} is set by the pipeline, not by a search space; remove it "
                "here (a pipeline sets device/fail_at_epoch under train:)"
            )
        if name in fields:
            continue
        if name in referenced and isinstance(sampled.get(name), CategoricalParam):
            continue  # a switch
        if name in referenced:
            raise DpivonError(
                f"{prefix}: {name!r} is not a TrainConfig field, so it can only be a switch, "
                "and a switch must be categorical"
            )
        settable = sorted(fields - set(PIPELINE_OWNED_FIELDS))
        close = difflib.get_close_matches(name, settable, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"fields: {', '.join(settable)}"
        raise DpivonError(
            f"{prefix}: {name!r} is not a TrainConfig field (nor a categorical switch named "
            f"by a when); {hint}"
        )
