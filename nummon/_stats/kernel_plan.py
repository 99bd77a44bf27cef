"""How a list of tensors is measured on the CPU (`Plan`): which small tensors are concatenated in
groups, which go through one `_foreach_norm` loop, which get a BLAS dot each, or whether the
whole list is one loop (`direct`); and the preallocated results each plan writes into (`Work`).
`kernels.NormKernels` runs the plans."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "DIRECT_GROUPED",
    "DIRECT_NUMEL",
    "FOREACH_DTYPES",
    "GRAIN",
    "LOOP_NUMEL",
    "MIN_GROUP",
    "Pick",
    "Plan",
    "SMALL_NUMEL",
    "Tensors",
    "Work",
    "dot_fits",
]

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
#: loop too, when only norms are wanted; larger ones by a BLAS dot each, the faster kernel there:
#: `vector_norm` accumulates float32 in double, a BLAS `sdot` in float32 SIMD lanes. Warm, one
#: tensor (µs, norm / dot): 2^16 elements 13.7 / 6.2, 2^18 31 / 10, 2^20 198 / 76 on an Intel
#: Xeon; about even on an AMD EPYC. Inside a monitored run's read of an 8-block LM's gradients,
#: its 26 tensors of 2^15-2^16 elements as dots: 868 -> 704 µs. With max |x| (an `aminmax` per
#: tensor above SMALL_NUMEL: the loop's inf-norm reads ~1 ns an element) each gets its dot and
#: its `aminmax` back to back, the second read from cache
LOOP_NUMEL = 1 << 15

#: CPU, norms only: a list whose groups would hold at most this many tensors in all, with none
#: above `DIRECT_NUMEL` elements, is measured by one `_foreach_norm` over the whole list, straight
#: into its result (`Plan.direct`). A group's two ops from Python cost about what the loop's C
#: launch costs for ~13 tensors, and the plan's own Python and its `index_select` back to list
#: order cost more again. The gradient read inside a monitored run (the end-of-backward callback,
#: interleaved with the plan, median µs): 2-block LM 295 -> 273 and 404 -> 382, 3-layer MLP 58 ->
#: 53, demo CNN within noise. The 8-block LM (50 tensors grouped) and a 1,000-tensor model keep
#: their groups, which are faster there (lm8 ~20 µs, the 1,000 tensors 470 against 2,050 µs)
DIRECT_GROUPED = 16
#: ... and past this many elements a tensor's BLAS dot reads it enough faster than the loop's norm
#: to pay for the plan (the demo CNN's 1.6M-element fc1: its gradient read 856 -> 555 µs as a dot,
#: Intel Xeon; within ~40 µs either way on an AMD EPYC). A lone dot of a smaller tensor costs more
#: than its place in the loop (the 3-layer MLP's 2^16-element weight: +15 µs)
DIRECT_NUMEL = 1 << 18

#: dtypes `_foreach_norm(..., dtype=float32)` measures in float32 (at least as wide as theirs)
FOREACH_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: takes a group's tensors out of a list, as a sequence (`picker`)
Tensors = tuple[torch.Tensor, ...] | list[torch.Tensor]
Pick = Callable[[Sequence[torch.Tensor]], Tensors]


@dataclass(frozen=True)
class Plan:
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
    pick: list[Pick]  # per group, a function taking its tensors out of the list (in C)
    pick_big: Pick | None  # None when `big` is empty
    pick_dot: Pick | None  # the rest of `big` (None: none)
    pick_singles: Pick | None  # None when `singles` is empty
    pick_norms: Pick | None  # the singles, then the loop's: one `_foreach_norm` for both (None: neither)
    direct: bool = False  # CPU, norms only: one `_foreach_norm` over the whole list (`DIRECT_GROUPED`)

    @staticmethod
    def make(tensors: Sequence[torch.Tensor], fused: bool) -> Plan:
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
        groups, singles, loop, big = loop_members(tensors, groups, big) if cpu else (groups, [], [], big)
        order = [i for g in groups for i in g] + singles + big
        inverse = None
        if order != list(range(len(tensors))):
            inv = [0] * len(order)
            for pos, i in enumerate(order):
                inv[i] = pos
            inverse = torch.tensor(inv, dtype=torch.long, device=dev)
        totals = [sum(tensors[i].numel() for i in g) for g in groups]
        return Plan(
            len(tensors),
            totals,
            groups,
            big,
            len(loop),
            singles,
            inverse,
            dev,
            fused,
            [picker(g) for g in groups],
            picker(big) if big else None,
            picker(big[len(loop) :]) if len(big) > len(loop) else None,
            picker(singles) if singles else None,
            picker(singles + big[: len(loop)]) if singles or loop else None,
            cpu and direct_list(tensors, groups),
        )


def loop_members(
    tensors: Sequence[torch.Tensor], groups: list[list[int]], big: list[int]
) -> tuple[list[list[int]], list[int], list[int], list[int]]:
    """CPU: (the groups left, the small tensors in too small a group of their shape, the large
    tensors whose norms the loop measures, every large tensor with those first): one C loop for
    all of those instead of a group's or a dot's Python each."""
    foreach = FOREACH_DTYPES
    few = [
        g for g in groups if len(g) < MIN_GROUP and all(tensors[i].numel() and tensors[i].dtype in foreach for i in g)
    ]
    singles = sorted(i for g in few for i in g)
    dev = tensors[0].device
    loop = [
        i
        for i in big
        if tensors[i].device == dev
        and tensors[i].dtype in foreach
        and (tensors[i].numel() <= LOOP_NUMEL or not dot_fits(tensors[i]))
    ]
    in_loop = set(loop)
    return [g for g in groups if g not in few], singles, loop, loop + [i for i in big if i not in in_loop]


def dot_fits(t: torch.Tensor) -> bool:
    """Whether a BLAS dot can read `t` where it lies (dense float32): other large tensors (half
    dtypes, strided views) stay in the loop, one C launch each where the dot's fallback costs
    three ops from Python."""
    return t.dtype == torch.float32 and t.is_contiguous()


def direct_list(tensors: Sequence[torch.Tensor], groups: list[list[int]]) -> bool:
    """CPU: whether one `_foreach_norm` over the whole list measures its norms faster than the
    plan's groups and loops (`DIRECT_GROUPED`, `DIRECT_NUMEL`)."""
    dev = tensors[0].device
    return sum(map(len, groups)) <= DIRECT_GROUPED and all(
        t.dtype in FOREACH_DTYPES and t.device == dev and t.numel() <= DIRECT_NUMEL for t in tensors
    )


def picker(idx: list[int]) -> Pick:
    """A C-level function returning the tensors at `idx` of a list (a list for a run of
    consecutive positions, else a tuple): no Python call per step."""
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return operator.itemgetter(slice(idx[0], idx[0] + len(idx)))
    return operator.itemgetter(*idx) if len(idx) > 1 else operator.itemgetter(slice(idx[0], idx[0] + 1))


@dataclass(frozen=True)
class Work:
    """One list's float32 results, preallocated per plan: a buffer in the plan's order (its
    groups, its singles, its big tensors) whose parts every kernel writes into (`out=`; no cat
    of parts, no view per step), and the result in the list's order (the buffer itself when the
    plan keeps the order, else one `index_select` into it)."""

    plan: Plan
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
    def make(plan: Plan, minmax: bool) -> Work:
        dev, nbig = plan.device, len(plan.big)
        buf = torch.zeros(plan.n, device=dev)
        *groups, singles, big = buf.split([*map(len, plan.groups), len(plan.singles), nbig])
        mm = torch.zeros(nbig if minmax else 0, 2, device=dev)
        dots = big[plan.loop :]
        start = sum(map(len, plan.groups))
        norm_loop = buf[start : start + len(plan.singles) + plan.loop]
        rows = [] if minmax else [big[i] for i in range(nbig)]
        return Work(
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
