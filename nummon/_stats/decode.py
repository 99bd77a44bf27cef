"""Host side: turn one step's combined values into a StepRecord, and say where the first
non-finite value appeared (and on which rank)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .._distributed import local_tensor
from .._functional import headroom_decades
from .._types import StepRecord
from .kernels import as_real
from .pending import Pending
from .probes import ActivationStep

__all__ = ["Decoder", "exact_where_overflowed", "locate", "origin_rank"]

Sources = dict[str, list["int | None"]]  # per segment, the rank each element came from


@dataclass(frozen=True)
class _Origin:
    """What localisation needs: the first non-finite module output and non-finite gradients
    (forward order), passed along rather than written anywhere."""

    first_bad_act: str | None
    bad_grads: list[str]


def exact_where_overflowed(norms: list[float], tensors: Sequence[torch.Tensor]) -> list[float]:
    """Float32 norms overflow to inf for finite values above ~1e19; recompute those few in float64.

    Runs only when a norm is not finite (a failing run), so the extra sync costs a healthy run
    nothing. A tensor that really holds NaN/Inf keeps its non-finite norm.
    """
    if all(math.isfinite(v) for v in norms) or len(tensors) != len(norms):
        return norms
    out = list(norms)
    for i, v in enumerate(norms):
        if not math.isfinite(v):
            t = _dense(tensors[i])
            if bool(torch.isfinite(t).all()):
                out[i] = float(torch.linalg.vector_norm(t.double()))
    return out


def _dense(t: torch.Tensor) -> torch.Tensor:
    t = as_real(t.detach())
    return t.coalesce().values() if t.is_sparse else t


def _l2(values: Sequence[float]) -> float:
    # in float64 on the host: the sum of squares of float32 norms cannot overflow here
    try:
        return math.sqrt(math.fsum(v * v for v in values))
    except OverflowError:
        return math.inf


def _absmax(lo: float, hi: float) -> float:
    """max |x| from a tensor's min and max; NaN if either is NaN."""
    return math.nan if lo != lo or hi != hi else max(hi, -lo)


def _nanmax(values: Sequence[float]) -> float:
    m = -math.inf
    for v in values:
        if math.isnan(v):
            return math.nan
        m = max(m, v)
    return m


def _act_values(get: Callable[[str], "list[float] | None"], acts: ActivationStep) -> list[float]:
    """max |output| per watched module (NaN-aware), from the per-dtype buffer it wrote to."""
    out = [math.nan] * len(acts.src)
    for i, dtype in enumerate(acts.src):
        if dtype is None:
            continue
        pairs = get(f"act_minmax:{dtype}")
        if pairs is not None:
            out[i] = _absmax(pairs[2 * i], pairs[2 * i + 1])
        else:  # distributed: maxima already taken on the device
            out[i] = get(f"act_max:{dtype}")[i]
    return out


class Decoder:
    """Builds StepRecords. `dist` (a DistributedReducer or None) is needed for the exact
    recomputation of overflowed norms across ranks; `count_nonfinite` counts on the failure
    path (a sync, which no longer matters once a run is failing)."""

    def __init__(self, dist: Any, grad_scaler: Any, count_nonfinite: Callable[[], int]) -> None:
        self.dist = dist
        self.grad_scaler = grad_scaler
        self.count_nonfinite = count_nonfinite

    def record(self, pending: Pending, vals: list[float], sources: Sources | None) -> StepRecord:
        lay = pending.layout

        def get(name: str) -> list[float] | None:
            s = lay.get(name)
            return None if s is None else vals[s.start : s.stop]

        if self.dist is not None:
            vals = self._exact_overflowed_across_ranks(vals, pending)
        rec = StepRecord(step=pending.step, lr=pending.lr if "lr" not in lay else get("lr")[0])
        rec.loss = pending.loss_host if pending.loss_host is not None else get("loss")[0]
        parts: list[str] = []
        if not math.isfinite(rec.loss):
            parts.append("loss")
        local = self.dist is None  # combined (distributed) norms are not this rank's to recompute
        bad_grads: list[str] = []
        gn = get("grad_norms")
        gmax = get("grad_absmax")
        if gmax is None and "grad_minmax" in lay:
            mm = get("grad_minmax")
            gmax = [_absmax(lo, hi) for lo, hi in zip(mm[0::2], mm[1::2])]
        if gn is not None:
            gn = exact_where_overflowed(gn, pending.grads) if local else gn
            rec.grad_norm = _l2(gn)
            rec.layer_grad_norms = dict(zip(pending.grad_names, gn))
            rec.grad_max = _nanmax(gmax)
            # a gradient is non-finite when its max |g| or its L2 norm is (a max kernel may skip
            # NaN; a finite-but-huge gradient has a finite max even when its float32 norm overflows)
            bad_grads = [n for n, v, w in zip(pending.grad_names, gmax, gn) if not math.isfinite(v) or math.isnan(w)]
            if bad_grads:
                parts.append("gradients")
        post = get("grad_norms_post")
        if post is not None and gn is not None:  # gn was measured before clipping
            post_norm = _l2(post)
            if rec.grad_norm and math.isfinite(rec.grad_norm) and math.isfinite(post_norm):
                rec.clip_ratio = post_norm / rec.grad_norm
        pn = get("param_norms")
        if pn is not None:
            pn = exact_where_overflowed(pn, pending.params) if local else pn
            rec.param_norm = _l2(pn)
            if not all(math.isfinite(v) for v in pn):
                parts.append("parameters")
        sn = get("state_norms")
        if sn is not None:
            sn = exact_where_overflowed(sn, pending.state) if local else sn
            rec.optim_state_norm = _l2(sn)
            if not all(math.isfinite(v) for v in sn):
                parts.append("optimizer state")
            if rec.lr is not None and rec.param_norm:
                rec.update_ratio = rec.lr * rec.optim_state_norm / rec.param_norm
        elif gn is not None and rec.lr is not None and rec.param_norm:
            applied = rec.grad_norm * rec.clip_ratio if rec.clip_ratio is not None else rec.grad_norm
            rec.update_ratio = rec.lr * applied / rec.param_norm
        first_bad_act = None
        acts = pending.acts
        if acts.order:
            act = _act_values(get, acts)
            rec.layer_activation_max = {acts.names[i]: act[i] for i in acts.order}
            rec.activation_max = _nanmax([act[i] for i in acts.order])
            # execution order: the first module whose output went non-finite
            first_bad_act = next((acts.names[i] for i in acts.order if not math.isfinite(act[i])), None)
            if first_bad_act is not None:
                parts.append("activations")
        inp = get("input_nonfinite")
        if inp is not None and inp[0]:
            rec.input_nonfinite = int(inp[0])
        fp = get("fingerprint")
        if fp is not None:
            rec.fingerprint = "-".join(f"{int(v):013x}" for v in fp)
        self._headroom(rec, pending)
        if parts == ["gradients"] and self.grad_scaler is not None and self.grad_scaler.is_enabled():
            # after scaler.step() gradients are unscaled; non-finite ones mean the scaler found
            # an overflow and skipped the update: the run is fine, the statistics meaningless
            rec.scaler_skipped = True
            rec.grad_norm = rec.grad_max = rec.update_ratio = rec.clip_ratio = None
            rec.layer_grad_norms = {}
            parts = []
        origin = _Origin(first_bad_act, bad_grads)
        if parts:
            rec.nonfinite_parts = tuple(parts)
            rec.nonfinite_location = locate(rec, origin)
            # exact counts are rank-local: left out under torch.distributed so every rank's alert is identical
            rec.nonfinite_count = self.count_nonfinite() if self.dist is None else None
            if sources:
                rec.rank = origin_rank(rec, origin, pending, sources)
        elif sources and rec.grad_max is not None and "grad_absmax" in sources:
            gm = get("grad_absmax")
            rec.rank = sources["grad_absmax"][max(range(len(gm)), key=lambda i: gm[i])] if gm else None
        return rec

    @staticmethod
    def _headroom(rec: StepRecord, pending: Pending) -> None:
        """The family closest to its own dtype's limit (the loss against the loss's dtype)."""
        best = None
        loss_mag = abs(rec.loss) if rec.loss is not None else None
        for mag, dt in ((rec.grad_max, pending.grad_dtype), (rec.activation_max, pending.acts.dtype), (loss_mag, pending.loss_dtype)):
            if mag is None or dt is None or not math.isfinite(mag):
                continue
            h = headroom_decades(mag, dt)
            if best is None or h < best[0]:
                best = (h, dt)
        if best is not None:
            rec.headroom, rec.headroom_dtype = best

    def _exact_overflowed_across_ranks(self, vals: list[float], pending: Pending) -> list[float]:
        """Under torch.distributed, recompute norms that overflowed float32 (combined +inf) from
        every rank's exact float64 sums of squares, so a finite-but-extreme tensor is not taken
        for a non-finite one. Every rank sees the same combined values, so every rank either
        makes the one extra collective or none does."""
        families = {
            "grad_norms": pending.grads,
            "param_norms": [local_tensor(p) for p in pending.params],
            "state_norms": [local_tensor(t) for t in pending.state],
        }
        over: list[tuple[int, torch.Tensor, str]] = []
        for name, tensors in families.items():
            s = pending.layout.get(name)
            if s is None or len(tensors) != s.stop - s.start:
                continue
            rules = (s.reduce,) * len(tensors) if isinstance(s.reduce, str) else s.reduce
            over += [(i, tensors[j], rules[j]) for j, i in enumerate(range(s.start, s.stop)) if vals[i] == math.inf]
        if not over:
            return vals
        local = []
        for _, t, _ in over:
            n = float(torch.linalg.vector_norm(_dense(t).double()))
            local.append(n * n)  # inf past ~1e154, where float ** 2 would raise
        exact = self.dist.exact_norms(local, [rule for _, _, rule in over])
        vals = list(vals)
        for (i, _, _), v in zip(over, exact):
            vals[i] = v
        return vals


def origin_rank(rec: StepRecord, origin: _Origin, pending: Pending, sources: Sources) -> int | None:
    """The rank where the first non-finite value appeared (same order as `locate`)."""
    if rec.input_nonfinite and "input_nonfinite" in sources:
        return sources["input_nonfinite"][0]
    if origin.first_bad_act is not None:
        i = pending.acts.names.index(origin.first_bad_act)
        key = f"act_max:{pending.acts.src[i]}"
        if key in sources:
            return sources[key][i]
    if "loss" in rec.nonfinite_parts and "loss" in sources:
        return sources["loss"][0]
    if origin.bad_grads and "grad_absmax" in sources:
        return sources["grad_absmax"][pending.grad_names.index(origin.bad_grads[-1])]
    return None


def locate(rec: StepRecord, origin: _Origin) -> str:
    """Where the first non-finite value appeared, in the order the step computed things."""
    if rec.input_nonfinite:
        return "input batch"
    if origin.first_bad_act is not None:
        return f"output of `{origin.first_bad_act}` (forward)"
    if "loss" in rec.nonfinite_parts:
        return "loss (forward, after the last watched module)"
    if origin.bad_grads:  # backward runs in reverse: the origin is the last one in forward order
        return f"gradient of `{origin.bad_grads[-1]}` (backward)"
    if "parameters" in rec.nonfinite_parts:
        return "parameters (optimizer step)"
    if "optimizer state" in rec.nonfinite_parts:
        return "optimizer state"
    return "loss"

