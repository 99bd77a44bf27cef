"""The loss held far above where it started."""
from __future__ import annotations

from collections import deque

from .. import _functional as F
from .._policy import DivergencePolicy
from .._types import AlertKind, Finding, Severity, StepRecord
from .trend import StartLevel

__all__ = ["DivergenceDetector"]


class DivergenceDetector:
    """The median of the last ``patience`` finite losses far above the starting level, or (a
    warning) several times above the best loss the run has reached.

    A median, not "every record": a run bouncing between 20 and 200 from a start of 4 is
    diverged even when single records dip below the factor, and a spike of one or two records
    that recovers moves it not at all. The second rule catches a run that had learned and lost
    it (a LoRA loss 1.4 -> 6.4 -> 4.6..5.5, only 3x its start). Shared value: ``level``.
    """

    section = "divergence"
    kinds = (AlertKind.DIVERGENCE,)
    needs = ("level",)

    def __init__(self, p: DivergencePolicy, level: StartLevel) -> None:
        self._p = p
        self._level = level
        self._recent: deque[float] = deque(maxlen=p.patience)
        self._smooth: deque[float] = deque(maxlen=p.rebound_smoothing)
        self._best: float | None = None  # lowest median of `rebound_smoothing` consecutive losses so far

    def update(self, rec: StepRecord) -> list[Finding]:
        base = self._level.observe(rec)
        if not F.is_finite(rec.loss):
            return []
        self._recent.append(float(rec.loss))
        self._smooth.append(float(rec.loss))
        if len(self._smooth) == self._smooth.maxlen:
            m = F.median(self._smooth)
            self._best = m if self._best is None else min(self._best, m)
        if base is None or base <= 0 or len(self._recent) < self._p.patience:
            return []
        held = F.median(self._recent)
        ratio = held / base
        if ratio >= self._p.critical_factor:
            sev, thr = Severity.CRITICAL, self._p.critical_factor
        elif ratio >= self._p.warning_factor:
            sev, thr = Severity.WARNING, self._p.warning_factor
        else:
            return self._rebound(held, base, rec.loss)
        return [
            Finding(
                AlertKind.DIVERGENCE,
                sev,
                "loss",
                rec.loss,
                base * thr,
                f"loss has held around {F.fmt_num(held)} (median of the last {self._p.patience} records), "
                f"{ratio:.3g}x its starting level {F.fmt_num(base)}",
                details={"ratio": ratio, "baseline": base},
            )
        ]

    def _rebound(self, held: float, base: float, loss: float) -> list[Finding]:
        """Warning: the held loss stands ``rebound_factor`` x above the best it reached, and is
        not noise near zero (at least ``rebound_min_level`` of the starting level)."""
        p, best = self._p, self._best
        if best is None or best <= 0 or held < p.rebound_min_level * base:
            return []
        ratio = held / best
        if ratio < p.rebound_factor:
            return []
        return [
            Finding(
                AlertKind.DIVERGENCE,
                Severity.WARNING,
                "loss",
                loss,
                best * p.rebound_factor,
                f"loss has held around {F.fmt_num(held)} (median of the last {p.patience} records), "
                f"{ratio:.3g}x the best {F.fmt_num(best)} it had reached: the run is losing what it learned",
                details={"ratio": ratio, "best": best, "baseline": base, "rule": "rebound"},
            )
        ]
