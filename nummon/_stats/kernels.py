"""Norm and extreme kernels over lists of tensors, launched without a host sync.

CUDA: fused `torch._foreach_norm` calls (a kernel per tensor would be launch-bound). CPU,
where `_foreach_norm` is a loop of `vector_norm` kernels: a BLAS dot per tensor and one
`aminmax` per tensor, each written into a preallocated buffer.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .dtypes import HALF_DTYPES

__all__ = ["NormKernels", "absmax_rows", "as_real"]


def as_real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its (re, im) float view: the same L2 norm, and kernels that take it
    (max |component| stands for max |z|)."""
    return torch.view_as_real(t) if t.is_complex() else t


def absmax_rows(buf: torch.Tensor) -> torch.Tensor:
    """max |x| of each (min, max) row of a (n, 2) buffer, on the device."""
    return torch.maximum(buf[:, 1], buf[:, 0].neg())


def _stack_float(values: Sequence[torch.Tensor]) -> torch.Tensor:
    if any(v.dtype != torch.float32 for v in values):
        values = [v.float() for v in values]
    return torch.stack(values)


class NormKernels:
    """L2 norms and extremes of tensor lists, into buffers made once per shape."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, int], tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]] = {}

    def l2_norms(self, tensors: list[torch.Tensor], key: str = "norms") -> torch.Tensor:
        """float32 L2 norm of each tensor.

        CUDA: one fused `_foreach_norm`. CPU: a BLAS dot product per dense float32 tensor (half
        the time of `vector_norm` on the tensors that matter, measured inside a training step)
        written into a preallocated buffer, then one square root.
        """
        dev = tensors[0].device
        if dev.type != "cpu":
            return _stack_float(torch._foreach_norm(tensors))
        buf, views = self._views(key, len(tensors), 1, dev)
        for t, (v,) in zip(tensors, views):
            if t.dtype == torch.float32 and t.is_cpu and t.is_contiguous():
                f = t.view(-1)
                torch.dot(f, f, out=v)
            else:  # other dtypes, layouts, devices (rare); float32 overflow is recomputed later
                n = torch.linalg.vector_norm(t, dtype=torch.float32) if t.dtype in HALF_DTYPES else torch.linalg.vector_norm(t)
                v.copy_(n.square())
        return buf.view(-1).sqrt_()

    def extremes(self, grads: list[torch.Tensor], distributed: bool, key: str = "grad_minmax") -> tuple[str, torch.Tensor]:
        """Each tensor's max |g| ("grad_absmax"), or its (min, max) pair ("grad_minmax"), which
        the host turns into max |g| (fewer device ops than doing it here). `key` names the
        buffer (callers whose results must outlive another caller's use their own).

        CUDA: one fused `_foreach_norm(inf)` (148 separate kernels of GPT-2 cost ~9 ms). CPU,
        where that norm is slow: one `aminmax` per gradient written into a preallocated buffer.
        Under torch.distributed the pairs become maxima on the device (ranks combine maxima).
        """
        dev = grads[0].device
        if dev.type == "cuda":
            return "grad_absmax", _stack_float(torch._foreach_norm(grads, float("inf")))
        buf, views = self._views(key, len(grads), 2, dev)
        for g, (lo, hi) in zip(grads, views):
            if g.numel() == 0:
                lo.zero_()
                hi.zero_()
            elif g.dtype == torch.float32 and g.device == dev:
                torch.aminmax(g, out=(lo, hi))
            else:
                mn, mx = torch.aminmax(g)
                lo.copy_(mn)
                hi.copy_(mx)
        if distributed:
            return "grad_absmax", absmax_rows(buf)
        return "grad_minmax", buf.view(-1)

    def _views(self, key: str, n: int, width: int, dev: torch.device) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """A preallocated float32 (n, width) buffer and its per-row 0-d views, made once per shape."""
        hit = self.buffers.get((key, n))
        if hit is None or hit[0].device != dev:
            buf = torch.zeros(n, width, device=dev)
            hit = self.buffers[(key, n)] = (buf, [tuple(buf[i, j] for j in range(width)) for i in range(n)])
        return hit
