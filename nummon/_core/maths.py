"""Pure maths over host-side floats: robust baselines, growth, trend. No state, no torch."""

from __future__ import annotations

import decimal
import math
from collections.abc import Sequence
from typing import TypeGuard, TypeVar

__all__ = [
    "spaced",
    "DTYPE_MAX",
    "MAD_TO_SIGMA",
    "is_finite",
    "median",
    "quantile",
    "robust_center",
    "log10_safe",
    "jump_decades",
    "growth_per_step",
    "steps_to_overflow",
    "headroom_decades",
    "relative_change",
    "relative_spread",
    "pow10",
    "clip_ratio",
]

#: Largest finite value per dtype (so detectors need no torch to reason about headroom).
DTYPE_MAX = {
    "float64": 1.7976931348623157e308,
    "float32": 3.4028234663852886e38,
    "bfloat16": 3.3895313892515355e38,
    "float16": 65504.0,
}

MAD_TO_SIGMA = 1.4826  # MAD of a normal sample times this estimates its standard deviation


def is_finite(v: float | None) -> TypeGuard[float]:
    """True for a finite int or float (so the type checker knows `v` is a number past the check)."""
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    s = sorted(values)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated q-quantile (0 <= q <= 1) of a non-empty sequence."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def robust_center(values: Sequence[float]) -> tuple[float, float]:
    """(median, sigma) where sigma = 1.4826 * MAD: a spread one outlier cannot move."""
    m = median(values)
    mad = median([abs(v - m) for v in values])
    return m, MAD_TO_SIGMA * mad


def printed_unit(v: float) -> float:
    """One unit of the last digit of `v` as it is written (its shortest repr): 1e-4 for a loss
    logged as 0.0057, ~1e-17 for a float32 loss read from a tensor."""
    exponent = decimal.Decimal(repr(float(v))).as_tuple().exponent
    return 10.0**exponent if isinstance(exponent, int) else 0.0


def log10_safe(v: float, floor: float = 1e-30) -> float:
    """log10 of a positive finite value, floored so zeros do not give -inf."""
    return math.log10(max(abs(v), floor))


def jump_decades(value: float, history_log10: Sequence[float]) -> tuple[float, float, float]:
    """How far `value` sits above the history in log10 units.

    Returns (decades above the median, median in log10, robust sigma in log10).
    """
    m, sigma = robust_center(history_log10)
    return log10_safe(value) - m, m, sigma


def growth_per_step(prev: float, cur: float, dsteps: int) -> float:
    """Geometric growth factor per step between two positive values `dsteps` apart."""
    if prev <= 0 or cur <= 0 or dsteps <= 0:
        return 1.0 if cur <= prev else math.inf
    return float((cur / prev) ** (1.0 / dsteps))  # float ** float is typed Any (complex for a negative base)


def steps_to_overflow(value: float, rate: float, dtype_max: float) -> float:
    """Steps until `value`, growing by `rate` per step, exceeds `dtype_max` (inf if not growing)."""
    if rate <= 1.0 or not math.isfinite(rate):
        return math.inf if rate <= 1.0 else 0.0
    if value <= 0:
        return math.inf
    return max(0.0, (math.log(dtype_max) - math.log(value)) / math.log(rate))


def headroom_decades(max_abs: float, dtype: str | float) -> float:
    """Decades between the largest magnitude and the dtype's largest finite value (<= 0: overflow).

    `dtype` is a dtype name ("float32", ...; unknown names count as float32) or that largest
    finite value itself. The one headroom rule: zero magnitudes get 30 decades more than the
    dtype's range, non-finite ones -inf."""
    top = float(dtype) if isinstance(dtype, (int, float)) else DTYPE_MAX.get(dtype, DTYPE_MAX["float32"])
    if not math.isfinite(max_abs):
        return -math.inf
    if max_abs <= 0:
        return math.log10(top) + 30.0
    return math.log10(top) - math.log10(max_abs)


def relative_change(first: Sequence[float], second: Sequence[float]) -> float:
    """(median(second) - median(first)) / |median(first)|: negative means improving."""
    a, b = median(first), median(second)
    return (b - a) / max(abs(a), 1e-12)


def relative_spread(values: Sequence[float]) -> float:
    """Inter-quartile range over |median|: a spread measure that single spikes cannot inflate."""
    m = median(values)
    return (quantile(values, 0.75) - quantile(values, 0.25)) / max(abs(m), 1e-12)


def pow10(x: float) -> float:
    """10**x without OverflowError (inf past float64's range)."""
    return math.inf if x > 308.25 else 10.0**x


def clip_ratio(grad_norm: float | None, max_norm: float | None) -> float | None:
    """How much norm clipping scales a step's gradients down (1.0 = not clipped); None when
    there is no clipping or no finite norm to compare with."""
    if not max_norm or max_norm <= 0 or grad_norm is None or not math.isfinite(grad_norm):
        return None
    if grad_norm <= 0:
        return 1.0
    return min(1.0, float(max_norm) / float(grad_norm))


T = TypeVar("T")


def spaced(items: Sequence[T], k: int) -> list[T]:
    """At most `k` of `items`, evenly spaced, the first and the last included."""
    if len(items) <= k:
        return list(items)
    return [items[round(i * (len(items) - 1) / (k - 1))] for i in range(k)]
