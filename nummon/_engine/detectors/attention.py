"""Attention-logit growth and attention-entropy collapse (Dehghani et al. 2023; Wortsman et al.
2023, arXiv 2309.14322): the max pre-softmax logit of a layer grows, its attention entropy
collapses, the loss jumps and can stay at chance while every value is still finite."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core import maths as F
from ..._core.types import AlertKind, Finding, Severity, StepRecord
from ..._policy.mechanism_sections import AttentionPolicy
from .trend import StartLevel

if TYPE_CHECKING:
    from ..quiet import QuietPlan

__all__ = ["AttentionDetector"]

#: At most this many samples of each layer are kept for its recent level.
_RECENT = 64


class AttentionDetector:
    """Per attention module: warning when its max logit stands far above the run's own level for
    it (or above `warning_logit`), critical at `critical_logit`; attention_collapse when its
    normalised entropy falls near 0, critical when the loss is then back at its starting level.

    Logits after the 1/sqrt(d) scaling are unitless, so the absolute levels hold for every width;
    the softmax runs in float32 or wider under autocast, so they hold for every dtype too.
    Shared value: ``level``, the loss's starting level (the chance level of a fresh LM).
    """

    section = "attention"
    kinds = (AlertKind.ATTENTION_LOGITS, AlertKind.ATTENTION_COLLAPSE)
    needs = ("level",)

    def __init__(self, p: AttentionPolicy, level: StartLevel | None = None) -> None:
        self._p = p
        self._level = level or StartLevel(10)
        self._recent: dict[str, deque[tuple[int, float]]] = {}  # per layer: (step, max logit) of its samples
        self._entropy_base: dict[str, deque[float]] = {}
        self._held: dict[tuple[str, str], int] = {}  # (condition, layer) -> consecutive samples

    @property
    def wants_sample(self) -> bool:
        """A condition seen but not held for `patience` samples yet: sample the next step too."""
        # over the distinct counts (a few), not every (condition, layer): asked on every step
        p = self._p.patience
        return any(0 < n < p for n in set(self._held.values()))

    def _hold(self, key: tuple[str, str], on: bool) -> int:
        n = self._held.get(key, 0) + 1 if on else 0
        self._held[key] = n
        return n

    def quiet(self, plan: QuietPlan) -> bool:
        """Silent on a record without attention logits (a quiet region admits none); no state to book."""
        return True

    def absorb(self, records: Sequence[StepRecord]) -> None:
        """Nothing to book: a record without attention logits changes nothing here."""

    def update(self, rec: StepRecord) -> list[Finding]:
        start = self._level.observe(rec)
        layers = rec.layer_attention_logit_max or (
            {"attention": rec.attention_logit_max} if rec.attention_logit_max is not None else {}
        )
        if not layers:
            return []
        p = self._p
        out: list[Finding] = []
        worst: tuple[float, Severity, str, float, float] | None = None  # (value, severity, layer, base, threshold)
        for name, v in layers.items():
            if not F.is_finite(v):
                continue  # the nonfinite detector takes over
            recent = self._recent.setdefault(name, deque(maxlen=_RECENT))
            while len(recent) > 1 and recent[0][0] <= rec.step - p.recent_steps:
                recent.popleft()  # a window in steps: the same time span at every cadence
            base = F.median([x for _, x in recent]) if recent else None
            if rec.step >= p.start_step:
                recent.append((rec.step, v))
            grown = base is not None and base > 0 and v >= p.warning_growth * base and v >= p.warning_floor
            sev = None
            if self._hold(("crit", name), v >= p.critical_logit) >= p.patience:
                sev = Severity.CRITICAL
            elif self._hold(("warn", name), grown or v >= p.warning_logit) >= p.patience:
                sev = Severity.WARNING
            if sev is not None and (worst is None or (sev.rank, v) > (worst[1].rank, worst[0])):
                if sev is Severity.CRITICAL:
                    thr = p.critical_logit
                elif v >= p.warning_logit:
                    thr = p.warning_logit
                else:
                    assert base is not None  # a warning below warning_logit held because it grew over `base`
                    thr = p.warning_growth * base
                worst = (v, sev, name, base if base is not None else v, thr)
        if worst is not None:
            v, sev, name, base, thr = worst
            out.append(
                Finding(
                    AlertKind.ATTENTION_LOGITS,
                    sev,
                    "attention_logit_max",
                    v,
                    thr,
                    f"attention logits are growing: max pre-softmax logit {v:.3g} in `{name}` "
                    f"({v / base:.3g}x its recent level {base:.3g}); the softmax is saturating and a loss spike "
                    f"usually follows",
                    details={
                        "layer": name,
                        "recent_level": base,
                        "growth": v / base if base else None,
                        "layers": {k: x for k, x in layers.items() if F.is_finite(x)},
                    },
                )
            )
        out.extend(self._collapse(rec, start))
        return out

    def _collapse(self, rec: StepRecord, start: float | None) -> list[Finding]:
        p = self._p
        ent = rec.layer_attention_entropy or (
            {"attention": rec.attention_entropy} if rec.attention_entropy is not None else {}
        )
        worst: tuple[float, str, float] | None = None
        for name, e in ent.items():
            if not F.is_finite(e):
                continue
            base_q = self._entropy_base.setdefault(name, deque(maxlen=p.baseline_samples))
            if len(base_q) < p.baseline_samples:
                base_q.append(e)
            base = max(base_q)
            low = e < p.collapse_entropy and e < p.collapse_drop * base
            if self._hold(("collapse", name), low) >= p.patience and (worst is None or e < worst[0]):
                worst = (e, name, base)
        if worst is None:
            return []
        e, name, base = worst
        at_chance = (
            start is not None and F.is_finite(rec.loss) and start > 0 and rec.loss >= (1 - p.chance_match) * start
        )
        if at_chance:
            assert start is not None and rec.loss is not None  # at_chance checked both
            msg = (
                f"attention collapsed in `{name}` (entropy {e:.2g} of its maximum, was {base:.2g}) and the loss "
                f"{rec.loss:.4g} is back at{' or above' if rec.loss > (1 + p.chance_match) * start else ''} its "
                f"starting level {start:.4g}: the model has lost what it learned "
                f"and is predicting at chance; this is not a stall"
            )
        else:
            msg = (
                f"attention collapsed in `{name}`: entropy {e:.2g} of its maximum (was {base:.2g}); each query "
                f"attends to one key"
            )
        return [
            Finding(
                AlertKind.ATTENTION_COLLAPSE,
                Severity.CRITICAL if at_chance else Severity.WARNING,
                "attention_entropy",
                e,
                p.collapse_entropy,
                msg,
                details={"layer": name, "baseline_entropy": base, "at_chance": at_chance, "start_loss": start},
            )
        ]
