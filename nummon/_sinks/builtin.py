"""Sinks: where step statistics, histograms and alerts go. Every argument is plain data.

The dispatcher (`dispatch.py`) runs each sink on its own thread; a sink only writes.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from .._core.errors import NummonError
from .._core.events import IncidentEvent
from .._core.json import dumps
from .._core.text import plain_text
from .._core.types import Alert, Health, IncidentState, Severity, StepRecord

__all__ = ["Sink", "BaseSink", "RunContext", "JsonlSink", "ConsoleSink", "MemorySink", "as_sink", "sink_name"]

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
    """What a sink implements (`BaseSink` gives no-op defaults). Every argument is plain data.

    `wants_histograms`: send it `on_histograms`. `synchronous`: call it on the training thread,
    in order with the user's own prints (console output). `durable`: it is a durable event log
    (with a `path`): a critical alert is on its disk before `post_step` returns, while the other
    sinks get it asynchronously.
    """

    wants_histograms: bool
    synchronous: bool
    durable: bool

    def bind(self, context: RunContext) -> None: ...

    def on_step(self, record: StepRecord, health: Health) -> None: ...

    def on_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None: ...

    def on_alert(self, alert: Alert) -> None: ...

    def on_incident(self, event: IncidentEvent) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class BaseSink:
    """No-op defaults of every `Sink` method; subclass and override what you need."""

    #: sinks that want histograms set this to True
    wants_histograms = False
    #: True: called on the training thread, in order with the user's own prints (console output)
    synchronous = False
    #: True: a durable event log, written and flushed before post_step returns from a critical alert
    durable = False
    #: the run's incident state as of the step `on_step` gets next (set by `on_incident_state`)
    incident_state = IncidentState.NONE

    def bind(self, context: RunContext) -> None:
        """Called once by the Monitor with the rank and run folder, before any other call."""

    def on_incident_state(self, state: IncidentState) -> None:
        """The run's incident state after the report of the step whose record `on_step` gets
        next: called just before that `on_step`, in the same order and on the same thread, so a
        chart of the state shows each step's own state whatever the sink's thread lags behind
        (incident events overtake queued step records)."""
        self.incident_state = state

    def on_step(self, record: StepRecord, health: Health) -> None:
        pass

    def on_alert(self, alert: Alert) -> None:
        pass

    def on_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None:
        pass

    def on_incident(self, event: IncidentEvent) -> None:
        """One transition of the run's incident (opened, escalated, resolved): notify people here."""

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


_SINK_METHODS = ("bind", "on_incident_state", "on_step", "on_histograms", "on_alert", "on_incident", "flush", "close")


class _PartialSink(BaseSink):
    """A duck-typed sink that implements only some of the protocol, completed with no-ops (the
    one place a sink's methods are looked up; the dispatcher then calls the protocol)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = type(inner).__name__
        self.wants_histograms = bool(getattr(inner, "wants_histograms", False))
        self.synchronous = bool(getattr(inner, "synchronous", False))
        self.durable = bool(getattr(inner, "durable", False))
        for method in _SINK_METHODS:
            fn = getattr(inner, method, None)
            if callable(fn):
                setattr(self, method, fn)

    def __getattr__(self, name: str) -> Any:  # e.g. a durable log's `path`, a sink's own settings
        return getattr(self.__dict__["inner"], name)


def as_sink(obj: Any) -> Sink:
    """`obj` as a complete `Sink`: itself when it implements the protocol, else completed with
    no-ops; NummonError when it has none of on_step / on_alert / on_histograms."""
    if isinstance(obj, Sink):
        return obj
    if not any(callable(getattr(obj, m, None)) for m in ("on_step", "on_alert", "on_histograms")):
        raise NummonError(f"{type(obj).__name__} is not a sink: it has none of on_step/on_alert/on_histograms")
    return _PartialSink(obj)


def sink_name(sink: Sink) -> str:
    """The class name a sink is reported under (the user's class for a completed one)."""
    return sink.name if isinstance(sink, _PartialSink) else type(sink).__name__


class JsonlSink(BaseSink):
    """Append-only local event log: one strict-JSON object per step record and per alert.

    ``{rank}`` in the path (e.g. ``events-rank{rank}.jsonl``) is the Monitor's rank in its process
    group (set the policy's ``sinks.rank0_only: false`` for one log per rank). Alerts are flushed
    at once (critical ones fsync'ed); step records at least every ``flush_every_steps`` steps.
    The file is opened at the first write. A durable event log: a critical alert is on disk
    before `post_step` returns. A path that can never be a file (a folder, a name ending in a
    separator, a parent that is a file) is refused when the sink is made (`NummonError`, one line).
    """

    durable = True

    def __init__(self, path: str | os.PathLike[str], steps: bool = True) -> None:
        self.template = os.fspath(path)
        _refuse_unwritable_log(self.template)
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

    def on_incident(self, event: IncidentEvent) -> None:
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


def _refuse_unwritable_log(template: str) -> None:
    """NummonError (one line) when the log's path can never be a file: a folder, a name ending in a
    separator, or a parent that exists and is not a folder (every event would be lost)."""
    text = template.replace("{rank}", "0")
    path = Path(text)
    if not text.strip() or text.endswith(("/", os.sep)) or path.is_dir():
        raise NummonError(f"JsonlSink({template!r}): a folder, not a file; name the log file in it (e.g. events.jsonl)")
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise NummonError(
                    f"JsonlSink({template!r}): {str(parent)!r} is not a folder; the log cannot be written"
                )
            return


class ConsoleSink(BaseSink):
    """One line per incident transition (opened, escalated, resolved, acted on) on the "nummon"
    logger: what, where, how bad (with the countdown when one is said) and where the detail is
    (the report, the flight record). `verbose=True` adds the incident's whole summary under the
    line; `per_alert=True` logs one line per alert as well.

    Synchronous: its lines appear in order with the training script's own output.
    """

    synchronous = True

    def __init__(
        self,
        logger: logging.Logger | None = None,
        min_severity: Severity | str = Severity.INFO,
        per_alert: bool = False,
        verbose: bool = False,
    ) -> None:
        self.logger = logger or log
        self.min_severity = Severity(min_severity)
        self.per_alert = per_alert
        self.verbose = verbose

    def on_alert(self, alert: Alert) -> None:
        if not self.per_alert or alert.severity.rank < self.min_severity.rank:
            return
        level = {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING, Severity.CRITICAL: logging.ERROR}[
            alert.severity
        ]
        hint = f" | hint: {alert.hint}" if alert.hint and not alert.cleared else ""
        self.logger.log(level, "nummon %s%s", alert, hint)

    def on_incident(self, event: IncidentEvent) -> None:
        rank = getattr(event.state, "rank", 1)
        level = logging.INFO if rank == 0 else (logging.WARNING if rank == 1 else logging.ERROR)
        if level == logging.INFO and self.min_severity.rank > Severity.INFO.rank:
            return
        if self.verbose:
            body = plain_text(event.summary()).replace("\n", "\n    ")  # the console shows text, not Markdown
            self.logger.log(level, "%s\n    %s", event.title, body)
        else:
            self.logger.log(level, "%s", console_line(event))


def console_line(event: IncidentEvent) -> str:
    """The incident event on one line: its title, the transition, the contributor that decides its
    state (the worst, the latest of those) and where the detail is."""
    if event.action:
        said = f"incident {event.number} at step {event.step}: {event.action}; now {event.state.value}"
    elif event.state is IncidentState.RESOLVED:
        said = f"incident {event.number} (opened at step {event.opened_step}) resolved at step {event.step}"
    elif event.reopened is not None:
        said = f"incident {event.number} re-opened at step {event.step} (its conditions had cleared at step {event.reopened})"
    else:
        verb = "opened" if not event.previous.active else f"{event.previous.value} -> {event.state.value}"
        said = f"incident {event.number} {verb} at step {event.step}"
    parts = [f"{event.title} | {said}"]
    if event.contributors and event.state is not IncidentState.RESOLVED:
        top = max(event.contributors, key=lambda c: (c.severity.rank, c.step))
        item = plain_text(top.line()).lstrip("- ")
        more = len(event.contributors) - 1
        parts.append(item + (f" (+{more} more)" if more else ""))
    where = event.report or event.flight_record
    if where and event.state is not IncidentState.RESOLVED:
        parts.append(f"{'report' if event.report else 'flight record'}: {where}")
    return " | ".join(parts)


class MemorySink(BaseSink):
    """Keeps everything in lists: for your own tests."""

    wants_histograms = True

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.healths: list[Health] = []
        self.alerts: list[Alert] = []
        self.incidents: list[IncidentEvent] = []
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

    def on_incident(self, event: IncidentEvent) -> None:
        self.incidents.append(event)

    def close(self) -> None:
        self.closed = True
        self.closed_at = time.monotonic()
