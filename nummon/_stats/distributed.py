"""torch.distributed support: one collective per step, identical decisions on every rank.

Each rank packs its statistics into one float64 vector; every element of it carries the rule
that combines it across ranks, declared where the statistic was packed (see `Reduce`). A single
``all_gather_into_tensor`` gives every rank every rank's vector, and each rank applies the
declared rules the same way on the host, so every rank feeds identical records to identical
detectors and takes identical decisions.

The gathered vector has a fixed capacity, derived from the model and agreed between ranks once
at install (the largest any rank derived: ranks whose models differ still gather the same
number of elements) and grown by all ranks together, with a small header in front (`LayoutHeader`): ranks
that pack different layouts (a batch of two tensors on one rank, one on another) therefore
still gather the same number of elements, and the header check turns the mismatch into a
`DistributedError` that names the rank and the difference, instead of a crashed backend.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._core.errors import DistributedError

__all__ = [
    "DistributedError",
    "DistributedReducer",
    "LayoutHeader",
    "Reduce",
    "is_sharded",
    "local_tensor",
    "norm_rules",
]

#: Upper bound on how long nummon waits for a collective by default (the group's own timeout
#: is 30 min unless set, far longer than a training loop should stall on a monitor).
DEFAULT_TIMEOUT_S = 300.0


class Reduce:
    """How one packed element is combined across ranks (a non-finite value always wins)."""

    SUM_SQ = "sum_sq"  # a shard's L2 norm: the global norm is sqrt of the sum of squares
    MAX = "max"  # maxima, and norms of replicated tensors (every rank holds the whole tensor)
    MIN = "min"
    SUM = "sum"  # counts
    MEAN = "mean"  # the loss
    LOCAL = "local"  # rank-local values kept as they are (fingerprints, the LR)
    ALL = frozenset({SUM_SQ, MAX, MIN, SUM, MEAN, LOCAL})


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


def norm_rules(tensors: Sequence[Any], all_sharded: bool = False) -> tuple[str, ...]:
    """The cross-rank rule of each tensor's L2 norm: shards add squares, replicas agree."""
    if all_sharded:
        return (Reduce.SUM_SQ,) * len(tensors)
    return tuple(Reduce.SUM_SQ if is_sharded(t) else Reduce.MAX for t in tensors)


@dataclass(frozen=True)
class LayoutHeader:
    """What a rank packed this step, sent in front of its statistics (small integers, exact in
    float64). `batch_tensors` is -1 when no batch was passed."""

    statistics: int
    layout: int  # CRC-32 of the segment names, sizes and rules
    batch_tensors: int
    gradients: int
    parameters: int
    optimizer_state: int
    activations: int

    FIELDS = ("statistics", "layout", "batch_tensors", "gradients", "parameters", "optimizer_state", "activations")
    SIZE = len(FIELDS)

    def values(self) -> list[float]:
        return [float(getattr(self, f)) for f in self.FIELDS]


def _describe(field: str, value: int) -> str:
    if field == "batch_tensors":
        return "no batch" if value < 0 else f"a batch of {value} tensor(s)"
    if field == "layout":
        return f"layout {value:08x}"
    return f"{value} {field.replace('_', ' ')}"


def _difference(head0: list[int], head: list[int], rank: int) -> str:
    """The first differing header field in words, the telling ones (batch, counts) before the
    total size and layout checksum that follow from them."""
    for f in LayoutHeader.FIELDS[2:] + LayoutHeader.FIELDS[:2]:
        i = LayoutHeader.FIELDS.index(f)
        if head0[i] != head[i]:
            return f"{_describe(f, head[i])} on rank {rank}, {_describe(f, head0[i])} on rank 0"
    return "identical headers"


def _group_timeout(group: Any) -> float | None:
    """The process group's own collective timeout in seconds (not the backend's default)."""
    pg = group if group is not None else dist.group.WORLD
    try:
        device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        t = pg._get_backend(device).options._timeout if pg is not None else None
        if isinstance(t, datetime.timedelta):
            return t.total_seconds()
    except Exception:
        pass
    try:
        t = dist.distributed_c10d._get_default_timeout(dist.get_backend(group))
        return t.total_seconds() if isinstance(t, datetime.timedelta) else None
    except Exception:
        return None


class DistributedReducer:
    """Gathers each step's packed statistics from every rank in one collective and combines
    them by their declared rules.

    `timeout_s` bounds every wait on the host-synchronous backends (gloo): a rank out of step
    (in a barrier, dead) gives a `DistributedError` after it, not after the group's timeout.
    On NCCL the wait is the stream's (never the host's); its watchdog enforces the group's.
    """

    def __init__(self, group: Any = None, timeout_s: float | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialised")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.group_timeout_s = _group_timeout(group)
        if timeout_s is None:
            timeout_s = min(self.group_timeout_s or DEFAULT_TIMEOUT_S, DEFAULT_TIMEOUT_S)
        self.timeout_s = float(timeout_s)
        self.capacity = 0  # elements per rank in the gathered vector (after the header); grows
        self._headers: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}

    # ------------------------------------------------------------------ collectives
    def agree_capacity(self, capacity: int) -> None:
        """Grow the capacity to `capacity` or the largest any rank asks for (one small all-reduce,
        at install: a rank with an extra layer derives a larger one, and a gather of unequal sizes
        would abort the backend instead of reaching the header check that names the rank)."""
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        want = torch.tensor([float(max(self.capacity, capacity))], dtype=torch.float64, device=device)
        try:
            work = dist.all_reduce(want, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            if self.backend == "nccl":
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DistributedError(
                f"nummon: agreeing the statistics' size across {self.world} ranks failed on rank {self.rank} "
                f"(nummon timeout {self.timeout_s:g} s): {first}"
            ) from None
        self.capacity = int(want.item())

    def _gather(self, local: torch.Tensor, what: str) -> torch.Tensor:
        if self.backend == "nccl" and local.device.type != "cuda":
            local = local.cuda()
        out = torch.empty(self.world * local.numel(), dtype=local.dtype, device=local.device)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        try:
            work = fn(out, local.contiguous(), group=self.group, async_op=True)
            if self.backend == "nccl":
                work.wait()  # the stream waits, not the host
            else:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            limits = f"nummon timeout {self.timeout_s:g} s"
            if self.group_timeout_s:
                limits += f", group timeout {self.group_timeout_s:g} s"
            raise DistributedError(
                f"nummon: gathering {what} across {self.world} ranks failed on rank {self.rank} ({limits}): {first}"
            ) from None
        return out

    def gather(self, packed: torch.Tensor, header: LayoutHeader) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Start this step's one collective.

        Returns (gathered, local, capacity): every rank's [header | statistics | padding] of
        `capacity` statistics (rank-major, on the device), this rank's own full vector (kept
        for the rare re-gather when a layout outgrew the capacity) and the capacity used.
        """
        packed = packed.reshape(-1).to(torch.float64)
        key = (tuple(header.values()), packed.device)
        head = self._headers.get(key)
        if head is None:  # made once per layout: a host->device copy per step could wait on the GPU
            if len(self._headers) > 64:
                self._headers.clear()
            head = self._headers[key] = torch.tensor(key[0], dtype=torch.float64, device=packed.device)
        local = torch.cat([head, packed])
        cap = self.capacity
        if packed.numel() <= cap:
            padded = torch.nn.functional.pad(local, (0, cap - packed.numel()))
        else:  # sent truncated: the header tells every rank to grow and gather again
            padded = local[: LayoutHeader.SIZE + cap]
        return self._gather(padded, "step statistics"), local, cap

    def finish(self, gathered: Sequence[float], local: torch.Tensor, capacity: int, step: int) -> list[list[float]]:
        """Check every rank's header and return each rank's statistics (rank-major rows).

        Raises DistributedError when ranks packed different layouts; re-gathers (all ranks
        together, since all see the same headers) when the layout outgrew the capacity.
        """
        h = LayoutHeader.SIZE
        width = h + capacity
        rows = [list(gathered[r * width : (r + 1) * width]) for r in range(self.world)]
        heads = [[int(v) for v in row[:h]] for row in rows]
        for r in range(self.world):
            if heads[r] != heads[0]:
                raise DistributedError(
                    f"nummon: rank {r} passed different statistics to post_step than rank 0 at step {step}: "
                    f"{_difference(heads[0], heads[r], r)} "
                    "(every rank must pass the same batch structure, model and optimizer)"
                )
        n = heads[0][0]
        if n > capacity:
            self.capacity = max(self.capacity, n + 16)  # a little slack: fingerprints vary
            again = self._gather(torch.nn.functional.pad(local, (0, self.capacity - n)), "step statistics").tolist()
            return self.finish(again, local, self.capacity, step)
        return [row[h : h + n] for row in rows]

    # ------------------------------------------------------------------ combining
    def combine(self, rows: Sequence[Sequence[float]], rules: Sequence[str]) -> tuple[list[float], list[int | None]]:
        """One combined vector and, per element, the rank it came from (the first rank where it
        was non-finite, else the rank holding the maximum), applying each element's rule."""
        out = list(rows[self.rank])
        src: list[int | None] = []
        ranks = range(self.world)
        for i, rule in enumerate(rules):
            col = [row[i] for row in rows]
            bad = next((r for r in ranks if not math.isfinite(col[r])), None)
            if rule == Reduce.SUM:
                out[i] = math.fsum(col)
            elif rule == Reduce.LOCAL:
                pass
            elif bad is not None:
                out[i] = col[bad]
            elif rule == Reduce.MEAN:
                out[i] = math.fsum(col) / self.world
            elif rule == Reduce.SUM_SQ:
                out[i] = math.sqrt(math.fsum(v * v for v in col))
            elif rule == Reduce.MIN:
                out[i] = min(col)
            else:  # Reduce.MAX
                out[i] = max(col)
            src.append(bad if bad is not None else max(ranks, key=lambda r: col[r]))
        return out, src

    def exact_norms(self, local_sum_sq: Sequence[float], rules: Sequence[str]) -> list[float]:
        """Global L2 norms from each rank's exact float64 sums of squares (one more collective).

        For the failure path only: float32 norms overflow to inf for finite values above ~1e19,
        and every rank sees the same combined inf, so every rank makes this call together.
        """
        k = len(local_sum_sq)
        gathered = self._gather(torch.tensor(list(local_sum_sq), dtype=torch.float64), "exact norms").tolist()
        out = []
        for j in range(k):
            col = [gathered[r * k + j] for r in range(self.world)]
            if any(math.isnan(v) for v in col):
                out.append(math.nan)
            elif rules[j] == Reduce.SUM_SQ:  # shards: the squares add up
                out.append(math.sqrt(math.fsum(col)))
            else:  # replicated: every rank holds the whole tensor
                out.append(math.sqrt(max(col)))
        return out
