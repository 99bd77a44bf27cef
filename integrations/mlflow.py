"""MLflow sink: nummon's step metrics in the run under ``nummon/``, and every incident visible in
the run's tags and artifacts.

Needs the `mlflow` package (``pip install 'nummon[mlflow]'``), imported only when a sink is
created. Metrics go out in batches (``MlflowClient.log_batch``, at most 1,000 values a call), never
one request per metric per step; like every sink it runs on its own thread behind the dispatcher's
bounded queue, so a slow or unreachable tracking server delays only itself.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from nummon._errors import NummonError
from nummon._events import IncidentEvent
from nummon._layout import TOP_K, TopOffenders, step_scalars
from nummon._lazy import require
from nummon._sinks import BaseSink, RunContext
from nummon._types import Alert, AlertKind, Health, IncidentState, Severity, StepRecord

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
    flight records are uploaded under ``nummon/flight-records``.

    The run: `run_id`, else MLflow's active run, else a new one in `experiment` (started here and
    ended at close). `tracking_uri`: the server (default: MLflow's own resolution, MLFLOW_TRACKING_URI).
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
        self.client = MlflowClient(tracking_uri)
        self._owns_run = run_id is None
        if run_id is None:
            name = experiment or "nummon"
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        self.run_id = run_id
        self.batch_steps = int(batch_steps)
        self.top = TopOffenders(top_k)
        self.state = "healthy"
        self.incident_state = IncidentState.NONE
        self._pending: list[Any] = []
        self._steps_pending = 0
        self._first_nonfinite: str | None = None
        self._incidents = 0
        self._tags: dict[str, str] = {}
        self._closed = False
        self.batches_sent = 0  # log_batch calls with metrics

    @property
    def url(self) -> str | None:
        """The run's page, when the tracking URI is a server."""
        uri = str(self.client.tracking_uri or "")
        if not uri.startswith(("http://", "https://")):
            return None
        run = self.client.get_run(self.run_id)
        return f"{uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{self.run_id}"

    def bind(self, context: RunContext) -> None:
        self._set_tags({"nummon.state": self.state, "nummon.rank": str(context.rank)})

    def on_step(self, record: StepRecord, health: Health | None) -> None:
        now = int(time.time() * 1000)
        data = step_scalars(record, health, self.incident_state)
        data.update(self.top.update(record))
        for tag, value in data.items():
            v = float(value)
            self._pending.append(self._Metric(metric_key(tag), v, now, int(record.step)))
        self._steps_pending += 1
        if self._steps_pending >= self.batch_steps:
            self.flush()

    def on_alert(self, alert: Alert) -> None:
        if alert.kind is AlertKind.NONFINITE and alert.severity is Severity.CRITICAL and self._first_nonfinite is None:
            self._first_nonfinite = alert.location or alert.metric
            self._set_tags(
                {"nummon.first_nonfinite": self._first_nonfinite, "nummon.first_nonfinite_step": str(alert.step)}
            )
        path = getattr(alert, "flight_record", None)
        if path and os.path.isfile(str(path)):
            self.client.log_artifact(self.run_id, str(path), "nummon/flight-records")

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
        self._set_tags(tags)
        report = getattr(event, "report", None)
        if report and os.path.isfile(str(report)):  # the HTML incident page as of this event
            self.client.log_artifact(self.run_id, str(report), "nummon")
        number = getattr(event, "number", self._incidents)
        self.client.log_text(self.run_id, event.summary(), f"nummon/incident-{number}-step{event.step}.md")
        if self.state in ("critical", "nonfinite"):
            self.flush()  # the charts up to the critical moment are in the run before anything else

    def _set_tags(self, tags: dict[str, str]) -> None:
        changed = {k: v[:5000] for k, v in tags.items() if self._tags.get(k) != v}
        if changed:
            self.client.log_batch(self.run_id, tags=[self._RunTag(k, v) for k, v in changed.items()])
            self._tags.update(changed)

    def flush(self) -> None:
        pending, self._pending, self._steps_pending = self._pending, [], 0
        for i in range(0, len(pending), BATCH_LIMIT):
            self.client.log_batch(self.run_id, metrics=pending[i : i + BATCH_LIMIT])
            self.batches_sent += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        self._set_tags({"nummon.state": self.state})
        if self._owns_run:
            self.client.set_terminated(self.run_id, "FAILED" if self.state == "nonfinite" else "FINISHED")
