"""Replica checks under data parallelism: every rank must hold bit-identical reduced gradients and
bit-identical parameters. On a cadence (policy `replicas.every`) each rank adds two exact
fingerprints to the statistics it already gathers once per step (16 bytes): the sum of the bit
patterns of its replicated gradients and of its replicated parameters. Every rank then sees every
rank's fingerprints, so every rank names the same minority, and a mismatch is a critical alert of
kind `replica_mismatch`.

Covered: DistributedDataParallel, and under FSDP the parameters that are not sharded (each rank's
shard of a sharded parameter is its own and is not compared; FSDP1 shards every parameter, so it
has nothing to compare).

The fingerprint: each tensor's elements read as integers of their width (float32 -> int32, ...)
and summed in int64 (wrapping alike on every rank), all tensors added up, mod 2^52 so the value
is exact in the float64 vector. Any single changed bit changes it; it costs one read of the
parameters and gradients on the steps it is due.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._stats.distributed import Reduce
from .._stats.transport import Segment

__all__ = ["SEGMENT", "ReplicaCheck", "ReplicaMismatch", "bits_fingerprint", "minority"]

SEGMENT = "replica_fingerprints"
_MOD = 1 << 52  # exact in a float64 slot
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
FAMILIES = ("gradients", "parameters")


def _bits_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum (int64, wrapping) of a tensor's elements read as integers of their width."""
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    as_int = _INT_OF_WIDTH.get(flat.element_size())
    if as_int is None or flat.dtype == torch.bool:
        return flat.to(torch.int64).sum()
    return flat.view(as_int).sum(dtype=torch.int64)


def bits_fingerprint(tensors: Sequence[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """One exact float64 fingerprint (a 0-d tensor on `dev`) of every bit of `tensors`."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=dev)
    sums = torch.stack([_bits_sum(t).to(dev) for t in tensors])
    return (sums.sum() % _MOD).to(torch.float64)


def minority(values: Sequence[float]) -> tuple[list[int], list[int]]:
    """(ranks that differ from the majority, the majority's ranks); with no strict majority
    (two ranks, or every value different) every rank is in the first list and the second is
    empty. ([], all ranks) when they agree."""
    counts = Counter(values)
    if len(counts) == 1:
        return [], list(range(len(values)))
    top, n = counts.most_common(1)[0]
    if n * 2 <= len(values):
        return list(range(len(values))), []
    return [r for r, v in enumerate(values) if v != top], [r for r, v in enumerate(values) if v == top]


@dataclass(frozen=True)
class ReplicaMismatch:
    """One family's disagreement at one step."""

    step: int
    family: str  # "gradients" or "parameters"
    suspects: tuple[int, ...]  # the ranks that differ from the majority (every rank when there is none)
    majority: tuple[int, ...]
    fingerprints: tuple[float, ...]  # per rank

    def text(self) -> str:
        s = self.suspects
        if not self.majority:
            if len(s) == 2:
                return f"ranks {s[0]} and {s[1]} disagree on their {self.family}"
            return f"no majority: ranks {', '.join(map(str, s))} all hold different {self.family}"
        who = f"rank {s[0]}'s" if len(s) == 1 else f"ranks {', '.join(map(str, s))}'s"
        return f"{who} {self.family} differ from those of ranks {', '.join(map(str, self.majority))}"


class ReplicaCheck:
    """Packs the fingerprints on due steps and compares every rank's (identically on every rank).

    `watched` (the statistics collector's WatchedParams): its `param_rules` say which parameters
    (and gradients) are full replicas on every rank (MAX) and which are shards (SUM_SQ).
    """

    def __init__(self, every: int, watched: Any) -> None:
        self.every = every
        self.watched = watched
        self.last: list[ReplicaMismatch] = []
        self.checks = 0

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def segments(
        self, step: int, grads: list[torch.Tensor], params: list[torch.Tensor], dev: torch.device
    ) -> list[Segment]:
        if not self.due(step):
            return []
        keep = [r == Reduce.MAX for r in self.watched.param_rules]  # replicated (sharded tensors add squares)
        g = [t for t, k in zip(grads, keep) if k] if len(grads) == len(keep) else []
        p = [t for t, k in zip(params, keep) if k] if len(params) == len(keep) else []
        with torch.no_grad():
            fp = torch.stack([bits_fingerprint(g, dev), bits_fingerprint(p, dev)])
        return [Segment(SEGMENT, fp, Reduce.LOCAL)]

    def compare(self, step: int, rows: Sequence[Sequence[float]], layout: dict[str, Any]) -> list[ReplicaMismatch]:
        """The families whose fingerprints differ across ranks this step ([] when not due or equal)."""
        slot = layout.get(SEGMENT)
        self.last = []
        if slot is None:
            return []
        self.checks += 1
        for i, family in enumerate(FAMILIES):
            values = [row[slot.start + i] for row in rows]
            suspects, majority = minority(values)
            if suspects:
                self.last.append(ReplicaMismatch(step, family, tuple(suspects), tuple(majority), tuple(values)))
        return self.last

    def take(self) -> list[ReplicaMismatch]:
        out, self.last = self.last, []
        return out
