"""Sinks: where step statistics, histograms and alerts go. Every argument is plain data.

The dispatcher (`_dispatch.py`) runs each sink on its own thread; a sink only writes.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from ._format import plain_text
from ._json import dumps
from ._types import Alert, Health, Severity, StepRecord

__all__ = ["Sink", "BaseSink", "RunContext", "JsonlSink", "ConsoleSink", "MemorySink"]

log = logging.getLogger("nummon")


@dataclass(frozen=True)
class RunContext:
    """What the Monitor tells its sinks before the first step."""

    rank: int = 0
    world_size: int = 1
    run_dir: Path | None = None
    flush_every_steps: int = 1  # a JSONL log flushes step records at least this often (steps)


@runtime_checkable
class Sink(Protocol):
    """What a sink implements. Every argument is plain data (no tensors)."""

    def on_step(self, record: StepRecord, health: Health) -> None: ...

    def on_alert(self, alert: Alert) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class BaseSink:
    """No-op defaults; subclass and override what you need. `on_histograms` and `bind` are optional."""

    #: sinks that want histograms set this to True
    wants_histograms = False
    #: True: called on the training thread, in order with the user's own prints (console output)
    synchronous = False

    def bind(self, context: RunContext) -> None:
        """Called once by the Monitor with the rank and run folder, before any other call."""

    def on_step(self, record: StepRecord, health: Health) -> None:
        pass

    def on_alert(self, alert: Alert) -> None:
        pass

    def on_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None:
        pass

    def on_incident(self, event: Any) -> None:
        """One transition of the run's incident (opened, escalated, resolved): notify people here."""

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink(BaseSink):
    """Append-only local event log: one strict-JSON object per step record and per alert.

    ``{rank}`` in the path (e.g. ``events-rank{rank}.jsonl``) is the Monitor's rank in its process
    group (set the policy's ``sinks.rank0_only: false`` for one log per rank). Alerts are flushed
    at once (critical ones fsync'ed); step records at least every ``flush_every_steps`` steps.
    The file is opened at the first write.
    """

    def __init__(self, path: str | os.PathLike[str], steps: bool = True) -> None:
        self.template = os.fspath(path)
        self._rank = int(os.environ.get("RANK", "0") or 0) if "{rank}" in self.template else 0
        self._steps = steps
        self._fh: IO[str] | None = None
        self._flush_every = 1
        self._unflushed = 0

    @property
    def path(self) -> Path:
        """The log's path, `{rank}` filled in."""
        return Path(self.template.replace("{rank}", str(self._rank)))

    def bind(self, context: RunContext) -> None:
        self._rank = context.rank
        self._flush_every = context.flush_every_steps

    def _file(self) -> IO[str]:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")
        return self._fh

    def on_step(self, record: StepRecord, health: Health) -> None:
        if not self._steps:
            return
        fh = self._file()
        fh.write(dumps({"type": "step", "health": health.value if health else None, **record.to_dict()}) + "\n")
        self._unflushed += 1
        if self._unflushed >= self._flush_every:
            fh.flush()
            self._unflushed = 0

    def on_alert(self, alert: Alert) -> None:
        fh = self._file()
        fh.write(dumps({"type": "alert", **alert.to_dict()}) + "\n")
        fh.flush()
        self._unflushed = 0
        if alert.severity is Severity.CRITICAL:
            os.fsync(fh.fileno())

    def on_incident(self, event: Any) -> None:
        fh = self._file()
        fh.write(dumps({"type": "incident", **event.to_dict()}) + "\n")
        fh.flush()
        self._unflushed = 0

    def flush(self) -> None:
        if self._fh is not None and not self._fh.closed:
            self._fh.flush()
            self._unflushed = 0

    def close(self) -> None:
        if self._fh is not None and not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()


class ConsoleSink(BaseSink):
    """One readable line per incident event (opened, escalated, resolved) on the "nummon"
    logger, with the incident's summary; with `per_alert=True`, one line per alert as well.

    Synchronous: its lines appear in order with the training script's own output.
    """

    synchronous = True

    def __init__(self, logger: logging.Logger | None = None, min_severity: Severity | str = Severity.INFO,
                 per_alert: bool = False) -> None:
        self.logger = logger or log
        self.min_severity = Severity(min_severity)
        self.per_alert = per_alert

    def on_alert(self, alert: Alert) -> None:
        if not self.per_alert or alert.severity.rank < self.min_severity.rank:
            return
        level = {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING, Severity.CRITICAL: logging.ERROR}[alert.severity]
        hint = f" | hint: {alert.hint}" if alert.hint and not alert.cleared else ""
        self.logger.log(level, "nummon %s%s", alert, hint)

    def on_incident(self, event: Any) -> None:
        rank = getattr(event.state, "rank", 1)
        level = logging.INFO if rank == 0 else (logging.WARNING if rank == 1 else logging.ERROR)
        if level == logging.INFO and self.min_severity.rank > Severity.INFO.rank:
            return
        body = plain_text(event.summary()).replace("\n", "\n    ")
        self.logger.log(level, "%s\n    %s", event.title, body)


class MemorySink(BaseSink):
    """Keeps everything in lists: for your own tests."""

    wants_histograms = True

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.healths: list[Health] = []
        self.alerts: list[Alert] = []
        self.incidents: list[Any] = []
        self.histograms: list[tuple[int, dict[str, Any]]] = []
        self.context: RunContext | None = None
        self.closed = False
        self.closed_at = 0.0

    def bind(self, context: RunContext) -> None:
        self.context = context

    def on_step(self, record: StepRecord, health: Health) -> None:
        self.records.append(record)
        self.healths.append(health)

    def on_alert(self, alert: Alert) -> None:
        self.alerts.append(alert)

    def on_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None:
        self.histograms.append((step, histograms))

    def on_incident(self, event: Any) -> None:
        self.incidents.append(event)

    def close(self) -> None:
        self.closed = True
        self.closed_at = time.monotonic()
