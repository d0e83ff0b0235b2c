"""The choices a config names for the privacy machinery: accountants and clipping engines,
and the one rule that ties an engine to the posterior samples per step. Their home is here,
beside their implementations (`accounting`, `engine`); the config takes its lists from here."""

from __future__ import annotations

import typing
from typing import Literal

from dpivon.errors import DpivonError

AccountantName = Literal["rdp", "prv"]  # Opacus accountants (dpivon.privacy.accounting)
# How clipped per-example gradients are computed (dpivon.privacy.engine). One-backward
# engines clip what one backward pass gives: they cannot average an example's gradient over
# several posterior samples before clipping (DPIVON needs p.grad_sample for that).
OneBackwardEngine = Literal["bk", "ghost"]
PerSampleEngine = Literal["hooks", "functorch", "ew"]  # Opacus grad-sample modes
EngineName = Literal["auto", OneBackwardEngine, PerSampleEngine]


def check_engine_samples(engine: str, mc_samples: int) -> None:
    """A one-backward engine clips a single backward pass, so it cannot take mc_samples > 1.
    The rule's one home: the config validates it, `make_private` for callers without one."""
    if engine in typing.get_args(OneBackwardEngine) and mc_samples > 1:
        raise DpivonError(
            f"engine {engine} clips the gradients of one backward pass; mc_samples="
            f"{mc_samples} needs each example's gradient averaged over the posterior samples "
            "before clipping: use engine hooks, functorch or ew (auto picks hooks)"
        )
