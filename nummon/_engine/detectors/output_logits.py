"""Output-logit divergence (PaLM; Wortsman et al. 2023, arXiv 2309.14322): the log-partition
log Z of the output softmax drifts away from where it started; z-loss holds it near 0."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core import maths as F
from ..._core.types import AlertKind, Finding, Severity, StepRecord
from ..._policy.mechanism_sections import OutputLogitsPolicy

if TYPE_CHECKING:
    from ..quiet import QuietPlan

__all__ = ["OutputLogitsDetector"]


class OutputLogitsDetector:
    """Warning when the mean log Z has drifted `warning_drift` nats from its first samples (or
    the largest logit passes `warning_logit`), critical at `critical_drift`. log Z is in nats
    whatever the vocabulary or width, so the drift thresholds hold for every model size."""

    section = "output_logits"
    kinds = (AlertKind.OUTPUT_LOGITS,)
    needs = ()

    def __init__(self, p: OutputLogitsPolicy) -> None:
        self._p = p
        self._first: list[float] = []
        self._held = 0

    @property
    def wants_sample(self) -> bool:
        """A drift seen but not held for `patience` samples yet: sample the next step too."""
        return 0 < self._held < self._p.patience

    def quiet(self, plan: QuietPlan) -> bool:
        """Silent on a record without output logits (a quiet region admits none); no state to book."""
        return True

    def absorb(self, records: Sequence[StepRecord]) -> None:
        """Nothing to book: a record without output logits changes nothing here."""

    def update(self, rec: StepRecord) -> list[Finding]:
        z, top = rec.output_logsumexp_mean, rec.output_logit_max
        if not F.is_finite(z):
            return []
        p = self._p
        if len(self._first) < p.baseline_samples:
            self._first.append(float(z))
            return []
        base = F.median(self._first)
        drift = abs(float(z) - base)
        big = F.is_finite(top) and top >= p.warning_logit
        on = drift >= p.warning_drift or big
        self._held = self._held + 1 if on else 0
        if self._held < p.patience:
            return []
        sev = Severity.CRITICAL if drift >= p.critical_drift else Severity.WARNING
        thr = p.critical_drift if sev is Severity.CRITICAL else p.warning_drift
        why = f"log Z (mean log-sum-exp of the output logits) is {z:.4g}, {drift:.3g} nats from where it started ({base:.4g})"
        if big:
            why += f"; the largest output logit is {top:.4g}"
        return [
            Finding(
                AlertKind.OUTPUT_LOGITS,
                sev,
                "output_logsumexp_mean",
                float(z),
                thr,
                f"output logits are diverging: {why}",
                details={"drift": drift, "baseline": base, "logit_max": top, "logsumexp_max": rec.output_logsumexp_max},
            )
        ]
