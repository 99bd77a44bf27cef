"""Device side of each statistic family: per step, read the step's inputs, note what decoding
will need on the `LaunchStep`, and return the family's segments (its reductions, not yet read).

One function per family, declared together with its segments, cross-rank rules and decoder in
`families.py`; the collector calls them in that order (later families may use what earlier ones
noted)."""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .distributed import Reduce
from .dtypes import dtype_name, narrowest
from .fingerprints import Fingerprinter, tensors_in
from .kernels import NormKernels, as_real
from .mechanisms import MechanismProbes
from .optim import OptimizerView
from .params import WatchedParams
from .preclip import PreClipCapture
from .probes import ActivationProbes
from .transport import Segment

__all__ = [
    "CLIP_ANCHORS",
    "CLIP_ANCHOR_ELEMENTS",
    "ClipAnchors",
    "Collecting",
    "LaunchStep",
    "launch_activations",
    "launch_batch",
    "launch_grads",
    "launch_loss",
    "launch_mechanisms",
    "launch_optimizer",
    "launch_params",
]

log = logging.getLogger("nummon")

#: the clip ratio is measured on this many gradients, the smallest (clip_grad_norm_ scales
#: every gradient by one factor, so a few tell it; a second read of all of them would cost a
#: full pass over the gradients' memory)
CLIP_ANCHORS = 8
#: ... holding at most this many elements together (at least one gradient): on a small model the
#: 8 smallest can include its largest matrix (the demo CNN's fc1, 1.6M of its 1.6M)
CLIP_ANCHOR_ELEMENTS = 1 << 16


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


class ClipAnchors:
    """The gradients the clip ratio is measured on, chosen once per gradient-list length."""

    def __init__(self) -> None:
        self.cache: tuple[int, list[int], Any] = (-1, [], None)

    def pick(self, grads: list[torch.Tensor]) -> tuple[list[int], Any]:
        """The positions of the smallest non-empty gradients (at most CLIP_ANCHORS, holding at
        most CLIP_ANCHOR_ELEMENTS but for the first), and a picker for them."""
        n = len(grads)
        if self.cache[0] != n:
            chosen: list[int] = []
            total = 0
            for size, i in sorted((g.numel(), i) for i, g in enumerate(grads) if g.numel())[:CLIP_ANCHORS]:
                if chosen and total + size > CLIP_ANCHOR_ELEMENTS:
                    break
                chosen.append(i)
                total += size
            idx = sorted(chosen) or [0]
            self.cache = (n, idx, operator.itemgetter(*idx))
        return self.cache[1], self.cache[2]


class Collecting(Protocol):
    """What the launch functions read of the statistics collector."""

    watched: WatchedParams
    optim: OptimizerView
    kernels: NormKernels
    fingerprint: Fingerprinter
    probes: ActivationProbes
    mechanisms: MechanismProbes | None
    preclip: PreClipCapture | None
    anchors: ClipAnchors
    said_no_grads: bool


def launch_loss(c: Collecting, s: LaunchStep) -> list[Segment]:
    params = c.watched.params
    s.loss_dtype = dtype_name(params[0].dtype) if params else "float32"
    if isinstance(s.loss, torch.Tensor):
        s.loss_dtype = dtype_name(s.loss.dtype)
        return [Segment("loss", s.loss.detach().reshape(1), Reduce.MEAN)]
    if s.distributed:  # every rank must pack the same layout
        return [Segment("loss", torch.tensor([float(s.loss)], device=s.dev), Reduce.MEAN)]
    s.loss_host = float(s.loss)
    return []


def launch_grads(c: Collecting, s: LaunchStep) -> list[Segment]:
    """Gradient norms and max |g|: the pre-clip capture's when a backward left one (today's
    gradients are then measured only for the clip ratio), else today's gradients."""
    grads, names, raw = c.watched.grads(s.dev, s.distributed)
    rules = c.watched.param_rules
    pre = c.preclip.take() if c.preclip is not None else None
    segs = []
    if pre is not None:
        segs.append(Segment("grad_norms", pre.norms, Reduce.LOCAL))  # single process only
        if pre.extremes is not None:
            segs.append(Segment(pre.extremes[0], pre.extremes[1], Reduce.LOCAL))
        if grads and names == pre.names:  # the clip ratio: a few gradients again, after clipping
            idx, pick = c.anchors.pick(grads)
            picked = pick(grads)
            s.clip_anchors = idx
            segs.append(
                Segment(
                    "grad_norms_post",
                    c.kernels.l2_norms(list(picked) if len(idx) > 1 else [picked], key="grad_norms_post"),
                    Reduce.LOCAL,
                )
            )
        elif grads:  # other gradients than the backward left (replaced, or more): all of them
            segs.append(Segment("grad_norms_post", c.kernels.l2_norms(grads, key="grad_norms_post_all"), Reduce.LOCAL))
        s.grads, s.grad_names, raw_dtypes = pre.grads, pre.names, pre.raw_dtypes
    else:
        if grads and s.extremes_due:
            norms, absmax = c.kernels.norms_and_absmax(grads, key="grads")
            segs += [Segment("grad_norms", norms, rules), Segment("grad_absmax", absmax, Reduce.MAX)]
        elif grads:
            segs.append(Segment("grad_norms", c.kernels.l2_norms(grads, key="grads"), rules))
        s.grads, s.grad_names, raw_dtypes = grads, names, set(map(operator.attrgetter("dtype"), raw))
    for dt in raw_dtypes:
        s.grad_dtype = narrowest(s.grad_dtype, dtype_name(dt))
    if not s.grads and c.watched.params and not c.said_no_grads:
        _say_no_grads(c, s.step)
    return segs


def _say_no_grads(c: Collecting, step: int) -> None:
    """Once per run: no watched parameter has a gradient (post_step before any backward, or
    after zero_grad); the record then shows the gradient statistics as missing (None)."""
    c.said_no_grads = True
    log.warning(
        "nummon: no gradients at step %d on any of the %d watched parameters (first: %s): post_step ran "
        "before backward or after optimizer.zero_grad(); call it after optimizer.step() and before "
        "zero_grad(). Gradient statistics are missing from the record (grad_norm None) while this lasts",
        step,
        len(c.watched.params),
        c.watched.names[0],
    )


def launch_params(c: Collecting, s: LaunchStep) -> list[Segment]:
    watched = c.watched
    if not (s.params_due and watched.params):
        return []
    s.params = watched.local(watched.params)
    measured = [as_real(p) for p in s.params] if watched.has_complex else s.params
    return [Segment("param_norms", c.kernels.l2_norms(measured, key="param_norms"), watched.param_rules)]


def launch_optimizer(c: Collecting, s: LaunchStep) -> list[Segment]:
    """The optimizer state's norms (when due) and the learning rate (as a tensor when it is one)."""
    segs = []
    state = c.optim.state_tensors() if s.optim_due else []
    if state:
        s.state = state
        local = c.watched.local(state)
        measured = [as_real(t) for t in local] if c.watched.has_complex else local
        segs.append(Segment("state_norms", c.kernels.l2_norms(measured, key="state_norms"), c.optim.state_rules))
    s.lr, lr_tensor = c.optim.lr()
    if lr_tensor is not None:
        segs.append(Segment("lr", lr_tensor, Reduce.LOCAL))
    return segs


def launch_activations(c: Collecting, s: LaunchStep) -> list[Segment]:
    s.acts, segs = c.probes.take(s.distributed)
    return segs


def launch_mechanisms(c: Collecting, s: LaunchStep) -> list[Segment]:
    if c.mechanisms is None:
        return []
    s.mech, segs = c.mechanisms.take(s.distributed, s.loss, lambda: _clip_scale(s))
    return segs


def _clip_scale(s: LaunchStep) -> torch.Tensor | None:
    """The factor the loop's norm clipping will scale today's gradients by, on the device, as
    torch.nn.utils.clip_grad_norm_ computes it: min(1, clip_norm / (total norm + 1e-6)); None
    when the loop does not clip after post_step. Adam divides that clipped gradient by its second
    moment, so its statistics must see it, not the gradient before clipping."""
    if s.clip_norm is None:
        return None
    norms = next((seg.tensor for seg in s.segments if seg.name == "grad_norms"), None)
    if norms is None:
        return None
    total = norms.float().square().sum().sqrt()
    return (s.clip_norm / (total + 1e-6)).clamp(max=1.0)


def launch_batch(c: Collecting, s: LaunchStep) -> list[Segment]:
    s.batch_tensors = tensors_in(s.batch) if s.batch is not None else None
    if not s.batch_tensors:
        return []
    segs = []
    fl = [t for t in s.batch_tensors if t.is_floating_point() or t.is_complex()]
    if fl:
        bad = torch.stack([(~torch.isfinite(t)).sum() for t in fl]).sum().reshape(1)
        segs.append(Segment("input_nonfinite", bad, Reduce.SUM))
    segs.append(Segment("fingerprint", torch.stack([c.fingerprint(t) for t in s.batch_tensors]), Reduce.LOCAL))
    return segs
