"""The loss held far above where it started."""
from __future__ import annotations

from collections import deque

from .. import _functional as F
from .._policy import DivergencePolicy
from .._types import AlertKind, Finding, Severity, StepRecord
from .trend import StartLevel

__all__ = ["DivergenceDetector"]


class DivergenceDetector:
    """The median of the last ``patience`` finite losses far above the starting level.

    A median, not "every record": a run bouncing between 20 and 200 from a start of 4 is
    diverged even when single records dip below the factor. Shared value: ``level``.
    """

    section = "divergence"
    kinds = (AlertKind.DIVERGENCE,)
    needs = ("level",)

    def __init__(self, p: DivergencePolicy, level: StartLevel) -> None:
        self._p = p
        self._level = level
        self._recent: deque[float] = deque(maxlen=p.patience)

    def update(self, rec: StepRecord) -> list[Finding]:
        base = self._level.observe(rec)
        if not F.is_finite(rec.loss):
            return []
        self._recent.append(float(rec.loss))
        if base is None or base <= 0 or len(self._recent) < self._p.patience:
            return []
        held = F.median(self._recent)
        ratio = held / base
        if ratio >= self._p.critical_factor:
            sev, thr = Severity.CRITICAL, self._p.critical_factor
        elif ratio >= self._p.warning_factor:
            sev, thr = Severity.WARNING, self._p.warning_factor
        else:
            return []
        return [
            Finding(
                AlertKind.DIVERGENCE,
                sev,
                "loss",
                rec.loss,
                base * thr,
                f"loss has held around {F.fmt(held)} (median of the last {self._p.patience} records), "
                f"{ratio:.3g}x its starting level {F.fmt(base)}",
                details={"ratio": ratio, "baseline": base},
            )
        ]
