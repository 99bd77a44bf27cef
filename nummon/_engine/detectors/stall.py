"""No meaningful improvement while the loss is still high: a flat trend window, a frozen loss, or
a loss stuck at a classifier's chance level."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core import maths as F
from ..._core.text import fmt_num
from ..._core.types import AlertKind, Finding, Severity, StepRecord
from ..._policy.sections import StallPolicy
from .trend import LossTrend, StartLevel, improvement_needed

if TYPE_CHECKING:
    from ..quiet import QuietPlan

__all__ = ["StallDetector", "CHANCE_CLASSES", "chance_classes"]

#: Class counts whose chance loss ln k a pinned loss is matched against when the policy does not
#: name one: small k only, because ln k for larger k lie so close together that almost any loss
#: would sit near one of them.
CHANCE_CLASSES = range(2, 11)
#: A loss that came down to ln 2 and stays there is a binary classifier predicting its prior, even
#: in a short run: ln 2 is the only ln k judged without the class count. The ln k of larger k lie
#: among ordinary converged losses (a healthy Whisper fine-tune sits within 1% of ln 3 for 22
#: records in the real-log set, a T5 within 1% of ln 6 for 15), and ln 2 only counts for a run that
#: started within 2 ln 2 (a from-scratch classifier's first losses; a language model coming down
#: from 2+ to 0.69 has learned).
BINARY_START = (1.05, 2.0)  # the first loss, in units of ln 2: it came down, from a classifier's start


def chance_classes(loss: float, match: float) -> int | None:
    """The k in CHANCE_CLASSES whose ln k lies within `match` (relative) of `loss`, if any."""
    for k in CHANCE_CLASSES:
        if abs(loss - math.log(k)) <= match * math.log(k):
            return k
    return None


class StallDetector:
    """Three ways a run can be stalled, each a warning of kind ``stall``:

    * the trend window shows no improvement while the loss is high and not bouncing;
    * the loss has not moved at all for ``frozen_records`` records while still high: however
      short the run is in steps, a loss printed as 0.6931 twenty times in a row is not learning;
      within ``chance_match`` of ln k (the chance level of a k-class classifier) for as many
      records spanning at least a trend window (``trend.min_span`` steps) is a stall too;
    * with ``chance_loss`` set: the recent losses sit at that chance level and are not falling.

    Shared values: ``trend`` (the loss-trend window, also read by oscillation) and ``level``
    (the starting level, for "still high").
    """

    section = "stall"
    kinds = (AlertKind.STALL,)
    needs = ("trend", "level")

    def __init__(self, p: StallPolicy, trend: LossTrend, level: StartLevel) -> None:
        self._p = p
        self._trend = trend
        self._level = level
        self._recent: deque[float] = deque(maxlen=max(p.frozen_records, p.chance_records, p.min_records))
        # the current stretch of losses pinned within chance_match of ln k: k, first step, records
        self._pinned_k: int | None = None
        self._pinned_since = 0
        self._pinned_records = 0
        self._finite = 0  # finite losses seen
        self._first_loss: float | None = None

    def update(self, rec: StepRecord) -> list[Finding]:
        t = self._trend.observe(rec)
        base = self._level.observe(rec)
        if not F.is_finite(rec.loss):  # a record without a loss says nothing about the trend
            return []
        self._recent.append(float(rec.loss))
        self._track_pinned(rec.step, float(rec.loss))
        self._finite += 1
        if self._first_loss is None:
            self._first_loss = float(rec.loss)
        found = self._frozen(base, rec.step) or self._at_chance() or self._stuck_at_ln2()
        if found is not None:
            return [found]
        p = self._p
        if t is None or t.records < p.min_records:
            return []
        need = improvement_needed(p.min_improvement, t.expected, p.min_improvement_floor)
        if t.change > -need and t.level >= p.high_fraction and t.spread < p.max_spread:
            return [
                Finding(
                    AlertKind.STALL,
                    Severity.WARNING,
                    "loss",
                    rec.loss,
                    need,
                    f"loss improved {max(-t.change, 0) * 100:.1f}% over the last {t.span} steps "
                    f"(< {need * 100:.2g}%) and is still at {t.level * 100:.0f}% of its starting level {fmt_num(base)}",
                    details={"change": t.change, "spread": t.spread, "level": t.level, "span": t.span},
                )
            ]
        return []

    def quiet(self, plan: QuietPlan) -> bool:
        """Silent while the trend holds its numbers (judged quiet at the last record), while the
        losses that stay in every `frozen_records` window still move more than
        `frozen_tolerance`, and while no stretch at ln 2 can reach `min_records`. With
        `chance_loss` set every record is judged."""
        p = self._p
        end = self._trend.held_until(plan.step)
        if p.chance_loss is not None or end is None or self._first_loss is None:
            return False
        plan.cap_step(end)
        first, ln2 = self._first_loss, math.log(2)
        if BINARY_START[0] * ln2 <= first <= BINARY_START[1] * ln2:  # a binary classifier's start
            plan.cap_records(p.min_records - 1 - (self._pinned_records if self._pinned_k == 2 else 0))
        n, band = p.frozen_records, plan.bands["loss"]
        if band is None:
            return False
        # a loss under the bar a frozen one must stand above (frozen_high_fraction of its start)
        # in every window of the records to come, old and new: no window is frozen, however long
        base, old = self._level.value, list(self._recent)[-(n - 1) :]
        if base is not None and max([band[1], *old]) < p.frozen_high_fraction * base * (1 - 1e-9):
            return True
        # every window of `n` losses that ends at a record of the region must move by more than
        # the tolerance x the highest median it can hold (its values are the last losses and the
        # region's, all under the band's top): no window is frozen however long the region lasts
        top = max([band[1], *old])
        plan.moving("loss", n, p.frozen_tolerance * top * (1 + 1e-9), old)
        return True

    def absorb(self, records: Sequence[StepRecord]) -> None:
        """Book records `quiet` promised silence on (their losses are finite)."""
        for rec in records:
            loss = float(rec.loss)  # type: ignore[arg-type]
            self._recent.append(loss)
            self._track_pinned(rec.step, loss)
        self._finite += len(records)

    def _track_pinned(self, step: int, loss: float) -> None:
        """Follow the current stretch of losses all within ``chance_match`` of one ln k."""
        match = self._p.chance_match
        k = self._pinned_k
        if k is not None and abs(loss - math.log(k)) <= match * math.log(k):
            self._pinned_records += 1
            return
        self._pinned_k = chance_classes(loss, match)
        self._pinned_since, self._pinned_records = step, 1

    def _frozen(self, base: float | None, step: int) -> Finding | None:
        """The last ``frozen_records`` losses have not moved while still high; "at chance" is said
        only when the frozen loss sits on ln k itself."""
        p = self._p
        n = p.frozen_records
        if len(self._recent) < n or base is None or base <= 0:
            return None
        last = list(self._recent)[-n:]
        held = F.median(last)
        if held <= 0 or held < p.frozen_high_fraction * base:
            return None  # near zero or far below the start: converged, whatever the rounding
        spread = (max(last) - min(last)) / held
        if held < p.high_fraction * base and max(map(F.printed_unit, last)) > p.frozen_tolerance * held:
            # a run that came down, now printed too coarsely to show a movement (0.0057 with 4
            # decimals: 1.8% a unit): converging at its print's floor. (One that never left its
            # start, 3.7 printed twelve times, is frozen however it is printed.)
            return None
        if spread > p.frozen_tolerance:
            # moving, even if within 1% of some ln k: near 1.79 a seq2seq token loss is not "a
            # 6-class classifier at chance". The class count is not known here (stall.chance_loss
            # names it: _at_chance); only a loss frozen exactly says anything whatever its value
            return None
        k = self._pinned_k
        if k is None or self._pinned_records < n or not self._near_ln_k(held, k):
            k = None  # frozen, but not on ln k: say frozen, not "at chance"
        records = max(n, self._pinned_records) if k is not None else n
        why = f"loss has stayed at {fmt_num(held)} for {records} records (spread of the last {n}: {spread * 100:.2g}%)"
        if k is not None:
            why += f": ln {k} = {math.log(k):.4f}, the chance level of a {k}-class classifier (it predicts the same for every input)"
        else:
            why += ": the model no longer changes its output (saturated or dead units, a zero learning rate, a detached loss)"
        return Finding(
            AlertKind.STALL,
            Severity.WARNING,
            "loss",
            held,
            p.frozen_tolerance,
            why,
            details={"frozen_records": n, "spread": spread, "level": held / base, "chance_classes": k},
        )

    def _near_ln_k(self, held: float, k: int) -> bool:
        """The held loss is ln k to the precision of a frozen loss (the class count is not
        known: only a loss sitting exactly on ln k says "chance level")."""
        return abs(held - math.log(k)) <= max(self._p.frozen_tolerance, 1e-4) * 2 * math.log(k)

    def _stuck_at_ln2(self) -> Finding | None:
        """A run that came down from a binary classifier's start to ln 2 and has stayed within
        ``chance_match`` of it for ``min_records`` records, not falling: stuck at chance, however
        few steps that is (a per-step trace of 21 batches is as telling as one of 21 epochs)."""
        p, ln2 = self._p, math.log(2)
        n = p.min_records
        first = self._first_loss
        if (
            self._pinned_k != 2
            or self._pinned_records < n
            or first is None
            or not BINARY_START[0] * ln2 <= first <= BINARY_START[1] * ln2
        ):
            return None
        last = list(self._recent)[-n:] if len(self._recent) >= n else None
        if last is None:
            return None
        half = n // 2
        if F.relative_change(last[:half], last[half:]) <= -p.chance_match / 2:
            return None  # still creeping down through ln 2: leaving it
        held = F.median(last)
        return Finding(
            AlertKind.STALL,
            Severity.WARNING,
            "loss",
            held,
            ln2,
            f"loss came down from {fmt_num(first)} to {fmt_num(held)} and has stayed within "
            f"{p.chance_match * 100:.2g}% of ln 2 = {ln2:.4f} for {self._pinned_records} records: the chance level "
            "of a binary classifier (it predicts the class prior for every input); set stall.chance_loss if the task "
            "has more classes",
            details={"chance_classes": 2, "records": self._pinned_records, "first_loss": first},
        )

    def _at_chance(self) -> Finding | None:
        """With ``chance_loss`` set: the recent losses at chance and not falling."""
        p = self._p
        chance, n = p.chance_loss, p.chance_records
        if chance is None or len(self._recent) < n or self._finite < max(self._trend.min_records, n + 1):
            return None
        last = list(self._recent)[-n:]
        held = F.median(last)
        if abs(held - chance) > p.chance_tolerance * chance:
            return None
        half = n // 2
        if F.relative_change(last[:half], last[half:]) <= -p.min_improvement:
            return None  # at chance but falling: it is leaving it
        return Finding(
            AlertKind.STALL,
            Severity.WARNING,
            "loss",
            held,
            chance,
            f"loss has held around {fmt_num(held)} for {n} records, the chance level {fmt_num(chance)} "
            f"(stall.chance_loss), without falling: the model predicts no better than a guess",
            details={"chance_loss": chance, "records": n, "level": held / chance},
        )
