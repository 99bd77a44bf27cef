"""The parameters' L2 norms (on the cadence, and every step while the run is watched closely),
and on a failing step that did not measure them, a measurement on the spot (`check_now`)."""

from __future__ import annotations

import math
from types import MappingProxyType

import torch

from ..._core.types import StepRecord
from ..distributed import local_tensor
from ..kernels import NormKernels, as_real
from ..params import WatchedParams
from ..transport import Segment
from .family import (
    NORM_RULES,
    Collecting,
    LaunchStep,
    RecordBuild,
    StatFamily,
    exact_where_overflowed,
    family_norm,
    rules,
)

__all__ = ["FAMILY", "check_now", "decode_params", "launch_params"]


def launch_params(c: Collecting, s: LaunchStep) -> list[Segment]:
    """The parameters' per-tensor L2 norms (float32), when due."""
    watched = c.watched
    if not (s.params_due and watched.params):
        return []
    s.params = watched.local(watched.params)
    measured = [as_real(p) for p in s.params] if watched.has_complex else s.params
    return [Segment("param_norms", c.kernels.l2_norms(measured, key="param_norms"), watched.param_rules)]


def decode_params(b: RecordBuild) -> None:
    """`rec.param_norm`, the total L2 norm; "parameters" is non-finite when a norm is."""
    if b.get("param_norms") is not None:  # (not measured: no call)
        b.rec.param_norm = family_norm(b, "param_norms", b.pending.params, "parameters")


def check_now(watched: WatchedParams, kernels: NormKernels, rec: StepRecord) -> None:
    """A non-finite step that did not measure the parameters (not due) measures them now:
    weights an update made non-finite are the recovery's cue to roll back, where skipping the
    batch would not help. The failure path only: its host read costs a healthy run nothing.
    (Under torch.distributed the next due step, identical on every rank, tells it.)"""
    params = watched.params
    if not params:
        return
    with torch.no_grad():
        measured = [as_real(p) for p in watched.local(params)]
        norms = exact_where_overflowed(kernels.l2_norms(measured, key="param_check").tolist(), measured)
    rec.param_norm = math.sqrt(math.fsum(v * v for v in norms)) if all(map(math.isfinite, norms)) else math.nan
    if not math.isfinite(rec.param_norm) and "parameters" not in rec.nonfinite_parts:
        rec.nonfinite_parts = rec.nonfinite_parts + ("parameters",)


FAMILY = StatFamily(
    "parameters",
    rules(param_norms=NORM_RULES),
    launch_params,
    (decode_params,),
    overflow=MappingProxyType({"param_norms": lambda p: [local_tensor(t) for t in p.params]}),
)
