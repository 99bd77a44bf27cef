"""The statistics collector: per step, launch every reduction on the device and
start the single device->host copy (`launch`); later, read it and build the record (`resolve`).

The parts: `params` (which parameters are watched), `optim` (state tensors, LR, kind), `kernels` (norms,
extremes), `probes` (activation hooks), `fingerprints`, `transport` (segments, packing, the
lagged copy), `decode` (values -> StepRecord, non-finite localisation), `histograms`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._distributed import LayoutHeader, Reduce
from .._errors import NummonError
from .._policy import Policy
from .._types import StepRecord
from .compiled import has_compiled_parts, unwrap_compiled
from .decode import Decoder, exact_where_overflowed
from .dtypes import dtype_name, narrowest
from .fingerprints import Fingerprinter, tensors_in
from .histograms import histograms
from .kernels import NormKernels, as_real
from .mechanisms import MechanismProbes
from .optim import OptimizerView
from .params import WatchedParams
from .pending import GatherTicket, Pending
from .preclip import PreClipCapture
from .probes import ActivationProbes
from .transport import PinnedPool, Segment, pack, rules_of, signature

__all__ = ["LaunchStep", "StatsCollector", "check_grad_scaler"]

log = logging.getLogger("nummon")

#: after a non-finite step, every module's output is hooked for this many steps
DETAIL_AFTER_NONFINITE = 50
#: the clip ratio is measured on this many gradients, the smallest (clip_grad_norm_ scales
#: every gradient by one factor, so a few tell it; a second read of all of them would cost a
#: full pass over the gradients' memory)
CLIP_ANCHORS = 8
#: ... holding at most this many elements together (at least one gradient): on a small model the
#: 8 smallest can include its largest matrix (the demo CNN's fc1, 1.6M of its 1.6M)
CLIP_ANCHOR_ELEMENTS = 1 << 16
#: gradient dtypes whose range is narrow enough that max |g| is measured on every step (for the
#: others the L2 norm, an upper bound of max |g|, stands for it between the sampled steps)
NARROW_GRAD_DTYPES = ("float16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


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


def check_grad_scaler(scaler: Any) -> None:
    """A GradScaler-like object (`is_enabled()`, `get_scale()`) or None; else a NummonError now,
    rather than an AttributeError at the first overflow step."""
    if scaler is None:
        return
    if not all(callable(getattr(scaler, m, None)) for m in ("is_enabled", "get_scale")):
        raise NummonError(
            f"grad_scaler must be a torch.amp.GradScaler (with is_enabled() and get_scale()), got {type(scaler).__name__}"
        )


class StatsCollector:
    """Computes one step's health statistics for a model and optimizer."""

    def __init__(
        self,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        policy: Policy,
        dist: Any = None,
        grad_scaler: Any = None,
    ) -> None:
        check_grad_scaler(grad_scaler)
        # a torch.compile wrapper: its module is watched (names without `_orig_mod.`), and the
        # forward probes replay the sampled step's first sample eagerly (see compiled.py)
        compiled = model is not None and (unwrap_compiled(model) is not model or has_compiled_parts(model))
        model = unwrap_compiled(model)
        self.model = model
        self.optimizer = optimizer
        self.policy = policy
        self.dist = dist  # a DistributedReducer: one collective over the packed vector per step
        self.grad_scaler = grad_scaler  # non-finite grads under an enabled scaler mean a skipped step
        self.optim = OptimizerView(optimizer)
        self.watched = WatchedParams(model, self.optim)
        meta = [n for n, p in self.watched.named if p.is_meta]
        if meta:
            self.watched.close()
            raise NummonError(
                f"{len(meta)} parameter(s) are on the meta device (first: {meta[0]}), with no values to watch: "
                "materialise the model (e.g. model.to_empty(device=...) and initialise it) before Monitor(...)"
            )
        if self.watched.lazy and dist is not None:  # every rank sizes its buffers from the model now
            self.watched.close()
            raise NummonError(
                f"{len(self.watched.lazy)} parameter(s) of lazy modules are not materialised yet: under "
                "torch.distributed run one forward before Monitor(...)"
            )
        self.device = self.watched.params[0].device if self.watched.params else torch.device("cpu")
        self.kernels = NormKernels()
        self.fingerprint = Fingerprinter()
        self.pinned = PinnedPool()
        self.probes = ActivationProbes(policy.sampling.activations_exclude)
        if model is not None and policy.sampling.activations:
            self.probes.install(model)
        self.decoder = Decoder(dist, grad_scaler, self._count_nonfinite)
        # the segment families of a step, in order (a new statistic adds its function here and
        # its decoder to `decoder.families`)
        self.families: list[Callable[[LaunchStep], list[Segment]]] = [
            self._loss_segments,
            self._grad_segments,
            self._param_segments,
            self._state_segments,
            self._lr_segments,
            self._activation_segments,
            self._mechanism_segments,
            self._batch_segments,
        ]
        mp = policy.mechanisms  # sampled mechanism probes (attention, output log Z, Adam): mechanisms.py
        self.mechanisms = (
            MechanismProbes(
                model,
                optimizer,
                adam=mp.adam,
                attention=mp.attention,
                output=mp.output,
                linear_rms=mp.linear_rms,
                compiled=compiled,
            )
            if mp.enabled
            else None
        )
        if self.mechanisms is not None and self.mechanisms.replay is not None:  # a replayed forward is no training step
            self.mechanisms.replay.others_paused = self._activations_paused
        self._incident_open = False
        self._detail_until = -1  # every module hooked up to this step (after a non-finite one)
        self._narrow_grads = False  # the last gradients had a narrow dtype (float16, float8)
        self._anchor_cache: tuple[int, list[int], Any] = (-1, [], None)
        self._said_no_grads = False  # the warning that no parameter has a gradient, given once
        self.replicas: Any = None  # the Monitor's replica check under data parallelism (nummon/_replicas.py)
        # not under torch.distributed (DDP/FSDP reduce gradients in end-of-backward callbacks of
        # their own, which may run after this one), nor with a GradScaler (gradients are still
        # scaled at the end of backward)
        self.preclip = PreClipCapture(self.watched, self.kernels) if dist is None and grad_scaler is None else None
        if dist is not None:  # a capacity every rank derives alike from the model (see _distributed)
            n, a = len(self.watched.params), len(self.probes.names)
            dist.capacity = max(dist.capacity, 4 * n + 4 * a + 32)

    # ------------------------------------------------------------------ the step
    def launch(
        self, step: int, loss: Any, batch: Any = None, params_due: bool = True, optim_due: bool = True
    ) -> Pending:
        """Launch this step's reductions and start the single device->host copy."""
        with torch.no_grad():  # out= reductions over parameters; and nothing here is for autograd
            return self._launch(step, loss, batch, params_due, optim_due)

    def _launch(self, step: int, loss: Any, batch: Any, params_due: bool, optim_due: bool) -> Pending:
        self._refresh()
        params = self.watched.params
        dev = params[0].device if params else self.device  # the model may have moved
        if isinstance(loss, torch.Tensor):
            dev = loss.device
        close = self._watch_closely(step)  # while an incident is open or after a non-finite step
        s = LaunchStep(
            step,
            loss,
            batch,
            params_due or close,
            optim_due or close,
            self._extremes_due(step, params_due),
            dev,
            self.dist is not None,
        )
        for family in self.families:
            s.segments += family(s)
        if self.replicas is not None:  # fingerprints of the replicated gradients and parameters, when due
            s.segments += self.replicas.segments(step, s.grads, self.watched.local(params), s.dev)
        self._narrow_grads = s.grad_dtype in NARROW_GRAD_DTYPES
        packed, layout = pack(s.segments, s.dev, wide=s.distributed)
        ticket = None
        if s.distributed:
            header = LayoutHeader(
                statistics=packed.numel(),
                layout=signature(layout),
                batch_tensors=-1 if s.batch_tensors is None else len(s.batch_tensors),
                gradients=len(s.grads),
                parameters=len(s.params),
                optimizer_state=len(s.state),
                activations=len(s.acts.names),
            )
            packed, local, capacity = self.dist.gather(packed, header)
            ticket = GatherTicket(local, capacity)
        host, event = self.pinned.to_host(packed)
        self._arm_probes(step + 1)
        if self.preclip is not None:  # what the next backward measures
            self.preclip.absmax = self._extremes_due(step + 1, self.policy.sampling.params_due(step + 1))
        return Pending(
            step=step,
            packed=host,
            event=event,
            layout=layout,
            grad_names=s.grad_names,
            acts=s.acts,
            grad_dtype=s.grad_dtype,
            loss_host=s.loss_host,
            loss_dtype=s.loss_dtype,
            lr=s.lr,
            grads=s.grads,
            params=params if s.params else [],
            state=s.state,
            gather=ticket,
            mech=s.mech,
            clip_anchors=s.clip_anchors,
        )

    def _watch_closely(self, step: int) -> bool:
        return self._incident_open or step <= self._detail_until

    def _extremes_due(self, step: int, params_due: bool) -> bool:
        """max |g| is measured with the parameters' cadence, every step for narrow dtypes and
        while the run is watched closely; the L2 norm bounds it (and shows NaN/Inf) between."""
        return params_due or self._narrow_grads or self._watch_closely(step)

    def _clip_anchors(self, grads: list[torch.Tensor]) -> tuple[list[int], Any]:
        """The positions of the smallest non-empty gradients (at most CLIP_ANCHORS, holding at
        most CLIP_ANCHOR_ELEMENTS but for the first), and a picker for them (chosen once per
        list length)."""
        n = len(grads)
        if self._anchor_cache[0] != n:
            chosen: list[int] = []
            total = 0
            for size, i in sorted((g.numel(), i) for i, g in enumerate(grads) if g.numel())[:CLIP_ANCHORS]:
                if chosen and total + size > CLIP_ANCHOR_ELEMENTS:
                    break
                chosen.append(i)
                total += size
            idx = sorted(chosen) or [0]
            self._anchor_cache = (n, idx, operator.itemgetter(*idx))
        return self._anchor_cache[1], self._anchor_cache[2]

    def _refresh(self) -> None:
        if self.watched.refresh():
            if self.model is not None and self.policy.sampling.activations:
                self.probes.install(self.model)  # the model grew: watch the new modules' outputs too
            if self.preclip is not None:  # its last backward missed the new parameters
                self.preclip.take()
                self.preclip.install()

    # one function per segment family: each reads the step's inputs, notes what decoding needs
    # and returns its segments, in this order (later families may use what earlier ones noted)
    def _loss_segments(self, s: LaunchStep) -> list[Segment]:
        params = self.watched.params
        s.loss_dtype = dtype_name(params[0].dtype) if params else "float32"
        if isinstance(s.loss, torch.Tensor):
            s.loss_dtype = dtype_name(s.loss.dtype)
            return [Segment("loss", s.loss.detach().reshape(1), Reduce.MEAN)]
        if s.distributed:  # every rank must pack the same layout
            return [Segment("loss", torch.tensor([float(s.loss)], device=s.dev), Reduce.MEAN)]
        s.loss_host = float(s.loss)
        return []

    def _grad_segments(self, s: LaunchStep) -> list[Segment]:
        """Gradient norms and max |g|: the pre-clip capture's when a backward left one (today's
        gradients are then measured only for the clip ratio), else today's gradients."""
        grads, names, raw = self.watched.grads(s.dev, s.distributed)
        rules = self.watched.param_rules
        pre = self.preclip.take() if self.preclip is not None else None
        segs = []
        if pre is not None:
            segs.append(Segment("grad_norms", pre.norms, Reduce.LOCAL))  # single process only
            if pre.extremes is not None:
                segs.append(Segment(pre.extremes[0], pre.extremes[1], Reduce.LOCAL))
            if grads and names == pre.names:  # the clip ratio: a few gradients again, after clipping
                idx, pick = self._clip_anchors(grads)
                picked = pick(grads)
                s.clip_anchors = idx
                segs.append(
                    Segment(
                        "grad_norms_post",
                        self.kernels.l2_norms(list(picked) if len(idx) > 1 else [picked], key="grad_norms_post"),
                        Reduce.LOCAL,
                    )
                )
            elif grads:  # other gradients than the backward left (replaced, or more): all of them
                segs.append(
                    Segment("grad_norms_post", self.kernels.l2_norms(grads, key="grad_norms_post_all"), Reduce.LOCAL)
                )
            s.grads, s.grad_names, raw_dtypes = pre.grads, pre.names, pre.raw_dtypes
        else:
            if grads and s.extremes_due:
                norms, absmax = self.kernels.norms_and_absmax(grads, key="grads")
                segs += [Segment("grad_norms", norms, rules), Segment("grad_absmax", absmax, Reduce.MAX)]
            elif grads:
                segs.append(Segment("grad_norms", self.kernels.l2_norms(grads, key="grads"), rules))
            s.grads, s.grad_names, raw_dtypes = grads, names, set(map(operator.attrgetter("dtype"), raw))
        for dt in raw_dtypes:
            s.grad_dtype = narrowest(s.grad_dtype, dtype_name(dt))
        if not s.grads and self.watched.params and not self._said_no_grads:
            self._say_no_grads(s.step)
        return segs

    def _say_no_grads(self, step: int) -> None:
        """Once per run: no watched parameter has a gradient (post_step before any backward, or
        after zero_grad); the record then shows the gradient statistics as missing (None)."""
        self._said_no_grads = True
        log.warning(
            "nummon: no gradients at step %d on any of the %d watched parameters (first: %s): post_step ran "
            "before backward or after optimizer.zero_grad(); call it after optimizer.step() and before "
            "zero_grad(). Gradient statistics are missing from the record (grad_norm None) while this lasts",
            step,
            len(self.watched.params),
            self.watched.names[0],
        )

    def _param_segments(self, s: LaunchStep) -> list[Segment]:
        watched = self.watched
        if not (s.params_due and watched.params):
            return []
        s.params = watched.local(watched.params)
        measured = [as_real(p) for p in s.params] if watched.has_complex else s.params
        return [Segment("param_norms", self.kernels.l2_norms(measured, key="param_norms"), watched.param_rules)]

    def _state_segments(self, s: LaunchStep) -> list[Segment]:
        state = self.optim.state_tensors() if s.optim_due else []
        if not state:
            return []
        s.state = state
        local = self.watched.local(state)
        measured = [as_real(t) for t in local] if self.watched.has_complex else local
        return [Segment("state_norms", self.kernels.l2_norms(measured, key="state_norms"), self.optim.state_rules)]

    def _lr_segments(self, s: LaunchStep) -> list[Segment]:
        s.lr, lr_tensor = self.optim.lr()
        return [] if lr_tensor is None else [Segment("lr", lr_tensor, Reduce.LOCAL)]

    def _activation_segments(self, s: LaunchStep) -> list[Segment]:
        s.acts, segs = self.probes.take(s.distributed)
        return segs

    def _mechanism_segments(self, s: LaunchStep) -> list[Segment]:
        if self.mechanisms is None:
            return []
        s.mech, segs = self.mechanisms.take(s.distributed, s.loss)
        return segs

    def _batch_segments(self, s: LaunchStep) -> list[Segment]:
        s.batch_tensors = tensors_in(s.batch) if s.batch is not None else None
        if not s.batch_tensors:
            return []
        segs = []
        fl = [t for t in s.batch_tensors if t.is_floating_point() or t.is_complex()]
        if fl:
            bad = torch.stack([(~torch.isfinite(t)).sum() for t in fl]).sum().reshape(1)
            segs.append(Segment("input_nonfinite", bad, Reduce.SUM))
        segs.append(Segment("fingerprint", torch.stack([self.fingerprint(t) for t in s.batch_tensors]), Reduce.LOCAL))
        return segs

    def _arm_probes(self, next_step: int) -> None:
        """Every module's output hooked on the next forward (not only the block boundaries) on
        the cadence, while an incident is open, after a non-finite step, or for histograms:
        decided from the step number and the (rank-identical) records, so alike on every rank."""
        every = self.policy.sampling.activations_all_every
        self.probes.set_detail(
            self.probes.want_tensors or self._incident_open or next_step <= self._detail_until or next_step % every == 0
        )

    def watch_all_modules(self, on: bool) -> None:
        """Hook every watched module's output, and measure everything every step, while `on`
        (the Monitor: while an incident is open)."""
        self._incident_open = on
        if on:
            self.probes.set_detail(True)
            if self.preclip is not None:
                self.preclip.absmax = True

    def resolve(self, pending: Pending) -> StepRecord:
        """Read a launched step on the host (waits for its copy) and build the StepRecord."""
        if pending.event is not None and not pending.event.query():
            pending.event.synchronize()  # only when the GPU is more than a step behind
        vals = pending.packed.tolist()
        sources = None
        if self.dist is not None:
            ticket = pending.gather
            assert ticket is not None  # launched with `self.dist` too, which gathered it
            rows = self.dist.finish(vals, ticket.local, ticket.capacity, pending.step)
            if self.replicas is not None:  # every rank's fingerprints side by side
                self.replicas.compare(pending.step, rows, pending.layout)
            vals, src = self.dist.combine(rows, rules_of(pending.layout))
            sources = {name: src[s.start : s.stop] for name, s in pending.layout.items()}
        rec = self.decoder.record(pending, vals, sources)
        if rec.nonfinite_parts and not pending.params and self.dist is None:
            self._check_params(rec)
        if self.mechanisms is not None:
            self.mechanisms.decode(rec, pending.layout, vals, pending.mech)
        if rec.nonfinite_parts:  # name the first non-finite module exactly on the next steps
            self._detail_until = max(self._detail_until, rec.step + 1 + DETAIL_AFTER_NONFINITE)
            self.probes.set_detail(True)
            if self.preclip is not None:  # and measure max |g| from the next backward on
                self.preclip.absmax = True
        return rec

    def _check_params(self, rec: StepRecord) -> None:
        """A non-finite step that did not measure the parameters (not due) measures them now:
        weights an update made non-finite are the recovery's cue to roll back, where skipping the
        batch would not help. The failure path only: its host read costs a healthy run nothing.
        (Under torch.distributed the next due step, identical on every rank, tells it.)"""
        params = self.watched.params
        if not params:
            return
        with torch.no_grad():
            measured = [as_real(p) for p in self.watched.local(params)]
            norms = exact_where_overflowed(self.kernels.l2_norms(measured, key="param_check").tolist(), measured)
        rec.param_norm = math.sqrt(math.fsum(v * v for v in norms)) if all(map(math.isfinite, norms)) else math.nan
        if not math.isfinite(rec.param_norm) and "parameters" not in rec.nonfinite_parts:
            rec.nonfinite_parts = rec.nonfinite_parts + ("parameters",)

    # ------------------------------------------------------------------ the rest
    def optimizer_kind(self) -> str | None:
        return self.optim.kind()

    def _count_nonfinite(self) -> int:
        # failure path only: exact counts cost a sync, which no longer matters once a run is failing
        total = 0
        for p in self.watched.params:
            total += int((~torch.isfinite(p.detach())).sum())
            if p.grad is not None and not p.grad.is_sparse:
                total += int((~torch.isfinite(p.grad)).sum())
        return total

    def want_activation_histograms(self, on: bool) -> None:
        self.probes.want_tensors = on
        if on:
            self.probes.set_detail(True)
        else:
            self.probes.tensors = {}

    def histograms(self, bins: int = 64) -> dict[str, dict[str, Any]]:
        """Histograms of gradients, parameters and (last forward's) activations per layer."""
        tensors: list[tuple[str, torch.Tensor]] = []
        for n, p in self.watched.named:
            tensors.append((f"params/{n}", p.detach()))
            if p.grad is not None and not p.grad.is_sparse:
                tensors.append((f"grads/{n}", p.grad.detach()))
        tensors += [(f"activations/{n}", t) for n, t in self.probes.tensors.items()]
        self.probes.tensors = {}
        return histograms(tensors, bins)

    @contextlib.contextmanager
    def _activations_paused(self) -> Iterator[None]:
        was, self.probes.paused = self.probes.paused, True
        try:
            yield
        finally:
            self.probes.paused = was

    @contextlib.contextmanager
    def hooks_paused(self) -> Iterator[None]:
        """Within this block the activation and gradient hooks record nothing."""
        self.probes.paused = True
        if self.mechanisms is not None:
            self.mechanisms.paused = True
        if self.preclip is not None:
            self.preclip.paused = True
        try:
            yield
        finally:
            self.probes.paused = False
            if self.mechanisms is not None:
                self.mechanisms.paused = False
            if self.preclip is not None:
                self.preclip.paused = False

    def remove_hooks(self) -> None:
        self.probes.remove()
        if self.mechanisms is not None:
            self.mechanisms.remove()
        if self.preclip is not None:
            self.preclip.remove()
        self.watched.close()
