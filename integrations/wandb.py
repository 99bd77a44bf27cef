"""Weights & Biases sink: metrics, histograms and W&B alerts (Slack / e-mail).

Needs the `wandb` package (``pip install 'nummon[wandb]'``), imported only when a sink is
created. Without W&B credentials it runs offline and says once how to sync.
"""
from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

from nummon._errors import NummonError
from nummon._format import alert_text, scalar_tags
from nummon._sinks import BaseSink, RunContext
from nummon._types import HEALTH_LEGEND, Alert, Health, Severity, StepRecord

from ._lazy import require

__all__ = ["WandbSink"]

log = logging.getLogger("nummon")

_LEVEL = {Severity.INFO: "INFO", Severity.WARNING: "WARN", Severity.CRITICAL: "ERROR"}
MAX_BINS = 512  # W&B's limit for a histogram
_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")


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
    """Logs nummon's scalars (`run.log(..., step=training step)`), histograms
    (`wandb.Histogram(np_histogram=...)`), and sends `run.alert` for alerts at or above
    `alert_min_severity`, throttled on the client to one per kind per `wait_duration`
    seconds (escalations always go through)."""

    wants_histograms = True

    def __init__(
        self,
        run: Any = None,
        project: str = "nummon",
        alert_min_severity: str | Severity = "warning",
        wait_duration: float = 300.0,
        histograms: bool = True,
        **init_kwargs: Any,
    ) -> None:
        wandb = require("wandb", "wandb")
        self._wandb = wandb
        self.alert_min_severity = Severity(alert_min_severity)
        self.wait_duration = float(wait_duration)
        self.histograms = histograms
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

    def _init_run(self, wandb: Any, project: str, init_kwargs: dict[str, Any]) -> Any:
        """A run of our own: offline (said once) when there are no credentials to go online."""
        mode = init_kwargs.pop("mode", None) or os.environ.get("WANDB_MODE") or None
        if mode is not None and mode not in _MODES:
            raise NummonError(f"W&B mode {mode!r} is not one of {', '.join(_MODES)} (from WANDB_MODE or mode=)")
        if mode in (None, "online", "run") and not _has_credentials():
            if mode is not None:
                log.warning("nummon: W&B mode %r needs an API key (WANDB_API_KEY or `wandb login`); running offline", mode)
            mode = "offline"
        self.offline = mode in ("offline", "dryrun")
        env_mode = os.environ.pop("WANDB_MODE", None)  # an explicit mode wins over the environment's
        try:
            run = wandb.init(project=project, mode=mode, **init_kwargs)
        finally:
            if env_mode is not None:
                os.environ["WANDB_MODE"] = env_mode
        if self.offline:
            log.warning("nummon: W&B is offline; sync later with `wandb sync %s`", self.run_dir_of(run) or "wandb/offline-run-*")
        return run

    @staticmethod
    def run_dir_of(run: Any) -> str | None:
        """A run's own folder (`.../offline-run-<date>-<id>`): its `dir` without the `/files` tail."""
        d = getattr(run, "dir", None)
        return os.path.dirname(d.rstrip("/")) if d else None

    @property
    def run_dir(self) -> str | None:
        return self.run_dir_of(self.run)

    def bind(self, context: RunContext) -> None:
        try:  # the legend of the health chart, where people look for it
            self.run.config.update({"nummon/health_legend": HEALTH_LEGEND}, allow_val_change=True)
        except Exception:  # a run that refuses config updates still gets the metrics
            pass

    def on_step(self, record: StepRecord, health: Health | None) -> None:
        data: dict[str, Any] = {k: v for k, v in scalar_tags(record).items()}
        if health is not None:
            data["nummon/health"] = health.code
        self.run.log(data, step=record.step)

    def on_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None:
        if not self.histograms:
            return
        H = self._wandb.Histogram
        data = {}
        for name, h in histograms.items():
            counts, edges = h["counts"][:MAX_BINS], h["edges"][: MAX_BINS + 1]
            data[f"nummon/hist/{name}"] = H(np_histogram=(counts.tolist(), edges.tolist()))
            lc, le = h["log10_counts"][:MAX_BINS], h["log10_edges"][: MAX_BINS + 1]
            data[f"nummon/log10abs/{name}"] = H(np_histogram=(lc.tolist(), le.tolist()))
        self.run.log(data, step=step)

    def on_alert(self, alert: Alert) -> None:
        if alert.severity.rank < self.alert_min_severity.rank:
            return
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
        if self._owns_run:
            self.run.finish()
            # finish() can return before an offline run file is complete; teardown waits for it
            if self._wandb.run is None:
                self._wandb.teardown()
