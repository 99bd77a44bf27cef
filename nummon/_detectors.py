"""Detectors: small, pure units over host-side step records (no torch).

Each detector holds only the state it needs, takes one `StepRecord` per step and returns the
`Finding`s active at that step. Deduplication, cooldown and routing are the lifecycle's and the
monitor's business, not a detector's.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Protocol, Sequence

from . import _functional as F
from ._policy import Policy
from ._types import AlertKind, Finding, Severity, StepRecord

__all__ = [
    "Detector",
    "NonfiniteDetector",
    "SpikeDetector",
    "RunawayDetector",
    "HeadroomDetector",
    "DivergenceDetector",
    "StallDetector",
    "OscillationDetector",
    "VanishingDetector",
    "build_detectors",
]

#: Magnitude statistics: where runaway growth and dtype overflow show first.
MAGNITUDE_FIELDS = ("loss", "grad_norm", "grad_max", "param_norm", "optim_state_norm", "activation_max")


class Detector(Protocol):
    kind: AlertKind

    def update(self, rec: StepRecord) -> list[Finding]:
        """Findings active at this step."""
        ...


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"


class NonfiniteDetector:
    """Critical on the first NaN/Inf anywhere; keeps the first location while the condition holds."""

    kind = AlertKind.NONFINITE

    def __init__(self, policy: Policy) -> None:
        self._first: tuple[str, str] | None = None  # (metric, location) of the first non-finite step

    def update(self, rec: StepRecord) -> list[Finding]:
        out: list[Finding] = []
        if rec.scaler_skipped:
            # dynamic loss scaling calibrates by overflowing: the weights were protected
            out.append(
                Finding(
                    self.kind,
                    Severity.INFO,
                    "scaled_gradients",
                    None,
                    None,
                    "scaled gradients overflowed and the GradScaler skipped this step (loss scale lowered)",
                    location="GradScaler",
                )
            )
        if rec.input_nonfinite:
            out.append(
                Finding(
                    self.kind,
                    Severity.CRITICAL,
                    "input",
                    float(rec.input_nonfinite),
                    0.0,
                    f"{rec.input_nonfinite} non-finite values in the input batch (a data problem, not the model)",
                    location="input batch",
                )
            )
        parts = list(rec.nonfinite_parts)
        if not parts and not rec.is_finite():  # records from traces carry no parts: find them
            parts = [k for k, v in rec.scalars().items() if not math.isfinite(v)]
            parts += [f"grad of {k}" for k, v in rec.layer_grad_norms.items() if not math.isfinite(v)][:3]
        if not parts:
            self._first = None
            return out
        if self._first is None:
            metric = parts[0] if not rec.nonfinite_parts else rec.nonfinite_parts[0]
            location = rec.nonfinite_location or metric
            self._first = (metric, location)
        metric, location = self._first
        count = f" ({rec.nonfinite_count} values)" if rec.nonfinite_count else ""
        where = f"first non-finite tensor: {location}"
        if rec.rank is not None:
            where = f"first non-finite: rank {rec.rank}, {location}"
        out.append(
            Finding(
                self.kind,
                Severity.CRITICAL,
                "nonfinite",
                float(rec.nonfinite_count or len(parts)),
                0.0,
                f"non-finite values in {', '.join(dict.fromkeys(parts))}{count}; {where}",
                location=location,
                details={"parts": list(dict.fromkeys(parts))},
            )
        )
        return out


class SpikeDetector:
    """A sudden upward jump against the run's own recent history, in log space (scale-free).

    History holds only finite positive values, so NaN/Inf never poison the baseline; a median
    over the window is not moved by one spike either.
    """

    kind = AlertKind.EXPLOSION
    LOSS_METRICS = ("loss",)
    # not grad_max: the largest single gradient element jumps 10x in healthy runs (one hard
    # sample); it stays watched for sustained growth (runaway) and headroom
    GRAD_METRICS = ("grad_norm", "optim_state_norm", "activation_max")

    def __init__(self, policy: Policy) -> None:
        p = policy.spike
        self._p = p
        self._hist: dict[str, deque[float]] = {
            m: deque(maxlen=p.window) for m in self.LOSS_METRICS + self.GRAD_METRICS
        }

    def update(self, rec: StepRecord) -> list[Finding]:
        out: list[Finding] = []
        for metric, hist in self._hist.items():
            v = getattr(rec, metric)
            if not F.is_finite(v) or v <= 0:
                continue
            is_loss = metric in self.LOSS_METRICS
            factor = self._p.loss_factor if is_loss else self._p.grad_factor
            if len(hist) < self._p.short_history:
                factor *= self._p.short_history_multiplier
            lv = F.log10_safe(v)
            # cheap pre-check: below factor x the smallest recent value it cannot be a jump
            if len(hist) >= self._p.min_history and lv - min(hist) >= math.log10(factor):
                up, m_log, sigma = F.jump_decades(v, hist)
                need = max(math.log10(factor), self._p.robust_z * sigma)
                if up >= need:
                    base = F.pow10(m_log)
                    kind = AlertKind.LOSS_SPIKE if is_loss else AlertKind.EXPLOSION
                    out.append(
                        Finding(
                            kind,
                            Severity.WARNING,
                            metric,
                            v,
                            base * F.pow10(need),
                            f"{metric} jumped to {_fmt(v)}, {F.pow10(up):.3g}x its recent median {_fmt(base)}",
                            details={"ratio": F.pow10(up), "baseline": base},
                        )
                    )
            hist.append(lv)
        return out


class RunawayDetector:
    """Sustained geometric growth over consecutive records, with steps left until overflow."""

    kind = AlertKind.RUNAWAY

    def __init__(self, policy: Policy) -> None:
        self._p = policy.runaway
        self._short = (policy.spike.short_history, policy.spike.short_history_multiplier)
        self._dtype = policy.headroom.default_dtype
        # per metric: (last step, last value, streak length, streak start step, streak start value)
        self._state: dict[str, tuple[int, float, int, int, float]] = {}
        self._records: dict[str, int] = {}  # growth records in the current streak
        self._hist: dict[str, deque[float]] = {m: deque(maxlen=policy.spike.window) for m in self._p.metrics}

    def update(self, rec: StepRecord) -> list[Finding]:
        out: list[Finding] = []
        p = self._p
        for metric in p.metrics:
            v = getattr(rec, metric, None)
            if not F.is_finite(v) or v <= 0:
                if v is not None:
                    self._state.pop(metric, None)  # a NaN ends the streak; the nonfinite detector takes over
                continue
            hist = self._hist[metric]
            prev = self._state.get(metric)
            if prev is None or rec.step <= prev[0]:
                self._state[metric] = (rec.step, v, 0, rec.step, v)
                self._records[metric] = 0
                hist.append(F.log10_safe(v))
                continue
            step0, v0, streak, start_step, start = prev
            if F.growth_per_step(v0, v, rec.step - step0) >= p.min_growth:
                # a streak is counted in steps: one record 5 steps after the last, grown at the
                # minimum rate per step, is 5 steps of sustained growth (logs every N steps)
                streak += rec.step - step0
                self._records[metric] = self._records.get(metric, 0) + 1
            else:
                streak, start_step, start = 0, rec.step, v
                self._records[metric] = 0
            self._state[metric] = (rec.step, v, streak, start_step, start)
            hist.append(F.log10_safe(v))
            if streak == 0:
                continue
            total = v / start
            warn_f, crit_f = p.warning_total_factor, p.critical_total_factor
            if len(hist) < self._short[0]:
                # early in a run (or trace) growth from tiny initial values is normal: demand more
                warn_f, crit_f = warn_f ** self._short[1], crit_f ** self._short[1]
            if streak < p.warning_steps or total < warn_f:
                continue
            # the value must also stand above the metric's recent level (median of earlier samples)
            earlier = list(hist)[:-1]
            above = v / F.pow10(F.median(earlier)) if earlier else math.inf
            severity = None
            # critical needs `critical_steps` growth observations too: with logs every N steps a
            # noise blip followed by one spike would otherwise look sustained
            if streak >= p.critical_steps and self._records[metric] >= p.critical_steps and total >= crit_f and above >= crit_f:
                severity = Severity.CRITICAL
            elif streak >= p.warning_steps and total >= warn_f and above >= warn_f:
                severity = Severity.WARNING
            if severity is None:
                continue
            mean_rate = total ** (1.0 / max(rec.step - start_step, 1))
            left = F.steps_to_overflow(v, mean_rate, F.DTYPE_MAX[self._dtype])
            out.append(
                Finding(
                    self.kind,
                    severity,
                    metric,
                    v,
                    crit_f if severity is Severity.CRITICAL else warn_f,
                    f"{metric} grew {total:.3g}x over {streak} consecutive steps (x{mean_rate:.3g} per step); "
                    f"~{left:.0f} steps left until {self._dtype} overflow at this rate",
                    details={"growth": total, "rate_per_step": mean_rate, "steps_to_overflow": left, "streak": streak},
                )
            )
        return out


class HeadroomDetector:
    """Finite but extreme: few decades left before the dtype overflows."""

    kind = AlertKind.EXTREME

    def __init__(self, policy: Policy) -> None:
        self._p = policy.headroom

    def update(self, rec: StepRecord) -> list[Finding]:
        dtype = rec.headroom_dtype or self._p.default_dtype
        if rec.headroom is not None:
            decades, metric = rec.headroom, "headroom"
        else:
            mags = {k: abs(v) for k in MAGNITUDE_FIELDS if F.is_finite(v := getattr(rec, k))}
            if not mags:
                return []
            metric = max(mags, key=mags.get)
            decades = F.headroom_decades(mags[metric], dtype)
        if not math.isfinite(decades):
            return []  # overflowed already: the nonfinite detector reports it
        crit = self._p.critical_decades.get(dtype)
        warn = self._p.warning_decades.get(dtype)
        if crit is not None and decades < crit:
            sev, thr = Severity.CRITICAL, crit
        elif warn is not None and decades < warn:
            sev, thr = Severity.WARNING, warn
        else:
            return []
        return [
            Finding(
                self.kind,
                sev,
                metric,
                decades,
                thr,
                f"only {decades:.1f} decades of {dtype} headroom left (limit {thr:g})",
                details={"dtype": dtype},
            )
        ]


class _LossBaseline:
    """The run's starting loss level: the median of its first N finite losses."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._first: list[float] = []
        self.value: float | None = None

    def update(self, loss: float | None) -> float | None:
        if self.value is None and F.is_finite(loss):
            self._first.append(float(loss))
            if len(self._first) >= self._n:
                self.value = F.median(self._first)
        return self.value


class DivergenceDetector:
    """The loss held far above its starting level."""

    kind = AlertKind.DIVERGENCE

    def __init__(self, policy: Policy) -> None:
        self._p = policy.divergence
        self._base = _LossBaseline(self._p.baseline_steps)
        self._warn_run = 0
        self._crit_run = 0

    def update(self, rec: StepRecord) -> list[Finding]:
        base = self._base.update(rec.loss)
        if base is None or base <= 0 or not F.is_finite(rec.loss):
            return []
        ratio = rec.loss / base
        self._warn_run = self._warn_run + 1 if ratio >= self._p.warning_factor else 0
        self._crit_run = self._crit_run + 1 if ratio >= self._p.critical_factor else 0
        if self._crit_run >= self._p.patience:
            sev, thr = Severity.CRITICAL, self._p.critical_factor
        elif self._warn_run >= self._p.patience:
            sev, thr = Severity.WARNING, self._p.warning_factor
        else:
            return []
        return [
            Finding(
                self.kind,
                sev,
                "loss",
                rec.loss,
                base * thr,
                f"loss {_fmt(rec.loss)} has stayed above {thr:g}x its starting level {_fmt(base)} for {self._p.patience}+ steps",
                details={"ratio": ratio, "baseline": base},
            )
        ]


class _LossWindow:
    """The last `window` steps of finite losses, with the numbers stall and oscillation judge.

    The window is in steps, not records, so traces logged every N steps are judged over the same
    span. A window-long condition needs no per-step verdict: the numbers are recomputed every
    `window // 20` steps and held in between (this keeps the hot path cheap).
    """

    MIN_RECORDS = 10

    def __init__(self, window: int, baseline_steps: int) -> None:
        self.window = window
        self.values: deque[tuple[int, float]] = deque()
        self.base = _LossBaseline(baseline_steps)
        self.every = max(1, window // 20)
        self._first_step: int | None = None
        self._judged_at: int | None = None
        self._last: tuple[float, float, float] | None = None

    def update(self, step: int, loss: float | None) -> tuple[float, float, float] | None:
        """(relative change across halves, relative spread, level / starting level) once the
        run has lasted `window` steps."""
        base = self.base.update(loss)
        if self._first_step is None:
            self._first_step = step
        if F.is_finite(loss):
            self.values.append((step, float(loss)))
        while self.values and self.values[0][0] <= step - self.window:
            self.values.popleft()
        if base is None or base <= 0 or step - self._first_step < self.window - 1 or len(self.values) < self.MIN_RECORDS:
            return None
        if self._last is not None and self._judged_at is not None and step - self._judged_at < self.every:
            return self._last
        self._judged_at = step
        mid = step - self.window // 2
        first = [v for s, v in self.values if s <= mid]
        second = [v for s, v in self.values if s > mid]
        if not first or not second:
            return None
        w = first + second
        self._last = F.relative_change(first, second), F.relative_spread(w), F.median(second) / base
        return self._last


class StallDetector:
    """No meaningful improvement over a long window while the loss is still high and flat."""

    kind = AlertKind.STALL

    def __init__(self, policy: Policy) -> None:
        self._p = policy.stall
        self._w = _LossWindow(self._p.window, policy.divergence.baseline_steps)

    def update(self, rec: StepRecord) -> list[Finding]:
        got = self._w.update(rec.step, rec.loss)
        if got is None:
            return []
        change, spread, level = got
        p = self._p
        if change > -p.min_improvement and level >= p.high_fraction and spread < p.max_spread:
            return [
                Finding(
                    self.kind,
                    Severity.WARNING,
                    "loss",
                    rec.loss,
                    p.min_improvement,
                    f"loss improved {max(-change, 0) * 100:.1f}% over the last {p.window} steps "
                    f"(< {p.min_improvement * 100:g}%) and is still at {level * 100:.0f}% of its starting level",
                    details={"change": change, "spread": spread, "level": level},
                )
            ]
        return []


class OscillationDetector:
    """Loss bouncing (large relative spread) with no downward trend, while still far from converged."""

    kind = AlertKind.OSCILLATION

    def __init__(self, policy: Policy) -> None:
        self._p = policy.oscillation
        self._w = _LossWindow(self._p.window, policy.divergence.baseline_steps)

    def update(self, rec: StepRecord) -> list[Finding]:
        got = self._w.update(rec.step, rec.loss)
        if got is None:
            return []
        change, spread, level = got
        p = self._p
        if change > -p.min_improvement and spread >= p.min_spread and level >= p.high_fraction:
            return [
                Finding(
                    self.kind,
                    Severity.WARNING,
                    "loss",
                    spread,
                    p.min_spread,
                    f"loss bounces (relative spread {spread:.2f} over {p.window} steps) without a downward trend "
                    f"(change {change * 100:+.1f}%)",
                    details={"change": change, "spread": spread, "level": level},
                )
            ]
        return []


class VanishingDetector:
    """Some layers' gradients ~0 for many steps while other layers' are not."""

    kind = AlertKind.VANISHING

    def __init__(self, policy: Policy) -> None:
        self._p = policy.vanishing
        self._count: dict[str, int] = {}

    def update(self, rec: StepRecord) -> list[Finding]:
        norms = {k: v for k, v in rec.layer_grad_norms.items() if F.is_finite(v)}
        if len(norms) < 2:
            return []
        top = max(norms.values())
        if top <= 0:
            return []
        out: list[Finding] = []
        for name, v in norms.items():
            if v <= self._p.ratio * top:
                self._count[name] = self._count.get(name, 0) + 1
            else:
                self._count[name] = 0
            if self._count[name] >= self._p.patience:
                out.append(
                    Finding(
                        self.kind,
                        Severity.WARNING,
                        "layer_grad_norm",
                        v,
                        self._p.ratio * top,
                        f"gradient of {name} has been ~0 ({_fmt(v)}, < {self._p.ratio:g} of the largest layer's {_fmt(top)}) "
                        f"for {self._count[name]} steps",
                        location=name,
                    )
                )
        return out


DETECTOR_TYPES: Sequence[type] = (
    NonfiniteDetector,
    SpikeDetector,
    RunawayDetector,
    HeadroomDetector,
    DivergenceDetector,
    StallDetector,
    OscillationDetector,
    VanishingDetector,
)

_SECTION = {
    NonfiniteDetector: "nonfinite",
    SpikeDetector: "spike",
    RunawayDetector: "runaway",
    HeadroomDetector: "headroom",
    DivergenceDetector: "divergence",
    StallDetector: "stall",
    OscillationDetector: "oscillation",
    VanishingDetector: "vanishing",
}


def build_detectors(policy: Policy) -> list[Detector]:
    """One instance of every detector the policy enables."""
    return [t(policy) for t in DETECTOR_TYPES if getattr(policy, _SECTION[t]).enabled]
