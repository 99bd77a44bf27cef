"""The loss: packed as a device value when it is a tensor (or under torch.distributed, where
every rank packs the same layout), else read on the host as it came; its dtype is the one its
headroom is judged against."""

from __future__ import annotations

import math

import torch

from ..distributed import Reduce
from ..dtypes import dtype_name
from ..transport import Segment
from .family import Collecting, LaunchStep, RecordBuild, StatFamily, rules

__all__ = ["FAMILY", "decode_loss", "launch_loss"]


def launch_loss(c: Collecting, s: LaunchStep) -> list[Segment]:
    """The loss as a (1,) segment when it is a tensor (or under torch.distributed); else noted on the host."""
    if isinstance(s.loss, torch.Tensor):
        s.loss_dtype = dtype_name(s.loss.dtype)
        # no detach: the collector launches under no_grad, where the view carries no history
        return [Segment("loss", s.loss.reshape(1), Reduce.MEAN)]
    params = c.watched.params
    s.loss_dtype = dtype_name(params[0].dtype) if params else "float32"
    if s.distributed:  # every rank must pack the same layout
        return [Segment("loss", torch.tensor([float(s.loss)], device=s.dev), Reduce.MEAN)]
    s.loss_host = float(s.loss)
    return []


def decode_loss(b: RecordBuild) -> None:
    """`rec.loss`, as it was packed or noted; "loss" is non-finite when it is."""
    p = b.pending
    if p.loss_host is not None:
        b.rec.loss = p.loss_host
    else:
        loss = b.get("loss")
        assert loss is not None  # a loss not read on the host rode in the packed vector
        b.rec.loss = loss[0]
    if not math.isfinite(b.rec.loss):
        b.parts.append("loss")


FAMILY = StatFamily("loss", rules(loss=Reduce.MEAN), launch_loss, (decode_loss,))
