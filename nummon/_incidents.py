"""Incidents: one run-level state machine over the alerts, so people get one message when a run
goes bad, one when it gets worse, one when it is lost and one when it recovers.

Pure (no torch, no I/O). `IncidentTracker.update` takes each step's alerts and returns the
`IncidentEvent`s of the transitions it made; notification sinks send those, while logs keep
every alert.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Any, Iterable

from ._format import cut_at_word
from ._functional import fmt_num
from ._json import json_float
from ._types import Alert, AlertKind, Severity

__all__ = ["IncidentState", "Contributor", "IncidentEvent", "IncidentTracker", "TITLE_MAX", "SUMMARY_MAX"]

TITLE_MAX = 63  # W&B alert titles must stay under 64 characters
SUMMARY_MAX = 999  # and texts under 1000


class IncidentState(str, enum.Enum):
    """Where the run's incident stands, mildest first."""

    NONE = "none"  # no incident yet
    OPEN = "open"  # a warning: something is going wrong
    CRITICAL = "critical"  # a critical alert: the run needs action now
    NONFINITE = "nonfinite"  # non-finite values: the run is lost unless a scaler skipped the step
    RESOLVED = "resolved"  # quiet for the policy's quiet period after an incident

    @property
    def active(self) -> bool:
        return self in (IncidentState.OPEN, IncidentState.CRITICAL, IncidentState.NONFINITE)

    @property
    def rank(self) -> int:
        return {IncidentState.OPEN: 1, IncidentState.CRITICAL: 2, IncidentState.NONFINITE: 3}.get(self, 0)

    def __str__(self) -> str:
        return self.value


def _state_of(alert: Alert) -> IncidentState:
    if alert.severity is Severity.CRITICAL:
        return IncidentState.NONFINITE if alert.kind is AlertKind.NONFINITE else IncidentState.CRITICAL
    return IncidentState.OPEN


@dataclass(frozen=True)
class Contributor:
    """One condition behind an incident, as its latest alert described it."""

    step: int
    kind: AlertKind
    severity: Severity
    metric: str
    value: float | None = None
    growth: float | None = None  # total growth factor over the streak (runaway)
    rate_per_step: float | None = None  # geometric growth per step (runaway)
    steps_to_overflow: float | None = None
    location: str | None = None
    rank: int | None = None
    overflow_bound: bool = False  # steps_to_overflow is an upper bound (the growth rate is rising)

    @classmethod
    def from_alert(cls, a: Alert) -> "Contributor":
        d = a.details or {}
        num = lambda k: float(d[k]) if isinstance(d.get(k), (int, float)) else None  # noqa: E731
        return cls(a.step, a.kind, a.severity, a.metric, a.value, num("growth"), num("rate_per_step"),
                   num("steps_to_overflow"), a.location, a.rank, bool(d.get("overflow_bound")))

    def line(self) -> str:
        """One Markdown list item."""
        parts = [f"**{self.severity.value}** {self.kind.value} `{self.metric}`"]
        if self.value is not None:
            parts.append(f"= {fmt_num(self.value)}")
        if self.rate_per_step is not None:
            parts.append(f"(x{self.rate_per_step:.3g}/step")
            ov = self.steps_to_overflow
            if ov is not None and math.isfinite(ov):
                n = max(1, round(ov))
                parts[-1] += f", {'at most ' if self.overflow_bound else ''}~{n} step{'' if n == 1 else 's'} to overflow)"
            else:
                parts[-1] += ")"
        if self.location:
            parts.append(f"at {self.location}")
        if self.rank is not None:
            parts.append(f"on rank {self.rank}")
        return "- " + " ".join(parts) + f" (step {self.step})"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step": self.step, "kind": self.kind.value, "severity": self.severity.value, "metric": self.metric}
        for k in ("value", "growth", "rate_per_step", "steps_to_overflow", "location", "rank"):
            v = getattr(self, k)
            if v is not None:
                d[k] = json_float(v) if isinstance(v, float) else v
        return d


_HEADLINE = {
    IncidentState.OPEN: "run unstable",
    IncidentState.CRITICAL: "run critical",
    IncidentState.NONFINITE: "run lost: non-finite values",
    IncidentState.RESOLVED: "run recovered",
}


@dataclass(frozen=True)
class IncidentEvent:
    """One transition of the run's incident: opened, escalated, or resolved."""

    step: int
    state: IncidentState
    previous: IncidentState
    number: int  # 1 for the run's first incident, 2 for the next after a resolution, ...
    opened_step: int
    contributors: tuple[Contributor, ...] = ()  # worst first
    flight_record: str | None = None
    hint: str | None = None
    action: str | None = None  # what nummon did about it (recovery), e.g. "rolled back to step 50, ..."
    explanation: str | None = None  # why the first non-finite value appeared (forensics: operator, line, cause)

    @property
    def title(self) -> str:
        """A short title naming the state (under 64 characters)."""
        if self.action:
            return cut_at_word(f"nummon: {self.action}", TITLE_MAX)
        head = _HEADLINE.get(self.state, self.state.value)
        if self.contributors and self.state in (IncidentState.OPEN, IncidentState.CRITICAL):
            c = self.contributors[0]
            head += f": {c.kind.value} in {c.metric}"
        return cut_at_word(f"nummon: {head}", TITLE_MAX)

    def summary(self) -> str:
        """A short Markdown summary (fits Slack and W&B alert texts: under 1000 characters)."""
        if self.action:
            head = f"Incident {self.number} at step {self.step}: {self.action}. Now **{self.state.value}**."
        elif self.state is IncidentState.RESOLVED:
            head = (f"Incident {self.number} (opened at step {self.opened_step}) resolved at step {self.step}: "
                    "no open condition and no new alert since.")
        else:
            verb = "opened" if not self.previous.active else f"escalated from {self.previous.value}"
            head = f"Incident {self.number} {verb} at step {self.step}: **{self.state.value}**."
        tail = []
        if self.explanation and self.state is not IncidentState.RESOLVED:
            tail.append(f"- why: {self.explanation}")
        if self.flight_record:
            tail.append(f"- flight record: `{self.flight_record}`")
        if self.hint and self.state is not IncidentState.RESOLVED:
            tail.append(f"- try: {self.hint}")
        lines = [head]
        budget = SUMMARY_MAX - len(head) - sum(len(t) + 1 for t in tail) - 40
        shown = 0
        for c in self.contributors:
            item = c.line()
            if len(item) + 1 > budget:
                break
            lines.append(item)
            budget -= len(item) + 1
            shown += 1
        if shown < len(self.contributors):
            lines.append(f"- … and {len(self.contributors) - shown} more")
        text = "\n".join(lines + tail)
        return text if len(text) <= SUMMARY_MAX else text[: SUMMARY_MAX - 1] + "…"

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "state": self.state.value,
            "previous": self.previous.value,
            "number": self.number,
            "opened_step": self.opened_step,
            "title": self.title,
            "contributors": [c.to_dict() for c in self.contributors],
            "flight_record": self.flight_record,
            "hint": self.hint,
            **({"action": self.action} if self.action else {}),
            **({"explanation": self.explanation} if self.explanation else {}),
        }

    def with_flight_record(self, path: str | None) -> "IncidentEvent":
        """This event naming a flight record written after it was made."""
        return replace(self, flight_record=path)

    def explained(self, explanation: str, hint: str | None) -> "IncidentEvent":
        """This event with the forensic explanation of its non-finite step (and its remedy)."""
        return replace(self, explanation=explanation, hint=hint or self.hint)


class IncidentTracker:
    """The run-level state machine: none/resolved -> open (warning) -> critical -> nonfinite,
    and back to resolved after ``quiet_steps`` steps with no open condition and no alert (the
    count starts at the last alert, a "cleared" one included).

    A condition counts as open from its warning/critical alert until its "cleared" alert; the
    engine may also say directly whether any condition is still open (``conditions_open``).
    """

    def __init__(self, quiet_steps: int) -> None:
        self.quiet_steps = quiet_steps
        self.state = IncidentState.NONE
        self.number = 0
        self._opened_step = 0
        self._quiet_since = 0  # last step with an alert or an open condition
        self._open: set[tuple[str, str, str]] = set()
        self._contributors: dict[tuple[str, str, str], Contributor] = {}
        self._hint: tuple[int, str] | None = None  # (state rank, hint) of the worst alert with one
        self._flight_record: str | None = None

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
                self._open.discard(_key(a))
        loud = [a for a in alerts if not a.cleared and a.severity.rank >= Severity.WARNING.rank]
        previous = self.state
        if loud:
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
        self._flight_record = flight_record or next((a.flight_record for a in alerts if a.flight_record), None) or self._flight_record
        still_open = bool(self._open) if conditions_open is None else conditions_open
        if alerts or still_open:
            self._quiet_since = step
        if self.state.active and step - self._quiet_since >= self.quiet_steps:
            self.state = IncidentState.RESOLVED
            self._open.clear()
        if self.state is previous:
            return []
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
        return {"state": self.state.value, "number": self.number, "opened_step": self._opened_step,
                "quiet_since": self._quiet_since}

    def load_state(self, d: dict[str, Any]) -> None:
        self.state = IncidentState(d.get("state", IncidentState.NONE.value))
        self.number = int(d.get("number", 0))
        self._opened_step = int(d.get("opened_step", 0))
        self._quiet_since = int(d.get("quiet_since", 0))

    def _note(self, a: Alert) -> None:
        key = _key(a)
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


def _key(a: Alert) -> tuple[str, str, str]:
    return (a.kind.value, a.metric, a.location or "")
