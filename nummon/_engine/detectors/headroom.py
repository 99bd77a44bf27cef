"""Finite but extreme: few decades left before the dtype overflows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from ..._core import maths as F
from ..._core.alert_text import sci
from ..._core.types import AlertKind, Finding, Severity, StepRecord
from ..._policy.sections import HeadroomPolicy
from .base import MAGNITUDE_FIELDS

if TYPE_CHECKING:
    from ..quiet import QuietPlan

__all__ = ["HeadroomDetector"]


class HeadroomDetector:
    """Warning/critical when the largest magnitude is within a few decades of its dtype's max."""

    section = "headroom"
    kinds = (AlertKind.EXTREME,)
    needs = ()

    def __init__(self, p: HeadroomPolicy) -> None:
        self._p = p

    def quiet(self, plan: QuietPlan) -> bool:
        """Silent while every magnitude keeps more decades of the region's dtype than both
        limits, and so does a record's own headroom when it has one; no state."""
        dtype = plan.dtype or self._p.default_dtype
        limits = [
            d
            for d in (
                cast("dict[str, float]", lim).get(dtype) for lim in (self._p.critical_decades, self._p.warning_decades)
            )
            if d is not None
        ]
        if limits:
            top = F.DTYPE_MAX.get(dtype, F.DTYPE_MAX["float32"])
            plan.floor("headroom", max(limits))
            for metric in MAGNITUDE_FIELDS:
                if metric not in plan.bands:
                    return False
                plan.cap(metric, top / F.pow10(max(limits)))
        return True

    def absorb(self, records: Sequence[StepRecord]) -> None:
        """Nothing to book: the headroom is judged from each record alone."""

    def update(self, rec: StepRecord) -> list[Finding]:
        dtype = rec.headroom_dtype or self._p.default_dtype
        magnitude = None
        if rec.headroom is not None:
            decades, metric = rec.headroom, "headroom"
        else:
            mags = {k: abs(v) for k in MAGNITUDE_FIELDS if F.is_finite(v := getattr(rec, k))}
            if not mags:
                return []
            metric = max(mags, key=mags.__getitem__)
            magnitude = mags[metric]
            decades = F.headroom_decades(magnitude, dtype)
        if not math.isfinite(decades):
            return []  # overflowed already: the nonfinite detector reports it
        # a record may name any dtype; the policy's limits name float dtypes (others have none)
        crit = cast("dict[str, float]", self._p.critical_decades).get(dtype)
        warn = cast("dict[str, float]", self._p.warning_decades).get(dtype)
        if crit is not None and decades < crit:
            sev, thr = Severity.CRITICAL, crit
        elif warn is not None and decades < warn:
            sev, thr = Severity.WARNING, warn
        else:
            return []
        return [
            Finding(
                AlertKind.EXTREME,
                sev,
                metric,
                decades,
                thr,
                (f"{metric} {sci(magnitude)}: " if magnitude is not None else "")
                + f"only {decades:.1f} decades of {dtype} headroom left (limit {thr:g} decades)",
                details={"dtype": dtype, **({"magnitude": magnitude} if magnitude is not None else {})},
            )
        ]
