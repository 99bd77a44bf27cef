"""Host side: turn one step's combined values into a StepRecord, and say where the first
non-finite value appeared (and on which rank)."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core.maths import headroom_decades
from .._core.types import StepRecord
from .distributed import local_tensor
from .kernels import as_real
from .pending import Pending
from .probes import act_values

__all__ = [
    "Decoder",
    "RecordBuild",
    "decode_activations",
    "decode_clip_ratio",
    "decode_grads",
    "decode_inputs",
    "decode_loss",
    "decode_mechanisms",
    "decode_optimizer",
    "decode_params",
    "exact_where_overflowed",
    "locate",
    "origin_rank",
]

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
    if all(map(math.isfinite, norms)) or len(tensors) != len(norms):
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
    # (map/fsum run in C: no Python work per tensor)
    try:
        return math.sqrt(math.fsum(map(operator.mul, values, values)))
    except OverflowError:  # float64 norms recomputed past float32's range
        return math.inf


def _nanmax(values: Sequence[float]) -> float:
    """The largest value; NaN if any is NaN."""
    if not values:
        return -math.inf
    return math.nan if any(map(math.isnan, values)) else max(values)


def _all_finite(values: Iterable[float]) -> bool:
    return all(map(math.isfinite, values))


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


def decode_loss(b: RecordBuild) -> None:
    p = b.pending
    if p.loss_host is not None:
        b.rec.loss = p.loss_host
    else:
        loss = b.get("loss")
        assert loss is not None  # a loss not read on the host rode in the packed vector
        b.rec.loss = loss[0]
    if not math.isfinite(b.rec.loss):
        b.parts.append("loss")


def decode_grads(b: RecordBuild) -> None:
    gn, gmax = b.get("grad_norms"), b.get("grad_absmax")
    if gn is None:
        return
    rec, names = b.rec, b.pending.grad_names
    gn = exact_where_overflowed(gn, b.pending.grads) if b.local else gn
    rec.grad_norm = _l2(gn)
    rec.layer_grad_norms = dict(zip(names, gn))
    b.grad_bound = _nanmax(gn)  # max |g| <= the largest L2 norm: the headroom's bound between samples
    if gmax is None:  # not measured this step: the norms tell finiteness (an overflowed one was recomputed)
        gmax = gn
    else:
        rec.grad_max = _nanmax(gmax)
        b.grad_bound = rec.grad_max
    # a gradient is non-finite when its max |g| or its L2 norm is (a finite-but-huge gradient
    # has a finite max even when its float32 norm overflows)
    if not (math.isfinite(_nanmax(gmax)) and not math.isnan(rec.grad_norm)):
        b.bad_grads = [n for n, v, w in zip(names, gmax, gn) if not math.isfinite(v) or math.isnan(w)]
        if b.bad_grads:
            b.parts.append("gradients")


def decode_clip_ratio(b: RecordBuild) -> None:
    post, rec = b.get("grad_norms_post"), b.rec
    if post is None or rec.grad_norm is None:  # grad_norm was measured before clipping
        return
    pre_norm = rec.grad_norm
    anchors = b.pending.clip_anchors
    if anchors is not None:  # post-clip norms of a few gradients: against the same ones before
        pre = b.get("grad_norms")
        assert pre is not None  # anchors are kept only when the norms before clipping were measured
        pre_norm = _l2([pre[i] for i in anchors])
    post_norm = _l2(post)
    if pre_norm and math.isfinite(pre_norm) and math.isfinite(post_norm):
        rec.clip_ratio = post_norm / pre_norm


def _family_norm(b: RecordBuild, segment: str, tensors: Sequence[torch.Tensor], part: str) -> float | None:
    vals = b.get(segment)
    if vals is None:
        return None
    vals = exact_where_overflowed(vals, tensors) if b.local else vals
    if not _all_finite(vals):
        b.parts.append(part)
    return _l2(vals)


def decode_params(b: RecordBuild) -> None:
    b.rec.param_norm = _family_norm(b, "param_norms", b.pending.params, "parameters")


def decode_optimizer(b: RecordBuild) -> None:
    rec, lr = b.rec, b.get("lr")
    rec.lr = b.pending.lr if lr is None else lr[0]
    rec.optim_state_norm = _family_norm(b, "state_norms", b.pending.state, "optimizer state")
    if rec.lr is None or not rec.param_norm:
        return
    if rec.optim_state_norm is not None:
        rec.update_ratio = rec.lr * rec.optim_state_norm / rec.param_norm
    elif rec.grad_norm is not None:
        applied = rec.grad_norm * rec.clip_ratio if rec.clip_ratio is not None else rec.grad_norm
        rec.update_ratio = rec.lr * applied / rec.param_norm


def decode_activations(b: RecordBuild) -> None:
    acts, rec = b.pending.acts, b.rec
    if not acts.order:
        return
    act = act_values(b.get, acts)
    names = acts.names
    rec.layer_activation_max = {names[i]: v for i, v in act.items()}
    # over the modules hooked every step only, so the series means the same on every step
    always = act.values() if acts.always is None else [v for i, v in act.items() if i in acts.always]
    rec.activation_max = _nanmax(list(always)) if always else None
    if not _all_finite(act.values()):  # execution order: the first module whose output went non-finite
        b.first_bad_act = next(names[i] for i, v in act.items() if not math.isfinite(v))
        b.parts.append("activations")


def decode_inputs(b: RecordBuild) -> None:
    inp, fp = b.get("input_nonfinite"), b.get("fingerprint")
    if inp is not None and inp[0]:
        b.rec.input_nonfinite = int(inp[0])
    if fp is not None:
        b.rec.fingerprint = "-".join(f"{int(v):013x}" for v in fp)


def decode_mechanisms(b: RecordBuild) -> None:
    """The sampled mechanism probes' fields (attention, output log Z, layer RMS, Adam)."""
    ms, rec, get = b.pending.mech, b.rec, b.get
    if ms is None:
        return
    if ms.samples and (v := get("mech_samples")) is not None:
        rec.sample_loss_ratio = v[0]
        rec.sample_loss_top = tuple(int(i) for i in v[1:])
    if ms.attention and (mx := get("mech_attn_max")) is not None:
        ent = get("mech_attn_entropy") or []
        rec.layer_attention_logit_max = dict(zip(ms.attention, mx))
        rec.layer_attention_entropy = dict(zip(ms.attention, ent))
        rec.attention_logit_max = max(mx)
        rec.attention_entropy = min(ent) if ent else None
    if ms.output and (m := get("mech_lse_mean")) is not None:
        lse_max, logit_max = get("mech_lse_max"), get("mech_logit_max")
        assert lse_max is not None and logit_max is not None  # packed with mech_lse_mean
        rec.output_logsumexp_mean = m[0]
        rec.output_logsumexp_max = lse_max[0]
        rec.output_logit_max = logit_max[0]
    if ms.linear and (r := get("mech_linear_rms")) is not None:
        rec.layer_output_rms = dict(zip(ms.linear, r))
    if ms.adam and (r := get("mech_adam_rms")) is not None:
        small, upd = get("mech_adam_small"), get("mech_adam_update")
        assert small is not None and upd is not None  # packed with mech_adam_rms
        rec.layer_adam_ratio_rms = dict(zip(ms.adam, r))
        rec.layer_update_ratio = dict(zip(ms.adam, upd))
        rec.adam_ratio_rms = max(r)
        rec.update_ratio_max = max(upd)
        rec.adam_small_grad_fraction = sum(small) / ms.adam_elements if ms.adam_elements else None
        rec.adam_ratio_bound = ms.adam_bound or None


class Decoder:
    """Builds StepRecords. `dist` (a DistributedReducer or None) is needed for the exact
    recomputation of overflowed norms across ranks; `count_nonfinite` counts the parameters'
    non-finite elements on the failure path (a sync, which no longer matters once a run is failing). `decoders`: the statistic
    families' decoders, in the order of `families.FAMILIES` (the one list of families)."""

    def __init__(
        self,
        dist: Any,
        grad_scaler: Any,
        count_nonfinite: Callable[[], int],
        decoders: Sequence[Callable[[RecordBuild], None]],
    ) -> None:
        self.dist = dist
        self.grad_scaler = grad_scaler
        self.count_nonfinite = count_nonfinite
        self.decoders = tuple(decoders)

    def record(self, pending: Pending, vals: list[float], sources: Sources | None) -> StepRecord:
        lay = pending.layout
        if self.dist is not None:
            vals = self._exact_overflowed_across_ranks(vals, pending)

        def get(name: str) -> list[float] | None:
            s = lay.get(name)
            return None if s is None else vals[s.start : s.stop]

        b = RecordBuild(pending, get, StepRecord(step=pending.step), local=self.dist is None)
        for decode in self.decoders:
            decode(b)
        rec = b.rec
        self._headroom(rec, pending, b.grad_bound)
        self._scaler_skip(b)
        origin = _Origin(b.first_bad_act, b.bad_grads)
        if b.parts:
            rec.nonfinite_parts = tuple(b.parts)
            rec.nonfinite_location = locate(rec, origin)
            # exact counts are rank-local: left out under torch.distributed so every rank's alert is identical
            rec.nonfinite_count = self._named_count(rec, origin, pending) if self.dist is None else None
            if sources:
                rec.rank = origin_rank(rec, origin, pending, sources)
        elif sources and rec.grad_max is not None and "grad_absmax" in sources:
            gm = get("grad_absmax")
            rec.rank = sources["grad_absmax"][max(range(len(gm)), key=gm.__getitem__)] if gm else None
        return rec

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
