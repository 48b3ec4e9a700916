"""A small CIFAR-style ResNet with BatchNorm, for 8×8 single-channel images (scikit-learn's digits).

A plain nn.Module that knows nothing of ZeRO: `python -m zero.workloads.digits` trains it with the
engine, and tests/distributed/test_workloads.py checks it at stages 0-3. The structure is He et
al.'s CIFAR ResNet (3×3 stem, three stages of basic blocks, widths 16/32/64, the first block of
stages 2 and 3 halving the resolution with a 1×1 projection shortcut, global average pooling, one
linear head), shrunk to 8×8 inputs:

    stem   conv3×3(1→16) BN ReLU                                  8×8
    blocks stage 1: `depth` × BasicBlock(16→16)                  8×8
           stage 2: BasicBlock(16→32, stride 2), ...             4×4
           stage 3: BasicBlock(32→64, stride 2), ...             2×2
    head   global average pool, Linear(64→classes)

Every residual block is a child of one nn.Sequential, `blocks`, so `units="auto"` makes each
block a unit (zero/build.py); the stem and the head form the root unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class ResNetConfig:
    in_channels: int = 1
    """Input channels (1: grey-level digits)."""
    classes: int = 10
    """Output classes."""
    widths: tuple[int, ...] = (16, 32, 64)
    """Channels of each stage; every stage after the first halves the resolution."""
    depth: int = 1
    """Basic blocks per stage."""


class BasicBlock(nn.Module):
    """conv3×3 BN ReLU conv3×3 BN, plus the shortcut (identity, or a strided 1×1 conv + BN
    when the shape changes), then ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet(nn.Module):
    """forward(x, y=None) -> (logits, mean cross-entropy or None), like zero.workloads.models'
    GPT."""

    def __init__(self, cfg: ResNetConfig = ResNetConfig(), *, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        # the initial values depend on the seed alone, never on the process's global RNG
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            w0 = cfg.widths[0]
            self.stem = nn.Sequential(
                nn.Conv2d(cfg.in_channels, w0, 3, padding=1, bias=False),
                nn.BatchNorm2d(w0),
            )
            blocks, c_in = [], w0
            for i, width in enumerate(cfg.widths):
                for k in range(cfg.depth):
                    stride = 2 if i > 0 and k == 0 else 1
                    blocks.append(BasicBlock(c_in, width, stride))
                    c_in = width
            self.blocks = nn.Sequential(*blocks)
            self.head = nn.Linear(c_in, cfg.classes)
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        h = self.blocks(F.relu(self.stem(x)))
        logits = self.head(h.mean(dim=(2, 3)))
        loss = None if y is None else F.cross_entropy(logits.float(), y)
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
