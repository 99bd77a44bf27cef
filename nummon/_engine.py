"""The detection core: detectors -> lifecycle transitions -> alerts -> incidents. Shared by
Monitor and replay (no torch)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Union

from ._detectors import build_detectors
from ._hints import hint_for
from ._incidents import IncidentEvent, IncidentTracker
from ._policy import AlertPolicy, Policy
from ._types import Alert, AlertKind, Finding, Health, Severity, StepRecord

__all__ = ["Transition", "AlertLifecycle", "EngineStep", "HealthEngine"]

Key = tuple[str, str, str]


@dataclass(frozen=True)
class Transition:
    """A change of one condition (kind, metric, location) that people should hear about."""

    change: Literal["opened", "escalated", "cleared"]
    finding: Finding  # the latest finding of the condition
    previous: Severity | None = None  # escalated: the severity before; cleared: the severity that held


@dataclass
class _Open:
    severity: Severity  # the worst severity seen while open
    silent: bool  # opened within the cooldown of its last alert: not announced
    finding: Finding


class AlertLifecycle:
    """Deduplicate, cool down, escalate and clear findings; returns transitions, not alerts.

    One transition per (kind, metric, location) when its condition opens; a higher severity
    while it holds is an escalation; when it clears, a "cleared" transition (unless it was
    silent). The cooldown counts from the last time the condition was announced: within
    `cooldown_steps` of it, the same key at the same or lower severity opens silently, and a
    condition that stays (or keeps coming back) is announced again once the cooldown is over.
    """

    def __init__(self, p: Union[AlertPolicy, Policy]) -> None:
        self._p = p.alerts if isinstance(p, Policy) else p
        self._open: dict[Key, _Open] = {}
        self._sent: dict[Key, tuple[int, Severity]] = {}  # key -> (step, severity) of its last announcement

    def _quiet(self, key: Key, step: int, severity: Severity) -> bool:
        sent = self._sent.get(key)
        return sent is not None and step - sent[0] <= self._p.cooldown_steps and severity.rank <= sent[1].rank

    def update(self, step: int, findings: list[Finding], hold: Union[bool, Callable[[Finding], bool]] = False) -> list[Transition]:
        """Transitions at this step. Conditions not seen now stay open when `hold` is true or
        returns true for their finding (a record that does not measure a metric, or a
        non-finite record, is no evidence that a condition cleared)."""
        active: dict[Key, Finding] = {}
        for f in findings:
            cur = active.get(f.key)
            if cur is None or f.severity.rank > cur.severity.rank:
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
                    t = Transition("opened", f)
            if t is not None:
                out.append(t)
                self._sent[key] = (step, f.severity)
        keep = hold if callable(hold) else (lambda f: hold)
        for key in [k for k, c in self._open.items() if k not in active and not keep(c.finding)]:
            cur = self._open.pop(key)
            if not cur.silent:
                out.append(Transition("cleared", cur.finding, cur.severity))
        return out

    def open_findings(self) -> list[Finding]:
        """The latest finding of every open condition."""
        return [c.finding for c in self._open.values()]


@dataclass(frozen=True)
class EngineStep:
    """Everything the engine concluded from one record."""

    alerts: tuple[Alert, ...]
    health: Health
    incidents: tuple[IncidentEvent, ...] = ()


class HealthEngine:
    """Runs every enabled detector over one record per step and returns the routed alerts."""

    def __init__(self, policy: Policy, context: dict | None = None) -> None:
        self.policy = policy
        self.context = context or {}
        self.detectors = build_detectors(policy)
        self.lifecycle = AlertLifecycle(policy.alerts)
        self.incidents = IncidentTracker(policy.alerts.incident_quiet_steps)

    def alert_for(self, step: int, t: Transition) -> Alert | None:
        """The one place alerts are built: None for transitions nobody should hear about."""
        f = t.finding
        if t.change == "cleared":
            if not self.policy.alerts.emit_cleared or t.previous is None or t.previous.rank < Severity.WARNING.rank:
                return None
            return Alert(
                step=step,
                kind=f.kind,
                severity=Severity.INFO,
                message=f"cleared: {f.kind.value} on {f.metric} is back within limits",
                metric=f.metric,
                location=f.location,
                cleared=True,
            )
        details = dict(f.details)
        if t.change == "escalated" and t.previous is not None:
            details["escalated_from"] = t.previous.value
        return Alert(
            step=step,
            kind=f.kind,
            severity=f.severity,
            message=f.message,
            metric=f.metric,
            value=f.value,
            threshold=f.threshold,
            location=f.location,
            hint=hint_for(f, self.context),
            details=details,
        )

    def step(self, rec: StepRecord) -> EngineStep:
        """Alerts, health and incident events of one record."""
        findings: list[Finding] = []
        for d in self.detectors:
            findings.extend(d.update(rec))
        finite = rec.is_finite()
        # a non-finite record says nothing about whether growth stopped, and a record that does
        # not measure a metric (an eval-only row) says nothing about that metric's condition
        hold = (lambda f: True) if not finite else (lambda f: not rec.measures(f.metric))
        transitions = self.lifecycle.update(rec.step, findings, hold=hold)
        alerts = tuple(a for t in transitions if (a := self.alert_for(rec.step, t)) is not None)
        open_loud = [f for f in self.lifecycle.open_findings() if f.severity.rank >= Severity.WARNING.rank]
        events = tuple(self.incidents.update(rec.step, alerts, conditions_open=bool(open_loud)))
        if not finite:
            health = Health.NONFINITE
        elif any(f.kind is AlertKind.EXTREME and f.severity.rank >= Severity.WARNING.rank for f in findings):
            health = Health.EXTREME
        elif self.incidents.state.active:
            health = Health.INCIDENT
        else:
            health = Health.HEALTHY
        return EngineStep(alerts, health, events)

    def wants_sample(self) -> bool:
        """Whether a sampled detector (attention, output logits, Adam) saw a condition it must
        confirm at the next step: the Monitor then samples the mechanism probes there too."""
        return any(getattr(d, "wants_sample", False) for d in self.detectors)

    def process(self, rec: StepRecord) -> tuple[list[Alert], Health]:
        """Alerts raised at this record, and the record's health state."""
        got = self.step(rec)
        return list(got.alerts), got.health
