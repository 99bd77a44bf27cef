"""Incident events of one watched run: nummon's own incident state machine (the HealthEngine's
`IncidentTracker`, as in the Monitor), each event labelled with the run it belongs to.
Notifications go per event, never per alert."""
from __future__ import annotations

from typing import Any

from .._incidents import IncidentEvent

__all__ = ["RunIncident"]


class RunIncident:
    """One incident event of one watched run (the interface every notification target takes)."""

    def __init__(self, run: str, event: IncidentEvent) -> None:
        self.run = run
        self.event = event

    @property
    def id(self) -> str:
        """Unique per run, incident and state (skips events already written after a restart)."""
        return f"{self.run}#{self.event.number}:{self.transition}:{self.level}"

    @property
    def transition(self) -> str:
        """opened, escalated or resolved."""
        if not self.event.state.active:
            return "resolved"
        return "escalated" if self.event.previous.active else "opened"

    @property
    def level(self) -> int:
        """0 resolved, 1 warning, 2 critical, 3 non-finite."""
        return self.event.state.rank

    @property
    def title(self) -> str:
        return self.event.title

    def summary(self) -> str:
        return f"run `{self.run}`: {self.event.summary()}"

    def to_dict(self) -> dict[str, Any]:
        return {"type": "incident", "id": self.id, "run": self.run, "level": self.level, "transition": self.transition,
                "summary": self.summary(), **self.event.to_dict()}
