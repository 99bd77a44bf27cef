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

from nummon._format import alert_text, scalar_tags
from nummon._sinks import BaseSink
from nummon._types import Alert, Health, Severity, StepRecord

from ._lazy import require

__all__ = ["WandbSink"]

log = logging.getLogger("nummon")

_LEVEL = {Severity.INFO: "INFO", Severity.WARNING: "WARN", Severity.CRITICAL: "ERROR"}
MAX_BINS = 512  # W&B's limit for a histogram


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
            mode = os.environ.get("WANDB_MODE") or init_kwargs.pop("mode", None)
            if mode is None and not _has_credentials():
                mode = "offline"
            if mode == "offline":
                self.offline = True
            run = wandb.init(project=project, mode=mode, **init_kwargs)
            self._owns_run = True
            if self.offline:
                log.warning("nummon: W&B is offline (no credentials); sync later with `wandb sync %s`", run.dir.rsplit("/files", 1)[0] if getattr(run, "dir", None) else "wandb/offline-run-*")
        self.run = run
        self._last_sent: dict[str, tuple[float, int]] = {}
        self.sent_alerts: list[tuple[str, str, str]] = []  # (title, level, text) actually sent

    @property
    def run_dir(self) -> str | None:
        d = getattr(self.run, "dir", None)
        return d.rsplit("/files", 1)[0] if d else None

    def on_step(self, record: StepRecord, health: Health) -> None:
        data: dict[str, Any] = {k: v for k, v in scalar_tags(record).items()}
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
