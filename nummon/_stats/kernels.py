"""Norm and extreme kernels over lists of tensors, launched without a host sync, with host work
that does not grow with the number of tensors (beyond building a list).

A `_Plan` per list (made once, re-made when a tensor's shape changes) sorts the tensors into
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
#: CPU: a group of fewer same-shape small tensors than this joins the one `_foreach_norm` loop
#: (its per-tensor launch is in C, ~1.5 us; a group's own kernels cost ~10 us from Python)
MIN_GROUP = 8
#: CPU: tensors above SMALL_NUMEL and up to this many elements have their norms measured by that
#: loop too, when only norms are wanted; larger ones by a BLAS dot each, the faster kernel there.
#: With max |x| (an `aminmax` per tensor above SMALL_NUMEL: the loop's inf-norm reads ~1 ns an
#: element) each gets its dot and its `aminmax` back to back, the second read from cache
LOOP_NUMEL = 1 << 18

#: CPU, norms only: a list whose groups would hold at most this many tensors in all, with none
#: above `DIRECT_NUMEL` elements, is measured by one `_foreach_norm` over the whole list, straight
#: into its result (`_Plan.direct`). A group's two ops from Python cost about what the loop's C
#: launch costs for ~13 tensors, and the plan's own Python and its `index_select` back to list
#: order cost more again. The gradient read inside a monitored run (the end-of-backward callback,
#: interleaved with the plan, median µs): 2-block LM 295 -> 273 and 404 -> 382, 3-layer MLP 58 ->
#: 53, demo CNN within noise. The 8-block LM (50 tensors grouped) and a 1,000-tensor model keep
#: their groups, which are faster there (lm8 ~20 µs, the 1,000 tensors 470 against 2,050 µs)
DIRECT_GROUPED = 16
#: ... and past this many elements a tensor's BLAS dot reads it enough faster than the loop's norm
#: (~25% at 4M elements, measured from memory) to keep the plan
DIRECT_NUMEL = 1 << 21

#: dtypes `_foreach_norm(..., dtype=float32)` measures in float32 (at least as wide as theirs)
_FOREACH_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: takes a group's tensors out of a list, as a sequence (`_picker`)
_Tensors = tuple[torch.Tensor, ...] | list[torch.Tensor]
_Pick = Callable[[Sequence[torch.Tensor]], _Tensors]


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
    big: list[int]  # CPU: tensors measured one by one (their norms: the first `loop` in the C loop)
    loop: int  # CPU: the first this many of `big` have their norms measured by one _foreach_norm (norms only)
    singles: list[int]  # CPU: small tensors in too small a group of their shape, measured by one _foreach_norm
    inverse: torch.Tensor | None  # result position of each list position (None: already in order)
    device: torch.device
    fused: bool  # one `_foreach_norm` per group (devices other than the CPU)
    pick: list[_Pick]  # per group, a function taking its tensors out of the list (in C)
    pick_big: _Pick | None  # None when `big` is empty
    pick_dot: _Pick | None  # the rest of `big` (None: none)
    pick_singles: _Pick | None  # None when `singles` is empty
    pick_norms: _Pick | None  # the singles, then the loop's: one `_foreach_norm` for both (None: neither)
    direct: bool = False  # CPU, norms only: one `_foreach_norm` over the whole list (`DIRECT_GROUPED`)

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
        groups, singles, loop, big = _loop_members(tensors, groups, big) if cpu else (groups, [], [], big)
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
            len(loop),
            singles,
            inverse,
            dev,
            fused,
            [_picker(g) for g in groups],
            _picker(big) if big else None,
            _picker(big[len(loop) :]) if len(big) > len(loop) else None,
            _picker(singles) if singles else None,
            _picker(singles + big[: len(loop)]) if singles or loop else None,
            cpu and _direct(tensors, groups),
        )


def _loop_members(
    tensors: Sequence[torch.Tensor], groups: list[list[int]], big: list[int]
) -> tuple[list[list[int]], list[int], list[int], list[int]]:
    """CPU: (the groups left, the small tensors in too small a group of their shape, the large
    tensors whose norms the loop measures, every large tensor with those first): one C loop for
    all of those instead of a group's or a dot's Python each."""
    foreach = _FOREACH_DTYPES
    few = [
        g for g in groups if len(g) < MIN_GROUP and all(tensors[i].numel() and tensors[i].dtype in foreach for i in g)
    ]
    singles = sorted(i for g in few for i in g)
    dev = tensors[0].device
    loop = [
        i for i in big if tensors[i].numel() <= LOOP_NUMEL and tensors[i].device == dev and tensors[i].dtype in foreach
    ]
    in_loop = set(loop)
    return [g for g in groups if g not in few], singles, loop, loop + [i for i in big if i not in in_loop]


def _direct(tensors: Sequence[torch.Tensor], groups: list[list[int]]) -> bool:
    """CPU: whether one `_foreach_norm` over the whole list measures its norms faster than the
    plan's groups and loops (`DIRECT_GROUPED`, `DIRECT_NUMEL`)."""
    dev = tensors[0].device
    return sum(map(len, groups)) <= DIRECT_GROUPED and all(
        t.dtype in _FOREACH_DTYPES and t.device == dev and t.numel() <= DIRECT_NUMEL for t in tensors
    )


class _Stale(Exception):
    """A plan no longer fits its list (a tensor changed shape or device)."""


def _picker(idx: list[int]) -> _Pick:
    """A C-level function returning the tensors at `idx` of a list (a list for a run of
    consecutive positions, else a tuple): no Python call per step."""
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return operator.itemgetter(slice(idx[0], idx[0] + len(idx)))
    return operator.itemgetter(*idx) if len(idx) > 1 else operator.itemgetter(slice(idx[0], idx[0] + 1))


def _rows(ts: _Tensors) -> torch.Tensor:
    """Same-shape tensors as the rows of one (k, numel) tensor (one copy; none for one tensor)."""
    if ts[0].dim() == 1 and len(ts) > 1:
        x = torch.stack(ts)  # already (k, numel): one op where a cat and its reshape are two
    else:
        x = torch.stack(ts) if ts[0].dim() == 0 else torch.cat(ts) if len(ts) > 1 else ts[0]
        x = x.reshape(len(ts), -1)
    return x.float() if x.dtype in HALF_DTYPES else x


@dataclass(frozen=True)
class _Work:
    """One list's float32 results, preallocated per plan: a buffer in the plan's order (its
    groups, its singles, its big tensors) whose parts every kernel writes into (`out=`; no cat
    of parts, no view per step), and the result in the list's order (the buffer itself when the
    plan keeps the order, else one `index_select` into it)."""

    plan: _Plan
    buf: torch.Tensor  # (n,), in the plan's order
    result: torch.Tensor  # (n,), in the list's order
    groups: list[torch.Tensor]  # per group, its part of `buf`
    singles: torch.Tensor  # the singles' part
    big: torch.Tensor  # the big tensors' part
    norm_loop: torch.Tensor  # the singles' places and the loop's, side by side: norms, one _foreach_norm
    dots: torch.Tensor  # ... and the rest (norms: a dot into each, then one sqrt)
    big_rows: list[torch.Tensor]  # norms: per big tensor, the 0-d view its dot writes
    dot_rows: list[torch.Tensor]  # ... those past the loop's places (`big_rows[plan.loop:]`)
    minmax: torch.Tensor  # max |x|: the big tensors' (n, 2) (min, max) buffer
    minmax_rows: list[tuple[torch.Tensor, torch.Tensor]]
    minmax_cols: tuple[torch.Tensor, torch.Tensor]

    @staticmethod
    def make(plan: _Plan, minmax: bool) -> _Work:
        dev, nbig = plan.device, len(plan.big)
        buf = torch.zeros(plan.n, device=dev)
        *groups, singles, big = buf.split([*map(len, plan.groups), len(plan.singles), nbig])
        mm = torch.zeros(nbig if minmax else 0, 2, device=dev)
        dots = big[plan.loop :]
        start = sum(map(len, plan.groups))
        norm_loop = buf[start : start + len(plan.singles) + plan.loop]
        rows = [] if minmax else [big[i] for i in range(nbig)]
        return _Work(
            plan,
            buf,
            buf if plan.inverse is None else torch.zeros(plan.n, device=dev),
            groups,
            singles,
            big,
            norm_loop,
            dots,
            rows,
            rows[plan.loop :],
            mm,
            [(mm[i, 0], mm[i, 1]) for i in range(len(mm))],
            (mm[:, 0], mm[:, 1]),
        )


class NormKernels:
    """L2 norms and max |x| of tensor lists, into buffers made once per list."""

    def __init__(self, fused: bool | None = None) -> None:
        self.fused = fused  # None: fused multi-tensor kernels on every device but the CPU
        # per key (and statistic): the CPU path's preallocated results (`_Work`)
        self.buffers: dict[str, _Work] = {}
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

    def _grouped(self, tensors: list[torch.Tensor], plan: _Plan, key: str, norms: bool, absmax: bool) -> tuple:
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

    def _work(self, key: str, plan: _Plan, minmax: bool) -> _Work:
        """The list's preallocated results for this plan (made again with a new plan)."""
        work = self.buffers.get(key)
        if work is None or work.plan is not plan:
            work = self.buffers[key] = _Work.make(plan, minmax)
        return work

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


def _big_norms(tensors: Sequence[torch.Tensor], work: _Work) -> None:
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


def _big_absmax(tensors: Sequence[torch.Tensor], work: _Work) -> None:
    """One `aminmax` per tensor into a preallocated (n, 2) buffer, then max |x| per row into its place."""
    dev = work.minmax.device
    for g, (lo, hi) in zip(tensors, work.minmax_rows):
        if g.dtype == torch.float32 and g.device == dev:
            torch.aminmax(g, out=(lo, hi))
        else:
            _minmax(g, lo, hi)
    lo_col, hi_col = work.minmax_cols
    torch.maximum(hi_col, lo_col.neg(), out=work.big)  # absmax_rows, into place


def _big_both(tensors: Sequence[torch.Tensor], norms: _Work, extremes: _Work) -> None:
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
