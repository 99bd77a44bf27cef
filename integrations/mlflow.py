"""MLflow sink: nummon's step metrics in the run under ``nummon/``, and every incident visible in
the run's tags and artifacts.

Needs the `mlflow` package (``pip install 'nummon[mlflow]'``), imported only when a sink is
created. Metrics go out in batches (``MlflowClient.log_batch``, at most 1,000 values a call), never
one request per metric per step; like every sink it runs on its own thread behind the dispatcher's
bounded queue, so a slow or unreachable tracking server delays only itself: creating the sink
and the Monitor asks the server nothing (the run is looked up or created, and its first tags
written, on the sink's thread, with the first batch). Step records whose metrics the server did
not take (a failed batch, or what the sink still held when close gave up on it) are counted in
`Monitor.sink_stats` as dropped.

MLflow's UI hides a metric whose last value is NaN and stores +-inf as +-1.797e308, a value that
ruins a chart. A non-finite value is therefore never logged into its metric: ``nummon/loss``
holds finite values only, and ``nummon/nonfinite/loss`` marks each step where the loss was NaN
(1), +inf (2) or -inf (-2). `nummon replay`, `watch` and `report` over ``mlflow:`` read the
marker back as that value.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import threading
import time
from typing import Any

from nummon import (
    Alert,
    AlertKind,
    BaseSink,
    Health,
    IncidentEvent,
    IncidentState,
    NummonError,
    RunContext,
    Severity,
    StepRecord,
)
from nummon._support import TOP_K, TopOffenders, nonfinite_marker, require, step_scalars

__all__ = ["MlflowSink"]

log = logging.getLogger("nummon")

#: MLflow's limit of metrics in one log_batch call.
BATCH_LIMIT = 1000
#: The worst state first: what the `nummon.state` tag says (a run's worst moment, not its last).
_STATES = ("healthy", "incident", "critical", "nonfinite")
_STATE_OF_INCIDENT = {
    IncidentState.OPEN: "incident",
    IncidentState.CRITICAL: "critical",
    IncidentState.NONFINITE: "nonfinite",
}


def nonfinite_code(v: float) -> float:
    """The value of a non-finite marker: NaN 1, +inf 2, -inf -2."""
    return 1.0 if math.isnan(v) else math.copysign(2.0, v)


def metric_key(tag: str) -> str:
    """A step_scalars tag under the ``nummon/`` prefix: nummon/loss stays, nummon_more/x ->
    nummon/more/x, nummon_layers_grad_norm/fc1 -> nummon/layers_grad_norm/fc1."""
    if tag.startswith("nummon/"):
        return tag
    return "nummon/" + (tag[len("nummon_") :] if tag.startswith("nummon_") else tag)


class MlflowSink(BaseSink):
    """Logs the step scalars and top offenders as MLflow metrics (``nummon/...``, step = training
    step) every `batch_steps` steps, and per incident event sets the run's ``nummon.*`` tags
    (``nummon.state``: the worst of healthy / incident / critical / nonfinite; ``nummon.incident``:
    the open incident's title; ``nummon.first_nonfinite``: where the first non-finite value
    appeared) and writes the incident's text as an artifact (``nummon/incident-<n>-<step>.md``);
    flight records are uploaded under ``nummon/flight-records``. A non-finite value goes to the
    marker ``nummon/nonfinite/<stat>`` (NaN 1, +inf 2, -inf -2), never into its chartable series.

    The run: `run_id`, else MLflow's active run, else a new one in `experiment` (created on the
    sink's thread before its first write, `run_id` None until then, and ended at close). `tracking_uri`: the server (default: MLflow's own resolution, MLFLOW_TRACKING_URI).
    """

    def __init__(
        self,
        run_id: str | None = None,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        batch_steps: int = 10,
        top_k: int = TOP_K,
    ) -> None:
        mlflow = require("mlflow", "mlflow")
        if batch_steps < 1:
            raise NummonError(f"MlflowSink: batch_steps must be >= 1 (got {batch_steps})")
        from mlflow.entities import Metric, RunTag
        from mlflow.tracking import MlflowClient

        self._Metric, self._RunTag = Metric, RunTag
        active = mlflow.active_run() if run_id is None else None
        if active is not None:
            run_id = active.info.run_id
            tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        self.client = MlflowClient(tracking_uri)  # no request yet: the server is first asked on the sink's thread
        self._owns_run = run_id is None
        self._experiment, self._run_name = experiment or "nummon", run_name
        self.run_id: str | None = run_id  # None until the sink's thread has created the run
        self.batch_steps = int(batch_steps)
        self.top = TopOffenders(top_k)
        self.state = "healthy"
        self.incident_state = IncidentState.NONE
        self._rank = 0
        self._pending: list[list[Any]] = []  # the metrics of each step record not yet sent
        self._lock = threading.Lock()  # guards the counts below: sink_stats reads them on another thread
        self._in_flight = 0  # step records of the batch being sent
        self._lost = 0  # step records whose batch the server did not take
        self._started = False
        self._first_nonfinite: str | None = None
        self._incidents = 0
        self._tags: dict[str, str] = {}
        self._closed = False
        self.batches_sent = 0  # log_batch calls with metrics

    def _run(self) -> str:
        """The run's id, creating the run (and writing its first tags) on first use: always on
        the sink's thread, never in the constructor or `bind` (the training thread)."""
        if self.run_id is None:
            exp = self.client.get_experiment_by_name(self._experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(self._experiment)
            self.run_id = self.client.create_run(exp_id, run_name=self._run_name).info.run_id
        if not self._started:
            first = {"nummon.state": self.state, "nummon.rank": str(self._rank)}
            self.client.log_batch(self.run_id, tags=[self._RunTag(k, v) for k, v in first.items()])
            self._tags.update(first)
            self._started = True
        return self.run_id

    @property
    def url(self) -> str | None:
        """The run's page, when the tracking URI is a server."""
        uri = str(self.client.tracking_uri or "")
        if not uri.startswith(("http://", "https://")) or self.run_id is None:
            return None
        run = self.client.get_run(self.run_id)
        return f"{uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{self.run_id}"

    def bind(self, context: RunContext) -> None:
        self._rank = context.rank  # written with the first tags, on the sink's thread

    def on_step(self, record: StepRecord, health: Health | None) -> None:
        now = int(time.time() * 1000)
        data = step_scalars(record, health, self.incident_state)
        data.update(self.top.update(record))
        metrics = []
        for tag, value in data.items():
            v, key = float(value), metric_key(tag)
            if not math.isfinite(v):  # the chartable series stays finite; the marker says what was there
                key, v = nonfinite_marker(key), nonfinite_code(v)
            metrics.append(self._Metric(key, v, now, int(record.step)))
        with self._lock:
            self._pending.append(metrics)
        if len(self._pending) >= self.batch_steps:
            self.flush()

    def on_alert(self, alert: Alert) -> None:
        if alert.kind is AlertKind.NONFINITE and alert.severity is Severity.CRITICAL and self._first_nonfinite is None:
            self._first_nonfinite = alert.location or alert.metric
            self._set_tags(
                {"nummon.first_nonfinite": self._first_nonfinite, "nummon.first_nonfinite_step": str(alert.step)}
            )
        path = getattr(alert, "flight_record", None)
        if path and os.path.isfile(str(path)):
            self.client.log_artifact(self._run(), str(path), "nummon/flight-records")

    def on_incident(self, event: IncidentEvent) -> None:
        self._incidents += 1
        self.incident_state = event.state
        state = _STATE_OF_INCIDENT.get(event.state)
        if state is not None and _STATES.index(state) > _STATES.index(self.state):
            self.state = state
        tags = {
            "nummon.state": self.state,
            "nummon.incident_state": str(getattr(event.state, "value", event.state)),
            "nummon.incident": event.title,
            "nummon.incident_step": str(event.step),
        }
        run_id = self._run()
        self._set_tags(tags)
        report = getattr(event, "report", None)
        if report and os.path.isfile(str(report)):  # the HTML incident page as of this event
            self.client.log_artifact(run_id, str(report), "nummon")
        number = getattr(event, "number", self._incidents)
        self.client.log_text(run_id, event.summary(), f"nummon/incident-{number}-step{event.step}.md")
        if self.state in ("critical", "nonfinite"):
            self.flush()  # the charts up to the critical moment are in the run before anything else

    def _set_tags(self, tags: dict[str, str]) -> None:
        changed = {k: v[:5000] for k, v in tags.items() if self._tags.get(k) != v}
        if changed:
            self.client.log_batch(self._run(), tags=[self._RunTag(k, v) for k, v in changed.items()])
            self._tags.update(changed)

    def flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._in_flight = len(batch)
        if not batch:
            return
        metrics = [m for step in batch for m in step]
        ends = [0] * len(batch)  # where each step record's metrics end in `metrics`
        total = 0
        for i, step in enumerate(batch):
            total += len(step)
            ends[i] = total
        sent = 0
        try:
            run_id = self._run()
            for i in range(0, len(metrics), BATCH_LIMIT):
                self.client.log_batch(run_id, metrics=metrics[i : i + BATCH_LIMIT])
                self.batches_sent += 1
                sent = min(i + BATCH_LIMIT, len(metrics))
                with self._lock:  # the step records whose metrics are all in
                    self._in_flight = len(batch) - bisect.bisect_right(ends, sent)
        except BaseException:
            with self._lock:
                self._lost += len(batch) - bisect.bisect_right(ends, sent)
                self._in_flight = 0
            raise
        with self._lock:
            self._in_flight = 0

    def undelivered(self, final: bool = False) -> int:
        """Step records whose metrics the server did not take; `final` (close gave up on this
        sink): those still held or being sent too."""
        with self._lock:
            return self._lost + ((len(self._pending) + self._in_flight) if final else 0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        self._set_tags({"nummon.state": self.state})
        if self._owns_run:
            self.client.set_terminated(self._run(), "FAILED" if self.state == "nonfinite" else "FINISHED")
