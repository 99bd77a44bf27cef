"""A minimal run-level incident grouper over alerts (to be swapped for nummon._incidents): one
event when a run goes bad (opened), gets worse (escalated: critical, then non-finite), and when
it has been quiet for `quiet_records` records (resolved). Notifications go per event, never per
alert."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._types import Alert, AlertKind, Health, Severity, StepRecord

__all__ = ["IncidentEvent", "IncidentGrouper", "LEVEL_NAMES"]

#: Incident level -> name; 0 means no open incident.
LEVEL_NAMES = {0: "resolved", 1: "warning", 2: "critical", 3: "nonfinite"}
_MAX_ALERTS = 20  # contributing alerts kept per event (bounded memory per run)


@dataclass
class IncidentEvent:
    """One incident transition of one watched run."""

    run: str
    incident: int  # 1, 2, ... per run
    transition: str  # "opened" | "escalated" | "resolved"
    level: int  # the level after the transition (see LEVEL_NAMES)
    step: int
    alerts: list[Alert] = field(default_factory=list)

    @property
    def id(self) -> str:
        """Unique per run and transition (used to skip events already written after a restart)."""
        return f"{self.run}#{self.incident}:{self.transition}:{self.level}"

    @property
    def state(self) -> str:
        return LEVEL_NAMES[self.level]

    @property
    def title(self) -> str:
        """A short title (< 64 characters) naming the incident state."""
        word = {"opened": "incident opened", "escalated": "incident escalated", "resolved": "incident resolved"}[self.transition]
        head = f"nummon: {word}" + ("" if self.level == 0 else f" ({self.state})")
        return head[:63]

    def summary(self) -> str:
        """A short readable text: run, step, and one Markdown list item per contributing alert."""
        lines = [f"run `{self.run}` at step {self.step}: {self.transition} -> {self.state}"]
        for a in self.alerts[-5:]:
            lines.append(f"- {a.severity.value} {a.kind.value} on {a.metric}: {a.message}")
        hint = next((a.hint for a in reversed(self.alerts) if a.hint), None)
        if hint and self.level:
            lines.append(f"hint: {hint}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "incident",
            "id": self.id,
            "run": self.run,
            "incident": self.incident,
            "transition": self.transition,
            "state": self.state,
            "step": self.step,
            "title": self.title,
            "summary": self.summary(),
            "alerts": [a.to_dict() for a in self.alerts],
        }


class IncidentGrouper:
    """Incident state of one run, fed one record (and its alerts) at a time."""

    def __init__(self, run: str, quiet_records: int = 20) -> None:
        self.run = run
        self.quiet_records = quiet_records
        self.level = 0
        self.incident = 0
        self.quiet = 0
        self._recent: list[Alert] = []

    def update(self, rec: StepRecord, alerts: list[Alert], health: Health) -> list[IncidentEvent]:
        bad = [a for a in alerts if not a.cleared and a.severity.rank >= Severity.WARNING.rank]
        now = max((_level(a) for a in bad), default=0)
        if health is Health.NONFINITE:
            now = 3
        self._recent = (self._recent + bad)[-_MAX_ALERTS:]
        out: list[IncidentEvent] = []
        if now > self.level:
            transition = "opened" if self.level == 0 else "escalated"
            if self.level == 0:
                self.incident += 1
            self.level = now
            out.append(self._event(transition, rec.step))
            self.quiet = 0
        elif self.level and not bad and health is Health.HEALTHY:
            self.quiet += 1
            if self.quiet >= self.quiet_records:
                self.level = 0
                out.append(self._event("resolved", rec.step))
        elif bad or health is not Health.HEALTHY:
            self.quiet = 0
        return out

    def _event(self, transition: str, step: int) -> IncidentEvent:
        ev = IncidentEvent(self.run, self.incident, transition, self.level, step, list(self._recent))
        self._recent = []
        return ev

    def to_state(self) -> dict[str, Any]:
        return {"level": self.level, "incident": self.incident, "quiet": self.quiet}

    def load_state(self, d: dict[str, Any]) -> None:
        self.level = int(d.get("level", 0))
        self.incident = int(d.get("incident", 0))
        self.quiet = int(d.get("quiet", 0))


def _level(a: Alert) -> int:
    if a.kind is AlertKind.NONFINITE:
        return 3
    return 2 if a.severity is Severity.CRITICAL else 1
