"""Wide-ResNet with GroupNorm for DP training (De et al. 2022 style)."""

from __future__ import annotations

from torch import Tensor, nn


class _PreActBlock(nn.Module):
    """Pre-activation basic block: GN-ReLU-conv3x3-GN-ReLU-conv3x3 plus a shortcut."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, num_groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(num_groups, in_ch)
        self.act1 = nn.ReLU()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(num_groups, out_ch)
        self.act2 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        # A 1x1 projection only where the shape changes, as in Zagoruyko & Komodakis.
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        pre = self.act1(self.norm1(x))
        # The projection reads the pre-activated input so both paths see normalized features.
        skip = x if self.shortcut is None else self.shortcut(pre)
        out = self.conv1(pre)
        out = self.conv2(self.act2(self.norm2(out)))
        return out + skip


class WideResNet(nn.Module):
    """Pre-activation Wide-ResNet-depth-width with GroupNorm in place of BatchNorm, no dropout.

    ``WideResNet(16, 4)`` has 2,748,890 parameters at 10 classes. Convs carry no bias because
    each is followed by a GroupNorm with its own affine shift.
    """

    def __init__(
        self, depth: int = 16, width: int = 4, num_classes: int = 10, num_groups: int = 16
    ) -> None:
        super().__init__()
        if (depth - 4) % 6 != 0:
            raise ValueError(f"Wide-ResNet depth must be 6n+4, got {depth}")
        blocks_per_stage = (depth - 4) // 6
        widths = (16 * width, 32 * width, 64 * width)

        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        blocks: list[nn.Module] = []
        in_ch = 16
        for stage, out_ch in enumerate(widths):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(_PreActBlock(in_ch, out_ch, stride, num_groups))
                in_ch = out_ch
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(
            nn.GroupNorm(num_groups, in_ch),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(in_ch, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)))
