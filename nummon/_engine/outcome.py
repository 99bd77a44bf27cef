"""What the engine concludes from one step, once the torch side has said what it found and did.

The engine judges a record first (`HealthEngine.step`: a `StepOutcome` with the alerts as the
detectors raised them); the Monitor then gathers the evidence only torch can give (the cause of
a non-finite value, a re-run's verdict, what recovery did) as plain data in `StepEvidence`, and
`HealthEngine.finish` turns both into the final `StepOutcome`: every alert with its final text and
details, the incident events, the directives for the next step, the stop decision and the files
due (the run's first flight record, the HTML report). Every alert of a step is built here or in
`HealthEngine.alert_for` (pure: no torch, no files: the Monitor writes the files due and records
their paths with `StepOutcome.with_flight_record` / `with_report`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._core.events import IncidentEvent
from .._core.types import Alert, AlertKind, Health, IncidentState, Severity, StepRecord

__all__ = [
    "FlightRecordDue",
    "FlightRecordRef",
    "RecoveryAction",
    "RecoveryReport",
    "StepEvidence",
    "StepOutcome",
    "recovery_alert",
    "replica_alert",
    "rerun_due",
    "with_cause",
    "with_verdict",
    "without_verdict",
]


@dataclass(frozen=True)
class FlightRecordRef:
    """A flight record written for an alert: its path, the steps it holds and the last records."""

    path: str
    steps: list[int]
    recent: list[dict[str, Any]]


@dataclass(frozen=True)
class RecoveryAction:
    """One thing recovery did, as data: `action` is skip, retry, skips_warning, rollback or
    gave_up; `facts` the numbers its alert states."""

    action: str
    step: int
    kind: AlertKind
    facts: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RecoveryReport:
    """What recovery did about one record."""

    actions: tuple[RecoveryAction, ...] = ()  # in the order they were taken
    handled: bool = False  # its critical alerts were handled (update skipped, or rolled back): no need to stop
    rebaseline: bool = False  # the health engine must start its detectors afresh (a rollback happened)
    covered: bool = False  # the skipped update covered the step's non-finite values (the weights never saw them)
    entries: tuple[dict[str, Any], ...] = ()  # the entries this record added to `Recovery.log`


@dataclass(frozen=True)
class StepEvidence:
    """What the torch side found and did at one step, handed to `HealthEngine.finish`."""

    rec: StepRecord
    cause: Any = None  # the NonfiniteReport explaining this step's first non-finite value
    verdict: Any = None  # the re-run's Verdict
    verdict_unavailable: str | None = None  # why no verdict could be given
    recovery: RecoveryReport | None = None
    distributed: bool = False  # alerts name the rank of the record
    flight_record: str | None = None  # the run's flight record, when one was written already


@dataclass(frozen=True)
class FlightRecordDue:
    """A critical alert the run's first flight record is due for: `alert` as the file states it
    (before the record's rank and batch facts), `index` its place in the outcome's alerts."""

    index: int
    alert: Alert


@dataclass(frozen=True)
class StepOutcome:
    """Everything decided about one step: what to send, what to do next, which files to write.

    `HealthEngine.step` gives the judged outcome (alerts as raised, nothing decided yet about
    stopping, sampling or files); `HealthEngine.finish` the final one."""

    step: int
    health: Health
    alerts: tuple[Alert, ...] = ()  # final: text, details, flight record, rank
    incidents: tuple[IncidentEvent, ...] = ()  # acted-on ones included
    stop: bool = False  # a critical alert nobody handled, under alerts.stop_on_critical
    sample_next: bool = False  # sample the mechanism probes at the next step
    # the detectors hold a quiet region and this record did not rise out of it: the mechanism
    # probes may sample more sparsely (`MechanismsPolicy.due`, `HealthEngine.calm`)
    calm: bool = False
    flight_record: str | None = None  # the flight record written at this step (None when none)
    incident_state: IncidentState = IncidentState.NONE  # the run's incident after this step (charted at it)
    # the run has no flight record yet and this step raised critical alerts: one is written for
    # the first of them whose write succeeds
    flight_record_due: tuple[FlightRecordDue, ...] = ()
    report_due: bool = False  # an incident went critical at this step: the HTML report is written
    # the record rose well out of its quiet band, or the detectors are still warming up: measure the
    # activations at the next step too (`HealthEngine.unsettled`)
    look_closer: bool = False

    @property
    def critical(self) -> bool:
        return any(a.severity is Severity.CRITICAL for a in self.alerts)

    @property
    def detail_on(self) -> bool:
        """An incident is open: watch every module's output from the next step."""
        return self.incident_state.active

    def with_flight_record(self, due: FlightRecordDue, ref: FlightRecordRef) -> StepOutcome:
        """This outcome once `ref` was written for `due`: its alert and the open incident's
        events name it, with the trajectory it holds."""
        alerts = list(self.alerts)
        final = alerts[due.index]
        # its details in the order they always had: the flight record's before the record's facts
        named = with_flight_record(due.alert, ref)
        alerts[due.index] = dataclasses.replace(
            final, flight_record=ref.path, details={**named.details, **final.details}
        )
        incidents = tuple(
            e.with_flight_record(e.flight_record or ref.path) if e.state.active else e for e in self.incidents
        )
        return dataclasses.replace(
            self, alerts=tuple(alerts), incidents=incidents, flight_record=ref.path, flight_record_due=()
        )

    def with_report(self, path: str) -> StepOutcome:
        """This outcome once the HTML report was written to `path`: the open incident's events name it
        (the console line, webhook and TensorBoard text show it)."""
        incidents = tuple(dataclasses.replace(e, report=path) if e.state.active else e for e in self.incidents)
        return dataclasses.replace(self, incidents=incidents, report_due=False)


def rerun_due(alerts: Sequence[Alert]) -> bool:
    """A step is re-run for a verdict when it raised a critical alert (every non-finite step does)."""
    return any(a.severity is Severity.CRITICAL and not a.cleared for a in alerts)


def replica_alert(found: Sequence[Any], every: int) -> Alert:
    """One critical alert for a step's replica mismatches (`_replicas.ReplicaMismatch`), identical on every rank."""
    step = found[0].step
    suspects = sorted({r for m in found for r in m.suspects})
    text = "; ".join(m.text() for m in found)
    return Alert(
        step=step,
        kind=AlertKind.REPLICA_MISMATCH,
        severity=Severity.CRITICAL,
        metric="replica_fingerprint",
        value=float(len(suspects)),
        rank=suspects[0] if found[0].majority and len(suspects) == 1 else None,
        threshold=0.0,
        location=", ".join(m.family for m in found),
        message=(
            f"replicas differ at step {step} (bit-pattern fingerprints after the gradient all-reduce, "
            f"checked every {every} steps): {text}; data-parallel replicas must be bit-identical, so "
            "this is silent data corruption or a rank that computed differently"
        ),
        hint=(
            f"drain and replace the node of rank(s) {', '.join(map(str, suspects))} and resume from the last "
            "checkpoint; do not lower the LR (the model is not at fault)"
        ),
        details={
            "suspect_ranks": suspects,
            "families": {m.family: {"suspects": list(m.suspects), "fingerprints": list(m.fingerprints)} for m in found},
            "majority": None if not found[0].majority else list(found[0].majority),
        },
    )


def with_cause(alerts: Sequence[Alert], report: Any) -> list[Alert]:
    """The non-finite alerts saying why (message), what to do (hint) and carrying the report."""
    return [
        dataclasses.replace(
            a,
            message=f"{a.message}; why: {report}",
            hint=report.remedy,
            details={**a.details, "cause": report.to_dict(), "why": report.headline()},
        )
        if a.kind is AlertKind.NONFINITE and not a.cleared
        else a
        for a in alerts
    ]


def with_verdict(alerts: Sequence[Alert], v: Any) -> list[Alert]:
    """The step's critical alerts carrying the re-run's verdict (details, message, hint)."""
    out = []
    for a in alerts:
        if a.severity is Severity.CRITICAL and not a.cleared:
            hint = a.hint
            if not v.reproducible:
                hint = (
                    f"transient fault on {v.where()}: re-run or resume the step; if it recurs on this rank, "
                    "drain and replace the node (do not lower the LR)"
                )
            details = {**a.details, "verdict": v.verdict, "verdict_evidence": v.to_dict()}
            if not v.reproducible:
                details["suspect"] = {"rank": v.rank, "host": v.host, "device": v.device}
            a = dataclasses.replace(a, message=f"{a.message}; {v.sentence()}", hint=hint, details=details)
        out.append(a)
    return out


def without_verdict(alerts: Sequence[Alert], why: str) -> list[Alert]:
    """The step's critical alerts saying why no verdict could be given."""
    return [
        dataclasses.replace(a, details={**a.details, "verdict_unavailable": why})
        if a.severity is Severity.CRITICAL and not a.cleared
        else a
        for a in alerts
    ]


def covered(a: Alert) -> Alert:
    """A critical non-finite alert whose update recovery skipped: the weights never saw it."""
    if a.kind is not AlertKind.NONFINITE or a.severity is not Severity.CRITICAL:
        return a
    return dataclasses.replace(
        a,
        severity=Severity.INFO,
        message=a.message + " (this step's update was skipped: weights and optimizer state untouched)",
        details={**a.details, "recovery": "skip", "original_severity": "critical"},
    )


def rollback_message(f: Mapping[str, Any]) -> str:
    """The sentence saying where a rollback went, what it did to the LR and why."""
    to = "the start (before step 0)" if f["to_step"] < 0 else f"step {f['to_step']}"
    left = f["rollbacks_left"]
    lr_text = f"lr {f['lr_before'][0]:.4g} -> {f['lr_after'][0]:.4g}"
    if f.get("verdict") == "not_reproducible":
        lr_text = f"lr kept at {f['lr_after'][0]:.4g} (a transient fault: the step's failure did not repeat on re-run)"
    return f"recovered: rolled back to {to}, {lr_text} (cause: {f['cause']}; {left} rollback{'s' if left != 1 else ''} left)"


@dataclass(frozen=True)
class _RecoveryAlertRow:
    """How one kind of recovery action reads as an alert. The alert's kind is the action's; its
    message is a `str.format` template over the action's facts and `step`, or a function of the
    facts; `value` and `threshold` name the facts they are (as floats)."""

    severity: Severity
    metric: str
    location: str
    message: str | Callable[[Mapping[str, Any]], str]
    tag: str  # details["recovery"]: what recovery did
    details: tuple[str, ...] | None = ()  # the facts the details repeat after the tag (None: all of them)
    value: str | None = None
    threshold: str | None = None


_RECOVERY_ALERTS: dict[str, _RecoveryAlertRow] = {
    "skip": _RecoveryAlertRow(
        Severity.INFO,
        "grad_norm",
        "optimizer.step",
        "recovered: skipped the update of step {step}: {reason}; weights and optimizer state untouched, gradients zeroed",
        tag="skip",
        details=("skips",),
        value="grad_norm",
        threshold="limit",
    ),
    "retry": _RecoveryAlertRow(
        Severity.INFO,
        "recovery",
        "optimizer.step",
        "recovered: retried the update of step {step} from its re-run (loss {rerun_loss:.6g}, finite): the failure "
        "did not repeat, a transient fault on {suspect}; lr unchanged",
        tag="retry",
        details=("verdict", "suspect"),
        value="rerun_loss",
    ),
    "skips_warning": _RecoveryAlertRow(
        Severity.WARNING,
        "grad_norm",
        "optimizer.step",
        "{skips} updates skipped in the last {window} steps (recovery.max_skips {max_skips}): the gradients keep going bad",
        tag="skip",
        value="skips",
        threshold="max_skips",
    ),
    "rollback": _RecoveryAlertRow(
        Severity.WARNING,
        "recovery",
        "model and optimizer state",
        rollback_message,
        tag="rollback",
        details=None,
        value="to_step",
    ),
    # critical: the run stops as it would without recovery (even if a cooldown kept other alerts quiet)
    "gave_up": _RecoveryAlertRow(
        Severity.CRITICAL,
        "recovery",
        "model and optimizer state",
        "not recovered: {cause}, and {why}",
        tag="gave_up",
        details=("rollbacks",),
    ),
}
TERMINAL = frozenset({"rollback", "gave_up"})  # actions taken after the step's own alerts were judged


def recovery_alert(act: RecoveryAction) -> Alert:
    """The alert that says what recovery did (one row of `_RECOVERY_ALERTS` filled in)."""
    row, f = _RECOVERY_ALERTS[act.action], act.facts
    message = row.message.format(step=act.step, **f) if isinstance(row.message, str) else row.message(f)
    names = [k for k in f if k != "flight_record"] if row.details is None else row.details
    return Alert(
        step=act.step,
        kind=act.kind,
        severity=row.severity,
        metric=row.metric,
        value=_fact(f, row.value),
        threshold=_fact(f, row.threshold),
        location=row.location,
        message=message,
        details={"recovery": row.tag, **{k: f[k] for k in names}},
        flight_record=f.get("flight_record"),  # a rollback's own flight record, once written
    )


def _fact(facts: Mapping[str, Any], name: str | None) -> float | None:
    """The named fact as a float (None: no such column, or the fact is None)."""
    v = None if name is None else facts[name]
    return None if v is None else float(v)


def with_recovery(alerts: Sequence[Alert], report: RecoveryReport) -> list[Alert]:
    """The step's alerts, then recovery's own in the order it acted (a covered step's critical
    non-finite alerts turned to info before the rollback or give-up that ends it)."""
    out = list(alerts) + [recovery_alert(a) for a in report.actions if a.action not in TERMINAL]
    if report.covered:
        out = [covered(a) for a in out]
    return out + [recovery_alert(a) for a in report.actions if a.action in TERMINAL]


def with_record_facts(a: Alert, rec: StepRecord, distributed: bool) -> Alert:
    """An alert naming its rank, its batch's fingerprint and worst samples (from the record)."""
    if distributed and a.rank is None and rec.rank is not None:
        a = dataclasses.replace(a, rank=rec.rank)
    if rec.fingerprint and not a.cleared:  # "failed again with identical inputs" is evidence
        a = dataclasses.replace(a, details={**a.details, "batch_fingerprint": rec.fingerprint})
    if rec.sample_loss_top and not a.cleared:  # the batch that did it: which samples, how far out
        a = dataclasses.replace(
            a,
            details={
                **a.details,
                "worst_samples": list(rec.sample_loss_top),
                "sample_loss_max_over_mean": rec.sample_loss_ratio,
            },
        )
    return a


def with_flight_record(a: Alert, ref: FlightRecordRef) -> Alert:
    """An alert naming the flight record written for it, with the trajectory it holds."""
    details = {**a.details, "flight_record_steps": ref.steps, "recent": ref.recent}
    return dataclasses.replace(a, flight_record=ref.path, details=details)
