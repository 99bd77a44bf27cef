"""Packing one step's statistics into one vector and bringing it to the host with one copy.

Every statistic is a `Segment` that declares its cross-rank rule where it is built; `pack`
concatenates them (copied: segments may be reused buffers) and records where each lies.
On CUDA the vector is copied non-blocking into one of two pinned host buffers and read a
step later; on CPU it already is on the host.
"""

from __future__ import annotations

import operator
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from .distributed import Reduce

__all__ = ["PinnedPool", "Segment", "Slot", "pack", "rules_of", "signature"]


@dataclass(frozen=True, init=False)
class Segment:
    """A named run of statistics and how each combines across ranks: one rule for all, or a
    tuple with one rule per element (norms, where some tensors are sharded and some not)."""

    name: str
    tensor: torch.Tensor
    reduce: str | tuple[str, ...]

    def __init__(self, name: str, tensor: torch.Tensor, reduce: str | tuple[str, ...]) -> None:
        # written out (not the dataclass's __init__ and __post_init__): one Python call per segment, not two
        if not (reduce in Reduce.ALL if isinstance(reduce, str) else Reduce.ALL.issuperset(reduce)):
            raise ValueError(f"unknown reduction {reduce!r} for segment {name!r}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "tensor", tensor)
        object.__setattr__(self, "reduce", reduce)


@dataclass(frozen=True)
class Slot:
    """Where a segment lies in the packed vector, and its rule(s)."""

    start: int
    stop: int
    reduce: str | tuple[str, ...]

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)


Layout = dict[str, Slot]


#: what a segment's place in the packed vector depends on (read in C, no Python call per segment)
_SEGMENT_KEY = operator.attrgetter("name", "reduce", "tensor.dtype", "tensor.shape", "tensor.device")
_TENSOR = operator.attrgetter("tensor")


@dataclass(frozen=True)
class _PackPlan:
    """How one combination of segments (names, rules, dtypes, shapes, devices) packs."""

    layout: Layout  # shared by every step packed alike (read-only)
    narrow: list[int]  # positions of the float32/16 segments, packed first as float32
    wide: list[int]  # positions of the float64 and integer segments, packed after as float64
    plain: bool  # every segment float32 on the target device, nothing widened: one cat as they are


#: plans by segment signature; an ordinary step's repeats, so its packing costs no Python per segment
_PLANS: dict[tuple, _PackPlan] = {}
_MAX_PLANS = 256  # cleared past this (a run whose shapes keep changing re-plans rather than grows)


def _plan(segments: list[Segment], dev: torch.device, wide: bool) -> _PackPlan:
    key = (dev, wide, *map(_SEGMENT_KEY, segments))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _make_plan(segments, dev, wide)
    return plan


def _make_plan(segments: list[Segment], dev: torch.device, wide: bool) -> _PackPlan:
    def is_narrow(t: torch.Tensor) -> bool:
        return t.is_floating_point() and t.dtype != torch.float64

    narrow = [i for i, s in enumerate(segments) if is_narrow(s.tensor)]
    wide_segs = [i for i, s in enumerate(segments) if not is_narrow(s.tensor)]
    layout, pos = {}, 0
    for i in narrow + wide_segs:
        s = segments[i]
        layout[s.name] = Slot(pos, pos + s.tensor.numel(), s.reduce)
        pos += s.tensor.numel()
    plain = (
        not wide_segs and not wide and all(s.tensor.dtype == torch.float32 and s.tensor.device == dev for s in segments)
    )
    return _PackPlan(layout, narrow, wide_segs, plain and bool(segments))


def pack(segments: list[Segment], dev: torch.device, wide: bool = False) -> tuple[torch.Tensor, Layout]:
    """One new vector holding every segment, and where each lies in it.

    float32/16 segments are concatenated into one float32 vector; only when there are float64
    or integer segments (fingerprints, counts, a float64 loss) or `wide` is set is it widened,
    once, to float64, so those join exactly.
    """
    plan = _plan(segments, dev, wide)
    if plan.plain:  # an ordinary step: copied as they are (segments may be reused buffers)
        ts = list(map(_TENSOR, segments))
        return (torch.cat(ts) if len(ts) > 1 else ts[0].clone()), plan.layout
    chunks = []
    for group, narrow_group in ((plan.narrow, True), (plan.wide, False)):
        if not group:
            continue
        ts = [t if t.device == dev else t.to(dev) for t in (segments[i].tensor for i in group)]
        if narrow_group:
            ts = [t if t.dtype == torch.float32 else t.float() for t in ts]
            chunk = torch.cat(ts) if len(ts) > 1 else ts[0].clone()
            if plan.wide or wide:
                chunk = chunk.to(torch.float64)
        else:
            chunk = torch.cat([t.to(torch.float64) for t in ts])
        chunks.append(chunk)
    if not chunks:
        return torch.zeros(0, device=dev, dtype=torch.float64 if wide else torch.float32), plan.layout
    return (torch.cat(chunks) if len(chunks) > 1 else chunks[0]), plan.layout


def rules_of(layout: Layout) -> list[str]:
    """The rule of every element of the packed vector, in order."""
    rules: list[str] = [Reduce.LOCAL] * max((s.stop for s in layout.values()), default=0)
    for s in layout.values():
        n = s.stop - s.start
        rules[s.start : s.stop] = [s.reduce] * n if isinstance(s.reduce, str) else list(s.reduce)
    return rules


def signature(layout: Layout) -> int:
    """A CRC-32 of the layout (names, places, rules): equal on ranks that packed alike (and,
    unlike `hash`, equal across processes)."""
    text = ";".join(f"{n}:{s.start}:{s.stop}:{s.reduce}" for n, s in sorted(layout.items()))
    return zlib.crc32(text.encode())


class PinnedPool:
    """Two pinned host buffers per size and dtype, used alternately (pinned allocation is slow,
    and the lagged step's buffer must survive until it is read)."""

    def __init__(self) -> None:
        self._pool: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def to_host(self, packed: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(host tensor, CUDA event or None): the one device->host copy of the step."""
        if packed.device.type == "cuda":
            key = (packed.numel(), packed.dtype)
            pool = self._pool.get(key)
            if pool is None:
                pool = self._pool[key] = [torch.empty(key[0], dtype=key[1], pin_memory=True) for _ in range(2)]
            pool.reverse()
            host = pool[0]
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return host, event
        if packed.device.type != "cpu":
            packed = packed.cpu()
        return packed, None
