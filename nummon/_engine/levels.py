"""Where each metric stood before a condition on it opened: a condition on a magnitude clears
only once the metric is back near that level (a spike's own values must not become the baseline
it clears against)."""

from __future__ import annotations

from collections.abc import Iterable

from .._core.maths import is_finite, median
from .._core.types import Finding, StepRecord

__all__ = ["ClearLevels"]

Key = tuple[str, str, str]


class ClearLevels:
    """The recent finite values of each magnitude metric, and the level (their median) each open
    condition's metric stood at when it opened."""

    CLEAR_FACTOR = 4.0  # "back near its level": within this factor of the pre-incident level
    KEPT = 8  # recent values a level is the median of

    def __init__(self, metrics: Iterable[str]) -> None:
        self._levels: dict[str, list[float]] = {m: [] for m in metrics}
        self._before: dict[Key, float] = {}

    def still_high(self, f: Finding, rec: StepRecord) -> bool:
        """The metric of an open condition still stands far above its level from before it opened."""
        before = self._before.get(f.key)
        v = getattr(rec, f.metric, None) if f.metric in self._levels else None
        return before is not None and is_finite(v) and abs(v) > self.CLEAR_FACTOR * before

    def note(self, rec: StepRecord, open_findings: Iterable[Finding]) -> None:
        """Remember each newly open condition's pre-incident level, forget closed ones, then add
        this record's values to the recent ones."""
        open_keys = {f.key: f for f in open_findings}
        for key in [k for k in self._before if k not in open_keys]:
            del self._before[key]
        for key, f in open_keys.items():
            levels = self._levels.get(f.metric)
            if key not in self._before and levels:
                self._before[key] = median(levels)
        for m, levels in self._levels.items():
            v = getattr(rec, m)
            if is_finite(v) and v > 0:
                levels.append(abs(float(v)))
                if len(levels) > self.KEPT:
                    del levels[0]

    def absorb(self, records: Iterable[StepRecord]) -> None:
        """`note` for records while no condition is open, in bulk."""
        self._before.clear()
        for m, levels in self._levels.items():
            levels.extend(abs(float(v)) for rec in records if is_finite(v := rec.__dict__[m]) and v > 0)
            del levels[: -self.KEPT]

    def clear(self) -> None:
        self._before.clear()
        for levels in self._levels.values():
            levels.clear()
