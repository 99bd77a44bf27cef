"""Prometheus: per-run training health on a ``/metrics`` endpoint, scraped by Prometheus.

`PrometheusSink("HOST:PORT")` serves the run of the training process it is in (rank 0 under
torch.distributed); `nummon watch --metrics HOST:PORT` serves every watched run through
`serve_metrics`. Both expose the same series (`METRICS`), built at each scrape from nummon's
plain per-run state (`nummon/_watch/metrics.py`): a retired run's series are gone at the next
scrape, and there is never a per-layer series.

Needs the `prometheus-client` package (``pip install 'nummon[prometheus]'``), imported only
when a server starts.
"""
from __future__ import annotations

import math
import os
import threading
from typing import Any, Iterator

from nummon._errors import NummonError
from nummon._sinks import BaseSink, RunContext
from nummon._types import Alert, Health, StepRecord
from nummon._watch.metrics import FleetMetrics, WatchSnapshot

from ._lazy import require

__all__ = ["PrometheusSink", "MetricsServer", "serve_metrics", "parse_listen", "METRICS"]

#: every series nummon exposes: name -> (type, help)
METRICS = {
    "nummon_health_state": ("gauge", "Numerical health of the latest record: 0 healthy, 1 incident, 2 extreme, 3 non-finite."),
    "nummon_incident_state": ("gauge", "The run's incident: 0 none, 1 open, 2 critical, 3 non-finite."),
    "nummon_loss": ("gauge", "Latest measured loss."),
    "nummon_grad_norm": ("gauge", "Latest measured global gradient L2 norm."),
    "nummon_headroom_decades": ("gauge", "Decades between the largest magnitude and its dtype's maximum."),
    "nummon_steps_to_overflow": ("gauge", "Steps until the nearest runaway metric overflows (absent when nothing runs away)."),
    "nummon_last_step": ("gauge", "Step of the latest record."),
    "nummon_last_record_timestamp_seconds": ("gauge", "Unix time of the latest record."),
    "nummon_run_open": ("gauge", "1 while the training process's Monitor is open (PrometheusSink only)."),
    "nummon_alerts": ("counter", "Alerts raised, by kind and severity."),
    "nummon_incidents": ("counter", "Incidents opened."),
    "nummon_watch_runs": ("gauge", "Runs the watcher follows."),
    "nummon_watch_poll_duration_seconds": ("gauge", "Wall time of the watcher's latest pass over its runs."),
    "nummon_notifications_failed": ("counter", "Notifications a target could not deliver, by target kind."),
}


def parse_listen(spec: str) -> tuple[str, int]:
    """`HOST:PORT` (or `:PORT`, meaning 0.0.0.0) as (host, port); NummonError naming a bad one."""
    host, sep, port = spec.rpartition(":")
    try:
        if not sep:
            raise ValueError
        p = int(port)
        if not 0 <= p < 65536:
            raise ValueError
    except ValueError:
        raise NummonError(f"{spec!r}: expected HOST:PORT, e.g. 0.0.0.0:9464") from None
    return (host.strip("[]") or "0.0.0.0"), p


class _Collector:
    """Builds the metric families from a snapshot at each scrape."""

    def __init__(self, metrics: FleetMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []  # families are built at each scrape (runs come and go)

    def collect(self) -> Iterator[Any]:
        core = require("prometheus_client.core", "prometheus")
        snap: WatchSnapshot = self.metrics.snapshot()
        fam = {}
        for name, (kind, doc) in METRICS.items():
            if name.startswith("nummon_watch") or name == "nummon_notifications_failed":
                continue
            labels = ["run", "source"] + (["kind", "severity"] if name == "nummon_alerts" else [])
            cls = core.CounterMetricFamily if kind == "counter" else core.GaugeMetricFamily
            fam[name] = cls(name, doc, labels=labels)

        def put(name: str, s: Any, value: Any, *extra: str) -> None:
            if value is not None:
                fam[name].add_metric([s.run, s.source, *extra], float(value))

        for s in snap.runs:
            put("nummon_health_state", s, s.health)
            put("nummon_incident_state", s, s.incident)
            put("nummon_loss", s, s.loss)
            put("nummon_grad_norm", s, s.grad_norm)
            put("nummon_headroom_decades", s, s.headroom)
            put("nummon_steps_to_overflow", s, s.steps_to_overflow)
            put("nummon_last_step", s, s.last_step)
            put("nummon_last_record_timestamp_seconds", s, s.last_record_ts)
            put("nummon_run_open", s, None if s.open is None else int(s.open))
            put("nummon_incidents", s, s.incidents_total)
            for (kind, severity), n in sorted(s.alerts.items()):
                put("nummon_alerts", s, n, kind, severity)
        yield from fam.values()
        if snap.watched is not None:
            yield core.GaugeMetricFamily("nummon_watch_runs", METRICS["nummon_watch_runs"][1], value=snap.watched)
            if snap.poll_duration_s is not None and math.isfinite(snap.poll_duration_s):
                yield core.GaugeMetricFamily("nummon_watch_poll_duration_seconds",
                                             METRICS["nummon_watch_poll_duration_seconds"][1], value=snap.poll_duration_s)
            failed = core.CounterMetricFamily("nummon_notifications_failed", METRICS["nummon_notifications_failed"][1],
                                              labels=["target"])
            for kind, n in sorted(snap.failed.items()):
                failed.add_metric([kind], float(n))
            yield failed


class MetricsServer:
    """`/metrics` over HTTP on a thread of its own, for one `FleetMetrics`."""

    def __init__(self, metrics: FleetMetrics, host: str, port: int) -> None:
        pc = require("prometheus_client", "prometheus")
        self.registry = pc.CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(metrics))
        try:
            self._server, self._thread = pc.start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise NummonError(f"metrics endpoint {host}:{port}: {e.strerror or e}") from None
        self.host = host
        self.port = self._server.server_port  # the OS's choice when port was 0

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve_metrics(metrics: FleetMetrics, listen: str) -> MetricsServer:
    """Serve `metrics` at `listen` (HOST:PORT; port 0 lets the OS choose)."""
    host, port = parse_listen(listen)
    return MetricsServer(metrics, host, port)


class PrometheusSink(BaseSink):
    """Serves this training run's health at ``http://HOST:PORT/metrics`` (rank 0 only under
    torch.distributed), for jobs that Prometheus scrapes directly (a Kubernetes pod).

    `run`: the `run` label (default: the run folder's name, else the process id). The endpoint
    starts when the Monitor binds the sink and stops at `close()`; until then, and after,
    nothing listens. `nummon_run_open` is 1 while the Monitor is open, so a rule can tell a
    hung process (open, no new record) from a finished one."""

    def __init__(self, listen: str = "0.0.0.0:9464", run: str | None = None) -> None:
        require("prometheus_client", "prometheus")
        self.listen = listen
        self.host, self.port = parse_listen(listen)
        self.run = run
        self.metrics = FleetMetrics()
        self.server: MetricsServer | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str | None:
        """The endpoint's URL once serving (None before bind, on other ranks, and after close)."""
        return self.server.url if self.server is not None else None

    def bind(self, context: RunContext) -> None:
        if context.rank != 0:
            return  # one endpoint per job: rank 0 sees the same decisions as every rank
        if self.run is None:
            self.run = context.run_dir.name if context.run_dir is not None else f"pid{os.getpid()}"
        self.metrics.run(self.run, "nummon").open = True
        with self._lock:
            if self.server is None:
                self.server = MetricsServer(self.metrics, self.host, self.port)

    def _series(self, fn) -> None:
        if self.run is not None:
            self.metrics.apply(self.run, fn)

    def on_step(self, record: StepRecord, health: Health) -> None:
        self._series(lambda s: s.observe_step(record, health))

    def on_alert(self, alert: Alert) -> None:
        self._series(lambda s: s.observe_alert(alert))

    def on_incident(self, event: Any) -> None:
        self._series(lambda s: s.observe_incident(event))

    def close(self) -> None:
        self._series(lambda s: setattr(s, "open", False))
        with self._lock:
            server, self.server = self.server, None
        if server is not None:
            server.close()
