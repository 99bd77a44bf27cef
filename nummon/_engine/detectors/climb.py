"""A climb at the start of a run: consecutive records each above every earlier one. The rules
that read it need no window, so they judge a run's first records, where a median or a noise
estimate has too few values (a loss that rises 75% over 5 records straight into NaN).

Not a detector: the divergence detector (the loss) and the spike detector (the gradient norm
beside a climbing loss) read it.
"""

from __future__ import annotations

from ..._core import maths as F

__all__ = ["Climb", "EARLY_RECORDS"]

#: A climb is judged only when it began within a run's first this many finite records: later on
#: the window rules (spike, runaway, divergence) have the history they need.
EARLY_RECORDS = 10


class Climb:
    """Consecutive finite positive values, each above every value before it (a run of new highs).

    `records`: how many values are in the current climb (0: the last value was no new high);
    `base`: the highest value before the climb began; `low`: the lowest value within the climb;
    `seen`: every value observed; `over`: no climb that begins from now on can be early (the
    readers then stop booking values: a run's ordinary step pays nothing for the start's rules)."""

    def __init__(self) -> None:
        self.over = False
        self.seen = 0
        self.records = 0
        self.top: float | None = None  # the highest value so far
        self.base = 0.0
        self.low = 0.0

    def add(self, v: float | None) -> None:
        """Book one value (non-finite or non-positive values are skipped: the nonfinite detector's)."""
        if not F.is_finite(v) or v <= 0:
            return
        if self.top is not None and v > self.top:
            if self.records == 0:
                self.base, self.low = self.top, v
            self.records += 1
            self.low = min(self.low, v)
        else:
            self.records = 0
        self.top = v if self.top is None else max(self.top, v)
        self.seen += 1
        # a climb beginning at the next value would start past the first EARLY_RECORDS
        self.over = self.records == 0 and self.seen >= EARLY_RECORDS

    @property
    def early(self) -> bool:
        """The current climb began within the run's first `EARLY_RECORDS` records."""
        return self.records > 0 and self.seen - self.records < EARLY_RECORDS

    def ratio(self, v: float) -> float:
        """`v` over the highest value before the climb."""
        return v / self.base if self.base > 0 else float("inf")
