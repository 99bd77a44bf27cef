"""The statistics collector: per step, launch every reduction on the device and
start the single device->host copy (`launch`); later, read it and build the record (`resolve`).

The parts: `params` (which parameters are watched), `optim` (state tensors, LR, kind), `kernels` (norms,
extremes; `kernel_plan`: how each list is measured), `probes` (activation hooks), `fingerprints`, `families/` (each statistic's segments,
launch and decoders), `cadence` (what is measured when), `transport` (segments, packing, the
lagged copy), `decode` (values -> StepRecord, non-finite localisation), `histograms`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._core.errors import NummonError
from .._core.types import StepRecord
from .._policy.policy import Policy
from .cadence import NARROW_GRAD_DTYPES, Cadence
from .compiled import has_compiled_parts, unwrap_compiled
from .decode import Decoder
from .distributed import LayoutHeader
from .families import FAMILIES, parameters
from .families.family import LaunchStep
from .families.gradients import ClipAnchors
from .fingerprints import Fingerprinter
from .histograms import histograms
from .kernels import NormKernels
from .mechanisms import MechanismProbes
from .optim import OptimizerView
from .params import WatchedParams
from .pending import GatherTicket, Pending
from .plain_step import PlainLaunch
from .preclip import PreClipCapture
from .probes import ActivationProbes
from .transport import PinnedPool, pack, rules_of, signature

__all__ = ["StatsCollector", "check_grad_scaler", "refuse_unwatchable"]


def check_grad_scaler(scaler: Any) -> None:
    """A GradScaler-like object (`is_enabled()`, `get_scale()`) or None; else a NummonError now,
    rather than an AttributeError at the first overflow step."""
    if scaler is None:
        return
    if not all(callable(getattr(scaler, m, None)) for m in ("is_enabled", "get_scale")):
        raise NummonError(
            f"grad_scaler must be a torch.amp.GradScaler (with is_enabled() and get_scale()), got {type(scaler).__name__}"
        )


def refuse_unwatchable(watched: WatchedParams, distributed: bool) -> None:
    """A NummonError (the watch closed) for parameters with no values yet: on the meta device,
    or of lazy modules under torch.distributed (every rank sizes its buffers from the model now)."""
    meta = [n for n, p in watched.named if p.is_meta]
    if meta:
        watched.close()
        raise NummonError(
            f"{len(meta)} parameter(s) are on the meta device (first: {meta[0]}), with no values to watch: "
            "materialise the model (e.g. model.to_empty(device=...) and initialise it) before Monitor(...)"
        )
    if watched.lazy and distributed:
        watched.close()
        raise NummonError(
            f"{len(watched.lazy)} parameter(s) of lazy modules are not materialised yet: under "
            "torch.distributed run one forward before Monitor(...)"
        )


class StatsCollector:
    """Computes one step's health statistics for a model and optimizer; `start_step`: the step
    number of the first forward it sees."""

    def __init__(
        self,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        policy: Policy,
        dist: Any = None,
        grad_scaler: Any = None,
        start_step: int = 0,
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
        refuse_unwatchable(self.watched, distributed=dist is not None)
        self.device = self.watched.params[0].device if self.watched.params else torch.device("cpu")
        self.kernels = NormKernels()
        self.fingerprint = Fingerprinter()
        self.pinned = PinnedPool()
        self.probes = ActivationProbes(policy.sampling.activations_exclude, traced=compiled)
        if model is not None and policy.sampling.activations:
            self.probes.install(model)
        self.decoder = Decoder(dist, grad_scaler, self._count_nonfinite, FAMILIES)
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
        self.anchors, self.plain = ClipAnchors(), PlainLaunch()  # the clip ratio's gradients; plain steps
        self.said_no_grads = False  # the warning that no parameter has a gradient, given once
        self.replicas: Any = None  # the Monitor's replica check under data parallelism (nummon/_forensics/replicas.py)
        # not under torch.distributed (DDP/FSDP reduce gradients in end-of-backward callbacks of
        # their own, which may run after this one), nor with a GradScaler (gradients are still
        # scaled at the end of backward)
        self.preclip = PreClipCapture(self.watched, self.kernels) if dist is None and grad_scaler is None else None
        self.cadence = Cadence(policy, self.probes, self.preclip)
        self.cadence.arm_next(start_step, first=True)  # the first forward, made before any launch
        # the Monitor's call, every step: the cadence's own method, with no call in between
        self.watch_all_modules = self.cadence.watch_all_modules
        if dist is not None:  # a capacity derived from the model, agreed between ranks (see _distributed)
            n, a = len(self.watched.params), len(self.probes.names)
            dist.agree_capacity(4 * n + 4 * a + 32)

    # ------------------------------------------------------------------ the step
    def launch(
        self,
        step: int,
        loss: Any,
        batch: Any = None,
        params_due: bool = True,
        optim_due: bool = True,
        clip_norm: float | None = None,
    ) -> Pending:
        """Launch this step's reductions and start the single device->host copy; `clip_norm`: the
        max total gradient norm the loop clips to after this call (None: no clipping after it)."""
        # out= reductions over parameters; and nothing here is for autograd. torch.no_grad()'s
        # own switch, without its ~7 Python calls a step
        was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            self._refresh()
            pending = self.plain.launch(self, step, loss, batch, params_due, optim_due)
            if pending is None:  # something is due beyond the loss and the gradients: every family
                pre = self.preclip.last if self.preclip is not None else None  # (what the gradients take)
                pending = self._launch(step, loss, batch, params_due, optim_due, clip_norm)
                self.plain.remember(self, loss, pre, pending)
            return pending
        finally:
            torch._C._set_grad_enabled(was)

    def _launch(
        self, step: int, loss: Any, batch: Any, params_due: bool, optim_due: bool, clip_norm: float | None
    ) -> Pending:
        params = self.watched.params
        # the loss's device, else the model's (it may have moved)
        dev = loss.device if isinstance(loss, torch.Tensor) else params[0].device if params else self.device
        cadence = self.cadence
        close = cadence.watch_closely(step)  # while an incident is open or after a non-finite step
        s = LaunchStep(
            step,
            loss,
            batch,
            params_due or close,
            optim_due or close,
            cadence.extremes_due(step, params_due, close),
            dev,
            self.dist is not None,
            clip_norm=clip_norm,
        )
        for family in FAMILIES:
            s.segments += family.launch(self, s)
        if self.replicas is not None:  # fingerprints of the replicated gradients and parameters, when due
            s.segments += self.replicas.segments(step, s.grads, self.watched.local(params), s.dev)
        cadence.narrow_grads = s.grad_dtype in NARROW_GRAD_DTYPES
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
        cadence.arm_next(step + 1)  # what the next forward and backward measure
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

    def _refresh(self) -> None:
        if self.watched.refresh():
            if self.model is not None and self.policy.sampling.activations:
                self.probes.install(self.model)  # the model grew: watch the new modules' outputs too
            if self.preclip is not None:  # its last backward missed the new parameters
                self.preclip.take()
                self.preclip.install()

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
            parameters.check_now(self.watched, self.kernels, rec)
        if rec.nonfinite_parts:
            self.cadence.after_nonfinite(rec.step)
        return rec

    # ------------------------------------------------------------------ the rest
    def optimizer_kind(self) -> str | None:
        return self.optim.kind()

    def _count_nonfinite(self) -> int:
        # failure path only: exact counts cost a sync, which no longer matters once a run is failing
        return sum(int((~torch.isfinite(p.detach())).sum()) for p in self.watched.params)

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
