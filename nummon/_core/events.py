"""Incident events and the step report: what the health engine tells people about a run.

`Contributor` (one condition behind an incident), `IncidentEvent` (one transition of the run's
incident, with its Markdown title and summary) and `StepReport` (what `Monitor.post_step` returns).
Plain data, no torch; the state machine that makes the events is `_incidents`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from .alert_text import SUMMARY_MAX, TITLE_MAX, value_text
from .json import json_float
from .text import cut_at_word
from .types import Alert, AlertKind, Health, IncidentState, Severity, StepRecord

__all__ = ["Contributor", "IncidentEvent", "StepReport"]


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
    # (if it keeps speeding up, at today's rate) in steps, while the alert cannot tell them apart
    steps_to_overflow_range: tuple[float, float] | None = None
    value_text: str | None = None  # the value with its name and unit (see `value_text`)

    @classmethod
    def from_alert(cls, a: Alert) -> Contributor:
        d = a.details or {}
        num = lambda k: float(d[k]) if isinstance(d.get(k), (int, float)) else None  # noqa: E731
        return cls(
            a.step,
            a.kind,
            a.severity,
            a.metric,
            a.value,
            num("growth"),
            num("rate_per_step"),
            num("steps_to_overflow"),
            a.location,
            a.rank,
            bool(d.get("overflow_bound")),
            _range(d.get("steps_to_overflow_range")),
            value_text(a.kind, a.metric, a.value, d, a.location),
        )

    def line(self) -> str:
        """One Markdown list item."""
        parts = [f"**{self.severity.value}** {self.kind.value}:"]
        said = self.value_text or value_text(self.kind, self.metric, self.value, location=self.location)
        parts.append(said if said else f"`{self.metric}`")
        if self.rate_per_step is not None:
            parts.append(f"(x{self.rate_per_step:.3g}/step")
            ov = self.steps_to_overflow
            if ov is not None and math.isfinite(ov):
                n = max(1, round(ov))
                bound = "at most " if self.overflow_bound else ""  # the alert's own qualifier
                rng = self.steps_to_overflow_range
                if rng is not None and max(1, round(rng[0])) < max(1, round(rng[1])):
                    # the headline alone would drop the other reading the alert names
                    left = f"~{max(1, round(rng[0]))}-{max(1, round(rng[1]))} steps"
                else:
                    left = f"~{n} step{'' if n == 1 else 's'}"
                parts[-1] += f", {bound}{left} to overflow)"
            else:
                parts[-1] += ")"
        if self.location and self.location not in (said or ""):
            parts.append(f"at {self.location}")
        if self.rank is not None:
            parts.append(f"on rank {self.rank}")
        return "- " + " ".join(parts) + f" (step {self.step})"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "step": self.step,
            "kind": self.kind.value,
            "severity": self.severity.value,
            "metric": self.metric,
        }
        for k in ("value", "growth", "rate_per_step", "steps_to_overflow", "location", "rank"):
            v = getattr(self, k)
            if v is not None:
                d[k] = json_float(v) if isinstance(v, float) else v
        if self.steps_to_overflow_range is not None:
            d["steps_to_overflow_range"] = [json_float(x) for x in self.steps_to_overflow_range]
        return d


def _range(v: Any) -> tuple[float, float] | None:
    """An alert's `steps_to_overflow_range` detail as a (low, high) pair, or None."""
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v):
        return float(v[0]), float(v[1])
    return None


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
    reopened: int | None = None  # re-opened: the step at which every condition had cleared before this alert
    report: str | None = None  # path of the HTML incident report written for it (nummon report)

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
            head = (
                f"Incident {self.number} (opened at step {self.opened_step}) resolved at step {self.step}: "
                "no open condition and no new alert since."
            )
        elif self.reopened is not None:
            head = (
                f"Incident {self.number} re-opened at step {self.step}: **{self.state.value}** again "
                f"(its conditions had cleared at step {self.reopened})."
            )
        else:
            verb = "opened" if not self.previous.active else f"escalated from {self.previous.value}"
            head = f"Incident {self.number} {verb} at step {self.step}: **{self.state.value}**."
        tail = []
        if self.explanation and self.state is not IncidentState.RESOLVED:
            tail.append(f"- why: {self.explanation}")
        if self.flight_record:
            tail.append(f"- flight record: `{self.flight_record}`")
        if self.report:
            tail.append(f"- report: `{self.report}`")
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
            **({"reopened": self.reopened} if self.reopened is not None else {}),
            **({"report": self.report} if self.report else {}),
        }

    def with_flight_record(self, path: str | None) -> IncidentEvent:
        """This event naming a flight record written after it was made."""
        return replace(self, flight_record=path)

    def explained(self, explanation: str, hint: str | None) -> IncidentEvent:
        """This event with the forensic explanation of its non-finite step (and its remedy)."""
        return replace(self, explanation=explanation, hint=hint or self.hint)


@dataclass(frozen=True)
class StepReport:
    """What `Monitor.post_step` returns."""

    step: int
    health: Health | None  # None only while `pending`
    alerts: tuple[Alert, ...] = ()
    should_stop: bool = False
    record: StepRecord | None = None
    pending: bool = False  # lagged (CUDA) mode: this step's statistics are still on their way
    incidents: tuple[IncidentEvent, ...] = ()  # this step's incident transitions (opened, escalated, resolved)

    @property
    def warned(self) -> bool:
        return any(a.severity.rank >= Severity.WARNING.rank for a in self.alerts)
