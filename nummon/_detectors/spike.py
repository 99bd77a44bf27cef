"""Sudden jumps against the run's own recent history: loss spikes and gradient explosions."""
from __future__ import annotations

import math
from collections import deque

from .. import _functional as F
from .._policy import SpikePolicy
from .._types import AlertKind, Finding, Severity, StepRecord

__all__ = ["SpikeDetector", "LOSS_MIN_FACTOR", "NOISE_MULTIPLE"]

#: The smallest jump of a smooth loss that is a spike (ratio to its recent median), and how many
#: of its robust standard deviations (log10) a jump must exceed to count below `loss_factor`.
LOSS_MIN_FACTOR = 2.0
NOISE_MULTIPLE = 8.0


class SpikeDetector:
    """A sudden upward jump against the run's own recent history, in log space (scale-free).

    History holds only finite positive values, so NaN/Inf never poison the baseline; a median
    over the window is not moved by one spike either.
    """

    section = "spike"
    kinds = (AlertKind.LOSS_SPIKE, AlertKind.EXPLOSION)
    needs = ()
    LOSS_METRICS = ("loss",)
    # not grad_max: the largest single gradient element jumps 10x in healthy runs (one hard
    # sample); it stays watched for sustained growth (runaway) and headroom
    GRAD_METRICS = ("grad_norm", "optim_state_norm", "activation_max")

    def __init__(self, p: SpikePolicy) -> None:
        self._p = p
        self._hist: dict[str, deque[float]] = {
            m: deque(maxlen=p.window) for m in self.LOSS_METRICS + self.GRAD_METRICS
        }

    def update(self, rec: StepRecord) -> list[Finding]:
        out: list[Finding] = []
        p = self._p
        for metric, hist in self._hist.items():
            v = getattr(rec, metric)
            if not F.is_finite(v) or v <= 0:
                continue
            is_loss = metric in self.LOSS_METRICS
            factor = p.loss_factor if is_loss else p.grad_factor
            short = len(hist) < p.short_history
            if short:
                factor *= p.short_history_multiplier
            lv = F.log10_safe(v)
            # the loss's threshold scales with its own noise: a smooth loss that doubles has
            # spiked (a large model's 2.2 -> 5), a noisy one needs up to `loss_factor`
            floor = factor if short or not is_loss else min(factor, LOSS_MIN_FACTOR)
            # cheap pre-check: below floor x the smallest recent value it cannot be a jump
            if len(hist) >= p.min_history and lv - min(hist) >= math.log10(floor):
                up, m_log, sigma = F.jump_decades(v, hist)
                need = max(math.log10(factor), p.robust_z * sigma)
                if is_loss and not short:
                    need = max(min(need, max(math.log10(floor), NOISE_MULTIPLE * sigma)), p.robust_z * sigma)
                if up >= need:
                    base = F.pow10(m_log)
                    out.append(
                        Finding(
                            AlertKind.LOSS_SPIKE if is_loss else AlertKind.EXPLOSION,
                            Severity.WARNING,
                            metric,
                            v,
                            base * F.pow10(need),
                            f"{metric} jumped to {F.fmt_num(v)}, {F.pow10(up):.3g}x its recent median {F.fmt_num(base)}",
                            details={"ratio": F.pow10(up), "baseline": base},
                        )
                    )
            hist.append(lv)
        return out
