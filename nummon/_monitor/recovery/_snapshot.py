"""Host copies of the model and optimizer state, and restoring them exactly.

A snapshot is the state_dicts copied to host memory (CPU tensors; from CUDA, non-blocking copies
into pinned memory, waited for only when restored). Restoring loads a fresh copy of the optimizer
state, since `Optimizer.load_state_dict` may alias the tensors it is given and the next steps would
then change the snapshot in place.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Snapshot"]


def _to_host(obj: Any, events: list) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type == "cuda":
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out.copy_(t, non_blocking=True)
            if not events:
                events.append(True)
            return out
        return t.clone()
    if isinstance(obj, dict):
        return {k: _to_host(v, events) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v, events) for v in obj)
    return copy.deepcopy(obj)


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return copy.deepcopy(obj)


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) state dict."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


@dataclass
class Snapshot:
    """Model and optimizer state as of the end of `step` (-1: before the first step)."""

    step: int
    model_state: dict[str, Any]
    optim_state: dict[str, Any]
    event: Any = None  # a torch.cuda.Event when the copies are still in flight

    @classmethod
    def take(cls, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Snapshot:
        pending: list = []
        model_state = _to_host(model.state_dict(), pending)
        optim_state = _to_host(optimizer.state_dict(), pending)
        event = None
        if pending:
            event = torch.cuda.Event()
            event.record()
        return cls(step, model_state, optim_state, event)

    @property
    def nbytes(self) -> int:
        return state_bytes(self.model_state) + state_bytes(self.optim_state)

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Load the saved state back (copies: the snapshot stays as it was)."""
        if self.event is not None:
            self.event.synchronize()
        model.load_state_dict(self.model_state)
        optimizer.load_state_dict(_clone(self.optim_state))
