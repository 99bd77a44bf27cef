"""The plain step: an ordinary step at which nothing is due but the loss and the gradients,
launched without the statistic families' pass.

Most steps of a run measure three things: the loss, the gradient norms the backward left (the
pre-clip capture) and the clip ratio's few gradients read again. No parameter or optimizer-state
norm, no activation or mechanism probe and no batch is due. A full launch of such a step costs
about 30 µs of Python on a 2-core CPU (a `LaunchStep`, seven family calls, their segments and the
pack plan's lookup). This one launches the same three segments with one `cat` and hands over the
same `Pending`.

`PlainLaunch` remembers what a full launch of a plain step made: its layout, the gradients' names
and dtypes, the loss's dtype and device. It launches a later step this way only while every input
that decided that launch is the same. Anything else goes through the families, which make a new
memory when the step is plain again: a statistic due, a probe that measured, a hook registered, a
grown model, a new dtype or device, a tensor learning rate, torch.distributed or a replica check.
tests/stats/test_plain_step.py holds the two launches equal, record by record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .families.gradients import anchor_grads
from .mechanisms import MechanismStep
from .pending import Pending
from .transport import Layout

if TYPE_CHECKING:
    from .families.family import Collecting
    from .preclip import PreClipGrads

__all__ = ["PLAIN_SEGMENTS", "PlainLaunch"]

#: the segments of a plain step, in the order `pack` lays them out
PLAIN_SEGMENTS = ("loss", "grad_norms", "grad_norms_post")


@dataclass(frozen=True)
class _Plain:
    """What a full launch of a plain step made, and the inputs that decided it."""

    names: list[str]  # the gradients' names: the watched list itself (its identity is checked)
    raw_dtypes: frozenset[torch.dtype]  # the gradients' dtypes
    device: torch.device  # the loss's and the norms'
    layout: Layout  # the pack plan's (shared, read-only)
    grad_dtype: str | None
    loss_dtype: str  # the loss's dtype, by name


class PlainLaunch:
    """Launches plain steps the way the statistic families would have, once a full launch showed
    how (see the module docstring). `enabled` off: every step goes through the families."""

    def __init__(self) -> None:
        self.enabled = True
        self.launched = 0  # steps launched here (the tests' proof that this path runs)
        self._plain: _Plain | None = None

    def remember(self, c: Collecting, loss: Any, pre: PreClipGrads | None, pending: Pending) -> None:
        """After a full launch of `loss`'s step: remember it when it was a plain step (`pre`: the
        capture the families took), forget the last one otherwise."""
        plain = None
        if (
            pre is not None
            and c.dist is None
            and c.replicas is None
            and tuple(pending.layout) == PLAIN_SEGMENTS
            and pending.grads is pre.grads
            and isinstance(loss, torch.Tensor)
            and loss.dtype is torch.float32  # the pack's plain `cat` (other dtypes are converted)
            and loss.device == pre.norms.device
            and not pending.acts.order
            and (pending.mech is None or pending.mech == MechanismStep())
        ):
            plain = _Plain(
                pre.names,
                frozenset(pre.raw_dtypes),
                loss.device,
                pending.layout,
                pending.grad_dtype,
                pending.loss_dtype,
            )
        self._plain = plain

    def launch(
        self, c: Collecting, step: int, loss: Any, batch: Any, params_due: bool, optim_due: bool
    ) -> Pending | None:
        """This step launched as the last plain step was, or None when any of its inputs differs
        (the families launch it then). Called after the collector's refresh, with grad mode off."""
        plain, preclip = self._plain, c.preclip
        if plain is None or not self.enabled or preclip is None or batch is not None or params_due or optim_due:
            return None
        pre, probes, mech = preclip.last, c.probes, c.mechanisms
        # (max |g| is measured on due steps, while the run is watched closely (an incident open,
        # a non-finite step) and for narrow gradient dtypes: `pre.extremes`, the direct statement)
        if (
            pre is None
            or pre.extremes is not None
            or pre.names is not plain.names
            or plain.raw_dtypes != pre.raw_dtypes
            or not isinstance(loss, torch.Tensor)
            or loss.dtype is not torch.float32
            or loss.device != plain.device
            or pre.norms.device != plain.device
            or (mech is not None and not mech.idle)
            or c.replicas is not None
        ):
            return None
        acts = probes.idle_step()
        anchored = anchor_grads(c, pre) if acts is not None else None
        if acts is None or anchored is None:  # a hook measured; an anchor's gradient is gone
            return None
        lr, lr_tensor = c.optim.lr()
        if lr_tensor is not None:  # a tensor LR rides in the packed vector: the families pack it
            return None
        preclip.take()
        idx, now = anchored
        post = c.kernels.l2_norms(now, key="grad_norms_post")
        host, event = c.pinned.to_host(torch.cat((loss.reshape(1), pre.norms, post)))
        c.cadence.arm_next(step + 1)
        self.launched += 1
        return Pending(
            step,
            host,
            event,
            plain.layout,
            pre.names,
            acts,
            plain.grad_dtype,
            None,
            plain.loss_dtype,
            lr,
            grads=pre.grads,
            mech=MechanismStep() if mech is not None else None,  # (the record carries an empty sample)
            clip_anchors=idx,
        )
