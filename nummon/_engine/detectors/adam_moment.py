"""Adam's second moment out of step with the gradients (Wortsman et al. 2023, arXiv 2304.13013:
loss spikes follow 1-8 steps after v underestimates g²; arXiv 2506.04805: and when g² << v with
most |g| below eps, the update is eps-dominated)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core import maths as F
from ..._core.types import AlertKind, Finding, Severity, StepRecord
from ..._policy.mechanism_sections import AdamMomentPolicy

if TYPE_CHECKING:
    from ..quiet import QuietPlan

__all__ = ["AdamMomentDetector"]


class AdamMomentDetector:
    """Warning when a tensor's RMS(g_t / sqrt(v_hat_t)) exceeds the warning level (critical only
    where the policy sets `critical_rms`), when most gradient elements are below Adam's eps, or
    when one step moves a tensor by more than `warning_update_ratio` of its norm. All three are
    ratios: no unit, no dependence on width or dtype.

    The ratio: g_t against the bias-corrected second moment that includes g_t itself, v_hat_t =
    (beta2 v_{t-1} + (1 - beta2) g_t^2) / (1 - beta2^t); every element, so the RMS, is at most
    sqrt((1 - beta2^t) / (1 - beta2)) (the record's `adam_ratio_bound`). It reaches that bound when
    a gradient dwarfs everything v remembers, which happens in high-LR runs that recover on their
    own as in runs that are lost: a warning, never a stop by default."""

    section = "adam_moment"
    kinds = (AlertKind.ADAM_SECOND_MOMENT,)
    needs = ()

    def __init__(self, p: AdamMomentPolicy) -> None:
        self._p = p
        self._held: dict[str, int] = {}
        self._small_base: list[float] = []  # the small-gradient fraction over the first samples

    @property
    def steady_floors(self) -> dict[str, float]:
        """Half the warning levels of the absolute rules: minibatch noise below them is no sign
        (the probes may thin out, `quiet.steady`)."""
        p = self._p
        return {"adam_small_grad_fraction": p.small_fraction / 2, "update_ratio_max": p.warning_update_ratio / 2}

    @property
    def wants_sample(self) -> bool:
        """A condition seen but not held for `patience` samples yet: sample the next step too."""
        # over the distinct counts (a few), not every (condition, layer): asked on every step
        p = self._p.patience
        return any(0 < n < p for n in set(self._held.values()))

    def _hold(self, key: str, on: bool) -> int:
        n = self._held.get(key, 0) + 1 if on else 0
        self._held[key] = n
        return n

    def _levels(self, bound: float | None) -> tuple[float, float]:
        """(warning, critical) levels of RMS(g_t / sqrt(v_hat_t)) at a step where the ratio is at
        most `bound` (None: unknown, the policy's levels). Critical: inf unless the policy sets one."""
        p = self._p
        crit = math.inf if p.critical_rms is None else p.critical_rms
        if bound is None or not F.is_finite(bound):
            return p.warning_rms, max(crit, p.warning_rms)
        warn = max(p.warning_rms, p.bound_fraction * bound)
        return warn, max(crit, warn)

    def quiet(self, plan: QuietPlan) -> bool:
        """Silent on a record without Adam statistics (a quiet region admits none); no state to book."""
        return True

    def absorb(self, records: Sequence[StepRecord]) -> None:
        """Nothing to book: a record without Adam statistics changes nothing here."""

    def update(self, rec: StepRecord) -> list[Finding]:
        if rec.adam_ratio_rms is None or rec.step < self._p.start_step:
            return []
        found = (self._ratio_finding(rec), self._small_grad_finding(rec), self._update_finding(rec))
        return [f for f in found if f is not None]

    def _ratio_finding(self, rec: StepRecord) -> Finding | None:
        """RMS(g_t/sqrt(v_hat_t)) held at or above its warning level for `patience` samples."""
        p = self._p
        layers = rec.layer_adam_ratio_rms
        rms = rec.adam_ratio_rms
        bound = rec.adam_ratio_bound
        warn, crit = self._levels(bound)
        if not (F.is_finite(rms) and self._hold("rms", rms >= warn) >= p.patience):
            return None
        name = max(layers, key=layers.__getitem__) if layers else None
        sev = Severity.CRITICAL if rms >= crit else Severity.WARNING
        where = f" in `{name}`" if name else ""
        of_bound = (
            f", {rms / bound:.0%} of the most it can be at this step ({bound:.3g}, when g_t dwarfs "
            f"everything v remembers)"
            if bound and F.is_finite(bound)
            else ""
        )
        return Finding(
            AlertKind.ADAM_SECOND_MOMENT,
            sev,
            "adam_ratio_rms",
            rms,
            crit if sev is Severity.CRITICAL else warn,
            f"Adam's second moment underestimates the gradient{where}: RMS(g_t/sqrt(v_hat_t)) is "
            f"{rms:.3g}{of_bound}; about 1 when v tracks g² (v_t includes g_t, bias-corrected): "
            f"the gradient jumped far above what v has seen",
            details={"tensor": name, "bound": bound},
        )

    def _small_grad_finding(self, rec: StepRecord) -> Finding | None:
        """The fraction of gradient elements below Adam's eps risen far above the run's own level."""
        p = self._p
        small = rec.adam_small_grad_fraction
        if not F.is_finite(small):
            return None
        base_q = self._small_base
        if len(base_q) < p.baseline_samples:
            base_q.append(small)
        base = min(base_q)  # the lowest: the fraction can take off within the first samples
        high = small >= p.small_fraction and small >= p.small_growth * base and len(base_q) >= 2
        if self._hold("small", high) < p.patience:
            return None
        return Finding(
            AlertKind.ADAM_SECOND_MOMENT,
            Severity.WARNING,
            "adam_small_grad_fraction",
            small,
            p.small_fraction,
            f"{small:.0%} of gradient elements are now below Adam's eps (the run's own level was {base:.1%}): "
            f"those parameters stopped receiving gradient while Adam's second moment still holds their old size "
            f"(g² << v), the state that comes before a loss spike",
            details={"baseline_fraction": base},
        )

    def _update_finding(self, rec: StepRecord) -> Finding | None:
        """One Adam step that moved a tensor by a large fraction of its norm, for `patience` samples."""
        p = self._p
        upd = rec.update_ratio_max
        if not (F.is_finite(upd) and self._hold("update", upd >= p.warning_update_ratio) >= p.patience):
            return None
        lu = rec.layer_update_ratio
        name = max(lu, key=lu.__getitem__) if lu else None
        where = f"`{name}`" if name else "one tensor"
        return Finding(
            AlertKind.ADAM_SECOND_MOMENT,
            Severity.WARNING,
            "update_ratio_max",
            upd,
            p.warning_update_ratio,
            f"one Adam step moved {where} by {upd:.3g} of its norm",
            details={"tensor": name},
        )
