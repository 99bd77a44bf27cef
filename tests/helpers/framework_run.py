"""What one framework run tells the shared framework suite (test_framework_callbacks.py), in nummon's
step numbers (nummon step s is the framework's optimizer step s, counted from 0)."""

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Run:
    trainer_steps: int  # optimizer steps the trainer finished
    losses: dict[int, float]  # the framework's own loss of each step
    grad_norms: dict[int, float] = field(default_factory=dict)  # the unclipped norm, where measured
    events_dir: str | Path | None = None  # where the event log and flight record go
    tb_dir: str | Path | None = None  # the framework's TensorBoard run folder
    wandb_root: str | Path | None = None  # a folder holding the W&B offline run
