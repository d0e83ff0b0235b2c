"""Model registry: Opacus-compatible (GroupNorm, no BatchNorm) networks for CIFAR-10."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from dpivon.errors import DpivonError
from dpivon.models.cnn import SmallCNN, TanhCNN
from dpivon.models.wide_resnet import WideResNet

_BUILDERS: dict[str, Callable[[int], nn.Module]] = {
    "small-cnn": lambda num_classes: SmallCNN(num_classes),
    "tanh-cnn": lambda num_classes: TanhCNN(num_classes),
    "tramer-boneh-cnn": lambda num_classes: TanhCNN(num_classes, num_groups=None),
    "wrn-16-4": lambda num_classes: WideResNet(16, 4, num_classes),
}

MODEL_NAMES: tuple[str, ...] = tuple(_BUILDERS)

__all__ = ["MODEL_NAMES", "SmallCNN", "TanhCNN", "WideResNet", "build_model"]


def build_model(name: str, num_classes: int = 10) -> nn.Module:
    """Build a freshly initialised model by registry name (weights follow torch's global RNG)."""
    if name not in _BUILDERS:
        raise DpivonError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")
    if num_classes < 2:
        raise DpivonError(f"num_classes must be at least 2, got {num_classes}")
    return _BUILDERS[name](num_classes)
