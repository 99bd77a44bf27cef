"""The gradients: per-tensor L2 norms and max |g| (with the parameters' cadence, every step for
narrow dtypes), from the pre-clip capture when a backward left one (`preclip.py`), else from
today's gradients; and the clip ratio, from a few gradients measured again after clipping."""

from __future__ import annotations

import functools
import logging
import math
import operator
from types import MappingProxyType
from typing import Any

import torch

from ..distributed import Reduce
from ..dtypes import dtype_name, narrowest
from ..kernel_plan import SMALL_NUMEL
from ..params import dense_grads
from ..preclip import PreClipGrads
from ..transport import Segment
from .family import (
    NORM_RULES,
    Collecting,
    LaunchStep,
    RecordBuild,
    StatFamily,
    exact_where_overflowed,
    l2,
    nanmax,
    rules,
)

__all__ = [
    "CLIP_ANCHORS",
    "CLIP_ANCHOR_ELEMENTS",
    "FAMILY",
    "ClipAnchors",
    "anchor_grads",
    "decode_clip_ratio",
    "decode_grads",
    "launch_grads",
]

log = logging.getLogger("nummon")

#: the clip ratio is measured on this many gradients, the smallest (clip_grad_norm_ scales
#: every gradient by one factor, so a few tell it; a second read of all of them would cost a
#: full pass over the gradients' memory)
CLIP_ANCHORS = 8
#: ... holding at most this many elements together, and no more than the kernels measure in groups
#: each (`SMALL_NUMEL`: one kernel call for all of them, not a dot per tensor), at least one
#: gradient: on a small model the 8 smallest can include its largest matrix (the demo CNN's fc1,
#: 1.6M of its 1.6M)
CLIP_ANCHOR_ELEMENTS = 1 << 16


class ClipAnchors:
    """The gradients the clip ratio is measured on, chosen once per gradient-list length."""

    def __init__(self) -> None:
        self.cache: tuple[int, list[int], Any] = (-1, [], None)

    def pick(self, grads: list[torch.Tensor]) -> tuple[list[int], Any]:
        """The positions of the smallest non-empty gradients (at most CLIP_ANCHORS, holding at
        most CLIP_ANCHOR_ELEMENTS and each at most SMALL_NUMEL, but for the first), and a picker
        for them."""
        n = len(grads)
        if self.cache[0] != n:
            chosen: list[int] = []
            total = 0
            for size, i in sorted((g.numel(), i) for i, g in enumerate(grads) if g.numel())[:CLIP_ANCHORS]:
                if chosen and (total + size > CLIP_ANCHOR_ELEMENTS or size > SMALL_NUMEL):
                    break
                chosen.append(i)
                total += size
            idx = sorted(chosen) or [0]
            self.cache = (n, idx, operator.itemgetter(*idx))
        return self.cache[1], self.cache[2]


def launch_grads(c: Collecting, s: LaunchStep) -> list[Segment]:
    """Gradient norms and max |g|: the pre-clip capture's when a backward left one (today's
    gradients are then measured only for the clip ratio), else today's gradients."""
    pre = c.preclip.take() if c.preclip is not None else None
    if pre is not None:
        segs = [Segment("grad_norms", pre.norms, Reduce.LOCAL)]  # single process only
        if pre.extremes is not None:
            segs.append(Segment(pre.extremes[0], pre.extremes[1], Reduce.LOCAL))
        segs += _clip_ratio_norms(c, s, pre)
        s.grads, s.grad_names, raw_dtypes = pre.grads, pre.names, pre.raw_dtypes
    else:
        grads, names, raw = c.watched.grads(s.dev, s.distributed)
        param_rules = c.watched.param_rules
        segs = []
        if grads and s.extremes_due:
            norms, absmax = c.kernels.norms_and_absmax(grads, key="grads")
            segs += [Segment("grad_norms", norms, param_rules), Segment("grad_absmax", absmax, Reduce.MAX)]
        elif grads:
            segs.append(Segment("grad_norms", c.kernels.l2_norms(grads, key="grads"), param_rules))
        s.grads, s.grad_names, raw_dtypes = grads, names, set(map(operator.attrgetter("dtype"), raw))
    s.grad_dtype = _narrowest_name(frozenset(raw_dtypes))
    if not s.grads and c.watched.params and not c.said_no_grads:
        _say_no_grads(c, s.step)
    return segs


def _clip_ratio_norms(c: Collecting, s: LaunchStep, pre: PreClipGrads) -> list[Segment]:
    """A few of today's gradients measured again, after clipping, for the clip ratio. When the
    backward's list held every watched parameter's gradient as it is, only those few are read
    off their parameters (reading all of them costs a Python attribute read per tensor)."""
    anchored = anchor_grads(c, pre)
    if anchored is not None:  # (else: the general case)
        s.clip_anchors = anchored[0]
        return [Segment("grad_norms_post", c.kernels.l2_norms(anchored[1], key="grad_norms_post"), Reduce.LOCAL)]
    grads, names, _raw = c.watched.grads(s.dev, s.distributed)
    if grads and names == pre.names:  # the clip ratio: a few gradients again, after clipping
        idx, pick = c.anchors.pick(grads)
        picked = pick(grads)
        s.clip_anchors = idx
        return [
            Segment(
                "grad_norms_post",
                c.kernels.l2_norms(list(picked) if len(idx) > 1 else [picked], key="grad_norms_post"),
                Reduce.LOCAL,
            )
        ]
    if grads:  # other gradients than the backward left (replaced, or more): all of them
        return [Segment("grad_norms_post", c.kernels.l2_norms(grads, key="grad_norms_post_all"), Reduce.LOCAL)]
    return []


def anchor_grads(c: Collecting, pre: PreClipGrads) -> tuple[list[int], list[torch.Tensor]] | None:
    """(the clip anchors' positions, today's `.grad` of their parameters), read off the parameters
    themselves, when the backward's list held every watched parameter's gradient as it is; None
    otherwise, or when one of those gradients is missing or sparse now."""
    if not (pre.whole and len(c.watched.params) == len(pre.grads)):
        return None
    idx, pick = c.anchors.pick(pre.grads)
    params = pick(c.watched.params)
    now = dense_grads(params if len(idx) > 1 else (params,))
    return None if now is None else (idx, now)


@functools.cache  # a C-level call per step once seen: the gradients' dtypes rarely change
def _narrowest_name(dtypes: frozenset[torch.dtype]) -> str | None:
    """The name of the narrowest of these dtypes (None for none)."""
    name = None
    for dt in dtypes:
        name = narrowest(name, dtype_name(dt))
    return name


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


def decode_grads(b: RecordBuild) -> None:
    """`rec.grad_norm` (total L2), `rec.layer_grad_norms`, `rec.grad_max` (max |g|, when measured) and
    the non-finite gradients, in forward order."""
    gn, gmax = b.get("grad_norms"), b.get("grad_absmax")
    if gn is None:
        return
    rec, names = b.rec, b.pending.grad_names
    gn = exact_where_overflowed(gn, b.pending.grads) if b.local else gn
    rec.grad_norm = l2(gn)
    rec.layer_grad_norms = dict(zip(names, gn))
    b.grad_bound = nanmax(gn)  # max |g| <= the largest L2 norm: the headroom's bound between samples
    if gmax is None:  # not measured this step: the norms tell finiteness (an overflowed one was recomputed)
        gmax = gn
    else:
        rec.grad_max = nanmax(gmax)
        b.grad_bound = rec.grad_max
    # a gradient is non-finite when its max |g| or its L2 norm is (a finite-but-huge gradient
    # has a finite max even when its float32 norm overflows)
    if not (math.isfinite(nanmax(gmax)) and not math.isnan(rec.grad_norm)):
        b.bad_grads = [n for n, v, w in zip(names, gmax, gn) if not math.isfinite(v) or math.isnan(w)]
        if b.bad_grads:
            b.parts.append("gradients")


def decode_clip_ratio(b: RecordBuild) -> None:
    """`rec.clip_ratio`: the gradients' L2 norm after clipping over before it (1: not clipped)."""
    post, rec = b.get("grad_norms_post"), b.rec
    if post is None or rec.grad_norm is None:  # grad_norm was measured before clipping
        return
    pre_norm = rec.grad_norm
    anchors = b.pending.clip_anchors
    if anchors is not None:  # post-clip norms of a few gradients: against the same ones before
        pre = b.get("grad_norms")
        assert pre is not None  # anchors are kept only when the norms before clipping were measured
        pre_norm = l2([pre[i] for i in anchors])
    post_norm = l2(post)
    if pre_norm and math.isfinite(pre_norm) and math.isfinite(post_norm):
        rec.clip_ratio = post_norm / pre_norm


_LOCAL = Reduce.LOCAL
FAMILY = StatFamily(
    "gradients",
    # the pre-clip capture's values are single-process only (LOCAL)
    rules(grad_norms=NORM_RULES | {_LOCAL}, grad_absmax=frozenset({Reduce.MAX, _LOCAL}), grad_norms_post=_LOCAL),
    launch_grads,
    (decode_grads, decode_clip_ratio),
    overflow=MappingProxyType({"grad_norms": lambda p: p.grads}),
)
