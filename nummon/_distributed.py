"""torch.distributed support: one collective per step, identical decisions on every rank.

Each rank packs its statistics into one float64 vector (same layout on every rank); a single
``all_gather_into_tensor`` gives every rank every rank's vector; each rank then combines them
the same way on the host (sums of squares summed for sharded tensors, maxima maxed, losses
averaged, non-finite counts summed, the rank holding each maximum / first non-finite kept),
so every rank feeds identical records to identical detectors and takes identical decisions.
"""
from __future__ import annotations

import datetime
import math
from typing import Any, Sequence

import torch
import torch.distributed as dist

_SUM_SQ = "sum_sq"  # sharded: the global L2 norm is sqrt of the sum of the ranks' squares
_REPLICATED = "replicated"  # every rank holds the full tensor (DDP): any rank's value; NaN wins


class DistributedError(RuntimeError):
    """A collective failed (a rank died, the group's timeout passed)."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor (norms of DTensors would each start a collective)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def is_sharded(t: Any) -> bool:
    """True for a DTensor with a Shard placement (FSDP2) or an FSDP1 flat parameter."""
    placements = getattr(t, "placements", None)
    if placements is not None:
        return any(type(p).__name__ in ("Shard", "_StridedShard") for p in placements)
    return bool(getattr(t, "_is_flat_param", False)) or type(t).__name__ == "FlatParameter"


def _group_timeout(group: Any) -> float | None:
    try:
        opts = dist.distributed_c10d._get_default_timeout(dist.get_backend(group))
        return opts.total_seconds() if isinstance(opts, datetime.timedelta) else None
    except Exception:
        return None


class DistributedReducer:
    """Gathers each step's packed statistics from every rank in one collective."""

    def __init__(self, group: Any = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialised")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.collectives = 0  # one per step: tests read this
        self.timeout_s = _group_timeout(group)

    def gather(self, packed: torch.Tensor) -> torch.Tensor:
        """(world * n,) with every rank's packed vector, rank-major."""
        backend = dist.get_backend(self.group)
        if backend == "nccl" and packed.device.type != "cuda":
            packed = packed.cuda()
        out = torch.empty(self.world * packed.numel(), dtype=packed.dtype, device=packed.device)
        self.collectives += 1
        try:
            _all_gather(out, packed.contiguous(), self.group)
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            limit = f" (group timeout {self.timeout_s:.0f} s)" if self.timeout_s else ""
            raise DistributedError(
                f"nummon: gathering step statistics across {self.world} ranks failed on rank {self.rank}{limit}: {first}"
            ) from None
        return out

    def combine(
        self, vals: Sequence[float], layout: dict[str, slice], kinds: dict[str, list[str]]
    ) -> tuple[list[float], dict[str, list[int | None]]]:
        """One combined vector (same layout) and, per segment, the rank each entry came from
        (the first rank where it was non-finite, else the rank holding the maximum)."""
        n = len(vals) // self.world
        rows = [vals[r * n : (r + 1) * n] for r in range(self.world)]
        out = list(rows[self.rank])
        ranks: dict[str, list[int | None]] = {}
        for name, sl in layout.items():
            idx = range(sl.start, sl.stop)
            seg_kinds = kinds.get(name)
            src: list[int | None] = []
            for j, i in enumerate(idx):
                col = [row[i] for row in rows]
                bad = next((r for r, v in enumerate(col) if not math.isfinite(v)), None)
                if name == "loss":
                    out[i] = math.fsum(col) / self.world if bad is None else col[bad]
                elif name in ("input_nonfinite",):
                    out[i] = math.fsum(col)
                elif name in ("fingerprint", "lr"):
                    pass  # rank-local / identical
                elif seg_kinds is not None and seg_kinds[j] == _SUM_SQ:
                    out[i] = col[bad] if bad is not None else math.sqrt(math.fsum(v * v for v in col))
                else:  # maxima, and replicated norms: the largest, NaN first
                    out[i] = col[bad] if bad is not None else max(col)
                src.append(bad if bad is not None else max(range(self.world), key=lambda r: col[r]))
            ranks[name] = src
        return out, ranks


    def exact_norms(self, local_sum_sq: Sequence[float], kinds: Sequence[str]) -> list[float]:
        """Global L2 norms from each rank's exact float64 sums of squares (one more collective).

        For the failure path only: float32 norms overflow to inf for finite values above ~1e19,
        and every rank sees the same combined inf, so every rank makes this call together.
        """
        k = len(local_sum_sq)
        gathered = self.gather(torch.tensor(list(local_sum_sq), dtype=torch.float64)).tolist()
        out = []
        for j in range(k):
            col = [gathered[r * k + j] for r in range(self.world)]
            if any(math.isnan(v) for v in col):
                out.append(math.nan)
            elif kinds[j] == _SUM_SQ:  # shards: the squares add up
                out.append(math.sqrt(math.fsum(col)))
            else:  # replicated: every rank holds the whole tensor
                out.append(math.sqrt(max(col)))
        return out


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    # all_gather_single supersedes all_gather_into_tensor in newer torch; both are one collective
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def norm_kinds(tensors: Sequence[Any]) -> list[str]:
    return [_SUM_SQ if is_sharded(t) else _REPLICATED for t in tensors]
