"""The loss held far above where it started."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core import maths as F
from ..._core.text import fmt_num
from ..._core.types import AlertKind, Finding, Severity, StepRecord
from ..._policy.sections import DivergencePolicy
from .climb import Climb
from .trend import StartLevel

if TYPE_CHECKING:
    from ..quiet import QuietPlan

__all__ = ["DivergenceDetector", "CLIMB_RECORDS", "CLIMB_FACTOR", "JUMP_FACTOR"]

#: A run's first records (a climb that began within `EARLY_RECORDS`), judged without a window:
#: a warning when `CLIMB_RECORDS` records in a row each stand above every earlier loss and the
#: last is `CLIMB_FACTOR` x the highest loss before them (a CE loss up 75% over 5 records into
#: NaN), or when two records in a row each stand `JUMP_FACTOR` x above every earlier loss (one
#: hard batch doubles a fine-tune's first loss and is gone the next record: two in a row are a
#: climb). A falling or wobbling start has no such run of new highs.
CLIMB_RECORDS = 4
CLIMB_FACTOR = 1.5
JUMP_FACTOR = 2.0


class DivergenceDetector:
    """The median of the last ``patience`` finite losses far above the starting level, or (a
    warning) several times above the best loss the run has reached.

    A median, not "every record": a run bouncing between 20 and 200 from a start of 4 is
    diverged even when single records dip below the factor, and a spike of one or two records
    that recovers moves it not at all. The second rule catches a run that had learned and lost
    it (a LoRA loss 1.4 -> 6.4 -> 4.6..5.5, only 3x its start), judged against a best that
    came before most of the held records (not the low end of a fall still under way). Both
    warnings are judged against the loss's own noise too: the starting level and the best are
    the lowest of several noisy medians, and the lowest of many noisy records is no level to
    hold a run to. Shared value: ``level``.
    """

    section = "divergence"
    kinds = (AlertKind.DIVERGENCE,)
    needs = ("level",)

    def __init__(self, p: DivergencePolicy, level: StartLevel) -> None:
        self._p = p
        self._level = level
        self._recent: deque[float] = deque(maxlen=p.patience)
        self._smooth: deque[float] = deque(maxlen=p.rebound_smoothing)
        # smoothed medians not yet old enough to be the best: the held median must be of records
        # mostly after the best (else a fall still under way reads as a rebound above its low end)
        self._young: deque[float] = deque()
        self._best: float | None = None  # lowest median of `rebound_smoothing` consecutive losses, before the held ones
        self._steps: deque[float] = deque(maxlen=p.noise_records)  # |change of ln loss| per record
        self._last: float | None = None
        self._candidates = 0  # smoothed medians the best is the lowest of
        self._climb = Climb()  # the loss's run of new highs at the start
        # (highest loss before the climb, the factor crossed, peak, records, losses seen) once warned
        self._climbed: tuple[float, float, float, int, int] | None = None

    def update(self, rec: StepRecord) -> list[Finding]:
        base = self._level.observe(rec)
        if not F.is_finite(rec.loss):
            return []
        loss = float(rec.loss)
        start = self._climbed is not None or not self._climb.over  # the start's rules still judge
        if start:
            self._climb.add(loss)
        held = self._held(base, loss)
        if held:
            return held
        climb = self._early_climb(loss) if start else None
        return [climb] if climb is not None else []

    def quiet(self, plan: QuietPlan) -> bool:
        """Past the start's climb rule and with the starting level settled, no rule fires while
        every loss held (the window's and the band's) stays under the lowest bar: `warning_factor`
        and `critical_factor` x the start, `rebound_factor` x the lowest best the loss can reach
        by then (the best, the medians waiting to become it, the window's losses, the band's
        lower end). The held median is at most their largest."""
        lo = plan.lo("loss")
        base = self._level.value
        if self._climbed is not None or not self._climb.over or not self._level.complete or lo is None:
            return False
        if base is None or base <= 0:
            return True  # `_held` judges nothing without a starting level
        p = self._p
        low = min([lo, *self._young, *self._smooth, *([] if self._best is None else [self._best])])
        bar = min(p.warning_factor * base, p.critical_factor * base, p.rebound_factor * low)
        if self._recent and max(self._recent) >= bar:
            return False
        plan.cap("loss", bar)
        return True

    def absorb(self, records: Sequence[StepRecord]) -> None:
        """Book records `quiet` promised silence on, as `_held` would."""
        for rec in records:
            self._book(float(rec.loss))  # type: ignore[arg-type]

    def _book(self, loss: float) -> None:
        """Add a finite loss to the held window, the noise and the candidates for the best."""
        self._recent.append(loss)
        self._smooth.append(loss)
        if self._last is not None and self._last > 0 and loss > 0:
            self._steps.append(abs(math.log(loss) - math.log(self._last)))  # (a ratio can under- or overflow)
        self._last = loss
        if len(self._smooth) == self._smooth.maxlen:
            self._young.append(F.median(self._smooth))
        while len(self._young) > (self._p.patience + 1) // 2:  # the held median's majority comes after it
            m = self._young.popleft()
            self._best = m if self._best is None else min(self._best, m)
            self._candidates += 1

    def _held(self, base: float | None, loss: float) -> list[Finding]:
        """The held median far above the starting level (or, a warning, far above the best)."""
        self._book(loss)
        if base is None or base <= 0 or len(self._recent) < self._p.patience:
            return []
        held = F.median(self._recent)
        ratio = held / base
        # the starting level is the lowest of nested running medians: counted as one noisy median
        warn = ratio >= self._p.warning_factor and math.log(ratio) >= self._noise_floor(1)
        if ratio >= self._p.critical_factor:
            sev, thr = Severity.CRITICAL, self._p.critical_factor
        elif warn:
            sev, thr = Severity.WARNING, self._p.warning_factor
        else:
            return self._rebound(held, base, loss)
        return [
            Finding(
                AlertKind.DIVERGENCE,
                sev,
                "loss",
                loss,
                base * thr,
                f"loss has held around {fmt_num(held)} (median of the last {self._p.patience} records), "
                f"{ratio:.3g}x its starting level {fmt_num(base)}",
                details={"ratio": ratio, "baseline": base},
            )
        ]

    def _early_climb(self, loss: float) -> Finding | None:
        """Warning: at the start of a run, a climb of new highs (see `CLIMB_RECORDS`); it holds
        while the loss stays at or above the level it crossed."""
        c = self._climb
        if c.early and c.records >= 2:
            if c.records >= CLIMB_RECORDS and c.ratio(loss) >= CLIMB_FACTOR:
                self._climbed = (c.base, CLIMB_FACTOR, loss, c.records, c.seen)
            elif c.low >= JUMP_FACTOR * c.base:
                self._climbed = (c.base, JUMP_FACTOR, loss, c.records, c.seen)
        if self._climbed is None:
            return None
        base, thr, peak, records, seen = self._climbed
        if loss < base * thr:
            self._climbed = None
            return None
        if loss > peak:  # still climbing: a new high
            if c.base == base:
                records, seen = c.records, c.seen
            peak = loss
            self._climbed = (base, thr, peak, records, seen)
        return Finding(
            AlertKind.DIVERGENCE,
            Severity.WARNING,
            "loss",
            loss,
            base * thr,
            f"loss climbed {records} records in a row within its first {seen}, each above every earlier one, "
            f"to {fmt_num(peak)}, and stands at {fmt_num(loss)}: {loss / base:.3g}x the highest before the climb "
            f"({fmt_num(base)}); a start too short for a window",
            details={"ratio": loss / base, "baseline": base, "records": records, "peak": peak, "rule": "early_climb"},
        )

    def _noise(self) -> float:
        """The loss's typical change from one record to the next (median |change of ln loss|)."""
        return F.median(self._steps) if self._steps else 0.0

    def _noise_floor(self, n: int, noise: float | None = None) -> float:
        """The rise (ln units) a held loss must stand above the lowest of `n` noisy medians: they
        lie about sigma * sqrt(2 ln n) below their level (the expected maximum of n Gaussians)."""
        noise = self._noise() if noise is None else noise
        return self._p.noise_multiple * noise * math.sqrt(2 * math.log(n + 1))

    def _rebound(self, held: float, base: float, loss: float) -> list[Finding]:
        """Warning: the held loss stands ``rebound_factor`` x above the best it reached, and is
        not noise near zero (at least ``rebound_min_level`` of the starting level)."""
        p, best = self._p, self._best
        if best is None or best <= 0 or held < p.rebound_min_level * base:
            return []
        log_ratio = math.log(held) - math.log(best)  # (held / best can overflow)
        ratio = math.exp(min(log_ratio, 700.0))
        if ratio < p.rebound_factor:
            return []
        noise = self._noise()
        if log_ratio < self._noise_floor(self._candidates, noise):
            return []
        return [
            Finding(
                AlertKind.DIVERGENCE,
                Severity.WARNING,
                "loss",
                loss,
                best * p.rebound_factor,
                f"loss has held around {fmt_num(held)} (median of the last {p.patience} records), "
                f"{ratio:.3g}x the best {fmt_num(best)} it had reached: the run is losing what it learned",
                details={"ratio": ratio, "best": best, "baseline": base, "rule": "rebound", "noise": noise},
            )
        ]
