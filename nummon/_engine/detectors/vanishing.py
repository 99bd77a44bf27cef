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
        self._count: dict[str, int] = {}  # records in a row at ~0, of the tensors where that is not 0
        self._live: set[str] = set()  # tensors whose gradient has been above the limit at least once

    def quiet(self, plan: QuietPlan) -> bool:
        """A count grows by at most one a record: silent for as many records as the highest
        count of a live tensor stays under `patience`."""
        # (only live tensors ever count: a count is kept only while it is not 0)
        plan.cap_records(self._p.patience - 1 - max(self._count.values(), default=0))
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
        # no Python per tensor beyond two comprehensions (this runs on every record, also the
        # quiet ones, booked in bulk): only the tensors at ~0 are visited one by one
        isfinite = math.isfinite  # the values are numbers: decoded, or checked by the trace reader
        norms = rec.layer_grad_norms
        if not all(map(isfinite, norms.values())):
            norms = {k: v for k, v in norms.items() if isfinite(v)}
        if len(norms) < 2:
            return None
        top = max(norms.values())
        if top <= 0:
            return None
        limit = self._p.ratio * top
        below = [k for k, v in norms.items() if v <= limit]
        live, patience = self._live, self._p.patience
        live.update(norms.keys() - set(below) if below else norms.keys())
        # a tensor absent from this record (or non-finite in it) keeps its count; one above the
        # limit, or at ~0 without ever having been live, counts 0 (dropped); a live one at ~0 counts on
        count = self._count
        kept = {k: n for k, n in count.items() if k not in norms}
        gone = []
        for name in below:
            if name in live:
                n = kept[name] = count.get(name, 0) + 1
                if n >= patience:
                    gone.append((norms[name], name))
        self._count = kept
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
