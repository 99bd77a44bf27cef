"""Sudden jumps against the run's own recent history: loss spikes and gradient explosions."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core import maths as F
from ..._core.text import fmt_num
from ..._core.types import AlertKind, Finding, Severity, StepRecord
from ..._policy.sections import SpikePolicy
from .climb import Climb

if TYPE_CHECKING:
    from ..quiet import QuietPlan

__all__ = [
    "SpikeDetector",
    "LOSS_MIN_FACTOR",
    "LOSS_NOISE_FLOOR",
    "NOISE_MULTIPLE",
    "GRAD_CLIMB_RECORDS",
    "LOSS_CLIMB_FACTOR",
]

#: The smallest jump of a smooth loss that is a spike (ratio to its recent median), and how many
#: of its robust standard deviations (log10) a jump must exceed to count below `loss_factor`.
LOSS_MIN_FACTOR = 2.0
NOISE_MULTIPLE = 8.0
#: ... and, once `NOISE_FLOOR_RECORDS` losses have measured the noise, down to this factor where the
#: jump is `NOISE_MULTIPLE` of the loss's own sigmas (an LM pretraining loss near 3.8 nats, 1-2%
#: noise, that jumps 1.9x in one record is 40 of them). The healthy tuning logs' largest such jump
#: is 1.39x (at 14 sigmas); the largest at 1.5x or more stands 5.4 sigmas.
LOSS_NOISE_FLOOR = 1.6
NOISE_FLOOR_RECORDS = 20
#: While the history is short the factors are raised (a baseline of a few records is uncertain),
#: unless the gradient norm bears the loss out: a smooth loss (at least `SHORT_RUN` records) that
#: doubles while grad_norm stands `grad_factor` x its level or more at that record or within the
#: `GRAD_WITNESS_RECORDS` before it is a spike however short the history (a large model's
#: pretraining stretch: 3.3, 3.4, 3.7, 7.3 with the grad norm 15x up).
SHORT_RUN = 3
GRAD_WITNESS_RECORDS = 3
#: At a run's start (a climb that began within `climb.EARLY_RECORDS` records) the gradient norm
#: climbing this many records in a row, each above every earlier one, to `grad_factor` x the
#: highest before, while the loss stands at a new high `LOSS_CLIMB_FACTOR` x its highest before
#: its own climb, is an explosion (a LoRA fine-tune: 0.27 -> 17-23 over six records while the
#: loss doubles). A warm-up's gradient norm climbs too, but under a falling loss.
GRAD_CLIMB_RECORDS = 3
LOSS_CLIMB_FACTOR = 1.5


class SpikeDetector:
    """A sudden upward jump against the run's own recent history, in log space (scale-free).

    History holds only finite positive values, so NaN/Inf never poison the baseline; a median
    over the window is not moved by one spike either.
    """

    section = "spike"
    kinds = (AlertKind.LOSS_SPIKE, AlertKind.EXPLOSION)
    needs = ()
    LOSS_METRICS = ("loss",)
    # not grad_max: the largest single gradient element jumps 10x in healthy runs (one hard
    # sample); it stays watched for sustained growth (runaway) and headroom
    GRAD_METRICS = ("grad_norm", "optim_state_norm", "activation_max")

    def __init__(self, p: SpikePolicy) -> None:
        self._p = p
        self._hist: dict[str, deque[float]] = {m: deque(maxlen=p.window) for m in self.LOSS_METRICS + self.GRAD_METRICS}
        # grad_norm / its recent median at the last records (1.0 where not measured)
        self._grad_ratios: deque[float] = deque(maxlen=GRAD_WITNESS_RECORDS + 1)
        self._climbs = {"loss": Climb(), "grad_norm": Climb()}  # runs of new highs at the start
        # (grad norm's and loss's highest before their climbs, records, values seen) once warned
        self._grad_climbed: tuple[float, float, int, int] | None = None

    def _grad_witness(self, rec: StepRecord) -> float:
        """The largest grad_norm / its recent median over this record and the few before it."""
        v, hist = rec.grad_norm, self._hist["grad_norm"]
        ratio = 1.0
        if F.is_finite(v) and v > 0 and hist:
            lv = F.log10_safe(v)
            if lv - min(hist) >= math.log10(self._p.grad_factor):  # (cheap: else under grad_factor)
                ratio = F.pow10(lv - F.median(hist))
        self._grad_ratios.append(ratio)
        return max(self._grad_ratios)

    def update(self, rec: StepRecord) -> list[Finding]:
        witness = self._grad_witness(rec)
        # the start's rule still judges (a climb of the gradient norm can still be early, or one holds)
        start = self._grad_climbed is not None or not self._climbs["grad_norm"].over
        if start:
            self._climbs["loss"].add(rec.loss)
            self._climbs["grad_norm"].add(rec.grad_norm)
        out: list[Finding] = []
        for metric, hist in self._hist.items():
            v = getattr(rec, metric)
            if not F.is_finite(v) or v <= 0:
                continue
            found = self._jump(metric, hist, float(v), witness)
            if found is None and start and metric == "grad_norm":
                found = self._grad_climb(float(v), rec.loss)
            if found is not None:
                out.append(found)
            hist.append(F.log10_safe(v))
        return out

    def quiet(self, plan: QuietPlan) -> bool:
        """Past the start's climb rules, no jump can be found while each value stays under its
        floor (the smallest `_jump` ever uses) x the lowest value its window can then hold (the
        window's lowest, or the band's lower end, raised where it binds): `_jump`'s pre-check then
        returns at once, and the gradient witness stays 1."""
        if self._grad_climbed is not None or not self._climbs["grad_norm"].over:
            return False
        p = self._p
        for metric, hist in self._hist.items():
            lo = plan.lo(metric)
            if lo is None:
                continue
            if metric in self.LOSS_METRICS:
                floor = min(
                    p.loss_factor, p.loss_factor * p.short_history_multiplier, LOSS_MIN_FACTOR, LOSS_NOISE_FLOOR
                )
            else:
                floor = min(p.grad_factor, p.grad_factor * p.short_history_multiplier)
            lowest = F.pow10(min(hist)) if hist else math.inf  # the window's lowest value
            level, top = plan.level.get(metric), plan.bands[metric][1]  # type: ignore[index]
            if level is not None and lo < lowest and floor * lo < top:
                # the band's lower end binds the top (its records may become the window's lowest):
                # raised toward level / sqrt(floor), the top lies as far above the level as the
                # lower end below it (a smooth loss's band about [0.79, 1.26] x its level, not [0.71, 1.14])
                lo = max(lo, min(lowest, level / math.sqrt(floor), top / floor))
                plan.floor(metric, lo)
            plan.cap(metric, floor * min(lowest, lo))
        return True

    def absorb(self, records: Sequence[StepRecord]) -> None:
        """Book records `quiet` promised silence on: each value into its window, a witness of 1."""
        ratios, hists, isfinite, log10 = self._grad_ratios, self._hist.items(), F.is_finite, F.log10_safe
        for rec in records:
            ratios.append(1.0)
            d = rec.__dict__
            for metric, hist in hists:
                v = d[metric]
                if isfinite(v) and v > 0:
                    hist.append(log10(v))

    def _jump(self, metric: str, hist: deque[float], v: float, witness: float) -> Finding | None:
        """`v` jumped far above the metric's recent median (its own noise, a short history's raised factor)."""
        p = self._p
        is_loss = metric in self.LOSS_METRICS
        factor = p.loss_factor if is_loss else p.grad_factor
        short = len(hist) < p.short_history
        borne_out = is_loss and short and len(hist) >= SHORT_RUN and witness >= p.grad_factor
        if borne_out:
            factor = min(factor, LOSS_MIN_FACTOR)
        elif short:
            factor *= p.short_history_multiplier
        lv = F.log10_safe(v)
        # the loss's threshold scales with its own noise: a smooth loss that doubles has
        # spiked (a large model's 2.2 -> 5), a noisy one needs up to `loss_factor`
        floor = (
            factor
            if short or not is_loss
            else min(factor, LOSS_NOISE_FLOOR if len(hist) >= NOISE_FLOOR_RECORDS else LOSS_MIN_FACTOR)
        )
        # cheap pre-check: below floor x the smallest recent value it cannot be a jump
        if len(hist) < p.min_history or lv - min(hist) < math.log10(floor):
            return None
        up, m_log, sigma = F.jump_decades(v, hist)
        need = max(math.log10(factor), p.robust_z * sigma)
        if is_loss and not short:
            need = max(min(need, max(math.log10(floor), NOISE_MULTIPLE * sigma)), p.robust_z * sigma)
        if borne_out:  # only a smooth run's doubling: `NOISE_MULTIPLE` of its own sigmas
            need = max(math.log10(LOSS_MIN_FACTOR), NOISE_MULTIPLE * sigma)
        if up < need:
            return None
        base = F.pow10(m_log)
        why = ""
        if is_loss and not short and F.pow10(up) < LOSS_MIN_FACTOR:  # under 2x: the noise says it
            why = (
                f", {up / sigma:.3g} times its recent noise (1.4826 MAD of log10 loss: {sigma:.3g})"
                if sigma > 0
                else ", on a loss that had not varied at all"
            )
        if borne_out:
            why = (
                f", with grad_norm {witness:.3g}x its level within the last {GRAD_WITNESS_RECORDS} "
                f"records (a short history, {len(hist)} records, borne out by the gradients)"
            )
        return Finding(
            AlertKind.LOSS_SPIKE if is_loss else AlertKind.EXPLOSION,
            Severity.WARNING,
            metric,
            v,
            base * F.pow10(need),
            f"{metric} jumped to {fmt_num(v)}, {F.pow10(up):.3g}x its recent median {fmt_num(base)}{why}",
            details={
                "ratio": F.pow10(up),
                "baseline": base,
                **({"grad_ratio": witness, "rule": "short_history_grad"} if borne_out else {}),
            },
        )

    def _grad_climb(self, v: float, loss: float | None) -> Finding | None:
        """At the start of a run, the gradient norm climbing `GRAD_CLIMB_RECORDS` records in a row
        to `grad_factor` x its highest earlier value while the loss, too, stands at a new high
        `LOSS_CLIMB_FACTOR` x its highest before its climb; held while both stay that high (the
        climb's own values lift a median: the jump rule sees 8x where the start was 60x lower)."""
        g, lc = self._climbs["grad_norm"], self._climbs["loss"]
        if g.early and g.records >= GRAD_CLIMB_RECORDS and lc.records > 0:
            if v >= self._p.grad_factor * g.base and F.is_finite(loss) and loss >= LOSS_CLIMB_FACTOR * lc.base:
                self._grad_climbed = (g.base, lc.base, g.records, g.seen)
        if self._grad_climbed is None:
            return None
        base, lbase, records, seen = self._grad_climbed
        if not (v >= self._p.grad_factor * base and F.is_finite(loss) and loss >= LOSS_CLIMB_FACTOR * lbase):
            self._grad_climbed = None
            return None
        assert loss is not None  # (finite, checked above)
        if g.records > records and g.base == base:  # still climbing
            records, seen = g.records, g.seen
            self._grad_climbed = (base, lbase, records, seen)
        return Finding(
            AlertKind.EXPLOSION,
            Severity.WARNING,
            "grad_norm",
            v,
            base * self._p.grad_factor,
            f"grad_norm climbed {records} records in a row within its first {seen}, each above every earlier one, "
            f"and stands at {fmt_num(v)}: {v / base:.3g}x the highest before the climb ({fmt_num(base)}), while the "
            f"loss stands {loss / lbase:.3g}x its highest before its own climb ({fmt_num(lbase)}); a start too "
            f"short for a window",
            details={"ratio": v / base, "baseline": base, "loss_ratio": loss / lbase, "rule": "early_climb"},
        )
