"""The loss's starting level and its trend window: computed once per record, shared by the
divergence, stall and oscillation detectors."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from ..._core import maths as F
from ..._core.types import StepRecord
from ..._policy.sections import TrendPolicy
from ..quiet import MAX_RECORDS

__all__ = ["StartLevel", "LossTrend", "TrendStats", "improvement_needed"]


class StartLevel:
    """Where the loss started: the lowest running median of the first ``records`` finite losses.

    Known from the first finite loss on (a run that climbs 1 -> 4 -> 9 -> 13 is judged at once),
    and a blow-up within the first records cannot raise it: each new record can only lower it.
    """

    def __init__(self, records: int) -> None:
        self._n = records
        self._first: list[float] = []
        self._seen: StepRecord | None = None
        self.value: float | None = None

    @property
    def complete(self) -> bool:
        """Whether the level is settled (its first `records` finite losses are in: it no longer moves)."""
        return len(self._first) >= self._n

    def observe(self, rec: StepRecord) -> float | None:
        """The level after this record (idempotent per record: every sharer may call it)."""
        if rec is self._seen:
            return self.value
        self._seen = rec
        if len(self._first) < self._n and F.is_finite(rec.loss):
            self._first.append(float(rec.loss))
            m = F.median(self._first)
            self.value = m if self.value is None else min(self.value, m)
        return self.value


@dataclass(frozen=True)
class TrendStats:
    """What the trend window says at one record (all relative, unitless)."""

    change: float  # (median of second half - median of first half) / |median of first|: < 0 improving
    spread: float  # IQR / |median| over the window
    level: float  # median of the second half / starting level
    span: int  # window length (steps)
    records: int  # finite losses in the window
    expected: float  # relative improvement the run's own average rate predicts over half the span (>= 0)


def improvement_needed(min_improvement: float, expected: float, floor: float = 0.2) -> float:
    """The improvement a window must show to count as progress: ``min_improvement``, lowered to
    half the run's own average progress over the same span when that is slower, but never below
    ``floor`` x ``min_improvement`` (a slow fine-tune is not a stall because it is slow; a loss
    that moves by noise only is)."""
    return min(min_improvement, max(0.5 * expected, floor * min_improvement))


class LossTrend:
    """Finite losses over a window that grows with the run, and the numbers judged over it.

    Span = max(min_span, span_fraction x steps so far, min_records x the run's logging cadence),
    so a 100-step demo and a 100,000-step pretraining log (every 50 steps) are both judged over a
    meaningful stretch. The numbers are recomputed every span/20 steps and held in between.
    Memory is bounded: past ``MAX_POINTS`` losses, every other one is dropped and only every
    second (then fourth, ...) new loss is kept, so the window stays evenly sampled.
    """

    MAX_POINTS = 4096

    def __init__(self, p: TrendPolicy, level: StartLevel) -> None:
        self._p = p
        self.level = level
        self._values: deque[tuple[int, float]] = deque()
        self._first_step: int | None = None
        self._records = 0  # records that carry a loss (finite or not), for the cadence
        self._stride = 1  # keep every `stride`-th finite loss (doubles when MAX_POINTS is reached)
        self._finite = 0
        self._seen: StepRecord | None = None
        self._judged_at: int | None = None
        self._stats: TrendStats | None = None

    @property
    def min_span(self) -> int:
        """The shortest trend window (the policy's trend.min_span, steps)."""
        return self._p.min_span

    @property
    def min_records(self) -> int:
        """Finite losses a window must hold before it is judged (the policy's trend.min_records)."""
        return self._p.min_records

    def span(self, step: int) -> int:
        """The window length at `step` (steps)."""
        if self._first_step is None:
            return self._p.min_span
        elapsed = step - self._first_step
        cadence = elapsed / max(self._records - 1, 1)
        return int(max(self._p.min_span, self._p.span_fraction * elapsed, self._p.min_records * cadence))

    @property
    def current(self) -> TrendStats | None:
        """What `observe` returned for the last record."""
        return self._stats if self._judged_at is not None else None

    def held_until(self, step: int) -> int | None:
        """The last step up to which `observe` surely returns `current` again, for records after
        `step` (the last one observed) that carry a finite loss; None when the next one may change it.

        While judged: until the next recomputation (span // 20 steps after the last, span at
        least `min_span` and `span_fraction` x the steps so far), provided the window keeps
        `min_records` losses however many it drops by then. While too short to judge: until the
        step the window first spans `min_span`."""
        p, first = self._p, self._first_step
        if first is None or not self.level.complete or p.min_records > self.MAX_POINTS // 2:
            return None
        if self._judged_at is None:
            end = first + p.min_span - 2  # `observe` returns None while step - first < min_span - 1
            return end if end > step else None
        shortest = max(p.min_span, int(p.span_fraction * (step - first)))
        end = self._judged_at + max(1, shortest // 20) - 1
        dropped = 0  # losses at or before `end - shortest` may leave the window by then
        for s, _ in self._values:
            if s > end - shortest:
                break
            dropped += 1
        # (within MAX_RECORDS of MAX_POINTS the window may be thinned to every other loss: twice the margin)
        need = p.min_records if len(self._values) + MAX_RECORDS < self.MAX_POINTS else 2 * p.min_records + 2
        return end if end > step and len(self._values) - dropped >= need else None

    def observe(self, rec: StepRecord) -> TrendStats | None:
        """The trend after this record, or None while the run is too short (idempotent per record)."""
        if rec is self._seen:
            return self._stats if self._judged_at is not None else None
        self._seen = rec
        base = self.level.observe(rec)
        if rec.loss is None:
            # an eval-only row does not log the training loss: it is no record of the loss's
            # cadence (counting it would shrink the window) and moves nothing
            return self._stats if self._judged_at is not None else None
        step = rec.step
        if self._first_step is None:
            self._first_step = step
        self._records += 1
        if F.is_finite(rec.loss):
            if self._finite % self._stride == 0:
                self._values.append((step, float(rec.loss)))
            self._finite += 1
            if len(self._values) > self.MAX_POINTS:
                self._values = deque(list(self._values)[1::2])
                self._stride *= 2
        span = self.span(step)
        while self._values and self._values[0][0] <= step - span:
            self._values.popleft()
        if (
            base is None
            or base <= 0
            or step - self._first_step < self._p.min_span - 1
            or len(self._values) < self._p.min_records
        ):
            self._judged_at, self._stats = None, None
            return None
        if self._stats is not None and self._judged_at is not None and step - self._judged_at < max(1, span // 20):
            return self._stats
        mid = step - span // 2
        first = [v for s, v in self._values if s <= mid]
        second = [v for s, v in self._values if s > mid]
        if len(first) < 2 or len(second) < 2:
            return self._stats if self._judged_at is not None else None
        self._judged_at = step
        now = F.median(second)
        elapsed = max(step - self._first_step, 1)
        rate = math.log(now / base) / elapsed if now > 0 else 0.0  # average log-change per step so far
        expected = 1.0 - math.exp(rate * span / 2) if rate < 0 else 0.0
        self._stats = TrendStats(
            F.relative_change(first, second),
            F.relative_spread(first + second),
            now / base,
            span,
            len(first) + len(second),
            expected,
        )
        return self._stats
