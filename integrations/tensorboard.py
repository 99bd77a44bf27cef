"""TensorBoard sink: nummon's run-level charts, per-layer groups, log10 companions, histograms
(linear and log10|x|), a custom-scalars layout, and every alert and incident event as text, and the incident picture (an image, `_incident_picture.py`)
at each step an incident reaches critical or goes non-finite.

Needs the `tensorboard` package (``pip install 'nummon[tensorboard]'``), imported only when a
sink is created. The tags and groups are described in `nummon/_sinks/layout.py`.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from nummon import Alert, BaseSink, Health, IncidentEvent, IncidentState, RunContext, StepRecord
from nummon._support import (
    DEFAULT_HISTOGRAM_EVERY,
    HEALTH_LEGEND,
    INCIDENT_LEGEND,
    LAYER_METRICS,
    TOP_K,
    VIEWS_LEGEND,
    TopOffenders,
    alert_tag,
    alert_text,
    custom_scalars_layout,
    histogram_tags,
    incident_tag,
    linear_histogram_readable,
    require,
    state_range_scalars,
    step_scalars,
)

from ._incident_picture import IncidentPicture, warm_imports

__all__ = ["TensorBoardSink", "PICTURE_TAG"]

log = logging.getLogger("nummon")

PICTURE_TAG = "nummon/incident_picture"  # an image at each step an incident reaches critical / non-finite


class TensorBoardSink(BaseSink):
    """Writes nummon's scalars every step (at most 12 run-level charts in the `nummon` group,
    per-layer series in groups of their own), histograms every `histogram_every` steps, and each
    alert and incident event as a text entry of its own.

    `histogram_every`: None follows the policy's `sampling.histogram_every`, or, when that is 0,
    draws histograms every `DEFAULT_HISTOGRAM_EVERY` steps (500; step 0 included); 0 turns them
    off for this sink; N draws them every N steps. `top_k`: layers in the "top offenders" charts.
    """

    wants_histograms = True

    @staticmethod
    def warm_imports() -> threading.Thread:
        """Start importing the incident picture's plotting library (matplotlib, about 0.8 s on one
        core) in a daemon thread now, where a picture is expected soon and a core is idle."""
        return warm_imports()

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        histogram_every: int | None = None,
        flush_secs: int = 10,
        writer: Any = None,
        top_k: int = TOP_K,
    ) -> None:
        """Give `log_dir` for a writer of its own, or `writer` (a `SummaryWriter`, e.g. Lightning's
        `TensorBoardLogger.experiment`) to write into an existing run's event files."""
        if writer is None:
            if log_dir is None:
                raise TypeError("TensorBoardSink needs a log_dir or a writer")
            require("tensorboard", "tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=os.fspath(log_dir), flush_secs=flush_secs)
            self._owns_writer = True
        else:
            self._owns_writer = False
        self.writer = writer
        self.log_dir = os.fspath(log_dir) if log_dir is not None else getattr(writer, "log_dir", None)
        self.histogram_every = histogram_every
        self.top = TopOffenders(top_k)
        self.incident_state = IncidentState.NONE
        self._layout_written = False
        self._layers_in_layout = False  # the layout names the layer groups once a step has layers
        self._texts = 0  # sequence number of alert and incident text entries
        self.picture = IncidentPicture()  # the drawn values of the last steps, for the incident picture

    @property
    def default_histogram_every(self) -> int:
        """The cadence the Monitor uses when neither the policy nor this sink sets one (0: none)."""
        return DEFAULT_HISTOGRAM_EVERY if self.histogram_every is None else 0

    def _write_layout(self) -> None:
        if not self._layout_written:
            self._layout_written = True
            self.writer.add_custom_scalars(custom_scalars_layout(self.top.k))

    def bind(self, context: RunContext) -> None:
        self._write_layout()
        legend = "  \n".join((HEALTH_LEGEND, INCIDENT_LEGEND, VIEWS_LEGEND))
        self.writer.add_text("nummon/legend", legend, global_step=0)

    def _write_layer_layout(self, record: StepRecord) -> None:
        """The layout again, now with one chart per layer group (the custom-scalars plugin shows
        a run's latest layout): written once, at the first step that carries per-layer values."""
        layers = {m: list(getattr(record, f)) for m, f in LAYER_METRICS.items() if getattr(record, f)}
        if layers and not self._layers_in_layout:
            self._layers_in_layout = True
            self.writer.add_custom_scalars(custom_scalars_layout(self.top.k, layers))

    def on_step(self, record: StepRecord, health: Health | None) -> None:
        self._write_layout()  # a sink used without a Monitor is never bound
        self._write_layer_layout(record)
        w, step = self.writer, record.step
        for tag, value in step_scalars(record, health, self.incident_state).items():
            w.add_scalar(tag, value, global_step=step)
        for tag, value in state_range_scalars().items():  # the state charts' whole range, outliers ignored or not
            w.add_scalar(tag, value, global_step=step)
        for tag, value in self.top.update(record).items():
            w.add_scalar(tag, value, global_step=step)
        self._pictures(self.picture.keep, record)

    def on_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None:
        if self.histogram_every == 0 or (self.histogram_every and step % self.histogram_every):
            return
        w = self.writer
        for name, h in histograms.items():
            if h["num"] <= 0:
                continue
            linear_tag, log_tag = histogram_tags(name)
            if linear_histogram_readable(h):  # values up to 2e33: only the log10|x| view is readable
                w.add_histogram_raw(
                    linear_tag,
                    min=h["min"],
                    max=h["max"],
                    num=int(h["num"]),
                    sum=h["sum"],
                    sum_squares=h["sum_squares"],
                    bucket_limits=h["edges"][1:].tolist(),
                    bucket_counts=h["counts"].tolist(),
                    global_step=step,
                )
            # log10|x| shows how many decades remain before the dtype overflows
            lc = h["log10_counts"]
            le = h["log10_edges"]
            mids = (le[:-1] + le[1:]) / 2
            w.add_histogram_raw(
                log_tag,
                min=float(le[0]),
                max=float(le[-1]),
                num=int(lc.sum()),
                sum=float((lc * mids).sum()),
                sum_squares=float((lc * mids**2).sum()),
                bucket_limits=le[1:].tolist(),
                bucket_counts=lc.tolist(),
                global_step=step,
            )

    def _text(self, tag_of: Any, key: Any, text: str, step: int) -> None:
        self._texts += 1  # a tag per entry: TensorBoard keeps one text per tag and step
        self.writer.add_text(tag_of(self._texts, key), text, global_step=step)
        self.writer.flush()

    def on_alert(self, alert: Alert) -> None:
        if alert.cleared:  # the incident's "resolved" entry says it; one per condition would bury the story
            return
        self._text(alert_tag, alert.kind, alert_text(alert, markdown=True), alert.step)

    def on_incident(self, event: IncidentEvent) -> None:
        """An incident event (nummon/_engine/incidents.py): a text entry (the `nummon/incident_state`
        chart gets each step's state with that step's record: `on_incident_state`)."""
        self.incident_state = event.state
        body = f"**{event.title}**  \n{event.summary()}"
        self._text(incident_tag, event.state, body, event.step)
        self._pictures(self.picture.note, event)

    def _pictures(self, feed: Any, *args: Any) -> None:
        """The incident pictures due after `feed(*args)`, as image summaries at their events'
        steps (critical, non-finite)."""
        try:
            for event, image in feed(*args):
                if image is not None:
                    self.writer.add_image(PICTURE_TAG, image, global_step=event.step, dataformats="HWC")
                    self.writer.flush()
        except Exception as e:  # a picture is never worth a failed training step
            log.warning("nummon: TensorBoard incident picture failed (%s: %s)", type(e).__name__, e)

    def flush(self) -> None:  # a picture still due waits for its step's record (or close)
        self.writer.flush()

    def close(self) -> None:
        self._pictures(self.picture.flush)
        if self._owns_writer:
            self.writer.close()
        else:  # the framework owns it and closes it
            self.writer.flush()
