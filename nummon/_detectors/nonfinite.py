"""Non-finite values anywhere: critical, with the first place they appeared."""
from __future__ import annotations

import math

from .._policy import NonfinitePolicy
from .._types import AlertKind, Finding, Severity, StepRecord

__all__ = ["NonfiniteDetector"]


class NonfiniteDetector:
    """Critical on the first NaN/Inf anywhere; keeps the first location while the condition holds."""

    section = "nonfinite"
    kinds = (AlertKind.NONFINITE,)
    needs = ()

    def __init__(self, p: NonfinitePolicy) -> None:
        self._first: tuple[str, str] | None = None  # (metric, location) of the first non-finite step

    def update(self, rec: StepRecord) -> list[Finding]:
        out: list[Finding] = []
        kind = AlertKind.NONFINITE
        if rec.scaler_skipped:
            # dynamic loss scaling calibrates by overflowing: the weights were protected
            out.append(
                Finding(
                    kind,
                    Severity.INFO,
                    "scaled_gradients",
                    None,
                    None,
                    "scaled gradients overflowed and the GradScaler skipped this step (loss scale lowered)",
                    location="GradScaler",
                )
            )
        if rec.input_nonfinite:
            out.append(
                Finding(
                    kind,
                    Severity.CRITICAL,
                    "input",
                    float(rec.input_nonfinite),
                    0.0,
                    f"{rec.input_nonfinite} non-finite values in the input batch (a data problem, not the model)",
                    location="input batch",
                )
            )
        parts = list(rec.nonfinite_parts)
        if not parts and not rec.is_finite():  # records from traces carry no parts: find them
            parts = [k for k, v in rec.scalars().items() if not math.isfinite(v)]
            parts += [f"grad of {k}" for k, v in rec.layer_grad_norms.items() if not math.isfinite(v)][:3]
        if not parts:
            self._first = None
            return out
        if self._first is None:
            metric = parts[0]
            self._first = (metric, rec.nonfinite_location or metric)
        metric, location = self._first
        count = f" ({rec.nonfinite_count} values)" if rec.nonfinite_count else ""
        where = f"first non-finite tensor: {location}"
        if rec.rank is not None:
            where = f"first non-finite: rank {rec.rank}, {location}"
        named = list(dict.fromkeys(parts))
        out.append(
            Finding(
                kind,
                Severity.CRITICAL,
                "nonfinite",
                float(rec.nonfinite_count or len(parts)),
                0.0,
                f"non-finite values in {', '.join(named)}{count}; {where}",
                location=location,
                details={"parts": named},
            )
        )
        return out
