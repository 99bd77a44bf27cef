"""Loss bouncing (large relative spread) with no downward trend, while still far from converged."""
from __future__ import annotations

from .._policy import OscillationPolicy
from .._types import AlertKind, Finding, Severity, StepRecord
from .trend import LossTrend, improvement_needed

__all__ = ["OscillationDetector"]


class OscillationDetector:
    """Shared value: ``trend`` (the loss-trend window, also read by stall)."""

    section = "oscillation"
    kinds = (AlertKind.OSCILLATION,)
    needs = ("trend",)

    def __init__(self, p: OscillationPolicy, trend: LossTrend) -> None:
        self._p = p
        self._trend = trend

    def update(self, rec: StepRecord) -> list[Finding]:
        t = self._trend.observe(rec)
        if t is None or rec.loss is None:
            return []
        p = self._p
        need = improvement_needed(p.min_improvement, t.expected)
        if t.change > -need and t.spread >= p.min_spread and t.level >= p.high_fraction:
            return [
                Finding(
                    AlertKind.OSCILLATION,
                    Severity.WARNING,
                    "loss",
                    t.spread,
                    p.min_spread,
                    f"loss bounces (relative spread {t.spread:.2f} over {t.span} steps) without a downward trend "
                    f"(change {t.change * 100:+.1f}%)",
                    details={"change": t.change, "spread": t.spread, "level": t.level, "span": t.span},
                )
            ]
        return []
