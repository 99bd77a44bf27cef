"""Sinks: where step statistics and alerts go, dispatched off the training thread.

Each sink runs on its own worker thread behind a bounded queue, so a slow sink delays only
itself. When a queue is full, step statistics are dropped (and counted); alerts are never
dropped. A sink that raises is isolated: the error is logged once, counted, and the other
sinks keep running.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ._errors import NummonError
from ._types import Alert, Health, Severity, StepRecord

__all__ = ["Sink", "BaseSink", "JsonlSink", "ConsoleSink", "MemorySink", "SinkDispatcher"]

log = logging.getLogger("nummon")


@runtime_checkable
class Sink(Protocol):
    """What a sink implements. Every argument is plain data (no tensors)."""

    def on_step(self, record: StepRecord, health: Health) -> None: ...

    def on_alert(self, alert: Alert) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class BaseSink:
    """No-op defaults; subclass and override what you need. `on_histograms` is optional."""

    #: sinks that want histograms every `histogram_every` steps set this to True
    wants_histograms = False

    def on_step(self, record: StepRecord, health: Health) -> None:
        pass

    def on_alert(self, alert: Alert) -> None:
        pass

    def on_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink(BaseSink):
    """Append-only local event log: one JSON object per step record and per alert.

    Under torch.distributed, put ``{rank}`` in the path (e.g. ``events-rank{rank}.jsonl``) and set
    the policy's ``sinks.rank0_only: false`` for one log per rank.

    Flushed on every alert and fsync'ed on critical ones, so the alert that precedes a crash
    is on disk.
    """

    def __init__(self, path: str | os.PathLike[str], steps: bool = True) -> None:
        # "{rank}" in the path gives one file per rank under torchrun (RANK is set per process)
        self.path = Path(os.fspath(path).replace("{rank}", os.environ.get("RANK", "0")))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")
        self._steps = steps

    def _write(self, obj: dict[str, Any]) -> None:
        self._fh.write(json.dumps(obj, default=_json_default) + "\n")

    def on_step(self, record: StepRecord, health: Health) -> None:
        if self._steps:
            self._write({"type": "step", "health": health.value, **record.to_dict()})

    def on_alert(self, alert: Alert) -> None:
        self._write({"type": "alert", **alert.to_dict()})
        self._fh.flush()
        if alert.severity is Severity.CRITICAL:
            os.fsync(self._fh.fileno())

    def flush(self) -> None:
        if not self._fh.closed:
            self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()


class ConsoleSink(BaseSink):
    """One readable log line per alert (stdlib logging, logger "nummon"), with its hint."""

    def __init__(self, logger: logging.Logger | None = None, min_severity: Severity = Severity.INFO) -> None:
        self.logger = logger or log
        self.min_severity = Severity(min_severity)

    def on_alert(self, alert: Alert) -> None:
        if alert.severity.rank < self.min_severity.rank:
            return
        level = {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING, Severity.CRITICAL: logging.ERROR}[alert.severity]
        hint = f" | hint: {alert.hint}" if alert.hint and not alert.cleared else ""
        self.logger.log(level, "nummon %s%s", alert, hint)


class MemorySink(BaseSink):
    """Keeps everything in lists: for your own tests."""

    wants_histograms = True

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.healths: list[Health] = []
        self.alerts: list[Alert] = []
        self.histograms: list[tuple[int, dict[str, Any]]] = []
        self.closed = False

    def on_step(self, record: StepRecord, health: Health) -> None:
        self.records.append(record)
        self.healths.append(health)

    def on_alert(self, alert: Alert) -> None:
        self.alerts.append(alert)

    def on_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None:
        self.histograms.append((step, histograms))

    def close(self) -> None:
        self.closed = True


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "value"):
        return o.value
    return str(o)


class _Worker:
    """One sink on its own thread: a bounded queue of step events, an unbounded one of alerts."""

    def __init__(self, sink: Any, queue_size: int, block: bool = False) -> None:
        self.sink = sink
        self.queue_size = queue_size
        self.block = block
        self.steps: collections.deque = collections.deque()
        self.alerts: collections.deque = collections.deque()
        self.cv = threading.Condition()
        self.closing = False
        self.errors = 0
        self.dropped = 0
        self._reported = False
        self.name = type(sink).__name__
        self.thread = threading.Thread(target=self._run, name=f"nummon-sink-{self.name}", daemon=True)
        self.thread.start()

    def put_step(self, item: tuple) -> None:
        with self.cv:
            if self.block:
                while len(self.steps) >= self.queue_size and self.thread.is_alive():
                    self.cv.wait(0.1)
            elif len(self.steps) >= self.queue_size:
                self.dropped += 1  # statistics may be dropped; alerts never are
                return
            self.steps.append(item)
            self.cv.notify_all()

    def put_alert(self, alert: Alert) -> None:
        with self.cv:
            self.alerts.append(alert)
            self.cv.notify_all()

    def _call(self, method: str, *args: Any) -> None:
        fn = getattr(self.sink, method, None)
        if fn is None:
            return
        try:
            fn(*args)
        except Exception as e:  # isolate: one broken sink must not stop training or the others
            self.errors += 1
            if not self._reported:
                self._reported = True
                log.warning("nummon: sink %s failed in %s (%s: %s); further errors are counted, not logged",
                            self.name, method, type(e).__name__, e)

    def _run(self) -> None:
        while True:
            with self.cv:
                while not (self.alerts or self.steps or self.closing):
                    self.cv.wait()
                if self.alerts:
                    kind, item = "alert", self.alerts.popleft()
                elif self.steps:
                    kind, item = "step", self.steps.popleft()
                    self.cv.notify_all()  # room for a producer blocked on a full queue
                else:
                    return
            if kind == "alert":
                self._call("on_alert", item)
            elif item[0] == "step":
                self._call("on_step", item[1], item[2])
            elif item[0] == "hist":
                self._call("on_histograms", item[1], item[2])
            elif item[0] == "flush":
                self._call("flush")
                item[1].set()

    def drain(self, timeout: float) -> bool:
        done = threading.Event()
        with self.cv:
            self.steps.append(("flush", done))  # flush markers bypass the size limit
            self.cv.notify()
        return done.wait(timeout)

    def stop(self, timeout: float) -> None:
        with self.cv:
            self.closing = True
            self.cv.notify()
        self.thread.join(timeout)
        if self.thread.is_alive():
            log.warning("nummon: sink %s did not finish within %.0f s; closing without it", self.name, timeout)
            return
        self._call("close")


class SinkDispatcher:
    """Fans step records, histograms and alerts out to every sink, off the training thread."""

    def __init__(self, sinks: list[Any], queue_size: int = 1024, block: bool = False) -> None:
        for s in sinks:
            if not any(hasattr(s, m) for m in ("on_step", "on_alert", "on_histograms")):
                raise NummonError(f"{type(s).__name__} is not a sink: it has none of on_step/on_alert/on_histograms")
        self.workers = [_Worker(s, queue_size, block) for s in sinks]

    @property
    def wants_histograms(self) -> bool:
        return any(getattr(w.sink, "wants_histograms", False) for w in self.workers)

    def step(self, record: StepRecord, health: Health) -> None:
        for w in self.workers:
            w.put_step(("step", record, health))

    def histograms(self, step: int, hists: dict[str, Any]) -> None:
        for w in self.workers:
            if getattr(w.sink, "wants_histograms", False):
                w.put_step(("hist", step, hists))

    def alert(self, alert: Alert) -> None:
        for w in self.workers:
            w.put_alert(alert)

    def flush(self, timeout: float = 30.0) -> None:
        for w in self.workers:
            w.drain(timeout)

    def close(self, timeout: float = 30.0) -> None:
        for w in self.workers:
            w.stop(timeout)

    def stats(self) -> dict[str, dict[str, int]]:
        """Errors and dropped step records per sink."""
        return {w.name: {"errors": w.errors, "dropped": w.dropped} for w in self.workers}
