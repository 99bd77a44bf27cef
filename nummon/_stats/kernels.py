"""Norm and extreme kernels over lists of tensors, launched without a host sync, with host work
that does not grow with the number of tensors (beyond building a list).

A `Plan` per list (made once, re-made when a tensor's shape changes) sorts the tensors into
groups. CPU: small tensors of one shape, `MIN_GROUP` or more, are concatenated (one `cat`, which
costs ~0.2 us per tensor where a view, a `dot` or an `aminmax` per tensor costs 1-4 us) and
reduced row-wise in one kernel per group; small tensors in fewer of their shape (a CNN's biases
and small layers) are measured by one `torch._foreach_norm` over all of them (its loop runs in
C: one Python-level op where a group each cost a reshape and a norm through Python). Larger
tensors: when only their norms are wanted (most steps), those up to `LOOP_NUMEL` elements join
that loop and the few larger ones get a BLAS dot each; with max |x| too, each gets a dot and
an `aminmax` into a preallocated buffer. Right after a backward every op from Python costs
several µs more than on a warm interpreter, so fewer ops is what counts (on the host-cost bar's
shapes: a quiet step's gradient read 5-25 µs less). Other devices: one fused
`torch._foreach_norm` per dtype. The per-group results are put back in the list's order with
one `index_select`. A short list that would group few tensors (`DIRECT_GROUPED`) has its norms
measured by one `_foreach_norm` over the whole list, in its own order: no plan's ops at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .dtypes import HALF_DTYPES
from .kernel_plan import Plan, Tensors, Work

__all__ = ["NormKernels", "absmax_rows", "as_real"]


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


class _Stale(Exception):
    """A plan no longer fits its list (a tensor changed shape or device)."""


def _rows(ts: Tensors) -> torch.Tensor:
    """Same-shape tensors as the rows of one (k, numel) tensor (one copy; none for one tensor)."""
    if ts[0].dim() == 1 and len(ts) > 1:
        x = torch.stack(ts)  # already (k, numel): one op where a cat and its reshape are two
    else:
        x = torch.stack(ts) if ts[0].dim() == 0 else torch.cat(ts) if len(ts) > 1 else ts[0]
        x = x.reshape(len(ts), -1)
    return x.float() if x.dtype in HALF_DTYPES else x


class NormKernels:
    """L2 norms and max |x| of tensor lists, into buffers made once per list."""

    def __init__(self, fused: bool | None = None) -> None:
        self.fused = fused  # None: fused multi-tensor kernels on every device but the CPU
        # per key (and statistic): the CPU path's preallocated results (`Work`)
        self.buffers: dict[str, Work] = {}
        self._plans: dict[str, Plan] = {}

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
    def _plan(self, key: str, tensors: list[torch.Tensor], stale: bool = False) -> Plan:
        """The list's plan, made again when its length or device changed or it went stale.

        Shapes are not compared per step (an attribute read per tensor, slow on Parameters):
        a group whose tensors changed shape fails to concatenate or yields a different number
        of elements, which `_measure` notices, and it then re-plans once."""
        plan = self._plans.get(key)
        if stale or plan is None or plan.n != len(tensors) or plan.device != tensors[0].device:
            fused = tensors[0].device.type != "cpu" if self.fused is None else self.fused
            plan = self._plans[key] = Plan.make(tensors, fused)
        return plan

    def _measure(self, tensors: list[torch.Tensor], key: str, norms: bool, absmax: bool) -> tuple:
        plan = self._plans.get(key)  # (`_plan`'s test, inline: this runs twice a step)
        if plan is None or plan.n != len(tensors) or plan.device != tensors[0].device:
            plan = self._plan(key, tensors)
        if plan.fused:  # no dependence on shapes
            return self._foreach(tensors, plan, norms, absmax)
        if plan.direct and not absmax:  # no dependence on shapes either: in list order, in C
            nw = self.buffers.get(key + ":n")
            if nw is None or nw.plan is not plan:
                nw = self._work(key + ":n", plan, minmax=False)
            try:
                torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32), out=nw.result)
                return nw.result, None
            except RuntimeError:  # a dtype or device changed
                plan = self._plan(key, tensors, stale=True)
        try:
            return self._grouped(tensors, plan, key, norms, absmax)
        except _Stale:
            return self._grouped(tensors, self._plan(key, tensors, stale=True), key, norms, absmax)

    def _grouped(self, tensors: list[torch.Tensor], plan: Plan, key: str, norms: bool, absmax: bool) -> tuple:
        buffers = self.buffers  # (`_work`'s lookups, inline: a call less each on every step)
        nw = buffers.get(key + ":n") if norms else None
        if norms and (nw is None or nw.plan is not plan):
            nw = self._work(key + ":n", plan, minmax=False)
        mw = buffers.get(key + ":m") if absmax else None
        if absmax and (mw is None or mw.plan is not plan):
            mw = self._work(key + ":m", plan, minmax=True)
        for i, (pick, total) in enumerate(zip(plan.pick, plan.totals)):
            ts = pick(tensors)
            if total == 0:  # its places keep the zeros they were made with
                if ts[0].numel():
                    raise _Stale
                continue
            try:
                x = _rows(ts)
            except RuntimeError:  # shapes or devices changed
                raise _Stale from None
            if x.numel() != total:
                raise _Stale
            if nw is not None:  # (`_row_norms`, inline for float32: a call less per group and step)
                if x.dtype == torch.float32:
                    torch.linalg.vector_norm(x, dim=1, out=nw.groups[i])
                else:
                    _row_norms(x, nw.groups[i])
            if mw is not None:
                _row_absmax(x, mw.groups[i])
        if mw is None:  # norms only: the singles and the loop's in one C loop, then the dots
            assert nw is not None  # (a call wants norms, max |x| or both)
            if plan.pick_norms is not None:
                try:
                    torch.stack(torch._foreach_norm(plan.pick_norms(tensors), 2, dtype=torch.float32), out=nw.norm_loop)
                except RuntimeError:
                    raise _Stale from None
            if plan.pick_dot is not None:
                _big_norms(plan.pick_dot(tensors), nw)
        else:
            if plan.singles:
                assert plan.pick_singles is not None  # made whenever `singles` is not empty
                ts = plan.pick_singles(tensors)
                try:  # (an empty tensor has no max: it went stale, and is re-planned into the empty group)
                    if nw is not None:
                        torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float32), out=nw.singles)
                    torch.stack(
                        torch._foreach_norm(ts, math.inf, dtype=torch.float32), out=mw.singles
                    )  # max |x|, NaN propagating
                except RuntimeError:
                    raise _Stale from None
            if plan.big:
                assert plan.pick_big is not None  # made whenever `big` is not empty
                big = plan.pick_big(tensors)
                if nw is not None:
                    _big_both(big, nw, mw)
                else:
                    _big_absmax(big, mw)
        if plan.inverse is not None:  # the results back in the list's order
            for w in (nw, mw):
                if w is not None:
                    torch.index_select(w.buf, 0, plan.inverse, out=w.result)
        return (nw.result if nw is not None else None, mw.result if mw is not None else None)

    def _work(self, key: str, plan: Plan, minmax: bool) -> Work:
        """The list's preallocated results for this plan (made again with a new plan)."""
        work = self.buffers.get(key)
        if work is None or work.plan is not plan:
            work = self.buffers[key] = Work.make(plan, minmax)
        return work

    @staticmethod
    def _foreach(tensors: list[torch.Tensor], plan: Plan, norms: bool, absmax: bool) -> tuple:
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


def _row_norms(x: torch.Tensor, out: torch.Tensor) -> None:
    """The L2 norm of each row of `x`, into `out` (float32)."""
    if x.dtype == torch.float32:
        torch.linalg.vector_norm(x, dim=1, out=out)
    else:  # float64 rows: measured in float64, then rounded once, as `.float()` would
        out.copy_(torch.linalg.vector_norm(x, dim=1))


def _row_absmax(x: torch.Tensor, out: torch.Tensor) -> None:
    """max |x| of each row of `x`, into `out` (float32; abs + amax: NaN propagates, where
    aminmax(dim=1) is ~1000x slower on CPU)."""
    if x.dtype == torch.float32:
        torch.amax(x.abs(), dim=1, out=out)
    else:
        out.copy_(x.abs().amax(dim=1))


def _big_norms(tensors: Sequence[torch.Tensor], work: Work) -> None:
    """The tensors past the loop's (`work.dots`): a BLAS dot per dense float32 tensor (half the
    time of `vector_norm` on the tensors that matter, measured inside a training step) into its
    place, then one sqrt in place."""
    for t, v in zip(tensors, work.dot_rows):
        if t.dtype == torch.float32 and t.is_cpu and t.is_contiguous():
            f = t.view(-1)
            torch.dot(f, f, out=v)
        else:  # other dtypes, layouts, devices (rare)
            _square_norm(t, v)
    work.dots.sqrt_()


def _big_absmax(tensors: Sequence[torch.Tensor], work: Work) -> None:
    """One `aminmax` per tensor into a preallocated (n, 2) buffer, then max |x| per row into its place."""
    dev = work.minmax.device
    for g, (lo, hi) in zip(tensors, work.minmax_rows):
        if g.dtype == torch.float32 and g.device == dev:
            torch.aminmax(g, out=(lo, hi))
        else:
            _minmax(g, lo, hi)
    lo_col, hi_col = work.minmax_cols
    torch.maximum(hi_col, lo_col.neg(), out=work.big)  # absmax_rows, into place


def _big_both(tensors: Sequence[torch.Tensor], norms: Work, extremes: Work) -> None:
    """`_big_norms` and `_big_absmax` tensor by tensor, so that each tensor's second read finds
    it in cache (a large model's gradients do not fit there together: all the dots, then all the
    `aminmax`, read them from memory twice). The same kernels, so the same values."""
    dev = extremes.minmax.device
    for t, v, (lo, hi) in zip(tensors, norms.big_rows, extremes.minmax_rows):
        if t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() and t.device == dev:
            f = t.view(-1)
            torch.dot(f, f, out=v)
            torch.aminmax(t, out=(lo, hi))
        else:  # other dtypes, layouts, devices (rare)
            _square_norm(t, v)
            _minmax(t, lo, hi)
    norms.big.sqrt_()
    lo_col, hi_col = extremes.minmax_cols
    torch.maximum(hi_col, lo_col.neg(), out=extremes.big)  # absmax_rows, into place


def _square_norm(t: torch.Tensor, out: torch.Tensor) -> None:
    """The squared L2 norm of `t` into the 0-d float32 `out` (any dtype, layout, device)."""
    if t.dtype == torch.float32 and t.is_cpu and t.is_contiguous():
        f = t.view(-1)
        torch.dot(f, f, out=out)
    else:
        n = torch.linalg.vector_norm(t, dtype=torch.float32) if t.dtype in HALF_DTYPES else torch.linalg.vector_norm(t)
        out.copy_(n.square())


def _minmax(t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """min and max of `t` into the 0-d float32 `lo` and `hi` (any dtype, device)."""
    if t.dtype == torch.float32 and t.device == lo.device:
        torch.aminmax(t, out=(lo, hi))
    else:
        mn, mx = torch.aminmax(t)
        lo.copy_(mn)
        hi.copy_(mx)
