"""The detection core: detectors -> lifecycle -> alerts. Shared by Monitor and replay (no torch)."""
from __future__ import annotations

from ._detectors import build_detectors
from ._hints import hint_for
from ._policy import Policy
from ._types import INSTABILITY_KINDS, Alert, Finding, Health, Severity, StepRecord


class AlertLifecycle:
    """Deduplicate, cool down, escalate and clear findings into alerts.

    One alert per (kind, metric, location) while its condition holds; a higher severity while it
    holds is a new (escalation) alert; when it clears an info alert says so; after clearing, the
    same key at the same or lower severity is quiet for `cooldown_steps`.
    """

    def __init__(self, policy: Policy) -> None:
        self._p = policy.alerts
        self._open: dict[tuple, tuple[Severity, bool, Finding]] = {}  # key -> (severity, silent, finding)
        self._closed: dict[tuple, tuple[int, Severity]] = {}

    def update(self, step: int, findings: list[Finding], make_alert, hold: bool = False) -> list[Alert]:
        """Alerts for this step's findings; with `hold`, conditions not seen now stay open (a
        non-finite record says nothing about whether growth stopped)."""
        active: dict[tuple, Finding] = {}
        for f in findings:
            cur = active.get(f.key)
            if cur is None or f.severity.rank > cur.severity.rank:
                active[f.key] = f
        out: list[Alert] = []
        for key, f in active.items():
            prev = self._open.get(key)
            if prev is None:
                closed = self._closed.get(key)
                quiet = (
                    closed is not None
                    and step - closed[0] <= self._p.cooldown_steps
                    and f.severity.rank <= closed[1].rank
                )
                self._open[key] = (f.severity, quiet, f)
                if not quiet:
                    out.append(make_alert(step, f))
            elif f.severity.rank > prev[0].rank:
                self._open[key] = (f.severity, False, f)
                out.append(make_alert(step, f, escalated_from=prev[0]))
            else:
                self._open[key] = (prev[0], prev[1], f)
        for key in [k for k in self._open if k not in active and not hold]:
            sev, silent, f = self._open.pop(key)
            self._closed[key] = (step, sev)
            if self._p.emit_cleared and not silent and sev.rank >= Severity.WARNING.rank:
                out.append(
                    Alert(
                        step=step,
                        kind=f.kind,
                        severity=Severity.INFO,
                        message=f"cleared: {f.kind.value} on {f.metric} is back within limits",
                        metric=f.metric,
                        location=f.location,
                        cleared=True,
                    )
                )
        return out

    def active(self) -> list[Finding]:
        return [f for (_, _, f) in self._open.values()]


class HealthEngine:
    """Runs every enabled detector over one record per step and returns the routed alerts."""

    def __init__(self, policy: Policy, context: dict | None = None) -> None:
        self.policy = policy
        self.context = context or {}
        self.detectors = build_detectors(policy)
        self.lifecycle = AlertLifecycle(policy)

    def _make_alert(self, step: int, f: Finding, escalated_from: Severity | None = None) -> Alert:
        details = dict(f.details)
        if escalated_from is not None:
            details["escalated_from"] = escalated_from.value
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

    def process(self, rec: StepRecord) -> tuple[list[Alert], Health]:
        """Alerts raised at this record, and the record's health state."""
        findings: list[Finding] = []
        for d in self.detectors:
            findings.extend(d.update(rec))
        finite = rec.is_finite()
        alerts = self.lifecycle.update(rec.step, findings, self._make_alert, hold=not finite)
        if not finite:
            health = Health.NONFINITE
        elif any(
            f.kind in INSTABILITY_KINDS and f.severity.rank >= Severity.WARNING.rank for f in findings
        ):
            health = Health.EXTREME
        else:
            health = Health.HEALTHY
        return alerts, health
