"""A step whose device work was launched and whose values are not read yet."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .probes import ActivationStep
from .transport import Layout

__all__ = ["GatherTicket", "Pending"]


@dataclass(frozen=True)
class GatherTicket:
    """Under torch.distributed: this rank's full [header | statistics] vector and the capacity
    the gather used (kept for the rare re-gather when the layout outgrew it)."""

    local: torch.Tensor
    capacity: int


@dataclass
class Pending:
    """Device work launched for one step, not yet read on the host."""

    step: int
    packed: torch.Tensor  # on the host (CPU), or pinned host memory being filled (CUDA)
    event: Any  # torch.cuda.Event, or None when `packed` is ready
    layout: Layout
    grad_names: list[str]
    acts: ActivationStep
    grad_dtype: str | None
    loss_host: float | None  # a python loss (no device value to pack)
    loss_dtype: str  # the dtype the loss's headroom is judged against
    lr: float | None
    grads: list[torch.Tensor] = field(default_factory=list)  # what the gradient norms measured
    params: list[torch.Tensor] = field(default_factory=list)
    state: list[torch.Tensor] = field(default_factory=list)
    gather: GatherTicket | None = None
    mech: Any = None  # MechanismStep: the names behind the sampled mechanism segments
    clip_anchors: list[int] | None = None  # positions in `grads` whose post-clip norms were packed
