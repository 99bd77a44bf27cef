"""Gradient statistics before clipping, with no change to the training loop.

A post-accumulate-grad hook on each watched parameter queues, on the first gradient of a
backward, one end-of-backward callback; that callback launches the gradient norm and extreme
kernels on the device (no host read) into buffers of its own. `post_step`, called after
`clip_grad_norm_` and `optimizer.step()`, packs those (the unclipped statistics; with gradient
accumulation, the last backward's, i.e. the full accumulated gradient) instead of measuring
the clipped gradients again for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .kernels import NormKernels
from .watch import WatchedParams

__all__ = ["PreClipCapture", "PreClipGrads"]


@dataclass(frozen=True)
class PreClipGrads:
    """One backward's gradient statistics, still on the device."""

    names: list[str]
    grads: list[torch.Tensor]  # the measured tensors (clipping later scales them in place)
    raw_dtypes: set[torch.dtype]
    norms: torch.Tensor  # (n,) float32 L2 norms
    extremes: tuple[str, torch.Tensor]  # as `NormKernels.extremes` returns them


class PreClipCapture:
    """Hooks the watched parameters; `take()` hands over the last backward's statistics once."""

    def __init__(self, watched: WatchedParams, kernels: NormKernels) -> None:
        self.watched = watched
        self.kernels = kernels
        self._handles: list[Any] = []
        self._hooked: set[int] = set()
        self._queued = False
        self._result: PreClipGrads | None = None
        self.install()

    paused = False  # forensics re-runs a backward that is not a training step

    def install(self) -> None:
        """Hook the watched parameters not hooked yet (also after the model grew)."""
        for p in self.watched.params:
            if id(p) not in self._hooked and hasattr(p, "register_post_accumulate_grad_hook"):
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
                self._hooked.add(id(p))

    def _on_grad(self, _param: torch.Tensor) -> None:
        if self.paused:
            return
        if not self._queued:  # once per backward: the callback runs after every gradient is in
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._queued = False
        with torch.no_grad():
            params = self.watched.params
            dev = params[0].device if params else torch.device("cpu")
            grads, names, raw = self.watched.grads(dev, distributed=False)
            if not grads:
                return
            norms = self.kernels.l2_norms(grads, key="preclip_norms")
            extremes = self.kernels.extremes(grads, False, key="preclip_minmax")
            self._result = PreClipGrads(names, grads, {g.dtype for g in raw}, norms, extremes)

    def take(self) -> PreClipGrads | None:
        """The statistics of the last backward since the previous call, or None."""
        result, self._result = self._result, None
        self._queued = False  # a backward that raised never ran its callback
        return result

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooked.clear()
