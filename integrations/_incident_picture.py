"""The incident picture the TensorBoard and W&B sinks log at the step an incident reaches
critical or goes non-finite: the signals the report's timeline draws (loss, pre-clip grad norm,
max activation, float headroom, the mechanisms when recorded) over the steps before it, on log
scales, with the warning, critical and first non-finite steps marked and the lead written on it.

Drawn with matplotlib's Agg backend (no pyplot, so no GUI backend is ever chosen in a training
process) rather than a hand-made rasteriser: a PNG people read needs axis numbers, titles and a
legend, i.e. text, which matplotlib draws well and a zlib+struct rasteriser would need a font
for. matplotlib is the `plot` extra and comes with the `tensorboard` extra; without it the
picture is skipped with a one-line install hint (the text entries and the HTML report are not).
It costs one figure (about 0.3 s, plus matplotlib's first import, 0.8 s) per escalation, at most
two per incident, never on a healthy step. Memory: the drawn values of the last `WINDOW` steps.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections import deque
from typing import Any

from nummon import IncidentEvent, StepRecord
from nummon._support import MARK_COLORS, MARK_WORDS, SIGNALS, escalated_to_critical

__all__ = ["IncidentPicture", "WINDOW", "warm_imports"]

log = logging.getLogger("nummon")
WINDOW = 512  # steps drawn before the incident step (the lead-up)
_HINT = "nummon: incident picture skipped: pip install 'nummon[plot]' (matplotlib) to draw it"


def warm_imports() -> threading.Thread:
    """Import matplotlib (about 0.8 s on one core) in a daemon thread, now, rather than in the
    sink's thread at the first picture, where it would delay that picture and the sink's close.
    Worth it where a picture is expected soon and a core is idle (the demo; its W&B process).
    While torch runs a kernel the training thread holds no interpreter lock, so the import
    costs the training little."""

    def work() -> None:
        with contextlib.suppress(ImportError):
            import matplotlib.backends.backend_agg  # noqa: F401
            import matplotlib.figure  # noqa: F401

    thread = threading.Thread(target=work, name="nummon-picture-imports", daemon=True)
    thread.start()
    return thread


class IncidentPicture:
    """`keep` each step record and `note` each incident event (in any order: a sink's worker
    handles incident events before the step records queued ahead of them); both return the
    pictures now due, as (event, RGB uint8 array height x width x 3, or None without matplotlib).
    A picture is due once the records up to its event's step are in, or at `flush`, and shows
    the steps up to its event's step and the marks as they stood then."""

    def __init__(self, window: int = WINDOW) -> None:
        self.steps: deque[tuple[int, dict[str, float]]] = deque(maxlen=window)
        self.marks: dict[str, int] = {}  # warning / critical / nonfinite -> step, of the incident now open
        self.number: int | None = None
        self.pending: list[tuple[IncidentEvent, dict[str, int]]] = []
        self._hinted = False

    def keep(self, record: StepRecord) -> list[tuple[IncidentEvent, Any]]:
        values = {}
        for field, *_ in SIGNALS:
            v = getattr(record, field, None)
            if v is not None:
                values[field] = float(v)
        for part in record.nonfinite_parts or (() if record.is_finite() else ("loss",)):
            values.setdefault(part, math.nan)  # a non-finite value is marked, never dropped
        self.steps.append((record.step, values))
        return self._due(record.step)

    def note(self, event: IncidentEvent) -> list[tuple[IncidentEvent, Any]]:
        if event.number != self.number:
            self.number, self.marks = event.number, {}
        self.marks.setdefault("warning", event.opened_step)
        state = getattr(event.state, "value", "")
        if state in ("critical", "nonfinite") and not event.action:
            self.marks.setdefault(state, event.step)
        if escalated_to_critical([event]):
            self.pending.append((event, dict(self.marks)))
        return self._due(self.steps[-1][0] if self.steps else None)

    def flush(self) -> list[tuple[IncidentEvent, Any]]:
        """Every picture still due, drawn with the records there are (at a sink's close: a
        flush in the middle of a run may come before its event's step record)."""
        return self._due(None, everything=True)

    def _due(self, step: int | None, everything: bool = False) -> list[tuple[IncidentEvent, Any]]:
        ready = [p for p in self.pending if everything or (step is not None and step >= p[0].step)]
        self.pending = [p for p in self.pending if p not in ready]
        return [(event, self.draw(event, marks)) for event, marks in ready]

    def draw(self, event: IncidentEvent, marks: dict[str, int]) -> Any:
        """The picture of the steps up to `event`'s with `marks`, as an RGB array; None (and
        the install hint, once) without matplotlib."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
            from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator
        except ImportError:
            if not self._hinted:
                self._hinted = True
                log.warning(_HINT)
            return None
        import numpy as np

        steps = [(s, v) for s, v in self.steps if s <= event.step]
        panels = [s for s in SIGNALS if any(s[0] in v for _, v in steps)]
        if not panels:
            return None
        height = 0.4 + 1.45 * len(panels)  # inches
        fig = Figure(figsize=(8.0, height), dpi=100)
        # fixed margins (inches turned into fractions) rather than tight_layout, which measured
        # every tick label twice and cost half of each picture
        fig.subplots_adjust(left=0.1, right=0.98, bottom=0.45 / height, top=1 - 0.35 / height, hspace=0.12)
        axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        plain = FuncFormatter(lambda v, _pos: f"{v:.0e}" if v and (abs(v) >= 1e4 or abs(v) < 1e-2) else f"{v:g}")
        for ax, (field, title, color, log_scale, _note) in zip(axes, panels, strict=True):
            pts = [(s, v[field]) for s, v in steps if field in v]
            ok = [(s, y) for s, y in pts if math.isfinite(y) and (y > 0 or not log_scale)]
            if ok:
                ax.plot([s for s, _ in ok], [y for _, y in ok], color=color, linewidth=1.3)
            if log_scale and ok:
                # plain "1e+05" labels, no minor ticks: matplotlib's default log labels are
                # mathtext ($10^{5}$), whose parser cost more than the rest of the figure
                ax.set_yscale("log")
                ax.yaxis.set_major_locator(LogLocator(numticks=4))
                ax.yaxis.set_minor_locator(NullLocator())
                ax.yaxis.set_major_formatter(plain)
            bad = [s for s, y in pts if not math.isfinite(y)]
            if bad:  # NaN/Inf: a cross at the top edge of the panel
                ax.plot(bad, [1.0] * len(bad), "x", color=MARK_COLORS["nonfinite"], transform=ax.get_xaxis_transform())
            ax.set_ylabel(title, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, alpha=0.25)
            for kind, step in marks.items():
                ax.axvline(step, color=MARK_COLORS[kind], linestyle="--", linewidth=1.8, label=MARK_WORDS[kind])
        axes[0].legend(fontsize=7, loc="upper left")
        axes[-1].set_xlabel("step", fontsize=8)
        lead = marks.get("nonfinite", event.step) - marks["warning"]
        fig.suptitle(f"{event.title} (step {event.step}; {lead} steps after the first warning)", fontsize=9)
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        return np.asarray(canvas.buffer_rgba())[..., :3].copy()
