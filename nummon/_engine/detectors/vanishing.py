"""Some layers' gradients ~0 for many steps while other layers' are not, after they had one.

A tensor whose gradient has been ~0 from its first step on has not vanished: its gradient is
structurally zero (a LayerNorm bias on the keys, which shifts every logit of a query alike so
softmax ignores it; a parameter the loss does not use) and only a change in it is news."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core.text import fmt_num
from ..._core.types import AlertKind, Finding, Severity, StepRecord
from ..._policy.sections import VanishingPolicy

if TYPE_CHECKING:
    from ..quiet import QuietPlan

__all__ = ["VanishingDetector"]


class VanishingDetector:
    """One finding per step for every vanished layer together, naming the worst few (no
    location: the set of layers may change while the condition holds, its key must not)."""

    section = "vanishing"
    kinds = (AlertKind.VANISHING,)
    needs = ()

    def __init__(self, p: VanishingPolicy) -> None:
        self._p = p
        self._count: dict[str, int] = {}
        self._live: set[str] = set()  # tensors whose gradient has been above the limit at least once

    def quiet(self, plan: QuietPlan) -> bool:
        """A count grows by at most one a record: silent for as many records as the highest
        count of a live tensor stays under `patience`."""
        count = self._count
        plan.cap_records(self._p.patience - 1 - max((count.get(n, 0) for n in self._live), default=0))
        return True

    def absorb(self, records: Sequence[StepRecord]) -> None:
        """Book records `quiet` promised silence on: the counts."""
        for rec in records:
            self._book(rec)

    def update(self, rec: StepRecord) -> list[Finding]:
        booked = self._book(rec)
        if booked is None:
            return []
        gone, top, limit = booked
        return self._findings(gone, top, limit)

    def _book(self, rec: StepRecord) -> tuple[list[tuple[float, str]], float, float] | None:
        """Count each tensor's records at ~0; (the tensors at `patience`, the largest norm, the
        limit), or None when the record has too few norms to judge."""
        # one pass per step over every tensor's norm, so no call per tensor (1,000 tensors: ~0.2 ms)
        isfinite = math.isfinite  # the values are numbers: decoded, or checked by the trace reader
        norms = {k: v for k, v in rec.layer_grad_norms.items() if isfinite(v)}
        if len(norms) < 2:
            return None
        top = max(norms.values())
        if top <= 0:
            return None
        limit = self._p.ratio * top
        live, count, patience = self._live, self._count, self._p.patience
        gone = []
        for name, v in norms.items():
            if v > limit:
                live.add(name)
                count[name] = 0
            elif name in live:
                n = count[name] = count.get(name, 0) + 1
                if n >= patience:
                    gone.append((v, name))
            else:
                count[name] = 0
        return gone, top, limit

    def _findings(self, gone: list[tuple[float, str]], top: float, limit: float) -> list[Finding]:
        """The one finding naming the vanished tensors (none when none has)."""
        if not gone:
            return []
        gone.sort()
        worst = gone[: self._p.max_named]
        named = ", ".join(f"{name} ({fmt_num(v)})" for v, name in worst)
        more = f" and {len(gone) - len(worst)} more" if len(gone) > len(worst) else ""
        held = min(self._count[name] for _, name in gone)
        layers = "layer has" if len(gone) == 1 else f"{len(gone)} layers have"
        return [
            Finding(
                AlertKind.VANISHING,
                Severity.WARNING,
                "layer_grad_norm",
                worst[0][0],
                limit,
                f"gradient of {layers} been ~0 (< {self._p.ratio:g} of the largest layer's {fmt_num(top)}) "
                f"for {held}+ steps: {named}{more}",
                details={"layers": {name: v for v, name in worst}, "count": len(gone)},
            )
        ]
