"""The statistics engine's orchestrator: per step, launch every reduction on the device and
start the single device->host copy (`launch`); later, read it and build the record (`resolve`).

The parts: `watch` (which parameters), `optim` (state tensors, LR, kind), `kernels` (norms,
extremes), `probes` (activation hooks), `fingerprints`, `transport` (segments, packing, the
lagged copy), `decode` (values -> StepRecord, non-finite localisation), `histograms`.
"""
from __future__ import annotations

import contextlib

from typing import Any, Iterator

import torch
from torch import nn

from .._distributed import LayoutHeader, Reduce
from .._errors import NummonError
from .._policy import Policy
from .._types import StepRecord
from .decode import Decoder
from .dtypes import dtype_name, narrowest
from .fingerprints import Fingerprinter, tensors_in
from .histograms import histograms
from .kernels import NormKernels, as_real
from .mechanisms import MechanismProbes
from .optim import OptimizerView
from .pending import GatherTicket, Pending
from .preclip import PreClipCapture
from .probes import ActivationProbes
from .transport import PinnedPool, Segment, pack, rules_of, signature
from .watch import WatchedParams

__all__ = ["StatsEngine", "check_grad_scaler"]


def check_grad_scaler(scaler: Any) -> None:
    """A GradScaler-like object (`is_enabled()`, `get_scale()`) or None; else a NummonError now,
    rather than an AttributeError at the first overflow step."""
    if scaler is None:
        return
    if not all(callable(getattr(scaler, m, None)) for m in ("is_enabled", "get_scale")):
        raise NummonError(
            f"grad_scaler must be a torch.amp.GradScaler (with is_enabled() and get_scale()), got {type(scaler).__name__}"
        )


class StatsEngine:
    """Computes one step's health statistics for a model and optimizer."""

    def __init__(self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None, policy: Policy,
                 dist: Any = None, grad_scaler: Any = None) -> None:
        check_grad_scaler(grad_scaler)
        self.model = model
        self.optimizer = optimizer
        self.policy = policy
        self.dist = dist  # a DistributedReducer: one collective over the packed vector per step
        self.grad_scaler = grad_scaler  # non-finite grads under an enabled scaler mean a skipped step
        self.optim = OptimizerView(optimizer)
        self.watched = WatchedParams(model, self.optim)
        self.device = self.watched.params[0].device if self.watched.params else torch.device("cpu")
        self.kernels = NormKernels()
        self.fingerprint = Fingerprinter()
        self.pinned = PinnedPool()
        self.probes = ActivationProbes(policy.sampling.activations_exclude)
        if model is not None and policy.sampling.activations:
            self.probes.install(model)
        self.decoder = Decoder(dist, grad_scaler, self._count_nonfinite)
        mp = policy.mechanisms  # sampled mechanism probes (attention, output log Z, Adam): mechanisms.py
        self.mechanisms = MechanismProbes(model, optimizer, adam=mp.adam, attention=mp.attention, output=mp.output,
                                          linear_rms=mp.linear_rms) if mp.enabled else None
        # not under torch.distributed (DDP/FSDP reduce gradients in end-of-backward callbacks of
        # their own, which may run after this one), nor with a GradScaler (gradients are still
        # scaled at the end of backward)
        self.preclip = PreClipCapture(self.watched, self.kernels) if dist is None and grad_scaler is None else None
        if dist is not None:  # a capacity every rank derives alike from the model (see _distributed)
            n, a = len(self.watched.params), len(self.probes.names)
            dist.capacity = max(dist.capacity, 4 * n + 4 * a + 32)

    # ------------------------------------------------------------------ the step
    def launch(self, step: int, loss: Any, batch: Any = None, params_due: bool = True, optim_due: bool = True) -> Pending:
        """Launch this step's reductions and start the single device->host copy."""
        with torch.no_grad():  # out= reductions over parameters; and nothing here is for autograd
            return self._launch(step, loss, batch, params_due, optim_due)

    def _launch(self, step: int, loss: Any, batch: Any, params_due: bool, optim_due: bool) -> Pending:
        watched = self.watched
        if watched.refresh():
            if self.model is not None and self.policy.sampling.activations:
                self.probes.install(self.model)  # the model grew: watch the new modules' outputs too
            if self.preclip is not None:  # its last backward missed the new parameters
                self.preclip.take()
                self.preclip.install()
        params = watched.params
        dev = params[0].device if params else self.device  # the model may have moved
        distributed = self.dist is not None
        segs: list[Segment] = []
        loss_host, loss_dtype = None, dtype_name(params[0].dtype) if params else "float32"
        if isinstance(loss, torch.Tensor):
            segs.append(Segment("loss", loss.detach().reshape(1), Reduce.MEAN))
            dev, loss_dtype = loss.device, dtype_name(loss.dtype)
        elif distributed:  # every rank must pack the same layout
            segs.append(Segment("loss", torch.tensor([float(loss)], device=dev), Reduce.MEAN))
        else:
            loss_host = float(loss)

        grads, grad_names, raw_grads = watched.grads(dev, distributed)
        grad_rules = watched.param_rules
        pre = self.preclip.take() if self.preclip is not None else None
        # every L2 norm of the step (gradients, parameters, optimizer state) in one fused pass;
        # with pre-clip statistics, today's gradients are measured only for the clip ratio
        families: list[tuple[str, list[torch.Tensor], tuple[str, ...]]] = [
            ("grad_norms" if pre is None else "grad_norms_post", grads, grad_rules)]
        if pre is not None:
            segs.append(Segment("grad_norms", pre.norms, Reduce.LOCAL))  # single process only
            grads, grad_names, raw_dtypes = pre.grads, pre.names, pre.raw_dtypes
        else:
            raw_dtypes = {g.dtype for g in raw_grads}
        grad_dtype = None
        for dt in raw_dtypes:
            grad_dtype = narrowest(grad_dtype, dtype_name(dt))
        measured_params = watched.local(params) if params_due and params else []
        if measured_params:
            families.append(("param_norms", [as_real(p) for p in measured_params] if watched.has_complex else measured_params, watched.param_rules))
        state = self.optim.state_tensors() if optim_due else []
        if state:
            local_state = watched.local(state)
            families.append(("state_norms", [as_real(t) for t in local_state] if watched.has_complex else local_state, self.optim.state_rules))
        flat = [t for _, ts, _ in families for t in ts]
        if flat:
            norms, i = self.kernels.l2_norms(flat), 0
            for name, ts, rules in families:
                if ts:
                    segs.append(Segment(name, norms[i : i + len(ts)], rules))
                    i += len(ts)
        lr, lr_tensor = self.optim.lr()
        if lr_tensor is not None:
            segs.append(Segment("lr", lr_tensor, Reduce.LOCAL))
        if pre is not None:
            segs.append(Segment(pre.extremes[0], pre.extremes[1], Reduce.LOCAL))
        elif grads:
            name, ext = self.kernels.extremes(grads, distributed)
            # (min, max) pairs are packed only for a single process
            segs.append(Segment(name, ext, Reduce.MAX if name == "grad_absmax" else Reduce.LOCAL))
        acts, act_segs = self.probes.take(distributed)
        segs += act_segs
        mech = None
        if self.mechanisms is not None:
            mech, mech_segs = self.mechanisms.take(distributed)
            segs += mech_segs
        batch_tensors = tensors_in(batch) if batch is not None else None
        if batch_tensors:
            fl = [t for t in batch_tensors if t.is_floating_point() or t.is_complex()]
            if fl:
                bad = torch.stack([(~torch.isfinite(t)).sum() for t in fl]).sum().reshape(1)
                segs.append(Segment("input_nonfinite", bad, Reduce.SUM))
            segs.append(Segment("fingerprint", torch.stack([self.fingerprint(t) for t in batch_tensors]), Reduce.LOCAL))

        packed, layout = pack(segs, dev, wide=distributed)
        ticket = None
        if distributed:
            header = LayoutHeader(
                statistics=packed.numel(), layout=signature(layout),
                batch_tensors=-1 if batch_tensors is None else len(batch_tensors), gradients=len(grads),
                parameters=len(measured_params), optimizer_state=len(state), activations=len(acts.names),
            )
            packed, local, capacity = self.dist.gather(packed, header)
            ticket = GatherTicket(local, capacity)
        host, event = self.pinned.to_host(packed)
        return Pending(
            step=step, packed=host, event=event, layout=layout, grad_names=grad_names, acts=acts,
            grad_dtype=grad_dtype, loss_host=loss_host, loss_dtype=loss_dtype, lr=lr,
            grads=grads, params=params if measured_params else [], state=state, gather=ticket, mech=mech,
        )

    def resolve(self, pending: Pending) -> StepRecord:
        """Read a launched step on the host (waits for its copy) and build the StepRecord."""
        if pending.event is not None and not pending.event.query():
            pending.event.synchronize()  # only when the GPU is more than a step behind
        vals = pending.packed.tolist()
        sources = None
        if self.dist is not None:
            rows = self.dist.finish(vals, pending.gather.local, pending.gather.capacity, pending.step)
            vals, src = self.dist.combine(rows, rules_of(pending.layout))
            sources = {name: src[s.start : s.stop] for name, s in pending.layout.items()}
        rec = self.decoder.record(pending, vals, sources)
        if self.mechanisms is not None:
            self.mechanisms.decode(rec, pending.layout, vals, pending.mech)
        return rec

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
        if not on:
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

    @property
    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        """The watched parameters with their names."""
        return self.watched.named

    @property
    def _act_order(self) -> list[int]:  # tests check diagnostics' model copies fire no probe
        return self.probes._order

    @property
    def _buffers(self) -> dict:  # tests check the CPU path used its preallocated buffers
        return self.kernels.buffers
