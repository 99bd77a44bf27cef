"""The demo's model and data: a small CNN and seeded synthetic digits with a domain switch.

Shared downward by the demo, `nummon diagnose`, the tests and the overhead benchmark; the
demo's constants live in `_demo_config` (no torch).
"""

from __future__ import annotations

import torch
from torch import nn

from .demo_config import BATCH, DOMAIN_B_GAIN, SWITCH_STEP

__all__ = ["DemoCNN", "SyntheticDigits"]


class DemoCNN(nn.Module):
    """Two conv layers (`width`, 2 x `width` channels) on `side` x `side` inputs, max-pool, fc1,
    fc2 -> `classes`. The defaults (32, 64 channels, 28x28, fc1 12544->128) are the benchmarks'
    workload; the demo runs a smaller one (`_demo_config.DEMO_MODEL`)."""

    def __init__(self, width: int = 32, hidden: int = 128, classes: int = 10, side: int = 28) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(2 * width * (side // 2) ** 2, hidden)
        self.fc2 = nn.Linear(hidden, classes)
        self.act = nn.LeakyReLU(0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.conv1(x))
        x = self.pool(self.act(self.conv2(x)))
        x = self.act(self.fc1(x.flatten(1)))
        return self.fc2(x)


class SyntheticDigits:
    """Ten classes of `side` x `side` images (a multiple of 7): a shared pattern plus a weaker
    pattern per class plus noise (learnable, not trivially), made on the fly from a seeded CPU
    generator (the same bytes on every machine and torch version)."""

    def __init__(self, seed: int = 0, noise: float = 1.0, separation: float = 0.6, side: int = 28) -> None:
        if side % 7:
            raise ValueError(f"side must be a multiple of 7, got {side}")
        g = torch.Generator().manual_seed(seed)
        base = torch.rand(1, 1, 7, 7, generator=g)
        per_class = torch.rand(10, 1, 7, 7, generator=g)
        # nearest-neighbour upsampling is a pure repeat: identical on every backend
        coarse, up = base + separation * per_class, side // 7
        self.prototypes = coarse.repeat_interleave(up, dim=2).repeat_interleave(up, dim=3)
        self.side = side
        self.noise = noise
        self.gen = torch.Generator().manual_seed(seed + 1)

    def batch(self, classes: range, size: int = BATCH, gain: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of `size` images of the given classes; `gain` scales the images (contrast)."""
        lo, n = classes.start, len(classes)
        y = torch.randint(0, n, (size,), generator=self.gen) + lo
        x = self.prototypes[y] + self.noise * torch.randn(size, 1, self.side, self.side, generator=self.gen)
        return x * gain, y

    def stream(self, step: int, healthy: bool = False, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
        """The demo's batch at `step`: domain A (classes 0-4) then domain B (5-9, `DOMAIN_B_GAIN` x contrast)."""
        if healthy:
            return self.batch(range(0, 10), size)
        if step < SWITCH_STEP:
            return self.batch(range(0, 5), size)
        return self.batch(range(5, 10), size, gain=DOMAIN_B_GAIN)
