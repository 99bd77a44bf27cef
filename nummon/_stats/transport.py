"""Packing one step's statistics into one vector and bringing it to the host with one copy.

Every statistic is a `Segment` that declares its cross-rank rule where it is built; `pack`
concatenates them (copied: segments may be reused buffers) and records where each lies.
On CUDA the vector is copied non-blocking into one of two pinned host buffers and read a
step later; on CPU it already is on the host.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

from .distributed import Reduce

__all__ = ["PinnedPool", "Segment", "Slot", "pack", "rules_of", "signature"]


@dataclass(frozen=True)
class Segment:
    """A named run of statistics and how each combines across ranks: one rule for all, or a
    tuple with one rule per element (norms, where some tensors are sharded and some not)."""

    name: str
    tensor: torch.Tensor
    reduce: str | tuple[str, ...]

    def __post_init__(self) -> None:
        rules = (self.reduce,) if isinstance(self.reduce, str) else self.reduce
        if not set(rules) <= Reduce.ALL:
            raise ValueError(f"unknown reduction {self.reduce!r} for segment {self.name!r}")


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


def pack(segments: list[Segment], dev: torch.device, wide: bool = False) -> tuple[torch.Tensor, Layout]:
    """One new vector holding every segment, and where each lies in it.

    float32/16 segments are concatenated into one float32 vector; only when there are float64
    or integer segments (fingerprints, counts, a float64 loss) or `wide` is set is it widened,
    once, to float64, so those join exactly.
    """

    def is_narrow(t: torch.Tensor) -> bool:
        return t.is_floating_point() and t.dtype != torch.float64

    narrow = [s for s in segments if is_narrow(s.tensor)]
    wide_segs = [s for s in segments if not is_narrow(s.tensor)]
    chunks, layout, pos = [], {}, 0
    for group, narrow_group in ((narrow, True), (wide_segs, False)):
        if not group:
            continue
        ts = [s.tensor if s.tensor.device == dev else s.tensor.to(dev) for s in group]
        if narrow_group:
            ts = [t if t.dtype == torch.float32 else t.float() for t in ts]
            chunk = torch.cat(ts) if len(ts) > 1 else ts[0].clone()
            if wide_segs or wide:
                chunk = chunk.to(torch.float64)
        else:
            chunk = torch.cat([t.to(torch.float64) for t in ts])
        chunks.append(chunk)
        for s in group:
            layout[s.name] = Slot(pos, pos + s.tensor.numel(), s.reduce)
            pos += s.tensor.numel()
    if not chunks:
        return torch.zeros(0, device=dev, dtype=torch.float64 if wide else torch.float32), layout
    return (torch.cat(chunks) if len(chunks) > 1 else chunks[0]), layout


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
