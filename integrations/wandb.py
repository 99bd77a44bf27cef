"""Weights & Biases sink: metrics in sections of their own, histograms, run summary fields and
W&B alerts (Slack / e-mail).

Needs the `wandb` package (``pip install 'nummon[wandb]'``), imported only when a sink is
created. Without W&B credentials it runs offline and says once how to sync. The sections are the
groups of `nummon/_sinks/layout.py`. It never calls `wandb.watch` (whose every-step hooks cost ~1.7x a
CPU step): histograms come from nummon's own pass, at the Monitor's cadence.
"""

from __future__ import annotations

import io
import logging
import math
import os
import threading
import time
from typing import Any

from nummon import Alert, BaseSink, Health, IncidentEvent, IncidentState, NummonError, RunContext, Severity, StepRecord
from nummon._support import (
    DEFAULT_HISTOGRAM_EVERY,
    HEALTH_LEGEND,
    INCIDENT_LEGEND,
    TOP_K,
    TopOffenders,
    alert_text,
    histogram_tags,
    incident_code,
    metric_sections,
    require,
    step_scalars,
)

from ._incident_picture import IncidentPicture, warm_imports

__all__ = ["WandbSink"]

log = logging.getLogger("nummon")

_LEVEL = {Severity.INFO: "INFO", Severity.WARNING: "WARN", Severity.CRITICAL: "ERROR"}
MAX_BINS = 512  # W&B's limit for a histogram
_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")
STEP_METRIC = "nummon_step"  # the x axis of every nummon chart (the training step)
_INCIDENT_LEVEL = {0: "INFO", 1: "WARN", 2: "ERROR", 3: "ERROR"}
# run-level charts whose run summary is better as an extreme than as the last value
_SUMMARIES = {
    "nummon/health": "max",
    "nummon/incident_state": "max",
    "nummon/headroom": "min",
    "nummon/grad_norm": "max",
    "nummon/activation_max": "max",
}


def _has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = os.path.expanduser(os.environ.get("NETRC", "~/.netrc"))
    try:
        with open(netrc) as fh:
            return "api.wandb.ai" in fh.read()
    except OSError:
        return False


class WandbSink(BaseSink):
    """Logs nummon's scalars (`run.log(..., step=training step)`, sections as in TensorBoard,
    `define_metric` with the `nummon_step` step metric), histograms
    (`wandb.Histogram(np_histogram=...)`) every `histogram_every` steps (None: the policy's
    cadence, else every `DEFAULT_HISTOGRAM_EVERY`), and sends one W&B alert (Slack / e-mail) per
    incident event: opened, escalated, resolved. Alerts update the run summary
    (`nummon/alert_count`, `nummon/last_alert`; incidents: `nummon/incident`, ...); with
    `per_alert=True` each alert at or above `alert_min_severity` is a W&B alert too, throttled on
    the client to one per kind per `wait_duration` seconds (escalations always go through)."""

    wants_histograms = True

    @staticmethod
    def has_credentials() -> bool:
        """Whether an API key is at hand (WANDB_API_KEY or a netrc entry), so online logging can work."""
        return _has_credentials()

    @staticmethod
    def warm_imports() -> threading.Thread:
        """As `TensorBoardSink.warm_imports`: the incident picture's plotting library, imported now."""
        return warm_imports()

    def __init__(
        self,
        run: Any = None,
        project: str = "nummon",
        alert_min_severity: str | Severity = "warning",
        wait_duration: float = 300.0,
        histograms: bool = True,
        histogram_every: int | None = None,
        top_k: int = TOP_K,
        per_alert: bool = False,
        **init_kwargs: Any,
    ) -> None:
        wandb = require("wandb", "wandb")
        self._wandb = wandb
        self.alert_min_severity = Severity(alert_min_severity)
        self.per_alert = per_alert  # also a W&B alert per alert (default: one per incident event)
        self.wait_duration = float(wait_duration)
        self.histograms = histograms
        self.histogram_every = histogram_every if histograms else 0
        self.top = TopOffenders(top_k)
        self.incident_state = IncidentState.NONE
        self._incident_events = 0
        self._alert_count = 0
        self._owns_run = False
        self.offline = False
        if run is None:
            run = wandb.run
        if run is None:
            run = self._init_run(wandb, project, init_kwargs)
            self._owns_run = True
        self.run = run
        self._last_sent: dict[str, tuple[float, int]] = {}
        self.sent_alerts: list[tuple[str, str, str]] = []  # (title, level, text) actually sent
        self.picture = IncidentPicture()  # the drawn values of the last steps, for the incident picture

    def _init_run(self, wandb: Any, project: str, init_kwargs: dict[str, Any]) -> Any:
        """A run of our own: offline (said once) when there are no credentials to go online."""
        mode = init_kwargs.pop("mode", None) or os.environ.get("WANDB_MODE") or None
        if mode is not None and mode not in _MODES:
            raise NummonError(f"W&B mode {mode!r} is not one of {', '.join(_MODES)} (from WANDB_MODE or mode=)")
        if mode in (None, "online", "run") and not _has_credentials():
            if mode is not None:
                log.warning(
                    "nummon: W&B mode %r needs an API key (WANDB_API_KEY or `wandb login`); running offline", mode
                )
            mode = "offline"
        self.offline = mode in ("offline", "dryrun")
        env_mode = os.environ.pop("WANDB_MODE", None)  # an explicit mode wins over the environment's
        try:
            run = wandb.init(project=project, mode=mode, **init_kwargs)
        finally:
            if env_mode is not None:
                os.environ["WANDB_MODE"] = env_mode
        if self.offline:
            log.warning(
                "nummon: W&B is offline; sync later with `wandb sync %s`", self.run_dir_of(run) or "wandb/offline-run-*"
            )
        return run

    @staticmethod
    def run_dir_of(run: Any) -> str | None:
        """A run's own folder (`.../offline-run-<date>-<id>`): its `dir` without the `/files` tail."""
        d = getattr(run, "dir", None)
        return os.path.dirname(d.rstrip("/")) if d else None

    @property
    def run_dir(self) -> str | None:
        return self.run_dir_of(self.run)

    @property
    def default_histogram_every(self) -> int:
        """The cadence the Monitor uses when neither the policy nor this sink sets one (0: none)."""
        return DEFAULT_HISTOGRAM_EVERY if self.histogram_every is None else 0

    def bind(self, context: RunContext) -> None:
        try:  # the legends of the health and incident charts, where people look for them
            self.run.config.update(
                {"nummon/health_legend": HEALTH_LEGEND, "nummon/incident_legend": INCIDENT_LEGEND},
                allow_val_change=True,
            )
        except Exception:  # a run that refuses config updates still gets the metrics
            pass
        try:  # one section per group, every chart over the training step
            self.run.define_metric(STEP_METRIC, hidden=True)
            for pattern in (*metric_sections(), "nummon_hist_*"):
                self.run.define_metric(pattern, step_metric=STEP_METRIC)
            for name, summary in _SUMMARIES.items():
                self.run.define_metric(name, step_metric=STEP_METRIC, summary=summary)
        except Exception:  # an old wandb without define_metric: default sections, same data
            log.debug("nummon: W&B define_metric failed", exc_info=True)

    def on_step(self, record: StepRecord, health: Health | None) -> None:
        data: dict[str, Any] = step_scalars(record, health, self.incident_state)
        data.update(self.top.update(record))
        data[STEP_METRIC] = record.step
        self.run.log(data, step=record.step)
        self._log_incident_media(self.picture.keep(record))

    def on_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None:
        if self.histogram_every == 0 or (self.histogram_every and step % self.histogram_every):
            return
        H = self._wandb.Histogram
        data: dict[str, Any] = {STEP_METRIC: step}
        for name, h in histograms.items():
            linear_tag, log_tag = histogram_tags(name)
            counts, edges = h["counts"][:MAX_BINS], h["edges"][: MAX_BINS + 1]
            data[linear_tag] = H(np_histogram=(counts.tolist(), edges.tolist()))
            lc, le = h["log10_counts"][:MAX_BINS], h["log10_edges"][: MAX_BINS + 1]
            data[log_tag] = H(np_histogram=(lc.tolist(), le.tolist()))
        self.run.log(data, step=step)

    def _summarise(self, fields: dict[str, Any]) -> None:
        try:
            self.run.summary.update(fields)
        except Exception:  # a summary that cannot be written never stops the alerts
            log.debug("nummon: W&B summary update failed", exc_info=True)

    def on_incident(self, event: IncidentEvent) -> None:
        """An incident event (nummon/_engine/incidents.py): run summary fields and one W&B alert."""
        self._incident_events += 1
        self.incident_state = event.state
        code = incident_code(event.state)
        state = str(getattr(event.state, "value", event.state))
        self._summarise(
            {
                "nummon/incident": state,
                "nummon/incident_step": event.step,
                "nummon/incident_title": event.title,
                "nummon/incident_events": self._incident_events,
                "nummon/incident_number": getattr(event, "number", self._incident_events),
            }
        )
        title, text, level = event.title[:63], event.summary(), _INCIDENT_LEVEL.get(code, "WARN")
        self.run.alert(title=title, text=text, level=level, wait_duration=1)
        self.sent_alerts.append((title, level, text))
        self._log_incident_media(self.picture.note(event))

    def _log_incident_media(self, due: list[tuple[IncidentEvent, Any]]) -> None:
        """For each incident event that took its incident to critical or non-finite (`due`, from
        the IncidentPicture): the incident picture (`nummon/incident_picture`, a wandb.Image)
        and the HTML report the Monitor wrote for it (`nummon/incident_report`, a wandb.Html,
        passed through unchanged: it is self-contained), at the event's step, or at the last step
        logged when that is later (W&B drops a step lower than its last)."""
        try:
            for event, image in due:
                media: dict[str, Any] = {}
                if image is not None:
                    media["nummon/incident_picture"] = self._wandb.Image(image, caption=event.title)
                html = _read_report(getattr(event, "report", None))
                if html is not None:
                    media["nummon/incident_report"] = self._wandb.Html(io.StringIO(html), inject=False)
                if media:
                    step = max(event.step, self.picture.steps[-1][0] if self.picture.steps else event.step)
                    self.run.log({**media, STEP_METRIC: event.step}, step=step)
        except Exception as e:  # media are never worth a failed training step
            log.warning("nummon: W&B incident picture failed (%s: %s)", type(e).__name__, e)

    def on_alert(self, alert: Alert) -> None:
        self._alert_count += 1
        self._summarise({"nummon/alert_count": self._alert_count, "nummon/last_alert": str(alert)})
        if not self.per_alert or alert.severity.rank < self.alert_min_severity.rank:
            return  # incident events are the notifications: one per opened / escalated / resolved incident
        key = alert.kind.value  # one message per kind: several metrics of one runaway are one event
        now = time.monotonic()
        last = self._last_sent.get(key)
        # W&B throttles only on its server (and not at all offline): throttle here too
        if last is not None and now - last[0] < self.wait_duration and alert.severity.rank <= last[1]:
            return
        self._last_sent[key] = (now, alert.severity.rank)
        title = alert.title[:63]
        text = alert_text(alert)
        level = _LEVEL[alert.severity]
        self.run.alert(title=title, text=text, level=level, wait_duration=max(1, int(math.ceil(self.wait_duration))))
        self.sent_alerts.append((title, level, text))

    def close(self) -> None:
        self._log_incident_media(self.picture.flush())
        if self._owns_run:
            self.run.finish()
            # finish() can return before an offline run file is complete; teardown waits for it
            if self._wandb.run is None:
                self._wandb.teardown()


def _read_report(path: str | None) -> str | None:
    """The HTML report at `path` (None when there is none or it cannot be read)."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return None
