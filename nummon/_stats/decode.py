"""Host side: turn one step's combined values into a StepRecord (each statistic family's
decoders, `families/`, in their order), then what no one family decides: the headroom (the
family closest to its dtype's limit), a GradScaler's skipped step, and where the first
non-finite value appeared (and on which rank)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._core.maths import headroom_decades
from .._core.types import StepRecord, publish, record_draft
from .families import decoders
from .families.family import RecordBuild, StatFamily, dense
from .pending import Pending

__all__ = ["Decoder", "locate", "origin_rank"]

Sources = dict[str, list["int | None"]]  # per segment, the rank each element came from


@dataclass(frozen=True)
class _Origin:
    """What localisation needs: the first non-finite module output and non-finite gradients
    (forward order), passed along rather than written anywhere."""

    first_bad_act: str | None
    bad_grads: list[str]


class Decoder:
    """Builds StepRecords. `dist` (a DistributedReducer or None) is needed for the exact
    recomputation of overflowed norms across ranks; `count_nonfinite` counts the parameters'
    non-finite elements on the failure path (a sync, which no longer matters once a run is
    failing). `families`: the statistic families (`families.FAMILIES`, the one list of them),
    whose decoders run in their order."""

    def __init__(
        self, dist: Any, grad_scaler: Any, count_nonfinite: Callable[[], int], families: Sequence[StatFamily]
    ) -> None:
        self.dist = dist
        self.grad_scaler = grad_scaler
        self.count_nonfinite = count_nonfinite
        self.decoders = decoders(tuple(families))
        # {norm segment: the tensors it measured}: what `_exact_overflowed_across_ranks` may recompute
        self.overflow = {seg: measured for f in families for seg, measured in f.overflow.items()}

    def record(self, pending: Pending, vals: list[float], sources: Sources | None) -> StepRecord:
        lay = pending.layout
        if self.dist is not None:
            vals = self._exact_overflowed_across_ranks(vals, pending)

        # every segment's values, sliced once: `get` is then a dict's own (C) method
        get = {name: vals[s.start : s.stop] for name, s in lay.items()}.get
        b = RecordBuild(pending, get, record_draft(pending.step), local=self.dist is None)
        for decode in self.decoders:
            decode(b)
        rec = b.rec
        self._headroom(rec, pending, b.grad_bound)
        if b.parts and self.grad_scaler is not None:
            self._scaler_skip(b)
        if b.parts:
            origin = _Origin(b.first_bad_act, b.bad_grads)
            rec.nonfinite_parts = tuple(b.parts)
            rec.nonfinite_location = locate(rec, origin)
            # exact counts are rank-local: left out under torch.distributed so every rank's alert is identical
            rec.nonfinite_count = self._named_count(rec, origin, pending) if self.dist is None else None
            if sources:
                rec.rank = origin_rank(rec, origin, pending, sources)
        elif sources and rec.grad_max is not None and "grad_absmax" in sources:
            gm = get("grad_absmax")
            rec.rank = sources["grad_absmax"][max(range(len(gm)), key=gm.__getitem__)] if gm else None
        return publish(rec)

    def _named_count(self, rec: StepRecord, origin: _Origin, pending: Pending) -> int | None:
        """The non-finite elements of the tensor `locate` names (failure path only: a sync): the
        batch's, the first non-finite gradient's, the parameters'; None where that tensor is gone
        by now (a module's output: the explanation's re-run counts it) or is the loss."""
        if rec.input_nonfinite:
            return rec.input_nonfinite
        if origin.first_bad_act is not None or "loss" in rec.nonfinite_parts:
            return None
        if origin.bad_grads:
            named = origin.bad_grads[-1]
            grads = [g for n, g in zip(pending.grad_names, pending.grads) if n == named]
            return int((~torch.isfinite(grads[0])).sum()) if grads else None
        if "parameters" in rec.nonfinite_parts:
            return self.count_nonfinite()
        return None

    def _scaler_skip(self, b: RecordBuild) -> None:
        if b.parts == ["gradients"] and self.grad_scaler is not None and self.grad_scaler.is_enabled():
            # after scaler.step() gradients are unscaled; non-finite ones mean the scaler found
            # an overflow and skipped the update: the run is fine, the statistics meaningless
            rec = b.rec
            rec.scaler_skipped = True
            rec.grad_norm = rec.grad_max = rec.update_ratio = rec.clip_ratio = None
            rec.layer_grad_norms = {}
            b.parts = []

    @staticmethod
    def _headroom(rec: StepRecord, pending: Pending, grad_bound: float | None) -> None:
        """The family closest to its own dtype's limit (the loss against the loss's dtype); the
        gradients' max |g|, or its bound (the largest L2 norm) on steps that did not measure it."""
        best = None
        loss_mag = abs(rec.loss) if rec.loss is not None else None
        for mag, dt in (
            (grad_bound, pending.grad_dtype),
            (rec.activation_max, pending.acts.dtype),
            (loss_mag, pending.loss_dtype),
        ):
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
        over: list[tuple[int, torch.Tensor, str]] = []
        for name, measured in self.overflow.items():
            s = pending.layout.get(name)
            if s is None:
                continue
            tensors = measured(pending)
            if len(tensors) != s.stop - s.start:
                continue
            rules = (s.reduce,) * len(tensors) if isinstance(s.reduce, str) else s.reduce
            over += [(i, tensors[j], rules[j]) for j, i in enumerate(range(s.start, s.stop)) if vals[i] == math.inf]
        if not over:
            return vals
        local = []
        for _, t, _ in over:
            n = float(torch.linalg.vector_norm(dense(t).double()))
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
