"""The alert lifecycle: findings in, transitions out (opened, escalated, recurred, cleared),
with the cooldown and the debounce of settled kinds. No torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .._core.types import AlertKind, Finding, Severity
from .._policy.policy import Policy
from .._policy.runtime import AlertPolicy

__all__ = ["AlertLifecycle", "Transition"]

Key = tuple[str, str, str]


@dataclass(frozen=True)
class Transition:
    """A change of one condition (kind, metric, location) that people should hear about."""

    change: Literal["opened", "escalated", "recurred", "cleared"]
    finding: Finding  # the latest finding of the condition
    previous: Severity | None = None  # escalated: the severity before; cleared: the severity that held


@dataclass
class _Open:
    severity: Severity  # the worst severity seen while open
    silent: bool  # opened within the cooldown of its last alert: not announced
    finding: Finding
    gap: bool = False  # held open while absent: its next finding is a recurrence


class AlertLifecycle:
    """Deduplicate, cool down, escalate and clear findings; returns transitions, not alerts.

    One transition per (kind, metric, location) when its condition opens; a higher severity
    while it holds is an escalation; when it clears, a "cleared" transition (unless it was
    silent). The cooldown counts from the last time the condition was announced: within
    `cooldown_steps` of it, the same key at the same or lower severity opens silently, and a
    condition that stays (or keeps coming back) is announced again once the cooldown is over.

    Kinds in `settled_kinds` clear only after a stretch of clean records (the engine holds them
    until then: non-finite values, `nonfinite.clear_records`). One that comes back within that
    stretch is a recurrence, announced ("recurred") once the cooldown since its last announcement
    is over; and since the stretch already keeps it from flapping, a return after its announced
    clear is a new alert, whatever the cooldown.
    """

    def __init__(
        self, p: AlertPolicy | Policy, settled_kinds: frozenset[AlertKind] = frozenset({AlertKind.NONFINITE})
    ) -> None:
        self._p = p.alerts if isinstance(p, Policy) else p
        self._settled_kinds = settled_kinds
        self._open: dict[Key, _Open] = {}
        self._sent: dict[Key, tuple[int, Severity]] = {}  # key -> (step, severity) of its last announcement

    def _quiet(self, key: Key, step: int, severity: Severity) -> bool:
        sent = self._sent.get(key)
        return sent is not None and step - sent[0] <= self._p.cooldown_steps and severity.rank <= sent[1].rank

    def update(
        self, step: int, findings: list[Finding], hold: bool | Callable[[Finding], bool] = False
    ) -> list[Transition]:
        """Transitions at this step. Conditions not seen now stay open when `hold` is true or
        returns true for their finding (a record that does not measure a metric, or a
        non-finite record, is no evidence that a condition cleared)."""
        active: dict[Key, Finding] = {}
        for f in findings:
            best = active.get(f.key)
            if best is None or f.severity.rank > best.severity.rank:
                active[f.key] = f
        out: list[Transition] = []
        for key, f in active.items():
            cur = self._open.get(key)
            t: Transition | None = None
            if cur is None:
                quiet = self._quiet(key, step, f.severity)
                self._open[key] = _Open(f.severity, quiet, f)
                t = None if quiet else Transition("opened", f)
            elif f.severity.rank > cur.severity.rank:
                previous = cur.severity
                cur.severity, cur.finding = f.severity, f
                if not self._quiet(key, step, f.severity):
                    cur.silent = False
                    t = Transition("escalated", f, previous)
            else:
                cur.finding = f
                if cur.silent and not self._quiet(key, step, cur.severity):
                    cur.silent = False  # recurring past the cooldown: announce it again
                    cur.gap = False
                    t = Transition("opened", f)
                elif cur.gap and not self._quiet(key, step, cur.severity):
                    cur.gap = False  # back after a gap, past the cooldown: say it came back
                    t = Transition("recurred", f)
            if t is not None:
                out.append(t)
                self._sent[key] = (step, f.severity)
        keep = hold if callable(hold) else (lambda f: hold)
        for key, cur in list(self._open.items()):
            if key in active:
                continue
            if keep(cur.finding):
                # held over a record without it: for a settled kind (a finite record amid
                # non-finite ones) its return is news; a sampled metric between samples is not
                cur.gap = cur.gap or cur.finding.kind in self._settled_kinds
                continue
            del self._open[key]
            if not cur.silent:
                out.append(Transition("cleared", cur.finding, cur.severity))
                if cur.finding.kind in self._settled_kinds:
                    self._sent.pop(key, None)  # its clear was debounced: a return is news
        return out

    def open_findings(self) -> list[Finding]:
        """The latest finding of every open condition."""
        return [c.finding for c in self._open.values()]

    @property
    def any_open(self) -> bool:
        """Whether any condition is open (announced or not)."""
        return bool(self._open)
