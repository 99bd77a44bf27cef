"""Per-run health as plain numbers for Prometheus: what `nummon watch --metrics` and the training
process's `PrometheusSink` serve. Pure state (no prometheus_client): the exposition lives in
`integrations/prometheus.py`, which reads `FleetMetrics.snapshot()` at each scrape.

Cardinality is bounded: one series per run (labels `run`, `source`), one per alert kind and
severity, never one per layer."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .._core.types import Alert, AlertKind, Finding, Health, StepRecord

if TYPE_CHECKING:
    from .output import Target

__all__ = [
    "HEALTH_CODES",
    "SOURCES",
    "RunSeries",
    "FleetMetrics",
    "MetricsObserver",
    "WatchSnapshot",
    "target_kind",
    "FreshFindings",
    "countdown_now",
]

#: `nummon_health_state`: worse is higher (0 healthy, 1 incident, 2 extreme, 3 non-finite)
HEALTH_CODES = {Health.HEALTHY: 0, Health.INCIDENT: 1, Health.EXTREME: 2, Health.NONFINITE: 3}


def _finite(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def countdown_now(record: StepRecord, findings: Iterable[Finding]) -> dict[str, float]:
    """Steps to overflow per runaway metric as the detectors measured it at `record` (the
    findings they gave for it): empty when nothing runs away now, and at a non-finite record
    (the metric has overflowed or gone NaN: there is nothing left to count down)."""
    if not record.is_finite():
        return {}
    out: dict[str, float] = {}
    for f in findings:
        ov = _finite((f.details or {}).get("steps_to_overflow")) if f.kind is AlertKind.RUNAWAY else None
        if ov is not None:
            out[f.metric] = min(ov, out.get(f.metric, math.inf))
    return out


class FreshFindings:
    """The findings the detectors gave at the latest record, told apart from conditions the
    engine's lifecycle holds open from earlier records (a runaway that stopped growing but has
    not cleared, anything during a non-finite record): the lifecycle keeps the latest finding of
    each open condition, so a condition the detectors did not see again still holds the same
    object as at the record before."""

    def __init__(self) -> None:
        self._seen: dict[Any, Finding] = {}

    def __call__(self, engine: Any) -> list[Finding]:
        now = {f.key: f for f in engine.lifecycle.open_findings()}
        fresh = [f for k, f in now.items() if self._seen.get(k) is not f]
        self._seen = now
        return fresh


@dataclass
class RunSeries:
    """The latest numbers of one run. `loss` and `grad_norm` keep the last measured value (NaN
    and Inf included: Prometheus carries them); `steps_to_overflow` is the nearest overflow of
    the runaways measured at the latest record, None when nothing is running away now (growth
    stopped, the incident ended, or the latest record is non-finite)."""

    run: str
    source: str
    health: int | None = None  # of the latest record read (None: none read yet, e.g. after a restart)
    incident: int = 0  # 0 none, 1 open, 2 critical, 3 non-finite
    loss: float | None = None
    grad_norm: float | None = None
    headroom: float | None = None  # decades between the largest magnitude and the dtype's max
    last_step: int | None = None
    last_record_ts: float | None = None  # unix seconds of the latest record (read, or written)
    open: bool | None = None  # the training process is alive (PrometheusSink only: 1 while it runs)
    alerts: dict[tuple[str, str], int] = field(default_factory=dict)  # (kind, severity) -> count
    # re-run verdicts and replica mismatches: (verdict, suspect rank, suspect host) -> count
    verdicts: dict[tuple[str, str, str], int] = field(default_factory=dict)
    incidents_total: int = 0
    overflow: dict[str, float] = field(default_factory=dict)  # metric -> steps to overflow
    # PrometheusSink only (it sees alerts, not the detectors' per-record findings): metric ->
    # (step of its runaway alert, steps to overflow then, the metric's latest value)
    anchors: dict[str, tuple[int, float, float]] = field(default_factory=dict)

    @property
    def steps_to_overflow(self) -> float | None:
        return min(self.overflow.values()) if self.overflow else None

    def observe(
        self,
        record: StepRecord,
        health: Health | None,
        alerts: Iterable[Alert] = (),
        events: Iterable[Any] = (),
        now: float | None = None,
        overflow: dict[str, float] | None = None,
        incident: int | None = None,
    ) -> None:
        """One record, with what the engine concluded from it; `overflow` (the countdown per
        runaway metric at this record) and `incident` (the rank of the engine's incident now),
        when given, replace what the alerts and events would say."""
        self.observe_step(record, health, now)
        for a in alerts:
            self.observe_alert(a)
        for ev in events:
            self.observe_incident(ev)
        if overflow is not None:
            self.overflow = dict(overflow)
            self.anchors.clear()
        if incident is not None:
            self.incident = incident

    def observe_step(self, record: StepRecord, health: Health | None, now: float | None = None) -> None:
        if health is not None:
            self.health = HEALTH_CODES.get(health, 0)
        if record.loss is not None:
            self.loss = float(record.loss)
        if record.grad_norm is not None:
            self.grad_norm = float(record.grad_norm)
        if record.headroom is not None:
            self.headroom = float(record.headroom)
        self.last_step = record.step
        self.last_record_ts = time.time() if now is None else now

    def observe_alert(self, alert: Alert) -> None:
        key = (alert.kind.value, alert.severity.value)
        self.alerts[key] = self.alerts.get(key, 0) + 1
        vkey = _verdict_key(alert)
        if vkey is not None:
            self.verdicts[vkey] = self.verdicts.get(vkey, 0) + 1
        if alert.cleared:
            self.overflow.pop(alert.metric, None)
            self.anchors.pop(alert.metric, None)
            return
        ov = _finite((alert.details or {}).get("steps_to_overflow")) if alert.kind is AlertKind.RUNAWAY else None
        if ov is not None:
            self.overflow[alert.metric] = ov
            v = _finite(alert.value)
            self.anchors[alert.metric] = (alert.step, ov, v if v is not None else -math.inf)

    def count_down(self, record: StepRecord) -> None:
        """PrometheusSink: each runaway's countdown from its latest alert, less the steps since
        (the rate then held); gone at a non-finite record, once the metric stops growing, and
        at zero."""
        if not record.is_finite():
            self.overflow.clear()
            self.anchors.clear()
            return
        for metric, (step, steps, last) in list(self.anchors.items()):
            v = getattr(record, metric, None)
            if not isinstance(v, (int, float)) or record.step <= step:
                continue  # not measured at this record (or the alert's own): no news on its growth
            left = steps - (record.step - step)
            if v <= last or left <= 0:
                del self.anchors[metric]
                self.overflow.pop(metric, None)
            else:
                self.anchors[metric] = (step, steps, float(v))
                self.overflow[metric] = left

    def observe_incident(self, event: Any) -> None:
        """An `IncidentEvent` (or anything with `.state.rank`, `.state.active`, `.previous.active`)."""
        state = event.state
        self.incident = state.rank
        if state.active and not event.previous.active:
            self.incidents_total += 1
        if not state.active:
            self.overflow.clear()
            self.anchors.clear()


@dataclass(frozen=True)
class WatchSnapshot:
    """What one scrape shows: the runs, and the watcher's own numbers (None: not a watcher)."""

    runs: tuple[RunSeries, ...]
    watched: int | None = None
    poll_duration_s: float | None = None
    failed: dict[str, int] = field(
        default_factory=dict
    )  # target kind -> notifications not delivered (failed or dropped)


def target_kind(target: Target) -> str:
    """A target's label value: its kind only (webhook, alertmanager, ...), never its URL (a
    Slack webhook URL is a secret)."""
    return target.kind


class FleetMetrics:
    """Thread-safe: the watch loop (or the training thread's sink) writes, the scrape thread reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, RunSeries] = {}
        self.watched: int | None = None
        self.poll_duration_s: float | None = None
        self.targets: list[Target] = []  # notification targets (those that count their failures are read)
        self.failed_extra: dict[str, int] = {}  # failures the targets did not count themselves

    def run(self, run: str, source: str = "nummon") -> RunSeries:
        with self._lock:
            s = self._runs.get(run)
            if s is None:
                s = self._runs[run] = RunSeries(run, source)
            return s

    def update(
        self,
        run: str,
        source: str,
        record: StepRecord,
        health: Health | None,
        alerts: Iterable[Alert] = (),
        events: Iterable[Any] = (),
        now: float | None = None,
        overflow: dict[str, float] | None = None,
        incident: int | None = None,
    ) -> None:
        s = self.run(run, source)
        with self._lock:
            s.observe(record, health, alerts, events, now, overflow, incident)

    def apply(self, run: str, fn) -> None:
        """Run `fn(series)` under the lock (sinks that get steps, alerts and incidents apart)."""
        s = self.run(run)
        with self._lock:
            fn(s)

    def remove(self, run: str) -> None:
        """A retired run: its series disappear from the next scrape."""
        with self._lock:
            self._runs.pop(run, None)

    def count_failure(self, kind: str) -> None:
        with self._lock:
            self.failed_extra[kind] = self.failed_extra.get(kind, 0) + 1

    def snapshot(self) -> WatchSnapshot:
        with self._lock:
            runs = tuple(
                replace(s, alerts=dict(s.alerts), overflow=dict(s.overflow), anchors=dict(s.anchors))
                for s in self._runs.values()
            )
            failed = dict(self.failed_extra)
        for t in self.targets:
            n = t.failures()  # failed, and pushed out of a full queue: not delivered either
            if n is not None:
                k = target_kind(t)
                failed[k] = failed.get(k, 0) + n
        return WatchSnapshot(runs, self.watched, self.poll_duration_s, failed)


#: `source` label of each watch format
SOURCES = {"tensorboard": "tensorboard", "hf": "hf", "csv": "lightning", "wandb": "wandb", "jsonl": "nummon"}


class MetricsObserver:
    """The watcher's hooks (`Watcher(observer=...)`) feeding a `FleetMetrics`."""

    def __init__(self, metrics: FleetMetrics) -> None:
        self.metrics = metrics

    def run_started(self, run: Any, spec: Any) -> None:
        source = SOURCES.get(spec.format, spec.format)
        series = self.metrics.run(run.id, source)
        if series.last_record_ts is None:  # a restart: the log's own mtime is when it last grew
            from .._logs import fs

            mtimes = [st.mtime for f in spec.files if (st := fs.stat(f)) is not None and st.mtime is not None]
            if mtimes:
                self.metrics.apply(run.id, lambda s: setattr(s, "last_record_ts", max(mtimes)))
        if run.last_step is not None:
            self.metrics.apply(run.id, lambda s: setattr(s, "last_step", run.last_step))
        state = run.engine.incident_state
        self.metrics.apply(run.id, lambda s: setattr(s, "incident", state.rank))
        fresh = FreshFindings()

        def on_record(run_id: str, rec: StepRecord, got: Any) -> None:
            # every gauge from the engine as it stands after this record (the countdown of the
            # runaways measured now, the incident now), never a value frozen at an alert
            self.metrics.update(
                run_id,
                source,
                rec,
                got.health,
                got.alerts,
                got.incidents,
                overflow=countdown_now(rec, fresh(run.engine)),
                incident=run.engine.incident_state.rank,
            )

        run.on_record = on_record

    def run_retired(self, run_id: str) -> None:
        self.metrics.remove(run_id)

    def polled(self, duration_s: float, watched: int) -> None:
        self.metrics.poll_duration_s = duration_s
        self.metrics.watched = watched

    def target_failed(self, target: Target) -> None:
        if target.failures() is None:  # targets with a count of their own are read at scrape
            self.metrics.count_failure(target_kind(target))


def _verdict_key(alert: Alert) -> tuple[str, str, str] | None:
    """(verdict, suspect rank, suspect host) of a critical alert that carries a verdict (a re-run
    step) or names out-of-step replicas; "" where there is no suspect."""
    d = alert.details or {}
    if alert.cleared or alert.severity.value != "critical":
        return None
    if alert.kind is AlertKind.REPLICA_MISMATCH:
        return ("replica_mismatch", ",".join(map(str, d.get("suspect_ranks") or [])), "")
    verdict = d.get("verdict")
    if verdict not in ("reproducible", "not_reproducible"):
        return None
    suspect = d.get("suspect") or {}
    return (verdict, str(suspect.get("rank", "")), str(suspect.get("host", "")))
