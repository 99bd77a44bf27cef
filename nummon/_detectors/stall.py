"""No meaningful improvement over the trend window while the loss is still high and flat."""
from __future__ import annotations

from .._policy import StallPolicy
from .._types import AlertKind, Finding, Severity, StepRecord
from .trend import LossTrend, improvement_needed

__all__ = ["StallDetector"]


class StallDetector:
    """Shared value: ``trend`` (the loss-trend window, also read by oscillation)."""

    section = "stall"
    kinds = (AlertKind.STALL,)
    needs = ("trend",)

    def __init__(self, p: StallPolicy, trend: LossTrend) -> None:
        self._p = p
        self._trend = trend

    def update(self, rec: StepRecord) -> list[Finding]:
        t = self._trend.observe(rec)
        if t is None or rec.loss is None:  # a record without a loss says nothing about the trend
            return []
        p = self._p
        need = improvement_needed(p.min_improvement, t.expected)
        if t.change > -need and t.level >= p.high_fraction and t.spread < p.max_spread:
            return [
                Finding(
                    AlertKind.STALL,
                    Severity.WARNING,
                    "loss",
                    rec.loss,
                    need,
                    f"loss improved {max(-t.change, 0) * 100:.1f}% over the last {t.span} steps "
                    f"(< {need * 100:.2g}%) and is still at {t.level * 100:.0f}% of its starting level",
                    details={"change": t.change, "spread": t.spread, "level": t.level, "span": t.span},
                )
            ]
        return []
