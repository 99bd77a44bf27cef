"""The demo's settings (no torch): defaults the CLI's help texts are derived from, and the
user's configuration before it is checked."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BATCH",
    "DEFAULT_STEPS",
    "DOMAIN_B_GAIN",
    "DemoConfig",
    "HEALTHY_LR",
    "RUNAWAY_LR",
    "SWITCH_STEP",
]

DEFAULT_STEPS = 120
SWITCH_STEP = 60  # first step of domain B (steps count from 0)
RUNAWAY_LR = 0.02  # runs away after the switch for every seed tried (0.015..0.03 all do)
HEALTHY_LR = 0.005
DOMAIN_B_GAIN = 3.0  # contrast of domain B relative to domain A
BATCH = 64  # images per batch


@dataclass(frozen=True)
class DemoConfig:
    """What the user asked for (unchecked; `nummon._demo.prepare` checks it)."""

    out: str | Path | None = None  # None: ./nummon-runs/<timestamp>
    steps: int = DEFAULT_STEPS
    lr: float | None = None  # None: RUNAWAY_LR, or HEALTHY_LR with `healthy`
    seed: int = 0
    device: str = "cpu"
    healthy: bool = False
    stop_at_critical: bool = False
    wandb: bool = True
    tensorboard: bool = True
    policy: str = "default"
    recover: bool = False  # turn on the policy's recovery section (skip poisoned updates, roll back)
