"""The activations: max |output| of the watched modules' outputs, from the (min, max) each
module's forward hook wrote into a per-dtype buffer on the device (`probes.py`): the
block boundaries every step, every module while watched closely; and the first module whose
output went non-finite, in execution order."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from ..distributed import Reduce
from ..probes import ActivationStep
from ..transport import Segment
from .family import Collecting, LaunchStep, RecordBuild, StatFamily, all_finite, nanmax

__all__ = ["FAMILY", "act_values", "decode_activations", "launch_activations"]


def launch_activations(c: Collecting, s: LaunchStep) -> list[Segment]:
    """The (min, max) buffers this step's forward hooks wrote, one segment per output dtype."""
    s.acts, segs = c.probes.take(s.distributed)
    return segs


def act_values(get: Callable[[str], list[float] | None], acts: ActivationStep) -> dict[int, float]:
    """max |output| of each module that ran this step (NaN-aware), from the per-dtype buffer it
    wrote to; keyed by module index, in execution order."""
    out: dict[int, float] = {}
    cache: dict[Any, tuple[list[float] | None, list[float] | None]] = {}
    for i in acts.order:
        dtype = acts.src[i]
        if dtype not in cache:
            cache[dtype] = (get(f"act_minmax:{dtype}"), get(f"act_max:{dtype}"))
        pairs, maxima = cache[dtype]
        if pairs is not None:
            lo, hi = pairs[2 * i], pairs[2 * i + 1]
            out[i] = math.nan if lo != lo or hi != hi else max(hi, -lo)
        else:  # distributed: maxima already taken on the device
            assert maxima is not None  # a dtype's buffer is packed as one segment or the other
            out[i] = maxima[i]
    return out


def decode_activations(b: RecordBuild) -> None:
    """`rec.layer_activation_max`, `rec.activation_max` (max |output|) and the first non-finite module."""
    acts, rec = b.pending.acts, b.rec
    if not acts.order:
        return
    act = act_values(b.get, acts)
    names = acts.names
    rec.layer_activation_max = {names[i]: v for i, v in act.items()}
    # over the modules hooked every step only, so the series means the same on every step
    always = act.values() if acts.always is None else [v for i, v in act.items() if i in acts.always]
    rec.activation_max = nanmax(list(always)) if always else None
    if not all_finite(act.values()):  # execution order: the first module whose output went non-finite
        b.first_bad_act = next(names[i] for i, v in act.items() if not math.isfinite(v))
        b.parts.append("activations")


FAMILY = StatFamily(
    "activations",
    # single process: (min, max) pairs; under torch.distributed max |x| (ranks combine maxima)
    MappingProxyType({"act_max:*": frozenset({Reduce.MAX}), "act_minmax:*": frozenset({Reduce.LOCAL})}),
    launch_activations,
    (decode_activations,),
)
