"""The detection core: detectors -> lifecycle transitions -> alerts -> incidents. Shared by
Monitor and replay (no torch)."""

from __future__ import annotations

from typing import Any

from .._core.errors import NummonError, StateError
from .._core.events import IncidentEvent
from .._core.types import Alert, AlertKind, Finding, Health, IncidentState, Severity, StepRecord
from .._policy.policy import Policy
from .detectors import MAGNITUDE_FIELDS, build_detectors, shared_values
from .hints import hint_for
from .incidents import IncidentTracker, escalated_to_critical
from .levels import ClearLevels
from .lifecycle import AlertLifecycle, Transition
from .outcome import (
    FlightRecordDue,
    StepEvidence,
    StepOutcome,
    replica_alert,
    with_cause,
    with_record_facts,
    with_recovery,
    with_verdict,
    without_verdict,
)
from .quiet import QuietPath
from .warm import WARM_FIRST, WARM_RECENT, WarmRecords

__all__ = ["Transition", "AlertLifecycle", "HealthEngine", "WARM_FIRST", "WARM_RECENT"]


class HealthEngine:
    """Runs every enabled detector over one record per step and returns the routed alerts.

    Two calls a step: `step(rec)` judges the record (a `StepOutcome` with the alerts as raised);
    `finish(judged, evidence)` completes every alert with what the torch side found and did
    (cause, verdict, recovery) and returns the step's final `StepOutcome`, naming the files due
    (a rollback starts the detectors afresh, the incident going on; a recovery action becomes an
    incident event). `state_dict()` / `load_state_dict()` carry the incident and the records
    that re-warm the detectors across a restart: `warm_first` from the run's start (the
    divergence baseline) and the `warm_recent` latest ones."""

    def __init__(
        self,
        policy: Policy,
        context: dict | None = None,
        *,
        warm_first: int = WARM_FIRST,
        warm_recent: int = WARM_RECENT,
        quiet_path: bool = True,
    ) -> None:
        self.policy = policy
        self.context = context or {}
        self.quiet_path = quiet_path  # records inside a quiet region skip the detectors (quiet.py)
        self._build_detectors()
        self.lifecycle = AlertLifecycle(policy.alerts)
        self._incidents = IncidentTracker(policy.alerts.incident_quiet_steps)
        self._warm = WarmRecords(warm_first, warm_recent)
        # clearing: a condition on a magnitude clears only once the metric is back near where it
        # stood before the condition opened (median of its last finite values then)
        self._levels = ClearLevels(MAGNITUDE_FIELDS)
        self._finite_run = 0  # finite records in a row: a non-finite condition clears at nonfinite.clear_records

    def _build_detectors(self) -> None:
        shared = shared_values(self.policy)
        self.detectors = build_detectors(self.policy, shared)
        self._samplers = _samplers(self.detectors)
        self._sampling: bool | None = None  # `_sample_next()` until a detector or the incident changes
        needs = {n for d in self.detectors for n in d.needs}
        # the shared value booked once per quiet record (the trend books the level too)
        booked = shared["trend"] if "trend" in needs else shared["level"] if "level" in needs else None
        self._quiet = QuietPath(self.detectors, booked, self.quiet_path)

    def wants_sample(self) -> bool:
        """Whether a sampled detector (attention, output logits, Adam) must confirm at the next step."""
        return any(d.wants_sample for d in self._samplers)

    @property
    def unsettled(self) -> bool:
        """Whether the last record left the quiet region toward trouble (`QuietRegion.rising`), or
        none has formed yet: the Monitor then measures the activations at the next step too."""
        q = self._quiet
        return q.on and (q.crossed or not q.formed)

    @property
    def calm(self) -> bool:
        """Whether the detectors hold a quiet region, the last record stayed in it (or left it only
        by noise) and the last sample's mechanism values held still: the probes may sample more
        sparsely (`MechanismsPolicy.due`)."""
        q = self._quiet
        return q.region is not None and not q.crossed and q.steady

    @property
    def incident_state(self) -> IncidentState:
        """Where the run's incident stands."""
        return self._incidents.state

    def current_incident(self, step: int) -> IncidentEvent | None:
        """The open incident as it stands at `step` (None when none is open), e.g. for a
        restarted notifier to re-post."""
        return self._incidents.current(step)

    def rebaseline(self) -> None:
        """Fresh detector windows and alert lifecycle (after a rollback, the history before it is
        not this run's); the incident is kept: it is what was recovered from."""
        self._build_detectors()  # (with a fresh fast path: quiet records before the rollback are dropped)
        self.lifecycle = AlertLifecycle(self.policy.alerts)
        self._warm.clear()
        self._levels.clear()
        self._finite_run = 0

    def mark_acted(self, alert: Alert) -> IncidentEvent:
        """The incident event saying what was done about it (a rollback, a recovery that gave up),
        described by `alert`'s message."""
        self._sampling = None
        return self._incidents.acted(alert.step, alert, alert.message)

    def state_dict(self) -> dict[str, Any]:
        """The incident state and the records that re-warm the detectors, as plain (strict-JSON) data."""
        self._book()
        first, history = self._warm.saved()
        return {"incident": self._incidents.to_state(), "first": first, "history": history}

    def load_state_dict(self, state: dict[str, Any], origin: str = "engine state") -> None:
        """Resume from `state_dict()`: the saved records run through the detectors again (their
        alerts are not repeated), then the incident state is restored. StateError (no state
        changed) when `state` is not such a dict."""
        try:
            # only what this engine keeps: a state saved with (or edited to) more records than
            # that re-warms from its first `warm_first` and its last `warm_recent`, not from all
            records = self._warm.parse(state.get("first"), state.get("history"), origin)
            incident = state.get("incident") or {}
            IncidentTracker(self._incidents.quiet_steps).load_state(incident)  # refused here, before any change
        except NummonError as e:  # a bad record: the message names `origin` already
            raise StateError(str(e)) from None
        except (AttributeError, TypeError, ValueError) as e:
            raise StateError(f"{origin}: not a saved engine state ({type(e).__name__}: {e})") from None
        for rec in records:
            self.step(rec)  # the contributors come back with the records
        self._book()
        self._incidents.load_state(incident)
        self._sampling = None

    def alert_for(self, step: int, t: Transition) -> Alert | None:
        """The one place alerts are built: None for transitions nobody should hear about."""
        return _alert(step, t, self.policy, self.context)

    def step(self, rec: StepRecord, replicas: Any = ()) -> StepOutcome:
        """The judged outcome of one record: its alerts as raised, its health and incident events
        (the record is frozen from here on: sinks hold it); `replicas`: the record's replica
        mismatches (`_replicas.ReplicaMismatch`), one alert. `finish` completes it."""
        rec.freeze()
        if self._quiet.takes(rec, judge=bool(replicas)):  # provably quiet: booked in bulk later
            return StepOutcome(rec.step, Health.HEALTHY, incident_state=self._incidents.state)
        self._book()
        self._quiet.judged(rec)
        self._sampling = None
        findings: list[Finding] = []
        for d in self.detectors:
            findings.extend(d.update(rec))
        finite = rec.is_finite()
        self._finite_run = self._finite_run + 1 if finite else 0
        settled = self._finite_run >= self.policy.nonfinite.clear_records
        # a non-finite record says nothing about whether growth stopped, and a record that does
        # not measure a metric (an eval-only row) says nothing about that metric's condition; a
        # non-finite condition holds until `clear_records` finite records in a row
        hold = (
            (lambda f: True)
            if not finite
            else (
                lambda f: (
                    (f.kind is AlertKind.NONFINITE and not settled)
                    or not rec.measures(f.metric)
                    or self._levels.still_high(f, rec)
                )
            )
        )
        transitions = self.lifecycle.update(rec.step, findings, hold=hold)
        self._levels.note(rec, self.lifecycle.open_findings())
        alerts = tuple(a for t in transitions if (a := self.alert_for(rec.step, t)) is not None)
        open_loud = [f for f in self.lifecycle.open_findings() if f.severity.rank >= Severity.WARNING.rank]
        events = tuple(self._incidents.update(rec.step, alerts, conditions_open=bool(open_loud)))
        self._warm.keep(rec)
        if not finite:
            health = Health.NONFINITE
        elif any(f.kind is AlertKind.EXTREME and f.severity.rank >= Severity.WARNING.rank for f in findings):
            health = Health.EXTREME
        elif self._incidents.state.active:
            health = Health.INCIDENT
        else:
            health = Health.HEALTHY
        if replicas:  # identical on every rank: every row was compared
            alerts += (replica_alert(list(replicas), self.policy.replicas.every),)
        quiet = health is Health.HEALTHY and not self.lifecycle.any_open and not self._incidents.state.active
        self._quiet.plan(rec, quiet)
        return StepOutcome(
            rec.step, health, alerts, events, incident_state=self.incident_state, look_closer=self.unsettled
        )

    def _book(self) -> None:
        """Book the quiet records taken since the last full evaluation, in order."""
        records = self._quiet.take_booked()
        if records:
            self._levels.absorb(records)
            for rec in records:
                self._warm.keep(rec)
            self._finite_run += len(records)

    def close(self, step: int) -> tuple[IncidentEvent, ...]:
        """The run ended at `step` (its last record): the incident event that ends an incident
        whose conditions had all cleared (none when one is still open or none was)."""
        self._book()
        self._sampling = None
        return tuple(self._incidents.close(step))

    def finish(self, got: StepOutcome, ev: StepEvidence) -> StepOutcome:
        """The step's final outcome: `got` (from `step`) with its alerts completed by the evidence
        (cause, verdict, what recovery did, rank, batch), its incident events (recovery's actions
        included), whether to stop, whether to sample the next step, and the files due (the run's
        first flight record, the HTML report), which the caller writes and records in it."""
        if not (got.alerts or got.incidents or ev.recovery is not None):  # a quiet step: nothing to complete
            sample, calm, state = self._sample_next(), self.calm, got.incident_state
            return StepOutcome(ev.rec.step, got.health, sample_next=sample, calm=calm, incident_state=state)
        self._sampling = None
        alerts = list(got.alerts)
        if ev.cause is not None:
            alerts = with_cause(alerts, ev.cause)
        if ev.verdict is not None:
            alerts = with_verdict(alerts, ev.verdict)
        elif ev.verdict_unavailable is not None:
            alerts = without_verdict(alerts, ev.verdict_unavailable)
        handled = False  # this step's critical alerts were handled (skip/rollback)
        if ev.recovery is not None:
            alerts, handled = with_recovery(alerts, ev.recovery), ev.recovery.handled
            if ev.recovery.rebaseline:
                self.rebaseline()
        due: list[FlightRecordDue] = []  # the file states the alert as it is before the record's facts
        stop = False
        for i, a in enumerate(alerts):
            if a.severity is Severity.CRITICAL:
                if ev.flight_record is None:
                    due.append(FlightRecordDue(i, a))
                stop = stop or (self.policy.alerts.stop_on_critical and not handled)
            alerts[i] = with_record_facts(a, ev.rec, ev.distributed)
        events = self._events(got.incidents, alerts, ev.flight_record)
        return StepOutcome(
            ev.rec.step,
            got.health,
            tuple(alerts),
            events,
            stop,
            self._sample_next(),
            calm=self.calm,
            incident_state=self.incident_state,
            flight_record_due=tuple(due),
            report_due=escalated_to_critical(events),
        )

    def _sample_next(self) -> bool:
        """Whether the next step must sample the mechanism probes: a sampled detector must confirm
        what it saw, or an incident is open (`mechanisms.during_incident`). Kept between full evaluations."""
        if self._sampling is None:
            incident = self.policy.mechanisms.during_incident and self._incidents.state.active
            self._sampling = self.wants_sample() or incident
        return self._sampling

    def _events(
        self, events: tuple[IncidentEvent, ...], alerts: list[Alert], flight_record: str | None
    ) -> tuple[IncidentEvent, ...]:
        """The step's incident events: explained, one per recovery action (rollback, budget
        spent), naming the run's flight record when it has one already."""
        out = list(events)
        why = next((a for a in alerts if (a.details or {}).get("why") and not a.cleared), None)
        if why is not None:  # the forensic explanation travels with the incident event too
            out = [e.explained(why.details["why"], why.hint) if e.state.value == "nonfinite" else e for e in out]
        for a in alerts:
            if (a.details or {}).get("recovery") in ("rollback", "gave_up"):
                out.append(self.mark_acted(a))
        if flight_record is not None:
            out = [e.with_flight_record(e.flight_record or flight_record) if e.state.active else e for e in out]
        return tuple(out)


def _samplers(detectors: list[Any]) -> list[Any]:
    """The detectors that can ask for a mechanism sample (a `wants_sample` of their own): found
    once, not by an attribute lookup per detector per step."""
    return [d for d in detectors if hasattr(type(d), "wants_sample")]


def _cleared_text(f: Finding, clear_records: int) -> str:
    """What cleared, by the name of its metric (a non-finite condition: the values that were
    non-finite, and the stretch of finite records that cleared it)."""
    if f.kind is not AlertKind.NONFINITE:
        return f"cleared: {f.kind.value} on {f.metric} is back within limits"
    d = f.details or {}
    names = ", ".join(d.get("parts") or [f.location or f.metric])
    k = clear_records
    text = f"cleared: {names} finite again, {k} finite record{'' if k == 1 else 's'} in a row"
    since, last, n = d.get("since"), d.get("last"), d.get("records")
    if isinstance(since, int) and isinstance(last, int):
        span = f"at step {since}" if since == last else f"from step {since} to step {last}"
        many = f", in {n} records" if isinstance(n, int) and n > 1 else ""
        text += f" (non-finite {span}{many})"
    return text


def _alert(step: int, t: Transition, policy: Policy, context: dict) -> Alert | None:
    """`HealthEngine.alert_for`: the alert of transition `t` at `step` (None: nobody should hear about it)."""
    f = t.finding
    if t.change == "cleared":
        if not policy.alerts.emit_cleared or t.previous is None or t.previous.rank < Severity.WARNING.rank:
            return None
        return Alert(
            step=step,
            kind=f.kind,
            severity=Severity.INFO,
            message=_cleared_text(f, policy.nonfinite.clear_records),
            metric=f.metric,
            location=f.location,
            cleared=True,
        )
    details = dict(f.details)
    if t.change == "escalated" and t.previous is not None:
        details["escalated_from"] = t.previous.value
    if t.change == "recurred":
        details["recurring"] = True
    return Alert(
        step=step,
        kind=f.kind,
        severity=f.severity,
        message=("recurring: " if t.change == "recurred" else "") + f.message,
        metric=f.metric,
        value=f.value,
        threshold=f.threshold,
        location=f.location,
        hint=hint_for(f, context),
        details=details,
    )
