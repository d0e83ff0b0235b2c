"""Convolutional networks for 3x32x32 inputs, built only from Opacus-supported layers."""

from __future__ import annotations

from torch import Tensor, nn


class SmallCNN(nn.Module):
    """Small, fast CNN for smoke runs and tests (24,458 parameters at 10 classes).

    Three conv(3x3) -> GroupNorm -> ReLU -> max-pool stages (16, 32, 64 channels), global
    average pooling and a linear head. The first conv has stride 2 so that the expensive
    full-resolution stage is skipped; that keeps a batch of 256 cheap on a CPU.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=3, stride=2, padding=1),  # 32 -> 16
            nn.GroupNorm(4, 16),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.GroupNorm(8, 32),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 16 -> 8
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.GroupNorm(16, 64),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8 -> 4
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(64, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class TanhCNN(nn.Module):
    """End-to-end CIFAR-10 CNN of Tramèr & Boneh (2021), with GroupNorm added after each conv.

    conv32, conv32, maxpool, conv64, conv64, maxpool, conv128, conv128, maxpool, dense128,
    dense(num_classes); 3x3 convs with padding 1, tanh activations. 551,466 parameters at
    10 classes (550,570 of them from the reference architecture, 896 from GroupNorm affines).

    The reference code (github.com/ftramer/Handcrafted-DP, ``CIFAR10_CNN``) has no
    normalization in this network; GroupNorm(16 groups) between each conv and its tanh is a
    deliberate addition of this project (GroupNorm, unlike BatchNorm, keeps examples
    independent, so per-sample gradients and DP accounting stay valid). ``num_groups=None``
    is the reference network layer for layer (registry name ``tramer-boneh-cnn``), the one
    the published anchor (59.2% at epsilon 3) was measured with.
    """

    def __init__(self, num_classes: int = 10, num_groups: int | None = 16) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_ch = 3
        for out_ch in (32, 64, 128):
            for _ in range(2):
                layers.append(nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1))
                if num_groups is not None:
                    layers.append(nn.GroupNorm(num_groups, out_ch))
                layers.append(nn.Tanh())
                in_ch = out_ch
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers, nn.Flatten())
        self.classifier = nn.Sequential(
            nn.Linear(128 * 4 * 4, 128),
            nn.Tanh(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))
