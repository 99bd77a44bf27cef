"""Incidents: one run-level state machine over the alerts, so people get one message when a run
goes bad, one when it gets worse, one when it is lost and one when it recovers.

Pure (no torch, no I/O). `IncidentTracker.update` takes each step's alerts and returns the
`IncidentEvent`s of the transitions it made; notification sinks send those, while logs keep
every alert. The events themselves (`IncidentEvent`, `Contributor`; `IncidentState`) are plain
data in `_events` (and `_types`), re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from .._core.events import Contributor, IncidentEvent
from .._core.types import Alert, AlertKind, IncidentState, Severity

__all__ = ["IncidentTracker", "escalated_to_critical"]


#: quiet steps after a rollback that end its incident (at most `alerts.incident_quiet_steps`):
#: recovery's own skip window, over which it judges a run's updates
ROLLBACK_QUIET_STEPS = 20


def escalated_to_critical(events: Iterable[Any]) -> bool:
    """Whether one of these incident events takes an incident to critical or non-finite."""
    return any(
        getattr(e.state, "rank", 0) >= 2 and e.state.rank > getattr(e.previous, "rank", 0) and not e.action
        for e in events
    )


def _state_of(alert: Alert) -> IncidentState:
    if alert.severity is Severity.CRITICAL:
        return IncidentState.NONFINITE if alert.kind is AlertKind.NONFINITE else IncidentState.CRITICAL
    return IncidentState.OPEN


class IncidentTracker:
    """The run-level state machine: none/resolved -> open (warning) -> critical -> nonfinite,
    and back to resolved after ``quiet_steps`` steps with no open condition and no alert (the
    count starts at the last alert, a "cleared" one included).

    A condition counts as open from its warning/critical alert until its "cleared" alert; the
    engine may also say directly whether any condition is still open (``conditions_open``).
    A loud alert after every condition had cleared, before the incident resolved, re-opens it:
    an event at the same state (``reopened``), so people hear that the trouble came back.
    """

    def __init__(self, quiet_steps: int) -> None:
        self.quiet_steps = quiet_steps
        self._quiet_needed = quiet_steps  # quiet steps that end the active incident (fewer after a rollback)
        self.state = IncidentState.NONE
        self.number = 0
        self._opened_step = 0
        self._quiet_since = 0  # last step with an alert or an open condition
        self._open: set[tuple[str, str, str]] = set()
        self._contributors: dict[tuple[str, str, str], Contributor] = {}
        self._hint: tuple[int, str] | None = None  # (state rank, hint) of the worst alert with one
        self._flight_record: str | None = None
        self._settled_at: int | None = None  # step at which every condition of the active incident had cleared

    def update(
        self,
        step: int,
        alerts: Iterable[Alert],
        conditions_open: bool | None = None,
        flight_record: str | None = None,
    ) -> list[IncidentEvent]:
        """The incident events this step's alerts cause (zero or one)."""
        alerts = list(alerts)
        for a in alerts:
            if a.cleared:
                self._open.discard(a.key)
        loud = [a for a in alerts if not a.cleared and a.severity.rank >= Severity.WARNING.rank]
        previous = self.state
        reopened_after = self._settled_at if loud and self.state.active else None
        if loud:
            self._settled_at = None
            if not self.state.active:  # a new incident
                self.number += 1
                self._opened_step = step
                self._open.clear()
                self._contributors.clear()
                self._hint, self._flight_record = None, None
            for a in loud:
                self._note(a)
            target = max((_state_of(a) for a in loud), key=lambda s: s.rank)
            if target.rank > self.state.rank:
                self.state = target
        self._flight_record = (
            flight_record or next((a.flight_record for a in alerts if a.flight_record), None) or self._flight_record
        )
        still_open = bool(self._open) if conditions_open is None else conditions_open
        if alerts or still_open:
            self._quiet_since = step
        if self.state.active and not still_open and not loud and self._settled_at is None:
            self._settled_at = step
        if self.state.active and step - self._quiet_since >= self._quiet_needed:
            self.state = IncidentState.RESOLVED
            self._open.clear()
            self._settled_at = None
            self._quiet_needed = self.quiet_steps
        if self.state is previous:
            if reopened_after is not None:
                return [replace(self._event(step, previous), reopened=reopened_after)]
            return []
        return [self._event(step, previous)]

    def close(self, step: int) -> list[IncidentEvent]:
        """The run ended at `step`: an incident whose every condition had cleared, with no alert
        since, ends here (resolved) rather than staying open for want of `quiet_steps` more
        steps; one still open stays open. Zero or one event."""
        if not self.state.active or self._settled_at is None or step < self._settled_at:
            return []
        previous, self.state = self.state, IncidentState.RESOLVED
        self._open.clear()
        self._settled_at = None
        return [self._event(step, previous)]

    def acted(self, step: int, alert: Alert, action: str) -> IncidentEvent:
        """An event saying what was done about the incident (a rollback, a recovery that gave
        up): always one, whatever the state; the incident stays open, at least as a warning."""
        previous = self.state
        if not self.state.active:
            self.number += 1
            self._opened_step = step
            self._open.clear()
            self._contributors.clear()
        self._note(alert)
        if (alert.details or {}).get("recovery") == "rollback":
            # the run is back on a snapshot taken while healthy, its detectors started afresh:
            # the incident ends once the restored run has stayed quiet this long
            self._quiet_needed = min(self.quiet_steps, ROLLBACK_QUIET_STEPS)
        if alert.severity is Severity.CRITICAL:
            self.state = max(self.state, IncidentState.CRITICAL, key=lambda s: s.rank)
        elif not self.state.active:
            self.state = IncidentState.OPEN
        self._quiet_since = step
        return replace(self._event(step, previous), action=action)

    def current(self, step: int) -> IncidentEvent | None:
        """The open incident as it stands at `step` (None when none is open): what a restarted
        notifier re-posts. Its `previous` is its own state (no transition happened)."""
        if not self.state.active:
            return None
        return self._event(step, self.state)

    def to_state(self) -> dict[str, Any]:
        """Where the incident stands, as plain data (a restarted watcher resumes from it)."""
        return {
            "state": self.state.value,
            "number": self.number,
            "opened_step": self._opened_step,
            "quiet_since": self._quiet_since,
        }

    def load_state(self, d: dict[str, Any]) -> None:
        self.state = IncidentState(d.get("state", IncidentState.NONE.value))
        self.number = int(d.get("number", 0))
        self._opened_step = int(d.get("opened_step", 0))
        self._quiet_since = int(d.get("quiet_since", 0))

    def _note(self, a: Alert) -> None:
        key = a.key
        self._open.add(key)
        old = self._contributors.get(key)
        c = Contributor.from_alert(a)
        if old is not None and old.severity.rank > c.severity.rank:
            c = replace(c, severity=old.severity)
        self._contributors[key] = c
        # the hint of the alert behind the worst state: a non-finite alert's beats a runaway's
        if a.hint and (self._hint is None or _state_of(a).rank > self._hint[0]):
            self._hint = (_state_of(a).rank, a.hint)

    def _event(self, step: int, previous: IncidentState) -> IncidentEvent:
        # worst first: non-finite, then critical, then warning; earliest first within each
        lost = lambda c: c.kind is AlertKind.NONFINITE and c.severity is Severity.CRITICAL  # noqa: E731
        worst = sorted(self._contributors.values(), key=lambda c: (-c.severity.rank - lost(c), c.step))
        return IncidentEvent(
            step=step,
            state=self.state,
            previous=previous,
            number=self.number,
            opened_step=self._opened_step,
            contributors=tuple(worst),
            flight_record=self._flight_record,
            hint=self._hint[1] if self._hint else None,
        )
