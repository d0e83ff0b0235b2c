"""The choices a config names for the privacy machinery: accountants and clipping engines,
and the one rule that ties an engine to the posterior samples per step. Their home is here,
beside their implementations (`accounting`, `engine`); the config takes its lists from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import AfterValidator

from dpivon.errors import DpivonError

AccountantName = Literal["rdp", "prv"]  # Opacus accountants (dpivon.privacy.accounting)


@dataclass(frozen=True)
class Engine:
    """How clipped per-example gradients are computed (dpivon.privacy.engine).

    ``wiring`` is ``module:function`` of a function (engine, model, optimizer, noise) ->
    (module to run, private optimizer, criterion), loaded when a run wires its engine, so a
    config names an engine without importing torch. A one-backward engine clips what one
    backward pass gives: it cannot average an example's gradient over several posterior
    samples before clipping (DPIVON needs p.grad_sample for that); the others are Opacus
    grad-sample modes that plug into the standard DPOptimizer (clipping in pre_step).
    """

    wiring: str
    one_backward: bool


# Every engine a config can name besides ``auto``: adding one is one entry here.
ENGINES: dict[str, Engine] = {
    "bk": Engine("dpivon.privacy.engine:wire_book_keeping", one_backward=True),
    "ghost": Engine("dpivon.privacy.engine:wire_ghost_clipping", one_backward=True),
    "hooks": Engine("dpivon.privacy.engine:wire_grad_sample_mode", one_backward=False),
    "functorch": Engine("dpivon.privacy.engine:wire_grad_sample_mode", one_backward=False),
    "ew": Engine("dpivon.privacy.engine:wire_grad_sample_mode", one_backward=False),
}
AUTO_ENGINE = "auto"  # the fastest exact engine for the model (dpivon.privacy.engine)


def per_sample_engines() -> tuple[str, ...]:
    """The engines that clip each example's own gradient (p.grad_sample)."""
    return tuple(name for name, engine in ENGINES.items() if not engine.one_backward)


def check_engine_name(name: str) -> str:
    if name != AUTO_ENGINE and name not in ENGINES:
        raise ValueError(
            f"unknown engine {name!r}; choose one of: {', '.join([AUTO_ENGINE, *ENGINES])}"
        )
    return name


EngineName = Annotated[str, AfterValidator(check_engine_name)]


def check_engine_samples(engine: str, mc_samples: int) -> None:
    """A one-backward engine clips a single backward pass, so it cannot take mc_samples > 1.
    The rule's one home: the config validates it, `make_private` for callers without one."""
    if engine in ENGINES and ENGINES[engine].one_backward and mc_samples > 1:
        raise DpivonError(
            f"engine {engine} clips the gradients of one backward pass; mc_samples="
            f"{mc_samples} needs each example's gradient averaged over the posterior samples "
            f"before clipping: use engine {' or '.join(per_sample_engines())} (auto picks hooks)"
        )
