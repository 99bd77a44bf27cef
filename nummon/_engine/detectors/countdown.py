"""Steps left before a runaway overflows its dtype: from a fit of log10|x| over the streak.

A steady runaway (SGD on a quadratic with too large a step) grows geometrically: log10|x| rises
by the same number of decades every step and the flat rate is the answer. Feedback loops can
make the rate itself rise; then the flat rate promises time that is not there. Which of the two
a run is doing is *measured*, never assumed: log10|x| is fitted with a parabola over the
streak's points, and its curvature counts as a rising (or falling) rate only when it stands out
of the noise (`SIGNIFICANCE` standard errors, the noise being the larger of the fit's residuals,
the metric's own record-to-record noise before the streak, and `NOISE_FLOOR`).

- Rising, over at least `MIN_POINTS` points: the growth is extrapolated with the better fitting
  of two accelerating forms (a rate growing linearly: log|x| quadratic; a rate growing
  geometrically: |x| double-exponential), "at most ~N steps (the growth rate is rising)".
- Steady: the flat rate of a line fitted over the streak, "~N steps at today's rate (steady)",
  when the fastest acceleration the data still allow would not shorten it by more than 1.5x.
- Falling, over more than `MIN_POINTS` points: the flat rate of the line over the streak, early
  while the rate keeps falling; no floor is promised (a noisy runaway that slowed can speed up
  again). Over fewer points a slowing rate is not yet a measurement, and the range below is said.
- Otherwise (too few points, or too much noise to tell): the range, "~A-F steps: ~F at today's
  rate, ~A if it keeps speeding up"; the headline is the flat rate unless the points already
  show a significant rise (then the accelerated figure).

The headline (`Countdown.steps`) is what a person and `details["steps_to_overflow"]` read; the
property tests in tests/engine/test_countdown_families.py hold it within [truth/1.5 - 2, 1.5 truth + 2]
on generated families of runaways. Pure maths over host floats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Countdown", "MIN_ACCELERATION", "MIN_POINTS", "NOISE_FLOOR", "SIGNIFICANCE", "countdown", "noise_of"]

#: Points (growth intervals + 1) before the rate's trend is claimed: three intervals, so a
#: rising rate is never read from one pair of increments.
MIN_POINTS = 4
#: Standard errors the fitted curvature must stand from zero to count as a rising/falling rate.
SIGNIFICANCE = 3.0
#: The least noise assumed in log10|x| (decades, ~1%): exact synthetic series and losses printed
#: with few digits would otherwise make any wiggle "significant".
NOISE_FLOOR = 0.001
#: The per-step growth of the rate assumed for the range's lower figure while the points are too
#: few to measure it (the runaways of benchmarks/countdown.py sped up by 1.5x-2x per step in
#: their last steps). It is never the headline.
MIN_ACCELERATION = 2.0
_MAX_STEPS = 10_000.0
# log-rate growth per step (ln g) tried by the double-exponential fit
_LAMBDAS = tuple(0.002 * 1.25**k for k in range(33))  # 0.002 .. ~2.5


@dataclass(frozen=True)
class Countdown:
    """How many steps (and records) are left before overflow, and how sure the number is."""

    steps: float  # the headline: steps left (inf: not on course to overflow); >= 1 while finite
    trend: str  # "rising" | "steady" | "falling" | "unknown": what the fit measured of the rate
    rate: float  # today's growth, decades of |x| per step
    records: float | None = None  # `steps` in records, when records are sparser than one per step
    at_rate: float | None = None  # steps left at today's rate (flat)
    if_faster: float | None = None  # steps left if the rate keeps rising (the range's lower end)

    @property
    def rising(self) -> bool:
        """The growth rate is measured to rise: `steps` is an upper bound ("at most")."""
        return self.trend == "rising"

    def phrase(self, dtype: str) -> str:
        """E.g. "~76 steps left until float32 overflow at today's rate (steady)"."""
        if not math.isfinite(self.steps):
            return f"not on course to overflow {dtype}"
        n = _n(self.steps)
        steps = _steps(n)
        if self.records is not None and _n(self.records) != n:
            r = _n(self.records)
            steps += f" (~{r} record" + ("" if r == 1 else "s") + ")"
        flat = _n(self.at_rate) if _finite(self.at_rate) else n
        if self.trend == "rising":
            tail = f"; ~{flat} at today's rate" if flat > n else ""
            return f"at most {steps} left until {dtype} overflow (the growth rate is rising{tail})"
        if self.trend == "steady":
            return f"{steps} left until {dtype} overflow at today's rate (steady)"
        if self.trend == "falling":
            return f"{steps} left until {dtype} overflow at today's rate (the growth rate is falling)"
        if self.range is None:
            return f"{steps} left until {dtype} overflow at today's rate"
        low, high = (_n(x) for x in self.range)
        # the two readings cannot be told apart yet: the range leads, each end named
        return (
            f"~{low}-{high} steps left until {dtype} overflow (~{high} at today's rate, ~{low} if it keeps speeding up)"
        )

    @property
    def range(self) -> tuple[float, float] | None:
        """(if it keeps speeding up, at today's rate) in steps, while the trend is unknown and
        the two differ; None once one reading is measured."""
        if self.trend != "unknown" or not (_finite(self.if_faster) and _finite(self.at_rate)):
            return None
        assert self.if_faster is not None and self.at_rate is not None
        if _n(self.if_faster) >= _n(self.at_rate):
            return None
        return (self.if_faster, self.at_rate)


def countdown(points: Sequence[tuple[int, float]], log10_max: float, noise: float = 0.0) -> Countdown:
    """The countdown from the streak's (step, log10|x|) points, oldest first (at least two).

    `log10_max`: log10 of the dtype's largest finite value; `noise`: the metric's own
    record-to-record noise in log10|x| (decades) before the streak, 0 when unknown.
    """
    (s1, l1), (s2, l2) = points[-2], points[-1]
    latest = (l2 - l1) / max(s2 - s1, 1)
    left = log10_max - l2
    spacing = _spacing(points)
    if len(points) < 3:
        rate = latest
    else:
        rate = _line_slope(points)
    if rate <= 0:
        return Countdown(math.inf, "unknown", rate)
    if left <= 0:
        return Countdown(1.0, "unknown", rate, 1.0 if spacing > 1 else None, 1.0, 1.0)
    flat = _clamp(left / rate)
    if len(points) < 3:
        return _made(flat, "unknown", rate, spacing, flat, None)
    fit = _parabola(points, noise)
    if fit is None:
        return _made(flat, "unknown", rate, spacing, flat, None)
    slope, curv, se = fit
    enough = len(points) >= MIN_POINTS
    now = max(slope, rate)
    sigma = max(noise, NOISE_FLOOR)
    assumed = _assumed_acceleration_steps(points, left, max(latest, rate))
    if not enough:
        # three points (one pair of increments): a jump and an acceleration look alike (the demo's
        # domain switch is a jump); the flat rate heads, the range names the other reading
        low = assumed
        if curv > SIGNIFICANCE * se and slope > 0:
            low = min(low, _best_accelerating(points, left, slope, curv, sigma))
        return _made(flat, "unknown", rate, spacing, flat, low)
    if curv > SIGNIFICANCE * se and slope > 0:
        best = _best_accelerating(points, left, slope, curv, sigma)
        return _made(best, "rising", now, spacing, _clamp(left / now), best)
    if curv < -SIGNIFICANCE * se and len(points) > MIN_POINTS:
        # a slowing rate, measured over more points than a rise needs (a claim that buys time
        # needs more evidence): the streak's rate heads, early while the rate keeps falling. No
        # floor is promised: a noisy runaway that slowed speeds up again (the demo's loss grew
        # 11x, 5.6x, 2.1x, then 6.7x, and overflowed 5 steps after a floor of ~212 was said)
        return _made(flat, "falling", rate, spacing, flat, None)
    # the fastest acceleration the data still allow: does it matter?
    hi = _clamp(_quadratic_steps(now, max(curv, 0.0) + SIGNIFICANCE * se, left))
    if hi * 1.5 >= flat:
        return _made(flat, "steady", rate, spacing, flat, hi)
    # the data cannot tell steady from accelerating yet: the early end of the range heads (every
    # real runaway of benchmarks/countdown.py sped up before it overflowed), the text gives both
    low = min(hi, assumed)
    return _made(low, "unknown", rate, spacing, flat, low)


def _assumed_acceleration_steps(points: Sequence[tuple[int, float]], left: float, rate: float) -> float:
    """Steps left if the rate (decades/step) keeps growing by MIN_ACCELERATION per step, or by
    the last two increments' ratio when larger: the smallest n with sum_k rate q^k >= left."""
    (s0, l0), (s1, l1), (s2, l2) = points[-3], points[-2], points[-1]
    before, latest = (l1 - l0) / max(s1 - s0, 1), (l2 - l1) / max(s2 - s1, 1)
    q = MIN_ACCELERATION
    if before > 0 and latest > before:
        q = max((latest / before) ** (1.0 / max((s2 - s0) / 2.0, 1.0)), q)
    return _clamp(math.log1p(left * (q - 1.0) / (rate * q)) / math.log(q))


def noise_of(history: Sequence[float]) -> float:
    """Record-to-record noise of a series of log10 values (decades): the robust sigma of its second
    differences over sqrt(6), so that a trend, also a curving one, is not counted as noise; 0 with
    fewer than 5 values."""
    if len(history) < 5:
        return 0.0
    d2 = sorted(a - 2.0 * b + c for a, b, c in zip(history, history[1:], history[2:]))
    m = _median(d2)
    mad = _median(sorted(abs(x - m) for x in d2))
    return 1.4826 * mad / math.sqrt(6.0)


def _made(
    steps: float, trend: str, rate: float, spacing: float, at_rate: float | None, if_faster: float | None
) -> Countdown:
    records = None
    if spacing > 1 and math.isfinite(steps):
        records = max(steps / spacing, 1.0)
    return Countdown(steps, trend, rate, records, at_rate, if_faster)


def _best_accelerating(
    points: Sequence[tuple[int, float]], left: float, slope: float, curv: float, sigma: float
) -> float:
    """Steps left under the accelerating form that fits the streak clearly better: a rate growing
    linearly (log|x| quadratic) or geometrically (|x| double-exponential); the geometric mean of
    the two when the fits are within the noise (`sigma`, decades) of each other (always with
    three points, which both fit exactly)."""
    quad = _quadratic_steps(slope, curv, left)
    dexp = _double_exp_fit(points)
    if dexp is None:
        return _clamp(quad)
    lam, beta, ssr_e = dexp
    de = _exp_steps(lam, beta, left)
    ssr_q = _parabola_ssr(points)
    margin = 4.0 * sigma * sigma
    if len(points) >= MIN_POINTS and ssr_e + margin < ssr_q:
        return _clamp(de)
    if len(points) >= MIN_POINTS and ssr_q + margin < ssr_e:
        return _clamp(quad)
    return _clamp(math.sqrt(quad * de))


def _quadratic_steps(slope: float, curv: float, left: float) -> float:
    """Smallest n with slope n + curv n^2 >= left (curv >= 0)."""
    if curv <= 1e-15:
        return left / slope
    return (-slope + math.sqrt(slope * slope + 4.0 * curv * left)) / (2.0 * curv)


def _exp_steps(lam: float, beta: float, left: float) -> float:
    """Smallest n with beta (e^(lam n) - 1) / lam >= left: a rate `beta` now, growing e^lam per step."""
    if beta <= 0:
        return math.inf
    if abs(lam) < 1e-9:
        return left / beta
    arg = 1.0 + left * lam / beta
    if arg <= 0:
        return math.inf  # a decaying rate that levels off below the max
    return math.log(arg) / lam


def _double_exp_steps(points: Sequence[tuple[int, float]], left: float) -> float | None:
    fit = _double_exp_fit(points)
    if fit is None:
        return None
    lam, beta, _ = fit
    return _exp_steps(lam, beta, left)


def _double_exp_fit(points: Sequence[tuple[int, float]]) -> tuple[float, float, float] | None:
    """(lam, beta, ssr) of L(t) = a + beta (e^(lam t) - 1) / lam, t in steps from the last point:
    a rate of beta decades per step now, growing by e^lam per step (lam > 0). A coarse grid over
    lam refined by golden section; linear least squares for a and beta."""
    ts = [s - points[-1][0] for s, _ in points]
    ls = [v for _, v in points]

    def ssr(lam: float) -> tuple[float, float]:
        got = _line_fit([math.expm1(lam * t) / lam for t in ts], ls)
        if got is None or got[1] <= 0:
            return math.inf, 0.0
        return got[2], got[1]

    grid = [(ssr(lam)[0], k) for k, lam in enumerate(_LAMBDAS)]
    best_ssr, k = min(grid)
    if not math.isfinite(best_ssr):
        return None
    lo, hi = _LAMBDAS[max(k - 1, 0)], _LAMBDAS[min(k + 1, len(_LAMBDAS) - 1)]
    g = (math.sqrt(5.0) - 1.0) / 2.0
    for _ in range(16):
        m1, m2 = hi - g * (hi - lo), lo + g * (hi - lo)
        if ssr(m1)[0] <= ssr(m2)[0]:
            hi = m2
        else:
            lo = m1
    lam = 0.5 * (lo + hi)
    got, beta = ssr(lam)
    if got > best_ssr:
        lam = _LAMBDAS[k]
        got, beta = ssr(lam)
    return lam, beta, got


def _line_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float] | None:
    """(intercept, slope, residual sum of squares) of y on x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    return a, b, sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))


def _line_slope(points: Sequence[tuple[int, float]]) -> float:
    """Least-squares slope of log10|x| per step over the points (today's rate, noise averaged)."""
    got = _line_fit([float(s) for s, _ in points], [v for _, v in points])
    return got[1] if got is not None else 0.0


def _parabola_coeffs(points: Sequence[tuple[int, float]]) -> tuple[list[float], list[list[float]]] | None:
    """Least-squares (level, slope, curvature) at the last point, and (X^T X)^-1."""
    ts = [float(s - points[-1][0]) for s, _ in points]
    ls = [v for _, v in points]
    rows = [(1.0, t, t * t) for t in ts]
    xtx = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    inv = _inverse3(xtx)
    if inv is None:
        return None
    xty = [sum(r[i] * y for r, y in zip(rows, ls)) for i in range(3)]
    beta = [sum(inv[i][j] * xty[j] for j in range(3)) for i in range(3)]
    return beta, inv


def _parabola_ssr(points: Sequence[tuple[int, float]]) -> float:
    got = _parabola_coeffs(points)
    if got is None:
        return math.inf
    (a, b, c), _ = got
    return sum((v - a - b * t - c * t * t) ** 2 for t, v in ((float(s - points[-1][0]), v) for s, v in points))


def _parabola(points: Sequence[tuple[int, float]], noise: float) -> tuple[float, float, float] | None:
    """(slope now in decades/step, curvature in decades/step^2, standard error of the curvature)."""
    got = _parabola_coeffs(points)
    if got is None:
        return None
    (a, b, c), inv = got
    dof = len(points) - 3
    resid = math.sqrt(_parabola_ssr(points) / dof) if dof > 0 else 0.0
    sigma = max(resid, noise, NOISE_FLOOR)
    return b, c, sigma * math.sqrt(max(inv[2][2], 0.0))


def _inverse3(m: list[list[float]]) -> list[list[float]] | None:
    (a, b, c), (d, e, f), (g, h, i) = m
    det = a * (e * i - f * h) - b * (d * i - f * g) + c * (d * h - e * g)
    scale = max(abs(x) for row in m for x in row)
    if abs(det) <= 1e-12 * scale**3:
        return None
    return [
        [(e * i - f * h) / det, (c * h - b * i) / det, (b * f - c * e) / det],
        [(f * g - d * i) / det, (a * i - c * g) / det, (c * d - a * f) / det],
        [(d * h - e * g) / det, (b * g - a * h) / det, (a * e - b * d) / det],
    ]


def _spacing(points: Sequence[tuple[int, float]]) -> float:
    """Steps per record over the points (1.0 for a log of every step)."""
    if len(points) < 2:
        return 1.0
    return (points[-1][0] - points[0][0]) / (len(points) - 1)


def _clamp(n: float) -> float:
    """Whole steps, at least 1, at most _MAX_STEPS (inf stays inf)."""
    if not math.isfinite(n):
        return n
    return float(min(max(math.ceil(n - 1e-9), 1.0), _MAX_STEPS))


def _median(sorted_values: Sequence[float]) -> float:
    n = len(sorted_values)
    return sorted_values[n // 2] if n % 2 else 0.5 * (sorted_values[n // 2 - 1] + sorted_values[n // 2])


def _n(x: float | None) -> int:
    return max(1, round(x)) if x is not None else 1


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _steps(n: int) -> str:
    return f"~{n} step" + ("" if n == 1 else "s")
