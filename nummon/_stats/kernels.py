"""Norm and extreme kernels over lists of tensors, launched without a host sync, with host work
that does not grow with the number of tensors (beyond building a list).

A `_Plan` per list (made once, re-made when a tensor's shape changes) sorts the tensors into
groups. CPU: small tensors of one shape are concatenated (one `cat`, which costs ~0.2 us per
tensor where a view, a `dot` or an `aminmax` per tensor costs 1-4 us) and reduced row-wise in
one kernel per group; the few large tensors get a BLAS dot / `aminmax` each into a
preallocated buffer (their own kernel dwarfs the launch); small tensors with no other of their
shape (a CNN's biases and small layers) are measured by one `torch._foreach_norm` over all of
them (its loop runs in C: one Python-level op where a group each cost a reshape and a norm
through Python). Other devices: one fused
`torch._foreach_norm` per dtype. The per-group results are put back in the list's order with
one `index_select`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .dtypes import HALF_DTYPES

__all__ = ["NormKernels", "absmax_rows", "as_real"]


#: tensors up to this many elements are measured in groups on CPU (copying them is cheaper
#: than a kernel launch each); larger ones are measured where they lie (on a 12-block LM's
#: gradients, 2^15 concatenated its 16k-element weights too, and the copy cost more than it saved)
SMALL_NUMEL = 1 << 12
#: torch's intra-op grain (at::internal::GRAIN_SIZE): groups stay below it, so their reductions
#: run on the calling thread
GRAIN = 1 << 15

#: dtypes `_foreach_norm(..., dtype=float32)` measures in float32 (at least as wide as theirs)
_FOREACH_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: takes a group's tensors out of a list, as a list (`_picker`)
_Pick = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


def as_real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its (re, im) float view: the same L2 norm, and kernels that take it
    (max |component| stands for max |z|)."""
    return torch.view_as_real(t) if t.is_complex() else t


def absmax_rows(buf: torch.Tensor) -> torch.Tensor:
    """max |x| of each (min, max) row of a (n, 2) buffer, on the device (NaN propagates)."""
    return torch.maximum(buf[:, 1], buf[:, 0].neg())


def _stack_float(values: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
    if any(v.dtype != torch.float32 for v in values):
        values = [v.float() for v in values]
    return torch.stack(values)


@dataclass(frozen=True)
class _Plan:
    """How one list of tensors is measured: groups of positions, and the way back to list order."""

    n: int  # the list's length
    totals: list[int]  # per group, its elements in all (checked per step: one number per group)
    groups: list[list[int]]  # CPU: small tensors of one shape; fused: one dtype and device
    big: list[int]  # CPU: tensors measured one by one
    singles: list[int]  # CPU: small tensors alone with their shape, measured by one _foreach_norm
    inverse: torch.Tensor | None  # result position of each list position (None: already in order)
    device: torch.device
    fused: bool  # one `_foreach_norm` per group (devices other than the CPU)
    pick: list[_Pick]  # per group, a function taking its tensors out of the list (in C)
    pick_big: _Pick | None  # None when `big` is empty
    pick_singles: _Pick | None  # None when `singles` is empty

    @staticmethod
    def make(tensors: Sequence[torch.Tensor], fused: bool) -> _Plan:
        dev = tensors[0].device
        by_key: dict[tuple, list[int]] = {}
        big: list[int] = []
        cpu = not fused
        for i, t in enumerate(tensors):
            if cpu and (t.numel() > SMALL_NUMEL or t.device != dev):
                big.append(i)
            elif t.numel() == 0:  # no identity for a max: these read 0
                by_key.setdefault(("empty",), []).append(i)
            else:  # CPU: one shape and dtype (cat keeps the dtype); elsewhere one dtype for _foreach
                by_key.setdefault((t.dtype, tuple(t.shape)) if cpu else (t.dtype, t.device), []).append(i)
        groups: list[list[int]] = []
        for idx in by_key.values():  # chunks below torch's parallel grain: a multi-threaded
            chunk: list[int] = []  # reduction of a small matrix costs ms on a busy CPU
            size = 0
            for i in idx:
                n = tensors[i].numel()
                if chunk and cpu and size + n > GRAIN:
                    groups.append(chunk)
                    chunk, size = [], 0
                chunk.append(i)
                size += n
            groups.append(chunk)
        singles: list[int] = []
        if cpu:  # alone with their shape: one C loop for all of them instead of a group each
            singles = [
                g[0] for g in groups if len(g) == 1 and tensors[g[0]].numel() and tensors[g[0]].dtype in _FOREACH_DTYPES
            ]
            alone = set(singles)
            groups = [g for g in groups if not (len(g) == 1 and g[0] in alone)]
        order = [i for g in groups for i in g] + singles + big
        inverse = None
        if order != list(range(len(tensors))):
            inv = [0] * len(order)
            for pos, i in enumerate(order):
                inv[i] = pos
            inverse = torch.tensor(inv, dtype=torch.long, device=dev)
        totals = [sum(tensors[i].numel() for i in g) for g in groups]
        return _Plan(
            len(tensors),
            totals,
            groups,
            big,
            singles,
            inverse,
            dev,
            fused,
            [_picker(g) for g in groups],
            _picker(big) if big else None,
            _picker(singles) if singles else None,
        )


class _Stale(Exception):
    """A plan no longer fits its list (a tensor changed shape or device)."""


def _picker(idx: list[int]) -> _Pick:
    """A function returning the tensors at `idx` of a list, as a list (one C call)."""
    get = operator.itemgetter(*idx)
    return (lambda ts: [get(ts)]) if len(idx) == 1 else (lambda ts: list(get(ts)))


def _rows(ts: list[torch.Tensor]) -> torch.Tensor:
    """Same-shape tensors as the rows of one (k, numel) tensor (one copy; none for one tensor)."""
    if ts[0].dim() == 0:
        x = torch.stack(ts)
    else:
        x = torch.cat(ts) if len(ts) > 1 else ts[0]
    x = x.reshape(len(ts), -1)
    return x.float() if x.dtype in HALF_DTYPES else x


class NormKernels:
    """L2 norms and max |x| of tensor lists, into buffers made once per list."""

    def __init__(self, fused: bool | None = None) -> None:
        self.fused = fused  # None: fused multi-tensor kernels on every device but the CPU
        # per key: the (n,) or (n, 2) float32 result buffer and, on CPU, its per-row 0-d views
        self.buffers: dict[tuple[str, int], tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]] = {}
        self._plans: dict[str, _Plan] = {}

    def l2_norms(self, tensors: list[torch.Tensor], key: str = "norms") -> torch.Tensor:
        """float32 L2 norm of each tensor (float32 overflow past ~1e19 is recomputed later)."""
        return self._measure(tensors, key, norms=True, absmax=False)[0]

    def extremes(
        self, grads: list[torch.Tensor], distributed: bool = False, key: str = "grad_absmax"
    ) -> tuple[str, torch.Tensor]:
        """("grad_absmax", max |g| of each tensor), NaN where a tensor holds NaN. `key` names
        the buffer (callers whose results must outlive another caller's use their own).
        `distributed` is kept for callers: the maxima combine across ranks as they are."""
        return "grad_absmax", self._measure(grads, key, norms=False, absmax=True)[1]

    def norms_and_absmax(self, tensors: list[torch.Tensor], key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Both statistics of one list, reading each small tensor's copy once."""
        norms, absmax = self._measure(tensors, key, norms=True, absmax=True)
        return norms, absmax

    # ------------------------------------------------------------------ internals
    def _plan(self, key: str, tensors: list[torch.Tensor], stale: bool = False) -> _Plan:
        """The list's plan, made again when its length or device changed or it went stale.

        Shapes are not compared per step (an attribute read per tensor, slow on Parameters):
        a group whose tensors changed shape fails to concatenate or yields a different number
        of elements, which `_measure` notices, and it then re-plans once."""
        plan = self._plans.get(key)
        if stale or plan is None or plan.n != len(tensors) or plan.device != tensors[0].device:
            fused = tensors[0].device.type != "cpu" if self.fused is None else self.fused
            plan = self._plans[key] = _Plan.make(tensors, fused)
        return plan

    def _measure(self, tensors: list[torch.Tensor], key: str, norms: bool, absmax: bool) -> tuple:
        plan = self._plan(key, tensors)
        if plan.fused:  # no dependence on shapes
            return self._foreach(tensors, plan, norms, absmax)
        try:
            return self._grouped(tensors, plan, key, norms, absmax)
        except _Stale:
            return self._grouped(tensors, self._plan(key, tensors, stale=True), key, norms, absmax)

    def _grouped(self, tensors: list[torch.Tensor], plan: _Plan, key: str, norms: bool, absmax: bool) -> tuple:
        nparts: list[torch.Tensor] = []
        mparts: list[torch.Tensor] = []
        for pick, total in zip(plan.pick, plan.totals):
            ts = pick(tensors)
            if total == 0:
                if ts[0].numel():
                    raise _Stale
                zero = torch.zeros(len(ts), device=plan.device)
                nparts.append(zero)
                mparts.append(zero)
                continue
            try:
                x = _rows(ts)
            except RuntimeError:  # shapes or devices changed
                raise _Stale from None
            if x.numel() != total:
                raise _Stale
            if norms:
                nparts.append(torch.linalg.vector_norm(x, dim=1).float())
            if absmax:
                # abs + amax: NaN propagates; aminmax(dim=1) is ~1000x slower on CPU
                mparts.append(x.abs().amax(dim=1).float())
        if plan.singles:
            assert plan.pick_singles is not None  # made whenever `singles` is not empty
            ts = plan.pick_singles(tensors)
            try:  # (an empty tensor has no max: it went stale, and is re-planned into the empty group)
                if norms:
                    nparts.append(torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float32)))
                if absmax:  # the inf-norm is max |x|, NaN propagating
                    mparts.append(torch.stack(torch._foreach_norm(ts, math.inf, dtype=torch.float32)))
            except RuntimeError:
                raise _Stale from None
        if plan.big:
            assert plan.pick_big is not None  # made whenever `big` is not empty
            big = plan.pick_big(tensors)
            if norms:
                nparts.append(self._big_norms(big, key))
            if absmax:
                mparts.append(self._big_absmax(big, key))
        return (
            self._in_order(nparts, plan, key + ":n", len(tensors)) if norms else None,
            self._in_order(mparts, plan, key + ":m", len(tensors)) if absmax else None,
        )

    def _in_order(self, parts: list[torch.Tensor], plan: _Plan, key: str, n: int) -> torch.Tensor:
        buf = self._buffer(key, n, 1, plan.device, views=False)[0].view(-1)
        if plan.inverse is None:
            if len(parts) == 1:
                buf.copy_(parts[0])
            else:
                torch.cat(parts, out=buf)
        else:
            torch.index_select(torch.cat(parts) if len(parts) > 1 else parts[0], 0, plan.inverse, out=buf)
        return buf

    @staticmethod
    def _foreach(tensors: list[torch.Tensor], plan: _Plan, norms: bool, absmax: bool) -> tuple:
        """Other devices: one fused multi-tensor kernel per dtype (a kernel per tensor would be
        launch-bound: 148 separate kernels of GPT-2 cost ~9 ms)."""
        out: list[torch.Tensor | None] = []
        for want, order in ((norms, 2.0), (absmax, float("inf"))):
            if not want:
                out.append(None)
                continue
            parts = []
            for pick in plan.pick:
                ts = pick(tensors)
                parts.append(
                    torch.zeros(len(ts), device=plan.device)
                    if ts[0].numel() == 0
                    else _stack_float(torch._foreach_norm(ts, order))
                )
            res = torch.cat(parts) if len(parts) > 1 else parts[0]
            out.append(res if plan.inverse is None else res.index_select(0, plan.inverse))
        return tuple(out)

    def _big_norms(self, tensors: list[torch.Tensor], key: str) -> torch.Tensor:
        """A BLAS dot per dense float32 tensor (half the time of `vector_norm` on the tensors
        that matter, measured inside a training step) into a preallocated buffer, one sqrt."""
        buf, views = self._buffer(key + ":big_n", len(tensors), 1, tensors[0].device)
        for t, (v,) in zip(tensors, views):
            if t.dtype == torch.float32 and t.is_cpu and t.is_contiguous():
                f = t.view(-1)
                torch.dot(f, f, out=v)
            else:  # other dtypes, layouts, devices (rare)
                n = (
                    torch.linalg.vector_norm(t, dtype=torch.float32)
                    if t.dtype in HALF_DTYPES
                    else torch.linalg.vector_norm(t)
                )
                v.copy_(n.square())
        return buf.view(-1).sqrt()

    def _big_absmax(self, tensors: list[torch.Tensor], key: str) -> torch.Tensor:
        """One `aminmax` per tensor into a preallocated (n, 2) buffer, then max |x| per row."""
        dev = tensors[0].device
        buf, views = self._buffer(key + ":big_m", len(tensors), 2, dev)
        for g, (lo, hi) in zip(tensors, views):
            if g.dtype == torch.float32 and g.device == dev:
                torch.aminmax(g, out=(lo, hi))
            else:
                mn, mx = torch.aminmax(g)
                lo.copy_(mn)
                hi.copy_(mx)
        return absmax_rows(buf)

    def _buffer(
        self, key: str, n: int, width: int, dev: torch.device, views: bool = True
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """A preallocated float32 (n, width) buffer and its per-row 0-d views (none unless
        `views`), made once per shape."""
        hit = self.buffers.get((key, n))
        if hit is None or hit[0].device != dev:
            buf = torch.zeros(n, width, device=dev)
            rows = [tuple(buf[i, j] for j in range(width)) for i in range(n)] if views else []
            hit = self.buffers[(key, n)] = (buf, rows)
        return hit
