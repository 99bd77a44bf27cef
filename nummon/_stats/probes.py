"""Activation probes: forward hooks writing each watched module's output (min, max) into a
per-dtype buffer on the device (one `aminmax`, no conversion, no host read)."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .._distributed import Reduce
from .dtypes import dtype_name, narrowest
from .kernels import absmax_rows
from .transport import Segment

__all__ = ["ActivationProbes", "ActivationStep"]


@dataclass(frozen=True)
class ActivationStep:
    """What the probes saw in one step: modules in execution order, the buffer dtype each wrote
    to (None: not called), the narrowest output dtype."""

    names: list[str]
    order: list[int]
    src: list[torch.dtype | None]
    dtype: str | None


class ActivationProbes:
    """Forward hooks on every module that owns parameters (where a runaway shows; hooking every
    module costs more than it tells), minus the policy's excluded name patterns."""

    def __init__(self, exclude: Sequence[str] = ()) -> None:
        self.exclude = tuple(exclude)
        self.names: list[str] = []
        self._hooked: set[int] = set()
        self._hooks: list[Any] = []
        self._bufs: dict[torch.dtype, torch.Tensor] = {}  # per dtype, (modules, 2) min and max
        self._views: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._src: list[torch.dtype | None] = []  # the buffer each module wrote to this step
        self._order: list[int] = []
        self._dtype: str | None = None
        self.paused = False  # forensics re-runs a forward that is not a training step
        self.want_tensors = False  # keep the outputs for histograms
        self.tensors: dict[str, torch.Tensor] = {}

    def install(self, model: nn.Module) -> None:
        """Hook the modules not hooked yet (also called again when the model grew)."""
        for name, mod in model.named_modules():
            if id(mod) in self._hooked or any(fnmatch.fnmatchcase(name, pat) for pat in self.exclude):
                continue
            if name and any(True for _ in mod.parameters(recurse=False)):
                self._hooked.add(id(mod))
                idx = len(self.names)
                self.names.append(name)
                self._src.append(None)
                self._hooks.append(mod.register_forward_hook(self._make_hook(idx)))
        self._views.clear()  # buffers sized for the new module count

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._hooked.clear()

    def _make_hook(self, idx: int) -> Callable:
        def hook(_mod: nn.Module, _inp: Any, out: Any) -> None:
            if self.paused:
                return
            t = out
            if not isinstance(t, torch.Tensor):
                if not isinstance(out, (tuple, list)):
                    return
                t = next((o for o in out if isinstance(o, torch.Tensor)), None)
                if t is None:
                    return
            if not t.is_floating_point() or t.numel() == 0:
                return
            t = t.detach()
            if self._src[idx] is None:  # the first call of this module in this step
                lo, hi = self._buffer_views(t.dtype, t.device)[idx]
                # one kernel, no conversion: min and max of bf16/fp16 values are exact in their own dtype
                torch.aminmax(t, out=(lo, hi))
                self._src[idx] = t.dtype
                self._order.append(idx)
                self._dtype = narrowest(self._dtype, dtype_name(t.dtype))
            else:  # a module called twice in one step (weight sharing, loops)
                lo, hi = self._buffer_views(self._src[idx], t.device)[idx]
                mn, mx = torch.aminmax(t)
                torch.minimum(lo, mn.to(lo.dtype), out=lo)
                torch.maximum(hi, mx.to(hi.dtype), out=hi)
            if self.want_tensors:
                self.tensors[self.names[idx]] = t

        return hook

    def _buffer_views(self, dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-module (min, max) 0-d views of a (modules, 2) buffer of this dtype, made once:
        on a GPU every per-call tensor op is a launch to pay for."""
        views = self._views.get(dtype)
        if views is None or views[0][0].device != device:  # first forward, the model moved or grew
            buf = self._bufs[dtype] = torch.zeros(len(self.names), 2, dtype=dtype, device=device)
            views = self._views[dtype] = [(buf[i, 0], buf[i, 1]) for i in range(len(self.names))]
        return views

    def take(self, distributed: bool) -> tuple[ActivationStep, list[Segment]]:
        """This step's observations and their segments; resets for the next forward."""
        step = ActivationStep(self.names, self._order, self._src, self._dtype)
        self._order, self._src, self._dtype = [], [None] * len(self.names), None
        segments = []
        for dtype in {d for d in step.src if d is not None}:
            buf = self._bufs[dtype]
            if distributed:  # ranks combine maxima; a (min, max) pair would need two rules
                segments.append(Segment(f"act_max:{dtype}", absmax_rows(buf), Reduce.MAX))
            else:
                segments.append(Segment(f"act_minmax:{dtype}", buf.view(-1), Reduce.LOCAL))
        return step, segments
