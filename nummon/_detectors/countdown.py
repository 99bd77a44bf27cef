"""Steps left before a runaway overflows its dtype: from the growth of log|x| and its acceleration.

A runaway's growth rate itself grows (momentum and a rising learning rate feed each other), so
the current rate extrapolated flat promises time that is not there: the demo's critical alert
said ~53 steps with 7 left. Here the per-step increments of log10|x| are followed: when the
latest increment is larger than the one before (the rate is rising), they are assumed to keep
growing by at least that ratio per step, and the estimate is an upper bound ("at most ~N
steps"); when it is not (yet) rising, a growth of the rate by `MIN_ACCELERATION` per step is
assumed all the same, and the message says so. Pure maths over host floats.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Countdown", "MIN_ACCELERATION", "MIN_POINTS", "countdown"]

#: The smallest per-step growth of the rate assumed once the rate is rising. Calibrated on the
#: runaways of benchmarks/countdown.py (the demo, the Lightning and HF examples driven to blow up,
#: the README table, the dev corpus' runaways): every one of them grew its rate by 1.5x per step
#: or more in its last steps; a lower assumption would promise steps that were not there.
MIN_ACCELERATION = 2.0
_MAX_STEPS = 10_000.0
#: Points (growth intervals + 1) of a streak before acceleration is assumed: a critical runaway
#: has at least three growth records (runaway.critical_steps), a single jump has one or two
MIN_POINTS = 4


@dataclass(frozen=True)
class Countdown:
    """How many steps (and records) are left before overflow, and how sure the number is."""

    steps: float  # steps left (inf: not growing); >= 1 while finite
    rising: bool  # the growth rate is rising: `steps` is an upper bound
    rate: float  # the latest growth, decades of |x| per step
    records: float | None = None  # the same in records, when records are sparser than one per step
    at_rate: float | None = None  # steps left if the growth kept today's rate (an optimistic figure)
    accelerating: bool = True  # the figure assumes the growth speeds up (a sustained streak)

    def phrase(self, dtype: str) -> str:
        """E.g. "at most ~3 steps left until float32 overflow (the growth rate is rising)"."""
        if not math.isfinite(self.steps):
            return f"not on course to overflow {dtype}"
        n = max(1, round(self.steps))
        steps = f"~{n} step" + ("" if n == 1 else "s")
        if self.records is not None and max(1, round(self.records)) != n:
            r = max(1, round(self.records))
            steps += f" (~{r} record" + ("" if r == 1 else "s") + ")"
        if self.rising:
            return f"at most {steps} left until {dtype} overflow (the growth rate is rising)"
        if not self.accelerating:
            return f"{steps} left until {dtype} overflow at this rate"
        flat = ""
        if self.at_rate is not None and round(self.at_rate) > n:
            flat = f"; ~{round(self.at_rate)} at today's rate"
        return f"{steps} left until {dtype} overflow if the growth speeds up as runaways do{flat}"


def countdown(points: Sequence[tuple[int, float]], log10_max: float) -> Countdown:
    """The countdown from the streak's (step, log10|x|) points, oldest first (at least two).

    Steps left n: the smallest n with sum_{k=1..n} r * q**k >= D, where D is the decades left,
    r the faster of the latest increment per step and the streak's mean, and q the per-step
    growth of the rate: the observed one when the rate is rising, never below
    MIN_ACCELERATION (every calibration runaway sped up before it overflowed, also those whose
    last two increments happened to be level). Never below 1 step while finite.
    """
    (s1, l1), (s2, l2) = points[-2], points[-1]
    latest = (l2 - l1) / max(s2 - s1, 1)
    mean = (l2 - points[0][1]) / max(s2 - points[0][0], 1)
    rate = max(latest, mean)
    left = log10_max - l2
    spacing = _spacing(points)
    if rate <= 0:
        return Countdown(math.inf, False, rate)
    if left <= 0:
        return Countdown(1.0, False, rate, 1.0 if spacing > 1 else None, 1.0)
    if len(points) < MIN_POINTS:
        # one or two growth intervals (a single jump): no evidence of a sustained runaway yet, so
        # no acceleration is assumed; the flat rate is the figure
        n = min(max(math.ceil(left / rate - 1e-9), 1.0), _MAX_STEPS)
        records = max(n / spacing, 1.0) if spacing > 1 else None
        return Countdown(float(n), False, rate, records, None, accelerating=False)
    rising = False
    q = MIN_ACCELERATION
    if len(points) >= 3:
        s0, l0 = points[-3]
        before = (l1 - l0) / max(s1 - s0, 1)
        if before > 0 and latest > before:
            rising = True
            # the rate's growth per step, over the steps between the two intervals' midpoints
            gap = max((s2 - s0) / 2.0, 1.0)
            q = max((latest / before) ** (1.0 / gap), MIN_ACCELERATION)
    # r q (q^n - 1) / (q - 1) >= D  ->  n = log(1 + D (q - 1) / (r q)) / log q
    n = math.log1p(left * (q - 1.0) / (rate * q)) / math.log(q)
    n = min(max(math.ceil(n - 1e-9), 1.0), _MAX_STEPS)
    flat = min(max(math.ceil(left / rate - 1e-9), 1.0), _MAX_STEPS)
    records = max(n / spacing, 1.0) if spacing > 1 else None
    return Countdown(float(n), rising, rate, records, float(flat), accelerating=True)


def _spacing(points: Sequence[tuple[int, float]]) -> float:
    """Steps per record over the points (1.0 for a log of every step)."""
    if len(points) < 2:
        return 1.0
    return (points[-1][0] - points[0][0]) / (len(points) - 1)
