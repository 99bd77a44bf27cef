"""Loss oscillation: swings (autocorrelated or alternating) wider than minibatch noise, with no
downward trend and no rise, while still far from converged."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core import maths as F
from ..._core.types import AlertKind, Finding, Severity, StepRecord
from ..._policy.sections import OscillationPolicy
from .trend import LossTrend, TrendStats, improvement_needed

if TYPE_CHECKING:
    from ..quiet import QuietPlan

__all__ = ["OscillationDetector", "noise_sigma", "swing_structure", "wave_crossings"]

#: Mean autocorrelation over lags 1-4 of the detrended log-loss at or above which the swings are
#: cyclic (each step follows the last: a wave), and lag-1 autocorrelation at or below which they
#: alternate (up, down, up). Minibatch noise at a plateau has both near 0.
CYCLIC_AUTOCORR = 0.3
ALTERNATING_AUTOCORR = -0.5
MAX_POINTS = 512
#: Waves must repeat: the smoothed residual crosses from one side of the trend to the other at
#: least this many times (two full up-and-down swings). A fall that flattens onto its noise floor
#: leaves a residual with one bend (+, -, +: two crossings) that autocorrelates like a wave.
MIN_CROSSINGS = 4
#: ... each crossing clearing a band of this many standard deviations of the smoothed noise
#: (the noise estimated from step-to-step differences, which a slow wave barely moves)
BAND_SIGMAS = 3.0
SMOOTH = 5  # moving-average width of the residual (records)


def _autocorr(xs: Sequence[float], lag: int) -> float:
    n = len(xs)
    if n <= lag + 2:
        return 0.0
    m = sum(xs) / n
    var = sum((x - m) ** 2 for x in xs)
    if var <= 0:
        return 0.0
    return sum((xs[i] - m) * (xs[i + lag] - m) for i in range(n - lag)) / var


def noise_sigma(resid: Sequence[float]) -> float:
    """The standard deviation of a series' batch-to-batch noise, from the median absolute
    step-to-step difference (robust to slow waves and to a few spikes; log units here)."""
    d = sorted(abs(b - a) for a, b in zip(resid, resid[1:]))
    if not d:
        return 0.0
    return d[len(d) // 2] / (0.6745 * math.sqrt(2.0))


def wave_crossings(resid: Sequence[float]) -> int:
    """How many times the residual, smoothed over SMOOTH records, goes from below to above the
    band of +-BAND_SIGMAS smoothed-noise deviations or back (a swing above the noise floor)."""
    n, half = len(resid), SMOOTH // 2
    band = BAND_SIGMAS * noise_sigma(resid) / math.sqrt(SMOOTH)
    side, count = 0, 0
    for i in range(n):
        part = resid[max(0, i - half) : i + half + 1]
        v = sum(part) / len(part)
        now = 1 if v > band else -1 if v < -band else 0
        if now and now != side:
            count += side != 0
            side = now
    return count


def swing_structure(values: Sequence[float]) -> tuple[str | None, float]:
    """("cyclic" | "alternating" | None, the autocorrelation that decided) of a loss window:
    log values, a straight-line trend removed, so a steady fall or rise is not a swing; waves
    count only where they repeat above the noise floor (MIN_CROSSINGS), so a fall that flattens
    onto its noise floor is not one."""
    logs = [math.log(v) for v in values if v > 0]
    n = len(logs)
    if n < 8:
        return None, 0.0
    xm, ym = (n - 1) / 2, sum(logs) / n
    sxx = sum((i - xm) ** 2 for i in range(n))
    slope = sum((i - xm) * (y - ym) for i, y in enumerate(logs)) / sxx
    resid = [y - ym - slope * (i - xm) for i, y in enumerate(logs)]
    lags = [_autocorr(resid, k) for k in (1, 2, 3, 4)]
    if lags[0] <= ALTERNATING_AUTOCORR:
        return "alternating", lags[0]
    mean = sum(lags) / len(lags)
    if mean >= CYCLIC_AUTOCORR and wave_crossings(resid) >= MIN_CROSSINGS:
        return "cyclic", mean
    return None, mean


class OscillationDetector:
    """Warning when, over the trend window, the loss's relative spread is large, it has no
    downward trend and does not rise either (a rise during warm-up is a rise), and the swings are
    structured (autocorrelated or alternating: minibatch noise at a plateau is neither).

    Shared value: ``trend`` (the loss-trend window, also read by stall)."""

    section = "oscillation"
    kinds = (AlertKind.OSCILLATION,)
    needs = ("trend",)

    def __init__(self, p: OscillationPolicy, trend: LossTrend) -> None:
        self._p = p
        self._trend = trend
        self._losses: deque[tuple[int, float]] = deque(maxlen=MAX_POINTS)

    def quiet(self, plan: QuietPlan) -> bool:
        """Silent while the trend holds numbers that do not call for the swings to be judged."""
        end = self._trend.held_until(plan.step)
        if end is None:
            return False
        plan.cap_step(end)
        t = self._trend.current
        return t is None or not self._judged(t)

    def absorb(self, records: Sequence[StepRecord]) -> None:
        """Book records `quiet` promised silence on (their losses are finite)."""
        self._losses.extend((rec.step, float(rec.loss)) for rec in records)  # type: ignore[arg-type]

    def _judged(self, t: TrendStats) -> bool:
        """Whether the trend calls for the swings to be judged: spread wide, no downward trend, no rise."""
        p = self._p
        need = improvement_needed(p.min_improvement, t.expected)
        return -need < t.change < p.min_improvement and t.spread >= p.min_spread and t.level >= p.high_fraction

    def update(self, rec: StepRecord) -> list[Finding]:
        t = self._trend.observe(rec)
        if F.is_finite(rec.loss):
            self._losses.append((rec.step, float(rec.loss)))
        if t is None or rec.loss is None:
            return []
        p = self._p
        if not self._judged(t):
            return []
        window = [v for s, v in self._losses if s > rec.step - t.span]
        shape, corr = swing_structure(window)
        if shape is None:
            return []
        swings = "swings in waves" if shape == "cyclic" else "alternates up and down"
        return [
            Finding(
                AlertKind.OSCILLATION,
                Severity.WARNING,
                "loss",
                t.spread,
                p.min_spread,
                f"loss {swings} (relative spread {t.spread:.2f} over {t.span} steps, autocorrelation {corr:+.2f}) "
                f"without a downward trend (change {t.change * 100:+.1f}%)",
                details={
                    "change": t.change,
                    "spread": t.spread,
                    "level": t.level,
                    "span": t.span,
                    "shape": shape,
                    "autocorrelation": corr,
                },
            )
        ]
