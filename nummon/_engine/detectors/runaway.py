"""Sustained geometric growth over consecutive records, with steps left until overflow."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core import maths as F
from ..._core.types import AlertKind, Finding, Severity, StepRecord
from ..._policy.sections import RunawayPolicy
from .countdown import countdown, noise_of

if TYPE_CHECKING:
    from ..quiet import QuietPlan

__all__ = ["RunawayDetector"]

#: Points of a streak kept for the countdown's fit: enough to measure whether the rate rises
_POINTS = 32


class RunawayDetector:
    """A metric that keeps growing by at least ``min_growth`` per step, far above its recent level.

    Shared value: ``default_dtype``, the dtype whose overflow is forecast when a record does not
    name one.
    """

    section = "runaway"
    kinds = (AlertKind.RUNAWAY,)
    needs = ("default_dtype",)

    def __init__(self, p: RunawayPolicy, default_dtype: str = "float32") -> None:
        self._p = p
        self._dtype = default_dtype
        # per metric: (last step, last value, streak length in steps, streak start step, streak start value)
        self._state: dict[str, tuple[int, float, int, int, float]] = {}
        self._records: dict[str, int] = {}  # growth records in the current streak
        self._points: dict[str, deque[tuple[int, float]]] = {}  # (step, log10 value) of the streak, for the countdown
        self._hist: dict[str, deque[float]] = {m: deque(maxlen=p.history) for m in p.metrics}

    def update(self, rec: StepRecord) -> list[Finding]:
        out: list[Finding] = []
        for metric in self._p.metrics:
            v = getattr(rec, metric)
            if not F.is_finite(v) or v <= 0:
                if v is not None:
                    self._state.pop(metric, None)  # a NaN ends the streak; the nonfinite detector takes over
                continue
            finding = self._observe(metric, rec.step, float(v), rec.headroom_dtype or self._dtype)
            if finding is not None:
                out.append(finding)
        return out

    def quiet(self, plan: QuietPlan) -> bool:
        """No finding while each metric's top stays under the smallest total growth a finding
        needs (`min(warning_total_factor, critical_total_factor)`: the short history's factors are
        powers of them, larger) x the lowest value a streak can start from: the band's lower end,
        or the running streak's start. A streak may start and grow inside the band; `absorb`
        books it record by record, as `update` would."""
        p = self._p
        factor = min(p.warning_total_factor, p.critical_total_factor)
        for metric in p.metrics:
            if metric not in plan.bands:
                return False  # a metric no band covers: judged every record
            lo = plan.lo(metric)
            if lo is None:
                continue
            last = self._state.get(metric)
            if last is not None and last[4] < lo:  # the running streak's start (the last value when none runs)
                lo = last[4]
            plan.cap(metric, lo * factor)
        return True

    def absorb(self, records: Sequence[StepRecord]) -> None:
        """Book records `quiet` promised silence on, each into its metric's streak and history, as
        `_extend_streak` would: a record that grows `min_growth` x from the last one through it,
        each other one ending the streak (its points made once, for the last such record)."""
        min_growth, growth, log10 = self._p.min_growth, F.growth_per_step, F.log10_safe
        for metric in self._p.metrics:
            hist, state = self._hist[metric], self._state.get(metric)
            ended: tuple[int, float] | None = None  # (step, log10 value) of the last record that ended the streak
            for rec in records:
                v = rec.__dict__[metric]
                if v is None:
                    continue
                v, step = float(v), rec.step  # (inside its band: finite and positive; growth needs a rise)
                if (
                    state is not None
                    and v > state[1]
                    and step > state[0]
                    and growth(state[1], v, step - state[0]) >= min_growth
                ):
                    if ended is not None:
                        self._points[metric] = deque([ended], maxlen=_POINTS)
                        ended = None
                    self._state[metric] = state
                    self._extend_streak(metric, step, v)
                    state = self._state[metric]
                else:
                    lv = log10(v)
                    state, ended = (step, v, 0, step, v), (step, lv)
                    self._records[metric] = 0
                    hist.append(lv)
            if state is not None:
                self._state[metric] = state
            if ended is not None:
                self._points[metric] = deque([ended], maxlen=_POINTS)

    def _observe(self, metric: str, step: int, v: float, dtype: str) -> Finding | None:
        streak = self._extend_streak(metric, step, v)
        if streak is None:
            return None
        steps, start_step, start = streak
        total = v / start
        judged = self._judge(metric, v, steps, total)
        if judged is None:
            return None
        severity, threshold = judged
        return self._finding(metric, step, v, dtype, severity, threshold, steps, start_step, total)

    def _extend_streak(self, metric: str, step: int, v: float) -> tuple[int, int, float] | None:
        """Book `v` into the metric's growth streak: (its length in steps, its start step, its start
        value) while one runs, None when there is none (first value, a restart, no growth)."""
        hist = self._hist[metric]
        prev = self._state.get(metric)
        if prev is None or step <= prev[0]:
            self._state[metric] = (step, v, 0, step, v)
            self._records[metric] = 0
            self._points[metric] = deque([(step, F.log10_safe(v))], maxlen=_POINTS)
            hist.append(F.log10_safe(v))
            return None
        step0, v0, streak, start_step, start = prev
        if F.growth_per_step(v0, v, step - step0) >= self._p.min_growth:
            # a streak is counted in steps: one record 5 steps after the last, grown at the
            # minimum rate per step, is 5 steps of sustained growth (logs every N steps)
            streak += step - step0
            self._records[metric] += 1
            self._points[metric].append((step, F.log10_safe(v)))
        else:
            streak, start_step, start = 0, step, v
            self._records[metric] = 0
            self._points[metric] = deque([(step, F.log10_safe(v))], maxlen=_POINTS)
        self._state[metric] = (step, v, streak, start_step, start)
        hist.append(F.log10_safe(v))
        return (streak, start_step, start) if streak else None

    def _judge(self, metric: str, v: float, streak: int, total: float) -> tuple[Severity, float] | None:
        """(severity, the total-growth factor it crossed) of a streak `streak` steps long that grew
        `total` x; None while it is below the warning bar."""
        p = self._p
        hist = self._hist[metric]
        warn_f, crit_f = p.warning_total_factor, p.critical_total_factor
        if len(hist) < p.short_history:
            # early in a run (or trace) growth from tiny initial values is normal: demand more
            warn_f, crit_f = warn_f**p.short_history_multiplier, crit_f**p.short_history_multiplier
        if streak < p.warning_steps or self._records[metric] < p.warning_records or total < warn_f:
            return None
        # the value must also stand above the metric's recent level (median of earlier samples)
        earlier = list(hist)[:-1]
        above = v / F.pow10(F.median(earlier)) if earlier else math.inf
        # critical needs `critical_steps` growth observations too: with logs every N steps a
        # noise blip followed by one spike would otherwise look sustained
        if (
            streak >= p.critical_steps
            and self._records[metric] >= p.critical_steps
            and total >= crit_f
            and above >= crit_f
        ):
            return Severity.CRITICAL, crit_f
        if total >= warn_f and above >= warn_f:
            return Severity.WARNING, warn_f
        return None

    def _finding(
        self,
        metric: str,
        step: int,
        v: float,
        dtype: str,
        severity: Severity,
        threshold: float,
        streak: int,
        start_step: int,
        total: float,
    ) -> Finding:
        """The runaway finding: growth, rate per step, and the steps left until `dtype` overflows."""
        hist = self._hist[metric]
        mean_rate = total ** (1.0 / max(step - start_step, 1))
        top = F.DTYPE_MAX.get(dtype, F.DTYPE_MAX["float32"])
        points = list(self._points[metric])
        # the metric's own noise before the streak: a rise of the rate must stand out of it
        before = list(hist)[: max(len(hist) - self._records[metric] - 1, 0)]
        left = countdown(points, math.log10(top), noise_of(before))
        records = self._records[metric]
        over = (
            f"over {streak} consecutive steps"
            if records == streak
            else f"over {_count(records, 'record')} ({_count(streak, 'step')})"
        )
        return Finding(
            AlertKind.RUNAWAY,
            severity,
            metric,
            v,
            threshold,
            f"{metric} grew {total:.3g}x {over} (x{mean_rate:.3g} per step); {left.phrase(dtype)}",
            details={
                "growth": total,
                "rate_per_step": mean_rate,
                "steps_to_overflow": left.steps,
                "streak": streak,
                "records": records,
                "overflow_bound": left.rising,
                # (if it keeps speeding up, at today's rate) while the two readings cannot be told apart
                "steps_to_overflow_range": list(left.range) if left.range else None,
            },
        )


def _count(n: int, word: str) -> str:
    """ "one record", "3 records"."""
    return f"one {word}" if n == 1 else f"{n} {word}s"
