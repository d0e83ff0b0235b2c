"""Search spaces: fixed TrainConfig values and Optuna distributions, sampled define-by-run,
one YAML file per optimizer; the format, key by key, is docs/search-space-format.md.
Loading checks the whole file and that every bound and choice is a valid TrainConfig value
for the optimizer, each problem one line naming the file and the parameter.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationError,
)

from dpivon.config import TrainConfig, config_key, format_validation_error, read_yaml_mapping
from dpivon.errors import DpivonError
from dpivon.optim.registry import OPTIMIZER_NAMES

# Optuna samples integers through floats, which hold them exactly up to 2**53 only.
_IntBound = Annotated[StrictInt, Field(ge=-(2**53), le=2**53)]
_FloatBound = Annotated[StrictFloat, Field(allow_inf_nan=False)]


# Values in messages, cut short: a YAML alias can make a list of millions of items.
_shown = reprlib.Repr()
_shown.maxdict, _shown.maxlist, _shown.maxlevel = 32, 4, 2


def _scalar(value: Any) -> Any:
    if value is not None and not isinstance(value, bool | int | float | str):
        raise ValueError(f"must be a number, string, boolean or null, got {_shown.repr(value)}")
    return value


_Choice = Annotated[Any, BeforeValidator(_scalar)]
_Choices = Annotated[list[_Choice], BeforeValidator(lambda v: v if isinstance(v, list) else [v])]


class _Spec(BaseModel):
    """One mapping of the file; strict: no ``yes`` or ``"3"`` passes for a number."""

    model_config = ConfigDict(extra="forbid", strict=True)
    when: dict[str, _Choices] = {}


class _Float(_Spec):
    low: _FloatBound
    high: _FloatBound
    log: bool = False
    step: _FloatBound | None = None
    distribution = property(lambda s: FloatDistribution(s.low, s.high, s.log, s.step))


class _Int(_Spec):
    low: _IntBound
    high: _IntBound
    log: bool = False
    step: _IntBound = 1
    distribution = property(lambda s: IntDistribution(s.low, s.high, s.log, s.step))


class _Categorical(_Spec):
    choices: list[_Choice] = Field(min_length=1)
    distribution = property(lambda s: CategoricalDistribution(s.choices))


_SPECS: dict[str, type[_Spec]] = {"float": _Float, "int": _Int, "categorical": _Categorical}


def _choice_key(value: Any) -> tuple[str, Any]:
    """Tells True from 1 (YAML does), not 1 from 1.0 (equal numbers hash alike)."""
    return (type(value).__name__ if isinstance(value, bool | str) else "number", value)


def _takes(dist: CategoricalDistribution | IntDistribution, value: Any) -> bool:
    if isinstance(dist, CategoricalDistribution):
        return _choice_key(value) in {_choice_key(c) for c in dist.choices}
    grid = range(dist.low, dist.high + 1, dist.step)
    return isinstance(value, int) and not isinstance(value, bool) and value in grid


def _inside(dist: BaseDistribution, value: Any) -> bool:
    """Whether ``dist`` can draw ``value`` (a float range: within bounds, on its step)."""
    if not isinstance(dist, FloatDistribution):
        return _takes(dist, value)
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    if not dist.low <= value <= dist.high:
        return False
    return dist.step is None or math.isclose(
        (value - dist.low) / dist.step, round((value - dist.low) / dist.step)
    )


def _extremes(param: Any) -> list[Any]:
    """A parameter's first and last values: its bounds, choices, or fixed value."""
    if isinstance(param, CategoricalDistribution):
        return list(param.choices)
    return [param.low, param.high] if isinstance(param, BaseDistribution) else [param]


def _at_extreme(index: int, held: tuple[str, Any] | None) -> Callable[[str, Any], Any]:
    """A draw that takes every parameter's extreme ``index`` (0: low, -1: high), except the
    one ``held`` (name, value) at its value."""

    def draw(name: str, param: Any) -> Any:
        return held[1] if held is not None and name == held[0] else _extremes(param)[index]

    return draw


@dataclass(frozen=True)
class SearchSpace:
    """A validated search space for one optimizer; build it with :func:`load_search_space`."""

    optimizer: str
    params: dict[str, Any]  # name -> fixed value or distribution, in declaration order
    conditions: dict[str, dict[str, list[Any]]]  # name -> its when (the names that have one)
    keys: dict[str, str]  # name -> the TrainConfig key it sets; switches have none
    path: Path | None = None
    start_points: tuple[dict[str, Any], ...] = ()  # tried first, in order (``start:``)

    @property
    def dimension(self) -> int:
        """How many parameters are searched (sampled ones, switches included)."""
        return len(self.distributions)

    @property
    def fixed(self) -> dict[str, Any]:
        return {n: p for n, p in self.params.items() if not isinstance(p, BaseDistribution)}

    @property
    def distributions(self) -> dict[str, BaseDistribution]:
        """The sampled parameters, switches included."""
        return {n: p for n, p in self.params.items() if isinstance(p, BaseDistribution)}

    @property
    def switches(self) -> frozenset[str]:
        return frozenset(self.params.keys() - self.keys.keys())

    @property
    def names(self) -> list[str]:
        """The TrainConfig keys the space sets, fixed or sampled."""
        return list(self.keys.values())

    def _param(self, key: str) -> Any:
        return next((self.params[n] for n, k in self.keys.items() if k == key), None)

    def max_value(self, key: str) -> Any:
        """The largest value TrainConfig key ``key`` takes in a trial (None if not set)."""
        numbers = [v for v in _extremes(self._param(key)) if type(v) in (int, float)]  # no bool
        return max(numbers, default=None)

    def all_values(self, key: str) -> list[Any] | None:
        """Every value TrainConfig key ``key`` takes in a trial (None if not set): the
        tuning-privacy bound needs each batch size. TypeError for a float range."""
        param = self._param(key)
        if isinstance(param, FloatDistribution):
            raise TypeError(f"{key} is a continuous parameter; it has no finite set of values")
        if isinstance(param, IntDistribution):
            return list(range(param.low, param.high + 1, param.step))
        return _extremes(param) if key in self.names else None

    def to_dict(self) -> dict[str, Any]:
        """The space as plain data (JSON/YAML-safe), for logging it with the sweep."""
        params: dict[str, Any] = {}
        for name, param in self.params.items():
            if isinstance(param, CategoricalDistribution):
                params[name] = {"type": "categorical", "choices": list(param.choices)}
            elif isinstance(param, BaseDistribution):
                kind = "int" if isinstance(param, IntDistribution) else "float"
                bounds = {k: getattr(param, k) for k in ("low", "high", "log", "step")}
                params[name] = {"type": kind, **bounds}
            else:
                params[name] = param
            if name in self.conditions:
                params[name]["when"] = self.conditions[name]
        path = None if self.path is None else str(self.path)
        start = [dict(point) for point in self.start_points]
        return {"optimizer": self.optimizer, "path": path, "params": params, "start": start}

    def _active_values(self, draw: Any) -> dict[str, Any]:
        """Fixed values and ``draw(name, distribution)`` of each active sampled parameter."""
        values: dict[str, Any] = {}
        for name, param in self.params.items():
            if not isinstance(param, BaseDistribution):
                values[name] = param
            elif all(
                ref in values  # else the referenced parameter is itself inactive
                and _choice_key(values[ref]) in {_choice_key(a) for a in allowed}
                for ref, allowed in self.conditions.get(name, {}).items()
            ):
                values[name] = draw(name, param)
        return values

    def define_by_run(self, trial: optuna.trial.Trial) -> dict[str, Any]:
        """Suggest every active distribution on ``trial``; return the fixed values.

        The define-by-run function for Ray's ``OptunaSearch(space=...)``, which records only
        ``suggest_*`` calls (Ray merges the returned constants into the trial config), or
        for a plain ``study.ask()`` trial.
        """
        self._active_values(lambda name, dist: _suggest(trial, name, dist))
        return self.fixed

    def trial_config(self, sampled: dict[str, Any]) -> dict[str, Any]:
        """The TrainConfig keys of one trial: ``optimizer`` + fixed + active sampled values.

        ``sampled`` is what was drawn (Optuna's ``trial.params``, or Ray's trial config,
        which also holds the fixed values). Switches are dropped, values of inactive
        parameters ignored; unknown keys and missing active parameters are errors.
        """
        where = f"the {self.optimizer} search space {self.path}; sample trials from this space"
        unknown = [k for k in sampled if k not in self.params]
        if unknown:
            listed = ", ".join(map(repr, unknown))
            raise DpivonError(f"trial values {listed} are not parameters of {where}")

        def drawn(name: str, _: BaseDistribution) -> Any:
            if name not in sampled:
                raise DpivonError(f"trial values lack {name!r} of {where}")
            return sampled[name]

        values = self._active_values(drawn)
        return {"optimizer": self.optimizer} | {
            self.keys[n]: v for n, v in values.items() if n in self.keys
        }

    def bound_configs(self) -> list[tuple[str, dict[str, Any]]]:
        """(description, TrainConfig keys) pairs covering every bound and choice.

        Each parameter's every extreme value alone; then every parameter at its first
        extreme (low / first choice) and at its last (high / last choice) together, and the
        same two with each categorical (switches included) held at each of its choices, so
        that every branch meets every other parameter's bounds; the conditions applied as in
        a trial (a combination no trial can draw is not refused); switches dropped.
        """
        extremes = {key: _extremes(self.params[name]) for name, key in self.keys.items()}
        configs = [
            (f"params.{k} = {_shown.repr(v)}", {k: v}) for k, vs in extremes.items() for v in vs
        ]
        branches: list[tuple[str, Any] | None] = [None] + [
            (name, choice)
            for name, param in self.params.items()
            if isinstance(param, CategoricalDistribution)
            for choice in param.choices
        ]
        for branch in branches:
            for label, index in (("low", 0), ("high", -1)):
                active = self._active_values(_at_extreme(index, branch))
                combo = {self.keys[name]: v for name, v in active.items() if name in self.keys}
                held = "" if branch is None else f"{branch[0]} = {_shown.repr(branch[1])} and "
                configs.append(
                    (f"{held}all parameters at their {label} values {_shown.repr(combo)}", combo)
                )
        return [(d, {"optimizer": self.optimizer, **c}) for d, c in configs]


def _suggest(trial: optuna.trial.Trial, name: str, dist: BaseDistribution) -> Any:
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)


class _SpaceFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    optimizer: str
    params: dict[str, Any] = Field(min_length=1)
    start: list[dict[str, Any]] = []


def load_search_space(path: str | Path) -> SearchSpace:
    """Read and validate a search-space YAML file (format: see the module docstring)."""
    path = Path(path)
    where = f"invalid search space {path}"
    try:
        raw = _SpaceFile.model_validate(read_yaml_mapping(path))
    except ValidationError as err:
        raise DpivonError(f"{where}: {format_validation_error(err)}") from None
    if raw.optimizer not in OPTIMIZER_NAMES:
        raise DpivonError(
            f"{where}: optimizer {raw.optimizer!r} is unknown; "
            f"choose one of: {', '.join(OPTIMIZER_NAMES)}"
        )
    params: dict[str, Any] = {}
    conditions: dict[str, dict[str, list[Any]]] = {}
    for name, value in raw.params.items():
        if not isinstance(value, dict):
            params[name] = value
            continue
        params[name], when = _distribution(f"{where}: params.{name}", value)
        for ref, allowed in when.items():
            at = f"{where}: params.{name}.when.{ref}"
            _check_condition(at, name, ref, allowed, params, raw.params)
        if when:
            conditions[name] = when
    referenced = {ref for when in conditions.values() for ref in when}
    keys = {}
    for name, param in params.items():
        prefix = f"{where}: params.{name}"
        try:
            keys[name] = config_key(name)
        except ValueError as err:
            if name not in referenced:
                raise DpivonError(f"{prefix}: {err}, nor a switch that a when names") from None
            if not isinstance(param, CategoricalDistribution):
                raise DpivonError(f"{prefix}: {err}; a switch must be categorical") from None
            continue
        earlier = next((n for n in keys if n != name and keys[n] == keys[name]), None)
        if earlier is not None:
            raise DpivonError(
                f"{prefix}: {name} and {earlier} both set {keys[name]}; a space sets each "
                "field once, under one name"
            )
    space = SearchSpace(raw.optimizer, params, conditions, keys, path)
    for description, config in space.bound_configs():
        try:
            TrainConfig.model_validate(config)
        except ValidationError as err:
            raise DpivonError(
                f"{where}: {description} is not a valid {raw.optimizer} setting: "
                f"{format_validation_error(err)}; change that bound or choice"
            ) from None
    for i, point in enumerate(raw.start):
        _check_start_point(f"{where}: start.{i}", space, point)
    return dataclasses.replace(space, start_points=tuple(raw.start))


def _check_start_point(prefix: str, space: SearchSpace, point: dict[str, Any]) -> None:
    """A point to try first: a value inside its distribution for every active sampled
    parameter, nothing for a fixed or inactive one, and a valid TrainConfig."""
    for name, value in point.items():
        dist = space.params.get(name)
        if not isinstance(dist, BaseDistribution):
            what = "a fixed value" if name in space.params else "not a parameter of this space"
            raise DpivonError(
                f"{prefix}.{name}: {name!r} is {what}; a start point sets sampled parameters only"
            )
        if not _inside(dist, value):
            raise DpivonError(
                f"{prefix}.{name}: {_shown.repr(value)} is outside {name}'s "
                f"distribution {dist}; move the point inside the space or widen it"
            )
    active = space._active_values(lambda name, _: point.get(name))
    missing = [n for n in space.distributions if n in active and n not in point]
    inactive = [n for n in point if n not in active]
    if missing or inactive:
        problem = (
            f"gives no value for the active {', '.join(missing)}"
            if missing
            else f"sets {', '.join(inactive)}, inactive at this point (its when is not met)"
        )
        raise DpivonError(f"{prefix}: the point {problem}")
    try:
        TrainConfig.model_validate(space.trial_config(point))
    except ValidationError as err:
        raise DpivonError(
            f"{prefix}: not a valid {space.optimizer} setting: {format_validation_error(err)}"
        ) from None


def _distribution(prefix: str, value: dict[str, Any]) -> tuple[BaseDistribution, dict]:
    """The distribution one mapping of the file describes, and its ``when``."""
    kind = value.get("type")
    spec_type = _SPECS.get(kind) if isinstance(kind, str) else None
    if spec_type is None:
        got = "a mapping needs a type"
        if "type" in value:
            got = f"type {_shown.repr(kind)} is unknown"
        kinds = ", ".join(_SPECS)
        raise DpivonError(f"{prefix}: {got} ({kinds}); a fixed value must not be a mapping")
    try:
        spec = spec_type.model_validate({k: v for k, v in value.items() if k != "type"})
    except ValidationError as err:
        raise DpivonError(f"{prefix}: {format_validation_error(err)}") from None
    if "when" in value and not spec.when:
        raise DpivonError(f"{prefix}: when is empty; name a parameter and its values, or drop it")
    if isinstance(spec, _Categorical):
        if len({_choice_key(c) for c in spec.choices}) != len(spec.choices):
            got = _shown.repr(spec.choices)
            raise DpivonError(f"{prefix}: choices must be distinct, got {got}")
    elif not spec.low < spec.high:
        got = f"low={spec.low}, high={spec.high}"
        raise DpivonError(f"{prefix}: low must be below high, got {got} (or write one value)")
    elif not math.isfinite(spec.high - spec.low):
        raise DpivonError(f"{prefix}: high - low overflows a float; narrow the range")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # that Optuna lowers high: an error below
            dist = spec.distribution
    except ValueError as err:
        raise DpivonError(f"{prefix}: {err}") from None
    except ArithmeticError:  # Optuna's Decimal arithmetic runs out of digits
        raise DpivonError(f"{prefix}: step {spec.step} is too fine for the range") from None
    if not isinstance(dist, CategoricalDistribution) and dist.high != spec.high:
        raise DpivonError(
            f"{prefix}: high - low ({spec.high - spec.low:g}) must be a multiple of step "
            f"({spec.step:g}); adjust high"
        )
    return dist, spec.when


def _check_condition(
    prefix: str, name: str, ref: str, allowed: list[Any], params: dict, names: dict
) -> None:
    """``params`` holds the parameters declared before ``name``, ``names`` all of them."""
    target = params.get(ref)
    if ref == name:
        problem = "a parameter cannot depend on itself"
    elif ref not in params:
        later = "declared later" if ref in names else "not a parameter of this space"
        problem = f"{ref!r} is {later}; a when may only name a parameter declared above {name!r}"
    elif not isinstance(target, BaseDistribution):
        problem = f"{ref!r} is a fixed value, so the condition is constant; drop the when"
    elif isinstance(target, FloatDistribution):
        problem = f"{ref!r} is a float range, which never equals a value; use a categorical"
    elif not allowed:
        problem = "give at least one value"
    elif never := [a for a in allowed if not _takes(target, a)]:
        problem = f"{ref!r} never takes {_shown.repr(never)[1:-1]}; use values it can take"
    else:
        return
    raise DpivonError(f"{prefix}: {problem}")
