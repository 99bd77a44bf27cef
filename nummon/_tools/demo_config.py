"""The demo's settings (no torch): defaults the CLI's help texts are derived from, and the
user's configuration before it is checked."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BATCH",
    "DEFAULT_STEPS",
    "DEMO_BATCH",
    "DEMO_SECONDS",
    "DOMAIN_B_GAIN",
    "DemoConfig",
    "HEALTHY_LR",
    "HIDDEN",
    "IMAGE_SIDE",
    "RUNAWAY_LR",
    "SWITCH_STEP",
    "WIDTH",
]

# The demo's model is a narrow DemoCNN (8 and 16 channels, fc1 3136->64) on batches of 32: its
# convolutions cost about 1/30 of the benchmarks' DemoCNN (32, 64 channels, batch 64), some 20 ms
# a step on one core; the story (learn, switch, warning, runaway, the first NaN named and
# explained) is told in 52 steps.
DEFAULT_STEPS = 80
SWITCH_STEP = 40  # first step of domain B (steps count from 0)
RUNAWAY_LR = 0.04  # seeds 0 and 1: non-finite 11-13 steps after the switch
HEALTHY_LR = 0.005
DOMAIN_B_GAIN = 4.0  # contrast of domain B relative to domain A
BATCH = 64  # images per batch of `SyntheticDigits` (the benchmarks', `nummon diagnose`'s)
DEMO_BATCH = 32  # images per batch of the demo
WIDTH = 8  # conv1's channels (conv2 has twice as many)
HIDDEN = 64  # fc1's outputs
IMAGE_SIDE = 28  # pixels per side
#: What the README claims `nummon demo` takes on a quiet 2-core machine, imports included
#: (seconds; measured by hand on 2026-12-02 on an idle 2-core machine, `time nummon demo`, six
#: runs: 7.6-9.1 s, median 8.7; with --no-wandb 8.8-8.9 s, the W&B client's start-up running in a
#: child process on the other core. Of it: ~2.4 s importing torch, ~1.7-2.1 s torch.optim's first
#: import of torch._dynamo, ~0.5 s nummon's own imports and ~3-4.5 s training and monitoring, the
#: two incident pictures included. Exiting skips the interpreter's last collections (`entry`):
#: they cost 1.2 s. The tests time nothing).
DEMO_SECONDS = 9


@dataclass(frozen=True)
class DemoConfig:
    """What the user asked for (unchecked; `nummon._tools.demo.prepare` checks it)."""

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
