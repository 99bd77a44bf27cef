"""What the debugging checklist's functions share: the verdict types and the copies they run on.

Below both `diagnose` (the public checklist) and `_overfit` (overfit one batch), so neither
imports the other.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._core.errors import NummonError

__all__ = [
    "LossFn",
    "Status",
    "Report",
    "LRRangeReport",
    "Diagnosis",
    "copy_with_batch",
    "copy_model",
    "split_batch",
    "device_of",
    "to_device",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Status(str, enum.Enum):
    PASS = "PASS"
    PARTIAL = "PARTIAL"
    WARN = "WARN"
    FAIL = "FAIL"

    @property
    def rank(self) -> int:
        """How bad: PASS 0, PARTIAL and WARN 1, FAIL 2 (the one ordering of statuses)."""
        return _STATUS_RANK[self]

    def __str__(self) -> str:
        return self.value


_STATUS_RANK = {Status.PASS: 0, Status.PARTIAL: 1, Status.WARN: 1, Status.FAIL: 2}


@dataclass
class Report:
    """One diagnostic's verdict: status, the findings behind it, and its numbers."""

    name: str
    status: Status
    findings: list[str] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"[{self.status}] {self.name}"]
        lines += [f"  - {f}" for f in self.findings] or ["  - all checks passed"]
        return "\n".join(lines)


@dataclass
class LRRangeReport(Report):
    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # smoothed
    suggested_lr: float | None = None
    diverged_lr: float | None = None
    plot: str | None = None


@dataclass
class Diagnosis:
    """`run_all`'s result: the reports in order, and where it stopped (the first FAIL)."""

    reports: list[Report]
    stopped_at: str | None = None

    @property
    def status(self) -> Status:
        return max((r.status for r in self.reports), key=lambda s: s.rank, default=Status.PASS)

    def __str__(self) -> str:
        body = "\n".join(str(r) for r in self.reports)
        tail = f"\nstopped at {self.stopped_at}: fix this first" if self.stopped_at else "\nall diagnostics ran"
        return body + tail


def copy_with_batch(model: nn.Module, batch: Any) -> tuple[nn.Module, Any, Any]:
    """A hook-free training copy of the model, and the batch moved to its device."""
    clone = copy_model(model)
    dev = device_of(clone)
    x, y = (to_device(t, dev) for t in split_batch(batch))
    return clone, x, y


def copy_model(model: nn.Module) -> nn.Module:
    """A deep copy without the original's hooks (a Monitor's hooks must not see the copy)."""
    clone = copy.deepcopy(model)
    for m in clone.modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_hooks_always_called",
            "_forward_pre_hooks_with_kwargs",
        ):
            d = getattr(m, attr, None)
            if d is not None:
                d.clear()
    clone.train()
    return clone


def split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise NummonError("batch must be an (inputs, targets) pair")


def device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def to_device(t: Any, device: torch.device) -> Any:
    return t.to(device) if isinstance(t, torch.Tensor) else t
