"""The common shape of a statistic family (one module each in this folder): what it reserves
in the packed statistics vector (its segments, each with the cross-rank rules it may use), what
it launches on the device (`launch(collector, step) -> segments`, noting on the `LaunchStep`
what decoding will need) and how it turns host floats back into StepRecord fields
(`decode(build)`, one or more decoders run in order).

Model: a torchmetrics `Metric`: its `add_state(name, default, dist_reduce_fx=...)` are the
segments (here a segment's rule travels with its values, `transport.Segment`), `update` the
launch, `compute` the decode. A family is a declaration, not an object with state: what it
keeps between steps (hooks, buffers, the clip ratio's anchors) lives on the collector's parts,
so the collector's one pass over `FAMILIES` costs one call per family."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import torch

from ..._core.types import StepRecord
from ..cadence import Cadence
from ..distributed import Reduce
from ..fingerprints import Fingerprinter
from ..kernels import NormKernels, as_real
from ..mechanisms import MechanismProbes
from ..optim import OptimizerView
from ..params import WatchedParams
from ..pending import Pending
from ..preclip import PreClipCapture
from ..probes import ActivationProbes
from ..transport import PinnedPool, Segment

__all__ = [
    "NORM_RULES",
    "Collecting",
    "Decode",
    "Launch",
    "LaunchStep",
    "RecordBuild",
    "StatFamily",
    "all_finite",
    "exact_where_overflowed",
    "family_norm",
    "l2",
    "nanmax",
    "rules",
]

#: per-tensor norms: a shard's L2 norm combines by sum of squares, a replicated tensor's by max
#: (chosen per tensor from its sharding: `WatchedParams.param_rules`, `OptimizerView.state_rules`)
NORM_RULES = frozenset({Reduce.SUM_SQ, Reduce.MAX})


@dataclass
class LaunchStep:
    """One step's inputs while the segment families launch, and what each notes for decoding."""

    step: int
    loss: Any
    batch: Any
    params_due: bool
    optim_due: bool
    extremes_due: bool  # max |g| this step (with the parameters, or every step for narrow dtypes)
    dev: torch.device
    distributed: bool
    segments: list[Segment] = field(default_factory=list)
    loss_host: float | None = None
    loss_dtype: str = "float32"
    grads: list[torch.Tensor] = field(default_factory=list)
    grad_names: list[str] = field(default_factory=list)
    grad_dtype: str | None = None
    clip_anchors: list[int] | None = None  # positions in `grads` the post-clip norms measured
    params: list[torch.Tensor] = field(default_factory=list)  # the measured parameters (rank-local)
    state: list[torch.Tensor] = field(default_factory=list)
    lr: float | None = None
    acts: Any = None  # an ActivationStep
    mech: Any = None  # a MechanismStep: the names behind the sampled mechanism segments
    batch_tensors: list[torch.Tensor] | None = None
    clip_norm: float | None = None  # the max total norm the loop clips to after post_step (None: none)


class Collecting(Protocol):
    """What the launch functions read of the statistics collector."""

    watched: WatchedParams
    optim: OptimizerView
    kernels: NormKernels
    fingerprint: Fingerprinter
    probes: ActivationProbes
    mechanisms: MechanismProbes | None
    preclip: PreClipCapture | None
    anchors: Any  # the gradients family's `ClipAnchors` (it imports this module, so not named here)
    said_no_grads: bool
    cadence: Cadence
    pinned: PinnedPool
    dist: Any  # a DistributedReducer, or None in a single process
    replicas: Any  # the replica check, or None


@dataclass
class RecordBuild:
    """One record while the family decoders fill it in, and what localisation will need."""

    pending: Pending
    get: Callable[[str], list[float] | None]
    rec: StepRecord
    local: bool  # this rank's own values (single process): overflowed norms may be recomputed
    parts: list[str] = field(default_factory=list)  # the families that went non-finite
    bad_grads: list[str] = field(default_factory=list)
    grad_bound: float | None = None  # max |g|, or the largest gradient L2 norm when max |g| was not measured
    first_bad_act: str | None = None


Launch = Callable[[Collecting, LaunchStep], list[Segment]]
Decode = Callable[[RecordBuild], None]
#: the tensors behind a norm segment, read from the launched step (rank-local parts)
Measured = Callable[[Pending], Sequence[torch.Tensor]]


@dataclass(frozen=True)
class StatFamily:
    """One statistic family. `segments`: {segment name (a trailing "*" names a prefix): the
    cross-rank rules its elements may use}; `launch`: its device side; `decode`: its host side,
    one or more decoders run in order; `overflow`: {norm segment: the tensors it measured}, whose
    float32 norms that overflowed are recomputed exactly across ranks (`Decoder`)."""

    name: str
    segments: Mapping[str, frozenset[str]]
    launch: Launch
    decode: tuple[Decode, ...]
    overflow: Mapping[str, Measured] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError(f"statistic family {self.name!r} declares no segments")
        for seg, rules in self.segments.items():
            if not rules or not rules <= Reduce.ALL:
                raise ValueError(f"statistic family {self.name!r}: segment {seg!r} has no valid reduction {rules!r}")
        if not callable(self.launch):
            raise ValueError(f"statistic family {self.name!r} declares no launch function")
        if not self.decode or not all(map(callable, self.decode)):
            raise ValueError(f"statistic family {self.name!r} declares no decoder")
        if not set(self.overflow) <= set(self.segments):
            raise ValueError(f"statistic family {self.name!r} recomputes segments it does not declare")

    def rules_for(self, segment: str) -> frozenset[str] | None:
        """The rules this family declares for a segment name, or None if it declares no such segment."""
        if segment in self.segments:
            return self.segments[segment]
        return next((r for p, r in self.segments.items() if p.endswith("*") and segment.startswith(p[:-1])), None)


def rules(**by_segment: frozenset[str] | str) -> Mapping[str, frozenset[str]]:
    """{segment: its rules} from keyword arguments, one rule given as a string."""
    return MappingProxyType({k: frozenset({v}) if isinstance(v, str) else v for k, v in by_segment.items()})


# ------------------------------------------------------------------ host maths the decoders share
def exact_where_overflowed(norms: list[float], tensors: Sequence[torch.Tensor]) -> list[float]:
    """Float32 norms overflow to inf for finite values above ~1e19; recompute those few in float64.

    Runs only when a norm is not finite (a failing run), so the extra sync costs a healthy run
    nothing. A tensor that really holds NaN/Inf keeps its non-finite norm.
    """
    if all(map(math.isfinite, norms)) or len(tensors) != len(norms):
        return norms
    out = list(norms)
    for i, v in enumerate(norms):
        if not math.isfinite(v):
            t = dense(tensors[i])
            if bool(torch.isfinite(t).all()):
                out[i] = float(torch.linalg.vector_norm(t.double()))
    return out


def dense(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as a dense real tensor (a sparse one's stored values, a complex one's (re, im))."""
    t = as_real(t.detach())
    return t.coalesce().values() if t.is_sparse else t


def l2(values: Sequence[float]) -> float:
    """The L2 norm of per-tensor norms (the family's total)."""
    # in float64 on the host: the sum of squares of float32 norms cannot overflow here
    # (map/fsum run in C: no Python work per tensor)
    try:
        return math.sqrt(math.fsum(map(operator.mul, values, values)))
    except OverflowError:  # float64 norms recomputed past float32's range
        return math.inf


def nanmax(values: Sequence[float]) -> float:
    """The largest value; NaN if any is NaN."""
    if not values:
        return -math.inf
    return math.nan if any(map(math.isnan, values)) else max(values)


def all_finite(values: Iterable[float]) -> bool:
    return all(map(math.isfinite, values))


def family_norm(b: RecordBuild, segment: str, tensors: Sequence[torch.Tensor], part: str) -> float | None:
    """The total L2 norm of a norm segment (None when not packed), its overflowed float32 norms
    recomputed on a single process; `part` is noted as non-finite when a norm is."""
    vals = b.get(segment)
    if vals is None:
        return None
    vals = exact_where_overflowed(vals, tensors) if b.local else vals
    if not all_finite(vals):
        b.parts.append(part)
    return l2(vals)
