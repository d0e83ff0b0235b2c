"""The optimizer a config names, built: each options family's class. The registry
(`dpivon.optim.registry`) imports no torch, so the classes are named here."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dpivon.optim.adambc import DPAdamBC
from dpivon.optim.dp_ivon import DPIVON
from dpivon.optim.ivon import IVON
from dpivon.optim.registry import (
    AdamBCOptions,
    AdamOptions,
    DPIVONOptions,
    GradsqIVONOptions,
    IVONOptions,
    OptimizerOptions,
    SGDOptions,
)

# By exact type: DP-AdamBC's options extend Adam's and DP-IVON's extend IVON's.
OPTIMIZER_CLASSES: dict[type[OptimizerOptions], type[torch.optim.Optimizer]] = {
    SGDOptions: torch.optim.SGD,
    AdamOptions: torch.optim.Adam,
    AdamBCOptions: DPAdamBC,
    IVONOptions: IVON,
    DPIVONOptions: DPIVON,
    GradsqIVONOptions: DPIVON,
}


def build_optimizer(
    options: OptimizerOptions,
    params: Iterable[torch.nn.Parameter],
    *,
    dataset_size: int,
    grad_noise_std: float = 0.0,
) -> torch.optim.Optimizer:
    """The optimizer ``options`` describe, before any privacy wrapping."""
    kwargs = options.optimizer_kwargs(dataset_size=dataset_size, grad_noise_std=grad_noise_std)
    return OPTIMIZER_CLASSES[type(options)](params, **kwargs)
