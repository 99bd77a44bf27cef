"""TensorBoard sink: nummon scalars, histograms (linear and log10|x|) and alerts as text.

Needs the `tensorboard` package (``pip install 'nummon[tensorboard]'``), imported only when a
sink is created.
"""
from __future__ import annotations

import os
from typing import Any

from nummon._format import alert_text, scalar_tags
from nummon._sinks import BaseSink
from nummon._types import Alert, Health, StepRecord

from ._lazy import require

__all__ = ["TensorBoardSink"]

_HEALTH_CODE = {Health.HEALTHY: 0.0, Health.EXTREME: 1.0, Health.NONFINITE: 2.0}


class TensorBoardSink(BaseSink):
    """Writes `nummon/...` scalars every step, histograms every `histogram_every` steps (set on
    the policy's `sampling.histogram_every`; this argument overrides it when given) and alerts
    as text (`nummon/alerts`) with the flight-recorder table for critical ones."""

    wants_histograms = True

    def __init__(self, log_dir: str | os.PathLike[str], histogram_every: int | None = None, flush_secs: int = 10) -> None:
        require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.fspath(log_dir)
        self.histogram_every = histogram_every
        self.writer = SummaryWriter(log_dir=self.log_dir, flush_secs=flush_secs)

    def on_step(self, record: StepRecord, health: Health) -> None:
        w = self.writer
        for tag, value in scalar_tags(record).items():
            w.add_scalar(tag, value, global_step=record.step)
        w.add_scalar("nummon/health", health.code, global_step=record.step)

    def on_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None:
        if self.histogram_every and step % self.histogram_every:
            return
        w = self.writer
        for name, h in histograms.items():
            if h["num"] <= 0:
                continue
            w.add_histogram_raw(
                f"nummon/{name}", min=h["min"], max=h["max"], num=int(h["num"]), sum=h["sum"],
                sum_squares=h["sum_squares"], bucket_limits=h["edges"][1:].tolist(),
                bucket_counts=h["counts"].tolist(), global_step=step,
            )
            # log10|x| shows how many decades remain before the dtype overflows
            lc = h["log10_counts"]
            le = h["log10_edges"]
            w.add_histogram_raw(
                f"nummon/log10abs/{name}", min=float(le[0]), max=float(le[-1]), num=int(lc.sum()),
                sum=float((lc * (le[:-1] + le[1:]) / 2).sum()), sum_squares=float((lc * ((le[:-1] + le[1:]) / 2) ** 2).sum()),
                bucket_limits=le[1:].tolist(), bucket_counts=lc.tolist(), global_step=step,
            )

    def on_alert(self, alert: Alert) -> None:
        self.writer.add_text("nummon/alerts", alert_text(alert, markdown=True), global_step=alert.step)
        self.writer.flush()

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
