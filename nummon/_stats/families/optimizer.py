"""The optimizer: its state's L2 norms (when due), the learning rate (packed when it is a
tensor), and the update ratio lr * ||update|| / ||param|| (the state's norm standing for the
update when measured, else the applied gradient's)."""

from __future__ import annotations

from types import MappingProxyType

from ..distributed import Reduce, local_tensor
from ..kernels import as_real
from ..transport import Segment
from .family import NORM_RULES, Collecting, LaunchStep, RecordBuild, StatFamily, family_norm, rules

__all__ = ["FAMILY", "decode_optimizer", "launch_optimizer"]


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


def decode_optimizer(b: RecordBuild) -> None:
    """`rec.lr`, `rec.optim_state_norm` (total L2 norm) and `rec.update_ratio` (dimensionless)."""
    rec, lr = b.rec, b.get("lr")
    rec.lr = b.pending.lr if lr is None else lr[0]
    if b.get("state_norms") is not None:  # (not measured: no call)
        rec.optim_state_norm = family_norm(b, "state_norms", b.pending.state, "optimizer state")
    if rec.lr is None or not rec.param_norm:
        return
    if rec.optim_state_norm is not None:
        rec.update_ratio = rec.lr * rec.optim_state_norm / rec.param_norm
    elif rec.grad_norm is not None:
        applied = rec.grad_norm * rec.clip_ratio if rec.clip_ratio is not None else rec.grad_norm
        rec.update_ratio = rec.lr * applied / rec.param_norm


FAMILY = StatFamily(
    "optimizer",
    rules(state_norms=NORM_RULES, lr=Reduce.LOCAL),
    launch_optimizer,
    (decode_optimizer,),
    overflow=MappingProxyType({"state_norms": lambda p: [local_tensor(t) for t in p.state]}),
)
