"""Generated families of runaways with their truth: for the countdown's property tests
(tests/engine/test_countdown_families.py) and its benchmark (benchmarks/countdown.py).

A family is log10|x| over steps: a healthy prefix (a loss near 2, slowly falling) and then a
runaway of a given shape, with multiplicative noise on every step (a normal number of decades),
logged every `every` steps. The truth is the first step whose |x| exceeds the dtype's max, read
from the per-step series (also when that step is not logged); the first logged step at or after
it carries inf, and the trace ends there.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

DTYPE_LOG10_MAX = {"float32": math.log10(3.4028234663852886e38), "float16": math.log10(65504.0)}

#: shape name -> log10 growth after k steps of runaway, from two parameters
SHAPES = {
    "constant": lambda k, a, _b: a * k,  # x10^a per step
    "quadratic": lambda k, a, c: a * k + c * k * k,  # the rate rises linearly
    "double_exp": lambda k, amp, lam: amp * math.expm1(lam * k),  # the rate rises geometrically
    "decelerating": lambda k, a, rho: a * (1.0 - rho**k) / (1.0 - rho),  # the rate decays by rho per step
}


@dataclass(frozen=True)
class Family:
    shape: str
    p1: float
    p2: float = 0.0
    noise: float = 0.0  # decades (sigma of log10 |x|), every step
    every: int = 1  # steps per record
    prefix: int = 30  # healthy records before the runaway
    dtype: str = "float32"
    seed: int = 0

    def log10_series(self) -> tuple[list[float], int]:
        """(log10 |x| per step up to and including the overflow step, runaway start step); the last
        value exceeds the dtype's max unless the growth levels off first."""
        rng = random.Random(self.seed)
        top = DTYPE_LOG10_MAX[self.dtype]
        start = self.prefix * self.every
        f = SHAPES[self.shape]
        out: list[float] = []
        level = math.log10(2.0)
        for t in range(start + 20_000):
            if t < start:
                base = level - 0.1 * t / max(start, 1)
            else:
                base = level - 0.1 + f(t - start, self.p1, self.p2)
            out.append(base + rng.gauss(0.0, self.noise))
            if t >= start and out[-1] > top:
                break
            if t >= start and base > top + 5:  # noise cannot hold it back any longer
                break
            k = t - start
            if self.shape == "decelerating" and k > 0 and f(k + 1, self.p1, self.p2) - f(k, self.p1, self.p2) < 0.01:
                break  # levelled off (< 2% growth per step): it never overflows
        return out, start

    def records(self) -> tuple[list[tuple[int, float]], float]:
        """([(step, value)] as logged, overflow step (inf: never))."""
        series, _ = self.log10_series()
        top = DTYPE_LOG10_MAX[self.dtype]
        over = next((t for t, v in enumerate(series) if v > top), math.inf)
        recs = []
        for t in range(0, len(series), self.every):
            if t >= over:
                recs.append((t, math.inf))
                break
            recs.append((t, 10.0 ** series[t]))
        else:
            if math.isfinite(over):
                recs.append((((int(over) // self.every) + 1) * self.every, math.inf))
        return recs, over
