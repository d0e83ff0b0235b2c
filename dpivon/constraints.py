"""Range constraints for config fields, declared on the field and reported in one line.

``lr: Annotated[float, Bound(gt=0)]`` rejects 0 with "lr must be > 0, got 0": the message
names the field and the whole interval (``beta2 must be in [0, 1), got 1.5``), which
pydantic's own ``Field(gt=...)`` messages ("Input should be greater than 0") do not.
`check_bound` applies a type's interval to a plain argument (a function that takes no
config), with the same rule and message.

A float must be finite unless its interval says what infinity means (``infinite=True``:
an epsilon of .inf is no noise): .inf or .nan elsewhere (a weight decay, a floor) would
train to NaN metrics instead of failing. An upper bound on a count may state what a value
costs (``cost``), so that the message says why it is refused: "ece_bins=10^12 would need
80 TB per reliability diagram; at most 10,000".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, StrictBool, StrictFloat, StrictInt, ValidationInfo

from dpivon.errors import DpivonError


@dataclass(frozen=True)
class _Interval:
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    shown: str | None = None  # the interval as the message shows it, e.g. "[0, 2**32)"
    why: str | None = None  # why the bound is there, for the message
    infinite: bool = False  # +-inf is a value with a meaning (the interval decides its sign)
    cost: Callable[[Any], str] | None = None  # what a value above the bound would take

    def text(self) -> str:
        if self.shown is not None:
            return self.shown
        low = self.gt if self.gt is not None else self.ge
        high = self.lt if self.lt is not None else self.le
        if high is None:
            return f"{'>' if self.gt is not None else '>='} {low:g}"
        if low is None:
            return f"{'<' if self.lt is not None else '<='} {high:g}"
        opening = "(" if self.gt is not None else "["
        closing = ")" if self.lt is not None else "]"
        return f"in {opening}{low:g}, {high:g}{closing}"

    def holds(self, value: float) -> bool:
        if isinstance(value, float) and not self._finite_or_meant(value):
            return False
        return self._within(value)

    def _finite_or_meant(self, value: float) -> bool:
        return math.isfinite(value) or (self.infinite and not math.isnan(value))

    def _within(self, value: float) -> bool:
        return not (
            (self.gt is not None and not value > self.gt)
            or (self.ge is not None and not value >= self.ge)
            or (self.lt is not None and not value < self.lt)
            or (self.le is not None and not value <= self.le)
        )

    def check(self, name: str | None, value: Any) -> None:
        if value is None or self.holds(value):
            return
        high = self.lt if self.lt is not None else self.le
        above = high is not None and not value <= high  # NaN too: no side holds it
        why = f" ({self.why})" if self.why and above else ""  # what the upper bound protects
        if self.cost is not None and high is not None and self._within(high) and value > high:
            raise DpivonError(f"{name}={value:,} would {self.cost(value)}; at most {high:,}{why}")
        rule = self.text()
        if isinstance(value, float) and not math.isfinite(value) and not rule.startswith("finite"):
            rule = f"a finite number {rule}"  # inf passes ">= 0" as the reader sees it
        raise DpivonError(f"{name} must be {rule}{why}, got {value!r}")

    def __call__(self, value: Any, info: ValidationInfo) -> Any:
        self.check(info.field_name, value)
        return value


def Bound(
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    shown: str | None = None,
    why: str | None = None,
    infinite: bool = False,
    cost: Callable[[Any], str] | None = None,
) -> AfterValidator:
    """A field's interval; None passes (an unset option that takes a default). ``why``
    says in the message what an upper bound protects, ``cost`` what a value above it would
    take ("need 80 TB"); ``infinite``: .inf is a value of the field (else it is refused)."""
    return AfterValidator(_Interval(gt, ge, lt, le, shown, why, infinite, cost))


def size_text(size: float) -> str:
    """A byte count as people write it: ``size_text(8e12)`` is "8 TB"."""
    units = ("bytes", "KB", "MB", "GB", "TB", "PB")
    for unit in units[:-1]:
        if size < 1000:
            return f"{size:,.0f} {unit}"
        size /= 1000
    return f"{size:,.0f} {units[-1]}"


# Strict types: YAML reads `yes` as True and pydantic would take it for the number 1.
Float = StrictFloat
Int = StrictInt
Bool = StrictBool
PositiveFloat = Annotated[StrictFloat, Bound(gt=0)]
# A clip norm or a learning rate: inf would mean no clipping (unbounded sensitivity) or a
# step that diverges at once, so neither can train a private model.
FinitePositiveFloat = Annotated[StrictFloat, Bound(gt=0, lt=math.inf, shown="finite and > 0")]
# A scale an optimizer multiplies or adds to tensors (a step size, a weight decay, a Hessian
# init or floor, a clip norm): near float32's 3.4e38 its arithmetic overflows (Adam's first
# step is lr / (1 - beta1): an lr of 3.4e37 did), and none is useful above 10^6.
_SCALE_BOUND = {"le": 1e6, "why": "larger values overflow float32 arithmetic"}
PositiveScale = Annotated[StrictFloat, Bound(gt=0, **_SCALE_BOUND)]
NonNegativeScale = Annotated[StrictFloat, Bound(ge=0, **_SCALE_BOUND)]
# A fixed noise multiplier: near 10^154 the RDP accountant's sigma^2 overflows, and at 10^6
# every budget's epsilon is already below 10^-9.
NoiseMultiplier = Annotated[
    StrictFloat, Bound(gt=0, le=1e6, why="beyond it the accountant's arithmetic overflows")
]
NonNegativeFloat = Annotated[StrictFloat, Bound(ge=0)]
Rate = Annotated[StrictFloat, Bound(ge=0, lt=1)]  # a moving-average rate / momentum
# IVON's beta2, the rate of h's moving average: 1 keeps h at hess_init (a frozen curvature,
# the ablation of learning it), which a moving average of anything else has no use for.
CurvatureRate = Annotated[StrictFloat, Bound(ge=0, le=1, shown="in [0, 1] (1: a frozen h)")]
Probability = Annotated[StrictFloat, Bound(gt=0, lt=1)]
Count = Annotated[StrictInt, Bound(ge=1)]
# A random seed: numpy's and torch's generators take 32 bits (a larger one overflows there)
Seed = Annotated[StrictInt, Bound(ge=0, lt=2**32, shown="in [0, 2**32)")]
# A privacy budget: > 0, inf meaning no noise (a non-private run). Every epsilon field and
# list is of this type; a budget that must be spent (a sweep's total) is `FiniteEpsilon`.
Epsilon = Annotated[StrictFloat, Bound(gt=0, infinite=True, shown="> 0 (.inf: no noise)")]
FiniteEpsilon = FinitePositiveFloat


def check_bound(constrained: Any, name: str, value: float) -> None:
    """DpivonError unless ``value`` lies in the interval of the ``constrained`` type
    (``check_bound(Epsilon, "epsilon", 0.0)``: "epsilon must be > 0 (.inf: no noise), got
    0.0"), for an argument of a function that takes no config."""
    for meta in getattr(constrained, "__metadata__", ()):
        if isinstance(meta, AfterValidator) and isinstance(meta.func, _Interval):
            meta.func.check(name, value)
