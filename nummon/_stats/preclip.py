"""Gradient statistics before clipping, with no change to the training loop.

A post-accumulate-grad hook on a few anchor parameters (spread over the model, so every
backward through it reaches one; not one hook per parameter: that is a Python call per tensor)
queues, on the first anchor gradient of a backward, one end-of-backward callback; that callback launches the gradient norm and extreme
kernels on the device (no host read) into buffers of its own. `post_step`, called after
`clip_grad_norm_` and `optimizer.step()`, packs those (the unclipped statistics; with gradient
accumulation, the last backward's, i.e. the full accumulated gradient) instead of measuring
the clipped gradients again for them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch

from .._core.maths import spaced
from .kernels import NormKernels
from .params import WatchedParams

__all__ = ["PreClipCapture", "PreClipGrads"]


@dataclass(frozen=True)
class PreClipGrads:
    """One backward's gradient statistics, still on the device."""

    names: list[str]
    grads: list[torch.Tensor]  # the measured tensors (clipping later scales them in place)
    raw_dtypes: set[torch.dtype]
    norms: torch.Tensor  # (n,) float32 L2 norms
    extremes: tuple[str, torch.Tensor] | None  # ("grad_absmax", (n,) max |g|), when it was due
    whole: bool = False  # `grads[i]` is the i-th watched parameter's `.grad` itself (none missing or converted)


_dtype = operator.attrgetter("dtype")

#: anchor parameters hooked: the first and last watched ones and evenly spaced ones between
ANCHORS = 8


def anchors(params: list[torch.Tensor], k: int = ANCHORS) -> list[torch.Tensor]:
    """Up to `k` parameters spread evenly over the list, the first and the last included."""
    return spaced(params, k)


class PreClipCapture:
    """Hooks a few anchor parameters; `take()` hands over the last backward's statistics once.

    A backward that reaches no anchor (one through a small, unanchored part of the model)
    leaves no capture, and the step measures its gradients as they are, after clipping.
    """

    def __init__(self, watched: WatchedParams, kernels: NormKernels) -> None:
        self.watched = watched
        self.kernels = kernels
        self._handles: list[Any] = []
        self._hooked: set[int] = set()
        self._queued = False
        self._result: PreClipGrads | None = None
        self.install()

    paused = False  # forensics re-runs a backward that is not a training step
    absmax = True  # whether the next backward measures max |g| too (the collector decides, per step)

    def install(self) -> None:
        """Hook the anchors not hooked yet (also after the model grew)."""
        for p in anchors(self.watched.params):
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
        was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # torch.no_grad()'s own switch, without its ~7 Python calls
        try:
            params = self.watched.params
            dev = params[0].device if params else torch.device("cpu")
            grads, names, raw = self.watched.grads(dev, distributed=False)
            if not grads:
                return
            if self.absmax:
                norms, absmax = self.kernels.norms_and_absmax(grads, key="preclip")
                extremes = ("grad_absmax", absmax)
            else:
                norms, extremes = self.kernels.l2_norms(grads, key="preclip"), None
            whole = grads is raw and len(grads) == len(params)
            self._result = PreClipGrads(names, grads, set(map(_dtype, raw)), norms, extremes, whole)
        finally:
            torch._C._set_grad_enabled(was)

    @property
    def last(self) -> PreClipGrads | None:
        """The statistics `take` would hand over now, left in place."""
        return self._result

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
