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

import logging
import math
import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from nummon import Alert, BaseSink, Health, NummonError, RunContext, StepRecord
from nummon._support import FleetMetrics, WatchSnapshot, require

__all__ = ["PrometheusSink", "MetricsServer", "serve_metrics", "parse_listen", "label_value", "METRICS"]

log = logging.getLogger("nummon")

#: connections /metrics serves at once (more are closed at once: a flood of clients never takes
#: the file descriptors the watcher reads logs with), and seconds a connection may sit idle
MAX_CONNECTIONS = 64
IDLE_TIMEOUT_S = 10.0

#: every series nummon exposes: name -> (type, help)
METRICS = {
    "nummon_health_state": (
        "gauge",
        "Numerical health of the latest record: 0 healthy, 1 incident, 2 extreme, 3 non-finite.",
    ),
    "nummon_incident_state": ("gauge", "The run's incident: 0 none, 1 open, 2 critical, 3 non-finite."),
    "nummon_loss": ("gauge", "Latest measured loss."),
    "nummon_grad_norm": ("gauge", "Latest measured global gradient L2 norm."),
    "nummon_headroom_decades": ("gauge", "Decades between the largest magnitude and its dtype's maximum."),
    "nummon_steps_to_overflow": (
        "gauge",
        "Steps until the nearest runaway metric overflows (absent when nothing runs away).",
    ),
    "nummon_last_step": ("gauge", "Step of the latest record."),
    "nummon_last_record_timestamp_seconds": ("gauge", "Unix time of the latest record."),
    "nummon_run_open": ("gauge", "1 while the training process's Monitor is open (PrometheusSink only)."),
    "nummon_alerts": ("counter", "Alerts raised, by kind and severity."),
    "nummon_verdicts": (
        "counter",
        "Critical steps re-run (verdict reproducible / not_reproducible) and replica mismatches, by suspect rank and host.",
    ),
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


def label_value(text: str) -> str:
    """A label value Prometheus can carry (valid UTF-8): a run folder named with bytes that are
    not UTF-8 (Python holds them as lone surrogates) keeps them as `\\xNN` escapes."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # lone surrogates that are not escaped bytes
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


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
            labels = ["run", "source"] + (
                ["kind", "severity"]
                if name == "nummon_alerts"
                else ["verdict", "suspect_rank", "suspect_host"]
                if name == "nummon_verdicts"
                else []
            )
            cls = core.CounterMetricFamily if kind == "counter" else core.GaugeMetricFamily
            fam[name] = cls(name, doc, labels=labels)

        def put(name: str, s: Any, value: Any, *extra: str) -> None:
            if value is not None:
                fam[name].add_metric([label_value(v) for v in (s.run, s.source, *extra)], float(value))

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
            for (verdict, rank, host), n in sorted(getattr(s, "verdicts", {}).items()):
                put("nummon_verdicts", s, n, verdict, rank, host)
        yield from fam.values()
        if snap.watched is not None:
            yield core.GaugeMetricFamily("nummon_watch_runs", METRICS["nummon_watch_runs"][1], value=snap.watched)
            if snap.poll_duration_s is not None and math.isfinite(snap.poll_duration_s):
                yield core.GaugeMetricFamily(
                    "nummon_watch_poll_duration_seconds",
                    METRICS["nummon_watch_poll_duration_seconds"][1],
                    value=snap.poll_duration_s,
                )
            failed = core.CounterMetricFamily(
                "nummon_notifications_failed", METRICS["nummon_notifications_failed"][1], labels=["target"]
            )
            for kind, n in sorted(snap.failed.items()):
                failed.add_metric([label_value(kind)], float(n))
            yield failed


class _Handler(BaseHTTPRequestHandler):
    """GET /metrics (or /): the exposition of the server's registry. HTTP/1.0: one request per
    connection."""

    server: _Server

    def setup(self) -> None:
        # a client silent this long is dropped (typeshed: a class variable; setup() reads the instance's)
        self.timeout = self.server.idle_timeout_s  # type: ignore[misc]
        super().setup()

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        if urlsplit(self.path).path not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is served")
            return
        try:
            body = self.server.exposition()
        except Exception as e:  # never a dead endpoint: the reason, once in the log, and a 500
            self.server.failed_once(e)
            self.send_error(500, f"{type(e).__name__}")
            return
        self.send_response(200)
        self.send_header("Content-Type", self.server.content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    """A threading HTTP server with a cap on connections served at once (those over it are
    closed as soon as accepted, so they hold no file descriptor) and an idle timeout on each."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, addr: tuple[str, int], registry: Any, max_connections: int, idle_timeout_s: float) -> None:
        self.registry = registry
        self.idle_timeout_s = idle_timeout_s
        self.refused = 0  # connections closed unserved (over the cap)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._failed = False
        pc = require("prometheus_client", "prometheus")
        self._generate, self.content_type = pc.generate_latest, pc.CONTENT_TYPE_LATEST
        super().__init__(addr, _Handler)

    def exposition(self) -> bytes:
        return self._generate(self.registry)

    def failed_once(self, e: BaseException) -> None:
        if not self._failed:
            self._failed = True
            log.warning("nummon: /metrics could not be built (%s: %s); answering 500", type(e).__name__, e)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            request.settimeout(self.idle_timeout_s)
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _server_class(host: str, port: int) -> type:
    """_Server for the address family of `host` (IPv6 literals and names included)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (OSError, UnicodeError):
        family = socket.AF_INET
    return type("_Server6", (_Server,), {"address_family": family}) if family != socket.AF_INET else _Server


class MetricsServer:
    """`/metrics` over HTTP on a thread of its own, for one `FleetMetrics`: at most
    `max_connections` served at once, each dropped after `idle_timeout_s` seconds of silence."""

    def __init__(
        self,
        metrics: FleetMetrics,
        host: str,
        port: int,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        pc = require("prometheus_client", "prometheus")
        if max_connections < 1 or not idle_timeout_s > 0:
            raise NummonError(
                f"metrics endpoint: max_connections must be >= 1 and idle_timeout_s > 0, "
                f"got {max_connections} and {idle_timeout_s}"
            )
        self.registry = pc.CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(metrics))
        try:
            self._server = _server_class(host, port)((host, port), self.registry, max_connections, idle_timeout_s)
        except OSError as e:
            raise NummonError(f"metrics endpoint {host}:{port}: {e.strerror or e}") from None
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name="nummon-metrics", daemon=True
        )
        self._thread.start()
        self.host = host
        self.port = self._server.server_port  # the OS's choice when port was 0

    @property
    def refused(self) -> int:
        """Connections closed unserved because `max_connections` were open."""
        return self._server.refused

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve_metrics(
    metrics: FleetMetrics, listen: str, max_connections: int = MAX_CONNECTIONS, idle_timeout_s: float = IDLE_TIMEOUT_S
) -> MetricsServer:
    """Serve `metrics` at `listen` (HOST:PORT; port 0 lets the OS choose)."""
    host, port = parse_listen(listen)
    return MetricsServer(metrics, host, port, max_connections, idle_timeout_s)


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
        def observe(s: Any) -> None:
            s.observe_step(record, health)
            s.count_down(record)  # the countdown follows the run between its alerts

        self._series(observe)

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
